"""The commands' own options and defaults: a value that cannot work is one line naming the option or
key and what is allowed, found before the work starts; never a traceback, never a silently wrong result."""

import json
import shutil

from jetrl_cli.rl import loop

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


def _resized_copy(src, dst, vocab):
    """The tiny policy with its vocabulary cut or padded to ``vocab`` rows (a valid model on its own)."""
    import torch

    from jetrl_cli.fileio import save_safetensors
    from jetrl_cli.models.hf import read_tensors

    shutil.copytree(src, dst)
    t = read_tensors(dst / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = t[name]
        t[name] = w[:vocab] if vocab <= len(w) else torch.cat([w, w[: vocab - len(w)]])
    save_safetensors(t, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))
    (dst / "tokenizer.json").unlink()  # a model directory without a tokenizer: only its vocab_size says what it is
    return dst


def test_mismatch_report_model_must_be_a_model_of_the_presets_tokenizer(tmp_path):
    """--model's weights score text tokenized by model.path's tokenizer: a smaller vocabulary failed in the
    embedding (IndexError), a larger one or another tokenizer gave a report on the wrong text."""
    tiny = loop.tiny_policy_dir()
    args = ["mismatch-report", "bf16", "--flows", "bf16", "--no-attribution", "--prompts", 1, "--lengths", 4, "--json"]
    small = _resized_copy(tiny, tmp_path / "small", 32)
    msg = one_line_error(invoke(*args, "--model", small))
    assert msg == (f"error: --model {small}: vocab_size 32, but model.path's tokenizer ({tiny}) has 52 tokens "
                   f"(a different model?); to report on that model, --set model.path={small} instead of --model")
    large = _resized_copy(tiny, tmp_path / "large", 96)
    msg = one_line_error(invoke(*args, "--model", large))
    assert msg.startswith(f"error: --model {large}: vocab_size 96, but model.path ({tiny}) has 64: another model")
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    tk = json.loads((other / "tokenizer.json").read_text())
    vocab = tk["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]  # the same size, other ids
    (other / "tokenizer.json").write_text(json.dumps(tk))
    msg = one_line_error(invoke(*args, "--model", other))
    assert msg.startswith(f"error: --model {other}: its tokenizer.json has another vocabulary than model.path's")
    same = tmp_path / "same"
    shutil.copytree(tiny, same)
    res = invoke(*args, "--model", same)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["model"] == str(same)
