"""jetrl's GPU code paths run on *fake* CUDA tensors, on a machine without a GPU.

Run as a script (``python tests/fake_cuda.py``; it patches ``torch.cuda``, so never import it into
a test process): prints one JSON object. It needs a CUDA build of torch (the GPU machines' torch
2.11+cu130, say), no GPU and no driver.

``FakeCuda`` is a dispatch mode in which CPU tensors stay real and CUDA tensors are torch's
``FakeTensor``s: shapes, dtypes, strides and devices are propagated by torch's own meta kernels
(``scaled_mm``'s layout checks and SDPA included; ``_int_mm``'s CUDA-only rule of more than 16
rows added here), but nothing is computed. So this checks what a CPU run of the same code cannot:
that the code placed every tensor on the device it meant to (a CPU tensor meeting CUDA ones in an
op raises, as on CUDA), and where the host reads device values -- ``.item()``, ``.tolist()``,
``.cpu()``, ``nonzero`` -- which on a GPU are synchronisations that stall the launch queue. Each
such read is recorded with the jetrl source line that asked for it, and answered with made-up
values (bools: every ``bool_every``-th True; ints: ``ints`` queued, then ``fill``; floats
``real``), which keeps data-dependent control flow going (rows stop, batches compact) without
meaning anything.

The backward runs too, though autograd's engine wants a real CUDA context: ``loss.backward()`` is
``py_autograd.backward`` here, which calls the graph's nodes from Python (checked against the
engine by ``tests/test_py_autograd.py``). What cannot run: CUDA graph capture and Triton kernels
(they need real memory): the quantizers' and the FP8 KV cache's kernels are stood in (``_NoLaunch``:
their wrappers run and allocate their outputs on the device, the launch is counted), so the paths
that take them are checked up to the kernel. The scenarios: the engine's decoding and the trainer's forward and update
through the ``scaled_mm``, ``emulated`` and torch backends; ``jetrl bench train`` and ``bench
rollout --device cuda`` at the 1.5B shape cut to one layer; ``jetrl run PRESET --set
model.device=cuda`` for two steps, the tiny presets (``fp8-unified`` also with a KL penalty, and with
LoRA) and the ``gpu-*`` ones (on a small Hugging Face model directory written here).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
import traceback
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import py_autograd  # noqa: E402 - beside this script

SOURCES = tuple(os.path.join(ROOT, d) + os.sep for d in ("jetrl_cli", "kernels"))
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


def _pretend_hopper() -> None:
    """What a Hopper machine's torch.cuda answers, without initialising CUDA."""
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda._lazy_init = lambda: None
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # page-locking is the driver's: nothing to fake
    torch._C._ensureCUDADeviceGuardSet()
    torch._C._set_only_lift_cpu_tensors(True)


def _site() -> str:
    for fr in reversed(traceback.extract_stack()):
        if fr.filename.startswith(SOURCES):
            return f"{os.path.relpath(fr.filename, ROOT)}:{fr.lineno} {(fr.line or '').strip()}"
    return "?"


