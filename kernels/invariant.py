"""Batch-invariant Triton kernels: a token's result does not depend on the rest of the batch.

**What "batch-invariant" means.** jetrl's rollout engine and trainer compute the same token's
logprob in very different batches: a decode step is a GEMM with M = a few rows (one query per
sequence), a prefill has M = prompt tokens, the trainer's forward has M = every token of every
sequence. A kernel is batch-invariant when the bits of output row i depend only on input row i (and
the weights), never on M, on the other rows, on where row i sits in the batch, or (attention) on
whether the query came alone in a decode step or with its whole sequence. Fast GPU kernels are not:
cuBLAS picks its tile shape and split-K factor from M (a small-M GEMM splits K across thread blocks
and adds the partial sums in another order), and flash-decoding splits the keys of a decode query
across thread blocks (split-KV) that the full-sequence kernel does not split. Floating-point addition
is not associative, so the low bits differ, and so do the logprobs.

**What makes each kernel here invariant.**

- ``invariant_mm`` / ``invariant_blockwise_mm``: ONE tile configuration for every M (``MM_CONFIG``,
  ``FP8_MM_CONFIG``: block sizes, warps, pipeline stages) and ONE split of K per weight:
  ``k_chunks(K, N, ...)`` cuts K's BLOCK_K steps into S consecutive chunks, a function of K, N and the
  tile, never of M or of the device (a table of choices, no timing). The bits of an output element
  are defined as: each chunk's fp32 sum of its tile dots, from zero, in K order; the chunks' sums
  added in order, ((p_0 + p_1) + p_2) + ...; then the bias; then one rounding to the output dtype.
  Two launches compute exactly that. Split mode (grid M tiles x N tiles x S: each program writes one
  chunk's sum to an fp32 workspace, then ``_chunk_sum_kernel`` adds the S partials in order) runs
  when a call has few output tiles (``SPLIT_BELOW_TILES``: a decode step); chunked mode (grid M tiles
  x N tiles: each program walks every chunk, its chunk sum restarted from zero at each boundary and
  added there to a running total) runs otherwise (prefill, training). The choice depends on M; the
  bits do not. Which rows share a tile does not matter because rows of a dot never mix. M is not
  specialised on (``do_not_specialize``), so M = 1 compiles the same code as M = 4096. With S = 1
  (a wide weight, a short K) both modes are the unsplit kernel. ``invariant_blockwise_mm`` follows
  ``kernels.fp8.blockwise_mm``'s math: per 128-wide K block an fp32 dot of the fp8 values, times the
  two scales, added to the chunk's fp32 sum in K order (its ``split=S`` runs, summed in the same order).
- ``invariant_attention``: one program owns a block of query rows of one (sequence, KV head) -- the
  (query head, query) pairs of that KV head's group of query heads, head by head, so a decode step's
  program takes the group's heads together and reads each key once for them -- and walks ALL their
  keys in fixed blocks of ``ATT_BLOCK_N`` from key 0 upward (online softmax; no split-KV, whatever t
  or the key width). A row's dots and softmax reductions are its own: which rows share a tile does not
  change its bits. A query at key index p sees keys 0..p; blocks past p are fully
  masked for that row, and a fully masked block is an exact no-op on its running max, sum and
  output (rescale factor exp2(0) = 1, added terms exactly 0). So a decode query (t = 1, its program
  stops after p's block) and the same query inside the trainer's full sequence (its program walks
  on to the block of its last row) give the same bits.
- ``invariant_rms_norm``: one program per row, the row read in chunks of ``ROW_BLOCK`` lanes; each
  lane accumulates its chunks in order, then one fixed-shape tree reduces the lanes. The number of
  rows only sets the number of programs.
- ``exact_rope``, ``exact_swiglu``: elementwise chains in one kernel each, every operation rounded as
  torch's op by op (no multiply-add contraction); see "elementwise chains" below.
- ``invariant_log_softmax``: a row is cut into fixed chunks of ``SOFTMAX_CHUNK`` entries, one program
  each (a decode step's few rows of a 152K vocabulary would leave all but a few SMs idle, each
  program waiting on ~150 loads in a row, twice): per chunk, each lane's running max and sum of
  exp(x - max) over its blocks in order and the lanes' fixed tree give a (max, sum) pair; a second
  launch combines a row's pairs by one fixed tree and writes x - lse. The split depends on the row's
  length only.

**What it costs, and why.** Measured on an H200 before K was split (``docs/benchmarks.md``, third
run; Qwen2.5-1.5B, a rollout of 32 sequences x 64 new tokens, a train step of 4 x 256): the mode took
2.40x its fast path's rollout time in bf16 and 1.92x in fp8-unified, 1.26x and 1.61x of the train
step. A fixed tile cannot suit every M: a decode GEMM with M = 32 still runs 64-row tiles (half of
each tensor-core instruction multiplies padding), and unsplit it had only N / 128 programs (12 for
o_proj and down_proj, 16 for q/k/v) on 132 SMs, each streaming its whole K alone. Split, a decode
GEMM runs S times the programs (3 x 12 and 3 x 16 for o_proj and q/k/v; down_proj 16 x 12 in bf16,
14 x 12 in FP8; gate/up and lm_head, wide, are not split), for S x M x N fp32 partials written and
read back and a second launch. Chunked mode adds to a prefill or training GEMM one fp32 add per
accumulator element and chunk, and a second fp32 tile in registers (the FP8 kernel, whose block
products take a third, then reads rows past the edges as the last row instead of masking them, to
stay within 255 registers unspilled). The speed with the split is NOT measured yet. Decode attention
without split-KV runs one program per (sequence, KV head) over the whole key range, which leaves SMs
idle at small batch and long contexts (that is what flash-decoding exists to fix); on the H200 one
program per (sequence, query head), each using 1 of its 64 query rows, took 27.8 us a layer at 32
sequences against 4.1 us for the fast path's decode kernel. For prefill and
training the tile is a reasonable one, but one that no autotuner chose, and cuBLAS /
FlashAttention-3 use Hopper's wgmma + TMA pipelines that Triton reaches only partly. fp32 operands
run IEEE fp32 dots on the CUDA cores (no tensor cores, no TF32), many times slower than bf16: use
them for checks, not speed.

**Checked without a GPU, and not.** The values and the invariance are tested in Triton's
interpreter (``tests/test_kernels_invariant.py``). The compiled code is checked offline
(``tests/test_kernels_sm90.py``): every kernel compiles for sm_90a with Triton 3.6 (the H100
machine's) and 3.9, the bf16 and FP8 ones without register spills and on wgmma. Triton specialises
integer arguments on ``== 1`` and divisibility by 16 (the key width, strides, a scale grid's stride
that equals M), so a decode step and the trainer's forward do run different compilations of one
kernel; for every kernel here those compilations (M = 1, 7, 64, 4096; key width 1, 37, 300, 512,
1024; strided or contiguous queries; each GEMM in both modes) have the same floating-point
instructions in the same program order in the PTX, and the same ones in the SASS; a GEMM's chunked
kernel has its split kernel's instructions plus the chunk adds and the output's rounding. The
unsplit GEMMs ran bitwise on-policy on an H100 and an H200; the split ones are not yet checked on a
GPU, neither their speed nor their bits (``tests/test_kernels_invariant.py`` runs there unchanged,
on CUDA tensors).

**Numerics.** fp32 accumulation throughout; bf16 operands go to bf16 tensor-core dots (products of
bf16 are exact in fp32), fp32 operands to IEEE fp32 dots (``input_precision="ieee"``, never TF32).
In attention with bf16 inputs the softmax weights are rounded to bf16 for the p @ v dot, as in
FlashAttention. Each function has a pure-torch ``*_reference`` beside it that defines the math (it is
not itself invariant). The backward of attention is not invariant: ``invariant_attention``'s autograd
recomputes the reference in plain torch (the trainer needs invariant *forward* logprobs only).

**Triton's interpreter (CPU tests).** Two interpreter defects are worked around in-kernel under an
``INTERPRET`` constexpr (``TRITON_INTERPRET=1``): ``tl.dot`` on bf16 operands returns garbage, so
operands are upcast to fp32 (exact) first; and fp32 -> bf16 casts truncate instead of rounding to
nearest even (and flush subnormals), so the rounding is done on the bits. Neither changes GPU code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from jetrl_cli.precision.quant import QTensor

from .attention import check_kv_scales, dequant_kv, dequantized_reference, out_quant_unsupported, pv_accumulate
from .fp8 import FP_FUSION, _interpreting, _last_sums, _rows_quantized, _split_counters, _to_bf16

# The one tile configuration of each kernel. Changing a value changes results (it is part of the math).
MM_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)
FP8_MM_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)  # BLOCK_K = scale block
ATT_BLOCK_M, ATT_BLOCK_N, ATT_WARPS, ATT_STAGES = 64, 64, 4, 2
ROW_BLOCK, ROW_WARPS = 1024, 4
# the log-softmax's fixed split of a row: programs of SOFTMAX_CHUNK entries each (a 152K vocabulary: 19),
# whatever the number of rows; part of the math, as the tile configurations are
SOFTMAX_CHUNK = 8192
SUM_BLOCK, SUM_WARPS = 1024, 4  # outputs per program of split mode's sum of the chunks
LOG2E = 1.4426950408889634
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_device(where: str, *ts: torch.Tensor) -> None:
    dev = ts[0].device
    if any(t.device != dev for t in ts):
        raise ValueError(f"{where}: tensors on different devices ({', '.join(str(t.device) for t in ts)})")
    if dev.type != "cuda" and not _interpreting():
        raise ValueError(f"{where}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 to run them "
                         f"in Triton's interpreter), got {dev}")


# --- the fixed split of K ---------------------------------------------------------------------------

# K is cut into chunks by ``k_chunks``, a pure function of (K, N, BLOCK_N, BLOCK_K): the same chunks for
# a decode step's GEMM and the trainer's, on any GPU. Changing a value changes results (part of the math).
SPLIT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)  # chunk counts k_chunks picks from
MIN_CHUNK_K = 512  # a chunk spans >= this much of K on average: 8 bf16 steps of 64, 4 FP8 steps of 128
SPLIT_PROGRAMS = 264  # column tiles x chunks at most this: two programs per SM of a 132-SM H100 / H200
# A launch choice, not part of the math (both modes give the same bits): split mode (one program per
# chunk, then ``_chunk_sum_kernel``) when a call has fewer output tiles than this, else chunked mode.
SPLIT_BELOW_TILES = 132


def k_chunks(k: int, n: int, block_n: int, block_k: int) -> tuple[int, int]:
    """How ``invariant_mm`` / ``invariant_blockwise_mm`` cut the K of an N x K weight: ``(chunks, steps)``,
    K walked in ``cdiv(K, block_k)`` steps of ``block_k``, cut into ``chunks`` runs of ``steps`` steps
    (the last run shorter where the steps do not divide evenly). A chunk boundary is a multiple of
    ``block_k`` (for FP8, of the 128-wide scale block).

    The rule: the largest s of ``SPLIT_CHOICES`` with ``steps_total >= s * cdiv(MIN_CHUNK_K, block_k)``
    (chunks of >= 512 of K on average: each program still walks a few pipelined steps) and
    ``cdiv(n, block_n) * s <= SPLIT_PROGRAMS`` (a decode step's GEMM, one row tile, gets up to two
    programs per SM, and a wide weight is not split at all); then ``steps = cdiv(steps_total, s)``
    and ``chunks = cdiv(steps_total, steps)``. Never a function of M or of the device: the rollout and
    the trainer must cut K alike wherever they run. N is the GEMM's: layers run as one GEMM on their
    concatenated weight (``linear_group``: q/k/v, gate/up, in the rollout and the trainer alike) are
    cut by the group's N, so a layer run alone (``separate_linears``, a diagnostic) may be cut
    otherwise and differ in its last bits. Qwen2.5-1.5B (N x K, bf16 | FP8): q/k/v 2048 x 1536
    and o_proj 1536 x 1536: 3 chunks of 8 | 4 steps; gate/up 17920 x 1536 and lm_head: 1 chunk;
    down_proj 1536 x 8960: 16 chunks of 9 steps | 14 of 5."""
    total = triton.cdiv(k, block_k)
    tiles = triton.cdiv(n, block_n)
    least = triton.cdiv(MIN_CHUNK_K, block_k)
    s = max(c for c in SPLIT_CHOICES if c == 1 or (total >= c * least and tiles * c <= SPLIT_PROGRAMS))
    steps = triton.cdiv(total, s) if total else 1
    return (triton.cdiv(total, steps) if total else 1), steps


def _launch_mode(mode: str | None, chunks: int, tiles: int) -> str:
    """The kernels' MODE: "split", "chunked", or "whole" (chunked mode of one chunk: K in one sum, no
    running total held beside it; the same bits, since the total starts at -0.0). ``mode`` ("split",
    "chunked") forces one (tests, offline compiles)."""
    if mode not in (None, "split", "chunked"):
        raise ValueError(f"mode must be 'split', 'chunked' or None, not {mode!r}")
    if mode == "split" or (mode is None and chunks > 1 and tiles < SPLIT_BELOW_TILES):
        return "split"
    return "chunked" if chunks > 1 else "whole"


@triton.jit(do_not_specialize=["MN"])
def _chunk_sum_kernel(p_ptr, c_ptr, bias_ptr, MN, N, S, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
                      INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
    """Split mode's second step: ``c = ((p[0] + p[1]) + ...) + p[S-1] (+ bias)`` in fp32, in that order,
    rounded once to c's dtype (p: S x M x N, c: M x N, both contiguous). The chunked kernels add the
    same partials in the same order, so the two modes give the same bits."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    total = tl.full((BLOCK,), -0.0, tl.float32)  # -0.0 + x == x for every x: total = p[0] exactly
    at = p_ptr + i
    for _ in range(0, S):
        total += tl.load(at, mask=ok, other=0.0)
        at += MN
    if HAS_BIAS:
        total += tl.load(bias_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + i, _to_bf16(total, INTERPRET) if OUT_BF16 else total, mask=ok)


