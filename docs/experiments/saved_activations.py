"""Bytes autograd saves for the backward, per flow, at a real model's layer shape, on the native path.

The native (GPU) code path keeps bf16 activations and, in FP8 flows with ``save_fp8_activations``,
FP8 copies; its dtypes do not depend on the device, so the saved bytes can be counted on CPU by
forcing the native path (``set_force_native``), as the tests do at a scaled-down shape. This script
counts them at the full layer shape of a model in ``models/shapes.py`` (random weights, the first
``--layers`` decoder layers) for one batch, and prints each flow's bytes and its ratio to ``bf16``.

    python docs/experiments/saved_activations.py --model qwen2.5-1.5b --layers 2 --batch 1 --seq 512

Slow on CPU (native bf16 matmuls): a few minutes at the default size.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from jetrl_cli.bench import _saved_bytes, _train_batch
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.models.shapes import load_bench_model
from jetrl_cli.precision.flow import named_flow
from jetrl_cli.precision.gemm import set_force_native
from jetrl_cli.precision.linear import apply_flow
from jetrl_cli.rl.trainer import token_logprobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--flows", default="bf16,fp8-unified")
    args = ap.parse_args()

    set_force_native(True)
    make, cfg, label = load_bench_model(args.model, args.layers)
    base = make(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    batch, _ = _train_batch(cfg.vocab_size, args.batch, args.seq, g)
    sp = SamplingParams(max_new_tokens=args.seq - args.seq // 2)
    out = {"model": label, "batch": args.batch, "seq": args.seq, "saved_bytes": {}}
    for name in args.flows.split(","):
        m = copy.deepcopy(base)
        apply_flow(m, named_flow(name), "train")
        saved, loss = _saved_bytes(lambda m=m: token_logprobs(m, batch, sp).sum())
        loss.backward()  # the saved tensors must serve a real backward
        out["saved_bytes"][name] = saved
        del m, loss
    bf = out["saved_bytes"].get("bf16")
    if bf:
        out["vs_bf16"] = {k: v / bf for k, v in out["saved_bytes"].items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