class FakeCuda(TorchDispatchMode):
    def __init__(self, fill: int = 1, bool_every: int = 5, real: float = 0.5):
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.fill, self.bool_every, self.real = fill, bool_every, real
        self.ints: list[int] = []
        self.reads: dict[str, int] = {}  # source line -> host reads of device values
        self.blocking_h2d: dict[str, int] = {}  # source line -> blocking host-to-device copies
        self.capturing = False  # a CUDA graph capture under way (``HostOnlyGraphs``)
        self.in_capture: dict[str, int] = {}  # source line -> host reads and host-to-device copies within one
        self._bools = 0

    def _read(self) -> None:
        s = _site()
        self.reads[s] = self.reads.get(s, 0) + 1
        if self.capturing:
            self.in_capture["read " + s] = self.in_capture.get("read " + s, 0) + 1

    def _made_up(self, shape, dtype) -> torch.Tensor:
        if dtype is torch.bool:
            self._bools += 1
            return torch.full(shape, self._bools % self.bool_every == 0, dtype=dtype)
        if dtype.is_floating_point:
            return torch.full(shape, self.real, dtype=dtype)
        return torch.full(shape, self.ints.pop(0) if self.ints else self.fill, dtype=dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        fake_in = any(isinstance(t, FakeTensor) for t in leaves)
        dev = kwargs.get("device")
        if not fake_in and not (dev is not None and torch.device(dev).type == "cuda"):
            return func(*args, **kwargs)  # host work: real
        if func is torch.ops.aten._int_mm.default and args[0].shape[0] <= 16:  # CUDA's rule; not in the meta kernel
            raise RuntimeError(f"self.size(0) needs to be greater than 16, but got {args[0].shape[0]}")
        if func is torch.ops.aten.addmm.dtype_out:  # fake mode's kernel for it is broken (takes out_dtype as beta)
            return _addmm_dtype_out(*args, **kwargs)
        if func in _READS:
            self._read()
            return self._made_up((), args[0].dtype).item()
        if func is torch.ops.aten.copy_.default and not isinstance(args[0], FakeTensor):
            self._read()
            return args[0].copy_(self._made_up(args[1].shape, args[1].dtype))
        if func is torch.ops.aten.nonzero.default:
            self._read()
            return self._made_up(args[0].shape, torch.bool).nonzero().to("cuda")
        copying = func in _COPIES or str(func).startswith("aten.to.")
        if copying and _host_to_device(func, args, kwargs):
            if not kwargs.get("non_blocking"):
                s = _site()  # a blocking copy from the host waits for the stream's queued work
                self.blocking_h2d[s] = self.blocking_h2d.get(s, 0) + 1
            if self.capturing:  # a graph would copy from a host buffer at every replay, or refuse to
                s = "host-to-device " + _site()
                self.in_capture[s] = self.in_capture.get(s, 0) + 1

        def lift(x):  # not as constants: the fake mode would run ops on constants for real, on CUDA
            return self.fake.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x

        args, kwargs = pytree.tree_map(lift, (args, kwargs))
        with self.fake:
            out = func(*args, **kwargs)
        if copying and isinstance(out, FakeTensor) and out.device.type == "cpu":  # device to host
            self._read()
            return self._made_up(out.shape, out.dtype)
        return out


def _addmm_dtype_out(self_, mat1, mat2, out_dtype, *, beta=1, alpha=1, out):
    """CUDA's ``addmm.dtype_out`` as torch 2.11 has it: its checks (``_addmm_dtype_out_cuda``: fp16/bf16
    operands may write fp32, ``self`` in the output's dtype or the operands'), then one GEMM into
    ``out`` -- an update in place, nothing allocated."""
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.shape[1] != mat2.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({tuple(mat1.shape)} and {tuple(mat2.shape)})")
    if mat1.dtype != mat2.dtype:
        raise RuntimeError(f"mat1 and mat2 must have the same dtype, but got {mat1.dtype} and {mat2.dtype}")
    if out_dtype != mat1.dtype and not (out_dtype == torch.float32 and mat1.dtype in (torch.float16, torch.bfloat16)):
        raise RuntimeError("out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs")
    if out.dtype != out_dtype:
        raise RuntimeError("out_dtype must be the same as the dtype of the provided out tensor")
    if self_.dtype not in (out_dtype, mat1.dtype):
        raise RuntimeError("self dtype must match either out_dtype or mat1 dtype")
    if tuple(out.shape) != (mat1.shape[0], mat2.shape[1]) or torch.broadcast_shapes(self_.shape, out.shape) != out.shape:
        raise RuntimeError(f"addmm: out {tuple(out.shape)}, self {tuple(self_.shape)} for a "
                           f"{mat1.shape[0]} x {mat2.shape[1]} product")
    return out


def _host_to_device(func, args, kwargs) -> bool:
    """A copy of a real host tensor to CUDA (``x.to("cuda")`` or ``cuda_tensor.copy_(x)``)."""
    if func is torch.ops.aten.copy_.default:
        return isinstance(args[0], FakeTensor) and not isinstance(args[1], FakeTensor) and args[1].device.type == "cpu"
    src = args[0] if args else None
    dev = kwargs.get("device")
    return (isinstance(src, torch.Tensor) and not isinstance(src, FakeTensor) and src.device.type == "cpu"
            and dev is not None and torch.device(dev).type == "cuda")


# --------------------------------------------------------------------------- scenarios

FLOWS = {  # name -> (base flow, backend of the 8-bit GEMMs or None, rollout KV cache or None[, batch-invariant])
    "bf16": ("bf16", None, None),
    "fp8-rollout": ("fp8-rollout", "scaled_mm", None),
    "int8-rollout": ("int8-rollout", "scaled_mm", None),
    "fp8-unified": ("fp8-unified", "scaled_mm", "fp8_e4m3 row"),
    "fp8-unified-emulated": ("fp8-unified", "emulated", None),
    "bf16+invariant": ("bf16", None, None, True),
    "fp8-unified+invariant": ("fp8-unified", None, None, True),
}
NEW_TOKENS = 24


def _flow(name: str):
    from jetrl_cli.precision import parse_flow

    base, backend, kv, *invariant = FLOWS[name]
    over: dict = {"batch_invariant": True} if invariant else {}
    if backend:  # on the 8-bit GEMMs (a bf16 GEMM has no 8-bit backend: the flow refuses one)
        f = parse_flow(base)
        gemms = {"fprop": f.train.linear.fprop, "dgrad": f.train.linear.dgrad, "wgrad": f.train.linear.wgrad}
        over = {"rollout": {"linear": {"backend": backend}},
                "train": {g: {"backend": backend} for g, spec in gemms.items() if spec.a.is_scaled}}
    if kv:
        over.setdefault("rollout", {})["kv_cache"] = kv
    return parse_flow({"base": base, **over})


def _model():
    from jetrl_cli.models.shapes import random_model
    from jetrl_cli.models.tiny import tiny_config

    return random_model(tiny_config("qwen2", hidden=256, layers=2, vocab=512), seed=0, std=0.05)


def _rollout(name: str) -> dict:
    from jetrl_cli.engine.base import make_payload
    from jetrl_cli.engine.embedded import EmbeddedEngine
    from jetrl_cli.engine.sampling import SamplingParams

    flow, model = _flow(name), _model()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(n=2, max_new_tokens=NEW_TOKENS, temperature=1.0, stop_token_ids=(2,))
    mode = FakeCuda()
    with mode:
        model = model.to("cuda")
        eng = EmbeddedEngine(model, flow, width=64, cuda_graphs=False)
        sync_reads = dict(mode.reads)
        for version in (1, 2):  # the trainer's weights arrive twice: the second sync writes in place
            eng.load_weights(make_payload(model, flow, version))
        load_reads = {k: v - sync_reads.get(k, 0) for k, v in mode.reads.items() if v != sync_reads.get(k, 0)}
        before = dict(mode.reads)
        out = eng.generate(prompts, params, seed=3)
    return {"completions": [len(g) for g in out], "check_every": eng.check_every, "rows": len(prompts) * params.n,
            "load_reads": load_reads,
            "generate_reads": {k: v - before.get(k, 0) for k, v in mode.reads.items() if v != before.get(k, 0)}}


def _train_forward(name: str) -> dict:
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.rl.algos import CorrectionConfig, importance, policy_loss
    from jetrl_cli.rl.trainer import Batch, host_values, score_logprobs, token_logprobs
    from jetrl_cli.precision import apply_flow

    flow, model = _flow(name), _model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 512, (3, 160), generator=g)
    b = Batch.build(ids[:, :32].tolist(), ids[:, 32:].tolist(), [[0.0] * 128] * 3, [0.0] * 3, list(range(3)))
    mode = FakeCuda()
    with mode:
        model = model.to("cuda").train()
        apply_flow(model, flow, "train")
        old = score_logprobs(model, b, SamplingParams(), micro_batch=2, width=160)
        score_reads = dict(mode.reads)
        m = b.mask.to("cuda")
        o, r = old.to("cuda"), b.rollout_logp.to("cuda")
        imp = importance(o, r, m, CorrectionConfig(type="tis"), 0.28, with_metrics=False)
        lp = token_logprobs(model, b, SamplingParams())
        loss, st = policy_loss(lp, o, torch.ones(3, device="cuda"), m, imp, 0.2, 0.28, 384.0)
        step_reads = {k: v - score_reads.get(k, 0) for k, v in mode.reads.items() if v != score_reads.get(k, 0)}
        values, _ = host_values([(loss.detach(), st)], torch.ones((), device="cuda"))
        final = {k: v - score_reads.get(k, 0) - step_reads.get(k, 0) for k, v in mode.reads.items()
                 if v != score_reads.get(k, 0) + step_reads.get(k, 0)}
    return {"logprobs": [list(lp.shape), str(lp.dtype), str(lp.device)], "score_reads": score_reads,
            "step_reads": step_reads, "host_values_reads": final, "stats": sorted(values[0][1])}


