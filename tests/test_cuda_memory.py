"""``jetrl_cli.cuda_memory``: the live allocations at a CUDA allocator trace's peak, by jetrl line."""

import os
import random

import pytest
import torch

from jetrl_cli import cuda_memory
from jetrl_cli.cuda_memory import peak_composition, site_of

from .conftest import fresh_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITES = [  # innermost frame first, as the allocator's snapshot lists them
    [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"},
     {"filename": os.path.join(ROOT, "jetrl_cli", "precision", "linear.py"), "line": 300, "name": "_fprop"},
     {"filename": os.path.join(ROOT, "jetrl_cli", "rl", "trainer.py"), "line": 50, "name": "update"}],
    [{"filename": os.path.join(ROOT, "kernels", "fp8.py"), "line": 611, "name": "_outputs"},
     {"filename": os.path.join(ROOT, "jetrl_cli", "precision", "gemm.py"), "line": 550, "name": "cast"}],
    [{"filename": "/usr/lib/python3/site-packages/torch/autograd/graph.py", "line": 1, "name": "backward"}],
    [],
]
NAMES = ["jetrl_cli/precision/linear.py:300 _fprop", "kernels/fp8.py:611 _outputs", "torch", "torch"]


def test_site_is_the_innermost_jetrl_frame():
    assert [site_of(f) for f in SITES] == NAMES


def _blocks(size):
    """The allocator's count for a request: whole 512-byte blocks."""
    return (size + 511) // 512 * 512


def _brute_force(events, held):
    """Every prefix's live set, the first largest one's total and contents."""
    live, held_now, best = {}, held, (held, held, {})
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            if live.pop(e["addr"], None) is None:
                held_now -= _blocks(e["size"])
        total = held_now + sum(_blocks(x["size"]) for x in live.values())
        if total > best[0]:
            best = (total, held_now, dict(live))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_peak_composition_matches_a_replay_of_every_prefix(seed):
    rng = random.Random(fresh_seed() + seed)  # fresh traces each session
    held_addrs = {10_000 + i: rng.randrange(1, 64) * 512 for i in range(5)}  # allocated before the trace
    held = sum(held_addrs.values())
    events, live, nxt = [], {}, 0
    for _ in range(400):
        r = rng.random()
        if r < 0.5 or not (live or held_addrs):
            nxt += 1
            # requests of any size (the trace records them unrounded), whole blocks among them
            size = rng.randrange(1, 4096) * 512 if rng.random() < 0.5 else rng.randrange(1, 1 << 21)
            e = {"action": "alloc", "addr": nxt, "size": size, "frames": rng.choice(SITES)}
            live[nxt] = e
            events.append(e)
        elif r < 0.9 and live:
            addr = rng.choice(list(live))
            size = live.pop(addr)["size"]
            events.append({"action": "free_requested", "addr": addr, "size": size})
            events.append({"action": "free_completed", "addr": addr, "size": size})
        elif held_addrs:
            addr = rng.choice(list(held_addrs))
            events.append({"action": "free_completed", "addr": addr, "size": held_addrs.pop(addr)})
        else:
            events.append({"action": "segment_alloc", "addr": 0, "size": 1 << 21})  # not a tensor's
    total, held_at_peak, alive = _brute_force(events, held)
    comp = peak_composition(events, held, top=2)
    assert comp["peak_bytes"] == total and comp["held_before_bytes"] == held
    assert comp["held_before_at_peak_bytes"] == held_at_peak
    want = {}
    for e in alive.values():
        b, n = want.get(site_of(e["frames"]), (0, 0))
        want[site_of(e["frames"])] = (b + _blocks(e["size"]), n + 1)
    ranked = sorted(want.items(), key=lambda kv: -kv[1][0])
    assert [(x["site"], x["bytes"], x["count"]) for x in comp["sites"]] == [(s, b, n) for s, (b, n) in ranked[:2]]
    assert comp["other_sites_bytes"] == sum(b for _, (b, _n) in ranked[2:])
    assert held_at_peak + sum(b for b, _ in want.values()) == total


