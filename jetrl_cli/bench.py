"""``jetrl bench``: throughput of every flow next to its BF16 baseline, measured in one process.

Modes:

- ``gemm``: ``a @ b.T`` per GEMM variant (format x granularity x backend) on real models' linear
  shapes; time, TFLOP/s, ratio to BF16, and in the same row the accuracy against float64 of the
  unquantized operands (quantization error) and against the emulated reference on the same
  quantized operands (kernel error: a broken backend fails this, not the first).
- ``quantize``: each quantizer's bandwidth next to a plain copy of the same bytes.
- ``attention``: one decode step's attention over a KV cache (the model's heads, batch x key width):
  a bf16 cache through SDPA (the engine's bf16 path), an FP8 cache dequantized then SDPA (its
  fallback), an FP8 cache read as stored by ``kernels.attention`` (its GPU path), and the
  batch-invariant kernel over either; time, the cache's bytes per second, and the error against
  float64 attention over the values each variant reads.
- ``rollout``: tokens/s of the embedded engine per flow, and ``transformers`` ``generate()`` on the
  same model and batch when transformers is installed.
- ``train``: one GRPO update (forward, backward, AdamW) per flow: step time, tokens/s, the bytes of
  activations saved for backward, and on CUDA the peak memory.
- ``e2e``: a few ``jetrl run`` steps per flow with the time split rollout / score / train / sync.

Method: warm-up, then ``repeats`` timed runs; the median and the spread (max - min). Engines
compared on one rollout workload are timed in turn (``measure_interleaved``). CUDA timings use
device events after a synchronize. Inputs are fresh random tensors (never zeros). On CPU every
FP8/INT8 path is emulated in fp32 and BF16 is emulated too (bf16-rounded operands, fp32 matmul):
those rows are labelled ``emulated`` and their ratios are not speed-ups of FP8 hardware.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cuda_memory
from .errors import JetrlError, is_out_of_memory
from .precision.gemm import ROW_TIERS

MODES = ("gemm", "quantize", "attention", "rollout", "train", "e2e")
DEFAULT_FLOWS = ("bf16", "fp8-rollout", "fp8-unified")

# (model, layer, N, K) for the linear layers of two real 7-8B models.
MODEL_SHAPES = (
    ("llama-3-8b", "qkv_proj", 6144, 4096),
    ("llama-3-8b", "o_proj", 4096, 4096),
    ("llama-3-8b", "gate_up_proj", 28672, 4096),
    ("llama-3-8b", "down_proj", 4096, 14336),
    ("qwen2.5-7b", "qkv_proj", 4608, 3584),
    ("qwen2.5-7b", "o_proj", 3584, 3584),
    ("qwen2.5-7b", "gate_up_proj", 37888, 3584),
    ("qwen2.5-7b", "down_proj", 3584, 18944),
)
# A rollout's decode steps multiply a few rows by the whole weight: the 1.5B model's layers at the
# batch sizes a rollout decodes at (bench gemm on a GPU; `auto` times its candidates at these row
# counts too and picks per tier: precision.gemm.ROW_TIERS)
DECODE_SHAPES = (
    ("qwen2.5-1.5b", "qkv_proj", 2048, 1536),
    ("qwen2.5-1.5b", "o_proj", 1536, 1536),
    ("qwen2.5-1.5b", "gate_up_proj", 17920, 1536),
    ("qwen2.5-1.5b", "down_proj", 1536, 8960),
)
DECODE_ROWS = ROW_TIERS["fprop"]
# A decode step's attention: (sequences, key width) -- RL batches at 1K and 4K contexts, and a small batch
ATTENTION_SHAPES = ((64, 1024), (256, 1024), (64, 4096), (8, 4096))
# relative error (norm) of a decode attention against float64 over the values it reads: bf16 output
# rounding is ~2^-9 per element, ~2e-3 in norm; an error of 1% is a wrong kernel
ATTENTION_TOLERANCE = 1e-2
# Targets from the project brief, reported against (never asserted in tests).
CPU_TARGETS = {"train_fp8_vs_bf16_step": 1.5, "rollout_vs_generate": 2.0}
GPU_TARGETS = {  # the GPU issues' targets (docs/benchmarks.md), checked on CUDA rows only
    "gemm_blockwise_vs_bf16": 1.5,  # Fprop/Dgrad 1x128 x 128x128 at M=4096 on 7-8B layer shapes, worst shape
    "gemm_wgrad_vs_bf16": 1.2,  # 1x128 x 1x128, same shapes
    "quantize_vs_copy": 0.8,  # every Triton quantizer
    "bf16_step_vs_transformers": 1.0,  # jetrl bf16 train step, and its peak memory, <= the transformers row
    "train_speedup_7b": 1.3,  # fp8-unified step vs bf16 at Llama-3-8B / Qwen2.5-7B layer shapes
    "train_speedup": 1.15,  # ... at smaller shapes (Qwen2.5-1.5B)
    "rollout_bf16_vs_static_generate": 1.0,  # embedded bf16 vs transformers static-cache generate()
    "rollout_fp8_vs_bf16": 1.3,  # embedded fp8-rollout vs embedded bf16
    "rollout_int8_vs_bf16": 1.2,  # embedded int8-rollout vs embedded bf16
    "sync_frac": 0.02,  # weight sync share of an RL step (e2e)
    "invariant_cost": 1.25,  # batch-invariant mode: <= 25% slower rollout and training step
}
KERNEL_TOLERANCE = 1e-3  # relative error of a backend against the emulated GEMM on the same operands


@dataclass
class Settings:
    device: str = "cpu"
    repeats: int = 5
    warmup: int = 1
    flows: tuple[str, ...] = DEFAULT_FLOWS
    gemm_shapes: list[tuple[str, int, int, int]] = field(default_factory=list)  # (label, M, N, K)
    quant_shapes: list[tuple[int, int]] = field(default_factory=list)
    attention_shapes: list[tuple[int, int]] = field(default_factory=list)  # (batch, key width)
    model: str = "tiny"  # "tiny", a HF model directory, or a shape name (models/shapes.py: random weights)
    layers: int | None = None  # keep the first N decoder layers (7-8B layer shapes on one GPU)
    batch: int = 64
    prompt: int = 16
    new_tokens: int = 64
    train_batch: int = 16
    micro_batch: int | None = None  # train: sequences per forward/backward (None: the whole batch)
    seq: int = 64
    e2e_steps: int = 3
    task_preset: str | None = "fp8-unified"  # rollout: also an RL-shaped batch from this preset's task
    task_overrides: list[str] = field(default_factory=list)  # key=value for that preset (its batch shape)
    profile_dir: str | None = None  # rollout/train: one more run of each row under torch.profiler
    transformers: bool = True  # rollout/train: also time the transformers baseline rows (when installed)
    cuda_graphs: bool = True  # rollout: the embedded engines replay decode steps as CUDA graphs (GPU)
    quant_warps: tuple[int, ...] = ()  # quantize: time the 128x128-tile Triton kernels at each (default: theirs)
    not_run: dict[str, str] = field(default_factory=dict)  # mode -> why ``all`` left it out
    progress: object = None
    partial_out: Path | None = None  # --out: rows written there as each finishes (a run cut short keeps them)
    rows_done: object = None  # set by run_bench: (mode, rows so far) -> None

    def say(self, msg: str) -> None:
        if self.progress:
            self.progress(msg)

    def done(self, mode: str, rows: list[dict]) -> None:
        """``rows`` of ``mode`` so far, each finished: written to ``partial_out`` (``"partial": true``)."""
        if self.rows_done:
            self.rows_done(mode, rows)


# --------------------------------------------------------------------------- parsing


def parse_modes(mode: str) -> list[str]:
    if mode == "all":
        return list(MODES)
    if mode not in MODES:
        raise JetrlError(f"unknown bench mode {mode!r} (allowed: {', '.join(MODES)}, all)")
    return [mode]


def parse_shapes(text: str, dims: int, want: str | None = None) -> list[tuple[int, ...]]:
    """``"MxNxK,..."`` (gemm, dims=3), ``"MxK,..."`` (quantize, dims=2) or ``want``'s form."""
    want = want or "x".join("MNK" if dims == 3 else "MK")
    example = {"MxNxK": "4096x4096x4096", "MxK": "4096x4096"}.get(want, "x".join(["64", "1024", "128"][:dims]))
    out = []
    for part in text.split(","):
        bits = part.strip().lower().split("x")
        try:
            vals = tuple(int(b) for b in bits)
        except ValueError:
            vals = ()
        if len(vals) != dims or any(v <= 0 for v in vals):
            raise JetrlError(f"--shapes: {part.strip()!r} is not {want} with positive integers (e.g. {example})")
        out.append(vals)
    return out


def parse_warps(text: str) -> tuple[int, ...]:
    """``--warps 8,16``: warp counts for the 128x128-tile quantizers."""
    out = []
    for part in text.split(","):
        if part.strip() not in ("4", "8", "16", "32"):
            raise JetrlError(f"--warps: {part.strip()!r} is not a warp count (allowed 4, 8, 16, 32, comma-separated)")
        out.append(int(part))
    return tuple(dict.fromkeys(out))


