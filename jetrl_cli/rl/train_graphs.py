"""CUDA graphs for the trainer's decoder layers (``train.cuda_graphs``).

A training micro-batch of the 1.5B shape launches thousands of kernels from Python: on an H200 the
FP8 update spent ~0.19 s in host work against 0.17 s of kernels (``docs/benchmarks.md``), so the
GPU waited on the host. Here the decoder layers -- everything between the token embedding and the
final norm -- are captured once per micro-batch shape as two graphs, their forward and their
backward, and replayed: two launches instead of thousands. The trainer's scoring (its forward
without autograd: the old policy's logprobs) replays a forward graph of its own. The embedding, the
final norm, the lm_head with its logprobs and the loss stay eager (their shapes follow the
completion tokens).

What makes replay correct:

- **Inputs at fixed addresses.** The layers' input (the embedding's output), the RoPE angles and
  the query positions are copied into the graph's own tensors before each forward replay; the
  gradients arriving from the final norm into the backward graph's.
- **Weights re-quantized inside the forward graph.** The capture starts with every layer's cached
  GEMM weights dropped (``_release_weights``), so the forward graph itself quantizes the master
  weights (the batched two launches, ``WeightCastBatch``) and every replay does it again from the
  current values: an optimizer step needs no Python to refresh them. A micro-batch after the first
  of an optimizer step re-quantizes the same weights (the same bits) -- a few milliseconds wasted,
  never a stale weight. The lm_head, outside the graph, is quantized eagerly as before
  (``WeightCastBatch.graphed`` keeps the two apart).
- **Weight gradients added where they are held.** The backward graph adds each layer parameter's
  gradient into its ``.grad`` (autograd's in-place accumulation, or the GEMM's epilogue under
  ``grads_in_place``), so the layers' gradients are never dropped; the addresses are checked
  before each replay, and graphs captured over gradients that moved are dropped and captured again.
- **An optimizer step's first backward writes them.** Zeroing every layer gradient before a step
  and adding the first micro-batch into those zeros costs a write of every gradient, and a read of
  the zeros in each Wgrad GEMM's epilogue -- or, for an FP8 Wgrad, whose ``scaled_mm`` cannot add in
  its epilogue, a product written and then read again with the zeros by an add (4.6 ms of the 1.5B
  FP8 update on an H200). So the trainer marks the layers' gradients stale at each optimizer step
  (``stale_grads``) instead of zeroing them, and a step's first micro-batch replays a graph pair of
  its own (``_Entry.first``), whose backward was captured under ``precision.linear.grads_written``:
  its Wgrad GEMMs write the gradients they would add into (an FP8 one through ``scaled_mm``'s
  ``out=``), after zeroing the few gradients autograd adds itself (norm weights, biases). A
  backward of eager layers zeroes stale gradients first (``zero_stale``). The sums are the same: the
  first term is the gradient itself either way (``0 + g == g``, but for the sign of a zero). A
  linear group's weights (q/k/v, gate/up) get their gradients back to back in one buffer
  (``_hold_grads``), so that its one Wgrad GEMM writes or adds into them.
- **Nothing copied from the host inside a capture.** The FP8 weight quantizer's launches read job
  tables kept on the device by their contents (tensor offsets and sizes); a capture cannot copy a new
  one in. So the warm-up runs exactly what the capture will: the weights quantized into one buffer
  per kind (``kernels.fp8.stacks_in_one_buffer``: offsets fixed by the shapes, wherever the buffer
  lands), every layer group known to the batch from the start (one learnt during the warm-up would
  be quantized alone there and batched in the capture), and the tables a capture used are kept for
  good (``kernels.fp8._CAPTURED_TABLES``).
- **The graph's memory** is a private pool: what the layers keep between forward and backward
  (activations, FP8 weights) stays reserved there between steps.

Capture follows ``torch.cuda.make_graphed_callables``: a warm-up forward and backward on the capture
stream (kernels compiled, first-call timings taken; its weight gradients go to scratch tensors,
not ``.grad``), then the captures, then a replay whose outputs must equal the warm-up's bit for bit
(the forward is deterministic). A capture that fails, or a replay that differs, switches the graphs
off with the reason kept in ``disabled`` (``jetrl bench train`` reports it), and the layers run
eagerly: a graph never silently changes a step.

With LoRA (``model.lora_rank``) the layers' trained parameters are the adapters': the graphs hold
their gradients and re-cast their weights at each replay, while the frozen base layers keep the
operands they hold (never released, never re-quantized). The reference forward of a LoRA model, its
adapters switched off (``adapters_disabled``), runs the layers eagerly.

Sequence lengths are padded up to a multiple of ``T_BUCKET`` tokens (``bucket``) so an RL run meets
a few shapes; at most ``MAX_SHAPES`` are captured (each with up to three graph pairs: scoring's
forward, an optimizer step's first micro-batch, the others), later ones run eagerly. Not under FSDP (its
hooks gather each layer's weights in Python), nor with hooks on the layers (they would not run).
Nothing here captures on CPU except through a test's stand-in for the capture API.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..engine.graphs import _CudaGraphAPI, _why  # the rollout's capture API, and its failure reasons
from ..precision.linear import adapters_are_off, back_to_back, grads_written, recording_sinks

T_BUCKET = 128  # a micro-batch's sequence length is padded up to a multiple of this
MAX_SHAPES = 8  # micro-batch shapes captured; others run eagerly


def bucket(t: int) -> int:
    """The sequence length a graphed micro-batch of ``t`` tokens runs at."""
    return -(-t // T_BUCKET) * T_BUCKET


@dataclass
class _Entry:
    fwd: object
    bwd: object
    x: torch.Tensor  # the layers' input (the embedding's output), a leaf
    cos: torch.Tensor
    sin: torch.Tensor
    q_index: torch.Tensor
    outs: tuple  # (x, delta) of the last layer, rewritten by each forward replay
    grads_in: tuple  # the gradients of ``outs``, copied in before each backward replay
    x_grad: torch.Tensor | None  # the input's gradient, rewritten by each backward replay
    grad_ptrs: tuple  # where the layer parameters' .grad lay at capture
    anchor: torch.nn.Parameter  # a layer parameter, an input of the autograd node so that its backward
    #   runs even when ``x`` needs no gradient (a frozen embedding); its gradient is the graph's to add
    first: bool = False  # the backward writes the layers' gradients (stale ones), not adds into them


class TrunkGraphs:
    """The decoder layers of ``model`` (a ``LlamaForCausalLM``) replayed as CUDA graphs in training
    forwards; installed as ``model.trunk_graphs`` (``install``)."""

    def __init__(self, model, graph_api=None):
        self.model = model
        self.api = graph_api or _CudaGraphAPI()
        self.entries: dict[tuple, _Entry] = {}
        self.disabled: str | None = None
        self.captures = 0
        self.replays = 0
        self.eager_shapes: set = set()  # shapes past MAX_SHAPES, run eagerly
        self.off = False  # ``suspended``
        self.pool = None
        self.stale = False  # the layers' gradients hold the last optimizer step's (``stale_grads``)
        self.first_replays = 0  # backward replays that wrote the gradients (``_Entry.first``)

    def __deepcopy__(self, memo):
        return None  # a copy of the model (a reference model) runs its layers eagerly; graphs do not copy

    def install(self) -> "TrunkGraphs":
        from ..precision.linear import _batchable

        self.model.trunk_graphs = self
        batch = _cast_batch(self.model)
        if batch is not None:
            for mods, _ in self.groups():
                ids = tuple(map(id, mods))
                batch.graphed.add(ids)
                # known from the start: the first warm-up quantizes every group in the one batched call its
                # capture then makes, with the same job tables (a group learnt during the warm-up would be
                # quantized alone there, batched in the capture: a table the capture cannot copy in)
                if _batchable(mods) is not None:
                    batch.groups.setdefault(ids, (mods, None))
        return self

    @contextlib.contextmanager
    def suspended(self):
        """Within: the layers run eagerly (``jetrl bench``'s count of the bytes a forward saves for the
        backward, which a graph's saved tensors do not show)."""
        before, self.off = self.off, True
        try:
            yield
        finally:
            self.off = before

    def state(self) -> str:
        """One line that changes only when the graphs do (a run's ``train_graphs`` metric): the shapes
        captured and those run eagerly, or why the graphs are off."""
        if self.disabled is not None:
            return f"off: {self.disabled}"
        more = f", {len(self.eager_shapes)} shapes eager" if self.eager_shapes else ""
        return f"{self.captures} captured{more}"

    def report(self) -> str:
        """``state``, the forward replays so far and the backward replays among them that wrote the
        gradients (an optimizer step's first: a bench row's ``train_graphs``)."""
        if self.disabled is not None:
            return self.state()
        return f"{self.state()}, {self.replays} replays ({self.first_replays} writing the gradients)"

    def groups(self) -> list:
        return [g for g in self.model.linear_groups() if g[1] is not self.model.lm_head]

    def _release(self) -> None:
        """Drop the layers' cached GEMM weights (the next forward quantizes them)."""
        from ..precision.linear import _release_weights

        for mods, owner in self.groups():
            _release_weights(mods, owner)

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.model.layers.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ gradients between optimizer steps

    def _hold_grads(self, params) -> None:
        """A gradient for every layer parameter before a backward capture, where the graph will add
        into it: a linear group's weights' (q/k/v, gate/up) back to back in one buffer, which
        ``grad_sink`` hands the group's one Wgrad GEMM to add into (or write) -- gradients of their
        own would leave each slice of the GEMM's product to autograd, written and then added (eager
        training gets such a buffer from autograd, which keeps the slices of the group's first
        gradient). A group's gradients that are not back to back move into one (their values kept:
        graphs captured over the old ones are captured again, ``run``)."""
        for mods, _ in self.groups():
            ws = [m.weight for m in mods]
            if (len(ws) < 2 or not all(w.requires_grad for w in ws) or back_to_back([w.grad for w in ws])
                    or any(w.dim() != 2 or w.shape[1] != ws[0].shape[1] or w.dtype != ws[0].dtype for w in ws)):
                continue
            buf = torch.zeros((sum(w.shape[0] for w in ws), ws[0].shape[1]), dtype=ws[0].dtype, device=ws[0].device)
            at = 0
            for w in ws:
                part = buf[at:at + w.shape[0]]
                if w.grad is not None:
                    part.copy_(w.grad)
                w.grad, at = part, at + w.shape[0]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def stale_grads(self, params) -> None:
        """Before an optimizer step's first micro-batch (``Trainer.update``), instead of zeroing:
        ``params`` outside the layers drop their gradients (their eager backward writes new ones, as
        without graphs); the layers' stay where the graphs captured them, marked stale, and the step's
        first backward writes them (a ``first`` graph pair) -- or, eager, finds them zeroed (``zero_stale``)."""
        mine = {id(p) for p in self.params()}
        for p in params:
            if id(p) not in mine:
                p.grad = None
        self.stale = True

    def zero_stale(self) -> None:
        """Zero the layers' stale gradients before a backward that adds into them (eager layers, or a
        graph pair that adds)."""
        if self.stale:
            grads = [p.grad for p in self.params() if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)
            self.stale = False

    def eager_layers(self, x, cos, sin, mask):
        """The layers run eagerly (no graph serves this forward): stale gradients zeroed first when a
        backward will follow."""
        if torch.is_grad_enabled():
            self.zero_stale()
        return self.model.run_layers(x, cos, sin, mask)

    # ------------------------------------------------------------------ use

    def applies(self, model, x: torch.Tensor) -> bool:
        """Whether ``model``'s trunk forward on ``x`` runs through the graphs: this object's model (not
        a copy of it), graphs not switched off, no hooks on the layers."""
        if (model is not self.model or self.off or self.disabled is not None or adapters_are_off()
                or not (x.is_cuda or getattr(self.api, "on_cpu", False))):
            return False  # (adapters off: a LoRA model's base forward, its KL reference; the graphs run them)
        layers = self.model.model.layers
        if not len(layers) or not any(p.requires_grad for p in layers.parameters()):
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                       for m in layers.modules())

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask) -> tuple:
        """The last layer's ``(x, delta)`` for input ``x``: replayed, or, when no graph can serve
        this shape, from the eager layers."""
        train = torch.is_grad_enabled()
        first = train and self.stale  # an optimizer step's first micro-batch: its backward writes the gradients
        shape = (tuple(x.shape), x.dtype, x.requires_grad, tuple(cos.shape), cos.dtype, bool(mask.invariant),
                 mask.width)
        key = (train, first, *shape)
        e = self.entries.get(key)
        if e is not None and train and e.grad_ptrs != _grad_ptrs(self.params()):
            self.reset()  # a gradient was dropped or replaced: the backward graph would add into freed memory
            e = None
        if e is None:
            if len({k[2:] for k in self.entries} | {shape}) > MAX_SHAPES:
                self.eager_shapes.add(shape)
                return self.eager_layers(x, cos, sin, mask)
            e, warm = self._capture(x, cos, sin, mask, train, first)
            if e is None:
                return self.eager_layers(x, cos, sin, mask)
            out = _GraphedLayers.apply(x, cos, sin, mask.q_index, e.anchor, e, self)
            if not all(torch.equal(a, b) for a, b in zip(e.outs, warm)):
                self.disabled = "a replayed training forward differed from the eager one"
                self.reset()
                return self.eager_layers(x, cos, sin, mask)
            self.entries[key] = e
            return out
        return _GraphedLayers.apply(x, cos, sin, mask.q_index, e.anchor, e, self)

    def reset(self) -> None:
        """Drop every graph (their pool's memory goes back to torch's allocator)."""
        self.entries.clear()
        self.pool = None

    # ------------------------------------------------------------------ capture

    def _capture(self, x, cos, sin, mask, train: bool, first: bool = False) -> tuple:
        """``(entry, warm-up outputs)``, or ``(None, None)`` with ``disabled`` set. ``train``: a forward
        with autograd, and its backward; else a forward alone (the trainer's scoring). ``first``: the
        backward writes the layers' gradients (an optimizer step's first, ``grads_written``), the
        gradients autograd adds itself zeroed first -- those the warm-up's backward did not hand its
        GEMMs (``recording_sinks``)."""
        from ..models.llama import Masking

        model, api = self.model, self.api
        try:
            api.prepare()
        except Exception as e:  # no stream here (a machine without a usable driver)
            self.disabled = _why(e)
            return None, None
        params = self.params()
        if train:  # the backward graph adds into them: they must exist, at addresses that stay
            self._hold_grads(params)
        xs = x.detach().clone().requires_grad_(x.requires_grad)
        cs, ss, qs = cos.clone(), sin.clone(), mask.q_index.clone()
        held: dict = {}

        def forward():
            m = Masking(qs, None, mask.width, True)
            m.invariant = mask.invariant
            held["outs"] = model.run_layers(xs, cs, ss, m)
            return held["outs"]

        grads_in: list = []
        sunk: dict = {}  # the weights whose gradients the backward's GEMMs write or add (``grad_sink``)

        def backward():
            rest = sunk.get("warm-up")
            if first and rest is not None:  # the gradients autograd adds itself (not the GEMMs') zeroed first
                rest = [p.grad for p in params if id(p) not in rest and p.grad is not None]
                if rest:
                    torch._foreach_zero_(rest)
            xs.grad = None  # written, not added to (a stand-in's replay runs this again)
            with grads_written() if first else contextlib.nullcontext(), recording_sinks() as seen:
                torch.autograd.backward(held["outs"], grad_tensors=tuple(grads_in),
                                        inputs=([xs] if xs.requires_grad else []) + params)
            sunk.setdefault("warm-up", {id(w) for w in seen})
            sunk["last"] = {id(w) for w in seen}
            return xs.grad

        def warm_up():
            out = forward()
            if train:
                grads_in[:] = [torch.zeros_like(o) for o in out]
                backward()
            return tuple(o.detach().clone() for o in out)

        try:
            # The warm-up runs what the capture will: the weights quantized too (their kernels' first-call
            # compilation and launch timings happen there; they cannot run inside a capture).
            self._release()
            with _scratch_grads(self, params if train else ()), _stacks_in_one_buffer():  # weight gradients: scratch
                warm = api.warmup(warm_up)
            self._release()  # so the forward graph quantizes every weight itself
            if self.pool is None:
                self.pool = api.pool()
            fwd, bwd, x_grad = api.new_graph(), None, None
            with _stacks_in_one_buffer():  # the FP8 weights' job tables: the warm-up's, already on the device
                outs = api.record(fwd, self.pool, forward)
            if train:
                ptrs, bwd = _grad_ptrs(params), api.new_graph()
                x_grad = api.record(bwd, self.pool, backward)
                if _grad_ptrs(params) != ptrs:  # autograd replaced a .grad instead of adding into it
                    raise RuntimeError("the captured backward moved a weight gradient")
                if sunk["last"] != sunk["warm-up"]:  # the graph would write gradients it did not zero, or so
                    raise RuntimeError("the captured backward wrote other weight gradients than its warm-up")
        except Exception as e:  # a kernel that cannot be captured on this GPU / torch, or no memory for it
            self.disabled = _why(e)
            self.reset()
            return None, None
        finally:
            held.clear()  # the capture's autograd graph (a stand-in's)
            # The layers' Python caches now name weights the capture allocated in the graphs' pool, whose
            # blocks other graphs' replays may write (as their captures saw them free): an eager forward
            # (a shape past MAX_SHAPES, the next warm-up) must quantize into memory of its own.
            self._release()
        self.captures += 1
        # the outputs without their capture's autograd graph, whose nodes would keep tensors of the pool alive
        outs = tuple(o.detach() for o in outs)
        e = _Entry(fwd, bwd, xs, cs, ss, qs, outs, tuple(grads_in), x_grad, _grad_ptrs(params), params[0], first)
        return e, warm


