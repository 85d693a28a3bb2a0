"""docs/from-verl.md, the guide for verl users, names only settings jetrl has.

Read from the guide itself, so that a row added or changed there is checked without touching this file:

- every table's ``jetrl`` column holds only jetrl preset keys (``train.kl_coef``, ``task.overlong_prompts=drop``:
  the key exists in ``jetrl_cli.config.SECTIONS``, and a value given for a key with a list of choices is one of
  them), ``precision`` settings, options of ``jetrl run`` (``--nproc N``) or jetrl commands;
- every other code span of the guide that starts like a jetrl key (``rollout.n``, ``eval.every``) is one,
  the verl columns aside (verl's keys there are written relative to their table's heading);
- every ``jetrl run`` command of its code blocks is one the CLI parses, and its preset with its ``--set``
  overrides loads with ``load_job_config``, each override reaching the job's configuration (the data and model
  paths, which do not exist here, are pointed at files this test writes).

The last tests show the checks failing on a guide with a wrong key, value or command.
"""

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from jetrl_cli.cli import app
from jetrl_cli.config import CHOICES, SECTIONS, load_job_config
from jetrl_cli.errors import PresetError
from jetrl_cli.precision.flow import named_flow

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "from-verl.md"
FIELDS = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}
# a code span that starts like a jetrl key: section, dot, field (``rollout.vllm_*``: any field of that prefix)
KEY = re.compile(rf"({'|'.join(SECTIONS)})\.(\w+\*?)(?:\s*[=:]\s*(.+))?$", re.S)
PATH_KEYS = ("model.path", "task.file", "task.eval_file")  # paths the example commands name on another machine


def _run_command():
    group = typer.main.get_command(app)
    return group, group.commands["run"]


def key_problem(span: str) -> str | None:
    """Why ``span`` (``section.field``, optionally ``=value`` or ``: value``) is not a jetrl preset key, or None."""
    m = KEY.match(span)
    if m is None:
        return f"`{span}`: not a jetrl key"
    section, field, value = m.groups()
    if field.endswith("*"):
        if not any(f.startswith(field[:-1]) for f in FIELDS[section]):
            return f"`{span}`: no {section} key starts with {field[:-1]!r}"
        return None
    if field not in FIELDS[section]:
        return f"`{span}`: {section} has no key {field!r} (its keys: {', '.join(sorted(FIELDS[section]))})"
    if value is not None and (section, field) in CHOICES:
        parsed = yaml.safe_load(value)
        if parsed not in CHOICES[(section, field)]:
            return f"`{span}`: {value!r} is not one of {section}.{field}'s choices {CHOICES[(section, field)]}"
    return None


def jetrl_cell_problem(span: str) -> str | None:
    """Why ``span``, in a table's jetrl column, is not a jetrl setting, or None."""
    if KEY.match(span):
        return key_problem(span)
    if span == "precision":
        return None
    if span.startswith("precision="):
        try:
            named_flow(span.split("=", 1)[1])
        except Exception as e:  # noqa: BLE001 -- any refusal is the finding
            return f"`{span}`: {e}"
        return None
    if span.startswith("precision."):
        try:
            load_job_config(str(ROOT / "presets" / "bf16.yaml"), [span] if "=" in span else [])
        except PresetError as e:
            return f"`{span}`: {e}"
        return None
    group, run = _run_command()
    if span.startswith("-"):
        opts = {o for p in run.params for o in p.opts}
        return None if span.split()[0] in opts else f"`{span}`: not an option of jetrl run ({', '.join(sorted(opts))})"
    if span.startswith("jetrl "):
        return None if span.split()[1] in group.commands else f"`{span}`: no such jetrl command"
    return f"`{span}`: not a jetrl key, precision setting or jetrl run option"


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Each Markdown table of ``text``: its header cells and its rows' cells."""
    out, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if block:
            header, rows = block[0], [r for r in block[1:] if not all(set(c) <= set("-: ") for c in r)]
            out.append((header, rows))
            block = []
    return out


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def doc_problems(text: str) -> tuple[list[str], int]:
    """Every jetrl-looking name in the guide that jetrl does not have, and how many jetrl spans were checked."""
    problems, checked = [], 0
    prose = without_code_blocks(text)
    for header, rows in tables(prose):
        strict = [i for i, h in enumerate(header) if h == "jetrl"]
        verl = [i for i, h in enumerate(header) if h.startswith("verl")]
        for row in rows:
            assert len(row) == len(header), f"a row with {len(row)} cells under {len(header)} headers: {row}"
            for i, cell in enumerate(row):
                for s in spans(cell):
                    if i in strict:
                        checked += 1
                        why = jetrl_cell_problem(s)
                    elif i in verl:
                        continue
                    else:
                        why = key_problem(s) if KEY.match(s) else None
                    if why:
                        problems.append(f"{row[0]}: {why}")
    for line in prose.splitlines():
        if line.startswith("|"):
            continue
        for s in spans(line):
            if KEY.match(s):
                checked += 1
                why = key_problem(s)
                if why:
                    problems.append(why)
    return problems, checked


def run_commands(text: str) -> list[list[str]]:
    """The argv (after ``jetrl``) of every ``jetrl run`` command in the guide's code blocks."""
    cmds = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["jetrl", "run"]:
                cmds.append(words[1:])
    return cmds