def _sum_chunks(p: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None) -> None:
    m, n = c.shape
    _chunk_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
        p, c, bias if bias is not None else c, m * n, n, p.shape[0], HAS_BIAS=bias is not None,
        OUT_BF16=c.dtype == torch.bfloat16, INTERPRET=_interpreting(), BLOCK=SUM_BLOCK, num_warps=SUM_WARPS,
        enable_fp_fusion=FP_FUSION)


def _by_chunks(parts: list[torch.Tensor], steps: int) -> torch.Tensor:
    """The order the kernels add in: ``parts`` (one per K step) summed from zero in order within each run
    of ``steps``, the runs' sums then added in order (the first taken as it is)."""
    total = None
    for c0 in range(0, len(parts), steps):
        p = torch.zeros_like(parts[0])
        for x in parts[c0:c0 + steps]:
            p = p + x
        total = p if total is None else total + p
    return total


FUSED_SUM_OP = "invariant split-K sum"  # kernels.fp8-style note_kernel op: "<kind> FUSED_SUM_OP, N x K"


def _fused_sum(kind: str, n: int, k: int, grid: tuple, dev: torch.device, forced: bool | None,
               run) -> torch.Tensor | None:
    """Split mode's sum: the arrival counters for the GEMM's last program of each tile to add the
    partials (``_last_chunk_sums``), or None for ``_chunk_sum_kernel`` after it (a second launch; off
    a GPU unless ``forced``). On a GPU decided at the first split call of each (kind, N, K): both ways
    timed on that call's operands (``run(fused)``), the fused one taken only where it wrote the two
    kernels' bytes and was faster; outside a graph capture only (inside one: the two kernels,
    undecided). A launch choice: the bits are the same either way."""
    fused = forced
    if fused is None:
        if dev.type != "cuda":
            return None
        from jetrl_cli.precision import gemm

        op = f"{kind} {FUSED_SUM_OP}, {n} x {k}"
        choice = gemm.kernel_choice(op, dev)
        if choice is None:
            if gemm.capturing(dev):
                return None
            choice = _choose_fused_sum(op, run, dev)
        fused = choice["fused"]
    return _split_counters(dev, grid[0] * grid[1]) if fused else None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _choose_fused_sum(op: str, run, dev: torch.device) -> dict:
    from jetrl_cli.precision import gemm

    try:
        two, one = run(False), run(True)
        same = torch.equal(_bits(two), _bits(one))
        t = {"two kernels": gemm.device_time_ms(lambda: run(False), dev)}
        if same:
            t["summed by the last program"] = gemm.device_time_ms(lambda: run(True), dev)
    except Exception as e:  # noqa: BLE001 - nothing timed: the two kernels, said why
        return gemm.note_kernel(op, dev, "two kernels", f"not timed ({type(e).__name__}: {str(e)[:120]})",
                                fused=False)
    best = min(t, key=t.get)
    why = ", ".join(f"{w} {ms:.4f} ms" for w, ms in t.items())
    if not same:
        why += "; the last-program sum was not the two kernels' bytes: not used"
    return gemm.note_kernel(op, dev, best, why, fused=best != "two kernels", timings_ms=dict(t))


