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
from ..precision.gemm import ROW_TILE, native
from ..precision.linear import JetLinear, apply_flow, weight_operands
from .base import Completion, WeightPayload, check_prompts, cut_at_stop
from .graphs import width_bucket
from .sampling import SamplingParams, invariant_for, prompt_seeds, sample, sample_keys, sampling_logprobs

PLAIN = SamplingParams()  # temperature 1, no top-k / top-p


def compaction(rows: list[int], live: int, pow2: bool = False) -> list[int] | None:
    """Which batch rows to keep, or None to keep them all, once some sequences have finished.

    A finished row stays in the batch (its tokens are ignored: rows never affect each other) until
    a quarter of the batch has finished: dropping rows copies every layer's KV cache, which costs
    more than decoding a few extra rows. The rows kept are rounded up to a multiple of
    ``ROW_TILE`` with finished ones, so the GEMMs need no row padding; with ``pow2`` (a GPU engine
    with CUDA graphs) up to a power of two, so a rollout meets few batch sizes to capture."""
    dead = len(rows) - live
    if dead < max(ROW_TILE, len(rows) // 4):
        return None
    target = -(-live // ROW_TILE) * ROW_TILE
    if pow2:
        target = max(ROW_TILE, 1 << (live - 1).bit_length())
    target = min(len(rows), target)
    if target == len(rows):
        return None
    keep = [i for i, r in enumerate(rows) if r >= 0]
    if target > live:
        keep = sorted(keep + [i for i, r in enumerate(rows) if r < 0][:target - live])
    return keep


def _completions(tokens: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams) -> list[Completion]:
    """Each row cut after its first stop (tokens past it were decoded before the host looked)."""
    return [cut_at_stop(toks, lps, params) for toks, lps in zip(tokens.tolist(), logprobs.tolist())]


def _by_length(sequences, dev) -> list[tuple[int, torch.Tensor]]:
    """Stop sequences grouped by length, each group an (n, count) tensor on ``dev``: a decode step
    compares a row's last n tokens with every sequence of n at once, not one sequence at a time."""
    groups: dict[int, list] = {}
    for q in sequences:
        groups.setdefault(len(q), []).append(q)
    return [(n, torch.tensor(qs, device=dev).t()) for n, qs in sorted(groups.items())]


class EmbeddedEngine:
    name = "embedded"
    runs_adapters = True  # its copy of the model runs LoRA adapters as the trainer's does (models/lora.py)

    def __init__(self, model: torch.nn.Module, flow, width: int, max_batch: int = 256, cuda_graphs: bool = True):
        """``model`` is copied: the engine owns its weights and gets new ones only by ``load_weights``.

        On a GPU the engine decodes in one KV cache allocated once (``StaticCacheStorage``),
        shrinking batches in place, and replays decode steps as CUDA graphs (``cuda_graphs``)."""
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
        # host syncs to look for stopped rows: every token on CPU (rows leave the batch at once),
        # every 8 tokens on a GPU, where a sync stalls the launch queue
        self.check_every = 1 if self.device.type == "cpu" else 8
        self.static = self.device.type == "cuda"  # one cache buffer, compacted in place
        self._static_storage = None
        self.graphs = None
        if self.static and cuda_graphs:
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model)

    def _static(self, batch: int):
        """The one cache buffer a GPU engine decodes in (grown if a chunk needs more rows)."""
        st = self._static_storage
        if st is None or st.batch < batch or st.kv.dtype != self.model.cache_dtype():
            self._static_storage = None
            st = self._static_storage = self.model.static_storage(max(batch, self.max_batch), self.width)
        return st

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

    @torch.inference_mode()
    def load_weights(self, payload: WeightPayload) -> None:
        """The trainer's weights, into the engine. In inference mode, as ``generate``: the cached
        operands a rollout built (inference tensors) take new values in place, which torch allows
        only there."""
        params = dict(self.model.named_parameters())
        modules = dict(self.model.named_modules())
        for name in payload.tensors:
            if name not in params:
                raise JetrlError(f"weight sync: the rollout model has no parameter {name}")
        # on a GPU a layer holds its GEMM operand only: bf16, or 8-bit with its scales, quantized here
        # once per sync when the payload is full precision (`weight_sync: hp`), the layers of one
        # precision together (``weight_operands``: one launch for all FP8 weights)
        by_spec: dict = {}
        for name, t in payload.tensors.items():
            mod = modules.get(name.rsplit(".", 1)[0])
            if isinstance(t, torch.Tensor) and self._holds_operand(mod, name, t):
                by_spec.setdefault(mod.precision.fprop, []).append((name, t))
        cast = {}
        for spec, items in by_spec.items():
            cast.update(zip([n for n, _ in items], weight_operands([t for _, t in items], spec)))
        replaced = False
        for name, t in payload.tensors.items():
            mod = modules.get(name.rsplit(".", 1)[0])
            if isinstance(t, torch.Tensor):
                if name not in cast:
                    params[name].copy_(t)
                    continue
                t = cast[name]
            if not isinstance(mod, JetLinear):
                raise JetrlError(f"weight sync: {name} arrived quantized but is not a quantized layer here")
            # On a GPU the held operand (or its view into the group's stacked one) takes the new
            # values in place: nothing is held twice, and captured graphs keep their addresses.
            held = mod._wfixed
            mod.load_quantized_weight(t, in_place=self.static)
            replaced |= mod._wfixed is not held
        if self.static:
            if replaced:  # an operand took a new tensor: the graphs read the old one
                self.model.hold_weights_once()  # master copies freed, fused layers view their group's operand
            in_place = self.model.refresh_weights()  # (after hold_weights_once, which rebuilds group caches)
            if (replaced or not in_place) and self.graphs is not None:
                self.graphs.reset()  # a weight moved: capture again
        self.weights_version = payload.version

    def _holds_operand(self, mod, name: str, t: torch.Tensor) -> bool:
        """Whether the layer of parameter ``name`` keeps only its GEMM operand of ``t``: on a GPU, a
        linear layer holds its rollout weight's cast (bf16, or 8-bit with scales, made once per sync
        by the same quantizer as the trainer's), not the master copy beside it. (A ``hp`` payload
        into an FP8 engine used to keep both: 7.6 GB against bf16's 3.8 at the Qwen2.5-1.5B shape.)"""
        return self.static and isinstance(mod, JetLinear) and name.endswith(".weight") and native(t)

    def weight_nbytes(self) -> int:
        """Bytes the engine's weights take: parameters and the cached GEMM operands, each storage once."""
        from ..precision.gemm import ExactOperand
        from ..precision.quant import QTensor

        seen: dict[int, int] = {}

        def add(t):
            if isinstance(t, torch.Tensor) and t.numel():
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()

        for p in self.model.parameters():
            add(p)
        for mod in self.model.modules():
            for item in [getattr(mod, "_wfixed", None), *(v[1] for v in getattr(mod, "_cache", {}).values()),
                         *(mod.__dict__.get("_jet_group_cache") or (None, None, None))[1:]]:
                for x in item if isinstance(item, list) else [item]:
                    if isinstance(x, QTensor):
                        add(x.data), add(x.scale)
                    elif isinstance(x, ExactOperand):
                        add(x.values), add(x.scales)
                    else:
                        add(x)
        return sum(seen.values())

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seed: int | Sequence[int]) -> list[list[Completion]]:
        """``seed``: one int for the call, or one seed per prompt (a data-parallel rank's slice of
        ``prompt_seeds``). Each sample's noise is keyed by its prompt's seed and its index in the
        group (``sampling.sample_keys``), so chunking and compaction do not change the tokens."""
        check_prompts(prompts, params, self.width)
        seeds = prompt_seeds(seed, len(prompts))
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
        lens = [len(p) for p in distinct]
        ids = torch.zeros(len(distinct), max(lens), dtype=torch.long)  # built on the host, copied once
        for i, p in enumerate(distinct):
            ids[i, :len(p)] = torch.tensor(p)
        ids, lengths = ids.to(dev), torch.tensor(lens, device=dev)
        if self.static:  # prefill the distinct prompts, then fill the engine's one cache buffer
            first = self.model.new_cache(len(distinct), self.width)
            logits = self.model.prefill(ids, lengths, first)
            cache = self.model.new_cache(b, self.width, self._static(b))
            src = torch.tensor(which, device=dev)
            cache.fill_from(first, src)
            logits = logits[src]
            del first
        else:
            self._storage(0, b), self._storage(1, b)  # each holds the chunk's largest batch
            cache = self.model.new_cache(len(distinct), self.width, self._storage(0, len(distinct)))
            logits = self.model.prefill(ids, lengths, cache)
            if len(distinct) < b:
                src = torch.tensor(which, device=dev)
                cache.select(src, self._storage(1, b))
                logits = logits[src]
        spare = 0 if len(distinct) < b else 1  # the storage buffer the next select copies into
        # Sampled tokens and their logprobs stay on the device, written at every step; the host
        # looks at which rows stopped only every ``check_every`` steps (one sync), and rows that
        # stopped in between decode a few more tokens that are cut off at the end. Each row's
        # tokens depend on its own key and position only, so when the checks happen changes nothing.
        new = params.max_new_tokens
        out_tok = torch.zeros(new, b, dtype=torch.long, device=dev)  # step-major: a step's write is contiguous
        out_lp = torch.zeros(new, b, dtype=torch.float32, device=dev)
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], device=dev)
        stop_seqs = _by_length(params.stop_sequences, dev)
        rows = list(range(b))  # original index of each batch row; -1: finished, not yet dropped
        orig = list(range(b))  # original index of each batch row
        rows_t = torch.arange(b, device=dev)
        prompt_len = [len(p) for p in prompts]
        longest_prompt = max(prompt_len)
        done = torch.zeros(b, dtype=torch.bool, device=dev)  # per batch row
        live = b
        check_every = self.check_every
        invariant = invariant_for(self.model, logits)
        # greedy decoding reports logprobs at temperature 1, without truncation: what it samples
        # from already, unless top-k / top-p truncate it
        report_plain = params.greedy and (params.top_k or params.top_p < 1.0)
        for step in range(new):
            logp = sampling_logprobs(logits, params, invariant)
            logp_report = sampling_logprobs(logits, PLAIN, invariant) if report_plain else logp
            nxt = sample(logp, params, keys=keys, position=step)
            out_tok[step].index_copy_(0, rows_t, nxt)
            out_lp[step].index_copy_(0, rows_t, logp_report.gather(-1, nxt[:, None])[:, 0])
            done |= (nxt[:, None] == stop_ids).any(-1)  # not isin: with many stop ids it sorts, and syncs
            for n, seqs in stop_seqs:  # a row's last n tokens (its column of out_tok) against each sequence of n
                if step + 1 >= n:
                    last = out_tok[step + 1 - n:step + 1].index_select(1, rows_t)
                    done |= (last[:, :, None] == seqs[:, None, :]).all(0).any(-1)
            if step == new - 1:
                break
            if step % check_every == check_every - 1:
                for i, d in enumerate(done.tolist()):
                    if d and rows[i] >= 0:
                        rows[i] = -1
                        live -= 1
                if live == 0:
                    break
                keep = compaction(rows, live, pow2=self.graphs is not None)
                if keep is not None:
                    idx = torch.tensor(keep, device=dev)
                    if self.static:
                        cache.compact_(idx)
                    else:
                        cache.select(idx, self._storage(spare, len(keep)))
                        spare = 1 - spare
                    rows, orig = [rows[i] for i in keep], [orig[i] for i in keep]
                    nxt, keys, rows_t, done = nxt[idx], keys[idx], rows_t[idx], done[idx]
                    longest_prompt = max(prompt_len[o] for o in orig)
            # a row holds its prompt and step + 1 tokens: the host knows the key width without asking
            width = key_width(longest_prompt + step + 1)
            if self.graphs is not None:
                logits = self.graphs.decode(nxt, cache, width_bucket(width, cache.width))
            else:
                logits = self.model.decode(nxt, cache, width)
        return _completions(out_tok.t().cpu(), out_lp.t().cpu(), params)
