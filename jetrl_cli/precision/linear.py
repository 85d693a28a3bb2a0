"""The one precision forward, and the FP8 linear layer built on it.

``y = x @ W.T + b``. Forward (Fprop), input gradient (Dgrad) and weight gradient (Wgrad) each cast
their operands as the flow says (see ``flow.py`` for the operand layouts) and write high precision:
activations and the gradients passed between operators are rounded to the GEMM's ``out`` format
(bf16 or fp32), never to 8 bits; master weights are the module's own fp32 parameters.

``linear_forward`` is the forward every caller runs -- the trainer (through ``JetLinear`` and
``linear_group``), the embedded rollout engine, and jetrl's quantization method inside vLLM -- so
a rollout forward and a training forward with the same precision run the same casts, the same
backend and the same GEMM, and give the same bits.

Linear layers that read the same input (q/k/v, gate/up) run as one group (``linear_group``): the
input is cast once, and their weights, each quantized on its own (its own 128x128 blocks and
scales), are concatenated along N into one GEMM operand, cached until a weight changes -- once
per optimizer step, or at each weight sync on the rollout side. Dgrad reads the same quantized
weights transposed (the 128x128 block grid is transpose-symmetric), also cached per step.

What the backward keeps: the Wgrad operand of the input, in its final layout. With
``save_fp8_activations`` that is the FP8 copy (128x1 groups along tokens), made in the forward,
and ``swiglu`` keeps FP8 copies of its two inputs; otherwise the input is kept in the Wgrad
operand's high precision (bf16 natively) and quantized in the backward.
"""

from __future__ import annotations

import contextlib
import fnmatch
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .flow import GemmSpec, LinearPrecision, PrecisionFlow
from .formats import B1x128, B128x1, B128x128, Block, Format
from .fuse import fused
from .gemm import (
    ExactOperand,
    Operand,
    accumulate_gemm,
    add_bias,
    backend_for,
    cast_operand,
    cast_pair,
    cast_weight_pair,
    dense_weight_operand,
    exact_dense_spec,
    exact_operand,
    finish,
    int8_kernels_for,
    kernel_quantizers,
    native,
    one_read_pair,
    operand_values,
    resolve,
    run_gemm,
    transpose_operand,
)
from .quant import CastSpec, QTensor, block_values

TILE = 128

# --------------------------------------------------------------------------- the forward


def linear_forward(x: torch.Tensor | None, weight: Operand | list, bias: torch.Tensor | None, spec: GemmSpec,
                   gemm: str = "fprop", x_op: Operand | None = None, x_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T + b`` in ``spec``'s precision, for any leading dims of ``x``.

    ``weight`` is the weight already cast for ``spec`` (``weight_operand``, or ``concat_operands``
    for several layers): a QTensor, a dense tensor (for the emulated backend, the fp32 values of
    the quantized weight), or a list of them (one GEMM each, outputs concatenated). The input is
    cast here, the GEMM runs on the resolved backend, the bias is added to the fp32 product
    (emulated) or to the output (native), and the result is rounded to ``out``. ``x_op``: the input
    already cast (when one read of x gave this operand and another); x may then be None (a kernel
    made the operand from what x is computed from: ``swiglu_down``), rows x K, and ``x_dtype`` is
    what x's dtype would be."""
    lead = None  # x's leading dims, when there are not just one
    if x is None:
        x2, dt, dev = None, x_dtype, x_op.data.device
    else:
        x2, dt = x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), x.dtype
        dev, lead = x2.device, None if x.dim() == 2 else x.shape[:-1]
    xa = x_op if x_op is not None else cast_operand(x2, spec.a, backend_for(spec, gemm, dev))
    if isinstance(weight, list):
        acc = add_bias(torch.cat([run_gemm(xa, w, spec, gemm, dev) for w in weight], dim=-1), bias)
    else:
        acc = run_gemm(xa, weight, spec, gemm, dev, bias)
    y = finish(acc, spec.out, dt)
    return y if lead is None else y.reshape(*lead, y.shape[-1])


def weight_operand(w: torch.Tensor, spec: GemmSpec, gemm: str = "fprop") -> Operand:
    """A weight (N x K) cast once for ``spec`` on the backend that will run it."""
    with torch.no_grad():
        return cast_operand(w.detach(), spec.b, backend_for(spec, gemm, w.device))


def weight_operands(ws: Sequence[torch.Tensor], spec: GemmSpec, gemm: str = "fprop") -> list[Operand]:
    """``[weight_operand(w, spec, gemm) for w in ws]``, the same operands; where the Triton weight
    quantizer makes them (FP8 128x128 blocks on a kernel backend), all in one launch
    (``kernels.fp8.quantize_weight_stacks``): a weight sync's 196 weights at the Qwen2.5-1.5B shape
    took a launch each."""
    if not ws:
        return []
    b, w0 = spec.b, ws[0]
    tri = None
    if b.format.is_fp8 and b.block == B128x128 and all(w.dim() == 2 and w.device == w0.device for w in ws):
        tri = kernel_quantizers(w0, (backend_for(spec, gemm, w0.device),), b)
    if tri is None or any(tri.unsupported(w, b.format, b.amax_floor) is not None for w in ws):
        return [weight_operand(w, spec, gemm) for w in ws]
    with torch.no_grad():
        out = tri.quantize_weight_stacks([[w.detach()] for w in ws], b.format, b.pow2_scale, b.amax_floor)
    return [q for q, _ in out]


def concat_operands(ops: Sequence[Operand], spec: GemmSpec, device: torch.device, gemm: str = "fprop") -> Operand | list:
    """Weights (each N_i x K, cast on its own) stacked along N as one GEMM operand.

    For the emulated backend (and unscaled specs) their values are concatenated; quantized
    weights are concatenated as one QTensor when no scale block spans two of them (per-row
    scales, or every part but the last a whole number of blocks tall); otherwise the list is
    returned and ``linear_forward`` runs one GEMM per part."""
    emulated = resolve(spec, gemm, device).backend == "emulated"
    if not spec.is_quantized:
        w = ops[0] if len(ops) == 1 else torch.cat(list(ops))
        return dense_weight_operand(w, spec) if exact_dense_spec(spec, gemm, device) else w
    if emulated:  # float64 values and per-row group scales, for exact_mm (or fp32 values, for the rest)
        exact = [exact_operand(op) for op in ops]
        if len({e.group for e in exact}) == 1:
            if len(exact) == 1:
                return exact[0]
            return ExactOperand(torch.cat([e.values for e in exact]), torch.cat([e.scales for e in exact]),
                                exact[0].group, exact[0].format)
        return torch.cat([operand_values(op) for op in ops])
    if len(ops) == 1:
        return ops[0]
    rows = ops[0].spec.block.rows
    if rows == 1 or (rows > 1 and all(op.data.shape[0] % rows == 0 for op in ops[:-1])):
        return QTensor(torch.cat([op.data for op in ops]), torch.cat([op.scale for op in ops]), ops[0].spec)
    return list(ops)


# --------------------------------------------------------------------------- layers


def mark_updated(params) -> None:
    """Give each of ``params`` a new in-place version, after an optimizer step wrote into them: the
    cached GEMM operands (``JetLinear.weight_key``) are keyed on it, and fused AdamW (the trainer's
    on CUDA, ``torch._fused_adamw_``) writes without bumping it. No kernel runs; the bits stay."""
    for p in params:
        torch.autograd.graph.increment_version(p)


