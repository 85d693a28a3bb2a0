"""What one training step asks of a GPU, counted on CPU: kernels launched, bytes they read and write,
and GEMM / attention FLOPs -- jetrl's trainer against the ``transformers`` baseline of ``jetrl bench
train``, on the native (GPU) code path, whole models at real sizes (fake tensors, as
``train_step_memory.py --fake``).

Counts, not times: nothing here says how fast a GPU runs the step. They show where a step spends
its memory traffic and launches, and what one implementation does that the other does not.

How each op is counted (a ``TorchDispatchMode`` under the fake-tensor counting of
``train_step_memory.py``; the second of two updates):

- A **kernel** is an aten op that is not a view (``OpOverload.is_view``, ``_unsafe_view``), a
  metadata query (``prim::device``) nor an allocation (``empty``), including in-place ones and
  copies/casts. Its bytes are the sizes of its tensor inputs (read) and outputs (written, or
  updated in place: the schema's mutated arguments), each tensor once; a broadcast input counts
  the elements it has, not the elements it is broadcast to. A gather (``embedding``,
  ``index_select``, ``gather``, ``index``) reads the rows it takes, not its whole table; a scatter
  (``index_copy_``, ``index_put_``, ``index_add_``, ``scatter_``) writes the rows it is given and reads no more of
  its target; ``copy_``, ``fill_`` and ``zero_`` write their target without reading it. Kernels
  run in the fake-tensor mode's own bookkeeping are not jetrl's and are not seen.
- jetrl's **fused** elementwise chains (``precision/fuse.py``: RMSNorm, SwiGLU, RoPE and their
  backward passes, the token logprobs' backward), compiled into one kernel each on a GPU, count as
  one kernel whose bytes are the chain's tensor arguments and results; the ops inside are not
  counted. (Inductor may keep an intermediate in memory inside the kernel; that is not seen.)
  ``--no-fuse`` counts them op by op.
- **FLOPs**: 2·M·N·K for a GEMM (``mm``, ``addmm``, ``bmm``, ``_scaled_mm``, ...); attention
  (SDPA) 4·B·H·Tq·Tk·D forward and twice that backward, halved when causal; nothing for the rest.
- The FP8 **quantizer** is one kernel per cast, as jetrl's Triton quantizers are on a GPU (its
  reference implementation runs here), and the conversions to the GEMM's scale layout, which the
  Triton quantizers make unnecessary, are not counted. Where a GPU makes two copies in one kernel
  -- a Fprop and a Wgrad copy of one tensor (``cast_pair``), W and W^T (``cast_weight_pair``),
  down's input and the copy of [g, u] from [g, u] (``swiglu_quantize``) -- this counts one, as it
  counts the backward's h^T from that copy (``swiglu_quantize_t``, or ``swiglu_grad_quantize`` with the
  gradient's operands).
- The ``transformers`` row runs eagerly under bf16 autocast: each of its casts is a kernel, as on
  a GPU. It clips no gradients (as ``jetrl bench train`` runs it); jetrl's rows do, and here their
  clipping multiply is always counted (the host reads of fake values get made-up answers, and the
  made-up norm is over the bound), through the ``_foreach`` kernels as on CUDA.
- An FP8 KV cache's **store** (``kernels.attention.kv_store``: a token's keys or values quantized and
  written to their cache rows, or the trainer's scratch copy) is one kernel, as on a GPU (the
  reference quantizer runs here): it reads the keys and writes their FP8 bytes and scales.

    python docs/experiments/train_step_traffic.py --batch 4 --seq 256
    python docs/experiments/train_step_traffic.py --batch 16 --seq 512 --flows bf16 --top 25
    python docs/experiments/train_step_traffic.py --decode --batch 64 --seq 512 --flows bf16,fp8-rollout

``--decode`` counts one decode step of the embedded rollout engine instead (``--batch`` sequences,
a KV cache ``--seq`` keys wide and half full), with the KV cache's bytes beside it: a decode step
is memory-bound, and the GEMM weights and the cache are the least it has to read. Not counted as
on a GPU: an FP8 KV cache read as stored (a Triton kernel that does not run on fake tensors; here
the cache is dequantized for SDPA) and INT8 GEMMs through Triton (here ``torch._int_mm`` with the
scaling as separate ops).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
from torch.nn.utils import clip_grad
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step_memory as tsm  # noqa: E402 - beside this script

from jetrl_cli.engine import sampling  # noqa: E402
from jetrl_cli.kernels import layouts  # noqa: E402
from jetrl_cli.models import llama  # noqa: E402
from jetrl_cli.precision import fuse, gemm, linear, quant  # noqa: E402
from jetrl_cli.precision.formats import Block  # noqa: E402
from jetrl_cli.precision.quant import QTensor  # noqa: E402
from jetrl_cli.rl import head_grad  # noqa: E402

GB = 1e9
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "scaled_mm", "_int_mm", "_scaled_mm_v2"}
_SDPA_FWD = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")


_GATHERS = {"embedding", "index_select", "gather", "index"}  # (table, indices): reads only the rows taken
_SCATTERS = {"index_copy_", "index_put_", "index_add_", "scatter_"}  # (self, ..., values): writes only the values' rows
_OVERWRITES = {"copy_", "fill_", "zero_"}  # in place, without reading what they write over
_NOT_KERNELS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten._unsafe_view.default,
                torch.ops.aten.lift_fresh.default, torch.ops.aten.detach.default,
                # allocations: no kernel runs, nothing is read or written
                torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.new_empty_strided.default}


def _tensors(x) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in pytree.tree_leaves(x):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's ``Tensor(a!)`` arguments: ``add_``'s self,
    ``_fused_adamw_``'s parameters and both moments -- its gradients only with a ``grad_scale`` --,
    an ``out=``)."""
    got = []
    for i, a in enumerate(func._schema.arguments):
        if a.name == "grads" and kwargs.get("grad_scale") is None:  # fused Adam writes them only to unscale
            continue
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            got += _tensors(v)
    return got


