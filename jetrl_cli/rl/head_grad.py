"""Token logprobs through the lm_head with a backward over vocabulary slices.

The trainer's forward scores the completion tokens a chunk of rows at a time, through the same
``logits`` -> log-softmax as the rollout engine (bit for bit its logprobs). The backward needs, for
every row, the gradient over the whole vocabulary, ``g * (onehot(target) - softmax)``, which takes a
row's normalizer (the log-sum-exp of its sampling scores): the forward keeps it, one float per row
(``lse = score[target] - logprob``). So the backward can run over *vocabulary* slices of all rows at
once: per slice, the logits of all rows are recomputed (the lm_head's forward GEMM on the slice's
weight rows), turned into the gradient in one pass (``_vocab_slice_grad``: no log-softmax is
written, the gradient is written once, in the Dgrad operand's dtype), and the slice's weight
gradient is written once; the input gradient adds up over slices in fp32 (tokens x hidden).

The row-chunked backward it replaces (a checkpoint per chunk) recomputed each chunk's logits and
its log-softmax, wrote an fp32 gradient and cast it for the GEMMs, read the whole lm_head weight
twice per chunk, and added each chunk's weight gradient into a vocab x hidden fp32 sum (a read and
a write of 0.93 GB per chunk at a 152K vocabulary and 1536 hidden). Same gradient, up to the order
of fp32 sums.

For the lm_head in a dense precision (every flow's: bf16 natively, its emulation on CPU) without a
bias, and sampling without top-k / top-p truncation (whose masks need whole rows);
``target_logprobs`` takes the row-chunked path otherwise.
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine.sampling import SamplingParams, gathered_logprobs_lse, invariant_for
from ..precision.formats import Format
from ..precision.fuse import fused
from ..precision.gemm import accumulate_gemm, dense_cast, finish, native, run_gemm, transpose_operand
from ..precision.linear import TILE, JetLinear, grad_sink, release_after_backward, sink_overwrites


def sliced_backward_applies(model, sampling: SamplingParams) -> bool:
    """Whether ``head_logprobs`` serves ``model``'s lm_head under ``sampling``."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, JetLinear) or head.bias is not None or head._wfixed is not None:
        return False
    if (sampling.top_k and sampling.top_k < head.out_features) or sampling.top_p < 1.0:
        return False
    p = head.precision
    return not p.is_quantized and p.dgrad.a.format is p.wgrad.a.format


def head_logprobs(model, h: torch.Tensor, targets: torch.Tensor, sampling: SamplingParams, rows: int,
                  elements: int, entropy: bool = False) -> torch.Tensor:
    """``log p(targets[i] | h[i])`` for rows ``h`` (n, hidden) with autograd: the forward ``rows``
    rows at a time, the backward over vocabulary slices of about ``elements`` logits each.
    ``entropy``: stacked with each row's entropy of the sampling distribution, (2, n), both
    differentiable (the forward keeps the entropy too, one more float per row)."""
    return _HeadLogprobs.apply(h, model.lm_head.weight, model, targets, sampling, rows, elements, entropy)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, model, targets, sampling, rows, elements, entropy):
        parts = []
        for s in range(0, h.shape[0], rows):
            logits = model.logits(h[s:s + rows])
            parts.append(gathered_logprobs_lse(logits, targets[s:s + rows], sampling, invariant_for(model, logits),
                                               entropy))
        lp, lse, *ent = (torch.cat(c) for c in zip(*parts))
        ctx.save_for_backward(_backward_copy(h, model.lm_head), targets, lse, *ent)
        ctx.model, ctx.sampling, ctx.elements, ctx.h_dtype = model, sampling, elements, h.dtype
        ctx.rows = getattr(model, "embed_slot", None)  # a tied embedding adds its rows into our gw
        return torch.stack([lp, *ent]) if entropy else lp

    @staticmethod
    def backward(ctx, g):
        h, targets, lse, *ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        head = ctx.model.lm_head
        into = grad_sink([head.weight]) if need_w else None  # added into the .grad held: autograd gets none
        entropy = (ent[0], g[1]) if ent else None
        gx, gw = _sliced_grads(head, h, targets, lse, g[0] if ent else g, ctx.sampling, ctx.elements, need_h,
                               need_w, into, entropy, ctx.h_dtype)
        release_after_backward(head)
        if ctx.rows is not None:
            ctx.rows.put(head.weight, gw)
        return gx, None if into is not None else gw, None, None, None, None, None, None


