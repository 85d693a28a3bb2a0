"""The embedded rollout engine: batch invariance, rollout-vs-trainer logprobs, sampling, sync."""

import copy
import itertools
import json
import math

import pytest
import torch

from jetrl_cli.engine.base import make_payload
from jetrl_cli.engine.embedded import EmbeddedEngine
from jetrl_cli.engine.sampling import (SamplingParams, gathered_logprobs, gathered_logprobs_entropy, keyed_uniform,
                                      prompt_seeds, sample, sample_keys, sampling_logprobs)
from jetrl_cli.errors import JetrlError
from jetrl_cli.models.llama import LlamaForCausalLM, key_width
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import apply_flow, named_flow
from jetrl_cli.precision.linear import JetLinear
from jetrl_cli.rl.trainer import Batch, Trainer
from jetrl_cli.rl.algos import CorrectionConfig
from jetrl_cli.config import TrainConfig

from .conftest import fresh_seed

WIDTH = 64
SEED = 20261123  # generators drawn in the tests below; a failure reproduces with the same draws


def _tiny_model():
    torch.manual_seed(1234)
    m = LlamaForCausalLM(tiny_config("qwen2", hidden=256, layers=2, vocab=512))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m


@pytest.fixture(scope="module")
def model():
    return _tiny_model()


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
    # quantization noise: about 1e-3 nats a token on average and 4e-3 at most for FP8 (a quarter of that for
    # INT8's per-channel weights) on this model; a wrong scale or block moves logprobs by O(1)
    assert diff.mean() < 0.01 and diff.max() < 0.05


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
    assert torch.equal(m(ids), full)
    with torch.no_grad():  # keys past the sequence add exact zeros, in any number of key chunks
        for w in (16, 32, 48, 80, 300):
            assert torch.equal(m(ids, width=w), full)


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


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=40),
                                    SamplingParams(temperature=1.3, top_p=0.9)], ids=["plain", "t0.7", "top_k", "top_p"])
def test_gathered_logprobs_are_the_sampling_logprobs_with_a_one_pass_backward(params):
    """The trainer's token logprobs (``gathered_logprobs``) are the rollout's ``sampling_logprobs`` at
    the tokens, bit for bit; their gradient is ``g * (onehot - p) / temperature`` (p the sampling
    distribution, 0 where top-k / top-p drop a token), checked against float64; and the backward
    makes one vocabulary-sized tensor, written in place -- no zero fill to scatter into and no
    log-softmax backward (autograd's way: five vocab-sized reads and writes more per logprob chunk)."""
    g = torch.Generator().manual_seed(SEED)
    n, v = 37, 1000
    logits = (torch.randn(n, v, generator=g) * 3).requires_grad_(True)
    full = sampling_logprobs(logits.detach(), params)
    targets = torch.multinomial(full.exp(), 1, generator=g)[:, 0]  # tokens the distribution can draw
    up = torch.randn(n, generator=g)
    lp = gathered_logprobs(logits, targets, params)
    assert torch.equal(lp.detach(), full.gather(-1, targets[:, None])[:, 0])
    with torch.no_grad():
        assert torch.equal(gathered_logprobs(logits, targets, params), lp.detach())
    made = []  # the vocabulary-sized tensors the backward allocates

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == n * v and not func.is_view \
                    and not any(a is out for a in args):
                made.append(func.overloadpacket.__name__)
            return out

    with Ops():
        lp.backward(up)
    # and with a temperature, autograd's backward of the division (top-k / top-p masks: of masked_fill)
    assert made[0] == "exp" and not {"new_zeros", "zeros_like", "scatter", "_log_softmax_backward_data"} & set(made)
    assert len(made) == 1 + (params.temperature != 1.0) + bool(params.top_k) + (params.top_p < 1.0), made
    x64 = logits.detach().double() / params.temperature
    p = (x64 - x64.max(-1, keepdim=True).values).exp() * (full > float("-inf"))  # the tokens kept
    p = p / p.sum(-1, keepdim=True)
    want = up.double()[:, None] * (torch.nn.functional.one_hot(targets, v).double() - p) / params.temperature
    assert (logits.grad.double() - want).abs().max() <= 1e-6


