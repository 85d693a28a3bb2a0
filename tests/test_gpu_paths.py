"""The GPU training path, checked on CPU where it can be and under the ``gpu`` marker where not.

On CPU: the native code path (bf16 tensors, real low-precision matmuls, SDPA) forced on tiny
shapes and compared with the emulated one; the scale layouts handed to ``scaled_mm``, checked by
torch's own shape/stride checks on meta tensors; ``auto`` resolution and counted fallbacks; the
memory-lean logprobs and backward passes against references. Under ``-m gpu`` (a CUDA machine): the
blockwise ``scaled_mm`` backend against the emulated reference, ``auto`` picking a kernel backend,
and a native training step against the CPU emulation.
"""

import collections
import contextlib
import functools
import copy
import math

import pytest
import torch

from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.errors import JetrlError
from jetrl_cli.models.llama import RMSNorm
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import CastSpec, GemmSpec, JetLinear, LinearPrecision, apply_flow, named_flow
from jetrl_cli.precision import gemm
from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.precision.quant import QTensor, dequantize, error_stats, quantize
from jetrl_cli.rl import trainer as trainer_mod
from jetrl_cli.rl.trainer import Batch, token_logprobs

from .conftest import fresh_seed

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _model(seed=0, hidden=128, layers=2, vocab=256):
    return random_model(tiny_config("qwen2", hidden=hidden, layers=layers, vocab=vocab), seed=seed, std=0.05)


# Where the Triton kernels run: on a GPU machine its GPU (natively), else CPU tensors in Triton's
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there) with the native path forced.
TRITON_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(vocab, n=3, t=24, seed=1):
    g = gen(seed)
    ids = torch.randint(1, vocab, (n, t), generator=g)
    return Batch.build(ids[:, :8].tolist(), ids[:, 8:].tolist(), [[0.0] * (t - 8)] * n, [0.0] * n, list(range(n)))


# --------------------------------------------------------------------------- native path, forced on CPU


# native vs emulated logits: bf16 attention (probabilities rounded inside the SDPA kernel, another
# summation order) moves values by ~2^-8; an FP8 flow then rounds some values to the neighbouring
# E4M3 step (2^-3 apart), so its difference is of the order of FP8 quantization noise (~2^-4.6 rms).
NATIVE_TOL = {"bf16": 2e-2, "fp8-unified": 0.1, "int8-rollout": 2e-2}


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified"])
def test_native_forward_matches_the_emulation(flow, forced_native):
    """The native path runs the same formats as the CPU emulation; only the order of fp32 additions
    and the attention kernel differ."""
    base = _model()
    ids = torch.randint(0, 256, (2, 20), generator=gen(2))
    native_m = copy.deepcopy(base)
    apply_flow(native_m, named_flow(flow), "train")
    with torch.no_grad():
        y_native = native_m(ids)
        qkv = native_m.model.layers[0].self_attn.q_proj(torch.randn(3, 128))
    gemm.set_force_native(False)
    gemm.reset_resolutions()
    emu_m = copy.deepcopy(base)
    apply_flow(emu_m, named_flow(flow), "train")
    with torch.no_grad():
        y_emu = emu_m(ids)
    assert qkv.dtype == torch.bfloat16  # GEMM outputs are bf16 tensors natively
    assert y_native.dtype == y_emu.dtype == torch.float32  # logits: the skipped lm_head writes fp32
    assert error_stats(y_emu, y_native)["rel_err"] < NATIVE_TOL[flow]


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified", "int8-rollout"])
def test_native_and_emulated_agree_where_attention_is_exact(flow, forced_native):
    """One-token sequences: attention returns v, so every other op (casts, quantizers, GEMMs, the
    bf16 / FP8 roundings of outputs, SwiGLU feeding the FP8 down projection in fp32) must agree to
    fp32 accumulation order."""
    base = _model()
    ids = torch.randint(0, 256, (6, 1), generator=gen(2))
    out = {}
    for side, nat in (("native", True), ("emulated", False)):
        gemm.set_force_native(nat)
        gemm.reset_resolutions()
        m = copy.deepcopy(base)
        apply_flow(m, named_flow(flow), "rollout")
        with torch.no_grad():
            out[side] = m(ids)
    assert error_stats(out["emulated"], out["native"])["rel_err"] < 1e-6


def test_native_cache_is_bf16_and_decode_agrees_with_the_full_forward(forced_native):
    m = _model()
    apply_flow(m, named_flow("bf16"), "rollout")
    ids = torch.randint(0, 256, (2, 12), generator=gen(3))
    cache = m.new_cache(2, 32)
    assert cache.kv.dtype == torch.bfloat16
    with torch.no_grad():
        first = m.prefill(ids[:, :8], torch.tensor([8, 8]), cache)
        nxt = m.decode(ids[:, 8], cache)
        full = m(ids[:, :9])
    assert error_stats(full[:, 7], first)["rel_err"] < 1e-2
    assert error_stats(full[:, 8], nxt)["rel_err"] < 1e-2


def test_native_training_step_matches_the_emulation(forced_native):
    base = _model(seed=4)
    b = _batch(256)
    sp = SamplingParams()

    def grads(native):
        gemm.set_force_native(native)
        gemm.reset_resolutions()
        m = copy.deepcopy(base)
        apply_flow(m, named_flow("fp8-unified"), "train")
        token_logprobs(m, b, sp).sum().backward()
        return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    g_native, g_emu = grads(True), grads(False)
    assert set(g_native) == set(g_emu) and len(g_emu) > 10
    for n in g_emu:
        assert g_native[n].dtype == torch.float32  # master-weight gradients stay fp32
        assert error_stats(g_emu[n], g_native[n])["rel_err"] < 2 * NATIVE_TOL["fp8-unified"], n


def test_fp8_flow_saves_at_most_0_6x_of_bf16_activations_at_a_real_layer_shape(forced_native):
    """Issue target: saved-activation bytes <= 0.6x of the bf16 flow's. Measured with the native
    path's dtypes on a model with Qwen2.5-1.5B's layer proportions scaled down 4x (the GPU number
    itself is measured by `jetrl bench train` on a GPU)."""
    from jetrl_cli.bench import _saved_bytes
    from jetrl_cli.models.llama import ModelConfig

    cfg = ModelConfig("qwen2", vocab_size=2048, hidden_size=384, intermediate_size=2240, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=1, head_dim=64, attention_bias=True)
    base = random_model(cfg)
    b = _batch(2048, n=2, t=136)
    saved = {}
    for flow in ("bf16", "fp8-unified"):
        m = copy.deepcopy(base)
        apply_flow(m, named_flow(flow), "train")
        saved[flow], _ = _saved_bytes(lambda: token_logprobs(m, b, SamplingParams()).sum())
    assert saved["fp8-unified"] <= 0.6 * saved["bf16"], saved


# --------------------------------------------------------------------------- scaled_mm layouts (meta tensors)


def _blockwise_operands(kind: str, x, w, gy) -> tuple:
    """The K-major FP8 operands of a linear layer's ``kind`` GEMM (x: tokens x K, w: N x K, gy:
    tokens x N), as the scaled_mm backend receives them."""
    e4 = "fp8_e4m3"
    if kind == "fprop":
        return quantize(x, CastSpec(e4, "1x128")), quantize(w, CastSpec(e4, "128x128"))
    if kind == "dgrad":
        return quantize(gy, CastSpec(e4, "1x128")), quantize(w, CastSpec(e4, "128x128")).t()
    return quantize(gy, CastSpec(e4, "128x1")).t(), quantize(x, CastSpec(e4, "128x1")).t()


@pytest.mark.parametrize("kind,t", [("fprop", 256), ("fprop", 1), ("fprop", 3), ("dgrad", 256), ("dgrad", 1),
                                    ("wgrad", 256)])
def test_blockwise_operands_pass_torchs_scaled_mm_checks(kind, t, forced_native):
    """The layouts the scaled_mm backend hands over are the ones torch checks for (shapes and
    strides), for each GEMM of a linear layer; run on meta tensors, so no GPU is needed. One row
    too (a decode step with one live sequence): torch wants the scales' row stride to be 1 even
    then, which a reference-quantized (1, K/128) scale grid does not have."""
    if gemm._scaled_mm_v2() is None:
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    k, n = 384, 640
    a, b = _blockwise_operands(kind, torch.randn(t, k), torch.randn(n, k), torch.randn(t, n))

    def meta(q):
        return QTensor(q.data.to("meta"), q.scale.to("meta"), q.spec)

    out = gemm.ScaledMMBackend().mm(meta(a), meta(b), Format.BF16)
    assert out.device.type == "meta" and tuple(out.shape) == (a.data.shape[0], b.data.shape[0])
    assert out.dtype == torch.bfloat16


def _blockwise_scaled_mm_stand_in(seen):
    """``torch.nn.functional.scaled_mm`` for the blockwise recipes, computed on CPU in float64 from
    exactly the tensors it is handed (data, and scales read through their strides): what a GPU's
    kernel would compute, for checking what jetrl hands it. Records a's rows and scale strides."""
    def f(a, b_t, sa, ra, sb, rb, output_dtype):
        seen.append((a.shape[0], tuple(sa.stride())))
        m, k = a.shape
        n = b_t.shape[1]
        av = a.double() * sa.double().repeat_interleave(128, dim=1)[:, :k]
        if rb.name == "BlockWise128x128":  # sb: (L4, N/128) with strides (1, L4): [k-group, n-group]
            bs = sb.double().repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
        else:  # BlockWise1x128 as b: (N, K/128), strides (1, N)
            bs = sb.double().repeat_interleave(128, dim=1)[:, :k].t()
        return (av @ (b_t.double() * bs)).to(output_dtype)

    return f


@pytest.mark.parametrize("t", [1, 2, 3, 5, 8, 130])
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_scaled_mm_gets_rows_in_multiples_of_four_and_the_callers_rows_back(kind, t, forced_native, monkeypatch):
    """A decode step's M (and a prefill's) can be any number; Hopper's blockwise GEMMs read the
    scale grid's columns (M values each) with 16-byte alignment, so the scaled_mm backend pads a's
    rows to a multiple of 4 (zero data, scale 1) and returns the caller's rows: those of the
    unpadded product. Checked with a CPU stand-in of scaled_mm that computes from what it is handed,
    against the emulated GEMM on the same operands, and against torch's own layout checks (meta)."""
    st = gemm._scaled_mm_v2()
    if st is None:
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    seen = []
    monkeypatch.setattr(gemm, "_scaled_mm_v2", lambda: (_blockwise_scaled_mm_stand_in(seen), st[1]))
    k, n = 384, 640
    a, b = _blockwise_operands(kind, torch.randn(t, k), torch.randn(n, k), torch.randn(t, n))
    got = gemm.ScaledMMBackend().mm(a, b, Format.FP32)
    rows = a.data.shape[0]
    assert got.shape == (rows, b.data.shape[0])
    (handed,) = seen
    assert handed[0] % 4 == 0 and handed[0] - rows < 4 and handed[1] == (1, handed[0]), handed
    ref = gemm.EmulatedBackend().mm(a, b)
    assert error_stats(ref, got)["rel_err"] < 1e-6


