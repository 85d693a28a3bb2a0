"""The shipped tiny policy: loads as a HF directory, starts RL with non-zero reward, rebuilds from a seed."""

import torch

from jetrl_cli.config import build_job_config
from jetrl_cli.models.make_tiny_policy import build
from jetrl_cli.rl.loop import evaluate, setup, tiny_policy_dir


def test_shipped_policy_has_nonzero_but_imperfect_reward():
    d = tiny_policy_dir()
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in d.iterdir()}
    assert sum(p.stat().st_size for p in d.iterdir()) < 4 * 2**20
    cfg = build_job_config({"precision": "bf16", "task": {"name": "arith", "digits": 3}}, "t", "t")
    ev, samples = evaluate(setup(cfg, with_trainer=False), 64)
    acc = ev["eval_accuracy"]
    assert 0.05 < acc < 0.95, acc  # room for RL either way
    assert all(s["completion"] for s in samples)


def test_policy_build_is_reproducible_from_the_seed(tmp_path):
    a = build(tmp_path / "a", seed=3, steps=2, batch=4, log=lambda *_: None)
    b = build(tmp_path / "b", seed=3, steps=2, batch=4, log=lambda *_: None)
    c = build(tmp_path / "c", seed=4, steps=2, batch=4, log=lambda *_: None)
    ab = [(a / f).read_bytes() == (b / f).read_bytes() for f in ("model.safetensors", "tokenizer.json", "config.json")]
    assert all(ab)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    from jetrl_cli.models.hf import load_model

    m = load_model(a)
    assert m(torch.tensor([[4, 5, 6]])).shape == (1, 3, 64)
