"""A backward pass run node by node from Python, for tensors autograd's C++ engine will not take.

``loss.backward()`` on fake CUDA tensors (``tests/fake_cuda.py``) fails on a machine without a
GPU: the engine asks the CUDA driver for the device's context before it runs a CUDA node. A graph's
nodes are callable on their own, though: ``node(*grads_of_its_outputs)`` returns the gradients for
``node.next_functions``, and an ``AccumulateGrad`` node adds into its leaf's ``.grad``.
``backward`` walks the graph as the engine does: a node runs once every node that feeds it has,
later-created nodes first; the gradients a node receives are summed in arrival order, each first
summed to its input's shape and cast to its dtype; nodes run with grad mode off, as the engine runs
a backward without ``create_graph`` (so ``AccumulateGrad`` keeps or adds into ``.grad`` in place as
there). Tensor and node hooks are not run (jetrl's
training path registers none); saved-tensor hooks are, so non-reentrant activation checkpointing
recomputes as usual.

A custom ``torch.autograd.Function``'s node runs its ``backward``, which returns a gradient per
forward input, while the node has edges for the tensor inputs only; which inputs were tensors is
known only at ``apply``, so a graph with custom Functions must be built inside ``recording()``.
Undefined gradients reach a custom ``backward`` as zeros (torch's default, ``materialize_grads``).

``tests/test_py_autograd.py`` checks it against the C++ engine on CPU.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools

import torch
from torch.autograd.function import BackwardCFunction, Function

_TENSOR_INPUTS = "_py_autograd_tensor_inputs"


@contextlib.contextmanager
def recording():
    """Inside, each custom Function applied notes on its node which forward inputs were tensors."""
    plain = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if kwargs:
            raise NotImplementedError(f"{cls.__name__}.apply with keyword arguments")
        out = plain.__func__(cls, *args)
        for o in out if isinstance(out, tuple) else (out,):
            if isinstance(o, torch.Tensor) and isinstance(o.grad_fn, BackwardCFunction):
                setattr(o.grad_fn, _TENSOR_INPUTS, [isinstance(a, torch.Tensor) for a in args])
                break
        return out

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = plain


def _run(node, grads: list) -> tuple:
    if node.name() == "torch::autograd::AccumulateGrad":
        _accumulate(node.variable, grads[0])
        return ()
    if not isinstance(node, BackwardCFunction):
        out = node(*grads)
        return out if isinstance(out, tuple) else (out,)
    if not hasattr(node, _TENSOR_INPUTS):
        raise RuntimeError(f"{node.name()} was applied outside py_autograd.recording()")
    grads = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
             for g, m in zip(grads, node._input_metadata)]
    out = node.apply(*grads)
    out = out if isinstance(out, tuple) else (out,)
    return tuple(g for g, t in zip(out, getattr(node, _TENSOR_INPUTS)) if t)


def _accumulate(leaf: torch.Tensor, g: torch.Tensor | None) -> None:
    """What ``AccumulateGrad`` does with no other reference to ``g`` (as in the engine, where the
    gradient it receives is its own; called from Python it would always copy it): the first gradient
    is kept as it is where its strides are the leaf's (a view of a larger result stays one), later
    ones are added in place."""
    if g is None:
        return
    if leaf.grad is None:
        leaf.grad = g.detach() if g.stride() == leaf.stride() else g.clone(memory_format=torch.contiguous_format)
    else:
        leaf.grad.add_(g)


def _as_input(g: torch.Tensor, meta, node) -> torch.Tensor:
    """What the engine's ``validate_outputs`` does: a gradient summed to its input's shape (undoing a
    broadcast) and cast to its dtype; a device mismatch raises."""
    if g.shape != meta.shape:
        g = g.sum_to_size(meta.shape)
    if g.device != meta.device:
        raise RuntimeError(f"{node.name()} returned a gradient on {g.device} for an input on {meta.device}")
    return g if g.dtype == meta.dtype else g.to(meta.dtype)


def backward(root: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
    """``root.backward(gradient)``. Unlike the engine it frees nothing: the saved tensors live until
    the graph is garbage."""
    if gradient is None:
        if root.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        gradient = torch.ones_like(root)
    backward_all((root,), (gradient,))


def backward_all(roots, gradients) -> None:
    """``torch.autograd.backward(roots, gradients)`` over every leaf the roots reach (no ``inputs=``)."""
    for i, root in enumerate(roots):
        if root.grad_fn is None:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")
    starts = list(dict.fromkeys(r.grad_fn for r in roots))
    waiting: dict = {}  # node -> edges into it not yet run
    todo, seen = list(starts), set(starts)
    while todo:
        for nxt, _ in todo.pop().next_functions:
            if nxt is None:
                continue
            waiting[nxt] = waiting.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    inbox: dict = {}
    for root, g in zip(roots, gradients):
        box = inbox.setdefault(root.grad_fn, {})
        box[root.output_nr] = g if root.output_nr not in box else box[root.output_nr] + g
    order = itertools.count()
    ready = [(-s._sequence_nr(), next(order), s) for s in starts if not waiting.get(s)]
    heapq.heapify(ready)
    while ready:
        node = heapq.heappop(ready)[2]
        got = inbox.pop(node, {})
        with torch.no_grad():  # as the engine runs a backward without create_graph
            outs = _run(node, [got.get(i) for i in range(len(node._input_metadata))]) if got else ()
        for k, (nxt, slot) in enumerate(node.next_functions):
            if nxt is None:
                continue
            g = outs[k] if k < len(outs) else None
            if g is not None:
                g = _as_input(g, nxt._input_metadata[slot], node)
                box = inbox.setdefault(nxt, {})
                box[slot] = g if slot not in box else box[slot] + g
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                heapq.heappush(ready, (-nxt._sequence_nr(), next(order), nxt))
