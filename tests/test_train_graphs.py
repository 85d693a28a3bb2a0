"""``train.cuda_graphs``: the decoder layers replayed as CUDA graphs in the trainer's updates
(``rl.train_graphs``). On CPU through a stand-in for the capture API whose "capture" runs the function
once with no effect on the gradients (as a capture runs nothing) and whose replay runs it again,
writing into the tensors the capture returned (as a replay rewrites them); on a GPU for real."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from jetrl_cli.config import TrainConfig
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import JetLinear, named_flow
from jetrl_cli.precision.linear import _release_weights
from jetrl_cli.rl import train_graphs
from jetrl_cli.rl.algos import CorrectionConfig
from jetrl_cli.rl.trainer import Batch, Trainer
from jetrl_cli.rl.train_graphs import TrunkGraphs

from .conftest import fresh_seed


class _Graph:
    def __init__(self, api):
        self.api, self.fn, self.out = api, None, None
        self.forward = False

    def replay(self):
        self.api.replays += 1
        if self.forward:  # a real forward graph holds the weights' quantization (its capture began with none
            for mods, owner in self.api.groups():  # cached: checked in record): each replay runs it again
                _release_weights(mods, owner)
        with torch.set_grad_enabled(self.grad):  # as captured (inside an autograd node's forward it is off)
            new = self.fn()
        if self.api.perturb and isinstance(new, tuple):
            new = (new[0] + 1e-3, *new[1:])
        for dst, src in zip(_leaves(self.out), _leaves(new)):
            dst.copy_(src)


def _leaves(t):  # (None: a backward with no input gradient, LoRA's frozen embedding's)
    return [] if t is None else [t] if isinstance(t, torch.Tensor) else [x for x in t if x is not None]


class StandIn:
    """The capture API of ``engine.graphs._CudaGraphAPI``, on CPU."""

    on_cpu = True

    def __init__(self, model, fail_at: int | None = None, perturb: bool = False, capturing: list | None = None):
        self.model, self.fail_at, self.perturb = model, fail_at, perturb
        self.capturing = capturing  # appended to while a capture runs (what a stream reports)
        self.records = self.replays = 0
        self.backwards_next = 0  # backward captures still to follow the last forward's

    def prepare(self):
        pass

    def groups(self):
        return [g for g in self.model.linear_groups() if g[1] is not self.model.lm_head]

    def pool(self):
        return object()

    def new_graph(self):
        return _Graph(self)

    def warmup(self, fn):
        return fn()

    def record(self, graph, pool, fn):
        self.records += 1
        if self.fail_at == self.records:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        if not self.backwards_next:  # a forward: it must quantize every trained layer's weights itself (none
            # cached; frozen layers, LoRA's base, keep the operands they hold)
            trained = [(mods, o) for mods, o in self.groups() if any(m.weight.requires_grad for m in mods)]
            assert not [o for mods, o in trained if o.__dict__.get("_jet_group_cache") or any(m._cache for m in mods)]
            graph.forward = True
            # with autograd a backward capture follows the forward's; a scoring forward is captured alone
            self.backwards_next = 1 if torch.is_grad_enabled() else 0
        else:
            self.backwards_next -= 1
        params = [p for p in self.model.parameters() if p.requires_grad]
        before = [None if p.grad is None else p.grad.clone() for p in params]
        if self.capturing is not None:
            self.capturing.append(True)
        try:
            out = fn()
        finally:
            if self.capturing is not None:
                self.capturing.clear()
        for p, g in zip(params, before):  # a capture runs nothing: the gradients stay as they were
            if g is None:
                p.grad = None
            else:
                p.grad.copy_(g)
        graph.fn, graph.out, graph.grad = fn, out, torch.is_grad_enabled()
        return out


def _batch(n=6, seed=1, vocab=128, longer=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (longer + int(torch.randint(2, 6, (), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    comps = [torch.randint(1, vocab, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    lps = [(-torch.rand(len(c), generator=g)).tolist() for c in comps]
    return Batch.build(prompts, comps, lps, [0.0] * n, [i // 3 for i in range(n)]), torch.randn(n, generator=g)


def _pair(flow_name, micro_batch=2, **api):
    model = random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=128), seed=4, std=0.05)

    def make():
        return Trainer(copy.deepcopy(model), named_flow(flow_name), TrainConfig(micro_batch=micro_batch, lr=1e-3),
                       CorrectionConfig(), SamplingParams(), 64)

    eager, graphed = make(), make()
    graphed.graphs = TrunkGraphs(graphed.model, graph_api=StandIn(graphed.model, **api)).install()
    return eager, graphed


def _updates(tr, steps=2, step=0):
    stats = []
    b, adv = _batch()  # the same micro-batch shapes at each update
    for step in range(step, step + steps):
        stats.append(tr.update(b, adv, tr.score(b), None, step=step))
    return stats, [p.detach().clone() for p in tr.model.parameters()]


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_graphed_layers_update_the_weights_as_the_eager_ones(monkeypatch, request, flow_name, native):
    """Two updates of three micro-batches each (so the graphs' forward must quantize the weights the
    optimizer step just changed, the first backward write the gradients held and the others add
    into them): the same statistics and the same weights, bit for bit, as the eager layers'. Each
    micro-batch shape is captured once (its warm-up running on gradients of its own); later
    micro-batches of the same shape replay. ``native``: the GPU's code path (bf16 activations, the
    FP8 weight stacks of ``WeightCastBatch``), forced on CPU tensors."""
    monkeypatch.setattr(train_graphs, "T_BUCKET", 1)  # no padding: the same GEMM shapes as the eager run
    if native:
        request.getfixturevalue("forced_native")
    eager, graphed = _pair(flow_name)
    st_e, w_e = _updates(eager)
    st_g, w_g = _updates(graphed, 1)
    g = graphed.graphs
    layers = g.params()
    held = [p.grad.data_ptr() for p in layers]
    st_g += _updates(graphed, 1, step=1)[0]
    w_g = [p.detach().clone() for p in graphed.model.parameters()]
    assert [p.grad.data_ptr() for p in layers] == held  # the layers' gradients never dropped
    # each update: three micro-batches scored (a forward graph each) and three trained, the first
    # backward of each update writing the gradients
    assert g.disabled is None and g.replays == 12 and g.first_replays == 2, g.report()
    assert g.captures == len(g.entries) <= 9  # the second update's shapes were replayed, not captured again
    assert {k[:2] for k in g.entries} == {(True, True), (True, False), (False, False)}  # training (an optimizer
    #   step's first micro-batch, the others) and scoring
    assert st_g == st_e
    assert all(torch.equal(a, b) for a, b in zip(w_g, w_e))


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_graphed_lora_layers_train_the_adapters_as_the_eager_ones(monkeypatch, request, flow_name, native):
    """LoRA (``model.lora_rank``) with the layers as CUDA graphs: the graphs hold the adapters' gradients
    and re-cast their weights at each replay; the frozen base layers keep the operands they hold (their
    fp32 masters freed, ``hold_frozen``). Its KL reference is the model with its adapters off, which runs
    the layers eagerly (the graphs hold the adapters' ops). Two updates: the same statistics (the KL term
    among them) and the same adapters, bit for bit, as the eager trainer's."""
    from jetrl_cli.models.lora import TARGETS, LoraSpec, add_adapters

    monkeypatch.setattr(train_graphs, "T_BUCKET", 1)
    if native:
        request.getfixturevalue("forced_native")
    model = random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=128), seed=4, std=0.05)
    add_adapters(model, LoraSpec(4, 16.0, TARGETS))

    def make():
        m = copy.deepcopy(model)
        return Trainer(m, named_flow(flow_name), TrainConfig(micro_batch=2, lr=1e-2, kl_coef=0.05),
                       CorrectionConfig(), SamplingParams(), 64, ref_model=m, hold_frozen=True)

    eager, graphed = make(), make()
    graphed.graphs = TrunkGraphs(graphed.model, graph_api=StandIn(graphed.model)).install()
    g = graphed.graphs
    assert {id(p) for p in g.params()} == {id(p) for p in graphed.params}  # the adapters, all in the layers
    b, adv = _batch()
    out = []
    for tr in (eager, graphed):
        st = [tr.update(b, adv, tr.score(b), tr.score(b, ref=True), step=s) for s in range(2)]
        out.append((st, [p.detach().clone() for p in tr.params]))
    # each update: three micro-batches scored and three trained; the reference's scoring eager
    assert g.disabled is None and g.replays == 12 and g.first_replays == 2, g.report()
    assert out[1][0] == out[0][0] and out[0][0][1]["kl_ref"] > 0  # B moved in the first update: a KL
    assert all(torch.equal(a, b) for a, b in zip(out[1][1], out[0][1]))
    base = [m.weight for m in graphed.model.modules() if isinstance(m, JetLinear) and not m.weight.requires_grad]
    assert base and all(w.numel() == 0 for w in base if w is not graphed.model.lm_head.weight) == native


