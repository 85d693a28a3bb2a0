"""Fused elementwise chains (``precision.fuse``): on a GPU, RMSNorm, SwiGLU and RoPE (and their
backward passes) and the token logprobs' backward run through ``torch.compile``.

Checked on CPU with fusion forced on CPU tensors and the native (GPU) code path forced: dynamo traces
every fused function whole (``fullgraph``: a graph break would be an error, and fusion would stop),
for training (autograd) and decoding alike, and with the ``aot_eager`` backend (dynamo and
AOTAutograd, no code generation) a training step and a rollout are bit for bit the op-by-op ones;
a slow test compiles with Inductor itself. A compilation that fails turns fusion off and says why;
the CPU emulation and a batch-invariant forward never run fused.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jetrl_cli.engine.base import make_payload
from jetrl_cli.engine.embedded import EmbeddedEngine
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.live import backend_lines
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import apply_flow, fuse, named_flow, parse_flow
from jetrl_cli.rl.mismatch import reference_flow
from jetrl_cli.rl.trainer import Batch, token_logprobs

from .conftest import fresh_seed, triton_runs

ALL = ["add_rms_norm", "add_rms_norm_grads", "rms_norm", "rms_norm_grads", "rope", "split_rope_grad", "swiglu_grad",
       "swiglu_math", "vocab_slice_grad"]


def fused_in_a_step(flow: str) -> list[str]:
    """The fused functions a training step of ``flow`` runs: with FP8 saved activations
    (fp8-unified) the SwiGLU backward reads the FP8 copy of its input (dequantized in the kernel)."""
    if flow != "fp8-unified":
        return ALL
    return sorted(set(ALL) - {"swiglu_grad"} | {"swiglu_grad_fp8", "swiglu_math_fp8"})


@pytest.fixture
def native(forced_native):
    fuse.set_force(False)  # nothing compiled or reported yet (a GPU machine's tests fuse CUDA tensors)
    yield
    fuse.set_force(False)


def _model(seed=0):
    return random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=256), seed=seed, std=0.05)


def _step(flow_name, seed, entropy=False):
    """Token logprobs of a batch and the gradients of their sum, in the flow's training precision
    (``entropy``: the logprobs stacked with the entropies, and the gradients of their sum, the
    entropy bonus's backward)."""
    m = _model()
    apply_flow(m, reference_flow() if flow_name == "fp32" else named_flow(flow_name), "train")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (3, 24), generator=g)
    b = Batch.build(ids[:, :8].tolist(), ids[:, 8:].tolist(), [[0.0] * 16] * 3, [0.0] * 3, [0, 1, 2])
    lp = token_logprobs(m, b, SamplingParams(), entropy=entropy)
    (lp.sum() if not entropy else lp[0].sum() + 0.3 * lp[1].sum()).backward()
    return lp.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("flow, entropy", [("bf16", False), ("fp8-unified", False), ("bf16", True)])
def test_fused_training_step_is_the_op_by_op_one(native, flow, entropy):
    seed = fresh_seed()
    lp, grads = _step(flow, seed, entropy)
    assert fuse.report() is None  # CPU tensors: op by op unless forced
    fuse.set_force(True, "aot_eager")
    lp_f, grads_f = _step(flow, seed, entropy)
    assert fuse.report() == {"fused": fused_in_a_step(flow)}  # every function traced whole, forward and backward
    assert torch.equal(lp, lp_f), f"seed {seed}"
    assert grads.keys() == grads_f.keys() and all(torch.equal(grads[k], grads_f[k]) for k in grads), f"seed {seed}"


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified"])
def test_no_fused_function_runs_under_autograd(native, flow, monkeypatch):
    """Every fused chain of a training step runs inside a custom autograd function, where autograd is
    off: a compiled function called with autograd would keep for its backward what AOTAutograd's
    partitioner picks, which the op-by-op memory counts (docs/experiments) cannot see."""
    from jetrl_cli.models import llama

    calls = []

    def compile_(fn, **kwargs):  # torch.compile, standing in: notes each call's autograd state
        def run(*args):
            calls.append((fn.__name__, torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args)))
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", compile_)
    fuse.set_force(True, "eager")
    _step(flow, fresh_seed())
    assert {name.lstrip("_") for name, _ in calls} == set(fused_in_a_step(flow))
    assert [name for name, grad in calls if grad] == []
    x = torch.randn(1, 2, 3, 8, requires_grad=True)  # the check sees one that does
    llama._rope(x, torch.ones(3, 8), torch.zeros(3, 8), 1, torch.float32, torch.float32)
    assert calls[-1] == ("_rope", True)


