"""GRPO advantages, importance corrections and losses against hand-computed values."""

import contextlib
import copy
import math

import pytest
import torch

from jetrl_cli.choices import LOSS_AGGREGATIONS
from jetrl_cli.rl.algos import (CorrectionConfig, advantages, group_advantages, importance, kl_penalty,
                                loss_denominator, mismatch_metrics, policy_loss)

from .conftest import fresh_seed


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    a = group_advantages(r, "std", eps=0.0 + 1e-12)
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-6)  # mean .5, std .5
    assert torch.equal(a[1], torch.zeros(4))  # a flat group carries no signal
    std = math.sqrt((2.25**2 + 3 * 0.75**2) / 4)
    assert torch.allclose(a[2], torch.tensor([2.25, -0.75, -0.75, -0.75]) / std, atol=1e-6)
    assert torch.allclose(group_advantages(r, "none")[2], torch.tensor([2.25, -0.75, -0.75, -0.75]))
    with pytest.raises(ValueError):
        group_advantages(r, "max")


# A 2-sequence batch, 3 token slots, the last slot of sequence 1 is padding.
MASK = torch.tensor([[True, True, True], [True, True, False]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
ROLL = torch.tensor([[-1.1, -1.0, -0.5], [-0.3, -2.0, 0.0]])  # ratios e^.1, e^-1, 1 | 1, e^.8
LOGP = torch.tensor([[-0.9, -2.1, -0.2], [-0.6, -1.0, 0.0]])  # current policy
ADV = torch.tensor([1.0, -0.5])
EPS_L, EPS_H = 0.2, 0.28


def hand_loss(weights, keep, upper):
    total = 0.0
    for i in range(2):
        for t in range(3):
            if not MASK[i, t] or not keep[i][t]:
                continue
            ratio = math.exp(LOGP[i, t] - OLD[i, t])
            a = float(ADV[i])
            clipped = min(max(ratio, 1 - EPS_L), upper[i][t])
            total += -min(ratio * a, clipped * a) * weights[i][t]
    return total / 5  # token-level: divided by the 5 completion tokens


def r(i, t):
    return math.exp(float(OLD[i, t] - ROLL[i, t])) if MASK[i, t] else 1.0


@pytest.mark.parametrize("kind", ["none", "tis", "tis-sequence", "tis-geometric", "mis-token", "mis-sequence", "acr",
                                  "acr-sequence"])
def test_each_correction_loss_by_hand(kind):
    ctype, _, level = kind.partition("-")
    cfg = CorrectionConfig(ctype, tis_cap=1.05, mis_low=0.5, mis_high=1.45,
                           mis_level=level if ctype == "mis" else "token",
                           tis_level=level if ctype != "mis" and level else "token")
    imp = importance(OLD, ROLL, MASK, cfg, EPS_H)
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, imp, EPS_L, EPS_H, denom=5.0)
    ones = [[1.0] * 3 for _ in range(2)]
    keep = [[True] * 3 for _ in range(2)]
    upper = [[1 + EPS_H] * 3 for _ in range(2)]
    w = ones
    if ctype in ("tis", "acr"):
        w = [[min(r(i, t), 1.05) for t in range(3)] for i in range(2)]
    if level == "sequence" and ctype != "mis":  # ratio products e^(.1-1+0), e^(0+.8): one under the cap, one over
        w = [[math.exp(-0.9)] * 3, [1.05] * 3]
    if level == "geometric":  # e^-.3 and e^.4
        w = [[math.exp(-0.3)] * 3, [1.05] * 3]
    if ctype == "acr":
        upper = [[(1 + EPS_H) / r(i, t) for t in range(3)] for i in range(2)]
    if kind == "mis-token":
        keep = [[0.5 <= r(i, t) <= 1.45 for t in range(3)] for i in range(2)]
        assert keep[0][1] is False and keep[1][1] is False  # e^-1 and e^.8 leave the band
    if kind == "mis-sequence":
        seq = [math.exp((0.1 - 1.0 + 0.0) / 3), math.exp((0.0 + 0.8) / 2)]
        keep = [[0.5 <= seq[i] <= 1.45] * 3 for i in range(2)]
        assert keep == [[True] * 3, [False] * 3]  # e^-.3 in, e^.4 = 1.49 out
    assert float(loss) == pytest.approx(hand_loss(w, keep, upper), rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_tis_weights_of_each_level_on_random_batches(level):
    g = torch.Generator().manual_seed(fresh_seed())
    for _, old, _, mask in _random_batches(g):
        roll = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.3
        roll[~mask] = float("nan")  # off the mask: never read
        imp = importance(old, roll, mask, CorrectionConfig("tis", tis_cap=1.3, tis_level=level), EPS_H)
        for i in range(mask.shape[0]):
            d = [float(old[i, t] - roll[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
            for j, t in enumerate(t for t in range(mask.shape[1]) if mask[i, t]):
                want = {"token": math.exp(d[j]), "sequence": math.exp(sum(d)),
                        "geometric": math.exp(sum(d) / len(d))}[level]
                assert float(imp.weight[i, t]) == pytest.approx(min(want, 1.3), rel=1e-12)
    with pytest.raises(ValueError, match=r"unknown tis_level 'seq' \(allowed: token, sequence, geometric\)"):
        importance(old, old, mask, CorrectionConfig("tis", tis_level="seq"), EPS_H)


def test_tis_level_comes_from_the_preset_and_is_refused_where_it_does_nothing():
    from jetrl_cli.config import load_job_config
    from jetrl_cli.errors import PresetError
    from jetrl_cli.rl.loop import correction_config

    cfg = load_job_config("fp8-rollout-tis", ["correction.tis_level=geometric", "correction.tis_cap=3"])
    assert correction_config(cfg) == CorrectionConfig("tis", tis_cap=3.0, tis_level="geometric")
    with pytest.raises(PresetError, match=r"correction.tis_level: applies to correction.type tis or acr \(this one is 'mis'\)"):
        load_job_config("bf16", ["correction.type=mis", "correction.tis_level=sequence"])
    with pytest.raises(PresetError, match=r"correction.tis_level: applies to correction.type tis or acr \(this one is 'none'\)"):
        load_job_config("bf16", ["correction.tis_level=token"])  # written, even at its default: it does nothing here
    assert correction_config(load_job_config("bf16", ["correction.type=mis", "correction.mis_level=sequence"])) == \
        CorrectionConfig("mis", mis_level="sequence")
    with pytest.raises(PresetError, match=r"correction.mis_level: applies to correction.type mis \(this one is 'acr'\)"):
        load_job_config("qurl", ["correction.mis_level=sequence"])


def test_kl_penalty_by_hand():
    ref = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    imp = importance(OLD, OLD, MASK, CorrectionConfig(), EPS_H)
    loss, st = policy_loss(LOGP, OLD, torch.zeros(2), MASK, imp, EPS_L, EPS_H, 5.0, ref, kl_coef=0.1)
    k3 = sum(math.exp(float(ref[i, t] - LOGP[i, t])) - float(ref[i, t] - LOGP[i, t]) - 1
             for i in range(2) for t in range(3) if MASK[i, t])
    assert float(loss) == pytest.approx(0.1 * k3 / 5, rel=1e-5)
    assert float(st["kl_ref"]) == pytest.approx(k3 / 5, rel=1e-5)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "k1+", "k3+"])
def test_each_kl_estimator_by_hand(estimator):
    """Each estimator per token against its formula, on fresh random logprobs with padding, and the
    policy loss's KL term is the chosen one's, averaged over the completion tokens. The straight-through
    forms (``k1+``, ``k3+``) have k1's / k3's value and k2's gradient."""
    k3 = lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1  # noqa: E731
    by_hand = {"k1": lambda lp, rf: lp - rf, "k2": lambda lp, rf: 0.5 * (lp - rf) ** 2, "k3": k3,
               "abs": lambda lp, rf: abs(lp - rf), "k1+": lambda lp, rf: lp - rf, "k3+": k3}[estimator]
    g = torch.Generator().manual_seed(fresh_seed())
    for logp, old, _, mask in _random_batches(g):
        ref = logp + torch.randn(logp.shape, generator=g, dtype=torch.float64) * 0.5
        ref[~mask] = float("inf")  # padding may hold anything: it must not reach the loss
        got = kl_penalty(logp, ref, estimator)
        terms = [by_hand(float(logp[i, t]), float(ref[i, t])) for i, t in mask.nonzero().tolist()]
        assert got[mask].tolist() == pytest.approx(terms, rel=1e-12, abs=1e-15)
        imp = importance(old, old, mask, CorrectionConfig(), EPS_H)
        _, st = policy_loss(logp, old, torch.zeros(len(logp), dtype=torch.float64), mask, imp, EPS_L, EPS_H,
                            float(mask.sum()), ref, kl_coef=0.1, kl_estimator=estimator)
        assert float(st["kl_ref"]) == pytest.approx(sum(terms) / len(terms), rel=1e-12)
        x = logp.clone().requires_grad_()
        (kl_penalty(x, ref, estimator) * mask).sum().backward()
        if estimator.endswith("+"):  # k2's gradient: the log-ratio
            assert x.grad[mask].tolist() == pytest.approx((logp - ref)[mask].tolist(), rel=1e-12)
    assert float(kl_penalty(torch.zeros(1), torch.zeros(1), estimator)) == 0.0
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4' \(allowed: k1, k2, k3, abs, k1\+, k3\+\)"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_each_advantage_estimator_by_hand():
    g = torch.Generator().manual_seed(fresh_seed())
    rewards = torch.randint(0, 3, (4, 5), generator=g).float() / 2
    rewards[1] = 1.0  # a flat group
    lengths = torch.randint(1, 30, (4, 5), generator=g)
    assert torch.equal(advantages(rewards, lengths, "grpo", "none"), group_advantages(rewards, "none"))
    rloo = advantages(rewards, lengths, "rloo")
    for i, j in [(i, j) for i in range(4) for j in range(5)]:
        others = [float(rewards[i, k]) for k in range(5) if k != j]
        assert float(rloo[i, j]) == pytest.approx(float(rewards[i, j]) - sum(others) / 4, abs=1e-6)
    rpp = advantages(rewards, lengths, "reinforce_plus_plus_baseline")
    tokens = []  # every completion token's group-centred reward, as verl whitens them
    for i in range(4):
        mean = float(rewards[i].mean())
        for j in range(5):
            tokens += [float(rewards[i, j]) - mean] * int(lengths[i, j])
    mu = sum(tokens) / len(tokens)
    sd = math.sqrt(sum((x - mu) ** 2 for x in tokens) / (len(tokens) - 1) + 1e-8)
    for i in range(4):
        for j in range(5):
            want = (float(rewards[i, j]) - float(rewards[i].mean()) - mu) / sd
            assert float(rpp[i, j]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo' \(allowed: grpo, rloo, "):
        advantages(rewards, lengths, "ppo")


def _token_terms(logp, old, adv, mask, weight, upper):
    """The PPO-clip term of every completion token, by hand (Python floats), per sequence."""
    out = []
    for i in range(mask.shape[0]):
        row = []
        for t in range(mask.shape[1]):
            if mask[i, t]:
                ratio = math.exp(float(logp[i, t] - old[i, t]))
                a = float(adv[i])
                clipped = min(max(ratio, 1 - EPS_L), float(upper[i, t]))
                row.append(-min(ratio * a, clipped * a) * float(weight[i, t]))
        out.append(row)
    return out


def _aggregated_by_hand(terms, agg, max_new_tokens):
    seqs = [row for row in terms if row]
    if agg == "token-mean":
        return sum(map(sum, seqs)) / sum(map(len, seqs))
    if agg == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in seqs) / len(seqs)
    if agg == "seq-mean-token-sum":
        return sum(map(sum, seqs)) / len(seqs)
    return sum(map(sum, seqs)) / (len(seqs) * max_new_tokens)


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_each_loss_aggregation_by_hand(agg):
    # the fixed batch (lengths 3 and 2), then fresh random ones with a sequence of no completion token
    cases = [(LOGP, OLD, ADV, MASK, 4)]
    g = torch.Generator().manual_seed(fresh_seed())
    for _ in range(3):
        n, t = 5, 7
        lengths = torch.randint(1, t + 1, (n,), generator=g)
        lengths[int(torch.randint(0, n, (), generator=g))] = 0
        mask = torch.arange(t)[None, :] < lengths[:, None]
        old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
        logp = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3
        cases.append((logp, old, torch.randn(n, generator=g, dtype=torch.float64), mask, t + 3))
    for logp, old, adv, mask, max_new in cases:
        imp = importance(old, old - 0.05, mask, CorrectionConfig("tis", tis_cap=1.02), EPS_H)
        denom = loss_denominator(mask, agg, max_new)
        loss, _ = policy_loss(logp, old, adv, mask, imp, EPS_L, EPS_H, denom, agg=agg)
        terms = _token_terms(logp, old, adv, mask, imp.weight, torch.full_like(logp, 1 + EPS_H))
        assert float(loss) == pytest.approx(_aggregated_by_hand(terms, agg, max_new), rel=1e-5)
    # the KL penalty is aggregated the same way
    ref = OLD - 0.3
    imp = importance(OLD, OLD, MASK, CorrectionConfig(), EPS_H)
    _, st = policy_loss(LOGP, OLD, torch.zeros(2), MASK, imp, EPS_L, EPS_H, loss_denominator(MASK, agg, 4), ref,
                        kl_coef=0.1, agg=agg)
    k3 = [[math.exp(float(ref[i, t] - LOGP[i, t])) - float(ref[i, t] - LOGP[i, t]) - 1 for t in range(3) if MASK[i, t]]
          for i in range(2)]
    assert float(st["kl_ref"]) == pytest.approx(_aggregated_by_hand(k3, agg, 4), rel=1e-5)


def test_an_unknown_loss_aggregation_is_refused():
    imp = importance(OLD, OLD, MASK, CorrectionConfig(), EPS_H)
    for call in (lambda: loss_denominator(MASK, "seq-sum", 4),
                 lambda: policy_loss(LOGP, OLD, ADV, MASK, imp, EPS_L, EPS_H, 5.0, agg="seq-sum")):
        with pytest.raises(ValueError, match=r"unknown loss aggregation 'seq-sum' \(allowed: token-mean, "
                                             r"seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm\)"):
            call()


def _random_batches(g, count=3, n=5, t=7):
    """Fresh random (logp, old, adv, mask) in float64, each with one sequence of no completion token."""
    out = []
    for _ in range(count):
        lengths = torch.randint(1, t + 1, (n,), generator=g)
        lengths[int(torch.randint(0, n, (), generator=g))] = 0
        mask = torch.arange(t)[None, :] < lengths[:, None]
        old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
        logp = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.05
        out.append((logp, old, torch.randn(n, generator=g, dtype=torch.float64), mask))
    return out


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_gspo_loss_is_the_sequence_ratio_objective_in_value_and_gradient(agg):
    """GSPO: every token of a sequence carries the sequence's ratio ``s = exp(mean log(pi/pi_old))``,
    clipped as a whole; the loss (with a TIS weight per token) matches a hand computation, and its
    gradient (no correction) is that of the sequence-level objective ``sum_i c_i min(s_i A_i,
    clip(s_i) A_i)`` with ``c_i`` the aggregation's weight of a sequence's tokens, computed directly."""
    lo, hi, max_new, moved = 3e-3, 4e-3, 10, 0
    g = torch.Generator().manual_seed(fresh_seed())
    # a sequence's gradient flows where min() takes its unclipped term (about half of them here): with 7
    # non-empty sequences a batch, fewer than 2 of 4 batches move about once in 5e5 draws (with 4 non-empty
    # sequences in 3 batches, about once in 100: CI failed on it)
    for logp, old, adv, mask in _random_batches(g, count=4, n=8) + [(LOGP.double(), OLD.double(), ADV.double(), MASK)]:
        denom = loss_denominator(mask, agg, max_new)
        imp = importance(old, old - 0.01, mask, CorrectionConfig("tis", tis_cap=1.005), hi)
        loss, st = policy_loss(logp, old, adv, mask, imp, lo, hi, denom, agg=agg, mode="gspo")
        terms, clipped = [], 0
        for i in range(mask.shape[0]):
            k = int(mask[i].sum())
            s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in range(k)) / max(k, 1))
            a = float(adv[i])
            term = -min(s * a, min(max(s, 1 - lo), 1 + hi) * a)
            clipped += k * (term != -s * a)
            terms.append([term * float(imp.weight[i, t]) for t in range(k)])
        assert float(loss) == pytest.approx(_aggregated_by_hand(terms, agg, max_new), rel=1e-9)
        assert int(st["clipped_tokens"]) == clipped and int(st["loss_tokens"]) == int(mask.sum())

        x = logp.clone().requires_grad_()
        none = importance(old, old, mask, CorrectionConfig(), hi)
        policy_loss(x, old, adv, mask, none, lo, hi, denom, agg=agg, mode="gspo")[0].backward()
        y = logp.clone().requires_grad_()
        k = mask.sum(-1).double()
        s = (((y - old) * mask).sum(-1) / k.clamp_min(1)).exp()
        f = torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv)
        weight = {"token-mean": k / k.sum(), "seq-mean-token-mean": (k > 0).double() / (k > 0).sum(),
                  "seq-mean-token-sum": k / (k > 0).sum(),
                  "seq-mean-token-sum-norm": k / ((k > 0).sum() * max_new)}[agg]
        (-(weight * f).sum()).backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)
        moved += bool(x.grad.abs().sum() > 0)
    assert moved >= 2  # the random batches have unclipped sequences (the fixed one is all clipped)


