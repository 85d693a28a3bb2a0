"""Peak tensor memory of one training step, native path, counted on CPU: jetrl's trainer against the
``transformers`` baseline of ``jetrl bench train`` (fp32 master weights, bf16 autocast, SDPA, fused
AdamW).

On the native (GPU) code path the tensors a step allocates -- their dtypes, shapes and lifetimes --
do not depend on the device, so their peak can be counted on CPU with the native path forced
(``set_force_native``) and bf16 autocast on CPU for the baseline. torch's ``MemTracker`` (a dispatch
mode) adds up the live storages; its peak is what a GPU's ``max_memory_allocated`` would show
before the caching allocator's rounding, cuBLAS workspaces and the attention kernels' scratch,
which it does not see. AdamW is fused in both (as on CUDA; CPU has the fused kernel too), so the
optimizer step allocates no temporaries. The second of two updates is counted (AdamW's states exist
by then).

``--fake`` counts whole models at real batch sizes: the weights, states and activations are torch's
``FakeTensor``s (shapes, dtypes and lifetimes without memory or arithmetic; the batch stays real),
and the few values the step reads on the host (finiteness checks, statistics) are answered with
made-up ones, which the step's allocations do not depend on. At a size both can run, the fake count
equals the real one but where the CPU lacks a GPU kernel: a GEMM of bf16 operands written into an
fp32 buffer (CUDA's ``addmm`` with ``out_dtype``; the lm_head's sliced Wgrad) makes the product
whole on CPU and then copies it, a temporary the fake count (which takes the CUDA op) does not
hold. FP8 flows need ``--fake``: their GEMMs then run through ``scaled_mm`` with the
operands a Hopper GPU gets (FP8 data and scales; the device check is skipped, fake tensors compute
nothing), where a real CPU run would take the emulated backend and its float64 operands.

Not counted, so a GPU's peak is higher by them: the allocator's rounding and fragmentation, cuBLAS
and attention workspaces, and what a compiled kernel keeps in registers instead of memory: the
SwiGLU backward runs eagerly here (its fp32 temporaries are counted), compiled on a GPU.

``--where`` prints the source line at the peak and the largest tensors then live, with the line
that allocated each. ``--no-release`` counts jetrl's trainer as it was before it dropped its cached
weights in the step's last backward (``releasing_weights``).

    python docs/experiments/train_step_memory.py --model qwen2.5-1.5b --layers 2 --batch 1 --seq 64
    python docs/experiments/train_step_memory.py --fake --batch 16 --seq 512 --flows bf16,fp8-unified

Real counts are slow on CPU (native bf16 matmuls over a 152K vocabulary): a few minutes at the first
line's size. Fake counts take seconds to two minutes for the whole 1.5B model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import traceback
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, get_untyped_storages
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from jetrl_cli.bench import _train_batch
from jetrl_cli.config import TrainConfig
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.models.shapes import load_bench_model
from jetrl_cli.precision import gemm, parse_flow
from jetrl_cli.precision.gemm import set_force_native
from jetrl_cli.rl import trainer as trainer_mod
from jetrl_cli.rl.algos import CorrectionConfig

GB = 1e9
warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # the weight caches key on it
SOURCES = os.path.dirname(os.path.dirname(os.path.abspath(gemm.__file__))) + os.sep  # jetrl_cli/
TORCH = os.path.dirname(torch.__file__) + os.sep


BIG_FACTORY = 1 << 24  # bytes


class Counting(TorchDispatchMode):
    """The dispatch mode a step is counted under (inside ``MemTracker``'s), for two things.

    - With ``fake`` (``--fake``): ops with a fake input run in that ``FakeTensorMode`` (host tensors
      are lifted), the others for real, except factories (no tensor input) of a tensor of
      ``BIG_FACTORY`` bytes or more, which make a fake one (an in-place op on a real buffer with a
      fake operand would otherwise write a lifted copy: a tensor a plain run never allocates).
      Host reads of fake values get made-up answers: True, 1, 0.5, all rows for ``nonzero``.
    - Always: autograd's engine sums two gradients for one tensor (a tied embedding's, a residual
      stream's) in place when it holds the only reference to one of them, but never while a
      dispatch mode is active (it treats the tensors as subclasses then), so under ``MemTracker``
      each such sum would be counted as a new tensor that a plain run never allocates. Such a sum
      (an ``add`` called by the engine itself, of two same-shaped contiguous tensors) is done in place
      here, as a plain run does it."""

    def __init__(self, fake: bool):
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True) if fake else None

    def building(self):
        """Where models are made: fake with ``fake``."""
        return self.fake or contextlib.nullcontext()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.add.Tensor and not kwargs and _engine_sum(args):
            return args[0].add_(args[1])
        leaves = pytree.tree_leaves((args, kwargs))
        if self.fake is not None and not any(isinstance(t, torch.Tensor) for t in leaves):  # a factory
            with self.fake:
                out = func(*args, **kwargs)
            if isinstance(out, FakeTensor) and out.untyped_storage().nbytes() >= BIG_FACTORY:
                return out
        if self.fake is None or not any(isinstance(t, FakeTensor) for t in leaves):
            return func(*args, **kwargs)
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            dt = args[0].dtype
            return True if dt is torch.bool else 0.5 if dt.is_floating_point else 1
        if func is torch.ops.aten.nonzero.default:
            return self.fake.from_tensor(torch.ones(args[0].shape, dtype=torch.bool).nonzero())
        if func is torch.ops.aten.addmm.dtype_out:  # a GEMM into ``out`` (CUDA has it; fake mode's is broken)
            return kwargs["out"]

        def lift(x):
            return self.fake.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x

        args, kwargs = pytree.tree_map(lift, (args, kwargs))
        with self.fake:
            return func(*args, **kwargs)


def _engine_sum(args) -> bool:
    """``add(a, b)`` called by autograd's engine (no Python frame between the engine's entry and
    this mode), of two contiguous gradients of one shape and dtype."""
    if len(args) != 2 or torch.is_grad_enabled():
        return False
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
            and a.is_contiguous() and b.is_contiguous()):
        return False
    for f in reversed(traceback.extract_stack()[:-1]):  # the innermost frame outside torch and this file
        if f.filename.startswith(TORCH) and f.name != "_engine_run_backward" or f.filename == __file__:
            continue
        return f.name == "_engine_run_backward"
    return False


def _site() -> str:
    frames = [f for f in traceback.extract_stack() if f.filename.startswith(SOURCES)][-3:]
    return " < ".join(f"{os.path.relpath(f.filename, os.path.dirname(SOURCES))}:{f.lineno} {f.name}"
                      for f in reversed(frames))


class WhereTracker(MemTracker):
    """``MemTracker`` that also notes where the peak happened and which tensors were live then."""

    BIG = 16e6  # bytes: smaller tensors are not traced to their source line

    def __init__(self):
        super().__init__()
        self.born: dict[int, str] = {}
        self.peak_site, self.peak_live = "", []

    def _track(self, reftype, t):
        new = [st for st in get_untyped_storages(t) if st not in self._WINFO]
        super()._track(reftype, t)
        for st in new:
            if st in self._WINFO and st.nbytes() > self.BIG:
                self.born[id(self._WINFO[st][0])] = f"{tuple(t.shape)} {str(t.dtype)[6:]} at {_site() or reftype}"

    def _update_peak_stats(self, peak_state):
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            self.peak_site = _site()
            live = sorted(((w.mem_consumed, self.born.get(id(w), "parameter or state")) for w, _ in self._WINFO.values()),
                          reverse=True)
            self.peak_live = [f"{b / GB:.3f} GB {what}" for b, what in live[:12]]


def _micro_batches(tracker: type) -> type:
    """``tracker`` for a step of several micro-batches: it installs no gradient hooks on the weights
    (with one, a micro-batch could not add its gradients where they are held: ``grad_sink``), so the
    gradients count as the backward's temporaries, not as gradients (the total is the same); and
    each micro-batch's forward starts the per-module statistics over (MemTracker refuses a model's
    second forward)."""

    class Tracker(tracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _pre_fw_hook(self, module, inputs) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

    return Tracker


def _peak(step, *external, where: bool = False, micro: bool = False) -> dict:
    """The second call of ``step()``'s peak tensor bytes, by kind (MemTracker's categories); ``micro``:
    a step of several micro-batches (``_micro_batches``)."""
    step()
    tracker = WhereTracker if where else MemTracker
    mt = (_micro_batches(tracker) if micro else tracker)()
    mt.track_external(*external)
    with mt:
        step()
    snap = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    out = {str(getattr(k, "value", k)).lower(): round(v / GB, 3) for k, v in snap.items() if v}
    if where:
        out["peak_at"], out["live_at_peak"] = mt.peak_site, mt.peak_live
    return out


def _flow(name: str, fake: bool):
    """A named flow, or one with ``jetrl bench``'s modifiers (``fp8-rollout+fp8kv``); its 8-bit GEMMs
    through ``scaled_mm``, as on Hopper."""
    from jetrl_cli.bench import FLOW_MODIFIERS

    if name == "bf16":
        return parse_flow(name)
    if not fake:
        raise SystemExit(f"flow {name}: FP8/INT8 flows are counted with --fake only (see the docstring)")
    base, *mods = name.split("+")
    over: dict = {"base": base}
    for m in mods:
        over.update(FLOW_MODIFIERS[m])
    over["rollout"] = {**over.get("rollout", {}), "linear": {"backend": "scaled_mm"}}
    over["train"] = {g: {"backend": "scaled_mm"} for g in ("fprop", "dgrad", "wgrad")}
    return parse_flow(over, name=name)


@contextlib.contextmanager
def _hopper_scaled_mm():
    """``scaled_mm``'s blockwise GEMMs accepted on (fake) CPU tensors: their shapes are Hopper's."""
    plain = gemm.ScaledMMBackend.unsupported
    gemm.ScaledMMBackend.unsupported = lambda self, spec, name, device: plain(self, spec, name, None)
    try:
        yield
    finally:
        gemm.ScaledMMBackend.unsupported = plain


@contextlib.contextmanager
def fused_quantizers(run=lambda kind, fn, *tensors: fn(*tensors)):
    """jetrl's SwiGLU quantizers (``kernels.fp8.swiglu_quantize`` / ``swiglu_quantize_t`` /
    ``swiglu_grad_quantize``), which ``gated_mlp`` takes on a kernel backend where Triton runs, its
    RMSNorm quantizer (``rms_norm_quantize``, which ``models.llama.norm_linear`` takes there) and its
    group weight quantizer (``quantize_weight_stack(s)``, which a trainer's FP8 q/k/v and gate/up take),
    taken on the (fake) CPU tensors too: their reference (the SwiGLU or the norm, and the quantizer)
    runs, as ``run(kind, fn, *tensors)`` with ``kind`` ``"swiglu"``, ``"norm"`` or ``"weight"`` (a
    counter may take it as the one kernel it is on a GPU; its temporaries are the reference's, not
    the kernel's)."""
    from jetrl_cli.models import llama
    from jetrl_cli.precision import linear, quant
    from jetrl_cli.precision.formats import Block
    from jetrl_cli.precision.quant import CastSpec, QTensor

    class Kernels:
        @staticmethod
        def unsupported(*args):
            return None

        @staticmethod
        def swiglu_quantize(gu, fmt, pow2_scale, amax_floor, save=False):
            spec = CastSpec(fmt, Block(1, 128), pow2_scale, amax_floor)

            def reference(gu):
                h = quant.quantize(linear._swiglu_math(gu, torch.float32), spec)
                return h, (quant.quantize(gu, spec) if save else None)
            return run("swiglu", reference, gu)

        @staticmethod
        def swiglu_quantize_t(q, gu_dtype, fmt, pow2_scale, amax_floor, pad_tokens_to):
            def reference(data, scale):
                h = linear._swiglu_math_fp8(data, scale, 128, gu_dtype, torch.float32)
                return quant.quantize(h, CastSpec(fmt, Block(128, 1), pow2_scale, amax_floor)).t()
            return run("swiglu", reference, q.data, q.scale)

        @staticmethod
        def swiglu_grad_quantize(q, gy, out_dtype, fmt, pow2_scale, amax_floor, rows=True, cols=True,
                                 pad_tokens_to=1, h_cols=False):
            def reference(data, scale, gy):
                d = linear._swiglu_grad_fp8(data, scale, 128, gy, out_dtype)
                h = linear._swiglu_math_fp8(data, scale, 128, out_dtype, torch.float32) if h_cols else None
                return (quant.quantize(d, CastSpec(fmt, Block(1, 128), pow2_scale, amax_floor)) if rows else None,
                        quant.quantize(d, CastSpec(fmt, Block(128, 1), pow2_scale, amax_floor)).t() if cols else None,
                        quant.quantize(h, CastSpec(fmt, Block(128, 1), pow2_scale, amax_floor)).t() if h_cols else None)
            return run("swiglu", reference, q.data, q.scale, gy)

        @staticmethod
        def rms_norm_quantize(x, delta, w, eps, out, fmt, pow2_scale, amax_floor, write_y=False, rsqrt=False):
            def reference(x, delta, w):
                s, y, r = llama._add_rms_norm(x, delta, w, eps, out, True)
                q = quant.quantize(y, CastSpec(fmt, Block(1, 128), pow2_scale, amax_floor))
                return (None if delta is None else s), (y if write_y else None), (r[:, 0] if rsqrt else None), q
            return run("norm", reference, x, delta, w)

        @staticmethod
        def quantize_weight_stack(ws, fmt, pow2_scale, amax_floor, transposed=False, held=None):
            from jetrl_cli.kernels.layouts import cdiv, padded_groups

            spec = CastSpec(fmt, Block(128, 128), pow2_scale, amax_floor)
            k, total, dev = ws[0].shape[1], sum(w.shape[0] for w in ws), ws[0].device
            gk, gt = cdiv(k, 128), cdiv(total, 128)
            wq = QTensor(torch.empty((total, k), dtype=fmt.torch_dtype(), device=dev),
                         torch.empty((gt, padded_groups(k)), device=dev)[:, :gk], spec)
            wt = QTensor(torch.empty((k, total), dtype=fmt.torch_dtype(), device=dev),
                         torch.empty((gk, padded_groups(total)), device=dev)[:, :gt], spec) if transposed else None
            start = 0
            for w in ws:  # one kernel per layer, writing its rows of W and its columns of W^T
                n, g0 = w.shape[0], start // 128

                def reference(w, start=start, n=n, g0=g0):
                    q = quant.quantize(w, spec)
                    rows = wq.data[start:start + n].copy_(q.data)
                    wq.scale[g0:g0 + q.scale.shape[0]].copy_(q.scale)
                    if not transposed:
                        return rows
                    wt.scale[:, g0:g0 + q.scale.shape[0]].copy_(q.scale.t())
                    return rows, wt.data[:, start:start + n].copy_(q.data.t())
                run("weight", reference, w)
                start += n
            return wq, wt

        @staticmethod
        def quantize_weight_stacks(groups, fmt, pow2_scale, amax_floor, transposed=False, helds=None):
            return [Kernels.quantize_weight_stack(ws, fmt, pow2_scale, amax_floor, transposed) for ws in groups]

    plain = linear.kernel_quantizers
    linear.kernel_quantizers = lambda x, backends, spec=None: Kernels if any(
        getattr(b, "name", "") in ("scaled_mm", "triton") for b in backends) else None
    try:
        yield
    finally:
        linear.kernel_quantizers = plain


def jetrl_peak(make, flow, batch, adv, t: int, release: bool, where: bool, measure=None,
               micro_batch: int | None = None) -> dict:
    sp = SamplingParams(max_new_tokens=t - t // 2)
    kind, trainer_mod.adamw_kind = trainer_mod.adamw_kind, lambda cuda: {"fused": True}  # as on CUDA
    tr = trainer_mod.Trainer(make(torch.device("cpu")), flow, TrainConfig(lr=1e-6, micro_batch=micro_batch or len(batch)),
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
        if measure is None:
            return _peak(step, tr.model, tr.opt, where=where, micro=tr.cfg.micro_batch < len(batch))
        return measure(step, tr.model, tr.opt, where=where)
    finally:
        trainer_mod.releasing_weights = before


def transformers_peak(make, batch, adv, where: bool, building=contextlib.nullcontext, measure=None,
                      micro_batch: int | None = None) -> dict:
    from jetrl_cli.models.transformers_ref import transformers_twin

    with building():  # the twin's module init too (fake with --fake)
        hf = transformers_twin(make(torch.device("cpu")), torch.float32).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=True)
    ids, mask = batch.ids, batch.mask.float()
    mb = micro_batch or len(ids)

    def step():
        for s in range(0, len(ids), mb):  # autograd adds each micro-batch's gradients into .grad
            i, m = ids[s:s + mb], mask[s:s + mb]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = hf(i).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, i[:, 1:, None])[..., 0]
            (-(logp * adv[s:s + mb, None] * m).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if measure is None:
        return _peak(step, hf, opt, where=where, micro=mb < len(ids))
    return measure(step, hf, opt, where=where)


def model_arguments(ap: argparse.ArgumentParser, batch: int, seq: int) -> None:
    """The model and batch options both counting scripts take."""
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per forward and backward (default: the whole batch, one micro-batch)")


def counted_setup(args, fake: bool):
    """``(make, label, batch, adv, mode)`` for a count: the native path forced, the model's maker
    (fake with ``fake``), the batch, and the ``Counting`` mode to count under."""
    set_force_native(True)
    real_make, cfg, label = load_bench_model(args.model, args.layers)
    batch, adv = _train_batch(cfg.vocab_size, args.batch, args.seq, torch.Generator().manual_seed(0))
    mode = Counting(fake)

    def make(device):
        with mode.building():
            return real_make(device)

    return make, label, batch, adv, mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(ap, batch=1, seq=64)
    ap.add_argument("--flows", default="bf16", help="comma-separated jetrl flows (FP8/INT8 ones need --fake)")
    ap.add_argument("--fake", action="store_true", help="count with fake tensors: any size, no memory")
    ap.add_argument("--where", action="store_true", help="also print where each peak happened")
    ap.add_argument("--no-release", action="store_true", help="also count jetrl without releasing_weights")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers row")
    args = ap.parse_args()
    make, label, batch, adv, mode = counted_setup(args, args.fake)
    out = {"model": label, "batch": args.batch, "seq": args.seq, "micro_batch": args.micro_batch or args.batch,
           "fake": args.fake, "peak_gb": {}}
    with mode, _hopper_scaled_mm(), fused_quantizers():
        for name in args.flows.split(","):
            flow = _flow(name, args.fake)
            out["peak_gb"][f"jetrl {name}"] = jetrl_peak(make, flow, batch, adv, args.seq, True, args.where,
                                                         micro_batch=args.micro_batch)
            if args.no_release:
                out["peak_gb"][f"jetrl {name}, caches kept"] = jetrl_peak(make, flow, batch, adv, args.seq, False,
                                                                          args.where, micro_batch=args.micro_batch)
        if not args.no_transformers:
            out["peak_gb"]["transformers"] = transformers_peak(make, batch, adv, args.where, mode.building,
                                                               micro_batch=args.micro_batch)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
