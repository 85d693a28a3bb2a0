"""Every `jetrl` command the README shows is one jetrl accepts.

The commands are read from the README's code blocks (comments dropped, `a && b` split, the
`for p in ...; do ...; done` loop expanded), so a command added to or changed in the README is
tested without touching this file. A command jetrl refuses fails:

- default suite: the cheap commands (`flow`, `quantize`, `--help`) run verbatim; every other
  command is parsed by the CLI itself and its preset + `--set` overrides are loaded, which is
  where a refused option or value (`kv_cache=fp8_e4m3`, a typo'd key) shows;
- `-m slow`: every command runs for real, in README order in a scratch directory, shrunk by
  `--set` overrides appended after its own (2 prompts x 2 samples, 1 step, 8 tokens; the last
  override of a key wins) and, for `jetrl bench`, small sizes. GPU and vLLM commands run where
  those exist; elsewhere jetrl must refuse them for that reason and no other.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from jetrl_cli.cli import app

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
SHRINK = ["train.steps=1", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "eval.prompts=2",
          "run.checkpoint_every=1"]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
runner = CliRunner()


def code_block_lines(text: str) -> list[str]:
    lines = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        lines += block.replace("\\\n", " ").splitlines()
    return lines


def split_commands(line: str) -> list[list[str]]:
    """Shell words of each command on a code-block line."""
    loop = re.fullmatch(r"\s*for (\w+) in (.*?); do (.*?); done\s*", line)
    if loop:
        var, items, body = loop.groups()
        return [w for item in items.split() for w in split_commands(body.replace(f"${var}", item))]
    out = []
    for segment in re.split(r"\s*(?:&&|;)\s*", line):
        try:
            words = shlex.split(segment, comments=True)
        except ValueError:  # prose in a code block (an apostrophe), not a command
            continue
        if words:
            out.append(words)
    return out


def readme_commands(text: str | None = None) -> list[list[str]]:
    """The argv (after `jetrl`) of every jetrl command in the README's code blocks, in order, once each."""
    seen, cmds = set(), []
    for line in code_block_lines(text if text is not None else README.read_text()):
        for words in split_commands(line):
            if words[0] == "jetrl" and tuple(words) not in seen:
                seen.add(tuple(words))
                cmds.append(words[1:])
    return cmds


def needs_gpu(argv: list[str]) -> bool:
    """A command that runs on a GPU: ``--device cuda``, ``model.device=cuda``, or a ``presets/gpu-*`` preset
    (which sets ``model.device: cuda``)."""
    return ("cuda" in argv or any(a.startswith("model.device=cuda") for a in argv)
            or any(Path(a).name.startswith("gpu-") and a.endswith(".yaml") for a in argv))


def needs_vllm(argv: list[str]) -> bool:
    return any("vllm" in a for a in argv)


def test_the_readme_commands_are_found():
    cmds = readme_commands()
    assert ["flow", "presets/fp8-rollout.yaml", "--set", "precision.rollout.kv_cache=fp8_e4m3"] in cmds
    assert ["run", "presets/qurl.yaml"] in cmds  # from the for loop
    assert {c[0] for c in cmds} >= {"run", "rollout", "train", "mismatch-report", "bench", "flow", "quantize"}
    assert split_commands("a && jetrl run x.yaml   # comment") == [["a"], ["jetrl", "run", "x.yaml"]]


def _parse(argv: list[str]) -> dict:
    """The CLI's own parsing of a command's options (an unknown option or a bad value raises)."""
    group = typer.main.get_command(app)
    with group.make_context("jetrl", list(argv)) as ctx:
        sub = group.get_command(ctx, argv[0])
        assert sub is not None, f"no command {argv[0]!r}"
        with sub.make_context(argv[0], list(argv[1:]), parent=ctx) as sctx:
            return dict(sctx.params)


