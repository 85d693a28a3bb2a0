"""A user's mistakes get one line naming the file, key or path, and cost no data: `--force` deletes a
run only once the new one has started, and never the model it starts from; no command overwrites
samples, checkpoints or a model without `--force`; `--resume` continues a run only with its own
settings; damaged files and unwritable paths are errors, not tracebacks."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from jetrl_cli.config import load_job_config
from jetrl_cli.errors import JetrlError, PresetError
from jetrl_cli.rl import loop
from jetrl_cli.rl.loop import run

from .test_run_output import TINY, invoke, sets


def one_line_error(res, code=2) -> str:
    assert res.exit_code == code, res.output
    assert res.output.startswith("error: ") and len(res.output.strip().splitlines()) == 1, res.output
    return " ".join(res.output.split())


def fake_run(out):
    """A directory that looks like a finished run (what --force may delete)."""
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    (out / "checkpoints" / "step_000002" / "weights").write_text("precious")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    return out


def test_force_keeps_the_old_run_when_the_new_one_cannot_start(tmp_path):
    old = fake_run(tmp_path / "r")
    msg = one_line_error(invoke("run", "bf16", "-o", old, "--force", *sets(TINY + ["model.path=/no/such/model"])))
    assert "model.path: /no/such/model: no such directory" in msg
    assert (old / "checkpoints" / "step_000002" / "weights").read_text() == "precious"


def test_force_never_deletes_the_model_it_starts_from(tmp_path):
    old = fake_run(tmp_path / "r")
    ck = old / "checkpoints" / "step_000002"
    shutil.copytree(loop.tiny_policy_dir(), ck, dirs_exist_ok=True)
    msg = one_line_error(invoke("run", "bf16", "-o", old, "--force", *sets(TINY + [f"model.path={ck}"])))
    assert f"model.path: {ck} lies inside {old}, which --force would delete" in msg
    assert (ck / "weights").read_text() == "precious"


def test_quantize_refuses_an_output_holding_its_input(tmp_path):
    src = tmp_path / "models" / "m"
    shutil.copytree(loop.tiny_policy_dir(), src)
    for out in (tmp_path / "models", src / "q"):
        msg = one_line_error(invoke("quantize", src, "-o", out, "--format", "fp8-block", "--force"))
        assert "output must not contain the input directory" in msg
    assert (src / "config.json").exists()


def test_rollout_and_train_do_not_overwrite_without_force(tmp_path):
    samples = tmp_path / "s.jsonl"
    samples.write_text("keep\n")
    msg = one_line_error(invoke("rollout", "bf16", "-o", samples, "--prompts", 1, *sets(TINY)))
    assert f"{samples}: exists" in msg and "--force replaces it" in msg
    assert samples.read_text() == "keep\n"
    trained = tmp_path / "t"
    (trained / "checkpoints" / "step_000001").mkdir(parents=True)
    msg = one_line_error(invoke("train", "bf16", "--rollouts", samples, "-o", trained, *sets(TINY)))
    assert f"{trained}: holds checkpoints of an earlier train; --force replaces them" in msg
    assert (trained / "checkpoints" / "step_000001").is_dir()
    msg = one_line_error(invoke("rollout", "bf16", "-o", tmp_path, "--prompts", 1, "--force", *sets(TINY)))
    assert f"{tmp_path}: is a directory" in msg
    assert not list(tmp_path.glob(".*.tmp"))
    msg = one_line_error(invoke("train", "bf16", "--rollouts", tmp_path, "-o", tmp_path / "t2", *sets(TINY)))
    assert "is a directory" in msg


def test_rollout_and_train_write_when_forced_and_train_keeps_out_of_the_run(tmp_path):
    samples = tmp_path / "s.jsonl"
    samples.write_text("old\n")
    res = invoke("rollout", "bf16", "-o", samples, "--prompts", 1, "--force", "--json", *sets(TINY))
    assert res.exit_code == 0, res.output
    assert len(samples.read_text().splitlines()) == 2 and not list(tmp_path.glob(".*.tmp"))
    cfg = load_job_config("bf16", TINY + [f"run.out_dir={tmp_path / 'runs' / 'x'}"])
    res = invoke("train", "bf16", "--rollouts", samples, "--json", *sets(TINY + [f"run.out_dir={cfg.out_dir}"]))
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["checkpoint"] == str(tmp_path / "runs" / "x-train" / "checkpoints" / "step_000001")
    again = invoke("train", "bf16", "--rollouts", samples, "--updates", 2, "--force", "--json",
                   *sets(TINY + [f"run.out_dir={cfg.out_dir}"]))
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in (tmp_path / "runs" / "x-train" / "checkpoints").iterdir()) == ["step_000002"]
    assert sorted(p.name for p in (tmp_path / "runs" / "x-train").iterdir()) == ["checkpoints", "latest"]


def test_resume_keeps_the_runs_settings_and_survives_a_cut_metrics_line(tmp_path):
    out = tmp_path / "r"
    run(load_job_config("fp8-unified", TINY + ["train.steps=3"]), out, stop_after=2)
    for preset, extra, changed in (("bf16", [], "precision: "),
                                   ("fp8-unified", ["train.lr=1.0"], "train.lr: 3e-05 -> 1.0")):
        msg = one_line_error(invoke("run", preset, "-o", out, "--resume", *sets(TINY + ["train.steps=3"] + extra)))
        assert f"--resume continues this run with its own settings ({out / 'preset.yaml'}), but {changed}" in msg
        assert "only train.steps, run.checkpoint_every" in msg
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')  # a kill while writing step 3's line
    res = invoke("run", "fp8-unified", "-o", out, "--resume", *sets(TINY + ["train.steps=3"]))
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    before = (out / "metrics.jsonl").read_text()
    res = invoke("run", "fp8-unified", "-o", out, "--resume", *sets(TINY + ["train.steps=3"]))
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"the run is complete (checkpoint {out / 'checkpoints' / 'step_000003'}, "
                                 "train.steps 3): nothing to do"), res.output
    assert (out / "metrics.jsonl").read_text() == before
    state = out / "checkpoints" / "step_000003" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    msg = one_line_error(invoke("run", "fp8-unified", "-o", out, "--resume", *sets(TINY + ["train.steps=4"])))
    assert f"{state}: unreadable (" in msg and "the file is damaged" in msg


def test_paths_that_cannot_be_written_are_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    msg = one_line_error(invoke("run", "bf16", "-o", afile, *sets(TINY + ["train.steps=1"])))
    assert msg == f"error: -o {afile}: is a file; -o takes the directory to write into"
    assert afile.read_text() == "x"
    msg = one_line_error(invoke("run", "bf16", "-o", afile / "sub", *sets(TINY + ["train.steps=1"])))
    assert msg == f"error: -o {afile / 'sub'}: {afile} is a file, not a directory"


@pytest.mark.parametrize("key_value, message", [
    ("task.prompt_template={prompt", "task.prompt_template: '{prompt' is not a format string"),
    ("task.prompt_template=same for all", "task.prompt_template: 'same for all' uses no field of the row"),
    ("task.eval_fraction=1.5", "task.eval_fraction: must be in (0, 1), got 1.5"),
    ("task.eval_fraction=-0.5", "task.eval_fraction: must be in (0, 1), got -0.5"),
    ("train.clip_low=2", "train.clip_low: must be below 1"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens: must be > 0, got 0"),
    ("task.file=data.jsonl", "task.file: read only by task.name: jsonl (this task is 'arith')"),
])
def test_preset_values_out_of_range_are_refused(key_value, message):
    with pytest.raises(PresetError) as e:
        load_job_config("bf16", [key_value])
    assert message in str(e.value)


def test_a_preset_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(b"\x00\xff\xfe")
    msg = one_line_error(invoke("run", bad))
    assert f"{bad}: not a UTF-8 text file (byte 1: 0xff)" in msg


def test_a_run_that_fails_at_its_first_rollout_leaves_no_directory(tmp_path):
    out = tmp_path / "o"
    msg = one_line_error(invoke("run", "bf16", "-o", out, *sets(TINY + ["rollout.max_len=10"])))
    assert "exceeds the engine width 10 (rollout.max_len: raise it, or lower rollout.max_new_tokens" in msg
    assert not out.exists()


def test_model_weights_that_do_not_match_config_json_are_named(tmp_path):
    from jetrl_cli.fileio import save_safetensors
    from jetrl_cli.models.hf import load_model, read_tensors

    wide = tmp_path / "wide"
    shutil.copytree(loop.tiny_policy_dir(), wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    with pytest.raises(JetrlError, match=r"wide: tensor \S+ is \(\d+, \d+\), config.json makes it"):
        load_model(wide)
    msg = one_line_error(invoke("quantize", wide, "-o", tmp_path / "q", "--format", "fp8-block"))
    assert re.search(r"wide: tensor \S+ is \(\d+(, \d+)?\), config.json makes it", msg), msg
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q.tmp-*"))
    tied = tmp_path / "tied"
    shutil.copytree(loop.tiny_policy_dir(), tied)
    t = read_tensors(tied / "model.safetensors")
    if "lm_head.weight" not in t:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    t["lm_head.weight"] = t["lm_head.weight"] + 1.0
    save_safetensors(t, tied / "model.safetensors", metadata={"format": "pt"})
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(JetrlError, match="tie_word_embeddings: true, but the checkpoint's lm_head.weight is not"):
        load_model(tied)


def test_plotting_a_directory_without_a_run_is_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "jetrl_cli.rl.plots", "-o", tmp_path / "x.png", tmp_path / "none"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip().endswith(f"{tmp_path / 'none'}: no metrics.jsonl (not a jetrl "
                                                               "run directory)"), res.stderr


def test_train_names_the_rollout_file_whose_groups_do_not_match_rollout_n(tmp_path):
    samples = tmp_path / "s.jsonl"
    assert invoke("rollout", "bf16", "-o", samples, "--prompts", 1, *sets(TINY)).exit_code == 0
    msg = one_line_error(invoke("train", "bf16", "--rollouts", samples, "-o", tmp_path / "t", *sets(TINY[:1])))
    assert f"{samples}: step 0's group 0 has 2 samples, rollout.n is 8 (set rollout.n to the n the file was sampled with)" in msg


def test_mismatch_report_lengths_beyond_the_models_positions_are_refused():
    msg = one_line_error(invoke("mismatch-report", "bf16", "--prompts", 1, "--lengths", "100000"))
    assert "--lengths 100000: the model takes at most 512 positions (max_position_embeddings in" in msg
    msg = one_line_error(invoke("mismatch-report", "bf16", "--prompts", 1, "--lengths", "508"))  # prompt too
    assert re.search(r"--lengths 508: after prompts of up to \d+ tokens, \d+ positions; the model takes at most 512",
                     msg), msg


def test_a_run_does_not_write_into_a_directory_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    msg = one_line_error(invoke("run", "bf16", "-o", tmp_path, *sets(TINY + ["train.steps=1"])))
    assert f"{tmp_path}: a directory with other files in it (not a jetrl run)" in msg
    msg = one_line_error(invoke("run", "bf16", "-o", tmp_path, "--force", *sets(TINY + ["train.steps=1"])))
    assert "not a jetrl run directory (no metrics.jsonl); --force only replaces runs" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_options_that_would_be_ignored_or_emptied_are_refused(tmp_path):
    msg = one_line_error(invoke("mismatch-report", "bf16", "--prompts", 1, "--flows", ""))
    assert "--flows: no flow given" in msg
    msg = one_line_error(invoke("bench", "gemm", "--flows", "bf16", "--repeats", 1))
    assert "--flows applies to the rollout, train and e2e modes" in msg
    out = tmp_path / "r"
    (out / "checkpoints" / "step_000004").mkdir(parents=True)
    (out / "latest").write_text("step_000004\n")
    msg = one_line_error(invoke("mismatch-report", "bf16", "--prompts", 1, "--model", out))
    ck = out / "checkpoints" / "step_000004"
    assert f"{out}: a jetrl run directory, not a model; its latest checkpoint is {ck}" in msg


def test_bench_checks_its_task_batch_settings_before_timing_anything(tmp_path):
    """``--task-set`` and ``--task-preset`` were read only after the fixed-length rollout rows had
    been timed (minutes on a GPU); a typo now fails at once, and ``--task-set`` where no task batch
    is timed is refused instead of ignored."""
    msg = one_line_error(invoke("bench", "rollout", "--task-set", "rollout.nn=8", "--repeats", 1, "--no-history"))
    assert "rollout.nn: unknown key" in msg
    msg = one_line_error(invoke("bench", "rollout", "--task-set", "rollout.n=0", "--no-history"))
    assert "rollout.n: must be > 0, got 0" in msg
    msg = one_line_error(invoke("bench", "rollout", "--task-preset", "fp8-unifed", "--no-history"))
    assert "fp8-unifed" in msg
    msg = one_line_error(invoke("bench", "gemm", "--task-set", "rollout.n=8", "--no-history"))
    assert "--task-set applies to the rollout mode's task batch" in msg
    msg = one_line_error(invoke("bench", "rollout", "--task-preset", "none", "--task-set", "rollout.n=8",
                                "--no-history"))
    assert "--task-set applies to the rollout mode's task batch" in msg


def test_train_never_writes_into_a_run_and_a_run_does_not_resume_a_trains_checkpoints(tmp_path):
    """``jetrl train -o RUN --force`` deleted a run's checkpoints and wrote its own, which ``--resume`` then
    continued as the run's; now train refuses a run's directory, with --force too, and a resume needs the
    run's metrics."""
    old = fake_run(tmp_path / "r")
    for force in ([], ["--force"]):
        msg = one_line_error(invoke("train", "bf16", "--rollouts", tmp_path / "none.jsonl", "-o", old, *force))
        assert f"{old}: holds a run of jetrl run (metrics.jsonl); jetrl train writes its checkpoint elsewhere" in msg
    assert (old / "checkpoints" / "step_000002" / "weights").read_text() == "precious"
    trained = tmp_path / "t"  # what jetrl train leaves: checkpoints and latest, no metrics
    (trained / "checkpoints" / "step_000001").mkdir(parents=True)
    (trained / "checkpoints" / "step_000001" / "trainer_state.pt").write_text("x")
    (trained / "latest").write_text("step_000001\n")
    msg = one_line_error(invoke("run", "bf16", "-o", trained, "--resume", *sets(TINY)))
    assert f"{trained}: holds checkpoints but no metrics.jsonl: not a run of jetrl run" in msg
    assert f"--set model.path={trained / 'checkpoints' / 'step_000001'}" in msg


