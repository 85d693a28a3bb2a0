"""A broken model directory, checkpoint or run file is one line naming the file and the key or tensor at
fault, read where it is loaded: config.json values of the wrong type or range, integer or NaN weights,
token ids past the model's vocabulary, a damaged ``trainer_state.pt`` or ``latest``. Nothing loads
silently wrong and no user mistake ends in a traceback."""

import io
import json
import re
import shutil
import warnings

import pytest
import torch

from jetrl_cli.errors import JetrlError
from jetrl_cli.fileio import save_safetensors
from jetrl_cli.models.hf import load_model, read_config, read_tensors
from jetrl_cli.models.tokenizer import Tokenizer
from jetrl_cli.rl import loop
from jetrl_cli.rl.checkpoint import latest_checkpoint, load_trainer_state

from .test_run_output import TINY, invoke, sets
from .test_user_mistakes import one_line_error

WEIGHT = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def model(tmp_path):
    """A copy of the shipped tiny policy, to break one thing in."""
    d = tmp_path / "m"
    shutil.copytree(loop.tiny_policy_dir(), d)
    return d


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weight(d, name, change):
    t = read_tensors(d / "model.safetensors")
    t[name] = change(t[name])
    save_safetensors(t, d / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": "4"}, 'num_hidden_layers is "4"; must be an integer >= 1'),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0; must be an integer >= 1"),
    ({"vocab_size": 64.0}, "vocab_size is 64.0; must be an integer >= 1"),
    ({"hidden_size": True}, "hidden_size is true; must be an integer >= 1"),
    ({"intermediate_size": [384]}, "intermediate_size is [384]; must be an integer >= 1"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"head_dim": 31}, "head_dim is 31; must be an even integer >= 2"),
    ({"max_position_embeddings": -1}, "max_position_embeddings is -1; must be an integer >= 1"),
    ({"rms_norm_eps": "1e-6"}, 'rms_norm_eps is "1e-6"; must be a number > 0'),
    ({"rope_theta": 0}, "rope_theta is 0; must be a number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
     'rope_parameters.rope_theta is "1e4"; must be a number > 0'),
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings is "false"; must be true or false'),
    ({"rope_scaling": "linear"}, 'rope_scaling is "linear"; must be null or an object'),
    ({"rope_parameters": [10000]}, "rope_parameters is [10000]; must be null or an object"),
    ({"quantization_config": "fp8"}, 'quantization_config is "fp8"; must be null or an object'),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling.original_max_position_embeddings"),
])
def test_config_values_of_the_wrong_type_or_range_are_named(model, changes, message):
    edit_json(model / "config.json", **changes)
    with pytest.raises(JetrlError) as e:
        read_config(model)
    assert str(e.value).startswith(f"{model / 'config.json'}: ") and message in str(e.value), str(e.value)


def test_a_config_that_is_not_an_object_is_named_by_tokenizer_and_model_loading(model):
    (model / "config.json").write_text("[1, 2]")
    for load in (read_config, Tokenizer.from_dir):
        with pytest.raises(JetrlError, match=re.escape(f"{model / 'config.json'}: must be a JSON object")):
            load(model)


def test_valid_configs_still_load(model):
    edit_json(model / "config.json", rope_scaling=None, num_key_value_heads=None, head_dim=None, rope_theta=1000000,
              rope_parameters={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 256})
    cfg, _ = read_config(model)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta) == (4, 32, 1000000.0)
    assert cfg.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.to(torch.int32), "has dtype torch.int32; expected fp32, bf16 or fp16"),
    (lambda t: t.float().index_fill(1, torch.tensor([3]), float("nan")), "contains NaN or Inf"),
    (lambda t: t.index_fill(0, torch.tensor([0]), float("inf")), "contains NaN or Inf"),
])
def test_integer_or_non_finite_weights_are_refused_naming_file_and_tensor(model, change, message):
    edit_weight(model, WEIGHT, change)
    with pytest.raises(JetrlError) as e:
        load_model(model)
    assert str(e.value).startswith(f"{model / 'model.safetensors'}: tensor {WEIGHT} {message}"), str(e.value)


