"""jetrl's quantization method inside vLLM: vLLM's linear layers run the precision core's casts.

Importing this module registers the quantization config ``"jetrl"`` with vLLM
(``register_quantization_config``, vLLM's registry for out-of-tree methods). The engine selects it
with ``quantization="jetrl"`` and passes the flow through ``hf_overrides={"quantization_config":
config_dict(flow)}``, the same path a checkpoint's ``config.json`` takes, so worker processes
rebuild the identical flow from plain data.

Every ``LinearBase`` (and the ``ParallelLMHead``) gets a :class:`JetrlLinearMethod` that runs
the flow's rollout GEMM through jetrl's one precision forward, ``precision.linear_forward`` (what
the trainer and the embedded engine run): the weight cast once per logical shard (vLLM fuses
q/k/v and gate/up into one layer; jetrl quantizes each projection on its own, so block boundaries
and scales stay the trainer's), the shards stacked into one GEMM operand (``concat_operands``),
the input cast, the GEMM on the resolved backend, the bias, the ``out`` rounding. Layers on the
flow's skip list run the flow's ``skip_format`` GEMM, as in jetrl's own model.

The weight sync (:func:`load_payload`) writes new weights into the tensors the method already
holds (``copy_``), so their addresses do not change (CUDA graphs captured over them stay valid)
and vLLM's post-load processing is not re-run.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.parameter import ModelWeightParameter

from ..models.llama import attention_format, cast_kv
from ..precision.flow import GemmSpec, PrecisionFlow, parse_flow
from ..precision.formats import Format
from ..precision.linear import concat_operands, copy_operand_, linear_forward, matches_skip, weight_operand
from ..precision.quant import CastSpec, QTensor, round_to

NAME = "jetrl"


def config_dict(flow: PrecisionFlow) -> dict:
    """The ``quantization_config`` entry that selects jetrl's method with ``flow``."""
    return {"quant_method": NAME, "flow_name": flow.name, "flow": flow.to_dict()}


@register_quantization_config(NAME)
class JetrlQuantConfig(QuantizationConfig):
    def __init__(self, flow: PrecisionFlow):
        super().__init__()
        self.flow = flow

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # the GEMM backend checks its own hardware needs (precision.gemm)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "JetrlQuantConfig":
        if "flow" not in config:
            raise ValueError("quantization_config for 'jetrl' needs a 'flow' entry (jetrl_cli.engine.vllm_quant.config_dict)")
        return cls(parse_flow(config["flow"], source="vLLM quantization_config",
                              name=config.get("flow_name", "custom")))

    def _skipped(self, prefix: str) -> bool:
        """A fused vLLM layer (qkv_proj) is skipped when all its projections (q/k/v_proj) are."""
        parent, _, leaf = prefix.rpartition(".")
        parts = self.packed_modules_mapping.get(leaf, [leaf])
        names = [f"{parent}.{p}" if parent else p for p in parts]
        skipped = {matches_skip(n, self.flow.skip) for n in names}
        if len(skipped) > 1:
            raise ValueError(f"flow skip list {list(self.flow.skip)} skips some but not all of {names}, "
                             f"which vLLM fuses into {prefix}")
        return skipped.pop()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        # A tied lm_head is the embedding itself in vLLM (a VocabParallelEmbedding): vLLM's own method
        if isinstance(layer, (LinearBase, ParallelLMHead)):
            spec = self.flow.skipped_linear().fprop if self._skipped(prefix) else self.flow.rollout.linear
            return JetrlLinearMethod(spec)
        return None


