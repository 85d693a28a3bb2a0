"""The embedded rollout engine: batch invariance, rollout-vs-trainer logprobs, sampling, sync."""

import copy

import pytest
import torch

from jetrl_cli.engine.base import make_payload
from jetrl_cli.engine.embedded import EmbeddedEngine
from jetrl_cli.engine.sampling import SamplingParams, sample, sampling_logprobs
from jetrl_cli.errors import JetrlError
from jetrl_cli.models.llama import LlamaForCausalLM
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import apply_flow, named_flow
from jetrl_cli.precision.gemm import row_invariant_mm
from jetrl_cli.precision.linear import JetLinear
from jetrl_cli.rl.trainer import Batch, Trainer
from jetrl_cli.rl.algos import CorrectionConfig
from jetrl_cli.config import TrainConfig

WIDTH = 64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1234)
    m = LlamaForCausalLM(tiny_config("qwen2", hidden=256, layers=2, vocab=512))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m


@pytest.mark.parametrize("k,n", [(64, 96), (256, 384), (384, 512)])
def test_row_invariant_mm_rows_do_not_depend_on_batch(k, n):
    a, b = torch.randn(300, k), torch.randn(n, k)
    full = row_invariant_mm(a, b)
    for rows in ([0], [5, 6, 7], list(range(17)), [299]):
        assert torch.equal(row_invariant_mm(a[rows], b), full[rows])
    ref = a.double() @ b.double().T
    assert ((full.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def _rollout_and_score(model, flow_name, seed=0, n=3, temperature=1.0, top_p=1.0, top_k=0):
    flow = named_flow(flow_name)
    tm = copy.deepcopy(model)
    sp = SamplingParams(max_new_tokens=24, temperature=temperature, top_p=top_p, top_k=top_k, n=n,
                        stop_token_ids=(7,))
    tr = Trainer(tm, flow, TrainConfig(micro_batch=5), CorrectionConfig(), sp, WIDTH)
    eng = EmbeddedEngine(tm, flow, WIDTH, max_batch=4)  # several chunks, rows leaving as they stop
    eng.load_weights(make_payload(tm, flow))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 14, (5,), generator=g)]
    out = eng.generate(prompts, sp, seed)
    flat = [(p, c) for p, grp in zip(prompts, out) for c in grp]
    b = Batch.build([p for p, _ in flat], [c.tokens for _, c in flat], [c.logprobs for _, c in flat],
                    [0.0] * len(flat), [i // n for i in range(len(flat))])
    return b, tr.score(b), out


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified"])
def test_on_policy_flows_rollout_logprobs_equal_trainer_bitwise(model, flow):
    b, old, out = _rollout_and_score(model, flow)
    assert b.mask.sum() > 40
    assert torch.equal(old[b.mask], b.rollout_logp[b.mask])
    from jetrl_cli.rl.algos import mismatch_metrics

    assert mismatch_metrics(old, b.rollout_logp, b.mask)["mismatch_kl"] == 0.0


def test_on_policy_holds_with_top_k_top_p_and_temperature(model):
    b, old, _ = _rollout_and_score(model, "fp8-unified", seed=3, temperature=0.7, top_p=0.9, top_k=40)
    assert torch.equal(old[b.mask], b.rollout_logp[b.mask])


@pytest.mark.parametrize("flow", ["fp8-rollout", "int8-rollout"])
def test_off_policy_flows_differ(model, flow):
    b, old, _ = _rollout_and_score(model, flow)
    diff = (old - b.rollout_logp)[b.mask].abs()
    assert (diff > 0).float().mean() > 0.5
    assert diff.max() < 0.5  # quantization noise, not a bug


def test_decode_logits_match_full_forward_in_fp32(model):
    m = copy.deepcopy(model).eval()
    ids = torch.randint(0, 512, (3, 10))
    lengths = torch.tensor([4, 6, 5])
    cache = m.new_cache(3, WIDTH)
    with torch.no_grad():
        first = m.prefill(ids[:, :6], lengths, cache)
        nxt = m.decode(ids[torch.arange(3), lengths], cache)
        full = m(ids, width=WIDTH)
    assert torch.equal(first, full[torch.arange(3), lengths - 1])
    assert torch.equal(nxt, full[torch.arange(3), lengths])
    hf_style = m(ids)  # default width: the sequence length; same numbers up to rounding
    assert torch.allclose(hf_style, full, atol=1e-5)


def test_generate_is_seeded_grouped_and_stops(model):
    flow = named_flow("bf16")
    eng = EmbeddedEngine(model, flow, WIDTH, max_batch=3)
    eng.load_weights(make_payload(model, flow))
    prompts = [[1, 2, 3], [4, 5], [6]]
    logits = eng.model.prefill(torch.tensor([[1, 2, 3]]), torch.tensor([3]), eng.model.new_cache(1, WIDTH))
    stop = int(logits.argmax())  # the greedy first token of prompt 0: must stop at once
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, n=4, stop_token_ids=(stop,))
    a = eng.generate(prompts, sp, seed=5)
    b = eng.generate(prompts, sp, seed=5)
    c = eng.generate(prompts, sp, seed=6)
    assert [[x.tokens for x in g] for g in a] == [[x.tokens for x in g] for g in b]
    assert [[x.tokens for x in g] for g in a] != [[x.tokens for x in g] for g in c]
    assert len(a) == 3 and all(len(g) == 4 for g in a)
    for g in a:
        for x in g:
            assert len(x.tokens) == len(x.logprobs) <= 10
            assert (x.finish_reason == "stop") == (x.tokens[-1] == stop)
            assert stop not in x.tokens[:-1]
            assert x.finish_reason == "stop" or len(x.tokens) == 10
    greedy = eng.generate(prompts, SamplingParams(10, 0.0, n=1, stop_token_ids=(stop,)), seed=0)
    assert greedy[0][0].tokens == [stop] and greedy[0][0].finish_reason == "stop"


def test_sampling_logprobs_masks_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = sampling_logprobs(logits, SamplingParams(top_k=2))
    assert torch.allclose(lp.exp(), torch.tensor([[0.625, 0.375, 0, 0]]))
    lp = sampling_logprobs(logits, SamplingParams(top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(lp.exp(), torch.tensor([[0.625, 0.375, 0, 0]]))
    lp = sampling_logprobs(logits, SamplingParams(top_p=0.81))
    assert torch.allclose(lp.exp(), torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95)
    lp = sampling_logprobs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(lp.exp(), torch.tensor([[0.25, 0.09, 0.0225, 0.0025]]) / 0.3650, atol=1e-4)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3), SamplingParams(), g)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_width_is_checked(model):
    flow = named_flow("bf16")
    eng = EmbeddedEngine(model, flow, 16)
    with pytest.raises(JetrlError, match="exceeds the engine width 16"):
        eng.generate([[1] * 10], SamplingParams(max_new_tokens=8), 0)


def test_quantized_sync_gives_the_trainers_quantized_weights(model):
    flow = named_flow("fp8-unified")
    tm = copy.deepcopy(model)
    apply_flow(tm, flow, "train")
    eng = EmbeddedEngine(tm, flow, WIDTH)
    with torch.no_grad():
        tm.model.layers[0].mlp.up_proj.weight.add_(0.01)
    payload = make_payload(tm, flow, version=3)
    eng.load_weights(payload)
    assert eng.weights_version == 3
    lin_e, lin_t = eng.model.model.layers[0].mlp.up_proj, tm.model.layers[0].mlp.up_proj
    assert isinstance(lin_e, JetLinear)
    qe, qt = lin_e.quantized_weight(), lin_t.quantized_weight()
    assert torch.equal(qe.data.view(torch.uint8), qt.data.view(torch.uint8)) and torch.equal(qe.scale, qt.scale)
    full = sum(p.numel() * 4 for p in tm.parameters())
    assert payload.nbytes < 0.5 * full  # FP8 payload for the quantized layers
