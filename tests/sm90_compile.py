"""Compile jetrl's Triton kernels for Hopper (sm_90a) on a machine without a GPU, and report what the
compiler made of them. Run as a script (``python tests/sm90_compile.py``); prints one JSON object.

Triton compiles a kernel for the target its active driver names. Here a stand-in driver names
``cuda:90`` and every launch becomes a warm-up (compile, never run), so each kernel is compiled
through jetrl's own wrappers, with the argument specialisations (``== 1``, divisibility by 16) that
real calls at these shapes produce. Triton's NVIDIA backend ships ptxas and cuobjdump, so nothing
here needs a GPU or a CUDA install. For each compiled kernel the report gives:

- ``reg``, ``stack`` (bytes of per-thread stack: register spills): from ``cuobjdump -res-usage`` on
  the cubin Triton built; ``shared``: the dynamic shared memory Triton asks for at launch;
- ``ptx_fp``: the floating-point instructions of the PTX, in program order;
- ``sass_fp``: the floating-point instructions of the SASS (the machine code), as a multiset.

The batch-invariant kernels promise that a row's bits do not depend on how many rows a call has or
on the key width. Triton still specialises integer arguments by value (``== 1``, ``% 16 == 0``), so a
decode step and the trainer's forward can run two compilations of one kernel; the test compares
their floating-point instructions (``tests/test_kernels_sm90.py``).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

_PTX_FP = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?((?:add|sub|mul|fma|div|rcp|sqrt|rsqrt|ex2|lg2|max|min|neg|abs|cvt|mma|"
    r"wgmma\.mma_async|tanh)\.[\w.:]*(?:f32|bf16|f16|e4m3|e5m2|f64)[\w.:]*)")
_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_SASS_FP = ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "HGMMA", "QGMMA", "HMMA", "F2F", "F2FP", "FSETP", "FSEL",
            "FCHK", "FFMA2", "FMUL2", "FADD2")


def ptx_fp(ptx: str) -> list[str]:
    return [m.group(1) for line in ptx.splitlines() if (m := _PTX_FP.match(line))]


_PTX_MMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:wgmma\.mma_async|mma)\.[\w.:]*)")
_PTX_F32_CONST = re.compile(r"\b0f[0-9A-F]{8}\b")


def ptx_mma(ptx: str) -> list[str]:
    """The tensor-core instructions of the PTX (each kind once), integer ones included."""
    return sorted({m.group(1) for line in ptx.splitlines() if (m := _PTX_MMA.match(line))})


_PTX_FMA_ONE = re.compile(r"^\s*(?:@!?%p\d+\s+)?fma\.rn\.f32\s+%r\d+, %r\d+, %r\d+, 0f3F800000;", re.M)


def ptx_fma_plus_one(ptx: str) -> int:
    """How many ``fma.rn.f32 d, a, b, 1.0`` the PTX has: ``1 + a * b`` contracted into one rounding."""
    return len(_PTX_FMA_ONE.findall(ptx))


_PTX_MEM = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:atom|red|ld\.global\.cg|st\.global)[\w.:]*)")


def ptx_memory_ops(ptx: str) -> list[str]:
    """The PTX's atomics, L2-only (``.cg``) loads and global stores, each kind once: a fused split-K's
    arrival count and its reads of the other programs' partials."""
    return sorted({m.group(1) for line in ptx.splitlines() if (m := _PTX_MEM.match(line))})


def ptx_f32_consts(ptx: str) -> list[str]:
    """The fp32 immediates of the PTX (``0f4B400000`` is 1.5 * 2^23), each once."""
    return sorted(set(_PTX_F32_CONST.findall(ptx)))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(NVIDIA_BIN, "cuobjdump"), flag, f.name], capture_output=True,
                              text=True, check=True).stdout


def sass_fp(cubin: bytes) -> dict[str, int]:
    ops = (m.group(1) for line in _cuobjdump(cubin, "-sass").splitlines() if (m := _SASS_OP.search(line)))
    return dict(collections.Counter(o for o in ops if o.split(".")[0] in _SASS_FP))


