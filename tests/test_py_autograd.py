"""tests/py_autograd.py's backward (the fake-CUDA runs' autograd engine) against torch's own."""

import pytest
import torch

from tests import py_autograd


def _grads(params):
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def test_small_graph_with_a_multi_output_node_a_reused_leaf_and_an_unused_output():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x = torch.randn(5, 6, generator=g, requires_grad=True)
    w = torch.randn(6, 6, generator=g, requires_grad=True)

    def f():
        a, b, _ = (x @ w).split(2, dim=1)  # the third output gets no gradient
        return (a.sin() * b).sum() + (x * w[0]).cos().sum() + (w * w).mean()

    f().backward()
    want = _grads([x, w])
    py_autograd.backward(f())
    got = _grads([x, w])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="scalar outputs"):
        py_autograd.backward(x @ w)


def test_several_roots_one_reached_from_another_as_the_engine_does():
    """``backward_all``: roots with their gradients (as ``torch.autograd.backward(tensors, grads)``),
    one of them upstream of another and two outputs of one node -- the trainer's CUDA-graph capture
    backpropagates a decoder stack's two outputs at once."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x = torch.randn(5, 6, generator=g, requires_grad=True)
    w = torch.randn(6, 6, generator=g, requires_grad=True)
    gs = [torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g), torch.randn(5, 6, generator=g)]

    def roots():
        a, b = (x @ w).split(3, dim=1)
        c = (a.repeat(1, 2) * x).tanh()  # downstream of a
        return a, b, c

    torch.autograd.backward(roots(), gs)
    want = _grads([x, w])
    py_autograd.backward_all(roots(), gs)
    got = _grads([x, w])
    assert all(torch.equal(p, q) for p, q in zip(got, want))


def test_leaves_keep_and_add_their_gradients_as_in_the_engine():
    """The first backward keeps a leaf's gradient as it arrives (the three weights of a ``cat`` get
    views of one buffer), the second adds into it in place; the same values as the engine's."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ws = [torch.randn(4, 3, generator=g, requires_grad=True) for _ in range(3)]
    x = torch.randn(5, 3, generator=g)

    def run(backward):
        for w in ws:
            w.grad = None
        backward((x @ torch.cat(ws).t()).sin().sum())
        first = [w.grad for w in ws]
        backward((x @ torch.cat(ws).t()).cos().sum())
        assert all(w.grad is f for w, f in zip(ws, first))  # added in place
        assert len({w.grad.untyped_storage()._cdata for w in ws}) == 1  # one buffer
        return _grads(ws)

    want = run(torch.Tensor.backward)
    assert all(torch.equal(a, b) for a, b in zip(run(py_autograd.backward), want))


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified"])
def test_policy_loss_backward_equals_torch_engine(flow, monkeypatch):
    """The trainer's loss: JetLinear's autograd functions, checkpointed logprob chunks, index_put."""
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.shapes import random_model
    from jetrl_cli.models.tiny import tiny_config
    from jetrl_cli.precision import apply_flow, named_flow
    from jetrl_cli.rl import trainer
    from jetrl_cli.rl.algos import CorrectionConfig, importance, policy_loss

    seed = int(torch.randint(0, 2**31, ()))
    model = random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=256), seed=seed, std=0.05).train()
    apply_flow(model, named_flow(flow), "train")
    monkeypatch.setattr(trainer, "LOGPROB_CHUNK_ELEMENTS", 256 * 8)  # 8 rows a chunk: several checkpoints
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (3, 40), generator=g)
    b = trainer.Batch.build(ids[:, :8].tolist(), ids[:, 8:].tolist(), [[-1.0] * 32] * 3, [0.0] * 3, [0, 1, 2])
    with torch.no_grad():  # ratios near 1, mixed advantages: most tokens carry a gradient
        old = trainer.token_logprobs(model, b, SamplingParams()) + 0.1 * torch.randn(b.mask.shape, generator=g) * b.mask
    adv = torch.tensor([1.0, -1.0, 0.5]) * torch.rand(3, generator=g)
    imp = importance(old, b.rollout_logp, b.mask, CorrectionConfig(type="tis"), 0.28, with_metrics=False)
    params = [p for p in model.parameters() if p.requires_grad]

    def loss():
        lp = trainer.token_logprobs(model, b, SamplingParams())
        return policy_loss(lp, old, adv, b.mask, imp, 0.2, 0.28, float(b.mask.sum()))[0]

    loss().backward()
    want = _grads(params)
    with py_autograd.recording():
        root = loss()
    py_autograd.backward(root)
    got = _grads(params)
    assert [n for (n, _), w in zip(model.named_parameters(), want) if not w.abs().sum() > 0] == []
    for (name, _), a, w in zip(model.named_parameters(), got, want):
        assert torch.equal(a, w), name
