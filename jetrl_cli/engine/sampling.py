"""Sampling parameters and the one function that turns logits into the sampling distribution.

``sampling_logprobs`` is called by the rollout engine (to sample, and to report the logprob of the
sampled token) and by the trainer (to score the same tokens under the training precision), so
"the distribution the token was sampled from" means the same thing on both sides: logits divided
by the temperature, then top-k and top-p truncation, renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy (logprobs then reported at temperature 1)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    n: int = 1  # samples per prompt (a GRPO group)
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 log-probabilities of the sampling distribution, rows of ``logits`` independently."""
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
    return torch.log_softmax(x, dim=-1)


def sample(logp: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: greedy argmax, or Gumbel-max (exact sampling from ``exp(logp)``)."""
    if params.greedy:
        return logp.argmax(-1)
    u = torch.rand(logp.shape, generator=generator, device=logp.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-20)))
    return (logp + gumbel).argmax(-1)