def test_gspo_on_one_token_sequences_is_ppo():
    g = torch.Generator().manual_seed(fresh_seed())
    logp, old, adv = (-torch.rand(6, 1, generator=g), -torch.rand(6, 1, generator=g), torch.randn(6, generator=g))
    mask = torch.ones(6, 1, dtype=torch.bool)
    imp = importance(old, old, mask, CorrectionConfig(), EPS_H)
    a = policy_loss(logp, old, adv, mask, imp, EPS_L, EPS_H, 6.0, mode="gspo")
    b = policy_loss(logp, old, adv, mask, imp, EPS_L, EPS_H, 6.0, mode="ppo")
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_dual_clip_bounds_negative_advantages_by_hand():
    """Dual-clip PPO: a token with a negative advantage contributes at most ``-c * A``: where the
    ratio has grown beyond ``c`` its term is ``c * A`` and gives no gradient; positive advantages
    and the other tokens are plain PPO-clip."""
    c, bounded = 3.0, 0
    g = torch.Generator().manual_seed(fresh_seed())
    for logp, old, adv, mask in _random_batches(g, count=6):
        logp = logp + torch.randn(logp.shape, generator=g, dtype=torch.float64) * 1.5  # some ratios far above c
        imp = importance(old, old, mask, CorrectionConfig(), EPS_H)
        x = logp.clone().requires_grad_()
        loss, st = policy_loss(x, old, adv, mask, imp, EPS_L, EPS_H, float(mask.sum()), dual_clip=c)
        loss.backward()
        loss = loss.detach()
        total, clipped = 0.0, 0
        for i, t in mask.nonzero().tolist():
            ratio, a = math.exp(float(logp[i, t] - old[i, t])), float(adv[i])
            surr = min(ratio * a, min(max(ratio, 1 - EPS_L), 1 + EPS_H) * a)
            if a < 0 and surr < c * a:
                surr = c * a
                bounded += 1
                assert float(x.grad[i, t]) == 0.0
            total -= surr
            clipped += surr != ratio * a
        assert float(loss) == pytest.approx(total / int(mask.sum()), rel=1e-9)
        assert int(st["clipped_tokens"]) == clipped
        plain, _ = policy_loss(logp, old, adv, mask, imp, EPS_L, EPS_H, float(mask.sum()))
        assert float(plain) >= float(loss)  # without the bound such tokens push the loss up
    assert bounded > 0  # the batches tested the bound


