"""The Triton GEMM against the pure-torch reference, in Triton's interpreter on CPU.

The GEMM is compared by relative error against the emulated reference on the same quantized
operands and by SQNR against float64; the Triton backend runs a whole linear layer like the
emulated one. The quantizers are tested bit for bit in tests/test_kernels_quant.py. The
interpreter's fp32 -> fp8 conversion is wrong (tests/triton_interp_fix.py); the first test shows
it and checks the fix, which every other test runs under.
"""

import math
from fractions import Fraction

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("ml_dtypes")

from jetrl_cli.precision.flow import GemmSpec, LinearPrecision  # noqa: E402
from jetrl_cli.precision.formats import Block, Format  # noqa: E402
from jetrl_cli.precision.gemm import EmulatedBackend, get_backend  # noqa: E402
from jetrl_cli.precision.linear import JetLinear  # noqa: E402
from jetrl_cli.precision.quant import CastSpec, QTensor, error_stats, quantize  # noqa: E402

from .conftest import fresh_seed  # noqa: E402
from .triton_interp_fix import fixed_fp8_conversion  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a GPU or TRITON_INTERPRET=1")
E4, E5 = Format.FP8_E4M3, Format.FP8_E5M2


def dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def fp8_fix():
    if torch.cuda.is_available():
        yield
    else:
        with fixed_fp8_conversion():
            yield


def _cast_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, n, OUT: tl.constexpr, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n).to(OUT), mask=i < n)

    return cast


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the interpreter")
@pytest.mark.parametrize("fmt", [E4, E5])
def test_interpreter_fp8_cast_is_wrong_and_the_fix_is_right(fmt):
    import triton.language as tl

    cast = _cast_kernel()
    out_t = {E4: tl.float8e4nv, E5: tl.float8e5}[fmt]
    fresh = torch.randn(4000) * torch.logspace(-6, 2, 4000)
    edge = torch.tensor([31.6, 126.3, 0.3, -15.9, 0.0, -0.0, 2.0**-9, 240.0, 239.9])
    x = torch.cat([edge, fresh]).clamp(-fmt.max, fmt.max)
    want = x.to(fmt.torch_dtype()).view(torch.uint8)
    y = torch.empty(len(x), dtype=fmt.torch_dtype())
    from triton.runtime import interpreter

    with fixed_fp8_conversion() as original:
        cast[(1,)](x, y, len(x), OUT=out_t, B=8192)
        assert torch.equal(y.view(torch.uint8), want)  # the fix: bit for bit torch's cast
        interpreter._convert_float = original  # the original conversion (restored by the context manager)
        cast[(1,)](x, y, len(x), OUT=out_t, B=8192)
        assert not torch.equal(y.view(torch.uint8), want)  # the defect: the fix is needed
    assert float(torch.tensor([31.6]).to(torch.float8_e4m3fn).float()) == 32.0