def _train_step(name: str) -> dict:
    """The trainer's whole update (``Trainer.update``: two mini-batches of two micro-batches each,
    forward, backward, gradient clipping, fused AdamW), the backward run by ``py_autograd``."""
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.rl.algos import CorrectionConfig
    from jetrl_cli.precision.gemm import kernel_choice
    from jetrl_cli.rl import trainer as trainer_mod
    from jetrl_cli.rl.trainer import Batch, Trainer

    from jetrl_cli.models import llama
    from jetrl_cli.precision import linear
    from jetrl_cli.rl import head_grad

    flow, model = _flow(name), _model()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 512, (8, 160), generator=g)
    sinks = []  # what the second micro-batches added their gradients into: linear groups, lm_head, embedding
    real_sink = linear.grad_sink

    def sink(weights):
        into = real_sink(weights)
        if into is not None:
            sinks.append(f"{len(weights)} x {into.device.type} {into.dtype}")
        return into

    for mod in (linear, head_grad, llama):
        mod.grad_sink = sink
    chunk, trainer_mod.LOGPROB_CHUNK_ELEMENTS = trainer_mod.LOGPROB_CHUNK_ELEMENTS, 128 * 512  # 2 logprob chunks
    b = Batch.build(ids[:, :32].tolist(), ids[:, 32:].tolist(), [[-1.0] * 128] * 8, [0.0] * 8,
                    [i // 2 for i in range(8)])
    try:
        mode = FakeCuda(bool_every=1)  # every check answers True: the parameters are finite
        with mode, py_autograd.recording():
            model = model.to("cuda")
            tr = Trainer(model, flow, TrainConfig(micro_batch=2, minibatches=2), CorrectionConfig(type="tis"),
                         SamplingParams(), width=160)
            old = tr.score(b)
            before, h2d = dict(mode.reads), dict(mode.blocking_h2d)
            stats = tr.update(b, torch.randn(8, generator=g), old, None, step=0)
            reads = {k: v - before.get(k, 0) for k, v in mode.reads.items() if v != before.get(k, 0)}
            h2d = {k: v - h2d.get(k, 0) for k, v in mode.blocking_h2d.items() if v != h2d.get(k, 0)}
            params = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
            state = [t for st in tr.opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    finally:
        trainer_mod.LOGPROB_CHUNK_ELEMENTS = chunk
        for mod in (linear, head_grad, llama):
            mod.grad_sink = real_sink
    return {"wgrad_sum": kernel_choice("wgrad sum", torch.device("cuda:0")), "update_reads": reads,
            "grads_in_place": collections.Counter(sinks),
            "update_blocking_h2d": h2d, "stats": sorted(stats), "updates": tr.updates,
            "no_grad": [n for n, p in params if p.grad is None],
            "grads": sorted({f"{p.grad.device.type} {p.grad.dtype} of {p.dtype}" for _, p in params if p.grad is not None}),
            "optimizer_state": sorted({f"{t.device.type} {t.dtype}" for t in state})}


class HostOnlyGraphs:
    """``rl.train_graphs``' capture API on fake CUDA tensors: a capture runs its function once, the stream
    reported capturing meanwhile (``mode.capturing``: a host read or a host-to-device copy there is
    noted, as each would break a real capture), and a replay runs nothing on the host, as a real one."""

    def __init__(self, mode: "FakeCuda | None" = None):
        self.mode, self.captures = mode, 0

    def prepare(self):
        pass

    def pool(self):
        return None

    def new_graph(self):
        return type("Graph", (), {"replay": lambda self: None})()

    def warmup(self, fn):
        return fn()

    def record(self, graph, pool, fn):
        from jetrl_cli.kernels import fp8

        self.captures += 1
        plain, fp8._stream_capturing = fp8._stream_capturing, lambda dev: True  # a new job table raises
        if self.mode is not None:
            self.mode.capturing = True
        try:
            return fn()
        finally:
            fp8._stream_capturing = plain
            if self.mode is not None:
                self.mode.capturing = False


def _train_graphs(name: str) -> dict:
    """``train.cuda_graphs``: the trainer's scoring and update (two mini-batches of two micro-batches),
    the layers captured through ``HostOnlyGraphs``; what the captures did on the host."""
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.rl.algos import CorrectionConfig
    from jetrl_cli.rl.train_graphs import TrunkGraphs
    from jetrl_cli.rl.trainer import Batch, Trainer

    flow, model = _flow(name), _model()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 512, (8, 160), generator=g)
    b = Batch.build(ids[:, :32].tolist(), ids[:, 32:].tolist(), [[-1.0] * 128] * 8, [0.0] * 8,
                    [i // 2 for i in range(8)])
    plain_backward, plain_equal = torch.autograd.backward, torch.equal
    # the captured backward has two roots (autograd's C++ engine wants a driver); the first replay is
    # compared with the warm-up (fake tensors hold no values)
    torch.autograd.backward = lambda tensors, grad_tensors=None, inputs=None, **kw: py_autograd.backward_all(
        tuple(tensors), tuple(grad_tensors))
    torch.equal = lambda a, b: True
    try:
        mode = FakeCuda(bool_every=1)
        api = HostOnlyGraphs(mode)
        with mode, py_autograd.recording():
            model = model.to("cuda")
            tr = Trainer(model, flow, TrainConfig(micro_batch=2, minibatches=2), CorrectionConfig(type="tis"),
                         SamplingParams(), width=160)
            tr.graphs = TrunkGraphs(tr.model, graph_api=api).install()
            stats = tr.update(b, torch.randn(8, generator=g), tr.score(b), None, step=0)
    finally:
        torch.autograd.backward, torch.equal = plain_backward, plain_equal
    return {"state": tr.graphs.report(), "captures": api.captures, "in_capture": mode.in_capture,
            "stats": sorted(stats), "first_replays": tr.graphs.first_replays}


def _decode_graphs(name: str) -> dict:
    """The engine's decode steps captured as CUDA graphs (``engine.graphs``) through ``HostOnlyGraphs``:
    what the captures did on the host (a read or a host-to-device copy there would break a real
    capture, and the engine would decode eagerly, host-bound)."""
    from jetrl_cli.engine.embedded import EmbeddedEngine
    from jetrl_cli.engine.graphs import DecodeGraphs
    from jetrl_cli.engine.sampling import SamplingParams

    flow, model = _flow(name), _model()
    params = SamplingParams(n=2, max_new_tokens=NEW_TOKENS, temperature=1.0, stop_token_ids=(2,))
    plain_equal = torch.equal
    torch.equal = lambda a, b: True  # a replay against the eager step: fake tensors hold no values
    try:
        mode = FakeCuda()
        api = HostOnlyGraphs(mode)
        with mode:
            eng = EmbeddedEngine(model.to("cuda"), flow, width=64)
            eng.graphs = DecodeGraphs(eng.model, graph_api=api)
            out = eng.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]], params, seed=3)
    finally:
        torch.equal = plain_equal
    return {"completions": [len(g) for g in out], "captures": api.captures, "disabled": eng.graphs.disabled,
            "in_capture": mode.in_capture}


class _Event:  # torch.cuda.Event's timing on the host clock (fake work takes host time only)
    def __init__(self, **kwargs):
        self.t = 0.0

    def record(self, *args) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_Event") -> float:
        return (end.t - self.t) * 1e3


@contextlib.contextmanager
def _pretend_bench():
    """What ``jetrl bench --device cuda`` asks of torch.cuda beyond ``_pretend_hopper``; a CUDA
    generator (it wants a driver) is a CPU one."""
    plain = torch.Generator

    class Generator(plain):
        def __new__(cls, device="cpu"):
            return plain.__new__(cls)

        def __init__(self, device="cpu"):
            super().__init__()

    fakes = {"Event": _Event, "get_device_name": lambda *a: "fake H100", "max_memory_allocated": lambda *a: 1 << 30,
             "max_memory_reserved": lambda *a: 1 << 31, "memory_allocated": lambda *a: 0,
             "reset_peak_memory_stats": lambda *a: None, "empty_cache": lambda *a: None,
             "memory_stats": lambda *a: {"num_alloc_retries": 0, "num_device_alloc": 0}}
    with contextlib.ExitStack() as stack:
        for name, fake in fakes.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, fake))
        stack.enter_context(mock.patch.object(torch, "Generator", Generator))
        yield


