"""Embedded rollout engine vs ``transformers`` ``generate()``: same model, batch, lengths, sampling.

    python benchmarks/rollout_vs_generate.py [--model tiny|DIR] [--batch 64] [--new 64] [--repeats 3]

Both sample at temperature 1 with a KV cache, fp32 weights and activations, and must produce
exactly ``--new`` tokens per sequence (stop tokens disabled), so tokens/s compare like for like.
The embedded engine also runs the bf16 (emulated on CPU) and fp8 flows, for reference.
Prints a table and one JSON line; the numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import transformers

    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.engine.embedded import EmbeddedEngine
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.hf import load_model
    from jetrl_cli.precision.flow import parse_flow
    from jetrl_cli.rl.loop import resolve_model_dir

    path = resolve_model_dir(args.model)
    model = load_model(path)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (args.batch, args.prompt), generator=g)
    total = args.batch * args.new
    fp32 = {"rollout": {"linear": {"input": "fp32", "weight": "fp32", "out": "fp32"}, "kv_cache": "fp32"},
            "train": {"fprop": {"input": "fp32", "weight": "fp32", "out": "fp32"},
                      "dgrad": {"grad_output": "fp32", "weight": "fp32", "out": "fp32"},
                      "wgrad": {"grad_output": "fp32", "input": "fp32", "out": "fp32"}}}
    rows = []

    def timed(fn):
        fn()  # warm-up
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), (max(ts) - min(ts))

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=args.new, min_new_tokens=args.new,
                              pad_token_id=0, eos_token_id=None)
        assert out.shape[1] == args.prompt + args.new

    med, spread = timed(run_hf)
    rows.append({"engine": "transformers generate()", "flow": "fp32", "s": med, "spread_s": spread,
                 "tokens_per_s": total / med})
    sp = SamplingParams(max_new_tokens=args.new, temperature=1.0, n=1, stop_token_ids=())
    plist = prompts.tolist()
    for name, flow in (("fp32", parse_flow(fp32, name="fp32")), ("bf16", parse_flow("bf16")),
                       ("fp8-unified", parse_flow("fp8-unified"))):
        eng = EmbeddedEngine(model, flow, args.prompt + args.new, max_batch=args.batch)
        eng.load_weights(make_payload(model, flow))

        def run_ours():
            out = eng.generate(plist, sp, seed=0)
            assert all(len(c[0].tokens) == args.new for c in out)

        med, spread = timed(run_ours)
        rows.append({"engine": "jetrl embedded", "flow": name, "s": med, "spread_s": spread,
                     "tokens_per_s": total / med})
    base = rows[0]["tokens_per_s"]
    print(f"model {path.name}  batch {args.batch}  prompt {args.prompt}  new {args.new}  "
          f"threads {torch.get_num_threads()}  torch {torch.__version__}  transformers {transformers.__version__}")
    print(f"{'engine':26s} {'flow':12s} {'median s':>9s} {'spread':>7s} {'tok/s':>9s} {'vs generate':>11s}")
    for r in rows:
        print(f"{r['engine']:26s} {r['flow']:12s} {r['s']:9.3f} {r['spread_s']:7.3f} {r['tokens_per_s']:9.0f} "
              f"{r['tokens_per_s'] / base:10.2f}x")
    print(json.dumps({"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                      "threads": torch.get_num_threads(), "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
