"""``kernels.sampling``: keyed Gumbel-max in one pass over the log-probabilities, against the torch
form in ``engine.sampling`` (the same uniforms bit for bit, the same tokens, torch's argmax rule).
On CPU the kernel runs in Triton's interpreter; ``sample`` takes it for CUDA tensors only."""

import pytest
import torch

from jetrl_cli.engine import sampling as S

from .conftest import triton_runs

needs_triton = pytest.mark.skipif(not triton_runs(), reason="needs a GPU or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _logp(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(rows, 1, generator=g))  # peaked and flat rows
    return torch.log_softmax(torch.randn(rows, width, generator=g) * 3 * scale, -1).to(DEV)


def _reference(logp: torch.Tensor, keys: torch.Tensor, pos: int) -> torch.Tensor:
    """The torch form: keyed uniforms, then Gumbel-max (what ``sample`` runs on CPU)."""
    return S.gumbel_argmax(logp, S.keyed_uniform(keys, pos, logp.shape[1]))


@needs_triton
@pytest.mark.parametrize("rows,width", [(6, 5000), (3, 2048), (1, 7), (9, 4099)])
def test_the_kernel_draws_the_torch_forms_uniforms_and_tokens(rows, width):
    from jetrl_cli.kernels.sampling import keyed_gumbel_argmax

    keys = S.sample_keys([rows * 1000 + width + i for i in range(rows)], 1, DEV)
    for seed, pos in enumerate((0, 5, 123456, 2**31 + 7)):
        logp = _logp(rows, width, seed + width)
        if rows > 1:
            logp[1, ::3] = float("-inf")  # a top-k / top-p row: its masked tokens are never drawn
        u = torch.full((rows, width), -1.0, device=DEV)
        got = keyed_gumbel_argmax(logp, keys, S._splitmix64(pos) >> 32, uniforms=u)
        assert torch.equal(u, S.keyed_uniform(keys, pos, width)), pos  # the same 24-bit uniforms
        assert got.dtype == torch.int64 and torch.equal(got, _reference(logp, keys, pos)), pos
        if rows > 1:
            assert (got[1] % 3 != 0).item()


@needs_triton
def test_the_kernel_keeps_torchs_argmax_rule_at_infinities_and_nans():
    """All ``-inf``: index 0; ``+inf``: its first index; a NaN anywhere: the first NaN's index (torch's
    ``argmax`` takes NaN as the maximum) -- across the kernel's blocks, as torch does."""
    from jetrl_cli.kernels.sampling import BLOCK, keyed_gumbel_argmax

    width = 2 * BLOCK + 5
    logp = _logp(5, width, 3)
    logp[0] = float("-inf")
    logp[1, [BLOCK + 3, 2 * BLOCK + 1]] = float("inf")
    logp[2, [2 * BLOCK + 2, BLOCK + 9]] = float("nan")
    logp[3, [7, BLOCK + 1]] = float("inf")
    logp[3, 2 * BLOCK] = float("nan")
    keys = S.sample_keys([1, 2, 3, 4, 5], 1, DEV)
    got = keyed_gumbel_argmax(logp, keys, S._splitmix64(9) >> 32)
    assert got.tolist() == [0, BLOCK + 3, BLOCK + 9, 2 * BLOCK, got[4].item()]
    assert torch.equal(got, _reference(logp, keys, 9))


@needs_triton
def test_the_kernel_names_bad_input():
    from jetrl_cli.kernels.sampling import keyed_gumbel_argmax

    logp, keys = _logp(2, 8, 0), S.sample_keys([1, 2], 1, DEV)
    for args, msg in [((logp.double(), keys, 1), "logp must be a 2-d float32"),
                      ((logp, keys[:1], 1), "keys must be int64 of shape"),
                      ((logp, keys.int(), 1), "keys must be int64"),
                      ((logp, keys, 2**32), "pos_hash must be a 32-bit value"),
                      ((logp[:, :0], keys, 1), "no columns")]:
        with pytest.raises(ValueError, match=msg):
            keyed_gumbel_argmax(*args)
    assert keyed_gumbel_argmax(logp[:0], keys[:0], 1).shape == (0,)


def test_sample_takes_the_kernel_for_cuda_tensors_only(monkeypatch):
    """``sample`` with keys: the one-pass kernel on a GPU, the torch form on CPU (where the native
    path's tests and the CPU runs keep their tokens); greedy and generator draws never use it."""
    from jetrl_cli.kernels import sampling as K

    calls = []
    real = K.keyed_gumbel_argmax

    def spy(*a, **k):
        calls.append(a[0].device.type)
        return real(*a, **k)

    monkeypatch.setattr(K, "keyed_gumbel_argmax", spy)
    logp = _logp(4, 300, 1)
    keys = S.sample_keys([7, 8], 2, DEV)
    got = S.sample(logp, S.SamplingParams(), keys=keys, position=3)
    assert torch.equal(got, _reference(logp, keys, 3))
    assert calls == (["cuda"] if DEV == "cuda" else [])
    S.sample(logp, S.SamplingParams(temperature=0.0), keys=keys, position=3)
    S.sample(logp, S.SamplingParams(), generator=None)
    assert len(calls) == (1 if DEV == "cuda" else 0)