def test_unknown_policy_losses_and_gspo_with_acr_are_refused():
    imp = importance(OLD, OLD, MASK, CorrectionConfig(), EPS_H)
    with pytest.raises(ValueError, match=r"unknown policy loss 'gpo' \(allowed: ppo, gspo\)"):
        policy_loss(LOGP, OLD, ADV, MASK, imp, EPS_L, EPS_H, 5.0, mode="gpo")
    acr = importance(OLD, ROLL, MASK, CorrectionConfig("acr"), EPS_H)
    with pytest.raises(ValueError, match="gspo policy loss clips whole sequences"):
        policy_loss(LOGP, OLD, ADV, MASK, acr, EPS_L, EPS_H, 5.0, mode="gspo")


def test_mismatch_metrics_by_hand_and_zero_when_equal():
    m = mismatch_metrics(OLD, ROLL, MASK)
    d = [0.1, -1.0, 0.0, 0.0, 0.8]  # log(pi_train / pi_rollout) on the 5 tokens
    assert m["mismatch_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 5)
    assert m["mismatch_k1"] == pytest.approx(-sum(d) / 5)
    assert m["abs_dlogp_max"] == pytest.approx(1.0)
    assert m["frac_bitwise_equal"] == pytest.approx(2 / 5)
    w = [math.exp(x) for x in d]
    assert m["ess"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    assert m["tokens"] == 5
    same = mismatch_metrics(OLD, OLD.clone(), MASK)
    assert same["mismatch_kl"] == 0.0 and same["frac_bitwise_equal"] == 1.0


def test_gradient_matches_finite_differences():
    torch.manual_seed(fresh_seed())
    logp = (torch.randn(3, 4) * 0.3 - 1).double().requires_grad_()
    old = logp.detach() + torch.randn(3, 4).double() * 0.1
    mask = torch.rand(3, 4) > 0.2
    imp = importance(old, old - 0.05, mask, CorrectionConfig("tis", tis_cap=2.0), EPS_H)
    adv = torch.randn(3).double()

    def f(x):
        return policy_loss(x, old, adv, mask, imp, EPS_L, EPS_H, float(mask.sum()))[0]

    assert torch.autograd.gradcheck(f, (logp,))


def _trainer(micro_batch, seed=0, loss_agg="token-mean", **train):
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.shapes import random_model
    from jetrl_cli.models.tiny import tiny_config
    from jetrl_cli.precision import named_flow
    from jetrl_cli.rl.trainer import Trainer

    model = random_model(tiny_config("qwen2", hidden=64, layers=1, vocab=128), seed=seed, std=0.05)
    return Trainer(model, named_flow("bf16"), TrainConfig(micro_batch=micro_batch, lr=1e-3, loss_agg=loss_agg, **train),
                   CorrectionConfig(), SamplingParams(), 64)


def _update_batch(seed=1):
    from jetrl_cli.rl.trainer import Batch

    g = torch.Generator().manual_seed(seed)
    n = 6
    prompts = [torch.randint(1, 128, (int(torch.randint(2, 6, (), generator=g)),), generator=g).tolist() for _ in range(n)]
    comps = [torch.randint(1, 128, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist() for _ in range(n)]
    lps = [(-torch.rand(len(c), generator=g)).tolist() for c in comps]
    b = Batch.build(prompts, comps, lps, [0.0] * n, [i // 3 for i in range(n)])
    adv = torch.randn(n, generator=g)
    return b, adv


def assert_same_updates(first, others, lr=1e-3):
    """``(stats, weights)`` of updates of one batch split into other micro-batches: the same
    statistics and weights as ``first``'s, up to the order of fp32 sums. Adam's first step moves a weight by
    ``lr * g / (|g| + eps)``: by about ``lr`` whatever ``g``'s size, except where ``|g|`` is near ``eps`` (1e-8),
    where the order of the sums moves the step itself (CI caught one weight of 32 off by 2.3e-6 with
    JETRL_TEST_SEED=551039956). A weight may differ there, in one element of 1000 at most and by at most the
    ``2 * lr`` that two steps of at most ``lr`` can part by; every other one to within the sums' order."""
    st0, w0 = first
    for st, w in others:
        assert st.keys() == st0.keys()
        for k in st:
            assert st[k] == pytest.approx(st0[k], rel=1e-4, abs=1e-7), k
        off = total = 0
        for p, q in zip(w, w0):
            torch.testing.assert_close(p, q, rtol=0, atol=2 * lr)
            off += int((~torch.isclose(p, q, rtol=1e-4, atol=1e-6)).sum())
            total += p.numel()
        assert off <= max(1, total // 1000), (off, total)


def assert_moved_elsewhere(w, other):
    """Two updates of one batch under different losses left different weights: some elements beyond
    ``assert_same_updates``' tolerance. (Their loss values alone can come within any bound under some draw
    of the inputs; Adam's first step moves each weight by about lr times its gradient's sign, and the
    signs of two different losses' gradients part in thousands of elements.)"""
    moved = sum(int((~torch.isclose(p, q, rtol=1e-4, atol=1e-6)).sum()) for p, q in zip(w, other))
    assert moved > 0


def test_an_update_with_fused_adamw_refreshes_the_cached_weights(monkeypatch):
    """Fused AdamW (the trainer's on CUDA) writes the weights in place without bumping their
    version; the linear layers' cached GEMM operands are keyed on it, so without a new version the
    next forward would still multiply by the weights of before the step."""
    from jetrl_cli.rl import trainer

    monkeypatch.setattr(trainer, "adamw_kind", lambda cuda: {"fused": True})  # CPU has fused AdamW too
    b, adv = _update_batch()
    tr = _trainer(6)
    assert tr.opt.defaults["fused"]
    lin = tr.model.model.layers[0].mlp.down_proj
    old = tr.score(b)  # builds the caches
    before = lin.weight.detach().clone()
    tr.update(b, adv, old, None, step=0)
    assert not torch.equal(before, lin.weight)
    fresh = _trainer(6)
    fresh.model.load_state_dict(tr.model.state_dict())
    assert torch.equal(tr.score(b), fresh.score(b))  # the trained weights, not the cached old ones


def test_update_adds_micro_batches_as_one_batch_and_stops_on_a_nan_loss():
    b, adv = _update_batch()
    stats = []
    noise = 0.4 * torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(fresh_seed())) * b.mask
    for mb in (6, 1, 4):
        tr = _trainer(mb)
        old = tr.score(b) + noise  # ratios away from 1: some tokens clip
        stats.append(tr.update(b, adv, old, None, step=0))
    assert 0 < stats[0]["clip_frac"] < 1
    for st in stats[1:]:  # loss terms add up over micro-batches, clip_frac counts the batch's tokens
        assert st.keys() == stats[0].keys() and {"loss", "pg_loss", "clip_frac", "grad_norm"} <= st.keys()
        for k in st:
            assert st[k] == pytest.approx(stats[0][k], rel=1e-4, abs=1e-7), k

    from jetrl_cli.rl.trainer import NonFiniteError

    tr = _trainer(2)
    old = tr.score(b)
    old[4, b.mask[4].nonzero()[0, 0]] = float("nan")  # one token of the third micro-batch
    before = [p.detach().clone() for p in tr.model.parameters()]
    with pytest.raises(NonFiniteError, match=r"step 3: the loss is nan; stopped before the update"):
        tr.update(b, adv, old, None, step=3)
    assert all(torch.equal(p, q) for p, q in zip(tr.model.parameters(), before))
    assert tr.updates == 0


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_each_loss_aggregation_splits_into_micro_batches_as_one_batch(agg):
    """Every micro-batch divides by the mini-batch's one denominator, so splitting it (6 sequences
    as 1 + 1 + ..., or 4 + 2) gives the same loss and weights; and the aggregation is the one asked
    for: its loss differs from token-mean's on the same update."""
    b, adv = _update_batch()
    noise = 0.4 * torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(fresh_seed())) * b.mask
    runs = []
    for mb, mode in ((6, agg), (1, agg), (4, agg), (6, "token-mean")):
        tr = _trainer(mb, loss_agg=mode)
        lp = tr.score(b)
        old = lp + noise
        runs.append((tr.update(b, adv, old, None, step=0), [p.detach().clone() for p in tr.model.parameters()]))
        if mb == 6:  # the update's loss is the aggregation's, at the logprobs before it
            imp = importance(old, b.rollout_logp, b.mask, CorrectionConfig(), EPS_H)
            want, _ = policy_loss(lp, old, adv, b.mask, imp, EPS_L, EPS_H,
                                  loss_denominator(b.mask, mode, tr.sampling.max_new_tokens), agg=mode)
            assert runs[-1][0]["pg_loss"] == pytest.approx(float(want), rel=1e-5)
    assert_same_updates(runs[0], runs[1:3])
    assert_moved_elsewhere(runs[0][1], runs[3][1])


def test_a_gspo_dual_clip_update_equals_policy_loss_and_splits_into_micro_batches():
    """``train.policy_loss: gspo`` and ``train.dual_clip`` reach the update: its loss is
    ``policy_loss``'s with them at the logprobs before it, splitting the mini-batch into micro-batches
    changes nothing, and it differs from the PPO update of the same batch."""
    b, adv = _update_batch()
    noise = 0.02 * torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(fresh_seed())) * b.mask
    gspo = {"policy_loss": "gspo", "dual_clip": 3.0, "clip_low": 3e-3, "clip_high": 4e-3}
    runs = []
    for mb, train in ((6, gspo), (1, gspo), (4, gspo), (6, {**gspo, "policy_loss": "ppo"})):
        tr = _trainer(mb, loss_agg="seq-mean-token-mean", **train)
        lp = tr.score(b)
        old = lp + noise
        runs.append((tr.update(b, adv, old, None, step=0), [p.detach().clone() for p in tr.model.parameters()]))
        if mb == 6:
            imp = importance(old, b.rollout_logp, b.mask, CorrectionConfig(), tr.cfg.clip_high)
            want, _ = policy_loss(lp, old, adv, b.mask, imp, tr.cfg.clip_low, tr.cfg.clip_high,
                                  loss_denominator(b.mask, "seq-mean-token-mean", 0), agg="seq-mean-token-mean",
                                  mode=train["policy_loss"], dual_clip=3.0)
            assert runs[-1][0]["pg_loss"] == pytest.approx(float(want), rel=1e-5)
    assert 0 < runs[0][0]["clip_frac"] < 1
    assert_same_updates(runs[0], runs[1:3])
    assert_moved_elsewhere(runs[0][1], runs[3][1])  # the PPO update of the same batch


def test_an_updates_micro_batches_add_into_the_gradients_held(monkeypatch):
    """The trainer runs an optimizer step's micro-batches within ``grads_in_place``: those after the
    first add their weight gradients where the first left them. The update equals the one autograd's
    own sums give, bit for bit."""
    from jetrl_cli.models import llama
    from jetrl_cli.precision import linear
    from jetrl_cli.rl import head_grad
    from jetrl_cli.rl import trainer as trainer_mod

    b, adv = _update_batch()
    found = []
    real = linear.grad_sink
    for mod in (linear, head_grad, llama):
        monkeypatch.setattr(mod, "grad_sink", lambda ws: (lambda t: found.append(t is not None) or t)(real(ws)))
    weights = {}
    for in_place in (True, False):
        if not in_place:
            monkeypatch.setattr(trainer_mod, "grads_in_place", contextlib.nullcontext)
        tr = _trainer(2)
        found.clear()
        tr.update(b, adv, tr.score(b), None, step=0)
        weights[in_place] = {n: p.detach() for n, p in tr.model.named_parameters()}
        # two micro-batches after the first (of three), each: q/k/v, o, gate/up, down, the (untied)
        # lm_head and embedding
        assert tr.model.lm_head.weight is not tr.model.model.embed_tokens.weight
        assert sum(found) == (2 * 6 if in_place else 0), found
    for n, w in weights[True].items():
        assert torch.equal(w, weights[False][n]), n


def test_nonfinite_parameters_names_each_tensor_holding_a_nan_or_an_infinity():
    from jetrl_cli.rl.trainer import nonfinite_parameters

    g = torch.Generator().manual_seed(torch.initial_seed())
    shapes = [(7, 33), (300,), (2, 3, 5), (1,), (64, 64)]
    params = [(f"p{i}", torch.randn(s, generator=g) * 1e3) for i, s in enumerate(shapes)]
    params += [("bf16", torch.randn(40, generator=g).bfloat16()), ("empty", torch.zeros(0, 4)),
               ("big", torch.full((5,), 3e38)), ("zeros", torch.zeros(9))]  # finite, however large
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):  # the most elements an op allocates (views of its inputs are not new)
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                    Sizes.largest = max(Sizes.largest, t.numel())
            return out

    with Sizes():
        assert nonfinite_parameters(params) == []
    assert Sizes.largest < 64, Sizes.largest  # per-tensor scalars, nothing the size of a parameter
    for bad in (float("nan"), float("inf"), float("-inf")):
        chosen = sorted(torch.randperm(len(params), generator=g)[:2].tolist())
        chosen = [i for i in chosen if params[i][0] != "empty"]
        broken = [(n, p.clone()) for n, p in params]
        for i in chosen:
            t = broken[i][1].view(-1)
            t[int(torch.randint(t.numel(), (1,), generator=g))] = bad
        assert nonfinite_parameters(broken) == [params[i][0] for i in chosen], bad


def _cached(mod) -> bool:
    """Whether a linear group's owner or a layer holds a cached GEMM weight."""
    return bool(mod.__dict__.get("_jet_group_cache") or getattr(mod, "_cache", None))


@pytest.mark.parametrize("clip", ["within", "above"])
def test_gradients_are_multiplied_only_when_clipping_changes_them(monkeypatch, clip):
    """The update reads the gradient norm on the host before the optimizer step anyway, so it
    clips only when the factor is below 1 -- ``clip_grad_norm_`` multiplies every gradient by its
    factor unconditionally. The updated weights and the reported norm are bit for bit those of
    clipping every time."""
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.shapes import random_model
    from jetrl_cli.models.tiny import tiny_config
    from jetrl_cli.precision import named_flow
    from jetrl_cli.rl import trainer as trainer_mod
    from jetrl_cli.rl.trainer import Trainer

    model = random_model(tiny_config("qwen2", hidden=128, layers=1, vocab=128), seed=int(torch.randint(0, 2**31, ())),
                         std=0.05)
    b, adv = _update_batch(seed=int(torch.randint(0, 2**31, ())))
    probe = Trainer(copy.deepcopy(model), named_flow("bf16"), TrainConfig(micro_batch=2, grad_clip=1e9),
                    CorrectionConfig(), SamplingParams(), 64)
    norm = probe.update(b, adv, probe.score(b), None, step=0)["grad_norm"]
    grad_clip = norm * 4 if clip == "within" else norm / 4  # the first mini-batch's norm, near the others'

    def run():
        tr = Trainer(copy.deepcopy(model), named_flow("bf16"),
                     TrainConfig(micro_batch=2, minibatches=2, grad_clip=grad_clip), CorrectionConfig(),
                     SamplingParams(), 64)
        stats = tr.update(b, adv, tr.score(b), None, step=0)
        return stats, [p.detach().clone() for p in tr.model.parameters()]

    calls = []
    real = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: calls.append(1) or real(*a, **k))
    stats, got = run()
    assert len(calls) == (0 if clip == "within" else 2)
    monkeypatch.setattr(trainer_mod, "clip_factor", lambda total, max_norm: torch.zeros(()))  # clip every time
    calls.clear()
    ref_stats, want = run()
    assert len(calls) == 2
    assert stats["grad_norm"] == ref_stats["grad_norm"]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_the_last_micro_batch_drops_the_cached_weights_layer_by_layer(monkeypatch, flow_name):
    """At the end of an optimizer step's backward every gradient is held: the step's peak. The
    last micro-batch's backward drops each layer's cached weight operands (its bf16 or FP8 copy,
    and Dgrad's W^T) as soon as it is done with them, so that peak holds no second copy of the
    weights, as with autocast, whose casts the graph frees layer by layer. The lm_head, whose
    chunked logprobs are recomputed chunk by chunk in the backward, keeps its cache until its last
    chunk. Nothing is cast more often than before, and the update is bit for bit the same."""
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.shapes import random_model
    from jetrl_cli.models.tiny import tiny_config
    from jetrl_cli.precision import linear, named_flow
    from jetrl_cli.rl import trainer as trainer_mod
    from jetrl_cli.rl.trainer import Trainer

    vocab = 256
    monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", 4 * vocab)  # a few rows per chunk: many chunks
    cfg = tiny_config("qwen2", hidden=128, layers=2, vocab=vocab)
    model = random_model(cfg, seed=3, std=0.05)
    b, adv = _update_batch()

    def make():
        return Trainer(copy.deepcopy(model), named_flow(flow_name), TrainConfig(micro_batch=2, lr=1e-3),
                       CorrectionConfig(), SamplingParams(), 64)

    casts = []
    real = linear.JetLinear._make_fprop_weight
    monkeypatch.setattr(linear.JetLinear, "_make_fprop_weight", lambda self: casts.append(self) or real(self))
    tr = make()
    old = tr.score(b)  # builds every cache
    layers = tr.model.model.layers
    owners = [m for m in tr.model.modules() if isinstance(m, linear.JetLinear)] + [
        x for layer in layers for x in (layer.self_attn, layer.mlp)]
    assert all(_cached(m) for m in (layers[0].mlp.down_proj, layers[1].self_attn, tr.model.lm_head))
    seen = []  # (micro-batch, layer 1's down_proj cached, layer 0's down_proj cached) at layer 1's Wgrad
    micro = [0]
    step = tr._forward_backward

    def counted(*a, **k):
        micro[0] += 1
        return step(*a, **k)

    monkeypatch.setattr(tr, "_forward_backward", counted)
    layers[1].mlp.down_proj.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append((micro[0], _cached(layers[1].mlp.down_proj), _cached(layers[0].mlp.down_proj))))
    casts.clear()
    tr.update(b, adv, old, None, step=0)
    assert micro[0] == 3 and [s[0] for s in seen] == [1, 2, 3]
    assert seen[0][1:] == seen[1][1:] == (True, True)  # kept between micro-batches
    assert seen[2][1:] == (False, True)  # last micro-batch: layer 1 dropped, layer 0's backward not run yet
    assert not [m for m in owners if _cached(m)]  # all dropped by the end of the step
    assert casts == []  # none was cast again (the lm_head's chunks recomputed on its kept cache)

    monkeypatch.setattr(trainer_mod, "releasing_weights", contextlib.nullcontext)
    ref = make()
    ref.update(b, adv, ref.score(b), None, step=0)
    assert all(_cached(m) for m in (ref.model.model.layers[0].mlp.down_proj, ref.model.lm_head))
    for (name, p), q in zip(tr.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(tr.score(b), ref.score(b))  # the next forward casts the new weights afresh


def test_learning_rate_warms_up_linearly_then_follows_the_schedule():
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.rl.trainer import learning_rate

    lr = float(torch.rand(()) * 1e-3 + 1e-5)
    flat = TrainConfig(steps=20, lr=lr, warmup_steps=4)
    assert [learning_rate(flat, s) for s in range(1, 7)] == [lr * s / 4 for s in (1, 2, 3, 4)] + [lr, lr]
    assert learning_rate(TrainConfig(steps=20, lr=lr), 1) == lr  # no warmup: the full rate from step 1
    cos = TrainConfig(steps=20, lr=lr, warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.1)
    rates = [learning_rate(cos, s) for s in range(1, 21)]
    assert rates[:4] == [lr * s / 4 for s in (1, 2, 3, 4)]
    assert rates[4] == pytest.approx(lr, rel=1e-12)  # the first step after the warmup
    assert rates[19] == pytest.approx(0.1 * lr, rel=1e-12)  # the last step
    assert all(a >= b for a, b in zip(rates[4:], rates[5:]))
    # the cosine's midpoint (progress 1/2 over steps 5..20 is step 12.5): between steps 12 and 13
    assert rates[11] > lr * (0.1 + 0.9 * 0.5) > rates[12]
    assert learning_rate(cos, 25) == pytest.approx(0.1 * lr)  # past the last step: held at the floor


def test_an_update_trains_at_the_scheduled_learning_rate():
    import dataclasses

    b, adv = _update_batch()
    tr = _trainer(6)
    tr.cfg = dataclasses.replace(tr.cfg, steps=10, warmup_steps=2, lr_schedule="cosine")
    old = tr.score(b)
    for step, want in ((1, tr.cfg.lr / 2), (3, tr.cfg.lr), (10, 0.0)):
        tr.update(b, adv, old, None, step=step)
        assert [g["lr"] for g in tr.opt.param_groups] == [pytest.approx(want, abs=1e-15)] * len(tr.opt.param_groups)


@pytest.mark.parametrize("override, message", [
    ("train.lr_schedule=linear", r"train.lr_schedule: 'linear' is not allowed \(allowed: constant, cosine\)"),
    ("train.min_lr_ratio=1.5", r"train.min_lr_ratio: must be in \[0, 1\], got 1.5"),
    ("train.loss_agg=seq-sum", r"train.loss_agg: 'seq-sum' is not allowed \(allowed: token-mean, "),
    ("train.policy_loss=grpo", r"train.policy_loss: 'grpo' is not allowed \(allowed: ppo, gspo\)"),
    ("train.dual_clip=0.5", r"train.dual_clip: must be 0 \(off\) or > 1 \(verl uses 3\), got 0.5"),
    ("train.kl_estimator=k4", r"train.kl_estimator: 'k4' is not allowed \(allowed: k1, k2, k3, abs, k1\+, k3\+\)"),
    ("train.adv_estimator=ppo", r"train.adv_estimator: 'ppo' is not allowed \(allowed: grpo, rloo, "),
])
def test_schedule_and_aggregation_keys_are_checked(override, message):
    from jetrl_cli.config import load_job_config
    from jetrl_cli.errors import PresetError

    with pytest.raises(PresetError, match=message):
        load_job_config("bf16", [override])


def test_gspo_with_the_acr_correction_is_refused_in_a_preset():
    from jetrl_cli.config import load_job_config
    from jetrl_cli.errors import PresetError

    with pytest.raises(PresetError, match=r"train.policy_loss: gspo clips whole sequences; correction.type acr"):
        load_job_config("qurl", ["train.policy_loss=gspo"])
    with pytest.raises(PresetError, match=r"train.loss_agg: gspo's objective is a mean over sequences: set "
                       r"train.loss_agg=seq-mean-token-mean \(verl's GSPO loss forces it\), got token-mean"):
        load_job_config("fp8-rollout-tis", ["train.policy_loss=gspo"])
    gspo = ["train.policy_loss=gspo", "train.loss_agg=seq-mean-token-mean"]
    assert load_job_config("fp8-rollout-tis", gspo).train.policy_loss == "gspo"


def test_overlong_penalty_by_hand():
    from jetrl_cli.rl.algos import overlong_penalty

    assert [overlong_penalty(n, 100, 20, 1.0) for n in (0, 79, 80, 81, 90, 100)] == [0, 0, 0, -0.05, -0.5, -1.0]
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # buffer 0: off
    assert overlong_penalty(95, 100, 20, 0.4) == pytest.approx(-0.3)
    assert overlong_penalty(100, 100, 100, 2.0) == -2.0 and overlong_penalty(1, 100, 100, 2.0) == -0.02


def test_adv_norm_with_another_estimator_is_refused_not_ignored():
    from jetrl_cli.config import load_job_config
    from jetrl_cli.errors import PresetError

    with pytest.raises(PresetError, match=r"train.adv_norm: applies to adv_estimator grpo only \(rloo "):
        load_job_config("bf16", ["train.adv_estimator=rloo", "train.adv_norm=none"])
    assert load_job_config("bf16", ["train.adv_estimator=rloo"]).train.adv_estimator == "rloo"


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus_baseline"])
def test_a_run_step_trains_on_the_chosen_advantages(monkeypatch, estimator):
    """``train.adv_estimator`` reaches the update: the advantages it receives are ``advantages``'
    for the step's rewards and completion lengths."""
    from jetrl_cli.config import load_job_config
    from jetrl_cli.rl import loop
    from jetrl_cli.rl.trainer import Trainer

    got = []
    monkeypatch.setattr(Trainer, "update", lambda self, b, adv, *a, **k: got.append((b, adv)) or {})
    cfg = load_job_config("bf16", ["rollout.prompts_per_step=3", "rollout.n=4", f"train.adv_estimator={estimator}"])
    job = loop.setup(cfg, with_trainer=True)
    samples = loop.rollout_samples(job, job.source.batch(1, 3), seed=1, step=1)
    loop.train_on_samples(job, samples, step=1)
    b, adv = got[0]
    rewards = torch.tensor([s["reward"] for s in samples]).reshape(3, 4)
    lengths = torch.tensor([len(s["tokens"]) for s in samples]).reshape(3, 4)
    assert torch.equal(adv, advantages(rewards, lengths, estimator).reshape(-1))
    assert not torch.equal(adv, advantages(rewards, lengths, "grpo").reshape(-1))


def test_an_update_penalises_with_the_chosen_kl_estimator():
    b, adv = _update_batch()
    ref_noise = 0.3 * torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(fresh_seed())) * b.mask
    kl = {}
    for est in ("k1", "k3"):
        tr = _trainer(6, kl_coef=0.1, kl_estimator=est)
        lp = tr.score(b)
        ref = lp + ref_noise
        kl[est] = tr.update(b, adv, lp, ref, step=0)["kl_ref"]
        want = kl_penalty(lp, ref, est)[b.mask].mean()
        assert kl[est] == pytest.approx(float(want), rel=1e-5)
    # the two estimators' means differ beyond the tolerance above (so each check tells them apart); k1's is a
    # random-signed mean and can come near k3's, but within 1e-4 of it only about once in 20000 draws
    assert kl["k1"] != pytest.approx(kl["k3"], rel=1e-4)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_entropy_bonus_by_hand(agg):
    g = torch.Generator().manual_seed(fresh_seed())
    for logp, old, adv, mask in _random_batches(g):
        ent = torch.rand(logp.shape, generator=g, dtype=torch.float64) * 3
        ent[~mask] = float("nan")  # off the mask: never read
        imp = importance(old, old, mask, CorrectionConfig(), EPS_H)
        denom = loss_denominator(mask, agg, 7)
        plain, _ = policy_loss(logp, old, adv, mask, imp, EPS_L, EPS_H, denom, agg=agg)
        loss, st = policy_loss(logp, old, adv, mask, imp, EPS_L, EPS_H, denom, agg=agg, entropy=ent,
                               entropy_coef=0.01)
        rows = [[float(ent[i, t]) for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
        want = _aggregated_by_hand(rows, agg, 7)
        assert float(st["entropy_bonus"]) == pytest.approx(want, rel=1e-12)
        assert float(loss) == pytest.approx(float(plain) - 0.01 * want, rel=1e-12)


def test_an_update_with_an_entropy_bonus_raises_the_entropy_and_splits_into_micro_batches():
    """``train.entropy_coef`` reaches the update: with zero advantages the loss is the entropy bonus
    alone, its value the scored entropy's mean, and the update raises the policy's entropy;
    splitting the mini-batch into micro-batches changes nothing; without it nothing moves."""
    b, _ = _update_batch()
    zero = torch.zeros(len(b))
    runs = []
    for mb in (6, 1, 4):
        tr = _trainer(mb, entropy_coef=0.5)
        old, ent = tr.score(b, entropy=True)
        st = tr.update(b, zero, old, None, step=0)
        after = tr.score(b, entropy=True)[1]
        assert st["entropy_bonus"] == pytest.approx(float(ent[b.mask].mean()), rel=1e-5)
        assert st["loss"] == pytest.approx(-0.5 * st["entropy_bonus"], rel=1e-5)
        assert float(after[b.mask].mean()) > float(ent[b.mask].mean())
        runs.append((st, [p.detach().clone() for p in tr.model.parameters()]))
    assert_same_updates(runs[0], runs[1:])
    tr = _trainer(6)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.update(b, zero, tr.score(b), None, step=0)
    assert all(torch.equal(p, q) for p, q in zip(tr.model.parameters(), before))


def _random_logps(seed, shape=(5, 7)):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < 0.8
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    roll = old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.6
    roll[0], roll[1] = old[0] - 1.0, old[1]  # ratios e (out of any band here) and 1 (in it)
    mask[:2, 0] = True
    logp = (old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.1).requires_grad_()
    ref = old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.2
    ent = torch.rand(shape, generator=g, dtype=torch.float64, requires_grad=True)
    adv = torch.randn(shape[0], generator=g, dtype=torch.float64)
    return mask, old, roll, logp, ref, ent, adv


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_mis_drops_tokens_from_every_term_and_denominator_as_verls_rejection_sampling(level, agg):
    """MIS's rejected tokens leave the loss altogether, as verl's rejection sampling drops them from
    its response mask: the loss (policy, KL and entropy terms, each denominator) equals the uncorrected
    loss on the kept tokens' mask; it used to keep them in the denominators and the KL and entropy."""
    from jetrl_cli.rl.algos import loss_tokens

    seed = int(torch.randint(0, 2**31, ()))
    mask, old, roll, logp, ref, ent, adv = _random_logps(seed)
    cfg = CorrectionConfig("mis", mis_low=0.7, mis_high=1.4, mis_level=level)
    imp = importance(old, roll, mask, cfg, EPS_H)
    keep = loss_tokens(mask, old, roll, cfg)
    assert torch.equal(keep, imp.keep) and 0 < int(keep.sum()) < int(mask.sum()), seed
    kw = dict(logp_ref=ref, kl_coef=0.1, agg=agg, entropy=ent, entropy_coef=0.01)
    got, st = policy_loss(logp, old, adv, mask, imp, EPS_L, EPS_H, loss_denominator(keep, agg, 7), **kw)
    plain = importance(old, roll, keep, CorrectionConfig(), EPS_H)
    want, _ = policy_loss(logp, old, adv, keep, plain, EPS_L, EPS_H, loss_denominator(keep, agg, 7), **kw)
    assert float(got) == float(want) and int(st["loss_tokens"]) == int(keep.sum())
    ga = torch.autograd.grad(got, (logp, ent))
    gb = torch.autograd.grad(want, (logp, ent))
    for a, b in zip(ga, gb):
        assert torch.equal(a, b) and not a[~keep].any()


def test_a_mis_update_divides_by_its_kept_tokens():
    """The trainer's denominator is the mini-batch's kept tokens (``Trainer.loss_tokens``)."""
    b, adv = _update_batch()
    tr = _trainer(6)
    tr.ccfg = CorrectionConfig("mis", mis_low=0.9, mis_high=1.1)
    lp = tr.score(b)
    old = b.rollout_logp + 0.2 * torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(fresh_seed())) * b.mask
    idx = torch.arange(len(b.rewards))
    keep = tr.loss_tokens(b, idx, old)
    assert 0 < int(keep.sum()) < int(b.mask.sum())
    imp = importance(old, b.rollout_logp, b.mask, tr.ccfg, tr.cfg.clip_high)
    want, _ = policy_loss(lp, old, adv, b.mask, imp, tr.cfg.clip_low, tr.cfg.clip_high,
                          loss_denominator(keep, "token-mean", 0))
    assert tr.update(b, adv, old, None, step=0)["pg_loss"] == pytest.approx(float(want), rel=1e-5)


def test_k3_and_the_ppo_ratio_are_bounded_as_verls():
    """k3 takes verl's clamps (log-ratio to [-20, 20], the estimate to at most 10, no gradient past
    them) and the PPO ratio a log-ratio clamped to [-20, 20]: a runaway token gives a finite loss and
    gradient (it gave 1.8e8, or inf and NaN). Inside the bounds nothing changes."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    logp = -torch.rand(50, generator=g, dtype=torch.float64) * 3
    ref = logp + torch.randn(50, generator=g, dtype=torch.float64)
    dl = ref - logp
    assert torch.equal(kl_penalty(logp, ref, "k3"), (torch.exp(dl) - dl - 1).clamp(max=10.0))
    # in fp32, as the trainer computes them: exp(99) overflows there, and 0 x inf is a NaN gradient
    far = torch.tensor([-5.0, -20.0, -100.0, -1.0, -1.0], requires_grad=True)
    k3 = kl_penalty(far, torch.tensor([-1.0, -1.0, -1.0, -1.0, -100.0]), "k3")
    assert k3.tolist() == [10.0, 10.0, 10.0, 0.0, 10.0]
    assert torch.autograd.grad(k3.sum(), far)[0].tolist() == [0.0] * 5
    old = torch.tensor([[-100.0, -1.0]])
    for a in (1.0, -1.0):
        for mask, mode, agg in (([[True, True]], "ppo", "token-mean"), ([[True, False]], "gspo", "seq-mean-token-mean")):
            mask = torch.tensor(mask)
            none = importance(old, old, mask, CorrectionConfig(), EPS_H)
            lp = torch.tensor([[-0.01, -1.0]], requires_grad=True)  # a token's log-ratio of about 100: gspo's too
            loss, _ = policy_loss(lp, old, torch.tensor([a]), mask, none, EPS_L, EPS_H, 2.0, mode=mode, agg=agg)
            grad = torch.autograd.grad(loss, lp)[0]
            assert math.isfinite(float(loss)) and torch.isfinite(grad).all(), (a, mode, float(loss), grad)


def _verl_reinforce_pp(rewards, mask, token_rewards):
    """verl's REINFORCE++ written out with Python floats: the reward added at each completion's last
    token, returns summed backwards with gamma 1 (reset where the mask is off), whitened over the
    mask's tokens with the Bessel-corrected variance (``masked_whiten``)."""
    n, t = mask.shape
    returns = [[0.0] * t for _ in range(n)]
    for i in range(n):
        ends = [j for j in range(t) if mask[i, j]]
        running = 0.0
        for j in reversed(range(t)):
            r = float(token_rewards[i, j]) if mask[i, j] else 0.0
            if ends and j == ends[-1]:
                r += float(rewards[i])
            running = r + running
            returns[i][j] = running
            running *= float(mask[i, j])
    values = [returns[i][j] for i in range(n) for j in range(t) if mask[i, j]]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return torch.tensor([[(returns[i][j] - mean) / math.sqrt(var + 1e-8) if mask[i, j] else 0.0 for j in range(t)]
                         for i in range(n)], dtype=torch.float64)


def test_reinforce_plus_plus_advantages_are_verls_whitened_returns():
    from jetrl_cli.rl.algos import token_advantages

    g = torch.Generator().manual_seed(fresh_seed())
    for _ in range(5):
        n, t = 6, 12
        starts = torch.randint(0, 5, (n,), generator=g)  # the prompt's positions come first
        lengths = torch.randint(1, 8, (n,), generator=g)
        pos = torch.arange(t)[None, :]
        mask = (pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])
        rewards = torch.randn(n, generator=g)
        rewards[0] = 0.0  # an edge among the draws
        token_rewards = torch.randn(n, t, generator=g) * 0.1
        got = token_advantages(rewards, mask, token_rewards)
        want = _verl_reinforce_pp(rewards, mask, token_rewards)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(got[~mask], torch.zeros(int((~mask).sum())))
        # without token rewards, each token's return is its sequence's reward: one advantage a sequence
        plain = token_advantages(rewards, mask)
        torch.testing.assert_close(plain.double(), _verl_reinforce_pp(rewards, mask, torch.zeros(n, t)), rtol=1e-5,
                                   atol=1e-6)
        for i in range(n):
            assert len(set(plain[i][mask[i]].tolist())) == 1
    with pytest.raises(ValueError, match="call token_advantages"):
        advantages(torch.zeros(2, 2), torch.ones(2, 2), "reinforce_plus_plus")


