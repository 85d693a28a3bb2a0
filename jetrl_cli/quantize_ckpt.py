"""``jetrl quantize``: write a Hugging Face checkpoint in a format vLLM loads, with the core's quantizers.

Formats (what vLLM reads for each scheme):

============== ============================================================================
fp8-block      vLLM / DeepSeek-V3 block FP8: ``weight`` float8_e4m3fn, ``weight_scale_inv`` fp32
               per 128x128 block; ``quantization_config = {quant_method: fp8, fmt: e4m3,
               activation_scheme: dynamic, weight_block_size: [128, 128]}``.
fp8-tensor     vLLM ``fp8`` serialized checkpoint: ``weight`` e4m3fn, ``weight_scale`` fp32 scalar,
               dynamic per-tensor activations.
fp8-channel    compressed-tensors ``float-quantized``: ``weight`` e4m3fn, ``weight_scale`` fp32
               (N, 1) per output channel; dynamic per-token FP8 activations (W8A8-FP8).
int8-channel   compressed-tensors ``int-quantized``: ``weight`` int8, ``weight_scale`` fp32 (N, 1);
               dynamic per-token symmetric INT8 activations (W8A8-INT8).
============== ============================================================================

fp8-block takes only models whose q_proj, k_proj and gate_proj have whole 128-row blocks: vLLM fuses
them with the next projection (qkv_proj, gate_up_proj) and refuses a partial block inside a fused layer.

Modules on the skip list keep their original weights and are listed in the config
(``ignored_layers`` / ``modules_to_not_convert`` for fp8, ``ignore`` for compressed-tensors).
The output is written to a temporary directory beside the target and renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .choices import CHECKPOINT_FORMATS
from .errors import JetrlError
from .fileio import apply_umask
from .models.hf import (FLOAT_DTYPES, INDEX_FILE, check_model_dir, check_weights, expected_shapes, read_config,
                        read_tensors, tensor_files)
from .precision import CastSpec, error_stats, quantize
from .precision.flow import DEFAULT_SKIP, PrecisionFlow
from .precision.linear import matches_skip

FORMATS: dict[str, CastSpec] = {
    "fp8-block": CastSpec("fp8_e4m3", "128x128"),
    "fp8-tensor": CastSpec("fp8_e4m3", "tensor"),
    "fp8-channel": CastSpec("fp8_e4m3", "row"),
    "int8-channel": CastSpec("int8", "row"),
}
assert tuple(FORMATS) == CHECKPOINT_FORMATS, "jetrl_cli/choices.py and quantize_ckpt.FORMATS disagree"


def format_for_flow(flow: PrecisionFlow) -> str:
    """The checkpoint format that holds exactly the flow's rollout weights."""
    w = flow.rollout.linear.b
    for name, spec in FORMATS.items():
        if spec == w:
            return name
    raise JetrlError(
        f"flow {flow.name}: rollout weights {w.short_str()} have no vLLM checkpoint format "
        f"(supported: {', '.join(f'{n} = {s.short_str()}' for n, s in FORMATS.items())}); pass --format"
    )


@dataclass
class LayerRow:
    name: str
    shape: list[int]
    dtype: str
    format: str
    rel_err: float
    sqnr_db: float
    bytes_before: int
    bytes_after: int


@dataclass
class QuantizeResult:
    source: str
    output: str
    format: str
    layers: list[LayerRow] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    bytes_before: int = 0  # the quantized linear weights only, before and after
    bytes_after: int = 0
    file_bytes_before: int = 0  # every safetensors file (embeddings, norms, skipped layers too)
    file_bytes_after: int = 0

    def to_json(self) -> dict:
        d = asdict(self)
        for row in d["layers"]:
            for k in ("rel_err", "sqnr_db"):
                if row[k] in (float("inf"), float("-inf")):
                    row[k] = str(row[k])
        return d