def test_graphed_layers_with_tied_embeddings_a_reference_model_and_an_entropy_bonus(monkeypatch):
    """The rest of a trainer around the graphed layers as a real preset may have it: tied embeddings (the
    lm_head's weight is the embedding's, outside the graphs), a frozen reference model for the KL term
    (a copy, which runs its layers eagerly), an entropy bonus, the batch-invariant mode's attention, two
    mini-batches: bit for bit the eager trainer's."""
    import dataclasses

    monkeypatch.setattr(train_graphs, "T_BUCKET", 1)
    cfg = dataclasses.replace(tiny_config("qwen2", hidden=128, layers=2, vocab=128), tie_word_embeddings=True)
    model = random_model(cfg, seed=6, std=0.05)
    flow = named_flow("fp8-unified")
    flow = dataclasses.replace(flow, batch_invariant=True)
    tcfg = TrainConfig(micro_batch=2, lr=1e-3, kl_coef=0.05, entropy_coef=0.01, minibatches=2)

    def make():
        m = copy.deepcopy(model)
        return Trainer(m, flow, tcfg, CorrectionConfig(type="tis"), SamplingParams(), 64, ref_model=copy.deepcopy(m))

    eager, graphed = make(), make()
    assert graphed.model.lm_head.weight is graphed.model.model.embed_tokens.weight
    graphed.graphs = TrunkGraphs(graphed.model, graph_api=StandIn(graphed.model)).install()
    b, adv = _batch()
    out = []
    for tr in (eager, graphed):
        st = [tr.update(b, adv, tr.score(b), tr.score(b, ref=True), step=s) for s in range(2)]
        out.append((st, [p.detach().clone() for p in tr.model.parameters()]))
    # two mini-batches of 3 sequences, micro-batches of 2 and 1: four a step, after three scored (the
    # reference model's scoring runs eagerly)
    assert graphed.graphs.disabled is None and graphed.graphs.replays == 2 * (4 + 3), graphed.graphs.report()
    assert out[1][0] == out[0][0]
    assert all(torch.equal(a, b) for a, b in zip(out[1][1], out[0][1]))


