"""The INT8 Triton kernels (kernels/int8.py) and the ``triton`` backend's INT8 path.

The quantizer is bit for bit the pure-torch reference (data bytes and scales, pow2 or not, bf16 /
fp16 / fp32 input, NaN / inf / all-zero rows, exact ties); the GEMM is bit for bit what ``backend:
scaled_mm`` computes (``torch._int_mm`` and its epilogue) and close to the float64 product. On CPU
they run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest when there is no GPU);
``tests/test_kernels_sm90.py`` compiles them for Hopper. Random inputs are drawn fresh each run;
the seed is in the assertion message.
"""

import pytest
import torch

from jetrl_cli.engine.base import make_payload
from jetrl_cli.engine.embedded import EmbeddedEngine
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import gemm, parse_flow
from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.precision.quant import CastSpec, QTensor, dequantize, error_stats, quantize

from .conftest import fresh_seed, triton_runs

ROW, TENSOR = Block(1, 0), Block(0, 0)


pytestmark = pytest.mark.skipif(not triton_runs(), reason="needs Triton (and a GPU or TRITON_INTERPRET=1)")


@pytest.fixture
def int8():
    from jetrl_cli.kernels import int8 as module

    return module


@pytest.fixture
def seed():
    return fresh_seed()


def dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def spread(m, k, seed, dtype=torch.float32):
    """Rows of very different magnitudes (one all zero when there are three or more)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 3)
    if m >= 3:
        x[2] = 0.0
    return x.to(dev(), dtype)


def same(q: QTensor, ref: QTensor) -> bool:
    return torch.equal(q.data.cpu(), ref.data.cpu()) and torch.equal(q.scale.cpu().nan_to_num(-1.0),
                                                                     ref.scale.cpu().nan_to_num(-1.0))


@pytest.mark.parametrize("shape", [(1, 7), (5, 300), (33, 1536), (70, 130), (3, 2100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_row_quantizer_is_the_reference(int8, shape, dtype, pow2, seed):
    spec = CastSpec(Format.INT8, ROW, pow2)
    x = spread(*shape, seed, dtype)
    q = int8.quantize_rows(x, spec)
    assert q.data.dtype is torch.int8 and q.data.shape == shape and q.scale.shape == (shape[0], 1)
    assert same(q, quantize(x, spec)), f"seed {seed}"


@pytest.mark.parametrize("pow2", [False, True])
def test_non_finite_rows_zero_rows_and_ties(int8, pow2):
    spec = CastSpec(Format.INT8, ROW, pow2)
    x = torch.randn(6, 256)
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")
    x[2, 9] = -float("inf")
    x[3] = 0.0
    x[4] = 3e38  # near fp32's largest: the scale is finite, every element is +-127
    x[4, ::2] *= -1
    # row 5: exact ties once scaled -- with amax 127 * 2 the scale is 2 (a power of two either way), and
    # k + 0.5 steps must round half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0, -2.5 -> -2
    x[5] = 0.0
    x[5, 0] = 254.0
    x[5, 1:6] = torch.tensor([1.0, 3.0, 5.0, -1.0, -5.0])
    x = x.to(dev())
    q, ref = int8.quantize_rows(x, spec), quantize(x, spec)
    assert same(q, ref)
    s, d = q.scale.cpu().flatten(), q.data.cpu()
    assert s[:3].isnan().all() and (d[:3] == 0).all()  # a non-finite row: NaN scale, zero data
    assert s[3] == spec.amax_floor / 127 or pow2  # all zero: the floor's scale
    assert (d[3] == 0).all() and (d[4].abs() == (113 if pow2 else 127)).all()  # pow2: 3e38 / 2^121 = 113
    assert s[5] == 2.0 and d[5, :6].tolist() == [127, 0, 2, 2, 0, -2]


def test_quantizer_refuses_what_it_cannot_do(int8):
    assert int8.quantize(torch.ones(4, 8), CastSpec(Format.FP8_E4M3, Block(1, 128))) is None
    assert int8.quantize(torch.ones(4, 8), CastSpec(Format.INT8, Block(1, 128))) is None
    assert int8.quantize(torch.ones(2, 4, 8), CastSpec(Format.INT8, ROW)) is None
    assert int8.quantize(torch.ones(4, 8, dtype=torch.float64), CastSpec(Format.INT8, ROW)) is None
    assert int8.quantize(torch.ones(4, 8), CastSpec(Format.INT8, ROW, amax_floor=1e-40)) is None  # subnormal scales
    with pytest.raises(ValueError, match="quantize_rows: the Triton INT8 quantizer takes int8 with one scale per row"):
        int8.quantize_rows(torch.ones(4, 8), CastSpec(Format.INT8, TENSOR))


def _scaled_mm_reference(a: QTensor, b: QTensor, out_dtype):
    """What ``backend: scaled_mm`` computes: the int32 product (``_int_mm``), then (acc * sa) * sb."""
    acc = a.data.cpu().int() @ b.data.cpu().int().t()
    sa = a.scale.cpu().reshape(()) if a.scale.numel() == 1 else a.scale.cpu().reshape(-1, 1)
    sb = b.scale.cpu().reshape(()) if b.scale.numel() == 1 else b.scale.cpu().reshape(1, -1)
    return (acc.float() * sa * sb).to(out_dtype)


@pytest.mark.parametrize("m,n,x_dtype,d_dtype,out,pow2", [
    (6, 256, torch.float32, torch.bfloat16, torch.bfloat16, False),
    (9, 384, torch.bfloat16, None, torch.bfloat16, True),
    (1, 96, torch.float32, None, torch.float32, False), (5, 2100, torch.float32, torch.float32, torch.bfloat16, False)])
def test_norm_int8_quantizer_is_the_fp8_kernels_norm_and_the_row_quantizer(int8, m, n, x_dtype, d_dtype, out, pow2,
                                                                           seed):
    """``int8.rms_norm_quantize``: the residual add and RMSNorm of ``fp8.rms_norm_quantize`` (s, y and
    r bit for bit, 2100 wide: the looped passes) with y quantized INT8 per row, ``quantize_rows``' and
    the reference's bytes and scales on that y -- the same when y is not written. An all-zero row, a
    row holding a NaN (its scale NaN, its bytes 0)."""
    from jetrl_cli.kernels import fp8

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).to(x_dtype).to(dev())
    delta = None if d_dtype is None else torch.randn(m, n, generator=g).to(d_dtype).to(dev())
    w = (torch.rand(n, generator=g) + 0.5).to(dev())
    x[0] = 0.0
    if delta is not None:
        delta[0] = 0.0
    if m > 2:
        x[2, n - 1] = float("nan")
    s, y, r, q = int8.rms_norm_quantize(x, delta, w, 1e-6, out, Format.INT8, pow2, write_y=True, rsqrt=True)
    want_s, want_y, want_r, _ = fp8.rms_norm_quantize(x, delta, w, 1e-6, out, write_y=True, rsqrt=True)
    for got, want in ((s, want_s), (y, want_y), (r, want_r)):
        assert (got is None) == (want is None), seed
        assert got is None or (got.dtype == want.dtype
                               and torch.equal(got.view(torch.uint8), want.view(torch.uint8))), seed
    spec = CastSpec(Format.INT8, ROW, pow2)
    assert q.spec == spec and q.data.shape == (m, n) and q.scale.shape == (m, 1)
    assert same(q, int8.quantize_rows(y, spec)) and same(q, quantize(y.float(), spec)), seed
    if m > 2:
        assert bool(q.scale[2].isnan()) and not q.data[2].any()
    _, none_y, none_r, alone = int8.rms_norm_quantize(x, delta, w, 1e-6, out, Format.INT8, pow2)
    assert none_y is None and none_r is None and same(alone, q)
    with pytest.raises(ValueError, match="rms_norm_quantize: the Triton INT8 quantizer takes int8 with one scale"):
        int8.rms_norm_quantize(x, delta, w, 1e-6, out, Format.FP8_E4M3)


@pytest.mark.parametrize("m,i,dtype,pow2", [(1, 96, torch.bfloat16, False), (7, 640, torch.float32, True),
                                            (20, 1100, torch.bfloat16, False), (3, 4200, torch.bfloat16, True),
                                            (70, 300, torch.float32, False)])  # decode: chunks of 4096; prefill
def test_swiglu_int8_quantizer_is_the_row_quantizer_of_h(int8, m, i, dtype, pow2, seed):
    """``int8.swiglu_quantize``: h = g / (1 + exp(-g)) * u in fp32 (the FP8 SwiGLU kernel's form, with
    the interpreter's exp: numpy's), quantized per row -- ``quantize_rows``' bytes and scales on that
    h, bit for bit (on a GPU Triton's exp may move a byte by one); a row holding a NaN gets a NaN
    scale and zero bytes; h is never written."""
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(m, 2 * i, generator=g) * 3).to(dtype)
    gu[0, :i] = 0.0  # a row of zero h
    if m > 3:
        gu[3, i + 5] = float("nan")
    gf, uf = (t.float().numpy() for t in gu.chunk(2, dim=1))
    h = torch.from_numpy((gf / (np.float32(1) + np.exp(-gf))) * uf)
    spec = CastSpec(Format.INT8, ROW, pow2)
    got, kept = int8.swiglu_quantize(gu.to(dev()), Format.INT8, pow2)
    want = int8.quantize_rows(h.to(dev()), spec)
    assert kept is None and got.spec == spec and got.data.shape == (m, i) and got.scale.shape == (m, 1)
    if torch.cuda.is_available():
        assert (got.data.int() - want.data.int()).abs().max() <= 1, seed
    else:
        assert same(got, want) and same(got, quantize(h, spec)), seed
    if m > 3:
        assert bool(got.scale[3].isnan()) and not got.data[3].any()
    with pytest.raises(ValueError, match="swiglu_quantize: keeps no copy of gu"):
        int8.swiglu_quantize(gu.to(dev()), save=True)


@pytest.mark.parametrize("m", [1, 7, 16, 17, 64, 65, 200])
@pytest.mark.parametrize("n,k", [(64, 128), (130, 300), (48, 1536)])
def test_int8_gemm_is_the_scaled_mm_backend_bit_for_bit(int8, m, n, k, seed):
    spec = CastSpec(Format.INT8, ROW)
    a, b = quantize(spread(m, k, seed), spec), quantize(spread(n, k, seed + 1) * 0.05, spec)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = int8.int8_mm(a, b, out_dtype)
        assert got.dtype is out_dtype and got.shape == (m, n)
        assert torch.equal(got.cpu(), _scaled_mm_reference(a, b, out_dtype)), f"seed {seed}, {out_dtype}"
    ref = dequantize(a).cpu().double() @ dequantize(b).cpu().double().t()  # float64 on the CPU, as `finite` indexes
    finite = ref.isfinite().all(dim=1)
    assert error_stats(ref[finite], int8.int8_mm(a, b).cpu().double()[finite])["rel_err"] < 1e-6, f"seed {seed}"


@pytest.mark.parametrize("m,n,k,split", [(1, 64, 384, 1), (7, 130, 1000, 3), (70, 48, 256, 1)])
def test_int8_gemm_adds_a_bias_in_its_epilogue_as_the_separate_add_does(int8, m, n, k, split, seed):
    """``int8_mm(bias=)``: the bias added in the epilogue (split K or not) is ``int8_mm(...) + bias``
    bit for bit, in bf16 (two roundings, as torch adds two bf16 tensors) and fp32; the triton
    backend's ``mm_bias`` takes this path, so a q/k/v GEMM with bias is one kernel."""
    spec = CastSpec(Format.INT8, ROW)
    a, b = quantize(spread(m, k, seed), spec), quantize(spread(n, k, seed + 1) * 0.05, spec)
    g = torch.Generator().manual_seed(seed + 2)
    for out_dtype in (torch.float32, torch.bfloat16):
        bias = (torch.randn(n, generator=g) * 3).to(dev(), out_dtype)
        want = int8.int8_mm(a, b, out_dtype, split=split) + bias
        got = int8.int8_mm(a, b, out_dtype, split=split, bias=bias)
        assert got.dtype is out_dtype and torch.equal(got, want), f"seed {seed}, {out_dtype}"
    backend = gemm.TritonBackend()
    assert torch.equal(backend.mm_bias(a, b, Format.FP32, bias.float()), int8.int8_mm(a, b) + bias.float())
    with pytest.raises(ValueError, match=r"int8_mm: bias must be \(%d,\) torch.float32" % n):
        int8.int8_mm(a, b, torch.float32, bias=bias)


@pytest.mark.parametrize("m,n,k", [(1, 64, 384), (7, 130, 1000), (64, 48, 1536)])
def test_int8_split_k_gemm_is_the_unsplit_gemm_bit_for_bit(int8, m, n, k, seed):
    """A decode step's INT8 GEMM split over K (``fp8.decode_split``'s choice, or ``split_k``): the
    splits' int32 partial sums add exactly, so every split gives the unsplit result's bits --
    ``scaled_mm``'s -- with per-row and per-tensor scales and a strided weight."""
    from jetrl_cli.kernels import fp8

    for block in (ROW, TENSOR):
        spec = CastSpec(Format.INT8, block)
        a, b = quantize(spread(m, k, seed), spec), quantize(spread(n, k, seed + 1) * 0.05, spec)
        b = QTensor(b.data.t().contiguous().t(), b.scale, spec)
        for out_dtype in (torch.float32, torch.bfloat16):
            want = _scaled_mm_reference(a, b, out_dtype)
            for split in (2, 3, 8):
                assert torch.equal(int8.int8_mm(a, b, out_dtype, split=split).cpu(), want), (block, split)
            for split in (1, 3):  # each K block's product as b @ a.T (the weight's rows as the MMA's): exact too
                assert torch.equal(int8.int8_mm(a, b, out_dtype, split=split, swap=True).cpu(), want), (block, split)
            with fp8.split_k(4):
                assert torch.equal(int8.int8_mm(a, b, out_dtype).cpu(), want)


def test_int8_decode_split_is_timed_on_int8_operands(int8, monkeypatch):
    """The split choice of an INT8 decode GEMM times ``int8_mm`` (not the FP8 GEMM) under its own name, each
    split with the plain tiles and as ``b @ a.T`` (no last-program sum: INT8's partials are int32)."""
    from jetrl_cli.kernels import fp8
    from jetrl_cli.precision import gemm

    monkeypatch.setattr(gemm, "_KERNELS", {})
    runs = []

    def device_time_ms(fn, device):
        out = fn()
        runs.append(out.shape)
        return 1.0 / len(runs)  # the last (most splits) fastest

    monkeypatch.setattr(gemm, "device_time_ms", device_time_ms)
    where = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    op = f"int8 {fp8.SPLIT_OP} 16 rows, 40 x 640"
    got = fp8._choose_split(op, "int8", 16, 40, 640, where)
    assert runs == [(16, 40)] * 8 and (got["split"], got["fused"], got["swap"]) == (5, False, True)
    assert got["kernel"] == "5 splits, b @ a.T" and gemm.kernel_choice(op, where) is got
    if where.type == "cuda":
        assert fp8._decode_flag(16, 40, 640, where, "swap", "int8")


def test_int8_gemm_with_per_tensor_scales_and_strided_operands(int8, seed):
    t = CastSpec(Format.INT8, TENSOR)
    a, b = quantize(spread(20, 256, seed), t), quantize(spread(72, 256, seed + 1), t)
    assert a.scale.numel() == b.scale.numel() == 1
    assert torch.equal(int8.int8_mm(a, b).cpu(), _scaled_mm_reference(a, b, torch.float32))
    # a row-sliced view of a bigger operand (the engine's live rows), b transposed twice (strides (1, K))
    r = CastSpec(Format.INT8, ROW)
    big = quantize(spread(40, 256, seed + 2), r)
    view = QTensor(big.data[5:25], big.scale[5:25], r)
    wt = quantize(spread(72, 256, seed + 3), r)
    wt = QTensor(wt.data.t().contiguous().t(), wt.scale, r)
    assert wt.data.stride() == (1, 72)
    assert torch.equal(int8.int8_mm(view, wt).cpu(), _scaled_mm_reference(view, wt, torch.float32))


def test_int8_gemm_refuses_what_it_cannot_do(int8):
    r = CastSpec(Format.INT8, ROW)
    a, b = quantize(torch.randn(4, 64), r), quantize(torch.randn(8, 32), r)
    with pytest.raises(ValueError, match=r"shapes \(4, 64\) and \(8, 32\) do not match"):
        int8.int8_mm(a, b)
    with pytest.raises(ValueError, match="int8_mm writes float32 or bfloat16"):
        int8.int8_mm(a, quantize(torch.randn(8, 64), r), torch.float16)
    grouped = quantize(torch.randn(8, 256), CastSpec(Format.INT8, Block(1, 128)))
    with pytest.raises(ValueError, match="operand b: int8_mm takes one scale per row"):
        int8.int8_mm(quantize(torch.randn(4, 256), r), grouped)
    fp8 = quantize(torch.randn(8, 64), CastSpec(Format.FP8_E4M3, ROW))
    with pytest.raises(ValueError, match="int8_mm takes int8 operands"):
        int8.int8_mm(a, fp8)


# --------------------------------------------------------------------------- the triton backend


def test_the_triton_backend_takes_int8_rows_and_the_invariant_one_does_not():
    flow = parse_flow("int8-rollout")
    spec = flow.rollout.linear
    dev_ = torch.device(dev())
    assert gemm.get_backend("triton").unsupported(spec, "rollout.linear", dev_) is None
    assert "FP8 operands" in gemm.get_backend("invariant").unsupported(spec, "rollout.linear", dev_)
    grouped = type(spec)(CastSpec(Format.INT8, Block(1, 128)), CastSpec(Format.INT8, ROW), spec.out, "triton")
    why = gemm.get_backend("triton").unsupported(grouped, "rollout.linear", dev_)
    assert "INT8 with per-row scales; operand a is int8[1x128], i.e. 1x128 along the reduction dim" in why
    # Dgrad of per-channel weights: the weight's scales run along the reduction, no kernel takes that
    dgrad = type(spec)(CastSpec(Format.INT8, ROW), CastSpec(Format.INT8, ROW), spec.out, "triton")
    assert "operand b" in gemm.get_backend("triton").unsupported(dgrad, "dgrad", dev_)


def test_triton_backend_casts_and_multiplies_as_scaled_mm_does(forced_native, seed):
    tri, smm = gemm.get_backend("triton"), gemm.ScaledMMBackend()
    spec = CastSpec(Format.INT8, ROW)
    x = spread(24, 384, seed, torch.bfloat16)
    w = spread(96, 384, seed + 1) * 0.05
    xa, wb = tri.cast(x, spec), tri.cast(w, spec)
    assert same(xa, quantize(x, spec)) and same(wb, quantize(w, spec))
    assert tri.shape_unsupported(xa, wb) is None
    got = tri.mm(xa, wb, Format.BF16)
    assert got.dtype is torch.bfloat16 and torch.equal(got, smm.mm(xa, wb, Format.BF16)), f"seed {seed}"
    long_k = QTensor(torch.zeros(1, gemm.INT8_K_LIMIT + 1, dtype=torch.int8), torch.ones(1, 1), spec)
    assert "could overflow" in tri.shape_unsupported(long_k, long_k)
    assert "could overflow" in smm.shape_unsupported(long_k, long_k)


@pytest.mark.slow  # 20 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_int8_rollout_through_triton_samples_what_scaled_mm_samples(forced_native, int8, monkeypatch):
    """The embedded engine's native INT8 rollout (bf16 activations, weights held as INT8 once per
    sync): the same tokens and logprobs through the Triton kernels as through ``_int_mm``. On either
    kernel backend each RMSNorm writes its INT8 operand itself (``int8.rms_norm_quantize``: q/k/v's
    and gate/up's inputs) and the SwiGLU down's (``int8.swiglu_quantize``), so a step quantizes only
    o_proj's input on its own."""
    calls = {"int8_mm": 0, "quantize_rows": 0, "rms_norm_quantize": 0, "swiglu_quantize": 0}
    for name in calls:
        fn = getattr(int8, name)

        def counted(*a, _fn=fn, _n=name, **k):
            calls[_n] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(int8, name, counted)
    model = random_model(tiny_config("qwen2", hidden=128, layers=1, vocab=128), seed=5, std=0.05).to(dev())
    prompts = [[5, 9, 3], [7, 2, 11, 4, 8]]
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)

    def rollout(backend):
        flow = parse_flow({"base": "int8-rollout", "rollout": {"linear": {"backend": backend}}})
        eng = EmbeddedEngine(model, flow, 32, max_batch=4, cuda_graphs=False)
        eng.load_weights(make_payload(model, flow))
        first = [(c.tokens, c.logprobs) for g in eng.generate(prompts, params, seed=4) for c in g]
        before = dict(calls)  # the weights' INT8 operands are cached by now (on CPU: made at the first step)
        out = [(c.tokens, c.logprobs) for g in eng.generate(prompts, params, seed=4) for c in g]
        assert out == first
        steps = {k: v - before[k] for k, v in calls.items()}  # one layer: 2 norms, 4 GEMMs a forward
        forwards = steps["swiglu_quantize"]
        assert forwards > 0 and steps["rms_norm_quantize"] == 2 * forwards, steps
        if backend == "triton":  # (scaled_mm's own activation quantizer on CPU is the reference)
            assert steps["quantize_rows"] == forwards and steps["int8_mm"] == 4 * forwards, steps
        return out

    if torch.cuda.is_available():  # a GPU times its split-K choices at each GEMM shape's first call: not counted
        rollout("triton")
        calls.update(int8_mm=0, quantize_rows=0, rms_norm_quantize=0, swiglu_quantize=0)
    outs = {}
    for backend in ("triton", "scaled_mm"):
        outs[backend] = rollout(backend)
        if backend == "triton":
            assert calls["int8_mm"] > 0, calls
            gemms = calls["int8_mm"]
    assert calls["int8_mm"] == gemms  # scaled_mm: torch._int_mm (its quantizer is this one on a GPU)
    assert outs["triton"] == outs["scaled_mm"]
    assert sum(len(t) for t, _ in outs["triton"]) > 8