@pytest.mark.parametrize("refused", [False, True])
def test_scaled_mm_adds_a_bias_in_its_epilogue_where_it_takes_one(refused, forced_native, monkeypatch):
    """A blockwise Fprop GEMM with a bias (a Qwen2 model's q/k/v) hands the bias to scaled_mm: added to
    the fp32 sum before the output is rounded (the emulated GEMM's order; one kernel where the add
    after it was another). Decided at the first call on a device and reported; where scaled_mm
    refuses a bias with block scales, the refusal is kept and reported, the bias is added after the
    GEMM (as before), and scaled_mm is not asked again. (A CPU stand-in of scaled_mm in float64.)"""
    st = gemm._scaled_mm_v2()
    if st is None:
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    monkeypatch.setattr(gemm, "_KERNELS", {})
    plain, asked = _blockwise_scaled_mm_stand_in([]), []

    def scaled_mm(a, b_t, sa, ra, sb, rb, output_dtype, bias=None):
        asked.append(bias is not None)
        if bias is not None and refused:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmul( ... )`")
        y = plain(a, b_t, sa, ra, sb, rb, torch.float64)
        return (y if bias is None else y + bias.double()).to(output_dtype)

    monkeypatch.setattr(gemm, "_scaled_mm_v2", lambda: (scaled_mm, st[1]))
    g = gen(fresh_seed())
    t, k, n = 5, 384, 640
    a, b = _blockwise_operands("fprop", torch.randn(t, k, generator=g), torch.randn(n, k, generator=g), None)
    bias = (torch.randn(n, generator=g) * 4).bfloat16()
    be = gemm.ScaledMMBackend()
    exact = plain(*_handed(a, b), torch.float64)[:t]  # (its rows padded to a multiple of 4)
    want = gemm.add_bias(exact.bfloat16(), bias) if refused else (exact + bias.double()).bfloat16()
    for _ in range(2):
        got = gemm._mm_bias(be, a, b, Format.BF16, bias)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert asked == ([True, False, False] if refused else [True, True])
    choice = gemm.kernel_choice(gemm.BIAS_OP, torch.device("cpu"))
    assert choice["epilogue"] is not refused
    assert choice["kernel"] == ("added after the GEMM" if refused else "in scaled_mm's epilogue")
    assert ("CUBLAS_STATUS_NOT_SUPPORTED" in choice["why"]) if refused else "why" not in choice
    assert not torch.equal((exact + bias.double()).bfloat16(), gemm.add_bias(exact.bfloat16(), bias))  # two roundings
    dense = gemm.ScaledMMBackend().mm_bias(a.dequantize(), b, Format.BF16, bias)  # not 8-bit: not this path
    assert dense is None


@pytest.mark.parametrize("how", ["writes", "other bits", "refused"])
def test_an_fp8_wgrad_writes_its_product_straight_into_the_gradient(how, forced_native, monkeypatch):
    """``accumulate_gemm``'s overwrite of an FP8 Wgrad (an optimizer step's first backward into gradients
    the CUDA graphs keep): scaled_mm writes the product into ``.grad`` (``out=``), no product of its own
    then copied. Decided at the first call on a device, outside a graph capture, by writing once both
    ways: kept where ``out=`` gives the functional call's bits; where it gives others or is refused,
    the product is copied (as before), said why, and ``out=`` not asked again. (CPU stand-ins of
    scaled_mm in float64.)"""
    st = gemm._scaled_mm_v2()
    if st is None:
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    monkeypatch.setattr(gemm, "_KERNELS", {})
    plain, into = _blockwise_scaled_mm_stand_in([]), []

    def scaled_mm_into(a, b_t, sa, ra, sb, rb, out_dtype, out, bias=None):
        into.append(out.data_ptr())
        if how == "refused":
            raise RuntimeError("_scaled_mm_v2: out must be contiguous")
        y = plain(a, b_t, sa, ra, sb, rb, out_dtype)
        return out.copy_(y if how == "writes" else y * 1.0001)

    monkeypatch.setattr(gemm, "_scaled_mm_v2", lambda: (plain, st[1]))
    monkeypatch.setattr(gemm, "_scaled_mm_into", scaled_mm_into)
    g = gen(fresh_seed())
    t, k, n = 256, 384, 512
    a, b = _blockwise_operands("wgrad", torch.randn(t, k, generator=g), None, torch.randn(t, n, generator=g))
    be = gemm.ScaledMMBackend()
    want = be.mm(a, b)
    for i in range(2):
        grad = torch.full((n, k), float("nan"))
        if how == "writes" or i == 0:
            into.clear()
        assert be.mm_into(a, b, grad) is (how == "writes")
        if how == "writes":  # written where it is held (the first call checked into a tensor of its own)
            assert torch.equal(grad, want) and into[-1] == grad.data_ptr() and len(into) == 2 - i
        else:
            assert grad.isnan().all() and len(into) == 1  # asked once, at the first call
    choice = gemm.kernel_choice(gemm.INTO_OP, torch.device("cpu"))
    assert choice["into"] is (how == "writes")
    assert choice["why"].startswith({"writes": "checked on (512, 384)", "other bits": "scaled_mm(out=) wrote other",
                                     "refused": "scaled_mm(out=) refused: RuntimeError: _scaled_mm_v2: out"}[how])
    assert not be.mm_into(a, b, torch.empty(n, k).t().contiguous().t())  # not contiguous: not written
    assert not be.mm_into(a.dequantize(), b, torch.empty(n, k))  # not 8-bit: not this path


def test_an_fp8_wgrad_is_not_decided_inside_a_graph_capture(forced_native, monkeypatch):
    """Nothing is decided inside a CUDA graph capture (no timing, no check): the product is copied
    there, and the check happens at the first call outside one (the graphs' warm-up runs first)."""
    st = gemm._scaled_mm_v2()
    if st is None:
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(gemm, "_scaled_mm_v2", lambda: (_blockwise_scaled_mm_stand_in([]), st[1]))
    monkeypatch.setattr(gemm, "capturing", lambda dev: True)
    a, b = _blockwise_operands("wgrad", torch.randn(128, 256), None, torch.randn(128, 128))
    assert not gemm.ScaledMMBackend().mm_into(a, b, torch.empty(128, 256))
    assert gemm.kernel_choice(gemm.INTO_OP, torch.device("cpu")) is None


def _handed(a, b) -> tuple:
    """What ``ScaledMMBackend`` hands scaled_mm for the blockwise operands ``a``, ``b`` (bar the recipes)."""
    from jetrl_cli.kernels.layouts import pad_rows, scaled_mm_scale, to_gemm_layout

    a, b = pad_rows(to_gemm_layout(a)), to_gemm_layout(b)
    st = gemm._scaled_mm_v2()[1]
    return (a.data, b.data.t(), scaled_mm_scale(a, "a", "v2"), st.BlockWise1x128, scaled_mm_scale(b, "b", "v2"),
            st.BlockWise128x128)


# --------------------------------------------------------------------------- auto, explicit backends, fallbacks


def test_auto_resolves_to_the_emulated_reference_on_cpu_and_says_why():
    gemm.reset_resolutions()
    spec = named_flow("fp8-unified").train.linear.fprop
    assert spec.backend == "auto"
    res = gemm.resolve(spec, "fprop", "cpu")
    assert res.backend == "emulated" and res.candidates == ["emulated"]
    assert set(res.rejected) == {"scaled_mm", "triton"}
    bf = named_flow("bf16").train.linear.fprop
    assert gemm.resolve(bf, "fprop", "cpu").backend == "torch"  # unscaled: no FP8 backend involved
    report = gemm.backend_report()
    assert [r["backend"] for r in report["resolved"]] == ["emulated"] and report["fallbacks"] == []
    gemm.reset_resolutions()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("g", ["fprop", "dgrad", "wgrad"])
def test_auto_probes_each_gemm_with_operands_cast_as_the_layers_cast_them(g):
    """``auto``'s probe (and timing) casts a GEMM's operands as the layers do: Wgrad's x^T and dy^T
    with 128x1 groups along tokens, transposed into K-major operands. Cast as plain K-major operands
    they are 128x1 scales along K, which no kernel backend takes, and ``auto`` would reject every
    kernel for Wgrad (what the fake-CUDA bench run found)."""
    from .triton_interp_fix import fixed_fp8_conversion

    be = gemm.get_backend("triton")
    spec = getattr(named_flow("fp8-unified").train.linear, g)
    x = torch.randn(256, 256, generator=gen(3)).to(TRITON_DEV)
    with fixed_fp8_conversion():
        assert gemm._probe(be, spec, g, torch.device(TRITON_DEV)) is None
        a, b = gemm._operands(be, spec, g, x, x * 0.5)
    assert be.shape_unsupported(a, b) is None and a.spec.block.name in ("1x128", "128x128")


def test_int8_gemm_with_few_rows_runs_as_cublas_requires(forced_native, monkeypatch):
    """torch._int_mm on CUDA takes only more than 16 rows (cuBLAS), and a decode step has fewer: the
    native path pads rows with zeros (int32 accumulation: exact) and cuts them off. The CUDA rule is
    imposed here on torch's CPU _int_mm; results must equal the unpadded product."""
    plain = torch._int_mm

    def cuda_rule(x, w):
        assert x.shape[0] > 16, f"torch._int_mm: self.size(0) needs to be greater than 16, but got {x.shape[0]}"
        return plain(x, w)

    be = gemm.ScaledMMBackend()
    spec = CastSpec("int8", "row")
    w = be.cast(torch.randn(48, 64, generator=gen(4)), spec)
    for m in (1, 5, 16, 17, 40):
        x = be.cast(torch.randn(m, 64, generator=gen(m)), spec)
        monkeypatch.setattr(torch, "_int_mm", plain)
        want = (plain(x.data, w.data.t()).float() * x.scale.reshape(m, 1) * w.scale.reshape(1, 48)).to(torch.bfloat16)
        monkeypatch.setattr(torch, "_int_mm", cuda_rule)
        got = be.mm(x, w, Format.BF16)
        assert got.shape == (m, 48) and torch.equal(got, want), m


class _StandInGraph:
    """torch.cuda.CUDAGraph's part that ``_time_ms`` uses: capture records the calls, replay runs them."""

    def __init__(self, fail=False):
        if fail:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.calls = []
        self.replays = 0

    def replay(self):
        self.replays += 1
        for fn in self.calls:
            fn()


@pytest.mark.parametrize("capturable", [True, False])
def test_auto_times_device_work_at_the_rows_each_gemm_runs(monkeypatch, capturable):
    """``auto``'s timing: a GEMM at the rows it is asked (a decode step's 64), else at 2048 (here 256),
    ``TIMED_CALLS`` calls captured in one graph and replayed (device time, as a captured decode step
    pays it); eagerly when capture fails."""
    import contextlib

    graphs, rows, capturing = [], [], []

    class Recording(gemm.EmulatedBackend):
        def mm(self, a, b, out=Format.FP32):
            rows.append(a.shape[0])
            if capturing:
                graphs[-1].calls.append(lambda: rows.append(a.shape[0]))
                return None
            return super().mm(a, b, out)

    def new_graph():
        graphs.append(_StandInGraph(fail=not capturable))
        return graphs[-1]

    @contextlib.contextmanager
    def capture(graph):
        capturing.append(True)
        try:
            yield
        finally:
            capturing.clear()

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    spec = named_flow("int8-rollout").rollout.linear
    n = gemm.TIMED_CALLS
    for want in (64, 256):
        rows.clear()
        assert gemm._time_ms(Recording(), spec, "fprop", torch.device("cpu"), rows=64 if want == 64 else None,
                             size=256) > 0
        assert set(rows) == {want}
        if capturable:  # warm-up, capture, then one untimed and three timed replays of the graph
            assert graphs[-1].replays == 4 and len(graphs[-1].calls) == n and len(rows) == n + n + 4 * n
        else:
            assert len(rows) == n + 4 * n  # warm-up, then four eager rounds


def test_row_tiers_keep_only_the_tiers_whose_choice_differs():
    assert gemm.row_tiers([(8, "s"), (64, "s"), (512, "s")], "s") == ()
    assert gemm.row_tiers([(8, "t"), (64, "t"), (512, "s")], "s") == ((64, "t"),)
    assert gemm.row_tiers([(8, "s"), (64, "t"), (512, "t")], "s") == ((8, "s"), (512, "t"))
    assert gemm.row_tiers([(8, "t"), (64, "s"), (512, "t")], "s") == ((8, "t"), (64, "s"), (512, "t"))


class _Recorder(gemm.EmulatedBackend):
    """A kernel backend stand-in: runs the emulated GEMM and records (its name, the rows)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def unsupported(self, spec, g, device):
        return None

    def mm(self, a, b, out=Format.FP32):
        self.calls.append((self.name, a.data.shape[0]))
        return super().mm(a, b, out)


def _stand_in_gpu(monkeypatch, ms, probe=lambda name, rows: None):
    """``auto`` on "cuda" with two recording kernel backends: ``ms(name, rows)`` their timings (rows
    None: 2048), ``probe(name, rows)`` their probes' verdicts. Returns the list the calls go to, and
    the (rows, name) pairs timed."""
    calls, timed = [], []

    def fake_time(backend, spec, g, device, rows=None, size=gemm.TIMING_SIZE):
        timed.append((rows, backend.name))
        return 50.0 if backend.name == "emulated" else ms(backend.name, rows)

    gemm.reset_resolutions()
    monkeypatch.setattr(gemm, "_BACKENDS", {**gemm._BACKENDS, "scaled_mm": _Recorder("scaled_mm", calls),
                                            "triton": _Recorder("triton", calls)})
    monkeypatch.setattr(gemm, "_probe", lambda be, spec, g, device, rows=256: probe(be.name, rows))
    monkeypatch.setattr(gemm, "_time_ms", fake_time)
    return calls, timed


@pytest.mark.parametrize("cut", gemm.ROW_TIERS["fprop"][:-1])
@pytest.mark.parametrize("fast_small", ["triton", "scaled_mm"])
def test_auto_on_a_gpu_picks_the_fastest_kernel_per_row_tier_and_calls_dispatch_by_rows(monkeypatch, fast_small, cut):
    """On CUDA, ``auto`` times a forward GEMM's kernel backends at 2048 rows and again at each decode
    tier (``ROW_TIERS``); a call runs on the fastest backend of the smallest tier holding its rows,
    beyond the last on the 2048-row choice. The rollout's decode steps and the trainer's forward both
    run ``fprop``, so this is how a decode step gets the small-M kernel. Here on CPU, with the device
    checks, probes and timings stood in; ``fast_small`` wins up to ``cut`` rows."""
    import random

    from jetrl_cli.live import backend_lines

    dev = torch.device("cuda")
    slow_small = "scaled_mm" if fast_small == "triton" else "triton"
    calls, timed = _stand_in_gpu(monkeypatch, lambda n, rows: 0.5 if n == fast_small and rows is not None and rows <= cut
                                 else {slow_small: 1.0, fast_small: 2.0}[n])
    spec = named_flow("fp8-unified").train.linear.fprop
    try:
        res = gemm.resolve(spec, "fprop", dev)
        assert res.backend == slow_small and res.candidates == [slow_small, fast_small, "emulated"]
        assert res.by_rows == ((cut, fast_small),)
        assert sorted(timed, key=str) == sorted([(None, n) for n in ("emulated", "scaled_mm", "triton")] + [
            (m, n) for m in gemm.ROW_TIERS["fprop"] for n in ("scaled_mm", "triton")], key=str)
        d = res.to_dict()
        assert d["by_rows"] == [{"rows_upto": cut, "backend": fast_small}] and set(d["row_timings_ms"]) == {
            str(m) for m in gemm.ROW_TIERS["fprop"]}
        assert f"up to {cut} rows: {fast_small}" in backend_lines(gemm.backend_report())[0]
        w = quantize(torch.randn(256, 256), spec.b)
        for m in sorted({1, cut, cut + 1, random.randint(1, 600), 2048}):
            calls.clear()
            x = quantize(torch.randn(m, 256), spec.a)
            out = gemm.run_gemm(x, w, spec, "fprop", dev)
            assert calls == [(fast_small if m <= cut else slow_small, m)], (m, calls)
            assert torch.equal(out, gemm.EmulatedBackend().mm(x, w))
        # dgrad and wgrad are training GEMMs of many rows: one choice, no tiers
        for g, s in (("dgrad", named_flow("fp8-unified").train.linear.dgrad),
                     ("wgrad", named_flow("fp8-unified").train.linear.wgrad)):
            timed.clear()
            r = gemm.resolve(s, g, dev)
            assert r.by_rows == () and {rows for rows, _ in timed} == {None}, g
    finally:
        gemm.reset_resolutions()


def test_a_tier_takes_the_fastest_backend_that_is_correct_at_its_rows(monkeypatch):
    """A decode tier's kernel may be another tile configuration than the 256-row probe ran: each
    tier's pick is probed at its rows, and one that fails gives way to the next fastest, or to the
    emulated reference when no kernel is correct there -- said in ``rejected``."""
    dev = torch.device("cuda")
    # triton is fastest at every tier but wrong up to 64 rows; scaled_mm is wrong at 8 rows
    calls, _ = _stand_in_gpu(monkeypatch, lambda n, rows: {"triton": 1.0, "scaled_mm": 2.0}[n],
                             probe=lambda n, rows: "probe: relative error 1 against emulated" if (
                                 rows is not None and (rows <= 8 or (n == "triton" and rows <= 64))) else None)
    spec = named_flow("fp8-unified").train.linear.fprop
    try:
        res = gemm.resolve(spec, "fprop", dev)
        assert res.backend == "triton" and res.by_rows == ((8, "emulated"), (64, "scaled_mm"))
        assert set(res.rejected) == {"triton at 8 rows", "scaled_mm at 8 rows", "triton at 64 rows"}
        w = quantize(torch.randn(256, 256), spec.b)
        for m, want in ((5, []), (40, [("scaled_mm", 40)]), (65, [("triton", 65)])):
            calls.clear()
            x = quantize(torch.randn(m, 256), spec.a)
            assert torch.equal(gemm.run_gemm(x, w, spec, "fprop", dev), gemm.EmulatedBackend().mm(x, w))
            assert calls == want, m
    finally:
        gemm.reset_resolutions()


def test_a_shape_the_backend_cannot_run_falls_back_and_is_counted():
    class EvenK(gemm.EmulatedBackend):
        name = "even_k"

        def shape_unsupported(self, a, b):
            k = a.data.shape[1]
            return None if k % 256 == 0 else f"needs K to be a multiple of 256, got {k}"

        def mm(self, a, b, out=Format.FP32):
            raise AssertionError("the fallback must run this shape, not even_k")

    gemm.reset_resolutions()
    gemm.register_backend("even_k", EvenK())
    try:
        c = CastSpec("fp8_e4m3", "1x128")
        spec = GemmSpec(c, CastSpec("fp8_e4m3", "128x128"), Format.FP32, "even_k")
        layer = JetLinear(torch.nn.Parameter(torch.randn(64, 128)), None, LinearPrecision.forward_only(spec))
        x = torch.randn(5, 128)
        with torch.no_grad():
            got = layer(x)
            layer(x)
        ref_spec = GemmSpec(spec.a, spec.b, spec.out, "emulated")
        ref = JetLinear(torch.nn.Parameter(layer.weight.detach().clone()), None, LinearPrecision.forward_only(ref_spec))
        with torch.no_grad():
            assert torch.equal(got, ref(x))
        fb = gemm.fallbacks()
        assert fb == [{"gemm": "fprop", "spec": spec.short_str(), "from": "even_k", "to": "emulated",
                       "why": "needs K to be a multiple of 256, got 128", "calls": 2}]
    finally:
        gemm._BACKENDS.pop("even_k")
        gemm.reset_resolutions()


# --------------------------------------------------------------------------- memory-lean logprobs, lean backwards


def test_chunked_logprobs_are_the_unchunked_bits_and_gradients(monkeypatch):
    """Scoring a chunk of tokens at a time (recomputed in the backward) changes no logprob bit; the
    gradients differ only by the order in which chunk contributions to lm_head's weight add up."""
    base = _model(seed=5)
    apply_flow(base, named_flow("fp8-unified"), "train")
    b = _batch(256, n=4, t=30)
    sp = SamplingParams(temperature=0.8, top_k=40)

    def run(chunk_elements):
        monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", chunk_elements)
        m = copy.deepcopy(base)
        with torch.no_grad():
            scored = token_logprobs(m, b, sp)
        lp = token_logprobs(m, b, sp)
        lp.sum().backward()
        return scored, lp.detach(), {n: p.grad for n, p in m.named_parameters()}

    one_chunk, chunks_of_7 = run(1 << 30), run(7 * 256)
    assert torch.equal(one_chunk[0], chunks_of_7[0]) and torch.equal(one_chunk[1], chunks_of_7[1])
    assert torch.equal(one_chunk[0], one_chunk[1])  # scoring and training compute the same logprobs
    for n, g in one_chunk[2].items():
        assert torch.allclose(g, chunks_of_7[2][n], rtol=1e-4, atol=1e-6), n


def test_logprobs_hold_no_vocab_sized_tensor_for_the_backward():
    vocab = 4096
    m = _model(vocab=vocab)
    apply_flow(m, named_flow("bf16"), "train")
    b = _batch(vocab, n=2, t=40)
    shapes = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(m, b, SamplingParams()).sum()
    assert shapes and not [s for s in shapes if vocab in s]  # logits are recomputed in the backward


@contextlib.contextmanager
def _bf16_head_model(native: bool, monkeypatch, vocab: int):
    """A fresh random 1-layer model in the bf16 flow (``native``: its GPU numerics) whose logprobs
    take row chunks of 16 and vocabulary slices of 128+, and a generator of the same random seed."""
    gemm.set_force_native(native)
    gemm.reset_resolutions()
    try:
        seed = int(torch.randint(0, 2**31, ()))
        m = _model(seed=seed % 1000, layers=1, vocab=vocab)
        apply_flow(m, named_flow("bf16"), "train")
        monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", 16 * vocab)
        yield m, gen(seed)
    finally:
        gemm.set_force_native(False)
        gemm.reset_resolutions()


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprob_backward_over_vocabulary_slices(monkeypatch, native, temperature):
    """The trainer's logprobs with autograd: the forward row chunk by row chunk (bit for bit the
    row-chunked path's logprobs, so the rollout's), the backward over vocabulary slices of all rows
    from each row's log-normalizer kept by the forward (``rl.head_grad``). Its gradients of the
    lm_head's input and weight agree with float64 to the bf16 flow's precision and with the
    row-chunked backward to fp32 rounding (the input gradient's slices add in fp32 and are rounded
    to bf16 once, as the row-chunked path's one GEMM over the vocabulary does); the whole model's
    gradients too. Top-k / top-p sampling takes the row-chunked path."""
    from jetrl_cli.rl import head_grad

    vocab = 1000
    with _bf16_head_model(native, monkeypatch, vocab) as (m, g):
        sp = SamplingParams(temperature=temperature)
        h = torch.randn(70, 128, generator=g).requires_grad_()
        targets = torch.randint(0, vocab, (70,), generator=g)
        targets[:3] = torch.tensor([0, vocab - 1, 128])  # slice edges
        up = torch.randn(70, generator=g)
        calls = []
        real = head_grad._sliced_grads
        monkeypatch.setattr(head_grad, "_sliced_grads", lambda *a: calls.append(1) or real(*a))

        def run(sliced: bool):
            monkeypatch.setattr(trainer_mod, "sliced_backward_applies",
                                head_grad.sliced_backward_applies if sliced else (lambda *a: False))
            h.grad, m.lm_head.weight.grad = None, None
            lp = trainer_mod.target_logprobs(m, h, targets, sp)
            (lp * up).sum().backward()
            return lp.detach(), h.grad.clone(), m.lm_head.weight.grad.clone()

        rows, sliced = run(False), run(True)
        assert calls == [1]
        assert torch.equal(rows[0], sliced[0])
        hd = h.detach().double().requires_grad_()
        wd = m.lm_head.weight.detach().double().requires_grad_()
        x = hd @ wd.T
        if temperature not in (0.0, 1.0):
            x = x / temperature
        (torch.log_softmax(x, -1).gather(-1, targets[:, None])[:, 0] * up.double()).sum().backward()

        def rel(a, b):
            return float((a.double() - b.double()).norm() / b.double().norm())

        for got, want, ref in ((sliced[1], rows[1], hd.grad), (sliced[2], rows[2], wd.grad)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert rel(got, ref) < 2**-7, rel(got, ref)  # bf16 operands
            assert rel(got, want) < (2**-7 if native else 2**-10), rel(got, want)  # a bf16 rounding flipped here and there
        # top-p / top-k: the row-chunked backward
        assert head_grad.sliced_backward_applies(m, sp)
        assert not head_grad.sliced_backward_applies(m, SamplingParams(top_p=0.9))
        assert not head_grad.sliced_backward_applies(m, SamplingParams(top_k=5))


def test_the_sliced_backward_keeps_the_heads_input_as_its_gemms_read_it(monkeypatch):
    """Natively the lm_head's GEMMs read its fp32 input h in bf16: the forward keeps that bf16 operand
    for the backward, not h (half the bytes), and the gradients are bit for bit those of keeping h;
    the logprobs' and h's gradient's dtype is still h's. In the emulation (fp32 operands holding
    rounded values) h itself is kept."""
    from jetrl_cli.rl import head_grad

    vocab = 600
    for native in (True, False):
        with _bf16_head_model(native, monkeypatch, vocab) as (m, g):
            h = torch.randn(40, 128, generator=g).requires_grad_()
            targets = torch.randint(0, vocab, (40,), generator=g)
            up = torch.randn(40, generator=g)

            def run():
                saved = []

                def pack(t):
                    saved.append((t.dtype, tuple(t.shape)))
                    return t

                h.grad, m.lm_head.weight.grad = None, None
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    lp = trainer_mod.target_logprobs(m, h, targets, SamplingParams())
                (lp * up).sum().backward()
                return saved, lp.detach(), h.grad.clone(), m.lm_head.weight.grad.clone()

            saved, *got = run()
            assert (torch.bfloat16 if native else torch.float32, (40, 128)) in saved
            assert (torch.float32, (40, 128)) not in saved if native else True
            assert got[0].dtype == got[1].dtype == torch.float32
            with monkeypatch.context() as mp:
                mp.setattr(head_grad, "_backward_copy", lambda h, head: h)
                saved_h, *want = run()
            assert (torch.float32, (40, 128)) in saved_h
            for a, b in zip(got, want):
                assert torch.equal(a, b)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_and_entropy_backward_over_vocabulary_slices(monkeypatch, native, temperature):
    """The trainer's logprobs stacked with the entropy (the loss's entropy bonus), with autograd:
    over vocabulary slices, the forward keeps each row's entropy beside its log-normalizer and the
    backward adds the entropy's term in the same pass. Logprobs and entropies are the row-chunked
    path's bits (and the logprobs those without the entropy); the gradients of the lm_head's input
    and weight agree with float64 to the bf16 flow's precision and with the row-chunked backward."""
    from jetrl_cli.rl import head_grad

    vocab = 1000
    with _bf16_head_model(native, monkeypatch, vocab) as (m, g):
        sp = SamplingParams(temperature=temperature)
        h = torch.randn(70, 128, generator=g).requires_grad_()
        targets = torch.randint(0, vocab, (70,), generator=g)
        up, up_ent = torch.randn(70, generator=g), torch.randn(70, generator=g)

        def run(sliced: bool):
            monkeypatch.setattr(trainer_mod, "sliced_backward_applies",
                                head_grad.sliced_backward_applies if sliced else (lambda *a: False))
            h.grad, m.lm_head.weight.grad = None, None
            out = trainer_mod.target_logprobs(m, h, targets, sp, entropy=True)
            assert out.shape == (2, 70)
            ((out[0] * up).sum() + (out[1] * up_ent).sum()).backward()
            return out.detach(), h.grad.clone(), m.lm_head.weight.grad.clone()

        rows, sliced = run(False), run(True)
        assert torch.equal(rows[0], sliced[0])
        with torch.no_grad():
            assert torch.equal(sliced[0][0], trainer_mod.target_logprobs(m, h, targets, sp))
        hd = h.detach().double().requires_grad_()
        wd = m.lm_head.weight.detach().double().requires_grad_()
        ls = torch.log_softmax(hd @ wd.T / temperature, -1)
        ent = -(ls.exp() * ls).sum(-1)
        assert float((sliced[0][1].double() - ent.detach()).abs().max()) < 1e-2 * math.log(vocab)  # bf16 logits
        ((ls.gather(-1, targets[:, None])[:, 0] * up.double()).sum() + (ent * up_ent.double()).sum()).backward()

        def rel(a, b):
            return float((a.double() - b.double()).norm() / b.double().norm())

        for got, want, ref in ((sliced[1], rows[1], hd.grad), (sliced[2], rows[2], wd.grad)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert rel(got, ref) < 2**-7, rel(got, ref)
            assert rel(got, want) < (2**-7 if native else 2**-10), rel(got, want)


def test_logprob_backward_writes_the_lm_head_weight_gradient_once(forced_native, monkeypatch):
    """Over vocabulary slices, each slice's lm_head weight gradient is written once into its rows
    of the gradient (no vocab x hidden sum read and written per row chunk: 0.93 GB each at a 152K
    vocabulary and 1536 hidden), and no log-softmax is recomputed: the gradient comes from the
    recomputed logits and the forward's log-normalizers in one pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = 1000
    m = _model(layers=1, vocab=vocab)
    apply_flow(m, named_flow("bf16"), "train")
    monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", 16 * vocab)
    h = torch.randn(70, 128, generator=gen(1)).bfloat16().requires_grad_()
    lp = trainer_mod.target_logprobs(m, h, torch.randint(0, vocab, (70,), generator=gen(2)), SamplingParams())
    whole = []
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ops.append(func.overloadpacket.__name__)
            if not func.is_view and func.overloadpacket.__name__ != "empty" and any(
                    isinstance(t, torch.Tensor) and t.numel() == vocab * 128 for t in (out if isinstance(out, (tuple, list)) else [out])):
                whole.append(func.overloadpacket.__name__)
            return out

    with Ops():
        lp.sum().backward()
    assert m.lm_head.weight.grad is not None and m.lm_head.weight.grad.shape == (vocab, 128)
    assert whole == [], whole
    assert "_log_softmax" not in ops, ops


@pytest.mark.parametrize("native, tied", [(False, False), (False, True), (True, True)])
def test_logprob_chunks_add_their_lm_head_weight_gradients_into_one_buffer(monkeypatch, native, tied):
    """The row-chunked logprob backward (what top-k / top-p sampling and an 8-bit lm_head take):
    each chunk's lm_head Wgrad adds into one buffer, and only the last chunk's backward hands
    autograd a gradient (the sum). The gradients are bit for bit those of autograd summing the
    chunks' own: the same terms, added in the order they arrive, the tied embedding's last (here
    as a dense gradient: its rows added into the sum are the next test's)."""
    import dataclasses

    from jetrl_cli.precision import linear

    monkeypatch.setattr(trainer_mod, "sliced_backward_applies", lambda *a: False)
    monkeypatch.setattr(linear.RowGradSlot, "put", lambda *a: None)
    vocab = 256
    gemm.set_force_native(native)
    gemm.reset_resolutions()
    monkeypatch.setattr(gemm, "_ADDMM_OUT_DTYPE", {})
    try:
        cfg = dataclasses.replace(tiny_config("qwen2", hidden=128, layers=1, vocab=vocab), tie_word_embeddings=tied)
        base = random_model(cfg, seed=int(torch.randint(0, 2**31, ())), std=0.05)
        apply_flow(base, named_flow("bf16"), "train")
        b = _batch(vocab, n=3, t=30, seed=int(torch.randint(0, 2**31, ())))  # 66 scored tokens
        monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", 16 * vocab)  # chunks of 16 rows: 5
        handed = []
        real_add = linear.WgradSum.add
        monkeypatch.setattr(linear.WgradSum, "add", lambda self, *a: (lambda g: handed.append(g) or g)(real_add(self, *a)))

        def grads():
            m = copy.deepcopy(base)
            lp = token_logprobs(m, b, SamplingParams(temperature=0.7))
            (lp * torch.randn(lp.shape, generator=gen(3))).sum().backward()
            return {n: p.grad for n, p in m.named_parameters()}

        summed = grads()
        assert [g is not None for g in handed] == [False] * 4 + [True]
        assert handed[-1].shape == (vocab, 128) and handed[-1].dtype == torch.float32
        monkeypatch.setattr(trainer_mod, "summing_wgrad", lambda *a: contextlib.nullcontext())
        handed.clear()
        each = grads()
        assert handed == []
        assert summed.keys() == each.keys()
        for n, g in summed.items():
            assert torch.equal(g, each[n]), n
        if native:  # CPU has no addmm(out_dtype=): each product is made, then added, and that is recorded
            why = gemm.kernel_choice("wgrad sum", torch.device("cpu"))
            assert why["kernel"] == "mm, then add" and "out_dtype" in why["why"], why
    finally:
        gemm.set_force_native(False)
        gemm.reset_resolutions()


def _logprob_model(monkeypatch, flow_name: str, tied: bool, sliced: bool, layers: int, vocab: int):
    """A random tiny model in ``flow_name``'s training precision whose logprobs run in chunks of 16
    rows; ``sliced=False``: their backward by row chunks (``summing_wgrad``), not vocabulary slices."""
    import dataclasses

    if not sliced:
        monkeypatch.setattr(trainer_mod, "sliced_backward_applies", lambda *a: False)
    monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", 16 * vocab)
    cfg = dataclasses.replace(tiny_config("qwen2", hidden=128, layers=layers, vocab=vocab), tie_word_embeddings=tied)
    base = random_model(cfg, seed=int(torch.randint(0, 2**31, ())), std=0.05)
    apply_flow(base, named_flow(flow_name), "train")
    return base


def test_embedding_rows_add_in_token_order_whatever_the_thread_count():
    """``add_rows_`` adds ``rows[i]`` into ``dst[index[i]]`` one i after another, and ``_token_sums``
    added so gives what autograd adds from ``embedding_dense_backward``: bit for bit, with 1 and 2
    threads. (CPU ``index_put_`` with accumulation adds in a thread-dependent order: with it a tied
    embedding's gradient varied from run to run.)"""
    from jetrl_cli.models.llama import _token_sums, add_rows_

    g = gen(int(torch.randint(0, 2**31, ())))
    vocab, hidden, n = 64, 128, 800
    ids, rows, dst = torch.randint(0, vocab, (n,), generator=g), torch.randn(n, hidden, generator=g), torch.randn(
        vocab, hidden, generator=g)
    want = dst.clone()
    for i, t in enumerate(ids.tolist()):
        want[t] += rows[i]
    threads = torch.get_num_threads()
    try:
        for k in (1, 2):
            torch.set_num_threads(k)
            assert torch.equal(add_rows_(dst.clone(), ids, rows), want), k
            dense = torch.ops.aten.embedding_dense_backward(rows, ids, vocab, -1, False)
            assert torch.equal(add_rows_(dst.clone(), ids, _token_sums(ids, rows, vocab)), dst + dense), k
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("native, sliced", [(False, True), (False, False), (True, True)])
def test_a_tied_embedding_adds_its_rows_into_the_lm_head_weight_gradient(monkeypatch, native, sliced):
    """With tied embeddings the embedding's backward adds each token's gradient row, in token order,
    into the weight gradient the lm_head's backward wrote (vocabulary slices, or the row chunks'
    sum): no dense vocab x hidden embedding gradient is written and added (a zero-fill, then a read
    of both and a write: 3.7 GB at the Qwen2.5-1.5B shape). Every other gradient is the dense
    path's bit for bit, and so is each embedding row whose token occurs at most once; a row whose
    token repeats is the head's row plus the tokens' rows added one by one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from jetrl_cli.models import llama
    from jetrl_cli.precision import linear

    vocab = 256
    gemm.set_force_native(native)
    gemm.reset_resolutions()
    try:
        base = _logprob_model(monkeypatch, "bf16", tied=True, sliced=sliced, layers=1, vocab=vocab)
        b = _batch(vocab, n=3, t=30, seed=int(torch.randint(0, 2**31, ())))
        b.ids[1, 3:9] = b.ids[0, 5]  # a token repeated within a row and across rows
        b.ids[2, 10:12] = b.ids[0, 5]
        seen = {}
        real_backward = llama._EmbedRows.backward

        def backward(ctx, g):
            seen["ids"], seen["g"] = ctx.saved_tensors[0].clone(), g.clone()
            seen["head"] = None if ctx.slot.grad is None else ctx.slot.grad.clone()
            return real_backward(ctx, g)

        monkeypatch.setattr(llama._EmbedRows, "backward", staticmethod(backward))

        def grads():
            m = copy.deepcopy(base)
            ops = []

            class Ops(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    ops.append(func.overloadpacket.__name__)
                    return func(*args, **(kwargs or {}))

            lp = token_logprobs(m, b, SamplingParams(temperature=0.7))
            with Ops():
                (lp * torch.randn(lp.shape, generator=gen(3))).sum().backward()
            assert m.lm_head.weight is m.model.embed_tokens.weight
            return {n: p.grad for n, p in m.named_parameters()}, ops

        rows, ops = grads()
        assert "embedding_dense_backward" not in ops and "index_add_" in ops, ops
        ids, g, head = seen["ids"].reshape(-1), seen["g"].reshape(-1, 128), seen["head"]
        assert head is not None and head.shape == (vocab, 128)
        want = head.clone()
        for i, t in enumerate(ids.tolist()):  # one add per token, in token order
            want[t] += g[i].to(want.dtype)
        emb = rows.pop("model.embed_tokens.weight")
        assert torch.equal(emb, want)

        monkeypatch.setattr(linear.RowGradSlot, "put", lambda *a: None)  # the dense path
        dense, ops = grads()
        assert "embedding_dense_backward" in ops and "index_add_" not in ops
        dense_emb = dense.pop("model.embed_tokens.weight")
        assert rows.keys() == dense.keys()
        for n, grad in rows.items():
            assert torch.equal(grad, dense[n]), n
        counts = torch.bincount(ids, minlength=vocab)
        assert counts.max() >= 9
        once = counts <= 1
        assert torch.equal(emb[once], dense_emb[once])
        # a repeated token's row: both sums within fp32's accumulation bound of the float64 sum (each of the
        # row's count + 1 additions rounds by at most 2^-24 of the running sum of magnitudes)
        exact = head.double().index_add(0, ids, g.double())
        bound = (counts + 1).double()[:, None] * 2.0**-24 * head.double().abs().index_add(0, ids, g.double().abs())
        for got in (emb, dense_emb):
            assert ((got.double() - exact).abs() <= bound).all()
    finally:
        gemm.set_force_native(False)
        gemm.reset_resolutions()


def test_a_native_gemm_adds_into_the_sum_in_place(forced_native):
    """``accumulate_gemm``: fp32 operands natively add in the GEMM (``addmm_`` into the sum: the sum
    keeps its storage, no product tensor of its own); bf16 ones where torch has no ``out_dtype``
    addmm (CPU) make the product and add it. Both within fp32 rounding of the float64 sum."""
    spec = GemmSpec(CastSpec(Format.FP32), CastSpec(Format.FP32), Format.FP32)
    dev = torch.device("cpu")
    n, k, t = 96, 64, 40
    a, b, c = torch.randn(n, t), torch.randn(k, t), torch.randn(n, k)
    acc = c.clone()
    made = []

    class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == n * k and func not in (torch.ops.aten.addmm_.default,):
                made.append(func)
            return out

    with Allocations():
        out = gemm.accumulate_gemm(acc, a, b, spec, "wgrad", dev, torch.float32)
    assert out.data_ptr() == acc.data_ptr() and made == []
    ref = c.double() + a.double() @ b.double().T
    assert error_stats(ref, out)["rel_err"] < 1e-6
    first = gemm.accumulate_gemm(None, a, b, spec, "wgrad", dev, torch.float32)  # the first term: a new tensor
    assert torch.equal(first, a @ b.T)
    spec16 = GemmSpec(CastSpec(Format.BF16), CastSpec(Format.BF16), Format.FP32)
    a16, b16 = a.bfloat16(), b.bfloat16()
    acc16 = c.clone()
    out16 = gemm.accumulate_gemm(acc16, a16, b16, spec16, "wgrad", dev, torch.float32)
    assert out16.data_ptr() == acc16.data_ptr()
    assert torch.equal(out16, c + a16.float() @ b16.float().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_native_gemm_overwrites_rows_of_a_buffer_in_place(forced_native, dtype):
    """``accumulate_gemm(..., overwrite=True)`` writes ``a @ b.T`` into a given buffer (rows of a
    gradient: the vocabulary-sliced lm_head backward), not reading what was there (NaN here): fp32
    operands in the GEMM itself (an ``mm`` into it), bf16 ones where torch has no ``out_dtype`` mm
    (CPU) through a product, copied. Within fp32 rounding of the float64 product; the rest of the
    buffer untouched."""
    spec = GemmSpec(CastSpec(Format.BF16 if dtype is torch.bfloat16 else Format.FP32),
                    CastSpec(Format.BF16 if dtype is torch.bfloat16 else Format.FP32), Format.FP32)
    dev = torch.device("cpu")
    g = gen(fresh_seed())
    a, b = torch.randn(48, 40, generator=g).to(dtype), torch.randn(32, 40, generator=g).to(dtype)
    buf = torch.full((100, 32), float("nan"))
    out = gemm.accumulate_gemm(buf[20:68], a, b, spec, "wgrad", dev, torch.float32, overwrite=True)
    assert out.data_ptr() == buf[20:68].data_ptr()
    ref = a.double() @ b.double().T
    assert error_stats(ref, buf[20:68])["rel_err"] < 1e-6
    assert buf[:20].isnan().all() and buf[68:].isnan().all()


def test_attention_backward_joins_the_q_k_v_gradients_in_one_kernel(forced_native, monkeypatch):
    """q, k and v are split from the q/k/v GEMM's output, not sliced: a slice's backward writes a
    zero-filled gradient of the whole output and autograd adds them up (4 such kernels and 2 adds
    per layer, with slices). The join is in RoPE's backward's fused function (``_split_rope_grad``,
    compiled on a GPU), written in the tokens-first layout that the GEMM's backward reads: outside
    the fused functions no concatenation runs (autograd's split backward took two per layer: q with
    k, then with v) and no copy moves the heads back (split heads-first, it took one per layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from jetrl_cli.models import llama
    from jetrl_cli.precision import fuse, linear

    inside = []  # non-empty: within a fused function (compiled on a GPU): its ops are not counted
    code = fuse.fused(lambda x: x).__code__
    for mod in (llama, linear):
        for name, fn in list(vars(mod).items()):
            if callable(fn) and getattr(fn, "__code__", None) is code:
                def one_kernel(*args, _fn=fn):
                    inside.append(1)
                    try:
                        return _fn(*args)
                    finally:
                        inside.pop()
                monkeypatch.setattr(mod, name, one_kernel)

    def backward_ops(layers: int) -> list[str]:
        m = random_model(tiny_config("qwen2", hidden=128, layers=layers, vocab=256), seed=4, std=0.05)
        apply_flow(m, named_flow("bf16"), "train")
        loss = m.hidden(torch.randint(1, 256, (2, 12), generator=gen(3))).square().sum()
        ops = []

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not inside:
                    ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        with Ops():
            loss.backward()
        return ops

    one, two = backward_ops(1), backward_ops(2)
    per_layer = collections.Counter(two)
    per_layer.subtract(one)
    assert per_layer["slice_backward"] == 0, two
    assert per_layer["clone"] == 0 and per_layer["copy_"] == 0, per_layer  # (native path: the GPU's)
    assert per_layer["cat"] == 0, sorted(per_layer.items())


@pytest.mark.parametrize("dtype,q_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                           (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("contiguous_v", [False, True])
def test_split_rope_backward_is_the_rotation_by_the_negative_angle_in_the_gemm_layout(dtype, q_dtype, contiguous_v,
                                                                                     monkeypatch):
    """q/k/v split from the GEMM's output and RoPE on q and k, with autograd: the backward is one
    function (compiled on a GPU: RoPE by the negative angle on q's and k's gradients, written
    with v's into the GEMM's tokens-first layout), where autograd's op-by-op backward joined q's and
    k's gradients, rotated them (a roll, two products and a sum in fp32, two casts) and joined the
    result with v's. The same bits as autograd's, for bf16 and fp32 inputs, and with the queries
    rounded to bf16 in the same function where the keys stay fp32 (an 8-bit KV cache's flows: as
    the queries' cast to what attention reads, and its backward, composed by autograd)."""
    from jetrl_cli.models import llama
    from jetrl_cli.models.llama import apply_rope, split_rope

    calls = []
    grad_fn = llama._split_rope_grad
    monkeypatch.setattr(llama, "_split_rope_grad", lambda *a: calls.append(a) or grad_fn(*a))
    g = gen(fresh_seed())
    b, h, hk, t, d = 2, 4, 2, 7, 16
    ang = torch.rand(b, 1, t, d // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([-ang.sin(), ang.sin()], -1)  # rotate_half's signs folded in, as the model's table
    x = torch.randn(b, t, h + 2 * hk, d, generator=g).to(dtype).requires_grad_(True)
    grads = [torch.randn(b, n, t, d, generator=g).to(dt) for n, dt in ((h, dtype), (hk, dtype), (hk, dtype))]

    if q_dtype is not None:
        grads[0] = grads[0].to(q_dtype)  # attention's gradient of the queries it read

    def op_by_op(x):
        qk, v = (p.transpose(1, 2) for p in x.split((h + hk, hk), dim=2))
        q, k = apply_rope(qk.float(), cos, sin).to(dtype).split((h, hk), dim=1)
        return (q if q_dtype is None else q.to(q_dtype)), k, v

    want_out = op_by_op(x)
    want = torch.autograd.grad(want_out, x, grads)[0]
    out = split_rope(x, h, hk, cos, sin, dtype, contiguous_v, q_dtype=q_dtype)
    for o, w in zip(out, want_out):
        assert o.dtype == w.dtype and torch.equal(o, w)
    assert out[2].is_contiguous() == contiguous_v
    got, = torch.autograd.grad(out, x, grads)
    assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, want)
    assert len(calls) == 1  # one fused call
    with torch.no_grad():  # no autograd: the same forward
        for o, w in zip(split_rope(x, h, hk, cos, sin, dtype, contiguous_v, q_dtype=q_dtype), want_out):
            assert torch.equal(o, w)


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_residual_add_and_norm_train_as_one_function_each_way(out, monkeypatch):
    """A decoder layer's residual add and the RMSNorm after it, with autograd: the forward is the
    rollout's ``_add_rms_norm`` (one kernel on a GPU) and the backward one function
    (``_add_rms_norm_grads``: the norm's input gradient plus the residual's, and that sum in delta's
    dtype) where autograd ran the norm's backward, an add and a cast -- the same bits as the add,
    ``_RMSNormFn`` and the cast composed by autograd, for an fp32 residual and a bf16 delta."""
    from jetrl_cli.models import llama
    from jetrl_cli.models.llama import _RMSNormFn

    g = gen(fresh_seed())
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x = torch.randn(3, 5, 64, generator=g).requires_grad_(True)
    delta = torch.randn(3, 5, 64, generator=g).bfloat16().requires_grad_(True)
    g_s, g_y = torch.randn(3, 5, 64, generator=g), torch.randn(3, 5, 64, generator=g).to(out)
    calls = []
    grads_fn = llama._add_rms_norm_grads
    monkeypatch.setattr(llama, "_add_rms_norm_grads", lambda *a: calls.append(1) or grads_fn(*a))
    s, y = norm.add_forward(x, delta, out)
    torch.autograd.backward((s, y), (g_s, g_y))
    got = [t.detach().clone() for t in (s, y, x.grad, delta.grad, norm.weight.grad)]
    assert calls == [1] and y.dtype is out and delta.grad.dtype is torch.bfloat16
    x.grad = delta.grad = norm.weight.grad = None
    s2 = x + delta
    y2 = _RMSNormFn.apply(s2, norm.weight, norm.eps, False).to(out)
    torch.autograd.backward((s2, y2), (g_s, g_y))
    for a, b in zip(got, (s2, y2, x.grad, delta.grad, norm.weight.grad)):
        assert torch.equal(a, b)


def test_a_norm_writes_its_consumers_dtype_where_the_gradient_comes_back_in_it(forced_native):
    """A norm in training writes its output in the dtype the next GEMM reads (bf16: one kernel, no
    cast) -- the bits and gradients of the fp32 norm cast by autograd -- but not where that GEMM's
    Dgrad writes a wider format (the gradient would be rounded to the input's dtype)."""
    from jetrl_cli.precision import parse_flow
    from jetrl_cli.precision.linear import input_dtype

    g = gen(fresh_seed())
    x = torch.randn(6, 128, generator=g).requires_grad_(True)
    layer = JetLinear(torch.nn.Parameter(torch.randn(64, 128, generator=g)), None, named_flow("bf16").train.linear)
    wide = parse_flow({"base": "bf16", "train": {"dgrad": {"grad_output": "bf16", "weight": "bf16", "out": "fp32"}}},
                      source="<test>").train.linear
    wide_layer = JetLinear(torch.nn.Parameter(torch.randn(64, 128, generator=g)), None, wide)
    assert input_dtype((layer,), x) is torch.bfloat16 and input_dtype((wide_layer,), x) is None
    with torch.no_grad():
        assert input_dtype((wide_layer,), x) is torch.bfloat16  # the rollout: no gradient to keep
    norm = RMSNorm(128, 1e-6)
    gy = torch.randn(6, 128, generator=g).bfloat16()
    y = norm(x, torch.bfloat16)
    y.backward(gy)
    got = (y.detach(), x.grad, norm.weight.grad)
    x.grad = norm.weight.grad = None
    y2 = norm(x).to(torch.bfloat16)
    y2.backward(gy)
    assert y.dtype is torch.bfloat16 and all(torch.equal(a, b) for a, b in zip(got, (y2, x.grad, norm.weight.grad)))


def _fp8_group(backend: str, sizes, dev):
    from jetrl_cli.precision import parse_flow

    gemms = {g: {"backend": backend} for g in ("fprop", "dgrad", "wgrad")}
    prec = parse_flow({"base": "fp8-unified", "rollout": {"linear": {"backend": backend}}, "train": gemms},
                      source="<test>").train.linear
    return tuple(JetLinear(torch.nn.Parameter(torch.randn(n, 128, generator=gen(n)).to(dev) / 16), None, prec)
                 for n in sizes)


@pytest.mark.parametrize("backend", ["emulated", "triton"])
def test_a_group_dgrad_is_one_gemm_over_its_stacked_weights(backend, forced_native, monkeypatch):
    """The Dgrad of a linear group (q/k/v, gate/up) is one GEMM: dy cast whole (from the read that
    makes Wgrad's copy, no cast of any layer's share) times the layers' W^T side by side, summed in
    fp32 and rounded once -- not a GEMM per layer on a fresh quantization of its share of dy with the
    results added in bf16 (at 16 x 512 tokens of the 1.5B shape that was 9 GB of quantizer reads and
    6 GB of bf16 adds per step). Checked against float64 on the same quantized operands."""
    from jetrl_cli.precision import linear

    if backend == "triton" and not (torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from .triton_interp_fix import fixed_fp8_conversion

    dev = TRITON_DEV if backend == "triton" else "cpu"
    sizes = (256, 128, 128)
    mods = _fp8_group(backend, sizes, dev)
    seed = fresh_seed()
    g = gen(seed)
    x = torch.randn(40, 128, generator=g).to(dev).bfloat16().requires_grad_(True)
    gy = torch.randn(40, sum(sizes), generator=g).to(dev).bfloat16()
    gemms, casts = [], []
    run_gemm, cast_operand = linear.run_gemm, linear.cast_operand
    monkeypatch.setattr(linear, "run_gemm", lambda a, b, spec, name, *r: gemms.append(name) or run_gemm(a, b, spec, name, *r))
    with fixed_fp8_conversion():
        y = linear_group_of(mods, x)
        monkeypatch.setattr(linear, "cast_operand", lambda *a: casts.append(a) or cast_operand(*a))
        y.backward(gy)
    assert gemms == ["fprop", "dgrad", "wgrad"] and casts == [], (gemms, len(casts))
    prec = mods[0].precision
    dy = quantize(gy.float(), prec.dgrad.a).dequantize(torch.float64)
    w = torch.cat([quantize(m.weight.detach().float(), prec.dgrad.b).dequantize(torch.float64) for m in mods])
    want = dy @ w
    err = (x.grad.double() - want).abs() - 2 ** -8 * (want.abs() + 1e-3)  # one bf16 rounding of an fp32 sum
    if x.is_cuda and backend == "triton":
        # plus the tensor cores' FP8 sums: within a 128-wide K block Hopper adds the products with
        # about 13 bits kept (truncated), so a block's error can reach 128 * 2^-13 of its terms' sum of
        # magnitudes; 2^-11 of it, 8x under that worst case (an H200 measured 0.07 relative at small
        # outputs against the fp32 bound above)
        err -= 2 ** -11 * (dy.abs() @ w.abs())
    assert err.max() <= 0, f"seed {seed}: {err.max()}"


def linear_group_of(mods, x):
    from jetrl_cli.precision.linear import linear_group

    return linear_group(mods, x, torch.nn.Module())


def test_side_by_side_operands_are_the_operand_of_the_concatenation():
    """W_1^T and W_2^T quantized on their own, side by side, are W^T of the stacked weight quantized
    whole, bit for bit, when each part but the last is a whole number of scale blocks wide (128x128
    and 1x128 blocks; the emulated backend's exact form too); otherwise there is no such operand
    (None): a block would span two layers, or a scale would cover a layer's whole width."""
    from jetrl_cli.precision.linear import side_by_side

    g = gen(fresh_seed())
    parts = [torch.randn(64, k, generator=g) * s for k, s in ((256, 1.0), (128, 30.0), (96, 0.01))]
    whole = torch.cat(parts, dim=1)
    for block in ("128x128", "1x128"):
        spec = CastSpec(Format.FP8_E4M3, block)
        got = side_by_side([quantize(p, spec) for p in parts])
        want = quantize(whole, spec)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
        ex = side_by_side([gemm.exact_operand(quantize(p, spec)) for p in parts])
        assert torch.equal(ex.values, gemm.exact_operand(want).values) and torch.equal(ex.scales, gemm.exact_operand(want).scales)
    assert torch.equal(side_by_side([p.bfloat16() for p in parts]), whole.bfloat16())
    spec = CastSpec(Format.FP8_E4M3, "128x128")
    assert side_by_side([quantize(p, spec) for p in (parts[2], parts[0])]) is None  # 96 wide, then a block
    assert side_by_side([quantize(p, CastSpec(Format.FP8_E4M3, "tensor")) for p in parts]) is None


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_a_group_without_a_stacked_dgrad_operand_quantizes_each_share_of_dy_in_place(forced_native):
    """A group whose layers' W^T cannot stand side by side (an output width that is not a whole number
    of 128x128 blocks) runs a Dgrad GEMM per layer; it quantizes each layer's columns of dy where they
    lie: the Triton quantizer reads them with dy's row stride, so no contiguous copy of any share is
    made. The input gradient is that of the layers run one by one."""
    from .triton_interp_fix import fixed_fp8_conversion

    sizes = (192, 64, 128)
    mods = _fp8_group("triton", sizes, TRITON_DEV)
    x = torch.randn(40, 128, generator=gen(1)).to(TRITON_DEV).bfloat16().requires_grad_(True)
    gy = torch.randn(40, sum(sizes), generator=gen(2)).to(TRITON_DEV).bfloat16()
    shares = {(40, n) for n in sizes}
    copies = []

    class Copies(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("clone", "contiguous", "copy_") and isinstance(out, torch.Tensor) \
                    and tuple(out.shape) in shares and out.dtype is torch.bfloat16:
                copies.append(func)
            return out

    with fixed_fp8_conversion():
        y = linear_group_of(mods, x)
        with Copies():
            y.backward(gy)
        got = x.grad
        x.grad = None
        for m, g in zip(mods, gy.split(list(sizes), dim=1)):
            m(x).backward(g)
    assert copies == []
    assert torch.equal(got, x.grad)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("sizes, k", [((256, 128, 96), 384), ((128, 128), 128)])
def test_a_trainers_fp8_group_is_quantized_into_its_stacked_operands(sizes, k, forced_native, monkeypatch):
    """A trainer's FP8 group (q/k/v, gate/up) gets its stacked W (Fprop) and its W^T side by side
    (Dgrad) from the weight quantizer writing each layer where it lies: no concatenation of FP8 data
    or scales (which read and wrote both copies again). The operands are the layers' reference
    quantizations concatenated, bit for bit, in the GEMM layout (scale pad entries 1.0); after an
    update they are rewritten in place; the group's gradients are those of the concatenating path."""
    from jetrl_cli.kernels import layouts
    from jetrl_cli.precision import linear

    from .triton_interp_fix import fixed_fp8_conversion

    g = gen(fresh_seed())
    mods = _fp8_group("triton", sizes, TRITON_DEV)
    for m in mods:  # k wide, values of every magnitude; one block all zeros
        m.weight = torch.nn.Parameter((torch.randn(m.out_features, k, generator=g) * torch.rand(m.out_features, 1, generator=g) * 3
                                       ).to(TRITON_DEV))
        m.in_features = k
    with torch.no_grad():
        mods[0].weight[:128, :128] = 0
    spec = mods[0].precision.fprop.b
    owner = torch.nn.Module()
    ops = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def check():
        ops.clear()
        with fixed_fp8_conversion(), Ops():
            w, _ = linear.group_weight(mods, owner)
            wt = linear.group_dgrad_weight(linear._Group(mods, w, None, owner))
        assert "cat" not in ops, ops
        ref = [quantize(m.weight.detach().float(), spec) for m in mods]
        want_w = QTensor(torch.cat([r.data for r in ref]), torch.cat([r.scale for r in ref]), spec)
        want_t = QTensor(torch.cat([r.data.t() for r in ref], 1), torch.cat([r.scale.t() for r in ref], 1), spec)
        for got, want in ((w, want_w), (wt, want_t)):
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(got.scale, want.scale) and layouts.is_gemm_layout(got)
            assert torch.all(layouts.scale_buffer(got)[:, got.scale.shape[1]:] == 1.0)
        return w, wt

    w, wt = check()
    with torch.no_grad():
        for m in mods:
            m.weight.mul_(torch.rand(m.weight.shape, generator=g).to(TRITON_DEV) + 0.5)
    linear.mark_updated([m.weight for m in mods])
    w2, wt2 = check()
    assert w2.data.data_ptr() == w.data.data_ptr() and wt2.data.data_ptr() == wt.data.data_ptr()  # in place

    x = torch.randn(40, k, generator=g).to(TRITON_DEV).bfloat16()
    gy = torch.randn(40, sum(sizes), generator=g).to(TRITON_DEV).bfloat16()

    def grads(stacked: bool):
        monkeypatch.setattr(linear, "_stack_fp8", real if stacked else (lambda *a: None))
        owner.__dict__.clear()
        for m in mods:
            m._cache, m.weight.grad = {}, None
        xi = x.clone().requires_grad_(True)
        with fixed_fp8_conversion():
            linear.linear_group(mods, xi, owner).backward(gy)
        return [xi.grad] + [m.weight.grad for m in mods]

    real = linear._stack_fp8
    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)


def _in_place_grads(monkeypatch, base, batches, in_place: bool, after_first=None):
    """Micro-batches' backwards (``batches``: ``(Batch, seed of the loss weights)``) into one copy of
    ``base``'s gradients, those after the first within ``grads_in_place`` when ``in_place``:
    ``(grads, the last backward's op names, {storage: rows} of the sums its Wgrad GEMMs added into,
    the model)``. ``after_first(model)`` runs after the first backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from jetrl_cli.precision import linear
    from jetrl_cli.rl import head_grad

    sums = []
    for mod in (linear, head_grad):
        monkeypatch.setattr(mod, "accumulate_gemm", lambda acc, *a, real=mod.accumulate_gemm, **k:
                            sums.append(acc) or real(acc, *a, **k))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    m = copy.deepcopy(base)
    for k, (b, seed) in enumerate(batches):
        if k == 1 and after_first is not None:
            after_first(m)
        sums.clear()
        ops = []
        with linear.grads_in_place() if in_place and k else contextlib.nullcontext():
            lp = token_logprobs(m, b, SamplingParams(temperature=0.7))
            with Ops():
                (lp * torch.randn(lp.shape, generator=gen(seed)).to(lp.device)).sum().backward()
    into = {}
    for a in sums:
        if a is not None:
            into.setdefault(a.untyped_storage()._cdata, set()).add(a.shape[0])
    return {n: p.grad for n, p in m.named_parameters()}, ops, into, m


@pytest.mark.parametrize("flow_name, tied, native, sliced", [
    ("bf16", False, False, True), ("bf16", True, False, True), ("bf16", True, False, False),
    ("fp8-unified", False, False, True), ("fp8-unified", True, False, True), ("bf16", False, True, True)])
def test_a_micro_batch_adds_its_gradients_into_the_grads_held(monkeypatch, flow_name, tied, native, sliced):
    """Within ``grads_in_place`` (the trainer's micro-batches after the first), a backward adds each
    linear group's Wgrad into the ``.grad`` its weights hold -- q/k/v and gate/up through one view of
    the back-to-back gradients the first micro-batch's group GEMM wrote -- an untied lm_head's too
    (vocabulary slices, or the row chunks' sum), and an untied embedding its tokens' summed rows: no
    dense embedding gradient, and autograd adds nothing. A tied lm_head's gradient goes to autograd
    with the embedding's rows added into it (``RowGradSlot``). Every gradient is autograd's sum, bit
    for bit, a repeated token's embedding row included."""
    from jetrl_cli.precision.linear import JetLinear

    with _two_micro_batches(monkeypatch, flow_name, tied, native, sliced, t=30) as (base, batches):
        b2 = batches[1][0]
        b2.ids[1, 3:9] = b2.ids[0, 5]  # a token repeated in the second micro-batch
        summed, ops, into, m = _in_place_grads(monkeypatch, base, batches, True)
        held = lambda mod: mod.weight.grad.untyped_storage()._cdata  # noqa: E731
        linears = [mod for mod in m.modules() if isinstance(mod, JetLinear) and not (tied and mod is m.lm_head)]
        assert len(linears) == 15 - tied and all(held(mod) in into for mod in linears)  # each Wgrad added where held
        assert (held(m.lm_head) in into) is not tied
        assert "embedding_dense_backward" not in ops and "index_add_" in ops  # add_rows_ on CPU
        attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
        assert attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features in into[held(attn.q_proj)]
        assert mlp.gate_proj.out_features + mlp.up_proj.out_features in into[held(mlp.gate_proj)]  # a view of two

        autograd, ops, into, m = _in_place_grads(monkeypatch, base, batches, False)
        assert ("embedding_dense_backward" in ops) is not tied  # tied: rows into the head's gradient
        assert not into.keys() & {p.grad.untyped_storage()._cdata for p in m.parameters()}
        assert torch.bincount(b2.ids.reshape(-1)).max() >= 7
        assert summed.keys() == autograd.keys()
        for n, g in summed.items():
            assert torch.equal(g, autograd[n]), n


@contextlib.contextmanager
def _two_micro_batches(monkeypatch, flow_name: str, tied: bool, native: bool, sliced: bool, t: int):
    """``(model, [(batch, loss seed)] * 2)`` for the in-place gradient tests: a two-layer model of the
    flow (the native path forced where ``native``), micro-batches of 3 and 2 sequences of ``t`` tokens."""
    vocab = 256
    gemm.set_force_native(native)
    gemm.reset_resolutions()
    try:
        base = _logprob_model(monkeypatch, flow_name, tied=tied, sliced=sliced, layers=2, vocab=vocab)
        yield base, [(_batch(vocab, n=n, t=t, seed=int(torch.randint(0, 2**31, ()))), int(torch.randint(0, 2**31, ())))
                     for n in (3, 2)]
    finally:
        gemm.set_force_native(False)
        gemm.reset_resolutions()


@pytest.mark.parametrize("flow_name, tied, native, sliced", [
    ("bf16", False, False, True), ("bf16", False, False, False), ("fp8-unified", True, False, True),
    ("fp8-unified", False, True, False)])
def test_within_grads_written_a_backward_writes_the_grads_held_not_adds(monkeypatch, flow_name, tied, native,
                                                                         sliced):
    """Within ``grads_in_place`` and ``grads_written`` (the first backward of an optimizer step whose
    CUDA graphs keep the gradients, ``rl.train_graphs``), each gradient ``grad_sink`` hands out is
    written: the linear groups' Wgrads (q/k/v, gate/up through one view), an untied lm_head's
    (vocabulary slices, or the row chunks' sum) and an untied embedding's rows. Their stale values
    (NaN here) are never read; with the others' zeroed (the caller's part), the gradients are a fresh
    backward's, bit for bit."""
    from jetrl_cli.precision import linear

    with _two_micro_batches(monkeypatch, flow_name, tied, native, sliced, t=24) as (base, batches):
        fresh = _in_place_grads(monkeypatch, base, batches[1:], False)[0]
        sunk = []

        def stale(m):  # after the first backward: what the sinks will write is stale, the rest zeroed
            with torch.no_grad(), linear.grads_in_place(), linear.recording_sinks() as seen:
                sinks = {id(w) for mods, _ in m.linear_groups() if linear.grad_sink([x.weight for x in mods])
                         is not None for w in (x.weight for x in mods)}
                if tied:  # the embedding adds its rows into the lm_head's gradient, which autograd adds
                    sinks.discard(id(m.lm_head.weight))
                else:
                    sinks.add(id(m.model.embed_tokens.weight))
                sunk.extend(seen)
            for p in m.parameters():
                p.grad.fill_(float("nan")) if id(p) in sinks else p.grad.zero_()

        real = linear.grads_in_place
        monkeypatch.setattr(linear, "grads_in_place", lambda: _both(real))
        written, _, _, m = _in_place_grads(monkeypatch, base, batches, True, after_first=stale)
        assert len(sunk) >= 14 - tied  # every linear layer's weight, the lm_head's unless tied
        assert not linear.sink_overwrites()
        assert written.keys() == fresh.keys()
        for n, g in written.items():
            assert torch.equal(g, fresh[n]), n


@contextlib.contextmanager
def _both(grads_in_place):
    from jetrl_cli.precision import linear

    with grads_in_place(), linear.grads_written():
        yield


@gpu
@needs_cuda
@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_a_micro_batch_adds_its_gradients_into_the_grads_held_on_gpu(monkeypatch, flow_name):
    """On CUDA, within ``grads_in_place``: a later micro-batch's bf16 Wgrad GEMMs add into the fp32
    ``.grad`` (through the q/k/v and gate/up views too) with ``addmm(out_dtype=)``, and every gradient
    agrees with autograd's sums to fp32 rounding (cuBLAS may order the epilogue's add differently)."""
    vocab = 256
    monkeypatch.setattr(gemm, "_ADDMM_OUT_DTYPE", {})
    base = random_model(tiny_config("qwen2", hidden=256, layers=2, vocab=vocab), seed=int(torch.randint(0, 2**31, ())),
                        std=0.05).cuda()
    apply_flow(base, named_flow(flow_name), "train")
    batches = [(_batch(vocab, n=n, t=40, seed=int(torch.randint(0, 2**31, ()))), int(torch.randint(0, 2**31, ())))
               for n in (3, 2)]
    summed, _, into, m = _in_place_grads(monkeypatch, base, batches, True)
    attn = m.model.layers[0].self_attn
    assert attn.q_proj.weight.grad.untyped_storage()._cdata in into
    if flow_name == "bf16":
        # recorded under the device the GEMMs ran on, the tensors' own ("cuda:0", not "cuda")
        choice = gemm.kernel_choice("wgrad sum", attn.q_proj.weight.device)
        assert choice["kernel"] == "GEMM into the sum (out_dtype)", choice
    autograd, _, _, _ = _in_place_grads(monkeypatch, base, batches, False)
    eps = torch.finfo(torch.float32).eps
    for n, g in summed.items():
        assert (g - autograd[n]).abs().max() <= 16 * eps * autograd[n].abs().max(), n


def test_a_gradient_with_a_hook_or_held_apart_goes_to_autograd(monkeypatch):
    """Within ``grads_in_place``, a weight whose gradient autograd must see -- one with a hook, which
    is called with the micro-batch's gradient as outside -- and a group whose gradients no longer lie
    back to back (one replaced by a copy) hand autograd their gradients; the rest are added where
    they are held, and every gradient is still autograd's sum bit for bit."""
    vocab = 256
    base = random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=vocab), seed=int(torch.randint(0, 2**31, ())),
                        std=0.05)
    apply_flow(base, named_flow("bf16"), "train")
    batches = [(_batch(vocab, n=n, t=30, seed=int(torch.randint(0, 2**31, ()))), int(torch.randint(0, 2**31, ())))
               for n in (3, 2)]
    calls = []

    def after_first(m):
        attn = m.model.layers[0].self_attn
        attn.k_proj.weight.grad = attn.k_proj.weight.grad.clone()  # q/k/v's gradients apart
        m.model.layers[1].mlp.down_proj.weight.register_hook(lambda g: calls.append(g.clone()))

    summed, _, into, m = _in_place_grads(monkeypatch, base, batches, True, after_first)
    held = lambda mod: mod.weight.grad.untyped_storage()._cdata  # noqa: E731
    attn, down = m.model.layers[0].self_attn, m.model.layers[1].mlp.down_proj
    assert not {held(attn.q_proj), held(attn.k_proj), held(attn.v_proj), held(down)} & into.keys()
    assert held(attn.o_proj) in into and held(m.model.layers[1].self_attn.q_proj) in into
    hooked = calls.pop()
    autograd, _, _, _ = _in_place_grads(monkeypatch, base, batches, False, after_first)
    assert torch.equal(hooked, calls.pop())  # the hook saw the same gradient
    for n, g in summed.items():
        assert torch.equal(g, autograd[n]), n


def test_out_of_memory_names_train_micro_batch(monkeypatch):
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.rl.algos import CorrectionConfig
    from jetrl_cli.rl.trainer import Trainer

    m = _model()
    tr = Trainer(m, named_flow("bf16"), TrainConfig(micro_batch=2), CorrectionConfig(), SamplingParams(), 64)
    b = _batch(256, n=4, t=20)

    def oom(*a, **k):
        raise trainer_mod._OOM("CUDA out of memory. Tried to allocate 9.27 GiB")

    monkeypatch.setattr(trainer_mod, "token_logprobs", oom)
    with pytest.raises(JetrlError, match=r"^train.micro_batch: scoring 2 sequences x 20 tokens ran out of memory "
                                         r"\(CUDA out of memory. Tried to allocate 9.27 GiB\); lower train.micro_batch$"):
        tr.score(b)
    with pytest.raises(JetrlError, match="train.micro_batch: a micro-batch of 2 sequences"):
        tr.update(b, torch.ones(4), torch.zeros(b.mask.shape), None, 1)

    def cpu_oom(*a, **k):  # the CPU allocator's failure is a plain RuntimeError
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:124] data. DefaultCPUAllocator: not enough memory: "
                           "you tried to allocate 9961472000 bytes.")

    monkeypatch.setattr(trainer_mod, "token_logprobs", cpu_oom)
    with pytest.raises(JetrlError, match=r"^train.micro_batch: scoring 2 sequences x 20 tokens ran out of memory "
                                         r"\(\[enforce fail .*DefaultCPUAllocator"):
        tr.score(b)

    def other(*a, **k):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(trainer_mod, "token_logprobs", other)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not the user's: not a one-line error
        tr.update(b, torch.ones(4), torch.zeros(b.mask.shape), None, 1)


def test_rmsnorm_backward_is_the_gradient_of_its_forward():
    norm = RMSNorm(24, 1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24, generator=gen(6), dtype=torch.float64) + 0.5)
    x = torch.randn(5, 24, generator=gen(7), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: type(norm).forward(_with_weight(norm, w), x), (x, norm.weight))


def _with_weight(norm, w):
    n = RMSNorm(w.shape[0], norm.eps)
    n.weight = torch.nn.Parameter(w) if not isinstance(w, torch.nn.Parameter) else w
    return n


def test_swiglu_backward_is_the_gradient_of_its_forward():
    from jetrl_cli.precision.linear import swiglu

    gu = torch.randn(6, 16, generator=gen(8), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (gu,))


class LargestFp32(torch.utils._python_dispatch.TorchDispatchMode):
    """Within: ``numel``, the most elements of any fp32 tensor an op made."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils import _pytree as pytree

        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype is torch.float32:
                self.numel = max(self.numel, t.numel())
        return out


def test_a_bf16_swiglu_gradient_is_rounded_once_and_never_held_whole_in_fp32():
    """bf16 [g, u]: the gradient is the fp32 one rounded to bf16 (bits), close to float64 autograd,
    and no fp32 tensor the size of gu is made on the way (the halves are cast before they are joined)."""
    from jetrl_cli.precision.linear import _swiglu_grad, swiglu

    gu = torch.randn(37, 2 * 96, generator=gen(12)).bfloat16().requires_grad_(True)
    gy = torch.randn(37, 96, generator=gen(13)).bfloat16()
    y = swiglu(gu)
    with LargestFp32() as largest:
        y.backward(gy)
    assert gu.grad.dtype is torch.bfloat16 and 0 < largest.numel <= gu.numel() // 2, largest.numel
    assert torch.equal(gu.grad, _swiglu_grad(gu.detach().float(), gy.float()).bfloat16())
    g64 = gu.detach().double().requires_grad_(True)
    g, u = g64.chunk(2, -1)
    (torch.nn.functional.silu(g) * u).backward(gy.double())
    err = (gu.grad.double() - g64.grad).abs().max() / g64.grad.abs().max()
    assert 0 < err < 2 ** -8, err


def test_fp8_mlp_keeps_only_the_fp8_swiglu_input_and_recomputes_from_it():
    """With save_fp8_activations the end of the MLP keeps an FP8 copy of [g, u] and nothing else; its
    gradients are exactly those computed from that copy (DeepSeek-V3's recipe)."""
    from jetrl_cli.precision.linear import _swiglu_grad, _swiglu_math, swiglu_down, swiglu_save_spec

    prec = named_flow("fp8-unified").train.linear
    down = JetLinear(torch.nn.Parameter(torch.randn(64, 256, generator=gen(9)) / 16), None, prec)
    gu = torch.randn(40, 512, generator=gen(10), requires_grad=True)
    gy = torch.randn(40, 64, generator=gen(11))
    y = swiglu_down(gu, down)
    saved = [t for t in y.grad_fn.saved_tensors]
    assert [t.dtype for t in saved] == [torch.float8_e4m3fn, torch.float32] and saved[0].shape == (40, 512)
    y.backward(gy)
    # the reference: the same forward, then a backward from the dequantized FP8 copy of gu
    copy_gu = dequantize(quantize(gu.detach(), swiglu_save_spec(prec)))
    h = _swiglu_math(copy_gu).requires_grad_(True)
    ref_down = JetLinear(torch.nn.Parameter(down.weight.detach().clone()), None, prec)
    ref_down(h).backward(gy)
    assert torch.equal(down.weight.grad, ref_down.weight.grad)
    assert torch.equal(gu.grad, _swiglu_grad(copy_gu, h.grad))
    with torch.no_grad():  # and the forward is the plain one
        plain = JetLinear(torch.nn.Parameter(down.weight.detach().clone()), None, prec)(_swiglu_math(gu))
    assert torch.equal(y.detach(), plain)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("save", [True, False])
def test_fp8_mlp_input_is_made_from_gu_by_one_kernel_in_rollout_and_training(save, forced_native, monkeypatch):
    """On a kernel backend, down's FP8 input comes from [g, u] by one kernel (``swiglu_quantize``)
    in the rollout's forward and in the trainer's alike -- their outputs are the same bits --, and
    the trainer's forward writes no fp32 h (rows x I) and, with ``save_fp8_activations``, keeps the
    kernel's own FP8 copy of [g, u], from which the backward makes down's Wgrad operand by one
    kernel (``swiglu_quantize_t``, no h either). The gradients are those of the op-by-op SwiGLU
    within FP8 rounding (the kernels' exp is not torch's: last bits of h)."""
    from jetrl_cli.precision import linear, parse_flow
    from jetrl_cli.precision.linear import swiglu_down

    from .triton_interp_fix import fixed_fp8_conversion

    gemms = {g: {"backend": "triton"} for g in ("fprop", "dgrad", "wgrad")}
    prec = parse_flow({"base": "fp8-unified", "rollout": {"linear": {"backend": "triton"}},
                       "train": {**gemms, "save_fp8_activations": save}}, source="<test>").train.linear
    dev = TRITON_DEV
    g = gen(fresh_seed())
    rows, inter = 40, 256
    down = JetLinear(torch.nn.Parameter(torch.randn(128, inter, generator=g).to(dev) / 16), None, prec)
    gu = (torch.randn(2, rows // 2, 2 * inter, generator=g) * 2).to(dev).bfloat16().requires_grad_(True)
    gy = torch.randn(2, rows // 2, 128, generator=g).to(dev).bfloat16()
    calls, fp32_h = [], []
    fp8 = gemm.triton_fp8_kernels()
    kernel, kernel_t, math_fp8 = fp8.swiglu_quantize, fp8.swiglu_quantize_t, linear._swiglu_math_fp8
    monkeypatch.setattr(fp8, "swiglu_quantize", lambda *a, **k: calls.append(k.get("save", False)) or kernel(*a, **k))
    monkeypatch.setattr(fp8, "swiglu_quantize_t", lambda *a: calls.append("t") or kernel_t(*a))
    monkeypatch.setattr(linear, "_swiglu_math_fp8", lambda *a: calls.append("h") or math_fp8(*a))

    class Outputs(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype is torch.float32 and out.shape[-1] == inter \
                    and out.numel() == rows * inter:
                fp32_h.append(func)
            return out

    with fixed_fp8_conversion():
        with torch.no_grad():
            rollout = swiglu_down(gu, down)
        with Outputs():
            y = swiglu_down(gu, down)
        assert calls == [False, save] and fp32_h == []
        assert torch.equal(y.detach(), rollout)
        saved = y.grad_fn.saved_tensors
        assert [t.dtype for t in saved] == ([torch.float8_e4m3fn, torch.float32] if save else [torch.bfloat16])
        y.backward(gy)
        assert calls == [False, save, "t"] if save else [False, False]  # without the FP8 copy: h from gu
        got_w, got_gu = down.weight.grad, gu.grad
        down.weight.grad = gu.grad = None
        monkeypatch.setattr(linear, "_swiglu_kernel", lambda *a: None)
        monkeypatch.setattr(linear, "_swiglu_t_kernel", lambda *a: None)
        swiglu_down(gu, down).backward(gy)
    for got, want in ((got_w, down.weight.grad), (got_gu, gu.grad)):
        assert ((got.float() - want.float()).norm() / want.float().norm()) < 0.02


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("x_grad", [True, False])
def test_the_mlp_backward_writes_the_gate_up_operands_from_the_swiglu_gradient(x_grad, forced_native, monkeypatch):
    """With ``save_fp8_activations`` on a kernel backend, a gated MLP is one autograd function whose
    backward writes the gate/up projections' FP8 Dgrad and Wgrad operands straight from the SwiGLU
    gradient (``swiglu_grad_quantize``): no bf16 d[g, u] is written, and ``quantize_act`` never reads
    one; the same kernel makes down's Wgrad operand h^T (no ``swiglu_quantize_t``). Its forward is ``swiglu_down(linear_group(...))``'s bit for bit, and its gradients are the
    op-by-op backward's (SwiGLU gradient, then the quantizer) bit for bit when that one computes
    with the kernel's exp (the interpreter's: numpy's), within FP8 rounding with torch's. Without
    an input gradient, only the Wgrad operand is made."""
    from jetrl_cli.precision import linear, parse_flow
    from jetrl_cli.precision.linear import gated_mlp, linear_group, swiglu_down

    from .test_kernels_quant import numpy_exp
    from .triton_interp_fix import fixed_fp8_conversion

    gemms = {g: {"backend": "triton"} for g in ("fprop", "dgrad", "wgrad")}
    prec = parse_flow({"base": "fp8-unified", "rollout": {"linear": {"backend": "triton"}},
                       "train": {**gemms, "save_fp8_activations": True}}, source="<test>").train.linear
    dev = TRITON_DEV
    g = gen(fresh_seed())
    rows, hidden, inter = 150, 128, 256
    owner = torch.nn.Module()

    def layer(n, k):
        return JetLinear(torch.nn.Parameter(torch.randn(n, k, generator=g).to(dev) / k ** 0.5), None, prec)

    gate, up, down = layer(inter, hidden), layer(inter, hidden), layer(hidden, inter)
    x = torch.randn(3, rows // 3, hidden, generator=g).to(dev).bfloat16().requires_grad_(x_grad)
    gy = torch.randn(3, rows // 3, hidden, generator=g).to(dev).bfloat16()
    fp8 = gemm.triton_fp8_kernels()
    calls = []
    grad_quantize, quantize_act, h_t = fp8.swiglu_grad_quantize, fp8.quantize_act, fp8.swiglu_quantize_t
    monkeypatch.setattr(fp8, "swiglu_grad_quantize", lambda *a, **k: calls.append(
        ("dgu", k["rows"], k["cols"], k.get("h_cols", False))) or grad_quantize(*a, **k))
    monkeypatch.setattr(fp8, "swiglu_quantize_t", lambda *a, **k: calls.append("h_t") or h_t(*a, **k))
    monkeypatch.setattr(fp8, "quantize_act", lambda *a, **k: calls.append(tuple(a[0].shape)) or quantize_act(*a, **k))
    dgu_written, fns = [], []

    class Outputs(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() >= rows * 2 * inter and out.dtype.itemsize > 1:
                dgu_written.append(func)
            return out

    def run():
        for p in (x, gate.weight, up.weight, down.weight):
            p.grad = None
        y = gated_mlp((gate, up), x, owner, down)
        fns.append(type(y.grad_fn).__name__)
        with Outputs():
            y.backward(gy)
        return y.detach(), [None if p.grad is None else p.grad.clone() for p in (x, gate.weight, up.weight, down.weight)]

    def grad_numpy_exp(data, scale, cols, gh, out_dtype):  # the reference's math with the interpreter's exp
        gv, uv = linear._halves_values(data, scale, cols)
        gh, sig = gh.float(), 1 / (1 + numpy_exp(-gv))
        return torch.cat([(gh * uv * sig * (1 + gv * (1 - sig))).to(out_dtype), (gh * gv * sig).to(out_dtype)], -1)

    if torch.cuda.is_available():  # a GPU times its kernels' launch choices at their first calls: not recorded
        run()
        calls.clear(), dgu_written.clear(), fns.clear()
    with fixed_fp8_conversion():
        with torch.no_grad():
            plain = swiglu_down(linear_group((gate, up), x, owner), down)
        y, got = run()
        assert calls[-1] == ("dgu", x_grad, True, True) and "h_t" not in calls
        assert (rows, 2 * inter) not in calls and dgu_written == []
        assert torch.equal(y, plain)
        calls.clear()
        monkeypatch.setattr(linear, "_dgu_casts", lambda *a: None)  # op by op: d[g, u] in bf16, then quantize_act
        if not torch.cuda.is_available():
            monkeypatch.setattr(linear, "_swiglu_grad_fp8", grad_numpy_exp)
        y_ref, want = run()
        assert (rows, 2 * inter) in calls and "h_t" in calls and not any(c[0] == "dgu" for c in calls) and dgu_written
    assert fns == ["_GatedMLPFnBackward", "_SwiGLUDownFnBackward"]
    assert torch.equal(y_ref, y) and (got[0] is None) is (not x_grad)
    for a, b in zip(got, want):
        if b is None:
            continue
        if torch.cuda.is_available():
            assert ((a.float() - b.float()).norm() / b.float().norm()) < 0.02
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("save", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_norm_writes_its_gemms_fp8_input_in_rollout_and_training(save, forced_native, monkeypatch):
    """On a kernel backend each decoder layer's two norms write the FP8 1x128 operand of the q/k/v and
    gate/up GEMMs themselves (``rms_norm_quantize``, with the residual add before the second): in
    the rollout's forward without writing the norm's output, in the trainer's with it (the Wgrad
    operand's source), the same kernel either way, so the logits are the same bits. With the kernel
    replaced by torch's norm and the reference quantizer (the values the op-by-op path computes),
    the trainer's logits and gradients are the op-by-op path's bit for bit: the operand handed to
    the GEMMs, the norm's backward from the kernel's rsqrt and the Wgrad operand made from the
    written output are the ones the separate kernels give."""
    from jetrl_cli.models import llama
    from jetrl_cli.precision import parse_flow

    from .triton_interp_fix import fixed_fp8_conversion

    gemms = {g: {"backend": "triton"} for g in ("fprop", "dgrad", "wgrad")}
    flow = parse_flow({"base": "fp8-unified", "rollout": {"linear": {"backend": "triton"}},
                       "train": {**gemms, "save_fp8_activations": save}}, source="<test>")
    seed = fresh_seed()
    base = _model(seed=seed, hidden=256, layers=2).to(TRITON_DEV)  # the triton backend runs where Triton does
    ids = torch.randint(0, 256, (2, 9), generator=gen(seed)).to(TRITON_DEV)
    fp8 = gemm.triton_fp8_kernels()
    kernel, calls = fp8.rms_norm_quantize, []
    monkeypatch.setattr(fp8, "rms_norm_quantize", lambda *a, **k: calls.append(k.get("write_y", False)) or kernel(*a, **k))
    quantize_act, row_casts = fp8.quantize_act, []  # 1x128 casts of a forward: o_proj's input only
    monkeypatch.setattr(fp8, "quantize_act", lambda *a, **k: row_casts.append(k.get("rows", True)) or quantize_act(*a, **k))

    def run(flow_side, grad=True):
        """The logits, the gradients (with ``grad``) and how many 1x128 casts the forward made."""
        m = copy.deepcopy(base)
        apply_flow(m, flow, flow_side)
        row_casts.clear()
        if not grad:
            with torch.no_grad():
                return m(ids), None, sum(row_casts)
        logits = m(ids)
        casts = sum(row_casts)
        with Fills():
            (logits.float().log_softmax(-1)[..., 0].mean()).backward()
        return logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, casts

    fp8_fills = []  # zero-filled "gradients" of the norms' FP8 outputs: none
    widened = []  # bf16 -> fp32 casts of the norms' output gradients (without a port)
    in_norm_grads = []  # within the norms' fused backward (one kernel on a GPU: its casts are in registers)
    norm_grads = llama._add_rms_norm_grads

    def counted_norm_grads(*args):
        in_norm_grads.append(1)
        try:
            return norm_grads(*args)
        finally:
            in_norm_grads.pop()

    monkeypatch.setattr(llama, "_add_rms_norm_grads", counted_norm_grads)

    class Fills(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and \
                    func.overloadpacket.__name__ in ("zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full"):
                fp8_fills.append(func)
            if func.overloadpacket.__name__ == "_to_copy" and args[0].dtype is torch.bfloat16 and \
                    out.dtype is torch.float32 and out.shape == (18, 256) and not in_norm_grads:
                widened.append(func)
            return out

    def torch_norm_quantize(x, delta, w, eps, out, fmt, pow2, floor, write_y=False, rsqrt=False):
        calls.append(write_y)
        s, y, r = llama._add_rms_norm(x, delta, w, eps, out, True)
        q = quantize(y, CastSpec(fmt, Block(1, 128), pow2, floor))
        return (None if delta is None else s), (y if write_y else None), (r[:, 0] if rsqrt else None), q

    if torch.cuda.is_available():  # a GPU times its kernels' launch choices at their first calls: not counted
        run("rollout", grad=False), run("train")
        calls.clear(), fp8_fills.clear(), widened.clear()
    with fixed_fp8_conversion():
        want, _, casts = run("rollout", grad=False)
        assert calls == [False] * 4 and casts == 2  # two norms per layer, no output written
        got, _, casts = run("train")
        assert calls[4:] == [True] * 4 and casts == 2 and torch.equal(got, want)
        # the norms' output gradients come back in the GEMMs' bf16 through a port, not cast to fp32
        assert widened == []
        monkeypatch.setattr(fp8, "rms_norm_quantize", torch_norm_quantize)
        got, grads, _ = run("train")
        assert calls[8:] == [True] * 4
        with monkeypatch.context() as mp:  # without the port: autograd casts each to fp32 first
            mp.setattr(llama, "gradient_port", lambda *a: None)
            _, no_port, _ = run("train")
            assert len(widened) == 4 and all(torch.equal(no_port[n], g) for n, g in grads.items())
            calls[12:] = []
        monkeypatch.setattr(llama, "fused_input_quantizer", lambda *a: None)
        want, ref, casts = run("train")
        assert casts == 6  # op by op: the norms' outputs cast by the quantizer
    assert len(calls) == 12 and torch.equal(got, want) and fp8_fills == []
    assert set(grads) == set(ref) and len(ref) > 10
    for n in ref:
        assert torch.equal(grads[n], ref[n]), n

def _fp8_gu(rows: int, inter: int, seed: int):
    from jetrl_cli.precision.linear import swiglu_save_spec

    gu = torch.randn(rows, 2 * inter, generator=gen(seed)).bfloat16()
    gu[rows // 2] = 0  # an all-zero row: zero groups
    return gu, quantize(gu.float(), swiglu_save_spec(named_flow("fp8-unified").train.linear))


@pytest.mark.parametrize("inter", [256, 192, 96])
def test_the_swiglu_backward_reads_the_fp8_copy_as_the_dequantized_one(inter):
    """The SwiGLU-down backward computes from the FP8 copy of [g, u] (data and scales) directly: the
    same bits as dequantizing it whole first (the old way), for intermediate sizes that split the
    1x128 groups between g and u (192, 96) and that do not (256); where they do not, no fp32 tensor
    bigger than one half is made on the way."""
    from jetrl_cli.precision.linear import _swiglu_grad, _swiglu_grad_fp8, _swiglu_math, _swiglu_math_fp8

    rows = 33
    gu, q = _fp8_gu(rows, inter, seed=int(torch.randint(0, 2**31, ())))
    gy = torch.randn(rows, inter, generator=gen(5)).bfloat16()
    whole = dequantize(q)
    with LargestFp32() as largest:
        h = _swiglu_math_fp8(q.data, q.scale, 128, torch.bfloat16, torch.float32)
        dgu = _swiglu_grad_fp8(q.data, q.scale, 128, gy, torch.bfloat16)
    assert torch.equal(h, _swiglu_math(whole.bfloat16(), torch.float32))
    assert torch.equal(dgu, _swiglu_grad(whole, gy, torch.bfloat16))
    assert dgu.dtype is torch.bfloat16 and h.dtype is torch.float32
    if inter % 128 == 0:
        assert 0 < largest.numel <= gu.numel() // 2, largest.numel


@pytest.mark.slow
def test_the_fused_swiglu_backward_from_fp8_is_one_kernel_without_a_whole_fp32_gu():
    """Compiled by Inductor (CPU code here; on a GPU the same graph becomes Triton): each function is
    one kernel, and none allocates an fp32 [g, u] (the old backward dequantized the FP8 copy into
    one, then cast it to bf16): its largest allocation is the size of one fp32 half."""
    from torch._inductor.utils import run_and_get_code

    from jetrl_cli.precision import fuse
    from jetrl_cli.precision.linear import _swiglu_grad_fp8, _swiglu_math_fp8

    rows, inter = 64, 256
    _, q = _fp8_gu(rows, inter, seed=3)
    gy = torch.randn(rows, inter, generator=gen(4)).bfloat16()
    torch._dynamo.reset()
    for fn, args in ((_swiglu_grad_fp8, (q.data, q.scale, 128, gy, torch.bfloat16)),
                     (_swiglu_math_fp8, (q.data, q.scale, 128, torch.bfloat16, torch.float32))):
        compiled = torch.compile(fn.__wrapped__, **fuse.COMPILE_OPTIONS)
        _, (code, *_) = run_and_get_code(compiled, *args)
        call = code[code.index("def call("):]
        kernels = [ln for ln in call.splitlines() if "cpp_fused" in ln and "(" in ln]
        assert len(kernels) == 1, kernels
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            compiled(*args)
        sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
        assert sizes and max(sizes) <= rows * inter * 4, (fn.__name__, sizes)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- on a GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("kind,t", [("fprop", 512), ("dgrad", 512), ("wgrad", 512),
                                    ("fprop", 1), ("fprop", 3), ("fprop", 7), ("fprop", 64)])
def test_blockwise_scaled_mm_matches_the_emulated_gemm_on_gpu(kind, t):
    """Training shapes, and decode steps' few rows (any number of live sequences, not only multiples
    of 4, through the Fprop GEMM: the one a decode step runs)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("blockwise FP8 needs a Hopper GPU")
    dev = "cuda"
    k, n = 1024, 768
    a, b = _blockwise_operands(kind, torch.randn(t, k, device=dev), torch.randn(n, k, device=dev) * 0.02,
                               torch.randn(t, n, device=dev))
    got = gemm.ScaledMMBackend().mm(a, b, Format.FP32 if kind == "wgrad" else Format.BF16).float()
    ref = gemm.EmulatedBackend().mm(a, b).float()
    # The reference is exact (float64 per 128-wide K block, rounded to fp32 once). Hopper's FP8 MMA
    # keeps ~14 significant bits in its accumulator (DeepSeek-V3 report, sec. 3.3.2: an e8m13 "fp22"),
    # truncating the running sum at each k=32 MMA step; the blockwise kernel promotes each 128-wide K
    # block to fp32 (scaled, then added: 2^-24, negligible). A block's 4 truncations each lose < 2^-13
    # of a running sum, and on these random operands a running sum is no larger in rms than the block's
    # sum: at most 4 * 2^-13 = 2^-11 relative (Frobenius). That is Wgrad's bound (fp32 output); this
    # accumulator simulated on these shapes gives 1.17e-4 (about 2^-13), an H100 measured 1.27e-4.
    # Fprop / Dgrad then round to bf16 (up to 2^-9 relative), which dominates: 2^-8.
    tol = 2.0 ** -8 if kind != "wgrad" else 4 * 2.0 ** -13
    assert error_stats(ref, got)["rel_err"] < tol


def _hopper_scaled_mm(monkeypatch) -> torch.device:
    """The CUDA device, for a test of torch's blockwise ``scaled_mm`` API (skipped without a Hopper GPU
    or without ``torch.nn.functional.scaled_mm``), with no per-device kernel decision made yet."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("blockwise FP8 needs a Hopper GPU")
    if gemm._scaled_mm_v2() is None:
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    monkeypatch.setattr(gemm, "_KERNELS", {})
    return torch.device("cuda")


@gpu
@needs_cuda
def test_a_blockwise_gemms_bias_on_gpu_is_in_the_epilogue_or_after_as_reported(monkeypatch):
    """On Hopper the q/k/v GEMM's bias goes into scaled_mm's epilogue where cuBLASLt takes it with
    block scales (else it is added after, and the refusal said); either way the result is the
    emulated GEMM plus the bias, within the bf16 output's rounding."""
    dev = _hopper_scaled_mm(monkeypatch)
    t, k, n = 64, 1024, 768
    a, b = _blockwise_operands("fprop", torch.randn(t, k, device=dev), torch.randn(n, k, device=dev) * 0.02, None)
    bias = torch.randn(n, device=dev).bfloat16()
    got = gemm._mm_bias(gemm.ScaledMMBackend(), a, b, Format.BF16, bias)
    ref = gemm.EmulatedBackend().mm(a, b).double() + bias.double()
    assert got.dtype == torch.bfloat16 and error_stats(ref, got.float())["rel_err"] < 2.0 ** -8
    choice = gemm.kernel_choice(gemm.BIAS_OP, dev)
    assert choice is not None and choice["kernel"] in ("in scaled_mm's epilogue", "added after the GEMM"), choice


@gpu
@needs_cuda
def test_an_fp8_wgrad_into_the_gradient_on_gpu_is_the_functional_calls_bits(monkeypatch):
    """On Hopper a blockwise FP8 Wgrad written by scaled_mm into the gradient (``out=``) holds the
    functional call's product bit for bit, or the refusal is reported and nothing is written."""
    dev = _hopper_scaled_mm(monkeypatch)
    t, k, n = 512, 1024, 768
    a, b = _blockwise_operands("wgrad", torch.randn(t, k, device=dev), None, torch.randn(t, n, device=dev))
    be = gemm.ScaledMMBackend()
    grad = torch.full((n, k), float("nan"), device=dev)
    wrote = be.mm_into(a, b, grad)
    choice = gemm.kernel_choice(gemm.INTO_OP, dev)
    assert choice is not None and choice["into"] is wrote, choice
    assert torch.equal(grad, be.mm(a, b)) if wrote else grad.isnan().all()


@gpu
@needs_cuda
def test_a_bf16_wgrad_adds_into_its_fp32_sum_in_the_gemm_on_gpu(monkeypatch):
    """On CUDA, ``addmm(out_dtype=fp32)`` adds bf16 products into the fp32 gradient sum in place (the
    lm_head's chunked Wgrad); where this torch cannot, the fallback is recorded with its reason."""
    monkeypatch.setattr(gemm, "_ADDMM_OUT_DTYPE", {})
    dev = torch.device("cuda")
    spec = GemmSpec(CastSpec(Format.BF16), CastSpec(Format.BF16), Format.FP32)
    n, k, t = 4096, 1536, 768
    a = torch.randn(n, t, device=dev).bfloat16()
    b = torch.randn(k, t, device=dev).bfloat16()
    c = torch.randn(n, k, device=dev)
    acc = c.clone()
    out = gemm.accumulate_gemm(acc, a, b, spec, "wgrad", dev, torch.float32)
    choice = gemm.kernel_choice("wgrad sum", dev)
    assert choice["kernel"] == "GEMM into the sum (out_dtype)", choice
    assert out.data_ptr() == acc.data_ptr()
    ref = c.double() + a.double() @ b.double().T
    assert error_stats(ref, out)["rel_err"] < 1e-5  # fp32 accumulation over 768 products, one add


@gpu
@needs_cuda
def test_auto_picks_a_kernel_backend_for_blockwise_fp8_on_gpu():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("blockwise FP8 needs a Hopper GPU")
    gemm.reset_resolutions()
    for g, spec in (("fprop", named_flow("fp8-unified").train.linear.fprop),
                    ("wgrad", named_flow("fp8-unified").train.linear.wgrad)):
        res = gemm.resolve(spec, g, "cuda")
        assert res.backend in ("scaled_mm", "triton"), res.to_dict()
        assert res.timings_ms[res.backend] == min(res.timings_ms.values())
    gemm.reset_resolutions()


@gpu
@needs_cuda
@pytest.mark.parametrize("flow", ["bf16", "fp8-unified"])
def test_native_training_step_on_gpu_matches_cpu_emulation(flow):
    base = _model(seed=12, hidden=256, layers=2, vocab=512)
    b = _batch(512, n=4, t=48)

    def grads(dev):
        m = copy.deepcopy(base).to(dev)
        apply_flow(m, named_flow(flow), "train")
        lp = token_logprobs(m, b, SamplingParams())
        lp.sum().backward()
        return lp.detach().cpu(), {n: p.grad.cpu() for n, p in m.named_parameters() if p.grad is not None}

    lp_gpu, g_gpu = grads("cuda")
    lp_cpu, g_cpu = grads("cpu")
    assert error_stats(lp_cpu, lp_gpu)["rel_err"] < NATIVE_TOL[flow]
    for n in g_cpu:
        assert error_stats(g_cpu[n], g_gpu[n])["rel_err"] < 2 * NATIVE_TOL[flow], n


# --------------------------------------------------------------------------- batch-invariant mode


def rollout_scored(m, flow, sp):
    """Three prompts rolled out by the embedded engine (decode steps of a few rows, no CUDA graphs) and the
    samples scored by a trainer of a copy of ``m``: ``(batch, trainer logprobs, trainer)``."""
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.engine.embedded import EmbeddedEngine
    from jetrl_cli.rl.algos import CorrectionConfig
    from jetrl_cli.rl.trainer import Trainer

    eng = EmbeddedEngine(m, flow, 32, max_batch=4, cuda_graphs=False)
    eng.load_weights(make_payload(m, flow))
    prompts = [[5, 9, 3], [7, 2, 11, 4, 8], [1]]
    out = eng.generate(prompts, sp, seed=2)
    flat = [(p, c) for p, g in zip(prompts, out) for c in g]
    b = Batch.build([p for p, _ in flat], [c.tokens for _, c in flat], [c.logprobs for _, c in flat],
                    [0.0] * len(flat), [i // 2 for i in range(len(flat))])
    tr = Trainer(copy.deepcopy(m), flow, TrainConfig(micro_batch=6), CorrectionConfig(), sp, 32)
    return b, tr.score(b), tr


@pytest.mark.parametrize("flow_name,kv", [pytest.param("bf16", None, marks=pytest.mark.slow), ("fp8-unified", None),
                                          pytest.param("fp8-unified", "fp8_e4m3 row", marks=pytest.mark.slow)])
def test_batch_invariant_mode_runs_every_forward_op_through_the_invariant_kernels(flow_name, kv, forced_native, monkeypatch):
    """``precision.batch_invariant`` on the native (GPU) path, run here with Triton's interpreter:
    GEMMs (q/k/v's bias in their epilogue), attention, RMSNorm (with its residual add), the
    log-softmax, RoPE and SwiGLU (bf16) go through kernels/invariant.py -- in FP8 flows a norm or a
    SwiGLU that feeds a GEMM is the fused quantizer's kernel (``rms_norm_quantize``,
    ``swiglu_quantize``: one launch configuration whatever the rows), as in the fast path -- and the
    rollout (prefill, then decode steps of a few rows) gives the trainer's logprobs bit for bit. With
    an FP8 KV cache the decode steps' attention reads the FP8 bytes and scales as stored
    (``kv_scales``)."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from jetrl_cli.kernels import invariant
    from jetrl_cli.precision import parse_flow

    from .triton_interp_fix import fixed_fp8_conversion

    over = {"base": flow_name, "batch_invariant": True}
    if kv is not None:
        over.update(rollout={"kv_cache": kv}, unified=True)
    flow = parse_flow(over, source="<test>")
    assert flow.rollout.linear.backend == flow.train.linear.fprop.backend == "invariant"
    assert flow.skipped_linear().fprop.backend == "invariant" and "batch-invariant" in flow.short_str()
    calls = {}
    from jetrl_cli.precision import fuse

    monkeypatch.setattr(fuse, "_force_exact", True)  # the GPU's elementwise kernels for CPU tensors too
    for name in ("invariant_mm", "invariant_blockwise_mm", "invariant_attention", "invariant_rms_norm",
                 "invariant_log_softmax", "invariant_add_rms_norm", "exact_rope", "exact_swiglu"):
        fn = getattr(invariant, name)

        def counted(*a, _fn=fn, _n=name, **k):
            calls[_n] = calls.get(_n, 0) + 1
            if k.get("kv_scales") is not None:
                calls["fp8 cache read as stored"] = calls.get("fp8 cache read as stored", 0) + 1
            return _fn(*a, **k)

        monkeypatch.setattr(invariant, name, counted)
    from jetrl_cli.kernels import fp8

    forms = set()  # each fused kernel's form (its compile-time flags): one each, whoever calls

    def fused_call(*a, _fn, _n, **k):
        calls[_n] = calls.get(_n, 0) + 1
        forms.add((_n, tuple(sorted((key, bool(k.get(key))) for key in ("write_y", "rsqrt", "save")))))
        return _fn(*a, **k)

    for name in ("rms_norm_quantize", "swiglu_quantize"):
        monkeypatch.setattr(fp8, name, functools.partial(fused_call, _fn=getattr(fp8, name), _n=name))
    added = []  # adds after a GEMM (its bias): none, the kernels' epilogue adds it
    real_add = gemm.add_bias
    monkeypatch.setattr(gemm, "add_bias", lambda acc, bias: (added.append(bias is not None), real_add(acc, bias))[1])
    with fixed_fp8_conversion():
        # 256 wide: q/k/v 256 + 128 + 128 and gate/up 2 x 384 rows, whole 128-row blocks, so each group is one
        # GEMM and the SwiGLU's halves whole 128-wide groups (the fused quantizer's case)
        m = _model(seed=9, hidden=256, layers=1, vocab=128).to(TRITON_DEV)
        sp = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
        b, old, tr = rollout_scored(m, flow, sp)
        with torch.enable_grad():  # the trainer's forward with autograd: the same bits too
            graded = token_logprobs(tr.model, b, sp)
        before = tr.model.lm_head.weight.detach().clone()
        stats = tr.update(b, torch.randn(len(b)), old, None, step=0)  # the backward need not be invariant
    assert torch.equal(old[b.mask], b.rollout_logp[b.mask])
    assert graded.requires_grad and torch.equal(graded.detach().cpu()[b.mask], b.rollout_logp[b.mask])
    assert len({n for n, _ in forms}) == len(forms), forms  # rollout, scoring, forward with grad: one form
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0 and not torch.equal(before, tr.model.lm_head.weight)
    want = {"invariant_mm", "invariant_attention", "invariant_log_softmax", "exact_rope"}
    if flow_name == "fp8-unified":  # the norms and the SwiGLU that feed GEMMs: the fused quantizers
        want |= {"invariant_blockwise_mm", "rms_norm_quantize", "swiglu_quantize"}
        assert "exact_swiglu" not in calls and "invariant_add_rms_norm" not in calls, calls
    else:
        want |= {"exact_swiglu", "invariant_add_rms_norm", "invariant_rms_norm"}
    if kv is not None:
        want.add("fp8 cache read as stored")
    assert want <= set(calls), calls
    assert not any(added), "a GEMM's bias is added in its kernel's epilogue"


def _kernel_reads_the_cache(monkeypatch, llama) -> list:
    """On a GPU an engine's first decode step times the Triton kernel against SDPA over the cache
    (``llama._time_kv_reads``: a warm-up round and a captured round of calls of each, ``_kv_values``
    for SDPA over an FP8 cache) and keeps the faster; Triton's interpreter times nothing. For tests of
    the kernel's path: the timing still runs, its calls happen while the returned list is not empty
    (they are not decode steps' calls), and the kernel is made the faster (which one is faster is
    ``test_the_faster_way_to_read_the_kv_cache_is_timed_once_and_kept``'s subject)."""
    deciding = []
    real = llama._time_kv_reads

    def time_reads(cache, heads, **kw):
        deciding.append(1)
        try:
            real(cache, heads, **kw)
        finally:
            deciding.pop()
        return {"triton": 1.0, "sdpa": 2.0}

    monkeypatch.setattr(llama, "_time_kv_reads", time_reads)
    return deciding


def test_decode_steps_read_an_fp8_kv_cache_as_stored(forced_native, monkeypatch):
    """Natively (a GPU; here Triton's interpreter) a decode step's attention reads the FP8 cache's
    bytes and scales (``kernels.attention.decode_attention``), never a dequantized copy of the cache
    (``_kv_values``, which the fallback path without a Triton kernel calls); the step's new keys and
    values are quantized into the cache by one kernel each (``kv_store``) -- also where attention
    reads the cache dequantized (through SDPA), whose steps then dequantize only in the cache's read,
    not the new rows as well. Not batch-invariant: the trainer's attention adds in another order, so
    the rollout's logprobs are within bf16 attention's rounding of the trainer's."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.engine.embedded import EmbeddedEngine
    from jetrl_cli.kernels import attention
    from jetrl_cli.models import llama
    from jetrl_cli.precision import parse_flow
    from jetrl_cli.rl.algos import CorrectionConfig
    from jetrl_cli.rl.trainer import Trainer

    flow = parse_flow({"base": "bf16", "rollout": {"kv_cache": "fp8_e4m3 row"}, "unified": True}, source="<test>")
    calls = {"decode_attention": 0, "kv_values": 0, "kv_store": 0}
    deciding = _kernel_reads_the_cache(monkeypatch, llama)  # a GPU's timing calls are not counted
    for mod, name, key in ((attention, "decode_attention", "decode_attention"), (llama, "_kv_values", "kv_values"),
                           (attention, "kv_store", "kv_store")):
        fn = getattr(mod, name)

        def counted(*a, _fn=fn, _k=key, **k):
            calls[_k] += not deciding
            return _fn(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    from .triton_interp_fix import fixed_fp8_conversion

    m = _model(seed=4, hidden=128, layers=2, vocab=128).to(TRITON_DEV)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
    prompts = [[5, 9, 3], [7, 2, 11, 4, 8], [1]]
    logps = {}
    stack = contextlib.ExitStack()
    stack.enter_context(fixed_fp8_conversion())  # the interpreter's fp32 -> fp8 cast (kv_store) rounds wrongly
    for stored in (True, False):
        if not stored:  # the dequantizing path, for comparison
            monkeypatch.setattr(llama, "_reads_cache_as_stored", lambda *a: False)
        before = dict(calls)
        eng = EmbeddedEngine(m, flow, 32, max_batch=4, cuda_graphs=False)
        eng.load_weights(make_payload(m, flow))
        out = eng.generate(prompts, sp, seed=2)
        rolled = dict(calls)
        if not stored:  # attention reads the cache dequantized: a step still stores by one kernel per
            # tensor, and dequantizes only in the cache's read (2 per layer and step), not its new rows too
            new = {k: rolled[k] - before[k] for k in calls}
            assert new["decode_attention"] == 0 and new["kv_store"] == new["kv_values"] >= 2 * 5, new
        flat = [(p, c) for p, g in zip(prompts, out) for c in g]
        b = Batch.build([p for p, _ in flat], [c.tokens for _, c in flat], [c.logprobs for _, c in flat],
                        [0.0] * len(flat), [i // 2 for i in range(len(flat))])
        tr = Trainer(copy.deepcopy(m), flow, TrainConfig(micro_batch=6), CorrectionConfig(), sp, 32)
        logps[stored] = (b.rollout_logp[b.mask], tr.score(b)[b.mask].cpu(), [c.tokens for _, c in flat])
        if stored:
            assert rolled["decode_attention"] >= 2 * 5 and rolled["kv_values"] == 0, rolled  # 2 layers x 5 steps or more
            # keys and values, one kernel each per layer and step (the device check calls each once)
            assert rolled["kv_store"] - 1 == 2 * (rolled["decode_attention"] - 1), rolled
            # the trainer's one forward rounds each layer's keys and values as the cache stores and
            # reads them: kv_store into a scratch copy, then the cache's dequantization (cast_kv)
            assert {k: calls[k] - rolled[k] for k in calls} == {"decode_attention": 0, "kv_values": 4,
                                                                 "kv_store": 4}, calls
    stack.close()
    assert calls["kv_values"] > 0
    rollout, trainer, tokens = logps[True]
    # bf16 attention summed in another order: within two bf16 ulps of each logprob (a fixed 2e-2 held on
    # the AVX-512 machine; on an AVX2-only one a logprob of -5.84 moved by 0.021, 0.4% of it)
    assert ((rollout - trainer).abs() <= 2**-7 * trainer.abs() + 2e-3).all()
    assert len(set(map(tuple, tokens))) > 1
    (choice,) = gemm.backend_report()["kernels"]
    assert {k: choice[k] for k in ("op", "device", "kernel", "runs")} == {
        "op": llama.KV_READ, "device": str(m.lm_head.weight.device), "kernel": "triton, read as stored", "runs": True}


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", [Format.FP8_E4M3, Format.FP8_E5M2])
def test_the_trainers_fp8_kv_rounding_is_the_caches_store_and_read(forced_native, monkeypatch, fmt):
    """Natively, the trainer's keys and values under an FP8 row cache (``cast_kv`` with the dtype
    attention reads) are what the rollout's cache stores and reads back: ``kv_store`` into a scratch
    copy, then ``_kv_values`` -- one call each -- bit for bit the reference quantizer's values in
    bf16, and the values of the op-by-op path (quantize, dequantize, the straight-through sum, the
    cast to bf16), gradients included; on fresh random keys with a zero row, a NaN row and a row of
    tiny values. (A negative key that rounds to zero is -0 here, as in the cache; the straight-through
    sum ``t + (q - t)`` made it +0: an equal value.)"""
    from jetrl_cli.kernels import attention
    from jetrl_cli.models import llama

    from .triton_interp_fix import fixed_fp8_conversion

    spec = CastSpec(fmt, Block.parse("row"))
    g = gen(fresh_seed())
    t = (torch.randn(2, 3, 5, 64, generator=g) * torch.rand(2, 3, 5, 1, generator=g) * 8).to(TRITON_DEV)
    t[0, 0, 0] = 0.0
    t[1, 2, 3, 7] = float("nan")
    t[0, 1, 4] = torch.randn(64, generator=g).to(TRITON_DEV) * 1e-30
    gy = torch.randn(t.shape, generator=g).to(TRITON_DEV, torch.bfloat16)
    calls = collections.Counter()
    for mod, name in ((attention, "kv_store"), (llama, "_kv_values")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **k: calls.update([_n]) or _fn(*a, **k))
    with fixed_fp8_conversion():
        ref_in, got_in = t.clone().requires_grad_(True), t.clone().requires_grad_(True)
        want = llama.cast_kv(ref_in, spec).to(torch.bfloat16)  # the reference, then attention's cast
        assert calls == {}
        got = llama.cast_kv(got_in, spec, torch.bfloat16)
    assert calls == {"kv_store": 1, "_kv_values": 1}
    stored = dequantize(quantize(t.reshape(-1, 64), spec)).reshape(t.shape).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), stored.view(torch.int16))
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert bool(got[1, 2, 3].isnan().all()) and not bool(got[1, 2, 2].isnan().any())
    want.backward(gy)
    got.backward(gy)
    assert got_in.grad.dtype == torch.float32 and torch.equal(got_in.grad, ref_in.grad)


@pytest.mark.slow  # 40 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_decode_attention_writes_o_projs_fp8_input_in_the_rollout(forced_native, monkeypatch):
    """An FP8 flow's decode step over the cache (``kernels.attention``, here over an FP8 cache) writes
    o_proj's FP8 1x128 input in the attention kernel (head_dim 128: a head is one group), so no
    quantizer runs between them: the same tokens and logprobs, bit for bit, as with the attention's
    bf16 output quantized by o_proj's own quantizer."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.engine.embedded import EmbeddedEngine
    from jetrl_cli.kernels import attention
    from jetrl_cli.models import llama
    from jetrl_cli.precision import parse_flow

    from .triton_interp_fix import fixed_fp8_conversion

    flow = parse_flow({"base": "fp8-unified", "rollout": {"kv_cache": "fp8_e4m3 row", "linear": {"backend": "triton"}},
                       "train": {g: {"backend": "triton"} for g in ("fprop", "dgrad", "wgrad")}}, source="<test>")
    seed = fresh_seed()
    m = _model(seed=seed, hidden=512, layers=1, vocab=128).to(TRITON_DEV)
    assert m.config.head_dim == 128
    fused = []
    decode = attention.decode_attention
    deciding = _kernel_reads_the_cache(monkeypatch, llama)  # a GPU's timing calls are not decode steps'

    def recorded(*a, **k):
        if not deciding:
            fused.append(k.get("quantize_out") is not None)
        return decode(*a, **k)

    monkeypatch.setattr(attention, "decode_attention", recorded)
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, n=2)
    prompts = [[5, 9, 3], [7, 2, 11, 4, 8], [1]]
    runs = []
    with fixed_fp8_conversion():
        for own_kernel in (True, False):
            if not own_kernel:
                monkeypatch.setattr(llama.Attention, "_o_proj_operand", lambda *a: None)
            fused.clear()
            eng = EmbeddedEngine(m, flow, 32, max_batch=8, cuda_graphs=False)
            eng.load_weights(make_payload(m, flow))
            out = eng.generate(prompts, sp, seed=seed % 1000)
            runs.append([(c.tokens, c.logprobs) for g in out for c in g])
            assert fused and all(f is own_kernel for f in fused[1:]), fused  # (the first: the device check)
    assert runs[0] == runs[1]


def test_a_kernel_that_cannot_read_the_fp8_cache_falls_back_and_says_why(forced_native, monkeypatch):
    """Checked once per device before the first decode step: where the FP8-reading kernel cannot
    compile or launch (or the GPU predates FP8 conversions), decode steps dequantize the cache for
    SDPA instead, and the run's backend report (metrics.jsonl, bench rows, the live display) says so."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.engine.embedded import EmbeddedEngine
    from jetrl_cli.kernels import attention
    from jetrl_cli.live import backend_lines
    from jetrl_cli.models import llama
    from jetrl_cli.precision import parse_flow

    launches = []

    def broken(*a, **k):
        launches.append(1)
        raise RuntimeError("PassManager::run failed\nmore detail")

    monkeypatch.setattr(attention, "decode_attention", broken)
    kv_values = llama._kv_values
    dequantized = []
    monkeypatch.setattr(llama, "_kv_values", lambda *a: dequantized.append(1) or kv_values(*a))
    flow = parse_flow({"base": "bf16", "rollout": {"kv_cache": "fp8_e4m3 row"}}, source="<test>")
    m = _model(seed=5, hidden=128, layers=2, vocab=128).to(TRITON_DEV)
    eng = EmbeddedEngine(m, flow, 32, max_batch=4, cuda_graphs=False)
    eng.load_weights(make_payload(m, flow))
    out = eng.generate([[5, 9, 3], [7, 2]], SamplingParams(max_new_tokens=5, temperature=1.0, n=2), seed=1)
    assert all(len(c.tokens) == 5 for g in out for c in g) and dequantized
    assert len(launches) == 1  # the check's call; decode steps never tried the kernel again
    (choice,) = gemm.backend_report()["kernels"]
    assert choice["kernel"] == "dequantized, then SDPA" and choice["why"] == (
        "the kernel failed: RuntimeError: PassManager::run failed")
    assert backend_lines(gemm.backend_report())[-1] == (f"{llama.KV_READ} on {m.lm_head.weight.device}: dequantized, "
                                                        "then SDPA (the kernel failed: RuntimeError: PassManager::run failed)")


@pytest.mark.parametrize("kv", ["fp8_e4m3 row", pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("faster", ["triton", pytest.param("sdpa", marks=pytest.mark.slow)])
def test_the_faster_way_to_read_the_kv_cache_is_timed_once_and_kept(kv, faster, forced_native, monkeypatch):
    """On a GPU the first decode step times the Triton kernel against SDPA (an FP8 cache dequantized
    first) at the cache's full width and keeps the faster, saying so; the batch-invariant mode reads
    an FP8 cache's bytes whenever the kernel runs (the same bits as through a dequantized copy).
    ``_time_kv_reads`` runs here on CPU tensors (the wall clock)."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.engine.embedded import EmbeddedEngine
    from jetrl_cli.kernels import attention
    from jetrl_cli.models import llama
    from jetrl_cli.precision import parse_flow

    from .triton_interp_fix import fixed_fp8_conversion

    timed = []

    def time_reads(cache, heads):
        n0 = calls["decode_attention"]
        real = llama.__dict__["_time_kv_reads"].__wrapped__(cache, heads, calls=1)
        calls["deciding"] += 1 + calls["decode_attention"] - n0  # the device check's call, and the timing's
        assert set(real) == {"triton", "sdpa"} and all(v > 0 for v in real.values())
        timed.append(cache.kv.shape)
        return {"triton": 1.0, "sdpa": 2.0} if faster == "triton" else {"triton": 2.0, "sdpa": 1.0}

    time_reads.__wrapped__ = llama._time_kv_reads
    monkeypatch.setattr(llama, "_time_kv_reads", time_reads)
    monkeypatch.setattr(llama, "_can_time", lambda device: True)
    calls = {"decode_attention": 0, "deciding": 0}
    real_decode = attention.decode_attention

    def counted(*a, **k):
        calls["decode_attention"] += 1
        return real_decode(*a, **k)

    monkeypatch.setattr(attention, "decode_attention", counted)
    from jetrl_cli.kernels import invariant as inv

    calls["invariant fp8 reads"] = 0
    real_inv = inv.invariant_attention

    def counted_inv(*a, **k):
        calls["invariant fp8 reads"] += k.get("kv_scales") is not None
        return real_inv(*a, **k)

    monkeypatch.setattr(inv, "invariant_attention", counted_inv)
    m = _model(seed=6, hidden=128, layers=2, vocab=128).to(TRITON_DEV)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, n=2)
    with fixed_fp8_conversion():
        for invariant in (False, True):
            flow = parse_flow({"base": "bf16", "rollout": {"kv_cache": kv}, "batch_invariant": invariant},
                              source="<test>")
            eng = EmbeddedEngine(m, flow, 32, max_batch=4, cuda_graphs=False)
            eng.load_weights(make_payload(m, flow))
            before = calls["decode_attention"]
            out = eng.generate([[5, 9, 3], [7, 2]], sp, seed=1)
            assert all(len(c.tokens) == 4 for g in out for c in g)
            if not invariant:
                decoding = calls["decode_attention"] - before - calls["deciding"]
                assert (decoding > 0) == (faster == "triton"), (decoding, calls)
    assert len(timed) == 1  # timed once per device, at the engine's first decode step
    (choice,) = gemm.backend_report()["kernels"]
    op = llama.KV_READ if kv != "bf16" else llama.BF16_READ
    assert choice["op"] == op and choice["kernel"] == llama.CACHE_KERNELS[op][0 if faster == "triton" else 1]
    assert choice["runs"] and choice["why"].startswith("timed at 4 sequences x 32 keys x 2 KV heads: triton ")
    # the invariant mode read the FP8 bytes, whichever was faster (a bf16 cache: through its own kernel)
    assert (calls["invariant fp8 reads"] > 0) == (kv != "bf16")


@gpu
@needs_cuda
@pytest.mark.parametrize("preset,extra", [
    ("fp8-unified", []), ("bf16", []),
    # LoRA adapters (bf16, beside the FP8 layers) and micro-batches by token budget
    ("fp8-unified", ["model.lora_rank=8", "train.lr=3e-4", "train.micro_batch_tokens=1024"]),
], ids=["fp8-unified", "bf16", "fp8-unified-lora"])
def test_batch_invariant_gpu_run_is_bitwise_on_policy_at_every_step(preset, extra, tmp_path):
    """Issue target: `jetrl run presets/<preset>.yaml --set model.device=cuda --set
    precision.batch_invariant=true` has mismatch_kl exactly 0 and every token bitwise equal."""
    from jetrl_cli.config import load_job_config
    from jetrl_cli.rl.loop import run

    cfg = load_job_config(preset, ["model.device=cuda", "precision.batch_invariant=true", "train.steps=4",
                                   "eval.every=0", "eval.prompts=8", "run.checkpoint_every=0", *extra])
    lines = [m for m in run(cfg, tmp_path / "r") if m["step"] > 0]
    assert len(lines) == 4
    assert all(m["mismatch_kl"] == 0.0 and m["frac_bitwise_equal"] == 1.0 for m in lines), lines


@pytest.mark.parametrize("t,left_pad", [(1, False), (5, True), (5, False)])
def test_masked_gqa_attention_folds_query_heads_onto_their_kv_head(t, left_pad):
    """Decode steps and left-padded prefills attend with a mask, where torch's fused kernels take no
    GQA (before 2026): the query heads that share a KV head are folded into query rows of it. Each
    output row is attention over its own visible keys, checked against float64 attention with the
    KV heads repeated per query head (heads i*rep .. i*rep+rep-1 read KV head i)."""
    from jetrl_cli.models.llama import Masking, _native_attention
    from jetrl_cli.precision.formats import Format

    g = torch.Generator().manual_seed(fresh_seed())
    b, hk, rep, d, width = 3, 2, 3, 16, 12
    h = hk * rep
    q = torch.randn(b, h, t, d, generator=g)
    k, v = torch.randn(b, hk, width, d, generator=g), torch.randn(b, hk, width, d, generator=g)
    q_index = torch.tensor([[4], [9], [11]]) + torch.arange(t) - (t - 1)  # rows at different lengths
    keep = (torch.rand(b, width, generator=g) > 0.3) if left_pad else None
    mask = Masking(q_index, keep, width, causal_from_zero=False)
    got = _native_attention(q, k, v, mask, rep, Format.FP32)
    kr, vr = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = (q.double() @ kr.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(~mask.visible(), float("-inf"))
    want = (scores.softmax(-1) @ vr).transpose(1, 2).reshape(b, t, h * d)
    assert got.shape == (b, t, h * d)
    assert (got.double() - want).abs().max() < 1e-5


def test_attention_saves_its_values_not_the_whole_qkv_projection(forced_native):
    """SDPA keeps v for its backward; a view of the q/k/v projection's output would keep all of it
    alive (8x v's bytes for Qwen2.5-1.5B's 12 query and 2 KV heads)."""
    m = _model()
    apply_flow(m, named_flow("bf16"), "train")
    b = _batch(256, n=2, t=16)
    a = m.model.layers[0].self_attn
    cfg = m.config
    qkv_bytes = b.ids.numel() * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * 2
    heads = []  # saved (batch, heads, tokens, head_dim) tensors: their storage's bytes

    def pack(t):
        if t.dim() == 4 and t.shape[-1] == cfg.head_dim and t.dtype is torch.bfloat16:
            heads.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(m, b, SamplingParams())
    assert heads and a.q_proj.weight.requires_grad
    assert qkv_bytes not in heads, heads


@pytest.mark.parametrize("held", [False, True])
def test_native_group_weight_is_cast_straight_into_the_stack(forced_native, held):
    """A native dense group's (q/k/v, gate/up) stacked weight is made by casting each layer's fp32
    master weight straight into its rows: one read of each master and one write of the stack, no
    per-layer bf16 copy concatenated afterwards (a second write and read of every weight per
    update). With a stack already held (after an update), into that one, in place. The same bits
    as the layers' casts, concatenated."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from jetrl_cli.precision.linear import group_weight

    g = gen(fresh_seed())
    prec = named_flow("bf16").train.linear
    mods = tuple(JetLinear(torch.nn.Parameter(torch.randn(n, 64, generator=g) / 8), None, prec) for n in (128, 32, 32))
    owner = torch.nn.Module()
    before = group_weight(mods, owner)[0] if held else None
    with torch.no_grad():
        for m in mods:
            m.weight.add_(torch.randn(m.weight.shape, generator=g) / 64)
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        w = group_weight(mods, owner)[0]
    assert torch.equal(w, torch.cat([m.weight.detach().to(torch.bfloat16) for m in mods]))
    written = [o for o in ops if o not in ("slice", "detach", "view", "empty")]
    assert written == ["copy_"] * len(mods), ops  # no separate cast, no concatenation
    if held:
        assert w is before


def test_native_bf16_weights_are_held_once(forced_native):
    """A bf16 trainer layer's Dgrad weight W^T is a view of the forward's bf16 W (a contiguous copy
    would hold a second bf16 copy of every weight for the whole run), and a fused group's layers
    view the group's stacked weight. After the weights change, the group's weight takes the new
    values in place (a rollout engine's captured graphs read it), and a one-layer group's layer
    reads that same tensor: its own new cast is not kept beside it."""
    m = _model()
    apply_flow(m, named_flow("bf16"), "train")
    b = _batch(256, n=2, t=16)
    token_logprobs(m, b, SamplingParams()).sum().backward()
    lin = m.model.layers[0].mlp.down_proj
    w, wt = lin.quantized_weight(), lin.dgrad_weight()
    assert w.dtype is torch.bfloat16 and torch.equal(wt, w.t())
    assert wt.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    # a fused group (q/k/v, gate/up): each layer's weight is its rows of the stacked one, held once
    from jetrl_cli.precision.linear import group_weight

    a = m.model.layers[0].self_attn
    groups = [((a.q_proj, a.k_proj, a.v_proj), a)] + [((x,), x) for x in (a.o_proj, m.model.layers[0].mlp.down_proj,
                                                                          m.lm_head)]
    for step in range(2):  # and after an update (in place: the group's weight keeps its address)
        for mods, owner in groups:  # a one-layer group too: its layer's weight is the group's, not a copy
            held = group_weight(mods, owner)[0]
            for lin in mods:
                for op in (lin.quantized_weight(), lin.dgrad_weight()):
                    assert op.untyped_storage().data_ptr() == held.untyped_storage().data_ptr(), (step, lin)
                assert torch.equal(lin.quantized_weight(), lin.weight.detach().to(torch.bfloat16))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        token_logprobs(m, b, SamplingParams()).sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_fp8_trainer_groups_hold_each_weight_once(forced_native):
    """In an FP8 trainer group (gate/up, q/k/v) each layer's forward weight is its rows of the
    group's stacked FP8 weight, data and scales (its own quantization, the same bytes, is dropped:
    0.9 GB held twice through a step at the 1.5B shape), and its Dgrad weight is still the W^T its
    quantizer wrote from the same read, which the group's Dgrad operand is made from."""
    from jetrl_cli.precision import parse_flow
    from jetrl_cli.precision.linear import group_dgrad_weight, group_weight, _Group

    from .triton_interp_fix import fixed_fp8_conversion

    gemms = {g: {"backend": "triton"} for g in ("fprop", "dgrad", "wgrad")}
    prec = parse_flow({"base": "fp8-unified", "rollout": {"linear": {"backend": "triton"}}, "train": gemms},
                      source="<test>").train.linear
    g = gen(fresh_seed())
    owner = torch.nn.Module()
    mods = tuple(JetLinear(torch.nn.Parameter(torch.randn(n, 256, generator=g).to(TRITON_DEV) / 16), None, prec)
                 for n in (256, 128, 128))
    with fixed_fp8_conversion():
        own = [quantize(m.weight.detach(), prec.fprop.b) for m in mods]
        w = group_weight(mods, owner)[0]
        wt = group_dgrad_weight(_Group(mods, w, None, owner))
    assert isinstance(w, QTensor) and isinstance(wt, QTensor)
    start = 0
    for m, q in zip(mods, own):
        n = m.out_features
        held = m.quantized_weight()
        assert held.data.untyped_storage().data_ptr() == w.data.untyped_storage().data_ptr()
        assert held.scale.untyped_storage().data_ptr() == w.scale.untyped_storage().data_ptr()
        assert torch.equal(held.data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(held.scale, q.scale) and torch.equal(w.scale[start // 128:(start + n) // 128], q.scale)
        assert torch.equal(wt.data[:, start:start + n].view(torch.uint8), q.data.t().view(torch.uint8))
        start += n


def test_native_bf16_group_input_gradient_is_one_gemm(forced_native, monkeypatch):
    """A fused group's (q/k/v, gate/up) input gradient: one GEMM against the stacked weight, summed
    in fp32, where per-layer GEMMs would add bf16 partial results. Checked against float64."""
    from jetrl_cli.precision import linear

    calls = []
    real = linear.run_gemm
    monkeypatch.setattr(linear, "run_gemm", lambda a, b, spec, gemm, *r, **k: calls.append(gemm) or real(
        a, b, spec, gemm, *r, **k))
    g = torch.Generator().manual_seed(fresh_seed())
    prec = named_flow("bf16").train.linear
    mods = [JetLinear(torch.nn.Parameter(torch.randn(n, 64, generator=g) * 0.05), None, prec) for n in (128, 32, 32)]
    owner = torch.nn.Module()
    x = torch.randn(48, 64, generator=g).to(torch.bfloat16).requires_grad_()
    gy = torch.randn(48, 192, generator=g)
    linear.linear_group(mods, x, owner).backward(gy.to(torch.bfloat16))
    assert calls.count("dgrad") == 1
    w = torch.cat([m.weight.detach().to(torch.bfloat16) for m in mods]).double()
    want = gy.to(torch.bfloat16).double() @ w
    assert error_stats(want, x.grad.double())["rel_err"] < 2.0 ** -8


def test_native_bf16_linear_rounds_product_plus_bias_once(forced_native):
    """A native bf16 linear adds its bias before the one rounding to bf16 (``addmm``'s epilogue),
    as the emulation does. Operands and bias are bf16 values and the bias nearly cancels the
    product, so a product rounded to bf16 before the add would be off by up to half a bf16 ulp of
    the product, far more than one of the result."""
    from jetrl_cli.precision.linear import linear_forward, weight_operand

    spec = named_flow("bf16").rollout.linear
    m, k, n = 9, 256, 40
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    exact = x.double() @ w.double().T
    bias = (-exact[0] + torch.rand(n, dtype=torch.float64) * 1e-2).bfloat16()  # cancels row 0
    y = linear_forward(x, weight_operand(w.float(), spec), bias, spec)
    assert y.dtype == torch.bfloat16
    ref = exact + bias.double()
    ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(ref.abs().clamp_min(2**-126)))
    acc_err = k * 2**-23 * (x.double().abs() @ w.double().abs().T)  # fp32 accumulation, generously
    assert ((y.double() - ref).abs() <= ulp / 2 + acc_err).all()


@pytest.mark.parametrize("flow_name,tied", [("bf16", False), ("bf16", True), ("fp8-unified", False)])
def test_a_frozen_reference_model_holds_its_forward_weights_only(forced_native, flow_name, tied):
    """The trainer's reference policy (``kl_coef``) never trains: natively its linear layers keep
    only their forward weights (bf16, or FP8 with scales), no fp32 master copy beside them, fused
    layers viewing their group's stacked weight; the tied lm_head keeps the embedding's. Its
    scores are bit for bit those of a reference that keeps its master weights."""
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.rl import trainer as trainer_mod
    from jetrl_cli.rl.algos import CorrectionConfig

    import dataclasses

    from jetrl_cli.models.tiny import tiny_config
    from jetrl_cli.precision.linear import group_weight

    m = random_model(dataclasses.replace(tiny_config("qwen2", hidden=128, layers=2, vocab=256), tie_word_embeddings=tied),
                     seed=2, std=0.05)
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
    b = _batch(256, n=3, t=12)

    def make(freeze):
        tr = trainer_mod.Trainer.__new__(trainer_mod.Trainer)
        tr.freeze_reference = freeze
        tr.__init__(copy.deepcopy(m), named_flow(flow_name), TrainConfig(micro_batch=2), CorrectionConfig(),
                    SamplingParams(), 64, ref_model=copy.deepcopy(m))
        return tr

    frozen, kept = make(True), make(False)
    projs = [x for n, x in frozen.ref.named_modules() if n.endswith("_proj")]
    assert projs and all(x.weight.numel() == 0 and x._wfixed is not None for x in projs)
    assert all(x.weight.numel() for n, x in kept.ref.named_modules() if n.endswith("_proj"))
    head = frozen.ref.lm_head  # tied: the embedding's weight, kept (its bf16 cast cached beside it)
    assert (head.weight.numel() > 0, head._wfixed is None) == (tied, tied)
    if flow_name == "bf16":  # (the CPU emulation multiplies FP8 groups as float64 copies: no views there)
        a = frozen.ref.model.layers[0].self_attn
        stacked = group_weight((a.q_proj, a.k_proj, a.v_proj), a)[0]
        assert all(x._wfixed.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
                   for x in (a.q_proj, a.k_proj, a.v_proj))
    assert all(p.grad is None and p.requires_grad for p in frozen.model.parameters())  # the policy trains
    assert torch.equal(frozen.score(b, ref=True), kept.score(b, ref=True))
    assert torch.equal(frozen.score(b, ref=True), kept.score(b))  # the policy's weights, not yet trained


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.slow  # 100 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_a_trainers_weights_are_quantized_together_after_an_update(forced_native, monkeypatch):
    """``batch_weight_casts``: after an optimizer step the first group to need its weights quantizes every
    FP8 group of the model whose weights changed, in one batched call (two launches), and the others
    take those results: the logprobs and gradients are bit for bit those of the groups quantized one at
    a time. A result is never taken for other weights (a weight changed after the batch: quantized
    again), and one released with the group's caches is dropped."""
    from jetrl_cli.precision import linear, parse_flow

    from .triton_interp_fix import fixed_fp8_conversion

    gemms = {g: {"backend": "triton"} for g in ("fprop", "dgrad", "wgrad")}
    flow = parse_flow({"base": "fp8-unified", "rollout": {"linear": {"backend": "triton"}}, "train": gemms},
                      source="<test>")
    seed = fresh_seed()
    base = _model(seed=seed, hidden=256, layers=2).to(TRITON_DEV)  # q/k/v and gate/up: whole 128-row blocks
    batch = _batch(256, n=2, t=20, seed=seed)
    fp8 = gemm.triton_fp8_kernels()
    calls = collections.Counter()
    for name in ("quantize_weight", "quantize_weight_stack", "quantize_weight_stacks"):
        real = getattr(fp8, name)
        monkeypatch.setattr(fp8, name, lambda *a, _r=real, _n=name, **k: calls.update([_n]) or _r(*a, **k))

    def run(batched: bool):
        m = copy.deepcopy(base)
        apply_flow(m, flow, "train")
        casts = linear.batch_weight_casts(m) if batched else None
        out = []
        for step in range(3):
            calls.clear()
            with fixed_fp8_conversion():
                lp = token_logprobs(m, batch, SamplingParams(max_new_tokens=12))
                (lp.sum() * 1e-2).backward()
            out.append((lp.detach(), [p.grad.clone() for p in m.parameters()], dict(calls)))
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(p.grad.sign() * 1e-3)  # an update in place, versions bumped as AdamW's
                    p.grad = None
            linear.mark_updated(list(m.parameters()))
        return m, casts, out

    if torch.cuda.is_available():  # a GPU times each decode-sized GEMM's split-K at its first call, on weights
        run(False)  # it quantizes (quantize_weight): a run first, so that no step counts those
    _, _, alone = run(False)
    m, casts, together = run(True)
    groups = 4 * 2  # q/k/v, o, gate/up and down of each layer (the tiny model's lm_head is bf16)
    for (lp_a, g_a, calls_a), (lp_b, g_b, calls_b), step in zip(alone, together, range(3)):
        assert torch.equal(lp_a, lp_b) and all(torch.equal(a, b) for a, b in zip(g_a, g_b))
        # every group on its own (its W^T in the same call), or: learnt one by one, then all in one call
        assert calls_a == {"quantize_weight_stack": 2 * 2, "quantize_weight": 2 * 2}
        assert calls_b == {"quantize_weight_stacks": groups if step == 0 else 1}
    assert casts.launches == groups + 2 and len(casts.groups) == groups and casts.ready == {}

    # a group whose weights change after the batch quantized them: its result is not taken
    attn0, attn1 = m.model.layers[0].self_attn, m.model.layers[1].self_attn
    mods0 = (attn0.q_proj, attn0.k_proj, attn0.v_proj)
    mods1 = (attn1.q_proj, attn1.k_proj, attn1.v_proj)
    with fixed_fp8_conversion():
        linear.group_weight(mods0, attn0)  # quantizes every group, attn1's q/k/v included
        assert tuple(map(id, mods1)) in casts.ready
        with torch.no_grad():
            attn1.k_proj.weight.mul_(3)
        linear.mark_updated([attn1.k_proj.weight])
        w1, _ = linear.group_weight(mods1, attn1)
    spec = mods1[0].precision.fprop.b
    want = [quantize(x.weight.detach().float(), spec) for x in mods1]
    assert torch.equal(w1.data.view(torch.uint8), torch.cat([r.data for r in want]).view(torch.uint8))
    assert torch.equal(w1.scale, torch.cat([r.scale for r in want]))
    # released caches drop what was quantized ahead for them
    mlp1 = m.model.layers[1].mlp
    assert tuple(map(id, (mlp1.gate_proj, mlp1.up_proj))) in casts.ready
    linear._release_weights((mlp1.gate_proj, mlp1.up_proj), mlp1)
    assert tuple(map(id, (mlp1.gate_proj, mlp1.up_proj))) not in casts.ready


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_a_weight_sync_quantizes_its_fp8_weights_in_one_launch(forced_native, monkeypatch):
    """``make_payload`` (``weight_sync: quantized``) casts every FP8 128x128 rollout weight in one call
    of the batched quantizer (``weight_operands``), not one per weight: the operands are
    ``weight_operand``'s, bit for bit and in its layout; other weights go as they are."""
    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.kernels import layouts
    from jetrl_cli.precision import linear, parse_flow

    from .triton_interp_fix import fixed_fp8_conversion

    gemms = {g: {"backend": "triton"} for g in ("fprop", "dgrad", "wgrad")}
    flow = parse_flow({"base": "fp8-unified", "rollout": {"linear": {"backend": "triton"}}, "train": gemms},
                      source="<test>")
    assert flow.weight_sync.payload == "quantized"
    model = _model(seed=fresh_seed(), hidden=256, layers=2).to(TRITON_DEV)
    fp8 = gemm.triton_fp8_kernels()
    calls = collections.Counter()
    for name in ("quantize_weight", "quantize_weight_stacks"):
        real = getattr(fp8, name)
        monkeypatch.setattr(fp8, name, lambda *a, _r=real, _n=name, **k: calls.update([_n]) or _r(*a, **k))
    with fixed_fp8_conversion():
        payload = make_payload(model, flow)
        assert calls == {"quantize_weight_stacks": 1}
        quantized = 0
        for name, p in model.named_parameters():
            got = payload.tensors[name]
            if not isinstance(got, QTensor):
                assert got is not None and torch.equal(got, p.detach())
                continue
            quantized += 1
            want = linear.weight_operand(p, flow.rollout.linear)
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            assert got.scale.stride() == want.scale.stride() and torch.equal(got.scale, want.scale)
            assert torch.equal(layouts.scale_buffer(got), layouts.scale_buffer(want))
    assert quantized == 7 * 2  # q, k, v, o, gate, up, down of each layer
