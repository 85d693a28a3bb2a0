"""LoRA adapters (``model.lora_rank``): the base model at step 0, PEFT's files and numbers, the rollout's
logprobs equal to the trainer's bit for bit with adapters, syncs of the adapters alone, the base model as
the KL reference, checkpoints (merged model + adapters) and resume, and bad settings as one line."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from jetrl_cli.config import TrainConfig, load_job_config
from jetrl_cli.engine.base import make_payload
from jetrl_cli.engine.embedded import EmbeddedEngine
from jetrl_cli.engine.sampling import SamplingParams
from jetrl_cli.errors import JetrlError, PresetError
from jetrl_cli.models.hf import load_model
from jetrl_cli.models.lora import (TARGETS, LoraSpec, adapted_layers, adapter_state, add_adapters, load_adapters,
                                   merge_state, save_adapters, sync_parameters)
from jetrl_cli.models.shapes import random_model
from jetrl_cli.models.tiny import tiny_config
from jetrl_cli.precision import apply_flow, named_flow
from jetrl_cli.precision.quant import QTensor, error_stats
from jetrl_cli.rl.algos import CorrectionConfig
from jetrl_cli.rl.loop import ENVIRONMENT_KEYS, run, tiny_policy_dir
from jetrl_cli.rl.trainer import Batch, Trainer

from .conftest import fresh_seed

WIDTH = 48


def _base(seed):
    return random_model(tiny_config("qwen2", hidden=256, layers=2, vocab=512), seed=seed, std=0.05)


def _with_adapters(model, seed, rank=8, targets=TARGETS, b_std=0.05):
    """``model`` with adapters whose B is drawn too (a trained adapter: the layer's output moves)."""
    add_adapters(model, LoraSpec(rank, 16.0, targets), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, m in adapted_layers(model):
            m.lora_B.weight.copy_(b_std * torch.randn(m.lora_B.weight.shape, generator=g))
    return model


def test_adapters_freeze_the_model_and_start_as_it_bitwise():
    s = fresh_seed()
    base = _base(s)
    adapted = copy.deepcopy(base)
    names = add_adapters(adapted, LoraSpec(8, 16.0, TARGETS), s)
    assert len(names) == 2 * 7
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    flow = named_flow("fp8-unified")
    ids = torch.randint(0, 512, (3, 17), generator=torch.Generator().manual_seed(s))
    for side in ("train", "rollout"):
        apply_flow(base, flow, side), apply_flow(adapted, flow, side)
        # the adapters run in the skip format, the base layers in the flow's FP8
        q = adapted.model.layers[0].self_attn.q_proj
        assert q.precision.is_quantized and not q.lora_A.precision.is_quantized
        with torch.no_grad():
            assert torch.equal(adapted(ids), base(ids))  # B = 0: not one bit moves


def _hf_qwen2(path, seed):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.save_pretrained(path)
    return hf


def test_peft_loads_the_adapters_and_gives_the_same_logits_and_gradients(tmp_path):
    peft = pytest.importorskip("peft")
    s = fresh_seed()
    hf = _hf_qwen2(tmp_path / "base", s)
    ours = _with_adapters(load_model(tmp_path / "base"), s, rank=4, targets=("q_proj", "v_proj", "down_proj"))
    save_adapters(ours.state_dict(), ours.lora, tmp_path / "adapter", str(tmp_path / "base"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 16.0 and cfg["peft_type"] == "LORA"
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).float()
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(s))
    w = torch.randn(2, 13, 256, generator=torch.Generator().manual_seed(s + 2))
    ys, yt = ours(ids), theirs(input_ids=ids).logits
    assert error_stats(ys.detach(), yt.detach())["rel_err"] < 1e-5
    (ys * w).sum().backward()
    (yt * w).sum().backward()
    mine = adapter_state(ours)
    peft_grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad
                  for n, p in theirs.named_parameters() if "lora_" in n}
    assert set(peft_grads) == set(mine)
    for n, p in mine.items():
        assert p.grad is not None and error_stats(p.grad, peft_grads[n])["rel_err"] < 1e-5, n
    # the merged model (a checkpoint's model.safetensors) gives the adapted logits without adapters
    plain = load_model(tmp_path / "base")
    plain.load_state_dict(merge_state(ours.state_dict(), ours.lora.scale))
    with torch.no_grad():
        assert error_stats(plain(ids), ys.detach())["rel_err"] < 1e-5


def _rollout(trainer, engine, sp, seed, n=3):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 14, (5,), generator=g)]
    out = engine.generate(prompts, sp, seed)
    flat = [(p, c) for p, grp in zip(prompts, out) for c in grp]
    b = Batch.build([p for p, _ in flat], [c.tokens for _, c in flat], [c.logprobs for _, c in flat],
                    [float(len(c.tokens) % 3) for _, c in flat], [i // n for i in range(len(flat))])
    return b, trainer.score(b)


@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_rollout_logprobs_equal_the_trainers_bitwise_before_and_after_an_update(flow_name):
    s = fresh_seed()
    flow = named_flow(flow_name)
    model = _with_adapters(_base(s), s)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, n=3, stop_token_ids=(7,))
    tr = Trainer(model, flow, TrainConfig(micro_batch=5, lr=1e-2), CorrectionConfig(), sp, WIDTH)
    eng = EmbeddedEngine(model, flow, WIDTH, max_batch=4)
    eng.load_weights(make_payload(model, flow, params=sync_parameters(model, eng, first=True)))
    b, old = _rollout(tr, eng, sp, s)
    assert b.mask.sum() > 30 and torch.equal(old[b.mask], b.rollout_logp[b.mask])
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    adv = torch.randn(len(b), generator=torch.Generator().manual_seed(s))
    tr.update(b, adv, old, None, 1)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    params = sync_parameters(model, eng)  # after the first sync: the adapters alone
    assert params is not None and all(".lora_" in n for n, _ in params) and len(params) == 2 * 7 * 2
    payload = make_payload(model, flow, version=1, params=params)
    assert all(not isinstance(t, QTensor) for t in payload.tensors.values())  # adapters travel in high precision
    eng.load_weights(payload)
    b2, old2 = _rollout(tr, eng, sp, s + 1)
    assert torch.equal(old2[b2.mask], b2.rollout_logp[b2.mask])
    # the update moved the policy: the same batch scores otherwise now
    assert not torch.equal(tr.score(b)[b.mask], old[b.mask])


def test_a_quantized_sync_quantizes_the_base_layers_not_the_adapters():
    s = fresh_seed()
    model = _with_adapters(_base(s), s)
    flow = named_flow("fp8-unified")
    apply_flow(model, flow, "train")
    payload = make_payload(model, flow)
    t = payload.tensors
    assert isinstance(t["model.layers.0.self_attn.q_proj.weight"], QTensor)
    assert not isinstance(t["model.layers.0.self_attn.q_proj.lora_A.weight"], QTensor)
    assert not isinstance(t["model.layers.1.mlp.down_proj.lora_B.weight"], QTensor)


def test_the_kl_reference_is_the_base_model():
    s = fresh_seed()
    flow = named_flow("fp8-unified")
    base = _base(s)
    model = _with_adapters(copy.deepcopy(base), s)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0, n=3, stop_token_ids=(7,))
    tr = Trainer(model, flow, TrainConfig(micro_batch=5), CorrectionConfig(), sp, WIDTH, ref_model=model)
    plain = Trainer(base, flow, TrainConfig(micro_batch=5), CorrectionConfig(), sp, WIDTH)
    eng = EmbeddedEngine(model, flow, WIDTH, max_batch=8)
    eng.load_weights(make_payload(model, flow))
    b, old = _rollout(tr, eng, sp, s)
    ref = tr.score(b, ref=True)
    assert torch.equal(ref[b.mask], plain.score(b)[b.mask])  # the adapters off: the base model's bits
    assert not torch.equal(ref[b.mask], old[b.mask])


