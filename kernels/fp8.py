"""Triton kernels of the unified FP8 flow, each the twin of a pure-torch reference in
``jetrl_cli.precision.quant`` / ``gemm``, writing its outputs in the layouts Hopper's blockwise FP8
GEMM consumes (``kernels/layouts.py`` describes them and why each exists):

- ``quantize_act(x)``: from ONE read of a 2-D activation or gradient x (T tokens x K), the 1x128
  quantization (groups along K; Fprop's and Dgrad's operand a) *and* the 128x1 quantization (groups
  along T; Wgrad's operands), the latter written already transposed as the K-major operand x^T
  (K, T_pad) with zero padding of T. Scales go straight into the GEMM's column-major grids.
- ``quantize_weight(w)``: 128x128 blocks of W (N x K) and W^T (K x N) for Dgrad (W^T's block scales
  written by the quantizer, its bytes transposed after it: ``transpose_bytes_``); scales in the
  padded (ceil(N/128), round_up(ceil(K/128), 4)) buffers the GEMM reads. ``quantize_weight_stacks``
  does a whole model's groups of weights in one launch (and their W^T bytes in one more): the
  kernel reads a table of each weight's offsets and sizes, one program per 128x128 block.
- ``swiglu_quantize(gu)``: from ONE read of a gated MLP's [g, u], ``silu(g) * u`` computed in fp32
  and quantized 1x128 (the down projection's Fprop operand), and [g, u]'s own 1x128 copy (what the
  backward keeps with ``save_fp8_activations``): the SwiGLU output is never written in high
  precision. ``swiglu_quantize_t`` is the backward's: from that FP8 copy, h quantized 128x1 and
  transposed (the down projection's Wgrad operand). ``swiglu_grad_quantize`` writes the SwiGLU
  gradient d[g, u], computed from that copy and the down projection's input gradient, straight into
  the gate/up projections' Dgrad (1x128) and Wgrad (128x1, transposed) operands: d[g, u] is never
  written in bf16 to be read back by ``quantize_act``; asked to, it also makes ``swiglu_quantize_t``'s
  output, so the backward reads the copy once. Each of its programs makes one part (d[g], d[u] or
  h^T) of a 128 x 128 tile; a tile's parts are neighbouring programs, so the second reads of the
  tile's dy, g and u are meant to hit L2 (not measured). Compiled for sm_90a with Triton 3.9 the
  SwiGLU kernels take 126-130 registers per thread (32 x 128 tiles, 4 warps) and 184-207 (128 x 128
  tiles, 8 warps), no spills (``tests/sm90_compile.py``).
- ``blockwise_mm``: ``a @ b.T`` for FP8 operands with 1x128 or 128x128 scales along K, fp32
  accumulation per 128-wide K block, scales applied to each block's partial sum before it is added
  (DeepSeek-V3's promotion rule), fp32 or bf16 output; it reads any scale strides. A decode step's
  few rows get narrow tiles (``decode_tiles``, shared with the INT8 GEMM), so more SMs stream the
  weight; prefill and training get 64 x 128.

Numerics (bit for bit the reference's): ``amax`` over the finite values of a group, floored at
``amax_floor``; ``scale = amax / fmt_max`` (optionally rounded up to a power of two), NaN when the
group holds a NaN or an infinity; data ``= cast(clamp(x * (1 / scale), -fmt_max, fmt_max))`` rounded
to nearest even, ``1 / scale`` correctly rounded once per group and the product rounded once. Two GPU
facts shape the code. Triton's ``/`` on fp32 compiles to ``div.full.f32``, an approximate division (up
to 2 ulp off), and ``div_rn`` to a slow path per call; the kernels divide nowhere: ``1 / scale`` once
per group (``_rcp``: the reciprocal unit's approximation and two Newton steps, correctly rounded), the
scale itself ``amax / fmt_max`` as the correctly rounded quotient from the constant ``RN(1 / fmt_max)``
and two FMA corrections (``_quotient``: Markstein's theorem), per element one multiply. And with
contraction on, a product followed by an add may become one FMA (other bits): the per-element product
is ``mul.rn`` (``_scaled``), which no compiler contracts. Until 2026-11-28 the rule divided each
element by the scale, which cost five instructions an element (the multiply and ``_quotient``'s two
corrections) in kernels bound by their instructions. The amax is an
integer max over the bits of ``|x|`` (sign bit cleared): for non-negative floats integer order is
float order and every NaN lies above +inf, so this one reduction yields both the amax and the
non-finite flag (the amax is NaN or inf exactly when the group holds a non-finite value), with no
per-element select. The kernels leave the reference's clamp out: for finite groups the rounded
``|x * (1 / scale)|`` exceeds fmt_max by at most two fp32 ulps, which the round-to-nearest cast
takes to fmt_max anyway (``_scaled``; the GPU's ``cvt.rn.satfinite`` and the tests' interpreter
cast alike).

Memory-speed design for Hopper (H100: 3.35 TB/s HBM3 by spec; a device copy measures ~2.75 TB/s,
``shared/notes/gpu-h100.md``). The fused act quantizer moves 2 bytes in (bf16) and 1 + 1 out per
element; at copy speed that is ~0.7 G elements/ms, which leaves the SMs (132 x 128 lanes x ~1.75 GHz)
about 40 thread-instructions per element. So it must read once, never re-read, and keep the
per-element work small:

- One program owns one 128x128 tile (both group shapes fit in it exactly): it loads the tile once
  (32 KB of bf16, 16-byte vector loads along K when rows are 16-byte aligned: Triton specializes
  such strides), reduces it along K (1x128 amax per row: registers and warp shuffles) and along T
  (128x1 amax per column: across warps through shared memory), and writes every output from those
  registers. Per element: a convert, an AND, one integer max per direction, and per output a
  multiply and four FMAs (the division, below; one multiply with pow2 scales) and half a packed
  cvt: 38 SASS instructions per element for the fused quantizer (2432 per thread at 8 warps, 64
  elements each), everything counted. Nothing is read twice and nothing is written twice.
- 8 warps hold the fp32 tile in 64 registers per thread (``NUM_WARPS``; on a GPU 8 or 16, as timed
  at the first call, ``launch_config``; ``jetrl bench quantize --warps 8,16`` times both); the grid is (token tiles, K tiles), for 8192 x 8192
  4096 programs of 64 KB of traffic each: many waves over 132 SMs, a short tail. What the compiler
  makes of it (sm_90a, Triton 3.9, ``tests/sm90_compile.py``; no spills): the fused 1x128 + 128x1
  quantizer takes 171 registers per thread, so ONE program per SM (65536 / (171 x 256) < 2), whose
  load no other program's compute overlaps; the 1x128-only quantizer 99 and the weight quantizer
  103, two per SM. Whether the fused kernel still beats two separate ones (one read of x, but half
  the programs in flight) is for ``jetrl bench quantize`` on a GPU to say: it times all three.
- No division per element: a group's scale is divided into 1 once (``_divisor``), and each element
  is multiplied by it (``_scaled``; until 2026-11-28 with two FMA corrections after the product,
  ``_quotient``, for the IEEE quotient the reference then took). ``div_rn`` per element was a multi-function-unit reciprocal, a range check and about
  six FMAs (sm_90a SASS: 129 reciprocals per thread in the fused quantizer, 450 in the SwiGLU
  backward). With the clamp gone too (``_scaled``), the fused quantizer's SASS went from 3760 to 2432
  instructions per thread and the SwiGLU backward's from 10600 to 8712 (8 warps); the first H100
  run measured the 3760 version. The divisions left, a group's two and the SwiGLU's ``1 / (1 +
  exp(-g))`` per element, were then each an IEEE ``div_rn`` (``FCHK``, a branch to a slow path, its
  call's register moves), and with each group's scale computed by every thread that holds a part of
  the group (16 column groups a thread at 8 warps) they were a fifth of the quantizers' instructions:
  now none is a division (``_group_scale``, ``_rcp``, ``_over``). Per thread, Triton 3.9, 8 warps,
  before / after: fused act quantizer 2432 / 1952 instructions (171 / 160 registers), 1x128 952 /
  768 (100 / 64: four programs per SM instead of two), 128x1 1832 / 1424, SwiGLU backward 8496 /
  7488 (190 / 175), its two-kernel form's 128x1 kernel 4344 / 3192 (16 warps: 2200 / 1584, 97 / 70
  registers); Triton 3.6 alike (``docs/benchmarks.md``). Untimed on a GPU.
- Every store is whole, contiguous lines: the 1x128 data is 128 bytes of a row per group; the
  transposed 128x1 data is 128 bytes of a row of x^T per tile row (Triton turns the tile around
  through shared memory, byte by byte, so that the store is coalesced along T; a form that packed
  four tokens into 32-bit words in registers and transposed words had fewer instructions but ran
  1.3-2.3x slower on an H200, ``docs/benchmarks.md``, and was removed); a tile's 128 row scales are 512
  contiguous bytes of the column-major scale grid (that layout is also the cheapest to write), and
  so are its 128 column scales in the (T/128, K) grid behind x^T's scales.
- A group's scale is a reduced, replicated value: Triton's store drops the replicas, so each scale
  is written by one thread; the 128x128 weight scale is a scalar store. Scale pads (1.0) are written
  by the last K tile of each row, so no buffer is filled in a separate pass.

No speed is claimed here: on a CPU these run in Triton's interpreter (``TRITON_INTERPRET=1``), which
is how they are tested (bit for bit against the reference); timings belong to ``jetrl bench
quantize`` on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from jetrl_cli.precision.formats import B1x128, B128x1, B128x128, Format
from jetrl_cli.precision import gemm  # its registry, timer and capture check (looked up at call time)
from jetrl_cli.precision.quant import DEFAULT_AMAX_FLOOR, CastSpec, QTensor

from .layouts import cdiv, padded_groups, round_up, scale_buffer

TILE = 128
MIN_SCALE = 2.0**-64  # the smallest scale the kernels take (``_quotient``'s precondition)
# Contraction of a * b + c into one fused multiply-add, pinned at every launch: Triton 3.9 warns that
# its default turns from on to off in 3.10, which would change the GEMMs' and reductions' last bits
# between Triton versions. On, as every measurement and compile check here was made.
FP_FUSION = True
# Warps of the 128x128-tile kernels: ``NUM_WARPS`` for the act and weight quantizers, ``SWIGLU_WARPS``
# for the SwiGLU backward's (``swiglu_quantize_t``, ``swiglu_grad_quantize``). Compiled for sm_90a
# (Triton 3.9; registers per thread / SASS instructions per thread, 128x128 tile):
#   at 8 warps:  fused act 171 / 2432, 1x128-only 99 / 952, weight 103 / 840, SwiGLU backward 204 / 8712
#   at 16 warps: fused act  96 / 1680, 1x128-only 57 / 560,  weight  59 / 520, SwiGLU backward 127 / 5168
# 16 warps issue 18-38% more instructions per tile (the per-thread fixed work is spread over half
# the elements) but keep twice the warps in flight per SM (the fused and SwiGLU kernels run one
# program per SM either way: 8 or 16 warps). Triton 3.6 (the H100 machine's) takes more registers:
# at 8 warps 224 (fused act), 114 (1x128), 128 (weight), 255 (SwiGLU backward); at 16 warps 127, 64,
# 63, and the SwiGLU kernels spill (88-120 bytes of stack per thread). Which is faster is for
# ``jetrl bench quantize --warps 8,16`` on a GPU to say (unmeasured); the bits do not depend on it
# (every reduction is a max, every other step elementwise). The H200 measured the SwiGLU backward at
# 16 warps at 0.16x of copy bandwidth (2026-11-27): one 16-warp program per SM waits on memory and
# issues alone. Its two-kernel form (``_swiglu_grad_split``, 32x128 and 128x32 tiles: 4096 values a
# program) takes, Triton 3.9 (3.6): at 8 warps 80 (80) registers for the 1x128 kernel and 128 (150)
# for the 128x1 one, at 16 warps 52 (54) and 97 (120) -- several programs per SM, at more
# instructions per value (the 128x1 kernel's column scales are computed by every thread holding the
# column). Both forms are timed on the GPU (``SWIGLU_CHOICES``). On the H200 (2026-11-27) the two
# kernels at 8 warps won the first update's timing, and in a 1.5B update the 128x1 one ran at 0.78 TB/s
# (0.66 ms a layer), the 1x128 one at 2.4. By its SASS that kernel is bound by instruction issue, not
# memory: 206 instructions per value (d[g], d[u] and h^T of one element) at 8 warps, about 0.45 ms a
# layer of issue alone at the 1.5B shape. Most of them were the column scales' work: its 32-column
# tile, loaded 16 FP8 bytes a thread, left each thread one token of 16 columns, so every thread reduced
# 16 columns across 128 threads and computed 16 scales and reciprocals. Its columns are now loaded 2 to
# a thread (``_runs``): 8 tokens of 2 columns a thread, 118 instructions per value at 8 warps, 108 at 4
# and 139 at 16 (Triton 3.6, with ``_exp_neg`` and the folded negations; were 206, 158, 215), no
# spills. The two kernels are also timed at 4 warps.
NUM_WARPS = 8  # the act and weight quantizers where nothing was timed (CPU, the interpreter): below
SWIGLU_WARPS = 8  # the SwiGLU backward kernels (swiglu_quantize_t, swiglu_grad_quantize), untimed

# On a GPU the 128x128-tile kernels' launch configuration is timed once per device, at the first
# eager call of an act or weight quantizer (``_choose_tiles``): the warps of a quantizer alone (8 or
# 16, timed as the 1x128 quantizer), and for the 1x128 + 128x1 pair of one tensor (the training
# step's Fprop and Wgrad copies) its warps and whether it is one kernel (one read of x, one program
# per SM) or two (two reads, more programs per SM). The SwiGLU backward's warps are timed at its own
# first call (``_choose_swiglu_warps``, as a training step runs it, with down's h^T; the registers
# and spills of each choice: above): the first H100 profile had it, at 8 warps, at 1.8 ms a layer
# for 0.9 GB, a fifth of the bandwidth. The bits are the same whichever runs (tested); the choices
# are reported with the GEMM backends (``backend_report``: ops ``TILES_OP``, ``SWIGLU_TILES_OP``).
TILES_OP = "fp8 quantizer tiles"
SWIGLU_TILES_OP = "fp8 SwiGLU backward tiles"
TRANSPOSE_OP = "fp8 weight transpose"
WARP_CHOICES = (8, 16)
TIMING_SHAPE = (4096, 4096)  # bf16 tokens x features the choice is timed on
class Launch(NamedTuple):
    """A 128x128-tile kernel's launch: its warps, and the 1x128 + 128x1 pair as one kernel or two (the
    SwiGLU backward: its 128x128-tile kernel, or two kernels of small tiles)."""
    warps: int
    one_kernel: bool = True


# the SwiGLU backward's timed choices: one kernel of 128x128 tiles, or two kernels of small tiles
# (``_swiglu_grad_split``), at 4 (two kernels only: one at 4 warps spills), 8 or 16 warps
SWIGLU_CHOICES = (Launch(8), Launch(16), Launch(4, False), Launch(8, False), Launch(16, False))


_FORCED: Launch | None = None  # while set by tile_warps or the timing


@contextlib.contextmanager
def tile_warps(n: int, one_kernel: bool = True):
    """Launch every 128x128-tile kernel at ``n`` warps inside the block, the 1x128 + 128x1 pair as one
    kernel or two (``jetrl bench quantize --warps``), instead of the device's timed choice."""
    global _FORCED
    if n not in (4, 8, 16, 32):
        raise ValueError(f"tile_warps: allowed 4, 8, 16 or 32 warps, got {n}")
    old, _FORCED = _FORCED, Launch(n, one_kernel)
    try:
        yield
    finally:
        _FORCED = old


def launch_config(x: torch.Tensor, pair: bool) -> Launch:
    """The launch of an act or weight quantizer of ``x`` (``pair``: the 1x128 + 128x1 pair)."""
    if _FORCED is not None:
        return _FORCED
    if not x.is_cuda:
        return Launch(NUM_WARPS)
    c = gemm.kernel_choice(TILES_OP, x.device) or _choose_tiles(x.device)
    return Launch(c["pair_warps"], c["one_kernel"]) if pair else Launch(c["warps"])


def swiglu_config(x: torch.Tensor) -> Launch:
    """The SwiGLU backward kernels' launch for an input on ``x``'s device (``launch_config``'s rule)."""
    if _FORCED is not None:
        return _FORCED
    if not x.is_cuda:
        return Launch(SWIGLU_WARPS)
    c = gemm.kernel_choice(SWIGLU_TILES_OP, x.device) or _choose_swiglu_warps(x.device)
    return Launch(c["warps"], c.get("one_kernel", True))


def _time_forced(device: torch.device, cases) -> dict:
    """``{label: device ms}`` of each ``(label, forced, fn)`` in ``cases``, ``fn`` run under ``_FORCED =
    forced``; what a timing raises is raised, and nothing stays forced."""
    global _FORCED
    t = {}
    try:
        for label, forced, fn in cases:
            _FORCED = Launch(*forced)
            t[label] = gemm.device_time_ms(fn, device)
    finally:
        _FORCED = None
    return t


def _choose_tiles(device: torch.device) -> dict:
    """Time the quantizers' launch configurations on ``device`` (``launch_config``) and record the
    fastest with ``note_kernel``: the 1x128 quantizer's warps, and the 1x128 + 128x1 pair's warps,
    one kernel or two; while a CUDA graph is being captured nothing can be timed: the defaults,
    unrecorded (an engine's first decode step runs eagerly before its capture)."""
    default = {"warps": NUM_WARPS, "pair_warps": NUM_WARPS, "one_kernel": True}
    if gemm.capturing(device):
        return default
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TIMING_SHAPE, generator=g).to(device, torch.bfloat16)
    runs = {"1x128": lambda: quantize_act(x, cols=False), "pair": lambda: quantize_act(x, pad_tokens_to=TILE)}
    try:
        cases = [(("1x128", w), (w, True), runs["1x128"]) for w in WARP_CHOICES]
        cases += [((f"pair as {'one kernel' if one else 'two kernels'}", w), (w, one), runs["pair"])
                  for w in WARP_CHOICES for one in (True, False)]
        t = _time_forced(device, cases)
    except Exception as e:  # noqa: BLE001 - nothing timed: the defaults, said why
        return gemm.note_kernel(TILES_OP, device, f"{NUM_WARPS} warps, the pair as one kernel", _untimed(e), **default)
    w1 = min(WARP_CHOICES, key=lambda w: t[("1x128", w)])
    pair, wp = min((k for k in t if k[0] != "1x128"), key=t.get)
    m, k = TIMING_SHAPE
    why = f"timed on {m} x {k} bf16: " + ", ".join(f"{what} at {w} warps {ms:.3f} ms" for (what, w), ms in t.items())
    return gemm.note_kernel(TILES_OP, device, f"{w1} warps; the 1x128 + 128x1 {pair} at {wp} warps", why,
                            warps=w1, pair_warps=wp, one_kernel=pair == "pair as one kernel",
                            timings_ms={f"{what} @ {w}": ms for (what, w), ms in t.items()})