def _bench_train() -> dict:
    """``jetrl bench train --device cuda`` as ``.ci/gpu train`` runs it (flows bf16, fp8-rollout,
    fp8-unified, the transformers row; GEMM backends ``auto``), at the 1.5B shape cut to one layer.
    The probes' relative errors read as 0 (``real=0``), so a backend is rejected only for what it
    cannot run; Triton's kernels cannot run on fake tensors at all."""
    from jetrl_cli import bench

    mode = FakeCuda(bool_every=1, real=0.0)
    with _pretend_bench(), mode, py_autograd.recording():
        s = bench.Settings(device="cuda", repeats=1, warmup=1, model="qwen2.5-1.5b", layers=1, train_batch=2,
                           seq=256)
        rows = bench.run_bench(["train"], s)["results"]["train"]
    out = {}
    for r in rows:
        res = r.get("gemm_backends", {}).get("resolved", [])
        out[r["flow"]] = {"keys": sorted(r), "phases": sorted(r.get("peak_memory_by_phase", {})),
                          "resolved": {x["gemm"]: {"backend": x["backend"], "fallback_order": x["fallback_order"],
                                                   "rejected": x.get("rejected", {})} for x in res},
                          "fallbacks": r.get("gemm_backends", {}).get("fallbacks")}
    return out


