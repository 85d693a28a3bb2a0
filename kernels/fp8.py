"""Triton kernels of the unified FP8 flow, each the twin of a pure-torch reference in
``jetrl_cli.precision.quant`` / ``gemm``:

- ``quantize_act``: FP8 quantization of a 2-D activation or gradient with 1x128 groups along K and,
  from the same read of each 128x128 tile, the 128x1 groups the weight-gradient GEMM needs
  (``quantize(x, 1x128)`` and ``quantize(x, 128x1)``, bit for bit);
- ``quantize_weight``: 128x128 blocks (``quantize(w, 128x128)``, bit for bit). The block grid is
  symmetric, so the transposed weight Dgrad needs is the same data and scales transposed;
- ``blockwise_mm``: ``a @ b.T`` for FP8 operands with 1x128 or 128x128 scales along K, fp32
  accumulation per 128-wide K block, scales applied to each block's partial sum before it is added
  (DeepSeek-V3's promotion rule), fp32 or bf16 output. Fprop (x 1x128, W 128x128), Dgrad
  (dy 1x128, W^T 128x128) and Wgrad (dy^T and x^T, both 1x128 along the token dim) are all this
  one kernel on ``QTensor`` operands.

Scales follow the reference rule: ``amax`` over the finite values of a block (floored at
``amax_floor``), ``scale = amax / fmt_max`` (optionally rounded up to a power of two), NaN when the
block holds a non-finite value; data ``= clamp(x / scale, -fmt_max, fmt_max)`` rounded to nearest
even. On CPU these run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how they are tested.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.precision.quant import CastSpec, QTensor

TILE = 128


@triton.jit
def _pow2_ceil(s):
    bits = s.to(tl.int32, bitcast=True)
    up = ((bits >> 23) + 1) << 23
    return tl.where((bits & 0x7FFFFF) == 0, bits, up).to(tl.float32, bitcast=True)


@triton.jit
def _finish_scale(amax, bad, FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr):
    s = tl.maximum(amax, FLOOR) / FMAX
    if POW2:
        s = _pow2_ceil(s)
    return tl.where(bad, float("nan"), s)


@triton.jit
def _cast(y, FMAX: tl.constexpr, OUT: tl.constexpr):
    c = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    c = tl.where(y != y, y, c)  # NaN stays NaN (torch.clamp's rule)
    return c.to(OUT)


@triton.jit
def _load_tile(x_ptr, pm, pk, M, K, stride_xm, stride_xk, T: tl.constexpr):
    """Tile (pm, pk) of x in fp32 with its |x| (non-finite as 0) and a non-finite flag per element."""
    rm = pm * T + tl.arange(0, T)
    rk = pk * T + tl.arange(0, T)
    inb = (rm < M)[:, None] & (rk < K)[None, :]
    offs = rm[:, None] * stride_xm + rk[None, :] * stride_xk
    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    finite = ax < float("inf")  # False for inf and NaN
    return rm, rk, inb, offs, x, tl.where(finite, ax, 0.0), (~finite).to(tl.int32)


@triton.jit
def _act_quant_kernel(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, stride_xm, stride_xk,
                      stride_srm, stride_srk, stride_scm, stride_sck,
                      FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr, T: tl.constexpr):
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rm, rk, inb, offs, x, ax, nonfinite = _load_tile(x_ptr, pm, pk, M, K, stride_xm, stride_xk, T)
    if ROWS:  # 1x128: one scale per row of the tile
        s = _finish_scale(tl.max(ax, axis=1), tl.max(nonfinite, axis=1) > 0, FMAX, FLOOR, POW2)
        tl.store(sr_ptr + rm * stride_srm + pk * stride_srk, s, mask=rm < M)
        tl.store(qr_ptr + offs, _cast(x / s[:, None], FMAX, OUT), mask=inb)
    if COLS:  # 128x1: one scale per column of the tile
        s = _finish_scale(tl.max(ax, axis=0), tl.max(nonfinite, axis=0) > 0, FMAX, FLOOR, POW2)
        tl.store(sc_ptr + pm * stride_scm + rk * stride_sck, s, mask=rk < K)
        tl.store(qc_ptr + offs, _cast(x / s[None, :], FMAX, OUT), mask=inb)


@triton.jit
def _weight_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_sm, stride_sk,
                         FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
                         T: tl.constexpr):
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rm, rk, inb, offs, x, ax, nonfinite = _load_tile(x_ptr, pm, pk, M, K, stride_xm, stride_xk, T)
    s = _finish_scale(tl.max(tl.max(ax, axis=1), axis=0), tl.max(tl.max(nonfinite, axis=1), axis=0) > 0,
                      FMAX, FLOOR, POW2)
    tl.store(s_ptr + pm * stride_sm + pk * stride_sk, s)
    tl.store(q_ptr + offs, _cast(x / s, FMAX, OUT), mask=inb)


@triton.jit
def _blockwise_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                         stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_sam, stride_sak, stride_sbn, stride_sbk,
                         SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, OUT_BF16: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,  # (BLOCK_K, BLOCK_N): K-major B
                    mask=(k < K)[:, None] & (rn < N)[None, :], other=0.0)
        part = tl.dot(a, b, out_dtype=tl.float32)
        sa = tl.load(sa_ptr + (rm // SA_ROWS) * stride_sam + kb * stride_sak, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + (rn // SB_ROWS) * stride_sbn + kb * stride_sbk, mask=rn < N, other=0.0)
        acc += part * sa[:, None] * sb[None, :]  # promote each 128-wide K block with its scales
    out = acc.to(tl.bfloat16) if OUT_BF16 else acc
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, out,
             mask=(rm < M)[:, None] & (rn < N)[None, :])


_TL_FP8 = {Format.FP8_E4M3: tl.float8e4nv, Format.FP8_E5M2: tl.float8e5}


def _check_fp8(fmt: Format) -> None:
    if fmt not in _TL_FP8:
        raise ValueError(f"the Triton quantizers take fp8_e4m3 or fp8_e5m2, not {fmt.value}")


def quantize_act(x: torch.Tensor, fmt: Format = Format.FP8_E4M3, pow2_scale: bool = False,
                 amax_floor: float = 1e-12, rows: bool = True, cols: bool = True) -> tuple[QTensor | None, QTensor | None]:
    """``(quantize(x, 1x128), quantize(x, 128x1))`` from one pass over ``x`` (2-D); either may be skipped."""
    _check_fp8(fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize_act takes a 2-D tensor, got shape {tuple(x.shape)}")
    m, k = x.shape
    gm, gk = triton.cdiv(m, TILE), triton.cdiv(k, TILE)
    dt = fmt.torch_dtype()
    qr = torch.empty((m, k), dtype=dt, device=x.device) if rows else None
    sr = torch.empty((m, gk), dtype=torch.float32, device=x.device) if rows else None
    qc = torch.empty((m, k), dtype=dt, device=x.device) if cols else None
    sc = torch.empty((gm, k), dtype=torch.float32, device=x.device) if cols else None
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    _act_quant_kernel[(gm, gk)](
        x, qr if rows else dummy, sr if rows else dummy, qc if cols else dummy, sc if cols else dummy, m, k,
        x.stride(0), x.stride(1), sr.stride(0) if rows else 0, sr.stride(1) if rows else 0,
        sc.stride(0) if cols else 0, sc.stride(1) if cols else 0,
        FMAX=fmt.max, FLOOR=amax_floor, POW2=pow2_scale, OUT=_TL_FP8[fmt], ROWS=rows, COLS=cols, T=TILE)
    out_r = QTensor(qr, sr, CastSpec(fmt, Block(1, TILE), pow2_scale, amax_floor)) if rows else None
    out_c = QTensor(qc, sc, CastSpec(fmt, Block(TILE, 1), pow2_scale, amax_floor)) if cols else None
    return out_r, out_c


def quantize_weight(w: torch.Tensor, fmt: Format = Format.FP8_E4M3, pow2_scale: bool = False,
                    amax_floor: float = 1e-12) -> QTensor:
    """``quantize(w, 128x128)``."""
    _check_fp8(fmt)
    if w.dim() != 2:
        raise ValueError(f"quantize_weight takes a 2-D tensor, got shape {tuple(w.shape)}")
    m, k = w.shape
    gm, gk = triton.cdiv(m, TILE), triton.cdiv(k, TILE)
    q = torch.empty((m, k), dtype=fmt.torch_dtype(), device=w.device)
    s = torch.empty((gm, gk), dtype=torch.float32, device=w.device)
    _weight_quant_kernel[(gm, gk)](w, q, s, m, k, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
                                   FMAX=fmt.max, FLOOR=amax_floor, POW2=pow2_scale, OUT=_TL_FP8[fmt], T=TILE)
    return QTensor(q, s, CastSpec(fmt, Block(TILE, TILE), pow2_scale, amax_floor))


def quantize(x: torch.Tensor, spec: CastSpec) -> QTensor | None:
    """The Triton quantizer for ``spec``, or None when there is none (the caller uses the reference)."""
    if spec.format not in _TL_FP8 or x.dim() != 2:
        return None
    if spec.block == Block(1, TILE):
        return quantize_act(x, spec.format, spec.pow2_scale, spec.amax_floor, rows=True, cols=False)[0]
    if spec.block == Block(TILE, 1):
        return quantize_act(x, spec.format, spec.pow2_scale, spec.amax_floor, rows=False, cols=True)[1]
    if spec.block == Block(TILE, TILE):
        return quantize_weight(x, spec.format, spec.pow2_scale, spec.amax_floor)
    return None


def _scale_rows(op: QTensor, where: str) -> int:
    """Rows sharing one scale along K-blocks of 128: 1 (1x128 groups) or 128 (128x128 blocks)."""
    blk = op.spec.block
    if blk.cols != TILE or blk.rows not in (1, TILE):
        raise ValueError(f"{where}: the Triton blockwise GEMM takes 1x128 or 128x128 scales along K, "
                         f"not {blk.name}")
    return blk.rows


def blockwise_mm(a: QTensor, b: QTensor, out_dtype: torch.dtype = torch.float32,
                 block_m: int = 64, block_n: int = 128) -> torch.Tensor:
    """``a @ b.T`` (a: M x K, b: N x K, FP8 with 1x128 or 128x128 scales), fp32 accumulation per K block."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"blockwise_mm: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)} do not match as a @ b.T")
    sa_rows, sb_rows = _scale_rows(a, "operand a"), _scale_rows(b, "operand b")
    m, k = a.data.shape
    n = b.data.shape[0]
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"blockwise_mm writes float32 or bfloat16, not {out_dtype}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _blockwise_mm_kernel[grid](
        a.data, b.data, c, a.scale, b.scale, m, n, k,
        a.data.stride(0), a.data.stride(1), b.data.stride(0), b.data.stride(1), c.stride(0), c.stride(1),
        a.scale.stride(0), a.scale.stride(1), b.scale.stride(0), b.scale.stride(1),
        SA_ROWS=sa_rows, SB_ROWS=sb_rows, OUT_BF16=out_dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=TILE)
    return c
