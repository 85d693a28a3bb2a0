"""Data-parallel rollout: each rank's engine samples its block of the prompts; all ranks get all.

``ShardedEngine`` wraps any ``RolloutEngine`` (embedded, or vLLM where installed) and is one
itself, so the RL loop's ``rollout_samples`` and ``evaluate`` run unchanged. A prompt's ``n``
samples stay on one rank (the engine samples a prompt's whole group), and each prompt keeps the seed
it has in a single process (``prompt_seeds`` of the whole call, sliced), so the samples are the
single-process samples. The completions (tokens and logprobs) are then all-gathered: every rank
computes rewards, metrics and advantages on the whole step, and the trainer picks its share.
"""

from __future__ import annotations

from typing import Sequence

from ..engine.base import Completion, RolloutEngine, WeightPayload, check_prompts
from ..engine.sampling import SamplingParams, prompt_seeds
from .world import World


class ShardedEngine:
    def __init__(self, inner: RolloutEngine, world: World):
        self.inner, self.world = inner, world
        self.name = f"{inner.name} x{world.size}"
        self.runs_adapters = getattr(inner, "runs_adapters", False)
        self.width = inner.width

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int | Sequence[int]) -> list[list[Completion]]:
        check_prompts(prompts, params, self.width)  # every rank refuses the same prompts
        seeds = prompt_seeds(seed, len(prompts))
        mine = self.world.shard(len(prompts))
        local = (self.inner.generate([prompts[i] for i in mine], params, [seeds[i] for i in mine])
                 if len(mine) else [])
        return [g for part in self.world.all_gather_object(local) for g in part]

    def load_weights(self, payload: WeightPayload) -> None:
        self.inner.load_weights(payload)

    @property
    def weights_version(self) -> int:
        return self.inner.weights_version