def test_an_update_takes_one_advantage_per_token_as_one_per_sequence_when_they_agree():
    """Per-token advantages ``(N, T)`` (``reinforce_plus_plus``) reach each micro-batch's loss sliced as
    its logprobs are: equal per-token values give the update per-sequence values give, bit for bit
    (values off the mask, drawn at random, change nothing)."""
    b, adv = _update_batch()
    noise = torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(fresh_seed()))
    per_token = torch.where(b.mask, adv[:, None].expand(b.mask.shape), noise)
    runs = []
    for a in (adv, per_token):
        tr = _trainer(2)
        old = tr.score(b)
        st = tr.update(b, a, old, None, step=1)
        runs.append((st, [p.detach().clone() for p in tr.model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1]))
    assert runs[0][0]["grad_norm"] > 0


@pytest.mark.parametrize("estimator, n", [("grpo", 4), ("reinforce_plus_plus", 1)])
def test_kl_in_reward_shapes_the_advantages_and_leaves_the_loss(monkeypatch, estimator, n):
    """``train.kl_in_reward``: the reference KL (from the trainer's scores, as verl's from its old
    logprobs) is a per-token reward -- summed into a sequence's reward for ``grpo``, a return term for
    ``reinforce_plus_plus`` -- and the loss gets no KL term (the update receives no reference logprobs)."""
    from jetrl_cli.config import load_job_config
    from jetrl_cli.rl import loop
    from jetrl_cli.rl.algos import token_advantages
    from jetrl_cli.rl.trainer import Trainer

    got = []
    monkeypatch.setattr(Trainer, "update", lambda self, b, adv, old, ref, step: got.append((b, adv, old, ref)) or {})
    cfg = load_job_config("bf16", ["rollout.prompts_per_step=3", f"rollout.n={n}", f"train.adv_estimator={estimator}",
                                   "train.kl_coef=0.5", "train.kl_in_reward=true", "train.kl_estimator=k1"])
    job = loop.setup(cfg, with_trainer=True)
    with torch.no_grad():  # the policy moved away from its reference
        for p in job.trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(fresh_seed())) * 0.02)
    samples = loop.rollout_samples(job, job.source.batch(1, 3), seed=1, step=1)
    stats = loop.train_on_samples(job, samples, step=1)
    b, adv, old, ref = got[0]
    assert ref is None
    ref_logp = job.trainer.score(b, ref=True)
    kl = torch.where(b.mask, old - ref_logp, 0.0)
    assert float(kl.abs().sum()) > 0
    assert stats["kl_reward"] == pytest.approx(float((kl.sum(-1) / b.mask.sum(-1)).mean()), rel=1e-5)
    if estimator == "grpo":
        shaped = (b.rewards - 0.5 * kl.sum(-1)).reshape(3, n)
        assert torch.equal(adv, advantages(shaped, b.mask.sum(-1).reshape(3, n), "grpo").reshape(-1))
        assert not torch.equal(adv, advantages(b.rewards.reshape(3, n), b.mask.sum(-1).reshape(3, n)).reshape(-1))
    else:
        assert adv.shape == b.mask.shape
        torch.testing.assert_close(adv.double(), _verl_reinforce_pp(b.rewards, b.mask, -0.5 * kl), rtol=1e-5, atol=1e-6)
        assert not torch.equal(adv, token_advantages(b.rewards, b.mask))