def test_graphed_sequences_are_padded_to_a_few_lengths():
    """A graphed micro-batch runs at its length rounded up to ``T_BUCKET`` (right padding, which no
    real token attends to): its logprobs equal the eager run's, and its update matches up to the
    order of the weight gradients' sums over tokens."""
    assert [train_graphs.bucket(t) for t in (1, 128, 129, 300)] == [128, 128, 256, 384]
    eager, graphed = _pair("bf16")
    b, adv = _batch()
    assert torch.equal(graphed.score(b), eager.score(b))
    grads = []
    for tr in (eager, graphed):
        def step(tr=tr, real=tr.opt.step):
            grads.append([p.grad.clone() for p in tr.params if p.grad is not None])
            real()
        tr.opt.step = step
    st_e, _ = _updates(eager, 1)
    st_g, _ = _updates(graphed, 1)
    # one length, 128: a scoring forward graph (6 replays: two scorings of 3) and two training pairs (the
    # optimizer step's first micro-batch, and the others: 3 replays)
    assert graphed.graphs.captures == 3 and graphed.graphs.replays == 6 + 3, graphed.graphs.report()
    assert len(grads[0]) == len(grads[1]) == len(eager.params)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert st_g[0]["loss"] == pytest.approx(st_e[0]["loss"], rel=1e-6)


@pytest.mark.parametrize("how", ["capture fails", "replay differs"])
def test_graphs_that_cannot_serve_switch_off_and_the_layers_run_eagerly(monkeypatch, how):
    """A capture that fails (a kernel that cannot be captured), or a first replay whose outputs differ
    from the eager warm-up's: the graphs switch off with the reason kept, and the update is the
    eager one, bit for bit."""
    monkeypatch.setattr(train_graphs, "T_BUCKET", 1)
    eager, graphed = _pair("fp8-unified", **({"fail_at": 2} if how == "capture fails" else {"perturb": True}))
    st_e, w_e = _updates(eager)
    st_g, w_g = _updates(graphed)
    g = graphed.graphs
    assert g.disabled is not None and not g.entries, g.report()
    assert ("capture failed: RuntimeError" in g.disabled) if how == "capture fails" else "differed" in g.disabled
    assert g.report().startswith("off: ")
    assert st_g == st_e and all(torch.equal(a, b) for a, b in zip(w_g, w_e))


