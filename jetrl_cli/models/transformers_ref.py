"""``transformers`` models as a reference (``jetrl bench`` times ``generate()`` and a training step
next to jetrl's engine and trainer), loaded quietly.

``from_pretrained`` / ``from_config`` take the weights' dtype as ``dtype`` since transformers 4.56
and warn on the old ``torch_dtype``; loading also draws a progress bar on stderr. Neither belongs in
jetrl's output: the dtype goes under the name the installed version reads, and transformers'
warnings and progress bars are off while the model loads (restored afterwards).
"""

from __future__ import annotations

import contextlib


def _dtype_kwarg(version: str) -> str:
    major, minor = (int("".join(ch for ch in p if ch.isdigit()) or 0) for p in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


@contextlib.contextmanager
def quiet():
    """transformers' warnings and progress bars off (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def hf_config_dict(cfg) -> dict:
    """A ``config.json`` for ``transformers`` describing jetrl's ``ModelConfig``."""
    from .hf import ARCHITECTURES

    arch = ARCHITECTURES[cfg.model_type]
    d = {
        "architectures": [arch], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "float32",
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.model_type in ("llama", "qwen3"):
        d["attention_bias"] = cfg.attention_bias
        d["mlp_bias"] = cfg.mlp_bias
    return d


def transformers_twin(model, dtype):
    """jetrl's ``model`` (a ``LlamaForCausalLM`` of ``jetrl_cli.models.llama``) as a ``transformers``
    model with the same weights, SDPA attention, in ``dtype``, on the same device: the baseline
    ``jetrl bench`` times next to jetrl. Works for a loaded checkpoint and for a random-weight shape
    alike, and loads quietly."""
    import torch
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**hf_config_dict(model.config))
    dev = model.lm_head.weight.device
    with quiet(), torch.device(dev):
        hf = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, attn_implementation="sdpa", **{_dtype_kwarg(transformers.__version__): dtype})
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"transformers twin: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf.to(dtype)