def test_sample_counts_and_kl_in_reward_are_checked_against_the_estimator():
    from jetrl_cli.config import load_job_config
    from jetrl_cli.errors import PresetError

    with pytest.raises(PresetError, match=r"rollout.n: adv_estimator grpo compares a prompt's samples: it needs at "
                       r"least 2 per prompt, got 1 \(reinforce_plus_plus alone takes 1\)"):
        load_job_config("bf16", ["rollout.n=1"])
    assert load_job_config("bf16", ["rollout.n=1", "train.adv_estimator=reinforce_plus_plus"]).rollout.n == 1
    with pytest.raises(PresetError, match=r"train.dynamic_sampling: .* with rollout.n = 1 it would drop every prompt"):
        load_job_config("bf16", ["rollout.n=1", "train.adv_estimator=reinforce_plus_plus",
                                 "train.dynamic_sampling=true"])
    with pytest.raises(PresetError, match=r"train.kl_in_reward: puts the kl_coef penalty in the reward: set "
                       r"train.kl_coef > 0"):
        load_job_config("bf16", ["train.kl_in_reward=true"])


@pytest.mark.parametrize("ctype, agg, mode", [("none", "token-mean", "ppo"), ("tis", "seq-mean-token-mean", "ppo"),
                                              ("mis", "token-mean", "ppo"), ("acr", "token-mean", "ppo"),
                                              ("tis", "seq-mean-token-mean", "gspo")])