def check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise JetrlError(f"--device {device!r}: allowed cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise JetrlError("--device cuda: torch sees no CUDA device (this build: "
                         f"torch {torch.__version__}); use --device cpu")


# --------------------------------------------------------------------------- timing


def _timed(fn, cuda: bool):
    """(seconds, result) of one call: CUDA events after a synchronize, else the wall clock."""
    if cuda:
        return _timed_calls(fn, 1)
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _stats(ts: list[float]) -> dict:
    return {"s": statistics.median(ts), "spread_s": max(ts) - min(ts), "repeats": len(ts)}


TIMED_S = 0.02  # on a GPU: a timed run of a short call repeats it back to back for at least this long
MAX_CALLS = 100


def _timed_calls(fn, n: int) -> tuple[float, object]:
    """(seconds per call, the last call's result) of ``n`` back-to-back calls between two CUDA events
    (after a synchronize)."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        out = fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / n, out


def measure(fn, s: Settings) -> dict:
    """Median and spread of ``fn()`` over ``s.repeats`` runs after ``s.warmup`` warm-up runs.

    On a GPU a run of a call shorter than ``TIMED_S`` is that many calls back to back (at most
    ``MAX_CALLS``), per call: one call between two events also times the host's launch of it while
    the GPU waits (likely why the first H100 run's blockwise FP8 GEMMs at M = 4096 came out at 0.4x
    of a bare ``_scaled_mm`` timed with ``do_bench``); back to back, the host enqueues while the GPU
    runs, as in a training step, and a call whose host work outlasts its kernels still shows that.
    ``calls`` in the result says how many."""
    for _ in range(s.warmup):
        fn()
    if s.device != "cuda":
        return _stats([_timed(fn, False)[0] for _ in range(s.repeats)])
    one = _timed_calls(fn, 1)[0]
    n = max(1, min(MAX_CALLS, int(TIMED_S / max(one, 1e-9))))
    return {**_stats([_timed_calls(fn, n)[0] for _ in range(s.repeats)]), "calls": n}


PROFILE_ROWS = 40  # ops in a profile's table


def profile_once(fn, s: Settings, name: str) -> dict:
    """With ``s.profile_dir``: one more ``fn()`` under ``torch.profiler``, its ops by self time (device
    time on a GPU, host time on CPU) written to ``DIR/NAME.txt``; returns the row's ``profile`` (that
    path) and, on a GPU, ``device_kernels``: the kernels the run launched (a decode step's count is
    what CUDA graphs and fusion are about). Without it: nothing."""
    if not s.profile_dir:
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = s.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ops = prof.key_averages()
    table = ops.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=PROFILE_ROWS)
    out = {"profile": os.path.join(s.profile_dir, _file_name(name) + ".txt")}
    text = f"{name}: one run under torch.profiler ({s.device})\n{table}\n"
    if cuda:
        out["device_kernels"] = sum(e.count for e in ops if e.device_type == DeviceType.CUDA)
        # is the run host-bound? the kernels' summed time against the run's wall time (both under the
        # profiler, which adds host time of its own), and where the host's time went
        out["profile_wall_s"] = wall
        out["profile_kernel_s"] = sum(e.self_device_time_total for e in ops if e.device_type == DeviceType.CUDA) / 1e6
        # the kernels' time by what they do (GEMMs, quantizers, attention, ...): where FP8 gains and pays
        out["profile_kinds_s"] = device_time_by_kind((e.key, e.self_device_time_total) for e in ops
                                                     if e.device_type == DeviceType.CUDA)
        host = ops.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
        gaps = device_gaps(prof.events())
        out["profile_device_idle_s"] = gaps["idle_s"]
        text += (f"\nwall {wall * 1e3:.1f} ms, kernels {out['profile_kernel_s'] * 1e3:.1f} ms (summed), "
                 f"{out['device_kernels']} kernels\n" + format_kinds(out["profile_kinds_s"]) + format_gaps(gaps)
                 + f"\nthe same run's ops by host (CPU) self time:\n{host}\n")
    os.makedirs(s.profile_dir, exist_ok=True)
    if cuda:  # the timeline itself (chrome://tracing, Perfetto), gzipped: where the device waited, and on what
        out["profile_trace"] = export_trace(prof, os.path.join(s.profile_dir, _file_name(name) + "-trace.json.gz"))
    tmp = out["profile"] + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, out["profile"])
    return out


# A profile's kernels by what they do: (kind, fragments of a kernel's name, lower-cased), the first kind
# with a fragment in the name. jetrl's Triton kernels by name; cuBLAS / CUTLASS, flash attention and
# torch's (and inductor's) kernels by the words their names carry.
KERNEL_KINDS = (
    ("quantizers (jetrl)", ("_act_quant", "_weight_quant", "_row_quant", "_transpose_words", "_swiglu_grad",
                            "_swiglu_quant", "_swiglu_rows", "_rms_norm_quant", "_rms_norm_rows")),
    ("attention, KV cache", ("_attention_kernel", "_decode_kernel", "_kv_store", "flash", "fmha", "attention",
                             "sdpa")),
    ("GEMMs", ("_mm_kernel", "_mm_split", "_split_sum", "_chunk_sum", "gemm", "gemv", "xmma", "nvjet", "cutlass",
               "cublas", "splitk", "triton_tem")),
    ("optimizer", ("adam", "multi_tensor")),
    ("copies, fills", ("memcpy", "memset", "copy_kernel", "fillfunctor", "catarray")),
)
OTHER_KIND = "other (norms, softmax, elementwise, reductions)"


def kernel_kind(name: str) -> str:
    """Which of ``KERNEL_KINDS`` a kernel named ``name`` is (else ``OTHER_KIND``)."""
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in low for p in parts)), OTHER_KIND)


def device_time_by_kind(kernels) -> dict:
    """``{kind: seconds}`` of ``(name, self device microseconds)`` pairs, largest first."""
    out: dict = {}
    for name, us in kernels:
        k = kernel_kind(name)
        out[k] = out.get(k, 0.0) + us / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def format_kinds(kinds: dict) -> str:
    total = sum(kinds.values())
    if not total:
        return ""
    return "device time by kind of kernel:\n" + "".join(
        f"  {1e3 * v:9.3f} ms  {100 * v / total:5.1f}%  {k}\n" for k, v in kinds.items())


GAP_ROWS = 8  # the longest device-idle gaps a profile lists


def device_gaps(events) -> dict:
    """Where the device sat idle between its first and last kernel in a profiled run: ``idle_s``
    (the time no kernel ran, copies counted as work), ``span_s`` and the ``GAP_ROWS`` longest gaps,
    each with the kernels before and after it (the timeline, ``export_trace``, shows what the host
    was running meanwhile)."""
    from torch.autograd import DeviceType

    ks = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not ks:
        return {"idle_s": 0.0, "span_s": 0.0, "gaps": []}
    gaps, end, last = [], ks[0].time_range.end, ks[0]
    for k in ks[1:]:
        if k.time_range.start > end:
            gaps.append((k.time_range.start - end, last.name, k.name))
        if k.time_range.end >= end:
            end, last = k.time_range.end, k
    idle = sum(g[0] for g in gaps)
    gaps.sort(key=lambda g: -g[0])
    return {"idle_s": idle / 1e6, "span_s": (end - ks[0].time_range.start) / 1e6,
            "gaps": [{"us": round(us, 1), "after": a, "before": b} for us, a, b in gaps[:GAP_ROWS]]}


def format_gaps(g: dict) -> str:
    if not g["span_s"]:
        return ""
    lines = [f"device idle {g['idle_s'] * 1e3:.1f} ms of the {g['span_s'] * 1e3:.1f} ms from its first kernel to "
             f"its last; the longest gaps:"]
    lines += [f"  {x['us'] / 1e3:8.3f} ms  after {x['after'][:60]}  before {x['before'][:60]}" for x in g["gaps"]]
    return "\n".join(lines) + "\n"


def export_trace(prof, path: str) -> str:
    """``prof``'s timeline as gzipped Chrome-trace JSON at ``path`` (written whole, then renamed)."""
    import gzip
    import shutil
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        raw = f.name
    try:
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path + ".tmp", "wb") as dst:
            shutil.copyfileobj(src, dst)
    finally:
        os.unlink(raw)
    os.replace(path + ".tmp", path)
    return path


PYTHON_ROWS = 40  # functions in a Python profile's table


