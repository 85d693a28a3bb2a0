"""Hardware counters of jetrl's slowest GPU kernels, for a GPU lease: why a kernel runs at the speed it does.

The H200 timed the quantizers at 0.2-0.8x of a copy's bandwidth, the SwiGLU backward's 128x1 kernel at
0.78 TB/s, a decode step's FP8 GEMM below cuBLAS bf16 with half its bytes (``docs/benchmarks.md``); the
sessions without a GPU could only count instructions (``quantizer_issue_time.py``) and guess whether a
kernel waits on memory, on its instructions, on shared-memory bank conflicts or on too few warps. Nsight
Compute (``ncu``) reads the answer off the hardware's counters, and the H200 machines lent here run it
(``--clock-control none``: their clocks are left alone). ``.ci/gpu counters`` runs this:

    ncu --clock-control none --profile-from-start off --set full -f -o runs/counters \\
        python3 docs/experiments/kernel_counters.py --manifest runs/counters.json
    ncu --import runs/counters.ncu-rep --csv --page raw --print-units base > runs/counters-raw.csv
    python3 docs/experiments/kernel_counters.py --summarize runs/counters-raw.csv --manifest runs/counters.json

Each case (a kernel variant at the shape where it was measured slow: a 1.5B training step's 16 x 512
tokens, a rollout's 32- and 256-row decode steps) is built, run once to compile it, and then run once more
between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that ``--profile-from-start off`` profiles
those launches only. Every variant is forced (warps, tiles, split, swap, W^T's way): no timed choice runs,
and what is profiled is what the case names. Before each case's launches a one-program marker kernel
(``_case_marker``, a grid of case index + 1 programs) is profiled too: ``--summarize`` splits ncu's rows
into cases at the markers. Its table: per kernel the device time, DRAM bytes moved and throughput (against
the bytes the case must move at least: each input read once, each output written once), achieved
occupancy, registers, shared-memory bank conflicts and the three largest stall reasons.

    python3 docs/experiments/kernel_counters.py --list                 # the cases
    TRITON_INTERPRET=1 python3 docs/experiments/kernel_counters.py --small --device cpu   # every case, tiny
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _case_marker(out_ptr):
    """A case's first launch: ``--summarize`` reads the case's index off the grid (index + 1 programs)."""
    tl.store(out_ptr + tl.program_id(0), tl.program_id(0))


@dataclass
class Shapes:
    tokens: int = 8192  # a training step's tokens (16 x 512)
    hidden: int = 1536  # Qwen2.5-1.5B
    inter: int = 8960
    decode: int = 32  # a rollout's decode rows
    wide: int = 256  # an RL batch's decode rows (rollout.max_batch)
    heads: int = 12
    kv_heads: int = 2
    head_dim: int = 128
    width: int = 512  # keys per sequence in the attention cases
    vocab: int = 151936


SMALL = Shapes(tokens=256, hidden=256, inter=384, decode=32, wide=128, heads=4, kv_heads=2, head_dim=128, width=64,
               vocab=4096)


@dataclass
class Case:
    name: str
    group: str  # "train", "decode", "invariant", "baseline"
    build: object  # build(shapes, device) -> (run, bytes it must move at least)
    cuda_only: str | None = None  # why it cannot run in Triton's interpreter


def _randn(*shape, device, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _fp8():
    from jetrl_cli.kernels import fp8

    return fp8


def _specs():
    from jetrl_cli.precision.formats import Block, Format
    from jetrl_cli.precision.quant import CastSpec

    e4 = Format.FP8_E4M3
    return {"1x128": CastSpec(e4, Block(1, 128)), "128x1": CastSpec(e4, Block(128, 1)),
            "int8 row": CastSpec(Format.INT8, Block(1, 0)), "row": CastSpec(e4, Block.parse("row"))}


def _nbytes(*ts) -> int:
    """Bytes of tensors and QTensors (data and scales); None counts nothing."""
    return sum(t.nbytes() if hasattr(t, "scale") else t.numel() * t.element_size() for t in ts if t is not None)


def _forced(ctx_fn, fn):
    """``fn`` run inside the contexts ``ctx_fn()`` makes (one, or a tuple: forced warps / ways / orders)."""
    def run():
        cms = ctx_fn()
        with contextlib.ExitStack() as stack:
            for cm in cms if isinstance(cms, tuple) else (cms,):
                stack.enter_context(cm)
            return fn()
    return run


# --- training-step quantizers (1.5B, 16 x 512 tokens) ------------------------------------------------


def _copy(s, dev):
    x = _randn(s.tokens, s.inter, device=dev)
    y = torch.empty_like(x)
    return (lambda: y.copy_(x)), 2 * _nbytes(x)


def _act_pair(one_kernel: bool, warps: int = 8):
    def build(s, dev):
        fp8 = _fp8()
        x = _randn(s.tokens, s.hidden, device=dev)
        run = _forced(lambda: fp8.tile_warps(warps, one_kernel=one_kernel),
                      lambda: fp8.quantize_act(x, pad_tokens_to=128))
        return run, _nbytes(x, *run())
    return build


def _act_cols(s, dev):
    fp8 = _fp8()
    x = _randn(s.tokens, s.hidden, device=dev)
    run = _forced(lambda: fp8.tile_warps(8), lambda: fp8.quantize_act(x, rows=False, pad_tokens_to=128))
    return run, _nbytes(x, *run())


def _swiglu_fwd(s, dev):
    fp8 = _fp8()
    gu = _randn(s.tokens, 2 * s.inter, device=dev)
    h, copy = fp8.swiglu_quantize(gu, save=True)
    return (lambda: fp8.swiglu_quantize(gu, save=True)), _nbytes(gu, h, copy)


def _swiglu_bwd(one_kernel: bool, warps: int):
    def build(s, dev):
        fp8 = _fp8()
        gu = _randn(s.tokens, 2 * s.inter, device=dev)
        _, copy = fp8.swiglu_quantize(gu, save=True)
        gy = _randn(s.tokens, s.inter, device=dev, scale=0.01)

        run = _forced(lambda: fp8.tile_warps(warps, one_kernel=one_kernel),
                      lambda: fp8.swiglu_grad_quantize(copy, gy, torch.bfloat16, pad_tokens_to=128, h_cols=True))
        return run, _nbytes(copy, gy, *run())
    return build


def _norm_train(s, dev):
    fp8 = _fp8()
    x = _randn(s.tokens, s.hidden, device=dev, dtype=torch.float32)  # the fp32 residual stream
    d = _randn(s.tokens, s.hidden, device=dev)  # a layer's bf16 output added to it
    w = _randn(s.hidden, device=dev, dtype=torch.float32)

    def run():
        return fp8.rms_norm_quantize(x, d, w, 1e-6, torch.bfloat16, write_y=True, rsqrt=True)
    return run, _nbytes(x, d, w, *[o for o in run() if isinstance(o, torch.Tensor) or hasattr(o, "scale")])


def _weight(way: str):
    def build(s, dev):
        fp8 = _fp8()
        w = _randn(s.inter, s.hidden, device=dev, dtype=torch.float32, scale=0.02)
        run = _forced(lambda: (fp8.wt_with(way), fp8.transpose_with("triton-n-first")),
                      lambda: fp8.quantize_weight(w, transposed=True))
        return run, _nbytes(w, *run())
    return build


def _transpose(order: str):
    def build(s, dev):
        fp8 = _fp8()
        src = torch.randint(0, 256, (s.inter, s.hidden), dtype=torch.uint8, device=dev)
        dst = torch.empty((s.hidden, s.inter), dtype=torch.uint8, device=dev)
        return _forced(lambda: fp8.transpose_with(order), lambda: fp8.transpose_bytes_(dst, src)), 2 * _nbytes(src)
    return build


# --- a rollout's decode GEMMs (32 and 256 rows) --------------------------------------------------------


def _gemm_operands(m: int, n: int, k: int, dev, kind: str = "fp8"):
    x = _randn(m, k, device=dev)
    w = _randn(n, k, device=dev, dtype=torch.float32, scale=0.02)
    if kind == "int8":
        from jetrl_cli.kernels import int8

        spec = _specs()["int8 row"]
        return x, w, int8.quantize_rows(x, spec), int8.quantize_rows(w, spec)
    fp8 = _fp8()
    return x, w, fp8.quantize_act(x, cols=False)[0], fp8.quantize_weight(w)


def _shape(s, which: str, rows: int) -> tuple[int, int, int]:
    return {"gate/up": (rows, 2 * s.inter, s.hidden), "down": (rows, s.hidden, s.inter),
            "q/k/v": (rows, s.hidden + 2 * s.kv_heads * s.head_dim, s.hidden)}[which]


def _bf16_mm(which: str, wide: bool = False):
    def build(s, dev):
        m, n, k = _shape(s, which, s.wide if wide else s.decode)
        x, w = _randn(m, k, device=dev), _randn(n, k, device=dev, scale=0.02)
        return (lambda: x @ w.t()), _nbytes(x, w) + m * n * 2
    return build


def _fp8_mm(which: str, swap: bool, wide: bool = False, split: int = 1):
    def build(s, dev):
        fp8 = _fp8()
        m, n, k = _shape(s, which, s.wide if wide else s.decode)
        _, _, a, b = _gemm_operands(m, n, k, dev)
        tiles = fp8.MID_TILES["fp8"][0] if wide else (fp8.swap_tiles(m) if swap else fp8.decode_tiles(m, n))
        return (lambda: fp8.blockwise_mm(a, b, torch.bfloat16, tiles=tiles, split=split, fused=False, swap=swap)), \
            _nbytes(a, b) + m * n * 2
    return build


def _scaled_mm(which: str, wide: bool = False):
    def build(s, dev):
        from jetrl_cli.precision.formats import Format
        from jetrl_cli.precision.gemm import ScaledMMBackend

        m, n, k = _shape(s, which, s.wide if wide else s.decode)
        _, _, a, b = _gemm_operands(m, n, k, dev)
        be = ScaledMMBackend()
        return (lambda: be.mm(a, b, Format.BF16)), _nbytes(a, b) + m * n * 2
    return build


def _int8_mm(which: str, wide: bool = True, tiles: int = 0, split: int = 1):
    """``int8_mm`` on ``MID_TILES["int8"][tiles]`` (wide) or the decode tiles, at ``split``."""
    def build(s, dev):
        from jetrl_cli.kernels import int8

        fp8 = _fp8()
        m, n, k = _shape(s, which, s.wide if wide else s.decode)
        _, _, a, b = _gemm_operands(m, n, k, dev, "int8")
        t = fp8.MID_TILES["int8"][tiles] if wide else fp8.decode_tiles(m, n)
        return (lambda: int8.int8_mm(a, b, torch.bfloat16, split=split, tiles=t, swap=False)), \
            _nbytes(a, b) + m * n * 2
    return build


def _int_mm(which: str):
    def build(s, dev):
        m, n, k = _shape(s, which, s.wide)
        _, _, a, b = _gemm_operands(m, n, k, dev, "int8")
        bt = b.data.t()
        return (lambda: torch._int_mm(a.data, bt)), _nbytes(a.data, b.data) + m * n * 4
    return build


def _norm_decode(s, dev):
    fp8 = _fp8()
    x, d = _randn(s.decode, s.hidden, device=dev), _randn(s.decode, s.hidden, device=dev)
    w = _randn(s.hidden, device=dev)

    def run():
        return fp8.rms_norm_quantize(x, d, w, 1e-6, torch.bfloat16)
    return run, _nbytes(x, d, w, *[o for o in run() if isinstance(o, torch.Tensor) or hasattr(o, "scale")])


def _attention(invariant: bool):
    def build(s, dev):
        b = s.decode
        q = _randn(b, s.heads, 1, s.head_dim, device=dev)
        k, v = (_randn(b, s.kv_heads, s.width, s.head_dim, device=dev) for _ in range(2))
        pos = torch.full((b,), s.width - 1, device=dev, dtype=torch.int64)
        if invariant:
            from jetrl_cli.kernels.invariant import invariant_attention

            p2 = pos[:, None]
            return (lambda: invariant_attention(q, k, v, p2, check_positions=False)), _nbytes(q, k, v, q)
        from jetrl_cli.kernels.attention import decode_attention

        return (lambda: decode_attention(q, k, v, pos)), _nbytes(q, k, v, q)
    return build


def _attention_fp8_cache(s, dev):
    from jetrl_cli.kernels.attention import decode_attention
    from jetrl_cli.precision.quant import quantize

    spec = _specs()["row"]
    b = s.decode
    q = _randn(b, s.heads, 1, s.head_dim, device=dev)
    kv = [quantize(_randn(b * s.kv_heads * s.width, s.head_dim, device=dev, dtype=torch.float32), spec)
          for _ in range(2)]
    (kd, ks), (vd, vs) = ((t.data.reshape(b, s.kv_heads, s.width, s.head_dim), t.scale.reshape(b, s.kv_heads, s.width))
                          for t in kv)
    pos = torch.full((b,), s.width - 1, device=dev, dtype=torch.int64)

    def run():
        return decode_attention(q, kd, vd, pos, kv_scales=(ks, vs), quantize_out=_specs()["1x128"])
    out = run()
    return run, _nbytes(q, kd, vd, ks, vs, out)


def _sampling(s, dev):
    from jetrl_cli.kernels.sampling import keyed_gumbel_argmax

    logp = torch.log_softmax(torch.randn(s.wide, s.vocab, device=dev), dim=-1)
    keys = torch.randint(0, 2**32, (s.wide,), device=dev, dtype=torch.int64)
    return (lambda: keyed_gumbel_argmax(logp, keys, 12345)), _nbytes(logp, keys)


def _invariant_mm(which: str):
    def build(s, dev):
        from jetrl_cli.kernels.invariant import invariant_mm

        m, n, k = _shape(s, which, s.decode)
        x, w = _randn(m, k, device=dev), _randn(n, k, device=dev, scale=0.02)
        return (lambda: invariant_mm(x, w, out_dtype=torch.bfloat16, _fused=False)), _nbytes(x, w) + m * n * 2
    return build


_CUDA = "torch's _scaled_mm / _int_mm blockwise and INT8 run on CUDA only"

CASES = [
    Case("copy bf16 T x I (the bandwidth ceiling)", "baseline", _copy),
    Case("act 1x128 + 128x1, one kernel, 8 warps (T x hidden)", "train", _act_pair(True)),
    Case("act 1x128 + 128x1, two kernels, 8 warps", "train", _act_pair(False)),
    Case("act 128x1 only, 8 warps", "train", _act_cols),
    Case("SwiGLU forward + [g, u] copy (T x 2I)", "train", _swiglu_fwd),
    Case("SwiGLU backward, two kernels, 8 warps", "train", _swiglu_bwd(False, 8)),
    Case("SwiGLU backward, two kernels, 4 warps", "train", _swiglu_bwd(False, 4)),
    Case("SwiGLU backward, one kernel, 8 warps", "train", _swiglu_bwd(True, 8)),
    Case("RMSNorm + add + 1x128, training form (fp32 residual)", "train", _norm_train),
    Case("weight 128x128 + W^T by the quantizer (I x hidden fp32)", "train", _weight("quantizer")),
    Case("weight 128x128 + W^T transposed after", "train", _weight("after")),
    Case("W^T byte transpose, triton-n-first", "train", _transpose("triton-n-first")),
    Case("bf16 cuBLAS, decode gate/up", "decode", _bf16_mm("gate/up")),
    Case("FP8 Triton, decode gate/up, plain tiles", "decode", _fp8_mm("gate/up", swap=False)),
    Case("FP8 Triton, decode gate/up, b @ a.T tiles", "decode", _fp8_mm("gate/up", swap=True)),
    Case("FP8 _scaled_mm blockwise, decode gate/up", "decode", _scaled_mm("gate/up"), cuda_only=_CUDA),
    Case("bf16 cuBLAS, decode down", "decode", _bf16_mm("down")),
    Case("FP8 Triton, decode down, b @ a.T tiles", "decode", _fp8_mm("down", swap=True)),
    Case("FP8 Triton, decode down, b @ a.T tiles, 4 splits", "decode", _fp8_mm("down", swap=True, split=4)),
    Case("RMSNorm + add + 1x128, decode form", "decode", _norm_decode),
    Case("bf16 cuBLAS, wide decode gate/up", "decode", _bf16_mm("gate/up", wide=True)),
    Case("FP8 Triton, wide decode gate/up, default mid tiles", "decode", _fp8_mm("gate/up", False, wide=True)),
    Case("FP8 _scaled_mm blockwise, wide decode gate/up", "decode", _scaled_mm("gate/up", wide=True), cuda_only=_CUDA),
    Case("INT8 Triton, wide decode gate/up, default mid tiles", "decode", _int8_mm("gate/up")),
    Case("INT8 torch._int_mm, wide decode gate/up", "decode", _int_mm("gate/up"), cuda_only=_CUDA),
    # a 1.5B model's down_proj at 256 rows on the default 128 x 128 INT8 tiles: 24 programs, each over 70 K blocks
    Case("INT8 Triton, wide decode down, default mid tiles", "decode", _int8_mm("down")),
    Case("INT8 Triton, wide decode down, 64 x 64 tiles, 4 splits", "decode", _int8_mm("down", tiles=2, split=4)),
    Case("INT8 torch._int_mm, wide decode down", "decode", _int_mm("down"), cuda_only=_CUDA),
    Case("attention, decode (fast path)", "decode", _attention(False)),
    Case("attention, decode, FP8 cache read as stored, writing o_proj's FP8 input", "decode", _attention_fp8_cache),
    Case("keyed Gumbel-max sampling, wide decode (rows x vocab)", "decode", _sampling),
    Case("attention, decode (batch-invariant)", "invariant", _attention(True)),
    Case("invariant GEMM bf16, decode gate/up", "invariant", _invariant_mm("gate/up")),
    Case("invariant GEMM bf16, decode down (split K, two kernels)", "invariant", _invariant_mm("down")),
]


def run_cases(shapes: Shapes, device: torch.device, only: str | None, manifest: str | None) -> list[dict]:
    """Build and warm every case, then run each once between cudaProfilerStart/Stop, a marker first."""
    cases = [(i, c) for i, c in enumerate(CASES) if only is None or re.search(only, c.name)]
    built, skipped = [], []
    for i, c in cases:
        if c.cuda_only and device.type != "cuda":
            skipped.append({"index": i, "case": c.name, "skipped": c.cuda_only})
            continue
        try:
            with _fp8().tile_warps(8):  # the operands' quantizers at a fixed launch: no timed choice in the set-up
                run, moved = c.build(shapes, device)
            run()  # compile, and the first call's allocations
        except Exception as e:  # noqa: BLE001 - one case that cannot run says why; the rest still run
            skipped.append({"index": i, "case": c.name, "skipped": f"{type(e).__name__}: {e}"})
            continue
        built.append((i, c, run, moved))
        print(f"built {i:2d} {c.name}", flush=True)
    marker = torch.zeros(len(CASES) + 1, dtype=torch.int32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.profiler.start()
    failed = set()
    for i, c, run, _ in built:
        _case_marker[(i + 1,)](marker)
        try:
            run()
            sync()
        except Exception as e:  # noqa: BLE001 - ran in the warm-up, not here: said, and the others still run
            failed.add(i)
            skipped.append({"index": i, "case": c.name, "skipped": f"profiled run: {type(e).__name__}: {e}"})
    if device.type == "cuda":
        torch.cuda.profiler.stop()
    rows = [{"index": i, "case": c.name, "group": c.group, "min_bytes": moved} for i, c, _, moved in built
            if i not in failed]
    out = {"shapes": shapes.__dict__, "device": str(device), "cases": rows, "skipped": skipped,
           "torch": torch.__version__, "triton": triton.__version__}
    if manifest:
        tmp = manifest + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, manifest)
    for s in skipped:
        print(f"skipped {s['index']:2d} {s['case']}: {s['skipped']}", flush=True)
    return rows


# --- ncu's raw page, summarized ----------------------------------------------------------------------

STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
COLUMNS = {  # what the table shows: (heading, metric)
    "time": "gpu__time_duration.sum",  # ns with --print-units base
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "smem_ld_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "smem_st_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "l2_hit": "lts__t_sector_hit_rate.pct",
    "ld_use": "smsp__sass_average_data_bytes_per_sector_mem_global_op_ld.pct",  # of each 32-byte sector fetched
    "st_use": "smsp__sass_average_data_bytes_per_sector_mem_global_op_st.pct",
}


def _number(v: str) -> float | None:
    v = (v or "").replace(",", "").strip()
    try:
        return float(v)
    except ValueError:
        return None


def read_raw(path: str) -> list[dict]:
    """ncu's ``--csv --page raw`` rows (one per profiled kernel), without the units row; ``==PROF==`` and
    other lines before the header are skipped."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{path}: no ncu CSV header (a line starting with \"ID\")")
    rows = list(csv.DictReader(lines[start:]))
    return [r for r in rows if _number(r.get("ID", "")) is not None]