def test_adapter_files_that_do_not_fit_are_one_line(tmp_path):
    s = fresh_seed()
    model = _with_adapters(_base(s), s, rank=8)
    save_adapters(model.state_dict(), model.lora, tmp_path, "base")
    other = _with_adapters(_base(s), s + 5, rank=8)
    load_adapters(other, tmp_path)
    assert all(torch.equal(p, adapter_state(model)[n]) for n, p in adapter_state(other).items())
    smaller = _with_adapters(_base(s), s, rank=4)
    with pytest.raises(JetrlError, match=r"adapter_config.json: r is 8, the preset's is 4"):
        load_adapters(smaller, tmp_path)
    fewer = _with_adapters(_base(s), s, rank=8, targets=("q_proj",))
    with pytest.raises(JetrlError, match=r"adapter_model.safetensors: model.layers.0.mlp.down_proj.lora_A.weight, "
                                          r"which .* do not adapt"):
        load_adapters(fewer, tmp_path)
    with pytest.raises(JetrlError, match=r"no adapter_model.safetensors"):
        load_adapters(fewer, tmp_path / "nowhere")


@pytest.mark.parametrize("overrides, key, msg", [
    (["model.lora_alpha=8"], "model.lora_alpha", "read only with model.lora_rank > 0"),
    (["model.lora_path=x"], "model.lora_path", "read only with model.lora_rank > 0"),
    (["model.lora_rank=8", "model.lora_target_modules=[q_proj,qproj]"], "model.lora_target_modules",
     "'qproj' is not a layer name"),
    (["model.lora_rank=-2"], "model.lora_rank", "must be >= 0"),
    (["model.lora_rank=8", "model.lora_alpha=0"], "model.lora_alpha", "must be > 0"),
    (["model.lora_rank=8", "train.invariant_scale=4"], "train.invariant_scale", "frozen"),
])
def test_bad_lora_settings_are_one_line(overrides, key, msg):
    with pytest.raises(PresetError, match=f"{key}: .*{msg}"):
        load_job_config("fp8-unified", overrides)


