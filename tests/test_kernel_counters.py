"""docs/experiments/kernel_counters.py, the hardware-counter run a GPU lease makes (``.ci/gpu counters``):
its cases must run (a broken one would cost a lease's minutes to find), and its summary must read ncu's
raw CSV into cases at the markers."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location(
        "kernel_counters", os.path.join(ROOT, "docs", "experiments", "kernel_counters.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_every_case_runs_and_is_in_the_manifest(tmp_path):
    """At small shapes: on a GPU every case, elsewhere in Triton's interpreter every case but those that
    need CUDA, which say why."""
    kc = _module()
    path = tmp_path / "m.json"
    cuda = torch.cuda.is_available()
    rows = kc.run_cases(kc.SMALL, torch.device("cuda" if cuda else "cpu"), None, str(path))
    manifest = json.loads(path.read_text())
    cuda_only = set() if cuda else {c.name for c in kc.CASES if c.cuda_only}
    assert [r["case"] for r in rows] == [c.name for c in kc.CASES if c.name not in cuda_only]
    assert {s["case"] for s in manifest["skipped"]} == cuda_only
    assert all(r["min_bytes"] > 0 for r in rows)


def _raw_csv(rows: list[dict], metrics: list[str]) -> str:
    """Text in the layout of ``ncu --csv --page raw --print-units base``: ==PROF== lines, the header, the
    units row, one row per kernel, every value quoted."""
    head = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
            "Grid Size", "Device", "CC", *metrics]
    buf = io.StringIO()
    buf.write("==PROF== Connected to process 123\n")
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(head)
    w.writerow(["", "", "", "", "", "", "", "", "", "", "", *["nsecond" if "time" in m else "" for m in metrics]])
    for i, r in enumerate(rows):
        w.writerow([str(i), "123", "python3", "h", r["name"], "1", "7", "(256, 1, 1)", r["grid"], "0", "9.0",
                    *[r.get(m, "") for m in metrics]])
    return buf.getvalue()


def test_the_summary_splits_ncus_rows_into_cases_at_the_markers(tmp_path):
    kc = _module()
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    metrics = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
               *(stall.format(k) for k in ("long_scoreboard", "barrier", "selected", "mio_throttle", "wait"))]
    t1, t2, t3 = (float(torch.randint(1000, 90000, ()).item()) for _ in range(3))
    rows = [
        {"name": "_case_marker", "grid": "(3, 1, 1)", "gpu__time_duration.sum": "1,024"},  # case index 2
        {"name": "_swiglu_grad_rows_kernel", "grid": "(256, 70, 1)", "gpu__time_duration.sum": str(t1),
         "dram__bytes_read.sum": "1,000,000", "dram__bytes_write.sum": "500000", stall.format("long_scoreboard"): "9.5",
         stall.format("barrier"): "2.5", stall.format("selected"): "50", stall.format("mio_throttle"): "4.0",
         stall.format("wait"): "1.0", "launch__registers_per_thread": "96"},
        {"name": "_swiglu_grad_cols_kernel", "grid": "(64, 280, 1)", "gpu__time_duration.sum": str(t2)},
        {"name": "_case_marker", "grid": "(1, 1, 1)"},  # case index 0
        {"name": "void at::native::copy_kernel(int)", "grid": "(9, 1, 1)", "gpu__time_duration.sum": str(t3)},
    ]
    manifest = {"cases": [{"index": 0, "case": "copy", "min_bytes": 2_000_000},
                          {"index": 2, "case": "swiglu", "min_bytes": 3_000_000}], "skipped": []}
    raw = tmp_path / "raw.csv"
    raw.write_text(_raw_csv(rows, metrics))
    entries = kc.summarize(kc.read_raw(str(raw)), manifest)
    assert [(e["case"], e["kernel"]) for e in entries] == [
        ("swiglu", "_swiglu_grad_rows_kernel"), ("swiglu", "_swiglu_grad_cols_kernel"),
        ("copy", "void at::native::copy_kernel")]
    first = entries[0]
    assert first["time"] == t1 and first["dram_read"] == 1e6 and first["registers"] == 96
    # the largest three stall reasons, "selected" (issuing, not a stall) left out
    assert first["stalls"] == [("long_scoreboard", 9.5), ("mio_throttle", 4.0), ("barrier", 2.5)]
    assert entries[1]["stalls"] == [] and entries[1]["dram_read"] is None
    text = kc.table(entries)
    # a case's time is its kernels' sum, its bandwidth its least bytes over that time
    assert f"== swiglu: {(t1 + t2) / 1e3:.1f} us, {3e6 / (t1 + t2):.0f} GB/s" in text
    assert f"== copy: {t3 / 1e3:.1f} us" in text
    assert "long_scoreboard 9.5, mio_throttle 4.0, barrier 2.5" in text


def test_the_summary_refuses_a_file_without_ncus_header(tmp_path):
    kc = _module()
    p = tmp_path / "raw.csv"
    p.write_text("==ERROR== the profiler could not start\n")
    with pytest.raises(SystemExit, match="no ncu CSV header"):
        kc.read_raw(str(p))
