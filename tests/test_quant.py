"""Quantizers: bit-exact against the independent slow reference, on fresh random shapes and edges."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl_cli.precision import Block, CastSpec, Format, dequantize, error_stats, quantize
from tests.slow_reference import NP_DTYPE, reference_quantize

from .conftest import fresh_seed

FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8"]
BLOCKS = ["tensor", "row", "col", "1x128", "128x1", "128x128", "1x32", "16x16"]


def assert_bit_exact(q, fmt, ref_data, ref_scale):
    got_scale = q.scale.numpy()
    np.testing.assert_array_equal(np.isnan(got_scale), np.isnan(ref_scale))
    np.testing.assert_array_equal(got_scale.view(np.uint32)[~np.isnan(got_scale)],
                                  ref_scale.view(np.uint32)[~np.isnan(ref_scale)])
    if fmt == "int8":
        np.testing.assert_array_equal(q.data.numpy(), ref_data)
        return
    got = q.data.view(torch.uint8).numpy()
    want = ref_data.view(np.uint8)
    got_nan = np.isnan(q.data.float().numpy())
    want_nan = np.isnan(ref_data.astype(np.float32))
    np.testing.assert_array_equal(got_nan, want_nan)
    np.testing.assert_array_equal(got[~got_nan], want[~want_nan])


def random_matrix(rng, m, k, kind):
    x = rng.standard_normal((m, k)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-4, 4, size=(m, 1)).astype(np.float32)  # per-row dynamic range
    if kind == "outliers":
        idx = rng.integers(0, m * k, size=max(1, m * k // 50))
        x.flat[idx] *= 1000.0
    elif kind == "zeros":
        x[: m // 2] = 0.0
    elif kind == "tiny":
        x *= np.float32(1e-38)  # subnormal fp32 range
    elif kind == "huge":
        with np.errstate(over="ignore"):
            x *= np.float32(1e34)  # the largest rows overflow to +-inf: the non-finite rule applies
    return x


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 300),
    k=st.integers(1, 300),
    fmt=st.sampled_from(FORMATS),
    block=st.sampled_from(BLOCKS),
    pow2=st.booleans(),
    kind=st.sampled_from(["normal", "outliers", "zeros", "tiny", "huge"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_bit_exact_against_slow_reference(m, k, fmt, block, pow2, kind, seed):
    x = random_matrix(np.random.default_rng(seed), m, k, kind)
    spec = CastSpec(Format(fmt), Block.parse(block), pow2)
    q = quantize(torch.from_numpy(x), spec)
    blk = Block.parse(block)
    ref_data, ref_scale = reference_quantize(x, fmt, (blk.rows, blk.cols), pow2)
    assert q.scale.shape == ref_scale.shape
    assert_bit_exact(q, fmt, ref_data, ref_scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", ["1x128", "128x128", "row", "tensor"])
def test_non_finite_rule(fmt, block):
    """A block with NaN or +-Inf gets a NaN scale and dequantizes to NaN; other blocks are untouched."""
    x = torch.randn(256, 256)
    x[3, 7] = float("nan")
    x[130, 200] = float("inf")
    x[200, 5] = -float("inf")
    spec = CastSpec(fmt, block)
    q = quantize(x, spec)
    ref_data, ref_scale = reference_quantize(x.numpy(), fmt, (spec.block.rows, spec.block.cols), False)
    assert_bit_exact(q, fmt, ref_data, ref_scale)
    d = dequantize(q)
    br, bc = spec.block.resolve(256, 256)
    for (i, j) in [(3, 7), (130, 200), (200, 5)]:
        tile = d[(i // br) * br : (i // br + 1) * br, (j // bc) * bc : (j // bc + 1) * bc]
        assert torch.isnan(tile).all()
    if block in ("1x128", "128x128"):
        assert torch.isfinite(d[0:128, 128:256]).all()  # a clean block stays clean


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_blocks_have_finite_scale(fmt):
    x = torch.zeros(5, 300)
    q = quantize(x, CastSpec(fmt, "1x128"))
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert torch.equal(dequantize(q), x)


def test_torch_fp8_cast_matches_ml_dtypes_on_every_fp32_pattern_class():
    """The cast under the quantizer: torch RNE + saturation vs ml_dtypes, on dense random bits."""
    rng = np.random.default_rng(20261123)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    vals = bits.view(np.float32)
    vals = vals[np.isfinite(vals)]
    for fmt, fmax in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        # scale the random bit patterns into the format's range, including ties and subnormals
        v = np.clip(vals / np.float32(2.0 ** rng.integers(0, 120)), -fmax, fmax).astype(np.float32)
        got = torch.from_numpy(v).to(Format(fmt).torch_dtype()).view(torch.uint8).numpy()
        want = v.astype(NP_DTYPE[fmt]).view(np.uint8)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt,x,want", [
    # scale 1 exactly (amax = the format's max): the quantizer's cast decides every tie
    ("fp8_e4m3", [1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10, 400.0, 432.0, 448.0],
     [1.0, 1.25, -1.0, 0.0, 2**-8, 384.0, 448.0, 448.0]),  # 1+1/16 -> 1 (even), 1+3/16 -> 1.25, subnormals
    ("fp8_e5m2", [1.125, 1.375, -1.125, 2**-17, 3 * 2**-17, 57344.0],
     [1.0, 1.5, -1.0, 0.0, 2**-15, 57344.0]),
    ("int8", [2.5, 3.5, -2.5, -3.5, 0.5, 127.0], [2.0, 4.0, -2.0, -4.0, 0.0, 127.0]),
])
def test_quantizer_rounds_ties_to_even(fmt, x, want):
    """jetrl's quantizer (not only torch's cast) rounds half-way values to the even neighbour."""
    q = quantize(torch.tensor([x]), CastSpec(fmt, "tensor"))
    assert float(q.scale.reshape(())) == 1.0  # amax / fmt_max, exactly
    assert q.data.float().flatten().tolist() == want
    assert dequantize(q).flatten().tolist() == want


def test_int8_never_produces_minus_128():
    x = torch.randn(64, 256) * 10
    x[0, 0] = -x.abs().max() * 1.0000001
    q = quantize(x, CastSpec("int8", "tensor"))
    assert int(q.data.min()) >= -127


def test_pow2_scale_is_power_of_two_and_upper_bound():
    x = torch.randn(64, 256) * 37.3
    q = quantize(x, CastSpec("e4m3", "1x128", pow2_scale=True))
    m, e = torch.frexp(q.scale)
    assert (m == 0.5).all()
    amax = x.reshape(64, 2, 128).abs().amax(-1)
    assert (q.scale * 448 >= amax).all()


@pytest.mark.parametrize("fmt,floor_db", [("fp8_e4m3", 28.0), ("fp8_e5m2", 22.0), ("int8", 30.0)])
def test_round_trip_sqnr(fmt, floor_db):
    x = torch.randn(257, 391)
    q = quantize(x, CastSpec(fmt, "1x128"))
    assert error_stats(x, dequantize(q))["sqnr_db"] > floor_db


def test_quantize_is_deterministic_and_keeps_shape():
    x = torch.randn(3, 5, 200)
    spec = CastSpec("e4m3", "1x128")
    a, b = quantize(x, spec), quantize(x, spec)
    assert a.data.shape == x.shape and a.scale.shape == (15, 2)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    assert dequantize(a).shape == x.shape


def test_bf16_input_is_quantized_from_its_exact_values():
    x = torch.randn(16, 256).to(torch.bfloat16)
    q = quantize(x, CastSpec("e4m3", "1x128"))
    ref_data, ref_scale = reference_quantize(x.float().numpy(), "fp8_e4m3", (1, 128), False)
    assert_bit_exact(q, "fp8_e4m3", ref_data, ref_scale)


def test_transpose_of_symmetric_block_grid():
    w = torch.randn(300, 200)
    spec = CastSpec("e4m3", "128x128")
    q = quantize(w, spec)
    qt = q.t()
    assert torch.equal(dequantize(qt), dequantize(q).t())
    direct = quantize(w.t().contiguous(), spec)
    assert torch.equal(direct.scale, qt.scale)
    assert torch.equal(direct.data.view(torch.uint8), qt.data.view(torch.uint8))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown format"):
        CastSpec("fp4", "row")
    with pytest.raises(ValueError, match="unknown granularity"):
        CastSpec("e4m3", "blocky")
    with pytest.raises(ValueError, match="amax_floor"):
        CastSpec("e4m3", "row", amax_floor=0.0)
    with pytest.raises(ValueError, match="8-bit format"):
        quantize(torch.randn(4, 4), CastSpec("bf16"))
    with pytest.raises(TypeError):
        quantize(torch.ones(4, 4, dtype=torch.int32), CastSpec("e4m3"))
    assert math.isinf(error_stats(torch.ones(3), torch.ones(3))["sqnr_db"])
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == 448


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", [Format.FP8_E4M3, Format.FP8_E5M2, Format.INT8])
def test_scales_are_the_correctly_rounded_quotient_on_every_device(device, fmt):
    """``scale = amax / fmt.max`` rounded once, as the Triton quantizers' ``div_rn`` computes it. On
    CUDA, torch divides by a Python number as a multiply by its fp32 reciprocal, 1 ulp off for some
    amax: the H100 run found the reference's scales differing from the kernels' in the last bit.
    The fp64 quotient rounded to fp32 is the correctly rounded one (fp64 has over 2 x 24 + 2 bits)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from jetrl_cli.precision.quant import compute_scale

    g = torch.Generator().manual_seed(fresh_seed())
    x = (torch.randn(256, 1024, generator=g) * torch.rand(256, 1, generator=g) * 10).to(device)
    spec = CastSpec(fmt, Block.parse("1x128" if fmt.value.startswith("fp8") else "row"))
    amax = x.abs().reshape(256, -1, spec.block.resolve(256, 1024)[1]).amax(-1)
    want = (amax.double().clamp_min(spec.amax_floor) / fmt.max).float()
    got = compute_scale(x, spec)
    assert got.shape == want.shape and torch.equal(got, want)
    # not vacuous: for some of these amax the reciprocal multiply (what CUDA did) rounds differently
    recip = amax.clamp_min(spec.amax_floor) * torch.tensor(1 / fmt.max, dtype=torch.float32, device=device)
    assert not torch.equal(recip, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_quantize_multiplies_by_the_correctly_rounded_reciprocal_on_every_device(device):
    """Rule 4: each element times ``RN(1 / scale)``, rounded once. On every device the reference's
    reciprocal is the correctly rounded one (the fp64 quotient rounded to fp32) and its data the cast of
    that product, bit for bit what the Triton kernels compute (``kernels.fp8._scaled``)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator().manual_seed(fresh_seed())
    x = (torch.randn(512, 1024, generator=g) * torch.exp2(torch.randint(-40, 40, (512, 1), generator=g).float()))
    x = x.to(device)
    for fmt in (Format.FP8_E4M3, Format.INT8):
        spec = CastSpec(fmt, Block.parse("1x128" if fmt is Format.FP8_E4M3 else "row"))
        q = quantize(x, spec)
        r = torch.reciprocal(q.scale)
        assert torch.equal(r, (1 / q.scale.double()).float())
        br, bc = spec.block.resolve(*x.shape)
        y = (x.reshape(512 // br, br, -1, bc) * r[:, None, :, None]).reshape(x.shape).clamp(-fmt.max, fmt.max)
        want = torch.round(y).to(torch.int8) if fmt is Format.INT8 else y.to(fmt.torch_dtype())
        assert torch.equal(q.data.view(torch.uint8), want.view(torch.uint8))
    # values within 3 ulps of the INT8 ties (k + 1/2) * scale: the product and the quotient round apart
    a = torch.exp2(torch.randint(-20, 20, (256, 1), generator=g).float()) * (1 + torch.rand(256, 1, generator=g))
    x = (torch.randint(0, 127, (256, 512), generator=g) + 0.5) * (a / 127) * torch.where(
        torch.rand(256, 512, generator=g) < 0.5, -1.0, 1.0)
    x = (x.view(torch.int32) + torch.randint(-3, 4, x.shape, generator=g, dtype=torch.int32)).view(torch.float32)
    x = x.clamp(-a, a)
    x[:, 0] = a[:, 0]
    q = quantize(x.to(device), CastSpec(Format.INT8, Block.parse("row")))
    s = q.scale.cpu()  # (256, 1): one a row
    assert torch.equal(q.data.cpu(), torch.round((x * torch.reciprocal(s)).clamp(-127, 127)).to(torch.int8))
    assert (torch.round((x / s).clamp(-127, 127)).to(torch.int8) != q.data.cpu()).sum() > 20