def overrides(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, w in enumerate(argv) if w == "--set"]


def load_command(argv: list[str], tmp_path: Path):
    """The job configuration ``jetrl <argv>`` would run, after the CLI's own parsing of its options."""
    group, run = _run_command()
    with group.make_context("jetrl", list(argv)) as ctx, run.make_context("run", list(argv[1:]), parent=ctx) as rc:
        preset = rc.params["preset"]
    sets = []
    for kv in overrides(argv):
        key, value = kv.split("=", 1)
        if key in PATH_KEYS:  # the guide's paths are on the user's machine: the same names, written here
            local = tmp_path / Path(value).name
            local.mkdir(exist_ok=True) if key == "model.path" else local.write_text("")
            kv = f"{key}={local}"
        sets.append(kv)
    path = ROOT / preset if (ROOT / preset).exists() else preset
    return load_job_config(str(path), sets), sets


def test_every_jetrl_key_in_the_guide_is_one():
    text = DOC.read_text()
    problems, checked = doc_problems(text)
    assert not problems, "\n".join(problems)
    assert checked >= 100  # the tables were found and read
    assert len(tables(without_code_blocks(text))) >= 9


def test_the_guide_and_its_test_keep_to_120_columns():
    for path in (DOC, Path(__file__)):
        long = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if len(line) > 120]
        assert not long, f"{path.name}: lines {long} are longer than 120 characters"


def test_the_readme_links_the_guide():
    assert "docs/from-verl.md" in (ROOT / "README.md").read_text()


def test_the_example_commands_load(tmp_path):
    cmds = run_commands(DOC.read_text())
    assert len(cmds) >= 3
    main = max(cmds, key=lambda c: len(overrides(c)))
    assert len(overrides(main)) >= 25 and "--nproc" in main
    for argv in cmds:
        cfg, sets = load_command(argv, tmp_path)
        for kv in sets:
            key, value = kv.split("=", 1)
            if key == "precision":
                assert cfg.flow.name == value
                continue
            section, field = key.split(".")
            got = getattr(getattr(cfg, section), field)
            want = yaml.safe_load(value)
            assert got == want or str(got) == value or (isinstance(got, float) and got == float(value)), (key, got)


def test_the_example_is_the_verl_job():
    """The worked example's numbers are the conversions the guide gives for verl's command beside it."""
    text = DOC.read_text()
    main = max(run_commands(text), key=lambda c: len(overrides(c)))
    sets = dict(kv.split("=", 1) for kv in overrides(main))
    block = next(b for b in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M) if "verl.trainer.main_ppo" in b)
    verl = dict(re.findall(r"^\s+([a-z_.]+)=(\S+?)\s*\\?$", block, re.M))
    assert int(sets["rollout.prompts_per_step"]) == int(verl["data.train_batch_size"])
    assert int(sets["rollout.n"]) == int(verl["actor_rollout_ref.rollout.n"])
    assert int(sets["train.minibatches"]) == (int(verl["data.train_batch_size"])
                                              // int(verl["actor_rollout_ref.actor.ppo_mini_batch_size"]))
    assert int(sets["train.micro_batch"]) == int(verl["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"])
    assert int(sets["rollout.max_new_tokens"]) == int(verl["data.max_response_length"])
    assert int(sets["rollout.max_len"]) == int(verl["data.max_prompt_length"]) + int(verl["data.max_response_length"])
    assert int(sets["train.steps"]) == 7473 // int(verl["data.train_batch_size"]) * int(verl["trainer.total_epochs"])
    assert float(sets["train.kl_coef"]) == float(verl["actor_rollout_ref.actor.kl_loss_coef"])
    assert int(sets["eval.every"]) == int(verl["trainer.test_freq"])
    assert int(sets["run.checkpoint_every"]) == int(verl["trainer.save_freq"])


# The checks above can fail: a guide with one wrong name, value or command is refused.

def test_a_wrong_key_in_the_guide_is_found():
    text = DOC.read_text()
    assert "`train.kl_coef`" in text
    problems, _ = doc_problems(text.replace("`train.kl_coef`", "`train.kl_coeff`", 1))
    assert any("train.kl_coeff" in p for p in problems), problems


def test_a_wrong_value_a_verl_key_or_an_unknown_option_in_a_jetrl_column_is_found():
    text = DOC.read_text()
    for old, new, named in (("`task.overlong_prompts=drop`", "`task.overlong_prompts=truncate`", "truncate"),
                            ("| `train_batch_size` | `rollout.prompts_per_step` |",
                             "| `train_batch_size` | `data.train_batch_size` |", "data.train_batch_size"),
                            ("`--nproc N`", "`--gpus N`", "--gpus")):
        assert old in text, old
        problems, _ = doc_problems(text.replace(old, new, 1))
        assert any(named in p for p in problems), (new, problems)


def test_a_wrong_override_in_the_example_is_found(tmp_path):
    text = DOC.read_text()
    assert "--set train.kl_coef=0.001" in text
    bad = run_commands(text.replace("--set train.kl_coef=0.001", "--set train.kl_coeff=0.001"))
    with pytest.raises(PresetError, match="kl_coeff"):
        for argv in bad:
            load_command(argv, tmp_path)
