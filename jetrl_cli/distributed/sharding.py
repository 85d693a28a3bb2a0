"""The sharding helper: FSDP2 (``torch.distributed.fsdp.fully_shard``) over jetrl's Llama model.

``shard_model`` puts each decoder layer in its own FSDP unit and the root (embeddings, final norm,
``lm_head``) in another. Parameters stay fp32 (the master weights; no ``MixedPrecisionPolicy``):
the flow's casts happen inside ``JetLinear`` on the unsharded weight, exactly as in one process.
Shards are rows (dim 0) of each parameter.

Three things make the sharded trainer's numbers equal a single process's:

1. **Quantization on the full weight.** Before a layer's forward FSDP all-gathers its parameters,
   so ``JetLinear`` sees the whole ``(out, in)`` weight; its 128x128 blocks and their scales are the
   single-process ones (a 64-row shard would split a block).
2. **Fresh weight caches.** ``JetLinear`` and ``fused_linears`` keep their quantized / concatenated
   weights until ``(data_ptr, _version)`` of the weight changes. FSDP2 all-gathers into the same
   unsharded storage without bumping the version counter (checked with torch 2.13), so after an
   optimizer step a cache could serve the old weight. A forward pre-hook, run after FSDP's own,
   bumps the version of every freshly gathered parameter (an in-place ``mul_(1)``: same bits).
3. **A fixed gradient sum** (``World.exact``, gloo): gradients are summed across ranks in rank
   order (``OrderedReduceScatter``: all-to-all, then ``((g0 + g1) + g2) + ...``), not in the order
   a ring reduce-scatter happens to use. Each rank accumulates its micro-batches locally first
   (``set_requires_gradient_sync(False)`` until the last), so the total is the single-process
   accumulation order whenever each rank's share of a mini-batch is one micro-batch.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..errors import JetrlError

try:  # FSDP2 with pluggable collectives (torch 2.13; ReduceScatter lives in a private module)
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.tensor import DTensor
except ImportError as e:  # pragma: no cover - older torch
    _MISSING = str(e)
    ReduceScatter = object
else:
    _MISSING = None


class OrderedReduceScatter(ReduceScatter):
    """Reduce-scatter (sum) whose result is the same on every run: this rank's chunk of every
    rank's input arrives by all-to-all and is added in rank order."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.RedOpType.SUM):
            raise RuntimeError(f"OrderedReduceScatter sums only (got {op}); set force_sum_reduction_for_comms")
        size = dist.get_world_size(group)
        chunks = input_tensor.view(size, -1)
        recv = torch.empty_like(chunks)
        dist.all_to_all_single(recv, chunks, group=group)
        acc = recv[0].clone()
        for r in range(1, size):
            acc += recv[r]
        output_tensor.copy_(acc)
        return None


def _bump_gathered_versions(module, args):
    """Forward pre-hook (after FSDP's unshard): mark this unit's gathered weights as new, for the
    operand caches keyed on a weight's version (a new version, no kernel: the bits stay)."""
    for p in module.parameters():
        if not isinstance(p, DTensor):  # gathered: this unit's own (sub-units stay sharded)
            torch.autograd.graph.increment_version(p)


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that become FSDP units: every decoder layer, then the root."""
    return [*model.model.layers, model]


def shard_model(model: torch.nn.Module, exact: bool) -> torch.nn.Module:
    """Shard ``model`` in place over the default process group (its ``JetLinear`` swap must already
    be done: FSDP records each parameter's owning module)."""
    if _MISSING is not None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise JetrlError(f"torchrun runs need FSDP2 with custom collectives (torch 2.13 has them); this torch "
                         f"{torch.__version__} lacks them ({_MISSING or 'FSDPModule.set_custom_reduce_scatter'})")
    for unit in fsdp_units(model):
        fully_shard(unit, reshard_after_forward=True)
    for unit in fsdp_units(model):
        unit: FSDPModule
        unit.set_gradient_divide_factor(1.0)  # losses are already divided by the global token count
        unit.set_force_sum_reduction_for_comms(True)
        if exact:
            unit.set_custom_reduce_scatter(OrderedReduceScatter())
        unit.register_forward_pre_hook(_bump_gathered_versions)
    return model


def set_gradient_sync(model: torch.nn.Module, on: bool) -> None:
    """Reduce-scatter after this backward (``on``) or accumulate unsharded gradients locally."""
    for unit in fsdp_units(model):
        unit.set_requires_gradient_sync(on, recurse=False)


def quiet_fsdp_view_warning() -> None:
    """The model returns its logits as a view; jetrl never modifies them in place, which is what
    FSDP2's warning is about."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
