"""The GRPO trainer: scores rollouts under the training precision and updates the policy.

Its model holds fp32 master weights; ``apply_flow(model, flow, "train")`` makes every forward
run the flow's training precision (for the unified flow, the rollout's quantizers). AdamW keeps its
state in fp32 (fused on CUDA). Sequences are right-padded (each starts at index 0, as in the
engine's KV cache), so the trainer's scores reproduce the engine's numerics exactly when the
precisions agree.

Logprobs are computed without a ``[batch, seq, vocab]`` tensor: only completion positions are
scored, ``LOGPROB_CHUNK_ELEMENTS`` logits at a time. Each row goes through the same ``logits`` ->
``sampling_logprobs`` as in the rollout engine (``gathered_logprobs``: its values at the tokens), so
the two agree bit for bit. With autograd the logits are recomputed in the backward instead of kept:
over vocabulary slices of all rows, from each row's log-normalizer (``rl.head_grad``), or, for
top-k / top-p sampling and an 8-bit lm_head, chunk by chunk of rows, the chunks' lm_head weight
gradients added into one buffer (``summing_wgrad``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..choices import LR_SCHEDULES
from ..config import TrainConfig
from ..engine.sampling import SamplingParams, gathered_logprobs, gathered_logprobs_entropy, invariant_for
from ..errors import JetrlError, is_out_of_memory
from ..precision.gemm import configure_cuda_numerics
from ..precision.linear import (JetLinear, adapters_disabled, apply_flow, batch_weight_casts, grads_in_place,
                                mark_updated, releasing_weights, summing_wgrad)
from .head_grad import head_logprobs, sliced_backward_applies

# Logits held at once: 128M fp32 values (512 MiB), whatever the vocab: 768 rows at a 152K vocabulary,
# a multiple of 128 rows for the GEMMs; the backward's vocabulary slices hold as many. A row-chunked
# backward also reads and writes the whole lm_head weight gradient per chunk (vocab x hidden fp32:
# 933 MB for Qwen2.5-1.5B), so chunks are few and large (1 << 25 made it 220 rows and 38 chunks).
LOGPROB_CHUNK_ELEMENTS = 1 << 27
_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
from .algos import CorrectionConfig, importance, loss_denominator, loss_tokens, policy_loss


class NonFiniteError(JetrlError):
    exit_code = 3


class MicroBatchOutOfMemory(JetrlError):
    """A micro-batch (of the update or of scoring) did not fit in the device's memory."""


@dataclass
class Batch:
    """Right-padded prompt+completion sequences; position t of ``mask``/``rollout_logp`` scores
    token t+1 of ``ids``."""

    ids: torch.Tensor  # (N, T) long
    mask: torch.Tensor  # (N, T-1) bool: completion tokens
    rollout_logp: torch.Tensor  # (N, T-1) fp32, 0 outside the mask
    rewards: torch.Tensor  # (N,)
    group: torch.Tensor  # (N,) group index

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
              rewards: list[float], group: list[int], pad_id: int = 0) -> "Batch":
        n = len(prompts)
        t = max(len(p) + len(c) for p, c in zip(prompts, completions))
        ids = torch.full((n, t), pad_id, dtype=torch.long)
        mask = torch.zeros(n, t - 1, dtype=torch.bool)
        lp = torch.zeros(n, t - 1)
        for i, (p, c, l) in enumerate(zip(prompts, completions, logprobs)):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
            mask[i, len(p) - 1:len(p) - 1 + len(c)] = True
            lp[i, len(p) - 1:len(p) - 1 + len(c)] = torch.tensor(l, dtype=torch.float32)
        return cls(ids, mask, lp, torch.tensor(rewards, dtype=torch.float32), torch.tensor(group))

    def __len__(self) -> int:
        return self.ids.shape[0]

    def select(self, idx: torch.Tensor) -> "Batch":
        mask = self.mask[idx]
        t = int(mask.any(0).nonzero().max()) + 2 if mask.any() else self.ids.shape[1]
        return Batch(self.ids[idx, :t], mask[:, :t - 1], self.rollout_logp[idx, :t - 1], self.rewards[idx],
                     self.group[idx])


