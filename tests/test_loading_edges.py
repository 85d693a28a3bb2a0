"""The edges of reading a checkpoint, for model loading and ``jetrl quantize`` alike: scale grids of
the wrong shape, which safetensors files make the checkpoint (the index, a stale or foreign file
beside the shards, a tensor in two files), a checkpoint that does not match its config.json, and
what vLLM's block FP8 refuses. Every bad input is one line naming the file and the tensor; nothing
loads or is written silently wrong."""

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from jetrl_cli.cli import app
from jetrl_cli.errors import JetrlError
from jetrl_cli.models.hf import INDEX_FILE, check_model_dir, load_model
from jetrl_cli.models.tiny import write_random_model
from jetrl_cli.quantize_ckpt import quantize_checkpoint
from jetrl_cli.rl.loop import tiny_policy_dir

from .conftest import fresh_seed

runner = CliRunner()
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(res) -> str:
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and len(res.output.strip().splitlines()) == 1, res.output
    return res.output.strip()[len("error: "):]


def random_linear() -> str:
    """A quantized linear layer's name, drawn fresh (write_random_model has 2 layers)."""
    i = int(torch.randint(0, 2, ()))
    return f"model.layers.{i}.{LINEARS[int(torch.randint(0, len(LINEARS), ()))]}"


@pytest.fixture
def src(tmp_path):
    """A random model whose shapes every format takes (vLLM's block FP8 included)."""
    return write_random_model(tmp_path / "src", seed=fresh_seed())


def edit(d, change, file="model.safetensors"):
    t = load_file(str(d / file))
    change(t)
    save_file(t, str(d / file), metadata={"format": "pt"})


def shard(d, parts: int = 2) -> dict[str, str]:
    """Split ``d/model.safetensors`` into shards with an index, as transformers saves a large model."""
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(t)
    weight_map = {}
    for i in range(parts):
        fname = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        keys = names[i::parts]
        save_file({k: t[k] for k in keys}, str(d / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fname))
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


# --- scales whose shape does not fit their weight -------------------------------------------------

def test_a_block_scale_of_the_wrong_shape_is_refused_not_broadcast(src, tmp_path):
    """A (1, 1) ``weight_scale_inv`` used to broadcast over every block of its weight: all values wrong."""
    q = tmp_path / "q"
    quantize_checkpoint(src, q, "fp8-block")
    layer = random_linear()
    rows, cols = load_file(str(q / "model.safetensors"))[f"{layer}.weight"].shape
    edit(q, lambda t: t.update({f"{layer}.weight_scale_inv": torch.ones(1, 1)}))
    want = (math.ceil(rows / 128), math.ceil(cols / 128))
    with pytest.raises(JetrlError) as e:
        load_model(q)
    assert str(e.value) == (f"{q / 'model.safetensors'}: scale {layer}.weight_scale_inv is (1, 1); {layer}.weight is "
                            f"{rows}x{cols}, so its 128x128-block scale must be {want}")