def python_profile_once(fn, s: Settings, name: str) -> dict:
    """With ``s.profile_dir``: one more ``fn()`` under cProfile, the functions by their own (self)
    time written to ``DIR/NAME-python.txt``; the row's ``python_profile`` (that path) and
    ``python_self_s`` (jetrl's and its kernels' wrappers' own Python time, cProfile's overhead
    included). Where the GPU waits for the host (a step whose kernels sum to less than its wall
    time), this says which Python the host was running: time inside a torch or Triton call that
    Python does not see is counted to the function that made it."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
        if s.device == "cuda":
            torch.cuda.synchronize()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mine = tuple(os.path.join(root, d) + os.sep for d in ("jetrl_cli", "kernels"))
    rows = []
    for (path, line, func), (_cc, calls, own, cum, _callers) in stats.items():
        ours = path.startswith(mine)
        rows.append((own, calls, cum, f"{os.path.relpath(path, root) if ours else path}:{line} {func}", ours))
    rows.sort(key=lambda r: -r[0])
    ours = sum(r[0] for r in rows if r[4])
    total = sum(r[0] for r in rows)
    lines = [f"{name}: one run under cProfile ({s.device}): {total * 1e3:.1f} ms of Python and the calls it made, "
             f"{ours * 1e3:.1f} ms in jetrl's own functions ({sum(r[1] for r in rows if r[4])} calls)",
             f"{'own ms':>9} {'calls':>7} {'cum ms':>9}  function"]
    lines += [f"{own * 1e3:9.2f} {calls:7d} {cum * 1e3:9.2f}  {what}" for own, calls, cum, what, _ in rows[:PYTHON_ROWS]]
    path = os.path.join(s.profile_dir, _file_name(name) + "-python.txt")
    os.makedirs(s.profile_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
    return {"python_profile": path, "python_self_s": ours}


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "-" for c in name).strip("-")


def measure_interleaved(fns: dict, s: Settings) -> dict:
    """``measure`` for several functions compared with each other (engines on one workload): after
    the warm-up, the timed runs alternate between them, so a change in the machine's speed while
    the benchmark runs (other tenants on a shared CPU) hits all of them alike. A function may
    return the number of tokens it produced: ``tokens_per_s`` is then the median of tokens / time."""
    for k, fn in fns.items():
        for i in range(s.warmup):
            t0 = time.perf_counter()
            fn()
            if s.device == "cuda":  # the warm-up's whole time, not just its launches
                torch.cuda.synchronize()
            s.say(f"  {k}: warm-up {i + 1} of {s.warmup}, {time.perf_counter() - t0:.2f} s")
    ts: dict = {k: [] for k in fns}
    counts: dict = {k: [] for k in fns}
    for i in range(s.repeats):
        for k, fn in fns.items():
            t, c = _timed(fn, s.device == "cuda")
            ts[k].append(t)
            counts[k].append(c)
            # each timed call as it ends: a bench cut off at a time limit still says what it measured
            rate = f", {c / t:.0f} tokens/s" if isinstance(c, int) else ""
            s.say(f"  {k}: run {i + 1} of {s.repeats}, {t:.3f} s{rate}")
    out = {}
    for k in fns:
        res = _stats(ts[k])
        if all(isinstance(c, int) for c in counts[k]):
            res["tokens"] = int(statistics.median(counts[k]))
            res["tokens_per_s"] = statistics.median(c / x for c, x in zip(counts[k], ts[k]))
        out[k] = res
    return out


def environment(device: str) -> dict:
    from . import __version__

    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "jetrl": __version__,
           "torch": torch.__version__, "device": device, "threads": torch.get_num_threads(),
           "machine": platform.machine(), "cpu": _cpu_name()}
    if device == "cuda":
        env["device_name"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    for mod in ("triton", "transformers", "vllm", "transformer_engine"):
        with contextlib.suppress(Exception):
            env[mod] = __import__(mod).__version__
    return env


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


# --------------------------------------------------------------------------- gemm


@dataclass(frozen=True)
class GemmVariant:
    name: str
    a: object  # CastSpec, K-major
    b: object
    backend: str
    gemm: str = "fprop"  # which GEMM of a linear layer this shape of scaling serves


def gemm_variants(device: str) -> list[GemmVariant]:
    """Every (scaling, backend) pair worth timing; rows a backend cannot run here are reported as
    skipped with the reason, not dropped."""
    from .precision.formats import Block, Format
    from .precision.quant import CastSpec

    e4 = Format.FP8_E4M3
    blk_a, blk_w = CastSpec(e4, Block(1, 128)), CastSpec(e4, Block(128, 128))
    out = []
    # invariant: the batch-invariant mode's GEMM (one tile for every M), whose price shows against triton
    for backend in ("emulated", "scaled_mm", "triton", "invariant"):
        out.append(GemmVariant("fp8 1x128 x 128x128", blk_a, blk_w, backend))
    for backend in ("scaled_mm", "triton"):  # Wgrad: 1x128 groups along the reduction (tokens) on both sides
        out.append(GemmVariant("fp8 1x128 x 1x128 (wgrad)", blk_a, blk_a, backend, "wgrad"))
    out += [
        GemmVariant("fp8 tensor", CastSpec(e4, Block(0, 0)), CastSpec(e4, Block(0, 0)), "scaled_mm"),
        GemmVariant("fp8 row", CastSpec(e4, Block(1, 0)), CastSpec(e4, Block(1, 0)), "scaled_mm"),
    ]
    for backend in ("scaled_mm", "triton"):
        out.append(GemmVariant("int8 row", CastSpec(Format.INT8, Block(1, 0)), CastSpec(Format.INT8, Block(1, 0)), backend))
    return out


def default_gemm_shapes(device: str) -> list[tuple[str, int, int, int]]:
    m = 4096 if device == "cuda" else 128
    # on CPU (emulated, ~1 min per 7B-size layer) only Llama-3-8B's four layers
    models = MODEL_SHAPES if device == "cuda" else [x for x in MODEL_SHAPES if x[0] == "llama-3-8b"]
    shapes = [(f"{model} {layer}", m, n, k) for model, layer, n, k in models]
    if device == "cuda":
        shapes += [(f"square {d}", d, d, d) for d in (4096, 8192)]
        shapes += [(f"{model} {layer} decode", rows, n, k) for rows in DECODE_ROWS for model, layer, n, k in DECODE_SHAPES]
    return shapes


def bench_gemm(s: Settings) -> list[dict]:
    from .precision.gemm import get_backend
    from .precision.quant import error_stats

    dev = torch.device(s.device)
    rows = []
    emulated = s.device == "cpu"
    for label, m, n, k in s.gemm_shapes:
        s.say(f"gemm {label}: {m}x{n}x{k}")
        g = torch.Generator(device="cpu").manual_seed(torch.seed() % 2**31)
        x = torch.randn(m, k, generator=g).to(dev)
        w = (torch.randn(n, k, generator=g) * 0.02).to(dev)
        ref = (x.double() @ w.double().t())
        flops = 2.0 * m * n * k
        if s.device == "cuda":
            xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
            base_fn = lambda: torch.matmul(xb, wb.t())  # noqa: E731  (cuBLAS bf16, fp32 accumulation)
            base_name = "bf16 (cuBLAS)"
        else:
            xb, wb = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()
            base_fn = lambda: torch.matmul(xb, wb.t())  # noqa: E731  (bf16 operands, fp32 accumulation)
            base_name = "bf16 (emulated)"
        t = measure(base_fn, s)
        base_t = t["s"]
        base_graph = _graph_s(base_fn, m, s)
        acc = error_stats(ref, base_fn().double())
        rows.append({"shape": label, "M": m, "N": n, "K": k, "variant": base_name, "backend": "torch",
                     "emulated": emulated, **t, "tflops": flops / t["s"] / 1e12, "vs_bf16": 1.0, **acc,
                     "kernel_rel_err": 0.0, "accuracy_ok": True,
                     **({"graph_s": base_graph, "graph_vs_bf16": 1.0} if base_graph else {})})
        emu = get_backend("emulated")
        for v in gemm_variants(s.device):
            base_row = {"shape": label, "M": m, "N": n, "K": k, "variant": v.name, "backend": v.backend}
            backend = get_backend(v.backend)
            spec = _spec(v)
            why = backend.unsupported(spec, "fprop", dev)
            if why is None:
                # the backend's own operand layouts on a GPU; the reference quantizer on CPU, where Triton
                # runs in its interpreter, whose fp8 rounding is wrong (/work/shared/notes)
                cast = backend.cast if s.device == "cuda" else emu.cast
                a_op, b_op = cast(x, v.a), cast(w, v.b)
                why = backend.shape_unsupported(a_op, b_op)
            if why is not None:
                rows.append({**base_row, "skipped": why})
                continue
            out_fmt = spec.out
            fn = lambda: backend.mm(a_op, b_op, out_fmt)  # noqa: E731
            try:
                out = fn()
            except JetrlError as e:
                rows.append({**base_row, "skipped": str(e)})
                continue
            t = measure(fn, s)
            graph = _graph_s(fn, m, s) if base_graph else None
            acc = error_stats(ref, out.double())
            kernel = error_stats(emu.mm(emu.cast(x, v.a), emu.cast(w, v.b), out_fmt).double(), out.double())["rel_err"]
            rows.append({**base_row, "emulated": emulated or v.backend == "emulated", **t,
                         "tflops": flops / t["s"] / 1e12, "vs_bf16": base_t / t["s"], **acc, "kernel_rel_err": kernel,
                         "accuracy_ok": kernel <= KERNEL_TOLERANCE and acc["sqnr_db"] > 15.0,
                         **({"graph_s": graph, "graph_vs_bf16": base_graph / graph} if graph else {})})
    return rows


def _graph_s(fn, m: int, s: Settings) -> float | None:
    """On a GPU, for a decode step's row count (at most ``DECODE_ROWS``): seconds per call of ``fn``
    replayed from a CUDA graph, as an engine's decode step runs it -- the back-to-back eager time of
    so small a GEMM is mostly the host's launch (the H200's decode rows). None elsewhere."""
    if s.device != "cuda":
        return None
    from .kernels.fp8 import DECODE_ROWS  # a CUDA build of torch brings Triton
    from .precision.gemm import device_time_ms

    return device_time_ms(fn, torch.device(s.device)) / 1e3 if m <= DECODE_ROWS else None


def _spec(v: GemmVariant):
    from .precision.flow import GemmSpec
    from .precision.formats import Format

    return GemmSpec(v.a, v.b, Format.FP32 if v.gemm == "wgrad" else Format.BF16, v.backend)


# --------------------------------------------------------------------------- quantize


def quantizers() -> list[tuple[str, object]]:
    from .precision.formats import Block, Format
    from .precision.quant import CastSpec

    e4 = Format.FP8_E4M3
    return [("fp8 1x128 (activations)", CastSpec(e4, Block(1, 128))),
            ("fp8 128x1 (wgrad operand)", CastSpec(e4, Block(128, 1))),
            ("fp8 128x128 (weights)", CastSpec(e4, Block(128, 128))),
            ("fp8 row", CastSpec(e4, Block(1, 0))),
            ("fp8 tensor", CastSpec(e4, Block(0, 0))),
            ("int8 row", CastSpec(Format.INT8, Block(1, 0)))]


def bench_quantize(s: Settings) -> list[dict]:
    from .kernels import quantize as triton_quantize  # light: imports Triton only when called
    from .precision.quant import dequantize, error_stats, quantize, same_bits

    dev = torch.device(s.device)
    dtype = torch.bfloat16 if s.device == "cuda" else torch.float32  # the activation dtype of each device
    dname = str(dtype).replace("torch.", "")
    kernels = _triton_quantizers(s.device)
    warps = s.quant_warps or (None,)  # None: each kernel as it runs here (on a GPU: the timed choice)
    rows = []

    def at(w, default):  # (context, the warps a row ran at)
        return (kernels.tile_warps(w), w) if w else (contextlib.nullcontext(), default)

    def launch(ran):  # a row's launch fields
        return {"warps": ran} if ran else {}

    def replayed(fn, moved) -> dict:
        """On a GPU, the kernels' own time: calls replayed from a CUDA graph (``graph_s``), without the
        host's launches, which ``measure``'s back-to-back calls include: a quantizer call's Python
        (its output buffers, a weight's job table) can outlast an 8192^2 tensor's kernel. Nothing on
        CPU, or where the calls cannot be captured."""
        if s.device != "cuda":
            return {}
        from .precision.gemm import replayed_time_ms

        ms, ok = replayed_time_ms(fn, dev)
        return {"graph_s": ms / 1e3, "graph_gb_per_s": moved / ms / 1e6} if ok else {}

    def timed(shape, name, backend, fn, moved, copy_bw, **extra):
        t = measure(fn, s)
        rows.append({"shape": shape, "quantizer": name, "dtype": dname, "backend": backend, **extra,
                     "emulated": s.device == "cpu", **t, "bytes": moved, "gb_per_s": moved / t["s"] / 1e9,
                     "vs_copy": (moved / t["s"]) / copy_bw})
        if backend != "torch (reference)" and copy_graph:
            g = replayed(fn, moved)
            if g:
                rows[-1].update(g, graph_vs_copy=g["graph_gb_per_s"] / copy_graph["graph_gb_per_s"])
        return rows[-1]

    for m, k in s.quant_shapes:
        s.say(f"quantize {m}x{k}")
        shape = f"{m}x{k}"
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(torch.seed() % 2**31)).to(dev, dtype)
        dst = torch.empty_like(x)
        t = measure(lambda: dst.copy_(x), s)
        copy_bytes = 2 * x.numel() * x.element_size()
        copy_bw = copy_bytes / t["s"]
        copy_graph = replayed(lambda: dst.copy_(x), copy_bytes)
        rows.append({"shape": shape, "quantizer": "copy (ceiling)", "dtype": dname,
                     **t, "bytes": copy_bytes, "gb_per_s": copy_bw / 1e9, "vs_copy": 1.0,
                     **(dict(copy_graph, graph_vs_copy=1.0) if copy_graph else {})})
        for name, spec in quantizers():
            if spec.block.rows > m or spec.block.cols > k:
                continue
            q = quantize(x, spec)
            moved = x.numel() * x.element_size() + q.nbytes()
            impls = [("torch (reference)", None, lambda spec=spec: quantize(x, spec))]
            tile = spec.format.is_fp8  # the 128x128-tile kernels (INT8 rows: one kernel, its own warps)
            if kernels is not None and triton_quantize(x, spec) is not None:
                impls += [("triton", w, lambda spec=spec: triton_quantize(x, spec))
                          for w in (warps if tile else (None,))]
            for backend, w, fn in impls:
                here = kernels.launch_config(x, False) if backend == "triton" and tile else None
                ctx, ran = at(w, here.warps) if here is not None else (contextlib.nullcontext(), None)
                with ctx:
                    got = fn()
                    same = same_bits(got, q)
                    timed(shape, name, backend, fn, moved, copy_bw, **launch(ran),
                          sqnr_db=error_stats(x.float(), dequantize(got))["sqnr_db"], matches_reference=same)
        if kernels is None:
            continue
        r, c = kernels.quantize_act(x, pad_tokens_to=128)  # 1x128 and 128x1 from one read
        moved = x.numel() * x.element_size() + r.nbytes() + c.nbytes()
        sqnr = error_stats(x.float(), dequantize(r))["sqnr_db"]
        here = kernels.launch_config(x, True)
        for w in warps:  # without --warps: the pair's warps as chosen here, as one kernel and two
            for one, name in ((True, "fp8 1x128 + 128x1 fused"), (False, "fp8 1x128 + 128x1 as two kernels")):
                # two kernels: two reads of x, each kernel with more programs per SM; the same bytes
                # written, so the same "moved" (``launch_config`` picks the faster on a GPU)
                with kernels.tile_warps(w or here.warps, one_kernel=one):
                    timed(shape, name, "triton", lambda: kernels.quantize_act(x, pad_tokens_to=128), moved,
                          copy_bw, **launch(w or here.warps), sqnr_db=sqnr, matches_reference=None)
        if m % 4 == 0:  # a weight's FP8 bytes as Dgrad's W^T (once per update): the kernel in each of its
            # tile orders, and torch's copy
            src = torch.randint(0, 256, (m, k), dtype=torch.uint8, device=dev)
            dst = torch.empty((k, m), dtype=torch.uint8, device=dev)
            for way in kernels.TRANSPOSE_WAYS:
                with kernels.transpose_with(way):
                    kernels.transpose_bytes_(dst, src)
                    timed(shape, "fp8 weight bytes transposed (W^T)", way, lambda: kernels.transpose_bytes_(dst, src),
                          2 * m * k, copy_bw, kind="transpose", matches_reference=torch.equal(dst, src.t()))
        # an update's weight: its fp32 master quantized 128x128 with W^T, whose bytes are transposed after
        # the quantizer or written by it (``wt_with``)
        w32 = x.float()
        want = kernels.quantize_weight(w32, transposed=True)
        moved = w32.numel() * 4 + want[0].nbytes() + want[1].nbytes()
        sqnr = error_stats(w32, dequantize(want[0]))["sqnr_db"]
        for way in kernels.WT_WAYS:
            with kernels.wt_with(way):
                got = kernels.quantize_weight(w32, transposed=True)
                timed(shape, "fp8 weight 128x128 + W^T, from fp32", way,
                      lambda: kernels.quantize_weight(w32, transposed=True), moved, copy_bw, kind="W^T", sqnr_db=sqnr,
                      matches_reference=same_bits(got[0], want[0]) and same_bits(got[1], want[1]))
        if k % 128 == 0:  # the SwiGLU backward of an MLP with I = k
            _, copy = kernels.swiglu_quantize(torch.cat([x, x.flip(0)], 1), save=True)  # [g, u]'s FP8 copy
            outs = kernels.swiglu_grad_quantize(copy, x, dtype, pad_tokens_to=128, h_cols=True)
            moved = copy.nbytes() + x.numel() * x.element_size() + sum(o.nbytes() for o in outs)
            g, u = dequantize(copy).float().chunk(2, dim=1)  # d[g, u] in fp32 at the copy's values
            sig, gy = torch.sigmoid(g), x.float()
            want = torch.cat([gy * u * sig * (1 + g * (1 - sig)), gy * g * sig], 1)
            sqnr = error_stats(want, dequantize(outs[0]).float())["sqnr_db"]
            here = kernels.swiglu_config(x)
            for w in warps:  # its 128x128-tile kernel, and its two kernels of small tiles (the same bytes)
                for one, how in ((True, ""), (False, " as two kernels")):
                    with kernels.tile_warps(w or here.warps, one_kernel=one):
                        timed(shape, f"fp8 SwiGLU backward (d[g,u] 1x128 + 128x1, h^T){how}", "triton",
                              lambda: kernels.swiglu_grad_quantize(copy, x, dtype, pad_tokens_to=128, h_cols=True),
                              moved, copy_bw, **launch(w or here.warps), sqnr_db=sqnr, matches_reference=None)
    return rows


# --------------------------------------------------------------------------- attention


def bench_attention(s: Settings) -> list[dict]:
    from .models.llama import Masking, _kv_values, _native_attention
    from .models.shapes import load_bench_model
    from .precision.formats import Block, Format
    from .precision.quant import CastSpec, quantize

    _, cfg, label = load_bench_model(s.model, s.layers)
    h, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev = torch.device(s.device)
    bf = torch.bfloat16
    spec = CastSpec(Format.FP8_E4M3, Block.parse("row"))  # what `kv_cache: fp8_e4m3 row` stores
    why = _triton_unavailable(s.device)
    rows = []
    for b, w in s.attention_shapes:
        s.say(f"attention {b}x{w} ({label})")
        g = torch.Generator().manual_seed(torch.seed() % 2**31)
        q = torch.randn(b, h, 1, d, generator=g).to(dev, bf)
        kv = [torch.randn(b, hk, w, d, generator=g).to(dev) for _ in range(2)]
        k8, v8 = (quantize(x.reshape(-1, d), spec) for x in kv)
        kd, vd = k8.data.reshape(b, hk, w, d), v8.data.reshape(b, hk, w, d)
        ks, vs = k8.scale.reshape(b, hk, w).float(), v8.scale.reshape(b, hk, w).float()
        kb, vb = (x.to(bf) for x in kv)
        kq, vq = _kv_values.__wrapped__(kd, ks, bf), _kv_values.__wrapped__(vd, vs, bf)  # what the FP8 cache holds
        del kv, k8, v8
        pos = torch.full((b,), w - 1, device=dev)  # every sequence at the end of the cache: w keys read
        mask = Masking(pos[:, None], None, w, causal_from_zero=False)
        bf16_bytes, fp8_bytes = 2 * b * hk * w * d * 2, 2 * b * hk * w * (d + 4)
        variants = [  # (name, cache, kernel, the values it reads, bytes of cache it reads, fn)
            ("bf16 cache, SDPA", "bf16", "sdpa", (kb, vb), bf16_bytes,
             lambda: _native_attention(q, kb, vb, mask, h // hk, Format.BF16)),
            ("fp8 cache, dequantize + SDPA", "fp8_e4m3", "sdpa", (kq, vq), fp8_bytes,
             lambda: _native_attention(q, _kv_values(kd, ks, bf), _kv_values(vd, vs, bf), mask, h // hk, Format.BF16)),
        ]
        if why is None:
            from .kernels.attention import decode_attention
            from .kernels.invariant import invariant_attention

            p2 = pos[:, None]
            variants += [
                ("fp8 cache, read as stored", "fp8_e4m3", "triton", (kq, vq), fp8_bytes,
                 lambda: decode_attention(q, kd, vd, pos, kv_scales=(ks, vs))),
                ("bf16 cache, triton", "bf16", "triton", (kb, vb), bf16_bytes, lambda: decode_attention(q, kb, vb, pos)),
                ("fp8 cache, batch-invariant", "fp8_e4m3", "invariant", (kq, vq), fp8_bytes,
                 lambda: invariant_attention(q, kd, vd, p2, check_positions=False, kv_scales=(ks, vs))[0]),
                ("bf16 cache, batch-invariant", "bf16", "invariant", (kb, vb), bf16_bytes,
                 lambda: invariant_attention(q, kb, vb, p2, check_positions=False)[0]),
            ]
        else:
            rows.append({"shape": f"{b}x{w}", "variant": "triton kernels", "skipped": why})
        from .kernels.attention import decode_attention_reference

        timed = measure_interleaved({name: fn for name, *_, fn in variants}, s)
        base = timed["bf16 cache, SDPA"]["s"]
        for name, cache, kernel, (kr, vr), nbytes, fn in variants:
            ref = decode_attention_reference(q, kr, vr, pos)[:, :, 0]
            got = fn().reshape(b, h, d) if kernel == "sdpa" else fn()[:, :, 0]
            err = float((got.double() - ref).norm() / ref.norm())
            rows.append({"shape": f"{b}x{w}", "model": label, "batch": b, "width": w, "heads": h, "kv_heads": hk,
                         "head_dim": d, "variant": name, "cache": cache, "kernel": kernel,
                         "emulated": s.device == "cpu", **timed[name], "kv_bytes": nbytes,
                         "gb_per_s": nbytes / timed[name]["s"] / 1e9, "vs_sdpa_bf16": base / timed[name]["s"],
                         "rel_err": err, "accuracy_ok": err < ATTENTION_TOLERANCE})
        rows += _kv_store_rows(s, b, hk, w, d, spec, why is None)
    return rows


def _kv_store_rows(s: Settings, b: int, hk: int, w: int, d: int, spec, triton_ok: bool) -> list[dict]:
    """A decode step's new keys (one token per sequence, fp32 from RoPE, strided) written into the
    cache of one layer: into a bf16 cache (a cast and an ``index_copy_``), into an FP8 cache by the
    reference (``quantize`` and two ``index_copy_``) and by ``kv_store``; whether the FP8 bytes and
    scales equal the reference's."""
    from .precision.quant import quantize

    dev = torch.device(s.device)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(b, 1, hk, d, generator=g).to(dev).transpose(1, 2)  # (b, hk, 1, d), as RoPE writes keys
    idx = (torch.arange(b * hk, device=dev) * w + (w - 1))  # each sequence's last slot
    flat_bf16 = torch.zeros(b * hk * w, d, dtype=torch.bfloat16, device=dev)
    data = torch.zeros(b * hk * w, d, dtype=spec.format.torch_dtype(), device=dev)
    scales = torch.zeros(b * hk * w, device=dev)
    ref_data, ref_scales = data.clone(), scales.clone()

    def bf16_store():
        flat_bf16.index_copy_(0, idx, x.reshape(-1, d).to(torch.bfloat16))

    def reference(dst=ref_data, dst_s=ref_scales):
        q = quantize(x.reshape(-1, d), spec)
        dst.view(torch.uint8).index_copy_(0, idx, q.data.view(torch.uint8))
        dst_s.index_copy_(0, idx, q.scale.reshape(-1))

    fns = {"bf16: cast, index_copy_": bf16_store, "fp8: quantize, 2 index_copy_": reference}
    if triton_ok:
        from .kernels.attention import kv_store

        fns["fp8: kv_store"] = lambda: kv_store(x, idx, data, scales, spec)
    timed = measure_interleaved(fns, s)
    base = timed["bf16: cast, index_copy_"]["s"]
    out = []
    for name, fn in fns.items():
        same = None
        if "kv_store" in name:
            fn()
            reference()
            same = bool(torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
                        and torch.equal(scales, ref_scales))
        out.append({"shape": f"{b}x{w}", "batch": b, "width": w, "kv_heads": hk, "head_dim": d, "kind": "store",
                    "variant": name, "emulated": s.device == "cpu", **timed[name], "vs_bf16_store": base / timed[name]["s"],
                    "matches_reference": same})
    return out


def _triton_unavailable(device: str) -> str | None:
    """Why Triton's kernels cannot run on ``device``'s tensors here (None: they can; ``--device
    cuda`` was checked to have a GPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed: pip install triton"
    if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "they run on CUDA tensors (or in Triton's interpreter with TRITON_INTERPRET=1)"
    return None


def _triton_quantizers(device: str):
    """``jetrl_cli.kernels.fp8`` when its kernels can run on ``device``'s tensors (a GPU, or CPU
    tensors in Triton's interpreter), else None."""
    if _triton_unavailable(device) is not None:
        return None
    from .kernels import fp8

    return fp8


# --------------------------------------------------------------------------- rollout


FLOW_MODIFIERS = {"invariant": {"batch_invariant": True},  # NAME+MOD[+MOD]: a named flow with these set
                  "fp8kv": {"rollout": {"kv_cache": "fp8_e4m3 row"}}}


def _flow(name: str):
    from .precision.flow import NAMED_FLOWS, parse_flow

    if name == "fp32":
        from .rl.mismatch import reference_flow

        return reference_flow()
    base, *mods = name.split("+")
    if base not in NAMED_FLOWS or any(m not in FLOW_MODIFIERS for m in mods) or len(set(mods)) < len(mods):
        raise JetrlError(f"--flows: unknown flow {name!r} (allowed: fp32, {', '.join(NAMED_FLOWS)}; a flow name "
                         "+invariant for its batch-invariant mode, +fp8kv for an FP8 KV cache; in train rows +graphs for "
                         "the decoder layers as CUDA graphs, +ckpt for them recomputed in the backward, +lora for LoRA "
                         "adapters)")
    if mods:
        over: dict = {"base": base}
        for m in mods:  # each sets its own top-level key
            over.update(FLOW_MODIFIERS[m])
        return parse_flow(over, source="--flows", name=name)
    return parse_flow(name, source="--flows")


def _transformers(s: Settings):
    """The transformers module for the baseline rows, or None (not installed, or ``--no-transformers``)."""
    if not s.transformers:
        return None
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def bench_rollout(s: Settings) -> list[dict]:
    from .engine.base import make_payload
    from .engine.embedded import EmbeddedEngine
    from .engine.sampling import SamplingParams
    from .models.shapes import load_bench_model
    from .models.transformers_ref import transformers_twin

    make, _, label = load_bench_model(s.model, s.layers)
    path = _model_path(s.model)
    dev = torch.device(s.device)
    model = make(dev)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = torch.randint(3, vocab, (s.batch, s.prompt), generator=g)
    total = s.batch * s.new_tokens
    rows = []
    hp = "bf16" if s.device == "cuda" else "fp32"
    base = None
    transformers = _transformers(s)
    sp = SamplingParams(max_new_tokens=s.new_tokens, temperature=1.0, n=1, stop_token_ids=())
    plist = prompts.tolist()
    names = (["fp32"] if s.device == "cpu" else []) + list(s.flows)
    fns = {}
    if transformers is not None:
        s.say(f"rollout: transformers generate() ({hp})")
        hf = transformers_twin(model, torch.bfloat16 if hp == "bf16" else torch.float32).eval()
        pd = prompts.to(dev)

        def run_hf():
            with torch.inference_mode():
                out = hf.generate(pd, attention_mask=torch.ones_like(pd), do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens,
                                  pad_token_id=0, eos_token_id=None)
            assert out.shape[1] == s.prompt + s.new_tokens

        fns["hf"] = run_hf
        if s.device == "cuda":  # transformers' fastest: a static cache, the decode step compiled
            def run_hf_static():
                with torch.inference_mode():
                    hf.generate(pd, attention_mask=torch.ones_like(pd), do_sample=True, temperature=1.0, top_k=0,
                                top_p=1.0, max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens,
                                pad_token_id=0, eos_token_id=None, cache_implementation="static")

            fns["hf-static"] = run_hf_static
    engines, details = {}, {}
    for name in names:
        s.say(f"rollout: embedded engine, {name}")
        flow = _flow(name)
        eng = EmbeddedEngine(model, flow, s.prompt + s.new_tokens, max_batch=s.batch, cuda_graphs=s.cuda_graphs)
        eng.load_weights(make_payload(model, flow))
        engines[name] = eng

        def run_ours(eng=eng):
            eng.generate(plist, sp, seed=0)

        fns[name] = run_ours
    s.say("rollout: timing the engines in turn")
    timed = measure_interleaved(fns, s)
    for key, fn in fns.items():
        timed[key].update(profile_once(fn, s, f"rollout-fixed-{key}"))
    for name, eng in engines.items():
        details[name] = engine_details(eng, model, _flow(name), plist, sp, s)
    fns.clear()  # frees the engines and transformers' model
    engines.clear()
    hf = eng = None
    base = total / timed["hf"]["s"] if "hf" in timed else None
    if base is not None:
        rows.append({"engine": "transformers generate()", "flow": hp, "emulated": False, **timed["hf"],
                     "tokens_per_s": base, "vs_generate": 1.0})
    if "hf-static" in timed:
        tps = total / timed["hf-static"]["s"]
        rows.append({"engine": "transformers generate(), static cache", "flow": hp, "emulated": False,
                     **timed["hf-static"], "tokens_per_s": tps, "vs_generate": tps / base})
    for name in names:
        tps = total / timed[name]["s"]
        rows.append({"engine": "jetrl embedded", "flow": name, "emulated": s.device == "cpu" and name != "fp32",
                     **timed[name], "tokens_per_s": tps, "vs_generate": tps / base if base else None,
                     **details[name]})
    if path is not None:
        rows += _vllm_rows(s, model, path, names, plist, sp, s.prompt + s.new_tokens, s.batch, base)
    _ratios_to_bf16(rows)
    for r in rows:
        r.update({"workload": "fixed", "model": label, "batch": s.batch, "prompt": s.prompt,
                  "new_tokens": s.new_tokens})
    if s.task_preset:
        rows += _rollout_task_rows(s, model, path, label, transformers, names)
    return rows


def engine_details(eng, model, flow, prompts, sp, s: Settings) -> dict:
    """What a rollout costs besides its tokens/s: time to first token (a generate() of one token),
    the weight sync (the trainer's payload, quantized for a quantized sync, loaded into the engine),
    the KV cache's bytes per token, the engine's weight bytes, its CUDA graphs, and on a GPU the
    peak memory of one rollout beyond what was allocated when it began (its KV cache, activations
    and graph pools; the weights are ``weight_bytes``)."""
    from dataclasses import replace

    from .engine.base import make_payload

    first = replace(sp, max_new_tokens=1)
    ttft = measure(lambda: eng.generate(prompts, first, seed=0), s)
    sync = measure(lambda: eng.load_weights(make_payload(model, flow)), s)
    out = {"ttft_s": ttft["s"], "sync_s": sync["s"], "kv_bytes_per_token": eng.model.new_cache(1, 16).nbytes_per_token(),
           "weight_bytes": eng.weight_nbytes()}
    if eng.graphs is not None:
        out["cuda_graphs"] = eng.graphs.disabled or f"{eng.graphs.captures} captured"
    from .models.llama import BF16_READ, KV_READ
    from .precision.gemm import kernel_choice

    op = KV_READ if flow.rollout.kv_cache.format.is_fp8 else BF16_READ
    kv = kernel_choice(op, eng.model.lm_head.weight.device)
    if kv is not None:  # which attention read the cache at decode steps (decided at the first one)
        if flow.batch_invariant:
            kernel = "batch-invariant kernel" + (", FP8 read as stored" if op == KV_READ and kv["runs"] else "")
            out["kv_attention"] = kernel
        else:
            out["kv_attention"] = kv["kernel"] + (f" ({kv['why']})" if kv.get("why") else "")
    from .precision.fuse import report as fuse_report
    from .precision.gemm import backend_report

    fused = fuse_report()
    if fused is not None:
        out["fused"] = fused
    out["gemm_backends"] = backend_report()  # on a GPU: each decode GEMM shape's split-K, timed at its first call
    if s.device == "cuda":
        # the rollout's own peak: above what the process held before it (in a bench of several engines,
        # every engine's weights: an H200 run showed one process peak for all three rows)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        eng.generate(prompts, sp, seed=0)
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated() - start
        out["memory_at_start_bytes"] = start
    return out


def _model_path(name: str):
    """The model's directory, or None for a random-weight shape."""
    from .models.shapes import SHAPES
    from .rl.loop import resolve_model_dir

    return None if name in SHAPES else resolve_model_dir(name)


def _ratios_to_bf16(rows: list[dict]) -> None:
    """Each engine's rows against the same engine's bf16 row."""
    for r in rows:
        bf = next((x["tokens_per_s"] for x in rows if x["engine"] == r["engine"] and x["flow"] == "bf16"), None)
        r["vs_bf16"] = r["tokens_per_s"] / bf if bf and r["engine"] != "transformers generate()" else None


def _vllm_rows(s: Settings, model, path, names, prompts, sp, width: int, max_batch: int, base) -> list[dict]:
    """vLLM, when installed: each flow through jetrl's quantization method in vLLM, with the time of
    its in-place weight sync (``sync_s``); on a GPU also vLLM's own FP8 (per-tensor and 128x128 blocks)
    and its unquantized bf16, whose syncs go through vLLM's reload_weights."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return []
    from .engine.base import make_payload
    from .engine.vllm_engine import VLLMEngine, VLLMSettings

    runs = [(name, "jetrl") for name in names]
    if s.device == "cuda":
        runs += [("bf16", "none"), ("fp8-rollout", "fp8"), ("fp8-rollout", "fp8-block")]
    rows = []
    for name, quant in runs:
        flow = _flow(name)
        if quant != "jetrl" and flow.weight_sync.payload != "hp":
            continue
        label = "vLLM (jetrl quantizers)" if quant == "jetrl" else f"vLLM ({quant}, its own)"
        s.say(f"rollout: {label}, {name}")
        settings = VLLMSettings(quantization=quant, dtype="bfloat16" if quant != "jetrl" and s.device == "cuda"
                                else "float32", max_batch=max_batch)
        try:
            eng = VLLMEngine(path, flow, width, settings, device=s.device)
        except JetrlError as e:
            if quant != "fp8-block" or not str(e).startswith("rollout.vllm_quantization: fp8-block:"):
                raise
            s.not_run[f"rollout {label}"] = str(e)  # this model's shapes: no block-FP8 checkpoint vLLM loads
            s.say(f"rollout: {label}: not run: {e}")
            continue
        try:
            payload = make_payload(model, flow)
            sync = measure(lambda: eng.load_weights(payload), s)
            count = [0]

            def run_vllm():
                count[0] = sum(len(c.tokens) for g in eng.generate(prompts, sp, seed=0) for c in g)

            t = measure(run_vllm, s)
        finally:
            eng.close()
        tps = count[0] / t["s"]
        rows.append({"engine": label, "flow": name if quant == "jetrl" else f"{quant} ({settings.dtype})",
                     "emulated": s.device == "cpu" and name != "fp32", **t, "tokens": count[0], "tokens_per_s": tps,
                     "vs_generate": tps / base if base else None, "sync_s": sync["s"],
                     "sync_bytes": payload.nbytes})
    return rows


def _rollout_task_rows(s: Settings, model, path, model_label: str, transformers, names) -> list[dict]:
    """An RL-shaped batch: a preset's task prompts, ``rollout.n`` samples each, stopping at EOS.
    Tokens counted: those generated up to and including the stop token (or the last token of a
    stop sequence), for both engines."""
    from .config import load_job_config
    from .engine.base import first_stop
    from .engine.embedded import EmbeddedEngine
    from .models.tokenizer import Tokenizer
    from .rl.loop import sampling_params
    from .tasks import PromptSource

    from .models.shapes import tokenizer_dir
    from .models.transformers_ref import transformers_twin

    cfg = load_job_config(s.task_preset, ([f"model.path={path}"] if path is not None else []) + list(s.task_overrides))
    tok = Tokenizer.from_dir(path if path is not None else tokenizer_dir())
    from .rl.loop import fitted_task

    task = fitted_task(cfg, tok, 0, strict=False)  # the run's prompts: without those it leaves out
    prompts = tok.encode_prompts(PromptSource(task, 0).batch(1, cfg.rollout.prompts_per_step), task.chat)[1]
    sp = sampling_params(cfg, tok)
    n, new = sp.n, sp.max_new_tokens
    width = max(len(p) for p in prompts) + new
    dev = torch.device(s.device)
    label = f"task ({s.task_preset}: {len(prompts)} prompts x {n}, stop at EOS, <= {new} tokens)"
    rows = []
    fns = {}
    if transformers is not None:
        s.say(f"rollout: {label}: transformers generate()")
        hf = transformers_twin(model, torch.bfloat16 if s.device == "cuda" else torch.float32).eval()
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[tok.pad_id] * (longest - len(p)) + p for p in prompts], device=dev)  # left-padded
        att = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=dev)
        stops = set(sp.stop_token_ids)

        def run_hf():
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=att, do_sample=True, temperature=sp.temperature, top_k=0,
                                  top_p=1.0, max_new_tokens=new, num_return_sequences=n, pad_token_id=tok.pad_id,
                                  eos_token_id=list(stops))
            rows = out[:, longest:].tolist()
            return sum(len(r) if (e := first_stop(r, sp)) is None else e + 1 for r in rows)  # sequences too

        fns["hf"] = run_hf
    engines = {}
    for name in names:
        s.say(f"rollout: {label}: embedded engine, {name}")
        eng = engines[name] = EmbeddedEngine(model, _flow(name), width, max_batch=cfg.rollout.max_batch,
                                             cuda_graphs=s.cuda_graphs)

        def run_ours(eng=eng):
            return sum(len(c.tokens) for g in eng.generate(prompts, sp, seed=0) for c in g)

        fns[name] = run_ours
    s.say(f"rollout: {label}: timing the engines in turn")
    timed = measure_interleaved(fns, s)
    for key, fn in fns.items():
        timed[key].update(profile_once(fn, s, f"rollout-task-{key}"))
    details = {name: engine_details(eng, model, _flow(name), prompts, sp, s) for name, eng in engines.items()}
    engines.clear()
    fns.clear()
    hf = eng = None
    base = timed["hf"]["tokens_per_s"] if "hf" in timed else None
    if base is not None:
        rows.append({"engine": "transformers generate()", "flow": "bf16" if s.device == "cuda" else "fp32",
                     "emulated": False, **timed["hf"], "vs_generate": 1.0})
    for name in names:
        tps = timed[name]["tokens_per_s"]
        rows.append({"engine": "jetrl embedded", "flow": name, "emulated": s.device == "cpu" and name != "fp32",
                     **timed[name], "vs_generate": tps / base if base else None, **details[name]})
    if path is not None:
        rows += _vllm_rows(s, model, path, names, prompts, sp, width, cfg.rollout.max_batch, base)
    _ratios_to_bf16(rows)
    for r in rows:
        r.update({"workload": label, "model": model_label, "batch": len(prompts) * n, "prompt": None, "new_tokens": new})
    return rows


# --------------------------------------------------------------------------- train


def _without_invariant(name: str) -> str:
    """A flow row's name without ``+invariant``: the fast path its batch-invariant mode is priced against."""
    return "+".join(p for p in name.split("+") if p != "invariant")


# NAME+graphs: a train row with ``train.cuda_graphs``; NAME+ckpt: with ``train.activation_checkpointing``;
# NAME+lora: LoRA adapters of rank BENCH_LORA_RANK on every linear layer (the trainer's settings, not the flow's)
TRAIN_MODIFIERS = ("graphs", "ckpt", "lora")
BENCH_LORA_RANK = 32


def _train_flow(name: str) -> tuple[object, frozenset]:
    """``(flow, trainer modifiers)`` of a train row's name: the flow without ``+graphs`` / ``+ckpt``, and
    which of them it had."""
    base, *mods = name.split("+")
    if "graphs" in mods and "ckpt" in mods:
        raise JetrlError(f"--flows: {name!r}: +graphs and +ckpt do not go together (train.activation_checkpointing "
                         "is refused with train.cuda_graphs)")
    return (_flow("+".join([base] + [m for m in mods if m not in TRAIN_MODIFIERS])),
            frozenset(m for m in mods if m in TRAIN_MODIFIERS))


def check_flow(name: str, modes) -> None:
    """``--flows NAME`` for ``modes`` (``parse_modes``' result): a clear error unless every mode can run it."""
    if set(name.split("+")[1:]) & set(TRAIN_MODIFIERS) and set(modes) != {"train"}:
        raise JetrlError(f"--flows: {name!r}: +graphs, +ckpt and +lora are for train rows only (bench train: the "
                         "decoder layers as CUDA graphs, recomputed in the backward, or LoRA adapters)")
    _train_flow(name)


def _train_flows(names) -> list[tuple[str, object, frozenset]]:
    """``(name, flow, trainer modifiers)`` of flows with distinct training precision (fp8-rollout trains like
    bf16: benched once); ``NAME+graphs`` replays the decoder layers as CUDA graphs, ``NAME+ckpt`` recomputes
    them in the backward (``train.activation_checkpointing``)."""
    out, seen = [], set()
    for n in names:
        f, mods = _train_flow(n)
        key = (f.train, f.kv_cast("train"), mods)
        if key in seen:
            continue
        seen.add(key)
        out.append((n, f, mods))
    return out


def _bench_policy(make, dev, mods: frozenset):
    """A train row's model: with ``+lora``, frozen under rank-``BENCH_LORA_RANK`` adapters on every linear
    layer (alpha 2 x rank), as ``model.lora_rank`` makes it."""
    model = make(dev)
    if "lora" in mods:
        from .models.lora import TARGETS, LoraSpec, add_adapters

        add_adapters(model, LoraSpec(BENCH_LORA_RANK, 2.0 * BENCH_LORA_RANK, TARGETS))
    return model


def _saved_bytes(fn) -> tuple[int, object]:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (each storage once).

    The pack hook keeps a detached view (the same storage): returning the tensor itself, a saved
    *output* would hold its own ``grad_fn`` through the hook's object, a cycle through C++ that
    Python's collector cannot see. It kept each row's whole last forward graph (and, through it,
    the model's weights) alive after the row: 39 GiB after the transformers row on an H200."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.nn.Parameter):  # weights are not activations
            return t
        with contextlib.suppress(Exception):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _train_batch(vocab: int, n: int, t: int, g: torch.Generator):
    from .rl.trainer import Batch

    ids = torch.randint(3, vocab, (n, t), generator=g)
    half = t // 2
    prompts, comps = ids[:, :half].tolist(), ids[:, half:].tolist()
    batch = Batch.build(prompts, comps, [[-1.0] * (t - half)] * n, torch.rand(n, generator=g).tolist(),
                        [i // 2 for i in range(n)])
    return batch, torch.randn(n, generator=g)


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def bench_train(s: Settings) -> list[dict]:
    """One GRPO update per flow, and the same model and batch as a plain ``transformers`` training
    step (fp32 master weights, bf16 autocast on CUDA, SDPA attention, fused AdamW): the baseline."""
    from .config import TrainConfig
    from .engine.sampling import SamplingParams
    from .models.shapes import load_bench_model
    from .precision.gemm import backend_report, reset_resolutions
    from .rl.algos import CorrectionConfig
    from .rl.trainer import Trainer, token_logprobs

    dev = torch.device(s.device)
    make, mcfg, label = load_bench_model(s.model, s.layers)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    n, t = s.train_batch, s.seq
    batch, adv = _train_batch(mcfg.vocab_size, n, t, g)
    sp = SamplingParams(max_new_tokens=t - t // 2)
    mb = min(s.micro_batch or n, n)
    tcfg = TrainConfig(lr=1e-6, micro_batch=mb)
    ccfg = CorrectionConfig()
    rows = []
    common = {"model": label, "batch": n, "micro_batch": mb, "seq": t}

    def flow_row(name: str, flow, mods: frozenset) -> dict:
        peaks = PhasePeaks(s.device == "cuda")
        graphs = "graphs" in mods
        cfg = dataclasses.replace(tcfg, cuda_graphs=graphs, activation_checkpointing="ckpt" in mods)
        tr, old = peaks("setup", lambda: _scored(Trainer(_bench_policy(make, dev, mods), flow, cfg, ccfg, sp, t,
                                                         hold_frozen="lora" in mods), batch))
        step = [0]

        def one():
            step[0] += 1
            tr.update(batch, adv, old, None, step[0])

        tm = timed_train_steps(one, s, peaks, f"train-{name}")
        first = batch if mb == n else batch.select(torch.arange(mb))  # what one forward saves
        with tr.graphs.suspended() if tr.graphs is not None else contextlib.nullcontext():  # graphs hide theirs
            saved, _ = peaks("saved-activations forward",
                             lambda: _saved_bytes(lambda: token_logprobs(tr.model, first, sp).sum()))
        row = {"flow": name, "train": flow.train.linear.fprop.short_str(), "emulated": s.device == "cpu",
               **tm, "tokens_per_s": n * t / tm["s"], "saved_activation_bytes": saved, **common,
               "gemm_backends": backend_report(), **peaks.row()}
        if s.device == "cuda":
            row["allocator_per_step"] = allocator_events(one)
        if "lora" in mods:
            row["lora_rank"] = BENCH_LORA_RANK
            row["trained_params"] = sum(p.numel() for p in tr.params)
        if graphs:  # what the decoder layers' CUDA graphs did (none on CPU)
            row["train_graphs"] = tr.graphs.report() if tr.graphs is not None else "off: not on a GPU"
        return row

    # the baseline first, on a device nothing else has used (on the first H100 run, measured after
    # jetrl's rows, it ran out of memory at both shapes); listed last
    hf_row = _transformers_train_row(s, make, batch, adv, dev, common)
    for name, flow, mods in _train_flows(s.flows):
        s.say(f"train: {name}")
        _free(s.device)
        reset_resolutions()  # each row reports the backends its own GEMMs resolved to
        rows.append(_unless_out_of_memory(s, name, common, lambda: flow_row(name, flow, mods)))
        s.done("train", rows)
    if hf_row is not None:
        rows.append(hf_row)
    _free(s.device)
    ran = [r for r in rows if "s" in r]
    bf = next((r for r in ran if r["flow"] == "bf16"), None)
    hf = hf_row if hf_row is not None and "s" in hf_row else None
    for r in ran:
        r["step_vs_bf16"] = r["s"] / bf["s"] if bf else None
        r["activations_vs_bf16"] = r["saved_activation_bytes"] / bf["saved_activation_bytes"] if bf else None
        r["step_vs_transformers"] = r["s"] / hf["s"] if hf else None
        if hf and "peak_memory_bytes" in r and "peak_memory_bytes" in hf:
            r["peak_vs_transformers"] = r["peak_memory_bytes"] / hf["peak_memory_bytes"]
    return rows


TRANSFORMERS_FLOW = "transformers"
TRAINING_PHASES = ("setup", "first update", "updates")  # what a training run holds; the rest is the bench's own


class PhasePeaks:
    """A bench row's peak CUDA memory per phase (the allocator's peak is reset at each): ``setup``
    (the model, trainer, reference logprobs), ``first update`` (the warm-up: optimizer state
    created, kernels compiled and timed), ``updates`` (the timed ones), and the bench's own extra
    runs (``profile``, ``memory record``, ``saved-activations forward``). ``row()``:
    ``peak_memory_bytes``, the highest of the training phases, and ``peak_memory_by_phase``; the
    same for the memory the caching allocator reserved from the device (``peak_reserved_bytes``,
    ``peak_reserved_by_phase``: above the allocated peak by its rounding and fragmentation).
    Allocated peaks are the row's own: less what the device held when the row began
    (``memory_at_start_bytes``; anything but 0 is left over from an earlier row, and
    ``left_over`` then lists the tensors among it with a Python object: ``cuda_memory.live_cuda_tensors``).
    Nothing on CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.by_phase, self.reserved = cuda, {}, {}
        # what the row starts with (after ``_free``): anything but 0 is left over from an earlier row
        self.start = torch.cuda.memory_allocated() if cuda else None
        self.left_over = cuda_memory.live_cuda_tensors() if cuda and self.start > LEFT_OVER_REPORTED else None

    def __call__(self, phase: str, fn):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
            own = torch.cuda.max_memory_allocated() - self.start
            self.by_phase[phase] = max(self.by_phase.get(phase, 0), own)
            self.reserved[phase] = max(self.reserved.get(phase, 0), torch.cuda.max_memory_reserved())
        return out

    def row(self) -> dict:
        train = [k for k in self.by_phase if k in TRAINING_PHASES]
        if not train:
            return {}
        return {"peak_memory_bytes": max(self.by_phase[k] for k in train),
                "peak_memory_by_phase": dict(self.by_phase),
                "peak_reserved_bytes": max(self.reserved[k] for k in train),
                "peak_reserved_by_phase": dict(self.reserved), "memory_at_start_bytes": self.start,
                **({"left_over": self.left_over} if self.left_over else {})}


LEFT_OVER_REPORTED = 2**20  # bytes held when a row begins beyond which the bench looks for their owners



def _scored(tr, batch):
    return tr, tr.score(batch)


def timed_train_steps(one, s: Settings, peaks: PhasePeaks, name: str) -> dict:
    """A train row's timing: the first update alone (warm-up), the rest of ``measure``, then with
    ``--profile`` one more update under the profiler and, on CUDA, one with the allocator's history
    (``cuda_memory``: what was live at its peak, written to ``DIR/NAME-memory.txt``)."""
    import dataclasses

    first = None
    if s.warmup > 0:  # timed on its own: compilations, first-call timings, a CUDA graph's capture
        first = peaks("first update", lambda: _timed(one, s.device == "cuda")[0])
    tm = peaks("updates", lambda: measure(one, dataclasses.replace(s, warmup=max(s.warmup - 1, 0))))
    if first is not None:
        tm["first_update_s"] = first
    if s.profile_dir:
        tm.update(peaks("profile", lambda: profile_once(one, s, name)))
        tm.update(peaks("profile", lambda: python_profile_once(one, s, name)))
        if s.device == "cuda":
            tm.update(peaks("memory record", lambda: memory_once(one, s, name)))
    return tm


def peak_lines(row: dict) -> list[str]:
    """A train row's peak memory per phase, and what its recorded step held at its peak (largest
    sites), as lines under the table (GiB)."""
    g, out = 2 ** 30, []
    phases, reserved = row.get("peak_memory_by_phase"), row.get("peak_reserved_by_phase") or {}
    if phases:
        held = row.get("memory_at_start_bytes")
        each = (f"{k} {v / g:.1f} / {reserved[k] / g:.1f}" if k in reserved else f"{k} {v / g:.1f}"
                for k, v in phases.items())
        out.append(f"{row['flow']}: peak GiB by phase (allocated above the row's start / reserved): "
                   + ", ".join(each) + (f"; {held / g:.2f} GiB held before the row began" if held else ""))
    lo = row.get("left_over")
    if lo:
        big = ", ".join(f"{x['dtype']}{x['shape']} {x['bytes'] / g:.2f}" for x in lo["largest"][:3])
        out.append(f"{row['flow']}: of what the row began with, {lo['python_visible_bytes'] / g:.2f} GiB in "
                   f"{lo['tensors']} tensors with a Python object" + (f" (largest GiB: {big})" if big else ""))
    if row.get("peak_sites"):
        out.append(f"{row['flow']}: live at the recorded step's peak ({row['recorded_peak_bytes'] / g:.1f} GiB, "
                   f"{row['memory_profile']}): " + "; ".join(f"{x['bytes'] / g:.2f} GiB {x['site']}"
                                                             for x in row["peak_sites"][:3]))
    return out


def memory_once(fn, s: Settings, name: str) -> dict:
    """One more ``fn()`` with the CUDA allocator's history recorded: the live memory at its peak by
    the jetrl line that allocated it, written to ``DIR/NAME-memory.txt`` (``memory_profile``; the
    largest sites also in the row, ``peak_sites``)."""
    from .cuda_memory import HistoryUnavailable, format_composition, record_peak

    try:
        comp = record_peak(fn)
    except HistoryUnavailable as e:
        return {"memory_profile": f"not recorded: {e}"}
    path = os.path.join(s.profile_dir, _file_name(name) + "-memory.txt")
    os.makedirs(s.profile_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(format_composition(name, comp))
    os.replace(path + ".tmp", path)
    return {"memory_profile": path, "peak_sites": comp["sites"][:5], "recorded_peak_bytes": comp["peak_bytes"]}


ALLOCATOR_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_events(step) -> dict:
    """What CUDA's caching allocator did during one more ``step()`` (after the timed ones): its
    retries (an allocation that failed, freed the cache and tried again: a device-wide
    synchronisation), and its ``cudaMalloc`` / ``cudaFree`` calls (slow driver calls; ``cudaFree``
    waits for the device).
    A steady training step at a fixed shape should show none; a step near the memory limit shows
    them, and its time then includes waits the GPU's kernels do not account for."""
    before = torch.cuda.memory_stats()
    step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR_EVENTS}


def _unless_out_of_memory(s: Settings, name: str, common: dict, make_row) -> dict:
    """``make_row()``, or, when the device runs out of memory, a row saying so (``out_of_memory``:
    the error's first line); the bench goes on with the next row, its memory freed."""
    from .rl.trainer import _OOM, MicroBatchOutOfMemory

    try:
        return make_row()
    except (_OOM, MicroBatchOutOfMemory) as e:
        why = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    _free(s.device)  # after the except block: the traceback no longer holds the row's tensors
    s.say(f"train: {name}: out of memory")
    return {"flow": name, "out_of_memory": why, **common}


def _transformers_train_row(s: Settings, make, batch, adv, dev, common: dict) -> dict | None:
    """The baseline a user would write: the same model as a transformers model with fp32 master
    weights, bf16 autocast on CUDA (fp32 on CPU, where bf16 matmuls are ~40x slower), SDPA, fused
    AdamW (foreach on CPU), full-vocabulary log-softmax of the logits, policy-gradient loss."""
    if _transformers(s) is None:
        return None
    s.say("train: transformers")
    _free(s.device)
    return _unless_out_of_memory(s, TRANSFORMERS_FLOW, common,
                                 lambda: _transformers_row(s, make, batch, adv, dev, common))


def _transformers_row(s: Settings, make, batch, adv, dev, common: dict) -> dict:
    from .models.transformers_ref import transformers_twin

    cuda = s.device == "cuda"
    peaks = PhasePeaks(cuda)

    def setup():
        ours = make(dev)
        return transformers_twin(ours, torch.float32).train()

    hf = peaks("setup", setup)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, **({"fused": True} if cuda else {"foreach": True}))
    ids, mask, a = batch.ids.to(dev), batch.mask.to(dev).float(), adv.to(dev)
    mb = common["micro_batch"]

    def logp(rows: slice):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = hf(ids[rows]).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[rows, 1:, None])[..., 0]

    def one():
        for i in range(0, len(ids), mb):  # autograd adds the micro-batches' gradients
            rows = slice(i, i + mb)
            loss = -(logp(rows) * a[rows, None] * mask[rows]).sum() / mask.sum()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    tm = timed_train_steps(one, s, peaks, f"train-{TRANSFORMERS_FLOW}")
    alloc = allocator_events(one) if cuda else None
    saved, _ = peaks("saved-activations forward", lambda: _saved_bytes(lambda: logp(slice(0, mb)).sum()))
    n, t = common["batch"], common["seq"]
    row = {"flow": TRANSFORMERS_FLOW, "train": "bf16 autocast" if cuda else "fp32", "emulated": False, **tm,
           "tokens_per_s": n * t / tm["s"], "saved_activation_bytes": saved, **common, **peaks.row()}
    if cuda:
        row["allocator_per_step"] = alloc
    del hf, opt
    return row


# --------------------------------------------------------------------------- e2e


def e2e_unsupported(model: str, flows, layers: int | None) -> str | None:
    """Why ``bench e2e`` cannot run these settings (None: it can). It runs ``jetrl run`` on the named
    flows' presets: a model directory or the tiny policy, whole, never a random-weight shape."""
    from .models.shapes import SHAPES
    from .precision.flow import NAMED_FLOWS

    if model in SHAPES:
        return (f"it runs `jetrl run` on a model directory or 'tiny', not on a shape with random weights "
                f"(--model {model})")
    if layers is not None:
        return "it runs whole models (--layers applies to the rollout and train modes)"
    bad = [f for f in flows if f not in NAMED_FLOWS]
    if bad:
        return f"it runs the named flows only ({', '.join(NAMED_FLOWS)}), not {', '.join(bad)}"
    return None


def bench_e2e(s: Settings) -> list[dict]:
    import tempfile

    from .config import load_job_config
    from .rl.loop import run

    why = e2e_unsupported(s.model, s.flows, s.layers)
    if why is not None:
        raise JetrlError(f"bench e2e: {why}")
    rows = []
    keys = ("rollout_s", "score_s", "train_s", "sync_s", "step_s")
    for name in s.flows:
        preset = name if name != "int8-rollout" else "int8-rollout-tis"
        s.say(f"e2e: {s.e2e_steps} steps of {preset}")
        cfg = load_job_config(preset, [f"train.steps={s.e2e_steps}", "eval.every=0", "eval.prompts=1",
                                       "run.checkpoint_every=0", "run.save_rollouts=false",
                                       f"model.path={s.model}", f"model.device={s.device}"])
        with tempfile.TemporaryDirectory() as d:
            lines = [m for m in run(cfg, Path(d) / "run") if m["step"] > 0]
        steady = lines[1:] or lines  # the first step warms up
        row = {"flow": name, "preset": preset, "steps": len(lines), "emulated": s.device == "cpu"}
        for k in keys:  # step_s excludes the eval (the last step always evaluates; eval_s times it)
            row[k] = statistics.median(m[k] for m in steady)
        row["eval_s_excluded"] = True
        row["rollout_frac"] = row["rollout_s"] / row["step_s"]
        row["rollout_tokens_per_s"] = statistics.median(m["rollout_tokens_per_s"] for m in steady)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- driver


RUNNERS = {"gemm": bench_gemm, "quantize": bench_quantize, "attention": bench_attention, "rollout": bench_rollout,
           "train": bench_train, "e2e": bench_e2e}


_NOT_SETTINGS = ("progress", "partial_out", "rows_done", "not_run")

# What an allocation that cannot be served says: torch.OutOfMemoryError on a GPU; on CPU a RuntimeError from
# the allocator (c10's enforce, not OutOfMemoryError), or Python's MemoryError.
def _sizes_to_lower(mode: str, s: Settings) -> str:
    """What to lower: the options that size ``mode``'s tensors, with their values."""
    def shapes(given):
        return "--shapes " + ",".join("x".join(map(str, x)) for x in given)

    model = ", or use a smaller --model or fewer --layers" if mode in ("rollout", "train") else ""
    return "lower " + {
        "gemm": shapes([x[1:] for x in s.gemm_shapes]), "quantize": shapes(s.quant_shapes),
        "attention": shapes(s.attention_shapes), "rollout": f"--batch {s.batch} or --new-tokens {s.new_tokens}",
        "train": f"--seq {s.seq} or --train-batch {s.train_batch}"
                 + (f" or --micro-batch {s.micro_batch}" if s.micro_batch else ", give a --micro-batch"),
    }[mode] + model


def out_of_memory_error(mode: str, s: Settings, e: BaseException) -> JetrlError:
    """One line for a bench that ran out of memory: how much it asked for, and the options to lower."""
    import re

    msg = str(e)
    got = re.search(r"allocate (\d+) bytes", msg)
    gib = int(got.group(1)) / 2**30 if got else 0
    asked = ((f"{gib / 1024:.1f} TiB" if gib >= 1024 else f"{gib:.1f} GiB") if got else
             (re.search(r"allocate ([\d.]+ [KMGTP]iB)", msg) or [None, None])[1])
    what = f" (asked for {asked})" if asked else ""
    if mode == "e2e":
        return JetrlError(f"bench e2e: out of memory on {s.device}{what}: the shipped presets' runs on --model "
                          f"{s.model} do not fit; use a smaller --model")
    return JetrlError(f"bench {mode}: out of memory on {s.device}{what}: {_sizes_to_lower(mode, s)}")


def run_bench(modes: list[str], s: Settings) -> dict:
    res = {"env": environment(s.device), "settings": {k: v for k, v in s.__dict__.items() if k not in _NOT_SETTINGS},
           "results": {}}

    def partial(mode: str, rows: list[dict]) -> None:
        if s.partial_out is not None:
            write_json({**res, "results": {**res["results"], mode: rows}, "partial": True}, s.partial_out)

    s.rows_done = partial
    for m in modes:
        err = None
        try:
            res["results"][m] = RUNNERS[m](s)
        except Exception as e:  # only an allocation that failed is the user's (sizes too large)
            if not is_out_of_memory(e):
                raise
            err = out_of_memory_error(m, s, e)
        if err is not None:  # raised outside the except block, whose traceback holds the mode's tensors
            raise err
    if s.not_run:  # what ``all`` left out before it ran, and rows a mode found it could not run
        res["not_run"] = dict(s.not_run)
    res["targets"] = targets(res["results"], s.device)
    return res


def targets(results: dict, device: str) -> list[dict]:
    """The brief's targets, each with the measured value and whether it is met."""
    out = []
    tr = {r["flow"]: r for r in results.get("train", []) if "s" in r}  # rows that ran (not out of memory)
    if device == "cpu":
        if "bf16" in tr and "fp8-unified" in tr:
            v = tr["fp8-unified"]["step_vs_bf16"]
            out.append({"target": "fp8-unified train step <= 1.5x bf16 step (CPU, emulated)", "value": v,
                        "met": v <= CPU_TARGETS["train_fp8_vs_bf16_step"]})
        for r in results.get("rollout", []):
            if r["engine"] == "jetrl embedded" and r["flow"] == "fp32" and r.get("vs_generate"):
                v = r["vs_generate"]
                out.append({"target": f"embedded rollout >= 2x generate() tokens/s (fp32, {r['workload']} workload)",
                            "value": v, "met": v >= CPU_TARGETS["rollout_vs_generate"]})
    else:
        out += _gpu_targets(results)
    if "bf16" in tr and "fp8-unified" in tr:
        v = tr["fp8-unified"]["activations_vs_bf16"]
        out.append({"target": "fp8-unified saved activations <= 0.6x bf16 (same batch)", "value": v, "met": v <= 0.6})
    return out


def _big_shape(label: str) -> bool:
    return any(m in label.lower() for m in ("8b", "7b"))


def _gpu_targets(results: dict) -> list[dict]:
    """The GPU issues' targets on CUDA rows; a target whose rows were not measured is left out."""
    T = GPU_TARGETS
    out = []

    def add(name, value, met):
        out.append({"target": name, "value": value, "met": met})

    gemm = [r for r in results.get("gemm", []) if "vs_bf16" in r and r.get("accuracy_ok", True)
            and r["backend"] not in ("torch", "invariant") and r["M"] >= 4096 and _big_shape(r["shape"])]
    for variant, key, what in (("fp8 1x128 x 128x128", "gemm_blockwise_vs_bf16", "blockwise FP8 GEMM (Fprop/Dgrad)"),
                               ("fp8 1x128 x 1x128 (wgrad)", "gemm_wgrad_vs_bf16", "blockwise FP8 Wgrad GEMM")):
        best: dict[str, float] = {}  # shape -> its fastest backend (what `auto` picks)
        for r in gemm:
            if r["variant"] == variant:
                best[r["shape"]] = max(best.get(r["shape"], 0.0), r["vs_bf16"])
        if best:
            v = min(best.values())
            add(f"{what} >= {T[key]}x cuBLAS BF16 (M=4096, 7-8B shapes, worst shape)", v, v >= T[key])
    q = [r for r in results.get("quantize", []) if r.get("backend") == "triton" and r.get("kind") != "transpose"]
    # the kernels' speed: their CUDA-graph replays where every row has one (a training step replays them
    # so, `train.cuda_graphs`), else the back-to-back calls, which include the host's launches
    key = "graph_vs_copy" if q and all("graph_vs_copy" in r for r in q) else "vs_copy"
    if any("warps" in r for r in q):  # a --warps sweep: each kernel at its fastest setting
        best: dict[tuple, float] = {}
        for r in q:
            best[(r["shape"], r["quantizer"])] = max(best.get((r["shape"], r["quantizer"]), 0.0), r[key])
        q = [{key: v} for v in best.values()]
    if q:
        v = min(r[key] for r in q)
        how = ", kernels replayed from a CUDA graph" if key == "graph_vs_copy" else ""
        add(f"every Triton quantizer >= {T['quantize_vs_copy']}x copy bandwidth (worst{how})", v,
            v >= T["quantize_vs_copy"])
    tr = {r["flow"]: r for r in results.get("train", []) if "s" in r}
    bf = tr.get("bf16")
    hf_oom = any(r["flow"] == TRANSFORMERS_FLOW and "out_of_memory" in r for r in results.get("train", []))
    if bf and hf_oom:  # the baseline did not fit where bf16 did
        add("bf16 train peak memory <= the transformers row's (transformers ran out of memory)", None, True)
    for r in results.get("train", []):  # does the batch fit (16 x 512 at the 1.5B shape is a target)
        if r["flow"] != TRANSFORMERS_FLOW and ("out_of_memory" in r or r.get("peak_memory_bytes")):
            fits = "out_of_memory" not in r
            add(f"{r['flow']} trains {r['batch']} x {r['seq']} tokens of {r['model']} on this GPU"
                + (" (peak GiB)" if fits else ""), r["peak_memory_bytes"] / 2**30 if fits else None, fits)
    if bf and bf.get("step_vs_transformers"):
        v = bf["step_vs_transformers"]
        add("bf16 train step <= the transformers row's", v, v <= T["bf16_step_vs_transformers"])
        if bf.get("peak_vs_transformers"):
            v = bf["peak_vs_transformers"]
            add("bf16 train peak memory <= the transformers row's", v, v <= 1.0)
    if bf and "fp8-unified" in tr:
        key = "train_speedup_7b" if _big_shape(bf["model"]) else "train_speedup"
        v = 1 / tr["fp8-unified"]["step_vs_bf16"]
        add(f"fp8-unified train step >= {T[key]}x faster than bf16 ({bf['model']})", v, v >= T[key])
    if "bf16+graphs" in tr and "fp8-unified+graphs" in tr:  # both flows with their layers as CUDA graphs
        key = "train_speedup_7b" if _big_shape(tr["bf16+graphs"]["model"]) else "train_speedup"
        v = tr["bf16+graphs"]["s"] / tr["fp8-unified+graphs"]["s"]
        add(f"fp8-unified+graphs train step >= {T[key]}x faster than bf16+graphs ({tr['bf16+graphs']['model']})",
            v, v >= T[key])
    for name in tr:
        fast = _without_invariant(name)
        if fast != name and fast in tr:
            v = tr[name]["s"] / tr[fast]["s"]
            add(f"{name} train step <= {T['invariant_cost']}x the fast path's ({fast})", v, v <= T["invariant_cost"])
    rollout = results.get("rollout", [])
    for wl in dict.fromkeys(r.get("workload") for r in rollout):
        rows = [r for r in rollout if r.get("workload") == wl]
        emb = {r["flow"]: r for r in rows if r["engine"] == "jetrl embedded"}
        static = next((r for r in rows if r["engine"] == "transformers generate(), static cache"), None)
        if "bf16" in emb and static:
            v = emb["bf16"]["tokens_per_s"] / static["tokens_per_s"]
            add(f"embedded bf16 rollout >= static-cache generate() ({wl})", v, v >= T["rollout_bf16_vs_static_generate"])
        if "bf16" not in emb:
            continue
        for name, key in (("fp8-rollout", "rollout_fp8_vs_bf16"), ("int8-rollout", "rollout_int8_vs_bf16")):
            if name in emb:
                v = emb[name]["tokens_per_s"] / emb["bf16"]["tokens_per_s"]
                add(f"{name} rollout >= {T[key]}x embedded bf16 ({wl})", v, v >= T[key])
        for name in emb:
            if _without_invariant(name) != name and _without_invariant(name) in emb:
                v = emb[_without_invariant(name)]["tokens_per_s"] / emb[name]["tokens_per_s"]
                add(f"{name} rollout time <= {T['invariant_cost']}x the fast path's ({wl})", v, v <= T["invariant_cost"])
    for r in results.get("e2e", []):
        if r.get("step_s"):
            v = r["sync_s"] / r["step_s"]
            add(f"{r['flow']} weight sync <= {T['sync_frac']:.0%} of an RL step", v, v <= T["sync_frac"])
    return out


def append_history(res: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(res) + "\n")


def write_json(res: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- tables


def _print_backends(console, rows: list[dict]) -> None:
    """The GEMM backends and kernel choices the rows report (``gemm_backends``), each line once."""
    from rich.markup import escape

    from .live import backend_lines

    seen = set()
    for x in rows:
        for line in backend_lines(x.get("gemm_backends")):
            if line not in seen:
                seen.add(line)
                console.print(escape(line), highlight=False)


def _f(v, fmt="{:.3g}") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return fmt.format(v)


def render(res: dict, console) -> None:
    from rich.table import Table

    from rich.markup import escape

    from .tables import print_table

    env = res["env"]
    where = env.get("device_name") or env.get("cpu") or env["machine"]
    console.print("[bold]jetrl bench[/] " + escape(f"{env['date']} · {env['device']} ({where}) · {env['threads']} "
                  f"threads · torch {env['torch']}"), highlight=False)
    r = res["results"]
    if "gemm" in r:
        t = Table(title="gemm: a @ b.T (time per GEMM; accuracy vs float64 of the unquantized operands)",
                  title_justify="left")
        t.add_column("shape", no_wrap=True)
        t.add_column("variant @ backend", no_wrap=True)
        graphs = any("graph_s" in x for x in r["gemm"])  # decode rows on a GPU: also replayed from a graph
        for c in ("ms", "TFLOP/s", "vs bf16", *(("graph ms", "graph vs bf16") if graphs else ()), "rel err", "SQNR dB",
                  "kernel err", "ok"):
            t.add_column(c, justify="right")
        for x in r["gemm"]:
            if "skipped" in x:
                continue
            mnk = f"{x['M']}x{x['N']}x{x['K']}"
            shape = x["shape"] if x["shape"] == mnk else f"{x['shape']} {mnk}"
            variant = x["variant"] if x["backend"] == "torch" else f"{x['variant']} @ {x['backend']}"
            g = ((f"{1e3 * x['graph_s']:.4f}", f"{x['graph_vs_bf16']:.2f}x") if "graph_s" in x else ("-", "-")) \
                if graphs else ()
            t.add_row(shape, variant, f"{1e3 * x['s']:.2f}", f"{x['tflops']:.3f}", f"{x['vs_bf16']:.2f}x", *g,
                      f"{x['rel_err']:.1e}", f"{x['sqnr_db']:.1f}", f"{x['kernel_rel_err']:.0e}", _f(x["accuracy_ok"]))
        print_table(console, t, keep=2)
        skipped = {(x["variant"], x["backend"]): x["skipped"] for x in r["gemm"] if "skipped" in x}
        for (variant, backend), why in skipped.items():
            console.print(escape(f"not run: {variant} @ {backend}: {why}"), highlight=False)
    if "quantize" in r:
        t = Table(title="quantize: bandwidth vs a copy of the same tensor", title_justify="left")
        s_warps = len({x["warps"] for x in r["quantize"] if "warps" in x}) > 1  # a --warps sweep
        graphs = any("graph_s" in x for x in r["quantize"])  # a GPU: the kernels replayed from a CUDA graph too
        for c in ("shape", "quantizer", "dtype", "ms", "GB/s", "vs copy",
                  *(("replayed ms", "replayed vs copy") if graphs else ()), "SQNR dB"):
            t.add_column(c, justify="left" if c in ("shape", "quantizer", "dtype") else "right")
        for x in r["quantize"]:
            how = [f"{x['warps']} warps"] if "warps" in x and s_warps else []
            where = (f" @ {x['backend']}" if x.get("kind") in ("transpose", "W^T") else
                     " @ triton" + (f" ({', '.join(how)})" if how else "") if x.get("backend") == "triton" else "")
            replay = ((_f(x.get("graph_s") and 1e3 * x["graph_s"], "{:.3f}"), _f(x.get("graph_vs_copy"), "{:.2f}"))
                      if graphs else ())
            t.add_row(x["shape"], x["quantizer"] + where, x["dtype"], f"{1e3 * x['s']:.3f}", f"{x['gb_per_s']:.1f}",
                      f"{x['vs_copy']:.2f}", *replay, _f(x.get("sqnr_db"), "{:.1f}"))
        print_table(console, t, keep=2)
    if "attention" in r:
        stores = [x for x in r["attention"] if x.get("kind") == "store"]
        xs = [x for x in r["attention"] if "skipped" not in x and x.get("kind") != "store"]
        if xs:
            x0 = xs[0]
            t = Table(title=escape(f"attention: one decode step, one layer, {x0['model']} ({x0['heads']} heads, "
                                   f"{x0['kv_heads']} KV heads, d={x0['head_dim']}); batch x key width"),
                      title_justify="left")
            for c in ("shape", "variant", "ms", "cache GB/s", "vs bf16 SDPA", "rel err", "ok"):
                t.add_column(c, justify="left" if c in ("shape", "variant") else "right", no_wrap=c == "variant")
            for x in xs:
                t.add_row(x["shape"], x["variant"] + (" (CPU)" if x["emulated"] else ""), f"{1e3 * x['s']:.3f}",
                          f"{x['gb_per_s']:.1f}", f"{x['vs_sdpa_bf16']:.2f}x", f"{x['rel_err']:.1e}",
                          _f(x["accuracy_ok"]))
            print_table(console, t, keep=2)
        if stores:
            t = Table(title="kv store: one decode step's new keys into one layer's cache (per tensor)",
                      title_justify="left")
            for c in ("shape", "variant", "ms", "vs bf16 store", "= reference"):
                t.add_column(c, justify="left" if c in ("shape", "variant") else "right", no_wrap=c == "variant")
            for x in stores:
                t.add_row(x["shape"], x["variant"] + (" (CPU)" if x["emulated"] else ""), f"{1e3 * x['s']:.3f}",
                          f"{x['vs_bf16_store']:.2f}x", _f(x["matches_reference"]))
            print_table(console, t, keep=2)
        for why in dict.fromkeys(x["skipped"] for x in r["attention"] if "skipped" in x):
            console.print(escape(f"not run: the Triton attention kernels: {why}"), highlight=False)
    if "rollout" in r:
        for wl in dict.fromkeys(x["workload"] for x in r["rollout"]):
            xs = [x for x in r["rollout"] if x["workload"] == wl]
            x0 = xs[0]
            title = (f"rollout: {x0['model']}, batch {x0['batch']}, prompt {x0['prompt']}, {x0['new_tokens']} new tokens"
                     if wl == "fixed" else f"rollout: {x0['model']}, {wl}")
            t = Table(title=escape(title), title_justify="left")
            for c in ("engine", "flow", "s", "spread", "tokens/s", "vs generate()", "vs bf16", "TTFT ms", "sync s",
                      "KV B/token", "weights MiB", "run peak MiB", "CUDA graphs"):
                t.add_column(c, justify="left" if c in ("engine", "flow", "CUDA graphs") else "right",
                             no_wrap=c in ("engine", "flow"))
            for x in xs:
                flow = x["flow"] + (" (emul.)" if x["emulated"] else "")
                t.add_row(x["engine"], flow, f"{x['s']:.3f}", f"{x['spread_s']:.3f}", f"{x['tokens_per_s']:.0f}",
                          _f(x["vs_generate"], "{:.2f}x"), _f(x["vs_bf16"], "{:.2f}x"),
                          _f(x.get("ttft_s") and 1e3 * x["ttft_s"], "{:.1f}"), _f(x.get("sync_s"), "{:.4f}"),
                          _f(x.get("kv_bytes_per_token"), "{:.0f}"),
                          _f(x.get("weight_bytes") and x["weight_bytes"] / 2**20, "{:.1f}"),
                          _f(x.get("peak_memory_bytes") and x["peak_memory_bytes"] / 2**20, "{:.0f}"),
                          x.get("cuda_graphs", "-"))
            print_table(console, t, keep=2)
            for x in xs:
                if x.get("kv_attention"):
                    console.print(escape(f"{x['flow']}: decode attention over its KV cache: {x['kv_attention']}"),
                                  highlight=False)
        _print_backends(console, r["rollout"])
    if "train" in r:
        x0 = r["train"][0]
        micro = x0.get("micro_batch", x0["batch"])
        per = f" in micro-batches of {micro}" if micro < x0["batch"] else ""
        t = Table(title=escape(f"train: one GRPO update, {x0['model']}, {x0['batch']} x {x0['seq']} tokens{per}"),
                  title_justify="left")
        for c in ("flow", "fprop", "step s", "spread", "tokens/s", "step vs bf16", "step vs HF", "saved act MiB",
                  "act vs bf16", "peak MiB", "peak vs HF"):
            t.add_column(c, justify="left" if c in ("flow", "fprop") else "right")
        for x in r["train"]:
            if "out_of_memory" in x:
                t.add_row(x["flow"], "-", "out of memory", *["-"] * 8)
                continue
            t.add_row(x["flow"] + (" (emul.)" if x["emulated"] else ""), x["train"], f"{x['s']:.3f}",
                      f"{x['spread_s']:.3f}", f"{x['tokens_per_s']:.0f}", _f(x["step_vs_bf16"], "{:.2f}x"),
                      _f(x.get("step_vs_transformers"), "{:.2f}x"),
                      f"{x['saved_activation_bytes'] / 2**20:.2f}", _f(x["activations_vs_bf16"], "{:.2f}x"),
                      _f(x.get("peak_memory_bytes") and x["peak_memory_bytes"] / 2**20, "{:.0f}"),
                      _f(x.get("peak_vs_transformers"), "{:.2f}x"))
        print_table(console, t, keep=1)
        for x in r["train"]:
            if "out_of_memory" in x:
                console.print(escape(f"{x['flow']}: out of memory: {x['out_of_memory']}"), highlight=False)
            ev = x.get("allocator_per_step") or {}
            if any(ev.values()):  # a step that makes the allocator wait (see allocator_events)
                console.print(escape(f"{x['flow']}: per step, the CUDA allocator retried {ev.get('num_alloc_retries', 0)}"
                                     f" allocations, called cudaMalloc {ev.get('num_device_alloc', 0)} and cudaFree "
                                     f"{ev.get('num_device_free', 0)} times"), highlight=False)
            if x.get("train_graphs"):
                first = f" (first update, captures included: {x['first_update_s']:.2f} s)" if "first_update_s" in x else ""
                console.print(escape(f"{x['flow']}: decoder layers as CUDA graphs: {x['train_graphs']}{first}"),
                              highlight=False)
            for line in peak_lines(x):
                console.print(escape(line), highlight=False)
        _print_backends(console, r["train"])
    if "e2e" in r:
        t = Table(title="e2e: jetrl run, median seconds per step (eval excluded)", title_justify="left")
        for c in ("flow", "steps", "rollout", "score", "train", "sync", "step", "rollout share", "rollout tok/s"):
            t.add_column(c, justify="left" if c == "flow" else "right")
        for x in r["e2e"]:
            t.add_row(x["flow"] + (" (emul.)" if x["emulated"] else ""), str(x["steps"]), f"{x['rollout_s']:.2f}",
                      f"{x['score_s']:.2f}", f"{x['train_s']:.2f}", f"{x['sync_s']:.3f}", f"{x['step_s']:.2f}",
                      f"{100 * x['rollout_frac']:.0f}%", f"{x['rollout_tokens_per_s']:.0f}")
        print_table(console, t, keep=1)
    for mode, why in res.get("not_run", {}).items():
        console.print(escape(f"not run: {mode}: {why}"), highlight=False)
    for tg in res["targets"]:
        style = "green" if tg["met"] else "yellow"
        measured = "" if tg["value"] is None else f": measured {tg['value']:.2f}"
        console.print(f"[{style}]target {'met' if tg['met'] else 'missed'}[/]: " + escape(f"{tg['target']}{measured}"),
                      highlight=False)
    if res["env"]["device"] == "cpu":
        console.print("[dim]CPU: FP8/INT8 and BF16 are emulated (fp32 matmuls on rounded values); ratios here are "
                      "not FP8 hardware speed-ups.[/]")