def _fma_rounded_once(a: float, b: float, c: float) -> float:
    """``a * b + c`` (fp32 values) computed exactly, rounded to the nearest fp32, ties to even; an exact
    zero signed as IEEE signs it (-0 only for -0 plus -0)."""
    import numpy as np

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:
        negative = a * b == 0 and math.copysign(1, a) * math.copysign(1, b) < 0 and math.copysign(1, c) < 0
        return -0.0 if negative else 0.0
    near = np.float32(float(exact))  # within one step of it (rounded twice)
    steps = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    dist = [abs(Fraction(float(v)) - exact) for v in steps]
    ties = [v for v, d in zip(steps, dist) if d == min(dist)]
    return float(min(ties, key=lambda v: int(np.array(v).view(np.int32)) & 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the interpreter")
def test_interpreter_fma_rounds_once_with_the_fix():
    """``tl.fma`` in fp32 is ``x * y + z`` rounded once (a GPU's ``fma.rn.f32``) in the interpreter under
    ``exact_fma``: Triton 3.6's own multiplies, then adds (two roundings), from Triton 3.7 on it is
    exact and the fix does nothing. Checked against the exact value rounded to nearest even: sums
    that cancel, sums a hair off an fp32 tie (float64 alone rounds those twice), subnormal results
    and signed zeros."""
    import numpy as np
    import triton
    import triton.language as tl

    from .triton_interp_fix import exact_fma

    @triton.jit
    def fma(x_ptr, y_ptr, z_ptr, out_ptr, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(out_ptr + i, tl.fma(tl.load(x_ptr + i), tl.load(y_ptr + i), tl.load(z_ptr + i)))

    g = torch.Generator().manual_seed(fresh_seed())
    x, y = torch.randn(2, 4096, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 4096), generator=g).float())
    z = -(x * y)  # cancels: the rounding error of the product, exactly, is the answer
    z[1024:2048] = torch.randn(1024, generator=g) * 2.0**-60 * (x * y)[1024:2048]  # far below a step of x * y
    x[2048:2560] = y[2048:2560] = 1 + 2.0**-12  # x * y = 1 + 2^-11 + 2^-24: an fp32 tie, and a hair off it
    z[2048:2560] = torch.randn(512, generator=g) * 2.0**-80
    x[2560:3072] *= 2.0**-70  # subnormal results
    y[2560:3072] *= 2.0**-70
    x[:4] = torch.tensor([0.0, -0.0, 1.0, 0.0])  # zeros: +0 * 1 - 0 = +0, -0 * 1 - 0 = -0, ...
    y[:4] = torch.tensor([1.0, 1.0, 0.0, -1.0])
    z[:4] = torch.tensor([-0.0, -0.0, -0.0, 0.0])
    want = torch.tensor([_fma_rounded_once(a, b, c) for a, b, c in zip(x.tolist(), y.tolist(), z.tolist())])
    out = torch.empty(4096)
    with exact_fma():
        fma[(1,)](x, y, z, out, B=4096)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    naive = (x.numpy() * y.numpy() + z.numpy()).view(np.int32)
    assert (torch.from_numpy(naive) != want.view(torch.int32)).sum() > 100  # two roundings get these wrong


@pytest.mark.parametrize("m,n,k", [(64, 128, 256), (100, 200, 300), (3, 129, 128)])
@pytest.mark.parametrize("b_block", [Block(128, 128), Block(1, 128)])
def test_blockwise_gemm_against_reference(m, n, k, b_block):
    from jetrl_cli.kernels import fp8

    x, w = torch.randn(m, k).to(dev()), (torch.randn(n, k) * 0.02).to(dev())
    a, b = quantize(x, CastSpec(E4, Block(1, 128))), quantize(w, CastSpec(E4, b_block))
    out = fp8.blockwise_mm(a, b)
    emu = EmulatedBackend().mm(a, b)
    # same products, fp32 sums in another order; on a GPU the FP8 tensor-core MMA keeps ~14
    # significant bits in its accumulator within each 128-wide K block (DeepSeek-V3's measurement;
    # 1.2e-4 was seen on an H100), so the bound there is 2^-11
    tol = 2.0 ** -11 if torch.cuda.is_available() else 1e-5
    assert error_stats(emu, out)["rel_err"] < tol
    ref64 = x.double() @ w.double().t()
    assert error_stats(ref64, out)["sqnr_db"] > 25  # FP8 quantization error only
    o16 = fp8.blockwise_mm(a, b, out_dtype=torch.bfloat16)
    assert o16.dtype == torch.bfloat16 and error_stats(emu, o16.float())["rel_err"] < 1e-2


@pytest.mark.parametrize("m", [1, 7, 33, 64])
@pytest.mark.parametrize("b_block", [Block(128, 128), Block(1, 128)])
def test_blockwise_gemm_decode_tiles_against_reference(m, b_block):
    """A decode step's few rows get narrow tiles (16-64 x 32 here); their masks and their scale reads
    must give the reference's result as the 64 x 128 tiles do."""
    from jetrl_cli.kernels import fp8

    n, k = 200, 384
    g = torch.Generator().manual_seed(fresh_seed())
    x, w = torch.randn(m, k, generator=g).to(dev()), (torch.randn(n, k, generator=g) * 0.02).to(dev())
    a, b = quantize(x, CastSpec(E4, Block(1, 128))), quantize(w, CastSpec(E4, b_block))
    tiles = fp8._mm_config(m, n)
    assert tiles[:2] == (max(16, 1 << (m - 1).bit_length()), 32)
    emu = EmulatedBackend().mm(a, b)
    tol = 2.0 ** -11 if torch.cuda.is_available() else 1e-5  # as in the test above
    assert error_stats(emu, fp8.blockwise_mm(a, b))["rel_err"] < tol
    wide = fp8.blockwise_mm(a, b, tiles=(64, 128, 4, 3))  # the prefill/training tiles, same operands
    assert error_stats(wide, fp8.blockwise_mm(a, b, tiles=tiles))["rel_err"] < tol


@pytest.mark.parametrize("m,n,k,split", [(1, 200, 384, 1), (7, 96, 1000, 3), (33, 130, 1152, 1), (64, 64, 640, 2)])
def test_a_swapped_decode_gemm_takes_the_same_products_and_scales(m, n, k, split):
    """``swap``: each K block's product as ``b @ a.T`` on ``swap_tiles`` (a decode step's FP8 GEMM on
    Hopper's ``wgmma``, its weight rows as the MMA's rows), transposed back: the emulation's result
    within the tolerance of a sum in another order, each block scaled as ``(part * sa) * sb``; with
    a bias, split (its partials added in order, by a second kernel or by each tile's last program),
    bf16 output, partial tiles and a NaN block's scale, as the plain tiles."""
    from jetrl_cli.kernels import fp8

    g = torch.Generator().manual_seed(fresh_seed())
    x, w = torch.randn(m, k, generator=g).to(dev()), (torch.randn(n, k, generator=g) * 0.02).to(dev())
    x[0, :128] = 0  # an all-zero group
    if n > 128:
        w[-1, -1] = float("nan")  # the last block of the weight (not every row): NaN in its scale and products
    a, b = quantize(x, CastSpec(E4, Block(1, 128))), quantize(w, CastSpec(E4, Block(128, 128)))
    bias = (torch.randn(n, generator=g) * 0.1).bfloat16().to(dev())
    assert fp8.swap_tiles(m)[:2] == (max(16, 1 << (m - 1).bit_length()), fp8.SWAP_N)
    tol = 2.0 ** -11 if torch.cuda.is_available() else 1e-5
    plain = fp8.blockwise_mm(a, b, bias=bias, split=split, swap=False)
    for fused in (False, True):
        got = fp8.blockwise_mm(a, b, bias=bias, split=split, fused=fused, swap=True)
        assert got.shape == (m, n) and torch.equal(got.isnan(), plain.isnan())
        ok = ~plain.isnan()
        assert bool(ok.any()) and error_stats(plain[ok], got[ok])["rel_err"] < tol, fused
        emu = EmulatedBackend().mm(a, b) + bias.float()
        assert error_stats(emu[ok], got[ok])["rel_err"] < tol
        assert torch.equal(got[ok], fp8.blockwise_mm(a, b, bias=bias, split=split, fused=fused, swap=True)[ok])
    o16 = fp8.blockwise_mm(a, b, out_dtype=torch.bfloat16, bias=bias, split=split, swap=True)
    assert o16.dtype == torch.bfloat16 and error_stats(plain[ok], o16.float()[ok])["rel_err"] < 1e-2
    if not torch.cuda.is_available():  # the interpreter sums a block's products in one order either way
        assert torch.equal(got[ok], plain[ok])


@pytest.mark.parametrize("m", [1, 40, 130])
def test_blockwise_gemm_adds_the_bias_to_its_fp32_sum_before_rounding(m):
    """The bias in the GEMM's epilogue (a decode step's q/k/v GEMM with Qwen's biases: no separate
    add kernel): added to the fp32 sum, rounded to bf16 once, as the emulation adds it; with decode
    and prefill tiles. Through ``run_gemm`` on ``backend: triton`` the epilogue serves the bias."""
    from jetrl_cli.kernels import fp8
    from jetrl_cli.precision import gemm

    n, k = 256, 384
    x, w = torch.randn(m, k).to(dev()), (torch.randn(n, k) * 0.02).to(dev())
    bias = (torch.randn(n) * 0.1).bfloat16().to(dev())
    a, b = quantize(x, CastSpec(E4, Block(1, 128))), quantize(w, CastSpec(E4, Block(128, 128)))
    prod = fp8.blockwise_mm(a, b)
    got = fp8.blockwise_mm(a, b, bias=bias)
    # the same fp32 sum, then one fp32 add (exact products and order aside, the kernel's own sum)
    assert torch.equal(got, prod + bias.float())
    got16 = fp8.blockwise_mm(a, b, out_dtype=torch.bfloat16, bias=bias)
    assert torch.equal(got16, (prod + bias.float()).bfloat16())  # rounded once, after the add
    emu = EmulatedBackend().mm(a, b) + bias.float()
    assert error_stats(emu, got)["rel_err"] < (2.0 ** -11 if torch.cuda.is_available() else 1e-5)
    spec = GemmSpec(CastSpec(E4, Block(1, 128)), CastSpec(E4, Block(128, 128)), Format.BF16, "triton")
    added = []
    real_add = gemm.add_bias
    gemm.add_bias = lambda acc, bb: added.append(bb) or real_add(acc, bb)
    try:
        out = gemm.run_gemm(a, b, spec, "fprop", torch.device(dev()), bias)
    finally:
        gemm.add_bias = real_add
    assert torch.equal(out, got if out.dtype is torch.float32 else got16)
    assert added == [], "the bias must be added in the GEMM, not after it"
    with pytest.raises(ValueError, match=r"bias must be a contiguous \(256,\)"):
        fp8.blockwise_mm(a, b, bias=bias[:128])


@pytest.mark.parametrize("m,n,k,split", [(1, 200, 640, 2), (7, 96, 1000, 3), (33, 130, 1152, 4), (64, 64, 384, 8)])
def test_split_k_gemm_adds_its_splits_partial_sums_in_order(m, n, k, split):
    """Split-K (a decode step's GEMM, ``decode_split``): each split sums its run of K blocks as the
    unsplit kernel sums all of them, and the partials are added in split order, in fp32, the bias
    last, rounded once: bit for bit that, whatever the tiles; within the emulation's tolerance."""
    from jetrl_cli.kernels import fp8

    g = torch.Generator().manual_seed(fresh_seed())
    x, w = torch.randn(m, k, generator=g).to(dev()), (torch.randn(n, k, generator=g) * 0.02).to(dev())
    x[0, :128] = 0  # an all-zero group
    a, b = quantize(x, CastSpec(E4, Block(1, 128))), quantize(w, CastSpec(E4, Block(128, 128)))
    bias = (torch.randn(n, generator=g) * 0.1).bfloat16().to(dev())
    kblocks = -(-k // 128)
    splits = fp8._splits(kblocks, split)
    per = -(-kblocks // splits)
    tiles = fp8._mm_config(m, n)
    parts = []
    for s in range(splits):  # each split's run of blocks, as its own unsplit GEMM
        lo, hi = s * per, min((s + 1) * per, kblocks)
        cut = lambda q: QTensor(q.data[:, lo * 128:hi * 128], q.scale[:, lo:hi], q.spec)  # noqa: E731
        parts.append(fp8.blockwise_mm(cut(a), cut(b), tiles=tiles, split=1))
    want = parts[0]
    for p in parts[1:]:
        want = want + p
    got = fp8.blockwise_mm(a, b, bias=bias, split=split)
    assert torch.equal(got, want + bias.float())
    assert torch.equal(fp8.blockwise_mm(a, b, out_dtype=torch.bfloat16, bias=bias, split=split),
                       (want + bias.float()).bfloat16())
    assert torch.equal(got, fp8.blockwise_mm(a, b, bias=bias, split=split))  # one order: deterministic
    # the partials added by each tile's last program instead of a second kernel: the same bytes, and its
    # arrival counters are back at zero after each call (a later call, or a graph replay, starts clean)
    for out_dtype, expect in ((torch.float32, got), (torch.bfloat16, (want + bias.float()).bfloat16())):
        for _ in range(2):
            assert torch.equal(fp8.blockwise_mm(a, b, out_dtype=out_dtype, bias=bias, split=split, fused=True), expect)
            assert not fp8._SPLIT_COUNTERS[str(a.data.device)].any()
    assert torch.equal(fp8.blockwise_mm(a, b, split=split, fused=True), want)  # no bias
    emu = EmulatedBackend().mm(a, b) + bias.float()
    assert error_stats(emu, got)["rel_err"] < (2.0 ** -11 if torch.cuda.is_available() else 1e-5)
    with fp8.split_k(split):  # the forced choice reaches a decode call that asks for none
        assert torch.equal(fp8.blockwise_mm(a, b, bias=bias), got)


def test_split_counts():
    from jetrl_cli.kernels import fp8

    assert [fp8._splits(70, s) for s in (1, 2, 4, 8)] == [1, 2, 4, 8]  # down_proj at the 1.5B shape
    assert [fp8._splits(12, s) for s in (1, 5, 8, 16)] == [1, 4, 6, 12]  # 3, 2 and 1 blocks a split
    assert fp8._splits(1, 8) == 1 and fp8._splits(0, 4) == 1
    assert fp8.decode_split(16, 1536, 8960, torch.device("cpu")) == 1  # CPU: never split unless forced
    with pytest.raises(ValueError, match="must be >= 1"):
        with fp8.split_k(0):
            pass


def test_the_decode_split_is_timed_once_per_shape_and_reported(monkeypatch):
    """On a GPU the first decode GEMM of a shape times 1, 2, 4 and 8 splits (those its K blocks allow),
    each split also with its partials added by the last program of a tile (once that gave the second
    kernel's bytes), each of those with the plain tiles and with each block's product taken as
    ``b @ a.T`` (``swap``), and keeps the fastest, reported with the GEMM backends; a failing timing
    keeps one split and says why; during a graph capture nothing is decided. (Scripted times; on CPU
    the interpreter runs.)"""
    from jetrl_cli.kernels import fp8
    from jetrl_cli.precision import gemm

    monkeypatch.setattr(gemm, "_KERNELS", {})
    plain = {(1, False): 3.0, (2, False): 1.0, (3, False): 2.0, (2, True): 1.5, (3, True): 0.5}
    ms = {**{(*c, False): t for c, t in plain.items()}, **{(*c, True): t + 0.25 for c, t in plain.items()}}
    timed = []

    def device_time_ms(fn, device):
        c = fn()
        assert c.shape == (16, 96) and c.dtype == torch.bfloat16
        s, fused, swap = fn.__defaults__[0]
        timed.append((fp8._splits(3, s), fused, swap))
        return ms[timed[-1]]

    monkeypatch.setattr(gemm, "device_time_ms", device_time_ms)
    where = torch.device(dev())
    op = f"fp8 {fp8.SPLIT_OP} 16 rows, 96 x 384"
    got = fp8._choose_split(op, "fp8", 16, 96, 384, where)  # 3 K blocks: 1, 2 or 3 splits
    assert timed == list(ms) and (got["split"], got["fused"], got["swap"]) == (3, True, False)
    assert got["kernel"] == "3 splits, summed by the last program"
    assert got["why"].startswith("timed on 16 x 384 x 96: 1 split 3.0000 ms, 2 splits 1.0000 ms, 3 splits 2.0000 ms, "
                                 "2 splits, summed by the last program 1.5000 ms, 3 splits, summed by the last "
                                 "program 0.5000 ms, 1 split, b @ a.T 3.2500 ms, ")
    assert got["timings_ms"]["3f"] == 0.5 and got["timings_ms"]["3fs"] == 0.75
    assert gemm.kernel_choice(op, where) is got
    if where.type == "cuda":
        assert fp8.decode_split(16, 96, 384, where) == 3 and fp8._decode_flag(16, 96, 384, where)
        assert not fp8._decode_flag(16, 96, 384, where, "swap")
    ms[(2, False, True)] = 0.1  # the swapped tiles the fastest
    monkeypatch.setattr(gemm, "_KERNELS", {})
    got = fp8._choose_split(op, "fp8", 16, 96, 384, where)
    assert (got["split"], got["fused"], got["swap"]) == (2, False, True) and got["kernel"] == "2 splits, b @ a.T"
    if where.type == "cuda":
        assert fp8._decode_flag(16, 96, 384, where, "swap")
    # where the last-program sum gives other bytes than the two kernels, it is neither timed nor taken
    real = fp8.SPLIT_RUNS["fp8"]

    def wrong_when_fused(*shape):
        run = real(*shape)
        return lambda s, fused=False, swap=False: run(s, False, swap) + (1.0 if fused else 0.0)

    monkeypatch.setitem(fp8.SPLIT_RUNS, "fp8", wrong_when_fused)
    monkeypatch.setattr(gemm, "_KERNELS", {})
    timed.clear()
    got = fp8._choose_split(op, "fp8", 16, 96, 384, where)
    assert timed == [(s, False, swap) for swap in (False, True) for s in (1, 2, 3)]
    assert (got["split"], got["fused"], got["swap"]) == (2, False, True)
    assert got["why"].endswith("; the last-program sum was not the two kernels' bytes: not used; the last-program "
                               "sum of b @ a.T was not the two kernels' bytes: not used")

    # a swapped or fused case that fails (a compile's resources, say) is left out, said why; the plain
    # tiles' cases are still timed and the choice made among them
    def swap_fails(*shape):
        run = real(*shape)

        def go(s, fused=False, swap=False):
            if swap:
                raise RuntimeError("out of resources")
            return run(s, fused)
        return go

    monkeypatch.setitem(fp8.SPLIT_RUNS, "fp8", swap_fails)
    monkeypatch.setattr(gemm, "_KERNELS", {})
    timed.clear()
    got = fp8._choose_split(op, "fp8", 16, 96, 384, where)
    assert timed == [(1, False, False), (2, False, False), (3, False, False), (2, True, False), (3, True, False)]
    assert (got["split"], got["fused"], got["swap"]) == (3, True, False)
    assert got["why"].endswith("; b @ a.T failed (RuntimeError: out of resources): not used")

    # nor b @ a.T where it gives another result than the plain tiles on this device
    def wrong_when_swapped(*shape):
        run = real(*shape)
        return lambda s, fused=False, swap=False: run(s, fused) * (2.0 if swap else 1.0)

    monkeypatch.setitem(fp8.SPLIT_RUNS, "fp8", wrong_when_swapped)
    monkeypatch.setattr(gemm, "_KERNELS", {})
    timed.clear()
    got = fp8._choose_split(op, "fp8", 16, 96, 384, where)
    assert timed == [(1, False, False), (2, False, False), (3, False, False), (2, True, False), (3, True, False)]
    assert not got["swap"] and got["why"].endswith("; b @ a.T did not give the plain tiles' result: not used")

    def broken(fn, device):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(gemm, "device_time_ms", broken)
    got = fp8._choose_split(op, "fp8", 16, 96, 384, where)
    assert got["split"] == 1 and got["why"] == "not timed (RuntimeError: out of resources)"
    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fp8._choose_split(op, "fp8", 16, 96, 384, torch.device("cuda")) == {"split": 1}
    assert gemm.kernel_choice(op, torch.device("cuda")) is None


@pytest.mark.slow  # 20 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_a_wide_decode_steps_gemm_tiles_are_timed_once_per_shape_and_reported(monkeypatch):
    """Past a decode step's rows (65-512: a rollout's wide decode step, a short prefill), on a GPU the
    first GEMM of a shape times each of ``MID_TILES`` at 1, 2 and 4 splits (those its K blocks allow),
    FP8 and INT8, and keeps the fastest, reported; each candidate gives the default tiles' result
    (INT8: the same bits; FP8: the emulation's within a sum order's tolerance); a failing timing keeps
    the default and says why; during a capture nothing is decided; on CPU, at other rows or under
    ``split_k`` there is no choice. (Scripted times; on CPU the interpreter runs.)"""
    from jetrl_cli.kernels import fp8, int8
    from jetrl_cli.precision import gemm

    monkeypatch.setattr(gemm, "_KERNELS", {})
    where = torch.device(dev())
    for kind in ("fp8", "int8"):
        timed, outs = [], []

        def device_time_ms(fn, device):
            out = fn()
            assert out.shape == (128, 96) and out.dtype == torch.bfloat16
            tiles, s = fn.__defaults__[0]
            timed.append((tuple(tiles), fp8._splits(3, s)))
            outs.append(out)
            return 1.0 if timed[-1] == (fp8.MID_TILES[kind][2], 2) else 2.0

        monkeypatch.setattr(gemm, "device_time_ms", device_time_ms)
        op = f"{kind} {fp8.MID_OP} 128 rows, 96 x 384"
        got = fp8._choose_mid(op, kind, 128, 96, 384, where)  # 3 K blocks: 1, 2 or 3 splits
        assert timed == [(t, s) for t in fp8.MID_TILES[kind] for s in (1, 2, 3)]
        assert (tuple(got["tiles"]), got["split"]) == (fp8.MID_TILES[kind][2], 2)
        assert got["kernel"] == fp8._mid_name(fp8.MID_TILES[kind][2], 2) and len(got["timings_ms"]) == 9
        assert got["why"].startswith(f"timed on 128 x 384 x 96: {fp8._mid_name(fp8.MID_TILES[kind][0], 1)} 2.0000 ms")
        assert gemm.kernel_choice(op, where) is got
        for out in outs[1:]:  # every candidate: the default's result
            if kind == "int8":
                assert torch.equal(out, outs[0])
            else:
                assert error_stats(outs[0].float(), out.float())["rel_err"] < 1e-2
        if where.type == "cuda":
            assert fp8.mid_choice(100, 96, 384, where, kind) is got
        else:
            assert fp8.mid_choice(100, 96, 384, where, kind) is None  # CPU: the default
        assert fp8.mid_choice(64, 96, 384, torch.device("cuda"), kind) is None  # a decode step's rows
        assert fp8.mid_choice(513, 96, 384, torch.device("cuda"), kind) is None
        with fp8.split_k(2):
            assert fp8.mid_choice(100, 96, 384, torch.device("cuda"), kind) is None

    # a candidate that gives another result on this device is neither timed nor taken, FP8 or INT8
    real = dict(fp8.SPLIT_RUNS)
    for kind in ("fp8", "int8"):
        def off_tiles(*shape, kind=kind):
            run = real[kind](*shape)
            return lambda s, fused=False, swap=False, tiles=None: run(s, tiles=tiles) + (
                1.0 if tiles == fp8.MID_TILES[kind][2] else 0.0)

        monkeypatch.setitem(fp8.SPLIT_RUNS, kind, off_tiles)
        monkeypatch.setattr(gemm, "_KERNELS", {})
        timed.clear()
        got = fp8._choose_mid(f"{kind} op", kind, 128, 96, 384, where)
        assert timed == [(t, s) for t in fp8.MID_TILES[kind][:2] for s in (1, 2, 3)], kind
        assert tuple(got["tiles"]) != fp8.MID_TILES[kind][2]
        assert got["why"].endswith("".join(f"; {fp8._mid_name(fp8.MID_TILES[kind][2], s)} not the default's "
                                           "result: not used" for s in (1, 2, 3)))
    # a candidate whose timing fails is left out, said why
    def slow_fails(fn, device):
        tiles, s = fn.__defaults__[0]
        if tiles == fp8.MID_TILES["int8"][1]:
            raise RuntimeError("out of resources")
        return 1.0

    monkeypatch.setattr(fp8, "SPLIT_RUNS", real)
    monkeypatch.setattr(gemm, "device_time_ms", slow_fails)
    monkeypatch.setattr(gemm, "_KERNELS", {})
    got = fp8._choose_mid("op", "int8", 128, 96, 384, where)
    assert tuple(got["tiles"]) == fp8.MID_TILES["int8"][0] and len(got["timings_ms"]) == 6
    assert "; " + fp8._mid_name(fp8.MID_TILES["int8"][1], 1) + " not timed (RuntimeError: out of resources)" in got["why"]

    def broken(fn, device):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(gemm, "device_time_ms", broken)
    monkeypatch.setattr(gemm, "_KERNELS", {})
    got = fp8._choose_mid("op", "int8", 128, 96, 384, where)
    assert (tuple(got["tiles"]), got["split"]) == (int8._mm_config(128, 96)[:4], 1)
    assert got["why"] == "not timed (RuntimeError: out of resources)"
    assert fp8._mm_config(128, 96) == fp8.MID_TILES["fp8"][0]  # the default is the untimed tiles
    monkeypatch.setattr(gemm, "_KERNELS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    got = fp8._choose_mid("op", "fp8", 128, 96, 384, torch.device("cuda"))
    assert got == {"tiles": list(fp8.MID_TILES["fp8"][0]), "split": 1} and gemm.kernel_choice("op", where) is None


def test_a_candidate_kernel_agrees_with_the_default_as_its_kind_allows():
    """``fp8.agrees``: INT8 outputs bit for bit; FP8 the same non-finite values at the same places and the
    rest within ``AGREE_TOL`` of the norm (another order of sums), never a scaled or shifted result."""
    from jetrl_cli.kernels import fp8

    ref = (torch.randn(64, 96) * 3).bfloat16()
    ref[0, 0], ref[1, 1], ref[2, 2] = float("nan"), float("inf"), -float("inf")
    near = ref.float()
    near[3:] += near[3:] * 2.0**-9 * torch.randn(61, 96).sign()  # a bf16 ulp or so here and there
    near = near.bfloat16()
    assert fp8.agrees("fp8", ref.clone(), ref) and fp8.agrees("fp8", near, ref)
    assert not fp8.agrees("int8", near, ref) and fp8.agrees("int8", ref.clone(), ref)
    for bad in (ref * 2, ref + 1):
        assert not fp8.agrees("fp8", bad, ref)
    for at, v in (((0, 0), 1.0), ((1, 1), -float("inf")), ((5, 5), float("nan"))):
        bad = ref.clone()
        bad[at] = v
        assert not fp8.agrees("fp8", bad, ref), (at, v)


def test_gemm_tiles_by_rows_and_width():
    from jetrl_cli.kernels import fp8, int8

    assert fp8._mm_config(1, 1536) == (16, 32, 4, 4)  # decode, 1.5B o_proj / down_proj: 48 programs
    assert fp8._mm_config(64, 17920) == (64, 64, 4, 4)  # decode, 1.5B gate_up_proj
    assert fp8._mm_config(65, 1536) == fp8._mm_config(4096, 1536) == (64, 128, 4, 3)  # prefill, training
    assert int8._mm_config(8, 8960) == fp8.decode_tiles(8, 8960) == (16, 64, 4, 4)
    assert int8._mm_config(4096, 8960) == (128, 128, 8, 3)


def test_gemm_rejects_unsupported_scales():
    from jetrl_cli.kernels import fp8

    x = torch.randn(8, 128)
    with pytest.raises(ValueError, match="1x128 or 128x128 scales along K"):
        fp8.blockwise_mm(quantize(x, CastSpec(E4, "row")), quantize(x, CastSpec(E4, "128x128")))


def test_triton_backend_runs_the_unified_linear_layer_like_emulated():
    """Fprop, Dgrad and Wgrad through ``backend: triton`` vs ``emulated``: the triton quantizers give
    the same operands, the GEMMs the same products up to fp32 summation order."""
    from jetrl_cli.precision.flow import named_flow

    base = named_flow("fp8-unified").train.linear
    tri = LinearPrecision(*(GemmSpec(g.a, g.b, g.out, "triton") for g in (base.fprop, base.dgrad, base.wgrad)),
                          base.save_fp8_activations)
    assert get_backend("triton").name == "triton"
    x, w, gy = torch.randn(96, 256), torch.randn(128, 256) * 0.05, torch.randn(96, 128)
    outs = []
    for prec in (base, tri):
        xi = x.clone().to(dev()).requires_grad_(True)
        lin = JetLinear(torch.nn.Parameter(w.clone().to(dev())), None, prec)
        y = lin(xi)
        y.backward(gy.to(dev()))
        outs.append((y.detach().float(), xi.grad.float(), lin.weight.grad.float()))
    for e, t in zip(*outs):
        assert error_stats(e, t)["rel_err"] < 1e-2  # bf16 outputs: at most a rounding step apart
    assert error_stats(outs[0][0], outs[1][0])["rel_err"] < 5e-3