def _fresh(func, out):
    """An op's results that are new tensors: not those its schema returns as an argument's alias (an
    in-place op's ``self``, an ``out=``; counted once, as written, by ``_mutated``)."""
    rets = func._schema.returns
    if not rets:
        return None
    if len(rets) == 1:
        return None if rets[0].alias_info is not None else out
    return [o for o, r in zip(out, rets) if r.alias_info is None]


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _gemm_flops(name: str, args) -> int:
    ts = [t for t in args if isinstance(t, torch.Tensor)]
    if name in ("addmm", "baddbmm"):
        ts = ts[1:]
    a, b = ts[0], ts[1]
    if a.dim() == 3:  # bmm
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2 * a.shape[0] * a.shape[1] * b.shape[-1]


def _sdpa_flops(name: str, args, kwargs) -> int:
    q, k = args[0], args[1]
    if "backward" in name:  # grad_out, q, k, v, ...
        q, k = args[1], args[2]
    b, h, tq, d = q.shape
    tk = k.shape[-2]
    causal = bool(kwargs.get("is_causal", False)) or any(a is True for a in args[3:8])
    flops = 4 * b * h * tq * tk * d * (2 if "backward" in name else 1)
    return flops // 2 if causal else flops


class Traffic(TorchDispatchMode):
    """Counts every non-view op (see the module docstring) by name: launches, bytes, FLOPs."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, list] = {}  # name -> [launches, bytes read, bytes written, flops]
        self.inside = 0  # > 0 within a fused chain (counted as one kernel by ``fused_call``)
        self.by_shape = False  # --quantizers-by-shape

    def kernel(self, label: str | None, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` as one kernel ``label`` (its tensor arguments read, its results
        written; None: free), the ops inside it not counted; inside another such call, not counted.
        With ``by_shape`` an 8-bit quantizer's label also names its first tensor's shape and dtype."""
        if self.by_shape and label is not None and "(Triton)" in label:
            t = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if t is not None:
                label = f"{label} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
        self.inside += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            self.inside -= 1
        if label is not None and not self.inside:
            res = out if isinstance(out, tuple) else (out,)
            self.add(label, _bytes(_tensors((args, kwargs))), _bytes(_tensors([_fields(o) for o in res])))
        return out

    def add(self, name: str, read: int, written: int, flops: int = 0) -> None:
        row = self.ops.setdefault(name, [0, 0, 0, 0])
        row[0] += 1
        row[1] += read
        row[2] += written
        row[3] += flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside or func.is_view or func.namespace != "aten" or func in _NOT_KERNELS:
            return out
        name = func.overloadpacket.__name__
        ins = _tensors((args, kwargs))
        written = _mutated(func, args, kwargs)
        outs = [t for t in _tensors(_fresh(func, out)) if not any(t is i for i in ins)] + written
        if name in _OVERWRITES:
            ins = [t for t in ins if not any(t is w for w in written)]
        if name in _GATHERS:  # reads the rows it gathers (as many bytes as it writes), not the table
            ins = ins[1:] + outs
        elif name in _SCATTERS:  # writes the rows it is given, into a tensor it does not read
            ins = ins[1:]
            outs = ins[-1:]
        flops = 0
        if name in _GEMMS:
            flops = _gemm_flops(name, args)
        elif name.startswith(_SDPA_FWD) or name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            flops = _sdpa_flops(name, args, kwargs)
        self.add(name, _bytes(ins), _bytes(outs), flops)
        return out


