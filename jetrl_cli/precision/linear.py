"""The FP8 linear layer: ``nn.Linear`` with each of its three GEMMs run in the flow's precision.

``y = x @ W.T + b``. Forward (Fprop), input gradient (Dgrad) and weight gradient (Wgrad) each cast
their operands as the flow says (see ``flow.py`` for the operand layouts) and write high precision:
activations and the gradients passed between operators are rounded to the GEMM's ``out`` format
(bf16 or fp32), never to 8 bits; master weights are the module's own fp32 parameters.

The forward is one code path: train or eval mode, with or without grad, it runs the same casts,
so a rollout forward and a training forward with the same precision give the same bits. With
``save_fp8_activations`` the forward also quantizes ``x`` in the weight-gradient layout (128x1
groups) and saves only that FP8 copy for the backward, instead of the high-precision ``x``.

On CPU, bf16 is emulated: operands rounded to bf16, products accumulated in fp32.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from .flow import GemmSpec, LinearPrecision, PrecisionFlow
from .gemm import Operand, get_backend
from .quant import CastSpec, QTensor, quantize, round_to


def cast_operand(x: torch.Tensor, spec: CastSpec, backend: str = "emulated") -> Operand:
    """An operand in the form a backend consumes: a QTensor, or fp32 values rounded to the format.
    A backend with its own quantizers (``cast``: the Triton kernels, bit-exact with the reference)
    quantizes the operands of its GEMMs."""
    if spec.is_scaled:
        if backend != "emulated":
            own = getattr(get_backend(backend), "cast", None)
            q = own(x, spec) if own is not None else None
            if q is not None:
                return q
        return quantize(x, spec)
    if x.is_cuda and spec.format.value == "bf16":
        return x.to(torch.bfloat16)
    return round_to(x, spec.format)


def _finish(acc: torch.Tensor, spec: GemmSpec, like: torch.dtype) -> torch.Tensor:
    """Round the fp32 product to the GEMM's output precision, return in the activation dtype."""
    out = round_to(acc, spec.out)
    return out if out.dtype is like else out.to(like)