@pytest.mark.parametrize("flow_name", ["bf16", "fp8-rollout"])
def test_fused_decoding_samples_what_op_by_op_decoding_samples(native, flow_name):
    """bf16: norms write the GEMMs' bf16 inputs and RoPE the bf16 queries and keys themselves;
    fp8-rollout: the quantizers read the norms' fp32 outputs."""
    _decode_op_by_op_and_fused(parse_flow(flow_name))
    assert fuse.report() == {"fused": ["add_rms_norm", "rms_norm", "rope", "swiglu_math"]}


def _decode_op_by_op_and_fused(flow, seed=3):
    """A rollout op by op, then with the fused functions (aot_eager): the same samples and logprobs."""
    model = _model(seed=seed)
    prompts = [[5, 9, 3], [7, 2, 11, 4, 8]]
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0)
    outs = []
    for force in (False, True):
        fuse.set_force(force, "aot_eager")
        eng = EmbeddedEngine(model, flow, 32, max_batch=4, cuda_graphs=False)
        eng.load_weights(make_payload(model, flow))
        outs.append([(c.tokens, c.logprobs) for g in eng.generate(prompts, params, seed=4) for c in g])
    assert outs[0] == outs[1]


class _Ops(TorchDispatchMode):
    """Counts the ops that launch a kernel on a GPU (views and allocations aside); a fused
    function counts as one."""

    FREE = {"view", "_unsafe_view", "reshape", "transpose", "t", "slice", "select", "expand", "as_strided",
            "detach", "alias", "unsqueeze", "squeeze", "permute", "split", "split_with_sizes", "unbind", "empty",
            "empty_strided", "promote_types"}  # (a dtype, computed on the host)

    def __init__(self):
        super().__init__()
        self.ops, self.inside = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        copied = not (name == "to" and out is args[0])
        if not self.inside and name not in self.FREE and copied:
            self.ops.append(name)
        return out

    def fused(self, fn, name: str | None = None):
        def run(*args, **kwargs):
            self.ops.append(name or fn.__name__)
            inside, self.inside = self.inside, True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside = inside
        return run


def test_a_bf16_decode_layer_is_eleven_kernels(native, monkeypatch):
    """What a captured decode step launches per decoder layer on a GPU (bf16, a model with qkv bias):
    residual+norm+cast (the previous layer's MLP output added), qkv GEMM with its bias, RoPE, two
    cache writes, attention, o_proj, residual+norm+cast, gate/up GEMM, SwiGLU, down GEMM. (Op by op
    it was 19, then 12 with the MLP's residual add of its own; each extra one is a launch per layer
    per token.)"""
    from jetrl_cli.models.llama import _add_rms_norm, _rms_norm, _rope
    from jetrl_cli.precision.linear import _swiglu_math

    counter = _Ops()
    fuse.set_force(True, "eager")
    for f in (_add_rms_norm, _rms_norm, _rope, _swiglu_math):
        monkeypatch.setitem(fuse._compiled, f.__wrapped__, counter.fused(f.__wrapped__))
    layer = _decode_layer_ops(named_flow("bf16"), counter)
    assert len(layer) == 11, layer


