"""What `jetrl run` tells and leaves behind: resume messages, nothing left by a failed start, file
modes, timing columns, the no-extractable-answer warning, TensorBoard event files."""

import json
import os
import sys

import pytest
from typer.testing import CliRunner

from jetrl_cli.cli import app
from jetrl_cli.config import load_job_config
from jetrl_cli.errors import JetrlError, PresetError
from jetrl_cli.rl import loop
from jetrl_cli.rl.loop import run

runner = CliRunner()
TINY = ["rollout.prompts_per_step=2", "rollout.n=2", "eval.prompts=4", "eval.every=0", "run.checkpoint_every=1",
        "rollout.max_new_tokens=24"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def sets(items):
    return [x for it in items for x in ("--set", it)]


def test_resume_without_a_run_is_an_error_and_creates_nothing(tmp_path):
    out = tmp_path / "nothing-here"
    res = invoke("run", "bf16", "-o", out, "--resume", *sets(TINY))
    assert res.exit_code == 2
    assert res.output.strip() == (f"error: {out}: --resume, but there is no run here to resume (no checkpoint); "
                                  "drop --resume to start a new run")
    assert not out.exists()


def test_resume_says_where_it_starts(tmp_path):
    out = tmp_path / "run"
    cfg = load_job_config("bf16", TINY + ["train.steps=3"])
    run(cfg, out, stop_after=2)  # killed after step 2 (its checkpoint written)
    res = invoke("run", "bf16", "-o", out, "--resume", *sets(TINY + ["train.steps=3"]))
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    assert first == f"resuming from step 3 (checkpoint {out / 'checkpoints' / 'step_000002'})"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


@pytest.mark.parametrize("break_model", ["missing", "corrupt config"])
def test_a_run_that_cannot_start_leaves_no_directory(tmp_path, break_model):
    model = tmp_path / "model"
    if break_model == "corrupt config":
        model.mkdir()
        (model / "config.json").write_text("{ not json")
        (model / "tokenizer.json").write_text((loop.tiny_policy_dir() / "tokenizer.json").read_text())
    out = tmp_path / "out"
    res = invoke("run", "bf16", "-o", out, *sets(TINY + [f"model.path={model}"]))
    assert res.exit_code == 2 and res.output.startswith("error: ") and len(res.output.strip().splitlines()) == 1
    assert not out.exists(), list(out.iterdir())


def test_checkpoints_follow_the_umask_and_step_time_leaves_out_the_eval(tmp_path, monkeypatch):
    import time

    evaluate, real, skipped = loop.evaluate, time.perf_counter, [0.0]

    def slow_evaluate(job, n):  # an eval that takes 1000 s more on the loop's clock
        skipped[0] += 1000.0
        return evaluate(job, n)

    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    monkeypatch.setattr(loop.time, "perf_counter", lambda: real() + skipped[0])
    old = os.umask(0o027)
    try:
        lines = run(load_job_config("bf16", TINY + ["train.steps=2"]), tmp_path / "run")
    finally:
        os.umask(old)
    ck = tmp_path / "run" / "checkpoints" / "step_000002"
    modes = {p.name: p.stat().st_mode & 0o777 for p in ck.iterdir()}
    assert modes["model.safetensors"] == 0o640 and set(modes.values()) == {0o640}, modes  # safetensors made 0600
    last = lines[-1]  # the last step always evaluates
    assert last["eval_s"] >= 1000.0
    parts = sum(last[k] for k in ("rollout_s", "score_s", "train_s", "sync_s"))
    assert parts <= last["step_s"] < parts + 500.0  # the eval's 1000 s are not in step_s


def test_a_first_step_with_no_readable_answer_is_said_at_once(tmp_path):
    """The tiny policy ends its answers with '#### n'; read as \\boxed{} only, none has an answer."""
    res = invoke("run", "bf16", "-o", tmp_path / "boxed", *sets(TINY + ["train.steps=1", "task.answer_format=boxed"]))
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("warning:"))
    assert lines[i] == ("warning: no completion of step 1 had an answer that task.answer_format 'boxed' can read, "
                        "so none can be scored correct; make the prompt ask for that form, or set "
                        "task.answer_format (auto, boxed_or_gsm8k, boxed, gsm8k, last_number)")
    assert lines[i + 1].startswith("step 1 ")  # before the first step's line
    m = [json.loads(x) for x in (tmp_path / "boxed" / "metrics.jsonl").read_text().splitlines()]
    assert m[1]["answer_found"] == 0.0 and m[1]["reward_mean"] == 0.0
    res = invoke("run", "bf16", "-o", tmp_path / "default", *sets(TINY + ["train.steps=1"]))
    assert res.exit_code == 0 and "warning:" not in res.output
    m = [json.loads(x) for x in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    assert m[1]["answer_found"] > 0


@pytest.mark.parametrize("value, msg", [
    ("[jsonl, mlflow]", "run.loggers: 'mlflow' is not a logger (allowed: jsonl, tensorboard, wandb)"),
    ("[tensorboard]", "run.loggers: must include jsonl"),
    ("jsonl", "run.loggers: expected a list"),
])
def test_bad_loggers_are_refused(value, msg):
    with pytest.raises(PresetError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_job_config("bf16", [f"run.loggers={value}"])


def test_missing_tensorboard_is_a_one_line_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    out = tmp_path / "tb"
    res = invoke("run", "bf16", "-o", out, *sets(TINY + ["run.loggers=[jsonl, tensorboard]"]))
    assert res.exit_code == 2
    assert res.output.strip() == ("error: run.loggers: tensorboard needs the tensorboard package: "
                                  "pip install 'jetrl[tensorboard]'")
    assert not out.exists()
    with pytest.raises(JetrlError, match="pip install 'jetrl\\[tensorboard\\]'"):
        loop.open_loggers(["jsonl", "tensorboard"])


def test_missing_wandb_is_a_one_line_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    out = tmp_path / "wb"
    res = invoke("run", "bf16", "-o", out, *sets(TINY + ["run.loggers=[jsonl, wandb]"]))
    assert res.exit_code == 2
    assert res.output.strip() == "error: run.loggers: wandb needs the wandb package: pip install 'jetrl[wandb]'"
    assert not out.exists()


@pytest.mark.slow  # 10 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_wandb_gets_the_metrics_jsonl_scalars_offline_one_run_per_start(tmp_path, monkeypatch):
    """``run.loggers: [jsonl, wandb]`` with the real wandb package, offline: each step's numbers
    (those of its ``metrics.jsonl`` line) go to ``Run.log`` at the line's step, in the project
    ``run.wandb_project``, with the preset as the run's config; a ``--resume`` is a second wandb run
    of the same group, from its first step on. wandb's files stay in ``OUT/wandb/``."""
    wandb = pytest.importorskip("wandb")
    from jetrl_cli.rl.loggers import scalars
    from jetrl_cli.rl.loop import ENVIRONMENT_KEYS

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    logged, inits = [], []
    real_log, real_init = wandb.sdk.wandb_run.Run.log, wandb.init

    def log(self, data, step=None, **kw):
        logged.append((self.name, step, dict(data)))
        return real_log(self, data, step=step, **kw)

    def init(**kw):
        inits.append(kw)
        return real_init(**kw)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", log)
    monkeypatch.setattr(wandb, "init", init)
    out = tmp_path / "wb"
    cfg = load_job_config("bf16", TINY + ["train.steps=4", "run.checkpoint_every=2", "run.loggers=[jsonl, wandb]",
                                          "run.wandb_project=jetrl-test"])
    killed = run(cfg, out, stop_after=3)  # the last checkpoint is step 2's
    run(cfg, out, resume=True)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(n, st) for n, st, _ in logged] == [("wb", 0), ("wb", 1), ("wb", 2), ("wb", 3), ("wb-from-step-3", 3),
                                                ("wb-from-step-3", 4)]
    for (_, st, data), m in zip(logged, killed + lines[3:]):
        assert data == scalars(m) and m["step"] == st
    assert {k for k in scalars(lines[3]) if k not in ENVIRONMENT_KEYS} >= {"reward_mean", "mismatch_kl", "grad_norm"}
    assert [(i["project"], i["group"], i["dir"]) for i in inits] == [("jetrl-test", "wb", str(out))] * 2
    assert inits[0]["config"]["train"]["steps"] == 4 and inits[0]["config"]["flow"] == "bf16"
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(list(r.glob("run-*.wandb")) for r in runs)
    assert wandb.run is None  # both finished


def _tb_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_the_metrics_jsonl_scalars_and_resume_hides_the_killed_steps(tmp_path):
    pytest.importorskip("tensorboard")
    import numpy as np

    from jetrl_cli.rl.loggers import scalars

    out = tmp_path / "tb"
    cfg = load_job_config("bf16", TINY + ["train.steps=4", "run.checkpoint_every=2", "run.loggers=[jsonl, tensorboard]"])
    killed = run(cfg, out, stop_after=3)  # killed after step 3; the last checkpoint is step 2's
    assert [m["step"] for m in killed] == [0, 1, 2, 3]
    run(cfg, out, resume=True)  # step 3 again, then 4
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
    assert killed[3]["step_s"] != lines[3]["step_s"]  # the killed step 3's events differ from the resumed one's
    got = _tb_scalars(out / "tensorboard")
    want: dict[str, list] = {}
    for m in lines:
        for k, v in scalars(m).items():
            want.setdefault(k, []).append((m["step"], float(np.float32(v))))
    assert {"reward_mean", "mismatch_kl", "eval_accuracy", "grad_norm", "step_s"} <= set(want)
    assert got == want  # every number of metrics.jsonl, once per step: the killed run's step 3 purged