def _grid_programs(grid: str) -> int:
    nums = [int(n) for n in re.findall(r"\d+", grid or "")]
    out = 1
    for n in nums:
        out *= n
    return out if nums else 0


def summarize(raw: list[dict], manifest: dict) -> list[dict]:
    """One entry per kernel row, with its case (the last marker before it) and the table's fields."""
    names = {c["index"]: c for c in manifest["cases"]}
    out, case = [], None
    for r in raw:
        kname = r.get("Kernel Name", "")
        if "_case_marker" in kname:
            case = names.get(_grid_programs(r.get("Grid Size", "")) - 1)
            continue
        e = {"case": case["case"] if case else "?", "index": case["index"] if case else -1,
             "min_bytes": case["min_bytes"] if case else 0, "kernel": kname.split("(")[0][:48],
             "grid": r.get("Grid Size", ""), "block": r.get("Block Size", "")}
        for key, metric in COLUMNS.items():
            e[key] = _number(r.get(metric, ""))
        stalls = {m.group(1): _number(v) for k, v in r.items() if (m := STALL.match(k)) and _number(v) is not None}
        e["stalls"] = sorted(((k, v) for k, v in stalls.items() if k != "selected"), key=lambda kv: -kv[1])[:3]
        out.append(e)
    return out


def table(entries: list[dict]) -> str:
    """The summary as text: per case, each kernel's row; the case's device time and bandwidth against the
    bytes it must move at least."""
    lines = []
    by_case: dict = {}
    for e in entries:
        by_case.setdefault((e["index"], e["case"]), []).append(e)
    for (_, case), es in sorted(by_case.items()):
        t = sum(e["time"] or 0.0 for e in es)
        least = es[0]["min_bytes"]
        lines.append(f"== {case}: {t / 1e3:.1f} us" + (f", {least / t:.0f} GB/s of its least bytes" if t else ""))
        for e in es:
            dram = (e["dram_read"] or 0) + (e["dram_write"] or 0)
            us = (e["time"] or 0) / 1e3
            stalls = ", ".join(f"{k} {v:.1f}" for k, v in e["stalls"])

            def f(v, fmt):
                return format(v, fmt) if v is not None else "?"
            rate = dram / e["time"] if e["time"] else None  # bytes per ns: GB/s
            lines.append(f"  {e['kernel']:<40} grid {e['grid']:<14} {f(us, '8.1f')} us  DRAM {dram / 1e6:8.1f} MB "
                         f"{f(rate, '6.0f')} GB/s {f(e['dram_pct'], '5.1f')}%  SM {f(e['sm_pct'], '5.1f')}%  "
                         f"occ {f(e['occupancy'], '5.1f')}%  L2 hit {f(e['l2_hit'], '.0f')}%  "
                         f"sector use ld/st {f(e['ld_use'], '.0f')}/{f(e['st_use'], '.0f')}%  "
                         f"regs {f(e['registers'], '.0f')}  smem conflicts ld/st {f(e['smem_ld_conflicts'], '.0f')}/"
                         f"{f(e['smem_st_conflicts'], '.0f')}  stalls (cycles/issue): {stalls or '?'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--only", help="a regular expression: the cases whose names match")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU check in Triton's interpreter)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--manifest", help="write (run) or read (--summarize) the cases' JSON here")
    ap.add_argument("--summarize", metavar="RAW_CSV", help="ncu's --csv --page raw --print-units base output")
    args = ap.parse_args()
    if args.list:
        for i, c in enumerate(CASES):
            print(f"{i:2d} [{c.group}] {c.name}")
        return
    if args.summarize:
        if not args.manifest:
            raise SystemExit("--summarize needs --manifest (the run's cases)")
        with open(args.manifest) as f:
            manifest = json.load(f)
        entries = summarize(read_raw(args.summarize), manifest)
        print(table(entries))
        for s in manifest.get("skipped", []):
            print(f"skipped: {s['case']}: {s['skipped']}")
        return
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here (on CPU: TRITON_INTERPRET=1 ... --small --device cpu)")
    torch.manual_seed(0)
    rows = run_cases(SMALL if args.small else Shapes(), dev, args.only, args.manifest)
    print(f"ran {len(rows)} cases")


if __name__ == "__main__":
    main()
