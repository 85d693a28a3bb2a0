"""Qwen3 (``model_type: qwen3``): an RMSNorm over each query and key head before RoPE, head_dim apart
from hidden_size / heads. Checked against ``transformers``' own Qwen3 (built here, nothing downloaded):
the logits and the gradients in fp32; the rollout's logprobs equal the trainer's bit for bit; the native
(GPU) path's q/k norms give the CPU emulation's bits."""

import copy
import json

import pytest
import torch

from jetrl_cli.errors import JetrlError
from jetrl_cli.models.hf import load_model
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import apply_flow, gemm, named_flow
from jetrl_cli.precision.quant import error_stats

from .conftest import fresh_seed

transformers = pytest.importorskip("transformers")


def _hf_qwen3(path, seed):
    """A small Qwen3 saved by transformers: q/k/v 2x the hidden size (head_dim 64 with 4 heads on 128),
    GQA, norm weights drawn away from 1 (so a norm left out or misplaced shows)."""
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(path)
    return hf


def test_logits_and_gradients_equal_transformers_qwen3(tmp_path):
    s = fresh_seed()
    hf = _hf_qwen3(tmp_path / "m", s)
    ours = load_model(tmp_path / "m")
    assert ours.config.qk_norm and ours.config.head_dim == 64
    assert ours.model.layers[0].self_attn.q_norm.weight.shape == (64,)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(s))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-4
    # gradients: jetrl in fp32 (a model before any flow: fp32 GEMMs) against transformers' autograd
    w = torch.randn(2, 11, 256, generator=torch.Generator().manual_seed(s + 1))
    (ours(ids) * w).sum().backward()
    (hf(ids).logits * w).sum().backward()
    theirs = dict(hf.named_parameters())
    names = ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.embed_tokens.weight"]
    got = dict(ours.named_parameters())
    assert set(got) == set(theirs)
    for n in names:
        g, want = got[n].grad, theirs[n].grad
        assert g is not None and error_stats(g, want)["rel_err"] < 1e-5, n


def _qwen3(seed):
    m = random_model(tiny_config("qwen3", hidden=128, layers=2, vocab=256), seed=seed, std=0.05)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in m.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g))
    return m


@pytest.mark.parametrize("flow", ["bf16", "fp8-unified"])
def test_qwen3_rollout_logprobs_equal_the_trainers_bitwise(flow):
    from .test_engine import _rollout_and_score

    m = random_model(tiny_config("qwen3", hidden=256, layers=2, vocab=512), seed=fresh_seed(), std=0.05)
    b, old, _ = _rollout_and_score(m, flow)
    assert b.mask.sum() > 40 and torch.equal(old[b.mask], b.rollout_logp[b.mask])


def test_the_qk_norm_natively_and_emulated_gives_the_same_bits(forced_native):
    """The q/k norms on the q/k/v GEMM's bf16 output: natively (a bf16 tensor in, bf16 out) and in the CPU
    emulation (its values in fp32, the output rounded to the GEMM's format) the same bits."""
    m = _qwen3(fresh_seed())
    apply_flow(m, named_flow("bf16"), "rollout")
    attn = m.model.layers[0].self_attn
    heads = torch.randn(2, 5, 4 + 2 * 2, 32, generator=torch.Generator().manual_seed(fresh_seed())).to(torch.bfloat16)
    gemm.set_force_native(True)
    with torch.no_grad():
        nat = attn._qk_norm(heads, 4, 2)
    gemm.set_force_native(False)
    with torch.no_grad():
        emu = attn._qk_norm(heads.float(), 4, 2)
    assert nat.dtype == torch.bfloat16 and emu.dtype == torch.float32
    assert torch.equal(nat.float(), emu)
    assert not torch.equal(emu[:, :, :6], heads[:, :, :6].float())  # the norms did something


def test_the_q_and_k_norms_are_rounded_as_the_gemm_wrote_and_train(tmp_path):
    """In the bf16 flow the normed queries and keys are bf16 values, as the GPU's bf16 tensor holds them
    (without the rounding the emulation would differ in kind from the GPU); one update moves the norms'
    weights."""
    from jetrl_cli.config import TrainConfig
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.rl.algos import CorrectionConfig
    from jetrl_cli.rl.trainer import Batch, Trainer

    m = _qwen3(fresh_seed())
    apply_flow(m, named_flow("bf16"), "train")
    attn = m.model.layers[0].self_attn
    seen = {}
    real = attn._qk_norm

    def spy(heads, h, hk):
        out = real(heads, h, hk)
        seen["qk"] = out[:, :, :h + hk]
        return out

    attn._qk_norm = spy
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        m(ids)
    qk = seen["qk"]
    assert qk.dtype == torch.float32 and torch.equal(qk, qk.to(torch.bfloat16).float())
    del attn._qk_norm
    before = attn.q_norm.weight.detach().clone()
    tr = Trainer(m, named_flow("bf16"), TrainConfig(micro_batch=4, lr=1e-2), CorrectionConfig(), SamplingParams(), 32)
    b = Batch.build(ids[:, :4].tolist(), ids[:, 4:].tolist(), [[-1.0] * 5] * 2, [1.0, 0.0], [0, 0])
    old = tr.score(b)
    tr.update(b, torch.tensor([1.0, -1.0]), old, None, step=1)
    assert not torch.equal(attn.q_norm.weight.detach(), before)


def test_a_sliding_window_qwen3_is_refused(tmp_path):
    _hf_qwen3(tmp_path / "m", 0)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, use_sliding_window=True)))
    with pytest.raises(JetrlError, match="use_sliding_window.*is not supported"):
        load_model(tmp_path / "m")


@pytest.mark.slow  # about a minute in Triton's interpreter
@pytest.mark.parametrize("flow_name", ["fp8-unified", "bf16"])
def test_qwen3_in_the_batch_invariant_mode_is_bitwise_on_policy(flow_name, forced_native, monkeypatch):
    """``precision.batch_invariant`` on the native (GPU) path, here in Triton's interpreter: the q/k norms run
    the invariant RMSNorm kernel (one program a row), and the rollout's logprobs (prefill, then decode steps of
    a few rows) equal the trainer's bit for bit."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.kernels import invariant
    from jetrl_cli.precision import fuse, parse_flow

    from .test_gpu_paths import rollout_scored
    from .triton_interp_fix import fixed_fp8_conversion

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    flow = parse_flow({"base": flow_name, "batch_invariant": True}, source="<test>")
    monkeypatch.setattr(fuse, "_force_exact", True)
    rows = []
    real = invariant.invariant_rms_norm
    monkeypatch.setattr(invariant, "invariant_rms_norm",
                        lambda x, *a, **k: (rows.append(x.shape[-1]), real(x, *a, **k))[1])
    with fixed_fp8_conversion():
        m = _qwen3(fresh_seed()).to(dev)  # 128 wide, heads of 32
        b, old, _ = rollout_scored(m, flow, SamplingParams(max_new_tokens=5, temperature=1.0, n=2))
    assert torch.equal(old[b.mask], b.rollout_logp[b.mask])
    assert 32 in rows  # the q/k norms (over a head's 32 features) through the invariant kernel
