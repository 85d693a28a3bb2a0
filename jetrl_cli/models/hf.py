"""Hugging Face causal-LM directories: config.json + safetensors (single file or sharded), local only.

Reads plain checkpoints (fp32 / bf16 / fp16) and the quantized ones ``jetrl quantize`` writes
(vLLM block-FP8, per-tensor FP8, compressed-tensors per-channel FP8 / INT8), which it dequantizes
with the precision core's own dequantizer. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import math
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


def _config_error(f: Path, key: str, got, allowed: str) -> JetrlError:
    shown = json.dumps(got)
    return JetrlError(f"{f}: {key} is {shown if len(shown) <= 60 else shown[:57] + '...'}; {allowed}")


def _config_int(f: Path, raw: dict, key: str, default: int | None = None, minimum: int = 1) -> int:
    """``raw[key]`` (``key``'s last dotted part) as an int >= ``minimum``; ``default`` when absent or
    null, and without a default the key is required."""
    v = raw.get(key.rpartition(".")[2])
    if v is None:
        if default is None:
            raise JetrlError(f"{f}: missing key {key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _config_error(f, key, v, f"must be an integer >= {minimum}")
    return v


def _config_float(f: Path, where: str, v, default: float) -> float:
    """``v`` (the value of ``where``) as a finite number > 0 (``default`` when null)."""
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _config_error(f, where, v, "must be a number > 0")
    return float(v)


def _config_bool(f: Path, raw: dict, key: str) -> bool:
    v = raw.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _config_error(f, key, v, "must be true or false")
    return v


def _config_object(f: Path, raw: dict, key: str) -> dict | None:
    v = raw.get(key)
    if v is not None and not isinstance(v, dict):
        raise _config_error(f, key, v, "must be null or an object")
    return v


def _check_rope_scaling(f: Path, key: str, scaling: dict) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("default", "llama3"):
        raise JetrlError(f"{f}: rope scaling {kind!r} is not supported (default, llama3)")
    if kind != "llama3":
        return
    _config_int(f, scaling, f"{key}.original_max_position_embeddings")
    if scaling.get("factor") is None:
        raise JetrlError(f"{f}: missing key '{key}.factor'")
    _config_float(f, f"{key}.factor", scaling["factor"], 1.0)
    lo = _config_float(f, f"{key}.low_freq_factor", scaling.get("low_freq_factor"), 1.0)
    hi = _config_float(f, f"{key}.high_freq_factor", scaling.get("high_freq_factor"), 4.0)
    if lo == hi:
        raise JetrlError(f"{f}: {key}.low_freq_factor and high_freq_factor are both {lo}; they must differ")


def read_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """``config.json`` as a ``ModelConfig``; every value read is checked (type and range), a wrong
    one named with the file and key."""
    p = check_model_dir(path)
    f = p / "config.json"
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise JetrlError(f"{f}: invalid JSON ({e.msg}, line {e.lineno})") from None
    except UnicodeDecodeError:
        raise JetrlError(f"{f}: not a UTF-8 text file") from None
    if not isinstance(raw, dict):
        raise JetrlError(f"{f}: must be a JSON object (a Hugging Face config), got a {type(raw).__name__}")
    mt = raw.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise JetrlError(f"{f}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    _config_object(f, raw, "quantization_config")
    rope = _config_object(f, raw, "rope_parameters") or {}
    scaling = _config_object(f, raw, "rope_scaling")
    scaling_key = "rope_scaling"
    if not scaling and rope.get("rope_type", "default") != "default":
        scaling, scaling_key = rope, "rope_parameters"
    if scaling:
        _check_rope_scaling(f, scaling_key, scaling)
    else:
        scaling = None
    heads = _config_int(f, raw, "num_attention_heads")
    kv_heads = _config_int(f, raw, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise JetrlError(f"{f}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    hidden = _config_int(f, raw, "hidden_size")
    head_dim = _config_int(f, raw, "head_dim", hidden // heads)
    if head_dim % 2 or head_dim < 2:  # RoPE rotates pairs of dimensions
        raise _config_error(f, "head_dim" if raw.get("head_dim") is not None else "hidden_size / num_attention_heads",
                            head_dim, "must be an even integer >= 2 (RoPE rotates pairs)")
    rope_theta = rope.get("rope_theta", raw.get("rope_theta"))
    cfg = ModelConfig(
        model_type=mt,
        vocab_size=_config_int(f, raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_config_int(f, raw, "intermediate_size"),
        num_hidden_layers=_config_int(f, raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_config_float(f, "rms_norm_eps", raw.get("rms_norm_eps"), 1e-6),
        rope_theta=_config_float(f, "rope_parameters.rope_theta" if "rope_theta" in rope else "rope_theta",
                                 rope_theta, 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=_config_int(f, raw, "max_position_embeddings", 2048),
        tie_word_embeddings=_config_bool(f, raw, "tie_word_embeddings"),
        attention_bias=True if mt == "qwen2" else _config_bool(f, raw, "attention_bias"),
        mlp_bias=_config_bool(f, raw, "mlp_bias"),
    )
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


def _dequantize_state(state: dict[str, torch.Tensor], qcfg: dict | None,
                      file_of: dict[str, Path]) -> dict[str, torch.Tensor]:
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
            if t.dtype not in (torch.int8, torch.float8_e4m3fn):
                raise JetrlError(f"{file_of[name]}: tensor {name} has a scale but dtype {t.dtype}; "
                                 "a quantized weight is int8 or float8_e4m3fn")
            fmt = "int8" if t.dtype == torch.int8 else "fp8_e4m3"
            s = scale.float()
            s = s.reshape(1, 1) if blk == "tensor" else s.reshape(-1, 1) if blk == "row" else s
            out[name] = dequantize(QTensor(t, s, CastSpec(fmt, blk)))
        else:
            out[name] = t
    return out


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, quantized ones dequantized; a tensor that is not fp32/bf16/fp16
    once dequantized (an integer tensor, a quantized weight without its scale) or holds NaN/Inf is
    refused, named with its file."""
    p = check_model_dir(path)
    _, raw = read_config(p)
    state: dict[str, torch.Tensor] = {}
    file_of: dict[str, Path] = {}
    for f in safetensors_files(p):
        tensors = read_tensors(f)
        state.update(tensors)
        file_of.update(dict.fromkeys(tensors, f))
    state = _dequantize_state(state, raw.get("quantization_config"), file_of)
    for name, t in state.items():
        if t.dtype not in FLOAT_DTYPES:
            raise JetrlError(f"{file_of[name]}: tensor {name} has dtype {t.dtype}; expected fp32, bf16 or fp16"
                             + (" (a quantized weight without its scale?)" if t.is_floating_point() else ""))
        if not torch.isfinite(t).all():
            raise JetrlError(f"{file_of[name]}: tensor {name} contains NaN or Inf (a diverged or damaged checkpoint)")
    return state


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