def test_tokens_beyond_the_trainers_cut_leave_the_loss_as_if_masked(ctype, agg, mode):
    """With top-k/top-p, a token the rollout sampled may lie beyond the trainer's cut: its training logprob
    is -inf. It leaves the loss, its denominators and the statistics (``frac_outside_support``): the loss
    and its gradient are those of the batch with the token masked out, finite (it was NaN: inf - inf)."""
    from jetrl_cli.rl.algos import loss_tokens

    g = torch.Generator().manual_seed(fresh_seed())
    cfg = CorrectionConfig(ctype, tis_cap=2.0, mis_low=0.5, mis_high=2.0)
    for logp0, old, adv, mask in _random_batches(g, n=6, t=8):
        rollout = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.1
        cut = mask & (torch.rand(mask.shape, generator=g) < 0.25)
        cut[0, 0] = bool(mask[0, 0])  # and an edge among the draws: the first token
        outs = []
        for m, inf in ((mask, True), (mask & ~cut, False)):
            lp = logp0.clone()
            o = old.clone()
            if inf:
                lp[cut], o[cut] = float("-inf"), float("-inf")
            lp.requires_grad_()
            imp = importance(o, rollout, m, cfg, EPS_H)
            denom = loss_denominator(loss_tokens(m, o, rollout, cfg), agg, 8)
            loss, st = policy_loss(lp, o, adv, m, imp, EPS_L, EPS_H, max(denom, 1.0), agg=agg, mode=mode)
            (grad,) = torch.autograd.grad(loss, lp)
            outs.append((loss, grad, {k: float(v) for k, v in st.items()}, imp.metrics))
        (l1, g1, s1, m1), (l2, g2, s2, m2) = outs
        assert torch.isfinite(l1) and torch.isfinite(g1).all()
        assert float(l1.detach()) == pytest.approx(float(l2.detach()), rel=1e-12, abs=1e-15)
        assert s1 == pytest.approx(s2, rel=1e-12)
        torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-15)
        assert m1["frac_outside_support"] == pytest.approx(float(cut.sum()) / float(mask.sum()))
        assert m2["frac_outside_support"] == 0.0
        for k in ("mismatch_kl", "chi2", "ess", "abs_dlogp_max", "prob_err", "seq_log_ratio_mean"):
            assert m1[k] == pytest.approx(m2[k], rel=1e-12), k


