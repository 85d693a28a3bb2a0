"""Bitwise on-policy on any CPU, by construction (issue 16, part 1).

The unified flow's FP8 GEMMs run ``exact_mm``: each K group's dot product of E4M3 values is exact in
float64, so its value cannot depend on the order a BLAS sums in, on the number of threads, on the
instruction set, or on how many rows share the call. These tests check that claim directly: the
same product computed in other orders gives the same bits, and the rollout-equals-trainer
property holds in fresh processes with 1, 2 and 8 threads and with MKL and torch held to AVX2.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.precision.gemm import EmulatedBackend, exact_bits, exact_mm, exact_operand
from jetrl_cli.precision.quant import CastSpec, QTensor, quantize

E4 = Format.FP8_E4M3


def _fp8_operands(m, n, k, seed, b_block=Block(128, 128)):
    g = torch.Generator().manual_seed(seed)
    # values spanning the format: magnitudes from subnormal to the max in the same groups
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 3, k)[torch.randperm(k, generator=g)]
    w = torch.randn(n, k, generator=g) * 0.05
    x[0, :5] = torch.tensor([448.0, -448.0, 2.0 ** -9, -(2.0 ** -9), 0.0])  # extremes of one block
    return quantize(x, CastSpec(E4, Block(1, 128))), quantize(w, CastSpec(E4, b_block))


def test_the_exactness_budget():
    assert exact_bits(E4, E4, 128) == 43 <= 53  # every partial sum of a group fits float64 exactly
    assert exact_bits(E4, E4, 1 << 17) == 53  # per-row scales: exact up to K = 131072
    assert exact_bits(Format.INT8, Format.INT8, 1 << 20) < 53
    assert exact_bits(E4, Format.FP8_E5M2, 128) > 53  # mixed formats: not claimed (fp32 path)


@pytest.mark.parametrize("b_block", [Block(128, 128), Block(1, 128)])
def test_exact_mm_does_not_depend_on_the_summation_order(b_block):
    a, b = _fp8_operands(37, 45, 384, seed=1, b_block=b_block)
    got = exact_mm(a, b)
    ea, eb = exact_operand(a), exact_operand(b)
    k = ea.values.shape[1]
    # the same groups summed in reverse K order, and in 16-wide partial sums added pairwise
    rev = torch.arange(k - 1, -1, -1)
    acc = None
    for k0 in range(0, k, 128):
        cols = rev[(rev >= k0) & (rev < k0 + 128)]
        p = ea.values[:, cols] @ eb.values[:, cols].t()
        q = sum((ea.values[:, c:c + 16] @ eb.values[:, c:c + 16].t() for c in range(k0, k0 + 128, 16)),
                torch.zeros_like(p))
        assert torch.equal(p, q)
        part = p * ea.scales[:, k0 // 128:k0 // 128 + 1] * eb.scales[:, k0 // 128]
        acc = part if acc is None else acc + part
    assert torch.equal(got, acc.float())
    # one element against Python's exactly rounded sum of the exact products
    i, j = 3, 7
    for k0 in range(0, k, 128):
        terms = [float(ea.values[i, c]) * float(eb.values[j, c]) for c in range(k0, k0 + 128)]
        assert math.fsum(terms) == float(ea.values[i, k0:k0 + 128] @ eb.values[j, k0:k0 + 128])


def test_exact_mm_rows_do_not_depend_on_the_batch():
    a, b = _fp8_operands(200, 96, 256, seed=2)
    full = EmulatedBackend().mm(a, b)
    for rows in ([0], [5, 6, 7], list(range(17)), [199]):
        sub = QTensor(a.data[rows], a.scale[rows], a.spec)
        assert torch.equal(EmulatedBackend().mm(sub, b), full[rows])
    ref = a.dequantize().double() @ b.dequantize().double().t()
    assert ((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6


def test_exact_mm_propagates_non_finite_blocks():
    a, b = _fp8_operands(4, 8, 256, seed=3)
    x = a.dequantize()
    x[1, 130] = float("nan")
    y = EmulatedBackend().mm(quantize(x, a.spec), b)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


_THREADS = "import os, torch; torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))\n"
_PROBE = _THREADS + r"""
import hashlib, json, torch
from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.precision.gemm import EmulatedBackend
from jetrl_cli.precision.quant import CastSpec, quantize
g = torch.Generator().manual_seed(0)
x, w = torch.randn(300, 512, generator=g) * 3, torch.randn(384, 512, generator=g) * 0.02
a = quantize(x, CastSpec(Format.FP8_E4M3, Block(1, 128)))
b = quantize(w, CastSpec(Format.FP8_E4M3, Block(128, 128)))
y = EmulatedBackend().mm(a, b)
print(json.dumps({"threads": torch.get_num_threads(),
                  "sha": hashlib.sha256(y.numpy().tobytes()).hexdigest()}))
"""

_ENVS = [{"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "8"},
         {"OMP_NUM_THREADS": "2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}]


def _run(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fp8_gemm_bits_are_the_same_with_any_thread_count_and_instruction_set():
    results = [_run(_PROBE, env) for env in _ENVS]
    assert [r["threads"] for r in results[:3]] == [1, 2, 8]
    assert len({r["sha"] for r in results}) == 1, results


_ON_POLICY = _THREADS + r"""
import json, sys, torch
sys.path.insert(0, "tests")
from test_engine import _rollout_and_score, _tiny_model
out = {}
for flow in ("fp8-unified", "bf16"):
    b, old, _ = _rollout_and_score(_tiny_model(), flow, seed=11)
    out[flow] = bool(torch.equal(old[b.mask], b.rollout_logp[b.mask])) and int(b.mask.sum()) > 40
print(json.dumps({"threads": torch.get_num_threads(), **out}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("env", _ENVS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_rollout_equals_trainer_in_fresh_processes(env):
    r = _run(_ON_POLICY, env)
    assert r["threads"] == int(env["OMP_NUM_THREADS"]) and r["fp8-unified"] and r["bf16"], r
