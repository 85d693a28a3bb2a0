"""Decode attention that reads the KV cache as it is stored: bf16, or FP8 with a scale per token and
head, dequantized in registers (the rollout engine's decode steps on a GPU); and ``kv_store``, which
quantizes a step's new keys and values and writes them into the FP8 cache in one kernel.

**Why.** An FP8 KV cache halves the cache's memory, but attention can only save bandwidth too if it
reads the FP8 bytes. Handing it a dequantized copy (``_kv_values`` then ``scaled_dot_product_attention``)
reads 1 byte per value, writes 2 and reads them again at every decode step, over the whole cached
width of every layer: more traffic than a bf16 cache. Here each key and value is read once, as 1
byte plus its row's 4-byte scale (``head_dim + 4`` bytes per token and head instead of
``2 * head_dim``).

**Layout of the work.** One program per (sequence, KV head). Its rows are the ``rep`` query heads
that share the KV head (GQA packing: the keys and values are read once for all of them, not once per
query head), padded to ``BLOCK_M`` = 16 rows, the smallest tensor-core tile. It walks the sequence's
keys ``0 .. q_pos`` in blocks of ``DEC_BLOCK_N`` with an online softmax; keys past ``q_pos`` (the
rest of the static cache) are never read. No split-KV: an RL rollout decodes many sequences at
once, and ``batch x kv_heads`` programs (64 x 2 = 128 at the 1.5B shape) already cover an H100's 132
SMs; a small batch with long contexts would leave SMs idle, which flash-decoding's split-KV fixes
(not done here).

**Numerics, the same in kind as the trainer's attention** (flash attention on bf16 operands): a
key or value is ``fp8 -> fp32`` (exact) ``* scale`` (one fp32 rounding) ``-> bf16`` (round to
nearest even), exactly the values ``_kv_values`` / ``cast_kv`` give the trainer (tested bit for bit);
``q . k`` dots on bf16 operands with fp32 accumulation; softmax in fp32 (base 2); the weights
rounded to bf16 for ``p @ v`` as FlashAttention does; output rounded to bf16. The result is not
batch-invariant (the trainer's full-sequence attention adds in another order); the batch-invariant
mode reads FP8 through ``kernels.invariant.invariant_attention`` instead, which takes the same
``kv_scales``.

**Not measured** (no GPU in the session that wrote it): its speed against dequantize-then-SDPA and
against SDPA on a bf16 cache. ``jetrl bench attention --device cuda`` times all of them. In Triton's
interpreter (CPU tests) a bf16 ``tl.dot`` returns garbage, so operands are upcast to fp32 first
(exact), and fp32 -> bf16 rounding is done on the bits (``kernels.fp8._to_bf16``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl_cli.precision.formats import Block
from jetrl_cli.precision.quant import CastSpec, QTensor

from .fp8 import unsupported as fp8_unsupported
from .fp8 import _TL_FP8, FP_FUSION, _interpreting, _rows_quantized, _to_bf16

DEC_BLOCK_M, DEC_BLOCK_N, DEC_WARPS, DEC_STAGES = 16, 64, 4, 3
LOG2E = 1.4426950408889634
KV_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def dequant_kv(x, s, TO_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """FP8 keys or values times their per-token scales (``s`` broadcast to x's shape) as attention
    reads them: fp8 -> fp32 (exact), one fp32 rounding for the product (what torch's
    ``data.float() * scale`` gives), then to bf16 when ``TO_BF16`` (round to nearest even)."""
    x = x.to(tl.float32) * s
    if TO_BF16:
        x = _to_bf16(x, INTERPRET)
    return x


@triton.jit
def pv_accumulate(p, v, acc, alpha, BF16: tl.constexpr, F32_DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """The online softmax's update ``acc * alpha + p @ v`` with fp32 accumulation; with bf16 inputs
    the weights p are rounded to bf16 first, as FlashAttention rounds the p @ v operand."""
    if BF16:
        p = _to_bf16(p, INTERPRET)
    if F32_DOT:
        return tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    return tl.dot(p, v, acc * alpha[:, None])


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, o_ptr, os_ptr, B, REP, D, qk_scale,
                   sqb, sqh, sqd, skb, skh, skw, skd, svb, svh, svw, svd,
                   sksb, sksh, sksw, svsb, svsh, svsw, spb, sob, soh, sod,
                   SCALED: tl.constexpr, F32_DOT: tl.constexpr, BF16: tl.constexpr, INTERPRET: tl.constexpr,
                   QUANT: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    row_ok = rm < REP
    d_ok = rd < D
    head = kvh * REP + rm
    q = tl.load(q_ptr + seq * sqb + head[:, None] * sqh + rd[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    n_keys = tl.load(pos_ptr + seq * spb).to(tl.int32) + 1  # keys 0..q_pos (the new token's included)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    k_base = k_ptr + seq * skb + kvh * skh
    v_base = v_ptr + seq * svb + kvh * svh
    ks_base = ks_ptr + seq * sksb + kvh * sksh
    vs_base = vs_ptr + seq * svsb + kvh * svsh
    for start in range(0, n_keys, BLOCK_N):
        kn = start + rn
        kv_ok = kn < n_keys
        k = tl.load(k_base + kn[None, :] * skw + rd[:, None] * skd, mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        if SCALED:
            k = dequant_kv(k, tl.load(ks_base + kn * sksw, mask=kv_ok, other=0.0)[None, :], BF16, INTERPRET)
        if F32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where(kv_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # every row sees key 0 in the first block: m_new is finite
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + kn[:, None] * svw + rd[None, :] * svd, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        if SCALED:
            v = dequant_kv(v, tl.load(vs_base + kn * svsw, mask=kv_ok, other=0.0)[:, None], BF16, INTERPRET)
        acc = pv_accumulate(p, v, acc, alpha, BF16, F32_DOT, INTERPRET)
        m_i = m_new
    out = tl.math.div_rn(acc, l_i[:, None])
    out = _to_bf16(out, INTERPRET) if BF16 else out
    if QUANT:  # o_proj's FP8 1x128 input: a head's D = 128 outputs are one group of its row (seq)
        y, s = _rows_quantized(out.to(tl.float32), FMAX, FLOOR, POW2)
        tl.store(os_ptr + head.to(tl.int64) * B + seq, s, mask=row_ok)  # (b, heads) grid, strides (1, b)
        out = y.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + seq * sob + head[:, None] * soh + rd[None, :] * sod, out, mask=row_ok[:, None] & d_ok[None, :])


def _check_device(where: str, *ts: torch.Tensor) -> None:
    devs = {t.device for t in ts}
    if len(devs) > 1:
        raise ValueError(f"{where}: tensors on different devices ({', '.join(sorted(map(str, devs)))})")
    if ts[0].device.type != "cuda" and not _interpreting():
        raise ValueError(f"{where}: needs CUDA tensors (or TRITON_INTERPRET=1 for Triton's interpreter), got {ts[0].device}")


def check_kv_scales(where: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_scales) -> tuple:
    """Validate an attention call's K/V dtypes against ``kv_scales`` (None, or the (b, kv_heads, w)
    fp32 scales of FP8 keys and values); returns the scales (dummies when unscaled) and whether
    they apply."""
    if kv_scales is None:
        if q.dtype not in (torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"{where}: q, k, v must all be bfloat16 or all float32 (or k, v FP8 with kv_scales), "
                             f"got {q.dtype}, {k.dtype}, {v.dtype}")
        return q, q, False
    ks, vs = kv_scales
    if q.dtype not in (torch.bfloat16, torch.float32) or k.dtype not in KV_FORMATS or v.dtype != k.dtype:
        raise ValueError(f"{where}: with kv_scales, q must be bfloat16 or float32 and k, v one FP8 dtype "
                         f"(float8_e4m3fn, float8_e5m2), got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, s in (("k_scale", ks), ("v_scale", vs)):
        if s.dtype != torch.float32 or s.shape != k.shape[:3]:
            raise ValueError(f"{where}: {name} must be float32 of shape {tuple(k.shape[:3])} (one scale per "
                             f"token and KV head), got {s.dtype} {tuple(s.shape)}")
    if torch.is_grad_enabled() and q.requires_grad:
        raise ValueError(f"{where}: attention over an FP8 cache is forward-only (rollout); q requires grad")
    return ks, vs, True


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     scale: float | None = None, quantize_out: CastSpec | None = None):
    """One decode step's attention: query (s, head) attends to keys ``0 .. q_pos[s]`` of sequence s.

    q: (b, heads, 1, d), bf16 or fp32, any strides; k, v: (b, kv_heads, w, d) in q's dtype, or FP8
    (e4m3 / e5m2) with ``kv_scales`` = (k_scale, v_scale), each fp32 (b, kv_heads, w): the cache's
    per-token-and-head scales (dequantized in the kernel to q's dtype). Heads a multiple of kv_heads
    (query head i reads KV head i // (heads / kv_heads)). q_pos: (b,) or (b, 1) int, the new token's
    key index (its key already written); keys past it are never read, so they may hold anything.
    Returns (b, heads, 1, d) in q's dtype. Forward only. Positions are not checked against w (that
    would cost a host sync per step): 0 <= q_pos < w is the caller's to keep.

    ``quantize_out`` (FP8, 1x128; bf16 q with d = 128): instead, the output as the next GEMM's
    (o_proj's) Fprop operand, written by the same kernel: a QTensor of data (b, heads * d) and scales
    (b, heads) with strides (1, b) -- ``kernels.fp8.quantize_act(out, rows)`` of the bf16 output
    reshaped to (b, heads * d), bit for bit, without the bf16 output written or read back."""
    where = "decode_attention"
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[2] != 1:
        raise ValueError(f"{where}: q must be (b, heads, 1, d) and k, v (b, kv_heads, w, d) alike, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, _, d = q.shape
    hk = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d or hk == 0 or h % hk:
        raise ValueError(f"{where}: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (same b and d, "
                         f"heads a multiple of kv_heads)")
    ks, vs, scaled = check_kv_scales(where, q, k, v, kv_scales)
    q_pos = q_pos.reshape(-1)
    if q_pos.shape != (b,) or q_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: q_pos must be an int32/int64 (b,) or (b, 1) tensor, got {q_pos.dtype} "
                         f"with {q_pos.numel()} elements for b={b}")
    _check_device(where, q, k, v, ks, vs, q_pos)
    quant = quantize_out
    if quant is not None:
        why = out_quant_unsupported(quant, q.dtype, d)
        if why is not None:
            raise ValueError(f"{where}: quantize_out: {why}")
    rep = h // hk
    if quant is None:
        out = torch.empty((b, h, 1, d), dtype=q.dtype, device=q.device)
        out_s = out
    else:  # data (b, heads * d) row-major, seen as (b, heads, 1, d); scales (b, heads), strides (1, b)
        out = torch.empty((b, h * d), dtype=quant.format.torch_dtype(), device=q.device)
        out_s = torch.empty((h, b), dtype=torch.float32, device=q.device).t()
    if out.numel() == 0:
        return out if quant is None else QTensor(out, out_s, quant)
    o4 = out if quant is None else out.view(b, h, 1, d)
    interp = _interpreting()
    bf16 = q.dtype == torch.bfloat16
    sks = ks.stride() if scaled else (0, 0, 0)
    svs = vs.stride() if scaled else (0, 0, 0)
    _decode_kernel[(b, hk)](
        q, k, v, ks, vs, q_pos, o4, out_s, b, rep, d, (d ** -0.5 if scale is None else float(scale)) * LOG2E,
        q.stride(0), q.stride(1), q.stride(3), *k.stride(), *v.stride(), *sks, *svs, q_pos.stride(0),
        o4.stride(0), o4.stride(1), o4.stride(3),
        SCALED=scaled, F32_DOT=interp or not bf16, BF16=bf16, INTERPRET=interp,
        QUANT=quant is not None, FMAX=quant.format.max if quant else 1.0,
        FLOOR=quant.amax_floor if quant else 0.0, POW2=bool(quant and quant.pow2_scale),
        BLOCK_M=max(DEC_BLOCK_M, triton.next_power_of_2(rep)), BLOCK_N=DEC_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=DEC_WARPS, num_stages=DEC_STAGES,
        enable_fp_fusion=FP_FUSION)
    return out if quant is None else QTensor(out, out_s, quant)


OUT_GROUP = 128  # the head size whose output row is exactly one 1x128 group of o_proj's input


def out_quant_unsupported(spec: CastSpec, q_dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``decode_attention`` cannot write its output as ``spec``'s operand (None: it can)."""
    if spec.block != Block(1, OUT_GROUP):
        return f"writes 1x{OUT_GROUP} groups, not {spec.short_str()}"
    if head_dim != OUT_GROUP or q_dtype != torch.bfloat16:
        return f"needs bf16 queries with head_dim {OUT_GROUP} (one group per head), got {q_dtype} and {head_dim}"
    return fp8_unsupported(None, spec.format, spec.amax_floor)


def dequantized_reference(k, v, kv_scales, dtype):
    """FP8 keys and values times their per-token scales, as ``dtype``: what the kernels read."""
    return tuple((x.float() * sc[..., None]).to(dtype) for x, sc in zip((k, v), kv_scales))


def decode_attention_reference(q, k, v, q_pos, kv_scales=None, compute_dtype=torch.float64) -> torch.Tensor:
    """The math of ``decode_attention`` in plain torch: keys and values dequantized as the kernel
    does (to q's dtype), then softmax(q.k * d^-0.5) over keys 0..q_pos, times v, in ``compute_dtype``."""
    b, h, _, d = q.shape
    if kv_scales is not None:
        k, v = dequantized_reference(k, v, kv_scales, q.dtype)
    rep = h // k.shape[1]
    j = torch.arange(k.shape[2], device=q.device)
    unseen = j[None, :] > q_pos.reshape(-1, 1)  # (b, w): never read by the kernel, may hold NaN
    kf, vf = (torch.where(unseen[:, None, :, None], 0, x.to(compute_dtype)).repeat_interleave(rep, 1) for x in (k, v))
    s = (q.to(compute_dtype) @ kf.transpose(-1, -2)) * d ** -0.5
    s = s.masked_fill(unseen[:, None, None], float("-inf"))
    return s.softmax(-1) @ vf


# --- storing keys and values into an FP8 cache ----------------------------------------------------------

STORE_ROWS, STORE_WARPS = 16, 4


@triton.jit
def _kv_store_kernel(x_ptr, idx_ptr, data_ptr, scale_ptr, R, HK, T, D, sxb, sxh, sxt, sxd,
                     FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr,
                     HAS_IDX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows in (batch, kv head, t) order
    rd = tl.arange(0, BLOCK_D)
    ok = r < R
    d_ok = rd < D
    src = (r // (HK * T)).to(tl.int64) * sxb + ((r // T) % HK) * sxh + (r % T) * sxt
    x = tl.load(x_ptr + src[:, None] + rd[None, :] * sxd, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q, s = _rows_quantized(x, FMAX, FLOOR, POW2)
    q = q.to(OUT)
    if HAS_IDX:
        dst = tl.load(idx_ptr + r, mask=ok, other=0).to(tl.int64)
    else:  # rows in order
        dst = r.to(tl.int64)
    tl.store(data_ptr + dst[:, None] * D + rd[None, :], q, mask=ok[:, None] & d_ok[None, :])
    tl.store(scale_ptr + dst, s, mask=ok)


def kv_store(x: torch.Tensor, idx: torch.Tensor | None, data: torch.Tensor, scales: torch.Tensor, spec) -> None:
    """Quantize keys or values ``x`` (b, kv_heads, t, d), any strides, fp32 or bf16, one scale per row
    of d (a token's head) under ``spec`` (the cache's ``fp8 row`` CastSpec), and write them straight
    into an FP8 cache: row i (in (b, kv_heads, t) order) to ``data[idx[i]]`` and ``scales[idx[i]]``
    (``idx`` None: to ``data[i]``, ``scales[i]``).
    ``data``: (rows, d) FP8, contiguous; ``scales``: (rows,) fp32. One kernel, where the reference
    (``quantize``, then two ``index_copy_``) is about ten; bit for bit the reference's data and scales
    (the rules of ``kernels.fp8``: NaN-propagating amax, the product by the scale's correctly rounded
    reciprocal, NaN kept)."""
    where = "kv_store"
    from jetrl_cli.precision.formats import Format

    if x.dim() != 4 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{where}: x must be a float32 or bfloat16 (b, kv_heads, t, d) tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    b, hk, t, d = x.shape
    fmt = spec.format
    if fmt not in (Format.FP8_E4M3, Format.FP8_E5M2) or spec.block.name != "row":
        raise ValueError(f"{where}: the cache's spec must be fp8_e4m3 or fp8_e5m2 with row scales, got {spec}")
    why = fp8_unsupported(None, fmt, spec.amax_floor)
    if why is not None:
        raise ValueError(f"{where}: {why}")
    if data.dtype != fmt.torch_dtype() or data.dim() != 2 or data.shape[1] != d or not data.is_contiguous():
        raise ValueError(f"{where}: data must be a contiguous ({'rows'}, {d}) {fmt.torch_dtype()} tensor, got "
                         f"{data.dtype} {tuple(data.shape)}")
    if scales.dtype != torch.float32 or scales.shape != data.shape[:1] or not scales.is_contiguous():
        raise ValueError(f"{where}: scales must be contiguous float32 of shape {tuple(data.shape[:1])}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    n = b * hk * t
    if idx is None:
        if data.shape[0] != n:
            raise ValueError(f"{where}: without idx, data must have the {n} rows of x, got {data.shape[0]}")
    elif idx.shape != (n,) or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: idx must be an int32/int64 ({n},) tensor, got {idx.dtype} {tuple(idx.shape)}")
    _check_device(where, x, *([] if idx is None else [idx]), data, scales)
    if n == 0:
        return
    _kv_store_kernel[(triton.cdiv(n, STORE_ROWS),)](
        x, data if idx is None else idx, data, scales, n, hk, t, d, *x.stride(), FMAX=fmt.max,
        FLOOR=spec.amax_floor, POW2=spec.pow2_scale, OUT=_TL_FP8[fmt], HAS_IDX=idx is not None, BLOCK_R=STORE_ROWS,
        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=STORE_WARPS, enable_fp_fusion=FP_FUSION)
