"""What the CPU's exact forward GEMM costs next to a plain fp32 GEMM (and a plain float64 one).

``exact_dense_mm`` puts both operands on their per-(row, K group) grid and multiplies in float64
(the weight's grid is computed once and cached, as the model does); this times it against
``torch.mm`` on the same bf16-valued operands at the tiny policy's layer shapes, 2 threads.

    python docs/experiments/exact_gemm_cost.py
"""

import time

import torch

from jetrl_cli.precision.flow import GemmSpec
from jetrl_cli.precision.formats import Format
from jetrl_cli.precision.gemm import dense_weight_operand, exact_dense_mm
from jetrl_cli.precision.quant import CastSpec


def us(fn, n=200) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    torch.set_num_threads(2)
    spec = GemmSpec(CastSpec(Format.BF16), CastSpec(Format.BF16), Format.BF16)
    print("M x K x N      fp32 mm us   float64 mm us   exact us   exact / fp32")
    for m, k, n in [(128, 128, 384), (128, 128, 768), (128, 384, 128), (128, 128, 64), (1024, 128, 384)]:
        x = torch.randn(m, k).bfloat16().float()
        w = (torch.randn(n, k) * 0.02).bfloat16().float()
        wop = dense_weight_operand(w, spec)
        xd, wd = x.double(), w.double()
        t32 = us(lambda: torch.mm(x, w.t()))
        t64 = us(lambda: torch.mm(xd, wd.t()))
        tex = us(lambda: exact_dense_mm(x, wop, Format.BF16, Format.BF16))
        print(f"{m}x{k}x{n:<8} {t32:10.0f} {t64:15.0f} {tex:10.0f} {tex / t32:12.2f}")


if __name__ == "__main__":
    main()
