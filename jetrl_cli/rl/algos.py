"""The RL math as pure functions of tensors: advantages, importance ratios, corrections, losses.

Shapes: per-token tensors are ``(sequences, positions)`` with a boolean ``mask`` of completion
tokens. ``logp_rollout`` is what the rollout engine reported (behaviour policy, rollout precision);
``logp_old`` the same tokens scored by the trainer before the update (training precision, the
"proximal" policy); ``logp`` the trainer's current, differentiable logprobs.

``importance`` is the one function computing the rollout-vs-trainer ratio, the correction it
implies and the mismatch metrics; the trainer, the run logs and ``mismatch-report`` all call it.

Corrections (``CorrectionConfig.type``):

- ``none``: the PPO ratio is ``pi/pi_old``; the rollout policy is ignored.
- ``tis``  (FlashRL): token weight ``min(exp(logp_old - logp_rollout), tis_cap)``; with
  ``tis_level: sequence`` every token of a sequence gets its sequence's weight, the product of its
  tokens' ratios capped (the unbiased sequence-level estimator), ``geometric`` their geometric mean
  capped (verl's levels; ``acr``'s TIS weight follows ``tis_level`` too).
- ``mis``  masked IS: tokens (``mis_level: token``) or whole sequences (``sequence``: geometric
  mean ratio; verl's ``seq_mean_k1``) whose ratio leaves ``[mis_low, mis_high]`` drop out of the loss
  altogether, as verl's rejection sampling drops them from its response mask: from the policy term,
  the KL and entropy terms and the loss denominators (``loss_tokens``). Kept tokens are unweighted.
- ``acr``  (QuRL): TIS weight, and the upper clip bound per token becomes ``(1+eps_high)/r`` with
  ``r = pi_old/pi_rollout``.

Loss aggregation (``TrainConfig.loss_agg``, verl's names; ``loss_denominator``):

- ``token-mean`` (DAPO; the default): a mini-batch's token terms summed and divided by its
  completion tokens. Every token weighs the same, so a long completion weighs more than a short one.
- ``seq-mean-token-mean`` (GRPO): each sequence's terms divided by its own completion tokens, then
  averaged over the mini-batch's sequences. Every sequence weighs the same, so a token of a short
  completion weighs more than one of a long completion.
- ``seq-mean-token-sum``: each sequence's terms summed, then averaged over the mini-batch's sequences
  (verl's name): a sequence weighs as many times more as it has tokens, and the loss grows with the length.
- ``seq-mean-token-sum-norm`` (Dr. GRPO, with ``adv_norm: none``): the token terms summed and
  divided by sequences x ``max_new_tokens``: one constant weight per token, whatever the lengths.
  That is Dr. GRPO's ``1 / (G * L_max)``; verl's ``agg_loss`` of that name divides by the length only,
  a loss (and gradient) as many times larger as the mini-batch has sequences.

Policy losses (``TrainConfig.policy_loss``, ``policy_loss(mode=...)``):

- ``ppo``: the token-level clipped ratio ``pi/pi_old`` (PPO, GRPO, DAPO; the default).
- ``gspo`` (GSPO, Zheng et al. 2025): one ratio per sequence, the geometric mean
  ``s = exp(mean_t log(pi_t/pi_old_t))`` over its completion tokens, clipped as a whole. Written
  per token as ``sg[s] * pi_t / sg[pi_t]`` (GSPO-token), whose value is ``s`` at every token and
  whose gradient, summed over a sequence's tokens and divided by its length
  (``seq-mean-token-mean``, GSPO's aggregation), is ``grad s``. Sequence ratios stay close to 1:
  GSPO clips at ``clip_low: 3e-4``, ``clip_high: 4e-4``; a preset with ``gspo`` must aggregate
  with ``seq-mean-token-mean`` (verl's GSPO loss forces it).

Ratios are exponentiated from log-ratios clamped to [-20, 20] (verl's bound): a token whose logprob
moved by more cannot overflow the loss to inf or its gradient to NaN.

``dual_clip: c`` (> 1; dual-clip PPO, verl's ``clip_ratio_c``) bounds a negative advantage's term
at ``c * A``: a token whose ratio grew far beyond the clip range cannot push the loss without end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..choices import ADV_ESTIMATORS, CORRECTIONS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, TIS_LEVELS  # noqa: E402

RATIO_CLAMP = 20.0  # |log-ratio| bound before an exp (the PPO ratio, k3's): verl's
K3_MAX = 10.0  # k3's per-token bound: verl's


@dataclass(frozen=True)
class CorrectionConfig:
    type: str = "none"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    mis_level: str = "token"
    tis_level: str = "token"


@dataclass
class Importance:
    log_ratio: torch.Tensor  # logp_old - logp_rollout, 0 outside the mask
    weight: torch.Tensor  # per-token multiplier of the policy-gradient term (detached)
    keep: torch.Tensor  # tokens that stay in the loss
    clip_high: torch.Tensor | None  # per-token upper clip bound of pi/pi_old (None: 1 + eps_high)
    metrics: dict


def group_advantages(rewards: torch.Tensor, norm: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(r - mean(group)) / (std(group) + eps)``; ``norm="none"``: mean-centred only (Dr. GRPO).

    ``rewards``: ``(groups, n)``. std is the population std (all n samples are the group; verl and
    TRL take Bessel's correction, so their advantages are ``sqrt((n - 1) / n)`` of these: 0.94x at
    n = 8)."""
    r = rewards.double()
    centred = r - r.mean(-1, keepdim=True)
    if norm == "std":
        centred = centred / (r.std(-1, unbiased=False, keepdim=True) + eps)
    elif norm != "none":
        raise ValueError(f"unknown advantage normalisation {norm!r}")
    return centred.float()