def test_a_trace_that_only_frees_peaks_at_what_was_held():
    comp = peak_composition([{"action": "free_completed", "addr": 1, "size": 1024}], held_before=4096)
    assert comp["peak_bytes"] == 4096 and comp["sites"] == [] and comp["held_before_at_peak_bytes"] == 4096


def test_a_request_counts_as_the_allocators_whole_blocks():
    """A GPU's trace records a scalar's 4 bytes where the allocator counts a 512-byte block (an
    H200's replayed peak was 508 bytes under max_memory_allocated)."""
    trace = [{"action": "alloc", "addr": 1, "size": 20 << 20, "frames": SITES[0]},
             {"action": "alloc", "addr": 2, "size": 4, "frames": SITES[2]},
             {"action": "alloc", "addr": 3, "size": 513, "frames": SITES[2]}]
    comp = peak_composition(trace, 0)
    assert comp["peak_bytes"] == (20 << 20) + 512 + 1024
    assert [x["bytes"] for x in comp["sites"]] == [20 << 20, 1536]
    assert peak_composition([*trace, {"action": "free_completed", "addr": 2, "size": 4},
                             {"action": "free_completed", "addr": 9, "size": 100}], 4096)["peak_bytes"] == \
        4096 + (20 << 20) + 1536


def test_the_table_names_the_sites_and_the_overflow():
    comp = peak_composition([{"action": "alloc", "addr": 1, "size": 3 * 2**30, "frames": SITES[1]}], 2**30)
    text = cuda_memory.format_composition("train-bf16", {**comp, "truncated": True})
    assert "peak 4.00 GiB = held before the run 1.00 GiB" in text
    assert "3.000 GiB      1 x  kernels/fp8.py:611 _outputs" in text
    assert "overflowed" in text


