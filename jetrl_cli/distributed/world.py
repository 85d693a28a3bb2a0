"""The processes of a run: which rank this is, how many there are, and the few collectives the RL
loop needs.

``SINGLE`` is the plain ``jetrl run``: one process, no process group, every collective a no-op.
``World.from_env()`` joins the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): gloo on CPU; on GPU one device per process
(``cuda:LOCAL_RANK``) with NCCL for CUDA tensors and gloo for the small CPU tensors and Python
objects (samples, metrics) the loop exchanges.

Work is split by ``shard``: rank ``r`` of ``W`` takes a contiguous block of ``n`` items, the first
``n % W`` ranks one more. Prompts, sequences to score and groups to train on are all split this
way, so a rank's share is a function of (n, r, W) alone and every rank knows every other's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import JetrlError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def shard_range(n: int, rank: int, size: int) -> range:
    """Rank ``rank``'s contiguous block of ``n`` items (sizes differ by at most one)."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (rank < extra))


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    distributed: bool = False  # a torch.distributed process group is up (launched by torchrun)
    device: str = "cpu"
    # Sum gradients in a fixed order and take the gradient norm on whole gradients, so a sharded
    # step equals a single-process step bit for bit (``sharding.py``). Default on CPU (gloo); on
    # GPU FSDP's own reduce-scatter and sharded norm (no full gradient copies). JETRL_EXACT_REDUCTION=0/1
    # overrides the default.
    exact: bool = True

    @property
    def is_writer(self) -> bool:
        """Rank 0 alone writes files and the live display."""
        return self.rank == 0

    def shard(self, n: int) -> range:
        return shard_range(n, self.rank, self.size)

    def shards(self, n: int) -> list[range]:
        return [shard_range(n, r, self.size) for r in range(self.size)]

    # ------------------------------------------------------------------ collectives

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order (pickled; for samples, metrics and small tensors)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    # ------------------------------------------------------------------ set-up

    @classmethod
    def from_env(cls, device: str) -> "World":
        """Join the process group ``torchrun`` started this process in."""
        import torch
        import torch.distributed as dist

        rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        if device == "cuda":
            if not torch.cuda.is_available():
                raise JetrlError("model.device: cuda, but torch sees no CUDA device (use model.device=cpu)")
            if local >= torch.cuda.device_count():
                raise JetrlError(f"torchrun started local rank {local}, but only {torch.cuda.device_count()} "
                                 "CUDA device(s) are visible (one process per GPU)")
            torch.cuda.set_device(local)
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        exact = os.environ.get("JETRL_EXACT_REDUCTION", "1" if device == "cpu" else "0")
        if exact not in ("0", "1"):
            raise JetrlError(f"JETRL_EXACT_REDUCTION={exact!r}: allowed 0 or 1")
        if not dist.is_initialized():
            dist.init_process_group(backend)
        return cls(rank, size, True, device, exact == "1")

    def close(self) -> None:
        """Free the run's objects, then the process group, while the interpreter is fully alive:
        FSDP modules sit in reference cycles, and a gloo work object they hold, destroyed during
        interpreter shutdown instead, can abort the process (seen as a rare SIGABRT at exit)."""
        if self.distributed:
            import gc

            import torch.distributed as dist

            gc.collect()
            if dist.is_initialized():
                dist.destroy_process_group()

    def transport(self):
        """How a weight sync reaches this rank's rollout engine (see ``transport.py``)."""
        from .transport import GatherTransport, LocalTransport

        return GatherTransport() if self.distributed else LocalTransport()


SINGLE = World()