def _bench_rollout() -> dict:
    """``jetrl bench rollout --device cuda`` for the bf16, FP8 and INT8 engines, the fixed batch and
    the task-shaped one, at the 1.5B shape cut to one layer. Without the transformers rows: its
    model's dtype conversion cannot run on fake tensors. Graph capture fails here, so the engines
    decode eagerly and say why."""
    from jetrl_cli import bench

    # import transformers fails: the rows users compare against are skipped
    with mock.patch.dict(sys.modules, {"transformers": None}), _pretend_bench(), FakeCuda(bool_every=3, real=0.0):
        s = bench.Settings(device="cuda", repeats=1, warmup=0, model="qwen2.5-1.5b", layers=1, batch=8,
                           new_tokens=24, flows=("bf16", "fp8-rollout", "int8-rollout"))
        rows = bench.run_bench(["rollout"], s)["results"]["rollout"]
    return {f"{r['workload'].split(' ')[0]} {r['flow']}": {"keys": sorted(r), "cuda_graphs": r.get("cuda_graphs")}
            for r in rows}


def _run_loop(preset: str, *overrides: str) -> dict:
    """``jetrl run presets/PRESET.yaml --set model.device=cuda`` for two steps (eval, rollout,
    scoring, update, weight sync), with torch's "is there a GPU" check and the checkpoint write
    (fake tensors cannot be pickled) stood in for."""
    import tempfile
    from pathlib import Path

    from jetrl_cli.config import load_job_config
    from jetrl_cli.rl import loop

    mode = FakeCuda(bool_every=1, real=0.0)
    with mock.patch.object(loop, "_device", lambda cfg: torch.device(cfg.model.device)), \
            mock.patch.object(loop, "save_checkpoint", lambda out, step, *a, **k: out / f"step-{step}"), \
            _pretend_bench(), mode, py_autograd.recording(), tempfile.TemporaryDirectory() as d:
        cfg = load_job_config(preset, ["model.device=cuda", "train.steps=2", "eval.prompts=1",
                                       "run.save_rollouts=false", *overrides])
        lines = list(loop.run(cfg, Path(d) / "run"))
    return {"steps": [m["step"] for m in lines], "keys": sorted(set().union(*(m for m in lines if m["step"] > 0))),
            "reads": mode.reads}


