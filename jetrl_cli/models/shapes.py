"""Models to benchmark without weights: real models' shapes with random weights (their
``transformers`` twins: ``transformers_ref.transformers_twin``).

``jetrl bench --model qwen2.5-1.5b`` builds a model with Qwen2.5-1.5B's configuration (hidden
size, heads, vocabulary, biases, RoPE) and random weights, so speed and memory can be measured on
a machine that has no checkpoint and no network. ``--layers N`` keeps the first N decoder layers,
which is how 7-8B *layer shapes* are measured on one GPU: a whole 8B model with fp32 master weights
and Adam states does not fit on one card.

The configurations are the published ``config.json`` values of each model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .llama import LlamaForCausalLM, ModelConfig

SHAPES: dict[str, ModelConfig] = {
    "qwen2.5-1.5b": ModelConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True),
    "qwen2.5-7b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=True),
    "llama-3-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False),
}


def with_layers(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    if layers is None:
        return cfg
    if not 0 < layers <= cfg.num_hidden_layers:
        from ..errors import JetrlError

        raise JetrlError(f"--layers {layers}: the model has {cfg.num_hidden_layers} decoder layers (allowed: 1.."
                         f"{cfg.num_hidden_layers})")
    return dataclasses.replace(cfg, num_hidden_layers=layers)


def random_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0, std: float = 0.02) -> LlamaForCausalLM:
    """``cfg``'s model in fp32 with N(0, std) weights (norms at 1, biases at 0), built on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return init_weights(model, std, g)


def init_weights(model: LlamaForCausalLM, std: float, generator: torch.Generator | None = None) -> LlamaForCausalLM:
    """Norms at 1, biases at 0, every other parameter N(0, std), drawn in parameter order from
    ``generator`` (torch's global one if None)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
    return model


def truncate_layers(model: LlamaForCausalLM, layers: int | None) -> LlamaForCausalLM:
    """Keep the first ``layers`` decoder layers of a loaded model (in place)."""
    cfg = with_layers(model.config, layers)
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config = cfg
    return model


def load_bench_model(name: str, layers: int | None = None):
    """``(make, config, label)`` for ``jetrl bench --model NAME [--layers N]``: ``make(device)`` builds
    a fresh fp32 copy of the model on ``device`` (the same weights every call). NAME is "tiny", a
    Hugging Face model directory, or a shape in ``SHAPES`` (random weights)."""
    import copy

    if name in SHAPES:
        cfg = with_layers(SHAPES[name], layers)
        label = name if layers is None else f"{name} ({layers} layers)"
        return (lambda device: random_model(cfg, device)), cfg, label
    from ..rl.loop import resolve_model_dir
    from .hf import load_model

    path = resolve_model_dir(name)
    base = truncate_layers(load_model(path), layers)
    label = path.name if layers is None else f"{path.name} ({layers} layers)"
    return (lambda device: copy.deepcopy(base).to(device)), base.config, label


def tokenizer_dir() -> Path:
    """A tokenizer for random-weight shapes: the tiny policy's (its ids are inside every large vocabulary)."""
    return Path(__file__).resolve().parent.parent / "assets" / "tiny-policy"
