"""GEMM backends behind one registry: ``mm(a, b) = a @ b.T`` with both operands K-major.

Every GEMM of a flow (``fprop``, ``dgrad``, ``wgrad``, ``rollout.linear``) names a backend. This
module is the one place that knows what each backend can run (``unsupported``), how its operands
are laid out (``cast``), and which one ``auto`` picks (``resolve``).

Execution: emulated on CPU, native on CUDA
------------------------------------------
- **CPU** emulates the GPU's numerics: an operand in ``bf16`` is an fp32 tensor holding bf16-rounded
  values, and a GEMM's ``out`` format is applied by rounding the fp32 result. Every forward GEMM is
  exact per K group, so a row's result cannot depend on the batch, the BLAS or the thread count:
  8-bit operands through ``exact_mm`` (their values and scales in float64), dense ones through
  ``exact_dense_mm`` (each element on a fixed-point grid of its row's K group, ``fixed_point``),
  rounded to fp32 once -- fp32-accumulation accuracy, an order fixed by jetrl. The backward's 8-bit
  GEMMs go through ``exact_mm`` as well (one 8-bit path); its dense ones multiply in fp32
  (they need no invariance).
- **CUDA** runs natively: ``bf16`` operands are bf16 tensors multiplied by cuBLAS with fp32
  accumulation (``allow_bf16_reduced_precision_reduction`` is turned off so split-K reductions stay
  fp32), the output is written in the ``out`` dtype, and FP8 GEMMs run on the tensor cores
  (``scaled_mm`` or ``triton``). The formats, block shapes and scales are the flow's on both; only
  the order of the fp32 additions differs.

Backends (for 8-bit GEMMs; an unscaled GEMM always runs ``torch.matmul`` as above)
----------------------------------------------------------------------------------
- ``emulated``: dequantize both operands to fp32, fp32 matmul. Any granularity, any device. The
  reference the others are checked against.
- ``scaled_mm``: ``torch.nn.functional.scaled_mm`` (torch >= 2.10) or ``torch._scaled_mm``:
  FP8 with per-tensor or per-row scales (CPU and GPU), INT8 per-row / per-tensor through
  ``torch._int_mm``, and on Hopper GPUs the blockwise recipes: 1x128 activations x 128x128 weights
  (Fprop, Dgrad) and 1x128 x 1x128 (Wgrad, groups along tokens). Blockwise needs the reduction dim
  (and, for 128x128 weights, N) to be a multiple of 128; scales are handed over in the layouts
  torch requires (``jetrl_cli.kernels.layouts``), which jetrl's Triton quantizers write directly,
  and operand a's rows are padded to a multiple of 4 (``layouts.pad_rows``, as vLLM pads M).
- ``triton``: jetrl's kernels (``jetrl_cli.kernels``): blockwise FP8 (1x128 / 128x128 scales along
  K) and INT8 with per-row or per-tensor scales (int32 accumulation, the scaling fused into the
  GEMM), with their quantizers; on a CUDA GPU or in Triton's interpreter (``TRITON_INTERPRET=1``).
- ``te``: a slot for Transformer Engine; choosing it is a clear error until one registers.
- ``auto`` (the default): resolved once per GEMM spec and device, by this rule:

  1. On CPU: ``emulated`` (exact reference; the fused FP8 kernels do not exist there and
     ``_scaled_mm`` on CPU is slower than the fp32 emulation).
  2. On CUDA: candidates ``scaled_mm``, ``triton``, ``emulated``, in that order. A candidate is
     dropped if it cannot run the spec (``unsupported``: formats, granularities, torch version,
     GPU generation) or if a probe GEMM (256 x 256 x 256, random operands and scales) does not
     match ``emulated`` within ``KERNEL_TOLERANCE``. The survivors are timed on one
     2048 x 2048 x 2048 GEMM, replayed from a CUDA graph (device time, as a captured decode step
     pays it), and the fastest is chosen.
  3. A forward GEMM (``fprop``: the trainer's forward, and the rollout's prefill and decode steps,
     which run the same function) is also timed at the row counts of decode steps, ``ROW_TIERS``
     (8, 64 and 512 rows x 2048 x 2048): a few rows stream the whole weight, and the backend that
     is fastest for 2048 rows need not be for 8. A call with M rows runs on the fastest backend of
     the smallest tier that holds M (beyond the last: the 2048-row choice). Only kernel backends
     are chosen per tier (the operands are the Triton quantizers' either way), each probed again at
     the tier's rows (a decode step's kernel may be another tile configuration); a spec that only
     ``emulated`` can run has no tiers. The tiers whose choice differs are reported (``by_rows``).
  4. At call time a shape the chosen backend cannot serve (e.g. a reduction dim that is not a
     multiple of 128 for blockwise ``scaled_mm``) goes to the next surviving candidate. Every such
     fallback is counted (``fallbacks()``) and reported with the resolution (``backend_report``):
     ``jetrl run`` writes it into ``metrics.jsonl`` and ``jetrl bench`` into its rows, so a
     benchmark never runs the emulated path without saying so.

  A backend named explicitly is used as named; if it cannot run the spec on this device that is a
  one-line error, and call-time shape fallbacks are counted as for ``auto``.

``register_backend(name, backend)`` is the extension point.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Protocol, Union

import torch

from ..errors import JetrlError
from ..choices import GEMM_BACKENDS
from .flow import OPERANDS, REDUCTION_ON_ROWS
from .formats import B1x128, B128x1, B128x128, Block, Format
from .fuse import report as fuse_report, reset_report as fuse_reset_report
from .quant import CastSpec, QTensor, quantize, round_to, to_float

Operand = Union[QTensor, torch.Tensor]

KERNEL_TOLERANCE = 1e-3  # relative error of a backend against the emulated GEMM on the same operands
ROW_TILE = 8
TILE = 128
INT_MM_PAD_ROWS = 32  # torch._int_mm on CUDA takes more than 16 rows; fewer (decode) are padded to this many
INT8_K_LIMIT = (2**31 - 1) // 127**2  # the longest INT8 reduction whose int32 sum cannot overflow


_FORCE_NATIVE = False  # tests: run the native (CUDA) code path on CPU tensors, at tiny sizes


def native(t: torch.Tensor) -> bool:
    """Whether ``t``'s GEMMs run natively (bf16 tensors, real low-precision matmuls): on CUDA."""
    return t.is_cuda or _FORCE_NATIVE


def set_force_native(on: bool) -> None:
    """Tests only: exercise the native path on CPU (real bf16 matmuls, slow beyond tiny shapes)."""
    global _FORCE_NATIVE
    _FORCE_NATIVE = on


def configure_cuda_numerics() -> None:
    """cuBLAS bf16 GEMMs accumulate in fp32, split-K reductions included (jetrl's ``bf16`` means
    bf16 operands, fp32 accumulation). Called before a native run."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def row_invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` in fp32, rows padded to a multiple of ``ROW_TILE`` (one BLAS kernel for every row
    count on the BLAS this project was developed on). For the GEMMs that claim no invariance (the
    backward, mixed 8-bit formats); the forward's are exact (``exact_mm``, ``exact_dense_mm``)."""
    m = a.shape[0]
    if a.is_cuda or m % ROW_TILE == 0:
        return torch.mm(a, b.t())
    pad = ROW_TILE - m % ROW_TILE
    return torch.mm(torch.nn.functional.pad(a, (0, 0, 0, pad)), b.t())[:m]


def operand_values(op: Operand) -> torch.Tensor:
    """The fp32 values an operand carries (dequantized for a QTensor)."""
    if isinstance(op, ExactOperand):
        k = op.values.shape[1]
        return (op.values * op.scales.repeat_interleave(op.group, 1)[:, :k]).float()
    if isinstance(op, QTensor):
        return op.dequantize(torch.float32)
    return op if op.dtype is torch.float32 else op.float()


def transpose_operand(op: Operand) -> Operand:
    """The operand of the transposed matrix (data and scale grid transposed, contiguous). A native
    dense (bf16/fp32) operand is transposed as a view: cuBLAS reads either layout at the same speed,
    and a contiguous copy of a weight's transpose would keep a second bf16 copy of every weight."""
    if isinstance(op, QTensor):
        return op.t()
    return op.t() if native(op) else op.t().contiguous()


# --------------------------------------------------------------------------- dense GEMMs