def _untimed(e: Exception) -> str:
    return f"not timed ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def _choose_swiglu_warps(device: torch.device) -> dict:
    """Time the SwiGLU backward kernels (as a training step runs them, with down's h^T) in each of
    ``SWIGLU_CHOICES`` on ``device`` and record the fastest (``swiglu_config``); at its first call on the
    device, a training backward's. Inside a graph capture nothing is timed: the default, unrecorded."""
    default_launch = Launch(SWIGLU_WARPS)
    default = {"warps": SWIGLU_WARPS, "one_kernel": True}
    if gemm.capturing(device):
        return default
    g = torch.Generator().manual_seed(0)
    m, k = TIMING_SHAPE
    try:
        gu = quantize(torch.randn(TIMING_SHAPE, generator=g).to(device, torch.bfloat16),
                      CastSpec(Format.FP8_E4M3, B1x128))  # [g, u]'s FP8 copy, halves k / 2 wide
        gy = torch.randn((m, k // 2), generator=g).to(device, torch.bfloat16)
        run = lambda: swiglu_grad_quantize(gu, gy, torch.bfloat16, pad_tokens_to=TILE, h_cols=True)  # noqa: E731
        t = _time_forced(device, [(launch, launch, run) for launch in SWIGLU_CHOICES])
    except Exception as e:  # noqa: BLE001 - nothing timed: the default, said why
        return gemm.note_kernel(SWIGLU_TILES_OP, device, _swiglu_name(default_launch), _untimed(e), **default)
    best = min(t, key=t.get)
    why = f"timed on [g, u] {m} x {k}: " + ", ".join(f"{_swiglu_name(c)} {ms:.3f} ms" for c, ms in t.items())
    return gemm.note_kernel(SWIGLU_TILES_OP, device, _swiglu_name(best), why, warps=best.warps,
                            one_kernel=best.one_kernel, timings_ms={_swiglu_name(c): ms for c, ms in t.items()})


def _swiglu_name(launch: Launch) -> str:
    return f"{'one kernel' if launch.one_kernel else 'two kernels'} at {launch.warps} warps"


def _interpreter_fma_is_exact() -> bool:
    """Whether Triton's interpreter rounds ``tl.fma`` once (Triton 3.7 on; 3.6 multiplies, then adds)."""
    try:
        from triton._C.libtriton import interpreter
    except ImportError:
        return False
    return hasattr(interpreter, "fma_fp32")


# Divide (a group's amax by fmt_max, silu's g by 1 + exp(-g)) with a reciprocal and two FMA corrections
# (``_quotient``), bit for bit ``tl.div_rn``; where the kernels run in an interpreter whose FMA rounds
# twice, divide.
MARKSTEIN = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1" or _interpreter_fma_is_exact())


@triton.jit
def _pow2_ceil(s):
    """Smallest power of two >= s (s positive, normal, finite or +inf), by its exponent bits."""
    bits = s.to(tl.int32, bitcast=True)
    up = ((bits >> 23) + 1) << 23
    return tl.where((bits & 0x7FFFFF) == 0, bits, up).to(tl.float32, bitcast=True)


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits: for non-negative floats integer order is float order, and every NaN lies
    above +inf, so an integer max of these is a NaN-propagating amax (one reduction, no select)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _amax(abits, axis: tl.constexpr):
    return tl.max(abits, axis).to(tl.float32, bitcast=True)


@triton.jit
def _group_scale(amax, FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr):
    """The reference scale from a NaN-propagating amax (NaN or inf: the group is not finite).
    ``amax / fmt_max`` correctly rounded by ``_quotient`` with the constant ``RN(1 / fmt_max)`` (a
    Python double rounded to fp32: 1/448, 1/57344 and 1/127 are far from any fp32 tie), no division
    instruction: ``_quotient``'s preconditions hold, amax being at least the floor (>= 2^-64 fmt_max)."""
    a = tl.maximum(amax, FLOOR)
    if MARKSTEIN:
        s = _quotient(a, FMAX, 1.0 / FMAX)
    else:
        s = tl.div_rn(a, FMAX)
    if POW2:
        s = _pow2_ceil(s)
    return tl.where(amax < float("inf"), s, float("nan"))


@triton.jit
def _divisor(s):
    """``1 / s`` correctly rounded, once per scale (a group's, not each element's): ``_rcp``, no division
    instruction; exact for a power of two."""
    return _rcp(s)


INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
RCP_NORMAL = tl.constexpr(2.0**126)  # the largest power of two whose reciprocal is a normal fp32


@triton.jit
def _rcp_approx(x):
    """An approximate ``1 / x``: the GPU's reciprocal unit (``rcp.approx.ftz.f32``, within one ulp); in
    the interpreter, the correctly rounded reciprocal with its last bit flipped where it is a normal
    number (one ulp off, or the exact value), so that ``_rcp``'s corrections are what the CPU tests
    check, and a signed zero where it is subnormal or zero (``.ftz``)."""
    if INTERPRETED:
        bits = tl.div_rn(1.0, x).to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        bits = tl.where(mag < 0x00800000, (bits >> 31) << 31, tl.where(mag < 0x7F800000, bits ^ 1, bits))
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _rcp(x):
    """``1 / x`` correctly rounded (``tl.div_rn(1.0, x)``) for a normal x with a normal reciprocal, with no
    division: two Newton steps ``y += y * (1 - x * y)`` (each residual exact in an FMA) from
    ``_rcp_approx``, then the last bit set when x's significand is all ones. From any y within one ulp
    of 1 / x, one step gives the correctly rounded reciprocal except for that significand, where the
    tie ``0.5 + 2^-25`` rounds down to 0.5 (checked for every fp32 significand and both neighbours of
    1 / x: ``tests/test_kernels_quant.py``); the second step makes the first guess's accuracy not
    matter (from 100 ulps off, one step lands within 0.51 ulp). NaN stays NaN."""
    if MARKSTEIN:
        nx = x * -1.0  # -x (Triton 3.6 compiles a negation as 0 - x, an instruction ptxas cannot fold)
        y = _rcp_approx(x)
        y = tl.fma(tl.fma(nx, y, 1.0), y, y)
        y = tl.fma(tl.fma(nx, y, 1.0), y, y)
        ones = ((x.to(tl.int32, bitcast=True) & 0x7FFFFF) == 0x7FFFFF).to(tl.int32)
        return (y.to(tl.int32, bitcast=True) | ones).to(tl.float32, bitcast=True)
    else:
        return tl.div_rn(1.0, x)


@triton.jit
def _quotient(x, s, r):
    """``x / s`` correctly rounded (``tl.div_rn``'s result) from ``r = 1 / s`` correctly rounded, with
    no division per element: ``q = x * r`` (within 1.5 ulp), then twice ``q -= (q * s - x) * r``
    with the residual exact in an FMA. The first correction brings q within 1 ulp; from there the
    second returns the correctly rounded quotient (Markstein's theorem: r within half an ulp of
    1 / s, q within 1 ulp of x / s, no underflow of the residual). The residual is taken as
    ``q * s - x`` (not ``x - q * s``) so a zero x keeps its sign. Preconditions, kept by
    ``unsupported``: s a normal number >= 2^-64 (the floor), so 1 / s is finite, and any quotient
    that can round to a non-zero FP8 or INT8 value has a residual far above the subnormal range;
    for |x / s| < 2^-18 any error is rounded away by the cast. About 5 instructions per element
    against ~10 and a multi-function-unit reciprocal for ``div_rn``.

    Each correction is ``fma(residual, -r, q)``, not ``fma(-residual, r, q)``: Triton 3.6 compiles a
    float's negation as ``0.0 - v``, which leaves +0 at +0, so for x = -0 (and a negative x whose
    quotient cancels to zero) the negated residual was +0 and the quotient +0 -- FP8 byte 0x00 where
    the reference writes 0x80 (seen on an H200; the PTX has ``sub.f32`` from ``0f00000000``, where
    Triton 3.9 emits ``neg.f32``). ``-r`` is exact either way (r > 0), and the residual is never
    -0 (its two terms are never both -0), so the sign of a zero quotient is x's with both."""
    nr = -r
    nx = x * -1.0  # -x: Triton 3.6 compiles a negation as 0 - x, an instruction a thread per element
    q = x * r
    q = tl.fma(tl.fma(q, s, nx), nr, q)
    return tl.fma(tl.fma(q, s, nx), nr, q)


@triton.jit
def _scaled(x, r):
    """``x * r`` in fp32 for ``r = _divisor(s)``, rounded once and never contracted into a multiply-add
    (``mul.rn``: an INT8 quantizer adds its rounding constant to it next), NaN kept: the reference's
    product (``precision.quant``, rule 4; the cast to FP8 or INT8 follows).

    The reference's clamp to [-fmt_max, fmt_max] is left out: it changes nothing. ``|x| <= amax``,
    ``s = RN(max(amax, floor) / fmt_max)`` (or its power-of-two ceiling, which is larger) and ``r =
    RN(1 / s)`` put the exact ``|x * r|`` at most ``fmt_max * (1 + 2^-23)``, so its rounded value is at
    most fmt_max plus two fp32 ulps, which the round-to-nearest cast takes to fmt_max (the next FP8
    value up is 1/8 of fmt_max away; INT8: 127). NaN and infinity make the group's scale NaN, and the
    product NaN. Per element that saves two compares and two selects per output (on sm_90 with Triton
    3.6, ``tl.clamp(propagate_nan=ALL)`` there also made transposed FP8 stores write garbage bytes:
    triton-lang/triton#11111). Until 2026-11-28 this was the correctly rounded ``x / s`` (``_quotient``:
    the multiply and two FMA corrections), five instructions an element to this one."""
    if INTERPRETED:
        return x * r
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, r], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _rows_quantized(x, FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr):
    """A tile's 1x128 quantization, one group per row: ``(x * (1 / s) in fp32, s)``."""
    s = _group_scale(_amax(_abs_bits(x), 1), FMAX, FLOOR, POW2)
    return _scaled(x, _divisor(s)[:, None]), s


@triton.jit
def _store_cols(x, s, qt_ptr, st_ptr, pm, rm, rk, row_ok, col_ok, K, M_PAD, OUT: tl.constexpr,
                ZERO_PAD: tl.constexpr):
    """A tile's 128x1 quantization with its column scales ``s``, written as x^T (K, M_PAD) and its
    (K, gM) scale grid, strides (1, K); padding tokens are zeros even in a NaN group."""
    tl.store(st_ptr + pm.to(tl.int64) * K + rk, s, mask=col_ok)
    q = _scaled(x, _divisor(s)[None, :])
    if ZERO_PAD:
        q = tl.where(row_ok[:, None], q, 0.0)
    tl.store(qt_ptr + rk.to(tl.int64)[:, None] * M_PAD + rm[None, :], tl.trans(q.to(OUT)),
             mask=col_ok[:, None] & (rm < M_PAD)[None, :])


@triton.jit
def _load_rows(at, rm, M, col_ok, stride_m):
    """fp32 values of rows ``rm`` (zeros past ``M``) at column pointers ``at``."""
    return tl.load(at + rm.to(tl.int64)[:, None] * stride_m, mask=(rm < M)[:, None] & col_ok[None, :], other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _word_rows(pm, T: tl.constexpr):
    """Rows ``pm * T + 4 i`` (i < T / 4) of a tile: the first of each 32-bit word of its transpose
    (``_transpose_words_kernel``); rows ``+ j`` are the word's byte j."""
    return pm * T + 4 * tl.arange(0, T // 4)


@triton.jit
def _runs(start, N: tl.constexpr, RUN: tl.constexpr):
    """``start + tl.arange(0, N)`` as Triton's analysis sees runs of ``RUN`` consecutive values (``RUN`` a
    power of two, at most N): the loads of a tile's rows along it then take ``RUN`` elements a thread,
    and its layout puts more of the other axis in each thread. A 128x1 quantizer reduces each column
    over the tokens and computes the column's scale and reciprocal in every thread that holds the
    column: ``_swiglu_grad_cols_kernel``'s 32-column tile, loaded 16 FP8 bytes a thread, left each
    thread one token of 16 columns (16 scales a thread, each column reduced across 128 threads)."""
    a = tl.arange(0, N)
    return start + (a // RUN) * RUN + a % RUN


@triton.jit
def _exp_neg(g):
    """``tl.exp(-g)`` as Triton computes it on a GPU (``ex2.approx`` of ``-g * log2(e)`` rounded to fp32:
    the same product as ``g * -log2(e)``), but with results below 2^-126 flushed to zero
    (``ex2.approx.ftz``): for the SwiGLU kernels' ``1 + exp(-g)`` the same sum (1 + a subnormal rounds
    to 1), without the range check and two predicated multiplies ``tl.exp`` adds per element to keep
    subnormal results, nor Triton 3.6's ``0 - g`` for the negation. In the interpreter ``tl.exp(-g)``."""
    if INTERPRETED:
        return tl.exp(-g)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [g * -1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _silu_mul(g, u):
    """``silu(g) * u`` in fp32, ``precision.linear``'s form ``g / (1 + exp(-g)) * u``, the division
    correctly rounded (``_over``); Triton's exp (not torch's, ``_exp_neg``), the same in every SwiGLU
    quantizer."""
    return _over(g, 1.0 + _exp_neg(g)) * u


@triton.jit
def _sigmoid(g):
    """``1 / (1 + exp(-g))`` in fp32, ``precision.linear``'s form, its division correctly rounded
    (``_over``)."""
    d = 1.0 + _exp_neg(g)
    if MARKSTEIN:
        return tl.where(d < RCP_NORMAL, _rcp(d), 0.0)
    else:
        return tl.div_rn(1.0, d)


# The SwiGLU backward's ``1 / (1 + exp(-g))`` (its sigmoid, and h = g * that * u for down's Wgrad operand):
# on a GPU the reciprocal unit's approximation (``rcp.approx.ftz``, within an ulp), as its ``exp`` is
# ``ex2.approx``; in the interpreter the correctly rounded division, so the CPU tests check the kernels'
# bytes against the reference's bit for bit. The backward's gradients are not part of the on-policy
# equality (the forward's logprobs are): an ulp of fp32 there, before the bf16 and FP8 roundings that
# follow, is what the GPU's exp already costs. The exact form took the 128x1 kernel about 25 of its 106
# instructions a value (sm_90a, Triton 3.6): the reciprocal's two Newton steps and last-bit fix, the
# range checks, and h's quotient with its own reciprocal. Tests force it on in the interpreter (whose
# stand-in reciprocal is one ulp off) and check the bytes against the reference within one FP8 step.
APPROX_BACKWARD = tl.constexpr(not INTERPRETED)


@triton.jit
def _sigmoid_bwd(g):
    """The SwiGLU backward's ``1 / (1 + exp(-g))`` (``APPROX_BACKWARD``)."""
    if APPROX_BACKWARD:
        return _rcp_approx(1.0 + _exp_neg(g))
    else:
        return _sigmoid(g)


@triton.jit
def _silu_mul_bwd(g, u):
    """The SwiGLU backward's ``silu(g) * u`` (down's Wgrad operand): ``g * (1 / (1 + exp(-g))) * u`` with
    the approximate reciprocal (``APPROX_BACKWARD``; two products, nothing to contract), else
    ``_silu_mul``'s correctly rounded quotient."""
    if APPROX_BACKWARD:
        return g * _rcp_approx(1.0 + _exp_neg(g)) * u
    else:
        return _silu_mul(g, u)


@triton.jit
def _over(x, d):
    """``x / d`` correctly rounded for ``d = 1 + exp(-g)`` (>= 1, or +inf), with no division: ``_rcp(d)``
    and ``_quotient``'s two corrections. Where ``d >= 2^126`` (g < -87.3: the reciprocal is subnormal)
    the result is ``x * 0``: zero with IEEE division's sign, where for a finite d IEEE division gives
    ``g / d`` with g in (-88.8, -87.3], under 2^-119 in magnitude. The FP8 and INT8 quantizers round
    both to that zero (a group's scale is at least 2^-64, ``unsupported``), so their bytes are IEEE
    division's."""
    if MARKSTEIN:
        return tl.where(d < RCP_NORMAL, _quotient(x, d, _rcp(d)), x * 0.0)
    else:
        return tl.div_rn(x, d)


@triton.jit
def _act_quant_kernel(x_ptr, qr_ptr, sr_ptr, qt_ptr, st_ptr, M, K, M_PAD, stride_xm, stride_xk,
                      FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr, ZERO_PAD: tl.constexpr, T: tl.constexpr):
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rk = pk * T + tl.arange(0, T)
    col_ok = rk < K
    at = x_ptr + rk[None, :] * stride_xk
    rm = pm * T + tl.arange(0, T)
    _store_tile(_load_rows(at, rm, M, col_ok, stride_xm), qr_ptr, sr_ptr, qt_ptr, st_ptr, pm, pk, rm, rk, rm < M,
                col_ok, M, K, M_PAD, FMAX, FLOOR, POW2, OUT, ROWS, COLS, ZERO_PAD)


@triton.jit
def _store_tile(x, qr_ptr, sr_ptr, qt_ptr, st_ptr, pm, pk, rm, rk, row_ok, col_ok, M, K, M_PAD, FMAX: tl.constexpr,
                FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                ZERO_PAD: tl.constexpr):
    """A 128x128 tile ``x`` (fp32; rows ``rm``, columns ``rk`` = group ``pk`` of a T x K tensor) quantized
    1x128 (``ROWS``) and 128x1 (``COLS``) into ``quantize_act``'s outputs."""
    ax = _abs_bits(x)
    # both amaxes first, so the bits of |x| are dead before either output is computed (221 -> ~170
    # registers per thread for the fused case, sm_90a, Triton 3.9: tests/sm90_compile.py)
    if ROWS:
        s_row = _group_scale(_amax(ax, 1), FMAX, FLOOR, POW2)
    if COLS:
        s_col = _group_scale(_amax(ax, 0), FMAX, FLOOR, POW2)
    if ROWS:  # 1x128: one scale per row of the tile; data (M, K) row-major, scale (M, gK) column-major
        tl.store(sr_ptr + pk.to(tl.int64) * M + rm, s_row, mask=row_ok)
        q = _scaled(x, _divisor(s_row)[:, None])
        tl.store(qr_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :], q.to(OUT), mask=row_ok[:, None] & col_ok[None, :])
    if COLS:  # 128x1: one scale per column; written as x^T (K, M_PAD) and its (K, gM) grid, strides (1, K)
        _store_cols(x, s_col, qt_ptr, st_ptr, pm, rm, rk, row_ok, col_ok, K, M_PAD, OUT, ZERO_PAD)


@triton.jit
def _swiglu_quant_kernel(gu_ptr, qh_ptr, sh_ptr, qg_ptr, sg_ptr, M, I, stride_m, stride_k,
                         FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
                         SAVE: tl.constexpr, BM: tl.constexpr, T: tl.constexpr):
    pm = tl.program_id(0)
    pk = tl.program_id(1)  # the tile's 128-wide group of h (and of each half of gu)
    rm = pm * BM + tl.arange(0, BM)
    rk = pk * T + tl.arange(0, T)
    row_ok = rm < M
    inb = row_ok[:, None] & (rk < I)[None, :]
    at = gu_ptr + rm.to(tl.int64)[:, None] * stride_m
    g = tl.load(at + rk[None, :] * stride_k, mask=inb, other=0.0, eviction_policy="evict_first").to(tl.float32)
    u = tl.load(at + (I + rk)[None, :] * stride_k, mask=inb, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if SAVE:  # gu's own 1x128 copy: (M, 2I) row-major, scale (M, 2I/128) column-major; g's group, then u's
        q, s = _rows_quantized(g, FMAX, FLOOR, POW2)
        tl.store(sg_ptr + pk.to(tl.int64) * M + rm, s, mask=row_ok)
        tl.store(qg_ptr + rm.to(tl.int64)[:, None] * (2 * I) + rk[None, :], q.to(OUT), mask=inb)
        q, s = _rows_quantized(u, FMAX, FLOOR, POW2)
        tl.store(sg_ptr + (pk + I // T).to(tl.int64) * M + rm, s, mask=row_ok)
        tl.store(qg_ptr + rm.to(tl.int64)[:, None] * (2 * I) + (I + rk)[None, :], q.to(OUT), mask=inb)
    q, s = _rows_quantized(_silu_mul(g, u), FMAX, FLOOR, POW2)
    tl.store(sh_ptr + pk.to(tl.int64) * M + rm, s, mask=row_ok)
    tl.store(qh_ptr + rm.to(tl.int64)[:, None] * I + rk[None, :], q.to(OUT), mask=inb)


@triton.jit
def _copy_tile(q_ptr, s_ptr, pm, pk, M, I, stride_qm, stride_sm, T: tl.constexpr):
    """Tile (``pm``, ``pk``) of the SwiGLU backward kernels: its rows and h's columns, their masks, and
    the rows' pointers into the FP8 copy of [g, u] (data, scales)."""
    rm = pm * T + tl.arange(0, T)
    rk = pk * T + tl.arange(0, T)
    row_ok = rm < M
    col_ok = rk < I
    inb = row_ok[:, None] & col_ok[None, :]
    return rm, rk, row_ok, col_ok, inb, q_ptr + rm.to(tl.int64)[:, None] * stride_qm, s_ptr + rm.to(tl.int64) * stride_sm


@triton.jit
def _copy_group(at, s_at, cols, group, mask, row_ok, stride_sk):
    """fp32 values of the FP8 1x128 copy of [g, u] at rows ``at`` (data) / ``s_at`` (scales), columns
    ``cols``: its 128-wide group ``group``."""
    return tl.load(at + cols[None, :], mask=mask, other=0.0).to(tl.float32) * tl.load(
        s_at + group * stride_sk, mask=row_ok, other=1.0)[:, None]


@triton.jit
def _swiglu_quant_t_kernel(q_ptr, s_ptr, qt_ptr, st_ptr, M, I, M_PAD, stride_qm, stride_sm, stride_sk,
                           FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
                           ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr, ZERO_PAD: tl.constexpr,
                           T: tl.constexpr):
    pm = tl.program_id(0)
    pk = tl.program_id(1)  # h's 128-wide column tile: g's group pk and u's group I/128 + pk
    rm, rk, row_ok, col_ok, inb, at, s_at = _copy_tile(q_ptr, s_ptr, pm, pk, M, I, stride_qm, stride_sm, T)
    _store_h_cols(at, s_at, qt_ptr, st_ptr, pm, pk, rm, rk, row_ok, col_ok, inb, stride_sk, I, M_PAD, FMAX, FLOOR,
                  POW2, OUT, ROUND_BF16, INTERPRET, ZERO_PAD, T)


@triton.jit
def _store_h_cols(at, s_at, qt_ptr, st_ptr, pm, pk, rm, rk, row_ok, col_ok, inb, stride_sk, I, M_PAD,
                  FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
                  ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr, ZERO_PAD: tl.constexpr, T: tl.constexpr):
    """Tile (``pm``, ``pk``) of h = silu(g) * u, at the values of the FP8 copy of [g, u] (``_copy_tile``'s
    pointers), as the down projection's Wgrad operand: 128x1 quantized, written transposed
    (``swiglu_quantize_t``'s output)."""
    g = _copy_group(at, s_at, rk, pk, inb, row_ok, stride_sk)
    u = _copy_group(at, s_at, I + rk, pk + I // T, inb, row_ok, stride_sk)
    _h_cols(g, u, qt_ptr, st_ptr, pm, rm, rk, row_ok, col_ok, I, M_PAD, FMAX, FLOOR, POW2, OUT, ROUND_BF16, INTERPRET,
            ZERO_PAD)


@triton.jit
def _h_cols(g, u, qt_ptr, st_ptr, pm, rm, rk, row_ok, col_ok, I, M_PAD, FMAX: tl.constexpr, FLOOR: tl.constexpr,
            POW2: tl.constexpr, OUT: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr,
            ZERO_PAD: tl.constexpr):
    """h = silu(g) * u of a tile of the FP8 copy's values ``g``, ``u`` (rounded to bf16 first with
    ``ROUND_BF16``), quantized 128x1 and written transposed: down's Wgrad operand."""
    if ROUND_BF16:  # the values the forward's bf16 [g, u] had
        g = _to_bf16(g, INTERPRET).to(tl.float32)
        u = _to_bf16(u, INTERPRET).to(tl.float32)
    h = _silu_mul_bwd(g, u)  # as swiglu_quantize computes it (in the interpreter; APPROX_BACKWARD)
    s = _group_scale(_amax(_abs_bits(h), 0), FMAX, FLOOR, POW2)  # 128x1: one scale per column of h
    _store_cols(h, s, qt_ptr, st_ptr, pm, rm, rk, row_ok, col_ok, I, M_PAD, OUT, ZERO_PAD)


@triton.jit
def _swiglu_grad_quant_kernel(q_ptr, s_ptr, gy_ptr, qr_ptr, sr_ptr, qt_ptr, st_ptr, qh_ptr, sh_ptr, M, I, M_PAD,
                              stride_qm, stride_sm, stride_sk, stride_gm, stride_gk, FMAX: tl.constexpr,
                              FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, ROUND_BF16: tl.constexpr,
                              INTERPRET: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                              ZERO_PAD: tl.constexpr, T: tl.constexpr):
    # 0: d[g], 1: d[u], 2 (when launched): h^T; a tile's programs run side by side (gy, g, u: one DRAM read)
    part = tl.program_id(0)
    pk = tl.program_id(1)  # gy's 128-wide column tile: d[g]'s group pk, d[u]'s group I/128 + pk
    pm = tl.program_id(2)
    rm, rk, row_ok, col_ok, inb, at, s_at = _copy_tile(q_ptr, s_ptr, pm, pk, M, I, stride_qm, stride_sm, T)
    if part == 2:  # down's Wgrad operand h^T (its own program: within d[g]'s, 255 registers and spills)
        _store_h_cols(at, s_at, qh_ptr, sh_ptr, pm, pk, rm, rk, row_ok, col_ok, inb, stride_sk, I, M_PAD, FMAX, FLOOR,
                      POW2, OUT, ROUND_BF16, INTERPRET, ZERO_PAD, T)
    else:
        half = part
        gy = tl.load(gy_ptr + rm.to(tl.int64)[:, None] * stride_gm + rk[None, :] * stride_gk, mask=inb, other=0.0)
        g = _copy_group(at, s_at, rk, pk, inb, row_ok, stride_sk)
        sig = _sigmoid_bwd(g)  # as precision.linear's ``_silu_mul_grad`` computes it (APPROX_BACKWARD)
        # d[g] = gy * u * sig * (1 + g * (1 - sig)), d[u] = gy * g * sig (* 1: exact), in that order of
        # operations (one path for both halves, u read by d[g]'s program only: 202-207 registers per
        # thread with the h^T branch beside it, sm_90a, where an if/else between the halves took 252)
        dg = (rm * 0 + half) == 0  # a vector: the interpreter takes no scalar in a load's mask
        u = _copy_group(at, s_at, I + rk, pk + I // T, inb & dg[:, None], row_ok & dg, stride_sk)
        a = tl.where(dg[:, None], u, g)
        d = gy.to(tl.float32) * a * sig * tl.where(dg[:, None], 1.0 + g * (1.0 - sig), 1.0)
        if ROUND_BF16:  # the gradient's dtype: the values its Dgrad and Wgrad casts would read
            d = _to_bf16(d, INTERPRET).to(tl.float32)
        _store_tile(d, qr_ptr, sr_ptr, qt_ptr, st_ptr, pm, pk + half * (I // T), rm, half * I + rk, row_ok, col_ok,
                    M, 2 * I, M_PAD, FMAX, FLOOR, POW2, OUT, ROWS, COLS, ZERO_PAD)


@triton.jit
def _swiglu_d(gy, g, u, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """d[g] and d[u] of ``silu(g) * u`` for its output gradient ``gy``, in fp32 (rounded to bf16 with
    ``ROUND_BF16``), in ``_swiglu_grad_quant_kernel``'s order of operations, for the split kernels."""
    sig = _sigmoid_bwd(g)  # as precision.linear's ``_silu_mul_grad`` computes it (APPROX_BACKWARD)
    gs = gy.to(tl.float32)
    dg = gs * u * sig * (1.0 + g * (1.0 - sig))
    du = gs * g * sig  # the fused kernel's ``* 1.0`` after it is exact
    if ROUND_BF16:
        dg = _to_bf16(dg, INTERPRET).to(tl.float32)
        du = _to_bf16(du, INTERPRET).to(tl.float32)
    return dg, du


@triton.jit
def _swiglu_grad_rows_kernel(q_ptr, s_ptr, gy_ptr, qr_ptr, sr_ptr, M, I, stride_qm, stride_sm, stride_sk,
                             stride_gm, stride_gk, FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr,
                             OUT: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                             BM: tl.constexpr, T: tl.constexpr):
    # the split form's 1x128 half: BM rows x one 128-wide column tile of gy, d[g] and d[u] quantized 1x128
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rk = pk * T + tl.arange(0, T)
    row_ok = rm < M
    col_ok = rk < I
    inb = row_ok[:, None] & col_ok[None, :]
    at, s_at = q_ptr + rm.to(tl.int64)[:, None] * stride_qm, s_ptr + rm.to(tl.int64) * stride_sm
    gy = tl.load(gy_ptr + rm.to(tl.int64)[:, None] * stride_gm + rk[None, :] * stride_gk, mask=inb, other=0.0)
    g = _copy_group(at, s_at, rk, pk, inb, row_ok, stride_sk)
    u = _copy_group(at, s_at, I + rk, pk + I // T, inb, row_ok, stride_sk)
    dg, du = _swiglu_d(gy, g, u, ROUND_BF16, INTERPRET)
    _store_tile(dg, qr_ptr, sr_ptr, qr_ptr, sr_ptr, pm, pk, rm, rk, row_ok, col_ok, M, 2 * I, M, FMAX, FLOOR, POW2,
                OUT, True, False, False)
    _store_tile(du, qr_ptr, sr_ptr, qr_ptr, sr_ptr, pm, pk + I // T, rm, I + rk, row_ok, col_ok, M, 2 * I, M, FMAX,
                FLOOR, POW2, OUT, True, False, False)


@triton.jit
def _swiglu_grad_cols_kernel(q_ptr, s_ptr, gy_ptr, qt_ptr, st_ptr, qh_ptr, sh_ptr, M, I, M_PAD, stride_qm, stride_sm,
                             stride_sk, stride_gm, stride_gk, FMAX: tl.constexpr, FLOOR: tl.constexpr,
                             POW2: tl.constexpr, OUT: tl.constexpr, ROUND_BF16: tl.constexpr,
                             INTERPRET: tl.constexpr, COLS: tl.constexpr, H_COLS: tl.constexpr,
                             ZERO_PAD: tl.constexpr, BN: tl.constexpr, RUN: tl.constexpr, T: tl.constexpr):
    # the split form's 128x1 half: one 128-token group x BN columns of gy (inside one 128-wide group of
    # g and of u): d[g] and d[u] quantized 128x1 and written transposed (COLS), and down's h^T (H_COLS)
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * T + tl.arange(0, T)
    rk = _runs(pn * BN, BN, RUN)
    grp = pn * BN // T  # the 128-wide group of g holding these columns (u's: I / 128 later)
    row_ok = rm < M
    col_ok = rk < I
    inb = row_ok[:, None] & col_ok[None, :]
    at, s_at = q_ptr + rm.to(tl.int64)[:, None] * stride_qm, s_ptr + rm.to(tl.int64) * stride_sm
    g = _copy_group(at, s_at, rk, grp, inb, row_ok, stride_sk)
    u = _copy_group(at, s_at, I + rk, grp + I // T, inb, row_ok, stride_sk)
    if COLS:
        gy = tl.load(gy_ptr + rm.to(tl.int64)[:, None] * stride_gm + rk[None, :] * stride_gk, mask=inb, other=0.0)
        dg, du = _swiglu_d(gy, g, u, ROUND_BF16, INTERPRET)
        _store_tile(dg, qt_ptr, st_ptr, qt_ptr, st_ptr, pm, grp, rm, rk, row_ok, col_ok, M, 2 * I, M_PAD, FMAX, FLOOR,
                    POW2, OUT, False, True, ZERO_PAD)
        _store_tile(du, qt_ptr, st_ptr, qt_ptr, st_ptr, pm, grp, rm, I + rk, row_ok, col_ok, M, 2 * I, M_PAD, FMAX,
                    FLOOR, POW2, OUT, False, True, ZERO_PAD)
    if H_COLS:
        _h_cols(g, u, qh_ptr, sh_ptr, pm, rm, rk, row_ok, col_ok, I, M_PAD, FMAX, FLOOR, POW2, OUT, ROUND_BF16,
                INTERPRET, ZERO_PAD)


@triton.jit
def _residual(x_at, d_at, k, ok, HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """``s = x + delta`` of a (rows, 128) tile in fp32, rounded to s's dtype as torch's add rounds it."""
    x = tl.load(x_at + k[None, :], mask=ok, other=0.0)
    d = tl.load(d_at + k[None, :], mask=ok, other=0.0) if HAS_DELTA else x
    return _residual_of(x, d, HAS_DELTA, S_BF16, INTERPRET)


@triton.jit
def _residual_of(x, d, HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """``_residual`` of a tile's x and delta (x again without one) loaded already."""
    s = x.to(tl.float32)
    if HAS_DELTA:
        s += d.to(tl.float32)
        if S_BF16:
            s = _to_bf16(s, INTERPRET).to(tl.float32)
    return s


@triton.jit
def _norm_squares(ss, x_at, d_at, k, row_ok, N: tl.constexpr, HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """``ss`` plus the squares of one 128-wide chunk of the residual (per lane: K order)."""
    s = _residual(x_at, d_at, k, row_ok[:, None] & (k < N)[None, :], HAS_DELTA, S_BF16, INTERPRET)
    return ss + s * s


@triton.jit
def _norm_rsqrt(x_at, d_at, rk, row_ok, eps, N: tl.constexpr, HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr,
                INTERPRET: tl.constexpr, UNROLL: tl.constexpr, BM: tl.constexpr, T: tl.constexpr):
    """The first pass of a norm's rows: ``1 / sqrt(mean(s^2) + eps)`` per row, the squares summed per
    lane in K order, then one fixed tree; the division and square root correctly rounded, as the
    batch-invariant RMSNorm's."""
    ss = tl.zeros((BM, T), dtype=tl.float32)  # a running sum of squares per lane, in K order
    if UNROLL:
        for k0 in tl.static_range(0, N, T):
            ss = _norm_squares(ss, x_at, d_at, k0 + rk, row_ok, N, HAS_DELTA, S_BF16, INTERPRET)
    else:
        for k0 in range(0, N, T):
            ss = _norm_squares(ss, x_at, d_at, k0 + rk, row_ok, N, HAS_DELTA, S_BF16, INTERPRET)
    ms = tl.div_rn(tl.sum(ss, axis=1), tl.full((BM,), N, tl.float32))
    return tl.div_rn(1.0, tl.sqrt_rn(ms + eps))


@triton.jit
def _norm_y(kb, r, w_ptr, x_at, d_at, rk, row_ok, N: tl.constexpr, HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr,
            Y_BF16: tl.constexpr, INTERPRET: tl.constexpr, T: tl.constexpr):
    """Chunk ``kb`` of a norm's rows: its columns ``k``, their mask, the residual s (pass 1's bits,
    recomputed) and the norm's output y = s * r * w in fp32, rounded to bf16 with ``Y_BF16`` (the
    values a bf16 output holds: what is quantized)."""
    x, d, w = _norm_in(kb, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T)
    return _norm_y_of(kb, x, d, w, r, rk, row_ok, N, HAS_DELTA, S_BF16, Y_BF16, INTERPRET, T)


@triton.jit
def _norm_in(kb, w_ptr, x_at, d_at, rk, row_ok, N: tl.constexpr, HAS_DELTA: tl.constexpr, T: tl.constexpr):
    """Chunk ``kb``'s inputs as loaded: x, delta (x again without one) and the norm's weight, the
    weight's chunk loaded once per row of the tile (from L1): in the tile's own layout, where a 1-D
    load of it took a layout of its own and a conversion through shared memory, a barrier per chunk."""
    k = kb * T + rk
    ok = row_ok[:, None] & (k < N)[None, :]
    x = tl.load(x_at + k[None, :], mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_at + k[None, :], mask=ok, other=0.0)
    else:
        d = x
    return x, d, tl.load(w_ptr + k[None, :] + (row_ok.to(tl.int32) * 0)[:, None], mask=ok, other=0.0)


@triton.jit
def _norm_y_of(kb, x, d, w, r, rk, row_ok, N: tl.constexpr, HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr,
               Y_BF16: tl.constexpr, INTERPRET: tl.constexpr, T: tl.constexpr):
    """``_norm_y`` of chunk ``kb``'s inputs loaded already (``_norm_in``): the same arithmetic."""
    k = kb * T + rk
    ok = row_ok[:, None] & (k < N)[None, :]
    s = _residual_of(x, d, HAS_DELTA, S_BF16, INTERPRET)
    y = s * r[:, None] * w.to(tl.float32)
    if Y_BF16:
        y = _to_bf16(y, INTERPRET).to(tl.float32)
    return k, ok, s, y


@triton.jit
def _norm_chunk(kb, inputs, r, s_ptr, y_ptr, q_ptr, rows, rk, row_ok, N: tl.constexpr,
                FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
                HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr, Y_BF16: tl.constexpr, WRITE_Y: tl.constexpr,
                INTERPRET: tl.constexpr, T: tl.constexpr):
    """The second pass over chunk ``kb`` (its ``inputs`` loaded by ``_norm_in``): s (with a delta), y
    (with ``WRITE_Y``) and y's 1x128 cast; returns the chunk's row scales (stored by the caller)."""
    x, d, w = inputs
    k, ok, s, y = _norm_y_of(kb, x, d, w, r, rk, row_ok, N, HAS_DELTA, S_BF16, Y_BF16, INTERPRET, T)
    if HAS_DELTA:
        tl.store(s_ptr + rows * N + k[None, :], s.to(s_ptr.dtype.element_ty), mask=ok)
    if WRITE_Y:
        tl.store(y_ptr + rows * N + k[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)
    q, sc = _rows_quantized(y, FMAX, FLOOR, POW2)
    tl.store(q_ptr + rows * N + k[None, :], q.to(OUT), mask=ok)
    return sc


@triton.jit
def _rms_norm_quant_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, r_ptr, q_ptr, sc_ptr, M, eps,
                           stride_xm, stride_dm, N: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr,
                           POW2: tl.constexpr, OUT: tl.constexpr, HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr,
                           Y_BF16: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_R: tl.constexpr,
                           INTERPRET: tl.constexpr, UNROLL: tl.constexpr, BM: tl.constexpr, T: tl.constexpr):
    # With UNROLL (N, the model's width, is a compile-time constant) both passes are unrolled and the
    # first is free of stores, so its loads of every 128-wide chunk issue back to back: a decode
    # step's few rows (16 programs at 64 rows) wait for memory once, not once per chunk (12 at width
    # 1536). Unrolled, Triton's compile time grows faster than the width (on sm_90a, 0.9 s at 1536,
    # 28 s at 4096: an 8B model's first step stalled in it), so wider rows loop. The arithmetic and
    # its order are the same either way.
    pm = tl.program_id(0)
    rm = pm * BM + tl.arange(0, BM)
    rk = tl.arange(0, T)
    row_ok = rm < M
    rows = rm.to(tl.int64)[:, None]
    x_at = x_ptr + rows * stride_xm
    d_at = d_ptr + rows * stride_dm
    # unrolled, the second pass loads each chunk two chunks ahead of its use (the first two before the
    # norm's reduction): each chunk's 1x128 amax and stores wait at barriers, which no load crosses,
    # so loading in turn waited on memory once per chunk: 12 L2 round trips in a row at width 1536
    # (a decode step's norm took 8.4 us on the H200, 2026-11-27, at 32 rows as at 512). The same
    # arithmetic on the same values either way.
    NC: tl.constexpr = (N + T - 1) // T
    if UNROLL:
        ahead1 = _norm_in(0, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T)
        ahead2 = _norm_in(1, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T) if NC > 1 else ahead1
    r = _norm_rsqrt(x_at, d_at, rk, row_ok, eps, N, HAS_DELTA, S_BF16, INTERPRET, UNROLL, BM, T)
    if WRITE_R:
        tl.store(r_ptr + rm, r, mask=row_ok)
    # the chunks' scales are kept in one (rows, chunks) tile and stored once at the end: a store of a
    # chunk's (rows,) vector took a layout of its own, a conversion through shared memory and two barriers
    # per chunk (sm_90a: 12 conversions and 23 barriers at width 1536, now 1 and 1)
    NCP: tl.constexpr = triton.next_power_of_2(NC)
    cg = tl.arange(0, NCP)
    scs = tl.zeros((BM, NCP), dtype=tl.float32)
    if UNROLL:
        for kb in tl.static_range(0, NC):
            cur = ahead1
            ahead1 = ahead2
            if kb + 2 < NC:
                ahead2 = _norm_in(kb + 2, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T)
            sc = _norm_chunk(kb, cur, r, s_ptr, y_ptr, q_ptr, rows, rk, row_ok, N, FMAX, FLOOR, POW2, OUT,
                             HAS_DELTA, S_BF16, Y_BF16, WRITE_Y, INTERPRET, T)
            scs = tl.where(cg[None, :] == kb, sc[:, None], scs)
    else:
        for kb in range(0, NC):
            sc = _norm_chunk(kb, _norm_in(kb, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T), r, s_ptr, y_ptr,
                             q_ptr, rows, rk, row_ok, N, FMAX, FLOOR, POW2, OUT, HAS_DELTA, S_BF16, Y_BF16, WRITE_Y,
                             INTERPRET, T)
            scs = tl.where(cg[None, :] == kb, sc[:, None], scs)
    # (chunks, M) scale grid; offsets < numel / 128: int32 is enough
    tl.store(sc_ptr + cg[None, :] * M + rm[:, None], scs, mask=row_ok[:, None] & (cg < NC)[None, :])


# The job tables of the table-driven kernels (one launch for many tensors): one row of int64 fields
# per tensor, and beside it, per program, the row it works on (``_job_table``). Columns of a row of
# the weight quantizer's table; the word transpose's use the first five.
(_J_SRC, _J_DST, _J_S, _J_ST, _J_N, _J_K, _J_SN, _J_DT, _J_GK, _J_L4, _J_PAD, _J_LT4, _J_PAD_T, _J_TILE0,
 _J_NT) = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)
_J_COLS = 16


@triton.jit
def _job_row(tab_ptr, jobs_ptr, COLS: tl.constexpr):
    """This program's row of a job table and its tile's index within that job."""
    pid = tl.program_id(0)
    row = tab_ptr + tl.load(jobs_ptr + pid).to(tl.int64) * COLS
    return row, pid - tl.load(row + 13).to(tl.int32)


@triton.jit
def _field(row, col: tl.constexpr, ALIGNED: tl.constexpr):
    """An int64 field of a job's row; with ``ALIGNED`` (the launch's every job has it a multiple of 16)
    written so the compiler knows it (``(v // 16) * 16``, the same value): values read from memory
    carry no divisibility, and without it every load and store of a tile is one element wide (sm_90a:
    254 registers and 3040 instructions per thread for the weight quantizer, against 94 and 776
    when its arguments were specialised). Addresses are fields too, as element offsets from a
    tensor argument (whose alignment Triton specialises): a pointer made from an integer carries
    no alignment whatever the hint."""
    v = tl.load(row + col)
    if ALIGNED:
        v = (v // 16) * 16
    return v


@triton.jit
def _weight_quant_kernel(tab_ptr, jobs_ptr, w_base, q_base, s_base, st_base, dt_base, FMAX: tl.constexpr,
                         FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, TRANS: tl.constexpr,
                         WT: tl.constexpr, ALIGNED: tl.constexpr, COLS: tl.constexpr, T: tl.constexpr):
    # one 128x128 block of one weight of the table: the weight, its rows of the stacked data and
    # scale buffer, and (``TRANS``) its columns of the W^T scale buffer are at its row's offsets from
    # the base arguments; the weight's rows are contiguous, each ``row + 6`` elements apart. ``WT``: the
    # block's bytes written transposed too, into its columns of W^T's data (rows ``row + 14`` apart)
    row, t = _job_row(tab_ptr, jobs_ptr, COLS)
    w_ptr = w_base + _field(row, 0, ALIGNED)
    q_ptr = q_base + _field(row, 1, ALIGNED)
    s_ptr = s_base + tl.load(row + 2)
    N = tl.load(row + 4).to(tl.int32)
    K = _field(row, 5, ALIGNED).to(tl.int32)
    GK = tl.load(row + 8).to(tl.int32)
    L4 = tl.load(row + 9).to(tl.int32)
    pn = t // GK
    pk = t % GK
    rn = pn * T + tl.arange(0, T)
    rk = pk * T + tl.arange(0, T)
    inb = (rn < N)[:, None] & (rk < K)[None, :]
    x = tl.load(w_ptr + rn.to(tl.int64)[:, None] * _field(row, 6, ALIGNED) + rk[None, :], mask=inb, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    amax = tl.max(tl.max(_abs_bits(x), 1), 0).to(tl.float32, bitcast=True)
    s = _group_scale(amax, FMAX, FLOOR, POW2)
    q = _scaled(x, _divisor(s)).to(OUT)
    pad = tl.arange(0, 4)
    ones = tl.full((4,), 1.0, tl.float32)
    # scales into a buffer with rows L4 apart; the pad entries after a row's GK (1.0) written by
    # the last K tile
    tl.store(s_ptr + pn * L4 + pk, s)
    tl.store(s_ptr + pn * L4 + GK + pad, ones, mask=pad < tl.where(pk == GK - 1, tl.load(row + 10), 0))
    if TRANS:  # W^T's block scale, and the pads after the group's last block column (last job, last row tile)
        st_ptr = st_base + tl.load(row + 3)
        lt4 = tl.load(row + 11).to(tl.int32)
        gn = (N + T - 1) // T
        tl.store(st_ptr + pk * lt4 + pn, s)
        tl.store(st_ptr + pk * lt4 + gn + pad, ones, mask=pad < tl.where(pn == gn - 1, tl.load(row + 12), 0))
    tl.store(q_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :], q, mask=inb)
    if WT:  # N through _field too: a mask whose bound has no known divisibility stores a byte at a time
        dt_ptr = dt_base + _field(row, 7, ALIGNED)
        tl.store(dt_ptr + rk.to(tl.int64)[:, None] * _field(row, 14, ALIGNED) + rn[None, :], tl.trans(q),
                 mask=(rk < K)[:, None] & (rn < _field(row, 4, ALIGNED).to(tl.int32))[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _to_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> bf16, round to nearest even (done on the bits in the interpreter, whose cast truncates
    and flushes subnormals to zero)."""
    if INTERPRET:  # bf16 is the top half of fp32: round the bits, keep the top 16 (NaN: the quiet NaN)
        bits = x.to(tl.int32, bitcast=True)
        top = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        return top.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _kblocks(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, kb0, kb1, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
             stride_sam, stride_sak, stride_sbn, stride_sbk, SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr = False):
    """The fp32 sum over K blocks ``kb0 .. kb1 - 1``, in K order, of each block's ``a @ b.T`` partial
    product scaled by its blocks' scales: rows ``rm`` of a, columns ``rn`` (rows of b).

    ``SWAP`` (a decode step's few rows): each block's product taken as ``b @ a.T``, the weight's rows
    as the MMA's rows -- from 64 of them Hopper's ``wgmma`` on the FP8 bytes themselves, where a 16- or
    32-row tile of a is ``mma.sync`` on f16 converted from FP8 -- then transposed back. The same
    products and scales, each block's product scaled as ``(part * sa) * sb``; only the MMA's order of
    sums within a block differs, as another tile shape's does."""
    rk = tl.arange(0, BLOCK_K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k = kb * BLOCK_K + rk
        sa = tl.load(sa_ptr + (rm // SA_ROWS) * stride_sam + kb * stride_sak, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + (rn // SB_ROWS) * stride_sbn + kb * stride_sbk, mask=rn < N, other=0.0)
        if SWAP:
            b = tl.load(b_ptr + rn.to(tl.int64)[:, None] * stride_bn + k[None, :] * stride_bk,
                        mask=(rn < N)[:, None] & (k < K)[None, :], other=0.0)
            a = tl.load(a_ptr + k[:, None] * stride_ak + rm.to(tl.int64)[None, :] * stride_am,  # K-major a^T
                        mask=(k < K)[:, None] & (rm < M)[None, :], other=0.0)
            acc += tl.dot(b, a, out_dtype=tl.float32) * sa[None, :] * sb[:, None]
        else:
            a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * stride_am + k[None, :] * stride_ak,
                        mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
            b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,  # (BLOCK_K, BLOCK_N): K-major B
                        mask=(k < K)[:, None] & (rn < N)[None, :], other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]  # each 128-wide block scaled
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _blockwise_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                         stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_sam, stride_sak, stride_sbn, stride_sbk,
                         SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of ``a @ b.T``: fp8 x fp8 -> fp32 per 128-wide K block, each
    block's partial product scaled and added in K order (no split-K here; ``kernels.invariant``'s
    batch-invariant GEMM follows this math in chunks of K fixed per weight, ``_fp8_mm_kernel``)."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _kblocks(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, 0, tl.cdiv(K, BLOCK_K), M, N, K, stride_am, stride_ak,
                   stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn, stride_sbk, SA_ROWS, SB_ROWS,
                   BLOCK_M, BLOCK_N, BLOCK_K, SWAP)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = _to_bf16(acc, INTERPRET) if OUT_BF16 else acc
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn, out,
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _blockwise_mm_split_kernel(a_ptr, b_ptr, p_ptr, sa_ptr, sb_ptr, c_ptr, bias_ptr, cnt_ptr, M, N, K, KB_SPLIT, S,
                               stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn,
                               stride_sbk, SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, FUSED: tl.constexpr,
                               HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               SWAP: tl.constexpr):
    """Split-K: program (m, n, s) sums K blocks ``s * KB_SPLIT ..`` (``_kblocks``, K order) into its
    fp32 partial ``p[s]`` (S x M x N, contiguous); ``_split_sum_kernel`` adds the partials, or with
    ``FUSED`` the tile's last program to finish does (``_last_sums``)."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    kb0 = ps * KB_SPLIT
    acc = _kblocks(a_ptr, b_ptr, sa_ptr, sb_ptr, rm, rn, kb0, tl.minimum(kb0 + KB_SPLIT, tl.cdiv(K, BLOCK_K)), M, N,
                   K, stride_am, stride_ak, stride_bn, stride_bk, stride_sam, stride_sak, stride_sbn, stride_sbk,
                   SA_ROWS, SB_ROWS, BLOCK_M, BLOCK_N, BLOCK_K, SWAP)
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    at = rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(p_ptr + ps.to(tl.int64) * M * N + at, acc, mask=ok)
    if FUSED:
        _last_sums(p_ptr, c_ptr, bias_ptr, cnt_ptr + pm * tl.num_programs(1) + pn, at, rn, ok, M, N, S, HAS_BIAS,
                   OUT_BF16, INTERPRET)


@triton.jit
def _last_sums(p_ptr, c_ptr, bias_ptr, cnt_at, at, rn, ok, M, N, S, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
               INTERPRET: tl.constexpr):
    """The fused split-K's sum: each program of a tile counts its arrival (after its partial is
    stored: a barrier, then a release); the last to arrive reads the S partials back from L2
    (acquire) and adds them as ``_split_sum_kernel`` does -- p[0] + p[1] + ... in that order, then
    the bias, rounded once -- and zeroes the tile's counter for the next call. No program waits on
    another, and the result's bits do not depend on which program arrives last."""
    tl.debug_barrier()  # every thread's partial stored before the count
    arrived = tl.atomic_add(cnt_at, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        total = tl.load(p_ptr + at, mask=ok, other=0.0, cache_modifier=".cg")
        for s in range(1, S):
            total += tl.load(p_ptr + s * M * N + at, mask=ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + at, _to_bf16(total, INTERPRET) if OUT_BF16 else total, mask=ok)
        tl.atomic_xchg(cnt_at, 0, sem="relaxed", scope="gpu")


@triton.jit
def _split_sum_kernel(p_ptr, c_ptr, bias_ptr, MN, N, S, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
                      INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
    """``c = p[0] + p[1] + ... + p[S-1] (+ bias)`` in that order, in fp32, rounded once to c's dtype:
    one order whatever the launch, so a split-K GEMM is deterministic."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.load(p_ptr + i, mask=ok, other=0.0)
    for s in range(1, S):
        acc += tl.load(p_ptr + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + i, _to_bf16(acc, INTERPRET) if OUT_BF16 else acc, mask=ok)


_TL_FP8 = {Format.FP8_E4M3: tl.float8e4nv, Format.FP8_E5M2: tl.float8e5}
_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


def unsupported(x: torch.Tensor | None, fmt: Format, amax_floor: float) -> str | None:
    """Why these kernels cannot quantize ``x`` as asked (None: only the format and floor), or None."""
    if fmt not in _TL_FP8:
        return f"the Triton quantizers take fp8_e4m3 or fp8_e5m2, not {fmt.value}"
    if x is not None and x.dim() != 2:
        return f"the Triton quantizers take a 2-D tensor, got shape {tuple(x.shape)}"
    if x is not None and x.dtype not in _INPUTS:
        return f"the Triton quantizers take bfloat16, float16 or float32 input, not {x.dtype}"
    if not amax_floor >= fmt.max * MIN_SCALE:  # every scale >= 2^-64: what ``_quotient`` needs
        return f"the Triton quantizers need amax_floor >= {fmt.max * MIN_SCALE:.3g} for {fmt.value}, got {amax_floor}"
    return None


@functools.lru_cache(maxsize=None)
def format_unsupported(fmt: Format, amax_floor: float) -> str | None:
    """``unsupported(None, fmt, amax_floor)``, computed once per (format, floor)."""
    return unsupported(None, fmt, amax_floor)


def _check(x: torch.Tensor, fmt: Format, amax_floor: float, where: str) -> None:
    why = unsupported(x, fmt, amax_floor)
    if why is not None:
        raise ValueError(f"{where}: {why}")


_DUMMIES: dict = {}  # device -> the one-element tensor a kernel gets for an output it does not write


@functools.lru_cache(maxsize=None)
def _spec_1x128(fmt: Format, pow2_scale: bool, amax_floor: float) -> CastSpec:
    """The 1x128 spec of the quantizers' outputs, made once per (format, pow2, floor): a CastSpec is a
    validated frozen dataclass, built at every quantizer call before (host time of the FP8 step)."""
    return CastSpec(fmt, B1x128, pow2_scale, amax_floor)


def _dummy(dev) -> torch.Tensor:
    """A stand-in pointer for the outputs a launch skips (never read or written), one per device: an
    allocation per quantizer call was an aten op of host time each (about 200 per training update of
    the 1.5B shape). Not kept when made inside a CUDA graph capture (its memory is the graph's)."""
    d = _DUMMIES.get(dev)
    if d is None:
        d = torch.empty(1, dtype=torch.float32, device=dev)
        if not gemm.capturing(d.device):
            _DUMMIES[dev] = d
    return d


def _rows_out(m: int, k: int, dt: torch.dtype, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers of a 1x128 operand (m x k): data row-major, scale (m, ceil(k/128)) with strides (1, m)."""
    return (torch.empty((m, k), dtype=dt, device=dev),
            torch.empty((cdiv(k, TILE), m), dtype=torch.float32, device=dev).t())


def _cols_out(k: int, m_pad: int, dt: torch.dtype, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers of a 128x1 copy of an m x k tensor written transposed (the K-major Wgrad operand):
    data (k, m_pad) row-major, scale (k, ceil(m_pad/128)) with strides (1, k)."""
    return (torch.empty((k, m_pad), dtype=dt, device=dev),
            torch.empty((cdiv(m_pad, TILE), k), dtype=torch.float32, device=dev).t())


def quantize_act(x: torch.Tensor, fmt: Format = Format.FP8_E4M3, pow2_scale: bool = False,
                 amax_floor: float = DEFAULT_AMAX_FLOOR, rows: bool = True, cols: bool = True,
                 pad_tokens_to: int = 1) -> tuple[QTensor | None, QTensor | None]:
    """``(rows, cols)`` from one read of ``x`` (T x K); either may be skipped (None).

    - rows: ``quantize(x, 1x128)``: data (T, K) row-major, scale (T, ceil(K/128)) with strides (1, T).
    - cols: ``quantize(x, 128x1).t()``, the K-major Wgrad operand x^T: data (K, T_pad) row-major with
      T_pad = round_up(T, pad_tokens_to) and zeros in columns T.., scale (K, ceil(T_pad/128)) with
      strides (1, K); spec 1x128. Groups made only of padding get the scale of an all-zero group.
    """
    _check(x, fmt, amax_floor, "quantize_act")
    if pad_tokens_to < 1:
        raise ValueError(f"quantize_act: pad_tokens_to must be >= 1, got {pad_tokens_to}")
    m, k = x.shape
    m_pad = round_up(m, pad_tokens_to)
    gk, gm = cdiv(k, TILE), cdiv(m_pad if cols else m, TILE)
    dt, dev = fmt.torch_dtype(), x.device
    qr, sr = _rows_out(m, k, dt, dev) if rows else (None, None)
    qt, st = _cols_out(k, m_pad, dt, dev) if cols else (None, None)
    if (rows or cols) and gm * gk > 0:
        dummy = _dummy(dev)
        launch = launch_config(x, rows and cols)
        pair_as_two = rows and cols and not launch.one_kernel  # the pair: one read of x, or two
        for r, c in ((True, False), (False, True)) if pair_as_two else ((rows, cols),):
            _act_quant_kernel[(cdiv(m_pad if c else m, TILE), gk)](
                x, qr if r else dummy, sr if r else dummy, qt if c else dummy,
                st if c else dummy, m, k, m_pad, x.stride(0), x.stride(1), FMAX=fmt.max, FLOOR=amax_floor,
                POW2=pow2_scale, OUT=_TL_FP8[fmt], ROWS=r, COLS=c, ZERO_PAD=c and m_pad > m, T=TILE,
                num_warps=launch.warps, enable_fp_fusion=FP_FUSION)
    spec = _spec_1x128(fmt, pow2_scale, amax_floor)
    return (QTensor(qr, sr, spec) if rows else None), (QTensor(qt, st, spec) if cols else None)


SWIGLU_ROWS = 32  # rows per program of the SwiGLU quantizer: g, u and h tiles of 32 x 128 fp32 at 4 warps


def swiglu_quantize(gu: torch.Tensor, fmt: Format = Format.FP8_E4M3, pow2_scale: bool = False,
                    amax_floor: float = DEFAULT_AMAX_FLOOR, save: bool = False) -> tuple[QTensor, QTensor | None]:
    """From ONE read of ``gu = [g, u]`` (T x 2I, I a multiple of 128): ``h = silu(g) * u`` computed in
    fp32 and quantized 1x128 (down's Fprop operand; data (T, I), scale (T, I/128) with strides (1, T)),
    and with ``save`` gu's own 1x128 copy (data (T, 2I), scale (T, 2I/128), strides (1, T)): what
    ``quantize(h, 1x128)`` and ``quantize(gu, 1x128)`` give, without h ever written in high precision
    (at 16 x 512 tokens of the 1.5B shape, 0.9 GB of traffic less per layer than three kernels).

    The gu copy is the reference's bit for bit. h is the reference form ``g / (1 + exp(-g)) * u`` with
    an IEEE division, but Triton's ``exp`` is not torch's: h may differ from torch's fp32 SwiGLU in
    its last bits, and so, rarely, an FP8 value of it by one step. So every forward that feeds down
    from gu -- the rollout's and the trainer's -- takes this kernel or none (``precision.linear.
    swiglu_down``), and they agree with each other bit for bit."""
    _check(gu, fmt, amax_floor, "swiglu_quantize")
    m, k2 = gu.shape
    if k2 % (2 * TILE):
        raise ValueError(f"swiglu_quantize: gu's width must be a multiple of {2 * TILE} (two halves of whole "
                         f"128-wide groups), got {k2}")
    i = k2 // 2
    dt, dev = fmt.torch_dtype(), gu.device
    qh, sh = _rows_out(m, i, dt, dev)
    qg, sg = _rows_out(m, k2, dt, dev) if save else (None, None)
    if m and i:
        _swiglu_quant_kernel[(cdiv(m, SWIGLU_ROWS), i // TILE)](
            gu, qh, sh, qg if save else qh, sg if save else sh, m, i, gu.stride(0), gu.stride(1),
            FMAX=fmt.max, FLOOR=amax_floor, POW2=pow2_scale, OUT=_TL_FP8[fmt], SAVE=save, BM=SWIGLU_ROWS, T=TILE,
            num_warps=4, enable_fp_fusion=FP_FUSION)
    spec = _spec_1x128(fmt, pow2_scale, amax_floor)
    return QTensor(qh, sh, spec), (QTensor(qg, sg, spec) if save else None)


def _gu_copy_shape(gu: QTensor, where: str, what: str, dtype: torch.dtype, x: torch.Tensor | None, fmt: Format,
                   amax_floor: float) -> tuple[int, int]:
    """``(T, I)`` of the FP8 1x128 copy of [g, u] (T x 2I) that the SwiGLU backward kernels read, with
    ``dtype`` (named ``what``) bf16 or fp32 and ``x`` (another input, or None) one they take; a
    ValueError naming ``where`` otherwise."""
    if gu.spec.block != B1x128 or gu.data.dim() != 2:
        raise ValueError(f"{where}: takes a 2-D 1x128 copy of [g, u], got {gu.spec.block.name} "
                         f"data of shape {tuple(gu.data.shape)}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{where}: {what} must be bfloat16 or float32, not {dtype}")
    why = unsupported(x, fmt, amax_floor)
    if why is not None:
        raise ValueError(f"{where}: {why}")
    m, k2 = gu.data.shape
    if k2 % (2 * TILE) or gu.data.stride(1) != 1:
        raise ValueError(f"{where}: [g, u] must be {2 * TILE}-aligned halves with unit column stride, "
                         f"got shape {tuple(gu.data.shape)}, strides {gu.data.stride()}")
    return m, k2 // 2


def swiglu_quantize_t(gu: QTensor, gu_dtype: torch.dtype, fmt: Format = Format.FP8_E4M3,
                      pow2_scale: bool = False, amax_floor: float = DEFAULT_AMAX_FLOOR,
                      pad_tokens_to: int = 1) -> QTensor:
    """The backward's twin of ``swiglu_quantize``: from the FP8 1x128 copy of [g, u] (T x 2I), its
    values rounded to ``gu_dtype`` (the forward's [g, u]; bf16 or fp32), ``h = silu(g) * u`` in
    fp32 quantized 128x1 and written transposed: down's Wgrad operand h^T, data (I, T_pad) row-major
    (zeros in columns T..), scale (I, T_pad/128) with strides (1, I), spec 1x128 -- what
    ``quantize_act(h, rows=False)`` gives for that h. h is never written (at 16 x 512 tokens of the
    1.5B shape: 0.29 GB of fp32 h per layer, written and read back)."""
    m, i = _gu_copy_shape(gu, "swiglu_quantize_t", "gu_dtype", gu_dtype, None, fmt, amax_floor)
    m_pad = round_up(m, pad_tokens_to)
    dev = gu.data.device
    qt, st = _cols_out(i, m_pad, fmt.torch_dtype(), dev)
    if m_pad and i:
        launch = swiglu_config(gu.data)
        if not launch.one_kernel:
            _swiglu_grad_split(gu, None, (None, None, None, None, qt, st), m, i, m_pad, fmt, pow2_scale, amax_floor,
                               gu_dtype, launch.warps)
            return QTensor(qt, st, _spec_1x128(fmt, pow2_scale, amax_floor))
        _swiglu_quant_t_kernel[(cdiv(m_pad, TILE), i // TILE)](
            gu.data, gu.scale, qt, st, m, i, m_pad, gu.data.stride(0),
            gu.scale.stride(0), gu.scale.stride(1), FMAX=fmt.max, FLOOR=amax_floor, POW2=pow2_scale, OUT=_TL_FP8[fmt],
            ROUND_BF16=gu_dtype is torch.bfloat16, INTERPRET=_interpreting(), ZERO_PAD=m_pad > m, T=TILE,
            num_warps=launch.warps, enable_fp_fusion=FP_FUSION)
    return QTensor(qt, st, _spec_1x128(fmt, pow2_scale, amax_floor))


def swiglu_grad_quantize(gu: QTensor, gy: torch.Tensor, out_dtype: torch.dtype, fmt: Format = Format.FP8_E4M3,
                         pow2_scale: bool = False, amax_floor: float = DEFAULT_AMAX_FLOOR, rows: bool = True,
                         cols: bool = True, pad_tokens_to: int = 1,
                         h_cols: bool = False) -> tuple[QTensor | None, QTensor | None, QTensor | None]:
    """The gated MLP's input gradient as its GEMMs read it: d[g, u] of ``silu(g) * u`` for the down
    projection's input gradient ``gy`` (T x I), at the values of the FP8 1x128 copy of [g, u] (T x 2I)
    the forward kept, computed in fp32 (``precision.linear._swiglu_grad_fp8``'s math), rounded to
    ``out_dtype`` (bf16 or fp32: the gradient's dtype), and quantized as ``quantize_act`` quantizes
    it -- ``rows`` 1x128 (the gate/up projections' Dgrad operand, T x 2I) and ``cols`` 128x1,
    transposed (their Wgrad operand, 2I x T_pad) -- from one read of the copy and ``gy``: d[g, u] is
    never written (at 16 x 512 tokens of the 1.5B shape, 0.29 GB of bf16 per layer written and read
    back). The quantization is ``quantize_act``'s of those values, bit for bit; the values are the
    reference's but for Triton's ``exp`` (torch's differs in last bits), as in ``swiglu_quantize``.

    Returns ``(rows, cols, h^T)``, each None when not asked for. ``h_cols``: from the same read, the
    down projection's Wgrad operand too, ``swiglu_quantize_t(gu, out_dtype, ...)`` bit for bit (h at
    [g, u] rounded to ``out_dtype``, the forward's dtype of [g, u] and so of its gradient): the
    backward then reads the copy of [g, u] once, not twice (0.15 GB per layer at 16 x 512 tokens of
    the 1.5B shape)."""
    m, i = _gu_copy_shape(gu, "swiglu_grad_quantize", "out_dtype", out_dtype, gy, fmt, amax_floor)
    k2 = 2 * i
    if gy.shape != (m, i):
        raise ValueError(f"swiglu_grad_quantize: gy must be {m} x {i} (tokens x half of [g, u]), "
                         f"got {tuple(gy.shape)}")
    if pad_tokens_to < 1:
        raise ValueError(f"swiglu_grad_quantize: pad_tokens_to must be >= 1, got {pad_tokens_to}")
    m_pad = round_up(m, pad_tokens_to)
    dt, dev = fmt.torch_dtype(), gy.device
    qr, sr = _rows_out(m, k2, dt, dev) if rows else (None, None)
    qt, st = _cols_out(k2, m_pad, dt, dev) if cols else (None, None)
    qh, sh = _cols_out(i, m_pad, dt, dev) if h_cols else (None, None)
    if (rows or cols or h_cols) and m_pad and i:
        dummy = _dummy(dev)
        launch = swiglu_config(gy)
        if not launch.one_kernel:
            _swiglu_grad_split(gu, gy, (qr, sr, qt, st, qh, sh), m, i, m_pad, fmt, pow2_scale, amax_floor,
                               out_dtype, launch.warps)
            spec = _spec_1x128(fmt, pow2_scale, amax_floor)
            return tuple(QTensor(q, sc, spec) if q is not None else None for q, sc in ((qr, sr), (qt, st), (qh, sh)))
        outs = (qr, sr, qt, st, qh, sh)
        _swiglu_grad_quant_kernel[(3 if h_cols else 2, i // TILE, cdiv(m_pad if cols or h_cols else m, TILE))](
            gu.data, gu.scale, gy, *(t if t is not None else dummy for t in outs), m, i, m_pad,
            gu.data.stride(0), gu.scale.stride(0), gu.scale.stride(1), gy.stride(0), gy.stride(1), FMAX=fmt.max,
            FLOOR=amax_floor, POW2=pow2_scale, OUT=_TL_FP8[fmt], ROUND_BF16=out_dtype is torch.bfloat16,
            INTERPRET=_interpreting(), ROWS=rows, COLS=cols, ZERO_PAD=m_pad > m, T=TILE,
            num_warps=launch.warps, enable_fp_fusion=FP_FUSION)
    spec = _spec_1x128(fmt, pow2_scale, amax_floor)
    return tuple(QTensor(q, sc, spec) if q is not None else None for q, sc in ((qr, sr), (qt, st), (qh, sh)))


SWIGLU_SPLIT_ROWS = 32  # the split SwiGLU backward: rows per program of its 1x128 kernel (x 128 columns)
SWIGLU_SPLIT_COLS = 32  # ... and columns per program of its 128x1 kernel (x 128 tokens)
# ... loaded 2 to a thread (``_runs``): each thread then holds 8 tokens of 2 columns. Compiled for sm_90a
# (tests/sm90_compile.py, Triton 3.6, 8 warps) 2112 SASS instructions a thread where 16 bytes a thread
# took 3304: 132 per value for d[g], d[u] and h^T against 206 (4 warps 120 against 158); runs of 4 took
# 138, 64-column tiles 122-125 at 219-255 registers
SWIGLU_COLS_RUN = 2


def _swiglu_grad_split(gu: QTensor, gy: torch.Tensor | None, outs: tuple, m: int, i: int, m_pad: int, fmt: Format,
                       pow2_scale: bool, amax_floor: float, dtype: torch.dtype, warps: int) -> None:
    """The SwiGLU backward as two kernels (``Launch.one_kernel`` False): the 1x128 outputs from tiles
    of ``SWIGLU_SPLIT_ROWS`` rows, the 128x1 ones (d[g, u] and h, transposed) from tiles of 128 tokens
    x ``SWIGLU_SPLIT_COLS`` columns. Each program's tile holds few values, so many programs share an
    SM, where the one-kernel form's 128x128 tiles take 127-255 registers per thread and run one program
    per SM; [g, u] and gy are read by both kernels. The same values and bits as the one kernel's
    (tested in the interpreter; compiled, both contract d[g]'s ``1 + g * (1 - sig)`` alike:
    tests/test_kernels_sm90.py): every group lies whole in one program, and each value is the same
    arithmetic."""
    qr, sr, qt, st, qh, sh = outs
    dummy = _dummy(gu.data.device)
    common = dict(FMAX=fmt.max, FLOOR=amax_floor, POW2=pow2_scale, OUT=_TL_FP8[fmt],
                  ROUND_BF16=dtype is torch.bfloat16, INTERPRET=_interpreting(), T=TILE, num_warps=warps,
                  enable_fp_fusion=FP_FUSION)
    strides = (gu.data.stride(0), gu.scale.stride(0), gu.scale.stride(1),
               *((gy.stride(0), gy.stride(1)) if gy is not None else (0, 0)))
    if qr is not None and m:
        _swiglu_grad_rows_kernel[(cdiv(m, SWIGLU_SPLIT_ROWS), i // TILE)](
            gu.data, gu.scale, gy, qr, sr, m, i, *strides, BM=SWIGLU_SPLIT_ROWS, **common)
    if qt is not None or qh is not None:
        _swiglu_grad_cols_kernel[(cdiv(m_pad, TILE), i // SWIGLU_SPLIT_COLS)](
            gu.data, gu.scale, gy if gy is not None else dummy, *(t if t is not None else dummy for t in (qt, st, qh, sh)),
            m, i, m_pad, *strides, COLS=qt is not None, H_COLS=qh is not None, ZERO_PAD=m_pad > m,
            BN=SWIGLU_SPLIT_COLS, RUN=SWIGLU_COLS_RUN, **common)


NORM_ROWS = 4  # rows per program of the RMSNorm quantizer (4 x 128 fp32 tiles at 4 warps)
NORM_UNROLL_MAX = 2048  # widest row whose two passes the RMSNorm quantizer unrolls (compile time)
_NORM_DTYPES = (torch.bfloat16, torch.float32)


def norm_outputs(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out_dtype: torch.dtype,
                 write_y: bool, rsqrt: bool, where: str) -> tuple:
    """The RMSNorm quantizers' inputs checked and their outputs s, y, r allocated (each None where not
    asked for), and s's dtype."""
    m, n = x.shape
    for name, t in (("x", x), ("delta", delta)):
        if t is not None and (t.dtype not in _NORM_DTYPES or t.shape != (m, n) or t.stride(1) != 1):
            raise ValueError(f"{where}: {name} must be a bfloat16 or float32 ({m}, {n}) tensor with unit column "
                             f"stride, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if weight.shape != (n,) or out_dtype not in _NORM_DTYPES:
        raise ValueError(f"{where}: weight must be ({n},) and out_dtype bfloat16 or float32, got "
                         f"{tuple(weight.shape)} and {out_dtype}")
    dev = x.device
    s_dtype = x.dtype if delta is None else torch.promote_types(x.dtype, delta.dtype)
    s = torch.empty((m, n), dtype=s_dtype, device=dev) if delta is not None else None
    y = torch.empty((m, n), dtype=out_dtype, device=dev) if write_y else None
    r = torch.empty((m,), dtype=torch.float32, device=dev) if rsqrt else None
    return s, y, r, s_dtype


def rms_norm_quantize(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      out_dtype: torch.dtype, fmt: Format = Format.FP8_E4M3, pow2_scale: bool = False,
                      amax_floor: float = DEFAULT_AMAX_FLOOR, write_y: bool = False,
                      rsqrt: bool = False) -> tuple:
    """A residual add and the RMSNorm after it, with the norm's output quantized 1x128 in the same
    kernel: ``(s, y, r, q)`` for x (T x N) and ``delta`` (T x N, or None: ``s = x``):

    - ``s = x + delta`` in torch's promoted dtype (None without ``delta``);
    - ``y = s * (1 / sqrt(sum(s^2) / N + eps)) * weight`` in fp32, rounded to ``out_dtype`` (bf16 or
      fp32), written only with ``write_y`` (else None: a rollout's forward needs only q);
    - ``r``, the per-row ``1 / sqrt(...)`` (fp32, T) with ``rsqrt`` (a backward's), else None;
    - ``q = quantize(y, 1x128)``: data (T, N) row-major, scale (T, ceil(N/128)) with strides (1, T),
      the next GEMM's Fprop operand, bit for bit the reference quantizer's on this y.

    One program owns ``NORM_ROWS`` whole rows, so a row's result does not depend on the batch; the
    sum of squares is per lane in K order, then one fixed tree, and the square root and division are
    IEEE (the batch-invariant RMSNorm's math), so y may differ from torch's RMSNorm in its last bits.
    Every forward that feeds a GEMM from this norm -- the rollout's and the trainer's -- takes this
    kernel or none (``models.llama.norm_linear``). A rollout's step writes neither y nor r: two
    kernels (norm, quantizer) become one and the norm's output never reaches memory."""
    where = "rms_norm_quantize"
    _check(x, fmt, amax_floor, where)
    m, n = x.shape
    s, y, r, s_dtype = norm_outputs(x, delta, weight, out_dtype, write_y, rsqrt, where)
    dev = x.device
    q, sc = _rows_out(m, n, fmt.torch_dtype(), dev)
    if m and n:
        dummy = q  # never written through: its flag is off
        _rms_norm_quant_kernel[(cdiv(m, NORM_ROWS),)](
            x, x if delta is None else delta, weight.contiguous(), s if s is not None else dummy,
            y if write_y else dummy, r if rsqrt else sc, q, sc, m, float(eps), x.stride(0),
            x.stride(0) if delta is None else delta.stride(0), N=n, FMAX=fmt.max, FLOOR=amax_floor, POW2=pow2_scale,
            OUT=_TL_FP8[fmt], HAS_DELTA=delta is not None, S_BF16=s_dtype is torch.bfloat16,
            Y_BF16=out_dtype is torch.bfloat16, WRITE_Y=write_y, WRITE_R=rsqrt, INTERPRET=_interpreting(),
            UNROLL=n <= NORM_UNROLL_MAX, BM=NORM_ROWS, T=TILE, num_warps=4, enable_fp_fusion=FP_FUSION)
    return s, y, r, QTensor(q, sc, _spec_1x128(fmt, pow2_scale, amax_floor))


def quantize_weight(w: torch.Tensor, fmt: Format = Format.FP8_E4M3, pow2_scale: bool = False,
                    amax_floor: float = DEFAULT_AMAX_FLOOR, transposed: bool = False) -> QTensor | tuple[QTensor, QTensor]:
    """``quantize(w, 128x128)`` for w (N x K); with ``transposed``, ``(that, its transpose)`` from one
    read of w (W^T's bytes and scales copied transposed from W's).

    The QTensor of w: data (N, K) row-major, scale (ceil(N/128), ceil(K/128)) a view into a contiguous
    (ceil(N/128), round_up(ceil(K/128), 4)) buffer whose pad entries are 1.0 (``layouts.scale_buffer``).
    The transpose (Dgrad's operand): data (K, N) row-major, scale (ceil(K/128), ceil(N/128)) a view
    into a (ceil(K/128), round_up(ceil(N/128), 4)) buffer; equal to ``quantize(w, 128x128).t()``.
    (A group of one weight: ``quantize_weight_stack``.)
    """
    q, qt = _weight_stacks([[w]], fmt, pow2_scale, amax_floor, transposed, [None], "quantize_weight")[0]
    return (q, qt) if transposed else q


def quantize_weight_stack(ws: Sequence[torch.Tensor], fmt: Format = Format.FP8_E4M3, pow2_scale: bool = False,
                          amax_floor: float = DEFAULT_AMAX_FLOOR, transposed: bool = False,
                          held: tuple[QTensor, QTensor | None] | None = None) -> tuple[QTensor, QTensor | None]:
    """The weights of a linear group (each W_i N_i x K; every N_i but the last a multiple of 128)
    quantized 128x128 as ``quantize_weight`` does, each written where it lies in the group's
    operands: W stacked along N (sum N_i x K: the Fprop operand), and with ``transposed`` the W_i^T
    side by side (K x sum N_i: the group's Dgrad operand). Bit for bit the concatenation of the
    layers' own ``quantize_weight`` results, in the GEMM layout, from one read of each weight and no
    concatenation (which read and wrote both FP8 copies again: 3.4 GB per update of the Qwen2.5-1.5B
    shape's q/k/v and gate/up). ``held``: a previous result of the same shapes, written in place
    (its addresses kept); else new buffers. ``(W, W^T or None)``. (Many groups in one launch:
    ``quantize_weight_stacks``.)"""
    return _weight_stacks([ws], fmt, pow2_scale, amax_floor, transposed, [held], "quantize_weight_stack")[0]


def quantize_weight_stacks(groups: Sequence[Sequence[torch.Tensor]], fmt: Format = Format.FP8_E4M3,
                           pow2_scale: bool = False, amax_floor: float = DEFAULT_AMAX_FLOOR, transposed: bool = False,
                           helds: Sequence | None = None) -> list[tuple[QTensor, QTensor | None]]:
    """``quantize_weight_stack`` of each group (``helds``: each group's ``held``), every group's weights
    quantized by one kernel launch (per weight dtype) and, with ``transposed``, every W^T's bytes moved
    by one more (``transpose_bytes_``'s choice; torch's copy is one per group). The same bits as the
    groups one at a time. A training step's weights -- 196 at the Qwen2.5-1.5B shape, 28 layers --
    took 196 quantizer launches, 112 transposes and 224 scale copies and fills, one by one (48 ms of
    an H200 host's time per update, under cProfile): now two launches."""
    return _weight_stacks(groups, fmt, pow2_scale, amax_floor, transposed, helds or [None] * len(groups),
                          "quantize_weight_stacks")


def _weight_stacks(groups, fmt: Format, pow2_scale: bool, amax_floor: float, transposed: bool, helds,
                   where: str) -> list[tuple[QTensor, QTensor | None]]:
    spec = CastSpec(fmt, B128x128, pow2_scale, amax_floor)
    why = format_unsupported(fmt, amax_floor)
    if why is not None:
        raise ValueError(f"{where}: {why}")
    dev = groups[0][0].device if groups and groups[0] else None
    outs, jobs, stacks, shapes = [], {}, [], []
    for ws in groups:
        k, total = ws[0].shape[1], 0
        for w in ws:  # unsupported()'s per-tensor checks, inline: a step quantizes ~200 weights
            if w.dim() != 2 or w.dtype not in _INPUTS:
                _check(w, fmt, amax_floor, where)
            if w.shape[1] != k or total % TILE:
                raise ValueError(f"{where}: weights {[tuple(w.shape) for w in ws]}: each needs the same K, "
                                 f"and every N but the last a multiple of {TILE}")
            if w.device != dev:
                raise ValueError(f"{where}: weights on {w.device} and {dev}: one device")
            total += w.shape[0]
        shapes.append((total, k))
    arena = _Arena(spec, shapes, dev, transposed) if _ONE_BUFFER and not any(h is not None for h in helds) else None
    # W^T by the quantizer only in a compiled variant this device's check (``_wt_exact``) passed in: a launch
    # whose every field is a multiple of 16 (``ALIGNED``), as a model's are, at these warps, format and scales
    in_kernel = transposed and dev is not None and _wt_in_quantizer(
        dev, (launch_config(groups[0][0], False).warps, fmt, pow2_scale, amax_floor))
    for ws, held, (total, k) in zip(groups, helds, shapes):
        wq, wt, s, st = arena.take(total, k) if arena is not None else _stack_outputs(spec, total, k, dev, transposed,
                                                                                        held)
        gk, gtot = -(-k // TILE), -(-total // TILE)
        start, row = 0, None
        for w in ws:  # the layer's rows of W and s, its columns of W^T's scales
            n = w.shape[0]
            g0 = start // TILE
            if n * k:
                if w.stride(1) != 1 and k > 1:
                    w = w.contiguous()  # the kernel reads rows of consecutive elements
                row = [0] * _J_COLS
                row[_J_N], row[_J_K], row[_J_SN], row[_J_GK], row[_J_L4] = n, k, w.stride(0), gk, s.stride(0)
                row[_J_PAD] = s.shape[1] - gk
                if transposed:
                    row[_J_LT4], row[_J_NT] = st.stride(0), total
                at = (w, wq.data[start:], s[g0:], st[:, g0:] if transposed else None,
                      wt.data[:, start:] if in_kernel else None)
                jobs.setdefault(w.dtype, []).append((row, at))
            start += n
        if transposed and row is not None:  # the group's last block column writes W^T's scale pads
            row[_J_PAD_T] = st.shape[1] - gtot
        if transposed:
            if gtot * gk == 0:  # no block to write W^T's scale pads
                st[:, gtot:] = 1.0
            stacks.append((wt.data.view(torch.uint8), wq.data.view(torch.uint8)))
        outs.append((wq, wt))
    launches = []
    for parts in jobs.values():
        rows = [row for row, _ in parts]
        bases = _offsets(rows, [at for _, at in parts], (_J_SRC, _J_DST, _J_S, _J_ST, _J_DT))
        aligned = _aligned(rows, (_J_SRC, _J_DST, _J_K, _J_SN), bases[:2])
        in_kernel = in_kernel and aligned and _aligned(rows, (_J_DT, _J_NT, _J_N), bases[4:])
        launches.append((rows, bases, aligned))
    if launches:
        warps = launch_config(groups[0][0], False).warps
        for rows, bases, aligned in launches:
            tab, which = _job_table(rows, [-(-r[_J_N] // TILE) * r[_J_GK] for r in rows], dev, where)
            _weight_quant_kernel[(which.numel(),)](
                tab, which, *bases, FMAX=fmt.max, FLOOR=amax_floor, POW2=pow2_scale, OUT=_TL_FP8[fmt],
                TRANS=transposed, WT=in_kernel, ALIGNED=aligned, COLS=_J_COLS, T=TILE, num_warps=warps,
                enable_fp_fusion=FP_FUSION)
    if stacks and not in_kernel:  # each group's W^T is its stack's transpose: the bytes copied after
        # the quantizer (``transpose_many_``), or (``_wt_in_quantizer``) written by it. Its block scales
        # the quantizer writes either way: a scalar store each, no tile transposed.
        transpose_many_(stacks)
    return outs


# W^T's bytes, Dgrad's operand: copied after the weight quantizer by a byte transpose (``transpose_many_``:
# on the H200 its kernel moved 2.6 GB in 5.0 ms of a 1.5B update, 0.13x of a copy, whatever its tile
# order), or written by the quantizer itself from the tile it holds (``WT``: one more 1-byte store per
# element through shared memory, as the activation quantizer's 128x1 copy is written, 0.57x of a copy
# there). An early version wrote W^T in the quantizer and got garbage bytes on sm_90 with Triton 3.6,
# as the activation quantizer's transposed stores did while ``_scaled`` clamped with
# ``tl.clamp(propagate_nan=ALL)`` (triton-lang/triton#11111; the clamp is gone); whether that was the
# cause here the byte check below settles: on a GPU the first transposed weight quantization checks the
# quantizer's bytes (``_wt_exact``) and, only where they are exact, times both ways on a TIMING_SHAPE fp32
# weight (``_choose_wt``). On an H200 on 2026-11-28 they were not (two rows of W^T wrong, in a test's
# unaligned launch), after a check on fresh outputs had let them through: the check now fills the outputs
# first, and the quantizer writes W^T only in launches of the variant checked (``ALIGNED``). On 2026-11-29
# the aligned variant was wrong too (3 rows of W^T in 8, at every warp count) in each of 17 fresh processes
# on an H200, and exact in one bench process's check: each compiled variant is now checked in the process
# that launches it (``_wt_in_quantizer``). On CPU: after.
WT_OP = "fp8 weight W^T"
WT_WAYS = ("after", "quantizer")
_WT_FORCED: str | None = None  # one of WT_WAYS while set by wt_with


def wt_with(way: str):
    """Write W^T's bytes ``way`` (``WT_WAYS``: "after": transposed after the quantizer; "quantizer": by
    the quantizer) instead of the device's timed choice (tests, ``jetrl bench``)."""
    return _forcing("wt_with", "_WT_FORCED", way, WT_WAYS)


def _wt_in_quantizer(dev: torch.device, variant: tuple | None = None) -> bool:
    """Whether W^T's bytes are written by the weight quantizer: where forced (``wt_with``); else on a GPU
    whose timed choice is the quantizer's (``_choose_wt``), in a launch ``variant`` (warps, format, pow2
    scales, amax floor: what compiles another kernel) whose bytes ``_wt_exact`` found exact in this
    process, checked at its first use (not during a CUDA graph capture: then after). On an H200 (Triton
    3.6, 2026-11-29) the quantizer's W^T was wrong in 37% of its bytes, at 4, 8 and 16 warps, in every one
    of 17 fresh processes, yet exact in the check of one bench process (which then chose it): why is not
    known, so each compiled variant is checked in the process that launches it."""
    way = _WT_FORCED
    if way is not None:
        return way == "quantizer"
    if dev.type != "cuda" or (gemm.kernel_choice(WT_OP, dev) or _choose_wt(dev))["kernel"] != "quantizer":
        return False
    if variant is None:
        return True
    key = (str(dev), *variant)
    exact = _WT_CHECKED.get(key)
    if exact is None:
        if gemm.capturing(dev):
            return False
        warps, fmt, pow2_scale, amax_floor = variant
        with tile_warps(warps):
            exact = _WT_CHECKED[key] = _wt_exact(dev, fmt, pow2_scale, amax_floor)
    return exact


_WT_CHECKED: dict = {}  # (device, warps, format, pow2 scales, amax floor) -> the quantizer's W^T there exact


def _choose_wt(device: torch.device) -> dict:
    """Time ``quantize_weight(w, transposed=True)`` of a TIMING_SHAPE fp32 weight with W^T written each of
    ``WT_WAYS`` on ``device`` and record the faster with ``note_kernel``; the quantizer's way is a
    candidate only where ``_wt_exact`` finds every byte it writes equal to the other's. During a graph
    capture: after, unrecorded."""
    if gemm.capturing(device):
        return {"kernel": "after"}
    global _WT_FORCED
    g = torch.Generator().manual_seed(0)
    m, k = TIMING_SHAPE
    w = torch.randn(m, k, generator=g).to(device)
    before = _WT_FORCED
    try:
        if not _wt_exact(device):
            return gemm.note_kernel(WT_OP, device, "after", "the quantizer's W^T bytes differ from the transpose's")
        t = {}
        for way in WT_WAYS:
            _WT_FORCED = way
            t[way] = gemm.device_time_ms(lambda: quantize_weight(w, transposed=True), device)
    except Exception as e:  # noqa: BLE001 - nothing timed: after, said why
        return gemm.note_kernel(WT_OP, device, "after", _untimed(e))
    finally:
        _WT_FORCED = before
    best = min(t, key=t.get)
    why = f"timed on a {m} x {k} fp32 weight: " + ", ".join(f"{way} {ms:.3f} ms" for way, ms in t.items())
    return gemm.note_kernel(WT_OP, device, best, why, timings_ms=t)


WT_CHECK_FILLS = (0x00, 0xFF, 0x5A)  # bytes the outputs hold before the quantizer's way writes them


def _wt_exact(device: torch.device, fmt: Format = Format.FP8_E4M3, pow2_scale: bool = False,
              amax_floor: float = DEFAULT_AMAX_FLOOR) -> bool:
    """Whether W^T written by the quantizer equals, bytes and scales (pads included), W^T transposed after
    it, in the one compiled variant that writes it (``ALIGNED``: every field a multiple of 16, as a
    model's are; other launches transpose after), on a stack of two weights, the second 144 rows (a
    partial block of rows) with a NaN block, and on a weight of 160 x 208 (partial blocks of rows and of
    columns): into outputs filled beforehand with each of ``WT_CHECK_FILLS`` (a byte it leaves
    unwritten cannot equal the transpose's under them all, whatever the allocator hands out), and into
    one buffer (``stacks_in_one_buffer``, a graphed step's). On an H200 (Triton 3.6) the quantizer's W^T
    once passed a check on fresh outputs of the first stack without the NaN, and then wrote wrong bytes
    in two rows of W^T in a test's run of it with one, launched beside a weight 130 columns wide (so
    the unaligned variant, which no launch runs since). On 2026-11-29 the aligned one was wrong in
    fresh processes there (rows 0, 1, 4, 5, 8, 9 of every 16 of W^T) and exact in one bench process:
    this check, at ``fmt``, ``pow2_scale`` and ``amax_floor`` and the launch's warps, settles it for the
    kernel a process compiled."""
    global _WT_FORCED, _ONE_BUFFER
    g = torch.Generator().manual_seed(0)
    stacks = [[(torch.randn(256, 384, generator=g) * 0.02).to(device), torch.randn(144, 384, generator=g).to(device)],
              [torch.randn(160, 208, generator=g).to(device)]]
    stacks[0][1][3, 7] = float("nan")
    before, one_buffer = _WT_FORCED, _ONE_BUFFER
    how = {"fmt": fmt, "pow2_scale": pow2_scale, "amax_floor": amax_floor, "transposed": True}
    try:
        for stack in stacks:
            _WT_FORCED, _ONE_BUFFER = "after", False
            want = quantize_weight_stack(stack, **how)
            held = quantize_weight_stack(stack, **how)  # the same layout, to be overwritten
            _WT_FORCED = "quantizer"
            for fill in WT_CHECK_FILLS:
                for q in held:
                    q.data.view(torch.uint8).fill_(fill)
                    scale_buffer(q).view(torch.uint8).fill_(fill)
                if not _same_operands(want, quantize_weight_stack(stack, held=held, **how)):
                    return False
            _ONE_BUFFER = True
            if not _same_operands(want, quantize_weight_stacks([stack], **how)[0]):
                return False
        return True
    finally:
        _WT_FORCED, _ONE_BUFFER = before, one_buffer


def _same_operands(a: tuple[QTensor, QTensor], b: tuple[QTensor, QTensor]) -> bool:
    """Whether two ``(W, W^T)`` results hold the same bytes and scale buffers (pads and NaNs included)."""
    return all(torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8))
               and torch.equal(scale_buffer(x).view(torch.int32), scale_buffer(y).view(torch.int32))
               for x, y in zip(a, b))


_ONE_BUFFER = False  # within ``stacks_in_one_buffer``


@contextlib.contextmanager
def stacks_in_one_buffer():
    """Within: ``quantize_weight_stacks`` writes all its groups' operands into one new buffer per kind (W's
    data, W^T's, and their scales), each group's at a fixed offset, instead of one allocation each (when
    no group gives operands to write into). Its launches' job tables hold the tensors' offsets from the
    first group's, which then depend on the groups' shapes alone, not on where the allocator put them:
    a CUDA graph capture (``rl.train_graphs``) finds the table its eager warm-up copied to the device
    (a capture cannot copy one from the host). The buffer lives until every group's operands are gone."""
    global _ONE_BUFFER
    before, _ONE_BUFFER = _ONE_BUFFER, True
    try:
        yield
    finally:
        _ONE_BUFFER = before


class _Arena:
    """``stacks_in_one_buffer``'s buffers for groups of ``shapes`` ((N, K) each), handed out in order."""

    def __init__(self, spec: CastSpec, shapes, dev, transposed: bool):
        self.spec, self.transposed = spec, transposed
        sizes = [self._sizes(total, k) for total, k in shapes]
        dt = spec.format.torch_dtype()
        self.data = torch.empty(sum(d for d, _, _ in sizes) * (2 if transposed else 1), dtype=dt, device=dev)
        self.scales = torch.empty(sum(a + (b if transposed else 0) for _, a, b in sizes), dtype=torch.float32,
                                  device=dev)
        self.at = self.s_at = 0

    @staticmethod
    def _sizes(total: int, k: int) -> tuple[int, int, int]:
        gk, gtot = -(-k // TILE), -(-total // TILE)  # W's data (16-byte multiples), W's and W^T's scales
        return round_up(total * k, 16), gtot * round_up(gk, 4), gk * round_up(gtot, 4)

    def _cut(self, n: int, shape: tuple) -> torch.Tensor:
        t = self.data[self.at:self.at + shape[0] * shape[1]].view(shape)
        self.at += n
        return t

    def _cut_scale(self, rows: int, cols: int) -> torch.Tensor:
        t = self.scales[self.s_at:self.s_at + rows * cols].view(rows, cols)
        self.s_at += rows * cols
        return t

    def take(self, total: int, k: int) -> tuple:
        """``_stack_outputs``' four results for a group of ``total`` x ``k``, in this buffer."""
        n, _, _ = self._sizes(total, k)
        gk, gtot = -(-k // TILE), -(-total // TILE)
        s = self._cut_scale(gtot, round_up(gk, 4))
        wq = QTensor(self._cut(n, (total, k)), s[:, :gk], self.spec)
        if not self.transposed:
            return wq, None, s, None
        st = self._cut_scale(gk, round_up(gtot, 4))
        return wq, QTensor(self._cut(n, (k, total)), st[:, :gtot], self.spec), s, st


def _stack_outputs(spec: CastSpec, total: int, k: int, dev, transposed: bool, held) -> tuple:
    """A group's W (total x k) and W^T operands and their scale buffers: ``held`` where it has their
    shapes, spec and layout, else new buffers."""
    gk, gtot = -(-k // TILE), -(-total // TILE)

    def fits(op, shape) -> bool:  # a held operand to write into: the shape, spec and layout we make
        return (isinstance(op, QTensor) and op.spec == spec and op.data.shape == shape and op.data.device == dev
                and op.data.is_contiguous() and op.scale.stride() == (padded_groups(shape[1]), 1))

    if held is not None and fits(held[0], (total, k)) and (fits(held[1], (k, total)) if transposed else held[1] is None):
        return held[0], held[1], scale_buffer(held[0]), scale_buffer(held[1]) if transposed else None
    dt = spec.format.torch_dtype()
    s = torch.empty((gtot, round_up(gk, 4)), dtype=torch.float32, device=dev)
    wq = QTensor(torch.empty((total, k), dtype=dt, device=dev), s[:, :gk], spec)
    if not transposed:
        return wq, None, s, None
    st = torch.empty((gk, round_up(gtot, 4)), dtype=torch.float32, device=dev)
    return wq, QTensor(torch.empty((k, total), dtype=dt, device=dev), st[:, :gtot], spec), s, st


def _offsets(rows: list[list[int]], tensors: list[tuple], cols: tuple[int, ...]) -> list[torch.Tensor]:
    """Fields ``cols`` of each job's row: its tensors' (``tensors``, one tuple per row, in ``cols``'
    order) addresses as element offsets from the first row's, which are returned as the kernel's
    base arguments (a missing tensor: offset 0 from the first, or from a stand-in)."""
    bases = [t if t is not None else _dummy(tensors[0][0].device) for t in tensors[0]]
    for row, ts in zip(rows, tensors):
        for c, t, b in zip(cols, ts, bases):
            if t is not None:
                d = t.data_ptr() - b.data_ptr()
                if d % t.element_size():
                    raise ValueError(f"{t.dtype} tensors {d} bytes apart: not a whole number of elements")
                row[c] = d // t.element_size()
    return bases


def _aligned(rows: list[list[int]], cols: tuple[int, ...], bases: Sequence[torch.Tensor]) -> bool:
    """Whether fields ``cols`` of every job are multiples of 16 (offsets in elements, sizes and strides)
    and the ``bases`` 16-byte aligned: the kernel's ``ALIGNED``, under which its loads and stores are
    vectors."""
    for b in bases:
        if b.data_ptr() % 16:
            return False
    for row in rows:
        for c in cols:
            if row[c] % 16:
                return False
    return True


_JOB_MAPS: collections.OrderedDict = collections.OrderedDict()  # (device, tiles per job) -> program -> job


def _stream_capturing(dev) -> bool:
    """Whether ``dev``'s current stream is capturing a CUDA graph; False where no stream can be asked
    (no driver: nothing is captured)."""
    try:
        return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001
        return False


def _job_table(rows: list[list[int]], tiles: list[int], dev, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A table-driven launch's inputs on ``dev``: the jobs' rows (int64, ``_J_COLS`` fields, each row's
    first tile filled in here) and, per program, its job (int32; one program per tile, jobs in
    order). Both are kept on the device by their contents (a few of each): the program map depends
    on the jobs' tile counts alone, and the table on the tensors' offsets and sizes, which a
    training step's weights repeat (the caching allocator hands the same blocks back), so a step
    copies nothing to the device. A new one is copied from pinned memory, without waiting -- not
    inside a CUDA graph capture, which would record the copy from a host buffer that is not kept."""
    first = 0
    for row, n in zip(rows, tiles):
        row[_J_TILE0] = first
        first += n
    which = _kept(_JOB_MAPS, (str(dev), tuple(tiles)), dev, where, lambda: torch.repeat_interleave(
        torch.arange(len(tiles), dtype=torch.int32), torch.tensor(tiles)))
    tab = _kept(_JOB_TABLES, (str(dev), tuple(itertools.chain.from_iterable(rows))), dev, where,
                lambda: torch.tensor(rows, dtype=torch.int64))
    return tab, which


_JOB_TABLES: collections.OrderedDict = collections.OrderedDict()  # (device, rows' fields) -> the table there
_KEPT = 32  # device tensors kept per cache


_CAPTURED_TABLES: dict = {}  # (id(cache), key) -> a table a CUDA graph's launch reads: never freed


def _kept(cache: collections.OrderedDict, key: tuple, dev, where: str, make) -> torch.Tensor:
    """``cache[key]``, else ``make()`` (a host tensor) copied to ``dev`` and kept (the ``_KEPT`` most
    recent). One taken during a CUDA graph capture is also kept for good (``_CAPTURED_TABLES``): every
    replay of the graph reads it where it was, whatever the cache drops since."""
    t = cache.get(key)
    if t is not None:
        cache.move_to_end(key)
        if _stream_capturing(dev):
            _CAPTURED_TABLES[(id(cache), key)] = t
        return t
    if _stream_capturing(dev):
        raise RuntimeError(f"{where}: a new job table is copied from the host, which a CUDA graph capture "
                           "would record from a buffer that is not kept: run it once before capturing")
    t = cache[key] = _to_device(make(), dev)
    if len(cache) > _KEPT:
        cache.popitem(last=False)
    return t


def _to_device(t: torch.Tensor, dev) -> torch.Tensor:
    """A host tensor on ``dev``; to a GPU from pinned memory, without waiting for the work queued there
    (torch's caching host allocator keeps the pinned block until the copy has run)."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


@triton.jit
def _transpose_words_kernel(tab_ptr, jobs_ptr, src_base, dst_base, ALIGNED: tl.constexpr, COLS: tl.constexpr,
                            ORDER: tl.constexpr, T: tl.constexpr):
    """One T x T tile of ``dst = src^T`` for bytes, for the table's job (src N x K row-major, dst K x N
    row-major viewed as int32 K x N/4, N a multiple of 4): four rows of src (4i + j) packed into one
    little-endian word in registers, words transposed -- no byte moves
    through shared memory. ``ORDER`` (``TRANSPOSE_ORDERS``): which tiles neighbouring programs take,
    so which addresses the programs running at once read and write."""
    row, t = _job_row(tab_ptr, jobs_ptr, COLS)
    src_ptr = src_base + _field(row, 0, ALIGNED)
    dst_ptr = dst_base + _field(row, 1, ALIGNED)
    N = _field(row, 4, ALIGNED).to(tl.int32)
    K = _field(row, 5, ALIGNED).to(tl.int32)
    GK = tl.load(row + 8).to(tl.int32)
    if ORDER == 0:  # along src's rows: a band of src rows, written down a band of dst's columns
        pn = t // GK
        pk = t % GK
    else:
        GN = (N + T - 1) // T
        pn = t % GN  # along dst's rows: a band of dst rows, read down a band of src's columns
        pk = t // GN
        if ORDER == 2:  # diagonal: neither band shared by neighbours (a bijection of the tiles)
            pk = (pk + pn) % GK
    r0 = _word_rows(pn, T)
    rk = pk * T + tl.arange(0, T)
    col_ok = rk[None, :] < K
    at = src_ptr + rk[None, :]
    w = tl.load(at + r0.to(tl.int64)[:, None] * K, mask=(r0 < N)[:, None] & col_ok, other=0).to(tl.uint32)
    for j in tl.static_range(1, 4):
        w = w | (tl.load(at + (r0 + j).to(tl.int64)[:, None] * K, mask=(r0 + j < N)[:, None] & col_ok,
                         other=0).to(tl.uint32) << (8 * j))
    tl.store(dst_ptr + rk.to(tl.int64)[:, None] * (N // 4) + (r0 // 4)[None, :], tl.trans(w.to(tl.int32, bitcast=True)),
             mask=(rk < K)[:, None] & (r0 < N)[None, :])


# W^T's ways besides torch's copy: ``_transpose_words_kernel`` with its tiles in each order. On the H200
# the kernel (order 0) moved 2.6 GB in 5.0 ms of a 1.5B update, 0.13x of a copy, for no reason its code
# shows (16-byte loads, whole 128-byte rows stored per warp, 312 instructions a thread); the programs
# running at once then all write one band of dst's columns, rows N bytes apart. Which order is fastest
# is for a GPU to say (``_choose_transpose``).
TRANSPOSE_ORDERS = {"triton": 0, "triton-n-first": 1, "triton-diagonal": 2}
TRANSPOSE_WAYS = (*TRANSPOSE_ORDERS, "torch")
_TRANSPOSE_FORCED: str | None = None  # one of TRANSPOSE_WAYS while set by transpose_with


def transpose_with(kind: str):
    """Transpose weight bytes with ``kind`` (``TRANSPOSE_ORDERS``: ``_transpose_words_kernel``, its tiles
    in that order; "torch": a strided copy) instead of the device's timed choice (tests, ``jetrl bench``)."""
    return _forcing("transpose_with", "_TRANSPOSE_FORCED", kind, TRANSPOSE_WAYS)


@contextlib.contextmanager
def _forcing(where: str, name: str, value: str, allowed: Sequence[str]):
    """Within: the module global ``name`` (a timed choice's override) set to ``value``, one of
    ``allowed``; restored after."""
    if value not in allowed:
        raise ValueError(f"{where}: allowed {', '.join(allowed)}, got {value}")
    g = globals()
    old, g[name] = g[name], value
    try:
        yield
    finally:
        g[name] = old


def _transpose_triton(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], order: int = 0) -> None:
    """``dst = src^T`` for every ``(dst, src)`` of ``pairs`` (uint8, src N x K with N a multiple of 4), one
    launch, its tiles in ``order`` (``TRANSPOSE_ORDERS``)."""
    rows, tiles, tensors = [], [], []
    for dst, src in pairs:
        n, k = src.shape
        if n * k:
            row = [0] * _J_COLS
            row[_J_N], row[_J_K], row[_J_GK] = n, k, cdiv(k, TILE)
            rows.append(row)
            tiles.append(cdiv(n, TILE) * cdiv(k, TILE))
            tensors.append((src, dst))
    if rows:
        bases = _offsets(rows, tensors, (_J_SRC, _J_DST))
        aligned = _aligned(rows, (_J_SRC, _J_DST, _J_N, _J_K), bases)
        tab, which = _job_table(rows, tiles, pairs[0][1].device, "transpose_bytes_")
        _transpose_words_kernel[(which.numel(),)](tab, which, *bases, ALIGNED=aligned, COLS=_J_COLS, ORDER=order,
                                                  T=TILE, num_warps=8, enable_fp_fusion=FP_FUSION)


def transpose_bytes_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src.t())`` for contiguous uint8 tensors (src N x K, dst K x N): the weight's FP8
    bytes as Dgrad's W^T, once per optimizer step. torch's strided copy moves a byte per thread (on
    an H200 7.9 ms of a 1.5B-shape update, 28 layers); the Triton kernel moves 32-bit words. On a GPU
    which runs is timed once per device, the kernel only where its bytes equal torch's on a test
    tensor (``_choose_transpose``); on CPU torch's copy."""
    transpose_many_([(dst, src)])


def transpose_many_(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``transpose_bytes_`` of each ``(dst, src)``: those the Triton kernel takes in one launch, the
    rest by torch's copy, one each."""
    kind = _TRANSPOSE_FORCED
    if kind is None:
        kind = "torch"
        src = pairs[0][1] if pairs else None
        if src is not None and src.is_cuda:
            kind = (gemm.kernel_choice(TRANSPOSE_OP, src.device) or _choose_transpose(src.device))["kernel"]
    words = [(d, s) for d, s in pairs if kind in TRANSPOSE_ORDERS and s.shape[0] % 4 == 0]
    if words:
        _transpose_triton([(d.view(torch.int32), s) for d, s in words], TRANSPOSE_ORDERS[kind])
    for dst, src in pairs:
        if not any(d is dst for d, _ in words):
            dst.copy_(src.t())


def _choose_transpose(device: torch.device) -> dict:
    """Time ``transpose_bytes_``'s ways (``TRANSPOSE_WAYS``) on ``device`` (4096 x 4096 bytes) and record
    the fastest with ``note_kernel``; the kernel is a candidate only where its bytes equal torch's copy
    in every order (a compiler that miscompiles its transpose is caught here, not in a training step).
    During a graph capture: torch's copy, unrecorded."""
    if gemm.capturing(device):
        return {"kernel": "torch"}
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, TIMING_SHAPE, generator=g, dtype=torch.uint8).to(device)
    want = src.t().contiguous()
    dst = torch.empty_like(want)
    try:
        for order in TRANSPOSE_ORDERS.values():
            dst.zero_()
            _transpose_triton([(dst.view(torch.int32), src)], order)
            if not torch.equal(dst, want):
                return gemm.note_kernel(TRANSPOSE_OP, device, "torch",
                                        "the Triton transpose's bytes differ from torch's")
        t = {way: gemm.device_time_ms(lambda o=order: _transpose_triton([(dst.view(torch.int32), src)], o), device)
             for way, order in TRANSPOSE_ORDERS.items()}
        t["torch"] = gemm.device_time_ms(lambda: dst.copy_(src.t()), device)
    except Exception as e:  # noqa: BLE001 - nothing timed: torch's copy, said why
        return gemm.note_kernel(TRANSPOSE_OP, device, "torch", _untimed(e))
    best = min(t, key=t.get)
    m, k = TIMING_SHAPE
    why = f"timed on {m} x {k} bytes: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in t.items())
    return gemm.note_kernel(TRANSPOSE_OP, device, best, why, timings_ms=t)


def quantize(x: torch.Tensor, spec: CastSpec) -> QTensor | None:
    """The Triton quantizer for ``spec`` (same values as ``precision.quant.quantize``), or None when
    there is none (the caller uses the reference). A 128x1 result is the natural-layout view (T, K)
    of the x^T that ``quantize_act`` writes: ``.t()`` of it is x^T again, without a copy."""
    if unsupported(x, spec.format, spec.amax_floor) is not None:
        return None
    args = (x, spec.format, spec.pow2_scale, spec.amax_floor)
    if spec.block == B1x128:
        return quantize_act(*args, rows=True, cols=False)[0]
    if spec.block == B128x1:
        xt = quantize_act(*args, rows=False, cols=True)[1]
        return QTensor(xt.data.t(), xt.scale.t(), spec)
    if spec.block == B128x128:
        return quantize_weight(*args)
    return None


def _scale_rows(op: QTensor, where: str) -> int:
    """Rows sharing one scale along K-blocks of 128: 1 (1x128 groups) or 128 (128x128 blocks)."""
    blk = op.spec.block
    if blk.cols != TILE or blk.rows not in (1, TILE):
        raise ValueError(f"{where}: the Triton blockwise GEMM takes 1x128 or 128x128 scales along K, "
                         f"not {blk.name}")
    return blk.rows


DECODE_ROWS = 64  # a GEMM of at most this many rows is a decode step's: it gets decode_tiles


def decode_tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a decode step's GEMM (M <= ``DECODE_ROWS``), FP8 or
    INT8. It reads the whole weight for a few rows, so it is bound by the weight's bytes and by how
    many SMs stream them: the tile is as tall as M (16 rows at least, the smallest MMA), and narrow
    -- 32 columns for N <= 4096, so that a 1.5B model's o_proj and down_proj (N = 1536) run 48
    programs instead of 12 at 128 columns, 64 above -- with a deeper pipeline over K. Untuned
    guesses until ``jetrl bench gemm`` (its decode rows) has been run on a GPU."""
    return max(16, triton.next_power_of_2(m)), 32 if n <= 4096 else 64, 4, 4


def _mm_config(m: int, n: int) -> tuple[int, int, int, int]:
    """The Triton FP8 GEMM's tiles: ``decode_tiles`` for a decode step, 64 x 128 (4 warps, 3 stages)
    for prefill- and training-sized M. On a GPU the tile shape can change the last bits of a result
    (the MMA instruction, and so the order of the sums within a 128-wide K block, differs): a row's
    result may differ between a decode step and the trainer's forward, as with cuBLAS. The
    batch-invariant twin (``kernels.invariant``) pins one configuration for every M."""
    if m <= DECODE_ROWS:
        return decode_tiles(m, n)
    return 64, 128, 4, 3


SPLIT_OP = "decode GEMM split-K"
SPLIT_CHOICES = (1, 2, 4, 8)
SUM_BLOCK = 1024  # outputs per program of the split-K sum
_FORCED_SPLIT: int | None = None  # while set by split_k


@contextlib.contextmanager
def split_k(n: int):
    """Run every Triton FP8 GEMM with its K blocks split ``n`` ways (at most one split per block)
    instead of the device's timed choice for decode steps (tests, ``jetrl bench``)."""
    global _FORCED_SPLIT
    if n < 1:
        raise ValueError(f"split_k: the number of splits must be >= 1, got {n}")
    old, _FORCED_SPLIT = _FORCED_SPLIT, n
    try:
        yield
    finally:
        _FORCED_SPLIT = old


def decode_split(block_m: int, n: int, k: int, device: torch.device, kind: str = "fp8") -> int:
    """How many ways a decode step's ``kind`` GEMM (``"fp8"``: ``blockwise_mm``; ``"int8"``:
    ``kernels.int8.int8_mm``; a ``block_m``-row tile, N x K weight) splits its K blocks.

    A decode step's GEMM runs one program per ``BLOCK_N`` columns: a 1.5B model's o_proj and
    down_proj (N = 1536) are 48 programs on a GPU of 132 SMs, and down_proj's each stream 70 K
    blocks of the weight in turn. Splitting K runs S times the programs, each over a share of the
    blocks, and ``_split_sum_kernel`` adds the S fp32 partials in one fixed order (deterministic;
    the sum's rounding differs from one split's, as another tile shape's would). On a GPU the split
    is timed once per (tile rows, N, K) at the first call (``_choose_split``: 1, 2, 4 or 8) and
    reported with the GEMM backends; during a graph capture, or on CPU, it is 1."""
    return _decode_choice(block_m, n, k, device, kind).get("split", 1)


def _decode_flag(block_m: int, n: int, k: int, device: torch.device, what: str = "fused", kind: str = "fp8") -> bool:
    """Whether ``decode_split``'s choice for this ``kind`` GEMM adds its partials in the last program of
    each tile (``_last_sums``, FP8): timed beside the second kernel, and taken only where its output
    was the same bytes (``_choose_split``); with ``what="swap"``, whether it takes each block's product
    as ``b @ a.T`` (``_kblocks``' ``SWAP``, timed beside the plain tiles). Forced splits (``split_k``)
    keep the two kernels and the plain tiles."""
    return bool(_decode_choice(block_m, n, k, device, kind).get(what))


def _decode_choice(block_m: int, n: int, k: int, device: torch.device, kind: str) -> dict:
    """A decode GEMM's recorded (else now timed) choice: ``split``, ``fused``, ``swap``; ``split_k``'s
    forced split alone; on CPU nothing (one split, the plain tiles)."""
    if _FORCED_SPLIT is not None:
        return {"split": _FORCED_SPLIT}
    if device.type != "cuda":
        return {}
    op = f"{kind} {SPLIT_OP} {block_m} rows, {n} x {k}"
    return gemm.kernel_choice(op, device) or _choose_split(op, kind, block_m, n, k, device)


def gemm_plan(kind: str, m: int, n: int, k: int, device: torch.device, config, tiles=None, split: int | None = None,
              fused: bool | None = None, swap: bool | None = None) -> tuple[tuple[int, int, int, int], int, bool, bool]:
    """``(tiles, split, fused, swap)`` of a Triton ``kind`` GEMM (``blockwise_mm``, ``kernels.int8.int8_mm``)
    of ``m`` rows on an N x K weight, each as asked or else as chosen: 65-512 rows, ``mid_choice``'s
    tiles and split; a decode step's rows (``DECODE_ROWS``, no tiles asked), ``decode_split``'s split
    and, when no split is asked, its last-program sum and ``b @ a.T`` (on ``swap_tiles``); else
    ``config(m, n)``'s tiles, one split."""
    if tiles is None and split is None:
        mid = mid_choice(m, n, k, device, kind)
        if mid is not None:
            tiles, split = tuple(mid["tiles"]), mid["split"]
    plan = tiles or config(m, n)
    if split is None:
        choice = _decode_choice(plan[0], n, k, device, kind) if m <= DECODE_ROWS and tiles is None else {}
        split = choice.get("split", 1)
        fused = choice.get("fused", False) if fused is None else fused
        swap = choice.get("swap", False) if swap is None else swap
    if swap and tiles is None:
        plan = swap_tiles(m)
    return plan, split, bool(fused), bool(swap)


SWAP_N = 64  # a swapped decode tile's weight rows: the smallest M of Hopper's wgmma


def swap_tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a swapped decode GEMM (``blockwise_mm``'s ``swap``):
    the tokens as tall as ``decode_tiles`` makes them (16 at least: the MMA's smallest N here), the
    weight's rows ``SWAP_N`` at a time, one warpgroup. Untuned until timed on a GPU."""
    return max(16, triton.next_power_of_2(m)), SWAP_N, 4, 4


def _fp8_split_run(block_m: int, n: int, k: int, device: torch.device):
    """``blockwise_mm`` at a given split (``fused`` or not, ``swap``-ped or not) on random operands of a
    decode GEMM's shape."""
    g = torch.Generator(device).manual_seed(0)  # drawn on the device: a 7-8B weight's shape is 10^8 values
    a = quantize_act(torch.randn(block_m, k, generator=g, device=device, dtype=torch.bfloat16), cols=False)[0]
    b = quantize_weight(torch.randn(n, k, generator=g, device=device) * 0.05)
    return lambda s, fused=False, swap=False, tiles=None: blockwise_mm(a, b, torch.bfloat16, tiles=tiles, split=s,
                                                                     fused=fused, swap=swap)


SPLIT_RUNS = {"fp8": _fp8_split_run}  # kind -> its timing run's maker (``kernels.int8`` adds "int8")


def _choose_split(op: str, kind: str, block_m: int, n: int, k: int, device: torch.device) -> dict:
    """Time ``decode_split``'s choices for one GEMM shape on ``device`` and record the fastest: each split
    with the plain tiles; FP8's with its partials added by the last program where that gave the second
    kernel's bytes; and each with ``b @ a.T`` where that gave the plain tiles' result (``agrees``). A
    swapped or fused case that fails is left out, said why; the plain tiles' failing, nothing is timed."""
    if gemm.capturing(device):
        return {"split": 1}
    notes = []
    try:
        run = SPLIT_RUNS[kind](block_m, n, k, device)
        ways = sorted({_splits(cdiv(k, TILE), s) for s in SPLIT_CHOICES})
        cases = []
        for swap in (False, True):  # the plain tiles, then b @ a.T
            if swap:
                ok, why = _checked(lambda: agrees(kind, run(1, False, True), run(1)))
                if not ok:
                    why = why or "did not give the plain tiles' result"
                    notes.append(f"b @ a.T {why}: not used")
                    break
            cases += [(s, False, swap) for s in ways]
            if kind == "fp8" and ways[-1] > 1:
                # the last-program sum must give the second kernel's bytes here before it is timed
                ok, why = _checked(lambda: torch.equal(run(ways[-1], True, swap).view(torch.int16),
                                                       run(ways[-1], False, swap).view(torch.int16)))
                if ok:
                    cases += [(s, True, swap) for s in ways if s > 1]
                else:
                    what = "the last-program sum" + (" of b @ a.T" if swap else "")
                    why = why or "was not the two kernels' bytes"
                    notes.append(f"{what} {why}: not used")
        t, left = _timed(cases, lambda c: run(*c) if c[1] or c[2] else run(c[0]), device)
    except Exception as e:  # noqa: BLE001 - nothing timed: no split, said why
        return gemm.note_kernel(op, device, "1 split", _untimed(e), split=1)
    best = min(t, key=t.get)
    why = f"timed on {block_m} x {k} x {n}: " + ", ".join(f"{_split_name(*c)} {ms:.4f} ms" for c, ms in t.items())
    why += "".join(f"; {note}" for note in notes + [f"{_split_name(*c)} {w}" for c, w in left.items()])
    return gemm.note_kernel(op, device, _split_name(*best), why, split=best[0], fused=best[1], swap=best[2],
                            timings_ms={str(c[0]) + ("f" if c[1] else "") + ("s" if c[2] else ""): ms
                                        for c, ms in t.items()})


def _checked(check) -> tuple[bool, str | None]:
    """``(check(), None)``, or ``(False, why)`` where it raises (an optional candidate's check)."""
    try:
        return bool(check()), None
    except Exception as e:  # noqa: BLE001 - this candidate left out, said why
        return False, _untimed(e).replace("not timed", "failed", 1)


def _timed(cases: list, run_case, device: torch.device, check=None) -> tuple[dict, dict]:
    """``({case: device ms}, {case: why left out})`` of ``run_case(case)`` for each of ``cases``: a case
    that fails, or whose output ``check`` rejects, is left out, except the first (the default), whose
    failure is raised."""
    t, left = {}, {}
    for i, c in enumerate(cases):
        try:
            if check is not None and i and not check(run_case(c)):
                left[c] = "not the default's result: not used"
                continue
            t[c] = gemm.device_time_ms(lambda c=c: run_case(c), device)
        except Exception as e:  # noqa: BLE001 - this candidate left out, said why
            if not i:
                raise
            left[c] = _untimed(e)
    return t, left


def _split_name(s: int, fused: bool, swap: bool = False) -> str:
    return (f"{s} {'split' if s == 1 else 'splits'}" + (", summed by the last program" if fused else "")
            + (", b @ a.T" if swap else ""))


def _splits(kblocks: int, asked: int) -> int:
    """The splits a GEMM of ``kblocks`` K blocks runs when ``asked`` for: each split takes
    ``ceil(kblocks / asked)`` blocks (at least one), so there may be fewer than asked."""
    return cdiv(kblocks, cdiv(kblocks, max(1, min(asked, kblocks)))) if kblocks else 1


MID_ROWS = 512  # up to this many rows (past DECODE_ROWS), a GEMM's tiles and split are timed per shape
MID_OP = "GEMM tiles"
# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates, the untimed default first: a rollout's decode step
# of 256 rows on the default 128 x 128 INT8 tiles ran a 1.5B model's q/k/v on 32 programs, o_proj and
# down_proj on 24 (132 SMs on an H200), down_proj's each over 70 K blocks
MID_TILES = {"fp8": ((64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3)),
             "int8": ((128, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 4))}
MID_SPLITS = (1, 2, 4)


def mid_choice(m: int, n: int, k: int, device: torch.device, kind: str = "fp8") -> dict | None:
    """The tiles and split of a ``kind`` GEMM (``"fp8"``: ``blockwise_mm``; ``"int8"``: ``int8_mm``) of
    ``DECODE_ROWS < m <= MID_ROWS`` rows -- a rollout's wide decode step, a short prefill -- or None
    (the default tiles, one split: on CPU, outside those rows, or while ``split_k`` forces a split).
    On a GPU each of ``MID_TILES`` at each of ``MID_SPLITS`` is timed once per (rows rounded up to a
    power of two, N, K) at the first call (``_choose_mid``), the fastest kept and reported with the
    GEMM backends. INT8's bits do not depend on it (exact int32 sums); FP8's, as any tile shape's, may
    differ in the last bits from another row count's."""
    if _FORCED_SPLIT is not None or device.type != "cuda" or not DECODE_ROWS < m <= MID_ROWS:
        return None
    rows = triton.next_power_of_2(m)
    op = f"{kind} {MID_OP} {rows} rows, {n} x {k}"
    return gemm.kernel_choice(op, device) or _choose_mid(op, kind, rows, n, k, device)


def _choose_mid(op: str, kind: str, rows: int, n: int, k: int, device: torch.device) -> dict:
    """Time ``mid_choice``'s candidates for one GEMM shape on ``device`` and record the fastest; during a
    graph capture the default, unrecorded (the engine's eager step before a capture decides)."""
    default = {"tiles": list(MID_TILES[kind][0]), "split": 1}
    if gemm.capturing(device):
        return default
    try:
        run = SPLIT_RUNS[kind](rows, n, k, device)
        ways = sorted({_splits(cdiv(k, TILE), s) for s in MID_SPLITS})
        cases = [(tiles, s) for tiles in MID_TILES[kind] for s in ways]
        # a candidate is timed only where it runs and gives the default's result on this device (a kernel
        # compiled wrong there -- as the weight quantizer's W^T once was on an H200 -- is never taken)
        ref = run(1, tiles=MID_TILES[kind][0])
        t, left = _timed(cases, lambda c: run(c[1], tiles=c[0]), device, check=lambda out: agrees(kind, out, ref))
    except Exception as e:  # noqa: BLE001 - nothing timed: the default, said why
        return gemm.note_kernel(op, device, _mid_name(*default.values()), _untimed(e), **default)
    best = min(t, key=t.get)
    why = f"timed on {rows} x {k} x {n}: " + ", ".join(f"{_mid_name(*c)} {ms:.4f} ms" for c, ms in t.items())
    why += "".join(f"; {_mid_name(*c)} {w}" for c, w in left.items())
    return gemm.note_kernel(op, device, _mid_name(*best), why, tiles=list(best[0]), split=best[1],
                            timings_ms={_mid_name(*c): ms for c, ms in t.items()})


AGREE_TOL = 2.0**-7  # FP8 GEMMs of other tiles or splits: the norm-wise difference of their bf16 outputs


def agrees(kind: str, out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether a GEMM's ``out`` (another tile shape or split of the ``kind`` GEMM that gave ``ref``, both
    bf16) is its result: INT8 bit for bit (exact int32 sums in any order); FP8 NaN and infinity at the
    same places and the rest within ``AGREE_TOL`` of ``ref``'s norm (its sums in another order)."""
    if kind == "int8":
        return torch.equal(out.view(torch.int16), ref.view(torch.int16))
    fin = ref.isfinite()
    if not torch.equal(fin, out.isfinite()) or not torch.equal(out[~fin].isnan(), ref[~fin].isnan()):
        return False
    if not torch.equal(out[~fin & ~ref.isnan()], ref[~fin & ~ref.isnan()]):  # infinities: the same signs
        return False
    o, r = out[fin].float(), ref[fin].float()
    return bool((o - r).norm() <= AGREE_TOL * r.norm())


def _mid_name(tiles, split: int) -> str:
    bm, bn, warps, stages = tiles
    return f"{bm}x{bn} tiles, {warps} warps, {stages} stages, {split} {'split' if split == 1 else 'splits'}"


# The fused split-K's arrival counters (``_last_sums``): one int32 per output tile, per device, zero
# between calls (the last program of a tile zeroes its own). Split GEMMs of one device run one after
# another on its stream (a decode step's), so a call's counters are not shared with another's. Grown
# outside a graph capture only: a capture that would need more tiles takes the two-kernel sum.
_SPLIT_COUNTERS: dict[str, torch.Tensor] = {}


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    key = str(device)
    held = _SPLIT_COUNTERS.get(key)
    if held is None or held.numel() < tiles:
        if device.type == "cuda" and gemm.capturing(device):
            return None
        held = _SPLIT_COUNTERS[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return held


def blockwise_mm(a: QTensor, b: QTensor, out_dtype: torch.dtype = torch.float32,
                 tiles: tuple[int, int, int, int] | None = None, bias: torch.Tensor | None = None,
                 split: int | None = None, fused: bool | None = None, swap: bool | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` (a: M x K, b: N x K, FP8 with 1x128 or 128x128 scales), fp32 accumulation
    per K block; ``bias`` (N values) is added to the fp32 sum before the output is written (rounded
    once, as the emulation adds it). ``tiles``: (BLOCK_M, BLOCK_N, num_warps, num_stages), by default
    chosen from M and N (``_mm_config``). ``split``: the K blocks in that many consecutive runs, each
    summed on its own, the runs' fp32 sums then added in order (by default ``decode_split``'s choice
    for a decode step's GEMM, else 1); ``fused``: the partials added by the last program of each tile
    instead of a second kernel (the same bits; by default ``decode_split``'s timed choice); ``swap``:
    each K block's product taken as ``b @ a.T`` on ``swap_tiles`` (``_kblocks``' ``SWAP``; by default
    ``decode_split``'s timed choice for a decode step that asks for no split, else not; ``tiles`` then
    give its token rows)."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"blockwise_mm: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)} do not match as a @ b.T")
    sa_rows, sb_rows = _scale_rows(a, "operand a"), _scale_rows(b, "operand b")
    m, k = a.data.shape
    n = b.data.shape[0]
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"blockwise_mm writes float32 or bfloat16, not {out_dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype not in _INPUTS or not bias.is_contiguous()):
        raise ValueError(f"blockwise_mm: bias must be a contiguous ({n},) bfloat16, float16 or float32 tensor, "
                         f"got {tuple(bias.shape)} {bias.dtype}")
    dev = a.data.device
    c = torch.empty((m, n), dtype=out_dtype, device=dev)
    (block_m, block_n, warps, stages), split, fused, swap = gemm_plan("fp8", m, n, k, dev, _mm_config, tiles, split,
                                                                      fused, swap)
    kblocks = cdiv(k, TILE)
    splits = _splits(kblocks, split)
    if splits > 1 and m * n:
        part = torch.empty((splits, m, n), dtype=torch.float32, device=dev)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
        counters = _split_counters(dev, grid[0] * grid[1]) if fused else None
        _blockwise_mm_split_kernel[grid](
            a.data, b.data, part, a.scale, b.scale, c, c if bias is None else bias,
            part if counters is None else counters, m, n, k, cdiv(kblocks, splits), splits,
            a.data.stride(0), a.data.stride(1), b.data.stride(0), b.data.stride(1),
            a.scale.stride(0), a.scale.stride(1), b.scale.stride(0), b.scale.stride(1),
            SA_ROWS=sa_rows, SB_ROWS=sb_rows, FUSED=counters is not None, HAS_BIAS=bias is not None,
            OUT_BF16=out_dtype == torch.bfloat16, INTERPRET=_interpreting(), BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=TILE, SWAP=swap, num_warps=warps, num_stages=stages, enable_fp_fusion=FP_FUSION)
        if counters is None:
            _split_sum_kernel[(cdiv(m * n, SUM_BLOCK),)](
                part, c, c if bias is None else bias, m * n, n, splits, HAS_BIAS=bias is not None,
                OUT_BF16=out_dtype == torch.bfloat16, INTERPRET=_interpreting(), BLOCK=SUM_BLOCK, num_warps=4,
                enable_fp_fusion=FP_FUSION)
        return c
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _blockwise_mm_kernel[grid](
        a.data, b.data, c, a.scale, b.scale, c if bias is None else bias, m, n, k,
        a.data.stride(0), a.data.stride(1), b.data.stride(0), b.data.stride(1), c.stride(0), c.stride(1),
        a.scale.stride(0), a.scale.stride(1), b.scale.stride(0), b.scale.stride(1),
        SA_ROWS=sa_rows, SB_ROWS=sb_rows, HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16,
        INTERPRET=_interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=TILE, SWAP=swap, num_warps=warps, num_stages=stages,
        enable_fp_fusion=FP_FUSION)
    return c
