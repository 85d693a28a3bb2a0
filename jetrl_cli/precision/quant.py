"""Pure-torch quantizers: the reference every other backend (Triton, vLLM, TE) must match bit for bit.

The rule, for one block of a 2-D tensor ``x`` (rows = tokens or output channels, cols = K):

1. ``amax = max(|x|)`` over the block, computed in fp32 on the elements that exist (a partial edge
   block at the bottom or right of a tensor whose shape is not a multiple of the block gets its own
   scale from the elements it holds; nothing is padded into the result).
2. ``amax = max(amax, amax_floor)`` so an all-zero block has a finite, non-zero scale.
3. ``scale = amax / fmt.max`` in fp32 (the *dequantization* scale, DeepSeek's ``scale_inv``).
   With ``pow2_scale`` it is rounded *up* to a power of two, exactly (via frexp), as TE and
   DeepGEMM do: ``x * (1 / scale)`` is then exact and cannot overflow.
4. ``q = cast(clamp(x * (1 / scale), -fmt.max, fmt.max))``: ``1 / scale`` correctly rounded once per
   block, each element multiplied by it in fp32 (one rounding), a saturating clamp, then
   round-to-nearest-even into the format (torch's cast for fp8, ``torch.round`` for int8). A multiply,
   not a division, as TE, torchao and DeepGEMM quantize: on a GPU a correctly rounded ``x / scale``
   costs a kernel five instructions per element where this costs one (the quantizers are bound by
   their instructions there), and the product differs from the quotient by at most an fp32 ulp,
   2^-20 of an FP8 step. (Until 2026-11-28 this rule divided; the bytes differ where such an ulp
   crosses a rounding tie of the format.)

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


def _tiles(x2d: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """``x2d`` as (row blocks, br, col blocks, bc): a view when the blocks tile it, else zero-padded
    (padding changes no block's amax; the padded elements are cut off again)."""
    m, k = x2d.shape
    nbr, nbc = -(-m // br), -(-k // bc)
    if nbr * br != m or nbc * bc != k:
        x2d = torch.nn.functional.pad(x2d, (0, nbc * bc - k, 0, nbr * br - m))
    return x2d.reshape(nbr, br, nbc, bc)


def _untile(t: torch.Tensor, m: int, k: int) -> torch.Tensor:
    y = t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
    return y if y.shape == (m, k) else y[:m, :k]


def divide(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` correctly rounded on every device, as the Triton kernels' ``div_rn``: on CUDA, torch
    divides by a Python number as a multiply by its fp32 reciprocal (1 ulp off for some ``t``);
    dividing by a 0-dim tensor on ``t``'s device divides."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def compute_scale(x2d: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """The fp32 dequantization scale of every block of a 2-D tensor (see the module rule).

    A block's amax over all its elements is finite exactly when every element is, and then equals
    the amax over its finite values; otherwise (NaN or +-Inf present) the block's scale is NaN."""
    br, bc = spec.block.resolve(*x2d.shape)
    xf = x2d if x2d.dtype is torch.float32 else x2d.float()
    amax = _tiles(xf, br, bc).abs().amax(dim=(1, 3))
    finite = torch.isfinite(amax)
    scale = divide(amax.clamp_min(spec.amax_floor), spec.format.max)
    if spec.pow2_scale:
        scale = _pow2_ceil(scale)
    return torch.where(finite, scale, torch.nan)


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
    xf = x2d if x2d.dtype is torch.float32 else x2d.float()
    y = (_tiles(xf, br, bc) * torch.reciprocal(scale)[:, None, :, None]).clamp_(-fmt.max, fmt.max)
    if fmt is Format.INT8:
        y = torch.round(y).nan_to_num_(0.0)
    data = _untile(y.to(fmt.torch_dtype()), m, k)
    return QTensor(data.reshape(x.shape) if data.is_contiguous() else data.contiguous().reshape(x.shape), scale, spec)


_TABLES: dict = {}


def to_float(data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """8-bit data as ``dtype`` values, exactly: FP8 through a 256-entry table (torch's own fp8 cast
    runs element by element on CPU, ~3x slower), INT8 by a cast."""
    if data.dtype is torch.int8 or data.is_cuda:
        return data.to(dtype)
    key = (data.dtype, dtype, data.device)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = torch.arange(256, dtype=torch.uint8, device=data.device).view(data.dtype).to(dtype)
    idx = data.reshape(-1).view(torch.uint8).to(torch.int32)
    return table.index_select(0, idx).view(data.shape)


def same_bits(a: "QTensor | None", b: "QTensor | None") -> bool:
    """Whether two quantized tensors hold the same data bytes and the same scales (NaN scales equal
    where both are NaN); None equals only None."""
    if a is None or b is None:
        return a is b
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(
        a.scale.nan_to_num(-1.0), b.scale.nan_to_num(-1.0))


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` in fp32, cast to ``dtype``."""
    d2 = _as_2d(q.data)
    out = block_values(d2, q.scale, *q.spec.block.resolve(*d2.shape))
    return out.reshape(q.data.shape).to(dtype)


def block_values(data: torch.Tensor, scale: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """The fp32 values of 2-D 8-bit ``data`` in ``br`` x ``bc`` blocks, each times its block's entry of
    ``scale`` (row blocks x column blocks, any strides): ``dequantize`` without the QTensor, for
    code that ``torch.compile`` traces (a fused SwiGLU backward reading its FP8 input)."""
    m, k = data.shape
    return _untile(_tiles(to_float(data), br, bc) * scale.float()[:, None, :, None], m, k)


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
