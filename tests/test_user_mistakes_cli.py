"""The commands' own options and defaults: a value that cannot work is one line naming the option or
key and what is allowed, found before the work starts; never a traceback, never a silently wrong result."""

import json

from .test_run_output import TINY, invoke, sets
from .test_user_mistakes import one_line_error


def test_rollout_and_train_default_outputs_beside_an_out_dir_of_dot_or_root(tmp_path, monkeypatch):
    """``run.out_dir: .`` is the current directory (its outputs beside it, as for any directory);
    ``/`` has nothing beside it: -o is needed."""
    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    res = invoke("rollout", "bf16", "--prompts", 1, "--json", *sets(TINY + ["run.out_dir=."]))
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["file"] == str(tmp_path / "a" / "work-rollout.jsonl")
    for cmd in (["rollout", "bf16"], ["train", "bf16", "--rollouts", tmp_path / "a" / "work-rollout.jsonl"]):
        msg = one_line_error(invoke(*cmd, *sets(TINY + ["run.out_dir=/"])))
        assert msg.startswith("error: run.out_dir /: the default output lies beside") and msg.endswith("give -o")
    res = invoke("train", "bf16", "--rollouts", tmp_path / "a" / "work-rollout.jsonl", "--json",
                 *sets(TINY + ["run.out_dir=..", "train.micro_batch=2"]))
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["checkpoint"].startswith(str(tmp_path / "a-train" / "checkpoints"))