@pytest.mark.parametrize("fmt", ["fp8-channel", "int8-channel"])
@pytest.mark.parametrize("bad", ["half the rows", "group-style", "a row"])
def test_a_channel_scale_of_the_wrong_shape_is_one_line_not_a_traceback(src, tmp_path, fmt, bad):
    q = tmp_path / "q"
    quantize_checkpoint(src, q, fmt)
    layer = random_linear()
    name = f"{layer}.weight_scale"
    scale = load_file(str(q / "model.safetensors"))[name]
    rows = scale.shape[0]
    wrong = {"half the rows": scale[: rows // 2], "group-style": scale.repeat(1, 4), "a row": scale.reshape(1, -1)}[bad]
    edit(q, lambda t: t.update({name: wrong.contiguous()}))
    with pytest.raises(JetrlError) as e:
        load_model(q)
    assert str(e.value).startswith(f"{q / 'model.safetensors'}: scale {name} is {tuple(wrong.shape)}; {layer}.weight "
                                   f"is {rows}x"), str(e.value)
    assert f"must be one value (per tensor), ({rows}, 1) or ({rows},) (per output row)" in str(e.value)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the CLI's rollout too (it needs a tokenizer)
        shutil.copy(tiny_policy_dir() / f, q / f)
    msg = one_line_error(invoke("rollout", "bf16", "-o", tmp_path / "r.jsonl", "--set", f"model.path={q}",
                                "--set", "rollout.prompts_per_step=1", "--set", "rollout.n=2"))
    assert f"scale {name} is {tuple(wrong.shape)}" in msg


def test_every_allowed_scale_shape_loads_to_the_same_weights(src, tmp_path):
    """A per-row scale as (N,) or (N, 1), a per-tensor one as (), (1,) or (1, 1): the same numbers."""
    q = tmp_path / "q"
    quantize_checkpoint(src, q, "fp8-channel")
    layer = random_linear()
    ref = load_model(q).state_dict()[f"{layer}.weight"]
    edit(q, lambda t: t.update({f"{layer}.weight_scale": t[f"{layer}.weight_scale"].reshape(-1).contiguous()}))
    assert torch.equal(load_model(q).state_dict()[f"{layer}.weight"], ref)
    qt = tmp_path / "qt"
    quantize_checkpoint(src, qt, "fp8-tensor")
    ref = load_model(qt).state_dict()[f"{layer}.weight"]
    for shape in ((1,), (1, 1)):
        edit(qt, lambda t: t.update({f"{layer}.weight_scale": t[f"{layer}.weight_scale"].reshape(shape)}))
        assert torch.equal(load_model(qt).state_dict()[f"{layer}.weight"], ref)


def test_scale_grids_jetrl_does_not_read_are_named_in_the_config(src, tmp_path):
    q = tmp_path / "q"
    quantize_checkpoint(src, q, "fp8-channel")
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=32)
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(JetrlError, match=re.escape(f"{q / 'config.json'}: quantization_config.config_groups.group_0."
                                                   'weights.strategy is "group"; jetrl reads channel or tensor')):
        load_model(q)
    qb = tmp_path / "qb"
    quantize_checkpoint(src, qb, "fp8-block")
    cfg = json.loads((qb / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128]
    (qb / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(JetrlError, match=re.escape("quantization_config.weight_block_size is [128]; must be [rows, ")):
        load_model(qb)


# --- which files make the checkpoint --------------------------------------------------------------

def test_the_index_chooses_the_files_a_consolidated_or_stale_copy_beside_them_is_not_read(src, tmp_path):
    """Mistral's repositories ship consolidated.safetensors beside the HF shards; an older
    model.safetensors may be left beside new shards. Hugging Face and vLLM read what the index names."""
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        ref = load_model(src)(ids)
    whole = load_file(str(src / "model.safetensors"))
    shard(src)
    save_file({"layers.0.attention.wq.weight": whole["model.layers.0.self_attn.q_proj.weight"]},
              str(src / "consolidated.safetensors"))
    save_file({k: v * 0 + 1 for k, v in whole.items()}, str(src / "model.safetensors"))  # stale, other values
    with torch.no_grad():
        assert torch.equal(load_model(src)(ids), ref)

    q = tmp_path / "q"
    res = invoke("quantize", src, "-o", q, "--format", "fp8-channel", "--json")
    assert res.exit_code == 0, res.output
    files = sorted(p.name for p in q.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((q / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert not [k for k in index["weight_map"] if k.startswith("layers.")]
    written = {k: v for f in files for k, v in load_file(str(q / f)).items()}
    assert set(written) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in written.values())
    assert json.loads(res.output)["file_bytes_before"] == sum((src / f).stat().st_size for f in files)
    load_model(q)


def test_a_missing_shard_is_named(src, tmp_path):
    shard(src, 3)
    (src / "model-00002-of-00003.safetensors").unlink()
    want = f"{src / INDEX_FILE}: names shard model-00002-of-00003.safetensors, which is missing from {src}"
    with pytest.raises(JetrlError) as e:
        load_model(src)
    assert str(e.value) == want
    assert one_line_error(invoke("quantize", src, "-o", tmp_path / "q", "--format", "fp8-channel")) == want
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("indexed", [True, False])
def test_a_tensor_in_two_files_is_refused_not_last_wins(src, tmp_path, indexed):
    whole = load_file(str(src / "model.safetensors"))
    name = f"{random_linear()}.weight"
    if indexed:
        weight_map = shard(src)
        other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
        edit(src, lambda t: t.update({name: whole[name] * 2}), other)
        files = sorted((weight_map[name], other))
    else:
        save_file({name: whole[name] * 2}, str(src / "extra.safetensors"))
        files = ["extra.safetensors", "model.safetensors"]
    want = f"{src}: tensor {name} is in both {files[0]} and {files[1]}; a checkpoint holds each tensor once"
    with pytest.raises(JetrlError) as e:
        load_model(src)
    assert str(e.value).startswith(want), str(e.value)
    assert one_line_error(invoke("quantize", src, "-o", tmp_path / "q", "--format", "fp8-channel")).startswith(want)
    assert not (tmp_path / "q").exists()


def test_an_index_that_does_not_match_its_shards_is_named(src):
    weight_map = shard(src)
    name = f"{random_linear()}.weight"
    moved = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
    (src / INDEX_FILE).write_text(json.dumps({"weight_map": {**weight_map, name: moved}}))
    with pytest.raises(JetrlError, match=re.escape(f"{INDEX_FILE}: maps tensor {name} to {moved}, but "
                                                   f"{weight_map[name]} holds it")):
        load_model(src)
    (src / INDEX_FILE).write_text(json.dumps({"weight_map": {**weight_map, "model.nope.weight": moved}}))
    with pytest.raises(JetrlError, match=re.escape(f"maps tensor model.nope.weight to {moved}, which does not hold")):
        load_model(src)
    (src / INDEX_FILE).write_text(json.dumps({"weight_map": {**weight_map, name: "../elsewhere.safetensors"}}))
    with pytest.raises(JetrlError, match=re.escape(f"weight_map['{name}'] is \"../elsewhere.safetensors\"; must name")):
        load_model(src)
    (src / INDEX_FILE).write_text("{")
    with pytest.raises(JetrlError, match=re.escape(f"{src / INDEX_FILE}: invalid JSON")):
        load_model(src)


# --- quantize checks its input as model loading does ----------------------------------------------

def _drop(name):
    return lambda d: edit(d, lambda t: t.pop(name))


def _layers(n):
    def change(d):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n}))
    return change


def _tied_with_own_head(d):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))