def sass_counts(cubin: bytes) -> dict:
    """``{"total": instructions, "shared": {shared-memory load/store mnemonic: count}, "global": {global
    load/store mnemonic: count}}`` of the SASS."""
    ops = [m.group(1) for line in _cuobjdump(cubin, "-sass").splitlines() if (m := _SASS_OP.search(line))]
    shared = collections.Counter(o for o in ops if o.split(".")[0] in ("LDS", "STS", "LDSM", "STSM"))
    glob = collections.Counter(o for o in ops if o.split(".")[0] in ("LDG", "STG"))
    return {"total": len(ops), "shared": dict(shared), "global": dict(glob)}


def resources(cubin: bytes) -> dict[str, int]:
    out = _cuobjdump(cubin, "-res-usage")
    return {k.lower(): int(re.search(rf"\b{k}:(\d+)", out).group(1)) for k in ("REG", "STACK")}


class _Hopper:
    """The stand-in driver: device 0 of a cuda:90 target, stream 0. Nothing is launched."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _install() -> list:
    """Every launch compiles for sm_90 and is recorded as (case, group, kernel name, compiled)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Hopper())
    record, run = [], JITFunction.run
    current = {}

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        record.append((current["case"], current["group"], self.fn.__name__, kernel))

    JITFunction.run = compile_only
    return record, current


def _qtensor(rows: int, k: int, block_rows: int):
    from jetrl_cli.precision.formats import Block, Format
    from jetrl_cli.precision.quant import CastSpec, QTensor

    data = torch.zeros(rows, k, dtype=torch.float8_e4m3fn)
    gk = triton.cdiv(k, 128)
    # 1x128: (rows, gk) column-major, as the activation quantizer writes it; 128x128: row-major blocks
    scale = torch.ones(gk, rows).t() if block_rows == 1 else torch.ones(triton.cdiv(rows, 128), gk)
    return QTensor(data, scale, CastSpec(Format.FP8_E4M3, Block(block_rows, 128), False, 1e-12))


def _split(warps: int, fn):
    """``fn()`` with the SwiGLU backward as its two kernels at ``warps`` warps."""
    from jetrl_cli.kernels import fp8

    with fp8.tile_warps(warps, one_kernel=False):
        return fn()


def _words(fn, way: str = "triton"):
    """``fn()`` with W^T's bytes moved by the word-transposing kernel in the tile order ``way`` (a GPU's
    timed choice)."""
    from jetrl_cli.kernels import fp8

    with fp8.transpose_with(way):
        return fn()


