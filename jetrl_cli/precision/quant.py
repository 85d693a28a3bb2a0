"""Pure-torch quantizers: the reference every other backend (Triton, vLLM, TE) must match bit for bit.

The rule, for one block of a 2-D tensor ``x`` (rows = tokens or output channels, cols = K):

1. ``amax = max(|x|)`` over the block, computed in fp32 on the elements that exist (a partial edge
   block at the bottom or right of a tensor whose shape is not a multiple of the block gets its own
   scale from the elements it holds; nothing is padded into the result).
2. ``amax = max(amax, amax_floor)`` so an all-zero block has a finite, non-zero scale.
3. ``scale = amax / fmt.max`` in fp32 (the *dequantization* scale, DeepSeek's ``scale_inv``).
   With ``pow2_scale`` it is rounded *up* to a power of two, exactly (via frexp), as TE and
   DeepGEMM do: ``x / scale`` is then exact and cannot overflow.
4. ``q = cast(clamp(x / scale, -fmt.max, fmt.max))``: fp32 division, a saturating clamp, then
   round-to-nearest-even into the format (torch's cast for fp8, ``torch.round`` for int8).

Non-finite input: a block that contains any NaN or +-Inf gets a NaN scale; its fp8 data is NaN and
its int8 data is 0, so the whole block dequantizes to NaN. Quantization never hides a NaN or turns
an overflow into a plausible number: the loss becomes NaN and the caller's finite-check fires.

``dequantize(quantize(x))`` reproduces ``x`` up to the format's rounding. Both are deterministic.
Tensors with more than two dims are quantized as 2-D views ``(-1, shape[-1])``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import Block, Format

DEFAULT_AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class CastSpec:
    """How one GEMM operand is cast: format, scaling granularity and scale rounding."""

    format: Format = Format.FP32
    block: Block = Block(0, 0)
    pow2_scale: bool = False
    amax_floor: float = DEFAULT_AMAX_FLOOR

    def __post_init__(self):
        if not isinstance(self.format, Format):
            object.__setattr__(self, "format", Format.parse(self.format))
        if not isinstance(self.block, Block):
            object.__setattr__(self, "block", Block.parse(self.block))
        if not (self.amax_floor > 0 and math.isfinite(self.amax_floor)):
            raise ValueError(f"amax_floor must be a positive finite number, got {self.amax_floor}")

    @property
    def is_scaled(self) -> bool:
        return self.format.is_scaled

    def short_str(self) -> str:
        if not self.format.is_scaled:
            return self.format.short
        s = f"{self.format.short}[{self.block.name}]"
        return s + "^2" if self.pow2_scale else s


@dataclass
class QTensor:
    """A quantized tensor: ``data`` (fp8 / int8, same shape as the input) and fp32 ``scale``.

    ``scale`` has shape ``(ceil(M / rows), ceil(K / cols))`` for the 2-D view (M, K).
    """

    data: torch.Tensor
    scale: torch.Tensor
    spec: CastSpec

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def t(self) -> "QTensor":
        """The transpose of a 2-D quantized tensor, its scale grid transposed with it."""
        spec = CastSpec(self.spec.format, self.spec.block.transposed(), self.spec.pow2_scale, self.spec.amax_floor)
        return QTensor(self.data.t().contiguous(), self.scale.t().contiguous(), spec)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def _pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= scale, exactly (no log2 rounding)."""
    mant, exp = torch.frexp(scale)  # scale = mant * 2**exp, mant in [0.5, 1)
    exp = exp - (mant == 0.5).to(exp.dtype)
    return torch.ldexp(torch.ones_like(scale), exp)


def _expand(scale: torch.Tensor, br: int, bc: int, m: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:m, :k]


def compute_scale(x2d: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """The fp32 dequantization scale of every block of a 2-D tensor (see the module rule)."""
    m, k = x2d.shape
    br, bc = spec.block.resolve(m, k)
    nbr, nbc = -(-m // br), -(-k // bc)
    xf = x2d.float()
    pad = (0, nbc * bc - k, 0, nbr * br - m)
    tiles = torch.nn.functional.pad(xf, pad).reshape(nbr, br, nbc, bc)
    finite = torch.isfinite(tiles)
    amax = torch.where(finite, tiles.abs(), 0.0).amax(dim=(1, 3))
    amax = amax.clamp_min(spec.amax_floor)
    scale = amax / spec.format.max
    if spec.pow2_scale:
        scale = _pow2_ceil(scale)
    bad = ~finite.all(dim=3).all(dim=1)
    return torch.where(bad, torch.nan, scale)


def quantize(x: torch.Tensor, spec: CastSpec) -> QTensor:
    """Quantize ``x`` under ``spec`` (an 8-bit format). Returns data and fp32 scales."""
    fmt = spec.format
    if not fmt.is_scaled:
        raise ValueError(f"quantize() needs an 8-bit format, got {fmt.value}; use cast() for {fmt.value}")
    if not x.is_floating_point():
        raise TypeError(f"quantize() needs a floating-point tensor, got {x.dtype}")
    x2d = _as_2d(x)
    m, k = x2d.shape
    scale = compute_scale(x2d, spec)
    br, bc = spec.block.resolve(m, k)
    y = x2d.float() / _expand(scale, br, bc, m, k)
    y = y.clamp(-fmt.max, fmt.max)
    if fmt is Format.INT8:
        data = torch.round(y).nan_to_num(0.0).to(torch.int8)
    else:
        data = y.to(fmt.torch_dtype())
    return QTensor(data.reshape(x.shape), scale, spec)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` in fp32, cast to ``dtype``."""
    d2 = _as_2d(q.data).float()
    m, k = d2.shape
    br, bc = q.spec.block.resolve(m, k)
    out = d2 * _expand(q.scale, br, bc, m, k)
    return out.reshape(q.data.shape).to(dtype)


def round_to(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Round to an unscaled high-precision format and return fp32 (the CPU emulation of bf16)."""
    if fmt is Format.FP32:
        return x if x.dtype is torch.float32 else x.float()
    if fmt is Format.BF16:
        return x.to(torch.bfloat16).float()
    raise ValueError(f"round_to() takes fp32 or bf16, got {fmt.value}")


def fake_quantize(x: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """The fp32 values a GEMM operand carries under ``spec``: dequantize(quantize(x)) or rounding."""
    if spec.is_scaled:
        return dequantize(quantize(x, spec))
    return round_to(x, spec.format)


def error_stats(ref: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius error and SQNR (dB) of ``approx`` against ``ref``, in float64."""
    r = ref.double()
    e = approx.double() - r
    sig = float(r.pow(2).sum())
    noise = float(e.pow(2).sum())
    rel = math.sqrt(noise / sig) if sig > 0 else (0.0 if noise == 0 else math.inf)
    if noise == 0:
        sqnr = math.inf
    elif sig == 0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(sig / noise)
    return {"rel_err": rel, "sqnr_db": sqnr}
