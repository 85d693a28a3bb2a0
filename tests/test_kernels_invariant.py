"""The batch-invariant kernels (kernels/invariant.py) against their references, in Triton's interpreter.

Two kinds of test per kernel:

- numerics: the kernel against its reference evaluated in float64 on the same inputs, element by
  element, within a bound derived from fp32 rounding (unit roundoff u = 2^-24; a chain of n fp32
  additions of terms t_i errs by at most gamma_n * sum |t_i|, gamma_n = n u / (1 - n u)); bf16 outputs
  add one bf16 rounding (2^-8 relative). Exact where the math is exact (integer-valued data);
- batch invariance: a row (a token) computed alone, among a few rows, and in a large batch (for
  attention: a decode step, a prefill and the full-sequence forward) gives the same bits.

The bounds assume IEEE fp32 accumulation, which is what the interpreter does (numpy). On a GPU the
tensor cores accumulate with truncation (bf16) or ~14 bits (fp8 on Hopper), so the GEMM bounds are
widened there; those GPU variants have not been run (no GPU when they were written).
"""

import math
import os

import pytest
import torch

pytest.importorskip("triton")

from jetrl_cli.precision.formats import Block, Format  # noqa: E402
from jetrl_cli.precision.quant import CastSpec, quantize  # noqa: E402

from .conftest import fresh_seed  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a GPU or TRITON_INTERPRET=1")
U32, U16 = 2.0**-24, 2.0**-8
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def inv():
    from jetrl_cli.kernels import invariant

    return invariant


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, scale=1.0, dtype=F32):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def gamma(n):
    return n * U32 / (1 - n * U32)


