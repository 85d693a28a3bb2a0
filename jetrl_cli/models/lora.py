"""LoRA adapters on the policy's linear layers (``model.lora_rank``), as PEFT's ``LoraModel`` adds them.

A targeted layer computes ``y = W x + (alpha / r) * B (A x)``: ``W`` frozen, in the flow's precision
(its 8-bit copy is cast once for the run: the weight never changes), ``A`` (r x in) and ``B``
(out x r) trained, in the flow's skip format (bf16: the adapters' GEMMs are tiny and their K of
r is no 128-wide FP8 group). ``A`` starts as PEFT's (Kaiming-uniform), ``B`` at zero, so step 0's
policy is the base model. Everything else is frozen: embeddings, norms, lm_head.

The adapters are ``JetLinear`` submodules ``lora_A`` / ``lora_B`` of the layer they adapt (PEFT's
parameter names, less its adapter name), run by ``linear.linear_group`` after the layer's own
GEMM in the rollout and the trainer alike: the embedded engine, which holds a copy of the
model, runs the same adapters, so a unified flow stays on-policy bit for bit. Each weight sync
sends the adapters alone (a few MB); an engine that runs plain layers (vLLM) gets the merged
weights ``W + (alpha / r) B A`` instead, which its own forward does not reproduce exactly.

The reference policy of a KL penalty is the base model: the policy with its adapters switched off
(``linear.adapters_disabled``), no second copy. A checkpoint holds the merged model
(``model.safetensors``, loadable anywhere), the adapters as PEFT writes them
(``adapter_model.safetensors`` + ``adapter_config.json``), and the trainer's state; ``--resume``
loads the base model again and the adapters from the checkpoint. Under torchrun the frozen weights and the
adapters are sharded together (FSDP2 shards parameter by parameter); a sync gathers the adapters alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import JetrlError
from ..precision.linear import JetLinear, has_adapter

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's and verl's name for every linear layer but the output head
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's names: the model wrapped in LoraModel wrapped in PeftModel


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, mcfg) -> "LoraSpec | None":
        """The preset's adapters (``model.lora_*``), or None for ``lora_rank: 0``."""
        if not mcfg.lora_rank:
            return None
        return cls(mcfg.lora_rank, float(mcfg.lora_alpha), target_names(mcfg.lora_target_modules))


def target_names(value) -> tuple[str, ...]:
    """``model.lora_target_modules`` as layer names: ``all-linear`` is every one of ``TARGETS``."""
    if value == ALL_LINEAR or value == [ALL_LINEAR]:
        return TARGETS
    names = [value] if isinstance(value, str) else list(value)
    return tuple(n for n in TARGETS if n in names)


def add_adapters(model: nn.Module, spec: LoraSpec, seed: int = 0) -> list[str]:
    """Freeze every parameter of ``model`` and give each targeted linear layer a rank-``spec.rank``
    adapter: ``A`` Kaiming-uniform (PEFT's ``init_lora_weights=True``), ``B`` zero. The draws are a
    function of ``seed`` and the layer's name. Returns the adapted layers' names."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, JetLinear) or name.rsplit(".", 1)[-1] not in spec.targets or has_adapter(mod):
            continue
        w = mod.weight
        g = torch.Generator().manual_seed(_name_seed(seed, name))
        bound = 1.0 / math.sqrt(mod.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT draw A
        a = (torch.rand(spec.rank, mod.in_features, generator=g, dtype=torch.float64) * 2 - 1) * bound
        mod.lora_A = JetLinear(nn.Parameter(a.to(device=w.device, dtype=w.dtype)), None, mod.precision)
        mod.lora_B = JetLinear(nn.Parameter(torch.zeros(mod.out_features, spec.rank, device=w.device, dtype=w.dtype)),
                               None, mod.precision)
        mod.lora_scale = spec.scale
        adapted.append(name)
    if not adapted:
        raise JetrlError(f"model.lora_target_modules: {', '.join(spec.targets)} match no linear layer of the model")
    model.lora = spec
    return adapted


def _name_seed(seed: int, name: str) -> int:
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % (1 << 61)
    return (seed * 1_000_003 + h) % (1 << 63)


def adapted_layers(model: nn.Module) -> list[tuple[str, JetLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, JetLinear) and has_adapter(m)]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by jetrl's names (``...q_proj.lora_A.weight``)."""
    return {f"{n}.{ab}.weight": getattr(m, ab).weight for n, m in adapted_layers(model) for ab in ("lora_A", "lora_B")}


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@torch.no_grad()
def merge_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict (a model's, or a sharded model's gathered whole) with each adapter folded into its
    layer's weight, ``W + scale * B @ A`` (in fp32, then W's dtype), and the adapters' entries dropped:
    the model a plain forward (vLLM, transformers) runs."""
    out = {}
    for name, w in state.items():
        if is_adapter_key(name):
            continue
        a = state.get(name[:-len("weight")] + "lora_A.weight") if name.endswith(".weight") else None
        if a is not None:
            b = state[name[:-len("weight")] + "lora_B.weight"]
            # on W's device: a frozen weight the trainer freed comes back from the source files, on the CPU
            b, a = b.to(w.device, torch.float32), a.to(w.device, torch.float32)
            w = (w.float() + (b @ a) * scale).to(w.dtype)
        out[name] = w
    return out


def merged_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the base model's parameters with the adapters folded in (``merge_state``)."""
    return list(merge_state({n: p.detach() for n, p in model.named_parameters()}, model.lora.scale).items())


