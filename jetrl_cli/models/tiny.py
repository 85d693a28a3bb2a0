"""Tiny randomly initialised Llama-family checkpoints, built locally from a seed (nothing downloaded).

Used by the tests and by the README's first command to have a real HF directory to quantize.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .llama import LlamaForCausalLM, ModelConfig


def tiny_config(model_type: str = "qwen2", hidden: int = 256, layers: int = 2, vocab: int = 512) -> ModelConfig:
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
    )


def write_random_model(path: str | Path, seed: int = 0, model_type: str = "qwen2", **kw) -> Path:
    """Write config.json + model.safetensors (bf16) for a random model; returns the directory."""
    from safetensors.torch import save_file

    cfg = tiny_config(model_type, **kw)
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones_like(p)
        elif name.endswith(".bias"):
            state[name] = torch.randn(p.shape, generator=gen) * 0.02
        else:
            state[name] = torch.randn(p.shape, generator=gen) * 0.05
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    from .hf import ARCHITECTURES

    arch = ARCHITECTURES[model_type]
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1.0}) + "\n")
    return path


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random Llama-family HF checkpoint.")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-type", default="qwen2", choices=["qwen2", "llama", "mistral"])
    args = ap.parse_args()
    print(write_random_model(args.out, args.seed, args.model_type))