def _quantization_config(fmt: str, ignored: list[str]) -> dict:
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "ignored_layers": ignored,
            "modules_to_not_convert": ignored,
        }
    if fmt == "fp8-tensor":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "ignored_layers": ignored, "modules_to_not_convert": ignored}
    kind = "float" if fmt == "fp8-channel" else "int"
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True,
                            "dynamic": False, "group_size": None},
                "input_activations": {"num_bits": 8, "type": kind, "strategy": "token", "symmetric": True,
                                      "dynamic": True, "group_size": None},
                "output_activations": None,
            }
        },
        "ignore": ignored,
        "kv_cache_scheme": None,
    }


def _is_linear_weight(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2


def checkpoint_tensors(name: str, t: torch.Tensor, fmt: str, skip: tuple[str, ...] = DEFAULT_SKIP):
    """One checkpoint tensor in ``fmt``: ``[(name, tensor)]`` as stored, or ``[(weight, data),
    (scale name, scale)]`` with the quantized tensor (its QTensor third) for a linear weight.
    ``jetrl quantize`` writes these; the vLLM backend syncs vLLM's own FP8 layers with them."""
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    if not _is_linear_weight(name, t) or matches_skip(module, skip):
        return [(name, t.contiguous())], None
    q = quantize(t, FORMATS[fmt])
    scale_name = f"{module}.weight_scale_inv" if fmt == "fp8-block" else f"{module}.weight_scale"
    scale = q.scale.reshape(()) if fmt == "fp8-tensor" else q.scale.contiguous()
    return [(name, q.data.contiguous()), (scale_name, scale)], q


# vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj, and loads a block-FP8 fused layer only
# when every part but the last is whole 128-row blocks (its validate_fp8_block_shape): these parts.
FUSED_NOT_LAST = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "gate_proj": "gate_up_proj"}


def _check_vllm_block_rows(src: Path, shapes: dict[str, torch.Size], skip: tuple[str, ...]) -> None:
    """fp8-block: refuse, before anything is written, a model whose checkpoint vLLM would refuse
    to load (jetrl itself reads partial blocks; vLLM's fused layers do not)."""
    bn = FORMATS["fp8-block"].block.rows
    for name, shape in shapes.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        fused = module and FUSED_NOT_LAST.get(module.rsplit(".", 1)[-1])
        if fused and shape[0] % bn and not matches_skip(module, skip):
            raise JetrlError(f"{src}: format fp8-block: {module} has {shape[0]} rows, not a multiple of {bn}; "
                             f"vLLM fuses it into {fused} and refuses its {bn}x{bn} blocks "
                             "(use --format fp8-channel or fp8-tensor)")