def _backward_copy(h: torch.Tensor, head: JetLinear) -> torch.Tensor:
    """What the backward keeps of the lm_head's input ``h``: where its GEMMs read h in one dtype
    narrower than h's (natively: the recomputed logits' and the Wgrad's bf16 operand, for an fp32
    norm output), h in that dtype -- the operand those GEMMs cast h to, so the same bits, at half
    the bytes (at 16 x 1024 tokens of a 4096-wide model, 134 MB less to keep through the forward);
    else h itself."""
    p = head.precision
    fmt = p.fprop.a.format
    if native(h) and fmt is p.wgrad.b.format and fmt.torch_dtype().itemsize < h.dtype.itemsize:
        return dense_cast(h, fmt)
    return h


def _sliced_grads(head: JetLinear, h, targets, lse, g, sampling: SamplingParams, elements: int, need_h: bool,
                  need_w: bool, into: torch.Tensor | None = None,
                  entropy: tuple[torch.Tensor, torch.Tensor] | None = None, h_dtype: torch.dtype | None = None):
    """``(gx, gw)``: the gradients of ``g . logprobs`` (with ``entropy = (H, g_H)``: plus ``g_H . H``)
    w.r.t. ``h`` and the lm_head weight; the weight's added into ``into`` (its ``.grad``, from
    ``grad_sink``) when given. ``h`` may be the forward's input in its GEMMs' operand dtype
    (``_backward_copy``); ``h_dtype`` is then the input's own (the logits' and ``gx``'s dtype)."""
    h_dtype = h.dtype if h_dtype is None else h_dtype
    prec = head.precision
    fp, dg, wg = prec.fprop, prec.dgrad, prec.wgrad
    dg_sum = dataclasses.replace(dg, out=Format.FP32)  # slices' products add in fp32, rounded to dg.out once
    dev = h.device
    temperature = None if sampling.greedy or sampling.temperature == 1.0 else float(sampling.temperature)
    d_dtype = dg.a.format.torch_dtype() if native(h) else torch.float32
    xa = dense_cast(h, fp.a.format)
    wf = head.quantized_weight()
    wt = head.dgrad_weight() if need_h else None
    ht = transpose_operand(dense_cast(h, wg.b.format)) if need_w else None  # Wgrad's b: h^T (hidden x rows)
    v, n = wf.shape[0], h.shape[0]
    step = max(TILE, elements // max(n, 1) // TILE * TILE)
    gx = None
    gw = into if into is not None or not need_w else torch.empty(head.weight.shape, dtype=head.weight.dtype,
                                                                  device=dev)
    g = g.float()
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        logits = finish(run_gemm(xa, wf[v0:v1], fp, "fprop", dev), fp.out, h_dtype)
        d = _vocab_slice_grad(logits, lse, g, targets - v0, temperature, d_dtype, *(entropy or ()))
        d = dense_cast(d, dg.a.format)
        if need_h:
            gx = accumulate_gemm(gx, d, wt[:, v0:v1], dg_sum, "dgrad", dev, torch.float32)
        if need_w:
            accumulate_gemm(gw[v0:v1], transpose_operand(d), ht, wg, "wgrad", dev, gw.dtype,
                            overwrite=into is None or sink_overwrites())
    if gx is not None:
        gx = finish(gx, dg.out, h_dtype)
        gx = gx if gx.dtype is h_dtype else gx.to(h_dtype)
    return gx, gw


@fused
def _vocab_slice_grad(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, local: torch.Tensor,
                      temperature: float | None, dtype: torch.dtype, ent: torch.Tensor | None = None,
                      g_ent: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of ``g[i] * logprob(targets[i])`` w.r.t. one vocabulary slice of the logits
    (rows x slice), in ``dtype``: ``g * (onehot - exp(score - lse))`` with the sampling scores
    ``logits / temperature`` (as ``_sampling_scores`` divides them), over the temperature again.
    ``local``: each row's target index within the slice (outside it: no one-hot term). With the
    rows' entropies ``ent`` and their upstream ``g_ent``, of ``g . logprob + g_ent . H``:
    ``g * onehot - p * (g + g_ent * (log p + H))`` (``dH/dx_v = -p_v (log p_v + H)``)."""
    x = logits.float()
    if temperature is not None:
        x = x / temperature
    if ent is None:
        d = (x - lse[:, None]).exp_().mul_(-g[:, None])  # in place: op by op, one temporary of the slice's size
    else:
        logp = x - lse[:, None]
        d = logp.add(ent[:, None]).mul_(g_ent[:, None]).add_(g[:, None]).mul_(logp.exp_()).neg_()
    width = x.shape[1]
    inside = (local >= 0) & (local < width)
    d = d.scatter_add_(-1, local.clamp(0, width - 1)[:, None], torch.where(inside, g, 0.0)[:, None])
    if temperature is not None:
        d = d.div_(temperature)
    return d if d.dtype is dtype else d.to(dtype)
