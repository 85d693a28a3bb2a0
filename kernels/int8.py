"""Triton kernels of the INT8 (W8A8) rollout flow, each the twin of a pure-torch reference:

- ``quantize_rows(x)``: ``precision.quant.quantize(x, int8 row)`` -- one scale per row (per token for
  activations, per output channel for weights), ``scale = max(amax, amax_floor) / 127`` (optionally
  rounded up to a power of two; NaN for a row holding a NaN or an infinity), data
  ``round(clamp(x * (1 / scale), -127, 127))``, half to even, NaN -> 0 (the product by the scale's
  correctly rounded reciprocal, rounded once, and no clamp: ``fp8._scaled``). One
  program owns a few rows: a first pass over K finds each row's amax (an integer max over the bits
  of |x|, as in ``fp8.py``), a second quantizes and stores; the second pass reads what the first just
  read, from L2. Both passes are unrolled over K (a compile-time constant).
- ``rms_norm_quantize(x, delta, w, ...)``: ``fp8.rms_norm_quantize``'s residual add and RMSNorm (the
  same s, y and r, bit for bit) with y quantized per row as ``quantize_rows`` quantizes it: an INT8
  rollout's q/k/v and gate/up inputs come from the norm's kernel, one launch where there were two,
  and the norm's output never reaches memory. ``swiglu_quantize(gu)``: the same for the down
  projection's input, h = silu(g) * u as ``fp8.swiglu_quantize`` computes it, quantized per row.
- ``int8_mm(a, b)``: ``a @ b.T`` for INT8 operands with per-row (or per-tensor) scales: int8 x int8
  products summed in int32 (exact, in any order, while K * 127^2 < 2^31), then the scaled-GEMM
  backend's epilogue ``(float(acc) * scale_a) * scale_b`` in fp32, rounded to bf16 or kept fp32 --
  one kernel where ``torch._int_mm`` plus its epilogue is four, and no 17-row minimum. The result is
  bit for bit that of ``backend: scaled_mm`` (``_int_mm``), whatever the tile shape: the int32 sum is
  exact and the epilogue is elementwise. A bias (q/k/v's) is added in the same epilogue, to the
  rounded output, as the separate add after ``_int_mm`` adds it.

Rounding to an integer is ``(y + 1.5 * 2^23) - 1.5 * 2^23`` in fp32: for |y| <= 127 the sum lies in
[2^23, 2^24), where the spacing of fp32 is 1, so the add rounds y to an integer, half to even (what
``torch.round`` does), and the subtraction is exact. It is two additions with no multiply, so no
FMA contraction applies, and no compiler reassociates them without fast-math (the sm_90a compile
check looks for the constant in the PTX). ``libdevice.rint`` would do the same in one instruction,
but Triton's interpreter, where the CPU tests run these kernels, lacks it.

Tile shapes are chosen per call from M (``_mm_config``): small-M decode steps get narrow tiles so that
more programs stream the weight, and may split K over more programs (``fp8.decode_split``, timed per
shape on a GPU: the int32 partials add exactly); none of this changes a result bit. No speed is
claimed here: the kernels run on CPU in Triton's interpreter for the tests, and ``jetrl bench
gemm`` / ``bench rollout`` time them on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.precision.gemm import INT8_K_LIMIT as K_LIMIT
from jetrl_cli.precision.quant import DEFAULT_AMAX_FLOOR, CastSpec, QTensor

from . import fp8
from .fp8 import (DECODE_ROWS, FP_FUSION, MID_ROWS, MIN_SCALE, NORM_ROWS, NORM_UNROLL_MAX, _abs_bits, _divisor,
                  _group_scale, _interpreting, _norm_in, _norm_rsqrt, _norm_y, _norm_y_of, _scaled, _silu_mul, _splits,
                  _to_bf16, decode_tiles)

QMAX = tl.constexpr(127.0)  # Format.INT8.max
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding it rounds |y| <= 2^22 to an integer, half to even
_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _row_quant_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_xk, K: tl.constexpr,
                      FLOOR: tl.constexpr, POW2: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    # both passes unrolled (K is a compile-time constant): the amax pass's loads issue back to back,
    # so a decode step's few rows wait for memory once, not once per BLOCK_K chunk
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rm < M
    x_row = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    amax = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)  # per lane over the chunks, then one reduction a row
    for k0 in tl.static_range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + rk[None, :] * stride_xk, mask=row_ok[:, None] & (rk < K)[None, :], other=0.0)
        amax = tl.maximum(amax, _abs_bits(x.to(tl.float32)))
    s = _group_scale(tl.max(amax, 1).to(tl.float32, bitcast=True), QMAX, FLOOR, POW2)
    tl.store(s_ptr + rm, s, mask=row_ok)
    r = _divisor(s)
    q_row = q_ptr + rm.to(tl.int64)[:, None] * K
    for k0 in tl.static_range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        inb = row_ok[:, None] & (rk < K)[None, :]
        x = tl.load(x_row + rk[None, :] * stride_xk, mask=inb, other=0.0).to(tl.float32)
        tl.store(q_row + rk[None, :], _int8_rows(x, r), mask=inb)


@triton.jit
def _int8_rows(y, r):
    """``y`` (rows x chunk, fp32) times its rows' scales' reciprocals ``r``, rounded to integers half to
    even, NaN -> 0: ``_row_quant_kernel``'s second pass, as int8."""
    n = (_scaled(y, r[:, None]) + ROUND) - ROUND
    return tl.where(n == n, n, 0.0).to(tl.int8)


