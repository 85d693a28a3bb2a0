"""How long jetrl's FP8 quantizer kernels would take a Hopper GPU just to issue their instructions, counted
on a machine without one: each kernel compiled for sm_90a through ``tests/sm90_compile.py``'s stand-in
driver, at the Qwen2.5-1.5B training shapes (16 x 512 tokens: M = 8192, hidden 1536, intermediate 8960),
its SASS instructions a thread times the threads of its launch grid.

    python docs/experiments/quantizer_issue_time.py            # a table, one row per kernel launch
    python docs/experiments/quantizer_issue_time.py --json
    python docs/experiments/quantizer_issue_time.py --pow2     # with power-of-two scales

Why: on an H200 (2026-11-27, ``docs/benchmarks.md``) the SwiGLU backward's 128x1 kernel moved its bytes
at 0.78 TB/s, and its 206 instructions per value needed about 0.45 ms a layer of issue alone against the
0.66 ms it took; the other quantizers fit the same account. So a kernel whose issue time is near or
above its bytes' time at a copy's bandwidth is bound by its instructions, and fewer of them is what
makes it faster, which can be measured here. Estimates, not times:

- ``issue ms``: warp instructions / (SMS x 4 schedulers x CLOCK_GHZ), one instruction per scheduler per
  cycle. Real kernels issue at about 0.65 of that (the H200's 1x128 half of the SwiGLU backward: 0.14
  ms of issue, 0.18 ms measured).
- ``bytes ms``: the bytes the launch (all its kernels) must read and write / COPY_TBPS (an H200's copy,
  graph-replayed), on its first kernel's row.
- Counts are static: every kernel here is straight-line code (no loops at these shapes), so each
  thread runs each instruction once. Branches both count (the one-kernel SwiGLU backward's three
  program kinds: reported, but its number over-counts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import sm90_compile as S  # noqa: E402 - the stand-in driver (sets TRITON_INTERPRET off, imports triton)

import torch  # noqa: E402

SMS, CLOCK_GHZ, COPY_TBPS = 132, 1.98, 4.15  # H200: SMs, boost clock, graph-replayed copy bandwidth
M, HIDDEN, INTER = 8192, 1536, 8960


def launches(pow2: bool = False) -> list:
    """Compile each kernel once at the training shapes; return (label, kernel name, compiled, grid,
    bytes moved) per launch."""
    from triton.runtime.jit import JITFunction

    from jetrl_cli.kernels import fp8

    out, current = [], {}
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        g = grid(kwargs) if callable(grid) else grid
        g = tuple(g) + (1,) * (3 - len(g))
        out.append((current["label"], self.fn.__name__, kernel, g, current["bytes"]))

    from triton.runtime import driver

    driver.set_active(S._Hopper())
    JITFunction.run = record
    bf = torch.bfloat16
    fp8_copy = S._qtensor(M, 2 * INTER, 1)
    cases = [
        ("activation 1x128 + 128x1, one kernel (M x hidden)", M * HIDDEN * (2 + 2),
         lambda: fp8.quantize_act(torch.zeros(M, HIDDEN, dtype=bf), pow2_scale=pow2, pad_tokens_to=128), (8, True)),
        ("activation 1x128 + 128x1, two kernels", M * HIDDEN * (2 + 2 + 2),
         lambda: fp8.quantize_act(torch.zeros(M, HIDDEN, dtype=bf), pow2_scale=pow2, pad_tokens_to=128), (8, False)),
        ("activation 128x1 only", M * HIDDEN * (2 + 1),
         lambda: fp8.quantize_act(torch.zeros(M, HIDDEN, dtype=bf), pow2_scale=pow2, rows=False,
                                           pad_tokens_to=128), (8, True)),
        ("SwiGLU forward + [g, u]'s copy", M * INTER * (4 + 1 + 2),
         lambda: fp8.swiglu_quantize(torch.zeros(M, 2 * INTER, dtype=bf), pow2_scale=pow2, save=True), None),
        # each kernel reads [g, u]'s copy (2 bytes a value) and gy (2); d[g, u] 1x128 (2), 128x1 (2), h^T (1)
        ("SwiGLU backward, two kernels, 8 warps", M * INTER * (4 + 4 + 2 + 2 + 1),
         lambda: fp8.swiglu_grad_quantize(fp8_copy, torch.zeros(M, INTER, dtype=bf), bf, pow2_scale=pow2, pad_tokens_to=128,
                                          h_cols=True), (8, False)),
        ("SwiGLU backward, two kernels, 4 warps", M * INTER * (4 + 4 + 2 + 2 + 1),
         lambda: fp8.swiglu_grad_quantize(fp8_copy, torch.zeros(M, INTER, dtype=bf), bf, pow2_scale=pow2, pad_tokens_to=128,
                                          h_cols=True), (4, False)),
        ("RMSNorm + quantizer (train: residual in, s, q out)", M * HIDDEN * (4 + 2 + 4 + 1 + 2),
         lambda: fp8.rms_norm_quantize(torch.zeros(M, HIDDEN), torch.zeros(M, HIDDEN, dtype=bf),
                                       torch.ones(HIDDEN), 1e-6, torch.float32, pow2_scale=pow2, write_y=True,
                                       rsqrt=True), None),
        ("weight 128x128 + W^T in the quantizer (intermediate x hidden fp32)", INTER * HIDDEN * (4 + 2),
         lambda: fp8.quantize_weight(torch.zeros(INTER, HIDDEN), pow2_scale=pow2, transposed=True), "quantizer"),
    ]
    for label, moved, call, how in cases:
        current.update(label=label, bytes=moved)
        if isinstance(how, tuple):
            with fp8.tile_warps(*how):
                call()
        elif how is not None:
            with fp8.wt_with(how):
                call()
        else:
            call()
    JITFunction.run = run
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pow2", action="store_true", help="power-of-two scales (`<format> <block> pow2`)")
    args = ap.parse_args()
    rows = []
    for label, name, kernel, grid, moved in launches(args.pow2):
        cub = kernel.asm["cubin"]
        per_thread = S.sass_counts(cub)["total"]
        warps = kernel.metadata.num_warps
        warp_instr = per_thread * warps * grid[0] * grid[1] * grid[2]
        rows.append({"launch": label, "kernel": name, "warps": warps, "registers": S.resources(cub)["reg"],
                     "sass_per_thread": per_thread, "programs": grid[0] * grid[1] * grid[2],
                     "issue_ms": warp_instr / (SMS * 4 * CLOCK_GHZ * 1e6), "bytes_ms": moved / (COPY_TBPS * 1e9)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'launch':62s} {'kernel':28s} {'warps':>5s} {'regs':>4s} {'SASS':>5s} {'issue ms':>8s} {'bytes ms':>8s}")
    seen = set()
    for r in rows:  # a launch's bytes are listed with its first kernel
        first = r["launch"] not in seen
        seen.add(r["launch"])
        print(f"{r['launch'][:62]:62s} {r['kernel'][:28]:28s} {r['warps']:5d} {r['registers']:4d} "
              f"{r['sass_per_thread']:5d} {r['issue_ms']:8.3f} " + (f"{r['bytes_ms']:8.3f}" if first else f"{'':>8s}"))


if __name__ == "__main__":
    main()