def _fprop(x: torch.Tensor, w_op: Operand, bias, prec: LinearPrecision, n_out: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    fp = prec.fprop
    acc = get_backend(fp.backend).mm(cast_operand(x2, fp.a, fp.backend), w_op)
    if bias is not None:
        acc = acc + bias.float()
    return _finish(acc, fp, x.dtype).reshape(*x.shape[:-1], n_out)


class _JetLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, prec: LinearPrecision, w_op_fprop: Operand):
        x2 = x.reshape(-1, x.shape[-1])
        y = _fprop(x, w_op_fprop, bias, prec, weight.shape[0])

        ctx.prec = prec
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.reuse_w = prec.dgrad.b == prec.fprop.b
        ctx.w_op = w_op_fprop if ctx.reuse_w else None
        ctx.x_spec = None
        if prec.save_fp8_activations:
            xq = cast_operand(x2, prec.wgrad.b, prec.wgrad.backend)  # FP8, 128x1 groups: the Wgrad operand
            if isinstance(xq, QTensor):  # saved through autograd, so saved-tensor hooks see its bytes
                ctx.x_spec = xq.spec
                ctx.save_for_backward(weight, xq.data, xq.scale)
            else:
                ctx.save_for_backward(weight, xq)
        else:
            ctx.save_for_backward(weight, x2)
        return y

    @staticmethod
    def backward(ctx, gy):
        prec: LinearPrecision = ctx.prec
        weight = ctx.saved_tensors[0]
        gy2 = gy.reshape(-1, gy.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            dg = prec.dgrad
            w_op = ctx.w_op if ctx.reuse_w else cast_operand(weight, dg.b, dg.backend)
            acc = get_backend(dg.backend).mm(cast_operand(gy2, dg.a, dg.backend), w_op.t())
            gx = _finish(acc, dg, gy.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            wg = prec.wgrad
            saved = ctx.saved_tensors
            if ctx.x_spec is not None:
                x_op = QTensor(saved[1], saved[2], ctx.x_spec)
            elif prec.save_fp8_activations:
                x_op = saved[1]
            else:
                x_op = cast_operand(saved[1], wg.b, wg.backend)
            acc = get_backend(wg.backend).mm(cast_operand(gy2, wg.a, wg.backend).t(), x_op.t())
            gw = _finish(acc, wg, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy2.float().sum(0).to(gy.dtype)
        return gx, gw, gb, None, None


class JetLinear(nn.Module):
    """Drop-in ``nn.Linear`` running the flow's precision; shares the original's parameters."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, precision: LinearPrecision):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = weight
        self.bias = bias
        self._wcache: tuple | None = None
        self._wfixed: Operand | None = None
        self.set_precision(precision)

    @classmethod
    def from_linear(cls, lin: nn.Linear, precision: LinearPrecision) -> "JetLinear":
        return cls(lin.weight, lin.bias, precision)

    def set_precision(self, precision: LinearPrecision) -> None:
        where = "precision"
        for gname in ("fprop", "dgrad", "wgrad"):
            g: GemmSpec = getattr(precision, gname)
            get_backend(g.backend).check(g, f"{where}.{gname}", gname)
        self.precision = precision
        self._wcache = None
        self._wfixed = None

    def load_quantized_weight(self, q: Operand) -> None:
        """Use ``q`` (already cast with this layer's fprop weight spec) as the forward's weight, as
        a rollout engine does after a quantized weight sync; ``self.weight`` is no longer read."""
        spec = self.precision.fprop.b
        if getattr(q, "spec", spec) != spec:
            raise ValueError(f"quantized weight has spec {q.spec.short_str()}, layer expects {spec.short_str()}")
        if tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight has shape {tuple(q.shape)}, layer expects "
                             f"{(self.out_features, self.in_features)}")
        self._wfixed = q

    def quantized_weight(self) -> Operand:
        """The forward's weight operand, cached until the weight changes (in place or replaced)."""
        if self._wfixed is not None:
            return self._wfixed
        w = self.weight
        # set_precision clears the cache; a new dtype or device means new storage (data_ptr)
        key = (w.data_ptr(), w._version)
        if self._wcache is None or self._wcache[0] != key:
            with torch.no_grad():
                self._wcache = (key, cast_operand(w.detach(), self.precision.fprop.b, self.precision.fprop.backend))
        return self._wcache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_grad = x.requires_grad or self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
        if not torch.is_grad_enabled() or not needs_grad:
            # No backward will run: the same forward math, without autograd's bookkeeping or the
            # FP8 copy of x saved for Wgrad.
            return _fprop(x, self.quantized_weight(), self.bias, self.precision, self.out_features)
        return _JetLinearFn.apply(x, self.weight, self.bias, self.precision, self.quantized_weight())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {self.precision.short_str()}"
        )


def matches_skip(name: str, patterns: tuple[str, ...]) -> bool:
    """A module is skipped if a pattern matches its full dotted name or its last component."""
    leaf = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(leaf, p) for p in patterns)


@dataclass
class SwapReport:
    quantized: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unmatched_patterns: list[str] = field(default_factory=list)


def swap_linears(model: nn.Module, precision: LinearPrecision, skip: tuple[str, ...]) -> SwapReport:
    """Replace every ``nn.Linear`` not on the skip list by a ``JetLinear`` with ``precision``.

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
        if matches_skip(name, skip):
            report.skipped.append(name)
            if isinstance(mod, JetLinear):
                raise ValueError(f"module {name} is on the skip list but was already swapped")
            continue
        if isinstance(mod, JetLinear):
            mod.set_precision(precision)
        else:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, JetLinear.from_linear(mod, precision))
        report.quantized.append(name)
    return report


def apply_flow(model: nn.Module, flow: PrecisionFlow, side: str) -> SwapReport:
    """Put ``model``'s linear layers in the flow's ``"train"`` or ``"rollout"`` precision."""
    if side == "train":
        prec = flow.train.linear
    elif side == "rollout":
        prec = flow.rollout_linear()
    else:
        raise ValueError(f"side must be 'train' or 'rollout', got {side!r}")
    report = swap_linears(model, prec, flow.skip)
    if hasattr(model, "set_kv_spec"):
        model.set_kv_spec(flow.kv_cast(side))
    return report