def cases():
    """(case, group, call): each group holds calls that must compile to the same arithmetic."""
    from jetrl_cli.kernels import attention, fp8, int8, invariant, sampling
    from jetrl_cli.precision.formats import Block, Format
    from jetrl_cli.precision.quant import CastSpec, QTensor

    invariant._check_device = lambda *a, **k: None  # CPU tensors stand in for CUDA ones (never read)
    attention._check_device = lambda *a, **k: None
    sampling._check_device = lambda *a, **k: None
    bf = torch.bfloat16
    hidden, inter, vocab = 1536, 8960, 151936  # Qwen2.5-1.5B
    b, heads, kv_heads, d = 4, 12, 2, 128
    out = []
    for pow2 in (False, True):
        x = torch.zeros(4096, hidden, dtype=bf)
        out.append((f"quantize_act pow2={pow2}", None, lambda x=x, p=pow2: fp8.quantize_act(x, pow2_scale=p, pad_tokens_to=128)))
        out.append((f"quantize_act rows pow2={pow2}", None, lambda x=x, p=pow2: fp8.quantize_act(x, pow2_scale=p, cols=False)))
        out.append((f"quantize_act cols pow2={pow2}", None, lambda x=x, p=pow2: fp8.quantize_act(x, pow2_scale=p, rows=False, pad_tokens_to=128)))
        w = torch.zeros(inter, hidden, dtype=bf)
        out.append((f"quantize_weight pow2={pow2}", None, lambda w=w, p=pow2: fp8.quantize_weight(w, pow2_scale=p, transposed=True)))
        gu = torch.zeros(4096, 2 * inter, dtype=bf)  # an MLP's [g, u]: down's input and the FP8 copy of gu
        out.append((f"swiglu_quantize pow2={pow2}", None, lambda gu=gu, p=pow2: fp8.swiglu_quantize(gu, pow2_scale=p, save=True)))
        out.append((f"swiglu_quantize_t pow2={pow2}", None, lambda p=pow2: fp8.swiglu_quantize_t(
            _qtensor(4096, 2 * inter, 1), bf, pow2_scale=p, pad_tokens_to=128)))
        out.append((f"swiglu_grad_quantize pow2={pow2}", None, lambda p=pow2: fp8.swiglu_grad_quantize(
            _qtensor(4096, 2 * inter, 1), torch.zeros(4096, inter, dtype=bf), bf, pow2_scale=p, pad_tokens_to=128)))
        out.append((f"swiglu_grad_quantize h_cols pow2={pow2}", None, lambda p=pow2: fp8.swiglu_grad_quantize(
            _qtensor(4096, 2 * inter, 1), torch.zeros(4096, inter, dtype=bf), bf, pow2_scale=p, pad_tokens_to=128,
            h_cols=True)))
        for w in (4, 8, 16):  # its two kernels of small tiles (a GPU's timed choice)
            out.append((f"swiglu_grad_quantize split {w} warps pow2={pow2}", None, lambda p=pow2, w=w: _split(
                w, lambda: fp8.swiglu_grad_quantize(_qtensor(4096, 2 * inter, 1), torch.zeros(4096, inter, dtype=bf), bf,
                                                    pow2_scale=p, pad_tokens_to=128, h_cols=True))))
        res, wn = torch.zeros(4096, hidden), torch.ones(hidden)  # fp32 residual stream, bf16 attention output
        out.append((f"rms_norm_quantize train pow2={pow2}", None, lambda r=res, p=pow2: fp8.rms_norm_quantize(
            r, r.to(bf), wn, 1e-6, torch.float32, pow2_scale=p, write_y=True, rsqrt=True)))
        out.append((f"rms_norm_quantize decode pow2={pow2}", None, lambda r=res[:64], p=pow2: fp8.rms_norm_quantize(
            r, None, wn, 1e-6, torch.float32, pow2_scale=p)))
    out.append(("rms_norm_quantize decode 8B", None, lambda: fp8.rms_norm_quantize(  # 4096 wide: its chunks loop
        torch.zeros(64, 4096), None, torch.ones(4096), 1e-6, torch.float32)))
    out.append(("weight transpose words", None, lambda: _words(lambda: fp8.quantize_weight(
        torch.zeros(inter, hidden), transposed=True))))
    for way in ("triton-n-first", "triton-diagonal"):  # the kernel's other tile orders
        out.append((f"weight transpose words {way}", None, lambda way=way: _words(lambda: fp8.transpose_bytes_(
            torch.zeros(hidden, inter, dtype=torch.uint8), torch.zeros(inter, hidden, dtype=torch.uint8)), way)))

    def model_weights():  # a layer's four groups of fp32 masters in one call, W^T by the word transpose
        qkv = [torch.zeros(n, hidden) for n in (hidden, 256, 256)]
        groups = [qkv, [torch.zeros(hidden, hidden)], [torch.zeros(inter, hidden)] * 2, [torch.zeros(hidden, inter)]]
        with fp8.transpose_with("triton"):
            fp8.quantize_weight_stacks(groups, transposed=True)

    out.append(("quantize_weight_stacks model", None, model_weights))

    def model_weights_wt():  # the same, W^T written by the quantizer
        qkv = [torch.zeros(n, hidden) for n in (hidden, 256, 256)]
        groups = [qkv, [torch.zeros(hidden, hidden)], [torch.zeros(inter, hidden)] * 2, [torch.zeros(hidden, inter)]]
        with fp8.wt_with("quantizer"):
            fp8.quantize_weight_stacks(groups, transposed=True)

    out.append(("quantize_weight_stacks model, W^T in the quantizer", None, model_weights_wt))
    for pow2 in (False, True):  # INT8 rollout: per-token activations (bf16), per-channel weights (fp32 masters)
        spec = CastSpec(Format.INT8, Block(1, 0), pow2)
        for m in (1, 64, 4096):
            out.append((f"int8 quantize_rows M={m} pow2={pow2}", None, lambda m=m, spec=spec: int8.quantize_rows(
                torch.zeros(m, hidden, dtype=bf), spec)))
        out.append((f"int8 quantize_rows weight pow2={pow2}", None, lambda spec=spec: int8.quantize_rows(
            torch.zeros(hidden, inter), spec)))

    def int8_op(rows, k):
        return QTensor(torch.zeros(rows, k, dtype=torch.int8), torch.ones(rows, 1), CastSpec(Format.INT8, Block(1, 0)))

    for m in (1, 7, 64, 4096):
        out.append((f"int8_mm M={m}", None, lambda m=m: int8.int8_mm(int8_op(m, hidden), int8_op(inter, hidden),
                                                                     out_dtype=bf)))
    for m in (1, 32):  # a decode step's swapped INT8 GEMMs (b @ a.T): q/k/v with its bias, down_proj split
        out.append((f"swapped int8_mm M={m} bias", None, lambda m=m: int8.int8_mm(
            int8_op(m, hidden), int8_op(2048, hidden), out_dtype=bf, bias=torch.zeros(2048, dtype=bf), split=1,
            swap=True)))
        out.append((f"swapped split-K int8_mm M={m} N=1536", None, lambda m=m: int8.int8_mm(
            int8_op(m, inter), int8_op(hidden, inter), out_dtype=bf, split=4, swap=True)))
    for i, t in enumerate(fp8.MID_TILES["int8"]):  # a wide decode step's timed candidates (down_proj, split 2)
        out.append((f"mid int8_mm M=256 tiles {i}", None, lambda t=t: int8.int8_mm(
            int8_op(256, inter), int8_op(hidden, inter), out_dtype=bf, split=2, tiles=t)))
    for i, t in enumerate(fp8.MID_TILES["fp8"]):
        out.append((f"mid blockwise_mm M=256 tiles {i}", None, lambda t=t: fp8.blockwise_mm(
            _qtensor(256, inter, 1), _qtensor(hidden, inter, 128), out_dtype=bf, split=2, tiles=t)))
    out.append(("split-K int8_mm M=32 N=1536", None, lambda: int8.int8_mm(int8_op(32, inter), int8_op(hidden, inter),
                                                                       out_dtype=bf, split=4)))
    out.append(("int8_mm M=64 N=1536", None, lambda: int8.int8_mm(int8_op(64, inter), int8_op(hidden, inter),
                                                                  out_dtype=bf)))  # down_proj: narrower tiles
    out.append(("int8 bias GEMM M=32 (q/k/v)", None, lambda: int8.int8_mm(  # the bias in the epilogue
        int8_op(32, hidden), int8_op(2048, hidden), out_dtype=bf, bias=torch.zeros(2048, dtype=bf))))
    out.append(("int8 bias GEMM M=7 fp32", None, lambda: int8.int8_mm(  # an fp32 output: a mul and an add
        int8_op(7, hidden), int8_op(2048, hidden), bias=torch.zeros(2048))))
    out.append(("split-K int8 bias GEMM M=32 fp32", None, lambda: int8.int8_mm(
        int8_op(32, inter), int8_op(hidden, inter), split=4, bias=torch.zeros(hidden))))
    spec8 = CastSpec(Format.INT8, Block(1, 0))
    res8 = torch.zeros(64, hidden)
    out.append(("int8 norm quantizer decode", None, lambda: int8.rms_norm_quantize(
        res8, res8.to(bf), torch.ones(hidden), 1e-6, bf, spec8.format)))
    out.append(("int8 swiglu quantizer decode", None, lambda: int8.swiglu_quantize(
        torch.zeros(64, 2 * inter, dtype=bf))))
    out.append(("blockwise_mm M=64 N=1536", None, lambda: fp8.blockwise_mm(  # down_proj: narrower tiles
        _qtensor(64, inter, 1), _qtensor(hidden, inter, 128), out_dtype=bf)))
    out.append(("split-K blockwise_mm M=32 N=1536 bias", None, lambda: fp8.blockwise_mm(  # down_proj, 4 splits
        _qtensor(32, inter, 1), _qtensor(hidden, inter, 128), out_dtype=bf, bias=torch.zeros(hidden, dtype=bf),
        split=4)))
    out.append(("split-K blockwise_mm M=32 N=1536 bias fused", None, lambda: fp8.blockwise_mm(  # its partials summed
        _qtensor(32, inter, 1), _qtensor(hidden, inter, 128), out_dtype=bf, bias=torch.zeros(hidden, dtype=bf),
        split=4, fused=True)))  # by each tile's last program
    for m in (1, 32, 64):  # a decode step's swapped GEMMs (b @ a.T): q/k/v with its bias, down_proj split
        out.append((f"swapped blockwise_mm M={m} bias", None, lambda m=m: fp8.blockwise_mm(
            _qtensor(m, hidden, 1), _qtensor(2048, hidden, 128), out_dtype=bf, bias=torch.zeros(2048, dtype=bf),
            split=1, swap=True)))
        out.append((f"swapped split-K blockwise_mm M={m} N=1536 fused", None, lambda m=m: fp8.blockwise_mm(
            _qtensor(m, inter, 1), _qtensor(hidden, inter, 128), out_dtype=bf, split=4, fused=True, swap=True)))
    out.append(("blockwise_mm M=7 bias", None, lambda: fp8.blockwise_mm(  # q/k/v with Qwen's biases, in the epilogue
        _qtensor(7, hidden, 1), _qtensor(2048, hidden, 128), out_dtype=bf, bias=torch.zeros(2048, dtype=bf))))
    for m in (1, 7, 64, 4096):  # decode (one row, a few), prefill, training
        out.append((f"blockwise_mm M={m}", None, lambda m=m: fp8.blockwise_mm(
            _qtensor(m, hidden, 1), _qtensor(inter, hidden, 128), out_dtype=bf)))
        # the GEMMs in each of their two launch modes (K in 3 chunks here), forced at every M: one
        # arithmetic per mode whatever M (split mode: the chunks' kernel and the sum of the chunks)
        for mode in ("chunked", "split"):
            sfx = "" if mode == "chunked" else " split"
            out.append((f"invariant_blockwise_mm{sfx} M={m}", f"invariant_blockwise_mm{sfx}",
                        lambda m=m, mode=mode: invariant.invariant_blockwise_mm(
                            _qtensor(m, hidden, 1), _qtensor(inter, hidden, 128), out_dtype=bf, _mode=mode)))
            out.append((f"invariant_mm bf16{sfx} M={m}", f"invariant_mm bf16{sfx}", lambda m=m, mode=mode:
                        invariant.invariant_mm(torch.zeros(m, hidden, dtype=bf), torch.zeros(inter, hidden, dtype=bf),
                                               out_dtype=bf, _mode=mode)))
            out.append((f"invariant_mm fp32{sfx} M={m}", f"invariant_mm fp32{sfx}", lambda m=m, mode=mode:
                        invariant.invariant_mm(torch.zeros(m, hidden), torch.zeros(256, hidden), _mode=mode)))
        # split mode with the chunks' sum in the GEMM (each tile's last program: one kernel)
        out.append((f"invariant_blockwise_mm split fused M={m}", "invariant_blockwise_mm split fused",
                    lambda m=m: invariant.invariant_blockwise_mm(_qtensor(m, hidden, 1), _qtensor(inter, hidden, 128),
                                                                 out_dtype=bf, _mode="split", _fused=True)))
        out.append((f"invariant_mm bf16 split fused M={m}", "invariant_mm bf16 split fused", lambda m=m:
                    invariant.invariant_mm(torch.zeros(m, hidden, dtype=bf), torch.zeros(inter, hidden, dtype=bf),
                                           out_dtype=bf, _mode="split", _fused=True)))
        if m != 7:  # gate/up (N = 2 x 8960): K in one chunk, the unsplit kernel at every M
            out.append((f"invariant_blockwise_mm whole M={m}", "invariant_blockwise_mm whole", lambda m=m:
                        invariant.invariant_blockwise_mm(_qtensor(m, hidden, 1), _qtensor(2 * inter, hidden, 128),
                                                         out_dtype=bf)))
            out.append((f"invariant_mm bf16 whole M={m}", "invariant_mm bf16 whole", lambda m=m: invariant.invariant_mm(
                torch.zeros(m, hidden, dtype=bf), torch.zeros(2 * inter, hidden, dtype=bf), out_dtype=bf)))
        out.append((f"invariant_rms_norm M={m}", "invariant_rms_norm", lambda m=m: invariant.invariant_rms_norm(
            torch.zeros(m, hidden, dtype=bf), torch.ones(hidden), 1e-6)))
        out.append((f"invariant_add_rms_norm M={m}", "invariant_add_rms_norm", lambda m=m: invariant.invariant_add_rms_norm(
            torch.zeros(m, hidden), torch.zeros(m, hidden, dtype=bf), torch.ones(hidden), 1e-6, bf)))
        out.append((f"invariant_log_softmax M={m}", "invariant_log_softmax", lambda m=m: invariant.invariant_log_softmax(
            torch.zeros(m, vocab, dtype=bf))))
    out.append(("invariant_blockwise_mm down_proj M=32 bias", None, lambda: invariant.invariant_blockwise_mm(
        _qtensor(32, inter, 1), _qtensor(hidden, inter, 128), torch.zeros(hidden, dtype=bf), out_dtype=bf)))
    out.append(("invariant_mm bf16 down_proj M=32 bias", None, lambda: invariant.invariant_mm(  # automatic: split
        torch.zeros(32, inter, dtype=bf), torch.zeros(hidden, inter, dtype=bf), torch.zeros(hidden, dtype=bf),
        out_dtype=bf)))
    cache = torch.zeros(b, kv_heads, 1024, d, dtype=bf)  # a KV cache: (b, kv heads, capacity, d), read up to a width

    def att(t, width, contiguous=False, dtype=bf):
        q = torch.zeros(b, heads, t, d, dtype=dtype) if contiguous else torch.zeros(b, t, heads, d, dtype=dtype).transpose(1, 2)
        if t == 1:  # a decode step: one query per sequence at position width - 1, keys from the cache
            kv = cache.to(dtype)[:, :, :width]
            return lambda: invariant.invariant_attention(q, kv, kv, torch.full((b, 1), width - 1), check_positions=False)
        kv = torch.zeros(b, t, kv_heads, d, dtype=dtype).transpose(1, 2)
        return lambda: invariant.invariant_attention(q, kv, kv, check_positions=False)

    for t, width in ((512, 512), (37, 37)):  # training, prefill
        out.append((f"invariant_attention t={t}", "invariant_attention bf16", att(t, width)))
    for width in (300, 1024, 1):
        out.append((f"invariant_attention decode w={width}", "invariant_attention bf16", att(1, width)))
    out.append(("invariant_attention decode contiguous q", "invariant_attention bf16", att(1, 300, contiguous=True)))
    cache8 = torch.zeros(b, kv_heads, 1024, d, dtype=torch.float8_e4m3fn)  # an FP8 cache and its scales
    scales8 = torch.ones(b, kv_heads, 1024)
    for width in (300, 1024, 1):  # decode steps over an FP8 cache read as stored
        q1 = torch.zeros(b, 1, heads, d, dtype=bf).transpose(1, 2)
        kv8, s8 = cache8[:, :, :width], scales8[:, :, :width]
        out.append((f"invariant_attention fp8 cache decode w={width}", "invariant_attention fp8 cache",
                    lambda q1=q1, kv8=kv8, s8=s8, w=width: invariant.invariant_attention(
                        q1, kv8, kv8, torch.full((b, 1), w - 1), check_positions=False, kv_scales=(s8, s8))))
        out.append((f"decode_attention fp8 cache w={width}", None, lambda q1=q1, kv8=kv8, s8=s8, w=width:
                    attention.decode_attention(q1, kv8, kv8, torch.full((b,), w - 1), kv_scales=(s8, s8))))
        out.append((f"decode_attention bf16 cache w={width}", None, lambda q1=q1, w=width:
                    attention.decode_attention(q1, cache[:, :, :w], cache[:, :, :w], torch.full((b,), w - 1))))
    o_spec = CastSpec(Format.FP8_E4M3, Block(1, 128))  # o_proj's input, written by the attention kernel
    q1 = torch.zeros(b, 1, heads, d, dtype=bf).transpose(1, 2)
    for width in (300, 1024, 1):  # a batch-invariant decode step writing o_proj's input, bf16 and FP8 caches
        out.append((f"invariant_attention decode w={width} fp8 out", "invariant_attention bf16 fp8 out",
                    lambda w=width: invariant.invariant_attention(q1, cache[:, :, :w], cache[:, :, :w],
                                                                  torch.full((b, 1), w - 1), check_positions=False,
                                                                  quantize_out=o_spec)))
        out.append((f"invariant_attention fp8 cache decode w={width} fp8 out", "invariant_attention fp8 cache fp8 out",
                    lambda w=width: invariant.invariant_attention(
                        q1, cache8[:, :, :w], cache8[:, :, :w], torch.full((b, 1), w - 1), check_positions=False,
                        kv_scales=(scales8[:, :, :w], scales8[:, :, :w]), quantize_out=o_spec)))
    out.append(("decode_attention fp8 cache w=1024 fp8 out", None, lambda q1=q1: attention.decode_attention(
        q1, cache8, cache8, torch.full((b,), 1023), kv_scales=(scales8, scales8), quantize_out=o_spec)))
    kv_spec = CastSpec(Format.FP8_E4M3, Block.parse("row"))
    for dtype in (torch.float32, bf):  # a decode step's keys (RoPE's fp32) and values (the GEMM's bf16) into the cache
        x = torch.zeros(b, 1, kv_heads, d, dtype=dtype).transpose(1, 2)
        out.append((f"kv_store {str(dtype)[6:]}", None, lambda x=x: attention.kv_store(
            x, torch.arange(b * kv_heads), cache8[:, :, :2].reshape(-1, d)[:b * kv_heads * 2].contiguous(),
            torch.ones(b * kv_heads * 2), kv_spec)))
    xt = torch.zeros(b, 64, kv_heads, d).transpose(1, 2)  # the trainer's fp32 keys, rows in order into a scratch copy
    out.append(("kv_store rows in order", None, lambda: attention.kv_store(
        xt, None, torch.zeros(b * kv_heads * 64, d, dtype=torch.float8_e4m3fn), torch.ones(b * kv_heads * 64), kv_spec)))
    out.append(("invariant_attention fp32 t=512", "invariant_attention fp32", att(512, 512, dtype=torch.float32)))
    for width in (300, 1024):
        out.append((f"invariant_attention fp32 decode w={width}", "invariant_attention fp32", att(1, width, dtype=torch.float32)))
    # a batch-invariant forward's RoPE and SwiGLU chains, one kernel each: decode, prefill, training
    angles = torch.zeros(4096, d)
    for t in (1, 37, 512):
        qk = torch.zeros(b, t, heads + 2 * kv_heads, d, dtype=bf).split((heads + kv_heads, kv_heads), 2)[0].transpose(1, 2)
        cs = angles[torch.zeros(b, t, dtype=torch.long)][:, None]
        out.append((f"exact_rope t={t}", "exact_rope", lambda qk=qk, cs=cs: invariant.exact_rope(qk, cs, cs, heads, bf, bf)))
    for m in (1, 32, 4096):
        out.append((f"exact_swiglu M={m}", "exact_swiglu", lambda m=m: invariant.exact_swiglu(
            torch.zeros(m, 2 * inter, dtype=bf))))
    # the FP8 quantizers a batch-invariant forward takes where a norm, the SwiGLU or attention feeds a GEMM:
    # decode steps, prefill and training (the norm's training form writes y and the rsqrt as well)
    res, delta, wn = torch.zeros(4096, hidden), torch.zeros(4096, hidden, dtype=bf), torch.ones(hidden)
    for m in (1, 7, 64):
        out.append((f"rms_norm_quantize M={m}", "fp8 rms_norm_quantize", lambda m=m: fp8.rms_norm_quantize(
            res[:m], delta[:m], wn, 1e-6, torch.float32)))
    for m in (7, 512, 4096):
        out.append((f"rms_norm_quantize train M={m}", "fp8 rms_norm_quantize train", lambda m=m: fp8.rms_norm_quantize(
            res[:m], delta[:m], wn, 1e-6, torch.float32, write_y=True, rsqrt=True)))
    gu = torch.zeros(4096, 2 * inter, dtype=bf)
    for m in (1, 32, 4096):
        out.append((f"swiglu_quantize M={m}", "fp8 swiglu_quantize", lambda m=m: fp8.swiglu_quantize(gu[:m])))
        out.append((f"quantize_act rows M={m}", "fp8 quantize_act rows", lambda m=m: fp8.quantize_act(
            delta[:m], cols=False)))
    for m in (7, 512, 4096):
        out.append((f"swiglu_quantize save M={m}", "fp8 swiglu_quantize save", lambda m=m: fp8.swiglu_quantize(
            gu[:m], save=True)))
    # a rollout step's keyed Gumbel-max: 512 rows of a 152K vocabulary
    out.append(("keyed_gumbel_argmax", None, lambda: sampling.keyed_gumbel_argmax(
        torch.zeros(512, vocab), torch.zeros(512, dtype=torch.int64), 12345)))
    return out