def test_an_update_with_top_k_trains_on_the_tokens_inside_the_cut():
    """The trainer scores the sampling distribution (top-k 64 of 128 here): about half the random tokens lie
    beyond its cut. The update is finite and is the update of the batch with those tokens masked out."""
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.shapes import random_model
    from jetrl_cli.models.tiny import tiny_config
    from jetrl_cli.precision import named_flow
    from jetrl_cli.rl.trainer import Batch, Trainer

    b, adv = _update_batch(seed=fresh_seed())
    runs = []
    for masked in (False, True):
        model = random_model(tiny_config("qwen2", hidden=64, layers=1, vocab=128), seed=0, std=0.05)
        tr = Trainer(model, named_flow("bf16"), TrainConfig(micro_batch=6, lr=1e-3), CorrectionConfig("tis"),
                     SamplingParams(top_k=64), 64)
        old = tr.score(b)
        inside = b.mask & ~torch.isneginf(old)
        assert 0 < int(inside.sum()) < int(b.mask.sum())
        rollout = torch.where(b.mask, old.clamp(min=-5.0) - 0.05, 0.0)  # what a rollout reported: finite
        bb = Batch(b.ids, inside if masked else b.mask, rollout, b.rewards, b.group)
        grads = []  # the gradients the optimizer would take (Adam would magnify the rounding of tiny ones)
        tr.opt.step = lambda: grads.extend(p.grad.clone() for p in tr.params)
        st = tr.update(bb, adv, old, None, step=1)
        runs.append((st, grads))
    (s1, g1), (s2, g2) = runs
    assert math.isfinite(s1["loss"]) and s1["grad_norm"] > 0
    assert s1 == pytest.approx(s2, rel=1e-6)
    for p, q in zip(g1, g2):  # the same sums over other padded widths: fp32 rounding apart
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6 * float(q.abs().max()))


