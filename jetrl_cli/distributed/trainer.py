"""The GRPO trainer on FSDP2: the same ``score`` / ``update`` as ``rl.trainer.Trainer``, sharded.

Every rank holds the step's whole batch (samples are small next to weights, and the loop gathers
them after the rollout), so the shares need no communication to agree on: rank ``r`` scores the
``r``-th block of sequences and trains on the ``r``-th block of each mini-batch's groups (a group's
samples never split, and every rank knows every other rank's share).

What is global and how:

- the loss is divided by the mini-batch's token count over all ranks (read off the whole batch),
  and FSDP sums (not averages) the gradients, so the gradient is the single-process gradient;
- ``score`` all-gathers each rank's logprobs into the whole batch's tensor, so the importance
  ratios, mismatch metrics and advantages are computed on all sequences, as in one process;
- the loss terms and statistics of each micro-batch are gathered and added in the global
  micro-batch order (the order one process adds them);
- the gradient norm: ``World.exact`` (gloo) gathers each gradient whole and calls the very norm
  function ``clip_grad_norm_`` uses; otherwise FSDP's DTensor norm (NCCL, no full copies).

FSDP runs collectives in every forward and backward, so all ranks run the same number of them: a
rank with fewer micro-batches than another runs masked ones (a 2-token forward whose loss is
multiplied by 0, adding exact zeros to the gradient).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from ..errors import JetrlError
from ..precision.linear import adapters_disabled, releasing_weights
from ..rl.algos import loss_denominator
from ..rl.trainer import (Batch, NonFiniteError, Trainer, add_minibatch, clip_factor, host_values, minibatch_groups,
                          nonfinite_parameters, plan_micro_batches, score_logprobs)
from .sharding import quiet_fsdp_view_warning, set_gradient_sync, shard_model
from .world import World


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedTrainer(Trainer):
    freeze_reference = False  # FSDP shards its master weights (and needs them)
    batch_casts = False  # FSDP gathers a layer's weights for its own forward only
    layer_graphs = False  # FSDP's hooks gather each layer's weights in Python

    def __init__(self, model, flow, tcfg, ccfg, sampling, width, ref_model=None, *, world: World):
        self.world = world
        super().__init__(model, flow, tcfg, ccfg, sampling, width, ref_model)

    def _prepare(self) -> None:
        quiet_fsdp_view_warning()
        super()._prepare()  # before sharding: FSDP records each parameter's module
        shard_model(self.model, self.world.exact)
        if self.ref is not None and self.ref is not self.model:  # (a LoRA model is its own reference)
            shard_model(self.ref, self.world.exact)

    # ---------------------------------------------------------------- scoring

    @torch.no_grad()
    def score(self, b: Batch, ref: bool = False, entropy: bool = False) -> torch.Tensor:
        """The whole batch's logprobs (every rank gets all of them); each rank scores its block.
        ``entropy``: stacked with the entropies, as ``Trainer.score``; a LoRA model's reference is itself
        with its adapters off."""
        with adapters_disabled() if ref and self.ref is self.model else contextlib.nullcontext():
            return self._score(self.ref if ref else self.model, b, entropy)

    def _score(self, model, b: Batch, entropy: bool) -> torch.Tensor:
        if b.ids.shape[1] > self.width:
            raise JetrlError(f"a sequence of {b.ids.shape[1]} tokens is longer than rollout.max_len ({self.width})")
        mb, tokens = self.cfg.micro_batch, self.cfg.micro_batch_tokens
        shares = self.world.shards(len(b))
        mine = shares[self.world.rank]
        local = torch.zeros(2 if entropy else 1, len(mine), b.mask.shape[1])
        if len(mine):
            sub = b.select(torch.tensor(list(mine)))
            out = score_logprobs(model, sub, self.sampling, mb, self.width, entropy, tokens)
            local[..., :out.shape[-1]] = out
        counts = [len(plan_micro_batches(b, torch.tensor(list(s), dtype=torch.long), mb, tokens)) for s in shares]
        for _ in range(max(counts) - counts[self.world.rank]):
            model(b.ids[:1, :2].to(self._device))  # FSDP's all-gathers: as many forwards as the busiest rank
        full = torch.cat(self.world.all_gather_object(local), dim=1)
        return full if entropy else full[0]

    # ---------------------------------------------------------------- update

    def update(self, b: Batch, adv: torch.Tensor, old: torch.Tensor, ref_logp: torch.Tensor | None,
               step: int) -> dict:
        cfg, world = self.cfg, self.world
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(step)
        gsplit = minibatch_groups(b.group, cfg.minibatches)
        agg: dict[str, float] = {}
        count = 0
        dev = self._device
        for _ in range(cfg.ppo_epochs):
            for gs in gsplit:
                idx = torch.isin(b.group, gs).nonzero()[:, 0]
                denom = loss_denominator(self.loss_tokens(b, idx, old), cfg.loss_agg, self.sampling.max_new_tokens)
                plans = [plan_micro_batches(b, torch.isin(b.group, gs[r.start:r.stop]).nonzero()[:, 0],
                                            cfg.micro_batch, cfg.micro_batch_tokens) for r in world.shards(len(gs))]
                mine, rounds = plans[world.rank], max(len(p) for p in plans)
                self.opt.zero_grad(set_to_none=True)
                parts = []  # this rank's micro-batches: (loss, stats)
                for k in range(rounds):
                    set_gradient_sync(self.model, k == rounds - 1 or not world.exact)
                    last = k == rounds - 1  # the rank's last backward drops the cached weights
                    if k < len(mine):
                        parts.append(self._micro_step(b, mine[k], adv, old, ref_logp, denom, last=last))
                    else:
                        with releasing_weights() if last else contextlib.nullcontext():
                            (self.model(b.ids[:1, :2].to(dev)).sum() * 0.0).backward()
                total, full = self._grad_norm()
                values, (gnorm, factor) = host_values(parts, full, clip_factor(full, cfg.grad_clip))
                # rank order = the global micro-batch order; every rank raises on the same values
                add_minibatch(agg, [v for part in world.all_gather_object(values) for v in part], gnorm, step)
                if factor < 1.0:  # the same on every rank (the global norm); as in one process
                    torch.nn.utils.clip_grads_with_norm_(
                        [p for p in self.model.parameters() if p.grad is not None], cfg.grad_clip, total)
                self.opt.step()
                self._check_finite_params(step)
                count += 1
        self.updates += count
        return {k: v / count for k, v in agg.items()}

    def _grad_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients' global 2-norm, as ``clip_grads_with_norm_`` takes it and as a plain tensor:
        with ``World.exact`` from the gradients gathered whole (the same norm, bit for bit, as one
        process computes), else FSDP's sharded norm (a DTensor)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not self.world.exact:
            total = torch.nn.utils.get_total_norm(grads, 2.0)
            return total, total.full_tensor() if isinstance(total, DTensor) else total
        full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
        total = torch.nn.utils.get_total_norm(full, 2.0)
        return total, total

    def _check_finite_params(self, step: int) -> None:
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        mine = nonfinite_parameters([(n, _local(p)) for n, p in params])
        bad = set().union(*self.world.all_gather_object(mine))
        if bad:
            first = next(n for n, _ in params if n in bad)
            raise NonFiniteError(f"step {step}: parameter {first} became non-finite after the update")
