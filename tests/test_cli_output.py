"""What the CLI prints: tables readable at 80 columns (piped output), help without cut text or
type tags on flags, brackets printed as written, YAML errors on the right line."""

import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from jetrl_cli.cli import app
from jetrl_cli.errors import PresetError
from jetrl_cli.presets_io import load_yaml
from jetrl_cli.tables import fit_table, min_width, print_table

runner = CliRunner()
COMMANDS = ["", "flow", "quantize", "rollout", "train", "mismatch-report", "run", "bench"]


def render(fn, width=80) -> str:
    con = Console(width=width, file=io.StringIO())
    fn(con)
    return con.file.getvalue()


def wide_table(cols: int = 12) -> tuple[Table, list[str]]:
    t = Table(title="a wide table of small numbers")
    t.add_column("flow")
    numbers = []
    for j in range(cols):
        t.add_column(f"metric {j}", justify="right")
    for i, name in enumerate(("bf16", "fp8-rollout", "fp8-unified")):
        row = [f"{(i * cols + j + 1) * 1.2345e-5:.3e}" for j in range(cols)]
        numbers += row
        t.add_row(name, *row)
    return t, numbers


def test_a_table_wider_than_the_console_is_split_not_cut():
    t, numbers = wide_table()
    assert min_width(Console(width=80), t) > 80
    text = render(lambda con: print_table(con, t))
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    for n in numbers:
        assert text.count(n) == 1, n
    parts = fit_table(Console(width=80), wide_table()[0])
    assert len(parts) > 1 and all(p.columns[0].header.plain == "flow" for p in parts)  # the label repeats
    assert text.count("fp8-rollout") == len(parts)
    assert "(continued)" in text


def test_a_table_that_fits_only_when_wrapped_cuts_no_number():
    """Rich's own shrinking starts with the widest columns and would cut the 11-character shape."""
    t = Table(title="gemm")
    t.add_column("shape")
    t.add_column("variant @ backend")
    for c in ("ms", "TFLOP/s", "vs bf16", "rel err", "SQNR dB"):
        t.add_column(c, justify="right")
    t.add_row("256x256x256", "fp8 1x128 x 128x128 @ emulated and some more words", "0.81", "0.042", "9.88x",
              "3.7e-02", "28.6")
    text = render(lambda con: print_table(con, t), width=60)
    assert "…" not in text and all(len(line) <= 60 for line in text.splitlines())
    for n in ("256x256x256", "0.81", "0.042", "9.88x", "3.7e-02", "28.6"):
        assert n in text


def test_a_word_wider_than_the_console_is_folded_whole():
    t = Table()
    t.add_column("path")
    t.add_row("x" * 100)
    text = render(lambda con: print_table(con, t))
    assert "…" not in text and text.count("x") == 100


def test_cells_are_printed_as_written():
    t = Table()
    t.add_column("weights [fp8]")
    t.add_row("int8[row]xint8[row]")
    t.add_row("pip install 'jetrl[plot]'")
    text = render(lambda con: print_table(con, t))
    assert "int8[row]xint8[row]" in text and "'jetrl[plot]'" in text and "weights [fp8]" in text


def test_flow_table_keeps_the_bracketed_granularities():
    from jetrl_cli.precision import named_flow
    from jetrl_cli.report import print_flow

    text = render(lambda con: print_flow(con, named_flow("int8-rollout")))
    assert "input int8[row]" in text and "weight int8[row]" in text and "…" not in text
    text = render(lambda con: print_flow(con, named_flow("fp8-unified")))
    assert "e4m3[1x128]" in text and "e4m3[128x1]" in text


def test_run_summary_names_the_plot_extra_with_its_brackets(tmp_path):
    from jetrl_cli.config import load_job_config
    from jetrl_cli.live import RunDisplay

    cfg = load_job_config("int8-rollout-tis")
    lines = [{"step": 0, "eval_accuracy": 0.5, "eval_s": 1.0},
             {"step": 1, "reward_mean": 0.25, "mismatch_kl": 1.5e-4, "step_s": 2.0, "rollout_s": 1.0, "score_s": 0.5,
              "train_s": 0.4, "sync_s": 0.1, "eval_accuracy": 0.75, "eval_s": 1.0}]
    text = render(lambda con: RunDisplay(cfg, con).finish(lines, tmp_path))
    assert "(pip install 'jetrl[plot]' for curves.png)" in text
    assert "int8[row]xint8[row]" in text  # the flow in the table's title
    # time: the steps' step_s plus every eval_s (step_s leaves the eval out)
    assert "4s (rollout 25%, score 12%, train 10%, sync 2%, eval 50%)" in " ".join(text.replace("│", " ").split())


@pytest.mark.parametrize("command", COMMANDS)
def test_help_fits_80_columns_and_flags_show_no_type(command):
    res = runner.invoke(app, [*([command] if command else []), "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert res.exit_code == 0, res.output
    assert "…" not in res.output
    assert all(len(line) <= 80 for line in res.output.splitlines())
    assert "<bool>" not in res.output and "list[" not in res.output
    assert re.search(r"--help\s+-h\s+Show this message", res.output)


def test_help_shows_the_flows_default_whole():
    res = runner.invoke(app, ["mismatch-report", "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    text = " ".join(res.output.replace("│", " ").split())
    assert "Default: preset, bf16, fp8-rollout, fp8-unified." in text
    assert "--set KEY=VALUE" in text and "--fail-above METRIC=VALUE" in text


@pytest.mark.parametrize("text, line, shown", [
    ("precision: bf16\nmodel:\n  path tiny\n  device: cpu\n", 3, "path tiny"),  # a key without its colon
    ("precision: bf16\ntrain\nrun:\n  seed: 1\n", 2, "train"),
    ("precision: bf16\nmodel:\n  path: a: b\n", 3, "path: a: b"),
    ("precision: bf16\nmodel:\n\tpath: tiny\n", 3, "path: tiny"),
    ("precision: bf16\ntrain:\n  betas: [0.9, 0.99\nrun:\n  seed: 1\n", 3, "betas: [0.9, 0.99"),  # unclosed [
])
def test_yaml_syntax_errors_name_the_offending_line(tmp_path, text, line, shown):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(PresetError) as e:
        load_yaml(p)
    assert str(e.value).startswith(f"{p}: line {line}: invalid YAML: ")
    assert str(e.value).endswith(repr(shown))


def test_answer_format_choices_are_the_extractors():
    from jetrl_cli.config import CHOICES
    from jetrl_cli.tasks import ANSWER_FORMATS

    assert set(CHOICES[("task", "answer_format")]) == set(ANSWER_FORMATS)


def test_readme_table_is_between_the_markers():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("<!-- preset-table -->\n", 1)[1].split("\n<!-- /preset-table -->", 1)[0]
    assert block.startswith("| preset | train reward, first 5 steps |") and block.count("\n| `") >= 6
