"""Precision flows as data: named flows, YAML presets, one-line errors naming file and key."""

import itertools
from pathlib import Path

import pytest
import yaml

from jetrl_cli.errors import PresetError
from jetrl_cli.precision import NAMED_FLOWS, named_flow, parse_flow
from jetrl_cli.precision.formats import Block, Format
from jetrl_cli.presets_io import apply_overrides, load_preset, shipped_presets_dir

REPO_PRESETS = sorted((Path(__file__).parent.parent / "presets").glob("*.yaml"))


def test_repo_has_presets_and_they_are_the_shipped_ones():
    assert REPO_PRESETS, "presets/ is empty"
    shipped = sorted(p.name for p in shipped_presets_dir().glob("*.yaml"))
    assert shipped == [p.name for p in REPO_PRESETS]


@pytest.mark.parametrize("path", REPO_PRESETS, ids=lambda p: p.name)
def test_every_preset_loads_validates_and_documents_itself(path):
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# "), f"{path.name} must start with a comment saying what it shows"
    header = list(itertools.takewhile(lambda line: line.startswith("#"), lines))
    commands = [line.lstrip("#").strip() for line in header if line.lstrip("#").strip().startswith("jetrl ")]
    assert commands, f"{path.name}: its leading comment must give the command that runs it"
    assert commands[0].split()[:3] == ["jetrl", "run", f"presets/{path.name}"], commands[0]
    preset = load_preset(str(path))
    assert preset.flow.short_str()
    # the printed dict form parses back to the same flow
    again = parse_flow(preset.flow.to_dict(), name=preset.flow.name)
    assert again == preset.flow


@pytest.mark.parametrize("name", list(NAMED_FLOWS))
def test_named_flows_round_trip_and_the_preset_of_the_same_name_agrees(name):
    flow = named_flow(name)
    assert parse_flow(flow.to_dict(), name=name) == flow
    preset = Path(__file__).parent.parent / "presets" / f"{name}.yaml"
    if preset.exists():
        assert load_preset(str(preset)).flow == flow


def test_the_four_recipes_say_what_they_are():
    unified = named_flow("fp8-unified")
    assert unified.is_on_policy and unified.unified
    lin = unified.train.linear
    assert lin.fprop == unified.rollout.linear
    assert lin.fprop.a.format is Format.FP8_E4M3 and lin.fprop.a.block == Block(1, 128)
    assert lin.fprop.b.block == Block(128, 128)
    assert lin.dgrad.a.block == Block(1, 128) and lin.wgrad.a.block == Block(128, 1)
    assert lin.wgrad.b.block == Block(128, 1) and lin.save_fp8_activations
    assert lin.dgrad.out is Format.BF16 and unified.train.master_weights is Format.FP32
    assert named_flow("bf16").is_on_policy
    assert not named_flow("fp8-rollout").is_on_policy
    assert named_flow("int8-rollout").rollout.linear.a.format is Format.INT8
    assert named_flow("fp8-rollout").skip == named_flow("fp8-unified").skip == ("embed_tokens", "lm_head", "*norm*")


def write(tmp_path, text):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    return str(p)


