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


# --------------------------------------------------------------------------- dense GEMMs and attention


def _bf16(*shape, scale=1.0, g=None):
    x = torch.randn(*shape, generator=g) * scale
    return x.to(torch.bfloat16).float()


def _oracle_mm(a, b, bits_a, bits_b):
    """An independent exact product: int64 group dot products (no floating point), then the same
    float64 scaling and K-order sum as the definition."""
    from jetrl_cli.precision.gemm import exact_group, fixed_point

    g = exact_group(bits_a, bits_b, a.shape[1])
    av, sa = fixed_point(a, bits_a, g)
    bv, sb = fixed_point(b, bits_b, g)
    ai, bi = av.long(), bv.long()
    acc = None
    for i, k0 in enumerate(range(0, a.shape[1], g)):
        part = (ai[:, k0:k0 + g] @ bi[:, k0:k0 + g].t()).double()  # exact: |part| <= 2^53
        part = part * sa[:, i:i + 1] * sb[:, i]
        acc = part if acc is None else acc + part
    return acc.float()


def test_fixed_point_grid():
    from jetrl_cli.precision.gemm import DENSE_BITS, exact_group, fixed_point

    assert exact_group(22, 22) == 128 and exact_group(24, 24) == 32 and exact_group(24, 22) == 128
    assert exact_group(22, 22, 40) == 64  # never wider than K needs
    g = torch.Generator().manual_seed(torch.initial_seed())
    x = (torch.randn(17, 300, generator=g) * torch.logspace(-6, 2, 300)).bfloat16().float()  # 8 decades a row
    x[3] = 0.0
    x[5, 7] = 2.0 ** -140  # an fp32 subnormal next to normal values
    bits = DENSE_BITS[Format.BF16]
    v, sc = fixed_point(x, bits, 128)
    assert v.dtype == torch.float32 and sc.dtype == torch.float64 and sc.shape == (17, 3)
    assert torch.equal(v, v.round()) and v.abs().max() <= 2 ** bits
    assert torch.equal(torch.log2(sc), torch.log2(sc).round())  # powers of two
    assert torch.equal(v[3], torch.zeros(300))
    back = (v * sc.repeat_interleave(128, 1)[:, :300])
    err = (back - x.double()).abs()
    top = sc.repeat_interleave(128, 1)[:, :300]
    assert (err <= top / 2).all()  # at most half a grid step
    # bf16 values within 2^-14 of their group's largest are kept exactly
    gmax = x.abs().reshape(17, -1).new_zeros(17, 300)
    for j in range(3):
        gmax[:, j * 128:(j + 1) * 128] = x[:, j * 128:(j + 1) * 128].abs().amax(1, keepdim=True)
    big = x.abs() >= gmax * 2.0 ** -14
    assert torch.equal(back[big], x.double()[big])
    y = x.clone()
    y[1, 200] = float("inf")
    y[2, 10] = float("nan")
    v2, _ = fixed_point(y, bits, 128)
    assert torch.isinf(v2[1, 200]) and torch.isnan(v2[2, 10])
    from jetrl_cli.precision.gemm import exact_dense_mm

    out = exact_dense_mm(y, _bf16(5, 300, g=g), Format.BF16, Format.BF16)
    bad = ~torch.isfinite(out)
    assert bad[1].all() and bad[2].all() and not bad[[0, 3, 4]].any()  # a non-finite input is never hidden


@pytest.mark.parametrize("fa,fb,k", [(Format.BF16, Format.BF16, 384), (Format.FP32, Format.FP32, 200),
                                     (Format.BF16, Format.BF16, 96)])
def test_exact_dense_mm_is_exact_and_row_independent(fa, fb, k):
    from jetrl_cli.precision.gemm import DENSE_BITS, dense_weight_operand, exact_dense_mm
    from jetrl_cli.precision.flow import GemmSpec

    g = torch.Generator().manual_seed(torch.initial_seed())
    rnd = (lambda *s, scale=1.0: _bf16(*s, scale=scale, g=g)) if fa is Format.BF16 else \
        (lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale)
    a = rnd(150, k, scale=3.0)
    a[7] = 0.0
    b = rnd(70, k, scale=0.02)
    full = exact_dense_mm(a, b, fa, fb)
    assert torch.equal(full, _oracle_mm(a, b, DENSE_BITS[fa], DENSE_BITS[fb]))
    for rows in ([0], [5, 6, 7], list(range(17)), [149], torch.randperm(150, generator=g)[:33].tolist()):
        assert torch.equal(exact_dense_mm(a[rows], b, fa, fb), full[rows])
    spec = GemmSpec(CastSpec(fa), CastSpec(fb), Format.FP32)
    assert torch.equal(exact_dense_mm(a, dense_weight_operand(b, spec), fa, fb), full)  # a cached weight
    ref = a.double() @ b.double().t()
    assert ((full.double() - ref).abs().max() / ref.abs().max()) < 1e-6  # fp32-accumulation accuracy
    assert torch.equal(full[7], torch.zeros(70))