def control():
    """A negative control for the comparison: the attention kernel at another key block (a different
    summation order) must not compare equal to the shipped one."""
    from jetrl_cli.kernels import invariant

    q = torch.zeros(4, 12, 64, 128, dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 64, 128, dtype=torch.bfloat16)
    shipped = invariant.ATT_BLOCK_N
    invariant.ATT_BLOCK_N = shipped // 2
    try:
        invariant.invariant_attention(q, kv, kv, check_positions=False)
    finally:
        invariant.ATT_BLOCK_N = shipped


def main() -> dict:
    sys.path.insert(0, ROOT)
    try:
        record, current = _install()
    except (ImportError, AttributeError) as e:  # Triton's internals moved: say so, the test skips
        return {"unsupported": f"this Triton ({triton.__version__}) cannot be driven offline: {e!r}"}
    failures = {}
    for case, group, call in [*cases(), ("control: attention BLOCK_N/2", "control", control)]:
        current.update(case=case, group=group)
        try:
            call()
        except Exception as e:  # noqa: BLE001 - reported per case
            failures[case] = f"{type(e).__name__}: {str(e)[-2000:]}"
    kernels = []
    for case, group, name, k in record:
        kernels.append(dict(case=case, group=group, kernel=name, hash=k.hash, num_warps=k.metadata.num_warps,
                            shared=k.metadata.shared,
                            **resources(k.asm["cubin"]), ptx_fp=ptx_fp(k.asm["ptx"]), sass_fp=sass_fp(k.asm["cubin"]),
                            sass=sass_counts(k.asm["cubin"]),
                            ptx_mma=ptx_mma(k.asm["ptx"]), ptx_f32_consts=ptx_f32_consts(k.asm["ptx"]),
                            ptx_fma_plus_one=ptx_fma_plus_one(k.asm["ptx"]), ptx_mem=ptx_memory_ops(k.asm["ptx"]),
                            layout_conversions=k.asm["ttgir"].count("ttg.convert_layout"),
                            barriers=len(re.findall(r"\bbar\.sync\b", k.asm["ptx"]))))
    return {"triton": triton.__version__, "torch": torch.__version__, "failures": failures, "kernels": kernels}


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