def _entropy64(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution's entropy in float64: softmax of the logits over the temperature,
    restricted to the tokens top-k / top-p keep (those ``sampling_logprobs`` leaves finite)."""
    kept = sampling_logprobs(logits, params) > float("-inf")
    x = logits.double() / (params.temperature or 1.0)
    x = x.masked_fill(~kept, float("-inf"))
    lp = x.log_softmax(-1)
    return -(lp.exp() * lp.masked_fill(~kept, 0.0)).sum(-1)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=40),
                                    SamplingParams(temperature=1.3, top_p=0.9)], ids=["plain", "t0.7", "top_k", "top_p"])
def test_entropy_is_the_sampling_distributions_and_leaves_the_logprobs_alone(params):
    """``gathered_logprobs_entropy`` (the trainer's scoring with the policy-entropy metric): the same
    logprob bits as ``gathered_logprobs``, and each row's entropy of the distribution the token was
    sampled from against float64 -- random rows, plus a one-hot row (0 nats) and a flat one (log V)."""
    n, v = 37, 1000
    logits = torch.randn(n, v) * 3
    logits[0] = 0.0
    logits[1] = -1e4
    logits[1, 5] = 1e4
    targets = torch.multinomial(sampling_logprobs(logits, params).exp(), 1)[:, 0]
    lp, ent = gathered_logprobs_entropy(logits, targets, params)
    assert torch.equal(lp, gathered_logprobs(logits, targets, params))
    want = _entropy64(logits, params)
    assert (ent.double() - want).abs().max() <= 1e-5 * math.log(v)
    assert ent[1] == 0.0
    if params.top_p == 1.0:  # top-k keeps a flat row whole (its k-th score ties with every score)
        assert float(ent[0]) == pytest.approx(math.log(v), rel=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=40),
                                    SamplingParams(temperature=1.3, top_p=0.9)], ids=["plain", "t0.7", "top_k", "top_p"])
def test_entropy_with_autograd_has_the_same_bits_and_the_float64_gradient(params):
    """With autograd (the loss's entropy bonus), ``gathered_logprobs_entropy`` gives the bits it
    gives without, and the gradient w.r.t. the logits of ``g . logprob + g_H . entropy`` is
    float64 autograd's over the kept tokens (0 at the dropped ones), for fresh random logits and
    upstream gradients, with a one-hot and a flat row."""
    n, v = 29, 500
    g = torch.Generator().manual_seed(fresh_seed())
    logits = torch.randn(n, v, generator=g) * 3
    logits[0] = 0.0
    logits[1] = -1e4
    logits[1, 5] = 1e4
    targets = torch.multinomial(sampling_logprobs(logits, params).exp(), 1, generator=g)[:, 0]
    up, up_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    x = logits.clone().requires_grad_()
    lp, ent = gathered_logprobs_entropy(x, targets, params)
    plain = gathered_logprobs_entropy(logits, targets, params)
    assert torch.equal(lp.detach(), plain[0]) and torch.equal(ent.detach(), plain[1])
    ((lp * up).sum() + (ent * up_ent).sum()).backward()
    kept = sampling_logprobs(logits, params) > float("-inf")
    xd = logits.double().requires_grad_()
    s = (xd / (params.temperature or 1.0)).masked_fill(~kept, float("-inf"))
    ls = s.log_softmax(-1)
    ent64 = -(ls.exp() * ls.masked_fill(~kept, 0.0)).sum(-1)
    ((ls.gather(-1, targets[:, None])[:, 0] * up.double()).sum() + (ent64 * up_ent.double()).sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[~kept], torch.zeros_like(x.grad[~kept]))
    err = (x.grad.double() - xd.grad).norm() / xd.grad.norm()
    assert err < 1e-5, float(err)


def test_trainer_scores_the_policy_entropy_beside_the_same_logprobs(model):
    """``Trainer.score(entropy=True)``: the logprobs of ``score`` bit for bit, and at each completion
    token the entropy of the training precision's sampling distribution there (0 off the mask),
    against float64 from the model's full logits."""
    b, lp, _ = _rollout_and_score(model, "fp8-unified", temperature=0.8, top_k=50)
    sp = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=50)
    tr = Trainer(copy.deepcopy(model), named_flow("fp8-unified"), TrainConfig(micro_batch=5), CorrectionConfig(), sp,
                 WIDTH)
    both = tr.score(b, entropy=True)
    assert both.shape == (2, *b.mask.shape)
    assert torch.equal(both[0], lp)
    assert torch.equal(both[1][~b.mask], torch.zeros(int((~b.mask).sum())))
    with torch.no_grad():
        logits = tr.model(b.ids, head=lambda m, h: m.logits(h[:, :-1]))
    want = _entropy64(logits[b.mask].float(), sp)
    assert (both[1][b.mask].double() - want).abs().max() <= 1e-4
    assert want.min() > 0.01  # sampled tokens of a random model: far from one-hot


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
    g = torch.Generator().manual_seed(fresh_seed())
    draws = torch.stack([sample(torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3), SamplingParams(), g)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def _sampling_distribution64(row, temperature, top_k, top_p):
    """The sampling distribution of one row of logits, in float64 with Python's sort: the logits over
    the temperature; top-k keeps the k highest (ties with the k-th too); of those, top-p keeps the
    highest whose mass before them, renormalised over top-k's tokens, is below top_p. Returns the
    log-probabilities (-inf where dropped) and the smallest distance of a mass to top_p (a row that
    close to the boundary is decided by rounding; 0 where two equal logits straddle the cut)."""
    x = [float(v) / temperature for v in row]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    kept = order if not top_k or top_k >= len(x) else [i for i in order if x[i] >= x[order[top_k - 1]]]
    top = max(x[i] for i in kept)
    z = sum(math.exp(x[i] - top) for i in kept)
    margin, mass, chosen = math.inf, 0.0, []
    for i in kept:
        if top_p < 1.0:
            margin = min(margin, abs(mass - top_p))
            if mass >= top_p:
                if x[i] == x[chosen[-1]]:  # a tie across the cut: which of the two is kept is arbitrary
                    margin = 0.0
                break
        chosen.append(i)
        mass += math.exp(x[i] - top) / z
    top = max(x[i] for i in chosen)
    lse = top + math.log(sum(math.exp(x[i] - top) for i in chosen))
    out = [-math.inf] * len(x)
    for i in chosen:
        out[i] = x[i] - lse
    return torch.tensor(out, dtype=torch.float64), margin


def test_sampling_logprobs_are_the_float64_distribution_with_temperature_top_k_and_top_p():
    """Temperature, then top-k, then top-p on what top-k kept, renormalised: against a float64
    reference on fresh random rows, every combination (``sampling_logprobs`` is what the engine samples
    from and the trainer scores with)."""
    g = torch.Generator().manual_seed(fresh_seed())
    checked = 0
    for temperature, top_k, top_p in itertools.product((0.6, 1.0, 1.7), (0, 5, 20), (0.3, 0.9, 1.0)):
        logits = torch.randn(16, 50, generator=g) * torch.rand(16, 1, generator=g) * 6
        logits[0, 1] = logits[0, 0]  # a tie among the draws
        got = sampling_logprobs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)).double()
        for r in range(logits.shape[0]):
            want, margin = _sampling_distribution64(logits[r].tolist(), temperature, top_k, top_p)
            if margin < 1e-4:  # a mass within rounding of top_p: either choice is right
                continue
            assert torch.equal(got[r].isinf(), want.isinf()), (temperature, top_k, top_p, r)
            kept = ~want.isinf()
            torch.testing.assert_close(got[r][kept], want[kept], rtol=0, atol=1e-5)
            checked += 1
    assert checked >= 0.9 * 27 * 16


def test_keyed_sampling_draws_from_the_distribution():
    logp = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(4000, 3)
    keys = sample_keys(list(range(1000)), 4)  # 1000 prompt seeds x 4 samples: 4000 distinct keys
    assert keys.unique().numel() == 4000
    for pos in (0, 17):
        freq = torch.bincount(sample(logp, SamplingParams(), keys=keys, position=pos), minlength=3).float() / 4000
        assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
    u = keyed_uniform(keys, 3, 512)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.002
    assert torch.equal(u, keyed_uniform(keys, 3, 512)) and not torch.equal(u, keyed_uniform(keys, 4, 512))
    assert torch.equal(keyed_uniform(keys[10:20], 3, 512), u[10:20])  # a row's noise is its key's alone


def test_samples_depend_on_the_prompt_seed_only(model):
    """Chunking (max_batch), the other prompts of the call and how many there are do not change a
    prompt's samples: a data-parallel rank passing its slice of prompt_seeds gets the same ones."""
    flow = named_flow("fp8-unified")
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, stop_token_ids=(7,))
    g = torch.Generator().manual_seed(fresh_seed())
    prompts = [torch.randint(0, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 10, (5,), generator=g)]
    small, big = EmbeddedEngine(model, flow, WIDTH, max_batch=4), EmbeddedEngine(model, flow, WIDTH, max_batch=64)
    for eng in (small, big):
        eng.load_weights(make_payload(model, flow))

    def toks(groups):
        return [[(c.tokens, c.logprobs) for c in grp] for grp in groups]

    full = toks(small.generate(prompts, sp, 9))
    assert toks(big.generate(prompts, sp, 9)) == full
    assert toks(big.generate(prompts[2:4], sp, prompt_seeds(9, 5)[2:4])) == full[2:4]
    assert toks(small.generate(prompts, sp, 10)) != full
    assert len({tuple(c[0]) for grp in full for c in grp}) > 5  # the samples of a group differ


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


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified", "int8-rollout"])
def test_grad_and_no_grad_forwards_are_bitwise_equal(model, flow):
    """Inference fuses q/k/v and gate/up into one GEMM each; training runs them separately."""
    tm = copy.deepcopy(model)
    f = named_flow(flow)
    apply_flow(tm, f, "train")
    ids = torch.randint(0, 512, (3, 20))
    with torch.no_grad():
        fused = tm(ids, width=WIDTH)
    sep = tm(ids, width=WIDTH)
    assert sep.requires_grad and torch.equal(fused, sep.detach())
    apply_flow(tm, f, "rollout")
    with torch.no_grad():
        fused_r = tm(ids, width=WIDTH)
    with torch.enable_grad():
        sep_r = tm(ids, width=WIDTH)
    assert torch.equal(fused_r, sep_r.detach())