class JetLinear(nn.Module):
    """Drop-in ``nn.Linear`` running the flow's precision; shares the original's parameters."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, precision: LinearPrecision):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = weight
        self.bias = bias
        self._cache: dict = {}
        self._wfixed: Operand | None = None
        self._wfixed_version = 0  # bumped when a sync writes into the held operand in place
        self.set_precision(precision)

    @classmethod
    def from_linear(cls, lin: nn.Linear, precision: LinearPrecision) -> "JetLinear":
        return cls(lin.weight, lin.bias, precision)

    def set_precision(self, precision: LinearPrecision) -> None:
        from ..errors import JetrlError
        from .gemm import static_unsupported

        for gname in ("fprop", "dgrad", "wgrad"):
            g: GemmSpec = getattr(precision, gname)
            why = static_unsupported(g.backend, g, gname)
            if why is not None:
                raise JetrlError(f"precision.{gname}: backend {g.backend} {why}")
        self.precision = precision
        self._cache = {}
        self._wfixed = None

    def load_quantized_weight(self, q: Operand, in_place: bool = False) -> None:
        """Use ``q`` (already cast with this layer's fprop weight spec) as the forward's weight, as
        a rollout engine does after a quantized weight sync; ``self.weight`` is no longer read.
        ``in_place``: copy ``q``'s values into the operand already held (and so into any view of it)
        when it has the same kind, shapes and spec, rather than holding ``q``."""
        spec = self.precision.fprop.b
        if getattr(q, "spec", spec) != spec:
            raise ValueError(f"quantized weight has spec {q.spec.short_str()}, layer expects {spec.short_str()}")
        if tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight has shape {tuple(q.shape)}, layer expects "
                             f"{(self.out_features, self.in_features)}")
        if in_place and self._wfixed is not None and copy_operand_(self._wfixed, q):
            self._wfixed_version += 1
        else:
            self._wfixed = q
        self._cache = {}

    def weight_key(self) -> tuple:
        """What the cached operands depend on: the weight's storage and in-place version, the
        precision (by value: an ``id`` of a replaced precision object can be reused by the next one,
        which served a stale operand in another precision) and a loaded quantized weight."""
        w = self.weight
        return (w.data_ptr(), w._version, self.precision, id(self._wfixed), self._wfixed_version)

    def _cached(self, name: str, make):
        key = self.weight_key()
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, make())
            self._cache[name] = hit
        return hit[1]

    def quantized_weight(self) -> Operand:
        """The forward's weight operand, cast once until the weight changes."""
        if self._wfixed is not None:
            return self._wfixed
        return self._cached("fprop", self._make_fprop_weight)

    def _make_fprop_weight(self) -> Operand:
        p = self.precision
        if self.weight.requires_grad and p.dgrad.b == p.fprop.b:  # a trainer's layer: W and W^T in one read
            dev = self.weight.device
            backends = (backend_for(p.fprop, "fprop", dev), backend_for(p.dgrad, "dgrad", dev))
            batch = self.__dict__.get("_cast_batch")
            if batch is not None and _batchable((self,)) is not None:
                tri = kernel_quantizers(self.weight, backends, p.fprop.b)
                pair = None if tri is None else batch.stack(tri, (self,), None, _group_key((self,)))
            else:
                pair = cast_weight_pair(self.weight.detach(), p.fprop.b, backends)
            if pair is not None:
                self._cache["dgrad"] = (self.weight_key(), pair[1])
                return pair[0]
        return weight_operand(self.weight, p.fprop)

    def dgrad_weight(self) -> Operand:
        """Dgrad's operand: W^T (K x N), from the forward's quantized weight when Dgrad uses the
        same weight spec (the 128x128 grid is transpose-symmetric), else cast for Dgrad."""
        p = self.precision

        def make():
            if p.dgrad.b == p.fprop.b:
                w = transpose_operand(self.quantized_weight())
            else:
                w = transpose_operand(weight_operand(self.weight, p.dgrad, "dgrad"))
            if isinstance(w, QTensor) and backend_for(p.dgrad, "dgrad", w.data.device).name == "emulated":
                w = exact_operand(w)  # the form the emulated backend multiplies, made once per weight update
            return w

        self.quantized_weight()  # may have written W^T already, from the same read
        return self._cached("dgrad", make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_group((self,), x, self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {self.precision.short_str()}"
        )


def _group_key(mods) -> tuple:
    key = []
    for m in mods:
        key += (*m.weight_key(), -1 if m.bias is None else (m.bias.data_ptr(), m.bias._version))
    return tuple(key)


def group_weight(mods, owner: nn.Module):
    """The group's fprop weight (concatenated along N) and bias, cached on ``owner``.

    When the weights change (an optimizer step, a weight sync) but not their shapes or precision,
    the new values are copied into the cached tensors: their addresses stay, so a CUDA graph
    captured over them stays valid across steps."""
    key = _group_key(mods)
    hit = owner.__dict__.get("_jet_group_cache")
    if hit is None or hit[0] != key:
        spec = mods[0].precision.fprop
        dev = mods[0].weight.device
        with torch.no_grad():
            w = _stack_dense(mods, spec, None if hit is None else hit[1])
            if w is None:
                w = _stack_fp8(mods, hit, owner, key)
            if w is None:
                w = concat_operands([m.quantized_weight() for m in mods], spec, dev)
            b = None
            if mods[0].bias is not None:  # natively in the GEMM's output dtype (no cast per call)
                b = torch.cat([m.bias.detach() for m in mods])
                b = b.to(spec.out.torch_dtype() if native(b) else torch.float32)
            own = mods[0]._cache.get("fprop") if len(mods) == 1 else None
            if hit is not None and copy_operand_(hit[1], w) and copy_operand_(hit[2], b):
                if own is not None and own[1] is w:  # a one-layer group's weight is its layer's: keep one
                    mods[0]._cache["fprop"] = (own[0], hit[1])
                w, b = hit[1], hit[2]
            if len(mods) > 1:
                _view_into_stack(mods, w)
        hit = (key, w, b)
        owner.__dict__["_jet_group_cache"] = hit
    return hit[1], hit[2]


def _stack_dense(mods, spec: GemmSpec, held: Operand | None) -> torch.Tensor | None:
    """A native dense group's stacked weight (sum N x K), each layer's cast (``dense_cast``: a dtype
    conversion) written straight into its rows -- into ``held``, the stack already cached, when its
    shape and dtype still fit (its address kept). Casting each layer and then concatenating wrote
    and read every weight once more (3.4 GB per update of the 1.5B shape in bf16). None where the
    group's operand is made otherwise: one layer, 8-bit specs, the CPU emulation, a loaded weight."""
    w0 = mods[0].weight
    if (len(mods) < 2 or spec.is_quantized or not native(w0) or exact_dense_spec(spec, "fprop", w0.device)
            or any(m._wfixed is not None for m in mods)):
        return None
    dt = spec.b.format.torch_dtype()
    shape = (sum(m.out_features for m in mods), w0.shape[1])
    fits = isinstance(held, torch.Tensor) and held.shape == shape and held.dtype is dt and held.device == w0.device
    out = held if fits else torch.empty(shape, dtype=dt, device=w0.device)
    start = 0
    for m in mods:
        out[start:start + m.out_features].copy_(m.weight.detach())
        start += m.out_features
    return out


def _stack_fp8(mods, hit, owner: nn.Module, key: tuple) -> QTensor | None:
    """A trainer's FP8 group (128x128 weight blocks, W and W^T from one read: ``cast_weight_pair``'s
    case): W stacked, returned, and W^T side by side, cached as the group's Dgrad operand (``key``:
    the group's, as ``group_dgrad_weight`` checks it), each layer quantized by the Triton kernel
    straight into its rows and columns (``kernels.fp8.quantize_weight_stack``) -- into the operands
    held from before when they still fit. Quantizing each layer and concatenating read and wrote both FP8
    copies once more (3.4 GB per update at the Qwen2.5-1.5B shape). None where the operands are made
    otherwise (the same values): one layer, a loaded weight, a frozen or rollout layer, the
    emulated backend, a layer that is not a whole number of blocks tall before the last one."""
    p = mods[0].precision
    spec, w0 = p.fprop, mods[0].weight
    if (len(mods) < 2 or p.dgrad.b != spec.b or not spec.b.format.is_fp8 or spec.b.block != B128x128
            or any(m._wfixed is not None or not m.weight.requires_grad for m in mods)
            or any(m.out_features % TILE for m in mods[:-1]) or not native(w0)):
        return None
    dev = w0.device
    backends = (backend_for(spec, "fprop", dev), backend_for(p.dgrad, "dgrad", dev))
    if resolve(spec, "fprop", dev).backend == "emulated" or backends[1].name == "emulated":
        return None  # (the emulated backend multiplies the exact form: concat_operands, dgrad_weight)
    tri = kernel_quantizers(w0, backends, spec.b)
    if tri is None:
        return None
    held = owner.__dict__.get("_jet_group_dgrad")
    held = (hit[1], held[1]) if hit is not None and held is not None else None
    batch = mods[0].__dict__.get("_cast_batch")
    if batch is not None and _batchable(mods) is not None:
        w, wt = batch.stack(tri, mods, held, key)
    else:
        w, wt = tri.quantize_weight_stack([m.weight.detach() for m in mods], spec.b.format, spec.b.pow2_scale,
                                          spec.b.amax_floor, transposed=True, held=held)
    owner.__dict__["_jet_group_dgrad"] = (key, wt)
    for m in mods:
        m._cache.pop("dgrad", None)
    return w


def _batchable(mods) -> CastSpec | None:
    """The FP8 128x128 weight spec of a trainer's linear group whose W and W^T the Triton quantizer
    writes (``_stack_fp8``'s case, or one layer's ``cast_weight_pair``), so ``WeightCastBatch`` may
    quantize it with the model's other groups; None for any other group."""
    p = mods[0].precision
    spec = p.fprop.b
    if (p.dgrad.b != spec or not spec.format.is_fp8 or spec.block != B128x128
            or any(m.precision != p or m._wfixed is not None or not m.weight.requires_grad for m in mods)
            or any(m.out_features % TILE for m in mods[:-1]) or (len(mods) > 1 and not native(mods[0].weight))):
        return None
    return spec


class WeightCastBatch:
    """A trainer model's FP8 weight groups (``_batchable``), quantized together.

    An optimizer step changes every weight, and each linear group's forward then quantizes its own
    (W and Dgrad's W^T): at the 1.5B shape 112 groups a step, each a few launches and copies of host
    work. Here the first group to need its weights after a step quantizes, in the same launches
    (``kernels.fp8.quantize_weight_stacks``: two for the whole model), every group of the model it
    has seen whose weights changed too; the others take their results when their forwards reach them
    (``stack``). Results are keyed on the weights' address, version and precision, as the layers'
    own caches are, so a group never takes a result made from other weights: it quantizes again.
    Groups are learnt as they first quantize (the first step is one group at a time). Memory: every
    group's FP8 weights exist from the step's first forward on, as they do by the end of it anyway.
    One per model (``batch_weight_casts``); not for FSDP's sharded weights (gathered layer by layer)."""

    def __init__(self):
        self.groups: dict[tuple, tuple] = {}  # ids of a group's layers -> (layers, _group_key at its last quantization)
        self.ready: dict[tuple, tuple] = {}  # ids -> (key, (W, W^T)): quantized ahead of the group's forward
        self.launches = 0  # calls of the batched quantizer (tests, diagnostics)
        # ids of the groups a CUDA graph quantizes (``rl.train_graphs``: the decoder layers'): batched
        # only with each other, and the others (the eager lm_head) only with the others
        self.graphed: set[tuple] = set()

    def stack(self, tri, mods: tuple, held, key: tuple) -> tuple:
        """``(W, W^T)`` of the group ``mods`` (``held``: its operands to write into, or None; ``key``:
        ``_group_key(mods)``): quantized ahead with the others, or now, with every other known group
        whose weights changed."""
        ids = tuple(map(id, mods))
        got = self.ready.pop(ids, None)
        if got is not None and got[0] == key:
            return got[1]
        spec, p = mods[0].precision.fprop.b, mods[0].precision
        others, graphed = [], ids in self.graphed
        for i, (g, last) in self.groups.items():
            if i != ids and g[0].precision == p and (i in self.graphed) == graphed and _batchable(g) is not None:
                k = _group_key(g)
                if k != last and (i not in self.ready or self.ready[i][0] != k):
                    others.append((i, g, k))
        outs = tri.quantize_weight_stacks([[m.weight.detach() for m in mods]] + [[m.weight.detach() for m in g]
                                                                               for _, g, _ in others],
                                          spec.format, spec.pow2_scale, spec.amax_floor, transposed=True,
                                          helds=[held] + [None] * len(others))
        self.launches += 1
        self.groups[ids] = (mods, key)
        for (i, g, k), out in zip(others, outs[1:]):
            self.groups[i] = (g, k)
            self.ready[i] = (k, out)
        return outs[0]

    def discard(self, mods) -> None:
        """Drop a result made ahead for ``mods`` (their cached weights were released), and count the
        group as changed: the next batch quantizes it too, as its forward would have to."""
        ids = tuple(map(id, mods))
        self.ready.pop(ids, None)
        if ids in self.groups:
            self.groups[ids] = (self.groups[ids][0], None)


def batch_weight_casts(model: nn.Module) -> WeightCastBatch:
    """Quantize ``model``'s trainable FP8 linear groups together after each optimizer step
    (``WeightCastBatch``): the trainer's model, in one process."""
    batch = WeightCastBatch()
    for m in model.modules():
        if isinstance(m, JetLinear) and m.weight.requires_grad:
            m._cast_batch = batch
    return batch


def _native_stack(mods, w) -> bool:
    """Whether ``w`` is a group's stacked native dense (bf16/fp32) weight."""
    return len(mods) > 1 and isinstance(w, torch.Tensor) and native(w)


def _view_into_stack(mods, w: Operand) -> None:
    """Each layer's cached weight becomes its rows of the group's stacked one (native bf16/fp32, or
    8-bit data and scales), so a weight is held once, not twice -- at the 1.5B shape, 0.9 GB of FP8
    gate/up and q/k/v weights held twice through a step. A native dense layer's Dgrad reads its rows
    through a view, too; an 8-bit layer keeps the W^T its quantizer wrote (the group's Dgrad
    operand is made from those)."""
    dense = _native_stack(mods, w)
    if not dense and not (isinstance(w, QTensor) and native(w.data)):
        return
    start = 0
    views = []
    for m in mods:
        part = stack_rows(w, start, m.out_features)
        if part is None:
            return
        views.append(part)
        start += m.out_features
    for m, part in zip(mods, views):
        m._cache["fprop"] = (m.weight_key(), part)
        if dense:
            m._cache.pop("dgrad", None)


def stack_rows(w: Operand, start: int, n: int) -> Operand | None:
    """Rows ``start:start + n`` of a stacked weight operand (a group's, along N) as a view: a dense
    tensor's rows, or a QTensor's with their scales (1-row or 128-row scale blocks, the rows whole
    blocks); None where a scale block would be cut."""
    if isinstance(w, torch.Tensor):
        return w[start:start + n]
    r = w.spec.block.rows if isinstance(w, QTensor) else 0
    if r not in (1, TILE) or start % r or n % r:
        return None
    return QTensor(w.data[start:start + n], w.scale[start // r:(start + n) // r], w.spec)


def group_dgrad_weight(group: "_Group") -> Operand | None:
    """A group's Dgrad operand: the layers' W^T side by side (K x sum N_i), so the group's Dgrad is
    one GEMM over all their outputs, summed in fp32 and rounded once (a transformer's q/k/v and
    gate/up), and dy is cast once, whole, from the same read as Wgrad's copy. A native dense group
    reads the transpose of its stacked weight (a view); any other is the layers' Dgrad operands
    concatenated (``side_by_side``), cached on the group's owner until the weights change, the
    layers' own copies dropped. None where no scale grid spans them all: one GEMM per layer then."""
    mods, w = group.mods, group.weight
    p = mods[0].precision
    if _native_stack(mods, w) and p.dgrad.b == p.fprop.b and not p.dgrad.is_quantized:
        return transpose_operand(w)
    key = _group_key(mods)
    hit = group.owner.__dict__.get("_jet_group_dgrad")
    if hit is None or hit[0] != key:
        with torch.no_grad():
            op = side_by_side([m.dgrad_weight() for m in mods])
        if op is not None:
            for m in mods:
                m._cache.pop("dgrad", None)
        hit = (key, op)
        group.owner.__dict__["_jet_group_dgrad"] = hit
    return hit[1]


def side_by_side(ops: Sequence[Operand]) -> Operand | None:
    """Operands (each R x K_i, K-major) as one operand R x sum(K_i) -- a GEMM summing over all their
    reduction dims --, or None where a scale group would span two of them (every part but the last
    must be a whole number of groups wide) or their scales cover their whole K (per tensor)."""
    first, widths = ops[0], [op.shape[1] for op in ops[:-1]]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(ops), dim=1)
    if isinstance(first, QTensor):
        cols = first.spec.block.cols
        if cols == 0 or any(op.spec != first.spec for op in ops) or any(k % cols for k in widths):
            return None
        return QTensor(torch.cat([op.data for op in ops], 1), torch.cat([op.scale for op in ops], 1), first.spec)
    if isinstance(first, ExactOperand):
        g = first.group
        if any(op.group != g or op.format is not first.format for op in ops) or any(k % g for k in widths):
            return None
        return ExactOperand(torch.cat([op.values for op in ops], 1), torch.cat([op.scales for op in ops], 1), g,
                            first.format)
    return None


def copy_operand_(dst, src) -> bool:
    """Copy ``src``'s values into ``dst`` in place if they have the same kind, shapes, dtypes and
    spec; True if done (or both are None)."""
    if dst is None or src is None:
        return dst is None and src is None
    if dst is src:
        return True
    if isinstance(dst, list):
        return isinstance(src, list) and len(dst) == len(src) and all(copy_operand_(a, b) for a, b in zip(dst, src))
    pairs = {QTensor: ("data", "scale"), ExactOperand: ("values", "scales")}.get(type(dst))
    if pairs is not None:
        if type(src) is not type(dst) or any(getattr(dst, a, None) != getattr(src, a, None)
                                             for a in ("spec", "group", "format")):
            return False
        parts = [(getattr(dst, a), getattr(src, a)) for a in pairs]
    elif isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        parts = [(dst, src)]
    else:
        return False
    if any(d.shape != s.shape or d.dtype != s.dtype or d.device != s.device for d, s in parts):
        return False
    for d, s in parts:
        (d.view(torch.uint8) if d.dtype in _FP8 else d).copy_(s.view(torch.uint8) if s.dtype in _FP8 else s)
    return True


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _uniform(mods) -> bool:
    p, nb = mods[0].precision, mods[0].bias is None
    return all(m.precision == p and (m.bias is None) == nb for m in mods[1:])


_SEPARATE = False


@contextlib.contextmanager
def separate_linears():
    """Run grouped layers one module call each, so forward hooks on every layer fire (diagnostics:
    ``mismatch-report``'s per-layer attribution). Not bitwise the grouped forward on every BLAS."""
    global _SEPARATE
    before, _SEPARATE = _SEPARATE, True
    try:
        yield
    finally:
        _SEPARATE = before


def input_dtype(mods: Sequence["JetLinear"], x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``linear_group(mods, x)`` casts ``x`` to when that cast is a plain conversion (the
    native path, an unscaled input format): a producer may write ``x`` in it directly, saving a
    kernel. None otherwise (8-bit inputs are quantized from the high-precision values), and, with
    autograd, where Dgrad writes another format: x's gradient comes back in x's dtype, and a
    wider Dgrad output than the input's would be rounded to it."""
    a = mods[0].precision.fprop.a
    if not native(x) or a.is_scaled or any(m.precision.fprop.a != a for m in mods[1:]):
        return None
    if torch.is_grad_enabled() and any(m.precision.dgrad.out is not a.format for m in mods):
        return None
    return a.format.torch_dtype()


def linear_group(mods: Sequence["JetLinear"], x: torch.Tensor | None, owner: nn.Module, input_kept: bool = False,
                 x_op: Operand | None = None, x_dtype: torch.dtype | None = None,
                 x_values: torch.Tensor | None = None) -> torch.Tensor:
    """Linear layers reading the same ``x``, outputs concatenated along the last dim.

    The input is cast once and the forward is one GEMM on the concatenated weight (``group_weight``,
    cached on ``owner``), with or without autograd, so training and rollout run the same bits.
    ``input_kept``: the autograd graph already keeps ``x`` itself (an attention output that the
    attention backward needs), so the backward reads it rather than a separate FP8 copy; the
    Wgrad operand is quantized from it in the backward, to the same bits. ``x_op``: x's Fprop
    operand, already made by the kernel that computed x (``fused_input_quantizer``); without
    autograd x may then be None (never written; rows x K, ``x_dtype`` what its dtype would be), and
    the result is 2-D. ``x_values``: x's values where ``x`` is a ``gradient_port`` (which only
    carries x's gradient back, in its dtype)."""
    if _SEPARATE:
        assert x_values is None, "a gradient port is for one group function (see gradient_port)"
        return torch.cat([m(x) for m in mods], dim=-1) if len(mods) > 1 else mods[0](x)
    return _linear_group(tuple(mods), x, owner, input_kept, x_op, x_dtype, x_values)


def gradient_port(mods: Sequence["JetLinear"], x: torch.Tensor) -> torch.dtype | None:
    """The dtype of a gradient port for ``x`` as ``linear_group(mods, ...)``'s or ``gated_mlp``'s
    input, or None for none. Where the group's Dgrad writes x's gradient in a narrower dtype than
    x's (a native FP8 group's bf16 Dgrad output for an fp32 norm output), x's producer may return,
    beside x (then non-differentiable), a port: x's shape in that dtype, one element in memory
    (expanded), never read, passed to the group as its autograd input with ``x_values=x``. x's
    gradient then reaches the producer as the GEMM wrote it; autograd would cast it to x's dtype
    first (a kernel, and a write of the fp32 copy: 4.2 GB per update at 16 x 512 tokens of the 1.5B
    shape). None where the group would not run as one function, or the dtypes agree."""
    mods = tuple(mods)
    if _SEPARATE or not mods or (len(mods) > 1 and not _uniform(mods)) or not native(x) or any_adapter(mods):
        return None
    dt = mods[0].precision.dgrad.out.torch_dtype()
    return dt if dt.itemsize < x.dtype.itemsize else None


def _linear_group(mods: tuple, x: torch.Tensor | None, owner: nn.Module, input_kept: bool = False,
                  x_op: Operand | None = None, x_dtype: torch.dtype | None = None,
                  x_values: torch.Tensor | None = None) -> torch.Tensor:
    if len(mods) > 1 and not _uniform(mods):  # e.g. one layer switched to another precision (attribution)
        assert x_values is None, "a gradient port is for one group function (see gradient_port)"
        return torch.cat([m(x) for m in mods], dim=-1)  # (each module call adds its own adapter)
    needs_grad = torch.is_grad_enabled() and (
        (x is not None and x.requires_grad)
        or any(m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad) for m in mods))
    w, b = group_weight(mods, owner)
    if not needs_grad:
        y = linear_forward(x if x_values is None else x_values, w, b, mods[0].precision.fprop, x_op=x_op,
                           x_dtype=x_dtype)
    else:
        params = [m.weight for m in mods] + [m.bias for m in mods if m.bias is not None]
        y = _LinearGroupFn.apply(x, _Group(mods, w, b, owner, input_kept, x_op, x_values), *params)
    return _add_adapters(mods, x, y) if not _ADAPTERS_OFF and any_adapter(mods) else y


# --------------------------------------------------------------------------- LoRA adapters (models/lora.py)

_ADAPTERS_OFF = False  # within ``adapters_disabled``


def has_adapter(m: nn.Module) -> bool:
    """Whether linear layer ``m`` carries a LoRA adapter (``lora_A`` / ``lora_B`` submodules)."""
    return "lora_A" in m._modules


def any_adapter(mods) -> bool:
    """Whether a layer of ``mods`` carries an adapter. Such a group runs its GEMM on a written input: the
    kernels that hand a layer its input as an FP8 operand only (a norm's, SwiGLU's, decode attention's
    quantizing kernels) and gradient ports are not used for it, on both sides of a flow alike."""
    return any("lora_A" in m._modules for m in mods)


def adapters_are_off() -> bool:
    """Whether this forward runs the base model (inside ``adapters_disabled``)."""
    return _ADAPTERS_OFF


@contextlib.contextmanager
def adapters_disabled():
    """Within: every adapted layer runs without its adapter (the base model: a KL penalty's reference
    policy). The layers run the same unfused forward as with adapters, so the bits are the base's."""
    global _ADAPTERS_OFF
    before, _ADAPTERS_OFF = _ADAPTERS_OFF, True
    try:
        yield
    finally:
        _ADAPTERS_OFF = before


def _add_adapters(mods: tuple, x: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """``y`` (the group's output, its layers' outputs side by side) plus each adapted layer's
    ``scale * B (A x)``, in ``y``'s dtype (PEFT's order of operations: B's output times the scale,
    then added). The group's A matrices run as one GEMM (x read once, as the group's own GEMM reads it),
    each B on its share of that output."""
    assert x is not None, "an adapted layer reads its input (any_adapter keeps the input-only kernels out)"
    adapted = [m for m in mods if has_adapter(m)]
    downs = tuple(m.lora_A for m in adapted)
    z = _linear_group(downs, x, downs[0]).split([a.out_features for a in downs], dim=-1)
    deltas = {id(m): m.lora_B(zi) * m.lora_scale for m, zi in zip(adapted, z)}

    def add(m, yi):
        d = deltas[id(m)]
        return yi + d.reshape(*yi.shape[:-1], d.shape[-1]).to(yi.dtype)

    if len(mods) == 1:
        return add(mods[0], y)
    parts = y.split([m.out_features for m in mods], dim=-1)
    return torch.cat([add(m, yi) if has_adapter(m) else yi for m, yi in zip(mods, parts)], dim=-1)


def fused_input_quantizer(mods: Sequence["JetLinear"], x: torch.Tensor) -> tuple | None:
    """``(kernels.fp8 or kernels.int8, CastSpec)`` where the kernel that computes ``x`` may also write
    its Fprop operand for ``linear_group(mods, x)`` (``x_op``): where the group's input (bf16 or fp32)
    is quantized FP8 1x128, or INT8 with one scale per row, on a kernel backend, by jetrl's Triton
    quantizers (on a GPU, or in the interpreter). The operand is then the quantizer's bit for bit on
    that kernel's x. None otherwise (also for layers run one module call each: ``separate_linears``).
    It depends on nothing a rollout and a trainer of one flow do not share, so both make x the same
    way. (The FP8 module has every such kernel; the INT8 one its RMSNorm quantizer.)"""
    if (_SEPARATE or x.dtype not in (torch.bfloat16, torch.float32) or (len(mods) > 1 and not _uniform(mods))
            or any_adapter(mods)):
        return None
    prec = mods[0].precision
    kernels = _fp8_input_kernels(prec, x) or _int8_input_kernels(prec, x)
    return None if kernels is None else (kernels, prec.fprop.a)


def _int8_input_kernels(prec: LinearPrecision, x: torch.Tensor):
    """``kernels.int8`` where the layer's Fprop input is INT8 with one scale per row on a kernel backend
    (``scaled_mm``, ``triton``) and Triton runs where ``x`` is; else None."""
    a = prec.fprop.a
    if a.format is not Format.INT8 or a.block != Block(1, 0):
        return None
    if backend_for(prec.fprop, "fprop", x.device).name not in ("scaled_mm", "triton"):
        return None
    return int8_kernels_for(x, a)


def _fp8_input_kernels(prec: LinearPrecision, x: torch.Tensor):
    """``kernels.fp8`` where the layer's Fprop input is FP8 in 1x128 groups on a kernel backend
    (``scaled_mm``, ``triton``) and Triton runs where ``x`` is (a GPU, or the interpreter); else None."""
    a = prec.fprop.a
    if not (a.format.is_fp8 and a.block == B1x128):
        return None
    return kernel_quantizers(x, (backend_for(prec.fprop, "fprop", x.device),), a)


@dataclass
class _Group:
    mods: tuple
    weight: object
    bias: torch.Tensor | None
    owner: nn.Module
    input_kept: bool = False
    x_op: Operand | None = None  # x's Fprop operand, made with x (``fused_input_quantizer``)
    x_values: torch.Tensor | None = None  # x's values, where autograd's x is a ``gradient_port``


# --------------------------------------------------------------------------- releasing cached weights

_PENDING: dict | None = None  # within ``releasing_weights``: group owner -> counted forwards not yet backward


@contextlib.contextmanager
def releasing_weights():
    """Within: the cached GEMM weights of each linear group (its bf16 or 8-bit copy of the master
    weight, and Dgrad's W^T) are dropped in the backward, as soon as the backward of the group's
    last forward in the scope has run. The trainer runs an optimizer step's last micro-batch in it:
    the step is about to change the weights, so the caches would be rebuilt anyway, and dropping
    them while the gradients are written keeps the end of the backward -- the step's peak, when every
    gradient is held -- from holding a second copy of the weights (as autocast's casts, which the
    graph frees layer by layer). A forward recomputed inside the backward (a checkpointed chunk of
    logprobs) is not counted: the group's cache stays until its original forwards are done."""
    global _PENDING
    before, _PENDING = _PENDING, {}
    try:
        yield
    finally:
        _PENDING = before


def _count_forward(ctx, owner: nn.Module) -> None:
    """A forward whose backward will run (for ``releasing_weights``); not a recompute in a backward."""
    counted = _PENDING is not None and torch._C._current_graph_task_id() == -1
    ctx.owner = owner if counted else None
    if counted:
        _PENDING[owner] = _PENDING.get(owner, 0) + 1


def _backward_done(ctx) -> None:
    """After a group's backward: drop its cached weights if no counted forward still needs them."""
    owner, ctx.owner = ctx.owner, None
    if owner is None or _PENDING is None or owner not in _PENDING:
        return
    _PENDING[owner] -= 1
    if _PENDING[owner] == 0:
        del _PENDING[owner]
        _release_weights(ctx.mods, owner)
        ctx.dgrad_weight = None


def release_after_backward(layer: "JetLinear") -> None:
    """A backward that read ``layer``'s cached weights outside its own autograd function (the
    trainer's vocabulary-sliced lm_head backward) drops them as ``_backward_done`` would: within
    ``releasing_weights``, unless a counted forward of the layer still needs them."""
    if _PENDING is not None and layer not in _PENDING:
        _release_weights((layer,), layer)


def _release_weights(mods, owner: nn.Module) -> None:
    """Drop a group's cached weight operands (rebuilt from the master weights by the next forward).
    Not for a layer holding a loaded quantized weight (a rollout engine's): that is its only copy; nor
    for frozen layers (LoRA's base weights), which no update makes stale."""
    if any(m._wfixed is not None for m in mods) or not any(m.weight.requires_grad for m in mods):
        return
    batch = mods[0].__dict__.get("_cast_batch")
    if batch is not None:
        batch.discard(mods)
    owner.__dict__.pop("_jet_group_cache", None)
    owner.__dict__.pop("_jet_group_dgrad", None)
    for m in mods:
        m._cache = {}


# --------------------------------------------------------------------------- gradients added where they are held

_INTO_GRADS = False  # within ``grads_in_place``
_WRITE_GRADS = False  # within ``grads_written``
_SUNK: list | None = None  # within ``recording_sinks``: the weights ``grad_sink`` found a gradient to add into
_OPEN_SLOTS = weakref.WeakValueDictionary()  # id(tied weight) -> its newest ``RowGradSlot``


@contextlib.contextmanager
def grads_in_place():
    """Within: a backward adds each ``JetLinear``'s weight gradient, and an untied token embedding's
    rows (``models.llama._EmbedRows``), into the ``.grad`` the weight already holds, and hands
    autograd none for it -- for a trainer's micro-batches after the first of an optimizer step.

    Autograd would receive the micro-batch's gradient as a tensor of its own and add it into
    ``.grad``: the GEMM writes it, the add reads it and ``.grad`` and writes ``.grad``. A native dense
    Wgrad GEMM (``accumulate_gemm``) adds into ``.grad`` in its epilogue instead: every weight's fp32
    gradient is read and written once, not written, read twice and written (at the Qwen2.5-1.5B
    shape 12.3 GB per micro-batch instead of 24.7). A product the GEMM cannot add into its output
    (an FP8 ``_scaled_mm``'s) is added as autograd adds it. An untied embedding adds its tokens'
    summed rows into ``.grad`` instead of returning a vocab x hidden gradient (a zero-fill, the
    rows, then the add). Megatron's ``gradient_accumulation_fusion`` and Transformer Engine's
    ``fuse_wgrad_accumulation`` do this.

    Where ``grad_sink`` finds nothing to add into (no ``.grad`` yet, a gradient hook on the weight,
    a distributed tensor, a backward that builds a graph, a tied weight whose embedding rows are
    still to be added into the lm_head's gradient), the gradient goes to autograd as outside. The
    sums are autograd's: ``.grad`` plus the micro-batch's product, rounded once (bit for bit on CPU;
    on a GPU cuBLAS may add in its epilogue in another order), and an untied embedding's token sums
    (``models.llama._token_sums``)."""
    global _INTO_GRADS
    before, _INTO_GRADS = _INTO_GRADS, True
    try:
        yield
    finally:
        _INTO_GRADS = before


@contextlib.contextmanager
def grads_written():
    """Within (and within ``grads_in_place``): the tensor ``grad_sink`` hands out is *written* with the
    gradient, not added to -- its old values are never read (``sink_overwrites``). For a backward
    whose weight gradients are the first terms of their sums while ``.grad`` holds stale values (the
    trainer's CUDA graphs, ``rl.train_graphs``, keep each layer's ``.grad`` at one address, so it is
    not dropped between optimizer steps): the zero-fill before it and the read of those zeros go,
    and an FP8 Wgrad GEMM, whose product cannot be added in its epilogue, writes straight into
    ``.grad`` (``precision.gemm.accumulate_gemm``) instead of into a product that an add then reads.
    Gradients autograd adds itself (no sink: a norm's weight, a bias) must be zeroed by the caller."""
    global _WRITE_GRADS
    before, _WRITE_GRADS = _WRITE_GRADS, True
    try:
        yield
    finally:
        _WRITE_GRADS = before


def sink_overwrites() -> bool:
    """Whether a tensor from ``grad_sink`` is to be written, not added to (``grads_written``)."""
    return _WRITE_GRADS


@contextlib.contextmanager
def recording_sinks():
    """Within: yields a list that collects each weight ``grad_sink`` hands a gradient tensor for (the
    weights whose gradients a backward writes or adds itself; autograd adds the others')."""
    global _SUNK
    before, _SUNK = _SUNK, []
    try:
        yield _SUNK
    finally:
        _SUNK = before


def grad_sink(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Within ``grads_in_place``: the tensor to add the stacked gradient of ``weights`` (their rows one
    after another) into -- a weight's ``.grad``, or one view of several that lie back to back in one
    buffer, as the gradients of a group's first backward do (autograd keeps the slices of the
    group's one Wgrad result as its layers' ``.grad``); else None. None too for a tied weight whose
    ``RowGradSlot`` is open: the embedding adds its rows into the lm_head's gradient before autograd
    adds that into ``.grad``, and the sum keeps autograd's order."""
    if not _INTO_GRADS or torch.is_grad_enabled() or not weights:
        return None
    grads = []
    for w in weights:
        g, slot = w.grad, _OPEN_SLOTS.get(id(w))
        if (g is None or g.dtype is not w.dtype or g.shape != w.shape or not g.is_contiguous()
                or is_traceable_wrapper_subclass(w) or is_traceable_wrapper_subclass(g)
                or w._backward_hooks or getattr(w, "_post_accumulate_grad_hooks", None)
                or (slot is not None and slot.open and slot.weight is w)):
            return None
        grads.append(g)
    first = grads[0]
    if len(grads) == 1:
        return _sunk(weights, first)
    if not back_to_back(grads):
        return None
    cols = first.shape[1]
    return _sunk(weights, first.as_strided((sum(g.shape[0] for g in grads), cols), (cols, 1)))


def back_to_back(ts: Sequence[torch.Tensor | None]) -> bool:
    """Whether ``ts`` are contiguous matrices of one width lying one after another in one buffer (a
    group's stacked gradient, as ``grad_sink`` hands it out)."""
    if not ts or any(t is None or t.dim() != 2 or not t.is_contiguous() for t in ts):
        return False
    first = ts[0]
    at, store = first.storage_offset(), first.untyped_storage()._cdata
    for t in ts:
        if t.shape[1] != first.shape[1] or t.untyped_storage()._cdata != store or t.storage_offset() != at:
            return False
        at += t.numel()
    return True


def _sunk(weights: Sequence[torch.Tensor], into: torch.Tensor) -> torch.Tensor:
    if _SUNK is not None:
        _SUNK.extend(weights)
    return into


# --------------------------------------------------------------------------- one weight gradient, many forwards

_WGRAD_SUMS: dict | None = None  # within ``summing_wgrad``: id(weight) -> its WgradSum


class WgradSum:
    """One layer's weight gradient over the several forwards of one backward (the trainer's logprob
    chunks each run the lm_head). Each forward's Wgrad GEMM adds into one buffer in the weight's
    dtype (``accumulate_gemm``: natively an ``addmm`` into it), and the backward of the last of those
    forwards hands autograd the sum; the others hand it none. So no forward writes a weight-sized
    gradient of its own (vocab x hidden fp32 for the lm_head: 0.93 GB at a 152K vocabulary and 1536
    hidden), and autograd receives one gradient for the weight, as from a single GEMM."""

    def __init__(self, weight: torch.Tensor, rows: "RowGradSlot | None" = None):
        self.weight = weight
        self.pending = 0  # counted forwards whose backward has not run
        self.acc: torch.Tensor | None = None
        self.in_grad = False  # the sum is the weight's ``.grad`` (``grad_sink``): autograd gets none
        self.rows = rows

    def add(self, a: Operand, b: Operand, spec: GemmSpec, device) -> torch.Tensor | None:
        write = False
        if self.acc is None:
            self.acc = grad_sink([self.weight])
            self.in_grad = self.acc is not None
            write = self.in_grad and _WRITE_GRADS  # the first term written into a stale .grad
        self.acc = accumulate_gemm(self.acc, a, b, spec, "wgrad", device, self.weight.dtype, overwrite=write)
        self.pending -= 1
        if self.pending > 0:
            return None
        out, self.acc = self.acc, None
        if self.rows is not None:
            self.rows.put(self.weight, out)
        return None if self.in_grad else out


class RowGradSlot:
    """Hands a tied weight's gradient from the lm_head's backward to the token embedding's, which
    adds its rows into it in place (``models.llama._EmbedRows``) instead of returning a dense
    vocab x hidden gradient for autograd to add (a zero-fill, then a read of both and a write:
    3.7 GB at a 152K x 1536 fp32 embedding).

    One slot per training forward of a model with tied embeddings, made by the embedding's forward.
    The lm_head's backward ``put``s the weight gradient it hands autograd; the embedding's backward,
    which runs later in the same pass (the embedding is the graph's first op), ``take``s it. Until
    autograd's sum of the two is handed on, nothing else reads that gradient. Taken once: a second
    backward through the same graph, or a head whose backward does not put one, gets the dense
    gradient."""

    __slots__ = ("weight", "grad", "open", "__weakref__")

    def __init__(self, weight: torch.Tensor):
        self.weight, self.grad, self.open = weight, None, True
        _OPEN_SLOTS[id(weight)] = self

    def put(self, weight: torch.Tensor, grad: torch.Tensor | None) -> None:
        if self.open and weight is self.weight and grad is not None and grad.shape == weight.shape:
            self.grad = grad

    def take(self) -> torch.Tensor | None:
        grad, self.grad, self.open = self.grad, None, False
        return grad


@contextlib.contextmanager
def summing_wgrad(mod: "JetLinear", rows: RowGradSlot | None = None):
    """Within: each autograd forward of ``mod`` (a single layer, as the lm_head runs) adds its weight
    gradient into one ``WgradSum``, handed to autograd by the last of their backwards (and ``put``
    into ``rows``, a tied embedding's slot, when given). Every such forward's backward must run in
    one backward pass (the forwards feed one output), or the sum is not handed on."""
    global _WGRAD_SUMS
    before = _WGRAD_SUMS
    _WGRAD_SUMS = dict(before or {})
    if mod.weight.requires_grad:
        _WGRAD_SUMS[id(mod.weight)] = WgradSum(mod.weight, rows)
    try:
        yield
    finally:
        _WGRAD_SUMS = before


def _wgrad_sum(mods: tuple) -> WgradSum | None:
    """The ``WgradSum`` a forward of ``mods`` adds into, counted; not for a forward recomputed in a
    backward (a checkpoint's)."""
    if not _WGRAD_SUMS or len(mods) != 1 or torch._C._current_graph_task_id() != -1:
        return None
    box = _WGRAD_SUMS.get(id(mods[0].weight))
    if box is not None:
        box.pending += 1
    return box


def _wgrad_operand_of_input(x2: torch.Tensor, spec: GemmSpec, device) -> Operand:
    """x^T as Wgrad's operand b (K x tokens, groups along tokens)."""
    return _transposed_cast(x2, spec.b, spec, device)


def _transposed_cast(t: torch.Tensor, cast: CastSpec, spec: GemmSpec, device) -> Operand:
    """``t`` (tokens x F) cast with groups along tokens, as the K-major operand of ``t.T``."""
    be = backend_for(spec, "wgrad", device)
    return cast_pair(t, None, cast, (be, be))[1]


def _dgrad_weight(ctx, mods: tuple) -> Operand | None:
    """The group's Dgrad operand (W^T of all its layers), None where one GEMM per layer is needed."""
    return mods[0].dgrad_weight() if len(mods) == 1 else getattr(ctx, "dgrad_weight", None)


def _linear_backward(ctx, mods: tuple, gy2: torch.Tensor | None, x_dtype, need_x: bool, need_w: list, need_b: list,
                     x_operand, wsum: WgradSum | None = None, gy_ops: tuple | None = None) -> tuple:
    """Dgrad, Wgrad and bias gradients of a group of linears for ``gy2`` (tokens x sum(N_i)).
    ``x_operand(gx)``: Wgrad's operand b (x^T, K x tokens), fetched only if a weight needs a grad,
    after Dgrad (``gx``: its result, or None), so a kernel may make it with the next gradient.
    ``wsum``: a single layer's Wgrad is added into it (``WgradSum``) rather than returned alone.
    ``gy_ops``: dy's Dgrad and Wgrad operands (those ``cast_pair`` makes), already made by the kernel
    that computed dy; ``gy2`` is then None, and the group has a Dgrad operand and no bias."""
    prec: LinearPrecision = mods[0].precision
    dg, wg = prec.dgrad, prec.wgrad
    wt = _dgrad_weight(ctx, mods) if need_x else None
    if gy_ops is not None:
        gy_rows, gy_t = gy_ops
        dev = (gy_rows if gy_rows is not None else gy_t).data.device
        assert not any(need_b) and (wt is not None or not need_x), "dy's operands serve one Dgrad GEMM, no bias"
    else:
        dev = gy2.device
        be_d, be_w = backend_for(dg, "dgrad", dev), backend_for(wg, "wgrad", dev)
        # dy's Dgrad and Wgrad operands from one read of dy (Dgrad's: unless one GEMM per layer)
        gy_rows, gy_t = cast_pair(gy2, dg.a if wt is not None else None, wg.a if any(need_w) else None,
                                  (be_d, be_w))
    sizes = [m.out_features for m in mods]

    def parts():  # dy's share of each layer (high precision: where no operand was made from all of dy)
        return gy2.split(sizes, dim=1) if len(mods) > 1 else (gy2,)

    gx = None
    if wt is not None:
        gx = finish(run_gemm(gy_rows, wt, dg, "dgrad", dev), dg.out, x_dtype)
    elif need_x:  # no operand spans the group's weights: a GEMM per layer, the results added
        be_d = backend_for(dg, "dgrad", dev)
        for m, g in zip(mods, parts()):
            part = finish(run_gemm(cast_operand(g, dg.a, be_d), m.dgrad_weight(), dg, "dgrad", dev), dg.out, x_dtype)
            gx = part if gx is None else gx + part
    grads_w = [None] * len(mods)
    if any(need_w):
        sink = None if wsum is not None or not all(need_w) else grad_sink([m.weight for m in mods])
        if wsum is not None:
            grads_w = [wsum.add(gy_t, x_operand(gx), wg, dev)]
        elif sink is not None:  # added (or written) where autograd keeps the weights' gradients: it gets none
            accumulate_gemm(sink, gy_t, x_operand(gx), wg, "wgrad", dev, sink.dtype, overwrite=_WRITE_GRADS)
        else:
            gw = finish(run_gemm(gy_t, x_operand(gx), wg, "wgrad", dev), wg.out, mods[0].weight.dtype)
            grads_w = list(gw.split(sizes, dim=0)) if len(mods) > 1 else [gw]
    grads_b = [None] * len(need_b)
    if any(need_b):
        grads_b = [g.sum(0, dtype=torch.float32).to(m.bias.dtype) if need else None  # no fp32 copy of g
                   for m, g, need in zip(mods, parts(), need_b)]
    return gx, grads_w, grads_b


def _save_operands(ctx, *ops: Operand) -> None:
    """Save Wgrad operands through autograd (so saved-tensor hooks see their bytes)."""
    ctx.q_specs = [op.spec if isinstance(op, QTensor) else None for op in ops]
    ctx.save_for_backward(*[t for op in ops for t in ((op.data, op.scale) if isinstance(op, QTensor) else (op,))])


def _saved_operands(ctx) -> list:
    saved, out = iter(ctx.saved_tensors), []
    for spec in ctx.q_specs:
        out.append(QTensor(next(saved), next(saved), spec) if spec is not None else next(saved))
    return out


def _group_forward(st, x2: torch.Tensor, group: _Group, needs_x_grad: bool) -> tuple:
    """A linear group's forward with autograd (``_LinearGroupFn``'s, and the gate/up projections' of
    ``_GatedMLPFn``): ``(y, the Wgrad operand to save)``, its backward's state put on ``st``."""
    mods = group.mods
    prec: LinearPrecision = mods[0].precision
    st.mods, st.x_dtype = mods, x2.dtype  # (a port's: x's gradient is written in it)
    if group.x_values is not None:
        x2 = group.x_values.reshape(-1, x2.shape[-1])
    _count_forward(st, group.owner)
    st.wgrad_sum = _wgrad_sum(mods)
    st.dgrad_weight = group_dgrad_weight(group) if len(mods) > 1 and needs_x_grad else None
    st.fp8_saved = prec.save_fp8_activations and not group.input_kept
    xa = group.x_op
    if st.fp8_saved:  # Fprop's operand and the saved FP8 x^T (groups along tokens), from one read of x
        dev = x2.device
        rows, xt = cast_pair(x2, prec.fprop.a if xa is None else None, prec.wgrad.b,
                             (backend_for(prec.fprop, "fprop", dev), backend_for(prec.wgrad, "wgrad", dev)))
        return linear_forward(x2, group.weight, group.bias, prec.fprop, x_op=rows if xa is None else xa), xt
    y = linear_forward(x2, group.weight, group.bias, prec.fprop, x_op=xa)
    wb = prec.wgrad.b
    return y, x2 if wb.is_scaled or wb.format is Format.FP32 or not native(x2) else x2.to(wb.format.torch_dtype())


def _group_backward(st, saved: Operand, gy2: torch.Tensor | None, need_x: bool, need_w: list, need_b: list,
                    gy_ops: tuple | None = None) -> tuple:
    """The backward of ``_group_forward`` from the operand it saved: ``(gx, weight grads, bias grads)``."""
    mods = st.mods

    def x_operand(_gx):
        return saved if st.fp8_saved else _wgrad_operand_of_input(saved, mods[0].precision.wgrad, saved.device)

    out = _linear_backward(st, mods, gy2, st.x_dtype, need_x, need_w, need_b, x_operand, st.wgrad_sum, gy_ops)
    st.wgrad_sum = None
    _backward_done(st)
    return out


class _LinearGroupFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: _Group, *params):
        y, saved = _group_forward(ctx, x.reshape(-1, x.shape[-1]), group, ctx.needs_input_grad[0])
        _save_operands(ctx, saved)
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        n = len(ctx.mods)
        need = ctx.needs_input_grad
        gx, grads_w, grads_b = _group_backward(ctx, _saved_operands(ctx)[0], gy.reshape(-1, gy.shape[-1]), need[0],
                                               list(need[2:2 + n]), list(need[2 + n:]))
        return (None if gx is None else gx.reshape(ctx.x_shape), None, *grads_w, *grads_b)


# --------------------------------------------------------------------------- swiglu


@fused
def _swiglu_math(gu: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``g / (1 + exp(-g)) * u`` in fp32, returned in ``out_dtype`` (default ``gu``'s). torch's fused
    silu rounds its scalar tail differently from its vector body on CPU; this form keeps a row's
    result independent of the batch."""
    g, u = (h if h.dtype in (torch.float32, torch.float64) else h.float()  # fp64: gradient checks
            for h in gu.chunk(2, dim=-1))  # halves cast one by one: no fp32 copy of the whole gu
    return _silu_mul(g, u, out_dtype or gu.dtype)


def _silu_mul(g: torch.Tensor, u: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    y = g / (1 + torch.exp(-g)) * u
    return y if y.dtype is out_dtype else y.to(out_dtype)


@fused
def _swiglu_grad(gu: torch.Tensor, gy: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """d(silu(g) * u) for ``gu = [g, u]`` (fp32 math), in ``out_dtype`` (default: the math's). Each
    half is cast before they are joined, so a fused kernel writes the bf16 gradient directly (no
    fp32 tensor of the whole ``gu`` to write, read back and cast: at 16 x 1024 tokens of an 8B MLP
    that one is 1.9 GB per layer), and op by op the fp32 halves are never joined; the values are
    the same bits as the fp32 result cast afterwards."""
    dt = torch.float64 if gu.dtype is torch.float64 else torch.float32
    g, u = (h.to(dt) for h in gu.chunk(2, dim=-1))
    return _silu_mul_grad(g, u, gy.to(dt), out_dtype or dt)


def _silu_mul_grad(g: torch.Tensor, u: torch.Tensor, gy: torch.Tensor, od: torch.dtype) -> torch.Tensor:
    sig = 1 / (1 + torch.exp(-g))
    return torch.cat([(gy * u * sig * (1 + g * (1 - sig))).to(od), (gy * g * sig).to(od)], dim=-1)


def _halves_values(data: torch.Tensor, scale: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values of the two halves (g, u) of an 8-bit ``gu`` in 1 x ``cols`` groups; each half
    dequantized on its own where the groups split between them (an intermediate size a multiple of
    ``cols``, as in every released model), so a fused kernel holds no fp32 ``gu`` either."""
    half = data.shape[1] // 2
    if half % cols == 0 and 2 * half == data.shape[1]:
        n = half // cols
        return (block_values(data[:, :half], scale[:, :n], 1, cols),
                block_values(data[:, half:], scale[:, n:], 1, cols))
    g, u = block_values(data, scale, 1, cols).chunk(2, dim=-1)
    return g, u


@fused
def _swiglu_math_fp8(data: torch.Tensor, scale: torch.Tensor, cols: int, gu_dtype: torch.dtype,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``_swiglu_math`` of an FP8 copy of ``gu`` (1 x ``cols`` groups), its values rounded to
    ``gu_dtype`` first as the forward's ``gu`` was. Fused on a GPU: the copy is dequantized in
    registers, and no tensor of ``gu``'s size is written."""
    g, u = (h.to(gu_dtype).float() for h in _halves_values(data, scale, cols))
    return _silu_mul(g, u, out_dtype)


@fused
def _swiglu_grad_fp8(data: torch.Tensor, scale: torch.Tensor, cols: int, gy: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``_swiglu_grad`` at the fp32 values of an FP8 copy of ``gu``, dequantized in the same kernel."""
    g, u = _halves_values(data, scale, cols)
    return _silu_mul_grad(g, u, gy.float(), out_dtype)


def swiglu(gu: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``silu(g) * u`` for ``gu = [g, u]`` (concatenated along the last dim), in ``out_dtype``
    (default ``gu``'s); the forward is the same ops with or without autograd, and the backward keeps
    ``gu`` alone (not the intermediates autograd would)."""
    if torch.is_grad_enabled() and gu.requires_grad:
        return _SwiGLUFn.apply(gu, out_dtype)
    return _swiglu_math(gu, out_dtype)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, out_dtype):
        ctx.save_for_backward(gu)
        return _swiglu_math(gu, out_dtype)

    @staticmethod
    def backward(ctx, gy):
        (gu,) = ctx.saved_tensors
        return _swiglu_grad(gu, gy, gu.dtype), None


def swiglu_down(gu: torch.Tensor, down: "JetLinear") -> torch.Tensor:
    """``down(silu(g) * u)``, the end of a gated MLP.

    With ``save_fp8_activations`` (DeepSeek-V3's recipe) the backward keeps only an FP8 copy of the
    SwiGLU input ``gu`` (1x128 groups, the Fprop input's format) and recomputes from it both the
    SwiGLU gradient and ``down``'s Wgrad operand (its input, quantized in 128x1 groups); otherwise
    ``gu`` and ``down``'s input are kept as usual. When ``down`` quantizes its input to 8 bits, it
    quantizes the fp32 SwiGLU output, never a bf16-rounded copy, whose amax (hence scales) differ;
    where jetrl's Triton kernels run that input (FP8, 1x128) is made from ``gu`` by one kernel
    (``kernels.fp8.swiglu_quantize``, with gu's FP8 copy from the same read when it is kept), and
    then by it in every forward, the rollout's and the trainer's alike (``_swiglu_kernel``)."""
    prec = down.precision
    if has_adapter(down):  # the adapter reads down's input, written
        return linear_group((down,), swiglu(gu, torch.float32 if prec.fprop.a.is_scaled else None), down)
    save = swiglu_save_spec(prec)
    gu2 = gu.reshape(-1, gu.shape[-1])
    kernel = None if _SEPARATE else _swiglu_kernel(gu2, prec)
    params = [down.weight] + ([down.bias] if down.bias is not None else [])
    track = torch.is_grad_enabled() and (gu.requires_grad or any(p.requires_grad for p in params))
    if kernel is None and (save is None or _SEPARATE or not (track and gu.requires_grad)):
        h_dtype = torch.float32 if prec.fprop.a.is_scaled else None
        return linear_group((down,), swiglu(gu, h_dtype), down)
    group = _Group((down,), *group_weight((down,), down), down)
    if not track:
        y = _swiglu_down_by_kernel(kernel, gu2, group, False)[0]
        return y.reshape(*gu.shape[:-1], y.shape[-1])
    return _SwiGLUDownFn.apply(gu, group, save, kernel, *params)


def _swiglu_down_by_kernel(kernel, gu2: torch.Tensor, group: "_Group", keep: bool) -> tuple:
    """``down`` of SwiGLU(gu) with down's FP8 input made by ``kernel.swiglu_quantize`` (h never
    written in fp32), and with ``keep`` gu's FP8 copy from the same read: ``(y, copy or None)``."""
    fprop = group.mods[0].precision.fprop
    a = fprop.a
    h_op, kept = kernel.swiglu_quantize(gu2, a.format, a.pow2_scale, a.amax_floor, save=keep)
    return linear_forward(None, group.weight, group.bias, fprop, x_op=h_op, x_dtype=torch.float32), kept


def _swiglu_kernel(gu: torch.Tensor, prec: LinearPrecision):
    """``kernels.fp8`` (or ``kernels.int8``) where its ``swiglu_quantize`` makes down's input from ``gu``
    (rows x 2I): as ``_fp8_input_kernels`` (``_int8_input_kernels``), for a ``gu`` the kernel takes --
    FP8: halves of whole 128-wide groups; INT8: an even width -- else None. It depends on nothing a
    rollout and a trainer of one flow do not share, so both compute h the same way."""
    fp8 = _fp8_input_kernels(prec, gu)
    if fp8 is None:
        int8 = _int8_input_kernels(prec, gu)
        return int8 if int8 is not None and gu.dim() == 2 and gu.shape[-1] % 2 == 0 else None
    if gu.shape[-1] % (2 * TILE):
        return None
    return fp8 if fp8.unsupported(gu, prec.fprop.a.format, prec.fprop.a.amax_floor) is None else None


def _swiglu_t_kernel(q, gu_dtype: torch.dtype, wg: GemmSpec):
    """``kernels.fp8`` where ``swiglu_quantize_t`` makes down's Wgrad operand from the saved FP8 copy
    ``q`` of [g, u] as ``cast_pair`` would make it from h (Triton's 128x1 quantizer on a kernel
    backend, where Triton runs); else None."""
    b = wg.b
    if not (isinstance(q, QTensor) and q.spec.block == B1x128 and b.format.is_fp8
            and b.block == B128x1 and gu_dtype in (torch.bfloat16, torch.float32)
            and q.data.shape[-1] % (2 * TILE) == 0 and q.data.stride(-1) == 1):
        return None
    return kernel_quantizers(q.data, (backend_for(wg, "wgrad", q.data.device),), b)


def _swiglu_down_forward(st, gu2: torch.Tensor, group: _Group, save: CastSpec | None, kernel) -> tuple:
    """``down(silu(g) * u)`` with autograd (``_SwiGLUDownFn``'s, and ``_GatedMLPFn``'s end): ``(y, what
    the backward keeps of gu: its FP8 copy, or gu)``, the backward's state put on ``st``."""
    prec: LinearPrecision = group.mods[0].precision
    kept = None  # gu's FP8 copy for the backward, when the kernel made it
    if kernel is not None:  # ``_swiglu_kernel``'s choice, the rollout's too
        # batch-invariant: the rollout's form of the kernel (no copy: it is cast on its own below), so
        # the rollout, the trainer's scoring and this forward run one compiled kernel
        keep = save == prec.fprop.a and prec.fprop.backend != "invariant"
        y, kept = _swiglu_down_by_kernel(kernel, gu2, group, keep)
    else:
        y = linear_forward(_swiglu_math(gu2, torch.float32), group.weight, group.bias, prec.fprop)
    if save is None:
        kept = gu2
    elif kept is None:
        kept = cast_operand(gu2, save, backend_for(prec.fprop, "fprop", gu2.device))
    st.mods, st.gu_dtype = group.mods, gu2.dtype
    _count_forward(st, group.owner)
    return y, kept


def _swiglu_down_backward(st, q: Operand, gy2: torch.Tensor, need_gu: bool, need_w: list, need_b: list,
                          dgu_casts: tuple | None = None) -> tuple:
    """The backward of ``_swiglu_down_forward`` from what it kept of gu (``q``): ``(d[g, u], down's weight
    grads, bias grads)``. ``dgu_casts = (kernels.fp8, rows, cols)``: d[g, u] is returned as the gate/up
    projections' Dgrad and Wgrad operands (``rows``, ``cols``: their casts, either None when not
    needed), made by ``swiglu_grad_quantize`` from ``q`` (an FP8 copy) without writing d[g, u]; where
    down's Wgrad operand h^T has those casts' format and scaling, the same kernel makes it too, after
    down's Dgrad (one read of the copy, not two)."""
    mods = st.mods
    wg = mods[0].precision.wgrad
    kernel = _swiglu_t_kernel(q, st.gu_dtype, wg)
    b = wg.b
    with_h = None  # d[g, u]'s operands, when made with h^T
    joint = False  # whether h^T is made with them
    if need_gu and dgu_casts is not None:
        fp8, rows, cols = dgu_casts
        c = rows or cols
        grad_casts = dict(fmt=c.format, pow2_scale=c.pow2_scale, amax_floor=c.amax_floor, rows=rows is not None,
                          cols=cols is not None, pad_tokens_to=TILE)
        joint = kernel is not None and (b.format, b.pow2_scale, b.amax_floor) == (c.format, c.pow2_scale, c.amax_floor)
    if kernel is not None:  # down's Wgrad operand h^T straight from the FP8 copy: h never written

        def x_operand(gh):
            nonlocal with_h
            if joint:  # with d[g, u]'s operands, from one read of the copy (Dgrad has made gh)
                *with_h, h_t = fp8.swiglu_grad_quantize(q, gh, st.gu_dtype, h_cols=True, **grad_casts)
                return h_t
            return kernel.swiglu_quantize_t(q, st.gu_dtype, b.format, b.pow2_scale, b.amax_floor, TILE)
    else:
        if isinstance(q, QTensor):  # the FP8 copy of gu (rows x 2I, 1x128 groups), never dequantized whole
            h = _swiglu_math_fp8(q.data, q.scale, q.spec.block.cols, st.gu_dtype, torch.float32)
        else:
            h = _swiglu_math(q, torch.float32)

        def x_operand(_gh):  # down's input, as the forward has it
            return _wgrad_operand_of_input(h, wg, gy2.device)
    gh, grads_w, grads_b = _linear_backward(st, mods, gy2, torch.float32, need_gu, need_w, need_b, x_operand)
    _backward_done(st)
    dgu = None
    if need_gu and dgu_casts is not None:
        dgu = tuple(with_h) if with_h is not None else fp8.swiglu_grad_quantize(q, gh, st.gu_dtype, **grad_casts)[:2]
    elif need_gu:
        if isinstance(q, QTensor):
            dgu = _swiglu_grad_fp8(q.data, q.scale, q.spec.block.cols, gh, st.gu_dtype)
        else:
            dgu = _swiglu_grad(q, gh, st.gu_dtype)
    return dgu, grads_w, grads_b


class _SwiGLUDownFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, group: _Group, save: CastSpec | None, kernel, *params):
        y, kept = _swiglu_down_forward(ctx, gu.reshape(-1, gu.shape[-1]), group, save, kernel)
        _save_operands(ctx, kept)
        ctx.gu_shape = gu.shape
        return y.reshape(*gu.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        need = ctx.needs_input_grad
        dgu, grads_w, grads_b = _swiglu_down_backward(ctx, _saved_operands(ctx)[0], gy.reshape(-1, gy.shape[-1]),
                                                      need[0], [need[4]], list(need[5:]))
        return (None if dgu is None else dgu.reshape(ctx.gu_shape), None, None, None, *grads_w, *grads_b)


def gated_mlp(mods: Sequence["JetLinear"], x: torch.Tensor | None, owner: nn.Module, down: "JetLinear",
              x_op: Operand | None = None, x_dtype: torch.dtype | None = None,
              x_values: torch.Tensor | None = None) -> torch.Tensor:
    """A gated MLP: ``swiglu_down(linear_group(mods, x, owner, x_op=x_op, x_dtype=x_dtype), down)``,
    ``mods`` the gate and up projections (their outputs [g, u]).

    The same bits in every case. In training with ``save_fp8_activations``, where the gate/up
    projections' Dgrad and Wgrad cast their dy FP8 1x128 and 128x1 by jetrl's Triton quantizer, the
    two are one autograd function whose backward writes the SwiGLU gradient d[g, u] straight into
    those operands (``kernels.fp8.swiglu_grad_quantize``, from the FP8 copy of [g, u] and down's
    input gradient): d[g, u] is never written in bf16 to be read back by the quantizer (0.6 GB of
    traffic per layer at 16 x 512 tokens of the 1.5B shape)."""
    mods = tuple(mods)
    casts = None if x is None else _dgu_casts(mods, down, x)
    if casts is None:
        return swiglu_down(linear_group(mods, x, owner, x_op=x_op, x_dtype=x_dtype, x_values=x_values), down)
    gate = _Group(mods, *group_weight(mods, owner), owner, x_op=x_op, x_values=x_values)
    down_group = _Group((down,), *group_weight((down,), down), down)
    params = [m.weight for m in mods] + [down.weight] + ([down.bias] if down.bias is not None else [])
    return _GatedMLPFn.apply(x, gate, down_group, casts, *params)


def _dgu_casts(mods: tuple, down: "JetLinear", x: torch.Tensor) -> tuple | None:
    """``(kernels.fp8, Dgrad's cast, Wgrad's cast)`` of the gate/up projections' dy where ``gated_mlp``
    runs as one autograd function (the backward writes those operands from the SwiGLU gradient's
    registers), else None: with autograd, ``save_fp8_activations`` (the FP8 copy of [g, u] the kernel
    reads), no gate/up bias, [g, u] whole 128-wide groups, and where ``cast_pair`` would quantize dy
    with Triton's ``quantize_act`` (``one_read_pair``)."""
    if (_SEPARATE or not mods or not _uniform(mods) or mods[0].bias is not None or not torch.is_grad_enabled()
            or any_adapter((*mods, down))):
        return None
    if not (x.requires_grad or any(m.weight.requires_grad for m in mods)):
        return None
    prec: LinearPrecision = mods[0].precision
    if swiglu_save_spec(down.precision) is None or sum(m.out_features for m in mods) % (2 * TILE):
        return None
    dg, wg = prec.dgrad, prec.wgrad
    if not one_read_pair(dg.a, wg.a):
        return None
    fp8 = kernel_quantizers(x, (backend_for(dg, "dgrad", x.device), backend_for(wg, "wgrad", x.device)), dg.a)
    return None if fp8 is None else (fp8, dg.a, wg.a)


class _GatedMLPFn(torch.autograd.Function):
    """``gated_mlp`` with autograd: the gate/up projections' ``_LinearGroupFn`` and ``_SwiGLUDownFn`` in
    one function, so that the SwiGLU gradient reaches the gate/up GEMMs as their FP8 operands."""

    @staticmethod
    def forward(ctx, x, gate: _Group, down: _Group, casts: tuple, *params):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.gate, ctx.down = _State(), _State()
        gu2, x_saved = _group_forward(ctx.gate, x2, gate, ctx.needs_input_grad[0])
        prec = down.mods[0].precision  # down's input as ``swiglu_down`` makes it
        y, kept = _swiglu_down_forward(ctx.down, gu2, down, swiglu_save_spec(prec), _swiglu_kernel(gu2, prec))
        _save_operands(ctx, x_saved, kept)
        ctx.x_shape, ctx.casts = x.shape, casts
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        x_saved, q = _saved_operands(ctx)
        need = ctx.needs_input_grad
        mods = ctx.gate.mods
        n = len(mods)
        need_x, need_gate_w, need_down = need[0], list(need[4:4 + n]), need[4 + n:]
        need_gu = need_x or any(need_gate_w)
        fp8, rows, cols = ctx.casts
        ctx.casts = None
        # the operands straight from the SwiGLU gradient: unless Dgrad needs a GEMM per layer
        fused = need_gu and ctx.down.gu_dtype in (torch.bfloat16, torch.float32) and (
            not need_x or _dgrad_weight(ctx.gate, mods) is not None)
        casts = (fp8, rows if need_x else None, cols if any(need_gate_w) else None) if fused else None
        dgu, grads_down_w, grads_down_b = _swiglu_down_backward(
            ctx.down, q, gy.reshape(-1, gy.shape[-1]), need_gu, [need_down[0]], list(need_down[1:]), casts)
        gx, grads_gate_w = None, [None] * n
        if need_gu:
            gx, grads_gate_w, _ = _group_backward(ctx.gate, x_saved, None if fused else dgu, need_x, need_gate_w, [],
                                                  gy_ops=dgu if fused else None)
        else:
            _backward_done(ctx.gate)
        return (None if gx is None else gx.reshape(ctx.x_shape), None, None, None, *grads_gate_w, *grads_down_w,
                *grads_down_b)


class _State:
    """One part's backward state in an autograd function of several (``_GatedMLPFn``)."""


def swiglu_save_spec(prec: LinearPrecision) -> CastSpec | None:
    """The FP8 cast ``swiglu_down`` keeps its input in (1x128 groups, the Fprop input's format)."""
    if not prec.save_fp8_activations:
        return None
    a = prec.fprop.a
    fmt = a.format if a.format.is_fp8 else Format.FP8_E4M3
    return CastSpec(fmt, B1x128, a.pow2_scale, a.amax_floor)


# --------------------------------------------------------------------------- applying a flow


def is_adapter_name(name: str) -> bool:
    """Whether module ``name`` is a LoRA adapter's A or B (``...q_proj.lora_A``)."""
    return name.rsplit(".", 1)[-1] in ("lora_A", "lora_B")


def matches_skip(name: str, patterns: tuple[str, ...]) -> bool:
    """A module is skipped if a pattern matches its full dotted name or its last component."""
    leaf = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(leaf, p) for p in patterns)


@dataclass
class SwapReport:
    quantized: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unmatched_patterns: list[str] = field(default_factory=list)


def swap_linears(model: nn.Module, precision: LinearPrecision, skip: tuple[str, ...],
                 skipped: LinearPrecision | None = None) -> SwapReport:
    """Replace every ``nn.Linear`` by a ``JetLinear``: ``precision`` for most, ``skipped`` (a
    high-precision ``LinearPrecision``) for those on the skip list; without ``skipped`` those stay
    as they are.

    Modules already swapped get the new precision in place, so one model can be switched between
    its rollout and its training precision. Parameters are shared, never copied.
    """
    report = SwapReport()
    used = set()
    names = [n for n, _ in model.named_modules() if n]
    for p in skip:
        if any(matches_skip(n, (p,)) for n in names):
            used.add(p)
    report.unmatched_patterns = [p for p in skip if p not in used]
    for name, mod in list(model.named_modules()):
        if not name or not isinstance(mod, (nn.Linear, JetLinear)):
            continue
        if is_adapter_name(name):  # LoRA's A and B: the skipped layers' high precision (models/lora.py)
            if skipped is not None:
                mod.set_precision(skipped)
            continue
        prec = precision
        if matches_skip(name, skip):
            report.skipped.append(name)
            if skipped is None:
                if isinstance(mod, JetLinear):
                    raise ValueError(f"module {name} is on the skip list but was already swapped")
                continue
            prec = skipped
        else:
            report.quantized.append(name)
        if isinstance(mod, JetLinear):
            mod.set_precision(prec)
        else:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, JetLinear.from_linear(mod, prec))
    return report


def apply_flow(model: nn.Module, flow: PrecisionFlow, side: str) -> SwapReport:
    """Put ``model``'s linear layers in the flow's ``"train"`` or ``"rollout"`` precision (those on
    the skip list in the flow's ``skip_format``, on both sides)."""
    if side == "train":
        prec = flow.train.linear
    elif side == "rollout":
        prec = flow.rollout_linear()
    else:
        raise ValueError(f"side must be 'train' or 'rollout', got {side!r}")
    report = swap_linears(model, prec, flow.skip, flow.skipped_linear())
    if hasattr(model, "set_kv_spec"):
        model.set_kv_spec(flow.kv_cast(side))
    if hasattr(model, "batch_invariant"):
        model.batch_invariant = flow.batch_invariant
    return report