class JetrlLinearMethod(LinearMethodBase):
    """One vLLM linear layer in one GEMM spec (the flow's rollout GEMM, or fp32)."""

    def __init__(self, spec: GemmSpec):
        self.spec = spec

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        # A plain weight, so vLLM's own loaders (and their q/k/v shard offsets) fill it at start-up;
        # process_weights_after_loading turns it into jetrl's operands and frees it.
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=extra_weight_attrs.pop("weight_loader"))
        layer.register_parameter("weight", weight)
        for k, v in extra_weight_attrs.items():
            setattr(weight, k, v)
        layer.jetrl_sizes = list(output_partition_sizes)

    def tie_weights(self, layer, embed_tokens):
        """A tied lm_head reads the embedding's weight, which stays (the embedding needs it)."""
        layer.weight = embed_tokens.weight
        layer.jetrl_tied = True
        return layer

    def process_weights_after_loading(self, layer) -> None:
        w = layer.weight.detach()
        with torch.no_grad():
            layer.jetrl_ops = [weight_operand(s.float(), self.spec) for s in w.split(layer.jetrl_sizes, 0)]
            layer.jetrl_weight = concat_operands(layer.jetrl_ops, self.spec, w.device)
        if not getattr(layer, "jetrl_tied", False):
            layer.weight.data = torch.empty(0, dtype=w.dtype, device=w.device)  # jetrl_ops hold the weights now

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_forward(x, layer.jetrl_weight, None if bias is None else bias.float(), self.spec)

    # ------------------------------------------------------------------ weight sync, in place

    def load_shard(self, layer, param: str, shard: int, value) -> None:
        sizes = layer.jetrl_sizes
        if param == "bias":
            off = sum(sizes[:shard])
            layer.bias.data[off:off + sizes[shard]].copy_(value)
            return
        if param != "weight":
            raise KeyError(param)
        dst = layer.jetrl_ops[shard]
        if isinstance(value, QTensor):
            if not isinstance(dst, QTensor) or value.spec != dst.spec:
                have = dst.spec.short_str() if isinstance(dst, QTensor) else "high precision"
                raise ValueError(f"quantized weight with spec {value.spec.short_str()}, the layer holds {have}")
            if value.data.shape != dst.data.shape:
                raise ValueError(f"weight shape {tuple(value.shape)}, the layer holds {tuple(dst.shape)}")
            dst.data.copy_(value.data)
            dst.scale.copy_(value.scale)
            return
        device = (dst.data if isinstance(dst, QTensor) else dst).device
        value = value.to(device).float()
        rows = dst.shape[0]
        if value.dim() == 2 and value.shape[0] < rows and value.shape[1] == dst.shape[1]:
            # vLLM pads vocab-sized layers (lm_head) to a multiple of 64 rows with zeros; zero rows
            # leave every block's amax, so the real rows quantize exactly as the trainer's do
            value = torch.nn.functional.pad(value, (0, 0, 0, rows - value.shape[0]))
        q = weight_operand(value, self.spec)
        if tuple(q.shape) != tuple(dst.shape):
            raise ValueError(f"weight shape {tuple(q.shape)}, the layer holds {tuple(dst.shape)}")
        if isinstance(dst, QTensor):
            dst.data.copy_(q.data)
            dst.scale.copy_(q.scale)
        else:
            dst.copy_(q)

    def refresh(self, layer) -> None:
        """After shards changed: rewrite the stacked GEMM operand in place (its addresses stay)."""
        new = concat_operands(layer.jetrl_ops, self.spec, _device(layer.jetrl_ops[0]))
        old = layer.jetrl_weight
        if isinstance(old, list):
            layer.jetrl_weight = new  # the shards' own tensors, already updated in place
        elif not copy_operand_(old, new):
            raise ValueError(f"refreshed weight does not match the operand the layer holds ({type(old).__name__})")


def _device(op) -> torch.device:
    return (op.data if isinstance(op, QTensor) else op).device


