"""The GPU engine's decode path on CPU: one KV cache buffer compacted in place, decode steps
replayed from captured graphs, weights refreshed in place at each sync.

CUDA graphs cannot be captured on CPU; ``FakeGraphs`` stands in for torch.cuda's capture API with
the same contract (capturing runs nothing; capture returns the step's output tensor, and each
replay recomputes the step and writes its result into that tensor). The engine's plumbing around it -- static buffers,
graph keys, bucketing, the eager check of every new graph, the fallback -- is what runs here, and
its samples must be exactly the plain engine's. The real capture is exercised by the ``gpu`` test.
"""

import contextlib
import copy

import pytest
import torch

from jetrl_cli.engine.base import make_payload
from jetrl_cli.engine.embedded import EmbeddedEngine, compaction
from jetrl_cli.engine.graphs import DecodeGraphs
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import named_flow, parse_flow

SEED = 77


class FakeGraph:
    def __init__(self):
        self.fn = self.out = None
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())


class FakeGraphs:
    """torch.cuda's capture API, emulated: record() runs nothing the state keeps (lengths are put
    back), and replay() recomputes into the recorded output tensor."""

    def __init__(self, break_after: int | None = None):
        self.graphs = []
        self.break_after = break_after

    def pool(self):
        return object()

    def prepare(self):
        pass

    def warmup(self, fn):
        return fn()

    def new_graph(self):
        g = FakeGraph()
        self.graphs.append(g)
        return g

    def record(self, graph, pool, fn):
        if self.break_after is not None and len(self.graphs) > self.break_after:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph.fn = fn
        snap = _lengths_of(fn)
        before = snap.clone()
        graph.out = fn()  # the tensor the step writes its output into, as a capture returns it
        snap.copy_(before)  # capturing leaves the state as it was
        return graph.out


def _lengths_of(fn):
    for cell in fn.__closure__:
        obj = cell.cell_contents
        if hasattr(obj, "lengths") and hasattr(obj, "kv"):
            return obj.lengths
    raise AssertionError("the captured closure holds no cache")


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=256), seed=SEED, std=0.05)


def _engine(model, flow, graphs=None, static=True):
    eng = EmbeddedEngine(model, flow, 64, max_batch=32, cuda_graphs=False)
    eng.static = static
    if graphs is not None:
        eng.graphs = DecodeGraphs(eng.model, graph_api=graphs)
    eng.load_weights(make_payload(model, flow))
    return eng


def _prompts(n=6):
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(1, 256, (int(k),), generator=g).tolist() for k in torch.randint(2, 14, (n,), generator=g)]


def _samples(eng, sp, seed=3):
    return [[(c.tokens, c.logprobs, c.finish_reason) for c in gr] for gr in eng.generate(_prompts(), sp, seed)]


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified",  # the interpreted kernel: ~75 s
                                  pytest.param("fp8 KV cache read as stored", marks=pytest.mark.slow)])
def test_static_cache_and_replayed_graphs_sample_what_the_plain_engine_samples(model, flow, request):
    if flow == "fp8 KV cache read as stored":  # natively: decode attention reads the cache's FP8 bytes and scales
        if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs a GPU or TRITON_INTERPRET=1")
        request.getfixturevalue("forced_native")
        model = copy.deepcopy(model).to("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter
        f = parse_flow({"base": "bf16", "rollout": {"kv_cache": "fp8_e4m3 row"}, "unified": True}, source="<test>")
    else:
        f = named_flow(flow)
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, n=4, stop_token_ids=tuple(range(0, 256, 11)))
    plain = _samples(_engine(model, f, static=False), sp)
    fake = FakeGraphs()
    eng = _engine(model, f, graphs=fake)
    eng.check_every = 8
    got = _samples(eng, sp)
    assert got == plain
    assert eng.graphs.disabled is None and eng.graphs.captures >= 2
    assert sum(g.replays for g in fake.graphs) > eng.graphs.captures  # graphs were reused, not just captured
    widths = {key[1] for key in eng.graphs.graphs}
    assert widths <= {64} and {key[0] for key in eng.graphs.graphs} <= {24, 16, 8, 4}  # bucketed
    # a second rollout in the same buffers replays the graphs captured by the first
    n = eng.graphs.captures
    assert _samples(eng, sp) == plain and eng.graphs.captures == n