def _quantized_output(d: Path) -> bool:
    """Whether directory ``d`` is an earlier output of ``jetrl quantize`` (what ``--force`` may replace)."""
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("quantization_config"), dict)


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    fmt: str,
    skip: tuple[str, ...] = DEFAULT_SKIP,
    force: bool = False,
    on_tensor: Callable[[str], None] | None = None,
    count_tensors: Callable[[int], None] | None = None,
) -> QuantizeResult:
    if fmt not in FORMATS:
        raise JetrlError(f"unknown format {fmt!r} (allowed: {', '.join(FORMATS)})")
    src = check_model_dir(src)
    model_cfg, raw_cfg = read_config(src)
    if raw_cfg.get("quantization_config"):
        method = raw_cfg["quantization_config"].get("quant_method")
        raise JetrlError(f"{src}: already quantized (quant_method {method!r}); quantize a BF16/FP32 checkpoint")
    dst = Path(dst)
    if dst.resolve() == src.resolve():
        raise JetrlError(f"{dst}: output must differ from the input directory")
    if dst.resolve() in src.resolve().parents or src.resolve() in dst.resolve().parents:
        raise JetrlError(f"{dst}: output must not contain the input directory {src} or lie inside it "
                         "(--force would delete the input)")
    if dst.exists() and not dst.is_dir():
        raise JetrlError(f"{dst}: exists and is not a directory; -o takes the directory to write")
    if dst.exists() and not force:
        raise JetrlError(f"{dst}: already exists (pass --force to replace it)")
    if dst.exists() and any(dst.iterdir()) and not _quantized_output(dst):
        what = "a run of jetrl run" if (dst / "metrics.jsonl").exists() else "files that jetrl quantize did not write"
        raise JetrlError(f"{dst}: holds {what}; --force replaces only an earlier output of jetrl quantize "
                         "(config.json with a quantization_config): -o names a new directory")
    here = Path.cwd().resolve()
    if dst.resolve() == here or dst.resolve() in here.parents:
        raise JetrlError(f"{dst}: is the current directory or holds it; name a new directory to write")
    # the input checked as model loading checks it (one code path), before anything is written
    where = tensor_files(src)
    check_weights(src, model_cfg, {k: shape for k, (_, shape) in where.items()},
                  lambda name: _read_one(where[name][0], name))
    if fmt == "fp8-block":
        _check_vllm_block_rows(src, expected_shapes(model_cfg), skip)
    files = list(dict.fromkeys(f for f, _ in where.values()))
    spec = FORMATS[fmt]
    result = QuantizeResult(str(src), str(dst), fmt)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        if count_tensors:
            count_tensors(len(where))
        weight_map: dict[str, str] = {}
        total_size = 0  # the tensors' bytes, as Hugging Face writes an index's total_size
        ignored: set[str] = set()
        for f in files:  # one shard in memory at a time
            tensors = read_tensors(f)
            out: dict[str, torch.Tensor] = {}
            for name, t in tensors.items():
                if name not in where:  # an ignored buffer (rotary_emb.inv_freq)
                    continue
                if on_tensor:
                    on_tensor(name)
                if t.dtype not in FLOAT_DTYPES:
                    raise JetrlError(f"{f}: tensor {name} has dtype {t.dtype}; expected fp32, bf16 or fp16 "
                                     "(already quantized?)")
                if not torch.isfinite(t).all():
                    raise JetrlError(f"{f}: tensor {name} contains NaN or Inf; "
                                     "refusing to quantize a broken checkpoint")
                module = name[: -len(".weight")] if name.endswith(".weight") else name
                stored, q = checkpoint_tensors(name, t, fmt, skip)
                for k, v in stored:
                    out[k] = v
                    weight_map[k] = f.name
                    total_size += v.numel() * v.element_size()
                if q is None:
                    if _is_linear_weight(name, t) and "embed" not in module:
                        ignored.add(module)
                    continue
                st = error_stats(t.float(), q.dequantize())
                before = t.numel() * t.element_size()
                result.bytes_before += before
                after = q.nbytes()
                result.bytes_after += after
                result.layers.append(LayerRow(module, list(t.shape), str(t.dtype).replace("torch.", ""),
                                              spec.short_str(), st["rel_err"], st["sqnr_db"], before, after))
            _save_shard(out, tmp / f.name)
            del tensors, out
        if not result.layers:
            raise JetrlError(f"{src}: no linear weights to quantize (every 2-D weight is on the skip list?)")
        result.ignored = sorted(ignored)
        result.file_bytes_before = sum(f.stat().st_size for f in files)
        result.file_bytes_after = sum((tmp / f.name).stat().st_size for f in files)

        cfg = dict(raw_cfg)
        cfg["quantization_config"] = _quantization_config(fmt, result.ignored)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if len(files) > 1 or (src / INDEX_FILE).exists():
            index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for item in src.iterdir():
            if item.name in ("config.json", INDEX_FILE) or item.suffix == ".safetensors":
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        apply_umask(tmp, recursive=True)  # mkdtemp made it 0700; the output follows the umask
        _commit_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _read_one(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as fh:
            return fh.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise JetrlError(f"{file}: cannot read safetensors ({str(e).splitlines()[0]})") from None


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from .fileio import save_safetensors

    save_safetensors(tensors, path, metadata={"format": "pt"})


def _commit_dir(tmp: Path, dst: Path) -> None:
    """Move a finished directory into place; an existing one is replaced only after success."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