def test_exact_attention_gemms_do_not_depend_on_rows_or_key_width():
    """q @ k^T and p @ v: a query row's result is the same bits whatever other rows share the call
    and whatever the key width beyond its keys holds (zero probability, arbitrary finite values)."""
    from jetrl_cli.models.llama import exact_pv, exact_scores, kv_fixed

    g = torch.Generator().manual_seed(torch.initial_seed())
    q = torch.randn(6, 40, 32, generator=g)
    k, v = _bf16(6, 320, 32, g=g), _bf16(6, 320, 32, g=g)
    ki, ks = kv_fixed(k)
    vi, vs = kv_fixed(v)
    assert torch.equal(ki[:, :48], kv_fixed(k[:, :48])[0])  # a key's grid is its own
    n = 37  # this row's keys
    p = torch.rand(6, 40, 320, generator=g)
    p[..., n:] = 0.0
    qk = exact_scores(q, ki[:, :48], ks[:, :48])[..., :n]
    pv = exact_pv(p[..., :48], vi[:, :48], vs[:, :48])
    for w in (48, 64, 128, 144, 320):
        assert torch.equal(exact_scores(q, ki[:, :w], ks[:, :w])[..., :n], qk)
        assert torch.equal(exact_pv(p[..., :w], vi[:, :w], vs[:, :w]), pv)
        for rows in ([0], [3, 4], list(range(13))):
            assert torch.equal(exact_scores(q[:, rows], ki[:, :w], ks[:, :w])[..., :n], qk[:, rows])
            assert torch.equal(exact_pv(p[:, rows, :w], vi[:, :w], vs[:, :w]), pv[:, rows])
    ref_qk = q.double() @ k[:, :48].double().transpose(1, 2)
    ref_pv = p[..., :48].double() @ v[:, :48].double()
    assert ((qk.double() - ref_qk[..., :n]).abs().max() / ref_qk.abs().max()) < 1e-6
    assert ((pv.double() - ref_pv).abs().max() / ref_pv.abs().max()) < 1e-6


def test_exact_attention_gradients_are_the_plain_ones():
    """The exact forward's backward is the usual one: compared with autograd through float64 bmm."""
    from jetrl_cli.models.llama import _ExactAttentionGemm

    g = torch.Generator().manual_seed(torch.initial_seed())
    q = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    k = _bf16(3, 32, 16, g=g).requires_grad_()
    p = torch.rand(3, 5, 32, generator=g).requires_grad_()
    v = _bf16(3, 32, 16, g=g).requires_grad_()
    gs, go = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 16, generator=g)
    (_ExactAttentionGemm.apply(q, k, True) * gs).sum().backward()
    (_ExactAttentionGemm.apply(p, v, False) * go).sum().backward()
    qd, kd, pd, vd = (t.detach().double().requires_grad_() for t in (q, k, p, v))
    ((qd @ kd.transpose(1, 2)) * gs.double()).sum().backward()
    ((pd @ vd) * go.double()).sum().backward()
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (p.grad, pd.grad), (v.grad, vd.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-6


_THREADS = "import os, torch; torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))\n"
_PROBE = _THREADS + r"""
import hashlib, json, torch
from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.precision.gemm import EmulatedBackend
from jetrl_cli.precision.quant import CastSpec, quantize
g = torch.Generator().manual_seed(0)
def rnd(*shape, scale=1.0):  # from integers, exactly: torch.randn's bits depend on the instruction set
    m = torch.randint(-2**20, 2**20, shape, generator=g).double() / 2**20
    e = torch.randint(-6, 3, (*shape[:-1], 1), generator=g).double()  # rows of different magnitudes
    return (m * torch.pow(2.0, e) * scale).float()
x, w = rnd(300, 512, scale=3.0), rnd(384, 512, scale=0.02)
a = quantize(x, CastSpec(Format.FP8_E4M3, Block(1, 128)))
b = quantize(w, CastSpec(Format.FP8_E4M3, Block(128, 128)))
y = EmulatedBackend().mm(a, b)
from jetrl_cli.precision.gemm import exact_dense_mm
from jetrl_cli.models.llama import exact_pv, exact_scores, kv_fixed
xb, wb = x.bfloat16().float(), w.bfloat16().float()
d = exact_dense_mm(xb, wb, Format.BF16, Format.BF16)
q, k = rnd(8, 50, 64), rnd(8, 96, 64).bfloat16().float()
p = rnd(8, 50, 96).abs()
att = torch.cat([exact_scores(q, *kv_fixed(k)).flatten(), exact_pv(p, *kv_fixed(k)).flatten()])
print(json.dumps({"threads": torch.get_num_threads(),
                  "sha": [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in (x, w, y, d, att)]}))
"""

_ENVS = [{"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "8"},
         {"OMP_NUM_THREADS": "2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
         # no vector instructions in torch's own kernels: a CPU unlike this one (its exp, log, sums)
         {"OMP_NUM_THREADS": "2", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"}]


def _run(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_gemm_bits_are_the_same_with_any_thread_count_and_instruction_set():
    """FP8, dense bf16 and attention GEMMs: exact per group, so the same bits in every process."""
    results = [_run(_PROBE, env) for env in _ENVS]
    assert [r["threads"] for r in results[:3]] == [1, 2, 8]
    assert len({tuple(r["sha"]) for r in results}) == 1, results


_ON_POLICY = _THREADS + r"""
import json, sys, torch
sys.path.insert(0, ".")  # the repository root (the process's cwd): tests is a package
from tests.test_engine import _rollout_and_score, _tiny_model
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