def advantages(rewards: torch.Tensor, lengths: torch.Tensor, estimator: str = "grpo", norm: str = "std",
               eps: float = 1e-6) -> torch.Tensor:
    """Each sample's advantage, one per completion, from its group's rewards ``(groups, n)``:

    - ``grpo``: ``group_advantages(rewards, norm)``.
    - ``rloo`` (RLOO): the reward minus the mean of the group's *other* samples,
      ``n/(n-1) * (r - mean)``.
    - ``reinforce_plus_plus_baseline`` (REINFORCE++ with a group baseline, as verl): the reward
      minus its group's mean, then whitened over the whole batch's completion tokens (mean and
      unbiased variance with each sample counted once per token, ``lengths`` ``(groups, n)``).
    """
    if estimator == "reinforce_plus_plus":
        raise ValueError("reinforce_plus_plus gives each token its own advantage: call token_advantages")
    if estimator == "grpo":
        return group_advantages(rewards, norm, eps)
    r = rewards.double()
    centred = r - r.mean(-1, keepdim=True)
    if estimator == "rloo":
        n = r.shape[-1]
        return (centred * n / (n - 1)).float()
    if estimator == "reinforce_plus_plus_baseline":
        w = lengths.double()
        tokens = w.sum()
        mean = (w * centred).sum() / tokens.clamp_min(1)
        var = (w * (centred - mean) ** 2).sum() / (tokens - 1).clamp_min(1)
        return ((centred - mean) * torch.rsqrt(var + 1e-8)).float()
    raise ValueError(f"unknown advantage estimator {estimator!r} (allowed: {', '.join(ADV_ESTIMATORS)})")