def test_a_broken_model_directory_is_one_line_in_run_and_quantize(model, tmp_path):
    """The two commands users met these with: `jetrl run` (which trained on an int32 weight) and
    `jetrl quantize` (a TypeError traceback on a string in config.json)."""
    edit_weight(model, WEIGHT, lambda t: t.to(torch.int32))
    out = tmp_path / "o"
    msg = one_line_error(invoke("run", "bf16", "-o", out, *sets(TINY + ["train.steps=1", f"model.path={model}"])))
    assert f"{model / 'model.safetensors'}: tensor {WEIGHT} has dtype torch.int32" in msg
    assert not out.exists()
    edit_json(model / "config.json", num_hidden_layers="4")
    msg = one_line_error(invoke("quantize", model, "-o", tmp_path / "q", "--format", "fp8-block"))
    assert f'{model / "config.json"}: num_hidden_layers is "4"; must be an integer >= 1' in msg


def test_token_ids_past_the_models_vocabulary_are_refused(model):
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["model"]["vocab"]["7"] = 100
    (model / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(JetrlError, match=re.escape(f"{model / 'tokenizer.json'}: token '7' has id 100, but "
                                                   "config.json's vocab_size is 64")):
        Tokenizer.from_dir(model)


@pytest.mark.parametrize("file, value, message", [
    ("config.json", 999, "eos_token_id 999 is outside the vocabulary (config.json's vocab_size is 64: ids 0..63)"),
    ("generation_config.json", [1, 64], "eos_token_id 64 is outside the vocabulary"),
    ("generation_config.json", "1", 'eos_token_id is "1"; must be a token id (an integer >= 0), a list of them'),
    ("config.json", True, "eos_token_id is true; must be a token id"),
])
def test_eos_ids_outside_the_vocabulary_are_refused_naming_file_and_key(model, file, value, message):
    edit_json(model / file, eos_token_id=value)
    with pytest.raises(JetrlError) as e:
        Tokenizer.from_dir(model)
    assert str(e.value).startswith(f"{model / file}: ") and message in str(e.value), str(e.value)


def test_the_tiny_policys_tokenizer_still_loads():
    tok = Tokenizer.from_dir(loop.tiny_policy_dir())
    assert tok.eos_ids == (1,) and tok.pad_id == 0


def fake_checkpoint(out, state_bytes: bytes):
    ck = out / "checkpoints" / "step_000002"
    ck.mkdir(parents=True)
    (ck / "trainer_state.pt").write_bytes(state_bytes)
    (out / "latest").write_text("step_000002\n")
    return ck


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("content, message", [
    (b"garbage\n", "unreadable (Unsupported operand 103)"),
    (b"PK\x03\x04" + b"\x00" * 64, "unreadable ("),
    (torch_saved([1, 2]), "not a jetrl trainer state (no integer 'step')"),
    (torch_saved({"step": "2"}), "not a jetrl trainer state (no integer 'step')"),
])
def test_a_damaged_trainer_state_is_one_line(tmp_path, content, message):
    ck = fake_checkpoint(tmp_path, content)
    with pytest.raises(JetrlError) as e:
        load_trainer_state(ck)
    assert str(e.value).startswith(f"{ck / 'trainer_state.pt'}: {message}"), str(e.value)
    assert f"the file is damaged (resume from an earlier checkpoint: point {tmp_path / 'latest'} at it)" in str(e.value)


@pytest.mark.parametrize("content, message", [
    (b"", "empty; the file is damaged"),
    (b"\n \n", "empty; the file is damaged"),
    (b"../../elsewhere\n", "holds '../../elsewhere', not a checkpoint name; the file is damaged"),
    (b"\xff\xfe", "not a text file; the file is damaged"),
])
def test_a_damaged_latest_file_says_so(tmp_path, content, message):
    fake_checkpoint(tmp_path, b"")
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(JetrlError) as e:
        latest_checkpoint(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'latest'}: {message}"), str(e.value)
    assert f"write the name of a complete checkpoint in {tmp_path / 'checkpoints'} into it" in str(e.value)
    (tmp_path / "latest").write_text("step_000002\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000002"


def test_curves_of_a_run_without_steps_warn_of_nothing(tmp_path):
    """``train.steps=0`` leaves only step 0's eval: no train-reward curve, so no legend to draw."""
    from jetrl_cli.rl.plots import plot_curves

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_curves([("r", [{"step": 0, "eval_accuracy": 0.5, "reward_mean": None}])], tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0
