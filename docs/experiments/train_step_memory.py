"""Peak tensor memory of one training step, native path, counted on CPU: jetrl's ``bf16`` trainer
against the ``transformers`` baseline of ``jetrl bench train`` (fp32 master weights, bf16 autocast,
SDPA, fused AdamW).

On the native (GPU) code path the tensors a step allocates -- their dtypes, shapes and lifetimes --
do not depend on the device, so their peak can be counted on CPU with the native path forced
(``set_force_native``) and bf16 autocast on CPU for the baseline. torch's ``MemTracker`` (a dispatch
mode) adds up the live storages; its peak is what a GPU's ``max_memory_allocated`` would show
before the caching allocator's rounding, cuBLAS workspaces and the attention kernels' scratch,
which it does not see. AdamW is fused in both (as on CUDA; CPU has the fused kernel too), so the
optimizer step allocates no temporaries. The second of two updates is counted (AdamW's states exist
by then).

``--no-release`` counts jetrl's trainer as it was before it dropped its cached bf16 weights in the
step's last backward (``releasing_weights``).

    python docs/experiments/train_step_memory.py --model qwen2.5-1.5b --layers 2 --batch 1 --seq 64

Slow on CPU (native bf16 matmuls over a 152K vocabulary): a few minutes at the default size.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from jetrl_cli.bench import _train_batch
from jetrl_cli.config import TrainConfig
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.models.shapes import load_bench_model
from jetrl_cli.precision.flow import named_flow
from jetrl_cli.precision.gemm import set_force_native
from jetrl_cli.rl import trainer as trainer_mod
from jetrl_cli.rl.algos import CorrectionConfig

GB = 1e9


def _peak(step, *external) -> dict:
    """The second call of ``step()``'s peak tensor bytes, by kind (MemTracker's categories)."""
    step()
    mt = MemTracker()
    mt.track_external(*external)
    with mt:
        step()
    snap = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(getattr(k, "value", k)).lower(): round(v / GB, 3) for k, v in snap.items() if v}


def jetrl_peak(make, batch, adv, t: int, release: bool) -> dict:
    sp = SamplingParams(max_new_tokens=t - t // 2)
    kind, trainer_mod.adamw_kind = trainer_mod.adamw_kind, lambda cuda: {"fused": True}  # as on CUDA
    tr = trainer_mod.Trainer(make(torch.device("cpu")), named_flow("bf16"), TrainConfig(lr=1e-6, micro_batch=len(batch)),
                             CorrectionConfig(), sp, t)
    trainer_mod.adamw_kind = kind
    old = tr.score(batch)
    n = [0]

    def step():
        n[0] += 1
        tr.update(batch, adv, old, None, n[0])

    before = trainer_mod.releasing_weights
    if not release:
        trainer_mod.releasing_weights = contextlib.nullcontext
    try:
        return _peak(step, tr.model, tr.opt)
    finally:
        trainer_mod.releasing_weights = before


def transformers_peak(make, batch, adv) -> dict:
    from jetrl_cli.models.transformers_ref import transformers_twin

    hf = transformers_twin(make(torch.device("cpu")), torch.float32).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=True)
    ids, mask = batch.ids, batch.mask.float()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = hf(ids).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(logp * adv[:, None] * mask).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _peak(step, hf, opt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-release", action="store_true", help="also count jetrl without releasing_weights")
    args = ap.parse_args()

    set_force_native(True)
    make, cfg, label = load_bench_model(args.model, args.layers)
    batch, adv = _train_batch(cfg.vocab_size, args.batch, args.seq, torch.Generator().manual_seed(0))
    out = {"model": label, "batch": args.batch, "seq": args.seq, "peak_gb": {}}
    out["peak_gb"]["jetrl bf16"] = jetrl_peak(make, batch, adv, args.seq, release=True)
    if args.no_release:
        out["peak_gb"]["jetrl bf16, caches kept"] = jetrl_peak(make, batch, adv, args.seq, release=False)
    out["peak_gb"]["transformers"] = transformers_peak(make, batch, adv)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
