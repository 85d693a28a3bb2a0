"""Weight transports: how the trainer's new weights become a ``WeightPayload`` for a rollout engine.

A transport turns the trainer's model into the payload an engine's ``load_weights`` takes. Today's
two are both colocated (the engine lives in the trainer's process):

- ``LocalTransport``: one process; ``make_payload`` on the model as it is.
- ``GatherTransport``: a model sharded by FSDP2. Each parameter is all-gathered whole
  (``DTensor.full_tensor()``, one parameter at a time, in the same order on every rank), then
  ``make_payload`` quantizes it with the rollout's weight spec. A 128x128 weight block and its
  scale are therefore computed on the full weight, as in a single process, whatever the shard
  boundaries; every rank quantizes the same tensor with the same quantizer and gets the same bits.

A disaggregated setup (rollout servers on other GPUs or hosts) would add a transport whose
``payload`` runs on the trainer's rank 0 and ships the result (NCCL broadcast, RDMA, files); the
RL loop only calls ``payload`` and ``engine.load_weights``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..engine.base import WeightPayload, make_payload


class WeightTransport(Protocol):
    def payload(self, model: torch.nn.Module, flow, version: int = 0, params=None) -> WeightPayload:
        """The full weights of ``model`` as this rank's engine receives them (a collective when the
        model is sharded: every rank calls it at the same point); ``params``: the (name, tensor) pairs
        to send instead (a LoRA model's adapters, or its merged weights: ``models.lora.sync_parameters``)."""


class LocalTransport:
    name = "local"

    def payload(self, model: torch.nn.Module, flow, version: int = 0, params=None) -> WeightPayload:
        return make_payload(model, flow, version, params=params)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_parameters(model: torch.nn.Module):
    """(name, full tensor) of every parameter; sharded ones (DTensor) are all-gathered."""
    for name, p in model.named_parameters():
        yield name, _full(p.detach())


class GatherTransport:
    name = "gather"

    def payload(self, model: torch.nn.Module, flow, version: int = 0, params=None) -> WeightPayload:
        with torch.no_grad():
            if params is None:
                return make_payload(model, flow, version, params=full_parameters(model))
            return make_payload(model, flow, version, params=[(n, _full(t)) for n, t in params])