@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_an_updates_first_backward_writes_the_layers_gradients(monkeypatch, forced_native, flow_name):
    """Between optimizer steps the layers' gradients are not zeroed (``stale_grads``): the step's first
    graphed backward writes them (a graph pair of its own, ``_Entry.first``: its Wgrad GEMMs write, not
    add; the norm weights' and biases', which autograd adds, zeroed first), the later ones add. Filled with NaN before each
    update, they still give the eager run's weights bit for bit; and an update whose first micro-batch
    runs its layers eagerly (graphs suspended; a shape past ``MAX_SHAPES``) zeroes them first."""
    from jetrl_cli.precision import linear

    monkeypatch.setattr(train_graphs, "T_BUCKET", 1)
    eager, graphed = _pair(flow_name)
    g = graphed.graphs
    b, adv = _batch()
    zeroed = []
    real_zero = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: (zeroed.append(len(ts)), real_zero(ts))[1])
    n_layer = len(g.params())
    for step in range(4):
        if step == 3:  # new shapes only, and no graph for them: the first micro-batch's layers run eagerly
            monkeypatch.setattr(train_graphs, "MAX_SHAPES", len(g.entries))
            b, adv = _batch(seed=7, longer=9)
        zeroed.clear()
        with g.suspended() if step == 2 else contextlib.nullcontext():
            for tr in (eager, graphed):
                tr.update(b, adv, tr.score(b), None, step=step)
        # the graphs' first backward zeroes only the gradients autograd adds (norm weights, biases: not
        # the GEMMs'; step 0's warm-ups and captures too); eager layers find all of the layers' zeroed
        if step < 2:  # step 1: its first backward's zeroing alone
            assert zeroed and max(zeroed) <= n_layer / 2 and (step == 0 or len(zeroed) == 1), (step, zeroed)
        else:
            assert zeroed == [n_layer], (step, zeroed)
        for p in g.params():  # stale values, never to be read
            p.grad.fill_(float("nan"))
        assert all(torch.equal(x, y) for x, y in zip(graphed.model.parameters(), eager.model.parameters())), step
    assert g.disabled is None and g.first_replays == 2 and g.eager_shapes, g.report()
    assert g.report().endswith("(2 writing the gradients)")  # a bench row's train_graphs says so
    assert all(e.first is k[1] for k, e in g.entries.items())
    assert not linear.sink_overwrites()


def test_gradients_dropped_between_updates_are_captured_again(monkeypatch):
    """The backward graph adds into the gradients where they lay at capture. The trainer zeroes them in
    place; one dropped anyway (``zero_grad(set_to_none=True)``) makes the graphs capture again rather
    than add into memory that is gone."""
    monkeypatch.setattr(train_graphs, "T_BUCKET", 1)
    eager, graphed = _pair("bf16", micro_batch=6)
    b, adv = _batch()
    for tr in (eager, graphed):
        tr.update(b, adv, tr.score(b), None, step=0)
    assert graphed.graphs.captures == 2  # scoring's forward, the update's forward and backward
    graphed.opt.zero_grad(set_to_none=True)
    for tr in (eager, graphed):
        tr.update(b, adv, tr.score(b), None, step=1)
    assert graphed.graphs.captures == 3 and graphed.graphs.disabled is None  # the update's again
    assert all(torch.equal(a, b) for a, b in zip(graphed.model.parameters(), eager.model.parameters()))


def test_graphs_serve_only_their_own_model_without_hooks():
    """A copy of the model (a reference model made from the policy) runs its layers eagerly; so does a
    model with a hook on a layer (the mismatch report's per-layer attribution), whose hook a replay
    would skip. Scoring (no autograd) replays graphs of its own."""
    _, graphed = _pair("bf16")
    g = graphed.graphs
    x = torch.zeros(2, 3, 128)
    assert g.applies(graphed.model, x)
    assert not g.applies(copy.deepcopy(graphed.model), x)
    with torch.no_grad():
        assert g.applies(graphed.model, x)
    h = graphed.model.model.layers[1].register_forward_hook(lambda *a: None)
    assert not g.applies(graphed.model, x)
    h.remove()
    with g.suspended():  # the bench's count of the bytes a forward saves
        assert not g.applies(graphed.model, x)
    assert g.applies(graphed.model, x)


