"""The Triton quantizers (kernels/fp8.py) and the GEMM layouts (kernels/layouts.py).

Quantizers: bit for bit the pure-torch reference (data bytes and scale values), in Triton's
interpreter on CPU under the fp8 conversion fix (tests/triton_interp_fix.py), and the strides
scaled_mm needs asserted explicitly. Layouts: ``to_gemm_layout`` of reference operands equals the
Triton outputs, and torch's own shape/stride checks of ``scaled_mm`` (run on meta tensors, no GPU
needed) accept the operands of all three GEMMs of a linear layer.
"""

import collections

import pytest
import torch
import triton
import triton.language as tl

from jetrl_cli.kernels import layouts
from jetrl_cli.kernels.fp8 import RCP_NORMAL, _divisor, _over, _quotient, _rcp, _sigmoid_bwd, _silu_mul_bwd
from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.precision.quant import CastSpec, QTensor, dequantize, quantize

from .conftest import fresh_seed, triton_runs

E4, E5 = Format.FP8_E4M3, Format.FP8_E5M2
B1x128, B128x1, B128 = Block(1, 128), Block(128, 1), Block(128, 128)


needs_triton = pytest.mark.skipif(not triton_runs("ml_dtypes"),  # ml_dtypes: the interpreter fix
                                  reason="needs Triton and ml_dtypes (and a GPU or TRITON_INTERPRET=1)")


def dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fp8():
    """kernels/fp8.py, with the interpreter's fp32 -> fp8 conversion fixed when interpreting."""
    from jetrl_cli.kernels import fp8 as module

    if torch.cuda.is_available():
        yield module
    else:
        from .triton_interp_fix import fixed_fp8_conversion

        with fixed_fp8_conversion():
            yield module


def gen(seed):
    return torch.Generator().manual_seed(seed)


def spread(m, k, seed, dtype=torch.float32):
    """Values over many binades, groups of different amax, one all-zero 1x128 group."""
    g = gen(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 2) * torch.exp(
        torch.randn(1, k, generator=g))
    x[0, : min(k, 128)] = 0.0
    return x.to(dtype).to(dev())


def bytes_of(t):
    return t.view(torch.uint8)


