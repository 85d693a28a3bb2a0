"""Decode attention over a KV cache read as stored (kernels/attention.py), in Triton's interpreter:
against float64 attention within a bound derived from the kernel's roundings, and, over an FP8
cache, bit for bit against the same kernel on the cache dequantized by torch (the values the
trainer's keys and values are rounded to). The batch-invariant kernel's FP8 read is checked the same
way and against the trainer's full-sequence call."""

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from .test_kernels_invariant import BF16, DEV, F32, attention_bound, gen, randn, same_bits, within  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a GPU or TRITON_INTERPRET=1")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(scope="module")
def att():
    from jetrl_cli.kernels import attention

    return attention


def fp8_cache(x: torch.Tensor, dtype=torch.float8_e4m3fn, g=None):
    """x (b, kv_heads, w, d) quantized as the engine's cache stores it: one scale per token and head
    (the flow's quantizer, ``fp8 row``), data and scales laid out as in ``KVCache``."""
    from jetrl_cli.precision.formats import Block, Format
    from jetrl_cli.precision.quant import CastSpec, quantize

    fmt = Format.FP8_E4M3 if dtype == torch.float8_e4m3fn else Format.FP8_E5M2
    q = quantize(x.reshape(-1, x.shape[-1]).float(), CastSpec(fmt, Block.parse("row")))
    return q.data.reshape(x.shape), q.scale.reshape(x.shape[:-1]).float()


def cached_kv(cache: str, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``(k, v, kv_scales)`` as a cache of kind ``cache`` holds them: "bf16" as given (no scales), "fp8"
    stored as the engine stores them (``fp8_cache``)."""
    if cache != "fp8":
        return k, v, None
    (k, ks), (v, vs) = fp8_cache(k), fp8_cache(v)
    return k, v, (ks, vs)


def dequantized(data, scale, dtype):
    """What the engine's fallback and the trainer read: ``_kv_values``, op by op."""
    from jetrl_cli.models.llama import _kv_values

    return _kv_values.__wrapped__(data, scale, dtype)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("b,hk,rep,w,d", [(3, 2, 3, 80, 32), (2, 1, 1, 130, 64), (1, 2, 8, 16, 16), (2, 2, 5, 40, 24)])
def test_decode_attention_within_bound(att, dtype, b, hk, rep, w, d):
    g = gen(b * 100 + rep * 10 + d)
    h = hk * rep
    q, k, v = randn(b, h, 1, d, g=g, dtype=dtype), randn(b, hk, w, d, g=g, dtype=dtype), randn(b, hk, w, d, g=g, dtype=dtype)
    pos = torch.randint(0, w, (b,), generator=g).to(DEV)
    pos[0] = w - 1  # one sequence over every key
    out = att.decode_attention(q, k, v, pos)
    assert out.shape == q.shape and out.dtype == dtype
    bound_model = SimpleNamespace(ATT_BLOCK_N=att.DEC_BLOCK_N)
    exact, _, b_out, _ = attention_bound(bound_model, q, k, v, pos[:, None], dtype == BF16)
    ref = att.decode_attention_reference(q, k, v, pos)
    assert torch.allclose(ref, exact)  # the reference is this math
    ok, worst = within(out, exact, b_out)
    assert ok, f"error {worst:.2f}x the bound"


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_decode_attention_reads_an_fp8_cache_as_its_dequantized_values(att, fp8, dtype):
    """The FP8 bytes times their scales, dequantized in registers: the same bits as the kernel on
    torch's dequantized cache. Keys past each sequence's position hold NaN bytes (never read), and a
    token whose keys are all zero (scale at the amax floor) is among them."""
    g = gen(11)
    b, hk, rep, w, d = 3, 2, 4, 96, 32
    q = randn(b, hk * rep, 1, d, g=g, dtype=dtype)
    kf, vf = randn(b, hk, w, d, g=g, scale=3.0), randn(b, hk, w, d, g=g)
    kf[:, :, 7] = 0
    kd, ks = fp8_cache(kf, fp8)
    vd, vs = fp8_cache(vf, fp8)
    pos = torch.tensor([70, 7, 95], device=DEV)
    for s, p in enumerate(pos.tolist()):
        kd[s, :, p + 1:].view(torch.uint8).fill_(0x7F if fp8 == torch.float8_e4m3fn else 0x7E)  # NaN
        vd[s, :, p + 1:].view(torch.uint8).fill_(0x7F if fp8 == torch.float8_e4m3fn else 0x7E)
    out = att.decode_attention(q, kd, vd, pos, kv_scales=(ks, vs))
    plain = att.decode_attention(q, dequantized(kd, ks, dtype), dequantized(vd, vs, dtype), pos)
    assert torch.isfinite(out).all() and same_bits(out, plain)
    ref = att.decode_attention_reference(q, kd, vd, pos, (ks, vs))
    assert (out.double() - ref).abs().max() < 2e-2


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_decode_attention_writes_o_projs_fp8_input_bit_for_bit(att, cache, pow2):
    """With ``quantize_out`` the kernel writes its output as o_proj's FP8 1x128 operand (a head's 128
    outputs are one group of the token's row): bit for bit the reference quantizer on the kernel's
    own bf16 output, in the GEMM's layout (scales (b, heads), strides (1, b)), and the bf16 output is
    never written. A head whose values are all zero (its group's scale at the amax floor) included."""
    from jetrl_cli.kernels.layouts import is_gemm_layout
    from jetrl_cli.precision.formats import Block, Format
    from jetrl_cli.precision.quant import CastSpec, quantize

    from .triton_interp_fix import fixed_fp8_conversion

    g = gen(13)
    b, hk, rep, w, d = 5, 2, 3, 70, 128
    q = randn(b, hk * rep, 1, d, g=g, dtype=BF16)
    k, v = randn(b, hk, w, d, g=g, dtype=BF16), randn(b, hk, w, d, g=g, dtype=BF16, scale=4.0)
    v[1, 0] = 0  # sequence 1's first KV head: every value zero, so its query heads' outputs are zero
    pos = torch.randint(0, w, (b,), generator=g).to(DEV)
    k, v, scales = cached_kv(cache, k, v)
    spec = CastSpec(Format.FP8_E4M3, Block(1, 128), pow2)
    with fixed_fp8_conversion():  # the interpreter's fp32 -> fp8 cast is wrong (tests/triton_interp_fix.py)
        got = att.decode_attention(q, k, v, pos, kv_scales=scales, quantize_out=spec)
    out = att.decode_attention(q, k, v, pos, kv_scales=scales)
    want = quantize(out.reshape(b, -1).float(), spec)
    assert got.spec == spec and is_gemm_layout(got) and got.scale.stride() == (1, b)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)
    assert got.scale[1, :rep].eq(spec.amax_floor / Format.FP8_E4M3.max).all() or pow2


