"""What holds a GPU's memory at its peak: CUDA's caching allocator, recorded over one call and replayed.

``torch.cuda.max_memory_allocated`` says how high a step's memory went, not what was in it. Counting
on CPU (``docs/experiments/train_step_memory.py``) gives a step's tensors by the code's own account;
where a GPU's peak is far above that count, this says which lines of jetrl allocated what was live
at the GPU's peak. ``record_peak(fn)`` runs ``fn()`` once with the allocator's history on
(``torch.cuda.memory._record_memory_history``: every allocation and free with its Python stack),
takes the snapshot and turns it off; ``peak_composition`` replays the events: the live bytes after
each one, the highest point, and the allocations live there, grouped by the innermost jetrl line
on their stack (``jetrl_cli/...`` or ``kernels/...``; ``torch`` for an allocation with no jetrl frame,
such as autograd's own buffers).

Memory allocated before the call (weights, gradients, optimizer state, caches) is not in the history:
it is reported as one amount, ``held_before_bytes``. Sizes are the allocator's blocks, as
``max_memory_allocated`` counts them: the trace records each request's own size (4 bytes for a
scalar, on an H200 with torch 2.11), so the replay rounds it up to 512 bytes as the allocator does.
Recording costs host time (a stack per allocation): time a step without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

TOP_SITES = 25  # sites listed at the peak
BLOCK = 512  # the caching allocator's smallest block and rounding (c10's kMinBlockSize)
_OURS = (os.sep + "jetrl_cli" + os.sep, os.sep + "kernels" + os.sep)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def site_of(frames: Iterable[dict]) -> str:
    """The innermost jetrl frame of an allocation's stack (innermost first, as the snapshot lists
    them) as ``path:line function``; ``torch`` where none is jetrl's."""
    for f in frames:
        name = f.get("filename", "")
        if any(p in name for p in _OURS):
            rel = os.path.relpath(name, _ROOT) if os.path.isabs(name) else name
            return f"{rel}:{f.get('line', '?')} {f.get('name', '?')}"
    return "torch"


def peak_composition(events: list[dict], held_before: int = 0, top: int = TOP_SITES) -> dict:
    """Replay an allocator trace (``snapshot["device_traces"][device]``): ``alloc`` adds its size,
    ``free_completed`` takes back what that address's allocation added (a free of memory allocated
    before the trace began takes it from ``held_before``). Returns the peak (``peak_bytes``, counted
    from ``held_before``), the trace's allocations live at the peak grouped by ``site_of``
    (``sites``: ``[{"site", "bytes", "count"}]``, largest first, at most ``top``), the rest summed
    (``other_sites_bytes``), and ``held_before_bytes``."""
    live, peak, at = held_before, held_before, -1
    sizes: dict[int, int] = {}
    for i, e in enumerate(events):
        act = e.get("action")
        if act == "alloc":
            sizes[e["addr"]] = _block(e["size"])
            live += sizes[e["addr"]]
            if live > peak:
                peak, at = live, i
        elif act == "free_completed":
            live -= sizes.pop(e["addr"], _block(e["size"]))
    held = held_before
    alive: dict[int, dict] = {}
    for e in events[:at + 1]:  # the live set at the peak, with its stacks
        act = e.get("action")
        if act == "alloc":
            alive[e["addr"]] = e
        elif act == "free_completed":
            if alive.pop(e["addr"], None) is None:
                held -= _block(e["size"])
    groups: dict[str, list[int]] = {}
    for e in alive.values():
        g = groups.setdefault(site_of(e.get("frames", ())), [0, 0])
        g[0] += _block(e["size"])
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_bytes": peak, "held_before_bytes": held_before, "held_before_at_peak_bytes": held,
            "sites": [{"site": s, "bytes": b, "count": n} for s, (b, n) in ranked[:top]],
            "other_sites_bytes": sum(b for _, (b, _n) in ranked[top:])}