def _fused_wrappers():
    """Every ``@fused`` function of jetrl, as (module, attribute name)."""
    code = fuse.fused(lambda x: x).__code__
    for mod in (linear, llama, sampling, head_grad):
        for k, v in vars(mod).items():
            if callable(v) and getattr(v, "__code__", None) is code:
                yield mod, k


def _gpu_kernels(fuse_chains: bool):
    """(module, attribute, counted as) for each function that is one kernel on a GPU, or none (None)."""
    out = [(mod, k, f"fused {k.lstrip('_')}") for mod, k in _fused_wrappers()] if fuse_chains else []
    # the quantizer: on a GPU jetrl's Triton kernels (one per cast, or per pair of casts), which
    # write the scales in the GEMM's layout directly (no layout conversion runs there)
    out += [(quant, "quantize", "quantize (Triton)"), (gemm, "quantize", "quantize (Triton)"),
            (layouts, "to_gemm_layout", None)]
    return out


@contextlib.contextmanager
def as_kernels(traffic: Traffic, fuse_chains: bool):
    """Each function of ``_gpu_kernels`` called during the count is one kernel (its tensor arguments
    read, its results written), or nothing; the ops inside it are not counted."""
    saved = []
    for mod, k, label in _gpu_kernels(fuse_chains):
        fn = getattr(mod, k)

        def counted(*args, _fn=fn, _label=label, **kwargs):
            return traffic.kernel(_label, _fn, *args, **kwargs)

        saved.append((mod, k, fn))
        setattr(mod, k, counted)
    try:
        yield
    finally:
        for mod, k, fn in reversed(saved):
            setattr(mod, k, fn)


