"""The embedded rollout engine: batched sampling with a KV cache, in plain PyTorch, in process.

It runs jetrl's own model with the flow's rollout precision (``apply_flow(model, flow,
"rollout")``) and reports each sampled token's logprob from ``sampling_logprobs``, the function
the trainer scores with. Prompts are right-padded and every sequence lives in the cache from index
0, finished sequences leave the batch (see ``compaction``), and up to ``max_batch`` sequences
decode together.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from ..errors import JetrlError
from ..models.llama import KVCache, key_width
from ..precision.gemm import ROW_TILE
from ..precision.linear import JetLinear, apply_flow
from .base import Completion, WeightPayload, check_prompts
from .sampling import SamplingParams, prompt_seeds, sample, sample_keys, sampling_logprobs


def compaction(rows: list[int], live: int) -> list[int] | None:
    """Which batch rows to keep, or None to keep them all, once some sequences have finished.

    A finished row stays in the batch (its tokens are ignored: rows never affect each other) until
    a quarter of the batch has finished: dropping rows copies every layer's KV cache, which costs
    more than decoding a few extra rows. The rows kept are rounded up to a multiple of
    ``ROW_TILE`` with finished ones, so the GEMMs need no row padding."""
    dead = len(rows) - live
    if dead < max(ROW_TILE, len(rows) // 4):
        return None
    target = min(len(rows), -(-live // ROW_TILE) * ROW_TILE)
    keep = [i for i, r in enumerate(rows) if r >= 0]
    if target > live:
        keep = sorted(keep + [i for i, r in enumerate(rows) if r < 0][:target - live])
    return keep


class EmbeddedEngine:
    name = "embedded"

    def __init__(self, model: torch.nn.Module, flow, width: int, max_batch: int = 256):
        """``model`` is copied: the engine owns its weights and gets new ones only by ``load_weights``."""
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        apply_flow(self.model, flow, "rollout")
        self.flow = flow
        self.width = width
        self.max_batch = max_batch
        self.device = next(self.model.parameters()).device
        self.weights_version = -1
        self._kv_storage: list[torch.Tensor | None] = [None, None]

    def _storage(self, i: int, batch: int) -> torch.Tensor | None:
        """Flat buffer ``i`` of two that the KV cache lives in and is compacted between, kept from
        one rollout to the next on CPU (a fresh tensor there costs page faults on first touch;
        CUDA's caching allocator already reuses memory, and the trainer needs it between rollouts)."""
        if self.device.type != "cpu":
            return None
        n = KVCache.numel(self.model.config, batch, key_width(self.width))
        buf = self._kv_storage[i]
        if buf is None or buf.numel() < n or buf.dtype != self.model.cache_dtype():
            self._kv_storage[i] = None  # free the old one first
            buf = self._kv_storage[i] = torch.empty(n, dtype=self.model.cache_dtype(), device=self.device)
        return buf

    def load_weights(self, payload: WeightPayload) -> None:
        params = dict(self.model.named_parameters())
        modules = dict(self.model.named_modules())
        with torch.no_grad():
            for name, t in payload.tensors.items():
                if name not in params:
                    raise JetrlError(f"weight sync: the rollout model has no parameter {name}")
                if isinstance(t, torch.Tensor):
                    params[name].copy_(t)
                    continue
                mod = modules.get(name.rsplit(".", 1)[0])
                if not isinstance(mod, JetLinear):
                    raise JetrlError(f"weight sync: {name} arrived quantized but is not a quantized layer here")
                mod.load_quantized_weight(t)
        self.weights_version = payload.version

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int | Sequence[int]) -> list[list[Completion]]:
        """``seed``: one int for the call, or one seed per prompt (a data-parallel rank's slice of
        ``prompt_seeds``). Each sample's noise is keyed by its prompt's seed and its index in the
        group (``sampling.sample_keys``), so chunking and compaction do not change the tokens."""
        check_prompts(prompts, params, self.width)
        seeds = prompt_seeds(seed, len(prompts)) if isinstance(seed, int) else list(seed)
        flat = [p for p in prompts for _ in range(params.n)]  # group-major: prompt i -> rows i*n .. i*n+n-1
        keys = sample_keys(seeds, params.n, self.device)
        out: list[Completion] = []
        for start in range(0, len(flat), self.max_batch):
            out.extend(self._generate_chunk(flat[start:start + self.max_batch], params,
                                            keys[start:start + self.max_batch]))
        return [out[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, keys: torch.Tensor) -> list[Completion]:
        b = len(prompts)
        dev = self.device
        # A GRPO group repeats its prompt n times: prefill each distinct prompt once, then copy its
        # cache rows and logits to every sample (rows are computed independently of each other, so
        # the copies hold the same bits a prefill of every row would give).
        distinct: dict[tuple, int] = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        lengths = torch.tensor([len(p) for p in distinct], device=dev)
        ids = torch.zeros(len(distinct), int(lengths.max()), dtype=torch.long, device=dev)
        for i, p in enumerate(distinct):
            ids[i, :len(p)] = torch.tensor(p, device=dev)
        self._storage(0, b), self._storage(1, b)  # each holds the chunk's largest batch
        cache = self.model.new_cache(len(distinct), self.width, self._storage(0, len(distinct)))
        spare = 1  # the storage buffer the next select copies into
        logits = self.model.prefill(ids, lengths, cache)
        if len(distinct) < b:
            src = torch.tensor(which, device=dev)
            cache.select(src, self._storage(spare, b))
            spare = 1 - spare
            logits = logits[src]
        stops = set(params.stop_token_ids)
        toks = [[] for _ in range(b)]
        lps = [[] for _ in range(b)]
        reasons = ["length"] * b
        rows = list(range(b))  # original index of each batch row; -1: finished, not yet dropped
        live = b
        for step in range(params.max_new_tokens):
            logp = sampling_logprobs(logits, params)
            if params.greedy:
                logp_report = torch.log_softmax(logits.float(), -1)
            else:
                logp_report = logp
            nxt = sample(logp, params, keys=keys, position=step)
            chosen = logp_report.gather(-1, nxt[:, None])[:, 0]
            for i, (r, t, lp) in enumerate(zip(rows, nxt.tolist(), chosen.tolist())):
                if r < 0:
                    continue
                toks[r].append(t)
                lps[r].append(lp)
                if t in stops:
                    reasons[r] = "stop"
                    rows[i] = -1
                    live -= 1
            if step == params.max_new_tokens - 1 or live == 0:
                break
            keep = compaction(rows, live)
            if keep is not None:
                idx = torch.tensor(keep, device=dev)
                cache.select(idx, self._storage(spare, len(keep)))
                spare = 1 - spare
                rows, nxt, keys = [rows[i] for i in keep], nxt[idx], keys[idx]
            logits = self.model.decode(nxt, cache)
        return [Completion(toks[i], lps[i], reasons[i]) for i in range(b)]