SMALL = ["rollout.prompts_per_step=4", "rollout.n=4", "eval.prompts=8", "eval.every=2", "run.checkpoint_every=1",
         "model.lora_rank=8", "train.lr=1e-3", "train.kl_coef=0.01", "train.steps=2"]


def test_a_lora_run_resumes_exactly_and_checkpoints_the_merged_model_and_peft_adapters(tmp_path):
    cfg = load_job_config("fp8-unified", SMALL)
    full = run(cfg, tmp_path / "full")
    assert all(m["mismatch_kl"] == 0.0 for m in full if m["step"] > 0)
    assert all(m["sync_bytes"] < 400_000 for m in full if m["step"] > 0)  # the adapters, not the model
    assert all(m["kl_ref"] > 0 for m in full if m["step"] > 1)  # the reference (the base model) is left behind
    run(cfg, tmp_path / "part", stop_after=1)
    resumed = run(cfg, tmp_path / "part", resume=True)  # from step 1's checkpoint
    strip = lambda lines: [{k: v for k, v in m.items() if k not in ENVIRONMENT_KEYS} for m in lines]  # noqa: E731
    assert strip(resumed) == strip(full)
    ck = tmp_path / "full" / "checkpoints" / "step_000002"
    adapters = load_file(str(ck / "adapter_model.safetensors"))
    merged = load_file(str(ck / "model.safetensors"))
    base = load_file(str(tiny_policy_dir() / "model.safetensors"))
    scale = 16.0 / 8
    for name, w in base.items():
        a = adapters.get(f"base_model.model.{name[:-len('.weight')]}.lora_A.weight")
        if a is None:  # not adapted: the base weight as it was
            assert torch.equal(merged[name], w.float()), name
            continue
        b = adapters[f"base_model.model.{name[:-len('.weight')]}.lora_B.weight"]
        assert b.abs().max() > 0  # trained
        assert torch.allclose(merged[name], w.float() + scale * b @ a, atol=1e-6), name
    assert len(adapters) == 2 * 7 * 4  # four layers of the tiny policy