def fold_invariant_scale(model: torch.nn.Module, s: float) -> None:
    """QuRL invariant scaling: ``W x = (W / s)(s x)`` with ``s`` folded into the RMSNorm before each
    quantized projection group (attention q/k/v, MLP gate/up). The function is unchanged."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.mul_(s)
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.weight.div_(s)
            layer.post_attention_layernorm.weight.mul_(s)
            for lin in (layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight.div_(s)


def _chunk_logprobs(model, h: torch.Tensor, targets: torch.Tensor, sampling: SamplingParams,
                    entropy: bool = False) -> torch.Tensor:
    """Logprobs of a chunk of rows (``entropy``: stacked with the rows' entropies, (2, rows))."""
    logits = model.logits(h)
    invariant = invariant_for(model, logits)
    if entropy:
        return torch.stack(gathered_logprobs_entropy(logits, targets, sampling, invariant))
    return gathered_logprobs(logits, targets, sampling, invariant)


def _logprob_rows(model) -> int:
    """Rows of logits held at once: ``LOGPROB_CHUNK_ELEMENTS`` values, a multiple of 128 rows."""
    step = max(1, LOGPROB_CHUNK_ELEMENTS // model.config.vocab_size)
    return step // 128 * 128 or step


def target_logprobs(model, h: torch.Tensor, targets: torch.Tensor, sampling: SamplingParams,
                    entropy: bool = False) -> torch.Tensor:
    """``log p(targets[i] | h[i])`` under the sampling distribution, for rows ``h`` (n, hidden),
    a chunk of rows at a time; ``entropy``: stacked with each row's entropy of the sampling
    distribution, (2, n) (the logprobs the same bits). With autograd the logits are recomputed in
    the backward rather than kept (one extra lm_head forward per update, instead of vocab-sized
    activations): over vocabulary slices (``head_grad.head_logprobs``) where it applies, else chunk
    by chunk (a checkpoint each), the chunks' lm_head weight gradients summed in one buffer, handed
    to autograd once."""
    n = h.shape[0]
    step = _logprob_rows(model)
    grad = torch.is_grad_enabled() and h.requires_grad
    if n <= step and not grad:
        return _chunk_logprobs(model, h, targets, sampling, entropy)
    if grad and sliced_backward_applies(model, sampling):
        return head_logprobs(model, h, targets, sampling, step, LOGPROB_CHUNK_ELEMENTS, entropy)
    head = getattr(model, "lm_head", None)
    parts = []
    rows = getattr(model, "embed_slot", None)
    with summing_wgrad(head, rows) if grad and isinstance(head, JetLinear) else contextlib.nullcontext():
        for s in range(0, n, step):
            hc, tc = h[s:s + step], targets[s:s + step]
            if grad:
                from torch.utils.checkpoint import checkpoint

                parts.append(checkpoint(_chunk_logprobs, model, hc, tc, sampling, entropy, use_reentrant=False))
            else:
                parts.append(_chunk_logprobs(model, hc, tc, sampling, entropy))
    return torch.cat(parts, dim=-1)


def _to(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` on ``dev``. A host tensor goes to a GPU from pinned memory, asynchronously: a blocking
    copy (or one from pageable memory) may wait for all the work queued on the stream. torch's
    caching host allocator keeps the pinned block until the copy has run."""
    if t.device.type == "cpu" and dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def token_logprobs(model, b: Batch, sampling: SamplingParams, entropy: bool = False) -> torch.Tensor:
    """``b``'s completion tokens' logprobs under ``model`` and the sampling distribution (0 off the
    mask). ``entropy``: stacked with the sampling distribution's entropy at each of those tokens,
    (2, sequences, positions); with autograd, both differentiable."""
    dev = next(model.parameters()).device
    ids = _to(b.ids, dev)
    graphs = model.__dict__.get("trunk_graphs")
    if graphs is not None and graphs.applies(model, ids):
        from .train_graphs import bucket

        ids = torch.nn.functional.pad(ids, (0, bucket(ids.shape[1]) - ids.shape[1]))  # a few shapes to capture
    where = tuple(_to(w, dev) for w in b.mask.nonzero(as_tuple=True))  # indices from the host copy of the mask
    targets = ids[:, 1:][where]
    # inside forward, so module hooks (FSDP's parameter gathering) cover the lm_head too
    lp = model(ids, head=lambda m, h: target_logprobs(m, h[:, :-1][where], targets, sampling, entropy))
    if entropy:
        out = torch.zeros((2, *b.mask.shape), dtype=lp.dtype, device=dev)
        out[:, where[0], where[1]] = lp
        return out
    return torch.zeros(b.mask.shape, dtype=lp.dtype, device=dev).index_put(where, lp)


def sequence_lengths(b: Batch) -> torch.Tensor:
    """Each sequence's length as ``Batch.select`` pads to it: through its last completion token (1 without any)."""
    m = b.mask
    last = m.shape[1] - 1 - m.flip(1).int().argmax(1)
    return torch.where(m.any(1), last + 2, 1)


def plan_micro_batches(b: Batch, rows: torch.Tensor, size: int, tokens: int = 0) -> list[torch.Tensor]:
    """Sequences ``rows`` of ``b`` as micro-batches: ``size`` sequences each, in their order; with ``tokens`` > 0
    (``train.micro_batch_tokens``) also at most ``tokens`` padded tokens each (sequences x the longest's length),
    the rows taken longest first so that a micro-batch pads little (verl's dynamic batch size). A row's
    logprobs do not depend on its micro-batch (the forward is row-invariant), so neither does the rollout
    equality; the loss is the same sum, added in another order."""
    if not tokens:
        return [rows[s:s + size] for s in range(0, len(rows), size)]
    lengths = sequence_lengths(b)[rows]
    order = torch.argsort(lengths, descending=True, stable=True)
    out, cur, longest = [], [], 0
    for i in order.tolist():
        n = int(lengths[i])
        if cur and (len(cur) == size or max(longest, n) * (len(cur) + 1) > tokens):
            out.append(rows[torch.tensor(cur)])
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(rows[torch.tensor(cur)])
    return out


def _oom(e: Exception, what: str, n: int, t: int, tokens: int = 0) -> JetrlError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    key = "train.micro_batch_tokens" if tokens else "train.micro_batch"
    return MicroBatchOutOfMemory(f"{key}: {what} {n} sequences x {t} tokens ran out of memory "
                                 f"({first[:120]}); lower {key}")


@torch.no_grad()
def score_logprobs(model, b: Batch, sampling: SamplingParams, micro_batch: int, width: int,
                   entropy: bool = False, tokens: int = 0) -> torch.Tensor:
    """What the trainer scores a batch with (its old-policy logprobs), ``micro_batch`` sequences at a
    time; ``mismatch-report`` calls it too, so both see the same numbers. ``entropy``: stacked with
    the sampling distribution's entropy at each completion token (the same logprob bits), (2, N, T).
    ``tokens``: ``train.micro_batch_tokens`` (``plan_micro_batches``)."""
    if b.ids.shape[1] > width:
        raise JetrlError(f"a sequence of {b.ids.shape[1]} tokens is longer than rollout.max_len ({width})")
    out = torch.zeros((2, *b.mask.shape) if entropy else b.mask.shape)
    for idx in plan_micro_batches(b, torch.arange(len(b)), micro_batch, tokens):
        mb = b.select(idx)
        try:
            out[..., idx, :mb.mask.shape[1]] = token_logprobs(model, mb, sampling, entropy).float().cpu()
        except Exception as e:  # noqa: BLE001 - an allocation that failed is the user's micro-batch; else re-raised
            if not is_out_of_memory(e):
                raise
            raise _oom(e, "scoring", len(idx), mb.ids.shape[1], tokens) from None
    return out


def adamw_kind(cuda: bool) -> dict:
    """AdamW's implementation: fused on CUDA (one kernel for all parameters), one parameter at a
    time on CPU."""
    return {"fused": True} if cuda else {"foreach": False}


class Trainer:
    def __init__(self, model, flow, tcfg, ccfg: CorrectionConfig, sampling: SamplingParams, width: int,
                 ref_model=None, hold_frozen: bool = False):
        self.model = model.train()
        self.ref = ref_model
        self.hold_frozen = hold_frozen
        self.kl_coef = tcfg.kl_coef  # the in-reward KL coefficient (train.kl_ctrl: adaptive moves it)
        self.flow, self.cfg, self.ccfg = flow, tcfg, ccfg
        self.sampling, self.width = sampling, width
        self.model.activation_checkpointing = tcfg.activation_checkpointing
        self._prepare()
        self.params = params = [p for p in self.model.parameters() if p.requires_grad]
        cuda = bool(params) and params[0].is_cuda
        if cuda:
            configure_cuda_numerics()
        self.opt = torch.optim.AdamW(
            params, lr=tcfg.lr, betas=tuple(tcfg.betas), eps=tcfg.adam_eps, weight_decay=tcfg.weight_decay,
            **adamw_kind(cuda),
        )
        self.updates = 0
        self.graphs = None  # the decoder layers' CUDA graphs (``train.cuda_graphs``, on a GPU)
        if tcfg.cuda_graphs and cuda:
            if not self.layer_graphs:
                raise JetrlError("train.cuda_graphs: not under torchrun (FSDP gathers each layer's weights in "
                                 "Python, which a graph would skip); set it to false")
            from .train_graphs import TrunkGraphs

            self.graphs = TrunkGraphs(self.model).install()

    # The frozen reference model holds its linear layers' forward weights only (natively: bf16 or
    # 8-bit, no fp32 master copy beside them). Not under FSDP, which shards the masters instead.
    freeze_reference = True
    # The model's FP8 weight groups are quantized together after each optimizer step
    # (``WeightCastBatch``). Not under FSDP, which gathers a layer's weights only for its own forward.
    batch_casts = True
    # ``train.cuda_graphs`` may replay the decoder layers as CUDA graphs (``rl.train_graphs``). Not under
    # FSDP, whose hooks gather each layer's weights in Python.
    layer_graphs = True

    def _prepare(self) -> None:
        """The training precision on the model, and on the frozen reference model."""
        apply_flow(self.model, self.flow, "train")
        if self.batch_casts:
            batch_weight_casts(self.model)
        if self.hold_frozen and self.freeze_reference:  # LoRA's frozen base: its operands only (not under FSDP)
            self.model.hold_frozen_weights()
        if self.ref is not None and self.ref is not self.model:  # (a LoRA model is its own reference)
            apply_flow(self.ref.eval(), self.flow, "train")
            for p in self.ref.parameters():
                p.requires_grad_(False)
            if self.freeze_reference:
                self.ref.freeze_weights()

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---------------------------------------------------------------- scoring

    @torch.no_grad()
    def score(self, b: Batch, ref: bool = False, entropy: bool = False) -> torch.Tensor:
        """Per-token logprobs of the batch's completions under the training precision (no grad);
        ``entropy``: stacked with the policy's entropy at those tokens (``score_logprobs``). A LoRA
        model's reference is the model itself with its adapters off: the base policy."""
        base = ref and self.ref is self.model
        with adapters_disabled() if base else contextlib.nullcontext():
            return score_logprobs(self.ref if ref else self.model, b, self.sampling, self.cfg.micro_batch,
                                  self.width, entropy, self.cfg.micro_batch_tokens)

    # ---------------------------------------------------------------- update

    def lr_at(self, step: int) -> float:
        return learning_rate(self.cfg, step)

    def update(self, b: Batch, adv: torch.Tensor, old: torch.Tensor, ref_logp: torch.Tensor | None,
               step: int) -> dict:
        """ppo_epochs x minibatches optimizer steps on the batch; returns averaged stats."""
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(step)
        gsplit = minibatch_groups(b.group, cfg.minibatches)
        agg: dict[str, float] = {}
        count = 0
        for _ in range(cfg.ppo_epochs):
            for gs in gsplit:
                idx = torch.isin(b.group, gs).nonzero()[:, 0]
                denom = loss_denominator(self.loss_tokens(b, idx, old), cfg.loss_agg, self.sampling.max_new_tokens)
                if self.graphs is None:
                    self.opt.zero_grad(set_to_none=True)
                else:  # the layers' gradients stay where the graphs add into them; the first backward writes them
                    self.graphs.stale_grads(self.params)
                plan = plan_micro_batches(b, idx, cfg.micro_batch, cfg.micro_batch_tokens)
                with grads_in_place():  # micro-batches after the first add into the gradients held
                    parts = [self._micro_step(b, sub, adv, old, ref_logp, denom, last=k == len(plan) - 1)
                             for k, sub in enumerate(plan)]
                total = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], 2.0)
                values, (gnorm, factor) = host_values(parts, total, clip_factor(total, cfg.grad_clip))
                add_minibatch(agg, values, gnorm, step)
                if factor < 1.0:  # else clipping would multiply every gradient by exactly 1
                    torch.nn.utils.clip_grads_with_norm_(self.params, cfg.grad_clip, total)
                self.opt.step()
                mark_updated(self.params)  # fused AdamW keeps versions: the weight caches would go stale
                bad = nonfinite_parameters([(n, p) for n, p in self.model.named_parameters() if p.requires_grad])
                if bad:
                    raise NonFiniteError(f"step {step}: parameter {bad[0]} became non-finite after the update")
                count += 1
        self.updates += count
        return {k: v / count for k, v in agg.items()}

    def loss_tokens(self, b: Batch, idx: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """The tokens of sequences ``idx`` that their mini-batch's loss counts (``algos.loss_tokens``:
        less those beyond the trainer's top-k/top-p cut and those the MIS correction drops)."""
        mask = b.mask[idx]
        t, dev = mask.shape[1], mask.device
        return loss_tokens(mask, old[idx, :t].to(dev), b.rollout_logp[idx, :t].to(dev), self.ccfg)

    def _micro_step(self, b: Batch, sub: torch.Tensor, adv: torch.Tensor, old: torch.Tensor,
                    ref_logp: torch.Tensor | None, denom: float, last: bool = False) -> tuple:
        """Forward and backward of sequences ``sub``'s share of the mini-batch loss. Returns
        ``(loss, stats)`` as device tensors: the host reads them once per mini-batch
        (``host_values``), so no micro-batch waits for the device. ``last``: the optimizer step's
        last micro-batch, whose backward drops each layer's cached weight operands once done with
        them (``releasing_weights``): the update that follows makes them stale."""
        with releasing_weights() if last else contextlib.nullcontext():
            return self._forward_backward(b, sub, adv, old, ref_logp, denom)

    def _forward_backward(self, b: Batch, sub: torch.Tensor, adv: torch.Tensor, old: torch.Tensor,
                          ref_logp: torch.Tensor | None, denom: float) -> tuple:
        cfg, dev = self.cfg, self._device
        mb = b.select(sub)
        t1 = mb.mask.shape[1]
        # host -> device copies without waiting for the device (a blocking one from pageable memory
        # waits for all queued work: the previous micro-batch's backward, or this one's forward)
        o, r = _to(old[sub, :t1], dev), _to(mb.rollout_logp, dev)
        m, a = _to(mb.mask, dev), _to(adv[sub] if adv.dim() == 1 else adv[sub, :t1], dev)  # per token: (N, T)
        rl = _to(ref_logp[sub, :t1], dev) if ref_logp is not None else None
        imp = importance(o, r, m, self.ccfg, cfg.clip_high, with_metrics=False)
        try:
            lp, ent = token_logprobs(self.model, mb, self.sampling, entropy=True) if cfg.entropy_coef else (
                token_logprobs(self.model, mb, self.sampling), None)
            loss, st = policy_loss(lp, o, a, m, imp, cfg.clip_low, cfg.clip_high, denom, rl, cfg.kl_coef,
                                   agg=cfg.loss_agg, mode=cfg.policy_loss, dual_clip=cfg.dual_clip,
                                   kl_estimator=cfg.kl_estimator, entropy=ent, entropy_coef=cfg.entropy_coef)
            loss.backward()
        except Exception as e:  # noqa: BLE001 - as in score_logprobs
            if not is_out_of_memory(e):
                raise
            raise _oom(e, "a micro-batch of", len(sub), mb.ids.shape[1], cfg.micro_batch_tokens) from None
        return loss.detach(), st


def minibatch_groups(group: torch.Tensor, minibatches: int) -> list[torch.Tensor]:
    """The batch's groups in ``minibatches`` runs, one optimizer step each: a batch with fewer groups
    (dynamic sampling kept few; a small rollouts file) takes one step per group rather than empty
    steps."""
    return [g for g in torch.tensor_split(group.unique(), minibatches) if len(g)]


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """The learning rate of the run's step ``step`` (1 to ``cfg.steps``): step s of the first
    ``warmup_steps`` trains at ``lr * s / warmup_steps``; then ``constant``: ``lr``, or ``cosine``:
    from ``lr`` at the first step after the warmup down to ``lr * min_lr_ratio`` at the last. A
    function of the step alone, so a resumed run continues the schedule."""
    w = cfg.warmup_steps
    if w and step <= w:
        return cfg.lr * max(step, 0) / w
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule != "cosine":
        raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r} (allowed: {', '.join(LR_SCHEDULES)})")
    progress = min((step - w - 1) / max(cfg.steps - w - 1, 1), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def clip_factor(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What ``clip_grads_with_norm_`` multiplies the gradients by (its formula, on the device)."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


def host_values(parts: list[tuple], *scalars: torch.Tensor) -> tuple[list[tuple[float, dict]], list[float]]:
    """The micro-batches' ``(loss, stats)`` and ``scalars`` (the gradient norm, the clipping factor)
    as Python numbers, in one device-to-host read.

    The optimizer step waits for this read anyway (a non-finite loss or norm stops it), so the
    gradients are clipped only when the factor is below 1: ``clip_grad_norm_`` multiplies them by
    the factor unconditionally, to spare a host sync that this step has already paid -- a read and
    write of every gradient (12 GB at the Qwen2.5-1.5B shape) for nothing when the norm is within
    the bound."""
    flat = [t for loss, st in parts for t in (loss, *st.values())]
    got = torch.stack([t.float() for t in flat] + [s.float() for s in scalars]).tolist()
    values, i = [], 0
    for _, st in parts:
        values.append((got[i], dict(zip(st, got[i + 1:i + 1 + len(st)]))))
        i += 1 + len(st)
    return values, got[i:]


def add_minibatch(agg: dict, values: list[tuple[float, dict]], gnorm: float, step: int) -> None:
    """Adds one mini-batch's micro-batch values (in micro-batch order) and gradient norm to ``agg``;
    a non-finite loss or norm stops the step before the optimizer runs. Loss terms add up over
    micro-batches; ``clip_frac`` is the mini-batch's clipped tokens over its loss tokens."""
    losses, sums = 0.0, {}
    for value, st in values:
        if not math.isfinite(value):
            raise NonFiniteError(f"step {step}: the loss is {value}; stopped before the update")
        losses += value
        for k, v in st.items():
            sums[k] = sums.get(k, 0.0) + v
    if not math.isfinite(gnorm):
        raise NonFiniteError(f"step {step}: the gradient norm is {gnorm}; stopped before the update")
    sums["clip_frac"] = sums.pop("clipped_tokens") / max(sums.pop("loss_tokens"), 1.0)
    sums["loss"], sums["grad_norm"] = losses, gnorm
    for k, v in sums.items():
        agg[k] = agg.get(k, 0.0) + v


def nonfinite_parameters(params: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the (name, tensor) pairs holding a NaN or an infinity, in order; one host sync
    when all are finite (the usual case). Each tensor's max |x| (NaN or inf exactly when it holds
    one; torch's norms propagate NaN) comes from a reduction that allocates nothing of its size:
    ``isfinite`` would build an fp32 ``abs`` and three bool tensors of each -- 1.6 GB for a 152K x
    1536 embedding, at the point of a step where every gradient is still held."""
    named = [(n, p.detach()) for n, p in params if p.numel()]
    if not named:
        return []
    amax = torch._foreach_norm([p for _, p in named], float("inf"))
    finite = torch.stack([a.float() for a in amax]).isfinite()
    if bool(finite.all()):
        return []
    return [n for (n, _), ok in zip(named, finite.tolist()) if not ok]
