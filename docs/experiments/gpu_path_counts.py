"""jetrl's CUDA code path on fake CUDA tensors, without a GPU: what a training forward leaves live
(by the jetrl line that allocated it), the host's work in one update (aten ops, Triton launches,
jetrl's Python calls), and a ``jetrl bench train`` row's peak per phase. Counts, not times.

Built on ``tests/fake_cuda.py``'s mode: CUDA tensors are torch ``FakeTensor``s (shapes, dtypes,
devices; nothing computed), host tensors real; the Triton kernels' wrappers run and allocate their
outputs on the device, their launches are stood in; ``torch.compile`` fusion is off (the chains run op
by op, as the count of aten ops then shows), and the backward is ``tests/py_autograd.py``'s. SDPA on
fake tensors takes the math kernel, which keeps attention scratch that flash attention does not (the
``aten._safe_softmax`` and ``clone`` sites under ``F.scaled_dot_product_attention``). Needs a CUDA
build of torch (torch 2.11+cu130 installed on CPU will do); prints one JSON object.

    python docs/experiments/gpu_path_counts.py forward --flow fp8-unified --batch 16 --seq 512
    python docs/experiments/gpu_path_counts.py host --flow bf16 --batch 16 --seq 512
    python docs/experiments/gpu_path_counts.py host --flow fp8-unified --batch 16 --seq 512 --graphs
    python docs/experiments/gpu_path_counts.py bench --flow fp8-unified --batch 16 --seq 512

(2026-11-25, docs/benchmarks.md: the 1.5B shape, 28 layers, both flows.)
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import fake_cuda as fc  # noqa: E402 - the fake-CUDA mode, from the tests
import py_autograd  # noqa: E402

VIEWS = {"aten.view.default", "aten.t.default", "aten.detach.default", "aten.slice.Tensor", "aten.alias.default",
         "aten.transpose.int", "aten.expand.default", "aten.as_strided.default", "aten.view.dtype",
         "aten._unsafe_view.default", "aten.unsqueeze.default", "aten.split_with_sizes.default", "aten.select.int",
         "aten.permute.default", "aten.squeeze.dim", "aten.unbind.int", "aten.split.Tensor", "aten.narrow.default"}


class Counting(fc.FakeCuda):
    """``FakeCuda`` that also keeps the live bytes of device storages by allocation site, and counts
    the aten ops it dispatches while ``on``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.live, self.by_site, self.seen = 0, collections.Counter(), WeakIdKeyDictionary()
        self.ops, self.on = collections.Counter(), False

    def _free(self, n: int, site: str) -> None:
        self.live -= n
        self.by_site[site] -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops[str(func)] += 1
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, FakeTensor) and t.device.type == "cuda":
                st = t.untyped_storage()
                if st in self.seen:
                    continue
                n, site = st.nbytes(), f"{fc._site()} | {func}"
                self.seen[st] = n
                self.live += n
                self.by_site[site] += n
                weakref.finalize(st, self._free, n, site)
        return out


def _stand_in_kernels() -> collections.Counter:
    from jetrl_cli.precision import fuse

    fuse.set_enabled(False)  # compiled code cannot run on fake tensors
    import jetrl_cli.kernels as kernels_pkg
    from jetrl_cli.kernels import fp8, int8

    launches: collections.Counter = collections.Counter()

    class Launch(fc._NoLaunch):
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[self.name] += 1
            return launch

    kernels_pkg.unavailable_reason = lambda: None
    for mod, name in ((fp8, "_act_quant_kernel"), (fp8, "_weight_quant_kernel"), (fp8, "_swiglu_quant_kernel"),
                      (fp8, "_swiglu_quant_t_kernel"), (fp8, "_swiglu_grad_quant_kernel"),
                      (fp8, "_swiglu_grad_rows_kernel"), (fp8, "_swiglu_grad_cols_kernel"),
                      (fp8, "_rms_norm_quant_kernel"), (fp8, "_transpose_words_kernel"), (int8, "_row_quant_kernel"),
                      (int8, "_rms_norm_rows_kernel"), (int8, "_swiglu_rows_kernel")):
        setattr(mod, name, Launch(name, {}))
    return launches