def _gpu_preset(preset: str) -> dict:
    """A ``gpu-*`` preset (a Hugging Face model directory, GSM8K-style JSONL, the preset's training
    settings at 2 prompts x 4 samples x 16 new tokens) through ``_run_loop``, on a model built here
    with the real model's traits that matter to the code: Qwen2 with tied embeddings, GQA, head_dim
    128, an MLP width of an odd number of 128-blocks. Needs transformers (to write the directory)."""
    import shutil
    import tempfile

    import transformers

    with tempfile.TemporaryDirectory() as d:
        cfg = transformers.Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                       max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=1,
                                       pad_token_id=0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(f"{d}/model")
        tiny = os.path.join(ROOT, "jetrl_cli", "assets", "tiny-policy")
        shutil.copy(os.path.join(tiny, "tokenizer.json"), f"{d}/model/tokenizer.json")
        with open(os.path.join(tiny, "tokenizer_config.json")) as f:
            tcfg = json.load(f)
        tcfg["chat_template"] = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}assistant:{% endif %}")  # the presets' chat_template: true
        with open(f"{d}/model/tokenizer_config.json", "w") as f:
            json.dump(tcfg, f)
        with open(f"{d}/gsm8k.jsonl", "w") as f:
            for i in range(8):
                f.write(json.dumps({"question": f"What is {i} + 7?", "answer": f"{i} + 7 = {i + 7}\n#### {i + 7}"}) + "\n")
        return _run_loop(preset, f"model.path={d}/model", f"task.file={d}/gsm8k.jsonl",
                         f"task.eval_file={d}/gsm8k.jsonl", "rollout.prompts_per_step=2", "rollout.n=4",
                         "rollout.max_new_tokens=16")