def sync_parameters(model: nn.Module, engine, first: bool = False):
    """What a weight sync sends of a model with adapters: every parameter at the first sync, then the
    adapters alone, to an engine that runs them (``runs_adapters``: the embedded engine's copy of the
    model); the merged weights to one that does not (vLLM). None without adapters: every parameter."""
    if getattr(model, "lora", None) is None:
        return None
    if not getattr(engine, "runs_adapters", False):
        return merged_parameters(model)
    if first:
        return None
    return [(n, p.detach()) for n, p in adapter_state(model).items()]


# --------------------------------------------------------------------------- files


def peft_config(spec: LoraSpec, base: str) -> dict:
    """``adapter_config.json`` as PEFT writes it for these adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": spec.rank,
        "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": list(spec.targets), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None,
    }


def save_adapters(state: dict[str, torch.Tensor], spec: LoraSpec, dst: Path, base: str) -> None:
    """The adapters of ``state`` (a model's state dict, or a sharded one gathered whole) into ``dst`` as PEFT
    writes them: ``adapter_model.safetensors`` (fp32, PEFT's names) and ``adapter_config.json``."""
    from ..fileio import save_safetensors

    dst.mkdir(parents=True, exist_ok=True)
    adapters = {PEFT_PREFIX + k: v.detach().float().cpu().contiguous() for k, v in state.items() if is_adapter_key(k)}
    save_safetensors(adapters, dst / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (dst / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base), indent=2) + "\n")


def load_adapters(model: nn.Module, src: Path) -> None:
    """The adapters of a checkpoint (or any PEFT LoRA directory) into ``model``'s, which must have the
    same rank, alpha and layers; a mismatch is one line naming the file and what differs."""
    from safetensors.torch import load_file

    cfg_path, weights = src / ADAPTER_CONFIG, src / ADAPTER_WEIGHTS
    if not weights.exists():
        raise JetrlError(f"{src}: no {ADAPTER_WEIGHTS} (a PEFT LoRA directory, or a checkpoint of a run with "
                         "model.lora_rank > 0, has one)")
    spec: LoraSpec = model.lora
    if cfg_path.exists():
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise JetrlError(f"{cfg_path}: unreadable ({e})") from None
        if not isinstance(cfg, dict):
            raise JetrlError(f"{cfg_path}: not a PEFT adapter config (a JSON object)")
        if cfg.get("peft_type", "LORA") != "LORA":
            raise JetrlError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; jetrl loads LoRA adapters only")
        for key in ("use_rslora", "use_dora"):
            if cfg.get(key):
                raise JetrlError(f"{cfg_path}: {key} is true; jetrl's adapters are plain LoRA (scale alpha / r)")
        for key, want in (("r", spec.rank), ("lora_alpha", spec.alpha)):
            if cfg.get(key) != want:
                raise JetrlError(f"{cfg_path}: {key} is {cfg.get(key)!r}, the preset's is {want!r} "
                                 "(model.lora_rank / lora_alpha must match the adapters being loaded)")
    try:
        state = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types on damaged files
        raise JetrlError(f"{weights}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    state = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v for k, v in state.items()}
    state = {k.replace(".default.weight", ".weight"): v for k, v in state.items()}
    own = adapter_state(model)
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        what = (f"no {missing[0]}" if missing else
                f"{extra[0]}, which the preset's model.lora_target_modules do not adapt")
        raise JetrlError(f"{weights}: {what} ({len(missing)} missing, {len(extra)} unexpected)")
    with torch.no_grad():
        for k, p in own.items():
            if tuple(state[k].shape) != tuple(p.shape):
                raise JetrlError(f"{weights}: {k} has shape {tuple(state[k].shape)}, the model's is {tuple(p.shape)}")
            p.copy_(state[k])