def same_scales(a, b):
    """Equal values, NaN where the other has NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))


def same_data(a, b):
    """Equal bytes where finite; NaN at the same places (a NaN's sign is not specified)."""
    na, nb = a.float().isnan(), b.float().isnan()
    return torch.equal(na, nb) and torch.equal(bytes_of(a)[~na], bytes_of(b)[~nb])


def expected_cols(x, spec, pad_to):
    """``quantize(x, 128x1).t()`` padded with zero columns to a multiple of ``pad_to``."""
    ref = quantize(x, CastSpec(spec.format, B128x1, spec.pow2_scale, spec.amax_floor)).t()
    return layouts.to_gemm_layout(ref, pad_k_to=pad_to)


def check_rows(got, x, spec):
    m, k = x.shape
    ref = quantize(x, spec)
    assert got.spec == ref.spec
    assert got.data.shape == (m, k) and got.data.is_contiguous()
    assert got.scale.shape == (m, layouts.cdiv(k, 128)) and got.scale.stride() == (1, m)
    assert same_data(got.data, ref.data) and same_scales(got.scale, ref.scale)


def check_cols(got, x, spec, pad_to):
    m, k = x.shape
    m_pad = layouts.round_up(m, pad_to)
    want = expected_cols(x, spec, pad_to)
    assert got.spec == CastSpec(spec.format, B1x128, spec.pow2_scale, spec.amax_floor)
    assert got.data.shape == (k, m_pad) and got.data.is_contiguous()
    assert got.scale.shape == (k, layouts.cdiv(m_pad, 128)) and got.scale.stride() == (1, k)
    assert torch.all(bytes_of(got.data[:, m:]) == 0)  # zero padding, even in NaN groups
    assert same_data(got.data, want.data) and same_scales(got.scale, want.scale)


# (shape, pad_tokens_to, fmt, pow2, input dtype): every shape with both formats, pow2 or not, both dtypes
ACT_CASES = [
    ((1, 128), 1, E4, False, torch.bfloat16), ((1, 128), 256, E5, True, torch.float32),  # a group of padding only
    ((3, 300), 128, E4, True, torch.bfloat16), ((3, 300), 16, E5, False, torch.float32),
    ((129, 257), 256, E5, True, torch.bfloat16), ((129, 257), 128, E4, False, torch.float32),
    ((256, 384), 1, E5, False, torch.bfloat16), ((256, 384), 128, E4, True, torch.float32),
]


@needs_triton
@pytest.mark.parametrize("shape,pad_to,fmt,pow2,dtype", ACT_CASES)
def test_act_quantizer_rows_and_transposed_cols_are_the_reference(fp8, shape, pad_to, fmt, pow2, dtype):
    x = spread(*shape, seed=shape[0] * 1000 + shape[1] + pad_to, dtype=dtype)
    spec = CastSpec(fmt, B1x128, pow2)
    rows, cols = fp8.quantize_act(x, fmt, pow2_scale=pow2, pad_tokens_to=pad_to)
    check_rows(rows, x, spec)
    check_cols(cols, x, spec, pad_to)
    assert layouts.is_gemm_layout(rows) and layouts.is_gemm_layout(cols)
    r_only, none = fp8.quantize_act(x, fmt, pow2_scale=pow2, cols=False)
    none2, c_only = fp8.quantize_act(x, fmt, pow2_scale=pow2, rows=False, pad_tokens_to=pad_to)
    assert none is None and none2 is None
    assert torch.equal(bytes_of(r_only.data), bytes_of(rows.data)) and torch.equal(r_only.scale, rows.scale)
    assert torch.equal(bytes_of(c_only.data), bytes_of(cols.data)) and torch.equal(c_only.scale, cols.scale)


@needs_triton
@pytest.mark.parametrize("start,width", [(0, 256), (256, 128), (384, 128), (128, 300)])
def test_act_quantizer_reads_a_column_slice_in_place(fp8, start, width):
    """A linear group's Dgrad quantizes each layer's share of dy: a column slice of it, read with
    its row stride (no contiguous copy first); the result is the contiguous copy's, bit for bit."""
    whole = spread(70, 512 + 300, seed=start + width, dtype=torch.bfloat16)
    x = whole[:, start:start + width]
    assert not x.is_contiguous()
    spec = CastSpec(E4, B1x128)
    rows, cols = fp8.quantize_act(x, E4, pad_tokens_to=128)
    check_rows(rows, x.contiguous(), spec)
    check_cols(cols, x.contiguous(), spec, 128)


def swiglu_fp32(gu, exp=torch.exp):
    """``g / (1 + exp(-g)) * u`` in fp32, the SwiGLU quantizer's form, with the ``exp`` it runs."""
    g, u = gu.float().chunk(2, dim=-1)
    return g / (1 + exp(-g)) * u


def numpy_exp(x):
    """The interpreter's ``tl.exp``: numpy's fp32 exp (torch's CPU exp differs in last bits)."""
    import numpy as np

    with np.errstate(over="ignore"):
        return torch.from_numpy(np.exp(x.cpu().numpy())).to(x.device)


SWIGLU_CASES = [((2, 256), E4, False, torch.bfloat16), ((37, 512), E5, True, torch.float32),
                ((70, 768), E4, True, torch.bfloat16), ((129, 256), E4, False, torch.float32)]


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(-g) of a large -g: inf, as on a GPU
@pytest.mark.parametrize("shape,fmt,pow2,dtype", SWIGLU_CASES)
def test_swiglu_quantizer_is_the_reference_from_one_read(fp8, shape, fmt, pow2, dtype):
    """``swiglu_quantize``: gu's 1x128 copy is ``quantize(gu)`` bit for bit, and h's 1x128 operand is
    ``quantize(silu(g) * u)`` of the fp32 SwiGLU the kernel computes -- checked bit for bit with the
    exp the interpreter runs (numpy's); torch's fp32 SwiGLU differs from it in last bits only, so
    h's FP8 data matches torch's SwiGLU quantized but for rare one-step roundings. Scales are in the
    GEMM's column-major grid."""
    m, k2 = shape
    gu = spread(m, k2, seed=m * 7 + k2, dtype=dtype)
    gu[1, 5] = float("nan")  # a non-finite group of g, and h's group above it
    spec = CastSpec(fmt, B1x128, pow2)
    h, gq = fp8.swiglu_quantize(gu, fmt, pow2_scale=pow2, save=True)
    check_rows(gq, gu, spec)
    if not torch.cuda.is_available():
        check_rows(h, swiglu_fp32(gu, numpy_exp), spec)
    near = quantize(swiglu_fp32(gu), spec)
    differ = (bytes_of(h.data).int() - bytes_of(near.data).int()).abs()
    finite = ~h.data.float().isnan()
    assert int(differ[finite].max()) <= 1 and float((differ[finite] > 0).float().mean()) <= 1e-3
    assert int(h.scale.isnan().sum()) == 1 and h.scale.stride() == (1, m)
    h_only, none = fp8.swiglu_quantize(gu, fmt, pow2_scale=pow2)
    assert none is None and same_data(h_only.data, h.data) and same_scales(h_only.scale, h.scale)


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("shape,fmt,pow2,dtype,pad_to", [((2, 256), E4, False, torch.bfloat16, 128),
                                                        ((130, 512), E5, True, torch.float32, 1),
                                                        ((129, 768), E4, True, torch.bfloat16, 256)])
def test_swiglu_transposed_quantizer_is_the_reference_on_the_fp8_copy(fp8, shape, fmt, pow2, dtype, pad_to):
    """``swiglu_quantize_t``: from the FP8 copy of [g, u], its values rounded to the forward's dtype,
    h quantized 128x1 and transposed (down's Wgrad operand): what ``quantize_act`` gives on the h
    computed from the dequantized copy -- bit for bit with the interpreter's exp (numpy's); zero
    token padding; a NaN group of the copy gives NaN scales in the columns it reaches."""
    m, k2 = shape
    gu = spread(m, k2, seed=m * 11 + k2, dtype=dtype)
    gu[1, k2 // 2 + 3] = float("nan")  # a non-finite group of u: h's column 3 of token group 0
    spec = CastSpec(E4, B1x128)
    copy = quantize(gu, spec)
    got = fp8.swiglu_quantize_t(copy, dtype, fmt, pow2_scale=pow2, pad_tokens_to=pad_to)
    values = dequantize(copy).to(dtype).float()
    exp = numpy_exp if not torch.cuda.is_available() else torch.exp
    h = swiglu_fp32(values, exp)
    want_spec = CastSpec(fmt, B1x128, pow2)
    if not torch.cuda.is_available():
        check_cols(got, h, want_spec, pad_to)
    near = expected_cols(swiglu_fp32(values), want_spec, pad_to)
    differ = (bytes_of(got.data).int() - bytes_of(near.data).int()).abs()
    finite = ~got.data.float().isnan()
    assert int(differ[finite].max()) <= 1 and float((differ[finite] > 0).float().mean()) <= 1e-3
    assert int(got.scale.isnan().sum()) >= 1
    with pytest.raises(ValueError, match="swiglu_quantize_t: gu_dtype must be bfloat16 or float32"):
        fp8.swiglu_quantize_t(copy, torch.float16)


def swiglu_grad_fp32(values, gy, dtype, exp=torch.exp):
    """d[g, u] of ``silu(g) * u`` in fp32 in ``precision.linear``'s form, each half rounded to ``dtype``."""
    g, u = values.chunk(2, dim=-1)
    gy = gy.float()
    sig = 1 / (1 + exp(-g))
    return torch.cat([(gy * u * sig * (1 + g * (1 - sig))).to(dtype), (gy * g * sig).to(dtype)], dim=-1).float()


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("shape,fmt,pow2,dtype,gy_dtype,pad_to", [
    ((2, 256), E4, False, torch.bfloat16, torch.bfloat16, 128), ((130, 512), E5, True, torch.float32, torch.float32, 1),
    ((129, 768), E4, True, torch.bfloat16, torch.float32, 256), ((256, 256), E4, False, torch.float32, torch.bfloat16, 1)])
def test_swiglu_gradient_quantizer_is_the_reference_on_the_fp8_copy(fp8, shape, fmt, pow2, dtype, gy_dtype, pad_to):
    """``swiglu_grad_quantize``: d[g, u] at the values of the FP8 copy of [g, u], rounded to the
    gradient's dtype, quantized 1x128 (Dgrad's operand) and 128x1 transposed (Wgrad's) -- what
    ``quantize_act`` gives on that gradient, bit for bit with the interpreter's exp (numpy's); with
    torch's exp, the FP8 data of the two differ by one step at most, and rarely. A NaN in gy reaches
    the groups it belongs to and no others; either output alone is the same bytes. With ``h_cols``
    it also writes ``swiglu_quantize_t``'s output (down's Wgrad operand), the same bytes."""
    m, k2 = shape
    i = k2 // 2
    gu = spread(m, k2, seed=m * 13 + k2, dtype=dtype)
    copy = quantize(gu, CastSpec(E4, B1x128))
    gy = spread(m, i, seed=m * 17 + k2, dtype=gy_dtype)
    gy[-1, 3] = float("nan")  # d[g] and d[u] of the last token, column 3 of each half
    rows, cols, h_t = fp8.swiglu_grad_quantize(copy, gy, dtype, fmt, pow2_scale=pow2, pad_tokens_to=pad_to,
                                               h_cols=True)
    spec = CastSpec(fmt, B1x128, pow2)
    values = dequantize(copy)
    if not torch.cuda.is_available():
        d = swiglu_grad_fp32(values, gy, dtype, numpy_exp)
        check_rows(rows, d, spec)
        check_cols(cols, d, spec, pad_to)
    d = swiglu_grad_fp32(values, gy, dtype)
    for got, want in ((rows, quantize(d, spec)), (cols, expected_cols(d, spec, pad_to))):
        differ = (bytes_of(got.data).int() - bytes_of(want.data).int()).abs()
        finite = ~(got.data.float().isnan() | want.data.float().isnan())
        assert int(differ[finite].max()) <= 1 and float((differ[finite] > 0).float().mean()) <= 1e-3
    nan_rows = rows.scale.isnan().nonzero().tolist()
    assert nan_rows == [[m - 1, 0], [m - 1, i // 128]]
    assert int(cols.scale.isnan().sum()) == 2 and bool(cols.scale[3, (m - 1) // 128].isnan())
    r_only, none, none_h = fp8.swiglu_grad_quantize(copy, gy, dtype, fmt, pow2_scale=pow2, cols=False)
    none2, c_only, _ = fp8.swiglu_grad_quantize(copy, gy, dtype, fmt, pow2_scale=pow2, rows=False,
                                                pad_tokens_to=pad_to)
    none3, none4, h_only = fp8.swiglu_grad_quantize(copy, gy, dtype, fmt, pow2_scale=pow2, rows=False, cols=False,
                                                    pad_tokens_to=pad_to, h_cols=True)
    assert none is None and none2 is None and none_h is None and none3 is None and none4 is None
    assert same_data(r_only.data, rows.data) and same_scales(r_only.scale, rows.scale)
    assert same_data(c_only.data, cols.data) and same_scales(c_only.scale, cols.scale)
    want_h = fp8.swiglu_quantize_t(copy, dtype, fmt, pow2_scale=pow2, pad_tokens_to=pad_to)
    for got in (h_t, h_only):
        assert got.data.shape == want_h.data.shape and got.scale.stride() == want_h.scale.stride()
        assert same_data(got.data, want_h.data) and same_scales(got.scale, want_h.scale)


@triton.jit
def silu_rcp_kernel(g_ptr, u_ptr, sig_ptr, h_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g, u = tl.load(g_ptr + i), tl.load(u_ptr + i)
    tl.store(sig_ptr + i, _sigmoid_bwd(g))
    tl.store(h_ptr + i, _silu_mul_bwd(g, u))


def approximate_backward(fp8, monkeypatch, on=True):
    """``kernels.fp8.APPROX_BACKWARD`` as a GPU sets it, in the interpreter (whose stand-in for the
    reciprocal unit is the correctly rounded reciprocal one ulp off)."""
    monkeypatch.setattr(fp8, "APPROX_BACKWARD", tl.constexpr(on))


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_the_swiglu_backwards_reciprocal_is_approximate_on_a_gpu_only(fp8, monkeypatch):
    """Where ``APPROX_BACKWARD`` is on (a GPU), the SwiGLU backward's ``1 / (1 + exp(-g))`` is the reciprocal
    unit's (one ulp off here, in the interpreter's stand-in), sigmoid and h alike; where it is off (the
    interpreter) the correctly rounded one: the reference's ``1 / d`` and ``g / d * u``."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter's switch: on a GPU the kernels are compiled")
    g_, seed = fresh_gen()
    g = torch.randn(1 << 12, generator=g_) * 8
    g[:4] = torch.tensor([0.0, -0.0, -100.0, 100.0])  # exp(-g) infinite, and 0
    u = torch.randn(1 << 12, generator=g_)
    d = 1 + numpy_exp(-g)
    for on in (False, True):
        approximate_backward(fp8, monkeypatch, on)
        sig, h = torch.empty_like(g), torch.empty_like(g)
        silu_rcp_kernel[(4,)](g, u, sig, h, BLOCK=1 << 10)
        exact_sig, exact_h = 1 / d, g / d * u
        ulps = (sig.view(torch.int32) - exact_sig.view(torch.int32)).abs()
        assert int(ulps.max()) <= (1 if on else 0) and bool((ulps > 0).any()) is on, (seed, on)
        assert sig[2] == 0.0 and (on or sig[3] == 1.0)  # 1 / inf, 1 / 1
        assert torch.allclose(h, exact_h, rtol=2**-21, atol=0) and torch.equal(h.signbit(), exact_h.signbit())
        assert torch.equal(h, exact_h) is not on, (seed, on)  # h takes the same reciprocal


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("shape,dtype,pad_to", [((130, 512), torch.bfloat16, 128), ((256, 256), torch.float32, 1)])
def test_the_swiglu_backward_with_the_approximate_reciprocal_stays_within_a_step(fp8, monkeypatch, shape, dtype, pad_to):
    """The SwiGLU backward's kernels as a GPU runs them (``APPROX_BACKWARD``), in the interpreter: d[g, u]
    1x128 and 128x1 and h^T are the reference's bytes but for rare one-step roundings (the FP8 step
    is 2^19 of the reciprocal's ulp), NaN groups where the reference's are; the two-kernel form and the
    one-kernel form agree bit for bit, as they do with the exact reciprocal."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter's switch: on a GPU the kernels are compiled")
    approximate_backward(fp8, monkeypatch)
    m, k2 = shape
    i = k2 // 2
    gu = spread(m, k2, seed=m * 19 + k2, dtype=dtype)
    copy = quantize(gu, CastSpec(E4, B1x128))
    gy = spread(m, i, seed=m * 23 + k2, dtype=dtype)
    gy[-1, 3] = float("nan")
    spec = CastSpec(E4, B1x128)
    values = dequantize(copy)
    d = swiglu_grad_fp32(values, gy, dtype, numpy_exp)
    h = swiglu_fp32(values.to(dtype).float(), numpy_exp)
    outs = {}
    for one in (True, False):
        with fp8.tile_warps(8, one):
            outs[one] = fp8.swiglu_grad_quantize(copy, gy, dtype, E4, pad_tokens_to=pad_to, h_cols=True)
    for a, b in zip(outs[True], outs[False]):
        assert same_data(a.data, b.data) and same_scales(a.scale, b.scale)
    rows, cols, h_t = outs[False]
    for got, want in ((rows, quantize(d, spec)), (cols, expected_cols(d, spec, pad_to)),
                      (h_t, expected_cols(h, spec, pad_to))):
        assert torch.equal(got.scale.isnan(), want.scale.isnan())
        differ = (bytes_of(got.data).int() - bytes_of(want.data).int()).abs()
        finite = ~(got.data.float().isnan() | want.data.float().isnan())
        assert int(differ[finite].max()) <= 1 and float((differ[finite] > 0).float().mean()) <= 1e-3


@needs_triton
def test_swiglu_gradient_quantizer_refuses_what_it_cannot_read(fp8):
    copy = quantize(torch.randn(4, 256), CastSpec(E4, B1x128))
    with pytest.raises(ValueError, match="swiglu_grad_quantize: gy must be 4 x 128"):
        fp8.swiglu_grad_quantize(copy, torch.randn(4, 256), torch.bfloat16)
    with pytest.raises(ValueError, match="swiglu_grad_quantize: out_dtype must be bfloat16 or float32"):
        fp8.swiglu_grad_quantize(copy, torch.randn(4, 128), torch.float16)
    with pytest.raises(ValueError, match="swiglu_grad_quantize: takes a 2-D 1x128 copy"):
        fp8.swiglu_grad_quantize(quantize(torch.randn(4, 256), CastSpec(E4, B128x1)), torch.randn(4, 128),
                                 torch.bfloat16)


@needs_triton
def test_swiglu_quantizer_takes_whole_groups_only(fp8):
    with pytest.raises(ValueError, match="swiglu_quantize: gu's width must be a multiple of 256"):
        fp8.swiglu_quantize(torch.randn(4, 384))


# (rows, width, residual x dtype, delta dtype or None, output dtype, format, pow2): widths that are and
# are not whole 128-wide groups, a row count that is not a multiple of the kernel's rows per program
NORM_CASES = [(7, 320, torch.float32, torch.bfloat16, torch.float32, E4, False),
              (9, 256, torch.bfloat16, torch.bfloat16, torch.bfloat16, E5, True),
              (5, 384, torch.float32, None, torch.float32, E4, True),
              (1, 96, torch.bfloat16, None, torch.float32, E4, False)]


@needs_triton
@pytest.mark.parametrize("m,n,x_dtype,d_dtype,out,fmt,pow2", NORM_CASES)
def test_norm_quantizer_is_the_add_the_norm_and_the_quantizer_of_its_output(fp8, m, n, x_dtype, d_dtype, out, fmt, pow2):
    """``rms_norm_quantize``: s is torch's ``x + delta`` bit for bit; y is RMSNorm(s) * w to within
    fp32 rounding (the sum of squares in the kernel's order), rounded to the output dtype; r is
    the per-row 1 / sqrt(mean(s^2) + eps); and the FP8 operand is ``quantize(y, 1x128)`` bit for bit
    on the kernel's own y -- the same bytes when y is not written. Random inputs, an all-zero row
    and a row holding a NaN (its groups' scales NaN, as the quantizer's)."""
    g = gen(m * 31 + n)
    x = (torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).to(x_dtype).to(dev())
    delta = None if d_dtype is None else torch.randn(m, n, generator=g).to(d_dtype).to(dev())
    w = (torch.rand(n, generator=g) + 0.5).to(dev())
    x[0] = 0.0
    if delta is not None:
        delta[0] = 0.0
    if m > 2:
        x[2, n - 1] = float("nan")
    eps = 1e-6
    s, y, r, q = fp8.rms_norm_quantize(x, delta, w, eps, out, fmt, pow2, write_y=True, rsqrt=True)
    s_ref = x if delta is None else x + delta
    assert (s is None) == (delta is None) and (s is None or (s.dtype == s_ref.dtype and same_scales(s, s_ref)))
    sd = s_ref.double()
    r_ref = 1 / torch.sqrt((sd * sd).mean(-1) + eps)
    y_ref = sd * r_ref[:, None] * w.double()
    ok = ~torch.isnan(y_ref).any(-1)
    assert y.dtype == out and torch.isnan(y[~ok]).any(-1).all()
    tol = 2.0**-8 if out is torch.bfloat16 else 2.0**-20  # a rounding of y, or a few fp32 ulps
    assert ((y[ok].double() - y_ref[ok]).abs() <= tol * y_ref[ok].abs() + 1e-30).all()
    assert ((r[ok].double() - r_ref[ok]).abs() <= 2.0**-21 * r_ref[ok]).all()
    check_rows(q, y, CastSpec(fmt, B1x128, pow2))
    assert (torch.isnan(q.scale).any(-1) == ~ok).all()
    none_s, none_y, none_r, q_only = fp8.rms_norm_quantize(x, delta, w, eps, out, fmt, pow2)
    assert none_y is none_r is None and same_data(q_only.data, q.data) and same_scales(q_only.scale, q.scale)
    assert none_s is None or same_scales(none_s, s)


@needs_triton
@pytest.mark.parametrize("m,n,d_dtype", [(7, 320, torch.bfloat16), (5, 512, None)])
def test_norm_quantizer_looped_over_a_wide_row_writes_the_unrolled_bits(fp8, monkeypatch, m, n, d_dtype):
    """Rows wider than ``NORM_UNROLL_MAX`` (an 8B model's 4096) loop over their 128-wide chunks instead of
    unrolling them: the same s, y, r, FP8 data and scales (the chunks' scales gathered into one tile and
    stored once in both forms), a NaN row's groups included; the INT8 norm likewise."""
    from jetrl_cli.kernels import int8

    g = gen(m * 37 + n)
    x = (torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).to(dev())
    delta = None if d_dtype is None else torch.randn(m, n, generator=g).to(d_dtype).to(dev())
    x[2, 5] = float("nan")
    w = (torch.rand(n, generator=g) + 0.5).to(dev())
    runs = {}
    for widest in (fp8.NORM_UNROLL_MAX, 128):
        monkeypatch.setattr(fp8, "NORM_UNROLL_MAX", widest)
        monkeypatch.setattr(int8, "NORM_UNROLL_MAX", widest)
        runs[widest] = (fp8.rms_norm_quantize(x, delta, w, 1e-6, torch.float32, write_y=True, rsqrt=True),
                        int8.rms_norm_quantize(x, delta, w, 1e-6, torch.bfloat16, write_y=True, rsqrt=True))
    (unrolled, unrolled8), (looped, looped8) = runs.values()
    for a, b in ((unrolled, looped), (unrolled8, looped8)):
        for u, v in zip(a[:3], b[:3]):
            assert (u is None) == (v is None) and (u is None or same_scales(u, v))
        assert torch.equal(a[3].data.view(torch.uint8), b[3].data.view(torch.uint8))
        assert same_scales(a[3].scale, b[3].scale)
    assert bool(unrolled[3].scale[2].isnan().all()) and not unrolled[3].scale[3].isnan().any()


@needs_triton
def test_norm_quantizer_rejects_what_it_cannot_take(fp8):
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="rms_norm_quantize: delta must be a bfloat16 or float32"):
        fp8.rms_norm_quantize(x, torch.randn(4, 128), torch.ones(256), 1e-6, torch.float32)
    with pytest.raises(ValueError, match="rms_norm_quantize: weight must be"):
        fp8.rms_norm_quantize(x, None, torch.ones(128), 1e-6, torch.float32)
    with pytest.raises(ValueError, match="rms_norm_quantize: x must be"):
        fp8.rms_norm_quantize(x.half(), None, torch.ones(256), 1e-6, torch.float32)

@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_non_finite_groups_get_nan_scales_and_padding_stays_zero(fp8, dtype):
    x = spread(130, 300, seed=7)
    x[3, 5] = float("inf")  # row 3 group 0; column 5 token group 0
    x[129, 200] = float("nan")  # row 129 group 1; column 200 token group 1 (the partial one)
    x[60, 290] = -float("inf")  # row 60 group 2 (partial); column 290 token group 0
    x = x.to(dtype)
    rows, cols = fp8.quantize_act(x, E4, pad_tokens_to=256)
    spec = CastSpec(E4, B1x128)
    check_rows(rows, x, spec)
    check_cols(cols, x, spec, 256)
    assert int(rows.scale.isnan().sum()) == 3 and int(cols.scale.isnan().sum()) == 3
    w, wt = fp8.quantize_weight(x, E5, transposed=True)
    ref = quantize(x, CastSpec(E5, B128))
    assert int(ref.scale.isnan().sum()) == 3  # blocks (0, 0), (1, 1), (0, 2)
    assert same_scales(w.scale, ref.scale) and same_data(w.data, ref.data)
    assert same_scales(wt.scale, ref.scale.t()) and same_data(wt.data, ref.data.t())


def _above_max(m, fmt, seed):
    """amax values for which amax / (amax / fmt_max) exceeds fmt_max in fp32 (by an ulp or two)."""
    g = gen(seed)
    amax = torch.exp(torch.empty(50 * m).uniform_(-20, 80, generator=g)).float()
    over = amax / (amax / fmt.max) > fmt.max
    return amax[over][:m]


@needs_triton
@pytest.mark.parametrize("fmt", [E4, E5])
def test_huge_values_saturate_and_all_zero_tensors_get_the_floor_scale(fp8, fmt):
    m = 8
    peaks = _above_max(m, fmt, seed=11)
    assert len(peaks) == m  # the case is present, so the test can fail
    x = (torch.rand(m, 256, generator=gen(12)) * 2 - 1) * peaks[:, None] / 4  # below each row's peak
    x[:, 7] = peaks
    x[:, 9] = -peaks
    x[0, 100] = 3.0e38  # near fp32 max: its group's scale is huge but finite
    x = x.to(dev())
    for pow2 in (False, True):
        rows, cols = fp8.quantize_act(x, fmt, pow2_scale=pow2)
        spec = CastSpec(fmt, B1x128, pow2)
        check_rows(rows, x, spec)
        check_cols(cols, x, spec, 1)
        if not pow2:  # the peaks' quotients, just above the format's max, land on it
            assert torch.all(rows.data[1:, 7].float() == fmt.max) and torch.all(rows.data[1:, 9].float() == -fmt.max)
    zeros = torch.zeros(3, 200, device=dev())
    rows, cols = fp8.quantize_act(zeros, fmt, amax_floor=1e-6)
    spec = CastSpec(fmt, B1x128, False, 1e-6)
    check_rows(rows, zeros, spec)
    check_cols(cols, zeros, spec, 1)
    assert torch.all(rows.scale == layouts.zero_group_scale(spec)) and torch.all(bytes_of(rows.data) == 0)


WEIGHT_CASES = [((1, 128), E4, False, torch.float32), ((3, 300), E5, True, torch.bfloat16),
                ((129, 257), E4, True, torch.float32), ((256, 384), E5, False, torch.bfloat16),
                ((384, 640), E4, False, torch.bfloat16)]


@needs_triton
@pytest.mark.parametrize("shape,fmt,pow2,dtype", WEIGHT_CASES)
def test_weight_quantizer_and_its_transpose_are_the_reference(fp8, shape, fmt, pow2, dtype):
    n, k = shape
    w = (spread(n, k, seed=n * 1000 + k) * 0.02).to(dtype)
    ref = quantize(w, CastSpec(fmt, B128, pow2))
    q, qt = fp8.quantize_weight(w, fmt, pow2_scale=pow2, transposed=True)
    for got, want in ((q, ref), (qt, ref.t())):
        r, c = want.data.shape
        gr, gc, l4 = layouts.cdiv(r, 128), layouts.cdiv(c, 128), layouts.padded_groups(c)
        assert got.spec == want.spec and got.data.shape == (r, c) and got.data.is_contiguous()
        assert got.scale.shape == (gr, gc) and (got.scale.stride() == (l4, 1) or gr == 1)
        assert same_data(got.data, want.data) and same_scales(got.scale, want.scale)
        buf = layouts.scale_buffer(got)
        assert buf.shape == (gr, l4) and buf.is_contiguous() and torch.all(buf[:, gc:] == 1.0)
    alone = fp8.quantize_weight(w, fmt, pow2_scale=pow2)
    assert isinstance(alone, QTensor) and torch.equal(bytes_of(alone.data), bytes_of(q.data))
    assert torch.equal(layouts.scale_buffer(alone), layouts.scale_buffer(q))


@needs_triton
@pytest.mark.parametrize("sizes,k,fmt,pow2,dtype", [((256, 128, 40), 300, E4, False, torch.float32),
                                                   ((128, 384), 128, E5, True, torch.bfloat16)])
def test_weight_stack_is_the_layers_quantizations_side_by_side(fp8, sizes, k, fmt, pow2, dtype):
    """``quantize_weight_stack``: the layers' 128x128 quantizations written where they lie in the
    group's stacked W and side-by-side W^T -- the concatenation of ``quantize_weight``'s results, bit
    for bit, in the GEMM layout; written in place into held operands; layers whose N (before the
    last) is not a whole number of blocks refused."""
    ws = [(spread(n, k, seed=n + i) * 0.02).to(dtype) for i, n in enumerate(sizes)]
    w, wt = fp8.quantize_weight_stack(ws, fmt, pow2_scale=pow2, transposed=True)
    ref = [fp8.quantize_weight(x, fmt, pow2_scale=pow2, transposed=True) for x in ws]
    for got, parts, dim in ((w, [r[0] for r in ref], 0), (wt, [r[1] for r in ref], 1)):
        assert got.spec == parts[0].spec and layouts.is_gemm_layout(got)
        assert torch.equal(bytes_of(got.data), torch.cat([bytes_of(p.data) for p in parts], dim))
        assert same_scales(got.scale, torch.cat([p.scale for p in parts], dim))
        assert torch.all(layouts.scale_buffer(got)[:, got.scale.shape[1]:] == 1.0)
    again = fp8.quantize_weight_stack([x * 2 for x in ws], fmt, pow2_scale=pow2, transposed=True, held=(w, wt))
    assert again[0].data.data_ptr() == w.data.data_ptr() and again[1].data.data_ptr() == wt.data.data_ptr()
    fresh = fp8.quantize_weight_stack([x * 2 for x in ws], fmt, pow2_scale=pow2, transposed=True)
    assert torch.equal(bytes_of(w.data), bytes_of(fresh[0].data)) and torch.equal(bytes_of(wt.data), bytes_of(fresh[1].data))
    alone, none = fp8.quantize_weight_stack(ws, fmt, pow2_scale=pow2)
    assert none is None
    assert torch.equal(bytes_of(alone.data), torch.cat([bytes_of(r[0].data) for r in ref]))
    with pytest.raises(ValueError, match="every N but the last a multiple of 128"):
        fp8.quantize_weight_stack([ws[-1], ws[0]] if sizes[-1] % 128 else [ws[0][:100], ws[1]], fmt)


@needs_triton
def test_weight_stacks_of_a_model_are_one_launch_and_the_groups_bits(fp8, monkeypatch):
    """``quantize_weight_stacks``: groups of other widths, heights and dtypes (a step's q/k/v, o,
    gate/up and down, fp32 and bf16 masters) quantized by one launch per weight dtype and their W^T
    bytes moved by one more -- bit for bit each group's ``quantize_weight_stack``, scales and pads
    included, with or without W^T; held operands written in place."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    groups = [[torch.randn(256, 200, generator=gen) * 0.02, torch.randn(100, 200, generator=gen)],
              [torch.randn(132, 384, generator=gen).to(torch.bfloat16)],
              [torch.randn(128, 128, generator=gen), torch.randn(384, 128, generator=gen) * 30,
               torch.zeros(64, 128)],
              [torch.randn(520, 140, generator=gen).to(torch.bfloat16)],
              [torch.randn(256, 128, generator=gen), torch.randn(128, 140, generator=gen)]]
    # on the device the kernels run on (a GPU's Triton takes no host tensor); the last one strided
    groups = [[w.to(dev()) for w in ws] for ws in groups]
    groups[4][1] = groups[4][1].t()
    groups[0][1][3, 7] = float("nan")  # a NaN block: a NaN scale in W's and in W^T's grid
    launches = collections.Counter()
    for name in ("_weight_quant_kernel", "_transpose_words_kernel"):
        kernel = getattr(fp8, name)

        class Counted:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launches[name] += 1
                return kernel[grid]

        monkeypatch.setattr(fp8, name, Counted())
    for transposed in (True, False):
        launches.clear()
        with fp8.transpose_with("triton"), fp8.wt_with("after"):  # W^T by the transpose on a GPU too
            got = fp8.quantize_weight_stacks(groups, E4, transposed=transposed)
        assert launches == ({"_weight_quant_kernel": 2, "_transpose_words_kernel": 1} if transposed
                            else {"_weight_quant_kernel": 2})  # fp32 and bf16 weights, one launch each
        for ws, (w, wt) in zip(groups, got):
            want_w, want_t = fp8.quantize_weight_stack(ws, E4, transposed=transposed)
            assert (wt is None) == (not transposed)
            for a, b in ((w, want_w), (wt, want_t)) if transposed else ((w, want_w),):
                assert a.spec == b.spec and layouts.is_gemm_layout(a)
                assert torch.all(layouts.scale_buffer(a)[:, a.scale.shape[1]:] == 1.0)  # the pads
                assert torch.equal(bytes_of(a.data), bytes_of(b.data))
                assert torch.equal(layouts.scale_buffer(a).view(torch.int32), layouts.scale_buffer(b).view(torch.int32))
        assert bool(got[0][0].scale.isnan().any()) and (not transposed or bool(got[0][1].scale.isnan().any()))
    # the strided weight made contiguous here: the kernel reads a copy of it, new at each call, whose
    # address (a table field) a CPU may hand out anew each time
    groups = [[w.contiguous() for w in ws] for ws in groups]
    helds = fp8.quantize_weight_stacks(groups, E4, transposed=True)
    tables = dict(fp8._JOB_TABLES)
    with fp8.transpose_with("triton"):  # the same tensors and outputs again: the same job tables, kept on the device
        fp8.quantize_weight_stacks(groups, E4, transposed=True, helds=helds)
        n = len(fp8._JOB_TABLES)
        fp8.quantize_weight_stacks(groups, E4, transposed=True, helds=helds)
    kept = fp8._JOB_TABLES
    assert len(kept) == n and all(kept[k] is t for k, t in tables.items() if k in kept)
    again = fp8.quantize_weight_stacks([[x * 2 for x in ws] for ws in groups], E4, transposed=True, helds=helds)
    fresh = fp8.quantize_weight_stacks([[x * 2 for x in ws] for ws in groups], E4, transposed=True)
    for (w, wt), (hw, hwt), (fw, fwt) in zip(again, helds, fresh):
        assert w.data.data_ptr() == hw.data.data_ptr() and wt.data.data_ptr() == hwt.data.data_ptr()
        assert torch.equal(bytes_of(w.data), bytes_of(fw.data)) and torch.equal(bytes_of(wt.data), bytes_of(fwt.data))
    with pytest.raises(ValueError, match="quantize_weight_stacks: weights .*: each needs the same K"):
        fp8.quantize_weight_stacks([groups[1], [groups[0][1], groups[0][0]]], E4)


@needs_triton
def test_weight_stacks_in_one_buffer_reuse_their_job_tables_wherever_they_land(fp8, monkeypatch):
    """``stacks_in_one_buffer`` (a CUDA graph capture's weights and its warm-up's): every group's operands
    in one buffer per kind, at offsets fixed by the shapes, so a second call -- its buffer elsewhere --
    finds the first's job tables (a capture cannot copy a new one to the device); the bits are those of
    one allocation per group, and the operands are where the GEMMs want them (16-byte aligned)."""
    monkeypatch.setattr(fp8, "_JOB_TABLES", collections.OrderedDict())  # this test's own, dropped after it
    monkeypatch.setattr(fp8, "_CAPTURED_TABLES", {})
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    groups = [[torch.randn(256, 384, generator=gen) * 0.02, torch.randn(128, 384, generator=gen)],
              [torch.randn(384, 384, generator=gen)], [torch.randn(256, 128, generator=gen).to(torch.bfloat16)]]
    groups = [[w.to(dev()) for w in ws] for ws in groups]
    want = fp8.quantize_weight_stacks(groups, E4, transposed=True)
    with fp8.transpose_with("triton"), fp8.stacks_in_one_buffer():
        first = fp8.quantize_weight_stacks(groups, E4, transposed=True)
        tables = len(fp8._JOB_TABLES)
        spare = torch.empty(4096, device=dev())  # the next buffer lands elsewhere
        second = fp8.quantize_weight_stacks(groups, E4, transposed=True)
    assert first[0][0].data.data_ptr() != second[0][0].data.data_ptr()
    assert len(fp8._JOB_TABLES) == tables  # no new table: the same offsets
    # a capture's tables outlive the cache's turnover: its replays read them where they were
    held = dict(fp8._JOB_TABLES)
    monkeypatch.setattr(fp8, "_stream_capturing", lambda dev: True)
    with fp8.stacks_in_one_buffer():
        fp8.quantize_weight_stacks(groups, E4, transposed=True)
    monkeypatch.setattr(fp8, "_stream_capturing", lambda dev: False)
    captured = [t for (c, k), t in fp8._CAPTURED_TABLES.items() if c == id(fp8._JOB_TABLES)]
    assert captured and all(any(t is h for h in held.values()) for t in captured)
    for i in range(fp8._KEPT + 1):  # the cache turns over
        fp8._kept(fp8._JOB_TABLES, ("test", i), torch.device(dev()), "test", lambda: torch.zeros(1, dtype=torch.int64))
    assert not any(t is h for t in captured for h in fp8._JOB_TABLES.values())
    assert all(any(t is h for h in fp8._CAPTURED_TABLES.values()) for t in captured)
    data = second[0][0].data.untyped_storage().data_ptr()
    for (w, wt), (a, at) in zip(second, want):
        assert w.data.untyped_storage().data_ptr() == wt.data.untyped_storage().data_ptr() == data  # one buffer
        for q, r in ((w, a), (wt, at)):
            assert layouts.is_gemm_layout(q) and q.data.data_ptr() % 16 == 0 and q.scale.data_ptr() % 16 == 0
            assert torch.equal(bytes_of(q.data), bytes_of(r.data))
            assert torch.equal(layouts.scale_buffer(q).view(torch.int32), layouts.scale_buffer(r).view(torch.int32))
    del spare


@needs_triton
def test_quantize_dispatch_keeps_the_natural_layouts(fp8):
    """``fp8.quantize(x, spec)`` (the triton backend's cast) returns the reference's shapes; its
    128x1 result is a view of the x^T the kernel wrote, so ``.t()`` (Wgrad) copies no data."""
    x = spread(200, 256, seed=3)
    for block in (B1x128, B128x1, B128):
        spec = CastSpec(E4, block)
        got, ref = fp8.quantize(x, spec), quantize(x, spec)
        assert got.spec == spec and got.data.shape == ref.data.shape and got.scale.shape == ref.scale.shape
        assert same_data(got.data, ref.data) and same_scales(got.scale, ref.scale)
        assert torch.equal(dequantize(got), dequantize(ref))
    xt = x.t()  # a strided input: read through its strides, no copy
    got, ref = fp8.quantize(xt, CastSpec(E5, B1x128)), quantize(xt.contiguous(), CastSpec(E5, B1x128))
    assert same_data(got.data, ref.data) and same_scales(got.scale, ref.scale)
    col = fp8.quantize(x, CastSpec(E4, B128x1))
    assert col.t().data.data_ptr() == col.data.data_ptr()
    assert fp8.quantize(x, CastSpec(Format.INT8, B1x128)) is None
    assert fp8.quantize(x, CastSpec(E4, "row")) is None
    assert fp8.quantize(x, CastSpec(E4, B1x128, amax_floor=1e-40)) is None  # a subnormal scale: reference


@needs_triton
def test_bad_input_is_a_clear_error(fp8):
    x = torch.randn(4, 128)
    with pytest.raises(ValueError, match="quantize_act: the Triton quantizers take fp8_e4m3 or fp8_e5m2, not int8"):
        fp8.quantize_act(x, Format.INT8)
    with pytest.raises(ValueError, match="quantize_weight: the Triton quantizers take a 2-D tensor"):
        fp8.quantize_weight(x[None])
    with pytest.raises(ValueError, match="take bfloat16, float16 or float32 input, not torch.int32"):
        fp8.quantize_act(x.int())
    with pytest.raises(ValueError, match="pad_tokens_to must be >= 1"):
        fp8.quantize_act(x, pad_tokens_to=0)
    with pytest.raises(ValueError, match="amax_floor >= "):
        fp8.quantize_act(x, amax_floor=1e-40)


@needs_triton
@pytest.mark.parametrize("pad_to", [1, 128])
def test_reference_operands_in_gemm_layout_equal_the_triton_ones(fp8, pad_to):
    """``to_gemm_layout`` of reference QTensors: same bytes, same scale values, same strides."""
    x = spread(200, 300, seed=5)
    rows, cols = fp8.quantize_act(x, E4, pad_tokens_to=pad_to)
    q, qt = fp8.quantize_weight(x, E4, transposed=True)
    pairs = ((rows, layouts.to_gemm_layout(quantize(x, CastSpec(E4, B1x128)))),
             (cols, layouts.to_gemm_layout(quantize(x, CastSpec(E4, B128x1)).t(), pad_k_to=pad_to)),
             (q, layouts.to_gemm_layout(quantize(x, CastSpec(E4, B128)))),
             (qt, layouts.to_gemm_layout(quantize(x, CastSpec(E4, B128)).t())))
    for got, want in pairs:
        assert got.spec == want.spec and layouts.is_gemm_layout(want)
        assert got.data.shape == want.data.shape and got.data.stride() == want.data.stride()
        assert got.scale.shape == want.scale.shape and got.scale.stride() == want.scale.stride()
        assert torch.equal(bytes_of(got.data), bytes_of(want.data)) and torch.equal(got.scale, want.scale)
    assert torch.equal(layouts.scale_buffer(q), layouts.scale_buffer(pairs[2][1]))


@needs_triton
def test_wgrad_on_padded_transposed_operands_equals_the_unpadded_product(fp8):
    """dW = dy^T @ x from quantize_act's cols (tokens padded to 128): the blockwise GEMM gives the
    emulated product of the reference 128x1 operands; the zero padding adds nothing."""
    from jetrl_cli.precision.gemm import EmulatedBackend
    from jetrl_cli.precision.quant import error_stats

    t, n, k = 200, 128, 256
    x, dy = spread(t, k, seed=21), spread(t, n, seed=22) * 1e-3
    a, b = fp8.quantize_act(dy, E4, pad_tokens_to=128)[1], fp8.quantize_act(x, E4, pad_tokens_to=128)[1]
    assert a.data.shape == (n, 256) and b.data.shape == (k, 256)
    ref = EmulatedBackend().mm(quantize(dy, CastSpec(E4, B128x1)).t(), quantize(x, CastSpec(E4, B128x1)).t())
    assert error_stats(ref, EmulatedBackend().mm(a, b))["rel_err"] < 1e-6  # same terms, zeros added
    assert error_stats(ref, fp8.blockwise_mm(a, b))["rel_err"] < 1e-3  # fp32 sums in another order (GPU: ~1e-4)


# ---------------------------------------------------------------- layouts alone (no Triton needed)


def test_to_gemm_layout_strides_padding_and_errors():
    x = torch.randn(3, 300, generator=gen(1))
    spec = CastSpec(E5, B1x128, True)
    g = layouts.to_gemm_layout(quantize(x, spec), pad_k_to=512)
    assert g.data.shape == (3, 512) and g.scale.shape == (3, 4) and g.scale.stride() == (1, 3)
    assert torch.all(bytes_of(g.data[:, 300:]) == 0) and torch.all(g.scale[:, 3] == layouts.zero_group_scale(spec))
    assert layouts.zero_group_scale(spec) == 2.0**-55  # 1e-12 / 57344 = 1.74e-17, rounded up to 2^-55
    w = quantize(torch.randn(300, 300, generator=gen(2)), CastSpec(E4, B128))
    gw = layouts.to_gemm_layout(w)
    assert gw.scale.stride() == (4, 1) and torch.equal(gw.scale, w.scale)
    assert torch.equal(layouts.scale_buffer(gw)[:, 3], torch.ones(3))
    assert layouts.to_gemm_layout(gw).scale.stride() == (4, 1)  # idempotent
    assert not layouts.is_gemm_layout(quantize(x, CastSpec(E4, B1x128)))  # row-major scales
    assert not layouts.is_gemm_layout(w)  # 3 K-groups, not padded to 4
    with pytest.raises(ValueError, match=r"a 128x1 operand is q.t\(\)"):
        layouts.to_gemm_layout(quantize(x, CastSpec(E4, B128x1)))
    with pytest.raises(ValueError, match="not in the GEMM layout"):
        layouts.scaled_mm_scale(w, "b")


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.skipif(not hasattr(torch.nn.functional, "scaled_mm"), reason="torch.nn.functional.scaled_mm: torch >= 2.10")
def test_scaled_mm_accepts_the_three_gemms_operands():
    """torch's own checks of scaled_mm (meta_scaled_mm_v2, run on meta tensors) accept Fprop, Dgrad
    and Wgrad operands in the GEMM layout, and reject the reference's row-major 1x128 scales."""
    F = torch.nn.functional
    rec = {B1x128: F.ScalingType.BlockWise1x128, B128: F.ScalingType.BlockWise128x128}
    t, k, n = 256, 384, 640  # 3 K-groups (padded to 4 in the 128x128 grid), 5 N-groups (to 8)
    x, w, dy = torch.randn(t, k, generator=gen(1)), torch.randn(n, k, generator=gen(2)), torch.randn(t, n, generator=gen(3))
    q = layouts.to_gemm_layout
    fwd = (q(quantize(x, CastSpec(E4, B1x128))), q(quantize(w, CastSpec(E4, B128))))
    dgrad = (q(quantize(dy, CastSpec(E4, B1x128))), q(quantize(w, CastSpec(E4, B128)).t()))
    wgrad = (q(quantize(dy, CastSpec(E4, B128x1)).t(), 128), q(quantize(x, CastSpec(E4, B128x1)).t(), 128))
    for (a, b), shape in ((fwd, (t, n)), (dgrad, (t, k)), (wgrad, (n, k))):
        sa, sb = layouts.scaled_mm_scale(a, "a"), layouts.scaled_mm_scale(b, "b")
        out = F.scaled_mm(_meta(a.data), _meta(b.data).t(), _meta(sa), rec[a.spec.block], _meta(sb), rec[b.spec.block])
        assert tuple(out.shape) == shape
        la, lb = layouts.scaled_mm_scale(a, "a", "legacy"), layouts.scaled_mm_scale(b, "b", "legacy")
        out = torch._scaled_mm(_meta(a.data), _meta(b.data).t(), _meta(la), _meta(lb), out_dtype=torch.bfloat16)
        assert tuple(out.shape) == shape
    ref_a = quantize(x, CastSpec(E4, B1x128))  # row-major scales: not what scaled_mm takes
    with pytest.raises(RuntimeError, match="scale a must have shape"):
        F.scaled_mm(_meta(ref_a.data), _meta(fwd[1].data).t(), _meta(ref_a.scale), rec[B1x128],
                    _meta(layouts.scaled_mm_scale(fwd[1], "b")), rec[B128])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pow2", [False, True])
def test_quantizers_are_bit_exact_on_the_gpu(pow2):
    """On a GPU the kernels are compiled (not interpreted): division and casts are the hardware's."""
    from jetrl_cli.kernels import fp8

    for fmt in (E4, E5):
        x = spread(4096, 4096 + 128, seed=99, dtype=torch.bfloat16)
        rows, cols = fp8.quantize_act(x, fmt, pow2_scale=pow2, pad_tokens_to=128)
        check_rows(rows, x, CastSpec(fmt, B1x128, pow2))
        check_cols(cols, x, CastSpec(fmt, B1x128, pow2), 128)
        q, qt = fp8.quantize_weight(x, fmt, pow2_scale=pow2, transposed=True)
        ref = quantize(x, CastSpec(fmt, B128, pow2))
        assert same_data(q.data, ref.data) and same_scales(q.scale, ref.scale)
        assert same_data(qt.data, ref.data.t()) and same_scales(qt.scale, ref.scale.t())


# ------------------------------------------------------------------ the division by a group's scale


def fresh_gen():
    """A generator seeded fresh in each session (``fresh_seed``); its seed is in the failure message."""
    seed = fresh_seed()
    return torch.Generator().manual_seed(seed), seed


def hard_quotients(m, k, fmax, g, midpoints):
    """fp32 (m, k) rows whose 1x128 groups each have a random non-power-of-two scale s = amax / fmax and
    whose other values lie within 3 ulps of ``midpoint * s``: quotients at the target format's rounding
    ties, where a quotient 1 ulp off rounds the other way. ``midpoints``: (n,) fp32 values to draw from."""
    amax = (1 + torch.rand(m, k // 128, 1, generator=g)) * torch.exp2(torch.randint(-30, 30, (m, k // 128, 1), generator=g).float())
    s = amax / fmax  # fp32, correctly rounded: the reference's scale of each group
    mid = midpoints[torch.randint(0, len(midpoints), (m, k // 128, 128), generator=g)]
    sign = torch.randint(0, 2, mid.shape, generator=g).float() * 2 - 1
    x = (sign * mid) * s
    x = (x.view(torch.int32) + torch.randint(-3, 4, x.shape, generator=g, dtype=torch.int32)).view(torch.float32)
    x = x.clamp(-amax, amax)
    x[..., 0] = amax[..., 0] * (torch.rand(m, k // 128, generator=g) < 0.5).float().mul(2).sub(1)  # the group's amax
    x[..., 1] = 0.0
    x[..., 2] = -0.0  # zeros keep their sign
    return x.reshape(m, k)


def fp8_midpoints(fmt):
    """Every tie between neighbouring finite non-negative values of ``fmt`` (as fp32)."""
    v = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype()).float()
    v = v[v.isfinite() & (v >= 0)].unique().sort().values
    return (v[1:] + v[:-1]) / 2


def divided_bytes(x, spec):
    """What dividing by the scale instead of multiplying by its reciprocal would give (the test inputs
    must tell them apart)."""
    fmt = spec.format
    xs = x.reshape(x.shape[0], -1, 128)
    s = quantize(x, spec).scale.reshape(x.shape[0], -1, 1)
    return bytes_of((xs / s).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype()).reshape(x.shape))


@triton.jit
def quotient_kernel(x_ptr, s_ptr, q_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x, s = tl.load(x_ptr + i), tl.load(s_ptr + i)
    tl.store(q_ptr + i, _quotient(x, s, _divisor(s)))


@needs_triton
def test_quotient_by_a_reciprocal_is_the_correctly_rounded_division():
    """``fp8._quotient`` (x * (1/s) and two FMA corrections) against IEEE division, bit for bit, on fresh
    random pairs over the scales' whole range, on scales whose significand ends in ones, on quotients
    near FP8 and INT8 rounding ties, and on zeros, subnormals and tiny x; the uncorrected product
    differs on these inputs (so they test the corrections). In an interpreter whose FMA rounds twice
    (Triton 3.6) the kernels divide instead (``fp8.MARKSTEIN``), and ``_quotient`` runs here with the
    FMA rounded once, as on a GPU (``triton_interp_fix.exact_fma``)."""
    from .triton_interp_fix import exact_fma

    g, seed = fresh_gen()
    n = 1 << 16
    s = (1 + torch.rand(6, n, generator=g)) * torch.exp2(torch.randint(-64, 100, (6, n), generator=g).float())
    ones = (1 << 23) - (1 << torch.randint(0, 12, (n,), generator=g))  # significands ending in 12..23 ones
    s[1] = ((torch.randint(0, 1 << 23, (n,), generator=g) | ones) & ((1 << 23) - 1) | (127 << 23)).int().view(
        torch.float32) * torch.exp2(torch.randint(-64, 100, (n,), generator=g).float())
    x = (torch.rand(6, n, generator=g) * 2 - 1) * s * 448
    x[1] = (torch.rand(n, generator=g) * 2 - 1) * s[1] * 127
    for row, mids in ((2, fp8_midpoints(E4)), (3, fp8_midpoints(E5)), (4, torch.arange(127) + 0.5)):
        x[row] = mids[torch.randint(0, len(mids), (n,), generator=g)] * s[row]
        x[row] = (x[row].view(torch.int32) + torch.randint(-3, 4, (n,), generator=g, dtype=torch.int32)).view(torch.float32)
    x[5] = torch.randn(n, generator=g) * torch.exp2(torch.randint(-149, -100, (n,), generator=g).float())  # tiny x
    x[5, :4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
    x, s = x.reshape(-1).contiguous(), s.reshape(-1).contiguous()
    x, s = x.to(dev()), s.to(dev())
    q = torch.empty_like(x)
    with exact_fma():
        quotient_kernel[(x.numel() // 4096,)](x, s, q, BLOCK=4096)
    x, s, q = x.cpu(), s.cpu(), q.cpu()
    ref = x / s
    wrong = (q.view(torch.int32) != ref.view(torch.int32)).nonzero()[:, 0]
    wrong = wrong[wrong < 5 * n]  # the tiny x's quotients are checked below
    assert len(wrong) == 0, f"seed {seed}: {len(wrong)} quotients differ, first x={x[wrong[0]].item()!r} s={s[wrong[0]].item()!r}"
    naive = x * (1 / s)
    assert (naive.view(torch.int32) != ref.view(torch.int32))[:5 * n].sum() > 100  # the inputs need the corrections
    # quotients far below every format's smallest step (x tiny, the residual subnormal): not always the
    # correctly rounded fp32 value, but the same sign and the same FP8 and INT8 values
    tiny_q, tiny_ref = q[5 * n:], ref[5 * n:]
    assert torch.equal(tiny_q.signbit(), tiny_ref.signbit()) and tiny_q.abs().max() < 2.0**-20, seed
    for fmt in (E4, E5):
        assert torch.equal(bytes_of(tiny_q.to(fmt.torch_dtype())), bytes_of(tiny_ref.to(fmt.torch_dtype()))), seed


def newton_reciprocals(y_units, b_units):
    """``RN(y + y * RN(1 - b * y))`` (two FMAs), in exact integer arithmetic, for b = B * 2^-23 in (1, 2)
    and y = Y * 2^-24 in (0.5, 1): the result's Y. ``1 - b * y`` is D * 2^-47 with |D| < 2^24, exact in
    fp32 (asserted); ``y * e`` is P * 2^-71, added to Y and rounded to the nearest integer, ties to even."""
    d = (1 << 47) - b_units * y_units
    assert int(d.abs().max()) < 1 << 24
    p = y_units * d
    whole = p >> 47
    frac = p - (whole << 47)
    half = 1 << 46
    y1 = y_units + whole
    return y1 + ((frac > half) | ((frac == half) & (y1 % 2 == 1))).long()


def test_one_newton_step_rounds_every_reciprocal_correctly_but_one():
    """The proof behind ``fp8._rcp``: for EVERY fp32 significand b (2^23 of them, b = 1 below) and both
    fp32 neighbours y of 1 / b (any y within one ulp), one Newton step with FMAs gives the correctly
    rounded 1 / b, except when b's significand is all ones and y = 0.5, where the step lands on a tie
    and rounds down: setting the last bit (``_rcp``'s fix) makes that one right, and changes no other
    result. Exponents scale out (normal inputs and results). b = 1: y = 1 - 2^-24 and 1 + 2^-23 both
    step to 1 (1 - 2^-48 and 1 - 2^-46 round to 1)."""
    b = torch.arange((1 << 23) + 1, 1 << 24, dtype=torch.int64)
    q, rem = (1 << 47) // b, (1 << 47) % b  # 2^47 / b: 1 / b in units of 2^-24
    want = q + ((2 * rem > b) | ((2 * rem == b) & (q % 2 == 1))).long()  # RN(1 / b), ties to even
    all_ones = b == (1 << 24) - 1
    for y in (q, q + 1):  # floor and ceiling of 1 / b: every y within one ulp of it
        got = newton_reciprocals(y, b)
        wrong = (got != want).nonzero()[:, 0]
        assert wrong.tolist() == ([len(b) - 1] if y is q else []), [hex(int(b[i])) for i in wrong[:4]]
        assert torch.equal(torch.where(all_ones, got | 1, got), want)


@triton.jit
def reciprocal_kernel(x_ptr, d_ptr, r_ptr, q_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x, d = tl.load(x_ptr + i), tl.load(d_ptr + i)
    tl.store(r_ptr + i, _rcp(x))
    tl.store(q_ptr + i, _over(x, d))


@needs_triton
def test_reciprocals_and_quotients_without_a_division_are_ieee():
    """``fp8._rcp`` (the GPU's approximate reciprocal and two Newton steps; in the interpreter a
    reciprocal one ulp off stands in for the approximation) against IEEE ``1 / x``, bit for bit: fresh
    random x over every exponent with a normal reciprocal, significands ending in many ones (all ones:
    the step's one tie), powers of two; on a GPU every significand at three exponents. ``fp8._over``
    (the SwiGLU kernels' ``x / (1 + exp(-g))``): IEEE ``x / d`` for d in [1, 2^126), and where d >= 2^126
    (g < -87.3) a zero with IEEE's sign, whose FP8 byte is IEEE's."""
    from .triton_interp_fix import exact_fma

    g, seed = fresh_gen()
    gpu = torch.cuda.is_available()
    n = 1 << 23 if gpu else 1 << 16
    sig = torch.randint(0, 1 << 23, (4, n), generator=g)
    sig[1] |= (1 << 23) - (1 << torch.randint(0, 12, (n,), generator=g))  # ending in 12..23 ones
    sig[2] = (1 << 23) - 1 if not gpu else torch.arange(n)  # all ones; on a GPU every significand
    sig[3, : n // 2] = 0  # powers of two
    exp = torch.randint(1, 253, (4, n), generator=g)  # biased exponents 1..252: 1 / x normal
    exp[2] = torch.randint(1, 253, (n,), generator=g) if not gpu else torch.tensor([1, 127, 252]).repeat_interleave(
        n // 3 + 1)[:n]
    x = ((exp << 23) | sig).int().view(torch.float32)
    x[0] *= torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = x.reshape(-1)
    # x / d as the SwiGLU kernels divide: x = g, d = 1 + exp(-g) for g of an FP8 copy (scales >= 2^-64),
    # over the whole range to g < -88.8 (d infinite); half of them x and d drawn apart (d < 2^40)
    m = x.numel()
    xn = torch.randn(m, generator=g) * torch.exp2(torch.randint(-60, 7, (m,), generator=g).float())
    xn[: m // 8] = -87.3 - 1.5 * torch.rand(m // 8, generator=g)  # d from 2^126 to infinity
    d = 1 + torch.exp(-xn)
    d[m // 2:] = 1 + torch.exp2(torch.rand(m - m // 2, generator=g) * 40)
    xn[:2], d[:2] = torch.tensor([-0.0, 0.0]), torch.tensor([2.0, 2.0])
    x, xn, d = x.to(dev()), xn.to(dev()), d.to(dev())
    r, q = torch.empty_like(x), torch.empty_like(x)
    with exact_fma():
        reciprocal_kernel[(x.numel() // 4096,)](x, d, r, torch.empty_like(x), BLOCK=4096)
        reciprocal_kernel[(x.numel() // 4096,)](xn, d, torch.empty_like(x), q, BLOCK=4096)
    x, xn, d, r, q = x.cpu(), xn.cpu(), d.cpu(), r.cpu(), q.cpu()
    wrong = (r.view(torch.int32) != (1 / x).view(torch.int32)).nonzero()[:, 0]
    assert len(wrong) == 0, f"seed {seed}: 1 / {x[wrong[0]].item()!r} = {r[wrong[0]].item()!r}, {len(wrong)} wrong"
    ieee = xn / d
    normal = d < RCP_NORMAL.value
    # zeros (an interpreter whose FMA rounds twice divides instead: IEEE's values)
    assert int((~normal).sum()) > m // 16 and bool(((q == 0) | (q == ieee))[~normal].all())
    # quotients under 2^-100 (x tiny and d large: the residual subnormal) may be an ulp off, far below
    # the FP8 and INT8 steps of any scale >= 2^-64: same sign and same bytes
    exact = normal & (ieee.abs() >= 2.0**-100)
    wrong = (q.view(torch.int32) != ieee.view(torch.int32)) & exact
    assert not wrong.any(), (f"seed {seed}: {int(wrong.sum())} quotients differ, first "
                             f"{xn[wrong][0].item()!r} / {d[wrong][0].item()!r}")
    assert int(exact.sum()) > 0.8 * m and torch.equal(q.signbit(), ieee.signbit())
    for fmt in (E4, E5):  # as quantized with the smallest scale, 2^-64
        assert torch.equal(bytes_of((q[~exact] * 2.0**64).to(fmt.torch_dtype())),
                           bytes_of((ieee[~exact] * 2.0**64).to(fmt.torch_dtype())))


@needs_triton
@pytest.mark.parametrize("fmt", [E4, E5])
def test_quantizers_round_products_at_ties_as_the_reference(fp8, fmt):
    """The quantizers' data at FP8 rounding ties (values within 3 ulps of ``midpoint * scale``, fresh
    random draws) and at the group's amax: the 1x128 rows and 128x1 columns of ``quantize_act`` and
    the weight quantizer's 128x128 blocks, each ``x * (1 / scale)`` rounded once as the reference's;
    a division by the scale (or a product contracted into a multiply-add) gets some of them wrong."""
    g, seed = fresh_gen()
    x = hard_quotients(128, 256, fmt.max, g, fp8_midpoints(fmt))
    spec = CastSpec(fmt, B1x128)
    ref = quantize(x, spec)
    assert (divided_bytes(x, spec) != bytes_of(ref.data)).sum() > 20, seed
    # groups whose amax * (1 / scale) rounds above fmt_max: the cast, not a clamp, brings them to
    # fmt_max in the kernels
    assert (x.reshape(128, 2, 128).abs() * (1 / ref.scale.reshape(128, 2, 1)) > fmt.max).any(), seed
    rows, _ = fp8.quantize_act(x.to(dev()), fmt, cols=False)
    assert same_data(rows.data.cpu(), ref.data), f"seed {seed}"
    xt = x.t().contiguous()  # 128x1 groups of xt are the 1x128 groups of x
    _, cols = fp8.quantize_act(xt.to(dev()), fmt, rows=False)
    assert same_data(cols.data.cpu(), ref.data), f"seed {seed}"
    # a 128x128 block: one scale; rows of x scaled to the first row's amax, which stays the largest
    w = x[:, :128] / x[:, :1].abs() * x[0, 0].abs()
    w = (w.view(torch.int32) + torch.randint(-3, 4, w.shape, generator=g, dtype=torch.int32)).view(torch.float32)
    w[0, 0] = w.abs().max() * 1.0001
    ref_w = quantize(w, CastSpec(fmt, B128))
    q = fp8.quantize_weight(w.to(dev()), fmt)
    assert same_data(q.data.cpu(), ref_w.data) and same_scales(q.scale.cpu()[:1, :1], ref_w.scale), f"seed {seed}"
    assert (bytes_of((w / ref_w.scale).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype())) != bytes_of(ref_w.data)).any()


@needs_triton
def test_quantize_rows_for_int8_rounds_halves_as_the_reference():
    """INT8 per-row quantization of values within 3 ulps of ``(k + 1/2) * scale`` (fresh random draws):
    bit for bit the reference's ``round(x * (1 / scale))``, where a division by the scale, or the
    product contracted with the kernel's rounding constant into one multiply-add, rounds some of them
    the other way."""
    from jetrl_cli.kernels import int8

    g, seed = fresh_gen()
    x = hard_quotients(64, 128, 127.0, g, torch.arange(127) + 0.5)
    spec = CastSpec(Format.INT8, Block(1, 0))
    ref = quantize(x, spec)
    divided = ((x / ref.scale).clamp(-127, 127).round()).to(torch.int8)
    assert (divided != ref.data).sum() > 20, seed
    fused = (x.double() * (1 / ref.scale).double()).clamp(-127, 127).round().to(torch.int8)  # one rounding
    assert (fused != ref.data).sum() > 0, seed
    assert (x.abs() * (1 / ref.scale) > 127).any(), seed  # rounded above 127: the kernel does not clamp
    got = int8.quantize_rows(x.to(dev()), spec)
    assert torch.equal(got.data.cpu(), ref.data) and torch.equal(got.scale.cpu(), ref.scale), f"seed {seed}"


def test_quantizers_refuse_floors_below_the_smallest_scale_they_divide_by():
    """Scales below 2^-64 would break the reciprocal's division (1 / s, the residual's range): such an
    ``amax_floor`` is refused with a message naming the bound (the caller then uses the reference)."""
    pytest.importorskip("triton")
    from jetrl_cli.kernels import fp8, int8

    assert "amax_floor >=" in fp8.unsupported(None, E4, 448 * 2.0**-65)
    assert fp8.unsupported(None, E4, 448 * 2.0**-64) is None
    assert "amax_floor >=" in int8.unsupported(torch.ones(2, 3), CastSpec(Format.INT8, Block(1, 0), amax_floor=1e-30))


@needs_triton
def test_gemm_operands_fall_back_to_the_reference_below_the_kernels_floor(fp8):
    """A flow whose ``amax_floor`` is under the kernels' bound (legal: any positive floor is) gets its
    GEMM operands from the reference quantizer, with the same values, never a ValueError from a kernel."""
    from jetrl_cli.precision import gemm

    be = (gemm.ScaledMMBackend(),)
    x = spread(130, 256, seed=3).to(dev())
    low = CastSpec(E4, B1x128, amax_floor=1e-20)  # above 448 * 2^-126, below 448 * 2^-64
    assert gemm.kernel_quantizers(x, be, CastSpec(E4, B1x128)) is fp8
    assert gemm.kernel_quantizers(x, be, low) is None
    rows, cols = gemm.cast_pair(x, low, CastSpec(E4, B128x1, amax_floor=1e-20), (be[0], be[0]))
    ref = quantize(x, low)
    assert same_data(layouts.to_gemm_layout(rows).data, ref.data)
    assert gemm.cast_weight_pair(x[:128], CastSpec(E4, B128, amax_floor=1e-20), be) is None


# ------------------------------------------------------------------ the launch configuration


class Spy:
    """A Triton kernel whose launches' keyword arguments are noted in ``seen`` (with ``name``: as
    ``name``, beside them)."""

    def __init__(self, kernel, seen: list, name: str | None = None):
        self.kernel, self.seen, self.name = kernel, seen, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(kwargs if self.name is None else {**kwargs, "name": self.name})
            return self.kernel[grid](*args, **kwargs)
        return launch


@needs_triton
@pytest.mark.parametrize("warps", [8, 16])
def test_the_pair_as_two_kernels_or_at_other_warps_writes_the_same_bits(fp8, warps, monkeypatch):
    """``quantize_act``'s 1x128 + 128x1 pair from one kernel (one read of x) or two, at 8 or 16 warps:
    the same data and scales (the choice a GPU times, ``launch_config``, changes no bit), NaN groups
    and padding included."""
    seen = []
    monkeypatch.setattr(fp8, "_act_quant_kernel", Spy(fp8._act_quant_kernel, seen))
    for m, pad in ((200, 128), (132, 1), (130, 1)):
        x = spread(m, 384, seed=5 + m, dtype=torch.bfloat16)
        x[7, 130] = float("nan")
        want = fp8.quantize_act(x, pad_tokens_to=pad)
        want_cols = fp8.quantize_act(x, rows=False, pad_tokens_to=pad)[1]
        for one in (True, False):
            seen.clear()
            with fp8.tile_warps(warps, one_kernel=one):
                got = fp8.quantize_act(x, pad_tokens_to=pad)
                got_cols = fp8.quantize_act(x, rows=False, pad_tokens_to=pad)[1]
                w = fp8.quantize_weight(x.float(), transposed=True)
            assert [(k["num_warps"], k["ROWS"], k["COLS"]) for k in seen] == (
                [(warps, True, True)] if one else [(warps, True, False), (warps, False, True)]) + [(warps, False, True)]
            for a, b in [*zip(got, want), (got_cols, want_cols)]:
                assert same_data(a.data, b.data) and same_scales(a.scale, b.scale)
                assert a.data.stride() == b.data.stride() and a.scale.stride() == b.scale.stride()
            ref = quantize(x.float(), CastSpec(E4, B128))
            assert same_data(w[0].data, ref.data) and same_data(w[1].data, ref.data.t())


@needs_triton
@pytest.mark.parametrize("warps,one", [(8, True), pytest.param(16, True, marks=pytest.mark.slow),
                                       pytest.param(4, False, marks=pytest.mark.slow), (8, False),
                                       pytest.param(16, False, marks=pytest.mark.slow)])
def test_the_swiglu_backward_at_other_warps_writes_the_same_bits(fp8, warps, one, monkeypatch):
    """The SwiGLU backward at 4, 8 or 16 warps, as its one 128x128-tile kernel or as two kernels of small
    tiles (``swiglu_config``: timed on a GPU), writes the same d[g, u] copies and h^T -- NaN and inf
    groups, padding tokens and a last partial token group included -- and launches as asked."""
    split = ("_swiglu_grad_rows_kernel", "_swiglu_grad_cols_kernel")
    for m, pad in ((132, 128), (200, 4), (5, 1)):
        gu = quantize(spread(m, 512, seed=7 + m, dtype=torch.bfloat16).to(dev()), CastSpec(E4, B1x128))
        gy = spread(m, 256, seed=8 + m, dtype=torch.bfloat16).to(dev())
        gy[m - 3, 3] = float("inf")
        gy[1, 200] = float("nan")
        for dt in (torch.bfloat16, torch.float32):
            want = fp8.swiglu_grad_quantize(gu, gy, dt, pad_tokens_to=pad, h_cols=True)
            want_rows = fp8.swiglu_grad_quantize(gu, gy, dt, cols=False, pad_tokens_to=pad)
            want_cols = fp8.swiglu_grad_quantize(gu, gy, dt, rows=False, pad_tokens_to=pad)
            want_t = fp8.swiglu_quantize_t(gu, dt, pad_tokens_to=pad)
            seen = []
            for name in ("_swiglu_grad_quant_kernel", "_swiglu_quant_t_kernel", *split):
                monkeypatch.setattr(fp8, name, Spy(getattr(fp8, name), seen, name))
            with fp8.tile_warps(warps, one_kernel=one):
                got = fp8.swiglu_grad_quantize(gu, gy, dt, pad_tokens_to=pad, h_cols=True)
                got_rows = fp8.swiglu_grad_quantize(gu, gy, dt, cols=False, pad_tokens_to=pad)
                got_cols = fp8.swiglu_grad_quantize(gu, gy, dt, rows=False, pad_tokens_to=pad)
                got_t = fp8.swiglu_quantize_t(gu, dt, pad_tokens_to=pad)
            monkeypatch.undo()
            assert all(k["num_warps"] == warps for k in seen)
            if one:
                assert [k["name"] for k in seen] == ["_swiglu_grad_quant_kernel"] * 3 + ["_swiglu_quant_t_kernel"]
            else:  # the 1x128 kernel where rows are asked for, the 128x1 one where columns or h^T are
                assert [k["name"] for k in seen] == [*split, split[0], split[1], split[1]]
                assert [(k["COLS"], k["H_COLS"]) for k in seen if k["name"] == split[1]] == [
                    (True, True), (True, False), (False, True)]
            for a, b in [*zip(got, want), *zip(got_rows, want_rows), *zip(got_cols, want_cols), (got_t, want_t)]:
                if b is None:
                    assert a is None
                    continue
                assert a.data.shape == b.data.shape and a.scale.stride() == b.scale.stride()
                assert same_data(a.data, b.data) and same_scales(a.scale, b.scale), (m, pad, dt)


@needs_triton
def test_the_launch_configuration_is_timed_once_per_device_and_reported(fp8, monkeypatch):
    """On a GPU the first act or weight quantizer times the 1x128 quantizer and the 1x128 + 128x1
    pair (one kernel or two) at 8 and 16 warps and keeps the fastest of each, reported with the GEMM
    backends; a timing that fails keeps the defaults and says why; during a graph capture nothing is
    timed or recorded. (Scripted times; on CPU the kernels run in the interpreter.)"""
    from jetrl_cli.precision import gemm

    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(fp8, "TIMING_SHAPE", (132, 256))
    ms = {(w, what): 5.0 for w in (8, 16) for what in ("1x128", True, False)}
    ms.update({(16, "1x128"): 1.0, (8, False): 2.0})
    timed = []

    def device_time_ms(fn, device):
        out = fn()  # it runs, under the configuration being timed
        f = fp8._FORCED
        what = "1x128" if out[1] is None else f.one_kernel
        timed.append((f.warps, what))
        return ms[(f.warps, what)]

    monkeypatch.setattr(gemm, "device_time_ms", device_time_ms)
    where = torch.device(dev())  # the GPU, or the CPU's interpreter
    got = fp8._choose_tiles(where)
    assert sorted(timed, key=str) == sorted(ms, key=str) and fp8._FORCED is None
    assert (got["warps"], got["pair_warps"], got["one_kernel"]) == (16, 8, False)
    assert gemm.kernel_choice(fp8.TILES_OP, where) is got
    assert got["kernel"] == "16 warps; the 1x128 + 128x1 pair as two kernels at 8 warps"
    assert got["why"].startswith("timed on 132 x 256 bf16: 1x128 at 8 warps 5.000 ms")
    assert any(k.get("op") == fp8.TILES_OP for k in gemm.backend_report()["kernels"])
    if where.type == "cuda":
        probe = torch.zeros(2, 2, device=where)
        assert fp8.launch_config(probe, True) == (8, False) and fp8.launch_config(probe, False) == (16, True)

    def broken(fn, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(gemm, "device_time_ms", broken)
    got = fp8._choose_tiles(where)
    assert (got["warps"], got["pair_warps"], got["one_kernel"]) == (fp8.NUM_WARPS, fp8.NUM_WARPS, True)
    assert got["why"] == "not timed (RuntimeError: operation not permitted when stream is capturing)"
    assert fp8._FORCED is None
    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fp8._choose_tiles(torch.device("cuda"))["one_kernel"] is True
    assert gemm.kernel_choice(fp8.TILES_OP, torch.device("cuda")) is None  # decided at the next eager call
    assert fp8.launch_config(torch.zeros(2, 2), True) == (fp8.NUM_WARPS, True)  # CPU tensors: the defaults


@needs_triton
def test_the_swiglu_backward_warps_are_timed_once_per_device_and_reported(fp8, monkeypatch):
    """The SwiGLU backward is timed as a training step runs it (d[g, u] both ways and h^T), as one
    kernel at 8 and 16 warps and as two at 4, 8 and 16, at its first call on a GPU, and the fastest kept and
    reported; a timing that fails keeps the default and says why. (Scripted times; on CPU the
    kernels run in the interpreter.)"""
    from jetrl_cli.precision import gemm

    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(fp8, "TIMING_SHAPE", (132, 512))
    ms = {(8, True): 3.0, (16, True): 1.5, (4, False): 1.25, (8, False): 1.0, (16, False): 2.0}
    timed = []

    def device_time_ms(fn, device):
        rows, cols, h_t = fn()  # the training step's call: all three outputs
        assert rows is not None and cols is not None and h_t is not None
        timed.append(tuple(fp8._FORCED))
        return ms[timed[-1]]

    monkeypatch.setattr(gemm, "device_time_ms", device_time_ms)
    where = torch.device(dev())
    got = fp8._choose_swiglu_warps(where)
    assert timed == list(ms) and fp8._FORCED is None
    assert (got["warps"], got["one_kernel"], got["kernel"]) == (8, False, "two kernels at 8 warps")
    assert gemm.kernel_choice(fp8.SWIGLU_TILES_OP, where) is got
    assert got["why"] == ("timed on [g, u] 132 x 512: one kernel at 8 warps 3.000 ms, one kernel at 16 warps "
                          "1.500 ms, two kernels at 4 warps 1.250 ms, two kernels at 8 warps 1.000 ms, "
                          "two kernels at 16 warps 2.000 ms")
    probe = torch.zeros(2, 2, device=where)  # its kernels launch at the device's choice (CPU: the default)
    assert fp8.swiglu_config(probe) == ((8, False) if where.type == "cuda" else (fp8.SWIGLU_WARPS, True))

    def broken(fn, device):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(gemm, "device_time_ms", broken)
    got = fp8._choose_swiglu_warps(where)
    assert (got["warps"], got["one_kernel"]) == (fp8.SWIGLU_WARPS, True)
    assert got["why"] == "not timed (RuntimeError: out of resources)"
    assert fp8._FORCED is None


@needs_triton
@pytest.mark.parametrize("n,k", [(260, 300), (128, 128), (4, 1), (6, 130)])
def test_weight_bytes_transpose_by_kernel_equals_torchs(fp8, n, k):
    """``transpose_bytes_``'s Triton kernel (four rows per 32-bit word) writes torch's ``src.t()``
    byte for byte in each order of its tiles, ragged tiles included; where N is not a multiple of 4
    it is torch's copy."""
    src = torch.randint(0, 256, (n, k), generator=gen(n * k), dtype=torch.uint8).to(dev())
    assert fp8.TRANSPOSE_WAYS == ("triton", "triton-n-first", "triton-diagonal", "torch")
    for kind in fp8.TRANSPOSE_WAYS:  # the kernel's three tile orders, and torch's copy
        dst = torch.full((k, n), 7, dtype=torch.uint8, device=dev())
        with fp8.transpose_with(kind):
            fp8.transpose_bytes_(dst, src)
        assert torch.equal(dst, src.t())
    w = spread(n if n % 128 == 0 else 128, 256, seed=n).float()
    with fp8.transpose_with("triton"):
        q, qt = fp8.quantize_weight(w, transposed=True)
    assert same_data(qt.data, q.data.t()) and same_scales(qt.scale, q.scale.t())


@needs_triton
def test_the_weight_quantizer_can_write_w_t_itself_with_the_transposes_bits(fp8, monkeypatch):
    """``wt_with("quantizer")``: the weight quantizer writes W^T's bytes from the tile it holds (one
    launch per weight dtype, no transpose after it) -- W, W^T, their scales and pads bit for bit as
    when W^T is transposed after the quantizer, a NaN block, partial blocks and a stack in one buffer
    included -- in launches whose every field is a multiple of 16 (``ALIGNED``, the variant the device
    check runs); a call with a ragged width (130, 132, 200) transposes after, whatever the way. (On a
    GPU whose compiled kernel is not exact, what is checked is that it is never chosen.)"""
    where = torch.device(dev())
    if where.type == "cuda" and not fp8._wt_exact(where):
        from jetrl_cli.precision import gemm

        monkeypatch.setattr(gemm, "_KERNELS", {})
        assert not fp8._wt_in_quantizer(where)
        pytest.xfail("the weight quantizer's W^T bytes are not exact on this GPU: W^T is transposed after it")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    groups = [[torch.randn(256, 384, generator=g) * 0.02, torch.randn(144, 384, generator=g)],
              [torch.randn(132, 384, generator=g).to(torch.bfloat16)],
              [torch.randn(128, 256, generator=g), torch.randn(200, 256, generator=g) * 30],
              [torch.randn(256, 130, generator=g)]]
    groups = [[w.to(dev()) for w in ws] for ws in groups]
    groups[0][1][3, 7] = float("nan")
    seen = []
    monkeypatch.setattr(fp8, "_weight_quant_kernel", Spy(fp8._weight_quant_kernel, seen))
    real_transpose = fp8.transpose_many_
    transposed = []
    monkeypatch.setattr(fp8, "transpose_many_", lambda pairs: (transposed.append(len(pairs)), real_transpose(pairs)))
    outs = {}
    for way in ("after", "quantizer"):
        seen.clear()
        transposed.clear()
        with fp8.wt_with(way), fp8.transpose_with("torch"):
            outs[way] = fp8.quantize_weight_stacks(groups, E4, transposed=True)
            aligned = fp8.quantize_weight_stacks([groups[0]], E4, transposed=True)  # every field a multiple of 16
            with fp8.stacks_in_one_buffer():
                arena = fp8.quantize_weight_stacks(groups[:1], E4, transposed=True)
        # fp32, bf16 (ragged: after); the aligned stack; the arena
        assert [k["WT"] for k in seen] == [False, False] + [way == "quantizer"] * 2
        assert seen[2]["ALIGNED"] and transposed == ([4] if way == "quantizer" else [4, 1, 1])
        for (w, wt), (aw, awt) in zip((*aligned, *arena), outs[way][:1] * 2):
            assert same_data(w.data, aw.data) and same_data(wt.data, awt.data)
    for ws, (w, wt), (qw, qwt) in zip(groups, outs["after"], outs["quantizer"]):
        assert same_data(w.data, qw.data) and same_data(wt.data, qwt.data), [tuple(x.shape) for x in ws]
        for a, b in ((w, qw), (wt, qwt)):
            assert torch.equal(layouts.scale_buffer(a).view(torch.int32), layouts.scale_buffer(b).view(torch.int32))
        assert same_data(qwt.data, fp8.quantize_weight_stack(ws, E4)[0].data.t())
    assert bool(outs["quantizer"][0][1].scale.isnan().any())
    # held operands (a trainer's weight caches) written in place, W^T by the quantizer where aligned
    twice = [[x * 2 for x in ws] for ws in groups]
    seen.clear()
    with fp8.wt_with("quantizer"):
        again = fp8.quantize_weight_stacks(twice[:1], E4, transposed=True, helds=outs["after"][:1])
        again += fp8.quantize_weight_stacks(twice, E4, transposed=True, helds=outs["quantizer"])[1:]
    assert [k["WT"] for k in seen] == [True, False, False]
    for ws, (w, wt), (hw, hwt) in zip(twice, again, outs["after"][:1] + outs["quantizer"][1:]):
        assert w.data.data_ptr() == hw.data.data_ptr() and wt.data.data_ptr() == hwt.data.data_ptr()
        want_w, want_t = fp8.quantize_weight_stack(ws, E4, transposed=True)
        assert same_data(w.data, want_w.data) and same_data(wt.data, want_t.data)


@needs_triton
def test_the_w_t_way_is_chosen_once_per_device_and_only_if_exact(fp8, monkeypatch):
    """On a GPU the first transposed weight quantization times W^T written by the quantizer against
    its bytes transposed after it, on an fp32 weight, and keeps the faster, reported; the quantizer's
    way only where ``_wt_exact`` finds its W^T equal to the transpose's -- a byte written wrong, or left
    as the output held it (a miscompiled transposed store), is caught; a failing timing keeps the
    transpose; during a capture nothing is decided. (Scripted times.)"""
    from jetrl_cli.precision import gemm

    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(fp8, "TIMING_SHAPE", (256, 384))
    where = torch.device(dev())
    if where.type == "cuda":  # the byte transpose's and the tiles' own timed choices, before the scripted times
        fp8._choose_transpose(where)
        fp8._choose_tiles(where)
    timed = []

    def device_time_ms(fn, device):
        q, qt = fn()
        timed.append(fp8._WT_FORCED)
        assert tuple(qt.data.shape) == (384, 256)
        return {"after": 2.0, "quantizer": 1.0}[fp8._WT_FORCED]

    monkeypatch.setattr(gemm, "device_time_ms", device_time_ms)
    real_exact = fp8._wt_exact
    exact = real_exact(where)  # on CPU (Triton's interpreter) the quantizer's W^T is exact
    assert exact or where.type == "cuda"
    monkeypatch.setattr(fp8, "_wt_exact", lambda device: True)  # the timed choice, whatever this GPU's bytes
    got = fp8._choose_wt(where)
    assert timed == ["after", "quantizer"] and fp8._WT_FORCED is None, got
    assert got["kernel"] == "quantizer" and gemm.kernel_choice(fp8.WT_OP, where) is got
    assert got["why"] == "timed on a 256 x 384 fp32 weight: after 2.000 ms, quantizer 1.000 ms"
    if where.type == "cuda":  # the choice in use
        assert fp8._wt_in_quantizer(where)
    else:  # CPU: the transpose after the quantizer unless forced
        assert not fp8._wt_in_quantizer(where)
    monkeypatch.setattr(fp8, "_wt_exact", real_exact)
    real = fp8._weight_quant_kernel

    class Broken:  # the quantizer's W^T one byte off, or its first two rows left unwritten
        def __init__(self, how):
            self.how = how

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                wt = args[6]  # the first job's W^T (its columns of the stack's), when WT
                held = wt[:2].clone() if kwargs["WT"] else None
                out = real[grid](*args, **kwargs)
                if kwargs["WT"] and self.how == "byte":
                    wt.view(torch.uint8).view(-1)[0] ^= 1
                elif kwargs["WT"]:
                    wt[:2].copy_(held)
                return out
            return launch

    for how in ("byte", "rows"):
        monkeypatch.setattr(fp8, "_weight_quant_kernel", Broken(how))
        assert not fp8._wt_exact(where), how
        gemm._KERNELS.clear()
        got = fp8._choose_wt(where)
        assert got["kernel"] == "after" and got["why"] == "the quantizer's W^T bytes differ from the transpose's"
    monkeypatch.setattr(fp8, "_weight_quant_kernel", real)
    gemm._KERNELS.clear()
    assert fp8._choose_wt(where)["kernel"] == ("quantizer" if exact else "after")
    monkeypatch.setattr(fp8, "_wt_exact", lambda device: True)
    _untimed_then_undecided_in_a_capture(monkeypatch, fp8._choose_wt, fp8.WT_OP, "after", where)
    assert fp8._WT_FORCED is None
    with pytest.raises(ValueError, match="wt_with: allowed after, quantizer, got sideways"):
        with fp8.wt_with("sideways"):
            pass


@needs_triton
def test_the_quantizers_w_t_is_used_only_in_launch_variants_checked_exact_in_this_process(fp8, monkeypatch):
    """Where a GPU's timed choice is the quantizer's W^T, each launch variant (warps, format, pow2 scales,
    amax floor: each its own compiled kernel) is checked by ``_wt_exact`` at its first use, at those
    warps, once per process; one not exact transposes after; during a CUDA graph capture an unchecked
    variant transposes after and is checked at a later use; a forced way needs no check. (A fake GPU:
    the choice and the check scripted.)"""
    from jetrl_cli.precision import gemm

    cuda = torch.device("cuda")
    choice = {"kernel": "quantizer"}
    monkeypatch.setattr(gemm, "kernel_choice", lambda op, dev: choice if op == fp8.WT_OP else None)
    capturing = [False]
    monkeypatch.setattr(gemm, "capturing", lambda dev: capturing[0])
    monkeypatch.setattr(fp8, "_WT_CHECKED", {})
    checked = []

    def wt_exact(device, fmt, pow2_scale, amax_floor):
        checked.append((fp8.launch_config(torch.empty(1), False).warps, fmt, pow2_scale, amax_floor))
        return not pow2_scale

    monkeypatch.setattr(fp8, "_wt_exact", wt_exact)
    floor = 1e-12
    v8, v8_pow2, v16 = (8, E4, False, floor), (8, E4, True, floor), (16, E4, False, floor)
    assert fp8._wt_in_quantizer(cuda, v8) and fp8._wt_in_quantizer(cuda, v8)
    assert not fp8._wt_in_quantizer(cuda, v8_pow2) and not fp8._wt_in_quantizer(cuda, v8_pow2)
    assert fp8._wt_in_quantizer(cuda, v16)
    assert checked == [v8, v8_pow2, v16]  # each checked once, at its own warps
    capturing[0] = True
    v4 = (4, E4, False, floor)
    assert not fp8._wt_in_quantizer(cuda, v4) and fp8._wt_in_quantizer(cuda, v8) and len(checked) == 3
    capturing[0] = False
    assert fp8._wt_in_quantizer(cuda, v4) and checked[-1] == v4
    with fp8.wt_with("after"):
        assert not fp8._wt_in_quantizer(cuda, v8)
    with fp8.wt_with("quantizer"):
        assert fp8._wt_in_quantizer(cuda, (32, E4, True, floor)) and len(checked) == 4
    choice = {"kernel": "after"}
    assert not fp8._wt_in_quantizer(cuda, (32, E4, False, floor)) and len(checked) == 4
    assert not fp8._wt_in_quantizer(torch.device("cpu"), v8)  # CPU: after unless forced
    # the weight quantizer asks with its launch's variant
    asked = []
    monkeypatch.setattr(fp8, "_wt_in_quantizer", lambda dev, variant=None: asked.append(variant) or False)
    w = torch.randn(128, 256, generator=gen(fresh_seed()))
    fp8.quantize_weight_stacks([[w]], E4, pow2_scale=True, amax_floor=1e-6, transposed=True)
    assert asked == [(fp8.launch_config(w, False).warps, E4, True, 1e-6)]


@needs_triton
def test_the_weight_transpose_is_chosen_once_per_device_and_only_if_exact(fp8, monkeypatch):
    """On a GPU the first weight transpose times the kernel against torch's copy and keeps the faster,
    reported; a kernel whose bytes differ from torch's (a miscompiled transpose) is never chosen; a
    failing timing keeps torch's copy; during a capture nothing is decided. (Scripted times.)"""
    from jetrl_cli.precision import gemm

    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(fp8, "TIMING_SHAPE", (132, 260))
    ms = iter([3.0, 1.0, 2.0, 4.0])  # triton in its three orders, torch
    monkeypatch.setattr(gemm, "device_time_ms", lambda fn, device: (fn(), next(ms))[1])
    where = torch.device(dev())
    got = fp8._choose_transpose(where)
    assert got["kernel"] == "triton-n-first" and gemm.kernel_choice(fp8.TRANSPOSE_OP, where) is got
    assert got["why"] == ("timed on 132 x 260 bytes: triton 3.000 ms, triton-n-first 1.000 ms, "
                          "triton-diagonal 2.000 ms, torch 4.000 ms")
    src = torch.randint(0, 256, (260, 132), generator=gen(5), dtype=torch.uint8).to(dev())
    dst = torch.empty(132, 260, dtype=torch.uint8, device=dev())
    fp8.transpose_bytes_(dst, src)  # the choice in use (on CPU: the kernel only where forced)
    assert torch.equal(dst, src.t())

    real = fp8._transpose_triton

    def wrong(pairs, order=0):  # one byte off, in one order only
        real(pairs, order)
        if order == 2:
            pairs[0][0].view(torch.uint8).view(-1)[5] ^= 1

    monkeypatch.setattr(fp8, "_transpose_triton", wrong)
    got = fp8._choose_transpose(where)
    assert got["kernel"] == "torch" and got["why"] == "the Triton transpose's bytes differ from torch's"
    monkeypatch.setattr(fp8, "_transpose_triton", real)

    _untimed_then_undecided_in_a_capture(monkeypatch, fp8._choose_transpose, fp8.TRANSPOSE_OP, "torch", where)


def _untimed_then_undecided_in_a_capture(monkeypatch, choose, op: str, fallback: str, where) -> None:
    """A timed choice (``choose(device)``, recorded as ``op``): a timing that fails keeps ``fallback``
    and says why; during a CUDA graph capture it returns ``fallback`` and records nothing."""
    from jetrl_cli.precision import gemm

    def broken(fn, device):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(gemm, "device_time_ms", broken)
    assert choose(where)["why"] == "not timed (RuntimeError: out of resources)"
    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert choose(torch.device("cuda")) == {"kernel": fallback}
    assert gemm.kernel_choice(op, torch.device("cuda")) is None


