"""A Llama-family causal LM in plain PyTorch (Llama, Qwen2, Mistral, SmolLM layouts).

Module and parameter names follow Hugging Face's (``model.layers.3.self_attn.q_proj`` ...), so a
HF safetensors state dict loads as is and the precision flow's skip list means the same thing
here, in vLLM and in transformers. Every linear layer is a ``JetLinear``: fp32 until a flow is
applied (``apply_flow``), then in the flow's precision. Layers reading one input (q/k/v, gate/up)
run as one group (``linear_group``: one input cast, one GEMM), in training and in rollout alike.

Two ways to run it, one set of numerics:

- ``forward(input_ids, attention_mask)`` (or ``hidden`` then ``logits``, which lets a caller
  compute logprobs a chunk of tokens at a time): every position (training, scoring);
- ``prefill`` / ``decode`` with a ``KVCache``: what the rollout engine runs, one token at a time.

Execution. On CPU the model emulates the GPU's numerics in fp32 (see ``precision/gemm.py``), and
every op is computed so that a token's result does not depend on how many other rows are in the
batch or on whether it was computed in a full forward or in a decode step, on any CPU: every
forward GEMM -- the linear layers' and attention's ``q @ k^T`` and ``p @ v`` -- is exact per K
group (``exact_mm``, ``exact_scores``, ``exact_pv``: fixed-point operands whose group dot products
float64 holds exactly, so no BLAS's summation order can show), attention runs over a key width
that is a multiple of ``KEY_CHUNK`` with each sequence stored from index 0 (keys past a sequence's
end get probability exactly 0), and the row-local ops (RMSNorm, softmax, SiLU, RoPE) avoid kernels
whose vectorised and scalar paths round differently. That is what lets the rollout's logprobs
equal the trainer's bit for bit when both run the same precision (``tests/test_invariance.py``,
``tests/test_engine.py``).

On CUDA it runs natively: the residual stream, norms and RoPE in fp32 (as under bf16 autocast),
GEMMs on bf16 (or FP8) operands writing bf16, attention through
``scaled_dot_product_attention`` (flash for training and prefill) on bf16 queries, keys and
values, and a bf16 KV cache. Decode steps can read the cache as stored in a Triton kernel
(``kernels.attention``; an FP8 cache as its bytes and per-token scales, saving bandwidth as well as
memory) where that is faster than SDPA, timed once per device. The formats are the flow's on both
devices.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..precision import fuse
from ..precision.flow import LinearPrecision
from ..precision.formats import Block, Format
from ..precision.fuse import fused
from ..precision.gemm import (F64_BITS, device_time_ms, fixed_point, fp8_kernels_for, kernel_choice, native,
                              note_kernel)
from ..precision.linear import (JetLinear, RowGradSlot, fused_input_quantizer, gated_mlp, grad_sink,
                                gradient_port, group_weight, has_adapter, input_dtype, linear_group,
                                sink_overwrites)
from ..precision.quant import CastSpec, QTensor, dequantize, fake_quantize, quantize, round_to


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only llama3-style scaling is supported
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2: always)
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen3)


FP32_LINEAR = LinearPrecision.unquantized(Format.FP32)


def Linear(in_features: int, out_features: int, bias: bool = True) -> JetLinear:
    """A linear layer in fp32 (``nn.Linear``'s initialisation) until a flow sets its precision."""
    lin = nn.Linear(in_features, out_features, bias=bias)
    return JetLinear(lin.weight, lin.bias, FP32_LINEAR)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    invariant = False  # set by the model: the batch-invariant kernel on a GPU

    def forward(self, x: torch.Tensor, out: torch.dtype | None = None) -> torch.Tensor:
        """RMSNorm of ``x``; with autograd, in ``out`` when given (see ``add_forward``)."""
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFn.apply(x, self.weight, self.eps, self.invariant and native(x), out)
        if self.invariant and native(x):
            from ..kernels.invariant import invariant_rms_norm

            return invariant_rms_norm(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)[0]

    def tracks(self, x: torch.Tensor, delta: torch.Tensor | None) -> bool:
        """Whether autograd records this norm of ``x + delta``."""
        return torch.is_grad_enabled() and (
            x.requires_grad or self.weight.requires_grad or delta is not None and delta.requires_grad)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None, out: torch.dtype | None) -> tuple:
        """``(s, norm(s))`` with ``s = x + delta`` (a residual connection, then this norm; ``s = x``
        without ``delta``), the norm's output in ``out`` if given: the dtype its consumer casts it to
        (``input_dtype``). One function, so on a GPU one kernel in place of three (add, norm, cast),
        with the values of ``forward(x + delta).to(out)``; with autograd its backward is one function
        too (``_AddRMSNormFn``), except in a batch-invariant forward (op by op)."""
        grad = self.tracks(x, delta)
        invariant = self.invariant and native(x)
        if invariant and delta is not None:  # the batch-invariant kernel: add, norm and cast in one
            if grad:
                return _AddRMSNormFn.apply(x, delta, self.weight, self.eps, out, True)
            from ..kernels.invariant import invariant_add_rms_norm

            return invariant_add_rms_norm(x, delta, self.weight, self.eps,
                                          out or torch.promote_types(x.dtype, delta.dtype))
        if grad and delta is not None:  # the same function, and one for its backward
            return _AddRMSNormFn.apply(x, delta, self.weight, self.eps, out or x.dtype)
        if grad or invariant:
            s = x if delta is None else x + delta
            return s, self.forward(s, out)
        return _add_rms_norm(x, delta, self.weight, self.eps, out or x.dtype)