def _block(size: int) -> int:
    """What the caching allocator counts for a request of ``size`` bytes: a multiple of ``BLOCK``."""
    return -(-size // BLOCK) * BLOCK


class HistoryUnavailable(RuntimeError):
    """This torch cannot record the allocator's history as ``record_peak`` needs it (the bench's row
    says why and keeps its measurements)."""


def _line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def record_peak(fn: Callable[[], object], device=None, max_entries: int = 2_000_000) -> dict:
    """``fn()`` once with the CUDA allocator's history recorded; ``peak_composition`` of it. The
    device is synchronised before and after, so the trace holds the call's work alone."""
    import torch

    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    try:  # a history left by an earlier recording would be replayed with this one's
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", clear_history=True)
    except TypeError as e:
        raise HistoryUnavailable(f"torch {torch.__version__} cannot clear the allocator's history "
                           "(_record_memory_history has no clear_history)") from e
    except RuntimeError as e:  # e.g. an allocator configured without caching
        raise HistoryUnavailable(f"the allocator's history cannot be recorded here: {_line(e)}") from e
    try:
        fn()
        torch.cuda.synchronize(device)
        try:
            snap = torch.cuda.memory._snapshot(device)
        except RuntimeError as e:
            raise HistoryUnavailable(f"no snapshot of the allocator's history: {_line(e)}") from e
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    dev = torch.device("cuda") if device is None else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    traces = snap.get("device_traces", [])
    events = traces[index] if index < len(traces) else []
    try:
        out = peak_composition(events, held)
    except (KeyError, TypeError) as e:  # a trace in another format than this torch's
        raise HistoryUnavailable(f"the allocator's trace is not in the format read here ({type(e).__name__}: "
                                 f"{e})") from e
    out["events"] = len(events)
    out["truncated"] = len(events) >= max_entries  # the oldest events were overwritten
    return out


def format_composition(name: str, comp: dict) -> str:
    """A text table of ``peak_composition``'s result, in GiB."""
    g = 2 ** 30
    lines = [f"{name}: live CUDA memory at the peak of one run (allocator history)",
             f"peak {comp['peak_bytes'] / g:.2f} GiB = held before the run "
             f"{comp['held_before_at_peak_bytes'] / g:.2f} GiB (of {comp['held_before_bytes'] / g:.2f}) "
             "+ allocated in the run and live at the peak:"]
    for s in comp["sites"]:
        lines.append(f"  {s['bytes'] / g:8.3f} GiB  {s['count']:5d} x  {s['site']}")
    if comp["other_sites_bytes"]:
        lines.append(f"  {comp['other_sites_bytes'] / g:8.3f} GiB  (other sites)")
    if comp.get("truncated"):
        lines.append("(the history overflowed: its oldest events are missing)")
    return "\n".join(lines) + "\n"


def live_cuda_tensors(largest: int = 5) -> dict:
    """The CUDA tensors that have a Python object (each storage once): their bytes and the largest
    (bytes, shape, dtype). Who holds them is another question: a tensor that only C++ holds (a
    saved tensor of an autograd graph) keeps its Python object too. Memory beyond them is the
    allocator's or a library's own."""
    import gc
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    seen: dict[int, tuple[int, tuple, str]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated objects of other libraries warns
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor) or not obj.is_cuda:
                    continue
                st = obj.untyped_storage()
                seen.setdefault(st.data_ptr(), (st.nbytes(), tuple(obj.shape), str(obj.dtype).removeprefix("torch.")))
            except Exception:  # noqa: BLE001 - meta or freed-storage tensors: not device memory here
                continue
    top = sorted(seen.values(), key=lambda x: -x[0])[:largest]
    return {"python_visible_bytes": sum(v[0] for v in seen.values()), "tensors": len(seen),
            "largest": [{"bytes": b, "shape": list(sh), "dtype": dt} for b, sh, dt in top]}