def token_advantages(rewards: torch.Tensor, mask: torch.Tensor,
                     token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ (verl's ``reinforce_plus_plus``): each completion token's return -- the sum of the
    rewards from that token to the completion's end (no discount: verl's default gamma of 1) -- whitened
    over all the batch's completion tokens (their mean, and their variance with Bessel's correction, as
    verl's ``masked_whiten``); 0 outside the completions.

    ``rewards`` ``(N,)``: each completion's reward, given at its last token. ``mask`` ``(N, T)``: the
    completion tokens. ``token_rewards`` ``(N, T)``: rewards at every token besides (``kl_in_reward``'s
    ``-kl_coef * KL``), or None."""
    m = mask.bool()
    r = torch.zeros(m.shape, dtype=torch.float64)
    if token_rewards is not None:
        r = torch.where(m, token_rewards.double(), 0.0)
    counts = m.long().cumsum(-1)
    last = m & (counts == counts[:, -1:])  # each completion's last token
    r = r + torch.where(last, rewards.double()[:, None], 0.0)
    returns = r.flip(-1).cumsum(-1).flip(-1)
    values = returns[m]
    if values.numel() == 0:
        return torch.zeros(m.shape)
    mean = values.mean()
    var = values.var(correction=1) if values.numel() > 1 else values.new_zeros(())
    return torch.where(m, (returns - mean) * torch.rsqrt(var + 1e-8), 0.0).float()


def adaptive_kl_coef(coef: float, current_kl: float, n_steps: int, target: float, horizon: int) -> float:
    """The adaptive KL controller (Ziegler et al. 2019, verl's ``AdaptiveKLController``): the coefficient times
    ``1 + e * n_steps / horizon``, ``e`` the KL's relative error against ``target`` clipped to [-0.2, 0.2];
    ``n_steps``: the step's sequences (verl's batch size)."""
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi: ``k1 = log(pi/pi_ref)``
    (unbiased, can be negative; verl's ``kl``), ``k2 = (log(pi/pi_ref))^2 / 2`` (verl's ``mse``),
    ``k3 = pi_ref/pi - 1 - log(pi_ref/pi)`` (unbiased, never negative; verl's ``low_var_kl``, with its
    clamps: the log-ratio to [-20, 20], the estimate to at most 10 -- one token far from the reference
    would otherwise dominate the term, up to inf). k1 and k2 take the same log-ratio bound: with top-k
    or top-p, a token beyond the reference's cut has ``pi_ref = 0``. ``abs``: ``|log(pi/pi_ref)|`` (verl's).
    ``k1+`` / ``k3+`` (verl's straight-through forms): the value of k1 / k3, the gradient of k2 (whose
    gradient is the unbiased one of KL(pi || pi_ref)'s)."""
    if estimator.endswith("+") and estimator[:-1] in ("k1", "k3"):
        value = kl_penalty(logp, logp_ref, estimator[:-1])
        grad = kl_penalty(logp, logp_ref, "k2")
        return grad - grad.detach() + value.detach()
    if estimator == "abs":
        return (logp - logp_ref).clamp(-RATIO_CLAMP, RATIO_CLAMP).abs()
    if estimator == "k1":
        return (logp - logp_ref).clamp(-RATIO_CLAMP, RATIO_CLAMP)
    if estimator == "k2":
        return 0.5 * (logp - logp_ref).clamp(-RATIO_CLAMP, RATIO_CLAMP) ** 2
    if estimator == "k3":
        dl = (logp_ref - logp).clamp(-RATIO_CLAMP, RATIO_CLAMP)
        return (torch.exp(dl) - dl - 1).clamp(max=K3_MAX)
    raise ValueError(f"unknown KL estimator {estimator!r} (allowed: {', '.join(KL_ESTIMATORS)})")


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment, added to a completion's reward: 0 up to ``max_new_tokens -
    buffer`` tokens, then falling linearly to ``-factor`` at ``max_new_tokens`` (``buffer`` 0: off)."""
    excess = length - (max_new_tokens - buffer)
    if buffer <= 0 or excess <= 0:
        return 0.0
    return -factor * min(excess / buffer, 1.0)


def mismatch_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                     cfg: CorrectionConfig | None = None) -> dict:
    """How far the rollout policy is from the trainer's, on the rollout's own tokens.

    ``mismatch_kl`` is KL(rollout || train) by the k3 estimator ``E[r - 1 - log r]``, ``r =
    pi_train/pi_rollout`` (non-negative, exactly 0 when the logprobs are bitwise equal);
    ``mismatch_k1`` the plain ``E[log pi_rollout - log pi_train]``.

    ``chi2`` estimates the chi-square divergence of the importance weights, ``E_rollout[r^2] - 1``,
    self-normalised: ``mean((r - mean r)^2) / (mean r)^2`` (= ``mean(r^2)/mean(r)^2 - 1``). The
    plain ``mean(r^2) - 1`` assumes the sample mean of ``r`` is 1, which it is only in expectation:
    on a batch whose weights are all a little below 1 it goes negative (-3.45e-05 was reported for
    ``fp8-rollout``), impossible for a divergence. The self-normalised form is a variance over a
    square, so never negative, 0 exactly when all weights are equal, and consistent with ``ess``:
    ``ess = 1 / (1 + chi2)`` (Kish's effective sample size, as a fraction of the tokens)."""
    cfg = cfg or CorrectionConfig()
    m = mask.bool()
    n_all = int(m.sum())
    if n_all == 0:
        return {"mismatch_kl": 0.0, "mismatch_k1": 0.0, "tokens": 0}
    m = supported(m, logp_train)
    n = int(m.sum())
    outside = 1 - n / n_all
    if n == 0:
        return {"mismatch_kl": 0.0, "mismatch_k1": 0.0, "tokens": n_all, "frac_outside_support": outside}
    log_r = torch.where(m, logp_train.double() - logp_rollout.double(), 0.0)  # padding (even NaN) never read
    d = log_r[m]
    r = d.exp()
    seq_lr = log_r.sum(-1)
    has = m.sum(-1) > 0
    w = r
    raw = _tis_raw(log_r, m, cfg)[m]  # the TIS weight before its cap, at the correction's level
    p_train, p_rollout = logp_train.double()[m].exp(), logp_rollout.double()[m].exp()
    return {
        "mismatch_kl": float((torch.expm1(d) - d).mean()),  # r - 1 - log r, without r - 1's cancellation
        "mismatch_k1": float((-d).mean()),
        "abs_dlogp_mean": float(d.abs().mean()),
        "abs_dlogp_max": float(d.abs().max()),
        "abs_dp_mean": float((p_train - p_rollout).abs().mean()),
        "abs_dp_max": float((p_train - p_rollout).abs().max()),
        "prob_err": float(torch.expm1(d.abs()).mean()),  # mean |r - 1| in the larger direction: 0 when equal
        "chi2": float(((w - w.mean()) ** 2).mean() / w.mean() ** 2),
        "ess": float(w.sum() ** 2 / (n * (w * w).sum())),
        "frac_bitwise_equal": float((d == 0).double().mean()),
        "frac_above_tis_cap": float((raw > cfg.tis_cap).double().mean()),
        "frac_outside_mis": float(1 - _mis_keep(log_r, log_r.exp(), m, cfg)[m].double().mean()),
        "seq_log_ratio_mean": float(seq_lr[has].mean()),
        "seq_log_ratio_abs_max": float(seq_lr[has].abs().max()),
        "tokens": n_all,
        "frac_outside_support": outside,
    }


def supported(mask: torch.Tensor, logp_train: torch.Tensor) -> torch.Tensor:
    """The tokens of ``mask`` that the trainer's sampling distribution can draw: with top-k or top-p, a
    token the rollout sampled may lie beyond the trainer's cut (its logprob -inf) where the two
    precisions place the cut differently. Such a token has no ratio: it leaves the loss, its
    denominators and the drift statistics (``frac_outside_support`` counts it), as verl's rejection
    sampling drops a token from the response mask. Only -inf: a NaN is a fault, and stops the step."""
    return mask.bool() & ~torch.isneginf(logp_train)


def importance(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
               cfg: CorrectionConfig, eps_high: float, with_metrics: bool = True) -> Importance:
    """The correction for these tokens; ``with_metrics=False`` skips the (host-syncing) metrics,
    for the trainer's micro-batches once the step's metrics were taken on the whole batch."""
    m = supported(mask, logp_old)
    log_r = torch.where(m, logp_old - logp_rollout, 0.0).detach()  # a padding value (even NaN) is never read
    r = log_r.exp()
    ones = torch.ones_like(r)
    weight, keep, clip_high = ones, m, None
    if cfg.type in ("tis", "acr"):
        weight = _tis_weight(log_r, r, m, cfg)
    elif cfg.type == "mis":
        keep = _mis_keep(log_r, r, m, cfg)
    elif cfg.type != "none":
        raise ValueError(f"unknown correction {cfg.type!r} (allowed: {', '.join(CORRECTIONS)})")
    if cfg.type == "acr":
        clip_high = (1 + eps_high) / r
    metrics = {}
    if with_metrics:
        metrics = mismatch_metrics(logp_old, logp_rollout, mask, cfg)
        n = int(mask.bool().sum())
        metrics["frac_masked"] = float(1 - keep.sum() / n) if n else 0.0  # MIS's and the support's drops
    return Importance(log_r, weight, keep, clip_high, metrics)


def _mis_keep(log_r: torch.Tensor, r: torch.Tensor, m: torch.Tensor, cfg: CorrectionConfig) -> torch.Tensor:
    """MIS's tokens kept: those whose ratio (``token``) or whose sequence's geometric-mean ratio
    (``sequence``) lies in ``[mis_low, mis_high]``."""
    if cfg.mis_level == "token":
        return m & (r >= cfg.mis_low) & (r <= cfg.mis_high)
    seq = (log_r.sum(-1) / m.sum(-1).clamp_min(1)).exp()[:, None]
    return m & (seq >= cfg.mis_low) & (seq <= cfg.mis_high)


def loss_tokens(mask: torch.Tensor, logp_old: torch.Tensor, logp_rollout: torch.Tensor,
                cfg: CorrectionConfig) -> torch.Tensor:
    """The tokens a mini-batch's loss counts (``loss_denominator``'s ``mask``): its completion tokens,
    less those beyond the trainer's top-k/top-p cut (``supported``) and those MIS drops (``importance``'s
    ``keep``)."""
    m = supported(mask, logp_old)
    if cfg.type != "mis":
        return m
    log_r = torch.where(m, logp_old - logp_rollout, 0.0)
    return _mis_keep(log_r, log_r.exp(), m, cfg)


def _tis_raw(log_r: torch.Tensor, m: torch.Tensor, cfg: CorrectionConfig) -> torch.Tensor:
    """The TIS weight of each token before its cap, at ``cfg.tis_level``: the token's ratio, its sequence's
    ratio product, or their geometric mean (``log_r`` 0 off the mask ``m``)."""
    if cfg.tis_level == "token":
        return log_r.exp()
    seq = log_r.sum(-1)
    if cfg.tis_level == "geometric":
        seq = seq / m.sum(-1).clamp_min(1)
    elif cfg.tis_level != "sequence":
        raise ValueError(f"unknown tis_level {cfg.tis_level!r} (allowed: {', '.join(TIS_LEVELS)})")
    return seq.exp()[:, None].expand_as(log_r)


def _tis_weight(log_r: torch.Tensor, r: torch.Tensor, m: torch.Tensor, cfg: CorrectionConfig) -> torch.Tensor:
    """TIS's weight of each token: its own ratio (``token``), or its sequence's ratio product
    (``sequence``) or geometric mean (``geometric``), capped at ``tis_cap``. ``log_r`` is 0 off the
    mask ``m``, so a sequence's sum runs over its completion tokens."""
    return (r if cfg.tis_level == "token" else _tis_raw(log_r, m, cfg)).clamp(max=cfg.tis_cap)


def loss_denominator(mask: torch.Tensor, agg: str, max_new_tokens: int) -> float:
    """What the summed loss terms of a mini-batch (``mask``: its completion tokens, one row per
    sequence) are divided by under ``agg``: its completion tokens (``token-mean``), its sequences
    (``seq-mean-token-mean``; ``policy_loss`` divides each sequence's terms by its length first) or
    its sequences x ``max_new_tokens`` (``seq-mean-token-sum-norm``), its sequences again for
    ``seq-mean-token-sum`` (each sequence's terms summed). Sequences without a completion
    token add no term and are not counted. One number for the whole mini-batch, however its
    micro-batches or ranks split it."""
    if agg == "token-mean":
        return float(mask.sum().clamp_min(1))
    seqs = float((mask.sum(-1) > 0).sum().clamp_min(1))
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return seqs
    if agg == "seq-mean-token-sum-norm":
        return seqs * max_new_tokens
    raise ValueError(f"unknown loss aggregation {agg!r} (allowed: {', '.join(LOSS_AGGREGATIONS)})")


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                imp: Importance, clip_low: float, clip_high: float, denom: float,
                logp_ref: torch.Tensor | None = None, kl_coef: float = 0.0,
                agg: str = "token-mean", mode: str = "ppo", dual_clip: float = 0.0,
                kl_estimator: str = "k3", entropy: torch.Tensor | None = None,
                entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """PPO-clip loss (DAPO's clip-higher: separate low/high epsilon) with the ratio of ``mode``
    (``ppo``: per token; ``gspo``: per sequence), summed over tokens and divided by ``denom``
    (``loss_denominator`` of the whole mini-batch under ``agg``; ``seq-mean-token-mean`` divides
    each sequence's sum by its completion tokens first). ``dual_clip`` > 0 bounds the terms of
    negative advantages at ``dual_clip * A``.

    ``adv``: per sequence ``(N,)`` or per token ``(N, T)``. With ``kl_coef`` the ``kl_estimator``
    estimate of KL(pi || pi_ref) (``kl_penalty``) is added per token. With ``entropy_coef`` the policy's
    entropy at each token (``entropy``, differentiable) is subtracted, aggregated the same way
    (an entropy bonus: the update raises the entropy). The statistics are 0-dim device tensors (no host sync);
    the clipped fraction is ``clipped_tokens / loss_tokens``, over as many calls as make a batch."""
    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r} (allowed: {', '.join(LOSS_AGGREGATIONS)})")
    if mode not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {mode!r} (allowed: {', '.join(POLICY_LOSSES)})")
    if mode == "gspo" and imp.clip_high is not None:
        raise ValueError("the gspo policy loss clips whole sequences; the acr correction's per-token "
                         "clip bound does not apply (use tis or mis)")
    m = mask.bool() & imp.keep  # tokens MIS drops, or beyond the trainer's top-k/top-p cut, leave every term
    # and every length; their logprobs (-inf beyond the cut) are replaced before any arithmetic, so that no
    # inf - inf reaches a term or, through a product by 0, its gradient
    logp, logp_old = torch.where(m, logp, 0.0), torch.where(m, logp_old, 0.0)
    per_seq = agg == "seq-mean-token-mean"
    lengths = m.sum(-1).clamp_min(1)

    def total(terms: torch.Tensor) -> torch.Tensor:  # the aggregated sum, before the division by denom
        return (terms.sum(-1) / lengths).sum() if per_seq else terms.sum()

    a = adv[:, None] if adv.dim() == 1 else adv
    if mode == "gspo":
        seq = torch.where(m, logp - logp_old, 0.0).sum(-1) / lengths  # log s: the mean log-ratio of each sequence
        log_ratio = logp - logp.detach() + seq.detach()[:, None]  # value log s, gradient that of log pi_t
        ratio = torch.exp(log_ratio.clamp(max=10.0))  # as verl: a runaway sequence cannot overflow
    else:
        ratio = torch.exp((logp - logp_old).clamp(-RATIO_CLAMP, RATIO_CLAMP))  # as verl: no inf, no NaN gradient
    upper = imp.clip_high if imp.clip_high is not None else torch.full_like(ratio, 1 + clip_high)
    clipped = torch.minimum(torch.clamp(ratio, min=1 - clip_low), upper)
    surr = torch.minimum(ratio * a, clipped * a)
    if dual_clip > 0:
        surr = torch.where(a < 0, torch.maximum(surr, dual_clip * a), surr)
    pg = -total(surr * imp.weight * m) / denom
    loss = pg
    stats = {"pg_loss": pg.detach()}
    with torch.no_grad():
        stats["clipped_tokens"] = ((surr != ratio * a) & m).sum()
        stats["loss_tokens"] = m.sum()
    if logp_ref is not None and kl_coef > 0:
        kl = torch.where(m, kl_penalty(logp, logp_ref, kl_estimator), 0.0)
        kl_term = total(kl) / denom
        loss = loss + kl_coef * kl_term
        stats["kl_ref"] = kl_term.detach()
    if entropy is not None and entropy_coef > 0:
        ent_term = total(torch.where(m, entropy, 0.0)) / denom
        loss = loss - entropy_coef * ent_term
        stats["entropy_bonus"] = ent_term.detach()
    return loss, stats