def test_graphs_of_one_batch_size_share_one_logits_buffer(model, monkeypatch):
    """A captured graph's output stays allocated as long as the graph: one buffer per batch size
    keeps that to a few batch x vocabulary buffers, however many widths are captured."""
    from jetrl_cli.engine import graphs

    monkeypatch.setattr(graphs, "WIDTH_BUCKET", 16)
    f = named_flow("bf16")
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, n=4, stop_token_ids=tuple(range(0, 256, 11)))
    plain = _samples(_engine(model, f, static=False), sp)
    fake = FakeGraphs()
    eng = _engine(model, f, graphs=fake)
    assert _samples(eng, sp) == plain
    keys = list(eng.graphs.graphs)
    sizes = {k[0] for k in keys}
    assert len({k[1] for k in keys}) >= 3 and len(keys) > len(sizes)  # several widths per batch size
    for b in sizes:
        outs = {eng.graphs.graphs[k].logits.data_ptr() for k in keys if k[0] == b}
        assert outs == {eng.graphs.outputs[b].data_ptr()}, b


def test_a_rebuilt_rope_table_is_captured_again(model):
    """Past max_position_embeddings the model rebuilds its RoPE table larger; a graph captured on
    the old table must not be replayed (it would read freed memory on a GPU)."""
    f = named_flow("bf16")
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, n=2)
    eng = _engine(model, f, graphs=FakeGraphs())
    first = _samples(eng, sp)
    n = eng.graphs.captures
    cos, sin = eng.model._rope
    eng.model._rope = (cos.clone(), sin.clone())  # what a rebuild does: a new table, same values
    assert _samples(eng, sp) == first and eng.graphs.captures > n


def test_a_sync_refreshes_weights_in_place_and_the_graphs_stay_valid(model):
    f = named_flow("fp8-unified")
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, n=2)
    eng = _engine(model, f, graphs=FakeGraphs())
    _samples(eng, sp)
    n = eng.graphs.captures
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.mul_(1.01)
    eng.load_weights(make_payload(moved, f, version=2))
    fresh = _engine(moved, f, static=False)
    assert _samples(eng, sp) == _samples(fresh, sp)  # the new weights, through the old graphs
    assert eng.graphs.captures == n and eng.graphs.graphs


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified"])
def test_a_sync_after_a_rollout_that_built_the_cached_operands(model, flow):
    """An engine that rolls out before its first sync builds its GEMM operands inside ``generate``'s
    inference mode; the sync then writes into them (``jetrl bench rollout``'s task rows did this, and
    on a GPU stopped with "Inplace update to inference tensor outside InferenceMode")."""
    f = named_flow(flow)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, n=2)
    eng = EmbeddedEngine(model, f, 64, max_batch=32, cuda_graphs=False)
    eng.static = True
    _samples(eng, sp)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.mul_(1.01)
    eng.load_weights(make_payload(moved, f, version=2))
    assert _samples(eng, sp) == _samples(_engine(moved, f, static=False), sp)
    assert eng.weights_version == 2


def test_a_sync_that_replaces_weight_operands_drops_the_graphs(model):
    """Graphs captured before the first sync read the operands the rollout built from the master
    weights; the sync replaces them (the engine then holds the synced FP8 weights once), so those
    graphs must be captured again, even though the layers' group caches are rebuilt in the same call."""
    f = named_flow("fp8-unified")
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, n=2)
    eng = EmbeddedEngine(model, f, 64, max_batch=32, cuda_graphs=False)
    eng.static = True
    eng.graphs = DecodeGraphs(eng.model, graph_api=FakeGraphs())
    _samples(eng, sp)
    assert eng.graphs.graphs
    eng.load_weights(make_payload(model, f, version=2))
    assert not eng.graphs.graphs  # dropped: captured again at the next rollout
    assert _samples(eng, sp) == _samples(_engine(model, f, static=False), sp)


def test_a_graph_that_cannot_be_captured_falls_back_to_eager_and_says_why(model):
    f = named_flow("bf16")
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, n=2)
    plain = _samples(_engine(model, f, static=False), sp)
    eng = _engine(model, f, graphs=FakeGraphs(break_after=0))
    assert _samples(eng, sp) == plain
    assert eng.graphs.disabled.startswith("capture failed: RuntimeError: operation not permitted")