@contextlib.contextmanager
def triton_pairs(traffic: Traffic):
    """What jetrl's Triton quantizers do on a GPU, for the count: ``cast_pair`` with an 8-bit cast
    reads its tensor once and writes both copies in their GEMM layouts (one kernel),
    ``cast_weight_pair`` writes W and W^T from one read of W (here: the reference quantizer and a
    transpose, counted as that one kernel), ``swiglu_quantize`` makes down's FP8 input (and the
    FP8 copy of [g, u]) from one read of [g, u], ``swiglu_quantize_t`` down's Wgrad operand from
    that copy and ``swiglu_grad_quantize`` the gate/up GEMMs' dy operands from it and down's input
    gradient (here: the reference SwiGLU and quantizer), and ``rms_norm_quantize`` a residual add,
    the norm after it and the next GEMM's FP8 input (here: the reference norm and quantizer)."""
    plain_pair = gemm.cast_pair

    def one_kernel(fn, x, *args):  # reads x only (the specs and backends are not tensors)
        return traffic.kernel("quantize (Triton)", fn, x, *args)

    def cast_pair(x, rows, cols, backends):
        if not any(c is not None and c.is_scaled for c in (rows, cols)):
            return plain_pair(x, rows, cols, backends)
        return one_kernel(plain_pair, x, rows, cols, backends)

    def weight_pair(w, spec, backends):  # cast_weight_pair's conditions, but the device
        if not (spec.format.is_fp8 and spec.block == Block(128, 128) and w.dim() == 2
                and any(getattr(b, "name", "") in ("scaled_mm", "triton") for b in backends)):
            return None

        def both(w, spec, backends):
            q = gemm.cast_operand(w, spec, backends[0])
            return q, gemm.transpose_operand(q)
        return one_kernel(both, w, spec, backends)

    from jetrl_cli.kernels import attention

    def kv_store(x, idx, data, scales, spec):  # the reference's bytes, written where the kernel writes them
        def store(x, idx):
            q = quant.quantize(x.reshape(-1, x.shape[-1]), spec)
            rows = q.data.view(torch.uint8), q.scale.reshape(-1)
            if idx is None:
                data.view(torch.uint8).copy_(rows[0])
                scales.copy_(rows[1])
            else:
                data.view(torch.uint8).index_copy_(0, idx, rows[0])
                scales.index_copy_(0, idx, rows[1])
            return rows
        traffic.kernel("kv_store (Triton)", store, x, idx)

    saved = [(mod, k, getattr(mod, k)) for mod in (gemm, linear) for k in ("cast_pair", "cast_weight_pair")]
    saved += [(attention, "kv_store", attention.kv_store), (llama, "kv_store_runs", llama.kv_store_runs)]
    for mod in (gemm, linear):
        mod.cast_pair, mod.cast_weight_pair = cast_pair, weight_pair
    attention.kv_store = kv_store
    llama.kv_store_runs = lambda t, spec: gemm.native(t) and spec.format.is_fp8 and spec.block.name == "row"
    try:
        names = {"swiglu": "quantize (Triton)", "weight": "quantize (Triton)",
                 "norm": "fused add_rms_norm + quantize (Triton)"}
        with tsm.fused_quantizers(lambda kind, fn, *tensors: traffic.kernel(names[kind], fn, *tensors)):
            yield
    finally:
        for mod, k, fn in saved:
            setattr(mod, k, fn)


def _fields(x):
    """A QTensor's data and scale (its tensors), anything else as it is."""
    return (x.data, x.scale) if isinstance(x, QTensor) else x


def _category(name: str) -> str:
    if name.startswith("fused "):
        return "fused chains"
    if name.startswith("quantize"):
        return "8-bit quantizers"
    if name in _GEMMS:
        return "GEMMs"
    if "attention" in name:
        return "attention"
    if name.startswith("_fused_adam") or name.startswith("_foreach"):
        return "optimizer, clipping"
    if name in ("_to_copy", "copy_", "clone", "contiguous", "cat", "stack", "index_put_", "index_put", "index_add_",
                "index_select", "gather", "scatter", "constant_pad_nd", "new_zeros", "zeros_like", "fill_", "zero_",
                "empty", "empty_strided", "empty_like", "new_empty_strided", "full", "scalar_tensor"):
        return "copies, casts, fills, gathers"
    return "other elementwise, reductions"


@contextlib.contextmanager
def foreach_as_on_cuda():
    """Gradient norms and clipping through the ``_foreach`` kernels, as torch runs them on CUDA (it
    takes the per-tensor loop for fake tensors, a tensor subclass)."""
    plain = clip_grad._has_foreach_support
    clip_grad._has_foreach_support = lambda tensors, device: True
    try:
        yield
    finally:
        clip_grad._has_foreach_support = plain


def measure(traffic: Traffic, fuse_chains: bool):
    def run(step, *external, where: bool = False) -> dict:
        with triton_pairs(traffic):  # the first update creates AdamW's states
            step()
        traffic.ops.clear()
        with as_kernels(traffic, fuse_chains), triton_pairs(traffic), foreach_as_on_cuda(), traffic:
            step()
        return summarize(traffic.ops)
    return run


