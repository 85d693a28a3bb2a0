"""The first steps of a tiny preset, compared with values recorded once (torchtune's recipe tests).

`jetrl run presets/fp8-unified.yaml`, shrunk to 3 steps of 4 prompts x 4 samples, must reproduce
the reward, accuracy, response length, loss, gradient norm, clip fraction, policy entropy and
mismatch KL of every step, and the final eval accuracy, stored in ``tests/recorded/fp8-unified.json``
together with the command that produced them. Any change to the numerics -- a quantizer, a GEMM, the attention, the
sampler, the loss, the optimizer, the task's rewards -- moves these numbers.

Tolerances. On one machine the run is deterministic to the bit (every random draw is a function of
the seed and the step). Another CPU's BLAS may sum in another order: continuous values then move by
float rounding (~1e-7 relative), a little more where such a difference flips one FP8 rounding of
one element. So the continuous values (loss, gradient norm, clip fraction, response length,
entropy) must agree within 1e-3 relative (1e-6 absolute, for values near 0): loose for rounding noise, tight for
a real change -- a wrong scale, rounding mode, mask, advantage or learning rate moves them by far
more, as does a single different sampled token. Rewards and accuracies count whole samples, and the
unified flow's mismatch KL is exactly 0: they must match exactly. That holds for step 1, whose
forward passes are exact by construction on any CPU. From step 2 on the weights carry the first
updates, whose backward GEMMs BLAS sums in an order of its own: recorded on an AVX-512 CPU and rerun on an
AVX2-only one (2026-11-29), step 3's entropy moved by 2.5e-3 relative (the same samples, rewards and
zero mismatch; an ulp in a weight flips an FP8 rounding in the next forward). So later steps get 1e-2:
a real change to the numerics moves step 1 already, by far more than 1e-3. If the test fails on another
CPU by a hair while the numerics did not change, say so in the commit and widen no further than needed.

Re-record (after an intended change to the numerics), from the repository root:

    JETRL_RECORD=1 python -m pytest tests/test_recorded_curve.py

which reruns the command and rewrites the JSON file (commit it with the change that moved it).
"""

import datetime
import json
import os
import platform
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from jetrl_cli.cli import app

RECORDED = Path(__file__).parent / "recorded" / "fp8-unified.json"
OVERRIDES = ["train.steps=3", "rollout.prompts_per_step=4", "rollout.n=4", "eval.prompts=8", "eval.every=0",
             "run.checkpoint_every=0", "run.save_rollouts=false"]
CONTINUOUS = ("response_len", "loss", "grad_norm", "clip_frac", "entropy")
EXACT = ("reward_mean", "accuracy", "mismatch_kl", "eval_accuracy")
REL, ABS = 1e-3, 1e-6
REL_LATER = 1e-2  # steps after the first (see the module's docstring)


def command(out: Path) -> list[str]:
    return ["run", "presets/fp8-unified.yaml", "-o", str(out), *[w for o in OVERRIDES for w in ("--set", o)]]


def curve(out: Path) -> list[dict]:
    res = CliRunner().invoke(app, command(out), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: m[k] for k in ("step", *CONTINUOUS, *EXACT) if k in m} for m in lines if m["step"] > 0]


def test_fp8_unified_reproduces_its_recorded_curve(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).parent.parent)  # the command names presets/ from the repository root
    got = curve(tmp_path / "run")
    if os.environ.get("JETRL_RECORD") == "1":
        RECORDED.parent.mkdir(exist_ok=True)
        RECORDED.write_text(json.dumps({
            "command": "jetrl " + " ".join(command(Path("OUT"))),
            "record_with": "JETRL_RECORD=1 python -m pytest tests/test_recorded_curve.py",
            "recorded": datetime.date.today().isoformat(), "torch": torch.__version__,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "steps": got,
        }, indent=1) + "\n")
    want = json.loads(RECORDED.read_text())
    assert want["command"] == "jetrl " + " ".join(command(Path("OUT"))), "re-record: the command changed"
    assert [m["step"] for m in got] == [m["step"] for m in want["steps"]] == [1, 2, 3]
    for g, w in zip(got, want["steps"]):
        assert set(g) == set(w), (g, w)
        for k in EXACT:
            if k in w:
                assert g[k] == w[k], (g["step"], k, g[k], w[k])
        for k in CONTINUOUS:
            rel = REL if g["step"] == 1 else REL_LATER
            assert g[k] == pytest.approx(w[k], rel=rel, abs=ABS), (g["step"], k, g[k], w[k])
    assert all(m["mismatch_kl"] == 0.0 for m in got)  # the unified flow, whatever was recorded
