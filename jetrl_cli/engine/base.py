"""The interfaces between the trainer and a rollout engine.

Everything the RL loop needs from a rollout engine is ``generate`` (token ids in, sampled tokens
with their logprobs out) and ``load_weights`` (the weight sync). The embedded engine implements
both in process; an engine in another process or on other GPUs (vLLM) implements the same two
calls, so the loop never assumes one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence, Union

import torch

from ..errors import JetrlError
from ..precision.quant import QTensor
from .sampling import SamplingParams


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]  # of each sampled token, under the distribution it was sampled from
    finish_reason: str  # "stop" (a stop token or sequence, included in tokens) or "length"


def first_stop(tokens: Sequence[int], params: SamplingParams) -> int | None:
    """The index of the token that ends ``tokens`` at its first stop: a stop token, or the last
    token of a stop sequence; None if it has none."""
    stops = set(params.stop_token_ids)
    end = next((j for j, t in enumerate(tokens) if t in stops), None)
    limit = len(tokens) if end is None else end
    for seq in params.stop_sequences:
        k = len(seq)
        hit = next((j for j in range(k - 1, limit) if tuple(tokens[j - k + 1:j + 1]) == seq), None)
        if hit is not None:
            end = limit = hit
    return end


def cut_at_stop(tokens: list[int], logprobs: list[float], params: SamplingParams,
                reason: str = "length") -> Completion:
    """A completion cut after its first stop (``first_stop``), finish reason "stop"; without one,
    ``reason`` (an engine's own: decoded to the limit, or stopped by a stop token it knew)."""
    end = first_stop(tokens, params)
    if end is None:
        return Completion(tokens, logprobs, reason)
    return Completion(tokens[:end + 1], logprobs[:end + 1], "stop")


@dataclass
class WeightPayload:
    """What one sync sends: per parameter name a high-precision tensor, or a ``QTensor`` already
    quantized by the trainer with the rollout's weight spec (``weight_sync: quantized``)."""

    tensors: dict[str, Union[torch.Tensor, QTensor]]
    version: int = 0
    nbytes: int = field(default=0)


class RolloutEngine(Protocol):
    name: str
    width: int  # longest prompt + completion the engine holds (its KV-cache width)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int | Sequence[int]) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, sampled reproducibly from ``seed``: one int
        (prompt i then gets ``sampling.prompt_seeds(seed, len(prompts))[i]``) or one seed per
        prompt. A prompt's samples depend on its own seed only, not on the other prompts."""

    def load_weights(self, payload: WeightPayload) -> None:
        """Replace the engine's weights with the trainer's (the weight sync)."""


def check_prompts(prompts: list[list[int]], params: SamplingParams, width: int) -> None:
    """What every engine refuses: an empty prompt, or one that cannot fit its completion."""
    if any(len(p) == 0 for p in prompts):
        raise JetrlError("rollout: empty prompt (no tokens)")
    longest = max(len(p) for p in prompts) + params.max_new_tokens
    if longest > width:
        raise JetrlError(f"rollout: prompt + max_new_tokens = {longest} tokens exceeds the engine width "
                         f"{width} (rollout.max_len: raise it, or lower rollout.max_new_tokens / "
                         "eval.max_new_tokens, or shorten the prompts)")


def make_payload(model: torch.nn.Module, flow, version: int = 0,
                 params: Iterable[tuple[str, torch.Tensor]] | None = None) -> WeightPayload:
    """The trainer's side of a sync: every parameter, quantized once for ``weight_sync: quantized``.
    ``params``: the (name, full tensor) pairs to send instead of ``model.named_parameters()`` (a
    sharded trainer passes its parameters gathered whole, so blocks and scales are the same)."""
    from ..precision.linear import JetLinear, is_adapter_name, matches_skip, weight_operands

    tensors: dict[str, Union[torch.Tensor, QTensor]] = {}
    quantize_weights = flow.weight_sync.payload == "quantized"
    quantized_names = set()
    if quantize_weights:
        for name, mod in model.named_modules():
            if (isinstance(mod, (torch.nn.Linear, JetLinear)) and not matches_skip(name, flow.skip)
                    and not is_adapter_name(name)):  # LoRA adapters run in the skip format
                quantized_names.add(f"{name}.weight")
    nbytes = 0
    with torch.no_grad():
        named = [(name, p.detach()) for name, p in (model.named_parameters() if params is None else params)]
        quantized = [(name, p) for name, p in named if name in quantized_names]
        ops = dict(zip([n for n, _ in quantized], weight_operands([p for _, p in quantized], flow.rollout.linear)))
        for name, p in named:  # in the parameters' order
            t = ops.get(name, p)
            nbytes += t.nbytes() if name in ops else t.numel() * t.element_size()
            tensors[name] = t
    return WeightPayload(tensors, version, nbytes)
