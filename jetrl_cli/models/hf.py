"""Hugging Face causal-LM directories: config.json + safetensors (single file or sharded), local only.

Reads plain checkpoints (fp32 / bf16 / fp16) and the quantized ones ``jetrl quantize`` writes
(vLLM block-FP8, per-tensor FP8, compressed-tensors per-channel FP8 / INT8), which it dequantizes
with the precision core's own dequantizer. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable

import torch

from ..errors import JetrlError
from ..fileio import read_json
from .llama import LlamaForCausalLM, ModelConfig

# model_type -> the transformers class config.json's "architectures" names: the model types jetrl reads
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_FILE = "model.safetensors.index.json"


def check_model_dir(path: str | Path) -> Path:
    """``path`` as a model directory; "tiny" (when no such path exists) is the policy shipped with
    jetrl, as ``model.path: tiny`` is everywhere else."""
    p = Path(path)
    if str(path) == "tiny" and not p.exists():
        from ..rl.loop import tiny_policy_dir  # imported here: rl.loop imports this module

        p = tiny_policy_dir()
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
    raw = read_json(f)
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
        qk_norm=mt == "qwen3",
    )
    if mt in ("qwen2", "qwen3") and _config_bool(f, raw, "use_sliding_window"):
        raise _config_error(f, "use_sliding_window", True, "is not supported (jetrl attends over every earlier "
                            "token); the released Qwen2/Qwen3 checkpoints have it false")
    return cfg, raw


def _read_index(path: Path) -> dict[str, str] | None:
    """``model.safetensors.index.json``'s weight_map (tensor name -> shard file name), or None without one."""
    f = path / INDEX_FILE
    if not f.exists():
        return None
    raw = read_json(f)
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise JetrlError(f"{f}: no weight_map (an object mapping each tensor name to its shard file)")
    for name, shard in wm.items():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise _config_error(f, f"weight_map[{name!r}]", shard, f"must name a *.safetensors file in {path}")
    return wm