def dense_cast(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """An unscaled operand: bf16/fp32 tensor natively, fp32 holding rounded values on CPU."""
    if native(x):
        dt = fmt.torch_dtype()
        return x if x.dtype is dt else x.to(dt)
    return round_to(x, fmt)


_MM_OUT_DTYPE: dict = {}  # device type -> whether torch.mm(..., out_dtype=) runs there


def dense_mm(a: torch.Tensor, b: torch.Tensor, out: Format, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for unscaled operands, written in ``out`` (native) or fp32 (emulated: the
    caller rounds). Native bf16 x bf16 -> fp32 uses ``torch.mm(out_dtype=)`` where torch has it; a
    bias in the output dtype is added in the GEMM's epilogue (``addmm``: one kernel, and the sum is
    rounded once, as the emulation rounds fp32 ``acc + bias`` once; the bias itself is bf16 there,
    as before, and fp32 in the emulation)."""
    if not native(a):
        return add_bias(row_invariant_mm(operand_values(a), operand_values(b)), bias)
    dt = out.torch_dtype()
    if a.dtype == dt:
        if bias is not None and bias.dtype is dt:
            return torch.addmm(bias, a, b.t())
        return add_bias(torch.mm(a, b.t()), bias)
    return add_bias(_mm_to(a, b, dt), bias)


def add_bias(acc: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return acc
    return acc + (bias if bias.dtype is acc.dtype else bias.to(acc.dtype))


def _mm_to(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    key = a.device.type
    if _MM_OUT_DTYPE.get(key, True):
        try:
            return torch.mm(a, b.t(), out_dtype=dt)
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return torch.mm(a.to(dt), b.to(dt).t())


_ADDMM_OUT_DTYPE: dict[str, bool] = {}  # device type -> whether addmm(out_dtype=) adds into an fp32 sum


def accumulate_gemm(acc: torch.Tensor | None, a: Operand, b: Operand, spec, gemm: str, device: torch.device,
                    dtype: torch.dtype, overwrite: bool = False) -> torch.Tensor:
    """``acc + a @ b.T`` in ``dtype``, into ``acc`` (a gradient sum, in its parameter's dtype; None
    before the first term); with ``overwrite``, ``a @ b.T`` written into ``acc`` (its old values
    not read). The product is what ``run_gemm`` computes, rounded to ``spec.out``, then added. A
    native dense GEMM with fp32 products and sum adds in its epilogue instead: one ``addmm`` into
    ``acc`` (an ``mm`` into it, to overwrite; bf16 operands through ``out_dtype``), so the product
    is never written as a tensor of its own and no separate add reads it back. Same sum, one rounding
    per term either way; which way ran is recorded (``note_kernel``)."""
    if acc is not None and _fusable_sum(acc, a, b, spec, gemm, device):
        key = device.type
        try:
            if a.dtype is acc.dtype:
                return torch.mm(a, b.t(), out=acc) if overwrite else acc.addmm_(a, b.t())
            if _ADDMM_OUT_DTYPE.get(key, True):
                out = (torch.mm(a, b.t(), out_dtype=acc.dtype, out=acc) if overwrite
                       else torch.addmm(acc, a, b.t(), out_dtype=acc.dtype, out=acc))
                if key not in _ADDMM_OUT_DTYPE:
                    _ADDMM_OUT_DTYPE[key] = True
                    note_kernel(f"{gemm} sum", device, "GEMM into the sum (out_dtype)")
                return out
        except (RuntimeError, TypeError, NotImplementedError) as e:
            _ADDMM_OUT_DTYPE[key] = False
            note_kernel(f"{gemm} sum", device, "mm, then add",
                        why=f"{'mm' if overwrite else 'addmm'}(out_dtype=) cannot write into an fp32 sum here: "
                            f"{str(e).splitlines()[0][:120]}")
    if overwrite and acc is not None and _gemm_into(acc, a, b, spec, gemm, device):
        return acc
    g = finish(run_gemm(a, b, spec, gemm, device), spec.out, dtype)
    g = g if g.dtype is dtype else g.to(dtype)
    if acc is None:
        return g
    return acc.copy_(g) if overwrite else acc.add_(g)


def _gemm_into(acc: torch.Tensor, a: Operand, b: Operand, spec, gemm: str, device: torch.device) -> bool:
    """``a @ b.T`` written by the GEMM itself into ``acc`` (``accumulate_gemm``'s overwrite; a backend's
    ``mm_into``: the blockwise FP8 ``scaled_mm``), where its product would be ``acc``'s dtype anyway
    (fp32 out, fp32 sum); False where it is not done (the caller writes the product, then copies it)."""
    if spec.out is not Format.FP32 or acc.dtype is not torch.float32:
        return False
    res = resolve(spec, gemm, device)
    if res.backend == "torch":
        return False
    be = _BACKENDS[res.backend_at((a.data if isinstance(a, QTensor) else a).shape[0])]
    into = getattr(be, "mm_into", None)
    return into is not None and be.shape_unsupported(a, b) is None and into(a, b, acc)


def _fusable_sum(acc: torch.Tensor, a, b, spec, gemm: str, device: torch.device) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and native(a) and a.dtype is b.dtype
            and a.dtype in (torch.bfloat16, torch.float16, torch.float32) and spec.out is Format.FP32
            and acc.dtype is torch.float32 and resolve(spec, gemm, device).backend == "torch"
            and not exact_dense_spec(spec, gemm, device))


def finish(acc: torch.Tensor, out: Format, like: torch.dtype) -> torch.Tensor:
    """Round a GEMM result to its ``out`` format. Emulated: fp32 values rounded, returned in the
    activation dtype ``like``. Native: the tensor already has the ``out`` dtype."""
    if native(acc):
        dt = out.torch_dtype()
        return acc if acc.dtype is dt else acc.to(dt)
    y = round_to(acc, out)
    return y if y.dtype is like else y.to(like)


# --------------------------------------------------------------------------- backends


class GemmBackend(Protocol):
    name: str

    def unsupported(self, spec, gemm: str, device: torch.device | None) -> str | None:
        """Why this backend cannot run ``spec`` as GEMM ``gemm`` on ``device`` (None: it can).
        ``device=None`` asks only what holds on every device (checked when a preset is read)."""

    def cast(self, x: torch.Tensor, spec: CastSpec) -> Operand:
        """``x`` as this backend's K-major operand (8-bit: a QTensor)."""

    def shape_unsupported(self, a: Operand, b: Operand) -> str | None:
        """Why these operands' shapes cannot run here (None: they can)."""

    def mm(self, a: Operand, b: Operand, out: Format = Format.FP32) -> torch.Tensor:
        """``a @ b.T`` (a: M x K, b: N x K). Native: in ``out``'s dtype; emulated: fp32."""

    # optional: ``mm_bias(a, b, out, bias)``, ``a @ b.T + bias`` with the bias added in the GEMM
    # (before its output is rounded), or None where it cannot (``run_gemm`` then adds it after)


def _k_major_block(op: CastSpec, reduction_on_rows: bool) -> Block:
    """The operand's block in the K-major layout the GEMM reads."""
    return op.block.transposed() if reduction_on_rows else op.block


@dataclass
class ExactOperand:
    """An 8-bit GEMM operand prepared for ``exact_mm``: its data as float64 (exact) and, per row, the
    float64 scale of each ``group``-wide K group (one column when the scale spans K)."""

    values: torch.Tensor  # (R, K) float64: the fp8 / int8 values themselves
    scales: torch.Tensor  # (R, G) float64
    group: int  # K elements per scale group (K itself for per-tensor / per-row scales)
    format: Format

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def _row_group_scales(q: QTensor) -> tuple[torch.Tensor, int]:
    """(R, G) scales of a K-major QTensor, one per row and K group, and the group width."""
    r, k = q.data.shape
    rows, cols = q.spec.block.resolve(r, k)
    s = q.scale.double()
    if rows > 1:
        s = s.repeat_interleave(rows, 0)[:r]
    return s, cols


def exact_operand(q) -> ExactOperand:
    if isinstance(q, ExactOperand):
        return q
    scales, group = _row_group_scales(q)
    return ExactOperand(to_float(q.data, torch.float64), scales, group, q.spec.format)


# Per 8-bit format: (log2 of the spacing of its smallest values, log2 of a bound on its magnitude).
_GRID = {Format.FP8_E4M3: (-9, 9), Format.FP8_E5M2: (-16, 16), Format.INT8: (0, 7)}


def exact_bits(fa: Format, fb: Format, group: int) -> int:
    """Bits a ``group``-long dot product of ``fa`` x ``fb`` values can span: every product is a
    multiple of 2^(ga + gb) below 2^(ma + mb), so every partial sum, in any order, is a multiple of
    2^(ga + gb) below 2^(ma + mb) * group."""
    (ga, ma), (gb, mb) = _GRID[fa], _GRID[fb]
    return ma + mb + (group - 1).bit_length() - (ga + gb)


def exact_mm(a, b) -> torch.Tensor:
    """``a @ b.T`` for 8-bit operands, each K group's dot product exact, whatever the summation order.

    E4M3 values are multiples of 2^-9 below 2^9, INT8 values integers below 2^7: a dot product of 128
    E4M3 x E4M3 products spans at most 2^-18 .. 2^25 (43 bits; ``exact_bits``), within float64's 53
    bits, so any BLAS computes it exactly, in any order, with or without FMA, on any number of
    threads. Each group's product is then scaled ((p * sa) * sb, in float64) and the groups are
    added in K order, and the sum is rounded to fp32 once. A row's result therefore does not depend
    on the batch it is computed in, on any CPU: the bitwise rollout = trainer property of the
    unified flow holds by construction for its FP8 GEMMs. ``EmulatedBackend`` uses this when
    ``exact_bits`` <= 53 (E4M3 x E4M3 groups up to 2^17 wide, INT8 x INT8), else the fp32 path."""
    a, b = exact_operand(a), exact_operand(b)
    k = a.values.shape[1]
    g = min(a.group, b.group)
    if a.group % g or b.group % g:
        raise ValueError(f"exact_mm: K groups of {a.group} and {b.group} do not nest")
    acc = None
    for k0 in range(0, k, g):
        part = torch.mm(a.values[:, k0:k0 + g], b.values[:, k0:k0 + g].t())
        part.mul_(a.scales[:, k0 // a.group:k0 // a.group + 1]).mul_(b.scales[:, k0 // b.group])
        acc = part if acc is None else acc.add_(part)
    return acc.float()


# Dense (bf16 / fp32) operands made exact: each element on a fixed-point grid of its (row, K group)
# -- value = integer * 2^(e - bits), |integer| <= 2^bits, where 2^e bounds the group's largest
# magnitude. A bf16 value within 2^-14 of its group's largest keeps all its bits (bits = 22); an
# fp32 value in the group's top binade keeps all 24; smaller ones round to the grid (half to even),
# an error of at most 2^(e - bits - 1) <= 2^-bits of the group's largest value, that of fp32 accumulation.
DENSE_BITS = {Format.BF16: 22, Format.FP32: 24}
F64_BITS = 53
MAX_GROUP = 128


def exact_group(bits_a: int, bits_b: int, k: int | None = None) -> int:
    """The widest K group (a power of two, <= ``MAX_GROUP``) whose dot product of ``bits_a``- and
    ``bits_b``-bit integers is exact in float64: every partial sum is an integer of magnitude
    <= group * 2^(bits_a + bits_b) <= 2^53."""
    g = min(MAX_GROUP, 1 << max(0, F64_BITS - bits_a - bits_b))
    return g if k is None else min(g, 1 << max(0, (k - 1).bit_length()))


MIN_EXP = -100  # groups whose largest magnitude is below 2^-100 share the grid of 2^-100 (scales stay normal)


def pow2(n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^n for an integer tensor ``n`` (within the dtype's normal range), exactly: built from its bits."""
    if dtype is torch.float64:
        return ((n.long() + 1023) << 52).view(torch.float64)
    return ((n.int() + 127) << 23).view(torch.float32)


def _group_exponents(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., R, K) as (..., R, G, group) (zero-padded) and each group's exponent ``e``
    (..., R, G, 1): the group's largest magnitude is below 2^e (e >= ``MIN_EXP``)."""
    *lead, r, k = x.shape
    n = -(-k // group)
    pad = n * group - k
    xg = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xg = xg.reshape(*lead, r, n, group)
    return xg, torch.frexp(xg.abs().amax(-1, keepdim=True)).exponent.clamp_(min=MIN_EXP)


def _ungroup(v: torch.Tensor, k: int) -> torch.Tensor:
    v = v.reshape(*v.shape[:-2], -1)
    return v[..., :k] if v.shape[-1] != k else v


def fixed_point(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., R, K) fp32 or float64 as integers ``v`` (same dtype, ``|v| <= 2^bits``, bits <= 24)
    and float64 power-of-two scales ``s`` (..., R, G) of each row's K groups, ``x ~= v * s``, rounded
    half to even; a group is ``group`` elements from K index 0, the last one partial. A row's values
    depend on that row alone. Non-finite groups stay non-finite."""
    xg, e = _group_exponents(x, group)
    v = (xg * pow2(bits - e, x.dtype)).round_()  # a power-of-two scaling: exact
    return _ungroup(v, x.shape[-1]), pow2(e - bits, torch.float64)[..., 0]


def on_grid(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``x`` (fp32) rounded onto its ``fixed_point`` grid, as fp32 values (integer * power of two:
    exact). Two rows' products then share one power of two per K group, which is what makes their
    float64 group sums exact."""
    xg, e = _group_exponents(x, group)
    v = (xg * pow2(bits - e, torch.float32)).round_().mul_(pow2(e - bits, torch.float32))
    return _ungroup(v, x.shape[-1])


def dense_exact_operand(x: torch.Tensor, fmt: Format, group: int) -> ExactOperand:
    """A dense operand on its grid, as float64 values (``on_grid``; unit scales: the grid's powers of
    two are in the values)."""
    v = on_grid(x if x.dtype is torch.float32 else x.float(), DENSE_BITS[fmt], group).double()
    return ExactOperand(v, torch.ones(v.shape[0], -(-v.shape[1] // group), dtype=torch.float64, device=v.device),
                        group, fmt)


def exact_dense_mm(a: torch.Tensor, b, fa: Format, fb: Format) -> torch.Tensor:
    """``a @ b.T`` of dense CPU operands (fp32 tensors holding ``fa`` / ``fb`` values; ``b`` may be
    already converted, ``dense_weight_operand``), each K group's dot product exact (``on_grid``:
    within a group every product of a row of ``a`` and a row of ``b`` is an integer below 2^53
    times one power of two), groups added in K order in float64, rounded to fp32 once: a row's
    result is the same bits whatever else is in the batch, on any CPU, BLAS and thread count. What
    the forward GEMMs of the CPU emulation run (rollout and trainer alike); the backward's GEMMs
    need no invariance."""
    if not isinstance(b, ExactOperand):
        b = dense_exact_operand(b, fb, exact_group(DENSE_BITS[fa], DENSE_BITS[fb], a.shape[1]))
    g = b.group
    av = on_grid(a if a.dtype is torch.float32 else a.float(), DENSE_BITS[fa], g).double()
    acc = None
    for k0 in range(0, a.shape[1], g):
        part = torch.mm(av[:, k0:k0 + g], b.values[:, k0:k0 + g].t())
        acc = part if acc is None else acc.add_(part)
    return acc.float()


def exact_dense_spec(spec, gemm: str, device: torch.device) -> bool:
    """Whether GEMM ``gemm`` of ``spec`` runs ``exact_dense_mm``: a dense forward GEMM on CPU."""
    return (gemm == "fprop" and device.type != "cuda" and not _FORCE_NATIVE and not spec.is_quantized
            and spec.a.format in DENSE_BITS and spec.b.format in DENSE_BITS)


def dense_weight_operand(w: torch.Tensor, spec) -> ExactOperand:
    """A dense forward weight converted once for ``exact_dense_mm`` (cached with the layer's weights)."""
    fa, fb = spec.a.format, spec.b.format
    return dense_exact_operand(w, fb, exact_group(DENSE_BITS[fa], DENSE_BITS[fb], w.shape[1]))


def _exact(a, b) -> bool:
    fa = a.spec.format if isinstance(a, QTensor) else a.format
    fb = b.spec.format if isinstance(b, QTensor) else b.format
    ka = a.data.shape[1] if isinstance(a, QTensor) else a.values.shape[1]
    ga = _row_group_scales(a)[1] if isinstance(a, QTensor) else a.group
    gb = _row_group_scales(b)[1] if isinstance(b, QTensor) else b.group
    return exact_bits(fa, fb, min(ga, gb, ka)) <= 53


class EmulatedBackend:
    """The reference: quantized operands multiplied exactly (``exact_mm``), or dense operands in fp32."""

    name = "emulated"

    def unsupported(self, spec, gemm, device):
        return None

    def cast(self, x, spec):
        return quantize(x, spec) if spec.is_scaled else dense_cast(x, spec.format)

    def shape_unsupported(self, a, b):
        return None

    def mm(self, a, b, out=Format.FP32):
        quantized = isinstance(a, (QTensor, ExactOperand)), isinstance(b, (QTensor, ExactOperand))
        if not any(quantized):
            return dense_mm(a, b, out)
        if all(quantized) and _exact(a, b):
            acc = exact_mm(a, b)
        else:
            acc = row_invariant_mm(operand_values(a), operand_values(b))
        return acc.to(out.torch_dtype()) if native(acc) else acc


def _scaled_mm_v2():
    """``torch.nn.functional.scaled_mm`` and its ScalingType, when this torch has them."""
    f = getattr(torch.nn.functional, "scaled_mm", None)
    st = getattr(torch.nn.functional, "ScalingType", None)
    if f is None or st is None or not hasattr(st, "BlockWise1x128"):
        return None
    return f, st


def _scaled_mm_into(a, b_t, sa, recipe_a, sb, recipe_b, out_dtype, out, bias=None):
    """``torch.nn.functional.scaled_mm(...)`` written into ``out``: the functional has no ``out=``, so
    its op, with the arguments as the functional passes them (one scale and recipe per operand, no
    swizzle)."""
    return torch._scaled_mm_v2(a, b_t, [sa], [recipe_a.value], [], [sb], [recipe_b.value], [], bias, out_dtype, [],
                               False, out=out)


def blockwise_kind(a: CastSpec, b: CastSpec) -> str | None:
    """``"1x128x128x128"`` (Fprop/Dgrad), ``"1x128x1x128"`` (Wgrad) or None, for K-major blocks."""
    if a.block != B1x128:
        return None
    if b.block == B128x128:
        return "1x128x128x128"
    if b.block == B1x128:
        return "1x128x1x128"
    return None


_CPU_SCALED_MM: dict = {}


def _cpu_scaled_mm_runs(fmt: Format, ka: Block, kb: Block) -> bool:
    """Whether this torch's CPU build runs the scaled GEMM (torch 2.11's CPU _scaled_mm takes
    per-tensor scales only; 2.13's takes row-wise too). Probed once per format and scaling."""
    key = (fmt, ka.rows, kb.rows)
    if key not in _CPU_SCALED_MM:
        spec_a, spec_b = CastSpec(fmt, ka), CastSpec(fmt, kb)
        try:
            be = ScaledMMBackend()
            be.mm(quantize(torch.ones(2, 16), spec_a), quantize(torch.ones(16, 16), spec_b))
            _CPU_SCALED_MM[key] = True
        except (RuntimeError, ValueError, NotImplementedError, TypeError):
            _CPU_SCALED_MM[key] = False
    return _CPU_SCALED_MM[key]


class ScaledMMBackend:
    """torch's scaled GEMMs: FP8 per-tensor / per-row / blockwise (Hopper), INT8 through _int_mm."""

    name = "scaled_mm"

    def unsupported(self, spec, gemm, device):
        a, b = spec.a, spec.b
        if not (a.is_scaled and b.is_scaled):
            return "runs 8-bit operands only"
        rows = REDUCTION_ON_ROWS[gemm]
        ka, kb = _k_major_block(a, rows[0]), _k_major_block(b, rows[1])
        factorable = all(blk.cols == 0 and blk.rows in (0, 1) for blk in (ka, kb))
        kind = blockwise_kind(CastSpec(a.format, ka), CastSpec(b.format, kb))
        if a.format is Format.INT8 and not factorable:
            return "runs int8 with per-tensor or per-row scales only"
        if not factorable and kind is None:
            na, nb = OPERANDS[gemm]
            return (f"needs per-tensor or per-row scales that are constant along the reduction dim, or the "
                    f"blockwise recipes 1x128 x 128x128 / 1x128 x 1x128 along it; here {na} is {a.block.name} and "
                    f"{nb} is {b.block.name}, i.e. {ka.name} x {kb.name} along the reduction (use backend: emulated)")
        if device is None:
            return None
        if device.type == "cpu" and kind is None and not _cpu_scaled_mm_runs(a.format, ka, kb):
            return (f"this torch ({torch.__version__}) cannot run {a.format.value} with "
                    f"{ka.name} x {kb.name} scales on CPU (its CPU scaled_mm / _int_mm lacks it)")
        if kind is not None:
            if device.type != "cuda":
                return "blockwise FP8 runs on CUDA GPUs only (torch's CPU scaled_mm takes per-tensor and row-wise scales)"
            if torch.cuda.get_device_capability(device) < (9, 0):
                return "blockwise FP8 needs a Hopper (sm_90) or newer GPU"
        elif device.type == "cuda" and a.format.is_fp8 and torch.cuda.get_device_capability(device) < (8, 9):
            return "FP8 needs an Ada (sm_89) or Hopper GPU"
        return None

    def cast(self, x, spec):
        if not spec.is_scaled:
            return dense_cast(x, spec.format)
        q = _triton_quantize(x, spec) if x.is_cuda else None
        return q if q is not None else quantize(x, spec)

    def shape_unsupported(self, a, b):
        if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
            return "an operand is not 8-bit"
        k = a.data.shape[1]
        if blockwise_kind(a.spec, b.spec) is not None:
            if k % TILE:
                return f"blockwise scaled_mm needs the reduction dim to be a multiple of {TILE}, got {k}"
            if b.spec.block == B128x128 and b.data.shape[0] % TILE:
                return f"blockwise scaled_mm needs N to be a multiple of {TILE} for 128x128 scales, got {b.data.shape[0]}"
        elif a.data.is_cuda and (k % 16 or b.data.shape[0] % 16):
            return f"scaled_mm needs K and N to be multiples of 16, got K={k}, N={b.data.shape[0]}"
        return _int8_overflow(a)

    def mm(self, a, b, out=Format.FP32):
        if not isinstance(a, QTensor):
            return EmulatedBackend().mm(a, b, out)
        out_dtype = out.torch_dtype() if native(a.data) else torch.float32
        m, n = a.data.shape[0], b.data.shape[0]
        if blockwise_kind(a.spec, b.spec) is not None:
            return self._blockwise(a, b, out_dtype)
        for op in (a, b):  # K-major operands: scales must be one per row (or one in all)
            if op.spec.block not in (Block(0, 0), Block(1, 0)) and op.scale.numel() != 1:
                raise JetrlError(f"backend scaled_mm got an operand with {op.spec.block.name} scales along K")
        # reshape through 1-D: a transposed (1, M) grid has a large stride on its size-1 dim,
        # which _scaled_mm rejects even though the tensor counts as contiguous
        sa = a.scale.reshape(()) if a.scale.numel() == 1 and m != 1 else a.scale.reshape(-1).reshape(m, 1)
        sb = b.scale.reshape(()) if b.scale.numel() == 1 and n != 1 else b.scale.reshape(-1).reshape(1, n)
        if a.spec.format is Format.INT8:
            x = a.data
            if native(x) and m <= 16:  # cuBLAS' int8 GEMM refuses these: zero rows added, exact
                x = torch.nn.functional.pad(x, (0, 0, 0, INT_MM_PAD_ROWS - m))
            acc = torch._int_mm(x, b.data.t())[:m]
            return (acc.float() * sa * sb).to(out_dtype)
        if sa.dim() != sb.dim():  # _scaled_mm wants both tensor-wise or both row-wise
            sa = sa.expand(m, 1).contiguous() if sa.dim() == 0 else sa
            sb = sb.expand(1, n).contiguous() if sb.dim() == 0 else sb
        return torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=out_dtype)

    @staticmethod
    def _blockwise(a: QTensor, b: QTensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: the (M, N) tensor of ``out_dtype`` to write into (M a multiple of 4: no padded rows)."""
        from ..kernels.layouts import _pad_rows, _scaled_mm_scale, is_gemm_layout, to_gemm_layout

        m = a.data.shape[0]
        a = a if is_gemm_layout(a) else to_gemm_layout(a)  # each operand's layout checked once
        b = b if is_gemm_layout(b) else to_gemm_layout(b)
        if a.spec.block != B1x128:
            raise ValueError(f"scaled_mm blockwise: operand a must be 1x128, got {a.spec.block.name}")
        a = _pad_rows(a)  # M a multiple of 4: a decode step's few rows, a prefill's any number
        v2 = _scaled_mm_v2()
        api = "v2" if v2 is not None else "legacy"
        sa, sb = _scaled_mm_scale(a, "a", api), _scaled_mm_scale(b, "b", api)
        if v2 is not None:
            f, st = v2
            rb = st.BlockWise128x128 if b.spec.block == B128x128 else st.BlockWise1x128
            if out is not None:
                return _scaled_mm_into(a.data, b.data.t(), sa, st.BlockWise1x128, sb, rb, out_dtype, out, bias)
            kw = {} if bias is None else {"bias": bias}
            y = f(a.data, b.data.t(), sa, st.BlockWise1x128, sb, rb, output_dtype=out_dtype, **kw)
        elif out is not None:
            return torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=out_dtype, out=out)
        else:
            y = torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=out_dtype)
        return y if y.shape[0] == m else y[:m]

    def mm_into(self, a, b, out: torch.Tensor) -> bool:
        """A blockwise FP8 GEMM's fp32 product written by ``scaled_mm`` straight into ``out`` (a weight's
        ``.grad``: ``accumulate_gemm``'s overwrite), not into a tensor of its own then copied. The first
        call on a device checks, outside a graph capture, that this torch takes ``out=`` there and
        writes the functional call's bits (``INTO_OP``, reported); a refusal or a difference is kept,
        and the caller copies the product instead, as everywhere else. False: not written."""
        if not (isinstance(a, QTensor) and isinstance(b, QTensor) and native(a.data)
                and blockwise_kind(a.spec, b.spec) is not None and out.dtype is torch.float32
                and out.is_contiguous() and out.shape == (a.data.shape[0], b.data.shape[0])
                and a.data.shape[0] % 4 == 0):
            return False
        dev = out.device
        choice = kernel_choice(INTO_OP, dev)
        if choice is None:
            if capturing(dev):
                return False  # decided outside a capture (the trainer's graphs warm up eagerly first)
            choice = self._check_into(a, b, out)
        if not choice["into"]:
            return False
        self._blockwise(a, b, torch.float32, out=out)
        return True

    def _check_into(self, a: QTensor, b: QTensor, out: torch.Tensor) -> dict:
        dev = out.device
        try:
            want = self._blockwise(a, b, torch.float32)
            got = torch.empty_like(out)
            self._blockwise(a, b, torch.float32, out=got)
            same = torch.equal(got, want)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError, AttributeError) as e:
            why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            return note_kernel(INTO_OP, dev, "product, then copied", f"scaled_mm(out=) refused: {why}", into=False)
        if not same:
            return note_kernel(INTO_OP, dev, "product, then copied",
                               "scaled_mm(out=) wrote other bits than the functional call", into=False)
        return note_kernel(INTO_OP, dev, "scaled_mm into the gradient (out=)",
                           f"checked on {tuple(out.shape)}: the functional call's bits", into=True)

    def mm_bias(self, a, b, out, bias):
        """A blockwise FP8 GEMM plus ``bias`` in ``scaled_mm``'s epilogue: added to the fp32 sum before
        the output is rounded (the emulation's order, and the Triton backend's), one kernel where
        the add after it is another (a Qwen2 model's q/k/v: one per layer and step of a rollout).
        Natively, with torch's ``scaled_mm`` API; the first call on a device decides whether cuBLASLt
        takes a bias with block scales, and a refusal is kept and reported (``BIAS_OP``): None then,
        and the caller adds the bias after the GEMM, as on every other path here."""
        if not (isinstance(a, QTensor) and isinstance(b, QTensor) and native(a.data)
                and blockwise_kind(a.spec, b.spec) is not None and _scaled_mm_v2() is not None):
            return None
        dev = a.data.device
        choice = kernel_choice(BIAS_OP, dev)
        if choice is None and capturing(dev):
            return None  # nothing is decided inside a graph capture (an engine's eager steps come first)
        if choice is not None and not choice["epilogue"]:
            return None
        out_dtype = out.torch_dtype()
        try:
            y = self._blockwise(a, b, out_dtype, bias if bias.dtype is out_dtype else bias.to(out_dtype))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            if choice is not None:  # it ran before here: not a refusal of the bias
                raise
            why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            note_kernel(BIAS_OP, dev, "added after the GEMM", f"scaled_mm refused it: {why}", epilogue=False)
            return None
        if choice is None:
            note_kernel(BIAS_OP, dev, "in scaled_mm's epilogue", epilogue=True)
        return y


def cast_pair(x: torch.Tensor, rows: CastSpec | None, cols: CastSpec | None, backends) -> tuple:
    """``x`` (tokens x F) as its Fprop/Dgrad operand (``rows``: groups along F) and as its Wgrad
    operand x^T (``cols``: groups along tokens), either may be None. When one of ``backends`` is a
    kernel backend and jetrl's Triton quantizer can run on ``x`` for this pair of FP8 casts, both
    come from one read of ``x``, already in the GEMM layouts, x^T's token dim zero-padded to a
    multiple of 128 (what blockwise ``scaled_mm`` needs; the product is unchanged) -- so x^T comes from
    that kernel only where its own GEMM's backend is a kernel backend (the emulated one takes no
    padded tokens: a batch-invariant forward on the interpreter beside an emulated Wgrad). Otherwise
    each is cast on its own by its backend. Bit-identical either way."""
    be_rows, be_cols = backends
    padded_ok = cols is None or kernel_quantizers(x, (be_cols,), cols) is not None
    tri = (kernel_quantizers(x, backends, rows or cols) if x.dim() == 2 and one_read_pair(rows, cols) and padded_ok
           else None)
    if tri is not None:
        c = rows or cols
        return tri.quantize_act(x, c.format, c.pow2_scale, c.amax_floor, rows=rows is not None,
                                cols=cols is not None, pad_tokens_to=TILE)
    r = cast_operand(x, rows, be_rows) if rows is not None else None
    if cols is None:
        return r, None
    if r is not None and not rows.is_scaled and not cols.is_scaled and rows.format is cols.format:
        return r, transpose_operand(r)  # one dense cast serves both (a dense cast has no groups)
    return r, transpose_operand(cast_operand(x, cols, be_cols))


def one_read_pair(rows: CastSpec | None, cols: CastSpec | None) -> bool:
    """Whether jetrl's Triton quantizer (``quantize_act``) makes this pair of casts of one tensor from one
    read, where it runs: FP8 1x128 ``rows`` and 128x1 ``cols`` of one format, scaling and floor,
    either None. Then ``cast_pair`` takes it, and a kernel that computes such a tensor may write
    those operands itself in its layouts (``kernels.fp8.swiglu_grad_quantize``)."""
    specs = [c for c in (rows, cols) if c is not None]
    return bool(specs) and all(c.format.is_fp8 for c in specs) and len(
        {(c.format, c.pow2_scale, c.amax_floor) for c in specs}) == 1 and (
        rows is None or rows.block == B1x128) and (cols is None or cols.block == B128x1)


def cast_weight_pair(w: torch.Tensor, spec: CastSpec, backends) -> tuple | None:
    """``(W, W^T)`` quantized with 128x128 blocks from one read of ``w`` (the Triton kernel), when one
    of ``backends`` is a kernel backend and the kernel can run here; None otherwise (the caller then
    transposes W's operand: the block grid is transpose-symmetric, so the values are the same)."""
    if not (spec.format.is_fp8 and spec.block == B128x128 and w.dim() == 2):
        return None
    tri = kernel_quantizers(w, backends, spec)
    if tri is None:
        return None
    return tri.quantize_weight(w, spec.format, spec.pow2_scale, spec.amax_floor, transposed=True)


def kernel_quantizers(x: torch.Tensor, backends, spec: CastSpec):
    """``jetrl_cli.kernels.fp8`` where its Triton quantizers cast ``x`` for a GEMM under ``spec``: one of
    ``backends`` is a kernel backend (``scaled_mm``, ``triton``, ``invariant``: the ones that read
    their layouts) and ``fp8_kernels_for`` has them; else None (the reference quantizes, to the same
    bits). The batch-invariant mode takes them too: each quantizer's bits are the reference's, and the
    forward's fused ones (``rms_norm_quantize``, ``swiglu_quantize``) run one launch configuration
    whatever the rows, a row's result its own."""
    if not any(getattr(b, "name", "") in ("scaled_mm", "triton", "invariant") for b in backends):
        return None
    return fp8_kernels_for(x, spec)


def fp8_kernels_for(x: torch.Tensor, spec: CastSpec):
    """``jetrl_cli.kernels.fp8`` where its Triton kernels run on ``x`` (a GPU, or the interpreter) and
    take ``spec``'s format and floor, else None."""
    if x.is_cuda:  # a CUDA tensor: CUDA is there, so Triton's import decides (asked once: ~420 calls an update)
        fp8 = _cuda_fp8_kernels()
    elif os.environ.get("TRITON_INTERPRET") == "1":
        fp8 = triton_fp8_kernels()
    else:
        return None
    return fp8 if fp8 is not None and fp8.format_unsupported(spec.format, spec.amax_floor) is None else None


def int8_kernels_for(x: torch.Tensor, spec: CastSpec):
    """``jetrl_cli.kernels.int8`` where its Triton kernels run on ``x`` (``fp8_kernels_for``'s rule) and
    take ``spec`` (INT8, one scale per row) for ``x``'s dtype, else None."""
    if x.is_cuda:
        runs = _cuda_fp8_kernels() is not None
    else:
        runs = os.environ.get("TRITON_INTERPRET") == "1" and triton_fp8_kernels() is not None
    if not runs:
        return None
    from ..kernels import int8

    return int8 if int8.input_unsupported(x.dtype, spec) is None else None


@functools.lru_cache(maxsize=1)
def _cuda_fp8_kernels():
    """``triton_fp8_kernels()`` for a CUDA tensor's caller (whether Triton imports), looked up once
    per process."""
    return triton_fp8_kernels()


def triton_fp8_kernels():
    """``jetrl_cli.kernels.fp8`` when Triton can run here (a GPU, or the interpreter), else None."""
    from ..kernels import unavailable_reason

    if unavailable_reason() is not None:
        return None
    from ..kernels import fp8

    return fp8


def _int8_overflow(a: QTensor) -> str | None:
    """Why an INT8 GEMM with operand ``a`` could overflow its int32 sum, or None."""
    k = a.data.shape[1]
    if a.data.dtype is torch.int8 and k > INT8_K_LIMIT:
        return f"the int32 sum of an INT8 GEMM could overflow for K = {k} > {INT8_K_LIMIT}"
    return None


def _triton_quantize(x: torch.Tensor, spec: CastSpec) -> QTensor | None:
    """jetrl's Triton quantizer for ``spec`` (FP8 1x128 / 128x1 / 128x128, INT8 rows) on ``x`` when
    Triton can run here and has one, else None (the caller uses the reference: same values)."""
    if x.dim() != 2 or triton_fp8_kernels() is None:
        return None
    from .. import kernels

    return kernels.quantize(x, spec)


def _triton_unavailable(device: torch.device) -> str | None:
    """Why jetrl's Triton kernels cannot run on ``device`` here, or None."""
    from ..kernels import unavailable_reason

    why = unavailable_reason()
    if why is None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        why = "the Triton kernels run on CUDA tensors (or in Triton's interpreter with TRITON_INTERPRET=1)"
    return why


class TritonBackend:
    """jetrl's GEMMs and quantizers in Triton: blockwise FP8 (``jetrl_cli.kernels.fp8``) and INT8
    with per-row or per-tensor scales (``jetrl_cli.kernels.int8``)."""

    name = "triton"
    runs = "runs FP8 operands with 1x128 or 128x128 scales along the reduction dim, or INT8 with per-row scales"
    dense = False  # whether it also multiplies unscaled (bf16/fp32) operands
    int8 = True  # whether it multiplies INT8 operands

    def unsupported(self, spec, gemm, device):
        if spec.is_quantized or not self.dense:
            rows = REDUCTION_ON_ROWS[gemm]
            blocks = [_k_major_block(op, r) for op, r in zip((spec.a, spec.b), rows)]
            int8 = self.int8 and spec.a.format is Format.INT8 and spec.b.format is Format.INT8
            for op, blk, which in zip((spec.a, spec.b), blocks, ("a", "b")):
                if int8:
                    ok = blk.cols == 0 and blk.rows in (0, 1)  # one scale per row (or in all) across K
                else:
                    ok = op.format.is_fp8 and blk.cols == TILE and blk.rows in (1, TILE)
                if not ok:
                    return (f"{self.runs}; operand {which} is {op.short_str()}, i.e. {blk.name} along the "
                            f"reduction dim (use backend: emulated or scaled_mm)")
        return None if device is None else _triton_unavailable(device)

    def cast(self, x, spec):
        if not spec.is_scaled:
            return dense_cast(x, spec.format)
        q = _triton_quantize(x, spec)
        return q if q is not None else quantize(x, spec)

    def shape_unsupported(self, a, b):
        if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
            return "an operand is not 8-bit"
        return _int8_overflow(a)

    def mm(self, a, b, out=Format.FP32):
        if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
            return EmulatedBackend().mm(a, b, out)
        out_dtype = out.torch_dtype() if native(a.data) else torch.float32
        if a.data.dtype is torch.int8:
            from ..kernels import int8

            return int8.int8_mm(a, b, out_dtype=out_dtype)
        return triton_fp8_kernels().blockwise_mm(a, b, out_dtype=out_dtype)

    def mm_bias(self, a, b, out, bias):
        """``a @ b.T + bias`` with the bias added in the GEMM's epilogue, or None where this backend does
        not (the caller adds it). FP8: to the fp32 sum, before the output is rounded (the emulation's
        order). INT8: to the rounded output, as the separate add after ``_int_mm``'s epilogue (the
        ``scaled_mm`` backend's) does it, so the two backends keep the same bits."""
        if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
            return None
        out_dtype = out.torch_dtype() if native(a.data) else torch.float32
        if a.data.dtype is torch.int8:
            from ..kernels import int8

            return int8.int8_mm(a, b, out_dtype=out_dtype, bias=bias if bias.dtype is out_dtype else bias.to(out_dtype))
        return triton_fp8_kernels().blockwise_mm(a, b, out_dtype=out_dtype, bias=bias.contiguous())


class InvariantBackend(TritonBackend):
    """jetrl's batch-invariant Triton GEMMs (``kernels/invariant.py``): one tile configuration for
    every M and a split of K fixed by the weight's shape (``k_chunks``), so a row's result does not
    depend on the batch (``precision.batch_invariant``).
    Dense bf16/fp32 operands and FP8 with 1x128 / 128x128 scales along K; the Triton quantizers."""

    name = "invariant"
    runs = "runs dense bf16/fp32 operands, or FP8 operands with 1x128 or 128x128 scales along the reduction dim"
    dense = True
    int8 = False

    def shape_unsupported(self, a, b):
        return None

    def mm(self, a, b, out=Format.FP32):
        return self.mm_bias(a, b, out, None)

    def mm_bias(self, a, b, out, bias):
        """``a @ b.T (+ bias)``, the bias added in the kernels' epilogue, to the fp32 sum before the
        output is rounded: one launch fewer per layer (q/k/v's bias) than an add after the GEMM, and a
        row's bits still its own whatever the batch (the rollout's and the trainer's forward both
        come here)."""
        from ..kernels import invariant

        ref = a.data if isinstance(a, QTensor) else a
        out_dtype = out.torch_dtype() if native(ref) else torch.float32
        bias = None if bias is None else bias.contiguous()
        if isinstance(a, QTensor):  # unsupported() admits 8-bit specs only with both operands FP8
            return invariant.invariant_blockwise_mm(a, b, bias, out_dtype=out_dtype)
        return invariant.invariant_mm(a, b, bias, out_dtype=out_dtype)


class UnavailableBackend:
    """A named slot with nothing behind it (yet)."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def unsupported(self, spec, gemm, device):
        return self.why

    def cast(self, x, spec):
        raise JetrlError(f"GEMM backend {self.name!r} {self.why}")

    def shape_unsupported(self, a, b):
        return self.why

    def mm(self, a, b, out=Format.FP32):
        raise JetrlError(f"GEMM backend {self.name!r} {self.why}")


_BACKENDS: dict[str, GemmBackend] = {
    "emulated": EmulatedBackend(),
    "scaled_mm": ScaledMMBackend(),
    "triton": TritonBackend(),
    "invariant": InvariantBackend(),
    "te": UnavailableBackend("te", "is not available: no Transformer Engine integration is in this "
                                    "release; use 'auto' or 'emulated'"),
}
AUTO_ORDER = ("scaled_mm", "triton", "emulated")
assert ("auto", *_BACKENDS) == GEMM_BACKENDS, "jetrl_cli/choices.py and the backend registry disagree"


def register_backend(name: str, backend: GemmBackend) -> None:
    _BACKENDS[name] = backend
    _RESOLVED.clear()


def get_backend(name: str) -> GemmBackend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise JetrlError(f"unknown GEMM backend {name!r} (allowed: auto, {', '.join(_BACKENDS)})") from None


def check_backends(flow, device: torch.device | str) -> None:
    """A one-line error naming the preset key of each of ``flow``'s GEMMs whose preset names a backend
    that cannot run it on ``device`` (``resolve``'s rule, checked before a run starts rather than at
    the GEMM's first call), with the backends that can."""
    device = torch.device(device)
    t = flow.train.linear
    for key, spec, gemm in (("precision.rollout.linear", flow.rollout.linear, "fprop"),
                            ("precision.train.fprop", t.fprop, "fprop"), ("precision.train.dgrad", t.dgrad, "dgrad"),
                            ("precision.train.wgrad", t.wgrad, "wgrad")):
        asked = spec.backend
        if asked == "auto" or not spec.is_quantized or (asked == "invariant" and device.type != "cuda"):
            continue
        why = get_backend(asked).unsupported(spec, gemm, device)
        if why is not None:
            ok = [n for n, be in _BACKENDS.items() if n != asked and be.unsupported(spec, gemm, device) is None]
            raise JetrlError(f"{key}.backend: {asked} cannot run {spec.short_str()} on {device}: {why} (allowed "
                             f"here: {', '.join(['auto', *ok])})")


def static_unsupported(backend: str, spec, gemm: str) -> str | None:
    """What a preset can be told before any device is known: can ``backend`` run ``spec`` at all?"""
    if backend == "auto" or (backend == "invariant" and not spec.is_quantized):
        return None
    if not spec.is_quantized and backend != "te":  # would be ignored: torch's matmul runs it
        return ("runs 8-bit GEMMs only, and this one has no 8-bit operand (torch's matmul runs it; "
                "leave its backend auto, or invariant for a batch-invariant GEMM)")
    return get_backend(backend).unsupported(spec, gemm, None)


# --------------------------------------------------------------------------- resolution


@dataclass
class Resolution:
    """Which backend runs one GEMM spec on one device, and why."""

    gemm: str
    spec_str: str
    device: str
    asked: str
    backend: str
    candidates: list[str]  # usable backends, in fallback order (the chosen one first)
    rejected: dict[str, str] = field(default_factory=dict)  # backend -> why not
    timings_ms: dict[str, float] = field(default_factory=dict)
    # (rows, backend): calls of at most ``rows`` rows (the first such tier) run on ``backend``; only
    # tiers whose choice differs from the next one's (or, for the last, from ``backend``)
    by_rows: tuple[tuple[int, str], ...] = ()
    row_timings_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # tier rows -> backend -> ms

    def backend_at(self, rows: int) -> str:
        """The backend that runs a call of ``rows`` rows (operand a's)."""
        for upto, name in self.by_rows:
            if rows <= upto:
                return name
        return self.backend

    def to_dict(self) -> dict:
        d = {"gemm": self.gemm, "spec": self.spec_str, "device": self.device, "asked": self.asked,
             "backend": self.backend, "fallback_order": self.candidates[1:]}
        if self.rejected:
            d["rejected"] = dict(self.rejected)
        if self.timings_ms:
            d["timings_ms"] = {k: round(v, 4) for k, v in self.timings_ms.items()}
        if self.by_rows:
            d["by_rows"] = [{"rows_upto": upto, "backend": name} for upto, name in self.by_rows]
        if self.row_timings_ms:
            d["row_timings_ms"] = {str(m): {k: round(v, 4) for k, v in t.items()} for m, t in self.row_timings_ms.items()}
        return d


_RESOLVED: dict[tuple, Resolution] = {}
_FALLBACKS: dict[tuple, int] = {}  # (gemm, spec, from, to, why) -> calls


def _operands(backend: GemmBackend, spec, gemm: str, x: torch.Tensor, w: torch.Tensor) -> tuple:
    """``x`` and ``w`` as ``gemm``'s operands a and b, cast by ``backend`` the way the layers cast
    them: an operand reduced along its rows (Wgrad's x^T and dy^T, 128x1 groups along tokens) is cast
    from the token-major tensor and transposed (``cast_pair``), the others directly."""
    rows_a, rows_b = REDUCTION_ON_ROWS[gemm]
    return tuple(cast_pair(t, None, c, (backend, backend))[1] if on_rows else cast_operand(t, c, backend)
                 for t, c, on_rows in ((x, spec.a, rows_a), (w, spec.b, rows_b)))


def _probe(backend: GemmBackend, spec, gemm: str, device: torch.device, rows: int = 256) -> str | None:
    """Run a ``rows`` x 256 x 256 GEMM with random operands through ``backend`` and the emulated
    reference (a few rows: a decode step's kernel, which may be another tile configuration)."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = (torch.randn(rows, 256, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(device)
    w = (torch.randn(256, 256, generator=g) * 0.05).to(device)
    try:
        a, b = _operands(backend, spec, gemm, x, w)
        why = backend.shape_unsupported(a, b)
        if why is not None:
            return f"probe: {why}"
        got = backend.mm(a, b, spec.out).float()
    except Exception as e:  # a torch build or GPU that cannot run it
        return f"probe failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    emu = _BACKENDS["emulated"]
    ref = emu.mm(*_operands(emu, spec, gemm, x, w), spec.out).float()
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    if not err <= KERNEL_TOLERANCE:
        return f"probe: relative error {err:.2e} against emulated exceeds {KERNEL_TOLERANCE:g}"
    return None


TIMING_SIZE = 2048  # auto times each backend on one TIMING_SIZE^3 GEMM
# Forward GEMMs serve the rollout's decode steps too (a few rows to a few hundred): timed again at these rows
ROW_TIERS = {"fprop": (8, 64, 512)}
TIMED_CALLS = 10


def _time_ms(backend: GemmBackend, spec, gemm: str, device: torch.device, rows: int | None = None,
             size: int = TIMING_SIZE) -> float:
    """Milliseconds of one ``rows`` (default ``size``) x ``size`` x ``size`` GEMM, device time:
    ``TIMED_CALLS`` calls captured in one CUDA graph and replayed, as the engine replays its decode
    steps (host overhead is not what a captured step pays); launched eagerly if the backend's calls
    cannot be captured."""
    g = torch.Generator(device="cpu").manual_seed(99)
    x = torch.randn(rows or size, size, generator=g).to(device)
    a, b = _operands(backend, spec, gemm, x, (torch.randn(size, size, generator=g) * 0.05).to(device))

    return device_time_ms(lambda: backend.mm(a, b, spec.out), device)


def row_tiers(winners: list[tuple[int, str]], backend: str) -> tuple[tuple[int, str], ...]:
    """The fewest (rows, backend) tiers that send every row count where ``winners`` (the fastest
    backend at each timed row count, ascending) and ``backend`` (beyond the last) say."""
    kept, after = [], backend
    for upto, name in reversed(winners):
        if name != after:
            kept.append((upto, name))
        after = name
    return tuple(reversed(kept))


def device_time_ms(fn, device: torch.device, calls: int = TIMED_CALLS) -> float:
    """Milliseconds per call of ``fn()`` on ``device``. On a GPU, device time: ``calls`` calls
    captured in one CUDA graph and replayed, as the engine replays its decode steps (host overhead is
    not what a captured step pays), or launched eagerly if they cannot be captured (on CPU: the wall
    clock of eager calls). A warm-up round first (Triton compiles, cuBLAS picks its algorithms)."""
    return replayed_time_ms(fn, device, calls)[0]


def replayed_time_ms(fn, device: torch.device, calls: int = TIMED_CALLS) -> tuple[float, bool]:
    """``(device_time_ms(fn, device, calls), whether the calls were replayed from a CUDA graph)``."""
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def run_calls():
        for _ in range(calls):
            fn()

    run_calls()
    sync()
    run = run_calls
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_calls()
        run = graph.replay
    except Exception:  # noqa: BLE001 - not capturable (a host read, a torch build, a CPU): timed eagerly
        sync()
    run()
    sync()
    t0 = time.perf_counter()
    for _ in range(3):
        run()
    sync()
    return (time.perf_counter() - t0) / (3 * calls) * 1e3, run is not run_calls


def resolve(spec, gemm: str, device: torch.device | str) -> Resolution:
    """The backend that runs ``spec`` as GEMM ``gemm`` on ``device`` (see the module docstring)."""
    device = torch.device(device)
    key = (spec, gemm, device.type, device.index)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    asked = spec.backend
    dev_str = str(device)
    if asked == "invariant" and device.type != "cuda" and not _FORCE_NATIVE:
        res = Resolution(gemm, spec.short_str(), dev_str, asked, "emulated" if spec.is_quantized else "torch",
                         ["emulated" if spec.is_quantized else "torch"],
                         rejected={"invariant": "the CPU emulation is batch-invariant already (every "
                                                "forward GEMM exact per K group)"})
    elif not spec.is_quantized and asked != "invariant":
        res = Resolution(gemm, spec.short_str(), dev_str, asked, "torch", ["torch"])
    elif asked != "auto":
        why = get_backend(asked).unsupported(spec, gemm, device)
        if why is not None:
            raise JetrlError(f"the {gemm} GEMM {spec.short_str()}: backend {asked} cannot run it on {dev_str}: {why} "
                             "(the preset's precision names the backend: set it to auto)")
        order = [asked] + ([] if asked == "emulated" else ["emulated"])
        res = Resolution(gemm, spec.short_str(), dev_str, asked, asked, order)
    elif device.type != "cuda":
        res = Resolution(gemm, spec.short_str(), dev_str, asked, "emulated", ["emulated"],
                         rejected={n: "auto uses the exact emulated reference on CPU" for n in AUTO_ORDER if n != "emulated"})
    else:
        rejected, ok = {}, []
        for name in AUTO_ORDER:
            be = _BACKENDS[name]
            why = be.unsupported(spec, gemm, device) or (None if name == "emulated" else _probe(be, spec, gemm, device))
            if why is None:
                ok.append(name)
            else:
                rejected[name] = why
        timings = {name: _time_ms(_BACKENDS[name], spec, gemm, device) for name in ok}
        order = sorted(ok, key=lambda n: timings[n])
        res = Resolution(gemm, spec.short_str(), dev_str, asked, order[0], order, rejected, timings)
        kernels = [n for n in order if n != "emulated"]
        if res.backend != "emulated" and len(kernels) > 1 and gemm in ROW_TIERS:
            winners = []
            for m in ROW_TIERS[gemm]:
                t = res.row_timings_ms[m] = {n: _time_ms(_BACKENDS[n], spec, gemm, device, rows=m) for n in kernels}
                for n in sorted(t, key=t.get):  # the fastest that is also correct at these rows
                    why = _probe(_BACKENDS[n], spec, gemm, device, rows=m)
                    if why is None:
                        winners.append((m, n))
                        break
                    res.rejected[f"{n} at {m} rows"] = why
                else:  # none is: the reference
                    winners.append((m, "emulated"))
            res.by_rows = row_tiers(winners, res.backend)
    _RESOLVED[key] = res
    return res


def backend_for(spec, gemm: str, device: torch.device) -> GemmBackend:
    res = resolve(spec, gemm, device)
    return _BACKENDS["emulated"] if res.backend == "torch" else _BACKENDS[res.backend]


def run_gemm(a: Operand, b: Operand, spec, gemm: str, device: torch.device,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` on the resolved backend, falling back (and counting it) when the shapes
    do not fit. The bias is added to the product before it is rounded to ``spec.out`` where the
    GEMM allows it (emulated; native dense: ``addmm``; a backend's ``mm_bias``: the Triton FP8
    GEMM's epilogue), else to the GEMM's output."""
    res = resolve(spec, gemm, device)
    if res.backend == "torch":
        if isinstance(b, ExactOperand) or exact_dense_spec(spec, gemm, device):
            return add_bias(exact_dense_mm(operand_values(a), b, spec.a.format, spec.b.format), bias)
        return dense_mm(a, b, spec.out, bias)
    chosen = res.backend_at((a.data if isinstance(a, QTensor) else a).shape[0])
    first = _BACKENDS[chosen]
    why = first.shape_unsupported(a, b)
    if why is None:
        return _mm_bias(first, a, b, spec.out, bias)
    for name in res.candidates:
        be = _BACKENDS[name]
        if name != chosen and be.shape_unsupported(a, b) is None:
            k = (gemm, res.spec_str, chosen, name, why)
            _FALLBACKS[k] = _FALLBACKS.get(k, 0) + 1
            return _mm_bias(be, a, b, spec.out, bias)  # every backend reads jetrl's QTensors, whatever their strides
    raise JetrlError(f"precision.{gemm}: no backend can run {res.spec_str} on shapes "
                     f"{tuple(a.shape)} x {tuple(b.shape)} ({chosen}: {why})")


def _mm_bias(be: GemmBackend, a: Operand, b: Operand, out: Format, bias: torch.Tensor | None) -> torch.Tensor:
    """``be``'s GEMM plus ``bias``: in its epilogue where it has one (``mm_bias``), else added after."""
    with_bias = getattr(be, "mm_bias", None) if bias is not None else None
    y = with_bias(a, b, out, bias) if with_bias is not None else None
    return y if y is not None else add_bias(be.mm(a, b, out), bias)


def fallbacks() -> list[dict]:
    return [{"gemm": g, "spec": s, "from": f, "to": t, "why": w, "calls": n}
            for (g, s, f, t, w), n in _FALLBACKS.items()]


_KERNELS: dict[tuple[str, str], dict] = {}  # (operation, device) -> which kernel serves it, and why
BIAS_OP = "blockwise scaled_mm bias"  # ScaledMMBackend.mm_bias's decision, per device
INTO_OP = "blockwise scaled_mm into the gradient"  # ScaledMMBackend.mm_into's decision, per device


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (nothing is timed or decided
    then); True where no stream can be asked (no usable driver)."""
    try:
        return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001
        return True


_DEVICE_KEYS: dict = {}  # a device with its index -> its name (looked up at every quantizer call)


def _device_key(device) -> str:
    """One name per device: ``cuda`` and ``cuda:0`` are the same GPU when 0 is the current one (a
    tensor's device always has its index; a ``torch.device("cuda")`` has none)."""
    key = _DEVICE_KEYS.get(device)
    if key is not None:
        return key
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return str(torch.device("cuda", torch.cuda.current_device()))  # the current one: not kept
    key = str(d)
    if d.index is not None or d.type == "cpu":
        _DEVICE_KEYS[device] = key
    return key


def kernel_choice(op: str, device: torch.device) -> dict | None:
    """What ``note_kernel`` recorded for ``op`` on ``device`` in this process, or None."""
    return _KERNELS.get((op, _device_key(device)))


def note_kernel(op: str, device: torch.device, kernel: str, why: str | None = None, **extra) -> dict:
    """Record which kernel serves a non-GEMM operation (decided once per device; ``backend_report``
    lists it, so runs and benches say what ran), with ``extra`` facts about the decision."""
    key = _device_key(device)
    info = {"op": op, "device": key, "kernel": kernel, **({"why": why} if why else {}), **extra}
    _KERNELS[(op, key)] = info
    return info


def backend_report() -> dict:
    """Every resolution made so far in this process and every call-time fallback; ``fused``: the
    elementwise chains compiled on a GPU, or why they are not (``precision.fuse``), when any ran;
    ``kernels``: the kernels chosen for other operations (``note_kernel``), when any was."""
    out = {"resolved": [r.to_dict() for r in _RESOLVED.values() if r.backend != "torch"], "fallbacks": fallbacks()}
    fused = fuse_report()
    if fused is not None:
        out["fused"] = fused
    if _KERNELS:
        out["kernels"] = list(_KERNELS.values())
    return out


def reset_resolutions() -> None:
    """Start ``backend_report`` afresh (a run's, a bench row's): resolutions, fallbacks, kernel choices and
    which functions ran fused."""
    _RESOLVED.clear()
    _FALLBACKS.clear()
    _KERNELS.clear()
    fuse_reset_report()


def cast_operand(x: torch.Tensor, spec: CastSpec, backend: GemmBackend | str = "emulated") -> Operand:
    """``x`` as a K-major operand of ``backend`` (8-bit: a QTensor, bit-identical whichever backend
    quantizes it; unscaled: native dtype or fp32 rounded values)."""
    be = get_backend(backend) if isinstance(backend, str) else backend
    return be.cast(x, spec) if spec.is_scaled else dense_cast(x, spec.format)