def test_a_run_starts_from_the_adapters_of_model_lora_path(tmp_path):
    from jetrl_cli.rl.loop import setup

    cfg = load_job_config("fp8-unified", ["model.lora_rank=4", "model.lora_alpha=8"])
    job = setup(cfg, with_trainer=True)
    s = fresh_seed()
    with torch.no_grad():
        for p in adapter_state(job.trainer.model).values():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(s)))
    save_adapters(job.trainer.model.state_dict(), job.trainer.model.lora, tmp_path / "ad", "tiny")
    job2 = setup(load_job_config("fp8-unified", ["model.lora_rank=4", "model.lora_alpha=8",
                                                 f"model.lora_path={tmp_path / 'ad'}"]), with_trainer=True)
    want = adapter_state(job.trainer.model)
    for got in (adapter_state(job2.trainer.model), adapter_state(job2.engine.model)):  # the engine's copy too
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    cfg_file = tmp_path / "ad" / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "use_rslora": True}))
    with pytest.raises(JetrlError, match=r"adapter_config.json: use_rslora is true"):
        setup(load_job_config("fp8-unified", ["model.lora_rank=4", "model.lora_alpha=8",
                                              f"model.lora_path={tmp_path / 'ad'}"]), with_trainer=True)
    with pytest.raises(JetrlError, match=r"nowhere: no adapter_model.safetensors"):
        setup(load_job_config("fp8-unified", ["model.lora_rank=4", f"model.lora_path={tmp_path / 'nowhere'}"]),
              with_trainer=False)


def test_activation_checkpointing_gives_the_adapters_the_same_gradients_bitwise():
    from jetrl_cli.rl.trainer import token_logprobs

    s = fresh_seed()
    model = _with_adapters(_base(s), s)
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(1, 512, (4, 30), generator=g)
    b = Batch.build(ids[:, :8].tolist(), ids[:, 8:].tolist(), [[-1.0] * 22] * 4, [0.0] * 4, [0, 0, 1, 1])
    grads = []
    for ckpt in (False, True):
        tr = Trainer(copy.deepcopy(model), named_flow("fp8-unified"), TrainConfig(activation_checkpointing=ckpt),
                     CorrectionConfig(), SamplingParams(), 64)
        token_logprobs(tr.model, b, tr.sampling).sum().backward()
        got = {n: p.grad for n, p in tr.model.named_parameters() if p.grad is not None}
        assert set(got) == set(adapter_state(tr.model))  # the frozen weights get none
        grads.append(got)
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert all(grads[0][n].abs().max() > 0 for n in grads[0] if ".lora_A." in n)  # B != 0: A learns too


