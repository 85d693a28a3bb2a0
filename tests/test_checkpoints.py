"""Checkpoints and resumed runs when something went wrong before: a kill mid-write, a run resumed from
an earlier checkpoint, ``--force`` killed halfway, a damaged optimizer state, settings a resume may not
change."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from jetrl_cli.config import load_job_config
from jetrl_cli.distributed.checkpoint import restore_trainer
from jetrl_cli.distributed.world import SINGLE
from jetrl_cli.errors import JetrlError
from jetrl_cli.rl import checkpoint as ck
from jetrl_cli.rl.loop import run

SMALL = ["rollout.prompts_per_step=2", "rollout.n=2", "eval.prompts=4", "eval.every=0", "rollout.max_new_tokens=16"]


def _step_dir(root, step, payload="w"):
    d = root / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "trainer_state.pt").write_text(payload)
    return d


def test_pruning_counts_by_step_up_to_the_new_checkpoint(tmp_path):
    """A run resumed from step 2 while a step-4 checkpoint of the abandoned run remains: saving step 3
    with keep 1 keeps step 3 (it used to delete it, as the name sorted before step 4's) and leaves step
    4 to be replaced when the run gets there; steps past 999999 sort by number; a staging directory
    left by a killed save goes."""
    for s in (2, 4):
        _step_dir(tmp_path, s)
    (tmp_path / "checkpoints" / ".tmp-step_000001").mkdir()
    tmp, final = ck.checkpoint_dirs(tmp_path, 3)
    tmp.mkdir()
    (tmp / "trainer_state.pt").write_text("new")
    ck.publish_checkpoint(tmp_path, tmp, final, keep=1)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000003", "step_000004"]
    assert ck.latest_checkpoint(tmp_path) == final and (final / "trainer_state.pt").read_text() == "new"

    big = tmp_path / "big"
    _step_dir(big, 999_999)
    tmp, final = ck.checkpoint_dirs(big, 1_000_000)
    tmp.mkdir()
    (tmp / "trainer_state.pt").write_text("new")
    ck.publish_checkpoint(big, tmp, final, keep=1)
    assert [p.name for p in (big / "checkpoints").iterdir()] == ["step_1000000"]


def test_atomic_write_leaves_the_old_file_whole_when_the_write_fails(tmp_path, monkeypatch):
    f = tmp_path / "metrics.jsonl"
    f.write_text("old\n")

    def broken(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.os, "fsync", broken)
    with pytest.raises(OSError):
        ck.atomic_write_text(f, "new\n" * 1000)
    assert f.read_text() == "old\n"
    monkeypatch.undo()
    ck.atomic_write_text(f, "new\n")
    assert f.read_text() == "new\n"


def test_a_checkpoint_keeps_every_tokenizer_file_and_says_float32_in_both_dtype_keys(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen2", "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json"):
        (src / name).write_text(name)
    dst = tmp_path / "dst"
    dst.mkdir()
    ck.write_model_files(dst, {"w": torch.randn(2, 2)}, src, tie_word_embeddings=False)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json"):
        assert (dst / name).read_text() == name


class _Held:
    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_an_optimizer_state_that_does_not_fit_is_one_line(tmp_path):
    own = _Held(torch.nn.Linear(4, 4))
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    other_opt = torch.optim.AdamW(other.parameters())
    other(torch.randn(2, 4)).sum().backward()
    other_opt.step()
    ckpt = _step_dir(tmp_path, 2)
    torch.save({"step": 2, "optimizer": other_opt.state_dict()}, ckpt / "trainer_state.pt")
    with pytest.raises(JetrlError, match=r"trainer_state.pt: its optimizer state does not fit this model's parameters "
                       r"\(.*\); the file is damaged or from another model"):
        restore_trainer(own, ckpt, SINGLE)
    torch.save({"step": 2}, ckpt / "trainer_state.pt")
    with pytest.raises(JetrlError, match=r"trainer_state.pt: holds no optimizer state"):
        restore_trainer(own, ckpt, SINGLE)
    torch.save({"step": 2, "optimizer": own.opt.state_dict()}, ckpt / "trainer_state.pt")
    assert restore_trainer(own, ckpt, SINGLE) == 2


def _resumed_lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_resume_drops_a_rollout_line_cut_by_the_kill_and_rewrites_whole_files(tmp_path):
    cfg = load_job_config("fp8-unified", SMALL + ["train.steps=4", "run.checkpoint_every=2"])
    out = tmp_path / "r"
    run(cfg, out, stop_after=3)  # killed after step 3; the last checkpoint is step 2's
    rollouts = out / "rollouts.jsonl"
    text = rollouts.read_text()
    rollouts.write_text(text[:-20])  # the kill cut the last line
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text()[:-5])
    lines = run(cfg, out, resume=True)
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
    rows = _resumed_lines(rollouts)
    assert [sum(r["step"] == s for r in rows) for s in (1, 2, 3, 4)] == [4, 4, 4, 4]
    assert [m["step"] for m in _resumed_lines(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert not list(out.glob(".*.tmp"))

    # a damaged line that is not the last is named, not carried on
    (out / "latest").write_text("step_000002\n")  # as if killed after step 2's checkpoint
    body = rollouts.read_text().splitlines()
    body[1] = body[1][:30]
    rollouts.write_text("\n".join(body) + "\n")
    with pytest.raises(JetrlError, match=rf"{rollouts}:2: not a JSON line \(.*\); the file is damaged"):
        run(cfg, out, resume=True)
    body[1] = json.dumps({"no": "step"})
    rollouts.write_text("\n".join(body) + "\n")
    with pytest.raises(JetrlError, match=rf"{rollouts}:2: a line without an integer \"step\"; the file is damaged"):
        run(cfg, out, resume=True)


def test_resume_refuses_a_new_length_for_a_cosine_schedule(tmp_path):
    cfg = load_job_config("bf16", ["train.lr_schedule=cosine", "train.steps=40"])
    out = tmp_path / "r"
    out.mkdir()
    (out / "preset.yaml").write_text(yaml.safe_dump(cfg.raw, sort_keys=False))
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    _step_dir(out, 2)
    (out / "latest").write_text("step_000002\n")
    longer = load_job_config("bf16", ["train.lr_schedule=cosine", "train.steps=80"])
    with pytest.raises(JetrlError, match=r"train.steps: 40 -> 80 would stretch this run's cosine learning-rate "
                       r"schedule mid-run"):
        run(longer, out, resume=True)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_run_that_force_set_aside_and_nothing_put_back_is_named(tmp_path):
    """``--force`` moves the old run aside until the new run's first checkpoint; killed before it, the old
    run stays aside: the next run in that directory names it (and the way back) rather than starting
    without it, and once the new run has a checkpoint the old copy is deleted, as --force meant."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # the new run, killed before its checkpoint
    aside = tmp_path / f".r.replaced-{_dead_pid()}"
    _step_dir(aside, 4, "precious")
    cfg = load_job_config("bf16", SMALL + ["train.steps=1"])
    for kw in ({"resume": True}, {"replace": True}, {}):
        with pytest.raises(JetrlError, match=rf"{aside}: the run that --force replaced in {out}, kept because the "
                           rf"new run was stopped before its first checkpoint; put it back \(rm -r {out} && mv "):
            run(cfg, out, **kw)
    assert (aside / "checkpoints" / "step_000004" / "trainer_state.pt").read_text() == "precious"
    _step_dir(out, 1)
    (out / "latest").write_text("step_000001\n")
    with pytest.raises(JetrlError, match="already holds a run"):
        run(cfg, out)
    assert not aside.exists()
    live = tmp_path / f".r.replaced-{os.getpid()}"  # a --force in progress in another process: not touched
    live.mkdir()
    with pytest.raises(JetrlError, match="already holds a run"):
        run(cfg, out)
    assert live.exists()


def test_force_with_no_steps_does_not_replace_a_run(tmp_path):
    cfg = load_job_config("bf16", SMALL + ["train.steps=1", "run.checkpoint_every=1"])
    out = tmp_path / "r"
    run(cfg, out)
    with pytest.raises(JetrlError, match=r"--force with train.steps: 0 would replace this run with one that writes "
                       r"no checkpoint; write the evaluation elsewhere \(-o\)"):
        run(load_job_config("bf16", SMALL + ["train.steps=0"]), out, replace=True)
    assert ck.latest_checkpoint(out).name == "step_000001"


def test_a_rollout_longer_than_the_models_positions_is_refused():
    from jetrl_cli.rl.loop import setup

    cfg = load_job_config("bf16", ["rollout.max_len=513"])
    with pytest.raises(JetrlError, match=r"rollout.max_len: 513 is longer than the model's 512 positions "
                       r"\(max_position_embeddings in .*config.json\); set rollout.max_len <= 512"):
        setup(cfg, with_trainer=False)


def test_fewer_groups_than_minibatches_take_one_step_per_group():
    from .test_algos import _trainer, _update_batch

    b, adv = _update_batch()  # two groups
    tr = _trainer(6, minibatches=4)
    st = tr.update(b, adv, tr.score(b), None, step=1)
    assert tr.updates == 2 and st["grad_norm"] > 0
    assert all(s["step"] == 2 for s in tr.opt.state.values())