@pytest.mark.parametrize("change, message", [
    (_drop("model.layers.1.mlp.down_proj.weight"), "checkpoint lacks 1 tensor(s), e.g. model.layers.1.mlp.down_proj"),
    (_layers(3), "config.json has num_hidden_layers 3, but the checkpoint holds 2 layers (model.layers.0-1)"),
    (_layers(1), "config.json has num_hidden_layers 1, but the checkpoint holds 2 layers (model.layers.0-1)"),
    (_tied_with_own_head,
     "config.json has tie_word_embeddings: true, but the checkpoint's lm_head.weight is not model.embed_tokens"),
    (lambda d: edit(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2, 2)})),
     "checkpoint has 1 unexpected tensor(s), e.g. model.layers.0.mlp.extra.weight"),
])
def test_quantize_refuses_what_model_loading_refuses(src, tmp_path, change, message):
    """These were written with exit 0: a checkpoint missing a layer's tensor, one with more or fewer
    layers than config.json, a trained lm_head that a tied model drops."""
    change(src)
    with pytest.raises(JetrlError) as e:
        load_model(src)
    assert str(e.value).startswith(f"{src}: {message}"), str(e.value)
    assert one_line_error(invoke("quantize", src, "-o", tmp_path / "q", "--format", "fp8-tensor")) == str(e.value)
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q.tmp-*"))


def test_a_tied_head_equal_to_the_embedding_is_accepted(src, tmp_path):
    _tied_with_own_head(src)
    edit(src, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    load_model(src)
    assert invoke("quantize", src, "-o", tmp_path / "q", "--format", "fp8-tensor").exit_code == 0


def test_rotary_inv_freq_of_older_conversions_is_ignored(src, tmp_path):
    """Older Llama conversions saved each layer's ``rotary_emb.inv_freq``; HF and vLLM skip it on load."""
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        ref = load_model(src)(ids)
    edit(src, lambda t: t.update({name: torch.rand(32)}))
    with torch.no_grad():
        assert torch.equal(load_model(src)(ids), ref)
    assert invoke("quantize", src, "-o", tmp_path / "q", "--format", "fp8-tensor").exit_code == 0
    assert name not in load_file(str(tmp_path / "q" / "model.safetensors"))


# --- vLLM's block FP8 -----------------------------------------------------------------------------

def test_fp8_block_refuses_fused_parts_vllm_refuses(tmp_path):
    """vLLM fuses q/k/v and gate/up and needs every part but the last in whole 128-row blocks: the
    tiny policy's k_proj (64 rows) was written with exit 0 and then refused by vLLM."""
    q = tmp_path / "q"
    msg = one_line_error(invoke("quantize", "tiny", "-o", q, "--format", "fp8-block"))
    assert msg == (f"{tiny_policy_dir()}: format fp8-block: model.layers.0.self_attn.k_proj has 64 rows, not a "
                   "multiple of 128; vLLM fuses it into qkv_proj and refuses its 128x128 blocks "
                   "(use --format fp8-channel or fp8-tensor)")
    assert not q.exists() and list(tmp_path.iterdir()) == []
    wide = write_random_model(tmp_path / "wide", seed=fresh_seed(), hidden=320)  # q_proj 320 rows
    assert "model.layers.0.self_attn.q_proj has 320 rows" in one_line_error(
        invoke("quantize", wide, "-o", q, "--format", "fp8-block"))
    res = invoke("quantize", wide, "-o", q, "--format", "fp8-channel")
    assert res.exit_code == 0, res.output
    assert invoke("quantize", "tiny", "-o", tmp_path / "t", "--format", "fp8-tensor").exit_code == 0


def test_tiny_names_the_shipped_policy_unless_a_directory_is_called_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_model_dir("tiny") == tiny_policy_dir()
    res = invoke("quantize", "tiny", "-o", "q", "--format", "fp8-channel", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["source"] == str(tiny_policy_dir())
    shutil.rmtree("q")
    (tmp_path / "tiny").mkdir()
    assert "tiny: no config.json" in one_line_error(invoke("quantize", "tiny", "-o", "q", "--format", "fp8-channel"))