class _GraphedLayers(torch.autograd.Function):
    """The decoder layers as one autograd node: the forward replays the forward graph, the backward
    the backward graph, which also adds the layers' weight gradients into their ``.grad``."""

    @staticmethod
    def forward(ctx, x, cos, sin, q_index, anchor, e: _Entry, owner: TrunkGraphs):
        with torch.no_grad():
            for dst, src in ((e.x, x), (e.cos, cos), (e.sin, sin), (e.q_index, q_index)):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
        e.fwd.replay()
        owner.replays += 1
        ctx.e, ctx.owner = e, owner
        return tuple(o.detach() for o in e.outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        e, owner = ctx.e, ctx.owner
        for dst, g in zip(e.grads_in, grads):
            if g is None:
                dst.zero_()
            else:
                dst.copy_(g)
        if e.first:  # the optimizer step's first backward: it writes the gradients
            owner.stale = False
            owner.first_replays += 1
        else:
            owner.zero_stale()
        e.bwd.replay()
        return (None if e.x_grad is None else e.x_grad.detach()), None, None, None, None, None, None


class _scratch_grads:
    """Within: ``params`` hold zero gradients of their own, laid out as the real ones will be
    (``TrunkGraphs._hold_grads``), their real ``.grad`` put back after."""

    def __init__(self, graphs: TrunkGraphs, params):
        self.graphs, self.params = graphs, params

    def __enter__(self):
        self.real = [p.grad for p in self.params]
        if self.params:
            for p in self.params:
                p.grad = None
            self.graphs._hold_grads(self.params)

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.real):
            p.grad = g


def _stacks_in_one_buffer():
    """``kernels.fp8.stacks_in_one_buffer`` where Triton runs, else nothing to do."""
    from ..precision.gemm import triton_fp8_kernels

    fp8 = triton_fp8_kernels()
    return fp8.stacks_in_one_buffer() if fp8 is not None else contextlib.nullcontext()


def _grad_ptrs(params) -> tuple:
    return tuple(None if p.grad is None else p.grad.data_ptr() for p in params)


def _cast_batch(model):
    from ..precision.linear import JetLinear

    for m in model.modules():
        if isinstance(m, JetLinear) and "_cast_batch" in m.__dict__:
            return m._cast_batch
    return None