def load_payload(model: torch.nn.Module, tensors: dict) -> int:
    """Write a jetrl weight payload (Hugging Face parameter names) into a vLLM model in place.

    Projections vLLM fuses (``packed_modules_mapping``: q/k/v_proj -> qkv_proj) go to their shard
    of the fused layer. Returns the number of tensors written; an unknown name raises KeyError.
    """
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    to_fused = {sub: (fused, i) for fused, subs in packed.items() for i, sub in enumerate(subs)}
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    touched: dict[str, torch.nn.Module] = {}
    with torch.no_grad():
        for name, value in tensors.items():
            mod_name, _, param = name.rpartition(".")
            parent, _, leaf = mod_name.rpartition(".")
            shard = 0
            if leaf in to_fused:
                fused, shard = to_fused[leaf]
                mod_name = f"{parent}.{fused}" if parent else fused
            mod = modules.get(mod_name)
            method = getattr(mod, "quant_method", None)
            if isinstance(method, JetrlLinearMethod):
                method.load_shard(mod, param, shard, value)
                touched[mod_name] = mod
                continue
            p = params.get(name)
            if p is None:
                raise KeyError(f"the vLLM model has no parameter {name}")
            if isinstance(value, QTensor):
                raise ValueError(f"{name} arrived quantized but is not a jetrl-quantized layer in vLLM")
            if p.shape != value.shape:
                # vocab-parallel embeddings are padded to a multiple of 64 rows
                if p.dim() == value.dim() and p.shape[1:] == value.shape[1:] and p.shape[0] > value.shape[0]:
                    p.data[:value.shape[0]].copy_(value)
                    continue
                raise ValueError(f"{name}: shape {tuple(value.shape)}, vLLM holds {tuple(p.shape)}")
            p.data.copy_(value)
        for name, mod in modules.items():  # a tied lm_head re-reads the (updated) embedding
            if getattr(mod, "jetrl_tied", False) and tensors:
                mod.quant_method.load_shard(mod, "weight", 0, mod.weight.detach())
                touched[name] = mod
        for mod in touched.values():
            mod.quant_method.refresh(mod)
    return len(tensors)


def install_kv_rounding(model: torch.nn.Module, spec: CastSpec) -> int:
    """Round attention's inputs and output as jetrl's model does (``models.llama``): keys and values
    with ``cast_kv`` (its engine's KV-cache rounding) as they enter attention, after RoPE, queries
    and the attention output to ``attention_format`` (bf16 unless the cache is fp32, as flash
    attention reads and writes them). vLLM then keeps keys and values in a cache in the model dtype,
    holding the values jetrl's engine holds. Returns the number of attention layers hooked."""
    fmt = attention_format(spec)

    def rnd(t: torch.Tensor) -> torch.Tensor:
        return round_to(t, fmt).to(t.dtype)

    def before(_mod, args, kwargs):  # query, key, value: positional or by name
        args, kwargs = list(args), dict(kwargs)
        for i, name in enumerate(("query", "key", "value")):
            if i < len(args):
                t = args[i]
            elif kwargs.get(name) is not None:
                t = kwargs[name]
            else:
                continue
            t = rnd(t) if name == "query" else cast_kv(t, spec)
            if i < len(args):
                args[i] = t
            else:
                kwargs[name] = t
        return tuple(args), kwargs

    def after(_mod, _args, _kwargs, out):
        return rnd(out) if isinstance(out, torch.Tensor) else out

    n = 0
    for mod in model.modules():
        if isinstance(mod, Attention) and not getattr(mod, "_jetrl_kv_hook", False):
            mod.register_forward_pre_hook(before, with_kwargs=True)
            mod.register_forward_hook(after, with_kwargs=True)
            mod._jetrl_kv_hook = True
            n += 1
    return n


def install_qk_norm_rounding(model: torch.nn.Module, fmt: Format) -> int:
    """Round the output of each attention's query and key norms (Qwen3's ``q_norm``, ``k_norm``) to ``fmt``,
    the rollout GEMMs' output format, as jetrl's model does (``models.llama.Attention._qk_norm``: the q/k/v
    GEMM writes ``fmt``, so on a GPU the norms read and write it). vLLM's norms under an fp32 model dtype
    write fp32; without the rounding its queries and keys differ from jetrl's by a bf16 rounding. Returns
    the number of norms hooked."""
    if fmt is not Format.BF16:  # fp32: nothing to round; the 8-bit formats are no GEMM's output
        return 0

    def after(_mod, _args, out):
        return round_to(out, fmt).to(out.dtype) if isinstance(out, torch.Tensor) else out

    n = 0
    for name, mod in model.named_modules():
        if name.rpartition(".")[2] in ("q_norm", "k_norm") and not getattr(mod, "_jetrl_qk_hook", False):
            mod.register_forward_hook(after)
            mod._jetrl_qk_hook = True
            n += 1
    return n