def test_the_warm_up_and_the_capture_run_on_one_side_stream(monkeypatch):
    """torch's recipe for CUDA graphs: the eager warm-up runs on a side stream, ordered after the
    current stream's work and before its next (each waits for the other), and the capture uses that
    same stream -- so what is lazily set up per stream (a cuBLAS workspace) exists before capturing.
    torch.cuda is stood in: this checks the order of calls, not a GPU."""
    from jetrl_cli.engine import graphs as graphs_mod

    log, streams = [], []

    class Stream:
        def __init__(self, name=None):
            self.name = name or f"side{len(streams)}"
            streams.append(self)

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    main = Stream("main")

    @contextlib.contextmanager
    def on(stream):
        log.append(f"on {stream.name}")
        yield
        log.append(f"off {stream.name}")

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        log.append(f"capture on {stream.name}")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    api = graphs_mod._CudaGraphAPI()
    assert api.warmup(lambda: log.append("step") or 7) == 7
    api.record(object(), None, lambda: log.append("captured step"))
    api.warmup(lambda: log.append("step"))
    assert log == ["side1 waits main", "on side1", "step", "off side1", "main waits side1",
                   "capture on side1", "captured step",
                   "side1 waits main", "on side1", "step", "off side1", "main waits side1"]


def _cached_bytes(mod) -> int:
    from jetrl_cli.precision.gemm import ExactOperand

    items = [getattr(mod, "_wfixed", None), *(v[1] for v in getattr(mod, "_cache", {}).values()),
             *(mod.__dict__.get("_jet_group_cache") or (None, None, None))[1:]]
    seen = {}
    for x in items:
        for t in ([x.values, x.scales] if isinstance(x, ExactOperand) else [x]):
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() != mod.weight.data_ptr():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.slow  # 11 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_an_fp8_engine_holds_its_weights_once(model):
    """The GPU engine keeps only the FP8 weights of its quantized layers (master copies freed, fused
    layers viewing their group's stacked operand): about half of a bf16 engine's weight bytes. The
    Triton backend stacks QTensors as a GPU backend does (run here in Triton's interpreter)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from tests.triton_interp_fix import fixed_fp8_conversion

    cfg = tiny_config("qwen2", hidden=256, layers=2, vocab=256)
    m = random_model(cfg, seed=1).to("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter
    tri = {"base": "fp8-unified", "rollout": {"linear": {"input": "fp8_e4m3 1x128", "weight": "fp8_e4m3 128x128",
                                                       "out": "bf16", "backend": "triton"}},
           "train": {"fprop": {"input": "fp8_e4m3 1x128", "weight": "fp8_e4m3 128x128", "out": "bf16",
                               "backend": "triton"}}}
    with fixed_fp8_conversion():
        eng = _engine(m, parse_flow(tri, source="<test>"))
        quantized = [x for n, x in eng.model.named_modules() if n.endswith("_proj")]
        assert quantized and all(x.weight.numel() == 0 for x in quantized)  # master copies freed
        linear = sum(p.numel() for n, p in m.named_parameters() if n.endswith("proj.weight"))
        others = sum(p.numel() * 4 for n, p in m.named_parameters() if not n.endswith("proj.weight"))
        lm_head_cache = _cached_bytes(eng.model.lm_head)  # the skipped lm_head's CPU operands (bf16 values)
        assert lm_head_cache <= m.lm_head.weight.numel() * (4 + 8) * 1.01  # fp32 copy + exact float64 operand
        # one byte per quantized weight, plus scales (one fp32 per 128x128 block): held once
        assert eng.weight_nbytes() - others - lm_head_cache <= linear * 1.01
        out = eng.generate(_prompts(2), SamplingParams(max_new_tokens=4, n=2), 1)
        assert all(len(c.tokens) == 4 for gr in out for c in gr)
        held = eng.weight_nbytes()
        for version in (2, 3):  # later syncs write into the held operands: still held once
            eng.load_weights(make_payload(m, eng.flow, version=version))
        assert eng.weight_nbytes() == held


def test_a_bf16_engine_holds_its_bf16_weights_once(model, forced_native):
    """On a GPU (the native path, forced here) a bf16 engine's linear layers keep only their bf16
    weights, as an 8-bit layer keeps its quantized one: no fp32 master copy beside them (at
    Qwen2.5-1.5B that copy was 5.2 GB of a colocated run's memory), fused layers viewing their
    group's stacked weight. It samples exactly what an engine keeping the master copies samples,
    and later syncs write into the held weights."""
    flow = named_flow("bf16")
    sp = SamplingParams(max_new_tokens=6, n=2)
    eng = _engine(model, flow)
    projs = [x for n, x in eng.model.named_modules() if n.endswith("_proj")]
    assert projs and all(x.weight.numel() == 0 and x._wfixed.dtype is torch.bfloat16 for x in projs)
    a = eng.model.model.layers[0].self_attn
    stacked = a.__dict__["_jet_group_cache"][1]
    assert all(x._wfixed.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
               for x in (a.q_proj, a.k_proj, a.v_proj))
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    others = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.endswith("proj.weight"))
    lm_head = model.lm_head.weight.numel() * 2  # tied to the embedding: its bf16 cast beside the fp32 table
    assert eng.weight_nbytes() <= others + lm_head + linear * 2 + 4096  # biases (bf16 copies) aside
    _samples_as_an_engine_keeping_masters(model, flow, eng, sp, linear)
    assert stacked.untyped_storage().data_ptr() == a.__dict__["_jet_group_cache"][1].untyped_storage().data_ptr()


def _samples_as_an_engine_keeping_masters(model, flow, eng, sp, linear: int) -> None:
    """``eng`` (a GPU engine holding its GEMM operands only) takes ``linear`` x 4 bytes fewer than an
    engine keeping the fp32 master copies, samples what that one samples, and after two more syncs
    of new weights (written into the held operands: its bytes unchanged) still does."""
    held = eng.weight_nbytes()
    kept = EmbeddedEngine(model, flow, 64, max_batch=32, cuda_graphs=False)
    kept.static = True
    kept._holds_operand = lambda *a: False  # the engine as it was: master copies kept
    kept.load_weights(make_payload(model, flow))
    assert kept.weight_nbytes() >= held + linear * 4  # the master copies it frees
    assert _samples(eng, sp) == _samples(kept, sp)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    for version in (2, 3):
        eng.load_weights(make_payload(trained, flow, version=version))
        kept.load_weights(make_payload(trained, flow, version=version))
    assert eng.weight_nbytes() == held
    assert _samples(eng, sp) == _samples(kept, sp)


@pytest.mark.parametrize("flow_name", ["fp8-rollout", "int8-rollout"])
def test_an_8bit_engine_quantizes_a_full_precision_sync_once_and_holds_only_that(model, forced_native, flow_name):
    """A ``weight_sync: hp`` flow with an 8-bit rollout (fp8-rollout, int8-rollout) sends full
    weights; a GPU engine (forced native here) quantizes each linear weight once at the sync and
    keeps only that operand, its master copy freed (the first H100 run: the FP8 engine held 7.6 GB
    of weights, the bf16 one 3.8). It samples what an engine keeping the master copies samples, and
    later syncs write into the held operands."""
    from jetrl_cli.precision.quant import QTensor

    flow = named_flow(flow_name)
    assert flow.weight_sync.payload == "hp"
    sp = SamplingParams(max_new_tokens=6, n=2)
    eng = _engine(model, flow)
    projs = [x for n, x in eng.model.named_modules() if n.endswith("_proj")]
    assert projs and all(x.weight.numel() == 0 and isinstance(x._wfixed, QTensor) for x in projs)
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    _samples_as_an_engine_keeping_masters(model, flow, eng, sp, linear)


def test_power_of_two_compaction():
    rows = [0, -1, 2, -1, -1, 5, 6, -1, 8, 9, -1, -1, 12, 13, 14, -1, -1, -1, 18, 19, 20, -1, -1, 23]
    live = sum(r >= 0 for r in rows)  # 13 of 24
    keep = compaction(rows, live, pow2=True)
    assert len(keep) == 16 and sum(rows[i] >= 0 for i in keep) == live  # every live row kept, padded to 16
    assert compaction(rows, live) is not None and len(compaction(rows, live)) == 16  # 13 -> 16 either way
    assert compaction(rows[:16], 15, pow2=True) is None  # too few finished to pay a copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("flow", ["bf16", "fp8-unified", "fp8-unified+fp8kv"])
def test_real_cuda_graphs_sample_what_eager_decoding_samples(flow):
    base, _, kv = flow.partition("+")
    f = parse_flow({"base": base, "rollout": {"kv_cache": "fp8_e4m3 row"}}, source="<test>") if kv else named_flow(flow)
    m = random_model(tiny_config("qwen2", hidden=256, layers=2, vocab=512), seed=SEED, std=0.05).cuda()
    sp = SamplingParams(max_new_tokens=48, temperature=1.0, n=4, stop_token_ids=tuple(range(0, 512, 13)))
    runs = {}
    for graphs in (False, True):
        eng = EmbeddedEngine(m, f, 64, max_batch=32, cuda_graphs=graphs)
        eng.load_weights(make_payload(m, f))
        runs[graphs] = (_samples(eng, sp), eng.graphs)
    assert runs[True][1].disabled is None, runs[True][1].disabled
    assert runs[True][1].captures >= 1
    # the same kernels in the same order: the same samples (both non-invariant, but identically so)
    assert runs[True][0] == runs[False][0]
    if kv:  # the FP8 cache was read as stored, inside the graphs
        from jetrl_cli.models.llama import KV_READ
        from jetrl_cli.precision.gemm import kernel_choice

        assert kernel_choice(KV_READ, torch.device("cuda", torch.cuda.current_device()))["kernel"].startswith("triton")


def test_no_capture_stream_means_eager_decoding_said_why(model):
    """Where the capture's side stream cannot be made (no usable driver), the engine decodes eagerly
    with the reason kept, as for a failed capture."""
    class NoStream(FakeGraphs):
        def prepare(self):
            raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    f = named_flow("bf16")
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, n=2)
    eng = _engine(model, f, graphs=NoStream())
    assert _samples(eng, sp) == _samples(_engine(model, f, static=False), sp)
    assert eng.graphs.disabled == "capture failed: RuntimeError: CUDA driver version is insufficient for CUDA runtime version"
    assert eng.graphs.captures == 0


def test_a_capture_gets_its_own_cublas_workspace_inside_the_graph_pool(monkeypatch):
    """``_CudaGraphAPI.record`` drops torch's cuBLAS workspaces right before the capture (so the
    captured GEMMs allocate theirs inside the graph's pool, which lives as long as the graph) and
    right after it (so eager GEMMs never use pool memory), also when the capture fails: a workspace
    from the eager warm-up, captured by address, was freed by ``torch.compile``'s CUDA graphs
    (``transformers``' static-cache ``generate()``) and then released by the next engine's capture,
    and the first engine's replay hit an illegal memory access on an H100."""
    from jetrl_cli.engine import graphs as graphs_mod

    events = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: events.append("clear"), raising=False)

    @contextlib.contextmanager
    def capture(graph, pool=None, stream=None):
        events.append(("capture", graph, pool, stream))
        yield
        events.append("captured")

    monkeypatch.setattr(torch.cuda, "graph", capture)
    api = graphs_mod._CudaGraphAPI()
    api.stream = "side stream"
    assert api.record("g", "pool", lambda: events.append("step") or "logits") == "logits"
    assert events == ["clear", ("capture", "g", "pool", "side stream"), "step", "captured", "clear"]
    events.clear()
    with pytest.raises(RuntimeError, match="not permitted"):
        api.record("g", "pool", lambda: (_ for _ in ()).throw(RuntimeError("operation not permitted")))
    assert events[0] == "clear" and events[-1] == "clear"


REPLAY_AFTER_WORKSPACES_FREED = r"""
import torch
from jetrl_cli.engine.base import make_payload
from jetrl_cli.engine.embedded import EmbeddedEngine
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import named_flow

f = named_flow("bf16")
m = random_model(tiny_config("qwen2", hidden=512, layers=2, vocab=4096), seed=5, std=0.05).cuda()
sp = SamplingParams(max_new_tokens=40, temperature=1.0, n=4)
prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
eager = EmbeddedEngine(m, f, 64, max_batch=32, cuda_graphs=False)
eager.load_weights(make_payload(m, f))
want = [[c.tokens for c in g] for g in eager.generate(prompts, sp, 11)]
a = EmbeddedEngine(m, f, 64, max_batch=32, cuda_graphs=True)
a.load_weights(make_payload(m, f))
assert [[c.tokens for c in g] for g in a.generate(prompts, sp, 11)] == want  # a's graphs captured
torch._C._cuda_clearCublasWorkspaces()  # what torch.compile's CUDA graphs do at each recording
b = EmbeddedEngine(m, f, 64, max_batch=32, cuda_graphs=True)  # its capture calls empty_cache()
b.load_weights(make_payload(m, f))
b.generate(prompts, sp, 11)
junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(64)]  # reuse freed memory
got = [[c.tokens for c in g] for g in a.generate(prompts, sp, 11)]  # a's graphs replayed
torch.cuda.synchronize()
assert a.graphs.disabled is None and a.graphs.captures >= 1, a.graphs.disabled
assert got == want, "a replayed graph sampled other tokens"
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_replay_after_torch_compile_frees_the_cublas_workspaces(tmp_path):
    """The H100 crash, reduced: engine a captures its decode graphs; cuBLAS workspaces are freed (as
    ``torch.compile``'s CUDA graphs free them); engine b captures (``empty_cache``) and memory is
    reallocated; a's replays must still sample the eager tokens. In a subprocess: an illegal memory
    access kills the CUDA context."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", REPLAY_AFTER_WORKSPACES_FREED], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