def test_force_keeps_the_old_run_until_the_new_one_has_a_checkpoint(tmp_path, monkeypatch):
    """``--force`` deleted the old run once the new one had set up; a new run that then failed (a NaN loss
    at step 1, a crash) left no checkpoint at all. The old run now waits aside until the new run's first
    checkpoint, and comes back if the new run fails before it."""
    from jetrl_cli.rl.trainer import NonFiniteError

    old = fake_run(tmp_path / "r")
    cfg = load_job_config("bf16", TINY + ["train.steps=1", "eval.prompts=2"])

    def nan_loss(*a, **k):
        raise NonFiniteError("step 1: the loss is nan; stopped before the update")

    monkeypatch.setattr(loop, "train_on_samples", nan_loss)
    with pytest.raises(NonFiniteError, match=f"the previous run in {re.escape(str(old))} is kept"):
        run(cfg, old, replace=True)
    assert (old / "checkpoints" / "step_000002" / "weights").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # nothing left aside
    monkeypatch.undo()
    run(cfg, old, replace=True)
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["step_000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_quantize_force_replaces_only_an_earlier_quantize_output(tmp_path):
    """``jetrl quantize -o DIR --force`` deleted whatever DIR held: a run, a folder of notes."""
    run_dir = fake_run(tmp_path / "r")
    msg = one_line_error(invoke("quantize", loop.tiny_policy_dir(), "-o", run_dir, "--format", "fp8-block", "--force"))
    assert f"{run_dir}: holds a run of jetrl run; --force replaces only an earlier output of jetrl quantize" in msg
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.txt").write_text("mine")
    msg = one_line_error(invoke("quantize", loop.tiny_policy_dir(), "-o", notes, "--format", "fp8-block", "--force"))
    assert "holds files that jetrl quantize did not write" in msg
    assert (notes / "thesis.txt").read_text() == "mine"
    assert (run_dir / "checkpoints" / "step_000002" / "weights").read_text() == "precious"
    q = tmp_path / "q"
    for force in ([], ["--force"]):  # an earlier output of its own is replaced
        assert invoke("quantize", loop.tiny_policy_dir(), "-o", q, "--format", "fp8-tensor", *force).exit_code == 0
    assert "quantization_config" in json.loads((q / "config.json").read_text())


def _rows(tmp_path, rows) -> "Path":
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _row(step=0, group=0, **kw):
    return {"step": step, "group": group, "prompt_ids": [1, 2], "tokens": [3, 4], "logprobs": [-0.5, -1.0],
            "reward": 1.0, **kw}


def test_train_reads_a_runs_rollouts_with_each_steps_groups_apart(tmp_path):
    """A run's rollouts.jsonl holds every step's groups under the same numbers: train counted step 1's
    group 0 and step 2's group 0 as one group of 2n and refused the file."""
    from jetrl_cli.cli import _read_rollouts

    f = _rows(tmp_path, [_row(s, g) for s in (1, 2) for g in (0, 1) for _ in range(2)])
    rows = _read_rollouts(f, vocab=16, max_len=8, n=2)
    assert [r["group"] for r in rows] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [(r["step"], r["group"]) for r in _read_rollouts(f, vocab=16, max_len=8, n=2, step=2)] == [
        (2, 0), (2, 0), (2, 1), (2, 1)]
    with pytest.raises(JetrlError, match=r"no samples of step 3 \(steps in the file: 1, 2\)"):
        _read_rollouts(f, vocab=16, step=3)
    with pytest.raises(JetrlError, match="step 1's group 0 has 2 samples, rollout.n is 4"):
        _read_rollouts(f, vocab=16, n=4)


@pytest.mark.parametrize("change, msg", [
    ({"logprobs": ["x", -1.0]}, r"logprobs holds 'x'; a token's log-probability is a finite number <= 0"),
    ({"logprobs": [float("nan"), -1.0]}, "logprobs holds nan"),
    ({"logprobs": [5.0, -1.0]}, "logprobs holds 5.0"),
    ({"logprobs": [-1.0]}, r"logprobs must be a list with one number per token \(2\)"),
    ({"reward": "good"}, "reward is 'good'; it must be a finite number"),
    ({"reward": None}, "reward is None"),
    ({"reward": float("inf")}, "reward is inf"),
    ({"group": [1]}, r"group is \[1\]; it must be an integer >= 0"),
    ({"step": -1}, "step is -1"),
    ({"tokens": "abc"}, "tokens must be a non-empty list of token ids"),
    ({"tokens": [True, 3]}, "tokens must be a non-empty list of token ids"),
    ({"prompt_ids": []}, "prompt_ids must be a non-empty list of token ids"),
    ({"prompt_ids": [1] * 7}, r"prompt and completion are 9 tokens, longer than rollout.max_len \(8\)"),
])
def test_rollout_files_are_checked_field_by_field(tmp_path, change, msg):
    """Each of these gave a traceback or trained on nonsense."""
    from jetrl_cli.cli import _read_rollouts

    f = _rows(tmp_path, [_row(), _row(**change)])
    with pytest.raises(JetrlError, match=f"{re.escape(str(f))}:2: {msg}"):
        _read_rollouts(f, vocab=16, max_len=8, n=2)


def test_a_flow_by_name_takes_overrides_and_a_typo_lists_the_flows():
    res = invoke("flow", "int8-rollout", "--set", "precision.rollout.kv_cache=fp8_e4m3", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rollout"]["kv_cache"] == "fp8_e4m3 row"
    msg = one_line_error(invoke("flow", "int8-rolout"))
    assert "flows by name: bf16, fp8-rollout, int8-rollout, fp8-unified" in msg


def test_output_paths_of_the_wrong_kind_are_refused_before_any_work(tmp_path):
    """These failed only once the work was done (a rollout sampled, a report scored, a bench timed)."""
    a_file = tmp_path / "f"
    a_file.write_text("")
    cases = [(("rollout", "bf16", "-o", tmp_path, "--force"), f"-o {tmp_path}: is a directory"),
             (("rollout", "bf16", "-o", a_file / "x.jsonl"), f"{a_file} is a file, not a directory"),
             (("mismatch-report", "bf16", "--out", a_file), f"--out {a_file}: is a file"),
             (("bench", "gemm", "--out", tmp_path), f"--out {tmp_path}: is a directory"),
             (("bench", "gemm", "--history", tmp_path), f"--history {tmp_path}: is a directory"),
             (("run", "bf16", "-o", a_file), f"-o {a_file}: is a file")]
    for args, want in cases:
        assert want in one_line_error(invoke(*args)), args


def test_an_empty_model_path_or_a_file_is_named_as_such(tmp_path):
    """``model.path=`` read as "." and ``model.path=<a file>`` said "no tokenizer.json"."""
    with pytest.raises(JetrlError, match=r"^model.path: empty \(a Hugging Face model directory, or 'tiny'\)$"):
        loop.resolve_model_dir("")
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(JetrlError, match=f"model.path: {re.escape(str(f))}: a file, not a directory"):
        loop.resolve_model_dir(str(f))