def _control() -> dict:
    """The detectors on code that does wrong on purpose: a CPU tensor in a CUDA op, a host read, a
    blocking host-to-device copy (and one that does not block)."""
    mode, mixed = FakeCuda(), None
    with mode:
        x = torch.ones(4, device="cuda")
        float(x.sum())
        try:
            x + torch.ones(4)
        except RuntimeError as e:
            mixed = str(e)
        torch.arange(3).to("cuda")
        torch.arange(3).to("cuda", non_blocking=True)
    return {"reads": sum(mode.reads.values()), "mixed": mixed, "blocking_h2d": sum(mode.blocking_h2d.values())}


class _NoLaunch:
    """A Triton kernel's launch, stood in: the wrapper around it runs (argument checks, outputs
    allocated on the device), the kernel itself does not -- Triton cannot run on fake tensors.
    Counts the launches, so a scenario shows that its path reached the kernel."""

    def __init__(self, name: str, counts: dict):
        self.name, self.counts = name, counts

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return launch


def main() -> int:
    if not torch.backends.cuda.is_built():
        print(json.dumps({"unsupported": f"this torch ({torch.__version__}) is not built with CUDA"}))
        return 0
    _pretend_hopper()
    report: dict = {"torch": torch.__version__, "control": _control(), "rollout": {}, "train_forward": {}, "train_step": {},
                    "failures": {}}
    torch.Tensor.backward = py_autograd.backward  # autograd's C++ engine wants a CUDA context
    from jetrl_cli.precision import fuse

    fuse.set_enabled(False)  # compiled code cannot run on fake tensors: the op-by-op path is checked
    from jetrl_cli.kernels import attention

    report["triton_launches"] = {}
    attention._decode_kernel = _NoLaunch("decode_attention", report["triton_launches"])  # FP8 KV-cache decode
    attention._kv_store_kernel = _NoLaunch("kv_store", report["triton_launches"])
    from jetrl_cli.kernels import sampling

    sampling._keyed_gumbel_argmax_kernel = _NoLaunch("keyed_gumbel_argmax", report["triton_launches"])  # decoding
    import jetrl_cli.kernels as kernels_pkg
    from jetrl_cli.kernels import fp8, int8, invariant

    kernels_pkg.unavailable_reason = lambda: None  # Triton "runs" where a fake GPU is: the quantizers'
    for mod, name in ((fp8, "_act_quant_kernel"), (fp8, "_weight_quant_kernel"), (fp8, "_swiglu_quant_kernel"),
                      (fp8, "_swiglu_quant_t_kernel"), (fp8, "_swiglu_grad_quant_kernel"), (fp8, "_rms_norm_quant_kernel"),
                      (fp8, "_swiglu_grad_rows_kernel"), (fp8, "_swiglu_grad_cols_kernel"),
                      (int8, "_row_quant_kernel"),
                      (int8, "_rms_norm_rows_kernel"), (int8, "_swiglu_rows_kernel"),
                      *((invariant, k) for k in ("_mm_kernel", "_fp8_mm_kernel", "_chunk_sum_kernel", "_attention_kernel",
                                                 "_rms_norm_kernel", "_lse_part_kernel", "_lse_apply_kernel",
                                                 "_rope_kernel", "_silu_mul_kernel"))):
        setattr(mod, name, _NoLaunch(name, report["triton_launches"]))  # wrappers run, on the device
    for name in ("quantize_weight_stack", "quantize_weight_stacks"):  # FP8 group weights, into their stacks
        def counted(*args, _fn=getattr(fp8, name), _name=name, **kwargs):
            report["triton_launches"][_name] = report["triton_launches"].get(_name, 0) + 1
            return _fn(*args, **kwargs)

        setattr(fp8, name, counted)

    def attempt(where: dict, key, name: str, fn, *args) -> None:  # a failure is reported: the test fails on it
        try:
            where[key] = fn(*args)
        except Exception as e:  # noqa: BLE001
            report["failures"][name] = "".join(traceback.format_exception(e))[-3000:]

    for name in FLOWS:
        for part, fn in (("rollout", _rollout), ("train_forward", _train_forward), ("train_step", _train_step)):
            if part == "train_step" and len(FLOWS[name]) > 3:
                continue  # the invariant attention's backward calls autograd's C++ engine (no CUDA context here)
            attempt(report[part], name, f"{part} {name}", fn, name)
    report["decode_graphs"] = {}
    for name in FLOWS:
        attempt(report["decode_graphs"], name, f"decode_graphs {name}", _decode_graphs, name)
    report["train_graphs"] = {}
    for name in ("bf16", "fp8-unified"):
        attempt(report["train_graphs"], name, f"train_graphs {name}", _train_graphs, name)
    report["run"] = {}
    for preset in ("fp8-unified", "bf16", "int8-rollout-tis"):
        attempt(report["run"], preset, f"run {preset}", _run_loop, preset)
    # with a KL penalty: a frozen reference policy holding its forward weights only
    attempt(report["run"], "fp8-unified+kl", "run fp8-unified+kl", _run_loop, "fp8-unified", "train.kl_coef=0.01")
    # LoRA: adapters beside the FP8 layers, syncs of the adapters alone, the base model as the KL reference
    attempt(report["run"], "fp8-unified+lora", "run fp8-unified+lora", _run_loop, "fp8-unified", "model.lora_rank=8",
            "train.kl_coef=0.01")
    for preset in ("gpu-qwen2.5-1.5b-gsm8k-fp8-unified", "gpu-qwen2.5-1.5b-gsm8k-fp8-rollout-tis"):
        attempt(report["run"], preset, f"run {preset}", _gpu_preset, preset)
    for part, fn in (("bench_train", _bench_train), ("bench_rollout", _bench_rollout)):
        attempt(report, part, part, fn)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
