"""The Triton kernels as a Hopper GPU would run them, checked on a machine without one.

``tests/sm90_compile.py`` compiles every kernel for sm_90a through jetrl's own wrappers (Triton's
NVIDIA backend ships ptxas and cuobjdump) at the Qwen2.5-1.5B shapes of a decode step, a prefill
and a training step. The interpreter tests check the kernels' values; these check what only the
compiler can tell: that each kernel compiles for the GPU, that the fast paths do not spill
registers, and that the batch-invariant kernels compile to the same floating-point arithmetic
whatever the number of rows or the key width (a decode step and the trainer's forward can get two
compilations, since Triton specialises integer arguments on ``== 1`` and divisibility by 16).
"""

import collections
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # ~30 s of compiling on 2 cores

SCRIPT = os.path.join(os.path.dirname(__file__), "sm90_compile.py")


@pytest.fixture(scope="module")
def report():
    triton = pytest.importorskip("triton")
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(bin_dir, "cuobjdump")):
        pytest.skip(f"this Triton ({triton.__version__}) ships no NVIDIA tools in {bin_dir}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "FP_FUSION" not in proc.stderr  # every launch pins enable_fp_fusion (kernels.fp8.FP_FUSION)
    out = json.loads(proc.stdout)
    if "unsupported" in out:
        pytest.skip(out["unsupported"])
    return out


def _by_group(report):
    groups = collections.defaultdict(list)
    for k in report["kernels"]:
        groups[k["group"]].append(k)
    return groups


def test_every_kernel_compiles_for_hopper(report):
    assert report["failures"] == {}
    cases = {k["case"] for k in report["kernels"]}
    assert any(c.startswith("quantize_act") for c in cases) and any("attention decode" in c for c in cases)
    # Hopper's tensor-core instructions: wgmma for the bf16 and the FP8 dots
    by_case = {k["case"]: k for k in report["kernels"]}
    for case in ("invariant_mm bf16 M=4096", "blockwise_mm M=4096", "invariant_attention t=512"):
        assert any(op.startswith("wgmma") for op in by_case[case]["ptx_fp"]), case


def test_int8_kernels_use_the_integer_tensor_cores_and_round_half_to_even(report):
    by_case = {k["case"]: k for k in report["kernels"]}
    gemms = [k for c, k in by_case.items() if c.startswith("int8_mm")]
    assert len(gemms) == 5
    for k in gemms:  # int8 x int8 -> int32 on the tensor cores at every M (mma.sync for a decode step's rows)
        assert k["ptx_mma"] and all(".s8.s8" in op for op in k["ptx_mma"]), (k["case"], k["ptx_mma"])
    assert any(op.startswith("wgmma") for op in by_case["int8_mm M=4096"]["ptx_mma"])
    quantizers = [k for c, k in by_case.items() if c.startswith(("int8 quantize_rows", "int8 norm quantizer",
                                                                 "int8 swiglu quantizer"))]
    assert len(quantizers) == 10
    for k in quantizers:  # (y + 1.5 * 2^23) - 1.5 * 2^23 survived compilation: not folded into y
        assert {"0f4B400000", "0fCB400000"} <= set(k["ptx_f32_consts"]), k["case"]


def test_int8_gemm_adds_its_bias_to_the_rounded_product(report):
    """``int8_mm(bias=)`` in fp32 rounds the scaled product, then adds the bias (``mul.rn``, ``add.rn``),
    as the separate add does. Compiled with contraction, ``(acc * sa) * sb + bias`` was one FMA (one
    rounding where the add has two), and ``test_kernels_int8.py``'s bias test failed on an H200; the
    interpreter never contracts. No INT8 GEMM kernel has an FMA."""
    gemms = [k for k in report["kernels"] if k["kernel"] in ("_int8_mm_kernel", "_int8_split_sum_kernel")]
    for case in ("int8 bias GEMM M=7 fp32", "split-K int8 bias GEMM M=32 fp32"):
        fp = next(k["ptx_fp"] for k in gemms if k["case"] == case)
        assert "add.rn.f32" in fp and "mul.rn.f32" in fp, (case, fp)
    for k in gemms:
        assert not any(op.startswith("fma") for op in k["ptx_fp"]), (k["case"], k["kernel"])


def test_fast_paths_do_not_spill_registers(report):
    # The fp32 kernels are for checks (IEEE fp32 dots on the CUDA cores), not speed: the fp32
    # attention spills ~14 KB per thread; the fp32 GEMM 0 bytes with Triton 3.9 (8 with Triton 3.6)
    # in split mode, 264 bytes with Triton 3.9 in chunked mode (its second fp32 tile, the total).
    spills = {k["case"]: k["stack"] for k in report["kernels"]
              if k["stack"] and "fp32" not in k["group"] and k["group"] != "control"}
    assert spills == {}
    for k in report["kernels"]:
        assert k["shared"] <= 227 * 1024, k["case"]  # an H100 block's shared memory


def test_the_weight_transpose_moves_words_not_bytes(report):
    """W^T's FP8 bytes (``transpose_bytes_``'s kernel, a GPU's timed choice) move through shared memory
    as 32-bit words, never single bytes (the byte-wise ``tl.trans`` of an FP8 tile: 64 ``LDS.U8`` per
    thread)."""
    for case in ("weight transpose words", "weight transpose words triton-n-first",
                 "weight transpose words triton-diagonal"):  # each order of its tiles
        ks = {k["kernel"]: k for k in report["kernels"] if k["case"] == case}
        assert "_transpose_words_kernel" in ks, (case, sorted(ks))
        k = ks["_transpose_words_kernel"]
        assert not any(op.split(".")[-1] == "U8" for op in k["sass"]["shared"]), case
        assert k["sass"]["global"].get("LDG.E.128", 0) == 4 and k["stack"] == 0, (case, k["sass"]["global"])


def test_fp8_gemm_runs_on_the_tensor_cores_at_every_tile(report):
    """The plain FP8 GEMM's decode tiles (16-64 rows x 32-64 columns) and its 64 x 128 tiles: from 64
    rows ``wgmma`` on e4m3 operands; a 16-row tile is ``mma.sync`` on f16 operands converted from e4m3
    (exact: every e4m3 and e5m2 value is an f16 value), with fp32 accumulation either way."""
    by_case = {k["case"]: k for k in report["kernels"]}
    gemms = {c: k for c, k in by_case.items() if c.startswith("blockwise_mm")}
    assert len(gemms) == 6
    for case in ("blockwise_mm M=64", "blockwise_mm M=64 N=1536", "blockwise_mm M=4096"):
        (op,) = gemms[case]["ptx_mma"]
        assert op.startswith("wgmma") and op.endswith(".f32.e4m3.e4m3"), (case, op)
    for case in ("blockwise_mm M=1", "blockwise_mm M=7", "blockwise_mm M=7 bias"):
        (op,) = gemms[case]["ptx_mma"]
        assert op.startswith("mma.sync") and ".f32.f16.f16.f32" in op, (case, op)
        assert "cvt.rn.f16x2.e4m3x2" in gemms[case]["ptx_fp"], case


def test_a_swapped_decode_gemm_runs_wgmma_on_the_fp8_bytes(report):
    """``blockwise_mm(swap=True)``: a decode step's few rows as the MMA's N, the weight's rows as its M
    (64), so from one row up ``wgmma`` takes the e4m3 bytes themselves (the plain 16- and 32-row tiles
    convert them to f16 for ``mma.sync``), unspilled, split or not; ``int8_mm(swap=True)`` likewise on
    s8 (the plain tiles: ``mma.sync`` on s8)."""
    swapped = {k["case"]: k for k in report["kernels"]
               if k["case"].startswith("swapped") and k["kernel"].endswith(("mm_kernel", "mm_split_kernel"))}
    assert len(swapped) == 10
    for case, k in swapped.items():
        (op,) = k["ptx_mma"]
        int8 = "int8" in case  # INT8's twin: wgmma on s8, int32 sums
        assert op.startswith("wgmma") and op.endswith(".s32.s8.s8" if int8 else ".f32.e4m3.e4m3"), (case, op)
        assert k["stack"] == 0 and "cvt.rn.f16x2.e4m3x2" not in k["ptx_fp"], case


def test_split_k_gemm_runs_on_the_tensor_cores_and_sums_in_fp32(report):
    """A decode step's split-K FP8 and INT8 GEMMs (``decode_split``): the splits' kernels multiply on
    the tensor cores as the unsplit ones do at that tile; the FP8 sum kernel adds fp32 partials (and
    rounds to bf16 once, a ``cvt.rn``), the INT8 one int32 partials."""
    ks = {k["kernel"]: k for k in report["kernels"] if k["case"] == "split-K blockwise_mm M=32 N=1536 bias"}
    assert set(ks) == {"_blockwise_mm_split_kernel", "_split_sum_kernel"}
    (op,) = ks["_blockwise_mm_split_kernel"]["ptx_mma"]
    assert op.startswith(("wgmma", "mma.sync")), op
    fp = ks["_split_sum_kernel"]["ptx_fp"]
    assert "add.f32" in fp or "add.rn.f32" in fp, fp
    assert any(o.startswith("cvt.rn.bf16") for o in fp), fp
    assert not ks["_split_sum_kernel"]["ptx_mma"]
    ks = {k["kernel"]: k for k in report["kernels"] if k["case"] == "split-K int8_mm M=32 N=1536"}
    assert set(ks) == {"_int8_mm_split_kernel", "_int8_split_sum_kernel"}
    (op,) = ks["_int8_mm_split_kernel"]["ptx_mma"]
    assert ".s8.s8" in op, op  # int8 x int8 -> int32 on the tensor cores; the partials then add exactly
    assert not ks["_int8_split_sum_kernel"]["ptx_mma"]


def test_a_fused_split_k_counts_arrivals_and_reads_partials_from_l2(report):
    """The fused split-K (``_last_sums``): one kernel, the tensor cores as the unfused split's; each
    program counts its arrival with an acquire-release atomic at GPU scope (its partial's stores
    released to the other SMs, theirs acquired by the last), and the last reads the partials with
    L2-only loads (``ld.global.cg``, no stale L1 line) and adds them in fp32, rounding to bf16 once."""
    ks = {k["kernel"]: k for k in report["kernels"] if k["case"] == "split-K blockwise_mm M=32 N=1536 bias fused"}
    assert set(ks) == {"_blockwise_mm_split_kernel"}
    k = ks["_blockwise_mm_split_kernel"]
    (op,) = k["ptx_mma"]
    assert op.startswith(("wgmma", "mma.sync")) and k["stack"] == 0, (op, k["stack"])
    mem = k["ptx_mem"]
    assert any(o.startswith("atom") and ".acq_rel" in o and ".gpu" in o and ".add" in o for o in mem), mem
    assert any(o.startswith("atom") and ".exch" in o for o in mem), mem  # the counter zeroed for the next call
    assert any(o.startswith("ld.global.cg") for o in mem), mem
    assert any(o.startswith("cvt.rn.bf16") for o in k["ptx_fp"]), k["ptx_fp"]


def divides_without_division(k) -> bool:
    """Whether a kernel's quotients are IEEE division's with no division instruction: the reciprocal
    unit's approximation corrected by FMAs (``kernels.fp8._rcp``, ``_quotient``), no ``div.rn`` (an
    ``FCHK`` and a slow path in SASS) and never the approximate ``div.full`` / ``div.approx``."""
    fp = k["ptx_fp"]
    return ("rcp.approx.ftz.f32" in fp and "fma.rn.f32" in fp and k["sass_fp"].get("FCHK", 0) == 0
            and not any(op.startswith(("div.", "rcp.rn")) for op in fp))


def test_the_swiglu_forward_divides_exactly_and_its_backward_takes_the_reciprocal_unit(report):
    """The SwiGLU quantizers compute their scales as IEEE does, with no division instruction, and take the
    hardware's ``exp`` (``ex2.approx``, torch's is ``expf``): which is why h's last bits may differ from
    torch's SwiGLU, and why the rollout and the trainer share the forward's kernel. The forward divides
    silu's ``g / (1 + exp(-g))`` exactly too (the reciprocal's two Newton steps and the quotient's two
    corrections: 8 FMAs an exp at least); the backward's kernels (``kernels.fp8.APPROX_BACKWARD``) take
    ``1 / (1 + exp(-g))`` from the reciprocal unit: one ``rcp.approx`` an exp, and FMAs only for the
    scales' (8 a reciprocal) and d[g]'s contracted ``1 + g * (1 - sig)`` (one an exp)."""
    by_case = {k["case"]: k for k in report["kernels"]}
    backward = ("swiglu_quantize_t pow2=False", "swiglu_grad_quantize pow2=False",
                "swiglu_grad_quantize h_cols pow2=False",
                *(f"swiglu_grad_quantize split {w} warps pow2=False" for w in (4, 8, 16)))
    for case in ("swiglu_quantize pow2=False", *backward):
        for k in (k for k in report["kernels"] if k["case"] == case):
            assert divides_without_division(k), (case, k["ptx_fp"])
            assert any(op.startswith("ex2.approx") for op in k["ptx_fp"]), case
            fp = k["sass_fp"]
            ffma, rcp, ex2 = fp.get("FFMA", 0), fp.get("MUFU.RCP", 0), fp.get("MUFU.EX2", 0)
            assert ex2 > 0 and rcp > ex2, (case, fp)
            if case in backward:
                assert ffma <= 8 * (rcp - ex2) + ex2, (case, k["kernel"], fp)
            else:
                assert ffma >= 8 * ex2, (case, fp)
    assert by_case["swiglu_quantize pow2=False"]["kernel"] == "_swiglu_quant_kernel"


def test_the_swiglu_backwards_two_kernels_keep_its_arithmetic_in_few_registers(report):
    """The SwiGLU backward's two kernels of small tiles (a GPU's timed choice beside the 128x128-tile
    kernel) compute their scales exactly and take ``ex2.approx`` as that kernel does, contract d[g]'s ``1 + g * (1 -
    sig)`` into one FMA as it does (the same bits; in the interpreter it is tested), and run in far
    fewer registers, unspilled: the point of them (at 8 warps the one kernel takes 190-255 and runs
    one program per SM)."""
    fused = next(k for k in report["kernels"] if k["case"] == "swiglu_grad_quantize h_cols pow2=False")
    assert fused["ptx_fma_plus_one"] > 0
    # at 4 warps the 128x1 kernel holds two rows of its columns a thread: up to 254 registers (3.6), unspilled;
    # the 1x128 kernel 128 there (Triton 3.6, since its quotients are products: 96 before; its pow2 variant's
    # already were), four programs an SM
    for w, rows_max, cols_max in ((4, 128, 255), (8, 64, 128), (16, 48, 80)):
        ks = {k["kernel"]: k for k in report["kernels"] if k["case"] == f"swiglu_grad_quantize split {w} warps pow2=False"}
        assert set(ks) == {"_swiglu_grad_rows_kernel", "_swiglu_grad_cols_kernel"}, sorted(ks)
        for name, k in ks.items():
            fp = k["ptx_fp"]
            assert divides_without_division(k), name
            assert any(op.startswith("ex2.approx") for op in fp) and k["ptx_fma_plus_one"] > 0, name
            assert k["num_warps"] == w and k["stack"] == 0, (name, w, k["stack"])
        regs = ks["_swiglu_grad_rows_kernel"]["reg"], ks["_swiglu_grad_cols_kernel"]["reg"]
        assert regs[0] <= rows_max and regs[1] <= cols_max, (w, regs)


def test_the_sampling_kernel_takes_accurate_logarithms_unspilled(report):
    """The keyed Gumbel-max kernel computes its two logarithms as libdevice's ``logf`` (torch's CUDA
    ``log``): no ``lg2.approx``, which differs from it in the last bits, and so in which token wins a
    near tie; it compiles unspilled for a 152K vocabulary."""
    k = next(k for k in report["kernels"] if k["case"] == "keyed_gumbel_argmax")
    assert k["kernel"] == "_keyed_gumbel_argmax_kernel" and k["stack"] == 0
    assert not any(op.startswith(("lg2.approx", "ex2.approx")) for op in k["ptx_fp"]), k["ptx_fp"]
    assert any(op.startswith("fma.rn") for op in k["ptx_fp"])  # libdevice's polynomial


def test_the_norm_quantizer_divides_and_takes_the_root_exactly(report):
    """``rms_norm_quantize`` divides and takes its square root as IEEE does (``div.rn``, ``sqrt.rn``:
    the mean, 1 / sqrt and the scale), no approximate ``rsqrt``: its norm is the batch-invariant
    RMSNorm's math on a GPU as in the interpreter, for a rollout's step and a training forward alike."""
    by_case = {k["case"]: k for k in report["kernels"]}
    for case in ("rms_norm_quantize train pow2=False", "rms_norm_quantize decode pow2=False"):
        fp = by_case[case]["ptx_fp"]
        assert "div.rn.f32" in fp and "sqrt.rn.f32" in fp, (case, fp)
        assert not any(op.startswith(("div.full", "div.approx", "rsqrt", "sqrt.approx")) for op in fp), (case, fp)


def test_the_norm_quantizer_stores_its_chunks_scales_once(report):
    """``rms_norm_quantize`` (unrolled: a model's width) keeps each 128-wide chunk's row scales in one
    (rows, chunks) tile and stores it once: a store of each chunk's (rows,) vector took a layout of its
    own, a conversion through shared memory and two barriers a chunk, 12 and 23 at width 1536 -- what a
    decode step's norm waited on (8.4 us on the H200 at 32 rows as at 512). The decode norm keeps one
    conversion and one barrier (its reduction's); the training norm, which also writes r, two and three; an
    8B model's (4096 wide), whose chunks loop, one and one, after its loop."""
    by_case = {k["case"]: k for k in report["kernels"]}
    for case, conversions, barriers in (("rms_norm_quantize decode pow2=False", 1, 1),
                                        ("rms_norm_quantize train pow2=False", 2, 3),
                                        ("rms_norm_quantize decode 8B", 1, 1)):
        k = by_case[case]
        assert k["layout_conversions"] <= conversions and k["barriers"] <= barriers, \
            (case, k["layout_conversions"], k["barriers"])


@pytest.mark.parametrize("group", ["invariant_mm bf16", "invariant_mm fp32", "invariant_blockwise_mm",
                                   "invariant_mm bf16 split", "invariant_mm fp32 split", "invariant_blockwise_mm split",
                                   "invariant_mm bf16 split fused", "invariant_blockwise_mm split fused",
                                   "invariant_mm bf16 whole", "invariant_blockwise_mm whole",
                                   "invariant_attention bf16", "invariant_attention fp32", "invariant_rms_norm",
                                   "invariant_log_softmax", "invariant_attention fp8 cache", "exact_rope", "invariant_add_rms_norm",
                                   "exact_swiglu", "fp8 rms_norm_quantize", "fp8 rms_norm_quantize train",
                                   "fp8 swiglu_quantize", "fp8 swiglu_quantize save", "fp8 quantize_act rows",
                                   "invariant_attention bf16 fp8 out", "invariant_attention fp8 cache fp8 out"])
def test_invariant_kernels_compile_to_one_arithmetic(report, group):
    """Decode (M = 1, 7; one query over a key width of 1, 300 or 1024), prefill and training calls:
    the same floating-point instructions in the same program order in the PTX, and the same ones in
    the SASS (whose order is the scheduler's: it interleaves independent instructions, it does not
    reassociate them). The GEMMs in each launch mode (split mode: its two kernels, each compared
    with itself; split fused: the chunks' sum in the GEMM's last program of a tile, one kernel; whole: a
    weight whose K is one chunk); the log-softmax's two kernels (a row's chunk
    pairs, and their combination with x - lse), each compared with itself. The FP8 quantizers the
    batch-invariant forward shares with the fast path (the norm's, the SwiGLU's, o_proj's input):
    each form at every row count."""
    by_kernel = collections.defaultdict(list)
    for k in _by_group(report)[group]:
        by_kernel[k["kernel"]].append(k)
    assert len(by_kernel) == (2 if group.endswith(" split") or group == "invariant_log_softmax" else 1), \
        sorted(by_kernel)
    for kernels in by_kernel.values():
        assert len(kernels) >= 3
        first = kernels[0]
        assert first["ptx_fp"], group
        for k in kernels[1:]:
            assert k["ptx_fp"] == first["ptx_fp"], f"{k['case']} vs {first['case']}"
            assert k["sass_fp"] == first["sass_fp"], f"{k['case']} vs {first['case']}"


def _in_order(part: list, whole: list) -> bool:
    """Whether ``part`` is a subsequence of ``whole`` (its items in ``whole``, in order)."""
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


@pytest.mark.parametrize("cache", ["bf16", "fp8 cache"])
def test_invariant_attention_writing_o_projs_input_keeps_the_attention_arithmetic(report, cache):
    """A batch-invariant decode step whose attention kernel writes o_proj's FP8 input (``quantize_out``)
    must compute the output the trainer's attention (the kernel without it) computes, then quantize it as
    the trainer's quantizer does: its floating-point instructions hold the plain kernel's, in program
    order, the quantizer's (a group's amax, scale, reciprocal and products) added after them -- none of the
    attention's left out, reordered, or contracted otherwise. (The plain kernel rounds its output to bf16
    two values an instruction, ``cvt.rn.bf16x2.f32``; the other one value each, then widens it back,
    exactly, for the quantizer: the same roundings, so both are compared one value a rounding.)"""
    groups = _by_group(report)

    def one_by_one(ops):  # a packed bf16 rounding as two, and no widening (exact)
        return [c for op in ops if op != "cvt.f32.bf16"
                for c in (["cvt.rn.bf16.f32"] * 2 if op == "cvt.rn.bf16x2.f32" else [op])]

    plain = one_by_one(groups[f"invariant_attention {cache}"][0]["ptx_fp"])
    quant = one_by_one(groups[f"invariant_attention {cache} fp8 out"][0]["ptx_fp"])
    assert _in_order(plain, quant), cache
    assert not collections.Counter(plain) - collections.Counter(quant)
    added = collections.Counter(quant) - collections.Counter(plain)
    assert added["cvt.rn.satfinite.e4m3x2.f32"] > 0 and added["mul.rn.f32"] > 0, added  # the quantizer's products
    assert set(added) <= {"cvt.rn.satfinite.e4m3x2.f32", "mul.rn.f32", "mul.f32", "fma.rn.f32", "neg.f32",
                          "rcp.approx.ftz.f32", "max.f32"}, added


def test_the_exact_chains_round_each_operation_as_torch(report):
    """A batch-invariant forward's RoPE and SwiGLU kernels (``kernels.invariant.exact_rope``,
    ``exact_swiglu``): RoPE's products and sum each rounded (two ``mul.rn.f32`` and an ``add``, no
    ``fma``: contraction is off), SwiGLU's division IEEE (``div.rn.f32``, not ``div.full``). (Neither
    spills: ``test_fast_paths_do_not_spill_registers``.)"""
    by_group = _by_group(report)
    rope = by_group["exact_rope"][0]
    assert not any(op.startswith("fma") for op in rope["ptx_fp"]), rope["ptx_fp"]
    assert any(op.startswith("mul.rn.f32") for op in rope["ptx_fp"]) and any(op.startswith("add.rn.f32")
                                                                              for op in rope["ptx_fp"])
    swiglu = by_group["exact_swiglu"][0]
    assert any(op.startswith("div.rn.f32") for op in swiglu["ptx_fp"]), swiglu["ptx_fp"]
    assert not any(op.startswith("div.full") or op.startswith("div.approx") for op in swiglu["ptx_fp"])


@pytest.mark.parametrize("gemm", ["invariant_mm bf16", "invariant_mm fp32", "invariant_blockwise_mm"])
def test_invariant_gemms_chunked_mode_adds_only_the_chunks(report, gemm):
    """The batch-invariant GEMMs' two launch modes (``kernels.invariant.k_chunks``: K in 3 chunks
    here) against each other. The chunked kernel (one program walks every chunk: prefill, training)
    has every floating-point instruction of the split one (a program per chunk: decode) -- the same
    tensor-core instruction, the same scaling of an FP8 block -- plus one fp32 add per accumulator
    element (a chunk's sum into the total, in a branch taken once per chunk: no per-step selects)
    and the output's rounding; both are pipelined alike (the same shared memory). A weight whose K is
    one chunk (gate/up) runs the split kernel's arithmetic and the rounding alone: the unsplit kernel.
    The sum of the chunks adds fp32 partials and rounds once, on no tensor cores. A decode step's GEMM
    picks split mode by itself (down_proj, M = 32)."""
    by = {(k["case"], k["kernel"]): k for k in report["kernels"]}
    name = "_fp8_mm_kernel" if "blockwise" in gemm else "_mm_kernel"
    chunked, split = by[(f"{gemm} M=64", name)], by[(f"{gemm} split M=64", name)]
    total = by[(f"{gemm} split M=64", "_chunk_sum_kernel")]
    assert chunked["ptx_mma"] == split["ptx_mma"] and chunked["shared"] == split["shared"]
    if "fp32" not in gemm:
        (op,) = chunked["ptx_mma"]
        assert op.startswith("wgmma"), op
    more = collections.Counter(chunked["sass_fp"])
    more.subtract(split["sass_fp"])
    assert min(more.values()) >= 0, more  # nothing of the split kernel's arithmetic missing
    per_thread = 64 * 128 // (32 * chunked["num_warps"])
    assert {op: n for op, n in more.items() if n and not op.startswith("F2F")} == {"FADD": per_thread}, more
    if "fp32" not in gemm:
        whole = by[(f"{gemm} whole M=64", name)]
        assert whole["ptx_mma"] == split["ptx_mma"] and whole["stack"] == 0
        more = collections.Counter(whole["sass_fp"])
        more.subtract(split["sass_fp"])
        assert {op: n for op, n in more.items() if n and not op.startswith("F2F")} == {}, more
    assert "add.f32" in total["ptx_fp"] and not total["ptx_mma"]
    if "fp32" not in gemm:  # bf16 output: rounded once, in the sum
        assert any(o.startswith("cvt.rn.bf16") for o in total["ptx_fp"]), total["ptx_fp"]
    kind = "invariant_blockwise_mm" if "blockwise" in gemm else "invariant_mm bf16"
    if "fp32" not in gemm:
        ks = {k["kernel"] for k in report["kernels"] if k["case"] == f"{kind} down_proj M=32 bias"}
        assert ks == {name, "_chunk_sum_kernel"}, ks


def test_the_comparison_sees_another_summation_order(report):
    """Negative control: the attention kernel at half the key block adds in another order; the
    comparison above must tell it apart from the shipped configuration."""
    shipped = _by_group(report)["invariant_attention bf16"][0]
    (control,) = _by_group(report)["control"]
    assert control["ptx_fp"] != shipped["ptx_fp"] and control["sass_fp"] != shipped["sass_fp"]


def test_reading_an_fp8_cache_adds_only_its_dequantization(report):
    """Batch-invariant decode over an FP8 cache against the trainer's attention over bf16 keys and
    values: the bf16 kernel's floating-point instructions, in order, are a subsequence of the FP8
    one's, and what the FP8 one adds is the dequantization alone -- e4m3 -> f16 -> f32 (exact), one
    multiply by the scale, one round to bf16 -- so the bits match the trainer's where the values do
    (the interpreter tests check the values)."""
    by_case = {k["case"]: k for k in report["kernels"]}
    bf16, fp8 = by_case["invariant_attention decode w=300"]["ptx_fp"], by_case["invariant_attention fp8 cache decode w=300"]["ptx_fp"]
    extras, i = [], 0
    for op in bf16:
        while i < len(fp8) and fp8[i] != op:
            extras.append(fp8[i])
            i += 1
        assert i < len(fp8), f"{op} of the bf16 kernel is missing from the FP8-cache one, in order"
        i += 1
    extras += fp8[i:]
    assert extras and set(extras) == {"cvt.rn.f16x2.e4m3x2", "cvt.f32.f16", "mul.f32", "cvt.rn.bf16x2.f32"}, \
        collections.Counter(extras)


def test_decode_attention_runs_on_the_tensor_cores_without_spills(report):
    """The decode kernel (GQA heads packed into 16 rows): mma.sync on bf16 with fp32 accumulation,
    over a bf16 cache and an FP8 one (dequantized in registers), at every key width; writing o_proj's
    FP8 input too, with the quantizer's IEEE division."""
    kernels = [k for k in report["kernels"] if k["case"].startswith("decode_attention")]
    assert len(kernels) == 7
    for k in kernels:
        assert k["ptx_mma"] == ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"], (k["case"], k["ptx_mma"])
        assert k["stack"] == 0 and k["shared"] <= 227 * 1024, k["case"]
        if "fp8" in k["case"]:
            assert "cvt.rn.f16x2.e4m3x2" in k["ptx_fp"], k["case"]
    (out8,) = [k for k in kernels if k["case"].endswith("fp8 out")]
    assert "div.rn.f32" in out8["ptx_fp"] and "div.full.f32" not in out8["ptx_fp"], out8["ptx_fp"]


def test_kv_store_quantizes_with_the_references_rounding(report):
    """Keys and values into an FP8 cache: IEEE division (with no division instruction, never the
    approximate ``div.full``), the NaN-keeping clamp as selects (no ``min.NaN`` / ``max.NaN``: after those, an
    H100 run found Triton 3.6's transposed FP8 stores writing garbage, triton-lang/triton#11111), and
    a round-to-nearest-even cast that saturates, from fp32 keys and bf16 values alike, into the
    cache's rows or (the trainer's) rows in order."""
    kernels = [k for k in report["kernels"] if k["case"].startswith("kv_store")]
    assert len(kernels) == 3
    for k in kernels:
        ops = set(k["ptx_fp"])
        assert "cvt.rn.satfinite.e4m3x2.f32" in ops and divides_without_division(k), (k["case"], ops)
        assert not any(".NaN" in op for op in ops), (k["case"], ops)
        assert k["stack"] == 0, k["case"]


def test_table_driven_weight_kernels_keep_vector_loads(report):
    """The model's weights in one launch (``quantize_weight_stacks``: a job table of offsets and sizes)
    compile as the per-weight kernels did: 16-byte loads of the weights and 16-byte stores of the FP8
    data (sizes read from memory carry no divisibility unless restated: the first version loaded one
    element at a time, 254 registers and 3040 instructions per thread), no more than 128 registers
    per thread for the quantizer (two programs per SM at 8 warps), the transpose's bytes read 16 at a
    time."""
    ks = {k["kernel"]: k for k in report["kernels"] if k["case"] == "quantize_weight_stacks model"}
    assert set(ks) == {"_weight_quant_kernel", "_transpose_words_kernel"}, sorted(ks)
    quant, words = ks["_weight_quant_kernel"], ks["_transpose_words_kernel"]
    assert quant["reg"] <= 128 and quant["stack"] == 0 and words["stack"] == 0, (quant["reg"], words["reg"])
    wide = {op: n for op, n in quant["sass"]["global"].items() if op.endswith(".128")}
    assert sum(n for op, n in wide.items() if op.startswith("LDG")) == 16, quant["sass"]["global"]  # 64 fp32 a thread
    assert sum(n for op, n in wide.items() if op.startswith("STG")) == 4, quant["sass"]["global"]  # 64 bytes a thread
    assert words["sass"]["global"].get("LDG.E.128", 0) == 4 and "LDG.E.U8" not in words["sass"]["global"]


def test_no_fp8_quantizer_clamps_with_nan_propagating_min_max(report):
    """Every kernel that writes FP8 (a ``cvt...e4m3x2`` / ``e5m2x2`` cast) clamps with selects, never
    with ``min.NaN`` / ``max.NaN`` (``tl.clamp(propagate_nan=ALL)``): after those, Triton 3.6 on an
    H100 wrote garbage bytes, NaN among them, into the quantizers' transposed outputs (x^T, W^T) and
    an ``fp8-unified`` run stopped at step 1 on a NaN gradient norm (triton-lang/triton#11111)."""
    writers = [k for k in report["kernels"] if any(op.startswith("cvt.rn.satfinite.e") for op in k["ptx_fp"])]
    assert {k["case"].split()[0] for k in writers} >= {"quantize_act", "quantize_weight", "swiglu_quantize",
                                                      "swiglu_grad_quantize"}, sorted({k["case"] for k in writers})
    for k in writers:
        assert not any(".NaN" in op for op in k["ptx_fp"]), (k["case"], sorted(set(k["ptx_fp"])))


def test_quantizers_find_a_groups_reciprocal_once_and_multiply_each_element(report):
    """The act and weight quantizers find a group's ``1 / scale`` once (the reciprocal unit and two
    Newton steps, ``kernels.fp8._rcp``; the scale itself by ``_quotient``'s two corrections) and multiply
    each element by it once, ``mul.rn`` (``_scaled``): far fewer reciprocals than elements per thread,
    no IEEE division at all (``FCHK``, one per ``div_rn``, each with a branch to a slow path), and every
    FMA a group's (8 a reciprocal: the Newton steps and the scale's corrections), none an element's.
    Dividing each element (``tl.div_rn(x, s)``, as the first H100 run did) put 148 divisions into the
    fused 1x128 + 128x1 quantizer's 64 elements per thread; the correctly rounded quotient without a
    division (until 2026-11-28) still took two FMA corrections an element. The INT8 quantizer's product
    stays its own instruction: with contraction on, ``x * r + 1.5 * 2^23`` would be one FMA, rounding
    the exact product to an integer where the reference rounds the rounded one."""
    by_case = {k["case"]: k for k in report["kernels"]}
    for case in ("quantize_act pow2=False", "quantize_act rows pow2=False", "quantize_act cols pow2=False",
                 "quantize_weight pow2=False", "int8 quantize_rows M=64 pow2=False"):
        k = by_case[case]
        per_thread = 128 * 128 // (32 * k["num_warps"]) if case.startswith("quantize") else None
        fp = k["sass_fp"]
        assert fp.get("FCHK", 0) == 0 and divides_without_division(k), (case, fp)
        assert "mul.rn.f32" in k["ptx_fp"], (case, sorted(set(k["ptx_fp"])))
        assert 0 < fp.get("FFMA", 0) <= 8 * fp.get("MUFU.RCP", 0), (case, fp)  # a group's work only
        if per_thread:
            assert fp.get("MUFU.RCP", 0) <= 0.7 * per_thread and fp.get("FMUL", 0) >= per_thread, (case, fp)
            # a few negations per group (the scale's residual, the Newton steps' -s), none an element's
            negations = sum(op.startswith(("neg.", "sub.")) for op in k["ptx_fp"])
            assert negations <= per_thread, (case, negations, per_thread)
        else:  # INT8: each product's rounding constant added and taken away, not taken into an FMA
            assert fp.get("FADD", 0) >= fp.get("FMUL", 0), (case, fp)
