"""Sampling parameters and the one function that turns logits into the sampling distribution.

``sampling_logprobs`` is called by the rollout engine (to sample, and to report the logprob of the
sampled token) and by the trainer (to score the same tokens under the training precision), so
"the distribution the token was sampled from" means the same thing on both sides: logits divided
by the temperature, then top-k and top-p truncation, renormalised.

The random draws are keyed, not streamed: prompt ``i`` of a call with seed ``s`` has its own seed
(``prompt_seeds``), each of its ``n`` samples a 32-bit key (``sample_keys``), and the Gumbel noise
of token ``v`` at decode position ``t`` is a hash of (key, t, v) (``keyed_uniform``). A sample's
tokens therefore depend only on (seed, prompt index, sample index), never on which other prompts
share the batch, how the engine chunks or compacts it, or which process samples it: a rollout
sharded over data-parallel ranks draws exactly the samples one process draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..precision.fuse import fused


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy (logprobs then reported at temperature 1)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    n: int = 1  # samples per prompt (a GRPO group)
    stop_token_ids: tuple[int, ...] = ()
    # several tokens each: a row stops once its last tokens are one of them (a multi-token stop string)
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams, invariant: bool = False) -> torch.Tensor:
    """fp32 log-probabilities of the sampling distribution, rows of ``logits`` independently.
    ``invariant`` (a batch-invariant flow on a GPU): the final log-softmax is jetrl's one-program-
    per-row kernel, so a row's bits do not depend on how many rows there are."""
    return _log_softmax(_sampling_scores(logits, params), invariant)


def gathered_logprobs(logits: torch.Tensor, targets: torch.Tensor, params: SamplingParams,
                      invariant: bool = False) -> torch.Tensor:
    """``sampling_logprobs(logits, params, invariant)[i, targets[i]]``, the same bits. With autograd,
    the log-softmax and the gather are one function (``_GatheredLogSoftmax``) whose backward is one
    elementwise pass over the saved log-probabilities into one vocabulary-sized tensor (on a GPU one
    fused kernel and a scatter of a value per row), where autograd's would fill a zero gradient,
    scatter into it and run the log-softmax backward over it."""
    x = _sampling_scores(logits, params)
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatheredLogSoftmax.apply(x, targets, invariant)
    return _at(_log_softmax(x, invariant), targets)


def gathered_logprobs_lse(logits: torch.Tensor, targets: torch.Tensor, params: SamplingParams,
                          invariant: bool = False, entropy: bool = False) -> tuple[torch.Tensor, ...]:
    """``gathered_logprobs`` without autograd (the same bits) and each row's log-normalizer of the
    sampling distribution, ``score[target] - logprob`` (the trainer's vocabulary-sliced backward
    recomputes the probabilities from it: ``rl.head_grad``); ``entropy``: and each row's entropy,
    as ``gathered_logprobs_entropy`` gives it (the same bits)."""
    x = _sampling_scores(logits, params)
    ls = _log_softmax(x, invariant)
    lp = _at(ls, targets)
    if not entropy:
        return lp, _at(x, targets) - lp
    return lp, _at(x, targets) - lp, torch.special.entr(ls.exp_()).sum(-1)


def gathered_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, params: SamplingParams,
                              invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``gathered_logprobs`` (the same bits) and each row's entropy (nats) of the sampling
    distribution, ``-sum_v p_v log p_v`` over the tokens it keeps (temperature, top-k and top-p as
    sampled; a dropped token has p = 0 and adds 0). With autograd both are differentiable
    (``_GatheredLogSoftmaxEntropy``: the entropy bonus of the loss); without, the probabilities
    overwrite the log-probabilities in place."""
    x = _sampling_scores(logits, params)
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatheredLogSoftmaxEntropy.apply(x, targets, invariant)
    ls = _log_softmax(x, invariant)
    lp = _at(ls, targets)  # gathered (a copy) before ls becomes the probabilities in place
    return lp, torch.special.entr(ls.exp_()).sum(-1)


def _at(t: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``t[i, targets[i]]`` for each row i."""
    return t.gather(-1, targets[:, None])[:, 0]


def _sampling_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What the log-softmax of the sampling distribution takes: fp32 logits over the temperature,
    with the tokens top-k / top-p drop at -inf."""
    x = logits.float()
    if not params.greedy and params.temperature != 1.0:
        x = x / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        srt, order = torch.sort(x, dim=-1, descending=True)
        probs = srt.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keeps the smallest prefix reaching top_p (>= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def _log_softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    if invariant:
        from ..kernels.invariant import invariant_log_softmax

        return invariant_log_softmax(x)
    return torch.log_softmax(x, dim=-1)


class _GatheredLogSoftmax(torch.autograd.Function):
    """``log_softmax(x)[i, targets[i]]`` (rows x vocab -> rows); saves the log-probabilities, as
    autograd's log-softmax saves its output."""

    @staticmethod
    def forward(ctx, x, targets, invariant):
        lp = _log_softmax(x, invariant)
        ctx.save_for_backward(lp, targets)
        return _at(lp, targets)

    @staticmethod
    def backward(ctx, g):
        lp, targets = ctx.saved_tensors
        return _gathered_log_softmax_grad(lp, targets, g), None, None