def _flow(name: str):
    from jetrl_cli.precision import parse_flow

    if name == "bf16":
        return parse_flow({"base": name})
    fixed = {"backend": "scaled_mm"}  # what `auto` resolves to on Hopper (tests/test_fake_cuda.py)
    return parse_flow({"base": name, "rollout": {"linear": fixed}, "train": dict.fromkeys(("fprop", "dgrad", "wgrad"), fixed)})


def forward(args) -> dict:
    from jetrl_cli.bench import _train_batch
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.shapes import load_bench_model
    from jetrl_cli.precision import apply_flow
    from jetrl_cli.rl.trainer import token_logprobs

    _stand_in_kernels()
    make, cfg, label = load_bench_model(args.model, args.layers)
    batch, _ = _train_batch(cfg.vocab_size, args.batch, args.seq, torch.Generator().manual_seed(0))
    mode = Counting(bool_every=1, real=0.0)
    with fc._pretend_bench(), mode, py_autograd.recording():
        model = make(torch.device("cuda")).train()
        apply_flow(model, _flow(args.flow), "train")
        held, before = mode.live, collections.Counter(mode.by_site)
        loss = token_logprobs(model, batch, SamplingParams(max_new_tokens=args.seq - args.seq // 2)).sum()
        grown = collections.Counter({k: v - before.get(k, 0) for k, v in mode.by_site.items()})
        out = {"model": label, "flow": args.flow, "tokens": [args.batch, args.seq], "weights_gb": held / 1e9,
               "live_after_forward_gb": (mode.live - held) / 1e9,
               "sites_gb": [[round(v / 1e9, 3), k] for k, v in grown.most_common(args.top) if v > 0]}
        del loss
    return out


def host(args) -> dict:
    from jetrl_cli.bench import _train_batch
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.shapes import load_bench_model
    from jetrl_cli.rl.algos import CorrectionConfig
    from jetrl_cli.rl.trainer import Trainer

    launches = _stand_in_kernels()
    make, cfg, label = load_bench_model(args.model, args.layers)
    batch, adv = _train_batch(cfg.vocab_size, args.batch, args.seq, torch.Generator().manual_seed(0))
    mode = Counting(bool_every=1, real=0.0)
    plain_backward, plain_equal = torch.autograd.backward, torch.equal
    if args.graphs:  # the graphs' capture backpropagates two roots (autograd's C++ engine wants a driver),
        torch.autograd.backward = lambda tensors, grad_tensors=None, inputs=None, **kw: py_autograd.backward_all(
            tuple(tensors), tuple(grad_tensors))
        torch.equal = lambda a, b: True  # and checks its replay against the warm-up (no values here)
    with fc._pretend_bench(), mode, py_autograd.recording():
        tr = Trainer(make(torch.device("cuda")), _flow(args.flow), TrainConfig(lr=1e-6, micro_batch=args.batch),
                     CorrectionConfig(type="none"), SamplingParams(max_new_tokens=args.seq - args.seq // 2), args.seq)
        if args.graphs:
            from jetrl_cli.rl.train_graphs import TrunkGraphs

            tr.graphs = TrunkGraphs(tr.model, graph_api=fc.HostOnlyGraphs(mode)).install()
        old = tr.score(batch)
        tr.update(batch, adv, old, None, 1)  # the first update makes the optimizer state
        launches.clear()
        mode.on = True
        prof = cProfile.Profile()
        prof.enable()
        tr.update(batch, adv, old, None, 2)
        prof.disable()
    torch.autograd.backward, torch.equal = plain_backward, plain_equal
    if args.graphs and (tr.graphs.disabled or not tr.graphs.entries or mode.in_capture):
        raise RuntimeError(f"the graphs did not serve the update: {tr.graphs.report()}; in captures: {mode.in_capture}")
    ours = [v for k, v in pstats.Stats(prof).stats.items() if os.sep + "jetrl_cli" + os.sep in k[0]
            or os.sep + "kernels" + os.sep in k[0]]
    ops = {k: v for k, v in mode.ops.items() if not k.startswith("prim.")}
    mine = sorted(((v[1], f"{os.path.relpath(k[0], ROOT)}:{k[1]}:{k[2]}") for k, v in pstats.Stats(prof).stats.items()
                   if os.sep + "jetrl_cli" + os.sep in k[0] or os.sep + "kernels" + os.sep in k[0]), reverse=True)
    return {"model": label, "flow": args.flow + ("+graphs" if args.graphs else ""), "tokens": [args.batch, args.seq],
            "aten_ops": sum(v for k, v in ops.items() if k not in VIEWS),
            "view_ops": sum(v for k, v in ops.items() if k in VIEWS),
            "triton_launches": dict(launches), "jetrl_python_calls": sum(v[1] for v in ours),
            "most_called": [[n, where] for n, where in mine[:args.top]],
            "aten_ops_most_dispatched": mode.ops.most_common(args.top)}


def bench(args) -> dict:
    """``jetrl bench train --device cuda`` for one flow, every phase of its row run on fake CUDA tensors
    (``--no-transformers``, one timed update), with ``torch.cuda.max_memory_allocated`` and its reset
    answered from the live device bytes: each phase's peak as the tensors make it, and the largest
    sites live at the row's highest peak. The backward (``tests/py_autograd.py``) keeps every saved
    tensor until the graph is freed, where autograd frees a node's as it runs: its peaks are upper
    bounds for the same allocations."""
    from unittest import mock

    from jetrl_cli import bench as jbench

    _stand_in_kernels()
    state = {"peak": 0, "at_peak": collections.Counter(), "step": 0}
    mode = Counting(bool_every=1, real=0.0)
    plain = Counting.__torch_dispatch__

    def dispatch(self, func, types, args_=(), kwargs=None):
        out = plain(self, func, types, args_, kwargs)
        if self.live > state["peak"]:
            state["peak"] = self.live
            if self.live > state["step"] + 2**29:  # a snapshot per 0.5 GiB of growth
                state["at_peak"], state["step"] = collections.Counter(self.by_site), self.live
        return out

    def reset(*a):
        state["peak"], state["step"] = mode.live, 0

    with mock.patch.object(Counting, "__torch_dispatch__", dispatch), fc._pretend_bench(), mode, \
            py_autograd.recording(), mock.patch.object(torch.cuda, "max_memory_allocated", lambda *a: state["peak"]), \
            mock.patch.object(torch.cuda, "memory_allocated", lambda *a: mode.live), \
            mock.patch.object(torch.cuda, "reset_peak_memory_stats", reset):
        s = jbench.Settings(device="cuda", repeats=1, warmup=1, model=args.model, layers=args.layers,
                            train_batch=args.batch, seq=args.seq, flows=(args.flow,), transformers=False)
        (row,) = jbench.run_bench(["train"], s)["results"]["train"]
    return {"model": row["model"], "flow": args.flow, "tokens": [args.batch, args.seq],
            "peak_gb_by_phase": {k: round(v / 1e9, 2) for k, v in row["peak_memory_by_phase"].items()},
            "sites_gb_at_the_highest_peak": [[round(v / 1e9, 3), k] for k, v in state["at_peak"].most_common(args.top)
                                             if v > 0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("forward", "host", "bench"))
    ap.add_argument("--flow", default="fp8-unified")
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--top", type=int, default=15, help="forward, bench: allocation sites listed")
    ap.add_argument("--graphs", action="store_true", help="host: with train.cuda_graphs (the layers' replays run "
                    "no host work; what is left is counted)")
    args = ap.parse_args()
    if not torch.backends.cuda.is_built():
        sys.exit(f"needs a CUDA build of torch (this is {torch.__version__})")
    fc._pretend_hopper()
    torch.Tensor.backward = py_autograd.backward
    print(json.dumps({"forward": forward, "host": host, "bench": bench}[args.what](args), indent=1))


if __name__ == "__main__":
    main()