# --- dense GEMM -------------------------------------------------------------------------------------

@triton.jit
def _branch_zeros(x, INTERPRET: tl.constexpr):
    """fp32 zeros shaped as ``x`` (+0.0, as ``tl.zeros``), made in the branch that ends a chunk. On a GPU
    by an asm statement marked impure: LLVM then cannot if-convert the branch, whose arithmetic it
    would otherwise run at every K step as selects (64 ``add`` and 128 ``selp`` per thread and step in
    the FP8 kernel, whose chunk end waits on nothing)."""
    if INTERPRET:
        return tl.zeros(x.shape, dtype=tl.float32)
    return tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _chunk_range(K, CHUNK, MODE: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K steps a program walks: chunk ``program_id(2)``'s in split mode, all of them else."""
    steps = tl.cdiv(K, BLOCK_K)
    if MODE == "split":
        kb0 = tl.program_id(2) * CHUNK
        kb1 = tl.minimum(kb0 + CHUNK, steps)
    else:
        kb0 = 0
        kb1 = steps
    return kb0, kb1


@triton.jit
def _chunk_out(acc, total, c_ptr, p_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, MODE: tl.constexpr,
               HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """A program's result: split mode, its chunk's fp32 sum ``acc`` into ``p[program_id(2)]`` (S x M x N,
    contiguous); chunked mode, ``total (+ bias)`` rounded once into c (whole: ``acc``, its one chunk)."""
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    if MODE == "split":
        tl.store(p_ptr + tl.program_id(2).to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :], acc,
                 mask=ok)
    else:
        if MODE == "whole":
            total = acc  # == -0.0 + acc, bit for bit
        if HAS_BIAS:
            total += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = _to_bf16(total, INTERPRET) if OUT_BF16 else total
        tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn, out, mask=ok)


@triton.jit
def _last_chunk_sums(p_ptr, c_ptr, bias_ptr, cnt_ptr, rm, rn, M, N, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """Split mode's sum in the GEMM itself: the tile's last program to store its chunk's partial adds the
    partials as ``_chunk_sum_kernel`` does -- p[0] (== -0.0 + p[0]), + p[1], ... in chunk order, then the
    bias, rounded once -- and zeroes the tile's arrival counter (``kernels.fp8._last_sums``). The
    same bits whichever program arrives last: a launch choice (``_fused_sum``), not part of the math."""
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    at = rm.to(tl.int64)[:, None] * N + rn[None, :]
    _last_sums(p_ptr, c_ptr, bias_ptr, cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), at, rn, ok,
               M, N, tl.num_programs(2), HAS_BIAS, OUT_BF16, INTERPRET)


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, p_ptr, cnt_ptr, M, N, K, CHUNK, stride_am, stride_ak, stride_bn,
               stride_bk, stride_cm, stride_cn, MODE: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS: tl.constexpr,
               OUT_BF16: tl.constexpr, F32_DOT: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of ``a @ b.T``, K in chunks of CHUNK steps of BLOCK_K. MODE "split":
    program (m, n, c) sums chunk c's steps from zero in K order and writes that fp32 partial to ``p[c]``
    (``_chunk_sum_kernel`` adds them). "chunked": one program walks all steps, its chunk sum restarted
    from zero at each chunk boundary and added there to a running total, in chunk order (a branch taken
    once per chunk: it waits for the tensor cores' sum, so it stays a branch). "whole": one chunk.
    ``FUSED`` (split mode): the tile's last program to store its partial adds them (``_last_chunk_sums``)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    kb0, kb1 = _chunk_range(K, CHUNK, MODE, BLOCK_K)
    end = tl.minimum(kb0 + CHUNK, kb1) - 1  # the last step of the current chunk
    total = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)  # -0.0 + x == x for every x: total = p_0 exactly
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, kb1):  # K in one fixed order
        k = kb * BLOCK_K + rk
        a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(k < K)[:, None] & (rn < N)[None, :], other=0.0)
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if MODE == "chunked":
            if kb == end:  # a chunk ends: into the total, the next chunk's sum from zero
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                end = tl.minimum(end + CHUNK, kb1 - 1)
    _chunk_out(acc, total, c_ptr, p_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, MODE, HAS_BIAS, OUT_BF16,
               INTERPRET)
    if MODE == "split":
        if FUSED:
            _last_chunk_sums(p_ptr, c_ptr, bias_ptr, cnt_ptr, rm, rn, M, N, HAS_BIAS, OUT_BF16, INTERPRET)


def _check_out_dtype(where: str, out_dtype: torch.dtype) -> None:
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{where}: out_dtype must be torch.float32 or torch.bfloat16, not {out_dtype}")


def _check_bias(where: str, bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_floating_point()):
        raise ValueError(f"{where}: bias must be a 1-D float tensor of {n} elements, got "
                         f"{tuple(bias.shape)} {bias.dtype}")