@fused
def _gathered_log_softmax_grad(lp: torch.Tensor, targets: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient of ``log_softmax(x)[i, targets[i]]`` w.r.t. x for upstream ``g`` (rows): the
    log-softmax backward ``dy - exp(lp) * sum(dy)`` of the one-hot ``dy = g at the target``, whose
    row sum is ``g`` -- autograd's products and sums (up to the sign of a zero; torch's CPU
    log-softmax backward has an ``exp`` of its own, so the last bits differ), in one tensor:
    ``exp(lp) * -g``, then ``g`` added at the targets."""
    d = lp.exp().mul_(-g[:, None])
    return d.scatter_add_(-1, targets[:, None], g[:, None])


class _GatheredLogSoftmaxEntropy(torch.autograd.Function):
    """``(log_softmax(x)[i, targets[i]], entropy(softmax(x))[i])`` (rows x vocab -> two of rows);
    saves the log-probabilities and the entropies."""

    @staticmethod
    def forward(ctx, x, targets, invariant):
        ls = _log_softmax(x, invariant)
        ent = torch.special.entr(ls.exp()).sum(-1)
        ctx.save_for_backward(ls, targets, ent)
        return _at(ls, targets), ent

    @staticmethod
    def backward(ctx, g, g_ent):
        ls, targets, ent = ctx.saved_tensors
        return _logprob_entropy_grad(ls, ls.exp(), targets, g, g_ent, ent), None, None


def _logprob_entropy_grad(logp: torch.Tensor, p: torch.Tensor, targets: torch.Tensor, g: torch.Tensor,
                          g_ent: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    """The gradient w.r.t. the scores x of ``g * logp[target] + g_ent * H`` for rows of log-
    probabilities ``logp`` (their exponentials ``p``), ``H = -sum_v p_v logp_v``:
    ``g * onehot - p * (g + g_ent * (logp + H))`` (``dH/dx_v = -p_v (logp_v + H)``). A token the
    sampling dropped (``logp = -inf``, ``p = 0``) gets 0."""
    logp = torch.where(p > 0, logp, 0.0)
    d = logp.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g[:, None]).mul_(p).neg_()
    return d.scatter_add_(-1, targets[:, None], g[:, None])


def invariant_for(model, logits: torch.Tensor) -> bool:
    """Whether ``model``'s logprobs take the batch-invariant log-softmax (``sampling_logprobs``'s
    ``invariant``): in its batch-invariant mode, on native (GPU) logits."""
    from ..precision.gemm import native

    return bool(getattr(model, "batch_invariant", False)) and native(logits)


_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def prompt_seeds(seed: int | Sequence[int], count: int) -> list[int]:
    """The seed of each prompt of a ``generate(prompts, params, seed)`` call (the vLLM engine
    passes them to vLLM as per-request seeds). A data-parallel rank passes its slice: a sequence
    of seeds is returned as a list, as given."""
    if not isinstance(seed, int):
        return list(seed)
    return [seed * 1_000_003 + i for i in range(count)]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sample_keys(seeds: list[int], n: int, device=None) -> torch.Tensor:
    """One 32-bit key per sample, prompt-major (prompt i's n samples are rows i*n .. i*n+n-1)."""
    keys = [_splitmix64(_splitmix64(s & _M64) ^ j) >> 32 for s in seeds for j in range(n)]
    return torch.tensor(keys, dtype=torch.int64, device=device)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values below
    2**32; the multipliers are below 2**31, so no product overflows int64 on any device."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def keyed_uniform(keys: torch.Tensor, position: int, width: int) -> torch.Tensor:
    """``(len(keys), width)`` fp32 uniforms in [0, 1), 24 bits each (as ``torch.rand``): row r,
    column v is a hash of (keys[r], position, v) alone."""
    pos = _splitmix64(position) >> 32
    row = _hash32(keys ^ pos)
    cols = (torch.arange(width, device=keys.device, dtype=torch.int64) * 0x9E3779B1) & _M32
    x = _hash32((row[:, None] + cols[None, :]) & _M32)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample(logp: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           keys: torch.Tensor | None = None, position: int = 0) -> torch.Tensor:
    """One token per row: greedy argmax, or Gumbel-max (exact sampling from ``exp(logp)``) with
    the noise keyed by ``keys`` (one per row) and the decode ``position``, or else drawn from
    ``generator``."""
    if params.greedy:
        return logp.argmax(-1)
    if keys is not None and logp.is_cuda and logp.dtype == torch.float32 and logp.dim() == 2:
        # one Triton pass over logp, the same noise bits and argmax rule (``kernels.sampling``): the
        # torch form below is ~20 passes over (rows, vocab) int64 and fp32 tensors per decode step
        from ..kernels.sampling import keyed_gumbel_argmax

        return keyed_gumbel_argmax(logp, keys, _splitmix64(position) >> 32)
    if keys is not None:
        u = keyed_uniform(keys, position, logp.shape[-1])
    else:
        u = torch.rand(logp.shape, generator=generator, device=logp.device, dtype=torch.float32)
    return gumbel_argmax(logp, u)


def gumbel_argmax(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``argmax(logp + g)`` per row, ``g = -log(-log(u))`` (``u`` clamped to 1e-20 from below): the
    reference form of ``kernels.sampling``'s one-pass kernel."""
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-20)))
    return (logp + gumbel).argmax(-1)