def _decode_layer_ops(flow, counter: "_Ops", device: str = "cpu", hidden: int = 128) -> list[str]:
    """The ops ``counter`` sees in one decoder layer's share of a decode step (models of 2 and 3 layers,
    on ``device``, the difference), after a first step that makes the cached operands and decides how
    attention reads the cache."""
    ops = {}
    for layers in (2, 3):
        model = random_model(tiny_config("qwen2", hidden=hidden, layers=layers, vocab=256), seed=1, std=0.05).to(device)
        eng = EmbeddedEngine(model, flow, 32, max_batch=4, cuda_graphs=False)
        eng.load_weights(make_payload(model, flow))
        m = eng.model
        cache = m.new_cache(2, 32)
        with torch.inference_mode():  # as the engine decodes
            m.prefill(torch.tensor([[5, 9, 3], [7, 2, 0]], device=device), torch.tensor([3, 2], device=device), cache)
            tokens = torch.tensor([4, 6], device=device)
            m.decode(tokens, cache, 16)
            counter.ops = []
            with counter:
                m.decode(tokens, cache, 16)
        ops[layers], counter.ops = counter.ops, []
    layer = list(ops[3])
    for op in ops[2]:
        layer.remove(op)
    return layer


@pytest.mark.slow  # 60 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
@pytest.mark.skipif(not triton_runs(), reason="needs Triton (and a GPU or TRITON_INTERPRET=1)")
def test_an_int8_decode_layer_is_twelve_kernels(native, monkeypatch):
    """An INT8 rollout's decode layer on the triton backend: bf16's eleven with the norms, the SwiGLU
    and the q/k/v GEMM's bias writing or taking INT8 operands in their own kernels, plus o_proj's
    input quantizer (16 before: a row quantizer before each GEMM and the bias added after q/k/v's)."""
    from jetrl_cli.kernels import attention, fp8, int8
    from jetrl_cli.models.llama import _add_rms_norm, _rms_norm, _rope
    from jetrl_cli.precision.linear import _swiglu_math

    counter = _Ops()
    fuse.set_force(True, "eager")
    for f in (_add_rms_norm, _rms_norm, _rope, _swiglu_math):
        monkeypatch.setitem(fuse._compiled, f.__wrapped__, counter.fused(f.__wrapped__))

    def counted(name, run):  # a Triton kernel launch counts as one
        def launch(*args, **kwargs):
            counter.ops.append(name)
            counter.inside = True
            try:
                return run(*args, **kwargs)
            finally:
                counter.inside = False
        return launch

    class Launch:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            return counted(self.name, self.kernel[grid])

    for name in ("_row_quant_kernel", "_int8_mm_kernel", "_int8_mm_split_kernel", "_int8_split_sum_kernel",
                 "_rms_norm_rows_kernel", "_swiglu_rows_kernel"):
        monkeypatch.setattr(int8, name, Launch(getattr(int8, name), name))
    # attention over the cache: SDPA's one op, or on a GPU where it is timed faster, the Triton kernel's launch
    monkeypatch.setattr(attention, "decode_attention", counted("decode_attention", attention.decode_attention))
    flow = parse_flow({"base": "int8-rollout", "rollout": {"linear": {"backend": "triton"}}}, source="<test>")
    # the Triton kernels run where Triton does: on a GPU machine CUDA tensors (the interpreter is not
    # on there), with every decode GEMM's K unsplit (a GPU times each shape's split at its first call;
    # a split GEMM is two launches)
    with fp8.split_k(1):
        layer = _decode_layer_ops(flow, counter, device="cuda" if torch.cuda.is_available() else "cpu")
    assert len(layer) == 12 and layer.count("_rms_norm_rows_kernel") == 2, layer
    assert layer.count("_swiglu_rows_kernel") == 1 and layer.count("_row_quant_kernel") == 1, layer
    assert layer.count("_int8_mm_kernel") + layer.count("_int8_split_sum_kernel") == 4 and "add" not in layer, layer