def _rms_norm_math(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf, r = _rms_rsqrt(x, eps)
    wf = w if w.dtype in _WIDE else w.float()
    y = xf * r * wf
    return (y if y.dtype is x.dtype else y.to(x.dtype)), r


@fused
def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * rsqrt(mean(x^2) + eps) * w`` in fp32 (mean as a sum, then a division: F.rms_norm's own
    ops, without its dtype checks and copies); returns the output and rsqrt. One kernel on a GPU
    (``precision.fuse``)."""
    return _rms_norm_math(x, w, eps)


@fused
def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float,
                  out: torch.dtype, with_rsqrt: bool = False) -> tuple:
    """``s = x + delta`` and ``_rms_norm(s)`` rounded to ``out`` (what a consumer that casts its
    input to ``out`` would make of it: the same bits, with no cast of its own); ``with_rsqrt``: and
    the per-row rsqrt, for a backward."""
    s = x if delta is None else x + delta
    y, r = _rms_norm_math(s, w, eps)
    return (s, _as(y, out), r) if with_rsqrt else (s, _as(y, out))


_WIDE = (torch.float32, torch.float64)  # fp64 only in gradient checks


def _rms_rsqrt(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in fp32 (or fp64) and its per-row ``rsqrt(mean(x^2) + eps)``."""
    xf = x if x.dtype in _WIDE else x.float()
    ms = (xf * xf).sum(-1, keepdim=True).div_(x.shape[-1])
    return xf, torch.rsqrt(ms.add_(eps))


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm whose backward keeps only its input and the per-row rsqrt (autograd would keep
    two more activation-sized tensors); the forward is ``_rms_norm``, bit for bit."""

    @staticmethod
    def forward(ctx, x, w, eps, invariant=False, out=None):
        if invariant:  # the forward's bits from the batch-invariant kernel (rsqrt kept for the backward)
            from ..kernels.invariant import invariant_rms_norm

            y, r = invariant_rms_norm(x, w, eps), _rms_rsqrt(x, eps)[1]
        elif out is not None and out is not x.dtype:  # written in its consumer's dtype: one kernel, no cast
            _, y, r = _add_rms_norm(x, None, w, eps, out, True)
        else:
            y, r = _rms_norm(x, w, eps)
        ctx.save_for_backward(x, w, r)
        return y if out is None else _as(y, out)

    @staticmethod
    def backward(ctx, gy):
        x, w, r = ctx.saved_tensors
        gx, gw = _rms_norm_grads(x, w, r, gy, ctx.needs_input_grad[1])
        return gx, gw, None, None, None


class _AddRMSNormFn(torch.autograd.Function):
    """``s = x + delta`` (a residual connection) and RMSNorm(s) in ``out``: the rollout's
    ``_add_rms_norm``, bit for bit, with a backward that is one function too (``_add_rms_norm_grads``:
    the norm's input gradient, plus the residual's gradient of ``s``, and that sum in delta's dtype),
    where autograd ran the norm's backward, an add of the two gradients of ``s`` and a cast for
    delta: on a GPU one kernel for three, in the forward one for two. Keeps ``s``, the weight and
    the per-row rsqrt, as ``_RMSNormFn``. ``invariant``: the forward is the batch-invariant kernel's
    (``kernels.invariant.invariant_add_rms_norm``, the rollout's in that mode too)."""

    @staticmethod
    def forward(ctx, x, delta, w, eps, out, invariant=False):
        if invariant:  # the batch-invariant kernel's bits (out None: s's dtype)
            from ..kernels.invariant import invariant_add_rms_norm

            s, y, r = invariant_add_rms_norm(x, delta, w, eps, out or torch.promote_types(x.dtype, delta.dtype),
                                             rsqrt=True)
        else:
            s, y, r = _add_rms_norm(x, delta, w, eps, out, True)
        ctx.save_for_backward(s, w, r)
        ctx.dtypes = (x.dtype, delta.dtype)
        return s, y

    @staticmethod
    def backward(ctx, gs, gy):
        return (*_add_norm_backward(ctx, gs, gy), None)


def _add_norm_backward(ctx, gs, gy) -> tuple:
    """The backward of ``_AddRMSNormFn`` and ``_NormQuantFn`` (inputs x, delta, w and two more), from
    their saved ``s``, weight and per-row rsqrt and ``ctx.dtypes`` (x's, delta's or None)."""
    s, w, r = ctx.saved_tensors
    x_dtype, d_dtype = ctx.dtypes
    need = ctx.needs_input_grad
    gx, gd, gw = _add_rms_norm_grads(s, w, r, gy, gs, x_dtype, d_dtype or x_dtype, need[1], need[2])
    return gx, gd, gw, None, None


def norm_linear(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor | None, mods: tuple, owner: nn.Module,
                down: JetLinear | None = None) -> tuple:
    """``(s, linear_group(mods, norm(s)))`` with ``s = x + delta`` (``s = x`` without ``delta``): a
    residual connection, the norm after it and the linear layers that read the norm's output. With
    ``down``, ``mods`` are a gated MLP's gate and up projections and the second item is the MLP's
    output, ``gated_mlp(mods, norm(s), owner, down)``.

    Where those layers quantize their input FP8 1x128 with jetrl's Triton kernels
    (``fused_input_quantizer``), the norm's own kernel writes that operand
    (``kernels.fp8.rms_norm_quantize``): in a rollout's forward the norm's output never reaches
    memory (one kernel in place of two), and the trainer's forward takes the same kernel, writing
    the output too (the Wgrad operand is made from it), so the two agree bit for bit. In the
    batch-invariant mode too: the kernel runs one launch configuration whatever the rows (a row's sum
    of squares in one fixed order), so a row's bits do not depend on the batch; a norm whose output
    is not quantized there is ``kernels.invariant``'s."""
    def linears(h, x_op=None, x_dtype=None, x_values=None):
        if down is None:
            return linear_group(mods, h, owner, x_op=x_op, x_dtype=x_dtype, x_values=x_values)
        return gated_mlp(mods, h, owner, down, x_op=x_op, x_dtype=x_dtype, x_values=x_values)

    quant = fused_input_quantizer(mods, x)
    if quant is None:
        s, h = norm.add_forward(x, delta, input_dtype(mods, x))
        return s, linears(h)
    n = x.shape[-1]
    x2, d2 = x.reshape(-1, n), None if delta is None else delta.reshape(-1, n)
    if not norm.tracks(x, delta):
        fp8, spec = quant
        # batch-invariant: the trainer's form of the kernel (y and the rsqrt written too, unread), so the
        # rollout, the trainer's scoring and its forward with autograd run one compiled kernel
        s, _, _, rows = fp8.rms_norm_quantize(x2, d2, norm.weight, norm.eps, x.dtype, spec.format,
                                              spec.pow2_scale, spec.amax_floor, write_y=norm.invariant,
                                              rsqrt=norm.invariant)
        y = linears(None, x_op=rows, x_dtype=x.dtype)
    else:  # the norm's output h, and a port for its gradient in the GEMMs' Dgrad dtype (bf16)
        port = gradient_port(mods, x)
        *s, h, p, data, scale = _NormQuantFn.apply(x2, d2, norm.weight, norm.eps, quant, port)
        s = s[0] if s else None
        xq = QTensor(data, scale, quant[1])
        y = linears(h, x_op=xq) if port is None else linears(p, x_op=xq, x_values=h)
    return (x if s is None else s.reshape(x.shape)), y.reshape(*x.shape[:-1], y.shape[-1])


class _NormQuantFn(torch.autograd.Function):
    """``norm_linear``'s norm with autograd: ``rms_norm_quantize``'s outputs (s when there is a
    delta, then the norm's output, a gradient port for it or None, and its FP8 operand's data and
    scales, not differentiable), and the backward of ``_AddRMSNormFn`` (of ``_RMSNormFn`` without a
    delta) from s, the weight and the kernel's per-row rsqrt. With ``port`` (a dtype:
    ``linear.gradient_port``) the norm's output is not differentiable and its gradient comes back
    through the port, in that dtype (the norm's backward reads it in fp32 either way)."""

    @staticmethod
    def forward(ctx, x, delta, w, eps, quant, port):
        fp8, spec = quant
        s, y, r, rows = fp8.rms_norm_quantize(x, delta, w, eps, x.dtype, spec.format, spec.pow2_scale,
                                              spec.amax_floor, write_y=True, rsqrt=True)
        ctx.save_for_backward(x if s is None else s, w, r[:, None])
        ctx.dtypes = (x.dtype, None if delta is None else delta.dtype)
        ctx.port = port is not None
        p = None if port is None else y.new_empty((), dtype=port).expand(y.shape)
        ctx.mark_non_differentiable(rows.data, rows.scale, *([y] if ctx.port else []))
        ctx.set_materialize_grads(False)  # no zero-filled "gradients" of the FP8 operand (two kernels)
        return (y, p, rows.data, rows.scale) if s is None else (s, y, p, rows.data, rows.scale)

    @staticmethod
    def backward(ctx, *grads):
        gs, grads = (None, grads) if ctx.dtypes[1] is None else (grads[0], grads[1:])
        gy = grads[1] if ctx.port else grads[0]
        gx, gd, gw, _, _ = _add_norm_backward(ctx, gs, gy)
        return gx, gd, gw, None, None, None


@fused
def _add_rms_norm_grads(s, w, r, gy, gs, x_dtype: torch.dtype, delta_dtype: torch.dtype, with_delta: bool,
                        with_weight: bool):
    """``_AddRMSNormFn``'s gradients: RMSNorm's input gradient plus ``gs`` (the residual path's
    gradient of ``s``) for x, the same in ``delta_dtype`` for delta when ``with_delta``, and the
    weight's when ``with_weight`` (else None)."""
    gn, gw = _rms_norm_grads_math(s, w, r, gy, with_weight)
    g = gn if gs is None else gn + gs
    return _as(g, x_dtype), (_as(g, delta_dtype) if with_delta else None), gw


@fused
def _rms_norm_grads(x, w, r, gy, with_weight: bool):
    """RMSNorm's input gradient, and its weight gradient when ``with_weight`` (else None), from its
    input, weight, per-row rsqrt and output gradient."""
    return _rms_norm_grads_math(x, w, r, gy, with_weight)


def _rms_norm_grads_math(x, w, r, gy, with_weight: bool):
    xf, gyf, wf = (t.to(r.dtype) for t in (x, gy, w))
    xhat = xf * r
    gw = (gyf * xhat).reshape(-1, x.shape[-1]).sum(0).to(w.dtype) if with_weight else None
    gxhat = gyf * wf
    gx = r * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype), gw


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        lo_wl, hi_wl = old / lo, old / hi
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where((wavelen <= lo_wl) & (wavelen >= hi_wl), mid, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``; ``sin`` comes with the sign of rotate_half folded in."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin  # roll by half: [x2, x1]


@fused
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: int, q_dtype: torch.dtype,
          k_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope`` on ``x`` in fp32 (queries and keys in one pass: its first ``h`` heads are the
    queries), returned as (queries in ``q_dtype``, keys in ``k_dtype``): bf16 where attention (or
    the KV cache) reads bf16, so on a GPU the rounding is in the same kernel, not one more (the same
    bits: rounding an fp32 value to bf16 is one operation wherever it runs)."""
    y = apply_rope(_as(x, torch.float32), cos, sin)
    q, k = y.split((h, y.shape[1] - h), dim=1)
    return _as(q, q_dtype), _as(k, k_dtype)


def split_rope(qkv: torch.Tensor, h: int, hk: int, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
               contiguous_v: bool = False,
               q_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys after RoPE (``_rope``; keys in ``dtype``, queries in ``q_dtype``, by default
    ``dtype``) and values, heads at dim 1, from the q/k/v GEMM's output ``qkv`` (b, t, h + 2 * hk,
    d); ``contiguous_v``: values copied out of it (a view keeps the whole of ``qkv`` alive for as
    long as attention keeps v). RoPE runs on queries and keys in one pass (elementwise: the same
    bits as two passes), in fp32.

    With autograd this is one function (``_SplitRope``) whose backward is one fused function
    (``_split_rope_grad``; Inductor writes each part's slice of the result directly, no intermediate
    tensor): RoPE by the negative angle on the queries' and keys' gradients, written with the
    values' gradient straight into the GEMM's (tokens x features) layout. Op by op,
    autograd joined the queries' and keys' gradients, rotated them and joined the result with the
    values': two concatenations per layer (3.5 GB at 16 x 512 tokens of Qwen2.5-1.5B)."""
    q_dtype = dtype if q_dtype is None else q_dtype
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _SplitRope.apply(qkv, h, hk, cos, sin, dtype, contiguous_v, q_dtype)
    return _split_rope(qkv, h, hk, cos, sin, dtype, contiguous_v, q_dtype)


def _split_rope(qkv, h, hk, cos, sin, dtype, contiguous_v, q_dtype):
    qk, v = (p.transpose(1, 2) for p in qkv.split((h + hk, hk), dim=2))
    q, k = _rope(qk, cos, sin, h, q_dtype, dtype)
    return q, k, (v.contiguous() if contiguous_v else v)


class _SplitRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, h, hk, cos, sin, dtype, contiguous_v, q_dtype):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = qkv.dtype
        return _split_rope(qkv, h, hk, cos, sin, dtype, contiguous_v, q_dtype)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        cos, sin = ctx.saved_tensors
        return _split_rope_grad(gq, gk, gv, cos, sin, ctx.x_dtype), None, None, None, None, None, None, None


@fused
def _split_rope_grad(gq, gk, gv, cos, sin, dtype: torch.dtype) -> torch.Tensor:
    """``_SplitRope``'s input gradient (b, t, heads, d) in ``dtype``. RoPE's transpose is RoPE by the
    negative angle: x*cos + roll(x)*sin has the transpose g*cos + roll(g*sin) = g*cos + roll(g)*(-sin)
    (``sin`` carries rotate_half's signs, and rolling it by half a head flips them) -- the bits
    autograd's op-by-op backward gives."""
    rot = [_as(apply_rope(_as(g, torch.float32), cos, -sin), dtype).transpose(1, 2) for g in (gq, gk)]
    return torch.cat([*rot, _as(gv, dtype).transpose(1, 2)], dim=2)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without a dispatcher call when it is already that dtype (decode steps
    are made of small ops, and each call costs microseconds)."""
    return t if t.dtype is dtype else t.to(dtype)


def cast_kv(t: torch.Tensor, spec: CastSpec | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Round keys/values to the KV-cache format (per token and head for fp8: rows of head_dim).
    Natively a bf16 cache holds bf16 tensors; on CPU, fp32 tensors with bf16-rounded values.

    ``out_dtype``: what attention reads them in (it rounds them to it next). Given, where the FP8
    cache's Triton store runs (``kv_store_runs``), an FP8 row cache's values are made as the rollout
    stores and reads them -- ``kernels.attention.kv_store`` into a scratch copy, then ``_kv_values``
    in ``out_dtype`` (``_StoredKV``): two kernels per tensor, where the reference quantizer, its
    dequantization and the cast to ``out_dtype`` run op by op (about ten). The same values: the
    store is the reference quantizer's, and ``t + (q - t)`` is ``q`` (the two are within a factor of
    two of each other, or q is 0; a negative t whose q is 0 gives -0 here, +0 there)."""
    if spec is None or spec.format.value == "fp32":
        return t
    if native(t) and spec.format is Format.BF16:
        return t.to(torch.bfloat16)
    if out_dtype is not None and t.dim() == 4 and kv_store_runs(t, spec):
        return _StoredKV.apply(t, spec, out_dtype)
    with torch.no_grad():
        if spec.is_scaled:
            q = fake_quantize(t.reshape(-1, t.shape[-1]), spec).reshape(t.shape).to(t.dtype)
        else:
            q = round_to(t, spec.format).to(t.dtype)
    return t + (q - t).detach() if t.requires_grad else q  # straight-through in training


def kv_store_runs(t: torch.Tensor, spec: CastSpec) -> bool:
    """Whether ``kernels.attention.kv_store`` stores ``t`` (natively, where Triton runs) under ``spec``:
    FP8 with one scale per token and head, a floor the kernels take."""
    return native(t) and spec.format.is_fp8 and spec.block.name == "row" and fp8_kernels_for(t, spec) is not None


def _stored_kv_values(t: torch.Tensor, spec: CastSpec, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (b, kv_heads, n, d) as an FP8 row cache stores and reads it back, in ``dtype``."""
    from ..kernels.attention import kv_store

    b, hk, n, d = t.shape
    data = torch.empty(b * hk * n, d, dtype=spec.format.torch_dtype(), device=t.device)
    scales = torch.empty(b * hk * n, dtype=torch.float32, device=t.device)
    kv_store(t, None, data, scales, spec)
    return _kv_values(data.view(b, hk, n, d), scales.view(b, hk, n), dtype)


class _StoredKV(torch.autograd.Function):
    """``cast_kv``'s straight-through rounding to an FP8 cache's values, natively: the forward is
    ``_stored_kv_values``, the backward passes the gradient through in ``t``'s dtype (as ``t + (q -
    t).detach()`` and the cast after it would)."""

    @staticmethod
    def forward(ctx, t, spec, dtype):
        ctx.t_dtype = t.dtype
        return _stored_kv_values(t, spec, dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.t_dtype), None, None


KEY_CHUNK = 16  # key widths are multiples of this


def key_width(n: int) -> int:
    """The key width attention runs over for ``n`` keys: a multiple of ``KEY_CHUNK``."""
    return -(-n // KEY_CHUNK) * KEY_CHUNK


KV_BITS = 22  # keys and values on CPU: integers below 2^22 times a power of two per token and head
PV_GROUP = 128  # keys per exact group of p @ v


def q_bits(head_dim: int) -> int:
    """Fixed-point bits of a query row: q @ k^T over the head dim is then exact in float64."""
    return min(24, F64_BITS - KV_BITS - max(0, (head_dim - 1).bit_length()))


def kv_fixed(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values (..., tokens, d) on their CPU grid: fp32 integers and a float64 power-of-two
    scale per token (..., tokens), from that token alone. What the CPU KV cache stores."""
    v, s = fixed_point(t if t.dtype is torch.float32 else t.float(), KV_BITS, t.shape[-1])
    return v, s[..., 0]


def exact_scores(q: torch.Tensor, k_int: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``q @ k^T`` for queries (B, M, d) fp32 and keys on their grid (B, W, d) + (B, W): every dot
    product exact in float64 (``q_bits`` + ``KV_BITS`` + log2 d <= 53), then scaled and rounded to
    fp32 once. A row's scores do not depend on other rows, on the BLAS or on the key width."""
    qv, sq = fixed_point(q, q_bits(q.shape[-1]), q.shape[-1])
    acc = torch.bmm(qv.double(), k_int.double().transpose(1, 2))
    return acc.mul_(sq).mul_(k_scale.unsqueeze(1)).float()


def exact_pv(p: torch.Tensor, v_int: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """``p @ v`` for probabilities (B, M, W) fp32 and values on their grid (B, W, d) + (B, W),
    reduced over keys exactly per group of ``PV_GROUP`` keys: each key's scale is folded into ``p``
    (a power of two: exact), each row of ``p`` then gets a 24-bit grid per key group, whose largest
    element keys with ``p == 0`` (past a sequence's end) cannot change; group results are added in
    key order in float64 and rounded to fp32 once."""
    pp = p.double() * v_scale.unsqueeze(1)
    pv, sp = fixed_point(pp, F64_BITS - KV_BITS - (PV_GROUP - 1).bit_length(), PV_GROUP)
    vv = v_int.double()
    acc = None
    for i, k0 in enumerate(range(0, p.shape[-1], PV_GROUP)):
        part = torch.bmm(pv[..., k0:k0 + PV_GROUP], vv[:, k0:k0 + PV_GROUP]).mul_(sp[..., i:i + 1])
        acc = part if acc is None else acc.add_(part)
    return acc.float()


class _ExactAttentionGemm(torch.autograd.Function):
    """The trainer's attention GEMMs with keys / values given as values: ``exact_scores(a, b)``
    (``a @ b^T``, ``scores=True``) or ``exact_pv(a, b)`` (``a @ b``); the backward is the plain one."""

    @staticmethod
    def forward(ctx, a, b, scores: bool):
        ctx.save_for_backward(a, b)
        ctx.scores = scores
        return (exact_scores if scores else exact_pv)(a, *kv_fixed(b))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        bt = b if ctx.scores else b.transpose(1, 2)  # out = a @ bt^T
        ga = torch.bmm(g, bt) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[1]:
            gb = torch.bmm(g.transpose(1, 2), a) if ctx.scores else torch.bmm(a.transpose(1, 2), g)
        return ga, gb, None


def _emulated_attention(q, kf, vf, bias, rep: int, fixed: tuple | None = None) -> torch.Tensor:
    """CPU attention, (b, t, heads * d) from queries (b, h, t, d) and keys / values (b * kv_heads,
    w, d) in fp32, or ``fixed``: keys and values already on their grid (the KV cache's). Its two
    GEMMs are exact (``exact_scores``, ``exact_pv``), so a token's result does not depend on the
    other rows or on the key width; softmax is row-local over a width that is a multiple of
    ``KEY_CHUNK`` (keys past a sequence's end get probability exactly 0)."""
    b, h, t, d = q.shape
    hk = h // rep
    qf = (q * (d ** -0.5)).reshape(b * hk, rep * t, d)
    if fixed is None:
        att = _ExactAttentionGemm.apply(qf, kf, True)
    else:
        att = exact_scores(qf, fixed[0], fixed[1])
    w = att.shape[-1]
    att = (att.reshape(b, hk, rep, t, w) + bias).softmax(-1).reshape(b * hk, rep * t, w)
    out = _ExactAttentionGemm.apply(att, vf, False) if fixed is None else exact_pv(att, fixed[2], fixed[3])
    return out.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)


class KVCache:
    """Keys and values of every layer in one tensor, ``(2 * layers, batch, kv_heads, width,
    head_dim)`` (layer i: keys at 2i, values at 2i+1), each sequence stored from index 0.

    In each layer slot the first n sequences are contiguous, so a batch can shrink in place
    (``compact_``), keeping every address a captured CUDA graph reads, or be copied into another
    buffer (``select``: the CPU engine's two reused buffers).

    With an 8-bit ``spec`` (``precision.rollout.kv_cache: fp8_e4m3 row``) the tensor holds FP8 data
    and ``scales`` one fp32 scale per token and head, ``(2 * layers, batch, kv_heads, width)``: a
    token's keys take ``head_dim + 4`` bytes per head instead of ``2 * head_dim`` (bf16). Attention
    reads ``data * scale``, exactly the values the trainer's forward rounds its keys to.

    ``exact`` (the CPU emulation with an unscaled cache): the tensor holds each token's keys and
    values on their grid (``kv_fixed``: fp32 integers) and ``scales`` its power of two per token and
    head, computed once when the token is stored; attention multiplies them exactly
    (``read_fixed``), and ``read`` gives their values.

    ``storage``: a flat tensor to build the cache in (at least ``KVCache.numel(...)`` elements),
    reused from one rollout to the next. On CPU a fresh multi-MB tensor costs a page fault per
    4 KiB page on first touch, more than the copy that fills it."""

    def __init__(self, cfg: ModelConfig, batch: int, width: int, dtype=torch.float32, device=None,
                 storage: "torch.Tensor | StaticCacheStorage | None" = None, spec: CastSpec | None = None,
                 exact: bool = False):
        shape = (2 * cfg.num_hidden_layers, batch, cfg.num_key_value_heads, width, cfg.head_dim)
        self.spec = spec if spec is not None and spec.is_scaled else None
        self.exact = exact and self.spec is None
        if self.exact:
            dtype = torch.float32
        static = storage if isinstance(storage, StaticCacheStorage) else None
        if static is not None:
            storage = static.kv
        if self.spec is not None:
            dtype = self.spec.format.torch_dtype()
        if storage is not None and storage.dtype != dtype:
            storage = None
        if storage is None:
            kv = torch.zeros(shape, dtype=dtype, device=device)
        else:  # positions never written must hold finite values
            kv = _view(storage, shape).view(torch.uint8).zero_().view(dtype) if self.spec else _view(storage, shape).zero_()
        if self.spec is None and not self.exact:
            self.scales = None
        elif static is not None and static.scales is not None:
            self.scales = _view(static.scales, shape[:-1]).zero_()
        else:
            self.scales = torch.zeros(shape[:-1], dtype=torch.float32, device=kv.device)
        self.kv = kv
        self.lengths = static.lengths[:batch].zero_() if static is not None else \
            torch.zeros(batch, dtype=torch.long, device=kv.device)
        self.width = width
        self._index: tuple | None = None

    @staticmethod
    def numel(cfg: ModelConfig, batch: int, width: int) -> int:
        return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * width * cfg.head_dim

    @property
    def batch(self) -> int:
        return self.kv.shape[1]

    def layer(self, j: int) -> torch.Tensor:
        """Keys (j = 2i) or values (j = 2i + 1) of layer i: (batch, kv_heads, width, head_dim)."""
        return self.kv[j]

    def nbytes_per_token(self) -> int:
        """Bytes one token's keys and values take in this cache, over all layers and heads."""
        per = self.kv.shape[0] * self.kv.shape[2]
        return per * (self.kv.shape[-1] * self.kv.element_size() + (4 if self.scales is not None else 0))

    def write_index(self, q_index: torch.Tensor) -> torch.Tensor:
        """Rows of a layer slot flattened to ``(batch * kv_heads * width, head_dim)`` that the keys of
        ``q_index`` (batch, t) go to, in ``(batch, kv_heads, t)`` order; computed once per forward."""
        if self._index is not None and self._index[0] is q_index:
            return self._index[1]
        _, b, hk, w, _ = self.kv.shape
        bh = torch.arange(b * hk, device=q_index.device).reshape(b, hk, 1)
        idx = (bh * w + q_index[:, None, :]).reshape(-1)
        self._index = (q_index, idx)
        return idx

    def store(self, layer: int, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor, values: bool = True) -> tuple | None:
        """Write keys and values (b, kv_heads, t, head_dim) at the rows ``idx`` (``write_index``).
        With an 8-bit cache they are quantized here (per token and head) and their dequantized
        values -- what attention reads back -- are returned; else None (the caller rounded them).
        ``values=False`` (a decode step, whose attention reads the cache): nothing is returned, and
        natively, where Triton runs, one kernel per tensor quantizes and writes the rows
        (``kv_store``, the reference's bits)."""
        d = self.kv.shape[-1]
        out = []
        for j, t in ((2 * layer, k), (2 * layer + 1, v)):
            flat = self.kv[j].view(-1, d)  # the slot's first `batch` sequences are contiguous
            if not values and self.spec is not None and not self.exact and kv_store_runs(t, self.spec):
                from ..kernels.attention import kv_store

                kv_store(t, idx, flat, self.scales[j].view(-1), self.spec)
                continue
            rows = t.reshape(-1, d)
            if self.exact:
                ints, scale = kv_fixed(rows)
                flat.index_copy_(0, idx, ints)
                self.scales[j].view(-1).index_copy_(0, idx, scale.float())
                continue
            if self.spec is None:
                flat.index_copy_(0, idx, rows if rows.dtype is flat.dtype else rows.to(flat.dtype))
                continue
            q = quantize(rows, self.spec)  # FP8 bytes move as uint8 (CPU's index_copy_ skips float8)
            flat.view(torch.uint8).index_copy_(0, idx, q.data.view(torch.uint8))
            self.scales[j].view(-1).index_copy_(0, idx, q.scale.reshape(-1))
            if values:
                out.append(dequantize(q).reshape(t.shape))
        return tuple(out) if out else None

    def read(self, layer: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``< width``, (batch, kv_heads, width, head_dim), as ``dtype``."""
        out = []
        for j in (2 * layer, 2 * layer + 1):
            t = self.kv[j, :, :, :width]
            if self.scales is not None:
                out.append(_kv_values(t, self.scales[j, :, :, :width], dtype))
            else:
                out.append(t if t.dtype is dtype else t.to(dtype))
        return out[0], out[1]

    def read_fixed(self, layer: int, width: int) -> tuple:
        """An exact cache's keys and values of positions ``< width`` on their grid: integers
        (batch * kv_heads, width, head_dim) and float64 scales (batch * kv_heads, width), each."""
        _, b, hk, _, d = self.kv.shape
        out = []
        for j in (2 * layer, 2 * layer + 1):
            out += [self.kv[j, :, :, :width].reshape(b * hk, width, d),
                    self.scales[j, :, :, :width].reshape(b * hk, width).double()]
        return tuple(out)

    def select(self, rows: torch.Tensor, storage: torch.Tensor | None = None) -> None:
        """Keep only ``rows`` (finished sequences leave the batch, a prompt's cache is copied to
        its group), in one copy into ``storage`` (which must not be this cache's) or a new tensor."""
        shape = (self.kv.shape[0], rows.numel(), *self.kv.shape[2:])
        raw = self.kv.view(torch.uint8) if self.spec is not None else self.kv  # float8: moved as bytes
        if storage is None or storage.dtype != self.kv.dtype:
            kv = raw.index_select(1, rows)
        else:
            out = _view(storage, shape)
            kv = torch.index_select(raw, 1, rows, out=out.view(torch.uint8) if self.spec is not None else out)
        self.kv = kv.view(self.kv.dtype)
        if self.scales is not None:
            self.scales = self.scales.index_select(1, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self._index = None

    def fill_from(self, src: "KVCache", rows: torch.Tensor) -> None:
        """Copy ``src``'s sequences ``rows`` (one per sequence of this cache) into this cache, in
        place (a prompt prefilled once, copied to each sample of its group)."""
        raw = self.kv.view(torch.uint8) if self.spec is not None else self.kv
        src_raw = src.kv.view(torch.uint8) if src.spec is not None else src.kv
        _gather_rows(raw, src_raw, rows)
        if self.scales is not None:
            _gather_rows(self.scales, src.scales, rows)
        self.lengths.copy_(src.lengths.index_select(0, rows))
        self._index = None

    def compact_(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (ascending), moved to the front of this cache's own tensor: the cache
        becomes its first ``len(rows)`` sequences, at unchanged addresses."""
        n = rows.numel()
        raw = self.kv.view(torch.uint8) if self.spec is not None else self.kv
        _gather_rows(raw[:, :n], raw, rows)
        self.kv = self.kv[:, :n]
        if self.scales is not None:
            _gather_rows(self.scales[:, :n], self.scales, rows)
            self.scales = self.scales[:, :n]
        self.lengths[:n] = self.lengths.index_select(0, rows)
        self.lengths = self.lengths[:n]
        self._index = None


@fused
def _kv_values(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An 8-bit cache's keys or values times their scales (per token and head), as ``dtype``: on a
    GPU one kernel reading 1 byte per value (op by op: a cast to fp32, a multiply and a cast, ~19
    bytes moved per value at every decode step). The fp8 -> fp32 cast is exact; one rounding."""
    return (data.to(torch.float32) * scale[..., None]).to(dtype)


def _gather_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[j] = src[j, rows]`` for each layer slot j (dim 0), one slot at a time: the temporary is
    one slot's rows, not the whole cache's (a GPU engine's static cache can be tens of GB). ``dst``
    may be a view of ``src``: each slot's rows are gathered before any is written."""
    for j in range(dst.shape[0]):
        dst[j] = src[j].index_select(0, rows)


class StaticCacheStorage:
    """The buffers a KV cache of up to ``batch`` sequences lives in, allocated once (a GPU engine
    decodes every rollout in them, so a captured CUDA graph's addresses stay valid): keys and values,
    scales when the cache is 8-bit (or exact, on CPU), and the sequence lengths."""

    def __init__(self, cfg: ModelConfig, batch: int, width: int, dtype: torch.dtype, device, spec=None,
                 exact: bool = False):
        scaled = spec is not None and spec.is_scaled
        self.batch, self.width = batch, width
        self.kv = torch.zeros(KVCache.numel(cfg, batch, width), dtype=spec.format.torch_dtype() if scaled else dtype,
                              device=device)
        n_scales = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * width
        self.scales = torch.zeros(n_scales, dtype=torch.float32, device=device) if scaled or exact else None
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)


def _view(storage: torch.Tensor, shape: tuple) -> torch.Tensor:
    n = math.prod(shape)
    if storage.numel() < n:
        raise ValueError(f"KV-cache storage holds {storage.numel()} elements, {n} needed")
    return storage[:n].view(shape)


class Masking:
    """Which keys each query sees: key ``j`` is visible to the query at ``q_index`` if ``j <= q_index``
    and (with ``key_keep``, left padding) ``key_keep[j]`` or ``j == q_index``. Built once per forward;
    the emulated attention reads it as an additive mask, the native one as a boolean mask (or as
    plain causal attention when that is what it is)."""

    def __init__(self, q_index: torch.Tensor, key_keep: torch.Tensor | None, width: int, causal_from_zero: bool):
        self.q_index, self.key_keep, self.width = q_index, key_keep, width
        self.causal = causal_from_zero and key_keep is None  # queries at 0..t-1 over keys 0..t-1
        self._bias = self._visible = None
        self.invariant = False  # the batch-invariant kernels (a flow's batch_invariant, on a GPU)
        self.reads_cache = False  # a decode step's attention reads the KV cache in kernels.attention

    def visible(self) -> torch.Tensor:
        """(b, 1, t, width) bool."""
        if self._visible is None:
            j = torch.arange(self.width, device=self.q_index.device)
            see = j <= self.q_index[..., None]
            if self.key_keep is not None:
                see = (see & self.key_keep[:, None, :]) | (j == self.q_index[..., None])
            self._visible = see[:, None]
        return self._visible

    def additive(self) -> torch.Tensor:
        """(b, 1, 1, t, width) fp32: 0 where visible, -inf elsewhere."""
        if self._bias is None:
            vis = self.visible()
            self._bias = torch.zeros(vis.shape, device=vis.device).masked_fill_(~vis, float("-inf"))[:, :, None]
        return self._bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, bias=False)
        if cfg.qk_norm:  # Qwen3: per head, one weight of head_dim shared by the heads
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.kv_spec: CastSpec | None = None

    @property
    def qkv(self) -> tuple:
        return self.q_proj, self.k_proj, self.v_proj

    def attend(self, qkv, x_dtype: torch.dtype, cos, sin, mask: Masking, cache: KVCache | None = None, layer: int = 0):
        """Attention from the q/k/v projections' output ``qkv`` (b x t x ...; ``DecoderLayer`` runs
        the projections with the norm before them, ``norm_linear``), through o_proj; ``x_dtype``: the
        dtype of the projections' input, which the CPU emulation writes its output in."""
        b, t, _ = qkv.shape
        c = self.cfg
        h, hk = c.num_attention_heads, c.num_key_value_heads
        heads = qkv.reshape(b, t, h + 2 * hk, c.head_dim)
        if c.qk_norm:
            heads = self._qk_norm(heads, h, hk)
        # split, not sliced (a slice's backward writes a zero-filled gradient of the whole input, and
        # autograd adds them up); the backward writes the GEMM's layout in one fused function (split_rope)
        q, k, v = split_rope(heads, h, hk, cos, sin, self._rope_dtype(qkv),
                             contiguous_v=native(qkv) and qkv.requires_grad,  # attention saves v (1/8 of q/k/v at 1.5B)
                             q_dtype=self._query_dtype(qkv))
        width = mask.width
        if cache is None:
            dt = self.attention_format().torch_dtype() if native(qkv) else None
            keys, values = cast_kv(k, self.kv_spec, dt), cast_kv(v, self.kv_spec, dt)
        else:
            idx = cache.write_index(mask.q_index)
            in_kernel = mask.reads_cache
            if cache.spec is not None:  # an 8-bit cache quantizes (what cast_kv rounds to) as it stores
                # the new keys' and values' values only where attention reads them (prefill); a decode
                # step reads the cache (as stored, or dequantized by ``read``)
                k, v = cache.store(layer, idx, k, v, values=mask.causal and not in_kernel) or (None, None)
            else:
                k, v = cast_kv(k, self.kv_spec), cast_kv(v, self.kv_spec)
                cache.store(layer, idx, k, v)
            if in_kernel:
                fmt = self.attention_format()
                out = _cache_attention(q, cache, layer, width, mask, fmt, self._o_proj_operand(q, mask))
                if isinstance(out, QTensor):  # o_proj's FP8 input, written by the attention kernel
                    y = linear_group((self.o_proj,), None, self.o_proj, x_op=out, x_dtype=fmt.torch_dtype())
                    return y.reshape(b, t, y.shape[-1])
                return linear_group((self.o_proj,), out, self.o_proj, input_kept=True)
            # natively straight in the dtype attention reads (the same bits as through fp32)
            dt = self.attention_format().torch_dtype() if native(qkv) else q.dtype  # (CPU: fp32, as k)
            keys, values = (k, v) if mask.causal or cache.exact else cache.read(layer, width, dt)
        if native(qkv):
            out = _native_attention(q, keys, values, mask, h // hk, self.attention_format())
            # SDPA keeps its output for its backward; o_proj's backward reads the same tensor
            return linear_group((self.o_proj,), out, self.o_proj, input_kept=True)
        rep = h // hk
        d = c.head_dim
        fixed = cache.read_fixed(layer, width) if cache is not None and cache.exact and not mask.causal else None
        kf = vf = None
        if fixed is None:
            if keys.shape[2] < width:
                keys = F.pad(keys, (0, 0, 0, width - keys.shape[2]))
                values = F.pad(values, (0, 0, 0, width - values.shape[2]))
            # GQA without copying the cache: the `rep` query heads sharing a KV head are stacked as
            # rows of one (rep*t, d) matrix per (sequence, KV head).
            kf = _as(keys, torch.float32).reshape(b * hk, keys.shape[2], d)
            vf = _as(values, torch.float32).reshape(b * hk, values.shape[2], d)
        fmt = self.attention_format()
        q = round_to(q, fmt)  # as flash attention reads it
        out = _emulated_attention(q, kf, vf, mask.additive(), rep, fixed)
        out = round_to(out, fmt)  # as flash attention writes it
        return linear_group((self.o_proj,), _as(out, x_dtype), self.o_proj)

    def _qk_norm(self, heads: torch.Tensor, h: int, hk: int) -> torch.Tensor:
        """Qwen3's RMSNorm of each query and key head (its head_dim features), before RoPE, in the dtype
        the q/k/v GEMM wrote: natively its bf16 output, and in the CPU emulation rounded to that GEMM's
        output format as the GPU's bf16 tensor is (the same bits as a GPU's norm kernel writes)."""
        q, k, v = heads.split((h, hk, hk), dim=2)
        q, k = self.q_norm(q), self.k_norm(k)
        if not native(heads):
            fmt = self.q_proj.precision.fprop.out
            if fmt in (Format.BF16, Format.FP32):
                q, k = round_to(q, fmt), round_to(k, fmt)
        return torch.cat((q, k, v), dim=2)

    def attention_format(self) -> Format:
        return attention_format(self.kv_spec)

    def _o_proj_operand(self, q: torch.Tensor, mask: Masking) -> CastSpec | None:
        """o_proj's FP8 1x128 input spec where the decode attention kernel can write that operand
        itself (``kernels.attention.decode_attention(quantize_out=)``: a head of 128 is one group),
        bit for bit what o_proj's quantizer makes of the kernel's bf16 output; else None. Rollout
        decode steps only (no autograd); in the batch-invariant mode its kernel's option (a row's
        own: the trainer's quantizer makes the same bytes of the same output)."""
        if torch.is_grad_enabled():
            return None
        fused = fused_input_quantizer((self.o_proj,), q)
        if fused is None:
            return None
        from ..kernels.attention import out_quant_unsupported

        spec = fused[1]
        return spec if out_quant_unsupported(spec, self.attention_format().torch_dtype(), q.shape[-1]) is None else None

    def _query_dtype(self, x: torch.Tensor) -> torch.dtype:
        """What RoPE returns queries in: on the native path what attention reads them in (every
        attention path rounds queries to ``attention_format`` first: the same bits, one kernel and
        a write and read of fp32 queries fewer per layer, each way, than through ``_rope_dtype``'s
        fp32 beside an 8-bit cache); fp32 in the CPU emulation."""
        return self.attention_format().torch_dtype() if native(x) else torch.float32

    def _rope_dtype(self, x: torch.Tensor) -> torch.dtype:
        """What RoPE returns keys in: bf16 on the native path when attention reads bf16
        and keys are kept as bf16 (what ``cast_kv`` and ``_native_attention`` would round them
        to); fp32 otherwise (the CPU emulation, or keys an 8-bit cache quantizes from fp32)."""
        spec = self.kv_spec
        if native(x) and spec is not None and spec.format is Format.BF16 and not spec.is_scaled:
            return torch.bfloat16
        return torch.float32


def attention_format(kv_spec: CastSpec | None) -> Format:
    """What attention reads queries and writes outputs in: fp32 with an fp32 KV cache (or no flow),
    else bf16, as flash attention does on a GPU. The vLLM backend rounds the same way."""
    return Format.FP32 if kv_spec is None or kv_spec.format is Format.FP32 else Format.BF16


def _native_attention(q, keys, values, mask: Masking, rep: int, fmt: Format) -> torch.Tensor:
    """``scaled_dot_product_attention`` on queries, keys and values in ``fmt`` (bf16: flash attention
    for causal training and prefill; a boolean mask for decode steps and left padding);
    returns (b, t, heads * d) in ``fmt``."""
    b, h, t, d = q.shape
    dt = fmt.torch_dtype()
    qn, kn, vn = q.to(dt), keys.to(dt), values.to(dt)
    if mask.invariant:  # fixed key blocks from key 0, no split-KV: decode, prefill and training agree bitwise
        if mask.key_keep is not None:
            from ..errors import JetrlError

            raise JetrlError("precision.batch_invariant: left-padded sequences are not supported (right-pad them)")
        from ..kernels.invariant import invariant_attention

        # causal from key 0 over t keys (training, a prefill): q_pos None, the same positions, and the
        # trainer's backward may then be flash attention's
        q_pos = None if mask.causal and t == kn.shape[2] else mask.q_index
        out, _ = invariant_attention(qn, kn, vn, q_pos, check_positions=False)
        return out.transpose(1, 2).reshape(b, t, h * d)
    if mask.causal and t == kn.shape[2]:  # training, prefill: flash attention, which reads GQA's shared heads
        if rep > 1 and not _SDPA_GQA:
            kn, vn = kn.repeat_interleave(rep, 1), vn.repeat_interleave(rep, 1)
        kw = {"enable_gqa": True} if rep > 1 and _SDPA_GQA else {}
        out = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True, **kw)
        return out.transpose(1, 2).reshape(b, t, h * d)
    # A mask (decode steps, left padding): flash attention takes none, and the memory-efficient kernel
    # takes no GQA before torch's 2026 change (pytorch/pytorch#191085; not in the H100 machine's
    # 2.11), so enable_gqa with a mask runs the math kernel, which repeats K and V per query head and
    # computes in fp32. Instead the rep query heads that share a KV head become rep x t query rows of
    # that head -- each row is attended alone, so only the layout changes -- and the kernel reads each
    # KV head once.
    vis = mask.visible()[..., :kn.shape[2]]  # (b, 1, t, width)
    if rep > 1:
        qn = qn.reshape(b, h // rep, rep * t, d)
        vis = vis[:, :, None].expand(-1, -1, rep, -1, -1).reshape(b, 1, rep * t, kn.shape[2])  # a view at t = 1
    out = F.scaled_dot_product_attention(qn, kn, vn, attn_mask=vis)
    return out.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)


KV_READ = "attention over the FP8 KV cache"  # the operations' names in backend_report()["kernels"]
BF16_READ = "decode attention over the bf16 KV cache"
CACHE_KERNELS = {KV_READ: ("triton, read as stored", "dequantized, then SDPA"), BF16_READ: ("triton", "SDPA")}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _reads_cache_as_stored(x: torch.Tensor, cache: KVCache, mask: Masking, heads: int) -> bool:
    """Whether a decode step's attention reads the cache in ``kernels.attention``'s Triton kernel
    (an FP8 cache as stored: its bytes and scales) instead of through SDPA (an FP8 cache dequantized
    first): natively, where the kernel runs, and where it is the faster of the two -- except that the
    batch-invariant mode reads the cache in its own kernel whenever that runs (the same bits either way,
    and o_proj's FP8 input written by it: ``Attention._o_proj_operand``). Decided once per device and
    cache format, at the first decode step, and reported."""
    if not (not mask.causal and mask.key_keep is None and mask.q_index.shape[1] == 1 and native(x)):
        return False
    fp8 = cache.spec is not None and cache.kv.dtype in _FP8
    if not fp8 and cache.kv.dtype is not torch.bfloat16:
        return False
    if fp8:
        from ..kernels.fp8 import unsupported

        if unsupported(None, cache.spec.format, cache.spec.amax_floor) is not None:  # a floor below the kernels'
            return False
    op = KV_READ if fp8 else BF16_READ
    choice = kernel_choice(op, x.device) or _choose_cache_read(op, x.device, cache, heads)
    return choice["runs"] if mask.invariant else choice["kernel"] == CACHE_KERNELS[op][0]


def _choose_cache_read(op: str, device: torch.device, cache: KVCache, heads: int) -> dict:
    triton, sdpa = CACHE_KERNELS[op]
    why = _kv_read_unavailable(device, cache.kv.dtype)
    if why is not None:
        return note_kernel(op, device, sdpa, why, runs=False)
    if not _can_time(device):  # Triton's interpreter: nothing to time; FP8 takes the kernel's path (tested)
        return note_kernel(op, device, triton if op == KV_READ else sdpa, runs=True)
    b, hk, w = cache.kv.shape[1], cache.kv.shape[2], cache.kv.shape[3]
    try:
        t = _time_kv_reads(cache, heads)
    except Exception as e:  # noqa: BLE001 - no timing here: FP8 read once by the kernel, bf16 as before
        return note_kernel(op, device, triton if op == KV_READ else sdpa, f"not timed ({type(e).__name__})", runs=True)
    kernel = triton if t["triton"] <= t["sdpa"] else sdpa
    return note_kernel(op, device, kernel, f"timed at {b} sequences x {w} keys x {hk} KV heads: triton "
                       f"{t['triton']:.3f} ms, {sdpa if op == BF16_READ else 'dequantize + SDPA'} {t['sdpa']:.3f} ms",
                       runs=True, timings_ms=t)


def _can_time(device: torch.device) -> bool:
    return device.type == "cuda"


def _kv_read_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the cache-reading decode attention cannot run on ``device`` (None: it can): Triton's FP8
    conversions need compute capability 8.9 (Ada, Hopper); a tiny call must compile and launch. Runs
    before any CUDA graph is captured (a graph's capture follows an eager step)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels need a CUDA GPU"
    fp8 = dtype in _FP8
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < ((8, 9) if fp8 else (8, 0)):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        return (f"Triton's {'FP8 conversions need compute capability 8.9' if fp8 else 'bf16 dots need compute capability 8.0'}"
                f" or later (this GPU: {cap})")
    try:
        from ..kernels.attention import decode_attention, kv_store

        q = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16, device=device)
        kv = torch.zeros(1, 1, 16, 16, dtype=dtype, device=device)
        s = torch.ones(1, 1, 16, device=device)
        pos = torch.zeros(1, dtype=torch.long, device=device)
        decode_attention(q, kv, kv, pos, kv_scales=(s, s) if fp8 else None)
        if fp8:
            spec = CastSpec(Format.FP8_E4M3 if dtype == torch.float8_e4m3fn else Format.FP8_E5M2, Block.parse("row"))
            kv_store(q.float(), pos, kv.view(-1, 16), s.view(-1), spec)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot compile or launch here: the fallback runs
        return f"the kernel failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None


def _time_kv_reads(cache: KVCache, heads: int, calls: int | None = None) -> dict:
    """Milliseconds per call of each way to attend over layer 0's slots of ``cache`` at its full
    width (every key read): the Triton kernel, and SDPA (an FP8 cache dequantized first); device time
    as the GEMM backends are timed (``device_time_ms``: captured in a CUDA graph, as a decode step runs)."""
    from ..kernels.attention import decode_attention

    _, b, hk, w, d = cache.kv.shape
    k, v = cache.kv[0], cache.kv[1]
    q = torch.zeros(b, heads, 1, d, dtype=torch.bfloat16, device=k.device)
    pos = torch.full((b,), w - 1, device=k.device)
    mask = Masking(pos[:, None], None, w, causal_from_zero=False)
    if cache.scales is not None:  # FP8: read as stored, or dequantized for SDPA
        ks, vs = cache.scales[0], cache.scales[1]
        fns = {"triton": lambda: decode_attention(q, k, v, pos, kv_scales=(ks, vs)),
               "sdpa": lambda: _native_attention(q, _kv_values(k, ks, torch.bfloat16),
                                                 _kv_values(v, vs, torch.bfloat16), mask, heads // hk, Format.BF16)}
    else:
        fns = {"triton": lambda: decode_attention(q, k, v, pos),
               "sdpa": lambda: _native_attention(q, k, v, mask, heads // hk, Format.BF16)}
    kw = {} if calls is None else {"calls": calls}
    return {name: device_time_ms(fn, k.device, **kw) for name, fn in fns.items()}


def _cache_attention(q, cache: KVCache, layer: int, width: int, mask: Masking, fmt: Format,
                     out_spec: CastSpec | None = None):
    """A decode step's attention over the cache as stored (``kernels.attention``): bf16, or FP8 whose
    keys and values are read as 1 byte plus their row's scale and dequantized in registers to exactly
    the bf16 value ``_kv_values`` would give; the batch-invariant mode reads an FP8 cache through the
    invariant kernel. Returns (b, 1, heads * d) in ``fmt``; with ``out_spec`` (``Attention._o_proj_operand``)
    the kernel's output quantized as o_proj's input instead: a QTensor (b, heads * d)."""
    b, h, t, d = q.shape
    qn = q.to(fmt.torch_dtype())
    k, v = cache.kv[2 * layer, :, :, :width], cache.kv[2 * layer + 1, :, :, :width]
    scales = None if cache.scales is None else (cache.scales[2 * layer, :, :, :width],
                                                cache.scales[2 * layer + 1, :, :, :width])
    if mask.invariant:
        from ..kernels.invariant import invariant_attention

        out, _ = invariant_attention(qn, k, v, mask.q_index, check_positions=False, kv_scales=scales,
                                     quantize_out=out_spec)
    else:
        from ..kernels.attention import decode_attention

        out = decode_attention(qn, k, v, mask.q_index, kv_scales=scales, quantize_out=out_spec)
    if out_spec is not None:
        return out
    return out.transpose(1, 2).reshape(b, t, h * d)


def _sdpa_has_gqa() -> bool:
    import inspect

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: torch >= 2.5 has the argument
        return tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


_SDPA_GQA = _sdpa_has_gqa()


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias)

    @property
    def gate_up(self) -> tuple:  # run by ``DecoderLayer``: the norm before them, then ``gated_mlp``
        return self.gate_proj, self.up_proj


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask: Masking, cache=None, layer=0, delta=None):
        """The layer on the residual stream ``x + delta`` (``delta``: the previous layer's MLP output,
        or None): ``(x', delta')``, whose sum is the layer's output (``layer_output``). Each
        residual add runs in the norm after it (``norm_linear``), this layer's MLP output's in the
        next layer's first norm: no add of its own, with the same bits as adding it here."""
        a, m = self.self_attn, self.mlp
        x, qkv = norm_linear(self.input_layernorm, x, delta, a.qkv, a)
        return norm_linear(self.post_attention_layernorm, x, a.attend(qkv, x.dtype, cos, sin, mask, cache, layer),
                           m.gate_up, m, m.down_proj)


def _checkpointed_layer(suspended: bool, layer, x, cos, sin, mask, i, delta):
    """A decoder layer's training forward under ``torch.utils.checkpoint``: run again in the backward
    (on autograd's thread on a GPU) with the fused functions suspended as they were in the forward, so the
    recomputed activations have the forward's bits."""
    with fuse.suspended(suspended):
        return layer(x, cos, sin, mask, None, i, delta)


def layer_output(out: tuple) -> torch.Tensor:
    """The hidden state a ``DecoderLayer``'s output ``(x, delta)`` stands for: ``x + delta`` (what a
    forward hook on a decoder layer reads as the layer's output)."""
    x, delta = out
    return x + delta


class _EmbedRows(torch.autograd.Function):
    """The token embedding whose backward adds its gradient rows in place: each token's row, in
    token order, into the tied lm_head's weight gradient (``RowGradSlot``); or, within
    ``grads_in_place``, each token's rows summed (``_token_sums``) into the ``.grad`` the weight holds
    (``grad_sink``). Otherwise it returns the dense gradient ``nn.Embedding`` returns."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, slot: RowGradSlot | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.slot, ctx.weight = slot, weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        weight, ctx.weight = ctx.weight, None
        flat, rows = ids.reshape(-1), g.reshape(-1, g.shape[-1])
        into = ctx.slot.take() if ctx.slot is not None else None
        if into is not None:  # the tied lm_head's gradient, written by its backward
            add_rows_(into, flat, rows.to(into.dtype))
            return None, None, None
        held = grad_sink([weight]) if ctx.slot is None else None  # tied, without the head's: as autograd
        if held is None:
            return None, torch.ops.aten.embedding_dense_backward(g, ids, weight.shape[0], -1, False), None
        if sink_overwrites():  # .grad holds stale values (``grads_written``): the rows go into zeros
            held.zero_()
        add_rows_(held, flat, _token_sums(flat, rows.to(held.dtype), weight.shape[0]))
        return None, None, None


def add_rows_(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``dst[index[i]] += rows[i]`` for each i in turn, deterministic whatever the thread count: on
    CPU ``index_add_`` (serial over i, as ``embedding_dense_backward``; CPU ``index_put_`` with
    accumulation adds in a thread-dependent order), on CUDA ``index_put_`` with accumulation (a
    stable sort by index, then each index's rows in order; CUDA's ``index_add_`` uses atomics)."""
    if dst.device.type == "cpu":
        return dst.index_add_(0, index, rows)
    return dst.index_put_((index,), rows, accumulate=True)


def _token_sums(ids: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each token's ``rows`` summed in token order from zero, at the token's first position, zeros at
    its others: added into a gradient (``add_rows_``) it adds what autograd adds there from
    ``embedding_dense_backward`` -- bit for bit on CPU, where both sum a token's rows serially in token
    order -- without a vocab x hidden gradient. No host sync: the first positions come from a
    min-reduction into a vocab-sized index."""
    n, ids = ids.numel(), ids.long()  # (scatter's index is int64)
    first = torch.full((vocab,), n, dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, ids, torch.arange(n, device=ids.device), "amin")
    return add_rows_(torch.zeros_like(rows), first[ids], rows)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._batch_invariant = False
        self.embed_slot: RowGradSlot | None = None  # the last training forward's (``_embed``)

    # -- shared pieces ---------------------------------------------------------------------

    @property
    def batch_invariant(self) -> bool:
        """Set by ``apply_flow`` (``precision.batch_invariant``): on a GPU, attention, RMSNorm and the
        log-softmax run jetrl's batch-invariant kernels (GEMMs get them from their backend). The CPU
        emulation is batch-invariant already."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = bool(on)
        for mod in self.modules():
            if isinstance(mod, RMSNorm):
                mod.invariant = bool(on)

    def set_kv_spec(self, spec: CastSpec | None) -> None:
        """The format keys and values are rounded to (the KV cache's, in every forward)."""
        for layer in self.model.layers:
            layer.self_attn.kv_spec = spec

    def _cos_sin(self, pos: torch.Tensor, need: int):
        """RoPE angles from one table, so a position gets the same bits in every batch shape.
        ``need``: a bound on the positions (the key width), so no host sync reads ``pos.max()``."""
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].device != pos.device:
            n = max(need, self.config.max_position_embeddings)
            ang = torch.arange(n, device=pos.device, dtype=torch.float32)[:, None] * self.inv_freq.to(pos.device)
            emb = torch.cat((ang, ang), dim=-1)
            sin = emb.sin()
            sin[:, : sin.shape[1] // 2] *= -1  # rotate_half's sign, folded in (exact)
            self._rope = (emb.cos(), sin)
        cos, sin = self._rope
        return cos[pos][:, None], sin[pos][:, None]

    def _trunk(self, input_ids, pos, q_index, key_keep, width, cache=None, causal_from_zero=False) -> torch.Tensor:
        cos, sin = self._cos_sin(pos, width)  # every position is < width
        mask = Masking(q_index, key_keep, width, causal_from_zero)
        mask.invariant = self.batch_invariant
        with fuse.suspended(self.batch_invariant):  # its forward op by op (see precision.fuse)
            x = self._embed(input_ids)
            if cache is not None:  # decided once per forward, for every layer
                mask.reads_cache = _reads_cache_as_stored(x, cache, mask, self.config.num_attention_heads)
            graphs = self.__dict__.get("trunk_graphs")  # a trainer's CUDA graphs (rl.train_graphs)
            if (graphs is not None and cache is None and key_keep is None and causal_from_zero
                    and graphs.applies(self, x)):
                x, delta = graphs.run(x, cos, sin, mask)
            else:
                if graphs is not None and graphs.model is self and torch.is_grad_enabled():
                    graphs.zero_stale()  # an eager backward adds into the layers' gradients: not stale ones
                x, delta = self.run_layers(x, cos, sin, mask, cache)
            return self.model.norm(x + delta)  # a module call: its hooks see the final hidden state

    def run_layers(self, x, cos, sin, mask: Masking, cache=None) -> tuple:
        """The decoder layers on the embedded tokens ``x``: the last layer's ``(x, delta)``, whose sum
        is the residual stream."""
        delta = None  # each layer's MLP output, added in the next layer's first norm
        if self.activation_checkpointing and cache is None and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            run = functools.partial(_checkpointed_layer, fuse.is_suspended())
            for i, layer in enumerate(self.model.layers):
                x, delta = checkpoint(run, layer, x, cos, sin, mask, i, delta, use_reentrant=False,
                                      preserve_rng_state=False)
            return x, delta
        for i, layer in enumerate(self.model.layers):
            x, delta = layer(x, cos, sin, mask, cache, i, delta)
        return x, delta

    # ``train.activation_checkpointing``: a training forward keeps each decoder layer's input only, and its
    # backward runs the layer's forward again (the same ops, so the same bits) for what the backward reads
    activation_checkpointing = False

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding. In a training forward its backward adds the tokens' rows in place
        (``_EmbedRows``): in a tied model (its lm_head's weight is the embedding's) into the lm_head's
        weight gradient, handed over in a fresh ``RowGradSlot`` (``embed_slot``)."""
        emb = self.model.embed_tokens
        self.embed_slot = None
        if not (emb.weight.requires_grad and torch.is_grad_enabled()):
            return emb(input_ids)
        if self.lm_head.weight is emb.weight:
            self.embed_slot = RowGradSlot(emb.weight)
        return _EmbedRows.apply(input_ids, emb.weight, self.embed_slot)

    def logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of hidden states (any leading dims): the lm_head in the flow's precision;
        written into ``out`` (fp32, of their shape) when given."""
        y = linear_group((self.lm_head,), h, self.lm_head)
        return y.float() if out is None else out.copy_(y)

    # -- full sequences (training, scoring) -----------------------------------------------

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               width: int | None = None) -> torch.Tensor:
        """The final (normed) hidden state of every position; ``logits`` turns them into logits.

        ``attention_mask``: 1 for real tokens, 0 for padding (left or right). With right padding
        (or none) every token's result is bit-identical to what ``prefill`` / ``decode`` compute.
        ``width`` (tests only) forces a larger key width; results do not depend on it.
        """
        b, t = input_ids.shape
        dev = input_ids.device
        width = key_width(max(t, width or 0))
        q_index = torch.arange(t, device=dev).expand(b, t)
        if attention_mask is None:
            pos, keep = q_index, None
        else:
            keep = F.pad(attention_mask.bool(), (0, width - t))
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        return self._trunk(input_ids, pos, q_index, keep, width, causal_from_zero=True)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, width: int | None = None,
        head=None,
    ) -> torch.Tensor:
        """Logits (fp32) for every position (see ``hidden``), or ``head(self, hidden_states)``: what
        the trainer computes from the hidden states instead of full logits (its chunked logprobs),
        inside ``forward`` so module hooks apply to it too (FSDP gathers ``lm_head`` there)."""
        h = self.hidden(input_ids, attention_mask, width)
        return self.logits(h) if head is None else head(self, h)

    # -- incremental decoding (the rollout engine) ----------------------------------------

    def kv_spec(self) -> CastSpec | None:
        return self.model.layers[0].self_attn.kv_spec if len(self.model.layers) else None

    def new_cache(self, batch: int, max_len: int, storage=None) -> KVCache:
        dev = self.lm_head.weight.device
        return KVCache(self.config, batch, key_width(max_len), dtype=self.cache_dtype(), device=dev,
                       storage=storage, spec=self.kv_spec(), exact=not native(self.lm_head.weight))

    def static_storage(self, batch: int, max_len: int) -> StaticCacheStorage:
        return StaticCacheStorage(self.config, batch, key_width(max_len), self.cache_dtype(),
                                  self.lm_head.weight.device, self.kv_spec(), exact=not native(self.lm_head.weight))

    def linear_groups(self) -> list[tuple[tuple, nn.Module]]:
        """Each GEMM the model's linear layers run as ``(layers, owner)``: the layers reading one input
        (q/k/v, gate/up) or one alone, and the module their group weight is cached on; then the LoRA
        adapters' (a group's A matrices together, each B alone)."""
        groups = []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            groups += [((a.q_proj, a.k_proj, a.v_proj), a), ((a.o_proj,), a.o_proj),
                       ((m.gate_proj, m.up_proj), m), ((m.down_proj,), m.down_proj)]
        adapters = []  # LoRA: a group's A matrices run as one GEMM, each B alone (``linear._add_adapters``)
        for mods, _ in groups:
            adapted = [x for x in mods if has_adapter(x)]
            if adapted:
                downs = tuple(x.lora_A for x in adapted)
                adapters += [(downs, downs[0])] + [((x.lora_B,), x.lora_B) for x in adapted]
        return groups + [((self.lm_head,), self.lm_head)] + adapters

    def hold_weights_once(self) -> None:
        """Every linear layer holding a loaded GEMM weight (``JetLinear.load_quantized_weight``: 8-bit
        with its scales, or bf16) keeps only that one: its master copy is freed, and the layers of a
        fused group (q/k/v, gate/up) become views into the group's stacked operand, which is then
        the only copy. For a model that reads its weights but never trains them: a GPU rollout
        engine, a frozen reference policy."""
        from ..precision.linear import _group_key, stack_rows
        from ..precision.quant import QTensor

        for mod in self.modules():
            if isinstance(mod, JetLinear) and mod._wfixed is not None and mod.weight.numel():
                mod.weight.data = torch.empty(0, dtype=mod.weight.dtype, device=mod.weight.device)
        for mods, owner in self.linear_groups():
            if len(mods) == 1 or any(x._wfixed is None for x in mods):
                continue
            w, b = group_weight(mods, owner)
            if not (isinstance(w, torch.Tensor) and native(w) or isinstance(w, QTensor)):
                continue
            start = 0
            for x in mods:
                part = stack_rows(w, start, x.out_features)
                if part is None:
                    break
                x._wfixed = part
                start += x.out_features
            owner.__dict__["_jet_group_cache"] = (_group_key(mods), w, b)

    def freeze_weights(self) -> None:
        """Natively (a GPU), hold each linear layer's forward weight only, cast once from its master
        weight (``hold_weights_once``) -- for a frozen model: the trainer's reference policy. Its
        results do not change: it multiplies the operands it cached before. A weight shared with the
        embedding (tied lm_head) is kept; on CPU (the emulation) nothing changes."""
        from ..precision.linear import weight_operand

        tied = {id(mod.weight) for mod in self.modules() if isinstance(mod, nn.Embedding)}
        for mod in self.modules():
            if isinstance(mod, JetLinear) and id(mod.weight) not in tied and native(mod.weight):
                mod.load_quantized_weight(weight_operand(mod.weight, mod.precision.fprop))
        self.hold_weights_once()

    def hold_frozen_weights(self) -> int:
        """Natively (a GPU): each frozen linear layer of a trainer (LoRA's base layers) keeps its forward
        operand only -- bf16, or 8-bit with its scales, cast once --, its fp32 master copy freed
        (``hold_weights_once``); Dgrad reads the operand transposed. Not the lm_head (its vocabulary-sliced
        backward reads the master), nor a layer whose Dgrad weight spec is not its forward's. On CPU (the
        emulation) nothing changes. Returns the bytes of master weights freed."""
        from ..precision.linear import is_adapter_name, weight_operand

        tied = {id(mod.weight) for mod in self.modules() if isinstance(mod, nn.Embedding)}
        freed = 0
        for name, mod in self.named_modules():
            w = getattr(mod, "weight", None)
            if (isinstance(mod, JetLinear) and mod is not self.lm_head and not is_adapter_name(name)
                    and not w.requires_grad and w.numel() and native(w) and id(w) not in tied
                    and mod._wfixed is None and mod.precision.dgrad.b == mod.precision.fprop.b):
                mod.load_quantized_weight(weight_operand(w, mod.precision.fprop))
                freed += w.numel() * w.element_size()
        if freed:
            self.hold_weights_once()
        return freed

    def refresh_weights(self) -> bool:
        """Bring every cached GEMM weight up to date now (a captured decode step does not run the
        Python that would do it lazily). True if every one was updated in place."""
        same = True
        for mods, owner in self.linear_groups():
            before = owner.__dict__.get("_jet_group_cache")
            w, b = group_weight(mods, owner)
            same = same and before is not None and before[1] is w and before[2] is b
        return same

    def cache_dtype(self) -> torch.dtype:
        """The 8-bit format of an FP8 KV cache; else fp32 on CPU (the emulated bf16 cache holds
        bf16-rounded fp32 values) and natively bf16 unless the KV cache is fp32."""
        w = self.lm_head.weight
        spec = self.model.layers[0].self_attn.kv_spec if len(self.model.layers) else None
        if spec is not None and spec.is_scaled:
            return spec.format.torch_dtype()
        if native(w) and not (spec is not None and spec.format is Format.FP32):
            return torch.bfloat16
        return w.dtype

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Fill the cache with right-padded prompts; logits (fp32) at each prompt's last token."""
        b, t = input_ids.shape
        idx = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self._trunk(input_ids, idx, idx, None, key_width(t), cache, causal_from_zero=True)
        cache.lengths = lengths.clone()
        last = h[torch.arange(b, device=h.device), lengths - 1]
        return self.logits(last)

    def decode(self, tokens: torch.Tensor, cache: KVCache, width: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Append one token per sequence at its own length; logits (fp32) for the next token, in
        ``out`` when given (a captured step writes them into a buffer its engine keeps).
        ``width``: the key width (a multiple of ``KEY_CHUNK`` above every sequence's new length),
        when the caller knows it; otherwise it is read from the lengths (a host sync)."""
        idx = cache.lengths[:, None]
        if width is None:
            longest = int(cache.lengths.max())
            if longest >= cache.width:
                raise ValueError(f"KV cache full ({cache.width} positions)")
            width = key_width(longest + 1)
        elif width > cache.width:
            raise ValueError(f"KV cache full ({cache.width} positions, width {width} asked)")
        h = self._trunk(tokens[:, None], idx, idx, None, width, cache)
        cache.lengths.add_(1)
        return self.logits(h[:, 0], out)