def summarize(ops: dict, top: int = 0) -> dict:
    cats: dict[str, list] = {}
    for name, (n, r, w, f) in ops.items():
        c = cats.setdefault(_category(name), [0, 0, 0, 0])
        for i, v in enumerate((n, r, w, f)):
            c[i] += v
    total = [sum(c[i] for c in cats.values()) for i in range(4)]
    row = lambda c: {"launches": c[0], "read_gb": round(c[1] / GB, 2), "written_gb": round(c[2] / GB, 2),  # noqa: E731
                     "tflop": round(c[3] / 1e12, 2)}
    out = {"total": row(total), "by_category": {k: row(v) for k, v in sorted(cats.items())}}
    out["ops"] = {k: row(v) for k, v in sorted(ops.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))}
    return out


def decode_step(make, flow, batch: int, width: int, traffic: Traffic) -> dict:
    """One decode step of the embedded rollout engine: ``batch`` sequences, half of ``width`` keys
    already in the cache, eager (a CUDA graph replays the same kernels)."""
    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.engine.embedded import EmbeddedEngine

    model = make(torch.device("cpu"))
    eng = EmbeddedEngine(model, flow, width, max_batch=batch, cuda_graphs=False)
    eng.load_weights(make_payload(model, flow))
    m = eng.model
    cache = m.new_cache(batch, width)
    ids = torch.randint(1, m.config.vocab_size, (batch, width // 2), generator=torch.Generator().manual_seed(0))
    tokens = ids[:, -1]
    with torch.inference_mode():
        m.prefill(ids, torch.full((batch,), width // 2), cache)
        m.decode(tokens, cache, width)  # the first step decides how attention reads the cache
        traffic.ops.clear()
        with as_kernels(traffic, True), triton_pairs(traffic), traffic:
            m.decode(tokens, cache, width)
    out = summarize(traffic.ops)
    out["kv_cache_gb"] = round(cache.nbytes_per_token() * batch * width / GB, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tsm.model_arguments(ap, batch=4, seq=256)
    ap.add_argument("--flows", default="bf16,fp8-unified", help="comma-separated jetrl flows")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers row")
    ap.add_argument("--no-fuse", action="store_true", help="count jetrl's fused chains op by op")
    ap.add_argument("--top", type=int, default=15, help="ops listed per row, by bytes moved")
    ap.add_argument("--quantizers-by-shape", action="store_true",
                    help="an 8-bit quantizer's launches counted apart per input shape and dtype")
    ap.add_argument("--decode", action="store_true",
                    help="count one rollout decode step instead (--batch sequences, --seq cache width)")
    args = ap.parse_args()
    make, label, batch, adv, mode = tsm.counted_setup(args, fake=True)
    traffic = Traffic()
    traffic.by_shape = args.quantizers_by_shape
    out = {"model": label, "batch": args.batch, "seq": args.seq, "micro_batch": args.micro_batch or args.batch,
           "rows": {}}
    with mode, tsm._hopper_scaled_mm():
        for name in args.flows.split(",") if args.decode else ():
            out["rows"][f"jetrl {name} decode step"] = decode_step(make, tsm._flow(name, True), args.batch, args.seq,
                                                                   traffic)
        for name in args.flows.split(",") if not args.decode else ():
            out["rows"][f"jetrl {name}"] = tsm.jetrl_peak(make, tsm._flow(name, True), batch, adv, args.seq, True,
                                                          False, measure=measure(traffic, not args.no_fuse),
                                                          micro_batch=args.micro_batch)
        if not args.no_transformers and not args.decode:
            out["rows"]["transformers"] = tsm.transformers_peak(make, batch, adv, False, mode.building,
                                                                measure=measure(traffic, False),
                                                                micro_batch=args.micro_batch)
    for r in out["rows"].values():
        r["ops"] = dict(list(r["ops"].items())[:args.top])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