def safetensors_files(path: Path) -> list[Path]:
    """The files that make the checkpoint, chosen as Hugging Face and vLLM choose them: with an index
    exactly the shards it names (a ``consolidated.safetensors`` or an older ``model.safetensors``
    beside them is another copy of the weights, not a part), without one every ``*.safetensors``."""
    index = _read_index(path)
    if index is None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise JetrlError(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
        return files
    files = [path / name for name in sorted(set(index.values()))]
    for f in files:
        if not f.is_file():
            raise JetrlError(f"{path / INDEX_FILE}: names shard {f.name}, which is missing from {path}")
    return files


# Buffers older conversions saved beside the weights; Hugging Face and vLLM skip them on load.
IGNORED_TENSORS = ("rotary_emb.inv_freq",)


def read_header(file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in ``file``, from its header alone (no tensor data is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise JetrlError(f"{file}: cannot read safetensors ({str(e).splitlines()[0]})") from None


def tensor_files(path: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Where each tensor of the checkpoint is: ``{name: (file, shape)}``, read from the headers of
    ``safetensors_files``. A tensor in two files (which copy is meant?) or one that is not where the
    index says is refused; ignored buffers (``IGNORED_TENSORS``) are left out."""
    index = _read_index(path)
    where: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in safetensors_files(path):
        for name, shape in read_header(f).items():
            if name.endswith(IGNORED_TENSORS):
                continue
            if name in where:
                raise JetrlError(f"{path}: tensor {name} is in both {where[name][0].name} and {f.name}; "
                                 "a checkpoint holds each tensor once (remove the stale file)")
            where[name] = (f, shape)
    for name, shard in (index or {}).items():
        if name.endswith(IGNORED_TENSORS):
            continue
        if name not in where:
            raise JetrlError(f"{path / INDEX_FILE}: maps tensor {name} to {shard}, which does not hold it")
        if where[name][0].name != shard:
            raise JetrlError(f"{path / INDEX_FILE}: maps tensor {name} to {shard}, but {where[name][0].name} "
                             "holds it")
    return where


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise JetrlError(f"{file}: cannot read safetensors ({str(e).splitlines()[0]})") from None


def _block_size(f: Path, qcfg: dict) -> tuple[int, int]:
    v = qcfg.get("weight_block_size")
    if v is None:
        return 128, 128
    if (not isinstance(v, list) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)):
        raise _config_error(f, "quantization_config.weight_block_size", v, "must be [rows, columns] (e.g. [128, 128])")
    return v[0], v[1]


def _check_weight_strategies(f: Path, qcfg: dict) -> None:
    """compressed-tensors' weight strategies jetrl dequantizes: channel and tensor; a group or block
    scale grid is refused here rather than read as something else."""
    if qcfg.get("quant_method") != "compressed-tensors":
        return
    groups = qcfg.get("config_groups")
    for g, group in (groups.items() if isinstance(groups, dict) else ()):
        w = group.get("weights") if isinstance(group, dict) else None
        strategy = w.get("strategy") if isinstance(w, dict) else None
        if strategy not in (None, "channel", "tensor"):
            raise _config_error(f, f"quantization_config.config_groups.{g}.weights.strategy", strategy,
                                "jetrl reads channel or tensor weight scales")


def _scale_kind(file: Path, name: str, weight_shape, scale_name: str, scale: torch.Tensor,
                block: tuple[int, int]) -> str:
    """The block of ``scale`` (``"BNxBK"``, ``"row"`` or ``"tensor"``) once its shape is checked against
    its weight's: a scale grid of another shape would be broadcast into wrong weights, or fail in a
    traceback. ``weight_scale_inv`` is per block (DeepSeek / vLLM block FP8); ``weight_scale`` is one
    value (per tensor) or one per output row."""
    if len(weight_shape) != 2:
        raise JetrlError(f"{file}: tensor {name} has scale {scale_name} but is {tuple(weight_shape)}; "
                         "a quantized weight is 2-D")
    rows, cols = weight_shape
    got = tuple(scale.shape)
    if scale_name.endswith("_inv"):
        bn, bk = block
        want = (-(-rows // bn), -(-cols // bk))
        if got != want:
            raise JetrlError(f"{file}: scale {scale_name} is {got}; {name} is {rows}x{cols}, so its {bn}x{bk}-block "
                             f"scale must be {want}")
        return f"{bn}x{bk}"
    if scale.numel() == 1 and scale.dim() <= 2:
        return "tensor"
    if got not in ((rows, 1), (rows,)):
        raise JetrlError(f"{file}: scale {scale_name} is {got}; {name} is {rows}x{cols}, so its scale must be "
                         f"one value (per tensor), ({rows}, 1) or ({rows},) (per output row)")
    return "row"


def _dequantize_state(path: Path, state: dict[str, torch.Tensor], qcfg: dict | None,
                      file_of: dict[str, Path]) -> dict[str, torch.Tensor]:
    from ..precision import CastSpec, QTensor, dequantize

    out = {}
    qcfg = qcfg or {}
    block = _block_size(path / "config.json", qcfg)
    _check_weight_strategies(path / "config.json", qcfg)
    for name, t in state.items():
        if name.endswith((".weight_scale_inv", ".weight_scale", ".input_scale")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        scale_name = next((f"{base}.{s}" for s in ("weight_scale_inv", "weight_scale")
                           if base is not None and f"{base}.{s}" in state), None)
        if scale_name is None:
            out[name] = t
            continue
        if t.dtype not in (torch.int8, torch.float8_e4m3fn):
            raise JetrlError(f"{file_of[name]}: tensor {name} has a scale but dtype {t.dtype}; "
                             "a quantized weight is int8 or float8_e4m3fn")
        scale = state[scale_name]
        blk = _scale_kind(file_of[scale_name], name, t.shape, scale_name, scale, block)
        fmt = "int8" if t.dtype == torch.int8 else "fp8_e4m3"
        s = scale.float()
        s = s.reshape(1, 1) if blk == "tensor" else s.reshape(-1, 1) if blk == "row" else s
        out[name] = dequantize(QTensor(t, s, CastSpec(fmt, blk)))
    return out


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (the files ``tensor_files`` names), quantized ones dequantized; a
    tensor that is not fp32/bf16/fp16 once dequantized (an integer tensor, a quantized weight without
    its scale) or holds NaN/Inf is refused, named with its file."""
    p = check_model_dir(path)
    _, raw = read_config(p)
    where = tensor_files(p)
    state: dict[str, torch.Tensor] = {}
    for f in dict.fromkeys(f for f, _ in where.values()):
        state.update((k, v) for k, v in read_tensors(f).items() if k in where)
    file_of = {k: f for k, (f, _) in where.items()}
    state = _dequantize_state(p, state, raw.get("quantization_config"), file_of)
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


def check_weights(path, cfg: ModelConfig, shapes: dict[str, tuple], tensor: Callable[[str], torch.Tensor]) -> None:
    """The checks a checkpoint passes before any use, by whoever reads it (``load_model``, ``jetrl
    quantize``): every parameter of config.json's model present, with its shape, and nothing else; a
    ``lm_head.weight`` beside ``tie_word_embeddings: true`` only if it equals the embedding (a loader
    that ties them would drop it). ``shapes`` maps each tensor to its shape; ``tensor(name)`` reads
    one (only the two tied ones are read)."""
    expected = expected_shapes(cfg)
    tied = cfg.tie_word_embeddings and "lm_head.weight" in shapes
    if tied and "model.embed_tokens.weight" in shapes:
        head, embed = tensor("lm_head.weight"), tensor("model.embed_tokens.weight")
        if not (head.shape == embed.shape and torch.equal(head, embed)):
            raise JetrlError(f"{path}: config.json has tie_word_embeddings: true, but the checkpoint's lm_head.weight "
                             "is not model.embed_tokens.weight (set tie_word_embeddings to false to use it)")
    layers = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"model\.layers\.(\d+)\.", k))})
    if layers and layers == list(range(len(layers))) and len(layers) != cfg.num_hidden_layers:
        raise JetrlError(f"{path}: config.json has num_hidden_layers {cfg.num_hidden_layers}, but the checkpoint "
                         f"holds {len(layers)} layers (model.layers.0-{len(layers) - 1})")
    missing = sorted(set(expected) - set(shapes) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    unexpected = sorted(set(shapes) - set(expected))
    if missing:
        raise JetrlError(f"{path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    if unexpected:
        raise JetrlError(f"{path}: checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[0]}")
    for k, v in shapes.items():
        check_tensor_shape(path, k, v, expected[k])


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build the model from config.json and load its (dequantized) weights."""
    path = check_model_dir(path)
    cfg, _ = read_config(path)
    state = load_state_dict(path)
    check_weights(path, cfg, {k: tuple(v.shape) for k, v in state.items()}, state.__getitem__)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    return model.to(dtype)