def test_decode_attention_refuses_an_output_quantizer_it_cannot_run(att):
    from jetrl_cli.precision.formats import Block, Format
    from jetrl_cli.precision.quant import CastSpec

    q = torch.randn(2, 4, 1, 64, device=DEV).bfloat16()
    k = torch.randn(2, 2, 8, 64, device=DEV).bfloat16()
    pos = torch.tensor([3, 5], device=DEV)
    with pytest.raises(ValueError, match="quantize_out: needs bf16 queries with head_dim 128"):
        att.decode_attention(q, k, k, pos, quantize_out=CastSpec(Format.FP8_E4M3, Block(1, 128)))
    with pytest.raises(ValueError, match="quantize_out: writes 1x128 groups, not"):
        att.decode_attention(q, k, k, pos, quantize_out=CastSpec(Format.FP8_E4M3, Block(1, 0)))


def test_the_invariant_kernel_reads_an_fp8_cache_with_the_trainers_bits(att):
    """Batch-invariant mode: a decode step over the FP8 cache (bytes and scales) gives the bits of the
    trainer's full-sequence call on the dequantized keys and values, at every position."""
    from jetrl_cli.kernels import invariant

    g = gen(12)
    b, hk, rep, t, d = 2, 2, 3, 70, 32
    q = randn(b, hk * rep, t, d, g=g, dtype=BF16)
    kd, ks = fp8_cache(randn(b, hk, t, d, g=g))
    vd, vs = fp8_cache(randn(b, hk, t, d, g=g))
    full, full_lse = invariant.invariant_attention(q, dequantized(kd, ks, BF16), dequantized(vd, vs, BF16))
    for steps in ([0, 69], [63, 64]):
        qd = torch.stack([q[s, :, p] for s, p in enumerate(steps)])[:, :, None]
        out, lse = invariant.invariant_attention(qd, kd, vd, torch.tensor(steps, device=DEV)[:, None],
                                                 kv_scales=(ks, vs))
        for s, p in enumerate(steps):
            assert same_bits(out[s, :, 0], full[s, :, p]) and torch.equal(lse[s, :, 0], full_lse[s, :, p]), (s, p)
    ref, _ = invariant.attention_reference(q, kd, vd, compute_dtype=torch.float64, kv_scales=(ks, vs))
    assert (full.double() - ref).abs().max() < 2e-2


