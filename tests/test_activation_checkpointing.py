"""``train.activation_checkpointing``: a training forward keeps each decoder layer's input only and the
backward recomputes the layer -- the same gradients, bit for bit (the recomputed forward runs the same ops),
with a fraction of the saved activations."""

import copy

import pytest
import torch

from jetrl_cli.bench import _saved_bytes
from jetrl_cli.config import TrainConfig, load_job_config
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.errors import PresetError
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import named_flow
from jetrl_cli.rl.algos import CorrectionConfig
from jetrl_cli.rl.trainer import Batch, Trainer, token_logprobs

from .conftest import fresh_seed


def _batch(seed, vocab=256, n=4, t=40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, t), generator=g)
    return Batch.build(ids[:, :10].tolist(), ids[:, 10:].tolist(), [[-1.0] * (t - 10)] * n,
                       torch.rand(n, generator=g).tolist(), [i // 2 for i in range(n)])


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_the_same_gradients_bit_for_bit_with_fewer_saved_activations(flow, kind):
    s = fresh_seed()
    base = random_model(tiny_config(kind, hidden=128, layers=3, vocab=256), seed=s, std=0.05)
    b = _batch(s)
    out = {}
    for ckpt in (False, True):
        tr = Trainer(copy.deepcopy(base), named_flow(flow), TrainConfig(activation_checkpointing=ckpt),
                     CorrectionConfig(), SamplingParams(), 64)
        saved, lp = _saved_bytes(lambda: token_logprobs(tr.model, b, tr.sampling))
        lp.sum().backward()
        out[ckpt] = saved, lp.detach(), {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    (s0, lp0, g0), (s1, lp1, g1) = out[False], out[True]
    assert torch.equal(lp0, lp1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert s1 < 0.5 * s0, (s1, s0)  # 3 layers: their inputs kept, not everything inside them


def test_an_update_with_it_equals_one_without(tmp_path):
    s = fresh_seed()
    base = random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=256), seed=s, std=0.05)
    b = _batch(s + 1)
    weights = []
    for ckpt in (False, True):
        tr = Trainer(copy.deepcopy(base), named_flow("fp8-unified"),
                     TrainConfig(activation_checkpointing=ckpt, micro_batch=2, lr=1e-3), CorrectionConfig(),
                     SamplingParams(), 64)
        old = tr.score(b)
        st = tr.update(b, torch.randn(len(b), generator=torch.Generator().manual_seed(s)), old, None, step=1)
        weights.append((st, [p.detach().clone() for p in tr.model.parameters()]))
    (st0, w0), (st1, w1) = weights
    assert st0 == st1 and all(torch.equal(p, q) for p, q in zip(w0, w1))


def test_it_is_refused_with_cuda_graphs():
    with pytest.raises(PresetError, match="train.activation_checkpointing: not with train.cuda_graphs"):
        load_job_config("bf16", ["train.activation_checkpointing=true", "train.cuda_graphs=true"])