@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_a_gpu_engine_holds_the_adapters_once_and_syncs_them_in_place(forced_native, flow_name):
    """On a GPU (the native path, forced here; a static engine as on CUDA) the adapters are held as their
    bf16 operands only, a group's A matrices as views into the group's stacked operand, and a sync of the
    adapters writes into them: every cached GEMM weight keeps its address (``refresh_weights``: what lets the
    captured decode graphs replay), and the engine samples what an engine built from the new weights samples."""
    from .test_engine_gpu_path import _samples

    s = fresh_seed()
    flow = named_flow(flow_name)
    model = _with_adapters(random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=256), seed=s, std=0.05), s)
    eng = EmbeddedEngine(model, flow, 64, max_batch=32, cuda_graphs=False)
    eng.static = True
    eng.load_weights(make_payload(model, flow))
    a = eng.model.model.layers[0].self_attn
    downs = (a.q_proj.lora_A, a.k_proj.lora_A, a.v_proj.lora_A)
    stacked = a.q_proj.lora_A.__dict__["_jet_group_cache"][1]
    assert all(x.weight.numel() == 0 and x._wfixed.dtype is torch.bfloat16 for x in downs)
    assert all(x._wfixed.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() for x in downs)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, n=2)
    _samples(eng, sp)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in adapter_state(trained).values():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(s + 3)))
    eng.load_weights(make_payload(trained, flow, version=2, params=sync_parameters(trained, eng)))
    assert eng.model.refresh_weights()  # every group's operand, the adapters' included, updated in place
    assert stacked is a.q_proj.lora_A.__dict__["_jet_group_cache"][1]
    fresh = EmbeddedEngine(trained, flow, 64, max_batch=32, cuda_graphs=False)
    fresh.static = True
    fresh.load_weights(make_payload(trained, flow))
    assert _samples(eng, sp) == _samples(fresh, sp)



@pytest.mark.parametrize("flow_name", ["bf16", "fp8-unified"])
def test_a_gpu_trainer_holds_its_frozen_layers_operands_only(forced_native, flow_name, tmp_path):
    """On a GPU (the native path, forced here) a LoRA trainer keeps its frozen layers' forward operands only
    (``hold_frozen_weights``: no fp32 master beside them, the lm_head's aside): the logprobs and the adapters'
    gradients are those of a trainer keeping the masters, bit for bit, and a checkpoint still holds the merged
    model (the frozen weights read back from the model directory)."""
    from jetrl_cli.rl.checkpoint import save_checkpoint, write_model_files
    from jetrl_cli.rl.trainer import token_logprobs

    s = fresh_seed()
    base = random_model(tiny_config("qwen2", hidden=128, layers=2, vocab=256), seed=s, std=0.05)
    src = tmp_path / "base"
    src.mkdir()
    write_model_files(src, base.state_dict(), tiny_policy_dir(), False)
    cfg = json.loads((src / "config.json").read_text())  # the random model's own shape, not the tiny policy's
    from jetrl_cli.models.transformers_ref import hf_config_dict

    (src / "config.json").write_text(json.dumps({**cfg, **hf_config_dict(base.config)}))
    model = _with_adapters(load_model(src), s)
    ids = torch.randint(1, 256, (3, 24), generator=torch.Generator().manual_seed(s))
    b = Batch.build(ids[:, :6].tolist(), ids[:, 6:].tolist(), [[-1.0] * 18] * 3, [0.0] * 3, [0, 0, 1])
    out = []
    for hold in (False, True):
        tr = Trainer(copy.deepcopy(model), named_flow(flow_name), TrainConfig(), CorrectionConfig(),
                     SamplingParams(), 64, hold_frozen=hold)
        frozen = [m for n, m in tr.model.named_modules() if n.endswith("_proj") and ".lora_" not in n]
        assert all((m.weight.numel() == 0) == hold for m in frozen) and tr.model.lm_head.weight.numel()
        lp = token_logprobs(tr.model, b, tr.sampling)
        lp.sum().backward()
        out.append((tr, lp.detach(), {n: p.grad for n, p in adapter_state(tr.model).items()}))
    (kept, lp0, g0), (held, lp1, g1) = out
    assert torch.equal(lp0, lp1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    with torch.no_grad():
        for p in adapter_state(kept.model).values():
            p.add_(0.01)
        for p in adapter_state(held.model).values():
            p.add_(0.01)
    for name, tr in (("kept", kept), ("held", held)):
        save_checkpoint(tmp_path / name, 1, tr.model, tr.opt, src, {}, 1)
    a, b2 = (load_file(str(tmp_path / n / "checkpoints" / "step_000001" / "model.safetensors"))
             for n in ("kept", "held"))
    assert a.keys() == b2.keys() and all(torch.equal(a[k], b2[k]) for k in a)
