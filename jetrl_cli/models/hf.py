"""Hugging Face causal-LM directories: config.json + safetensors (single file or sharded), local only.

Reads plain checkpoints (fp32 / bf16 / fp16) and the quantized ones ``jetrl quantize`` writes
(vLLM block-FP8, per-tensor FP8, compressed-tensors per-channel FP8 / INT8), which it dequantizes
with the precision core's own dequantizer. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import JetrlError
from .llama import LlamaForCausalLM, ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_FILE = "model.safetensors.index.json"


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise JetrlError(f"{p}: no such directory")
    if not p.is_dir():
        raise JetrlError(f"{p}: not a directory (expected a Hugging Face model directory)")
    if not (p / "config.json").exists():
        if (p / "latest").is_file():  # a run's (or jetrl train's) directory: its checkpoints are models
            ck = p / "checkpoints" / (p / "latest").read_text().strip()
            raise JetrlError(f"{p}: a jetrl run directory, not a model; its latest checkpoint is {ck}")
        raise JetrlError(f"{p}: no config.json (expected a Hugging Face model directory)")
    return p


def read_config(path: str | Path) -> tuple[ModelConfig, dict]:
    p = check_model_dir(path)
    try:
        raw = json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise JetrlError(f"{p / 'config.json'}: invalid JSON ({e.msg}, line {e.lineno})") from None
    mt = raw.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise JetrlError(
            f"{p / 'config.json'}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("default", "llama3"):
        raise JetrlError(f"{p / 'config.json'}: rope scaling {scaling.get('rope_type')!r} is not supported (default, llama3)")
    heads = raw["num_attention_heads"]
    try:
        cfg = ModelConfig(
            model_type=mt,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if mt == "qwen2" else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
        )
    except KeyError as e:
        raise JetrlError(f"{p / 'config.json'}: missing key {e.args[0]!r}") from None
    return cfg, raw


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise JetrlError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise JetrlError(f"{file}: cannot read safetensors ({str(e).splitlines()[0]})") from None


def _dequantize_state(state: dict[str, torch.Tensor], qcfg: dict | None) -> dict[str, torch.Tensor]:
    from ..precision import CastSpec, QTensor, dequantize

    out = {}
    block = tuple((qcfg or {}).get("weight_block_size") or (128, 128))
    for name, t in state.items():
        if name.endswith((".weight_scale_inv", ".weight_scale", ".input_scale")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        scale = None
        if base is not None:
            if f"{base}.weight_scale_inv" in state:
                scale, blk = state[f"{base}.weight_scale_inv"], f"{block[0]}x{block[1]}"
            elif f"{base}.weight_scale" in state:
                scale = state[f"{base}.weight_scale"]
                blk = "tensor" if scale.numel() == 1 else "row"
        if scale is not None:
            fmt = "int8" if t.dtype == torch.int8 else "fp8_e4m3"
            s = scale.float()
            s = s.reshape(1, 1) if blk == "tensor" else s.reshape(-1, 1) if blk == "row" else s
            out[name] = dequantize(QTensor(t, s, CastSpec(fmt, blk)))
        else:
            out[name] = t
    return out


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    p = check_model_dir(path)
    raw = json.loads((p / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(p):
        state.update(read_tensors(f))
    return _dequantize_state(state, raw.get("quantization_config"))


def expected_shapes(cfg) -> dict[str, torch.Size]:
    """Every parameter's shape under ``config.json`` (the model built on the meta device: no memory)."""
    from .llama import LlamaForCausalLM

    with torch.device("meta"):
        return {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}


def check_tensor_shape(path, name: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise JetrlError(f"{path}: tensor {name} is {tuple(got)}, config.json makes it {tuple(want)} "
                         "(config.json and the weights are of different models?)")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build the model from config.json and load its (dequantized) weights."""
    cfg, _ = read_config(path)
    model = LlamaForCausalLM(cfg)
    state = load_state_dict(path)
    if cfg.tie_word_embeddings:
        head, embed = state.pop("lm_head.weight", None), state.get("model.embed_tokens.weight")
        if head is not None and embed is not None and not (head.shape == embed.shape and torch.equal(head, embed)):
            raise JetrlError(f"{path}: config.json has tie_word_embeddings: true, but the checkpoint's lm_head.weight "
                             "is not model.embed_tokens.weight (set tie_word_embeddings to false to use it)")
    shapes = model.state_dict()
    expected = set(shapes)
    missing = sorted(expected - set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    unexpected = sorted(set(state) - expected)
    if missing:
        raise JetrlError(f"{path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    if unexpected:
        raise JetrlError(f"{path}: checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[0]}")
    for k, v in state.items():
        check_tensor_shape(path, k, v.shape, shapes[k].shape)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    return model.to(dtype)