def test_the_graphed_layers_weights_are_quantized_apart_from_the_lm_head():
    """The forward graph quantizes the layers' FP8 weights in its own batched launch; the eager lm_head
    in another (``WeightCastBatch.graphed``): neither re-quantizes the other's weights."""
    _, graphed = _pair("fp8-unified")
    batch = graphed.model.lm_head._cast_batch
    ids = {tuple(map(id, mods)) for mods, _ in graphed.model.linear_groups()}
    head = (id(graphed.model.lm_head),)
    assert batch.graphed == ids - {head}


@pytest.mark.slow  # ~50 s: Triton's interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU captures for real: test_real_cuda_graphs_...")
def test_the_forward_graph_quantizes_the_layers_weights_in_one_batched_call(forced_native, monkeypatch):
    """FP8 weights by the Triton quantizers (in Triton's interpreter), the update the first time the
    model's weights are quantized at all: each warm-up and forward graph's capture (two pairs: the
    optimizer step's first micro-batch, and the other) quantize every layer's weights in one batched call (``WeightCastBatch``, two launches) with the same job
    tables -- checked as a capture checks them: a table the capture would have to copy from the host
    is an error there -- the stand-in's replays run that call again, as a real replay runs its
    kernels, and the update is the eager one, bit for bit."""
    import collections

    from jetrl_cli.precision import gemm, parse_flow

    from .triton_interp_fix import fixed_fp8_conversion

    gemms = {g: {"backend": "triton"} for g in ("fprop", "dgrad", "wgrad")}
    flow = parse_flow({"base": "fp8-unified", "rollout": {"linear": {"backend": "triton"}}, "train": gemms},
                      source="<test>")
    monkeypatch.setattr(train_graphs, "T_BUCKET", 1)
    fp8 = gemm.triton_fp8_kernels()
    calls = collections.Counter()
    real = fp8.quantize_weight_stacks
    monkeypatch.setattr(fp8, "quantize_weight_stacks", lambda *a, **k: calls.update(["stacks"]) or real(*a, **k))
    capturing = []
    monkeypatch.setattr(fp8, "_stream_capturing", lambda dev: bool(capturing))
    model = random_model(tiny_config("qwen2", hidden=256, layers=2, vocab=256), seed=5, std=0.05)
    g = torch.Generator().manual_seed(fresh_seed())
    ids = torch.randint(1, 256, (4, 20), generator=g)
    b = Batch.build(ids[:, :8].tolist(), ids[:, 8:].tolist(), [[-1.0] * 12] * 4, [0.0] * 4, [0, 0, 1, 1])
    adv, old = torch.randn(4, generator=g), -torch.rand(b.mask.shape, generator=g) * b.mask

    def trained(graphs: bool):
        tr = Trainer(copy.deepcopy(model), flow, TrainConfig(micro_batch=2, lr=1e-3), CorrectionConfig(),
                     SamplingParams(), 64)
        if graphs:
            tr.graphs = TrunkGraphs(tr.model, graph_api=StandIn(tr.model, capturing=capturing)).install()
        calls.clear()
        with fixed_fp8_conversion():
            tr.update(b, adv, old, None, step=0)
        return tr, dict(calls)

    eager, eager_calls = trained(False)
    graphed, graphed_calls = trained(True)
    groups = 4 * 2  # q/k/v, o, gate/up, down of two layers (the tiny model's lm_head is bf16)
    assert eager_calls == {"stacks": groups}  # learnt one by one; the second micro-batch uses them
    # two graph pairs: the optimizer step's first micro-batch (its backward writes the gradients), the other
    assert graphed.graphs.disabled is None and graphed.graphs.captures == 2, graphed.graphs.report()
    assert graphed_calls == {"stacks": 2 * (1 + 1) + 2}  # each pair's warm-up and capture, two replays: all groups
    assert all(torch.equal(p, q) for p, q in zip(graphed.model.parameters(), eager.model.parameters()))