@pytest.mark.skipif(not triton_runs(), reason="needs Triton (and a GPU or TRITON_INTERPRET=1)")
@pytest.mark.slow  # 40-50 s each on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_a_batch_invariant_decode_layer_is_as_many_kernels_as_the_fast_one(native, flow_name, monkeypatch):
    """``precision.batch_invariant``'s decode layer (natively; here in Triton's interpreter), a model whose
    q/k/v and gate/up weights are whole 128-row blocks (one GEMM a group), whose SwiGLU halves are whole
    128-wide groups and whose heads are 128 wide (one group of o_proj's input each). bf16: the fast path's eleven -- the residual add with its norm, q/k/v's GEMM (its bias
    in the epilogue: no add after it), RoPE, two cache writes, attention, o_proj, add + norm, gate/up,
    SwiGLU, down, each the invariant kernel. FP8 (unified): the same with each norm and the SwiGLU the
    fused quantizer's kernel the fast path runs (one launch configuration whatever the rows), and
    attention writing o_proj's FP8 input itself: 11 (16 when the norms, the SwiGLU and attention wrote
    their outputs for a quantizer of their own, and q/k/v's bias was added after its GEMM)."""
    from jetrl_cli.kernels import fp8, invariant

    counter = _Ops()
    monkeypatch.setattr(fuse, "_force_exact", True)  # the GPU's elementwise kernels for CPU tensors too
    for name in ("invariant_mm", "invariant_blockwise_mm", "invariant_attention", "invariant_rms_norm",
                 "invariant_add_rms_norm", "exact_rope", "exact_swiglu"):
        monkeypatch.setattr(invariant, name, counter.fused(getattr(invariant, name), name))
    for name in ("rms_norm_quantize", "swiglu_quantize", "quantize_act"):
        monkeypatch.setattr(fp8, name, counter.fused(getattr(fp8, name), name))
    from .triton_interp_fix import fixed_fp8_conversion

    with fixed_fp8_conversion():  # on a GPU machine CUDA tensors (the interpreter is not on there)
        layer = sorted(_decode_layer_ops(parse_flow({"base": flow_name, "batch_invariant": True}, source="<test>"),
                                         counter, device="cuda" if torch.cuda.is_available() else "cpu", hidden=512))
    common = ["exact_rope", "index_copy_", "index_copy_", "invariant_attention"]
    if flow_name == "bf16":
        want = common + ["exact_swiglu"] + ["invariant_add_rms_norm"] * 2 + ["invariant_mm"] * 4
    else:
        want = common + ["invariant_blockwise_mm"] * 4 + ["rms_norm_quantize"] * 2 + ["swiglu_quantize"]
    assert layer == sorted(want), layer


def test_a_failed_compilation_runs_op_by_op_and_says_why(native):
    def broken(gm, example_inputs):
        raise RuntimeError("no C compiler here")

    seed = fresh_seed()
    lp, _ = _step("bf16", seed)
    fuse.set_force(True, broken)
    lp_f, _ = _step("bf16", seed)
    assert torch.equal(lp, lp_f)
    why = fuse.report()["disabled"]
    name, _, rest = why.partition(": ")  # the first function compiled (the first layer's norm) and why
    assert name in ALL and rest.startswith("BackendCompilerFailed") and "no C compiler here" in why, why
    assert backend_lines({"resolved": [], "fallbacks": [], "fused": fuse.report()}) == [f"fusion off, eager: {why}"]


def test_fused_decoding_from_an_fp8_kv_cache_samples_what_op_by_op_decoding_samples(native, monkeypatch):
    """Where attention cannot read an FP8 cache as stored (no Triton kernel: a CPU-only native run),
    its keys and values, times their scales, cast to what attention reads: one fused function with
    the op-by-op bits."""
    from jetrl_cli.models import llama

    monkeypatch.setattr(llama, "_reads_cache_as_stored", lambda *a: False)
    _decode_op_by_op_and_fused(parse_flow({"base": "bf16", "rollout": {"kv_cache": "fp8_e4m3 row"}}, source="<test>"), 5)
    assert "kv_values" in fuse.report()["fused"]


