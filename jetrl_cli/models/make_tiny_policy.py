"""Build the tiny policy that ships with jetrl, from scratch, reproducibly from a seed.

A character-level Qwen2-style model (4 layers, hidden 128, ~0.8M parameters) warmed up by
supervised training on jetrl's built-in tasks (``arith`` with 1-4 digits, ``sort`` and ``count``
with 2-8 items), on the train split only. It is deliberately short of perfect, so RL on CPU starts
from a policy with non-zero but improvable reward::

    python -m jetrl_cli.models.make_tiny_policy jetrl_cli/assets/tiny-policy --seed 0

Takes a few minutes on 2 CPU cores. The same seed, torch version and CPU give the same bits.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch

from ..tasks import ALPHABET, Arith, Count, Sort, _is_eval
from .llama import LlamaForCausalLM, ModelConfig
from .shapes import init_weights
from .tokenizer import Tokenizer, write_char_tokenizer

EOS_ID, PAD_ID = 1, 0


def tiny_policy_config(vocab: int) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2", vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False, attention_bias=True,
    )


def warmup_example(rng: random.Random):
    kind = rng.random()
    if kind < 0.5:
        task = Arith(rng.randint(1, 4))
    elif kind < 0.75:
        task = Sort(rng.randint(2, 8))
    else:
        task = Count(rng.randint(2, 8))
    while True:
        p = task.make(rng)
        if not _is_eval(p.prompt):
            return p


def build(out: Path, seed: int = 0, steps: int = 350, batch: int = 64, lr: float = 3e-3, log=print) -> Path:
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    write_char_tokenizer(out, ALPHABET)
    tok = Tokenizer.from_dir(out)
    vocab = 64
    assert tok.vocab_size <= vocab
    cfg = tiny_policy_config(vocab)
    model = init_weights(LlamaForCausalLM(cfg), 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    for step in range(steps):
        seqs, masks = [], []
        for _ in range(batch):
            p = warmup_example(rng)
            a, b = tok.encode(p.prompt), tok.encode(" " + p.solution if not p.solution.startswith(" ") else p.solution)
            seqs.append(a + b + [EOS_ID])
            masks.append([0] * len(a) + [1] * (len(b) + 1))
        t = max(map(len, seqs))
        ids = torch.full((batch, t), PAD_ID)
        m = torch.zeros(batch, t)
        for i, (s, k) in enumerate(zip(seqs, masks)):
            ids[i, :len(s)] = torch.tensor(s)
            m[i, :len(k)] = torch.tensor(k, dtype=torch.float32)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        logits = model(ids)[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll * m[:, 1:].reshape(-1)).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.0f}s")
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "use_sliding_window": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID, "pad_token_id": PAD_ID}) + "\n")
    (out / "README.md").write_text(
        "# jetrl tiny policy\n\nA character-level Qwen2-style model (~0.8M parameters) for jetrl's CPU presets, "
        "warmed up on the built-in tasks (arith 1-4 digits, sort and count 2-8 items; train split only).\n\n"
        f"Made by `python -m jetrl_cli.models.make_tiny_policy DIR --seed {seed} --steps {steps}`.\n"
    )
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=350)
    args = ap.parse_args()
    print(build(args.out, args.seed, args.steps))