def test_micro_batches_by_token_budget_pack_the_longest_first_and_update_as_one_batch():
    """``train.micro_batch_tokens`` (verl's dynamic batch size): each micro-batch holds at most that many
    padded tokens (sequences x the longest's length) and at most ``micro_batch`` sequences, the sequences taken
    longest first; the update is the one-batch update, and the scores (row-invariant) are the same bits."""
    from jetrl_cli.rl.trainer import plan_micro_batches, sequence_lengths

    b, adv = _update_batch(seed=fresh_seed() % 1000)
    lengths = sequence_lengths(b)
    assert all(b.select(torch.tensor([i])).ids.shape[1] == int(lengths[i]) for i in range(len(b)))
    budget = int(lengths.max()) + 2
    plan = plan_micro_batches(b, torch.arange(len(b)), 6, budget)
    assert sorted(torch.cat(plan).tolist()) == list(range(len(b)))
    assert [int(lengths[p].max()) * len(p) <= budget or len(p) == 1 for p in plan] == [True] * len(plan)
    assert torch.equal(torch.cat(plan), torch.argsort(lengths, descending=True, stable=True))
    assert len(plan_micro_batches(b, torch.arange(len(b)), 2, 10_000)) == 3  # micro_batch caps the count too
    assert plan_micro_batches(b, torch.arange(len(b)), 4, 0)[0].tolist() == [0, 1, 2, 3]  # off: in order
    noise = 0.4 * torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(fresh_seed())) * b.mask
    runs = []
    for tokens in (0, budget):
        tr = _trainer(6, micro_batch_tokens=tokens)
        lp = tr.score(b)
        stats = tr.update(b, adv, lp + noise, None, step=0)
        runs.append((lp, stats, [p.detach().clone() for p in tr.model.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert_same_updates(runs[0][1:], [runs[1][1:]])
    from jetrl_cli.config import load_job_config
    from jetrl_cli.errors import PresetError

    with pytest.raises(PresetError, match=r"train.micro_batch_tokens: must be 0 \(off\) or at least rollout.max_len "
                                          r"\(48\), so that the longest sequence fits; got 40"):
        load_job_config("fp8-unified", ["train.micro_batch_tokens=40"])


def test_the_adaptive_kl_controller_moves_toward_its_target_as_verls_does():
    from jetrl_cli.rl.algos import adaptive_kl_coef

    g = torch.Generator().manual_seed(fresh_seed())
    for _ in range(20):
        coef, kl, target = (float(x) for x in torch.rand(3, generator=g) * torch.tensor([0.1, 0.4, 0.2]) + 1e-3)
        n, horizon = int(torch.randint(1, 512, (), generator=g)), int(torch.randint(100, 20000, (), generator=g))
        want = coef * (1 + max(-0.2, min(0.2, kl / target - 1)) * n / horizon)  # verl's AdaptiveKLController.update
        assert adaptive_kl_coef(coef, kl, n, target, horizon) == pytest.approx(want, rel=1e-12)
    assert adaptive_kl_coef(0.1, 0.5, 100, 0.1, 100) == pytest.approx(0.12)  # 5x over target: +20% at most
    assert adaptive_kl_coef(0.1, 0.0, 100, 0.1, 100) == pytest.approx(0.08)  # none: -20% at most