def same_bits(x, y):
    """Bitwise equality (torch.equal would call -0.0 and 0.0 equal)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[x.dtype]
    return torch.equal(x.contiguous().view(ints), y.contiguous().view(ints))


def within(got, exact, bound):
    err = (got.double() - exact).abs()
    return bool((err <= bound).all()), float((err / bound.clamp_min(1e-300)).max())


# --- dense GEMM --------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k", [(70, 72, 200), (3, 130, 64), (1, 8, 300), (5, 136, 1600)])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_mm_within_fp32_accumulation_bound(inv, m, n, k, dtype, out_dtype):
    g = gen(m * 1000 + k)
    a, b, bias = randn(m, k, g=g, dtype=dtype), randn(n, k, g=g, scale=0.1, dtype=dtype), randn(n, g=g)
    c = inv.invariant_mm(a, b, bias, out_dtype)
    assert c.shape == (m, n) and c.dtype == out_dtype
    exact = inv.mm_reference(a.double(), b.double(), bias.double())
    nb = math.ceil(k / inv.MM_CONFIG["BLOCK_K"])
    chunks = inv.k_chunks(k, n, inv.MM_CONFIG["BLOCK_N"], inv.MM_CONFIG["BLOCK_K"])[0]  # 3 at K = 1600
    bound = gamma((2 if GPU else 1) * (k + nb + chunks + 1)) * (a.double().abs() @ b.double().abs().t()
                                                                + bias.double().abs())
    if out_dtype == BF16:
        bound = bound * (1 + U16) + U16 * exact.abs()
    ok, worst = within(c, exact, bound)
    assert ok, f"error {worst:.2f}x the bound"


@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_mm_is_exact_on_integer_data(inv, out_dtype):
    g = gen(1)
    a = torch.randint(-4, 5, (37, 200), generator=g).to(BF16).to(DEV)
    b = torch.randint(-4, 5, (50, 200), generator=g).to(BF16).to(DEV)
    bias = torch.randint(-100, 100, (50,), generator=g).float().to(DEV)
    want = (a.double() @ b.double().t() + bias.double()).to(out_dtype)  # every partial sum is exact in fp32
    assert same_bits(inv.invariant_mm(a, b, bias, out_dtype), want)
    for mode in ("split", "chunked"):  # K in one chunk: split mode's two kernels, and the unsplit one
        assert same_bits(inv.invariant_mm(a, b, bias, out_dtype, _mode=mode), want), mode


def test_bf16_output_rounds_to_nearest_even(inv):
    """``a @ I`` is exact, so the bf16 output is the rounding of ``a`` itself: ties, carries into the
    exponent, subnormals and overflow to inf must match torch's round-to-nearest-even cast (a -0.0 in a
    would come out +0.0: the sum starts at +0)."""
    edge = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1.99999, 3.0e38, -3.4e38, 0.0, 2**-127, 2**-130, -3 * 2**-135])
    a = torch.cat([edge, torch.randn(64 * 5 - len(edge), generator=gen(2)) * 100]).reshape(5, 64).to(DEV)
    c = inv.invariant_mm(a, torch.eye(64, device=DEV), out_dtype=BF16)
    assert same_bits(c, a.to(BF16))


@pytest.mark.parametrize("dtype,out_dtype", [(BF16, BF16), (F32, F32), (BF16, F32)])
def test_mm_rows_do_not_depend_on_the_batch(inv, dtype, out_dtype):
    g = gen(3)
    a, b, bias = randn(300, 200, g=g, dtype=dtype), randn(136, 200, g=g, scale=0.1, dtype=dtype), randn(136, g=g)
    full = inv.invariant_mm(a, b, bias, out_dtype)
    for rows in ([0], [64], [299], list(range(17)), [250, 3, 77]):
        assert same_bits(inv.invariant_mm(a[rows], b, bias, out_dtype), full[rows]), rows


@pytest.mark.parametrize("dtype,out_dtype", [(BF16, BF16), (F32, F32), (BF16, F32)])
@pytest.mark.parametrize("k,n,bias", [(1024, 72, False), (1600, 136, True)])
def test_mm_decode_and_training_launches_give_the_same_bits(inv, dtype, out_dtype, k, n, bias):
    """K in 2 chunks (1024: 8 steps each) or 3 (1600: 9, 9 and 7 steps; N past one tile). The split
    launch (a program per chunk, then the sum of the chunks: a decode step's) and the chunked one
    (a program walks every chunk: the trainer's), each forced, on the same inputs; and rows alone,
    in the mode each call picks (split) and in the other."""
    assert inv.k_chunks(k, n, inv.MM_CONFIG["BLOCK_N"], inv.MM_CONFIG["BLOCK_K"])[0] == (2 if k == 1024 else 3)
    g = gen(k + n)
    a, b = randn(70, k, g=g, dtype=dtype), randn(n, k, g=g, scale=0.1, dtype=dtype)
    bias = randn(n, g=g) if bias else None
    split = inv.invariant_mm(a, b, bias, out_dtype, _mode="split")
    chunked = inv.invariant_mm(a, b, bias, out_dtype, _mode="chunked")
    assert same_bits(split, chunked)
    assert same_bits(inv.invariant_mm(a, b, bias, out_dtype), chunked)
    _check_fused_sum(inv, lambda f: inv.invariant_mm(a, b, bias, out_dtype, _mode="split", _fused=f), split)
    for rows in ([0], [69], [64, 3]):
        assert same_bits(inv.invariant_mm(a[rows], b, bias, out_dtype), chunked[rows]), rows
        assert same_bits(inv.invariant_mm(a[rows], b, bias, out_dtype, _mode="chunked"), split[rows]), rows


def _check_fused_sum(inv, run, split):
    """Split mode's sum in the GEMM (each tile's last program adds the chunks' partials) and in a second
    kernel: the same bits, twice in a row (the arrival counters are back at zero after each call: a
    later call, or a CUDA graph's replay, starts clean)."""
    from jetrl_cli.kernels import fp8

    for _ in range(2):
        assert same_bits(run(True), split)
        assert not fp8._SPLIT_COUNTERS[str(split.device)].any()
    assert same_bits(run(False), split)


def chunk_sum(parts, steps, reverse=False):
    """fp32 parts (one per K step) summed from zero within each run of ``steps``, the runs' sums added
    in order (or in reverse: a wrong order, for the negative checks)."""
    sums = []
    for c0 in range(0, len(parts), steps):
        p = torch.zeros_like(parts[0])
        for x in parts[c0:c0 + steps]:
            p = p + x
        sums.append(p)
    total = None
    for p in sums[::-1] if reverse else sums:
        total = p if total is None else total + p
    return total


def steps_with_rounding(rows, width, steps, g, big):
    """(rows, steps * width) values, each ``width``-wide K step either "big" (multiples of ``big``, < 256
    of them) or "small" (integers in [-4, 4]): every step's dot with a {-1, 0, 1} operand is exact in
    fp32, and adding a small step to a big running sum rounds -- so the bits tell how the steps were
    grouped and in which order the groups were added."""
    kind = torch.rand(rows, steps, 1, generator=g) < 0.4
    bigs = torch.randint(-255, 256, (rows, steps, width), generator=g).float() * big
    smalls = torch.randint(-4, 5, (rows, steps, width), generator=g).float()
    return torch.where(kind, bigs, smalls).reshape(rows, steps * width)


@pytest.mark.skipif(GPU, reason="bitwise in the interpreter (a step's dot, then one add); a GPU's dot adds into it")
@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_mm_adds_the_chunks_in_order(inv, out_dtype):
    """Each K step's dot exact, each addition of a step or a chunk rounding: the kernel's bits, in both
    modes, are those of steps summed from zero within their chunks (9, 9, 7 steps of 64) and the
    chunks' sums added in order -- and not (fp32 output; bf16's rounding hides most of it) those of one
    sum over all steps, of chunks one step longer or shorter, or of the chunks added in reverse."""
    g = gen(12)
    bk = inv.MM_CONFIG["BLOCK_K"]
    k, n = 1600, 8
    chunks, steps = inv.k_chunks(k, n, inv.MM_CONFIG["BLOCK_N"], bk)
    assert (chunks, steps) == (3, 9)
    a = steps_with_rounding(6, bk, 25, g, 2.0**20)[:, :k].to(BF16)
    b = torch.randint(-1, 2, (n, k), generator=g).to(BF16)
    bias = torch.randn(n, generator=g)
    parts = [a[:, k0:k0 + bk].float() @ b[:, k0:k0 + bk].float().t() for k0 in range(0, k, bk)]
    want = (chunk_sum(parts, steps) + bias).to(out_dtype)
    assert same_bits(inv.mm_reference(a, b, bias, out_dtype, chunked=True), want)
    for wrong in (chunk_sum(parts, len(parts)), chunk_sum(parts, steps - 1), chunk_sum(parts, steps + 1),
                  chunk_sum(parts, steps, reverse=True)):
        assert not same_bits(wrong + bias, chunk_sum(parts, steps) + bias)  # the data tell these apart (in fp32)
    for mode in ("split", "chunked"):
        assert same_bits(inv.invariant_mm(a, b, bias, out_dtype, _mode=mode), want), mode
    assert same_bits(inv.invariant_mm(a, b, bias, out_dtype, _mode="split", _fused=True), want)


def test_k_chunks_is_the_documented_rule(inv):
    """``k_chunks``: a function of (K, N) and the tile only (never of M or of the device); chunk
    boundaries on steps of BLOCK_K, no empty chunk, >= 512 of K per chunk on average, <= 264
    column tiles x chunks; Qwen2.5-1.5B's GEMMs as the docstring gives them."""
    import inspect

    assert list(inspect.signature(inv.k_chunks).parameters) == ["k", "n", "block_n", "block_k"]
    qwen = {(2048, 1536): ((3, 8), (3, 4)), (1536, 1536): ((3, 8), (3, 4)), (17920, 1536): ((1, 24), (1, 12)),
            (151936, 1536): ((1, 24), (1, 12)), (1536, 8960): ((16, 9), (14, 5))}
    for (n, k), (bf16, fp8) in qwen.items():
        assert inv.k_chunks(k, n, 128, 64) == bf16 and inv.k_chunks(k, n, 128, 128) == fp8, (n, k)
    for k in (1, 63, 64, 100, 511, 512, 1023, 1024, 1100, 1600, 4096, 8960, 20000, 100000):
        for n in (1, 128, 129, 1536, 2048, 4224, 8448, 17920):
            for bk in (64, 128):
                chunks, steps = inv.k_chunks(k, n, 128, bk)
                total, tiles, least = -(-k // bk), -(-n // 128), -(-inv.MIN_CHUNK_K // bk)
                assert (chunks - 1) * steps < total <= chunks * steps, (k, n, bk)  # no chunk empty
                assert 1 <= chunks <= max(inv.SPLIT_CHOICES), (k, n, bk)
                if chunks > 1:
                    assert total >= chunks * least and tiles * chunks <= inv.SPLIT_PROGRAMS, (k, n, bk)
                for c in inv.SPLIT_CHOICES:  # the largest choice allowed: none gives more chunks
                    if total >= c * least and tiles * c <= inv.SPLIT_PROGRAMS:
                        assert -(-total // -(-total // c)) <= chunks, (k, n, bk, c)


def test_mm_rejects_bad_input(inv):
    a = torch.randn(4, 8, device=DEV)  # on the kernels' device: a CPU tensor on a GPU machine is refused first
    for args, msg in [((a, torch.randn(3, 9, device=DEV)), "do not match"), ((a.half(), a), "operand a must be"),
                      ((a, a, torch.randn(5, device=DEV)), "bias must be"), ((a, a, None, torch.float16), "out_dtype")]:
        with pytest.raises(ValueError, match=msg):
            inv.invariant_mm(*args)
    with pytest.raises(ValueError, match="mode must be"):
        inv.invariant_mm(a, a, _mode="splt")
    if GPU:  # without the interpreter, CPU tensors (and mixed devices) are named, not launched
        with pytest.raises(ValueError, match="need CUDA tensors"):
            inv.invariant_mm(a.cpu(), a.cpu())
        with pytest.raises(ValueError, match="different devices"):
            inv.invariant_mm(a, a.cpu())


# --- blockwise FP8 GEMM ------------------------------------------------------------------------------

E4 = Format.FP8_E4M3


@pytest.mark.parametrize("m,n,k,b_block,out_dtype", [(70, 130, 300, Block(128, 128), F32),
                                                     (70, 130, 300, Block(1, 128), BF16),
                                                     (1, 64, 128, Block(128, 128), BF16),
                                                     (129, 72, 256, Block(1, 128), F32),
                                                     (5, 136, 1600, Block(128, 128), BF16)])
def test_blockwise_mm_within_bound(inv, m, n, k, b_block, out_dtype):
    g = gen(m + n + k)
    x, w, bias = randn(m, k, g=g), randn(n, k, g=g, scale=0.05), randn(n, g=g)
    a, b = quantize(x, CastSpec(E4, Block(1, 128))), quantize(w, CastSpec(E4, b_block))
    c = inv.invariant_blockwise_mm(a, b, bias, out_dtype)
    exact = inv.blockwise_mm_reference(a, b, bias, compute_dtype=torch.float64)
    nb = math.ceil(k / 128)
    u_dot = U32 if not GPU else 2.0**-13  # Hopper fp8 MMA keeps ~14 bits (DeepSeek-V3 3.3.2); unverified
    absprod = a.dequantize(torch.float64).abs() @ b.dequantize(torch.float64).abs().t()
    chunks = inv.k_chunks(k, n, inv.FP8_MM_CONFIG["BLOCK_N"], 128)[0]  # 3 at K = 1600
    bound = (min(k, 128) * u_dot + gamma(nb + chunks + 4)) * (absprod + bias.double().abs())
    if out_dtype == BF16:
        bound = bound * (1 + U16) + U16 * exact.abs()
    ok, worst = within(c, exact, bound)
    assert ok, f"error {worst:.2f}x the bound"


@pytest.mark.skipif(GPU, reason="bitwise equal to kernels.fp8 in the interpreter; on a GPU they compile apart")
@pytest.mark.parametrize("k", [300, 1600])
def test_blockwise_mm_is_kernels_fp8_math(inv, k):
    """``kernels.fp8.blockwise_mm``'s math: K = 300 is one chunk (its unsplit GEMM); K = 1600 is 3
    chunks of 5, 5 and 3 blocks, its GEMM split 3 ways (each run of blocks summed on its own, the
    runs' sums added in order)."""
    from jetrl_cli.kernels import fp8

    g = gen(5)
    a = quantize(randn(100, k, g=g), CastSpec(E4, Block(1, 128)))
    b = quantize(randn(200, k, g=g, scale=0.05), CastSpec(E4, Block(128, 128)))
    chunks, steps = inv.k_chunks(k, 200, inv.FP8_MM_CONFIG["BLOCK_N"], 128)
    assert (chunks, steps) == ((1, 3) if k == 300 else (3, 5))
    want = fp8.blockwise_mm(a, b, split=chunks)
    for mode in ("split", "chunked"):
        assert same_bits(inv.invariant_blockwise_mm(a, b, _mode=mode), want), mode


@pytest.mark.parametrize("b_block,out_dtype", [(Block(128, 128), BF16), (Block(1, 128), F32)])
def test_blockwise_mm_decode_and_training_launches_give_the_same_bits(inv, b_block, out_dtype):
    """K = 1600 in 3 chunks of 5, 5 and 3 blocks (the last one 64 wide), N = 136 past one tile, with
    a bias: the split launch and the chunked one, each forced, on the same inputs; and tokens
    quantized and multiplied alone (one row: split mode), in both modes."""
    g = gen(13)
    k, n = 1600, 136
    assert inv.k_chunks(k, n, inv.FP8_MM_CONFIG["BLOCK_N"], 128) == (3, 5)
    x, w, bias = randn(70, k, g=g), randn(n, k, g=g, scale=0.05), randn(n, g=g)
    spec = CastSpec(E4, Block(1, 128))
    a, b = quantize(x, spec), quantize(w, CastSpec(E4, b_block))
    split = inv.invariant_blockwise_mm(a, b, bias, out_dtype, _mode="split")
    chunked = inv.invariant_blockwise_mm(a, b, bias, out_dtype, _mode="chunked")
    assert same_bits(split, chunked) and same_bits(inv.invariant_blockwise_mm(a, b, bias, out_dtype), chunked)
    _check_fused_sum(inv, lambda f: inv.invariant_blockwise_mm(a, b, bias, out_dtype, _mode="split", _fused=f), split)
    for rows in ([0], [69], [64, 3]):
        alone = quantize(x[rows], spec)
        assert same_bits(inv.invariant_blockwise_mm(alone, b, bias, out_dtype), chunked[rows]), rows
        assert same_bits(inv.invariant_blockwise_mm(alone, b, bias, out_dtype, _mode="chunked"), split[rows]), rows


def test_blockwise_mm_adds_the_chunks_in_order(inv):
    """FP8 operands of small integers whose scales are 1 or 2^20 per block: each block's scaled
    product is exact, each addition of a block or of a chunk's sum can round. The kernel's bits (both
    modes) are those of blocks summed from zero within their chunks (5, 5, 3 blocks) and the chunks'
    sums added in order, not those of one sum over all blocks, of other chunk lengths, or of the
    chunks added in reverse (on a GPU too: a block's dot is exact and its scaling an fp32 FMA)."""
    from jetrl_cli.precision.quant import QTensor

    g = gen(14)
    m, n, k = 6, 136, 1600
    nb = -(-k // 128)
    chunks, steps = inv.k_chunks(k, n, inv.FP8_MM_CONFIG["BLOCK_N"], 128)
    assert (chunks, steps) == (3, 5)
    qa = torch.randint(-8, 9, (m, k), generator=g).float().to(torch.float8_e4m3fn)
    qb = torch.randint(-1, 2, (n, k), generator=g).float().to(torch.float8_e4m3fn)
    sa = torch.where(torch.rand(m, nb, generator=g) < 0.4, 2.0**20, 1.0).t().contiguous().t()  # (M, blocks), col-major
    sb = torch.where(torch.rand(2, nb, generator=g) < 0.5, 2.0**-3, 2.0**2)  # 128 x 128 weight blocks
    a = QTensor(qa.to(DEV), sa.to(DEV), CastSpec(E4, Block(1, 128), False, 1e-12))
    b = QTensor(qb.to(DEV), sb.to(DEV), CastSpec(E4, Block(128, 128), False, 1e-12))
    sbr = sb.repeat_interleave(128, 0)[:n]
    parts = [(qa[:, k0:k0 + 128].float() @ qb[:, k0:k0 + 128].float().t()) * sa[:, i, None] * sbr[None, :, i]
             for i, k0 in enumerate(range(0, k, 128))]
    want = chunk_sum(parts, steps)
    assert same_bits(inv.blockwise_mm_reference(a, b).cpu(), want)
    for wrong in (chunk_sum(parts, nb), chunk_sum(parts, steps - 1), chunk_sum(parts, steps + 1),
                  chunk_sum(parts, steps, reverse=True)):
        assert not same_bits(wrong, want)  # the data tell these apart
    for mode in ("split", "chunked"):
        assert same_bits(inv.invariant_blockwise_mm(a, b, _mode=mode).cpu(), want), mode


@pytest.mark.parametrize("b_block", [Block(128, 128), Block(1, 128)])
def test_blockwise_mm_rows_do_not_depend_on_the_batch(inv, b_block):
    g = gen(6)
    x, w = randn(130, 300, g=g), randn(136, 300, g=g, scale=0.05)
    spec = CastSpec(E4, Block(1, 128))
    b = quantize(w, CastSpec(E4, b_block))
    full = inv.invariant_blockwise_mm(quantize(x, spec), b, out_dtype=BF16)
    for rows in ([0], [129], [5, 6, 7], [100, 3, 77]):
        alone = inv.invariant_blockwise_mm(quantize(x[rows], spec), b, out_dtype=BF16)  # each token quantized alone
        assert same_bits(alone, full[rows]), rows


def test_blockwise_mm_rejects_bad_operands(inv):
    x = torch.randn(8, 256)
    row = quantize(x, CastSpec(E4, Block(1, 128)))
    with pytest.raises(ValueError, match="1x128 or 128x128 scales along K"):
        inv.invariant_blockwise_mm(row, quantize(x, CastSpec(E4, "row")))
    with pytest.raises(ValueError, match="2-D fp8 QTensor"):
        inv.invariant_blockwise_mm(row, x)
    with pytest.raises(ValueError, match="do not match"):
        inv.invariant_blockwise_mm(row, quantize(torch.randn(8, 128), CastSpec(E4, Block(1, 128))))


# --- attention ---------------------------------------------------------------------------------------

def attention_bound(inv, q, k, v, q_pos, out_bf16):
    """Per-element bounds on |out - exact| and |lse - exact| (float64), first order in u:
    scores err by E <= gamma_{d+2} scale sum|q||k| (softmax weights then by a factor exp(+-2E));
    each exp2 by u(|arg| + 3) with |arg| <= R (the row's score range plus the largest score, base 2);
    p rounded to bf16 for p @ v (2^-8) when the inputs are bf16; the weighted sum and the running sum
    by gamma over (keys + 3 per key block) (the rescales cancel in the ratio up to one rounding each)."""
    b, h, t, d = q.shape
    rep = h // k.shape[1]
    scale = d**-0.5
    qd, kd, vd = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    vis = (torch.arange(k.shape[2], device=q.device)[None, None, :] <= q_pos[:, :, None])[:, None]
    s = torch.where(vis, qd @ kd.transpose(-1, -2) * scale, -math.inf)
    err_s = torch.where(vis, gamma(d + 2) * scale * (qd.abs() @ kd.abs().transpose(-1, -2)), 0).amax(-1)
    lse = torch.logsumexp(s, -1)
    wts = torch.exp(s - lse[..., None])
    s2 = torch.where(vis, s * math.log2(math.e), 0)
    top = s2.amax(-1, keepdim=True)
    rng = torch.where(vis, s2.abs() + (s2 - top).abs(), 0).amax(-1)
    n = (q_pos + 1).double()[:, None]
    chain = n + 3 * torch.ceil(n / inv.ATT_BLOCK_N) + 10
    rel = torch.expm1(2 * err_s) + (U16 if q.dtype == BF16 else 0) + U32 * (2 * rng + chain)
    out = wts @ vd
    b_out = rel[..., None] * (wts @ vd.abs())
    b_out = b_out * (1 + U16) + U16 * out.abs() if out_bf16 else b_out + U32 * out.abs()
    b_lse = err_s + U32 * (rng + chain) + 3 * U32 * lse.abs()
    return out, lse, b_out, b_lse


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("b,h,hk,t,w,d", [(2, 4, 2, 70, 80, 24), (1, 2, 2, 5, 16, 64)])
def test_attention_within_bound(inv, dtype, b, h, hk, t, w, d):
    g = gen(t + w + d)
    q, k, v = randn(b, h, t, d, g=g, dtype=dtype), randn(b, hk, w, d, g=g, dtype=dtype), randn(b, hk, w, d, g=g, dtype=dtype)
    pos = torch.arange(t, device=DEV).expand(b, t) + torch.arange(b, device=DEV)[:, None] * (w - t)  # sequence 1 ends at w - 1
    out, lse = inv.invariant_attention(q, k, v, pos)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, t) and lse.dtype == F32
    exact, exact_lse, b_out, b_lse = attention_bound(inv, q, k, v, pos, dtype == BF16)
    ref, ref_lse = inv.attention_reference(q.double(), k.double(), v.double(), pos, compute_dtype=torch.float64)
    assert torch.allclose(ref, exact) and torch.allclose(ref_lse, exact_lse)  # the reference is this math
    for got, want, bound in ((out, exact, b_out), (lse, exact_lse, b_lse)):
        ok, worst = within(got, want, bound)
        assert ok, f"error {worst:.2f}x the bound"


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_attention_decode_prefill_and_training_give_the_same_bits(inv, dtype):
    """Two sequences of 70 tokens, GQA 4 heads / 2 KV heads. The trainer's forward sees all 70
    queries (q_pos None); decode steps see one query per sequence at its own position against a
    96-wide cache whose unwritten slots hold NaN; a prefill sees the first 33; a chunk sees queries
    40..69 (other rows of other programs than in the full forward); a sequence alone, itself."""
    g = gen(7)
    b, h, hk, t, d = 2, 4, 2, 70, 32
    q, k, v = randn(b, h, t, d, g=g, dtype=dtype), randn(b, hk, t, d, g=g, dtype=dtype), randn(b, hk, t, d, g=g, dtype=dtype)
    full, full_lse = inv.invariant_attention(q, k, v)
    for steps in ([0, 69], [63, 64], [40, 1]):
        kc = torch.full((b, hk, 96, d), float("nan"), dtype=dtype, device=DEV)
        vc = kc.clone()
        qd = torch.empty(b, h, 1, d, dtype=dtype, device=DEV)
        for s, p in enumerate(steps):
            kc[s, :, :p + 1], vc[s, :, :p + 1], qd[s, :, 0] = k[s, :, :p + 1], v[s, :, :p + 1], q[s, :, p]
        out, lse = inv.invariant_attention(qd, kc, vc, torch.tensor(steps, device=DEV)[:, None])
        for s, p in enumerate(steps):
            assert same_bits(out[s, :, 0], full[s, :, p]) and torch.equal(lse[s, :, 0], full_lse[s, :, p]), (s, p)
    nan_tail = torch.full((b, hk, 15, d), float("nan"), dtype=dtype, device=DEV)
    pre, pre_lse = inv.invariant_attention(q[:, :, :33], torch.cat([k[:, :, :33], nan_tail], 2),
                                           torch.cat([v[:, :, :33], nan_tail], 2))
    assert same_bits(pre, full[:, :, :33]) and torch.equal(pre_lse, full_lse[:, :, :33])
    chunk, _ = inv.invariant_attention(q[:, :, 40:], k, v, torch.arange(40, 70, device=DEV).expand(b, 30))
    assert same_bits(chunk, full[:, :, 40:])
    alone, _ = inv.invariant_attention(q[1:], k[1:], v[1:])
    assert same_bits(alone, full[1:])


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 9])
def test_attention_writes_o_projs_fp8_input_bit_for_bit(inv, t, cache):
    """``quantize_out``: the output as o_proj's FP8 1x128 operand (a head's 128 outputs one group of its
    (sequence, query) row), written by the kernel: bit for bit the reference quantizer on the kernel's
    own bf16 output seen as (b t, heads d), scales (b t, heads) with strides (1, b t) -- for decode steps
    (t = 1, over a cache, bf16 or FP8 read as stored) and a prefill; a head of zeros (its scale at the
    amax floor) included. Forward only; a spec or dtype it cannot write is refused."""
    from jetrl_cli.kernels.layouts import is_gemm_layout

    from .test_kernels_attention import cached_kv
    from .triton_interp_fix import fixed_fp8_conversion

    g = gen(fresh_seed())
    b, h, hk, d, w = 3, 4, 2, 128, 40
    pow2 = bool(torch.randint(0, 2, (), generator=g))
    q, k, v = randn(b, h, t, d, g=g, dtype=BF16), randn(b, hk, w, d, g=g, dtype=BF16), randn(b, hk, w, d, g=g, dtype=BF16)
    v[1, 0] = 0  # sequence 1's first KV head: its query heads' outputs are zero
    q_pos = torch.randint(t - 1, w, (b, 1), generator=g).to(DEV) + torch.arange(t, device=DEV) - (t - 1)
    k, v, scales = cached_kv(cache, k, v)
    spec = CastSpec(Format.FP8_E4M3, Block(1, 128), pow2)
    with fixed_fp8_conversion():  # the interpreter's fp32 -> fp8 cast is wrong (tests/triton_interp_fix.py)
        got, lse_q = inv.invariant_attention(q, k, v, q_pos, kv_scales=scales, quantize_out=spec)
    out, lse = inv.invariant_attention(q, k, v, q_pos, kv_scales=scales)
    want = quantize(out.transpose(1, 2).reshape(b * t, h * d).float(), spec)
    assert got.spec == spec and is_gemm_layout(got) and got.scale.stride() == (1, b * t)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale) and torch.equal(lse_q, lse)
    zero_rows = got.scale[t:2 * t, :h // hk]  # sequence 1's rows, the zero KV head's query heads
    assert zero_rows.eq(spec.amax_floor / Format.FP8_E4M3.max).all() or pow2
    with pytest.raises(ValueError, match="quantize_out: needs bf16 queries with head_dim 128"):
        inv.invariant_attention(q.float(), k.float() if cache == "bf16" else k, v.float() if cache == "bf16" else v,
                                q_pos, kv_scales=scales, quantize_out=spec)
    if cache == "bf16":
        with pytest.raises(ValueError, match="quantize_out: forward only"):
            inv.invariant_attention(q.requires_grad_(), k, v, q_pos, quantize_out=spec)


def test_attention_gradient_matches_float64(inv):
    g = gen(8)
    q = randn(2, 4, 20, 16, g=g).requires_grad_()
    k, v = randn(2, 2, 20, 16, g=g).requires_grad_(), randn(2, 2, 20, 16, g=g).requires_grad_()
    dy = randn(2, 4, 20, 16, g=g)
    out, lse = inv.invariant_attention(q, k, v)
    assert not lse.requires_grad
    assert same_bits(out.detach(), inv.invariant_attention(q.detach(), k.detach(), v.detach())[0])  # same kernel
    grads = torch.autograd.grad((out * dy).sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = inv.attention_reference(q64, k64, v64, compute_dtype=torch.float64)[0]
    want = torch.autograd.grad((ref * dy.double()).sum(), (q64, k64, v64))
    for got, w in zip(grads, want):
        assert float((got.double() - w).norm() / w.norm()) < 1e-5


def test_attention_rejects_bad_input(inv):
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 3, 8, 16)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        inv.invariant_attention(q, k, k)
    k = torch.randn(2, 2, 8, 16)
    with pytest.raises(ValueError, match="must all be bfloat16 or all float32"):
        inv.invariant_attention(q.bfloat16(), k, k)
    with pytest.raises(ValueError, match=r"q_pos must be an int32/int64 \(b, t\)"):
        inv.invariant_attention(q, k, k, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"q_pos must lie in \[0, 8\)"):
        inv.invariant_attention(q, k, k, torch.full((2, 5), 8))
    with pytest.raises(ValueError, match="t=9 > key width 8"):
        inv.invariant_attention(torch.randn(2, 4, 9, 16), k, k)


# --- RMSNorm and log-softmax -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("rows,n", [(5, 3000), (3, 64)])
def test_rms_norm_within_bound(inv, dtype, rows, n):
    g = gen(n)
    x, w = randn(rows, n, g=g, scale=3.0, dtype=dtype), randn(n, g=g)
    y = inv.invariant_rms_norm(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    exact = inv.rms_norm_reference(x.double(), w.double(), 1e-6)
    # sum of squares: a chain of (chunks + 33) roundings (lanes, then a tree <= 32 deep); then
    # / n, + eps, sqrt (halves the relative error), 1 / ., and two products
    rel = ((math.ceil(n / inv.ROW_BLOCK) + 35) / 2 + 4) * U32
    bound = rel * exact.abs()
    if dtype == BF16:
        bound = bound * (1 + U16) + U16 * exact.abs()
    ok, worst = within(y, exact, bound)
    assert ok, f"error {worst:.2f}x the bound"


def test_rms_norm_is_exact_when_the_sum_is(inv):
    g = gen(9)
    x = torch.randint(-8, 9, (6, 2500), generator=g).float().to(DEV)  # sums of squares exact in fp32
    w = torch.randn(2500, generator=g).to(DEV)
    assert same_bits(inv.invariant_rms_norm(x, w, 1e-5), inv.rms_norm_reference(x, w, 1e-5))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_rms_norm_rows_do_not_depend_on_the_batch(inv, dtype):
    g = gen(10)
    x, w = randn(2, 20, 1500, g=g, dtype=dtype), randn(1500, g=g)
    full = inv.invariant_rms_norm(x, w, 1e-6)
    assert full.shape == x.shape
    flat = full.reshape(40, 1500)
    for rows in ([0], [39], [5, 6, 7], [30, 3, 17]):
        assert same_bits(inv.invariant_rms_norm(x.reshape(40, 1500)[rows], w, 1e-6), flat[rows])


def log_softmax_bound(x64, n):
    """Per-lane sums over the chunks, rescaled by exp factors (each exp errs by u(|arg| + 3), |arg| <= the
    row's range R), a tree of <= 32 levels over the lanes, then log and x - lse."""
    fin = torch.isfinite(x64)
    top = torch.where(fin, x64, -math.inf).amax(-1, keepdim=True)
    rng = (top - torch.where(fin, x64, math.inf).amin(-1, keepdim=True)).clamp_min(0)
    lse = torch.logsumexp(x64, -1, keepdim=True)
    nc = math.ceil(n / 1024)
    err_lse = ((nc + 2) * (rng + 4) + nc + 34) * U32 + 2 * U32 * lse.abs()
    return err_lse + U32 * (x64 - lse).abs()


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("rows,n", [(4, 3000), (2, 50), (2, 20000)])  # 20000: three of SOFTMAX_CHUNK's programs
def test_log_softmax_within_bound(inv, dtype, rows, n):
    g = gen(n + 1)
    x = randn(rows, n, g=g, scale=4.0, dtype=dtype)
    x[0, ::7] = -math.inf  # masked by top-k / top-p
    y = inv.invariant_log_softmax(x)
    assert y.dtype == F32 and y.shape == x.shape
    exact = inv.log_softmax_reference(x.double())
    fin = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(y), fin) and (y[~fin] == -math.inf).all()
    ok, worst = within(y[fin], exact[fin], log_softmax_bound(x.double(), n).expand_as(exact)[fin])
    assert ok, f"error {worst:.2f}x the bound"


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_log_softmax_gradient_is_log_softmaxs(inv, dtype):
    """The trainer differentiates the batch-invariant logprobs: log-softmax's own backward, on the
    kernel's outputs, against torch's on the same input (masked entries included)."""
    g = gen(fresh_seed())
    x = randn(5, 300, g=g, scale=3.0, dtype=dtype)
    x[1, ::5] = -math.inf
    up = randn(5, 300, g=g)
    a = x.clone().requires_grad_()
    (inv.invariant_log_softmax(a) * up).sum().backward()
    b = x.clone().requires_grad_()
    (torch.log_softmax(b.float(), -1) * up).sum().backward()
    assert a.grad.dtype == dtype
    tol = 1e-2 if dtype == BF16 else 1e-5
    assert (a.grad.float() - b.grad.float()).abs().max() <= tol * up.abs().max()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on -inf - -inf in the interpreter
def test_log_softmax_all_masked_row_is_nan_like_torch(inv):
    x = torch.randn(3, 40).to(DEV)
    x[1] = -math.inf
    y = inv.invariant_log_softmax(x)
    assert torch.equal(y.isnan(), torch.log_softmax(x, -1).isnan()) and y[1].isnan().all()


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("n", [2100, 17000])  # one program a row, and three (SOFTMAX_CHUNK's split)
def test_log_softmax_rows_do_not_depend_on_the_batch(inv, dtype, n):
    g = gen(11)
    x = randn(40 if n < 5000 else 12, n, g=g, scale=3.0, dtype=dtype)
    if n > inv.SOFTMAX_CHUNK:
        x[1, :inv.SOFTMAX_CHUNK] = -math.inf  # a chunk all masked (top-k), and one partly
        x[2, inv.SOFTMAX_CHUNK - 5:] = -math.inf
    full = inv.invariant_log_softmax(x)
    for rows in ([0], [len(x) - 1], [5, 6, 7], [1, 2], [len(x) - 2, 3, 1]):
        assert same_bits(inv.invariant_log_softmax(x[rows]), full[rows])
    assert torch.isfinite(full[1, inv.SOFTMAX_CHUNK:]).all() if n > inv.SOFTMAX_CHUNK else True


def test_row_kernels_reject_bad_input(inv):
    with pytest.raises(ValueError, match="weight must be a float"):
        inv.invariant_rms_norm(torch.randn(3, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        inv.invariant_log_softmax(torch.randn(3, 8).half())
    with pytest.raises(ValueError, match="non-empty last dim"):
        inv.invariant_log_softmax(torch.randn(3, 0))


@pytest.mark.parametrize("how", ["faster", "slower", "other bits", "fails"])
def test_the_split_sum_in_the_gemm_is_a_timed_choice_kept_only_with_the_same_bytes(inv, monkeypatch, how):
    """On a GPU the first split call of a weight shape times the chunks' sum in the GEMM against the
    second kernel and keeps the faster -- the fused one only where it wrote the second kernel's bytes;
    a timing that fails keeps the two kernels. Each decision says why (``note_kernel``). Here the
    device's clock is stood in for: the fused way "takes" 1 or 3 units, the two kernels 2."""
    from jetrl_cli.precision import gemm

    monkeypatch.setattr(gemm, "_KERNELS", {})
    g = gen(21)
    a, b = randn(4, 1024, g=g, dtype=BF16), randn(72, 1024, g=g, scale=0.1, dtype=BF16)

    def run(fused):
        if how == "fails":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        c = inv.invariant_mm(a, b, None, BF16, _mode="split", _fused=fused)
        return c + 1 if fused and how == "other bits" else c

    times = iter([2.0, 1.0 if how == "faster" else 3.0])
    monkeypatch.setattr(gemm, "device_time_ms", lambda fn, device: (fn(), next(times))[1])
    choice = inv._choose_fused_sum("bf16 test op", run, torch.device("cpu"))
    assert choice is gemm.kernel_choice("bf16 test op", torch.device("cpu"))
    assert choice["fused"] is (how == "faster")
    assert choice["kernel"] == ("summed by the last program" if how == "faster" else "two kernels")
    if how == "other bits":
        assert "not the two kernels' bytes" in choice["why"] and list(choice["timings_ms"]) == ["two kernels"]
    elif how == "fails":
        assert choice["why"].startswith("not timed (RuntimeError: CUDA error")
    else:
        assert set(choice["timings_ms"]) == {"two kernels", "summed by the last program"}


# --- elementwise chains (a batch-invariant forward's RoPE and SwiGLU) --------------------------------

def fresh():
    return gen(int(torch.randint(0, 2**31, ())))


def rope_table(n, d, g):
    """cos and sin as the model's table holds them (``sin`` with rotate_half's sign folded in)."""
    ang = torch.arange(n, dtype=F32)[:, None] * torch.rand(d // 2, generator=g)
    emb = torch.cat((ang, ang), dim=-1)
    sin = emb.sin()
    sin[:, : d // 2] *= -1
    return emb.cos().to(DEV), sin.to(DEV)


@pytest.mark.parametrize("b,t,h,hk,d", [(2, 5, 4, 2, 16), (3, 1, 12, 2, 64), (1, 70, 2, 1, 128)])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_exact_rope_gives_the_op_by_op_bits(inv, b, t, h, hk, d, dtype):
    """``exact_rope`` on queries and keys as a layer has them (a strided view of the q/k/v GEMM's
    output, its positions' angles gathered from the table) gives, bit for bit, ``models.llama._rope``'s
    op-by-op result in each output dtype: x * cos and roll(x) * sin rounded to fp32, their sum rounded,
    then the cast. Zeros and a decode step (t = 1) included; what it cannot take returns None."""
    from jetrl_cli.models import llama

    g = fresh()
    qkv = randn(b, t, h + 2 * hk, d, g=g, scale=3.0, dtype=dtype)
    qkv[0, 0] = 0.0
    qk = qkv.split((h + hk, hk), dim=2)[0].transpose(1, 2)
    cos, sin = rope_table(200, d, g)
    pos = torch.randint(0, 200, (b, t), generator=g).to(DEV)
    c, s = cos[pos][:, None], sin[pos][:, None]
    for q_dtype, k_dtype in ((dtype, dtype), (F32, BF16), (BF16, F32)):
        got = inv.exact_rope(qk, c, s, h, q_dtype, k_dtype)
        want = llama.apply_rope(qk.float(), c, s)
        want = (want[:, :h].to(q_dtype), want[:, h:].to(k_dtype))
        for x, y in zip(got, want):
            assert x.is_contiguous() and same_bits(x, y), (q_dtype, k_dtype)
    assert inv.exact_rope(qk[..., :-1], c[..., :-1], s[..., :-1], h, dtype, dtype) is None  # odd head dim
    assert inv.exact_rope(qk.to(torch.float16), c, s, h, dtype, dtype) is None


@pytest.mark.parametrize("rows,i", [(7, 40), (1, 8960), (33, 1500)])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_exact_swiglu_is_the_op_by_op_math(inv, rows, i, dtype, out_dtype):
    """``exact_swiglu``: g / (1 + exp(-g)) * u in fp32, each operation rounded, one rounding to the
    output. Against float64: the fp32 chain's bound (exp within 2 ulp -- numpy's in the interpreter,
    libdevice's on a GPU -- then a sum, a division and a product, each one rounding) plus the output's
    rounding; a row alone gives its bits in the batch; large |g| (exp over- and underflowing) and
    zeros included."""
    g = fresh()
    gu = randn(rows, 2 * i, g=g, scale=4.0, dtype=dtype)
    gu[0, :3] = torch.tensor([0.0, 100.0, -100.0], dtype=dtype)
    got = inv.exact_swiglu(gu, out_dtype)
    assert got.shape == (rows, i) and got.dtype == out_dtype
    gf, uf = gu.double().chunk(2, dim=-1)
    exact = gf / (1 + torch.exp(-gf)) * uf
    # relative, and where exp(-g) overflows fp32 (g < -88.7: the result 0, its true value under
    # 100 e^-88.7 |u|) absolute
    bound = exact.abs() * (6 * U32 + (U16 if out_dtype == BF16 else 0)) + 1e-35 * uf.abs() + 1e-300
    ok, worst = within(got, exact, bound)
    assert ok, worst
    assert same_bits(inv.exact_swiglu(gu[rows // 2:rows // 2 + 1], out_dtype), got[rows // 2:rows // 2 + 1])
    assert same_bits(inv.exact_swiglu(gu.reshape(1, rows, 2 * i), out_dtype), got.reshape(1, rows, i))
    assert inv.exact_swiglu(gu[:, :-1], out_dtype) is None  # odd width: the caller's ops


def test_a_suspended_forward_runs_the_exact_chains_and_says_so(inv, monkeypatch):
    """``precision.fuse``: inside ``suspended`` (a batch-invariant forward) ``_rope`` and ``_swiglu_math``
    run their ``kernels.invariant`` kernel on a GPU's tensors (here forced, in the interpreter), and the
    report lists them; outside, and for the functions without one, the ops run as before."""
    from jetrl_cli.models import llama
    from jetrl_cli.precision import fuse, linear

    calls = []
    for name in ("exact_rope", "exact_swiglu"):
        real = getattr(inv, name)
        monkeypatch.setattr(inv, name, lambda *a, real=real, name=name: (calls.append(name), real(*a))[1])
    monkeypatch.setattr(fuse, "_force_exact", True)
    fuse.reset_report()
    g = fresh()
    gu = randn(3, 64, g=g, dtype=BF16)
    qk = randn(1, 3, 4, 16, g=g, dtype=BF16)
    cos, sin = rope_table(8, 16, g)
    c, s = cos[:4][None, None], sin[:4][None, None]
    plain = linear._swiglu_math(gu), llama._rope(qk, c, s, 2, BF16, BF16)
    assert calls == [] and not (fuse.report() or {}).get("exact")
    with fuse.suspended(True):
        inside = linear._swiglu_math(gu), llama._rope(qk, c, s, 2, BF16, BF16)
    assert calls == ["exact_swiglu", "exact_rope"] and fuse.report()["exact"] == ["rope", "swiglu_math"]
    assert same_bits(inside[1][0], plain[1][0]) and same_bits(inside[1][1], plain[1][1])  # RoPE: the same bits
    torch.testing.assert_close(inside[0].float(), plain[0].float(), rtol=U16, atol=0)
    fuse.reset_report()
    assert fuse.report() is None


@pytest.mark.parametrize("x_dtype,d_dtype", [(F32, BF16), (BF16, BF16), (F32, F32), (BF16, F32)])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_add_rms_norm_is_the_add_the_norm_and_the_cast(inv, x_dtype, d_dtype, out_dtype):
    """``invariant_add_rms_norm``: a residual add, the batch-invariant norm and the cast to its
    consumer's dtype in one kernel -- bit for bit ``x + delta`` (torch's add, in the promoted dtype),
    ``invariant_rms_norm`` of it and ``.to(out_dtype)``; the per-row rsqrt within one rounding of
    1 / sqrt(mean(s^2) + eps); a row alone gives its bits in the batch; rows of zeros included."""
    g = fresh()
    x, delta = randn(5, 3, 1500, g=g, scale=2.0, dtype=x_dtype), randn(5, 3, 1500, g=g, dtype=d_dtype)
    x[0, 0], delta[0, 0] = 0.0, 0.0
    w = randn(1500, g=g)
    s, y, r = inv.invariant_add_rms_norm(x, delta, w, 1e-6, out_dtype, rsqrt=True)
    want_s = x + delta
    assert same_bits(s, want_s) and same_bits(y, inv.invariant_rms_norm(want_s, w, 1e-6).to(out_dtype))
    sd = want_s.double()
    exact_r = 1 / torch.sqrt((sd * sd).mean(-1, keepdim=True) + 1e-6)
    assert r.shape == (5, 3, 1) and within(r, exact_r, exact_r * (1600 * U32))[0]
    alone = inv.invariant_add_rms_norm(x[2, 1:2], delta[2, 1:2], w, 1e-6, out_dtype)
    assert same_bits(alone[0], s[2, 1:2]) and same_bits(alone[1], y[2, 1:2])


def test_a_causal_bf16_backward_is_flash_attentions_on_a_gpu(inv):
    """The trainer's invariant attention (causal from key 0, bf16): on a GPU its backward is
    ``scaled_dot_product_attention``'s (``_sdpa_causal``: GQA, the kernel's scale), elsewhere the
    fp32 reference's; either way the gradients agree with float64 to bf16's rounding. ``_sdpa_causal``'s
    own gradient is checked here on any device, and which backward runs is the rule's."""
    g = fresh()
    b, h, hk, t, d = 2, 4, 2, 70, 32
    q, k, v = (randn(b, n, t, d, g=g, dtype=BF16).requires_grad_() for n in (h, hk, hk))
    dy = randn(b, h, t, d, g=g, dtype=BF16)
    out, _ = inv.invariant_attention(q, k, v, scale=0.3)
    grads = torch.autograd.grad((out.float() * dy.float()).sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = inv.attention_reference(q64, k64, v64, scale=0.3, compute_dtype=torch.float64)[0]
    want = torch.autograd.grad((ref * dy.double()).sum(), (q64, k64, v64))
    flash = torch.autograd.grad((inv._sdpa_causal(q, k, v, 0.3).float() * dy.float()).sum(), (q, k, v))
    for got in (grads, flash):
        for x, w in zip(got, want):
            assert ((x.double() - w).norm() / w.norm()).item() < 2 ** -6
    assert inv._flash_backward(True, q, k) == GPU
    assert not inv._flash_backward(False, q, k) and not inv._flash_backward(True, q.float(), k.float())
    assert not inv._flash_backward(True, q, k[:, :, :-1])  # keys past the queries: not causal from 0
