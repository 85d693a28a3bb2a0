"""The 128x1 quantizer's transposed FP8 store, two ways: jetrl's kernel against a variant that packs
four tokens into a 32-bit word before the transpose. A prepared GPU experiment (2026-11-27).

On an H200 (docs/benchmarks.md, 2026-11-27) the 1x128 quantizer ran at 0.70x of a copy and the
128x1 one, which writes x^T, at 0.24x; the SwiGLU backward, which writes three transposed outputs,
at 0.16x. Compiled offline for sm_90a with Triton 3.6 (``tests/sm90_compile.py``'s stand-in
driver), jetrl's 128x1 kernel at 8 warps moves the transposed tile through shared memory a byte at
a time: 64 ``LDS.U8`` per thread, 2040 instructions. Here each program loads its 128 tokens as four
sub-tiles (tokens 4i, 4i+1, 4i+2, 4i+3: every thread holds the four tokens of a word in the same
registers), packs the four FP8 bytes of a column into one uint32 (``|`` and shifts, no data
movement) and transposes 32-bit words: no byte-wide shared-memory access; the four sub-tiles'
column maxima are one reduction. Its bytes must be the kernel's, bit for bit (the same quotient
and cast per element).

    TRITON_INTERPRET=1 python docs/experiments/transposed_store.py   # CPU: bit-exact check only
    python docs/experiments/transposed_store.py                      # GPU: also times both

Prints one JSON object. On a GPU: each variant's device time on an 8192 x 8192 bf16 tensor, as a
fraction of a device copy of the same bytes (read x, write x^T and its scales), at 8 and 16 warps.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from jetrl_cli.kernels import fp8 as F
from jetrl_cli.precision.formats import Format


@triton.jit
def _packed_cols_kernel(x_ptr, qt_ptr, st_ptr, M, K, M_PAD, stride_xm, stride_xk, FMAX: tl.constexpr,
                        FLOOR: tl.constexpr, POW2: tl.constexpr, OUT: tl.constexpr, T: tl.constexpr):
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    ri = pm * (T // 4) + tl.arange(0, T // 4)  # word index along tokens: its tokens are 4 ri + j
    rk = pk * T + tl.arange(0, T)
    col_ok = rk < K
    at = x_ptr + rk[None, :] * stride_xk
    t0 = ri * 4
    x0 = tl.load(at + t0.to(tl.int64)[:, None] * stride_xm, mask=(t0 < M)[:, None] & col_ok[None, :], other=0.0)
    x1 = tl.load(at + (t0 + 1).to(tl.int64)[:, None] * stride_xm, mask=(t0 + 1 < M)[:, None] & col_ok[None, :],
                 other=0.0)
    x2 = tl.load(at + (t0 + 2).to(tl.int64)[:, None] * stride_xm, mask=(t0 + 2 < M)[:, None] & col_ok[None, :],
                 other=0.0)
    x3 = tl.load(at + (t0 + 3).to(tl.int64)[:, None] * stride_xm, mask=(t0 + 3 < M)[:, None] & col_ok[None, :],
                 other=0.0)
    x0, x1, x2, x3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    bits = tl.maximum(tl.maximum(F._abs_bits(x0), F._abs_bits(x1)), tl.maximum(F._abs_bits(x2), F._abs_bits(x3)))
    s = F._group_scale(F._amax(bits, 0), FMAX, FLOOR, POW2)  # one scale per column of the 128 tokens
    tl.store(st_ptr + pm.to(tl.int64) * K + rk, s, mask=col_ok)
    sc = s[None, :]
    r = F._divisor(s)[None, :]
    w = F._scaled(x0, sc, r, POW2).to(OUT).to(tl.uint8, bitcast=True).to(tl.uint32)
    w = w | (F._scaled(x1, sc, r, POW2).to(OUT).to(tl.uint8, bitcast=True).to(tl.uint32) << 8)
    w = w | (F._scaled(x2, sc, r, POW2).to(OUT).to(tl.uint8, bitcast=True).to(tl.uint32) << 16)
    w = w | (F._scaled(x3, sc, r, POW2).to(OUT).to(tl.uint8, bitcast=True).to(tl.uint32) << 24)
    tl.store(qt_ptr + rk.to(tl.int64)[:, None] * (M_PAD // 4) + ri[None, :], tl.trans(w).to(tl.int32, bitcast=True),
             mask=col_ok[:, None] & (t0 < M_PAD)[None, :])


def packed_cols(x: torch.Tensor, warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x^T's 128x1 FP8 E4M3 copy (K, M) and its scales (K, M/128), as ``quantize_act(x, rows=False)``
    writes them, for M a multiple of 128 (the training step's padded token count)."""
    m, k = x.shape
    if m % F.TILE:
        raise ValueError(f"packed_cols: tokens must be a multiple of {F.TILE}, got {m}")
    qt, st = F._cols_out(k, m, torch.float8_e4m3fn, x.device)
    _packed_cols_kernel[(m // F.TILE, triton.cdiv(k, F.TILE))](
        x, qt.view(torch.int32), st, m, k, m, x.stride(0), x.stride(1), FMAX=Format.FP8_E4M3.max,
        FLOOR=F.DEFAULT_AMAX_FLOOR, POW2=False, OUT=tl.float8e4nv, T=F.TILE, num_warps=warps,
        enable_fp_fusion=F.FP_FUSION)
    return qt, st


def main() -> None:
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    g = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    shapes = [(8192, 8192)] if gpu else [(256, 384), (128, 200)]
    out = {"device": torch.cuda.get_device_name() if gpu else "cpu (Triton's interpreter)", "triton": triton.__version__}
    for m, k in shapes:
        x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(1, k, generator=g) * 3)).to(dev, torch.bfloat16)
        x[:, 0] = 0  # an all-zero column group, and a column whose maximum repeats
        x[: m // 2, 1] = x[m // 2:, 1].abs().max()
        want = F.quantize_act(x, rows=False, pad_tokens_to=F.TILE)[1]
        for warps in (8, 16):
            qt, st = packed_cols(x, warps)
            same = torch.equal(qt.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(st, want.scale)
            row = {"shape": [m, k], "warps": warps, "bit_exact": same}
            if gpu:
                copy_ms = F.gemm.device_time_ms(lambda: torch.empty_like(x).copy_(x), x.device)
                with F.tile_warps(warps):
                    ref_ms = F.gemm.device_time_ms(lambda: F.quantize_act(x, rows=False, pad_tokens_to=F.TILE), x.device)
                new_ms = F.gemm.device_time_ms(lambda w=warps: packed_cols(x, w), x.device)
                moved = x.numel() * x.element_size() + x.numel() + st.numel() * 4  # read x; write x^T, scales
                copy_bw = 2 * x.numel() * x.element_size() / copy_ms
                row.update({"kernel_ms": ref_ms, "packed_ms": new_ms, "copy_ms": copy_ms,
                            "kernel_vs_copy": moved / ref_ms / copy_bw, "packed_vs_copy": moved / new_ms / copy_bw})
            out.setdefault("rows", []).append(row)
    print(json.dumps(out, indent=1))
    if not all(r["bit_exact"] for r in out["rows"]):
        raise SystemExit("the packed store's bytes differ from the kernel's")


if __name__ == "__main__":
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 (bit-exact check only)")
    main()