def test_attention_over_an_fp8_cache_rejects_bad_input(att):
    from jetrl_cli.kernels import invariant

    q = torch.randn(2, 4, 1, 16, device=DEV).bfloat16()
    kd, ks = fp8_cache(torch.randn(2, 2, 8, 16, device=DEV))
    pos = torch.tensor([3, 5], device=DEV)
    with pytest.raises(ValueError, match="all be bfloat16 or all float32 \\(or k, v FP8 with kv_scales\\)"):
        att.decode_attention(q, kd, kd, pos)
    with pytest.raises(ValueError, match=r"k_scale must be float32 of shape \(2, 2, 8\)"):
        att.decode_attention(q, kd, kd, pos, kv_scales=(ks[:, :, :4], ks))
    with pytest.raises(ValueError, match="v_scale must be float32"):
        invariant.invariant_attention(q, kd, kd, pos[:, None], kv_scales=(ks, ks.double()))
    with pytest.raises(ValueError, match="k, v one FP8 dtype"):
        att.decode_attention(q, kd.float(), kd.float(), pos, kv_scales=(ks, ks))
    with pytest.raises(ValueError, match="forward-only"):
        invariant.invariant_attention(q.float().requires_grad_(), kd, kd, pos[:, None], kv_scales=(ks, ks))
    with pytest.raises(ValueError, match=r"q must be \(b, heads, 1, d\)"):
        att.decode_attention(torch.randn(2, 4, 3, 16, device=DEV).bfloat16(), kd, kd, pos, kv_scales=(ks, ks))
    with pytest.raises(ValueError, match="q_pos must be an int32/int64"):
        att.decode_attention(q, kd, kd, pos.float(), kv_scales=(ks, ks))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kv_store_writes_the_reference_quantization_into_the_cache(att, fp8, dtype):
    """Keys (b, kv_heads, t, d) from a strided view, quantized per token and head and scattered to
    their cache rows in one kernel: bit for bit ``quantize`` + ``index_copy_`` (the reference path),
    with a zero row, a row holding NaN, one holding inf, and values past the format's range among them.
    Rows not written keep their bytes."""
    from jetrl_cli.precision.formats import Block, Format
    from jetrl_cli.precision.quant import CastSpec, quantize

    from .triton_interp_fix import fixed_fp8_conversion

    g = gen(13)
    b, hk, t, d, rows = 3, 2, 5, 40, 64
    spec = CastSpec(Format.FP8_E4M3 if fp8 == torch.float8_e4m3fn else Format.FP8_E5M2, Block.parse("row"))
    x = (randn(b, t, hk, d, g=g, scale=4.0) * torch.rand(b, t, hk, 1, generator=g).to(DEV) ** 4 * 3e5).to(dtype)
    x = x.transpose(1, 2)  # (b, hk, t, d) with t strided, as RoPE's keys are
    x[0, 1, 2] = 0
    x[1, 0, 3, 7] = float("nan")
    x[2, 1, 0, 5] = float("inf")
    idx = torch.randperm(rows, generator=g)[:b * hk * t].to(DEV)
    data = torch.randint(0, 100, (rows, d), generator=g, dtype=torch.uint8).to(DEV).view(fp8)
    scales = torch.rand(rows, generator=g).to(DEV)
    want_d, want_s = data.view(torch.uint8).clone(), scales.clone()
    q = quantize(x.reshape(-1, d), spec)
    want_d.index_copy_(0, idx, q.data.view(torch.uint8))
    want_s.index_copy_(0, idx, q.scale.reshape(-1))
    with fixed_fp8_conversion():
        att.kv_store(x, idx, data, scales, spec)
    # equal bytes where finite, NaN at the same places (a NaN's encoding is not specified)
    got_nan, want_nan = data.float().isnan(), want_d.view(fp8).float().isnan()
    assert torch.equal(got_nan, want_nan) and got_nan.sum() == 2 * d  # the rows holding NaN and inf
    assert torch.equal(data.view(torch.uint8)[~got_nan], want_d[~want_nan])
    assert torch.equal(scales.nan_to_num(-1.0), want_s.nan_to_num(-1.0)) and scales.isnan().sum() == 2
    # without idx: row i to row i (a scratch copy: the trainer's keys as the cache stores them)
    n = b * hk * t
    data2, scales2 = torch.empty(n, d, dtype=fp8, device=DEV), torch.empty(n, device=DEV)
    with fixed_fp8_conversion():
        att.kv_store(x, None, data2, scales2, spec)
    assert torch.equal(data2.view(torch.uint8), data.view(torch.uint8)[idx])
    assert torch.equal(scales2.nan_to_num(-1.0), scales[idx].nan_to_num(-1.0))


def test_kv_store_rejects_bad_input(att):
    from jetrl_cli.precision.formats import Block, Format
    from jetrl_cli.precision.quant import CastSpec

    spec = CastSpec(Format.FP8_E4M3, Block.parse("row"))
    x = torch.randn(1, 2, 3, 16, device=DEV)
    data, scales, idx = torch.zeros(8, 16, dtype=torch.float8_e4m3fn, device=DEV), torch.zeros(8, device=DEV), torch.arange(6, device=DEV)
    with pytest.raises(ValueError, match="with row scales"):
        att.kv_store(x, idx, data, scales, CastSpec(Format.FP8_E4M3, Block.parse("tensor")))
    with pytest.raises(ValueError, match=r"data must be a contiguous"):
        att.kv_store(x, idx, data.view(torch.float8_e5m2), scales, spec)
    with pytest.raises(ValueError, match=r"idx must be an int32/int64 \(6,\)"):
        att.kv_store(x, idx[:5], data, scales, spec)
    with pytest.raises(ValueError, match="scales must be contiguous float32"):
        att.kv_store(x, idx, data, scales.double(), spec)
    with pytest.raises(ValueError, match="without idx, data must have the 6 rows of x, got 8"):
        att.kv_store(x, None, data, scales, spec)