def test_hf_model_with_bpe_tokenizer_runs_a_jsonl_rollout(tmp_path):
    """A Qwen2 model and a BPE tokenizer saved by transformers (built here, nothing downloaded):
    jetrl loads both, matches transformers' logits, and samples with them."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Tk, models, pre_tokenizers, trainers, decoders

    tk = Tk(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["What is 12 plus 30? The answer is \\boxed{42}."] * 50,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<unk>")
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path / "m")
    fast.save_pretrained(tmp_path / "m")

    from jetrl_cli.models.hf import load_model
    from jetrl_cli.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tmp_path / "m")
    text = "What is 12 plus 30?"
    assert tok.encode(text) == fast.encode(text) and tok.decode(tok.encode(text)) == text
    assert fast.eos_token_id in tok.eos_ids
    ids = torch.tensor([tok.encode(text)])
    ours = load_model(tmp_path / "m")
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits.float(), atol=1e-4)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"question": "What is {i} plus {i}?", "answer": "#### {2 * i}"}}\n' for i in range(20)))
    from typer.testing import CliRunner

    from jetrl_cli.cli import app

    out = tmp_path / "r.jsonl"
    res = CliRunner().invoke(app, ["rollout", "bf16", "-o", str(out), "--prompts", "2", "--json",
                                   "--set", f"model.path={tmp_path / 'm'}", "--set", "task.name=jsonl",
                                   "--set", f"task.file={data}", "--set", "task.prompt_key=question",
                                   "--set", "rollout.n=2", "--set", "rollout.max_new_tokens=8"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["prompt"].startswith("What is")
    # mismatch-report runs on the same local HF model: unified on-policy, fp8 rollout not
    task = ["--set", f"model.path={tmp_path / 'm'}", "--set", "task.name=jsonl", "--set", f"task.file={data}",
            "--set", "task.prompt_key=question", "--set", "rollout.n=2"]
    res = CliRunner().invoke(app, ["mismatch-report", "bf16", "--flows", "fp8-rollout,fp8-unified", "--lengths", "8",
                                   "--prompts", "2", "--attribution-sequences", "2", "--json", *task])
    assert res.exit_code == 0, res.output
    rep = {f["flow"]: f for f in json.loads(res.stdout)["flows"]}
    assert rep["fp8-unified"]["summary"]["mismatch_kl"] == 0.0 and rep["fp8-rollout"]["summary"]["mismatch_kl"] > 0
    assert len(rep["fp8-rollout"]["layers"]) == 2 * 7


@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_group_prompts_share_one_prefill_with_the_same_bits(model, flow_name):
    """The engine prefills each distinct prompt once and copies its rows to the group: the cache
    and logits equal a prefill of every row, and sampling is unchanged."""
    m = copy.deepcopy(model).eval()
    apply_flow(m, named_flow(flow_name), "rollout")
    g = torch.Generator().manual_seed(SEED)
    distinct = [torch.randint(3, 60, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (3,), generator=g)]
    which = [0, 0, 1, 2, 2, 2, 1]
    prompts = [distinct[i] for i in which]

    def prefill(ps):
        lengths = torch.tensor([len(p) for p in ps])
        ids = torch.zeros(len(ps), int(lengths.max()), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, :len(p)] = torch.tensor(p)
        cache = m.new_cache(len(ps), WIDTH)
        return m.prefill(ids, lengths, cache), cache

    with torch.inference_mode():
        full_logits, full = prefill(prompts)
        logits, shared = prefill(distinct)
        shared.select(torch.tensor(which))
        logits = logits[torch.tensor(which)]
    assert torch.equal(logits, full_logits)
    for a, b in ((full.layer(j), shared.layer(j)) for j in range(full.kv.shape[0])):
        for i, p in enumerate(prompts):
            assert torch.equal(a[i, :, :len(p)], b[i, :, :len(p)])
    eng = EmbeddedEngine(model, named_flow(flow_name), WIDTH)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, n=3)
    grouped = eng.generate(distinct, sp, seed=5)
    assert all(len(gr) == 3 for gr in grouped)
    assert len({tuple(c.tokens) for gr in grouped for c in gr}) > 3  # samples of a group differ


def test_compaction_policy():
    from jetrl_cli.engine.embedded import compaction
    from jetrl_cli.precision.gemm import ROW_TILE

    rows = list(range(32))
    assert compaction(rows, 32) is None
    done = [i if i % 5 else -1 for i in rows]  # 7 finished: fewer than a ROW_TILE
    assert compaction(done, 25) is None
    done = [i if i % 3 else -1 for i in rows]  # 11 finished of 32: drop them, keep 24 = 21 live + 3
    keep = compaction(done, 21)
    assert len(keep) % ROW_TILE == 0 and len(keep) == 24 and keep == sorted(keep)
    assert all(i in keep for i, r in enumerate(done) if r >= 0)
    assert compaction([-1] * 7 + [3], 1) is None  # never below one tile


@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_rows_dropped_mid_rollout_keep_logprobs_bitwise_on_policy(model, flow_name):
    """Many stop tokens: rows finish at different steps and the batch is compacted several times
    (into the engine's reused KV storage); the logprobs still equal the trainer's, and a second
    call with the same seed, on the reused storage, gives the same samples."""
    flow = named_flow(flow_name)
    tm = copy.deepcopy(model)
    stops = tuple(range(0, 512, 6))  # ~1 token in 6 stops a row
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, n=8, stop_token_ids=stops)
    tr = Trainer(tm, flow, TrainConfig(micro_batch=16), CorrectionConfig(), sp, WIDTH)
    eng = EmbeddedEngine(tm, flow, WIDTH, max_batch=64)
    eng.load_weights(make_payload(tm, flow))
    sizes = []
    orig = eng.model.decode

    def decode(tokens, cache, width=None):
        sizes.append(tokens.shape[0])
        assert width == key_width(int(cache.lengths.max()) + 1)  # the host's width is the cache's
        return orig(tokens, cache, width)

    eng.model.decode = decode
    g = torch.Generator().manual_seed(SEED + 1)
    prompts = [torch.randint(1, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 14, (5,), generator=g)]
    out = eng.generate(prompts, sp, seed=11)
    assert len(set(sizes)) >= 3 and all(s % 8 == 0 for s in sizes)  # compacted, to whole row tiles
    flat = [(p, c) for p, grp in zip(prompts, out) for c in grp]
    lens = [len(c.tokens) for _, c in flat]
    assert min(lens) < 5 and max(lens) > 10
    b = Batch.build([p for p, _ in flat], [c.tokens for _, c in flat], [c.logprobs for _, c in flat],
                    [0.0] * len(flat), [i // 8 for i in range(len(flat))])
    old = tr.score(b)
    assert torch.equal(old[b.mask], b.rollout_logp[b.mask])
    again = eng.generate(prompts, sp, seed=11)
    assert [[c.tokens for c in gr] for gr in again] == [[c.tokens for c in gr] for gr in out]
    assert [[c.logprobs for c in gr] for gr in again] == [[c.logprobs for c in gr] for gr in out]


def test_kv_cache_select_into_storage():
    from jetrl_cli.models.llama import KVCache

    cfg = tiny_config("qwen2", hidden=64, layers=2, vocab=64)
    cache = KVCache(cfg, 5, 32)
    cache.kv.normal_()
    cache.lengths = torch.tensor([3, 4, 5, 6, 7])
    before = cache.kv.clone()
    storage = torch.full((KVCache.numel(cfg, 8, 32),), float("nan"))
    rows = torch.tensor([4, 1, 1])
    cache.select(rows, storage)
    assert cache.kv.data_ptr() == storage.data_ptr() and torch.equal(cache.kv, before[:, rows])
    assert torch.equal(cache.layer(3), before[3][rows])  # layer 1's values
    assert cache.lengths.tolist() == [7, 4, 4]
    fresh = KVCache(cfg, 8, 32, storage=storage)  # reused storage starts from zeros, never stale
    assert torch.count_nonzero(fresh.kv) == 0
    with pytest.raises(ValueError, match="storage holds"):
        KVCache(cfg, 9, 32, storage=storage)


def test_kv_cache_compacts_in_place_at_the_same_addresses():
    """A GPU engine shrinks its batch inside one cache tensor, so a captured decode step keeps
    reading the same memory; the kept sequences move to the front, in order."""
    from jetrl_cli.models.llama import KVCache
    from jetrl_cli.precision.quant import CastSpec

    cfg = tiny_config("qwen2", hidden=64, layers=2, vocab=64)
    for spec in (None, CastSpec("fp8_e4m3", "row")):
        cache = KVCache(cfg, 6, 32, spec=spec)
        g = torch.Generator().manual_seed(SEED + 4)
        k_in, v_in = (torch.randn(6, cfg.num_key_value_heads, 16, cfg.head_dim, generator=g) for _ in range(2))
        cache.store(0, cache.write_index(torch.arange(16).expand(6, 16)), k_in, v_in)
        cache.lengths = torch.arange(10, 16)
        before_k, before_v = (t.clone() for t in cache.read(0, 16, torch.float32))
        ptr = cache.kv.data_ptr()
        keep = torch.tensor([1, 4, 5])
        cache.compact_(keep)
        k, v = cache.read(0, 16, torch.float32)
        assert cache.kv.data_ptr() == ptr and cache.batch == 3 and cache.lengths.tolist() == [11, 14, 15]
        assert torch.equal(k, before_k[keep]) and torch.equal(v, before_v[keep])


def test_looking_for_stops_less_often_changes_no_sample(model):
    """On a GPU the engine looks for stopped rows every 8 tokens (one host sync each time), so rows
    decode a few tokens past their stop; what it returns is the same as looking after every token."""
    flow = named_flow("fp8-unified")
    stops = tuple(range(0, 512, 19))  # ~1 token in 19: some rows stop early, some run to the end
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, n=4, stop_token_ids=stops)
    g = torch.Generator().manual_seed(SEED + 2)
    prompts = [torch.randint(1, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 14, (6,), generator=g)]
    outs = {}
    for every in (1, 3, 8):
        eng = EmbeddedEngine(model, flow, WIDTH, max_batch=16)
        eng.load_weights(make_payload(model, flow))
        eng.check_every = every
        outs[every] = [[(c.tokens, c.logprobs, c.finish_reason) for c in gr] for gr in eng.generate(prompts, sp, 3)]
    assert outs[1] == outs[3] == outs[8]
    reasons = [r for gr in outs[1] for _, _, r in gr]
    assert "stop" in reasons and "length" in reasons


def test_first_stop_by_hand():
    from jetrl_cli.engine.base import cut_at_stop, first_stop

    sp = SamplingParams(stop_token_ids=(9,), stop_sequences=((4, 5), (5, 6, 7)))
    assert first_stop([1, 2, 3], sp) is None
    assert first_stop([1, 4, 5, 9], sp) == 2  # the sequence ends before the stop token
    assert first_stop([1, 4, 9, 5], sp) == 2  # the stop token comes first
    assert first_stop([4, 5], sp) == 1 and first_stop([5, 6, 7, 4, 5], sp) == 2  # the earliest end wins
    assert first_stop([1, 4, 2, 5, 6, 8], sp) is None  # interrupted sequences do not count
    c = cut_at_stop([3, 5, 6, 7, 1], [-0.1, -0.2, -0.3, -0.4, -0.5], sp)
    assert (c.tokens, c.logprobs, c.finish_reason) == ([3, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4], "stop")
    assert cut_at_stop([1, 2], [-1.0, -2.0], sp, "stop").finish_reason == "stop"  # an engine's own reason kept
    assert cut_at_stop([1, 2], [-1.0, -2.0], sp).finish_reason == "length"


def test_rollout_stop_strings_become_stop_tokens_or_token_sequences():
    """``rollout.stop``: a one-token string is a stop token, a longer one the token sequence the
    tokenizer spells it as, for the rollout, greedy eval and sampled eval alike; a string that
    encodes to nothing is refused, naming the key."""
    from jetrl_cli.config import load_job_config
    from jetrl_cli.errors import JetrlError
    from jetrl_cli.models.tokenizer import Tokenizer
    from jetrl_cli.rl.loop import resolve_model_dir, sampling_params

    cfg = load_job_config("fp8-unified", ['rollout.stop=["12", "=", "ns:"]'])
    tok = Tokenizer.from_dir(resolve_model_dir(cfg.model.path))
    twelve, eq, ns = (tuple(tok.encode(x)) for x in ("12", "=", "ns:"))
    assert len(eq) == 1 and len(twelve) == 2 and len(ns) == 3
    for sp in (sampling_params(cfg, tok), sampling_params(cfg, tok, greedy=True),
               sampling_params(cfg, tok, evaluation=True)):
        assert sp.stop_token_ids == (*tok.eos_ids, eq[0]) and sp.stop_sequences == (twelve, ns)
    with pytest.raises(JetrlError, match="rollout.stop: '' encodes to no token"):
        sampling_params(load_job_config("fp8-unified", ['rollout.stop=[""]']), tok)


@pytest.mark.parametrize("every", [1, 4])
def test_stop_sequences_cut_each_row_where_its_tokens_first_spell_one(model, every):
    """Multi-token stop sequences: each row stops once its last tokens are one of them (looked for
    on the device, every step), and what it returns is the unstopped generation cut there (a row's
    tokens depend on its own key and position only), with every row compacted out of the batch once
    stopped. The sequences are taken from the unstopped samples, so they occur."""
    flow = named_flow("bf16")
    g = torch.Generator().manual_seed(fresh_seed())
    prompts = [torch.randint(1, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 14, (5,), generator=g)]
    free = SamplingParams(max_new_tokens=20, temperature=1.0, n=3)
    eng = EmbeddedEngine(model, flow, WIDTH, max_batch=16)
    eng.load_weights(make_payload(model, flow))
    eng.check_every = every
    unstopped = eng.generate(prompts, free, 5)
    rows = [c.tokens for gr in unstopped for c in gr]
    seqs = tuple({tuple(r[2:4]) for r in rows[:11]}) + (tuple(rows[12][6:9]),)  # 11 rows stop by step 4
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, n=3, stop_sequences=seqs)
    decoded = []  # rows of each decode step: stopped rows leave the batch, they are not just cut at the end
    real = eng.model.decode
    eng.model.decode = lambda nxt, *a, **k: decoded.append(len(nxt)) or real(nxt, *a, **k)
    got = eng.generate(prompts, sp, 5)
    assert decoded[-1] < 15 and sum(decoded) < 15 * 19  # without a stop: 15 rows x 19 decode steps
    from jetrl_cli.engine.base import cut_at_stop

    want = [[cut_at_stop(c.tokens, c.logprobs, sp) for c in gr] for gr in unstopped]
    assert got == want
    stopped = [c for gr in got for c in gr if c.finish_reason == "stop"]
    assert len(stopped) >= 11 and all(any(tuple(c.tokens[-len(q):]) == q for q in seqs) for c in stopped)


@pytest.mark.parametrize("flow_name", ["fp8-unified", "bf16"])
def test_fp8_kv_cache_holds_fp8_and_stays_bitwise_on_policy(model, flow_name):
    """``kv_cache: fp8_e4m3 row`` stores FP8 keys and values with one fp32 scale per token and head
    (head_dim + 4 bytes per head and token, against 2 * head_dim in bf16), attention reads them
    dequantized, and the trainer rounds its keys and values to the same values: the rollout's
    logprobs still equal the trainer's bit for bit."""
    from jetrl_cli.precision import parse_flow

    flow = parse_flow({"base": flow_name, "rollout": {"kv_cache": "fp8_e4m3 row"}, "unified": True},
                      source="<test>")
    assert flow.kv_cast("train") == flow.kv_cast("rollout")
    tm = copy.deepcopy(model)
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, n=4, stop_token_ids=tuple(range(0, 512, 23)))
    eng = EmbeddedEngine(tm, flow, WIDTH, max_batch=8)
    eng.load_weights(make_payload(tm, flow))
    cache = eng.model.new_cache(2, WIDTH)
    assert cache.kv.dtype == torch.float8_e4m3fn and cache.scales.shape == cache.kv.shape[:-1]
    cfg = eng.model.config
    assert cache.nbytes_per_token() == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim + 4)
    g = torch.Generator().manual_seed(SEED + 3)
    prompts = [torch.randint(1, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 14, (5,), generator=g)]
    out = eng.generate(prompts, sp, seed=4)
    flat = [(p, c) for p, grp in zip(prompts, out) for c in grp]
    b = Batch.build([p for p, _ in flat], [c.tokens for _, c in flat], [c.logprobs for _, c in flat],
                    [0.0] * len(flat), [i // 4 for i in range(len(flat))])
    tr = Trainer(copy.deepcopy(model), flow, TrainConfig(micro_batch=7), CorrectionConfig(), sp, WIDTH)
    old = tr.score(b)
    assert b.mask.sum() > 40 and torch.equal(old[b.mask], b.rollout_logp[b.mask])
    # and the FP8 cache changes the numbers: against the bf16-cache flow the logprobs differ
    ref = Trainer(copy.deepcopy(model), named_flow(flow_name), TrainConfig(micro_batch=7), CorrectionConfig(), sp, WIDTH)
    assert not torch.equal(ref.score(b)[b.mask], b.rollout_logp[b.mask])