def _rl_variants(flow_name):
    """One flow's calls of the fused functions in an RL step: prefill and decode under inference mode,
    batches shrinking to one row, a one-prompt rollout, a training step and a no-grad scoring of
    one sequence (each None-ness, dtype, grad mode and size-1 dimension is its own compilation)."""
    model = _model(seed=3)
    flow = parse_flow(flow_name)
    eng = EmbeddedEngine(model, flow, 64, max_batch=8, cuda_graphs=False)
    eng.load_weights(make_payload(model, flow))
    done = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, stop_token_ids=[3, 7, 9])
    eng.generate([[5, 9, 3], [7, 2, 11, 4, 8]], done, seed=4)
    eng.generate([[5, 9, 3]], SamplingParams(n=1, max_new_tokens=4), seed=4)
    _step(flow_name, 0)
    m = _model()
    apply_flow(m, named_flow(flow_name), "train")
    ids = torch.randint(1, 256, (1, 24))
    with torch.no_grad():
        token_logprobs(m, Batch.build(ids[:, :8].tolist(), ids[:, 8:].tolist(), [[0.0] * 16], [0.0], [0]),
                       SamplingParams())


def test_an_rl_step_compiles_every_variant_it_needs(native):
    """12 variants of add_rms_norm in one flow's RL step (bf16), more with several flows in one
    process: over dynamo's default limit of 8, which with fullgraph=True is an error that turned
    fusion off for the whole process before the limit was raised."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from jetrl_cli.models import llama

    fuse.set_force(True, "aot_eager")
    for flow_name in ("bf16", "fp8-rollout"):
        _rl_variants(flow_name)
    assert len(_debug_get_cache_entry_list(llama._add_rms_norm.__wrapped__.__code__)) > 8
    assert fuse.report() == {"fused": ALL}


def test_a_variant_past_the_recompile_limit_runs_eagerly(native, monkeypatch):
    """Past the limit, that call runs op by op and is reported; fusion stays on for the rest."""
    monkeypatch.setattr(fuse, "RECOMPILE_LIMIT", 2)
    with torch._dynamo.config.patch(recompile_limit=2):
        _decode_op_by_op_and_fused(parse_flow("bf16"))
    rep = fuse.report()
    assert "add_rms_norm" in rep["fused"] and "add_rms_norm" in rep["eager_variants"]
    line = backend_lines({"resolved": [], "fallbacks": [], "fused": rep})[0]
    assert line.startswith("fused (torch.compile): ") and "eager past the recompile limit: add_rms_norm" in line


def test_batch_invariant_forward_runs_op_by_op(native, monkeypatch):
    """A batch-invariant model's forward is not fused (a compiled forward and the trainer's autograd
    twin need not round alike): op by op, RoPE and SwiGLU as one kernel each whose operations are the
    op-by-op ones (``EXACT``; forced here for CPU tensors, in Triton's interpreter); its backward may be
    fused."""
    monkeypatch.setattr(fuse, "_force_exact", True)
    fuse.set_force(True, "aot_eager")
    # the batch-invariant ops are Triton kernels: on the GPU where there is one, else CPU tensors in
    # Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = _model().to(dev)
    apply_flow(m, parse_flow({"base": "bf16", "batch_invariant": True}, source="<test>"), "train")
    assert m.batch_invariant
    ids = torch.randint(1, 256, (2, 12)).to(dev)
    with torch.no_grad():
        m.hidden(ids)
    assert fuse.report() == {"exact": ["rope", "swiglu_math"]}
    m.hidden(ids).sum().backward()
    # the residual adds' norms: the invariant kernel forward (add, norm and cast), one function backward
    assert fuse.report() == {"fused": ["add_rms_norm_grads", "rms_norm_grads", "split_rope_grad", "swiglu_grad"],
                             "exact": ["rope", "swiglu_math"]}


def test_report_lines():
    assert backend_lines({"resolved": [], "fallbacks": [], "fused": {"fused": ["rms_norm", "swiglu_math"]}}) == [
        "fused (torch.compile): rms_norm, swiglu_math"]
    assert backend_lines({"resolved": [], "fallbacks": [], "fused": {"exact": ["rope", "swiglu_math"]}}) == [
        "batch-invariant forward, one kernel op by op: rope, swiglu_math"]
    assert backend_lines({"resolved": [], "fallbacks": []}) == []


@pytest.mark.slow
def test_inductor_compiles_every_fused_function(native):
    """Inductor itself (C++ on CPU; Triton on a GPU) compiles the same functions, and a training step
    agrees with the op-by-op one. Not bit for bit: a fused kernel may contract a * b + c into one
    FMA, and a last-bit difference can move a value across a rounding boundary of the flow's
    formats (bf16: 2^-8 relative, E4M3: 2^-3), which the next layers carry on; so agreement is
    checked at the scale of each flow's coarsest format. A wrong kernel would be off by O(1)."""
    seed = fresh_seed()
    for flow, tol in (("fp32", 1e-3), ("bf16", 2**-4), ("fp8-unified", 0.25)):
        fuse.set_force(False)
        lp, grads = _step(flow, seed)
        fuse.set_force(True, "inductor")
        lp_f, grads_f = _step(flow, seed)
        assert fuse.report() == {"fused": fused_in_a_step(flow)}
        assert (lp - lp_f).abs().max() <= tol, (flow, seed)
        for k in grads:
            assert (grads[k] - grads_f[k]).norm() <= tol * grads[k].norm(), (flow, k, seed)


@pytest.mark.slow
def test_inductor_compiles_the_decoding_functions(native):
    """The rollout's fused functions (residual + norm + cast, RoPE writing bf16) through Inductor:
    a no-grad forward agrees with the op-by-op one at bf16's scale."""
    seed = fresh_seed()
    ids = torch.randint(1, 256, (3, 20), generator=torch.Generator().manual_seed(seed))
    outs = []
    for force in (False, True):
        fuse.set_force(force, "inductor")
        m = _model()
        apply_flow(m, named_flow("bf16"), "rollout")
        with torch.inference_mode():
            outs.append(m(ids))
    assert fuse.report() == {"fused": ["add_rms_norm", "rms_norm", "rope", "swiglu_math"]}
    assert (outs[0] - outs[1]).abs().max() <= 2**-4 * outs[0].abs().max(), seed


def test_only_the_sizes_that_change_are_symbols_in_a_fused_kernel(native):
    """A fused function meets its first sizes as constants, and once a size changes it is compiled
    again with that dimension alone symbolic: feature sizes (heads, head_dim) stay constants, so a
    kernel's index arithmetic divides by constants (with every size a symbol, the H200's fused RoPE
    backward ran at 3% of its bandwidth). Read from the graphs dynamo hands the backend."""
    from jetrl_cli.models.llama import _split_rope_grad

    graphs = []

    def recording(gm, example_inputs):
        vals = (n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder")
        graphs.append([tuple(v.shape) for v in vals if isinstance(v, torch.Tensor)])
        return gm.forward

    fuse.set_force(True, recording)
    g = torch.Generator().manual_seed(fresh_seed())
    h, hk, d = 4, 2, 16
    cos = torch.randn(1, 1, 64, d, generator=g)
    outs = []
    for b, t in ((2, 12), (3, 20), (4, 9)):  # batch rows and tokens change; heads and head_dim do not
        gq, gk, gv = (torch.randn(b, n, t, d, generator=g) for n in (h, hk, hk))
        c = cos[:, :, :t].expand(b, 1, t, d)
        outs.append(_split_rope_grad(gq, gk, gv, c, -c, torch.float32))
        want = _split_rope_grad.__wrapped__(gq, gk, gv, c, -c, torch.float32)
        assert torch.equal(outs[-1], want)  # the backend here runs the traced graph: the same ops
    assert len(graphs) == 2, graphs  # static, then dynamic in the sizes that changed; the third reuses it
    static, dynamic = graphs
    assert (2, h, 12, d) in static, static
    for shape in dynamic:
        consts = [x for x in shape if isinstance(x, int)]
        assert d in consts, shape  # head_dim a constant in every input
    assert any(h in [x for x in s if isinstance(x, int)] for s in dynamic), dynamic  # and the queries' heads
    assert any(not isinstance(x, int) for s in dynamic for x in s), dynamic  # tokens (and rows) symbolic
    fuse.set_force(False)