@pytest.mark.gpu
@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified", "fp8-unified+lora"])
def test_real_cuda_graphs_train_as_the_eager_layers(flow_name):
    """On a GPU: two updates of three micro-batches through captured graphs (each update's first
    backward writing the gradients, the others adding), each against an eager update from the same
    weights and optimizer state: the first from the initial model, the second from the graphed model
    after its first update (an eager run's own weights would differ from it after Adam's first step by
    about lr wherever a small gradient's sign differed; on an H200, 2026-11-29, that moved a gradient by
    14% in norm). The forward is checked bit for bit at capture (``TrunkGraphs``); each update's
    gradients agree to the rounding of the backward's sums (flash attention's backward and the GEMMs
    may add in another order from one run to the next, and the graphed sequences are padded to 128
    tokens: other Wgrad token groups). ``+lora``: rank-8 adapters on every linear layer train, the frozen
    layers holding their operands only."""
    flow_name, lora = flow_name.removesuffix("+lora"), flow_name.endswith("+lora")
    model = random_model(tiny_config("qwen2", hidden=256, layers=2, vocab=512), seed=4, std=0.05).cuda()
    if lora:
        from jetrl_cli.models.lora import TARGETS, LoraSpec, add_adapters

        add_adapters(model, LoraSpec(8, 16.0, TARGETS))
    sp = SamplingParams()
    grads: dict = {}
    after_first: dict = {}

    def make(graphs, name, weights=None, opt_state=None):
        start = copy.deepcopy(model)
        if weights is not None:
            start.load_state_dict(weights, strict=False)  # the trained parameters (LoRA: the adapters)
        tr = Trainer(start, named_flow(flow_name), TrainConfig(micro_batch=2, lr=1e-3, cuda_graphs=graphs),
                     CorrectionConfig(), sp, 64, hold_frozen=lora)
        if opt_state is not None:
            tr.opt.load_state_dict(opt_state)

        def step(tr=tr, real=tr.opt.step, name=name):
            grads.setdefault(name, []).append([p.grad.clone() for p in tr.params])
            real()
            if name == "graphed" and not after_first:  # the graphed model and Adam's state after update 0
                after_first.update(model={k: v.detach().clone() for k, v in tr.model.named_parameters()
                                          if v.requires_grad},
                                   opt=copy.deepcopy(tr.opt.state_dict()))
        tr.opt.step = step
        return tr

    eager, graphed = make(False, "eager"), make(True, "graphed")
    assert graphed.graphs is not None and eager.graphs is None
    st_g, _ = _updates(graphed)
    st_e, _ = _updates(eager, 1)
    st_e += _updates(make(False, "eager", after_first["model"], after_first["opt"]), 1, step=1)[0]
    g = graphed.graphs
    assert g.disabled is None and g.captures >= 2 and g.replays == 12, g.report()  # 3 scored, 3 trained, twice
    assert g.first_replays == 2  # each update's first backward wrote the layers' gradients (``bwd_first``)
    assert len(grads["eager"]) == len(grads["graphed"]) == 2
    fp8 = flow_name != "bf16"
    for update, (ge, gg) in enumerate(zip(grads["eager"], grads["graphed"])):
        for a, b in zip(gg, ge):
            if not fp8:
                torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * b.abs().max().item())
                continue
            # FP8 backward: a sum added in another order can round a gradient element to the
            # neighbouring E4M3 value (2^-3 apart relative), and Wgrad's 128-token groups differ with
            # the padding, so single elements may move by an FP8 step (on the H200: 30 of 131072 beyond
            # the bf16 bound; 7 of a norm's 256 weights). Whole tensors may not: their relative error
            # stays under one E4M3 step, and at most 1% of a tensor's elements (5% of a small one's)
            # leave the elementwise bound (a stale or wrong gradient fails both)
            err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
            assert err <= 2.0 ** -3, (update, tuple(a.shape), err)
            off = ~torch.isclose(a, b, rtol=5e-2, atol=5e-2 * b.abs().max().item())
            bound = 0.01 if a.numel() >= 4096 else 0.05
            assert off.float().mean().item() <= bound, (update, tuple(a.shape), off.sum().item())
    for e, gr in zip(st_e, st_g):
        assert gr["loss"] == pytest.approx(e["loss"], rel=5e-2, abs=1e-3)