def invariant_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32, *, _mode: str | None = None,
                 _fused: bool | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` (a: M x K, b: N x K, bf16 or fp32), fp32 accumulation, one tile config for
    every M and K cut into the chunks ``k_chunks`` gives for (K, N): row i of the result does not depend
    on M or on the other rows of ``a``. ``_mode`` forces split or chunked mode, ``_fused`` split mode's
    sum in the GEMM or in a second kernel (same bits; tests)."""
    where = "invariant_mm"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{where}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not match as a @ b.T")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{where}: operand {name} must be bfloat16 or float32, not {t.dtype}")
    _check_out_dtype(where, out_dtype)
    _check_bias(where, bias, b.shape[0])
    _check_device(where, a, b, *(() if bias is None else (bias,)))
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.copy_((bias.float() if bias is not None else torch.zeros(n, device=a.device)).expand(m, n))
    interp = _interpreting()
    cfg = MM_CONFIG
    chunks, steps = k_chunks(k, n, cfg["BLOCK_N"], cfg["BLOCK_K"])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    mode = _launch_mode(_mode, chunks, grid[0] * grid[1])
    split = mode == "split"
    p = torch.empty((chunks, m, n), dtype=torch.float32, device=a.device) if split else c
    cnt = _fused_sum("bf16" if a.dtype == torch.bfloat16 else "fp32", n, k, grid, a.device, _fused,
                     lambda f: invariant_mm(a, b, bias, out_dtype, _mode="split", _fused=f)) if split else None
    _mm_kernel[grid + ((chunks,) if split else ())](
        a, b, bias if bias is not None else c, c, p, p if cnt is None else cnt, m, n, k, steps, a.stride(0),
        a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), MODE=mode, FUSED=cnt is not None,
        HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16,
        F32_DOT=interp or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16,
        INTERPRET=interp, enable_fp_fusion=FP_FUSION, **cfg)
    if split and cnt is None:
        _sum_chunks(p, c, bias)
    return c


def mm_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, chunked: bool = False) -> torch.Tensor:
    """The math of ``invariant_mm`` in plain torch: fp32 (fp64 for fp64 inputs) ``a @ b.T + bias``.
    ``chunked``: in the kernel's order -- each ``BLOCK_K`` step's ``a @ b.T`` added in K order to its
    chunk's sum (``k_chunks``), the chunks' sums added in order (bitwise the kernel's in the
    interpreter where every step's product is exact in fp32; torch sums within a step its own way)."""
    ct = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    if chunked and a.shape[1]:
        bk = MM_CONFIG["BLOCK_K"]
        k = a.shape[1]
        steps = k_chunks(k, b.shape[0], MM_CONFIG["BLOCK_N"], bk)[1]
        c = _by_chunks([a[:, k0:k0 + bk].to(ct) @ b[:, k0:k0 + bk].to(ct).t() for k0 in range(0, k, bk)], steps)
    else:
        c = a.to(ct) @ b.to(ct).t()
    if bias is not None:
        c = c + bias.to(ct)
    return c if out_dtype is None else c.to(out_dtype)


# --- blockwise FP8 GEMM -----------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M"])
def _fp8_mm_kernel(a_ptr, b_ptr, c_ptr, p_ptr, cnt_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, CHUNK,
                   stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                   stride_sam, stride_sak, stride_sbn, stride_sbk, MODE: tl.constexpr, FUSED: tl.constexpr,
                   SA_ROWS: tl.constexpr, SB_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of ``a @ b.T`` for FP8 operands, ``kernels.fp8.blockwise_mm``'s math
    per 128-wide K block (BLOCK_K): an fp32 dot of the fp8 values, times the block's two scales, added
    to the chunk's sum. K in chunks of CHUNK blocks, split or chunked as ``_mm_kernel``.

    Rows of a past M and rows of b past N are read as a's last row and b's last row, not masked: an
    output element is a dot of its own row and column only, and those past the edges are not stored.
    Fewer masks leave the chunked mode (three 64 x 128 fp32 tiles live: the total, the chunk's sum
    and the block's product) within the 255 registers without spills."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ra = tl.minimum(rm, M - 1)
    rb = tl.minimum(rn, N - 1)
    rk = tl.arange(0, BLOCK_K)
    kb0, kb1 = _chunk_range(K, CHUNK, MODE, BLOCK_K)
    end = tl.minimum(kb0 + CHUNK, kb1) - 1  # the last block of the current chunk
    total = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)  # -0.0 + x == x for every x: total = p_0 exactly
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb0, kb1):  # K blocks in one fixed order
        k = kb * BLOCK_K + rk
        a = tl.load(a_ptr + ra.to(tl.int64)[:, None] * stride_am + k[None, :] * stride_ak, mask=(k < K)[None, :],
                    other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + rb[None, :] * stride_bn,  # (BLOCK_K, BLOCK_N): K-major B
                    mask=(k < K)[:, None], other=0.0)
        part = tl.dot(a, b, out_dtype=tl.float32)
        sa = tl.load(sa_ptr + (ra // SA_ROWS) * stride_sam + kb * stride_sak)
        sb = tl.load(sb_ptr + (rb // SB_ROWS) * stride_sbn + kb * stride_sbk)
        acc += part * sa[:, None] * sb[None, :]  # promote each 128-wide K block with its scales
        if MODE == "chunked":
            if kb == end:  # a chunk ends: into the total, the next chunk's sum from zero
                total += acc
                acc = _branch_zeros(acc, INTERPRET)
                end = tl.minimum(end + CHUNK, kb1 - 1)
    _chunk_out(acc, total, c_ptr, p_ptr, bias_ptr, rm, rn, M, N, stride_cm, stride_cn, MODE, HAS_BIAS, OUT_BF16,
               INTERPRET)
    if MODE == "split":
        if FUSED:
            _last_chunk_sums(p_ptr, c_ptr, bias_ptr, cnt_ptr, rm, rn, M, N, HAS_BIAS, OUT_BF16, INTERPRET)


def _k_scale_rows(where: str, name: str, op: QTensor) -> int:
    """Rows sharing one scale along K-blocks of 128 (1 or 128); checks the operand."""
    if not isinstance(op, QTensor) or op.data.dim() != 2 or op.data.dtype not in _FP8:
        raise ValueError(f"{where}: operand {name} must be a 2-D fp8 QTensor")
    blk = op.spec.block
    if blk.cols != 128 or blk.rows not in (1, 128):
        raise ValueError(f"{where}: operand {name} needs 1x128 or 128x128 scales along K, not {blk.name}")
    m, k = op.data.shape
    want = (-(-m // blk.rows), -(-k // 128))
    if tuple(op.scale.shape) != want or op.scale.dtype != torch.float32:
        raise ValueError(f"{where}: operand {name}'s scale must be float32 {want}, got "
                         f"{tuple(op.scale.shape)} {op.scale.dtype}")
    return blk.rows


def invariant_blockwise_mm(a: QTensor, b: QTensor, bias: torch.Tensor | None = None,
                           out_dtype: torch.dtype = torch.float32, *, _mode: str | None = None,
                           _fused: bool | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for FP8 operands (a: M x K, b: N x K) with 1x128 or 128x128 scales along K,
    ``kernels.fp8.blockwise_mm``'s math per K block with one fixed tile config and K cut into the chunks
    ``k_chunks`` gives for (K, N): rows independent of M. ``_mode`` as ``invariant_mm``'s."""
    where = "invariant_blockwise_mm"
    sa_rows, sb_rows = _k_scale_rows(where, "a", a), _k_scale_rows(where, "b", b)
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"{where}: shapes {tuple(a.data.shape)} and {tuple(b.data.shape)} do not match as a @ b.T")
    _check_out_dtype(where, out_dtype)
    m, k = a.data.shape
    n = b.data.shape[0]
    _check_bias(where, bias, n)
    _check_device(where, a.data, b.data, a.scale, b.scale, *(() if bias is None else (bias,)))
    c = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.copy_((bias.float() if bias is not None else torch.zeros(n, device=c.device)).expand(m, n))
    cfg = FP8_MM_CONFIG
    chunks, steps = k_chunks(k, n, cfg["BLOCK_N"], cfg["BLOCK_K"])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    mode = _launch_mode(_mode, chunks, grid[0] * grid[1])
    split = mode == "split"
    p = torch.empty((chunks, m, n), dtype=torch.float32, device=c.device) if split else c
    cnt = _fused_sum("fp8", n, k, grid, c.device, _fused,
                     lambda f: invariant_blockwise_mm(a, b, bias, out_dtype, _mode="split", _fused=f)) if split else None
    _fp8_mm_kernel[grid + ((chunks,) if split else ())](
        a.data, b.data, c, p, p if cnt is None else cnt, a.scale, b.scale, bias if bias is not None else c, m, n, k,
        steps, a.data.stride(0), a.data.stride(1), b.data.stride(0), b.data.stride(1), c.stride(0), c.stride(1),
        a.scale.stride(0), a.scale.stride(1), b.scale.stride(0), b.scale.stride(1), MODE=mode,
        FUSED=cnt is not None, SA_ROWS=sa_rows, SB_ROWS=sb_rows, HAS_BIAS=bias is not None,
        OUT_BF16=out_dtype == torch.bfloat16, INTERPRET=_interpreting(), enable_fp_fusion=FP_FUSION, **cfg)
    if split and cnt is None:
        _sum_chunks(p, c, bias)
    return c


def blockwise_mm_reference(a: QTensor, b: QTensor, bias: torch.Tensor | None = None,
                           out_dtype: torch.dtype | None = None,
                           compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The math of ``invariant_blockwise_mm``: per 128-wide K block ``(qa @ qb.T) * sa * sb``, summed
    over blocks in K order within each chunk (``k_chunks``), the chunks' sums added in order, in
    ``compute_dtype`` (fp64 gives the exact value of the quantized GEMM)."""
    m, k = a.data.shape
    n = b.data.shape[0]
    sa = a.scale.to(compute_dtype).repeat_interleave(a.spec.block.rows, 0)[:m]
    sb = b.scale.to(compute_dtype).repeat_interleave(b.spec.block.rows, 0)[:n]
    qa, qb = a.data.to(compute_dtype), b.data.to(compute_dtype)
    parts = [(qa[:, k0:k0 + 128] @ qb[:, k0:k0 + 128].t()) * sa[:, kb, None] * sb[None, :, kb]
             for kb, k0 in enumerate(range(0, k, 128))]
    steps = k_chunks(k, n, FP8_MM_CONFIG["BLOCK_N"], 128)[1]
    c = _by_chunks(parts, steps) if parts else torch.zeros((m, n), dtype=compute_dtype, device=a.data.device)
    if bias is not None:
        c = c + bias.to(compute_dtype)
    return c if out_dtype is None else c.to(out_dtype)


# --- causal GQA attention (forward) -----------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, o_ptr, os_ptr, lse_ptr, H, REP, T, W, D, BT,
                      qk_scale, sqb, sqh, sqt, sqd, skb, skh, skw, skd, svb, svh, svw, svd,
                      sksb, sksh, sksw, svsb, svsh, svsw, spb, spt,
                      sob, soh, sot, sod, slb, slh, slt, SCALED: tl.constexpr,
                      F32_DOT: tl.constexpr, P_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
                      QUANT: tl.constexpr, FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr,
                      INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    # one program: BLOCK_M rows of one sequence's KV head's group of REP query heads, its (query head,
    # query) pairs taken head by head (row i: head i // T of the group, query i % T). A row's arithmetic
    # is its own (the dots' rows, the softmax's row reductions): which rows share its tile does not
    # change its bits, so a decode step (T = 1) takes a group's REP heads in one program, reading each
    # key and value once for them, instead of one program per head with 1 of its BLOCK_M rows used
    seq = tl.program_id(1) // (H // REP)
    kvh = tl.program_id(1) % (H // REP)
    ri = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    row_ok = ri < REP * T
    head = kvh * REP + ri // T
    rm = ri % T
    d_ok = rd < D
    pos = tl.load(pos_ptr + seq * spb + rm * spt, mask=row_ok, other=-1).to(tl.int32)
    q = tl.load(q_ptr + seq * sqb + head[:, None] * sqh + rm[:, None] * sqt + rd[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    hi = tl.max(pos, axis=0) + 1  # keys 0..(last position among this program's rows)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):  # every key block from 0 upward, in one program
        kn = start + rn
        kv_ok = (kn < hi) & (kn < W)  # keys past the last position are never read
        k = tl.load(k_ptr + seq * skb + kvh * skh + kn[None, :] * skw + rd[:, None] * skd,
                    mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        if SCALED:  # an FP8 cache: the bf16 values the trainer's keys are rounded to (kernels.attention)
            ks = tl.load(ks_ptr + seq * sksb + kvh * sksh + kn * sksw, mask=kv_ok, other=0.0)
            k = dequant_kv(k, ks[None, :], P_BF16, INTERPRET)
        if F32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where((kn[None, :] <= pos[:, None]) & (kn < W)[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at 0 (no NaN)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + seq * svb + kvh * svh + kn[:, None] * svw + rd[None, :] * svd,
                    mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        if SCALED:
            vs = tl.load(vs_ptr + seq * svsb + kvh * svsh + kn * svsw, mask=kv_ok, other=0.0)
            v = dequant_kv(v, vs[:, None], P_BF16, INTERPRET)
        acc = pv_accumulate(p, v, acc, alpha, P_BF16, F32_DOT, INTERPRET)
        m_i = m_new
    l_i = tl.where(row_ok, l_i, 1.0)  # rows past t (not stored): no 0 / 0
    out = tl.math.div_rn(acc, l_i[:, None])
    out = _to_bf16(out, INTERPRET) if OUT_BF16 else out
    if QUANT:  # o_proj's FP8 1x128 input: a head's D = 128 outputs are one group of its (sequence, query) row
        y, sc = _rows_quantized(out.to(tl.float32), FMAX, FLOOR, POW2)
        tl.store(os_ptr + head.to(tl.int64) * BT + seq * T + rm, sc, mask=row_ok)  # (b t, heads), strides (1, b t)
        out = y.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + seq * sob + head[:, None] * soh + rm[:, None] * sot + rd[None, :] * sod, out,
             mask=row_ok[:, None] & d_ok[None, :])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural-log log-sum-exp of the scaled scores
    tl.store(lse_ptr + seq * slb + head * slh + rm * slt, lse, mask=row_ok)


def _attention_args(q, k, v, q_pos, scale, check_positions, kv_scales=None):
    where = "invariant_attention"
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"{where}: q must be (b, heads, t, d) and k, v (b, kv_heads, w, d) alike, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, t, d = q.shape
    hk, w = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or hk == 0 or h % hk:
        raise ValueError(f"{where}: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (same b and d, "
                         f"heads a multiple of kv_heads)")
    check_kv_scales(where, q, k, v, kv_scales)
    if q_pos is None:
        if t > w:
            raise ValueError(f"{where}: without q_pos query i sits at key i, but t={t} > key width {w}")
        q_pos = torch.arange(t, device=q.device).expand(b, t)
    elif q_pos.shape != (b, t) or q_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: q_pos must be an int32/int64 (b, t) = {(b, t)} tensor, got "
                         f"{tuple(q_pos.shape)} {q_pos.dtype}")
    elif check_positions and q_pos.numel() and (int(q_pos.min()) < 0 or int(q_pos.max()) >= w):
        raise ValueError(f"{where}: q_pos must lie in [0, {w}) (key indices), got "
                         f"[{int(q_pos.min())}, {int(q_pos.max())}]")
    _check_device(where, q, k, v, q_pos, *(kv_scales or ()))
    return q_pos, (d ** -0.5 if scale is None else float(scale))


def _attention_forward(q, k, v, q_pos, scale, kv_scales=None, quant=None):
    b, h, t, d = q.shape
    hk, w = k.shape[1], k.shape[2]
    # (b, heads, t, d) over a (b, t, heads, d) buffer: the layer's (b, t, heads * d) o_proj input is then
    # a view of it, not a copy; ``quant``: FP8 bytes there, and their (b t, heads) scales, strides (1, b t)
    out = torch.empty((b, t, h, d), dtype=q.dtype if quant is None else quant.format.torch_dtype(),
                      device=q.device).transpose(1, 2)
    out_s = out if quant is None else torch.empty((h, b * t), dtype=torch.float32, device=q.device).t()
    lse = torch.empty((b, h, t), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return _quantized_out(out, out_s, quant), lse.fill_(float("-inf"))
    interp = _interpreting()
    bf16 = q.dtype == torch.bfloat16
    grid = (triton.cdiv(h // hk * t, ATT_BLOCK_M), b * hk)  # a KV head's query heads together
    ks, vs = kv_scales if kv_scales is not None else (q, q)  # unread when unscaled
    _attention_kernel[grid](
        q, k, v, ks, vs, q_pos, out, out_s, lse, h, h // hk, t, w, d, b * t, scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *(ks.stride() if kv_scales is not None else (0, 0, 0)),
        *(vs.stride() if kv_scales is not None else (0, 0, 0)), *q_pos.stride(), *out.stride(), *lse.stride(),
        SCALED=kv_scales is not None, F32_DOT=interp or not bf16, P_BF16=bf16, OUT_BF16=bf16,
        QUANT=quant is not None, FMAX=quant.format.max if quant else 1.0, FLOOR=quant.amax_floor if quant else 0.0,
        POW2=bool(quant and quant.pow2_scale), INTERPRET=interp,
        BLOCK_M=ATT_BLOCK_M, BLOCK_N=ATT_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(d)),
        num_warps=ATT_WARPS, num_stages=ATT_STAGES, enable_fp_fusion=FP_FUSION)
    return _quantized_out(out, out_s, quant), lse


def _quantized_out(out: torch.Tensor, out_s: torch.Tensor, quant) -> torch.Tensor | QTensor:
    """The attention's output: (b, heads, t, d), or with ``quant`` o_proj's operand, data (b t, heads d)."""
    if quant is None:
        return out
    b, h, t, d = out.shape
    return QTensor(out.transpose(1, 2).reshape(b * t, h * d), out_s, quant)


class _InvariantAttention(torch.autograd.Function):
    """Forward: the invariant kernel. Backward (not batch-invariant, and need not be): for causal
    attention from key 0 over keys 0..t-1 (``causal``: the trainer's forward) in bf16 on a GPU, the
    gradient of ``scaled_dot_product_attention`` (flash attention's backward, the fast path's); else
    the gradient of ``attention_reference`` (plain torch, fp32, materialises the (b, heads, t, w)
    scores: on the H200 its fp32 GEMMs and softmax took about 9 ms of a 4 x 256 Qwen2.5-1.5B update)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, scale, causal=False):
        out, lse = _attention_forward(q, k, v, q_pos, scale)
        ctx.save_for_backward(q, k, v, q_pos)
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, q_pos = ctx.saved_tensors
        ins = [x.detach().requires_grad_(need) for x, need in zip((q, k, v), ctx.needs_input_grad[:3])]
        with torch.enable_grad():
            if _flash_backward(ctx.causal, q, k):
                out = _sdpa_causal(*ins, ctx.scale)
            else:
                out = attention_reference(*ins, q_pos, ctx.scale)[0]
        wrt = [x for x in ins if x.requires_grad]
        grads = iter(torch.autograd.grad(out, wrt, d_out.to(out.dtype)))
        return (*(next(grads) if x.requires_grad else None for x in ins), None, None, None)


def _flash_backward(causal: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``_InvariantAttention``'s backward takes SDPA's: causal from key 0 over as many keys as
    queries, bf16, on a GPU."""
    return causal and q.is_cuda and q.dtype == torch.bfloat16 and q.shape[2] == k.shape[2]


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    try:  # GQA read by the kernel (torch >= 2.5)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=rep > 1)
    except TypeError:
        k, v = (x.repeat_interleave(rep, 1) for x in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None = None,
                        scale: float | None = None, check_positions: bool = True,
                        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        quantize_out=None) -> tuple[torch.Tensor | QTensor, torch.Tensor]:
    """Causal GQA attention whose result for a (sequence, query position) does not depend on the batch,
    on t, on the key width, or on which other queries came in the same call.

    q: (b, heads, t, d); k, v: (b, kv_heads, w, d), heads a multiple of kv_heads (query head i reads
    KV head i // (heads / kv_heads)); all bf16 or all fp32, any strides. Each sequence's keys are
    stored from index 0 (right padding), as the model's KV cache holds them.
    q_pos: (b, t) int, the key index each query sits at; query (s, i) attends to keys
    0..q_pos[s, i] of sequence s (itself included) and never reads a key past the last position of
    its block of queries. None means ``arange(t)`` for every sequence (training, prefill). A decode step
    passes ``lengths[:, None]`` (the new token's key already written at index ``lengths``).
    ``check_positions`` checks 0 <= q_pos < w (one host sync; pass False in a hot loop).
    scale: the softmax scale, ``d ** -0.5`` when None.
    kv_scales: an FP8 cache read as stored -- k, v FP8 (e4m3 / e5m2) and (k_scale, v_scale) fp32
    (b, kv_heads, w), one per token and KV head; each key and value is dequantized in the kernel to
    q's dtype exactly as ``(data.float() * scale).to(q.dtype)`` (``kernels.attention.dequant_kv``),
    so the result has the bits of a call on those dequantized tensors. Forward only.

    Returns ``(out, lse)``: out (b, heads, t, d) in q's dtype (laid out as (b, t, heads, d): its
    ``transpose(1, 2)`` is contiguous); lse (b, heads, t) fp32, the natural-log
    log-sum-exp of the scaled scores over the visible keys. Differentiable in q, k, v (backward by
    recomputation: flash attention's for the trainer's causal bf16 forward on a GPU, else plain torch;
    see ``_InvariantAttention``); lse carries no gradient.

    ``quantize_out`` (FP8 1x128; bf16 q, d = 128; forward only): out instead as o_proj's Fprop operand,
    written by the same kernel (``kernels.attention.decode_attention``'s option): a QTensor of data
    (b t, heads d) and scales (b t, heads) with strides (1, b t), bit for bit ``kernels.fp8.quantize_act``
    of the bf16 output seen as (b t, heads d) -- a row's own, so as batch-invariant as the output.
    """
    causal = q_pos is None and q.shape[2] == k.shape[2]  # the trainer's forward: its backward may be flash's
    q_pos, scale = _attention_args(q, k, v, q_pos, scale, check_positions, kv_scales)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if quantize_out is not None:
        why = out_quant_unsupported(quantize_out, q.dtype, q.shape[3])
        if why is not None or grad:
            raise ValueError(f"invariant_attention: quantize_out: {why or 'forward only (q, k or v requires grad)'}")
    if kv_scales is None and grad:
        return _InvariantAttention.apply(q, k, v, q_pos, scale, causal)
    return _attention_forward(q, k, v, q_pos, scale, kv_scales, quantize_out)


def attention_reference(q, k, v, q_pos=None, scale=None, compute_dtype=torch.float32, kv_scales=None):
    """The math of ``invariant_attention`` in plain torch, in ``compute_dtype``: softmax of
    ``scale * q.k`` over keys 0..q_pos, times v. Returns (out in compute_dtype, lse). Keys past a
    sequence's last query position are zeroed first, so unwritten cache slots cannot leak NaN.
    With ``kv_scales`` FP8 keys and values are first dequantized to q's dtype, as the kernel does."""
    if kv_scales is not None:
        k, v = dequantized_reference(k, v, kv_scales, q.dtype)
    b, h, t, d = q.shape
    hk, w = k.shape[1], k.shape[2]
    if q_pos is None:
        q_pos = torch.arange(t, device=q.device).expand(b, t)
    scale = d ** -0.5 if scale is None else scale
    j = torch.arange(w, device=q.device)
    used = (j[None, :] <= q_pos.max(dim=1, keepdim=True).values)[:, None, :, None]  # (b, 1, w, 1)
    kf = torch.where(used, k.to(compute_dtype), 0).repeat_interleave(h // hk, 1)
    vf = torch.where(used, v.to(compute_dtype), 0).repeat_interleave(h // hk, 1)
    s = (q.to(compute_dtype) @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill((j[None, None, :] > q_pos[:, :, None])[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ vf, lse


# --- row kernels: RMSNorm and log-softmax -----------------------------------------------------------

@triton.jit
def _store_as(ptr, y, mask, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    if BF16:
        tl.store(ptr, _to_bf16(y, INTERPRET), mask=mask)
    else:
        tl.store(ptr, y, mask=mask)


@triton.jit
def _residual(x_ptr, d_ptr, row, stride_x, stride_d, cols, ok, HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr,
              INTERPRET: tl.constexpr):
    """A chunk of the norm's input row: x, or ``s = x + delta`` (one fp32 add, rounded to s's dtype)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = x + tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
        if S_BF16:
            x = _to_bf16(x, INTERPRET).to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, s_ptr, w_ptr, y_ptr, r_ptr, N, eps, stride_x, stride_d, stride_s, stride_y,
                     HAS_DELTA: tl.constexpr, S_BF16: tl.constexpr, ROUND_BF16: tl.constexpr,
                     OUT_BF16: tl.constexpr, WRITE_R: tl.constexpr, INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
    # one row: (``HAS_DELTA``: s = x + delta, written) the norm of s, rounded to bf16 where s or the
    # output is bf16 (``ROUND_BF16``), stored in the output's dtype; the same reduction either way
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ss = tl.zeros((BLOCK,), dtype=tl.float32)  # one running sum of squares per lane
    for c0 in range(0, N, BLOCK):
        ok = c0 + cols < N
        x = _residual(x_ptr, d_ptr, row, stride_x, stride_d, c0 + cols, ok, HAS_DELTA, S_BF16, INTERPRET)
        if HAS_DELTA:
            _store_as(s_ptr + row * stride_s + c0 + cols, x, ok, S_BF16, INTERPRET)
        ss += x * x
    ms = tl.math.div_rn(tl.sum(ss, axis=0), N.to(tl.float32))
    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))  # correctly rounded, like torch's 1 / sqrt
    if WRITE_R:
        tl.store(r_ptr + row, r)
    for c0 in range(0, N, BLOCK):
        ok = c0 + cols < N
        x = _residual(x_ptr, d_ptr, row, stride_x, stride_d, c0 + cols, ok, HAS_DELTA, S_BF16, INTERPRET)
        w = tl.load(w_ptr + c0 + cols, mask=ok, other=0.0).to(tl.float32)
        y = x * r * w
        if ROUND_BF16:
            y = _to_bf16(y, INTERPRET)
        tl.store(y_ptr + row * stride_y + c0 + cols, y.to(tl.bfloat16 if OUT_BF16 else tl.float32), mask=ok)


def _rows(where: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{where}: x must have a non-empty last dim, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{where}: x must be bfloat16 or float32, not {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dim, fp32 math, output in x's dtype
    (bf16 or fp32); one program per row, so a row's result does not depend on the other rows."""
    where = "invariant_rms_norm"
    x2 = _rows(where, x)
    n = x2.shape[1]
    if weight.shape != (n,) or not weight.is_floating_point():
        raise ValueError(f"{where}: weight must be a float ({n},) tensor, got {tuple(weight.shape)} {weight.dtype}")
    _check_device(where, x2, weight)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        bf16 = x.dtype == torch.bfloat16
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, x2, weight.contiguous(), y, y, n, float(eps), x2.stride(0), 0, 0,
                                         y.stride(0), HAS_DELTA=False, S_BF16=bf16, ROUND_BF16=bf16, OUT_BF16=bf16,
                                         WRITE_R=False, INTERPRET=_interpreting(), BLOCK=ROW_BLOCK,
                                         num_warps=ROW_WARPS, enable_fp_fusion=FP_FUSION)
    return y.reshape(x.shape)


def invariant_add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype, rsqrt: bool = False) -> tuple:
    """``s = x + delta`` (a residual connection; s in their promoted dtype) and ``invariant_rms_norm(s)``
    cast to ``out_dtype``, in one kernel: the bits of those three ops (an fp32 add rounded to s's dtype,
    the norm's reduction unchanged, its output's rounding). ``(s, y)``, with ``rsqrt`` also the per-row
    1 / sqrt(mean(s^2) + eps) (fp32, rows x 1), for a backward."""
    where = "invariant_add_rms_norm"
    x2, d2 = _rows(where, x), _rows(where, delta)
    n = x2.shape[1]
    s_dtype = torch.promote_types(x.dtype, delta.dtype)
    if d2.shape != x2.shape or out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{where}: delta {tuple(delta.shape)} must have x's shape {tuple(x.shape)}, and the "
                         f"output dtype be bfloat16 or float32 (got {out_dtype})")
    if weight.shape != (n,) or not weight.is_floating_point():
        raise ValueError(f"{where}: weight must be a float ({n},) tensor, got {tuple(weight.shape)} {weight.dtype}")
    _check_device(where, x2, d2, weight)
    s = torch.empty(x2.shape, dtype=s_dtype, device=x.device)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    r = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device) if rsqrt else y  # y: unread
    if x2.shape[0]:
        s_bf16, out_bf16 = s_dtype == torch.bfloat16, out_dtype == torch.bfloat16
        _rms_norm_kernel[(x2.shape[0],)](x2, d2, s, weight.contiguous(), y, r, n, float(eps), x2.stride(0),
                                         d2.stride(0), s.stride(0), y.stride(0), HAS_DELTA=True, S_BF16=s_bf16,
                                         ROUND_BF16=s_bf16 or out_bf16, OUT_BF16=out_bf16, WRITE_R=rsqrt,
                                         INTERPRET=_interpreting(), BLOCK=ROW_BLOCK, num_warps=ROW_WARPS,
                                         enable_fp_fusion=FP_FUSION)
    s, y = s.reshape(x.shape), y.reshape(x.shape)
    return (s, y, r.reshape(*x.shape[:-1], 1)) if rsqrt else (s, y)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The math of ``invariant_rms_norm`` (fp32, fp64 for fp64 input): ``x * (1 / sqrt(sum(x*x) / n + eps)) * w``."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    ms = (xf * xf).sum(-1, keepdim=True) / x.shape[-1]
    return (xf * (1 / torch.sqrt(ms + eps)) * weight.to(ct)).to(x.dtype)


@triton.jit
def _lse_part_kernel(x_ptr, p_ptr, N, stride_x, CHUNKS, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # one chunk of CHUNK entries of one row: each lane's running max and sum of exp(x - max) over the
    # chunk's blocks in order, then the lanes' fixed tree: the chunk's (max, sum) pair
    row = tl.program_id(0)
    c = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    at = x_ptr + row.to(tl.int64) * stride_x
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, CHUNK, BLOCK):
        k = c * CHUNK + c0 + cols
        x = tl.load(at + k, mask=k < N, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with only -inf so far keeps s = 0
        s = s * tl.exp(m - m_use) + tl.exp(x - m_use)
        m = m_new
    mx = tl.max(m, axis=0)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    at_p = p_ptr + (row.to(tl.int64) * CHUNKS + c) * 2
    tl.store(at_p, mx)
    tl.store(at_p + 1, tl.sum(s * tl.exp(m - mx_use), axis=0))


@triton.jit
def _lse_apply_kernel(x_ptr, p_ptr, y_ptr, N, stride_x, stride_y, CHUNKS, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                      P: tl.constexpr):
    # the row's chunk pairs combined by one fixed tree (every program of the row computes the same lse),
    # then x - lse over this program's chunk
    row = tl.program_id(0)
    c = tl.program_id(1)
    j = tl.arange(0, P)
    at_p = p_ptr + (row.to(tl.int64) * CHUNKS + j) * 2
    pm = tl.load(at_p, mask=j < CHUNKS, other=float("-inf"))
    ps = tl.load(at_p + 1, mask=j < CHUNKS, other=0.0)
    mx = tl.max(pm, axis=0)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    lse = mx + tl.log(tl.sum(ps * tl.exp(pm - mx_use), axis=0))
    cols = tl.arange(0, BLOCK)
    at_x, at_y = x_ptr + row.to(tl.int64) * stride_x, y_ptr + row.to(tl.int64) * stride_y
    for c0 in range(0, CHUNK, BLOCK):
        k = c * CHUNK + c0 + cols
        ok = k < N
        x = tl.load(at_x + k, mask=ok, other=0.0).to(tl.float32)
        tl.store(at_y + k, x - lse, mask=ok)


class _InvariantLogSoftmax(torch.autograd.Function):
    """The trainer's logprobs in the batch-invariant mode: the kernel's forward, and log-softmax's
    usual backward ``g - exp(y) * sum(g)`` (the backward need not be batch-invariant)."""

    @staticmethod
    def forward(ctx, x):
        y = _log_softmax_rows(x)
        ctx.save_for_backward(y)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return (g - y.exp() * g.sum(-1, keepdim=True)).to(ctx.in_dtype)


def invariant_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax(x, dim=-1)`` in fp32 (x bf16 or fp32; -inf entries, e.g. top-k/top-p masks, give
    -inf), one program per row: a row's logprobs do not depend on the other rows. Returns fp32.
    Differentiable (``_InvariantLogSoftmax``) when x requires grad."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _InvariantLogSoftmax.apply(x)
    return _log_softmax_rows(x)


def _log_softmax_rows(x: torch.Tensor) -> torch.Tensor:
    where = "invariant_log_softmax"
    x2 = _rows(where, x)
    _check_device(where, x2)
    rows, n = x2.shape
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if rows:
        chunks = triton.cdiv(n, SOFTMAX_CHUNK)
        parts = torch.empty((rows, chunks, 2), dtype=torch.float32, device=x.device)
        common = dict(CHUNK=SOFTMAX_CHUNK, BLOCK=ROW_BLOCK, num_warps=ROW_WARPS, enable_fp_fusion=FP_FUSION)
        _lse_part_kernel[(rows, chunks)](x2, parts, n, x2.stride(0), chunks, **common)
        _lse_apply_kernel[(rows, chunks)](x2, parts, y, n, x2.stride(0), y.stride(0), chunks,
                                          P=triton.next_power_of_2(chunks), **common)
    return y.reshape(x.shape)


def log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """The math of ``invariant_log_softmax``: ``x - logsumexp(x)`` over the last dim, fp32 (fp64 for fp64)."""
    return torch.log_softmax(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1)


# --- elementwise chains, op by op in one kernel ---------------------------------------------------------
#
# A batch-invariant forward runs RoPE and SwiGLU op by op (``precision.fuse.suspended``): a chain compiled
# by torch.compile for the rollout and its autograd twin compiled for the trainer need not contract the
# same multiply-adds. Op by op they were about 13 kernels a decoder layer (casts, a roll, products, sums,
# exp; on the H200 about 1.1 ms of a 4.1 ms invariant decode step of Qwen2.5-1.5B at 32 rows). These
# kernels run each chain as one, every operation the op-by-op one: no multiply-add contraction
# (``enable_fp_fusion=False``), each product and sum rounded to fp32 as torch rounds it, one rounding to
# the output dtype at the end. Elementwise, so a value's bits depend on its own inputs only; the rollout
# and the trainer call the same kernel. RoPE (products and sums only) gives torch's op-by-op bits exactly;
# SwiGLU's exp is libdevice's ``expf`` on a GPU (torch's CUDA ``exp`` is the same CUDA math library
# function), numpy's in the interpreter.

ELEMENTWISE_BLOCK, ELEMENTWISE_WARPS = 1024, 4


@triton.jit
def _exp_precise(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter has no libdevice: numpy's exp
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def _rope_kernel(x_ptr, c_ptr, s_ptr, q_ptr, k_ptr, H, HEADS, T, D, sxb, sxh, sxt, sxd, scb, sch, sct, scd,
                 ssb, ssh, sst, ssd, sqb, sqh, sqt, skb, skh, skt, Q_BF16: tl.constexpr, K_BF16: tl.constexpr,
                 INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # rows BLOCK_T of one (sequence, head): y = x * cos + roll(x, D / 2) * sin in fp32, the sum of two
    # rounded products; heads below H are queries (into q), the rest keys (into k)
    bi = tl.program_id(1) // HEADS
    hi = tl.program_id(1) % HEADS
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = tl.arange(0, BLOCK_D)
    ok = (rt < T)[:, None] & (rd < D)[None, :]
    partner = (rd + D // 2) % D  # roll by half a head: [x2, x1]
    at = x_ptr + bi.to(tl.int64) * sxb + hi * sxh + rt.to(tl.int64)[:, None] * sxt
    x = tl.load(at + rd[None, :] * sxd, mask=ok, other=0.0).to(tl.float32)
    xr = tl.load(at + partner[None, :] * sxd, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + bi.to(tl.int64) * scb + hi * sch + rt.to(tl.int64)[:, None] * sct + rd[None, :] * scd,
                mask=ok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + bi.to(tl.int64) * ssb + hi * ssh + rt.to(tl.int64)[:, None] * sst + rd[None, :] * ssd,
                mask=ok, other=0.0).to(tl.float32)
    y = x * c + xr * s
    if hi < H:
        _store_as(q_ptr + bi.to(tl.int64) * sqb + hi * sqh + rt.to(tl.int64)[:, None] * sqt + rd[None, :], y, ok,
                  Q_BF16, INTERPRET)
    else:
        _store_as(k_ptr + bi.to(tl.int64) * skb + (hi - H) * skh + rt.to(tl.int64)[:, None] * skt + rd[None, :], y,
                  ok, K_BF16, INTERPRET)


_ELEMENTWISE_OUT = (torch.bfloat16, torch.float32)


def exact_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: int, q_dtype: torch.dtype,
               k_dtype: torch.dtype):
    """``models.llama._rope`` in one kernel with its op-by-op bits: ``x * cos + roll(x, d / 2) * sin`` in
    fp32 over x (b, heads, t, d; any strides, bf16 or fp32), cos and sin broadcastable to it (fp32 or
    bf16); the first ``h`` heads returned as queries in ``q_dtype``, the rest as keys in ``k_dtype``
    (contiguous (b, heads, t, d) tensors). None where it does not apply (other dtypes or ranks, an odd d):
    the caller runs the ops."""
    if (x.dim() != 4 or x.dtype not in _ELEMENTWISE_OUT or q_dtype not in _ELEMENTWISE_OUT
            or k_dtype not in _ELEMENTWISE_OUT or x.shape[-1] % 2 or not 0 <= h <= x.shape[1]
            or cos.dtype not in _ELEMENTWISE_OUT or sin.dtype not in _ELEMENTWISE_OUT):
        return None
    try:
        c, s = torch.broadcast_to(cos, x.shape), torch.broadcast_to(sin, x.shape)
    except RuntimeError:
        return None
    _check_device("exact_rope", x, c, s)
    b, heads, t, d = x.shape
    q = torch.empty((b, h, t, d), dtype=q_dtype, device=x.device)
    k = torch.empty((b, heads - h, t, d), dtype=k_dtype, device=x.device)
    if x.numel():
        block_d = triton.next_power_of_2(d)
        block_t = max(1, ELEMENTWISE_BLOCK // block_d)  # whatever t: one compilation for every call
        _rope_kernel[(triton.cdiv(t, block_t), b * heads)](
            x, c, s, q, k, h, heads, t, d, *x.stride(), *c.stride(), *s.stride(), *q.stride()[:3], *k.stride()[:3],
            Q_BF16=q_dtype == torch.bfloat16, K_BF16=k_dtype == torch.bfloat16, INTERPRET=_interpreting(),
            BLOCK_T=block_t, BLOCK_D=block_d, num_warps=ELEMENTWISE_WARPS, enable_fp_fusion=False)
    return q, k


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, I, s_gu, s_y, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                     BLOCK: tl.constexpr):
    # one row's columns BLOCK: g / (1 + exp(-g)) * u in fp32, each operation rounded as torch's
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + row * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_gu + I + cols, mask=ok, other=0.0).to(tl.float32)
    y = tl.math.div_rn(g, _exp_precise(-g, INTERPRET) + 1.0) * u
    _store_as(y_ptr + row * s_y + cols, y, ok, OUT_BF16, INTERPRET)


def exact_swiglu(gu: torch.Tensor, out_dtype: torch.dtype | None = None):
    """``precision.linear._swiglu_math`` in one kernel, op by op: ``g / (1 + exp(-g)) * u`` in fp32 for
    ``gu = [g, u]`` (last dim; bf16 or fp32), in ``out_dtype`` (default gu's). None where it does not
    apply (other dtypes, an odd last dim): the caller runs the ops."""
    out_dtype = out_dtype or gu.dtype
    if gu.dim() == 0 or gu.dtype not in _ELEMENTWISE_OUT or out_dtype not in _ELEMENTWISE_OUT or gu.shape[-1] % 2:
        return None
    _check_device("exact_swiglu", gu)
    g2 = gu.reshape(-1, gu.shape[-1])
    if g2.shape[1] and g2.stride(1) != 1:
        g2 = g2.contiguous()
    i = g2.shape[1] // 2
    y = torch.empty((g2.shape[0], i), dtype=out_dtype, device=gu.device)
    if y.numel():
        block = ELEMENTWISE_BLOCK
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(i, block))](
            g2, y, i, g2.stride(0), y.stride(0), OUT_BF16=out_dtype == torch.bfloat16, INTERPRET=_interpreting(),
            BLOCK=block, num_warps=ELEMENTWISE_WARPS, enable_fp_fusion=False)
    return y.reshape(*gu.shape[:-1], i)
