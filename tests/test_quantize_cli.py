"""`jetrl quantize` and the CLI shell: round trips on models the test builds, and every bad input."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from jetrl_cli.cli import app
from jetrl_cli.models.hf import load_model
from jetrl_cli.models.tiny import write_random_model
from jetrl_cli.precision import error_stats

from .conftest import fresh_seed

runner = CliRunner()
FORMATS = ["fp8-block", "fp8-tensor", "fp8-channel", "int8-channel"]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """A Qwen2 and a Llama (tied embeddings), random weights, saved by transformers itself. Partial
    128x128 blocks (hidden 320) only where vLLM's fused layers allow them: q, k and gate (the parts of
    qkv_proj and gate_up_proj before the last) are whole blocks of rows (head_dim 64 x 4 and 2 heads,
    intermediate 384)."""
    transformers = pytest.importorskip("transformers")
    out = {}
    for name, cls, kw in (
        ("qwen2", transformers.Qwen2Config, {}),
        ("llama", transformers.LlamaConfig, {"tie_word_embeddings": True}),
    ):
        cfg = cls(vocab_size=320, hidden_size=320, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256, **kw)
        torch.manual_seed(len(out))
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        (d / "tokenizer_config.json").write_text("{}")
        out[name] = (d, model)
    return out


def invoke(*args):
    return runner.invoke(app, list(map(str, args)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_quantize_round_trip(hf_models, tmp_path, fmt, arch):
    src, hf_model = hf_models[arch]
    out = tmp_path / "q"
    res = invoke("quantize", src, "-o", out, "--format", fmt, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["format"] == fmt and len(report["layers"]) == 14  # 7 linears x 2 layers
    assert all(r["sqnr_db"] > 25 for r in report["layers"])

    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    tensors = load_file(str(out / "model.safetensors"))
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    if fmt == "fp8-block":
        assert qc == {**qc, "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128]}
        assert w.dtype == torch.float8_e4m3fn
        assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (3, 3)  # 320 x 384
        assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
    elif fmt == "fp8-tensor":
        assert qc["quant_method"] == "fp8" and w.dtype == torch.float8_e4m3fn
        assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == ()
    else:
        assert qc["quant_method"] == "compressed-tensors"
        assert qc["format"] == ("float-quantized" if fmt == "fp8-channel" else "int-quantized")
        assert w.dtype == (torch.float8_e4m3fn if fmt == "fp8-channel" else torch.int8)
        assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (320, 1)
    # skip list: embeddings, norms and lm_head untouched and listed
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert tensors["model.norm.weight"].dtype == torch.float32
    if arch == "qwen2":
        assert tensors["lm_head.weight"].dtype == torch.float32
        ignored = qc.get("ignored_layers", qc.get("ignore"))
        assert ignored == ["lm_head"]
    assert (out / "tokenizer_config.json").exists()

    # loads back into jetrl (dequantized), logits close to the original model's
    ids = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        ref = hf_model(ids).logits
        ours_orig = load_model(src)(ids)
        ours_q = load_model(out)(ids)
    assert error_stats(ref, ours_orig)["rel_err"] < 1e-5
    assert error_stats(ref, ours_q)["sqnr_db"] > 20, error_stats(ref, ours_q)


def test_preset_chooses_format_and_skip_list(hf_models, tmp_path):
    src, _ = hf_models["qwen2"]
    res = invoke("quantize", src, "-o", tmp_path / "a", "--preset", "fp8-unified", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["format"] == "fp8-block"
    res = invoke("quantize", src, "-o", tmp_path / "b", "--preset", "int8-rollout-tis", "--json")
    assert json.loads(res.output)["format"] == "int8-channel"
    res = invoke("quantize", src, "-o", tmp_path / "c", "--preset", "bf16")
    assert res.exit_code == 2 and "have no vLLM checkpoint format" in res.output
    res = invoke("quantize", src, "-o", tmp_path / "d", "--preset", "fp8-unified", "--format", "fp8-tensor")
    assert res.exit_code == 2 and "contradicts" in res.output


def test_human_output_has_a_table_and_both_sizes(hf_models, tmp_path):
    from jetrl_cli.report import _mib

    src, _ = hf_models["qwen2"]
    res = invoke("quantize", src, "-o", tmp_path / "q", "--format", "fp8-block")
    assert res.exit_code == 0
    assert "SQNR" in res.output and "total: 14 layers quantized" in res.output
    assert "…" not in res.output and all(len(line) <= 80 for line in res.output.splitlines())
    info = json.loads(invoke("quantize", src, "-o", tmp_path / "j", "--format", "fp8-block", "--json").output)
    on_disk = {d: sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in (src, tmp_path / "q")}
    assert info["file_bytes_before"] == on_disk[src] and info["file_bytes_after"] == on_disk[tmp_path / "q"]
    assert info["bytes_before"] == sum(r["bytes_before"] for r in info["layers"]) < info["file_bytes_before"]
    text = " ".join(res.output.split())
    assert (f"size: quantized linear layers {_mib(info['bytes_before'])} -> {_mib(info['bytes_after'])} · "
            f"checkpoint files {_mib(on_disk[src])} -> {_mib(on_disk[tmp_path / 'q'])}") in text


def test_output_files_follow_the_umask(hf_models, tmp_path):
    """Not the 0700 staging directory and 0600 safetensors files the writers create."""
    import os

    src, _ = hf_models["qwen2"]
    old = os.umask(0o027)
    try:
        assert invoke("quantize", src, "-o", tmp_path / "q", "--format", "fp8-block").exit_code == 0
    finally:
        os.umask(old)
    out = tmp_path / "q"
    assert out.stat().st_mode & 0o777 == 0o750
    files = list(out.iterdir())
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= {f.name for f in files}
    assert all(f.stat().st_mode & 0o777 == 0o640 for f in files), {f.name: oct(f.stat().st_mode) for f in files}


def test_existing_output_needs_force_and_force_replaces(hf_models, tmp_path):
    src, _ = hf_models["qwen2"]
    out = tmp_path / "q"
    assert invoke("quantize", src, "-o", out, "--format", "fp8-tensor").exit_code == 0
    res = invoke("quantize", src, "-o", out, "--format", "fp8-block")
    assert res.exit_code == 2 and "already exists" in res.output
    assert json.loads((out / "config.json").read_text())["quantization_config"].get("weight_block_size") is None
    assert invoke("quantize", src, "-o", out, "--format", "fp8-block", "--force").exit_code == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # no temporary directories left behind


def test_interrupted_run_leaves_nothing(hf_models, tmp_path, monkeypatch):
    src, _ = hf_models["qwen2"]
    import jetrl_cli.quantize_ckpt as qc

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(qc, "_commit_dir", boom)
    res = invoke("quantize", src, "-o", tmp_path / "q", "--format", "fp8-block")
    assert res.exit_code == 130
    assert list(tmp_path.iterdir()) == []


def one_line_error(res, *needles):
    assert res.exit_code == 2, res.output
    text = res.output.strip()
    assert text.startswith("error:") and "Traceback" not in text
    assert len(text.splitlines()) == 1, text
    for n in needles:
        assert n in text, text


def test_malformed_inputs(tmp_path):
    out = tmp_path / "out"
    one_line_error(invoke("quantize", tmp_path / "missing", "-o", out, "--format", "fp8-block"), "no such directory")
    one_line_error(invoke("quantize", tmp_path / "missing", "-o", out), "missing: no such directory")  # before --format
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(invoke("quantize", empty, "-o", out, "--format", "fp8-block"), "no config.json")

    d = write_random_model(tmp_path / "m", seed=1)
    one_line_error(invoke("quantize", d, "-o", out, "--format", "fp4"), "not a format")
    one_line_error(invoke("quantize", d, "-o", out), "pass --format")

    nost = tmp_path / "nost"
    nost.mkdir()
    (nost / "config.json").write_text((d / "config.json").read_text())
    one_line_error(invoke("quantize", nost, "-o", out, "--format", "fp8-block"), "no *.safetensors")

    arch = tmp_path / "arch"
    write_random_model(arch, seed=2)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (arch / "config.json").write_text(json.dumps(cfg))
    one_line_error(invoke("quantize", arch, "-o", out, "--format", "fp8-block"), "model_type 'gpt2' is not supported")

    bad = tmp_path / "nan"
    write_random_model(bad, seed=3)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight"][3, 3] = float("nan")
    save_file(t, str(bad / "model.safetensors"))
    one_line_error(invoke("quantize", bad, "-o", out, "--format", "fp8-block"), "model.layers.1.mlp.up_proj.weight",
                   "NaN or Inf")

    q = tmp_path / "q"
    assert invoke("quantize", d, "-o", q, "--format", "fp8-block").exit_code == 0
    one_line_error(invoke("quantize", q, "-o", out, "--format", "fp8-block"), "already quantized")

    dt = tmp_path / "dtype"
    write_random_model(dt, seed=4)
    t = load_file(str(dt / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.float8_e5m2)
    save_file(t, str(dt / "model.safetensors"))
    one_line_error(invoke("quantize", dt, "-o", out, "--format", "fp8-block"), "model.norm.weight", "float8_e5m2")
    assert not out.exists()


def test_sharded_checkpoint_keeps_its_shards(tmp_path):
    d = write_random_model(tmp_path / "m", seed=5)
    t = load_file(str(d / "model.safetensors"))
    names = sorted(t)
    half = len(names) // 2
    (d / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(d / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "q"
    assert invoke("quantize", d, "-o", out, "--format", "fp8-block").exit_code == 0
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, fname in idx.items():
        assert name in load_file(str(out / fname))
    assert idx["model.layers.0.self_attn.q_proj.weight_scale_inv"] == idx["model.layers.0.self_attn.q_proj.weight"]
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        assert error_stats(load_model(d)(ids), load_model(out)(ids))["sqnr_db"] > 20


def test_flow_command(tmp_path):
    res = invoke("flow", "fp8-unified", "--json")
    assert res.exit_code == 0
    d = json.loads(res.output)
    assert d["on_policy"] and d["train"]["wgrad"]["grad_output"] == "fp8_e4m3 128x1"
    res = invoke("flow", "presets/fp8-rollout.yaml")
    assert res.exit_code == 0 and "off-policy" in res.output
    res = invoke("flow", "fp8-unified", "--set", "precision.train.fprop.input=bf16")
    one_line_error(res, "precision.train.fprop", "both operands must be 8-bit or neither")
    bad = tmp_path / "b.yaml"
    bad.write_text("precision: {base: bf16, trian: {}}\n")
    one_line_error(invoke("flow", bad), str(bad), "precision.trian", "unknown key")
    one_line_error(invoke("flow", "no-such-thing"), "no such file")


def test_version_and_help_do_not_import_torch():
    code = ("import sys; from typer.testing import CliRunner; from jetrl_cli.cli import app; "
            "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
            "assert 'quantize' in r.output and 'flow' in r.output; "
            "assert 'torch' not in sys.modules, 'torch imported at start-up'; "
            "r = CliRunner().invoke(app, ['--version']); assert r.output.startswith('jetrl ')")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-tensor"])
def test_checkpoint_tensors_of_live_weights_equal_the_written_checkpoint(tmp_path, fmt):
    """The vLLM backend syncs vLLM's own FP8 layers with ``checkpoint_tensors`` of the trainer's
    weights: the same tensors, bit for bit, as ``jetrl quantize`` writes for those weights (on a model
    whose shapes vLLM's block FP8 takes: the tiny policy's are refused for fp8-block)."""
    from jetrl_cli.models.hf import safetensors_files
    from jetrl_cli.quantize_ckpt import checkpoint_tensors, quantize_checkpoint

    src = write_random_model(tmp_path / "src", seed=fresh_seed())
    model = load_model(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # live weights, as after an update
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"))
    quantize_checkpoint(src, tmp_path / "q", fmt)
    written = {}
    for f in safetensors_files(tmp_path / "q"):
        written.update(load_file(f))
    live = {}
    for name, p in model.named_parameters():
        live.update(dict(checkpoint_tensors(name, p.detach(), fmt)[0]))
    assert set(live) == set(written)
    for k, v in live.items():
        a, b = v, written[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a.float(),
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b.float()), k