@pytest.fixture
def in_scratch_dir(tmp_path, monkeypatch):
    """A directory where README paths resolve: presets/ and docs/ as in the repository, runs/ fresh."""
    (tmp_path / "presets").symlink_to(ROOT / "presets")
    (tmp_path / "docs").symlink_to(ROOT / "docs")
    shutil.copy(README, tmp_path / "README.md")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _substitute(argv: list[str], tmp: Path, model_dir: Path) -> list[str]:
    """README placeholders -> real paths: MODEL_DIR / OUT_DIR of `quantize`, `/models/...` of `bench`,
    `--set model.path=/models/...` -> the tiny policy, `/data/...` of `--set task.file=` -> a GSM8K-style row
    written here."""
    out = []
    for a in argv:
        a = {"MODEL_DIR": str(model_dir), "OUT_DIR": str(tmp / "quantized")}.get(a, a)
        key, eq, value = a.partition("=")
        if eq and value.startswith("/data/"):
            data = tmp / "gsm8k.jsonl"
            data.write_text(json.dumps({"question": "What is 1 plus 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
            a = f"{key}={data}"
        elif eq and value.startswith("/models/"):  # a model of a run: the shipped policy (tokenizer included)
            a = f"{key}=tiny"
        out.append(str(model_dir) if a.startswith("/models/") else a)
    return out


def test_every_readme_command_is_accepted(in_scratch_dir):
    from jetrl_cli import bench
    from jetrl_cli.config import load_job_config
    from jetrl_cli.models.tiny import write_random_model
    from jetrl_cli.rl import mismatch as mm

    model_dir = write_random_model(in_scratch_dir / "model", seed=0)
    checked = 0
    for argv in readme_commands():
        argv = _substitute(argv, in_scratch_dir, model_dir)
        if argv[0] in ("flow", "quantize") or argv == ["--help"]:  # cheap: verbatim
            res = runner.invoke(app, argv)
            assert res.exit_code == 0, (argv, res.output)
        else:
            params = _parse(argv)
            if "preset" in params:
                cfg = load_job_config(params["preset"], list(params.get("override") or []))
            if argv[0] == "mismatch-report":
                mm.parse_gates(list(params["fail_above"] or []))
                mm.parse_lengths(params["lengths"])
                if params["flows"]:
                    mm.resolve_flows(params["flows"].split(","), cfg.flow, cfg.name)
            if argv[0] == "bench":
                modes = bench.parse_modes(params["mode"])
                for f in (params["flows"] or "").split(","):
                    if f:
                        bench.check_flow(f, modes)
        checked += 1
    assert checked == len(readme_commands()) >= 20


@pytest.mark.slow
def test_every_readme_command_runs(in_scratch_dir, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from jetrl_cli import bench

    # q/k/gate rows in whole 128-row blocks: the README's `quantize --format fp8-block` takes only such models
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model_dir = in_scratch_dir / "hf-model"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    from jetrl_cli import config

    # `jetrl bench` (every mode) at small sizes: its GEMM and quantizer shapes, and the presets its
    # rollout and e2e modes load internally, shrunk like the commands' own presets below
    monkeypatch.setattr(bench, "default_gemm_shapes", lambda device: [("small", 16, 256, 256)])
    quantize_bench = bench.RUNNERS["quantize"]

    def small_quantize_bench(s):
        s.quant_shapes = [(128, 256)]
        return quantize_bench(s)

    monkeypatch.setitem(bench.RUNNERS, "quantize", small_quantize_bench)
    load = config.load_job_config
    monkeypatch.setattr(config, "load_job_config", lambda preset, overrides=None: load(preset, [*(overrides or []),
                                                                                               *SHRINK]))
    shrink_bench = ["--repeats", "1", "--warmup", "0", "--batch", "2", "--new-tokens", "4", "--train-batch", "2",
                    "--seq", "16", "--steps", "1", "--no-history"]
    for argv in readme_commands():
        argv = _substitute(argv, in_scratch_dir, model_dir)
        if argv[0] == "bench":
            argv = argv + shrink_bench + (["--shapes", "16x256x256"] if "--shapes" in argv else [])
        elif argv[0] in ("run", "rollout", "train", "mismatch-report"):
            argv = argv + [w for s in SHRINK for w in ("--set", s)]
            if argv[0] == "mismatch-report":
                argv += ["--prompts", "2", "--attribution-sequences", "2"]
                if "--lengths" in argv:
                    argv += ["--lengths", "8,16"]
            refused_here = (needs_gpu(argv) and not torch.cuda.is_available()) or (needs_vllm(argv) and not HAS_VLLM)
            if argv[0] == "run" and "--resume" not in argv:
                from jetrl_cli.config import load_job_config

                out = load_job_config(argv[1]).out_dir
                if (in_scratch_dir / out / "metrics.jsonl").exists():  # the README runs a preset in two places
                    # start over; a command this machine must refuse gets a directory of its own instead,
                    # so it is refused for its own reason
                    argv += ["-o", str(in_scratch_dir / "elsewhere")] if refused_here else ["--force"]
        res = runner.invoke(app, argv)
        if needs_gpu(argv) and not torch.cuda.is_available():
            assert res.exit_code == 2 and "no CUDA device" in res.output, (argv, res.output)
        elif needs_vllm(argv) and not HAS_VLLM:
            assert res.exit_code == 2 and "pip install 'jetrl[vllm]'" in res.output, (argv, res.output)
        else:
            assert res.exit_code == 0, (argv, res.output)
    # the README's other code-block commands that build its figures and table from those runs
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for line in code_block_lines(README.read_text()):
        if line.startswith(("python -m jetrl_cli.rl.plots", "python docs/preset_table.py")):
            res = subprocess.run(["bash", "-c", line.replace("docs/tiny-curves.png", "curves.png")], env=env,
                                 capture_output=True, text=True)
            assert res.returncode == 0, (line, res.stderr)
    assert (in_scratch_dir / "curves.png").exists()
    assert "| `fp8-unified` |" in (in_scratch_dir / "README.md").read_text()


def test_every_recipe_in_the_readme_loads_with_its_settings():
    """The README's recipes table: each row's `KEY=VALUE` settings, added to a preset, load and
    reach the job's configuration (a renamed key or a refused combination fails here)."""
    from jetrl_cli.config import load_job_config

    table = README.read_text().split("<!-- recipes -->")[1].split("<!-- /recipes -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| recipe")]
    assert len(rows) >= 10
    for row in rows:
        name, settings = row.split(" | ")[0][2:], row.split(" | ")[1]
        sets = [x for x in re.findall(r"`([^`\s]+=[^`\s]+)`", settings)]
        assert sets, name
        cfg = load_job_config("bf16", sets)
        for kv in sets:
            key, value = kv.split("=", 1)
            if key == "precision":
                assert cfg.flow.name == value, name
                continue
            section, field = key.split(".")
            got = getattr(getattr(cfg, section), field)
            assert str(got) == value or got == type(got)(value) or str(got).lower() == value, (name, key, got)