def test_bench_prints_the_peaks_by_phase_and_the_recorded_sites():
    from jetrl_cli.bench import peak_lines

    g = 2**30
    row = {"flow": "fp8-unified", "peak_memory_by_phase": {"setup": 20 * g, "updates": 33 * g, "profile": 66 * g},
           "peak_reserved_by_phase": {"setup": 21 * g, "updates": 40 * g, "profile": 70 * g},
           "memory_at_start_bytes": g // 4,
           "left_over": {"python_visible_bytes": g // 8, "tensors": 2,
                         "largest": [{"bytes": g // 8, "shape": [1024, 65536], "dtype": "bfloat16"}]},
           "peak_sites": [{"site": NAMES[0], "bytes": g // 2, "count": 3}], "recorded_peak_bytes": 33 * g,
           "memory_profile": "p/train-fp8-unified-memory.txt"}
    assert peak_lines(row) == [
        "fp8-unified: peak GiB by phase (allocated above the row's start / reserved): setup 20.0 / 21.0, "
        "updates 33.0 / 40.0, profile 66.0 / 70.0; 0.25 GiB held before the row began",
        "fp8-unified: of what the row began with, 0.12 GiB in 2 tensors with a Python object "
        "(largest GiB: bfloat16[1024, 65536] 0.12)",
        "fp8-unified: live at the recorded step's peak (33.0 GiB, p/train-fp8-unified-memory.txt): "
        "0.50 GiB jetrl_cli/precision/linear.py:300 _fprop"]
    assert peak_lines({"flow": "bf16"}) == []


@pytest.mark.gpu
def test_record_peak_on_a_gpu_agrees_with_the_allocator_counters():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from jetrl_cli.precision.quant import divide

    keep = torch.empty(3 << 20, device="cuda")  # held before the run

    def run():
        a = torch.randn(1 << 20, device="cuda")
        b = divide(a, 3.0)  # a jetrl line allocates b
        del a
        return b.sum()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    comp = cuda_memory.record_peak(run)
    assert comp["held_before_bytes"] >= keep.numel() * 4
    assert comp["peak_bytes"] == torch.cuda.max_memory_allocated()
    assert any(s["site"].startswith("jetrl_cli/precision/quant.py") for s in comp["sites"]), comp["sites"]


def test_record_peak_records_one_call_and_turns_the_history_off(monkeypatch):
    """The glue around the allocator, with torch.cuda's calls stood in (no GPU here): history on and
    cleared before the call, off after it (also when the call raises), this device's trace replayed."""
    calls = []
    trace = [{"action": "alloc", "addr": 1, "size": 2048, "frames": SITES[0]},
             {"action": "free_completed", "addr": 1, "size": 2048}]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 512)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a: {"device_traces": [[], trace]})
    comp = cuda_memory.record_peak(lambda: calls.append("run"))
    assert calls[0][1]["clear_history"] is True and calls[1] == "run" and calls[2] == ((), {"enabled": None})
    assert comp["peak_bytes"] == 512 + 2048 and comp["held_before_bytes"] == 512 and comp["events"] == 2
    # live at the peak though freed by the end
    assert comp["sites"] == [{"site": NAMES[0], "bytes": 2048, "count": 1}] and not comp["truncated"]
    calls.clear()
    with pytest.raises(ZeroDivisionError):
        cuda_memory.record_peak(lambda: 1 / 0)
    assert calls[-1] == ((), {"enabled": None})

    def old_torch(*a, **k):
        if "clear_history" in k:
            raise TypeError("unexpected keyword argument 'clear_history'")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", old_torch)
    with pytest.raises(cuda_memory.HistoryUnavailable, match="clear_history"):
        cuda_memory.record_peak(lambda: None)

    # what the allocator refuses, or a trace in another format: unavailable (the bench keeps its row)
    def no_caching(*a, **k):
        if k.get("enabled", "all") is not None:
            raise RuntimeError("Recording memory history requires the CUDA caching allocator")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", no_caching)
    with pytest.raises(cuda_memory.HistoryUnavailable, match="cannot be recorded here: Recording memory"):
        cuda_memory.record_peak(lambda: None)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a: {"device_traces": [[], [{"action": "alloc"}]]})
    with pytest.raises(cuda_memory.HistoryUnavailable, match=r"not in the format read here \(KeyError"):
        cuda_memory.record_peak(lambda: None)

    def no_snapshot(*a):
        raise RuntimeError("snapshot failed")

    monkeypatch.setattr(torch.cuda.memory, "_snapshot", no_snapshot)
    with pytest.raises(cuda_memory.HistoryUnavailable, match="no snapshot of the allocator's history: snapshot failed"):
        cuda_memory.record_peak(lambda: None)


@pytest.mark.gpu
def test_a_bench_rows_peaks_are_its_own_and_what_it_began_with_is_traced():
    """A row's allocated peaks leave out what the device held when it began (an earlier row's
    left-overs on the first H200 run: 39 GiB after the transformers row), and the tensors among
    those that have a Python object are listed."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from jetrl_cli.bench import PhasePeaks

    keep = torch.empty(3 << 20, device="cuda")  # 12 MiB held before the row (more than LEFT_OVER_REPORTED)
    peaks = PhasePeaks(True)
    peaks("setup", lambda: torch.ones(5 << 20, device="cuda").sum())  # 20 MiB at its peak
    row = peaks.row()
    assert row["memory_at_start_bytes"] >= keep.untyped_storage().nbytes()
    assert 20 << 20 <= row["peak_memory_bytes"] < (20 << 20) + (2 << 20), row  # reductions' scratch aside
    lo = row["left_over"]
    assert lo["python_visible_bytes"] >= 12 << 20
    assert {"bytes": 12 << 20, "shape": [3 << 20], "dtype": "float32"} in lo["largest"]
    del keep
