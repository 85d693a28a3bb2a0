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

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import JetrlError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 600  # JETRL_DIST_TIMEOUT: as NCCL's default; gloo's own is 30 minutes


def launched_by_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def _env_int(name: str, low: int) -> int:
    v = os.environ[name]
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or n < low:
        raise JetrlError(f"{name}={v!r} (set by torchrun): must be an integer >= {low}")
    return n


def torchrun_rank() -> int:
    """This process's rank under torchrun (0 otherwise, or where RANK is unreadable)."""
    try:
        return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0
    except ValueError:
        return 0


def torchrun_world_size() -> int:
    """How many processes torchrun started (1 when not under torchrun)."""
    return _env_int("WORLD_SIZE", 1) if launched_by_torchrun() else 1


def dist_timeout() -> float:
    """Seconds a collective waits for the other ranks before it fails (JETRL_DIST_TIMEOUT)."""
    v = os.environ.get("JETRL_DIST_TIMEOUT")
    if v is None:
        return float(DEFAULT_TIMEOUT_S)
    try:
        t = float(v)
    except ValueError:
        t = float("nan")
    if not 0 < t < float("inf"):
        raise JetrlError(f"JETRL_DIST_TIMEOUT={v!r}: must be a number of seconds > 0 (default {DEFAULT_TIMEOUT_S})")
    return t


class CollectiveTimeout(JetrlError):
    """The other ranks did not answer within JETRL_DIST_TIMEOUT: one of them is stuck or dead."""

    exit_code = 1


def is_collective_timeout(e: BaseException) -> bool:
    """gloo's ``Timed out waiting ...ms for ... operation to complete`` (a RuntimeError)."""
    return isinstance(e, RuntimeError) and "timed out" in str(e).lower()


def file_digest(path: Path, whole_below: int = 64 << 20, sample: int = 4 << 20) -> str:
    """A file's identity for comparing ranks: a hash of its bytes; of a large file (weights), of its size
    and its first and last ``sample`` bytes (a safetensors header and weights on either side: another
    checkpoint differs there) without reading gigabytes."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= whole_below:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            h.update(f.read(sample))
            f.seek(max(size - sample, 0))
            h.update(f.read(sample))
    return h.hexdigest()[:16]


def dir_digests(path: Path, label: str) -> dict[str, str]:
    """``{"LABEL/NAME": digest}`` for the files directly in a model directory (config, tokenizer,
    weights; not a checkpoint's ``dcp/``)."""
    return {f"{label}/{f.name}": file_digest(f) for f in sorted(path.iterdir()) if f.is_file()}


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

    def check_same(self, what: dict, hint: str) -> None:
        """Refuse to start unless every rank has the same ``what`` (``{name: value}``; small values, or
        digests of large ones): one line naming the first name whose value differs and the ranks that
        differ from rank 0. Ranks that start from different presets, models or data would exchange
        samples of different prompts and train one model on them, silently."""
        if not self.distributed:
            return

        def shown(v) -> str:
            return repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."

        every = self.all_gather_object(what)
        for name in dict.fromkeys(k for w in every for k in w):  # rank 0's order, then names only others have
            values = [w.get(name, "<absent>") for w in every]
            odd = [r for r, v in enumerate(values) if v != values[0]]
            if odd:
                ranks = ", ".join(f"rank {r}: {shown(values[r])}" for r in odd[:3]) + (", ..." if len(odd) > 3 else "")
                raise JetrlError(f"the ranks disagree on {name} (rank 0: {shown(values[0])}; {ranks}); {hint}")

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
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        rank, size, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
        timeout = dist_timeout()
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
        if not dist.is_initialized():  # a stuck or dead rank fails the others' collectives after `timeout`
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
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