@triton.jit
def _rms_norm_rows_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, r_ptr, q_ptr, sc_ptr, M, eps, stride_xm, stride_dm,
                          N: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, HAS_DELTA: tl.constexpr,
                          S_BF16: tl.constexpr, Y_BF16: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_R: tl.constexpr,
                          INTERPRET: tl.constexpr, UNROLL: tl.constexpr, BM: tl.constexpr, T: tl.constexpr):
    # ``fp8._rms_norm_quant_kernel``'s norm (the same passes, helpers and order of operations, so the
    # same s, y and r), its output quantized with one scale per row: a second pass finds each row's
    # amax over the whole width (and writes s and y where asked), a third recomputes y and quantizes
    pm = tl.program_id(0)
    rm = pm * BM + tl.arange(0, BM)
    rk = tl.arange(0, T)
    row_ok = rm < M
    rows = rm.to(tl.int64)[:, None]
    x_at = x_ptr + rows * stride_xm
    d_at = d_ptr + rows * stride_dm
    # unrolled, the second and third passes load each chunk two chunks ahead of its use, as the FP8
    # kernel does (``fp8._rms_norm_quant_kernel``): the second pass's barriers (its amax, its stores)
    # would otherwise make each chunk's load wait for the previous chunk. The same arithmetic.
    NC: tl.constexpr = (N + T - 1) // T
    if UNROLL:
        ahead1 = _norm_in(0, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T)
        ahead2 = _norm_in(1, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T) if NC > 1 else ahead1
    r = _norm_rsqrt(x_at, d_at, rk, row_ok, eps, N, HAS_DELTA, S_BF16, INTERPRET, UNROLL, BM, T)
    amax = tl.zeros((BM,), dtype=tl.int32)
    if WRITE_R:
        tl.store(r_ptr + rm, r, mask=row_ok)
    if UNROLL:
        for kb in tl.static_range(0, NC):
            cur = ahead1
            ahead1 = ahead2
            if kb + 2 < NC:
                ahead2 = _norm_in(kb + 2, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T)
            amax = _norm_amax(amax, kb, cur, r, s_ptr, y_ptr, rows, rk, row_ok, N, HAS_DELTA, S_BF16, Y_BF16, WRITE_Y,
                              INTERPRET, T)
        ahead1 = _norm_in(0, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T)  # the third pass's first two
        ahead2 = _norm_in(1, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T) if NC > 1 else ahead1
    else:
        for kb in range(0, NC):
            amax = _norm_amax(amax, kb, _norm_in(kb, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T), r, s_ptr, y_ptr,
                              rows, rk, row_ok, N, HAS_DELTA, S_BF16, Y_BF16, WRITE_Y, INTERPRET, T)
    sc = _group_scale(amax.to(tl.float32, bitcast=True), QMAX, FLOOR, POW2)
    tl.store(sc_ptr + rm, sc, mask=row_ok)
    rr = _divisor(sc)
    if UNROLL:
        for kb in tl.static_range(0, NC):
            cur = ahead1
            ahead1 = ahead2
            if kb + 2 < NC:
                ahead2 = _norm_in(kb + 2, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, T)
            x, d, w = cur
            k, ok, _, y = _norm_y_of(kb, x, d, w, r, rk, row_ok, N, HAS_DELTA, S_BF16, Y_BF16, INTERPRET, T)
            tl.store(q_ptr + rows * N + k[None, :], _int8_rows(y, rr), mask=ok)
    else:
        for kb in range(0, (N + T - 1) // T):
            k, ok, _, y = _norm_y(kb, r, w_ptr, x_at, d_at, rk, row_ok, N, HAS_DELTA, S_BF16, Y_BF16, INTERPRET, T)
            tl.store(q_ptr + rows * N + k[None, :], _int8_rows(y, rr), mask=ok)


@triton.jit
def _norm_amax(amax, kb, inputs, r, s_ptr, y_ptr, rows, rk, row_ok, N: tl.constexpr,
               HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr, Y_BF16: tl.constexpr, WRITE_Y: tl.constexpr,
               INTERPRET: tl.constexpr, T: tl.constexpr):
    """The second pass over chunk ``kb`` (its ``inputs`` loaded by ``fp8._norm_in``): s (with a delta)
    and y (with ``WRITE_Y``) written, and each row's running amax of y (``_abs_bits``' integer max:
    NaN-propagating)."""
    x, d, w = inputs
    k, ok, s, y = _norm_y_of(kb, x, d, w, r, rk, row_ok, N, HAS_DELTA, S_BF16, Y_BF16, INTERPRET, T)
    if HAS_DELTA:
        tl.store(s_ptr + rows * N + k[None, :], s.to(s_ptr.dtype.element_ty), mask=ok)
    if WRITE_Y:
        tl.store(y_ptr + rows * N + k[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)
    return tl.maximum(amax, tl.max(_abs_bits(y), 1))


@triton.jit(do_not_specialize=["M"])
def _swiglu_rows_kernel(gu_ptr, q_ptr, s_ptr, M, stride_m, stride_k, I: tl.constexpr, FLOOR: tl.constexpr,
                        POW2: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    # ``_row_quant_kernel`` of h = silu(g) * u (fp32, ``fp8._silu_mul``: the FP8 SwiGLU quantizer's h),
    # h computed from gu in each pass and never written: the amax pass, then the quantizing one
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rm < M
    at = gu_ptr + rm.to(tl.int64)[:, None] * stride_m
    amax = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)  # per lane over the chunks, then one reduction a row
    for k0 in tl.static_range(0, I, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        h = _h_chunk(at, rk, row_ok, stride_k, I)
        amax = tl.maximum(amax, _abs_bits(h))
    s = _group_scale(tl.max(amax, 1).to(tl.float32, bitcast=True), QMAX, FLOOR, POW2)
    tl.store(s_ptr + rm, s, mask=row_ok)
    r = _divisor(s)
    q_row = q_ptr + rm.to(tl.int64)[:, None] * I
    for k0 in tl.static_range(0, I, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        h = _h_chunk(at, rk, row_ok, stride_k, I)
        tl.store(q_row + rk[None, :], _int8_rows(h, r), mask=row_ok[:, None] & (rk < I)[None, :])


@triton.jit
def _h_chunk(at, rk, row_ok, stride_k, I: tl.constexpr):
    """h = silu(g) * u in fp32 at columns ``rk`` of rows ``at`` of gu = [g, u] (zeros outside)."""
    ok = row_ok[:, None] & (rk < I)[None, :]
    g = tl.load(at + rk[None, :] * stride_k, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(at + (I + rk)[None, :] * stride_k, mask=ok, other=0.0).to(tl.float32)
    return _silu_mul(g, u)


def swiglu_quantize(gu: torch.Tensor, fmt: Format = Format.INT8, pow2_scale: bool = False,
                    amax_floor: float = DEFAULT_AMAX_FLOOR, save: bool = False) -> tuple[QTensor, None]:
    """``kernels.fp8.swiglu_quantize``'s h = silu(g) * u (fp32, the same h bit for bit) for gu = [g, u]
    (T x 2I), quantized INT8 with one scale per row as ``quantize_rows`` would quantize it: down's
    input in an INT8 flow, ``(h's QTensor, None)``, h never written (one kernel where there were two:
    the SwiGLU, which wrote h in fp32, and the row quantizer). ``save`` (gu's own FP8 copy) is the FP8
    kernel's only."""
    where = "swiglu_quantize"
    spec = CastSpec(fmt, Block(1, 0), pow2_scale, amax_floor)
    why = unsupported(gu, spec)
    if why is not None or save:
        raise ValueError(f"{where}: {why or 'keeps no copy of gu (save=True is the FP8 kernel only)'}")
    m, k2 = gu.shape
    if k2 % 2:
        raise ValueError(f"{where}: gu = [g, u] must have an even width, got {k2}")
    i = k2 // 2
    q = torch.empty((m, i), dtype=torch.int8, device=gu.device)
    sc = torch.empty((m, 1), dtype=torch.float32, device=gu.device)
    if m and i:
        one_row = m <= MID_ROWS
        # a decode step's rows one per program: h's exp and division are most of the work, and
        # 4 rows a program left a 32-row step 8 programs for the whole GPU (a wide decode step's 256
        # rows 64 programs of 4 warps, each walking 4 x 8960 values twice); and each of those
        # programs at 16 warps in chunks of up to 4096 (4 warps: one per scheduler, each waiting on
        # its own exp and division; an 8960-wide row was two passes of 9 chunks of 1024). The bits
        # do not depend on it: h is elementwise, its amax a max.
        block_k = min(triton.next_power_of_2(i), 4096 if one_row else 1024)
        rows = 1 if one_row else max(1, min(16, 4096 // block_k))
        _swiglu_rows_kernel[(triton.cdiv(m, rows),)](
            gu, q, sc, m, gu.stride(0), gu.stride(1), I=i, FLOOR=amax_floor, POW2=pow2_scale, ROWS=rows,
            BLOCK_K=block_k, num_warps=16 if one_row else 4, enable_fp_fusion=FP_FUSION)
    return QTensor(q, sc, spec), None


def rms_norm_quantize(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      out_dtype: torch.dtype, fmt: Format = Format.INT8, pow2_scale: bool = False,
                      amax_floor: float = DEFAULT_AMAX_FLOOR, write_y: bool = False, rsqrt: bool = False) -> tuple:
    """``kernels.fp8.rms_norm_quantize`` (the same residual add and RMSNorm, bit for bit its ``s``, ``y``
    and ``r``) with the norm's output quantized INT8 with one scale per row, ``quantize_rows``' bits
    on that y: ``(s, y, r, q)``, q's data (T, N) int8 and scale (T, 1). One kernel where a rollout's
    INT8 step ran two (the norm, then the row quantizer), and the norm's output never reaches memory
    unless ``write_y``."""
    where = "rms_norm_quantize"
    spec = CastSpec(fmt, Block(1, 0), pow2_scale, amax_floor)
    why = unsupported(x, spec)
    if why is not None:
        raise ValueError(f"{where}: {why}")
    m, n = x.shape
    s, y, r, s_dtype = fp8.norm_outputs(x, delta, weight, out_dtype, write_y, rsqrt, where)
    q = torch.empty((m, n), dtype=torch.int8, device=x.device)
    sc = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _rms_norm_rows_kernel[(triton.cdiv(m, NORM_ROWS),)](
            x, x if delta is None else delta, weight.contiguous(), s if s is not None else q, y if write_y else q,
            r if rsqrt else sc, q, sc, m, float(eps), x.stride(0), x.stride(0) if delta is None else delta.stride(0),
            N=n, FLOOR=amax_floor, POW2=pow2_scale, HAS_DELTA=delta is not None, S_BF16=s_dtype is torch.bfloat16,
            Y_BF16=out_dtype is torch.bfloat16, WRITE_Y=write_y, WRITE_R=rsqrt, INTERPRET=_interpreting(),
            UNROLL=n <= NORM_UNROLL_MAX, BM=NORM_ROWS, T=fp8.TILE, num_warps=4, enable_fp_fusion=FP_FUSION)
    return s, y, r, QTensor(q, sc, spec)


@triton.jit(do_not_specialize=["M"])
def _int8_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_sa, stride_sb,
                    OUT_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of ``a @ b.T``: int8 x int8 summed in int32, then scaled."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _int8_kblocks(a_ptr, b_ptr, rm, rn, 0, K, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                        BLOCK_M, BLOCK_N, BLOCK_K, SWAP)
    _int8_epilogue(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, stride_sa, stride_sb,
                   OUT_BF16, HAS_BIAS, INTERPRET)


@triton.jit
def _int8_kblocks(a_ptr, b_ptr, rm, rn, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr = False):
    """The int32 sum of int8 products over K in ``k_lo .. k_hi`` (exact) of rows ``rm`` and columns ``rn``;
    with ``SWAP`` taken as ``b @ a.T`` and transposed back (``fp8._kblocks``': the weight's rows as the
    MMA's; the same exact sums)."""
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + rk
        if SWAP:
            b = tl.load(b_ptr + rn.to(tl.int64)[:, None] * stride_bn + k[None, :] * stride_bk,
                        mask=(rn < N)[:, None] & (k < K)[None, :], other=0)
            a = tl.load(a_ptr + k[:, None] * stride_ak + rm.to(tl.int64)[None, :] * stride_am,  # K-major a^T
                        mask=(k < K)[:, None] & (rm < M)[None, :], other=0)
            acc = tl.dot(b, a, acc, out_dtype=tl.int32)
        else:
            a = tl.load(a_rows + k[None, :] * stride_ak, mask=(rm < M)[:, None] & (k < K)[None, :], other=0)
            b = tl.load(b_cols + k[:, None] * stride_bk, mask=(k < K)[:, None] & (rn < N)[None, :], other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _int8_epilogue(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, stride_sa, stride_sb,
                   OUT_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """``(float(acc) * scale_a) * scale_b`` in fp32 (``_int_mm``'s epilogue), rounded to c's dtype; with
    ``HAS_BIAS`` then ``+ bias`` (in c's dtype) as torch adds two tensors of that dtype -- in fp32,
    rounded once more -- so the sum is the separate add's, bit for bit (launched without contraction:
    ``int8_mm``); stored."""
    sa = tl.load(sa_ptr + rm * stride_sa, mask=rm < M, other=0.0)
    sb = tl.load(sb_ptr + rn * stride_sb, mask=rn < N, other=0.0)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    out = _to_bf16(out, INTERPRET) if OUT_BF16 else out
    if HAS_BIAS:
        out = out.to(tl.float32) + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = _to_bf16(out, INTERPRET) if OUT_BF16 else out
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn, out,
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _int8_mm_split_kernel(a_ptr, b_ptr, p_ptr, M, N, K, K_SPLIT, stride_am, stride_ak, stride_bn, stride_bk,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr):
    """Split-K: program (m, n, s) sums K ``s * K_SPLIT ..`` into its int32 partial ``p[s]`` (S x M x N)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ps = tl.program_id(2)
    k_lo = ps * K_SPLIT
    acc = _int8_kblocks(a_ptr, b_ptr, rm, rn, k_lo, tl.minimum(k_lo + K_SPLIT, K), M, N, K, stride_am, stride_ak,
                        stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, SWAP)
    tl.store(p_ptr + ps.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :], acc,
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _int8_split_sum_kernel(p_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, S, stride_sa, stride_sb,
                           OUT_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The S int32 partials added (exact: the unsplit kernel's int32 sum), then ``_int8_epilogue``."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    at = p_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    acc = tl.load(at, mask=ok, other=0)
    for s in range(1, S):
        acc += tl.load(at + s * M * N, mask=ok, other=0)
    _int8_epilogue(acc, c_ptr, sa_ptr, sb_ptr, bias_ptr, rm, rn, M, N, N, 1, stride_sa, stride_sb, OUT_BF16, HAS_BIAS,
                   INTERPRET)


def unsupported(x: torch.Tensor, spec: CastSpec) -> str | None:
    """Why ``quantize_rows`` cannot quantize ``x`` under ``spec``, or None."""
    if x.dim() != 2 or x.shape[1] == 0:
        why = input_unsupported(x.dtype, spec)
        return why or f"the Triton INT8 quantizer takes a 2-D tensor with rows, got shape {tuple(x.shape)}"
    return input_unsupported(x.dtype, spec)


def input_unsupported(dtype: torch.dtype, spec: CastSpec) -> str | None:
    """Why the INT8 quantizers cannot take ``dtype`` input under ``spec`` (the shape aside), or None."""
    if spec.format is not Format.INT8 or spec.block != Block(1, 0):
        return f"the Triton INT8 quantizer takes int8 with one scale per row, not {spec.short_str()}"
    if dtype not in _INPUTS:
        return f"the Triton INT8 quantizer takes bfloat16, float16 or float32 input, not {dtype}"
    if not spec.amax_floor >= QMAX.value * MIN_SCALE:  # every scale >= 2^-64: ``fp8._quotient``'s precondition
        return f"the Triton INT8 quantizer needs amax_floor >= {QMAX.value * MIN_SCALE:.3g}, got {spec.amax_floor}"
    return None


def quantize_rows(x: torch.Tensor, spec: CastSpec) -> QTensor:
    """``precision.quant.quantize(x, spec)`` for int8 with one scale per row: data (M, K) int8
    row-major, scale (M, 1) fp32."""
    why = unsupported(x, spec)
    if why is not None:
        raise ValueError(f"quantize_rows: {why}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block_k = min(triton.next_power_of_2(k), 1024)
        # a decode step's rows one per program (4 a program left a 32-row step 8 programs, a wide
        # decode step's 256 rows 64); a max and elementwise steps: the bits do not depend on it
        rows = 1 if m <= MID_ROWS else max(1, min(16, 4096 // block_k))
        _row_quant_kernel[(triton.cdiv(m, rows),)](
            x, q, s, m, x.stride(0), x.stride(1), K=k, FLOOR=spec.amax_floor, POW2=spec.pow2_scale, ROWS=rows,
            BLOCK_K=block_k, num_warps=4, enable_fp_fusion=FP_FUSION)
    return QTensor(q, s, spec)


def quantize(x: torch.Tensor, spec: CastSpec) -> QTensor | None:
    """The Triton quantizer for ``spec`` (same values as the reference), or None when there is none."""
    return None if unsupported(x, spec) is not None else quantize_rows(x, spec)


def _scale_stride(op: QTensor, rows: int, where: str) -> int:
    """The stride to a row's scale: 1 per row (an (M, 1) grid), 0 for one scale for all."""
    if op.scale.numel() == 1:
        return 0
    if op.spec.block.cols != 0 or op.scale.numel() != rows:
        raise ValueError(f"{where}: int8_mm takes one scale per row or one in all, not {op.spec.block.name} "
                         f"scales ({tuple(op.scale.shape)})")
    return op.scale.reshape(-1).stride(0)


def _mm_config(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): a decode step gets ``fp8.decode_tiles`` (narrow
    tiles, so more programs stream the weight); prefill- and training-sized M get 128 x 128. Untuned
    guesses until ``jetrl bench gemm`` has been run on a GPU; no choice here changes a result bit."""
    if m <= DECODE_ROWS:
        return decode_tiles(m, n)
    return 128, 128, 8, 3


def int8_mm(a: QTensor, b: QTensor, out_dtype: torch.dtype = torch.float32,
            split: int | None = None, bias: torch.Tensor | None = None,
            tiles: tuple[int, int, int, int] | None = None, swap: bool | None = None) -> torch.Tensor:
    """``a @ b.T`` (a: M x K, b: N x K, INT8 with per-row or per-tensor scales), int32 accumulation.
    ``split``: K in that many runs of whole 128-wide blocks, their int32 sums added exactly (the same
    bits as one run), by default ``fp8.decode_split``'s timed choice for a decode step, else 1.
    ``bias`` (N, in ``out_dtype``): added in the epilogue, the bits of ``int8_mm(a, b) + bias`` (a
    Qwen2 model's q/k/v: one kernel fewer per layer and decode step). ``tiles``: (BLOCK_M, BLOCK_N,
    num_warps, num_stages), by default ``_mm_config``'s, or past a decode step's rows
    ``fp8.mid_choice``'s timed tiles and split; ``swap``: each K block's product taken as ``b @ a.T`` on
    ``fp8.swap_tiles`` (by default the timed choice for a decode step that asks for no split). None of
    it changes a bit."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"int8_mm: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)} do not match as a @ b.T")
    if a.data.dtype is not torch.int8 or b.data.dtype is not torch.int8:
        raise ValueError(f"int8_mm takes int8 operands, got {a.data.dtype} and {b.data.dtype}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int8_mm writes float32 or bfloat16, not {out_dtype}")
    m, k = a.data.shape
    n = b.data.shape[0]
    if k > K_LIMIT:
        raise ValueError(f"int8_mm: K = {k} could overflow the int32 sum (at most {K_LIMIT})")
    ssa, ssb = _scale_stride(a, m, "operand a"), _scale_stride(b, n, "operand b")
    if bias is not None and (bias.shape != (n,) or bias.dtype is not out_dtype):
        raise ValueError(f"int8_mm: bias must be ({n},) {out_dtype}, got {tuple(bias.shape)} {bias.dtype}")
    bias = None if bias is None else bias.contiguous()
    c = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    if m == 0 or n == 0:
        return c
    dev = a.data.device
    (block_m, block_n, warps, stages), split, _, swap = fp8.gemm_plan("int8", m, n, k, dev, _mm_config, tiles, split,
                                                                       swap=swap)
    # a bias is added to the product rounded to fp32, as the separate add adds it: with contraction on, the
    # GPU compile made an fp32 output's (acc * sa) * sb + bias one FMA, rounded once (other last bits; the
    # interpreter never contracts). Nothing else here to contract: without a bias, FP_FUSION as pinned.
    fusion = FP_FUSION and bias is None
    kblocks = triton.cdiv(k, 128)
    splits = _splits(kblocks, split)
    if splits > 1:
        per = triton.cdiv(kblocks, splits) * 128
        part = torch.empty((splits, m, n), dtype=torch.int32, device=dev)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _int8_mm_split_kernel[(*grid, splits)](
            a.data, b.data, part, m, n, k, per, a.data.stride(0), a.data.stride(1), b.data.stride(0),
            b.data.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, SWAP=swap, num_warps=warps,
            num_stages=stages, enable_fp_fusion=FP_FUSION)
        _int8_split_sum_kernel[grid](
            part, c, a.scale, b.scale, c if bias is None else bias, m, n, splits, ssa, ssb,
            OUT_BF16=out_dtype == torch.bfloat16, HAS_BIAS=bias is not None, INTERPRET=_interpreting(),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, enable_fp_fusion=fusion)
        return c
    _int8_mm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a.data, b.data, c, a.scale, b.scale, c if bias is None else bias, m, n, k,
        a.data.stride(0), a.data.stride(1), b.data.stride(0), b.data.stride(1), c.stride(0), c.stride(1), ssa, ssb,
        OUT_BF16=out_dtype == torch.bfloat16, HAS_BIAS=bias is not None, INTERPRET=_interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, SWAP=swap, num_warps=warps, num_stages=stages,
        enable_fp_fusion=fusion)
    return c


def _int8_split_run(block_m: int, n: int, k: int, device: torch.device):
    """``int8_mm`` at a given split on random operands of a decode GEMM's shape (``fp8.decode_split``)."""
    g = torch.Generator(device).manual_seed(0)  # drawn on the device, as fp8's
    spec = CastSpec(Format.INT8, Block(1, 0))
    a = quantize_rows(torch.randn(block_m, k, generator=g, device=device, dtype=torch.bfloat16), spec)
    b = quantize_rows(torch.randn(n, k, generator=g, device=device) * 0.05, spec)
    return lambda s, fused=False, swap=False, tiles=None: int8_mm(a, b, torch.bfloat16, split=s, tiles=tiles,
                                                                  swap=swap)  # no fused sum: the kernels' int32


fp8.SPLIT_RUNS["int8"] = _int8_split_run