BAD = [
    ("precision: fp9-magic\n", "precision", "unknown flow 'fp9-magic'"),
    ("precision: bf16\nmodle: x\n", "modle", "unknown key"),
    ("precision: {base: fp8-unified, rolout: {}}\n", "precision.rolout", "unknown key"),
    ("precision: {base: fp8-unified, rollout: {linear: {input: fp4 1x128}}}\n",
     "precision.rollout.linear.input", "unknown format 'fp4'"),
    ("precision: {base: fp8-unified, rollout: {linear: {input: fp8_e4m3 7y7}}}\n",
     "precision.rollout.linear.input", "unknown granularity"),
    ("precision: {base: fp8-unified, train: {save_fp8_activations: 'yes'}}\n",
     "precision.train.save_fp8_activations", "expected true or false"),
    ("precision: {base: fp8-unified, train: {fprop: {input: bf16, weight: bf16}}}\n",
     "precision.unified", "train.fprop differs from rollout.linear"),
    ("precision: {base: fp8-rollout, train: {save_fp8_activations: true}}\n",
     "precision.train.save_fp8_activations", "needs an fp8 wgrad.input"),
    ("precision: {base: fp8-rollout, rollout: {linear: {input: int8 row, weight: fp8_e4m3 row}}}\n",
     "precision.rollout.linear", "cannot mix int8 and fp8"),
    ("precision: {base: fp8-rollout, rollout: {linear: {input: fp8_e5m2 row, weight: fp8_e5m2 row}}}\n",
     "precision.rollout.linear", "e5m2 x e5m2"),
    ("precision: {base: fp8-rollout, rollout: {linear: {input: fp8_e4m3 1x64, weight: fp8_e4m3 128x128}}}\n",
     "precision.rollout.linear", "scale groups along the reduction dim differ"),
    ("precision: {base: fp8-rollout, rollout: {linear: {input: fp8_e4m3 1x128, weight: bf16}}}\n",
     "precision.rollout.linear", "both operands must be 8-bit or neither"),
    ("precision: {base: bf16, weight_sync: quantized}\n", "precision.weight_sync", "needs an 8-bit rollout weight"),
    ("precision: {base: bf16, rollout: {kv_cache: int8 row}}\n", "precision.rollout.kv_cache", "int8 KV cache"),
    ("precision: {base: bf16, rollout: {kv_cache: fp8_e4m3 tensor}}\n", "precision.rollout.kv_cache", "takes 'row' scales"),
    ("precision: {base: bf16, train: {master_weights: fp8_e4m3}}\n", "precision.train.master_weights", "not allowed"),
    ("precision: {base: bf16, train: {master_weights: bf16}}\n", "precision.train.master_weights",
     "bf16 master weights are not implemented"),
    ("precision: {base: bf16, train: {fprop: {input: bf16, weight: bf16, backend: cutlass}}}\n",
     "precision.train.fprop.backend", "unknown backend"),
    ("precision: {base: fp8-rollout, rollout: {linear: {input: fp8_e4m3 1x64, weight: fp8_e4m3 64x64, backend: scaled_mm}}}\n",
     "precision.rollout.linear.backend", "or the blockwise recipes 1x128 x 128x128"),
    ("precision: {base: bf16, train: {dgrad: {grad_output: fp8_e4m3 row, weight: fp8_e4m3 row, backend: scaled_mm}}}\n",
     "precision.train.dgrad.backend", "grad_output is row and weight is row, i.e. row x col along the reduction"),
    ("precision: {base: bf16, skip_format: fp8_e4m3}\n", "precision.skip_format", "not allowed here (allowed: bf16, fp32)"),
    ("precision: {base: bf16, skip: lm_head}\n", "precision.skip", "list of module-name patterns"),
    ("precision: {base: bf16, rollout: {linear: {input: bf16 row, weight: bf16}}}\n",
     "precision.rollout.linear.input", "takes no granularity"),
    ("precision: [1, 2]\n", "precision", "expected a flow name or a mapping"),
    ("precision: {base: [fp8-unified]}\n", "precision.base",
     "expected a flow name (bf16, fp8-rollout, int8-rollout, fp8-unified), got ['fp8-unified']"),
    ("precision: {base: {fp8-unified: 1}, unified: false}\n", "precision.base", "expected a flow name"),
    ("precision: {base: fp8-rollout, rollout: {linear: {input: {format: fp8_e4m3, block: [1.7, 128]}}}}\n",
     "precision.rollout.linear.input.block", "expected two whole numbers [rows, cols], got [1.7, 128]"),
    ("precision: {base: fp8-rollout, rollout: {linear: {input: {format: fp8_e4m3, block: [true, 128]}}}}\n",
     "precision.rollout.linear.input.block", "expected two whole numbers [rows, cols], got [True, 128]"),
    ("precision: {base: bf16, train: {fprop: {input: {format: fp8_e4m3, block: 1x128, amax_floor: -1}, weight: bf16}}}\n",
     "precision.train.fprop.input.amax_floor", "positive number"),
    ("- just\n- a list\n", "", "expected a mapping at the top level"),
    ("precision: {base: bf16\n", "line", "invalid YAML"),
    ("", "", "empty file"),
]


@pytest.mark.parametrize("text,key,msg", BAD)
def test_bad_preset_is_one_line_naming_file_and_key(tmp_path, text, key, msg):
    path = write(tmp_path, text)
    with pytest.raises(PresetError) as e:
        load_preset(path)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(path)
    assert key in line and msg in line, line


def test_missing_preset_file(tmp_path):
    with pytest.raises(PresetError, match="no such file"):
        load_preset(str(tmp_path / "nope.yaml"))


def test_shipped_preset_by_name_and_overrides():
    p = load_preset("fp8-unified", overrides=["precision.rollout.kv_cache=fp8_e4m3 row"])
    assert p.flow.rollout.kv_cache.format is Format.FP8_E4M3
    # an fp8 KV cache has one granularity, per token and head: a bare format means it (the README's example)
    bare = load_preset("fp8-rollout", overrides=["precision.rollout.kv_cache=fp8_e4m3"])
    assert bare.flow.rollout.kv_cache == p.flow.rollout.kv_cache and bare.flow.rollout.kv_cache.block == Block.parse("row")
    assert load_preset("bf16", overrides=["precision.rollout.kv_cache=fp32"]).flow.rollout.kv_cache.block == Block.parse("tensor")
    p = load_preset("bf16", overrides=["precision.train.wgrad.out=bf16"])
    assert p.flow.train.linear.wgrad.out is Format.BF16 and p.flow.name == "bf16"
    with pytest.raises(PresetError, match="precision.train.wgrad.out"):
        load_preset("bf16", overrides=["precision.train.wgrad.out=int8"])
    with pytest.raises(PresetError, match="key.sub=value"):
        apply_overrides({}, ["nonsense"], "x.yaml")


def test_pow2_and_mapping_cast_specs(tmp_path):
    text = yaml.safe_dump({"precision": {"base": "fp8-unified", "rollout": {"linear": {
        "input": {"format": "fp8_e4m3", "block": "1x128", "pow2_scale": True},
        "weight": "fp8_e4m3 128x128 pow2"}}, "unified": False}})
    flow = load_preset(write(tmp_path, text)).flow
    assert flow.rollout.linear.a.pow2_scale and flow.rollout.linear.b.pow2_scale
    assert not flow.is_on_policy  # the training side kept its non-pow2 scales
    assert "e4m3[1x128]^2" in flow.short_str()


def test_a_flow_base_given_by_set_as_a_list_is_one_line():
    with pytest.raises(PresetError, match=r"fp8-unified.yaml: precision.base: expected a flow name \(bf16, .*got \['a'\]$"):
        load_preset("fp8-unified", overrides=["precision.base=[a]"])
