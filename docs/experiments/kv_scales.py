"""FP8 KV cache: per-token-and-head scales against one per-tensor scale per layer.

Scores the same sampled completions of the tiny policy with the fp32 model whose keys and values
are rounded in four ways, and reports the KL of each against the unrounded fp32 model
(``mismatch_metrics``, the function behind ``mismatch_kl``): bf16; FP8 E4M3 with a scale per token
and head (``kv_cache: fp8_e4m3 row``, jetrl's default); FP8 E4M3 with one scale per layer for keys
and one for values, calibrated on this very batch (the most favourable per-tensor scale: a scale
recalibrated at each weight sync, as FP8-RL / NeMo-RL do, sees other data than it quantizes and can
only do worse). Also the quantization SQNR of the keys and values themselves.

    python docs/experiments/kv_scales.py        # ~1 min on 2 CPU cores
"""

import json

import torch

from jetrl_cli.config import load_job_config
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.models import llama
from jetrl_cli.precision.quant import CastSpec, error_stats, fake_quantize
from jetrl_cli.rl.algos import mismatch_metrics
from jetrl_cli.rl.loop import rollout_samples, setup
from jetrl_cli.rl.trainer import score_logprobs
from jetrl_cli.rl.loop import batch_from_samples


def main():
    cfg = load_job_config("fp8-rollout", ["rollout.max_new_tokens=40"])
    job = setup(cfg, with_trainer=False)
    model = job.engine.model
    for layer in model.model.layers:  # an unquantized model: only the KV rounding differs
        layer.self_attn.kv_spec = None
    from jetrl_cli.precision.linear import swap_linears
    from jetrl_cli.models.llama import FP32_LINEAR

    swap_linears(model, FP32_LINEAR, ())
    samples = rollout_samples(job, job.source.batch(3, 32), seed=7)
    b = batch_from_samples(samples, job.tokenizer.pad_id)
    sp = SamplingParams()
    ref = score_logprobs(model, b, sp, 64, cfg.rollout.max_len)
    e4 = "fp8_e4m3"
    captured = []
    original = llama.cast_kv

    def rounding(mode):
        def cast(t, spec):
            if mode == "capture":
                captured.append(t.detach().clone())
                return t
            if mode == "bf16":
                return original(t, CastSpec("bf16"))
            if mode == "row":
                return original(t, CastSpec(e4, "row"))
            # per tensor: one scale for this layer's keys (or values) over the whole batch
            return fake_quantize(t.reshape(1, -1), CastSpec(e4, "tensor")).reshape(t.shape)
        return cast

    out = {}
    for mode in ("capture", "bf16", "row", "tensor"):
        llama.cast_kv = rounding(mode)
        try:
            lp = score_logprobs(model, b, sp, 64, cfg.rollout.max_len)
        finally:
            llama.cast_kv = original
        if mode == "capture":
            continue
        out[mode] = {"kl_vs_fp32": mismatch_metrics(lp, ref, b.mask)["mismatch_kl"]}
    kv = [t.reshape(-1, t.shape[-1]) for t in captured]
    for mode, spec in (("row", CastSpec(e4, "row")), ("tensor", CastSpec(e4, "tensor"))):
        sq = [error_stats(t, fake_quantize(t if mode == "row" else t.reshape(1, -1), spec).reshape(t.shape))["sqnr_db"]
              for t in kv]
        out[mode]["kv_sqnr_db_mean"] = sum(sq) / len(sq)
    print(json.dumps({"tokens": int(b.mask.sum()), **out}, indent=1))


if __name__ == "__main__":
    main()
