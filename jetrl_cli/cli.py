"""The ``jetrl`` command line. Start-up imports only typer and rich; torch loads inside commands."""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from . import __version__
from .errors import JetrlError


class _NoTagOnHelp:
    """typer prints a type tag after every option in the help, ``<bool>`` after ``--help`` too; a flag
    takes no value, so its tag is blank (jetrl's own flags pass ``metavar=""`` for the same reason)."""

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt


class _Command(_NoTagOnHelp, typer.core.TyperCommand):
    pass


class _Group(_NoTagOnHelp, typer.core.TyperGroup):
    pass


class _App(typer.Typer):
    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    cls=_Group,
    name="jetrl",
    help="Reinforcement learning of language models in low precision, on-policy.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_show_locals=False,
)
console = Console()
err_console = Console(stderr=True)

from .choices import CHECKPOINT_FORMATS as QUANT_FORMATS


def user_errors(fn):
    """A JetrlError becomes one red line on stderr and exit code 2, as does an OSError on a named
    path (an output that is a file, a directory that cannot be made: the user's paths); anything
    else is a bug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from rich.markup import escape

        try:
            return fn(*args, **kwargs)
        except JetrlError as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except OSError as e:
            if e.filename is None:
                raise
            where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
            err_console.print(f"[bold red]error:[/] {escape(where)}: {escape(e.strerror or str(e))}",
                              highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/] (jetrl run --resume continues a run from its last "
                              "checkpoint)", highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None

    return wrapper


def _version(value: bool):
    if value:
        console.print(f"jetrl {__version__}")
        raise typer.Exit()


@app.callback()
@user_errors
def root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, metavar="", help="Print the version and exit.")
    ] = False,
):
    """Reinforcement learning of language models in low precision, on-policy."""
    _only_run_is_distributed(ctx.invoked_subcommand)


def _only_run_is_distributed(command: str | None) -> None:
    """Under torchrun with more than one process, every command but ``run`` would run once per rank:
    the same output N times, N writers racing on one file or checkpoint. Refused, by every rank."""
    from .distributed.world import torchrun_rank, torchrun_world_size

    if command is None or command == "run":
        return
    size = torchrun_world_size()
    if size > 1:
        rank = torchrun_rank()
        raise JetrlError(f"{f'rank {rank}: ' if rank else ''}jetrl {command} does not run under torchrun "
                         f"(WORLD_SIZE={size}): only jetrl run is distributed; run jetrl {command} as one process")


@app.command("flow")
@user_errors
def flow_cmd(
    preset: Annotated[str, typer.Argument(help="Preset file, or the name of a shipped preset or flow.")],
    override: Annotated[
        Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", help="Override a preset value: key.sub=value (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the flow as JSON.")] = False,
):
    """Check a preset's precision flow and show which format every GEMM, the KV cache and the sync use."""
    from .precision.flow import NAMED_FLOWS
    from .presets_io import apply_overrides, load_preset, resolve_preset_path

    try:
        resolve_preset_path(preset)
    except JetrlError as e:
        if preset not in NAMED_FLOWS:
            raise JetrlError(f"{e}; flows by name: {', '.join(NAMED_FLOWS)}") from None
        from .config import build_job_config  # a flow by name: the preset {precision: {base: NAME}}

        flow = build_job_config(apply_overrides({"precision": {"base": preset}}, override or [], preset), preset,
                                preset).flow
    else:
        flow = load_preset(preset, override or []).flow
    if as_json:
        print(json.dumps({"name": flow.name, "on_policy": flow.is_on_policy, "short": flow.short_str(),
                          **flow.to_dict()}, indent=2))
        return
    from .report import print_flow

    print_flow(console, flow)


@app.command("quantize")
@user_errors
def quantize_cmd(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face causal-LM directory (config.json + safetensors).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory to write (must not exist, or --force).")],
    fmt: Annotated[
        Optional[str],
        typer.Option("--format", "-f", help=f"Checkpoint format: {', '.join(QUANT_FORMATS)}."),
    ] = None,
    preset: Annotated[
        Optional[str],
        typer.Option("--preset", help="Take the format and skip list from this preset's rollout weights."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", metavar="", help="Replace an existing output directory.")] = False,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the per-layer results as JSON.")] = False,
):
    """Quantize a checkpoint into a format vLLM loads, with jetrl's own quantizers; print per-layer errors."""
    from .models.hf import check_model_dir
    from .precision.flow import DEFAULT_SKIP

    check_model_dir(model_dir)  # a missing input is the first thing to say, before any option

    skip = DEFAULT_SKIP
    if preset is not None:
        from .presets_io import load_preset
        from .quantize_ckpt import format_for_flow

        flow = load_preset(preset).flow
        skip = flow.skip
        preset_fmt = format_for_flow(flow)
        if fmt is not None and fmt != preset_fmt:
            raise JetrlError(f"--format {fmt} contradicts --preset {preset} (its rollout weights are {preset_fmt})")
        fmt = preset_fmt
    if fmt is None:
        raise JetrlError(f"pass --format ({', '.join(QUANT_FORMATS)}) or --preset")
    if fmt not in QUANT_FORMATS:
        raise JetrlError(f"--format {fmt!r} is not a format (allowed: {', '.join(QUANT_FORMATS)})")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from .quantize_ckpt import quantize_checkpoint

    progress = Progress(
        TextColumn("quantizing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}", markup=False),
        console=err_console, transient=True, disable=as_json or not err_console.is_terminal,
    )
    with progress:
        task = progress.add_task("", total=None)
        result = quantize_checkpoint(
            model_dir, output, fmt, skip=skip, force=force,
            count_tensors=lambda n: progress.update(task, total=n),
            on_tensor=lambda name: progress.update(task, advance=1, description=name),
        )
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    from .report import print_quantize

    print_quantize(console, result)


def _overrides(override: Optional[list[str]]) -> list[str]:
    return list(override or [])


SetOpt = Annotated[
    Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", help="Override a preset value: key.sub=value (repeatable).")
]


def _check_output(path: Path, flag: str, kind: str) -> None:
    """Before any work: ``path`` (``kind``: "file" or "directory") can be written, as far as its type and
    its parents' go -- an existing one of the other kind, or a parent that is a file, is refused."""
    if kind == "file" and path.is_dir():
        raise JetrlError(f"{flag} {path}: is a directory; {flag} takes the file to write")
    if kind == "directory" and path.exists() and not path.is_dir():
        raise JetrlError(f"{flag} {path}: is a file; {flag} takes the directory to write into")
    parent = next((q for q in path.parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise JetrlError(f"{flag} {path}: {parent} is a file, not a directory")


def _beside_out_dir(cfg, suffix: str) -> Path:
    """The default output of ``rollout``/``train``: ``OUT_DIR{suffix}``, beside the run's directory
    (``run.out_dir``). ``.`` or ``..`` is taken as the directory it names; ``/`` has nothing beside it."""
    d = cfg.out_dir if cfg.out_dir.name not in ("", "..") else cfg.out_dir.resolve()
    if not d.name:
        raise JetrlError(f"run.out_dir {cfg.run.out_dir}: the default output lies beside the run's directory, "
                         f"and {cfg.run.out_dir} has nothing beside it; give -o")
    return d.with_name(f"{d.name}{suffix}")


def _write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    import os

    if path.is_dir():
        raise JetrlError(f"{path}: is a directory; -o takes the JSONL file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # the user's path, not the temporary file's
        raise JetrlError(f"{path}: cannot write ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)


@app.command("rollout")
@user_errors
def rollout_cmd(
    preset: Annotated[str, typer.Argument(help="Preset file, or the name of a shipped preset.")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="JSONL to write (default OUT_DIR-rollout.jsonl, beside the run's directory).")] = None,
    prompts: Annotated[Optional[int], typer.Option("--prompts", help="Prompts to sample (default rollout.prompts_per_step).")] = None,
    split: Annotated[str, typer.Option("--split", help="train or eval problems.")] = "train",
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    override: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the summary as JSON.")] = False,
    force: Annotated[bool, typer.Option("--force", metavar="", help="Replace an existing output file.")] = False,
):
    """Sample completions with the preset's rollout precision; write JSONL (tokens, logprobs, reward)."""
    import time

    from .config import load_job_config
    from .rl.loop import rollout_samples, setup

    if split not in ("train", "eval"):
        raise JetrlError(f"--split {split!r}: allowed train, eval")
    if prompts is not None and prompts <= 0:
        raise JetrlError(f"--prompts must be > 0, got {prompts}")
    if seed < 0:
        raise JetrlError(f"--seed must be >= 0, got {seed}")
    cfg = load_job_config(preset, _overrides(override))
    out = output or _beside_out_dir(cfg, "-rollout.jsonl")
    _check_output(out, "-o", "file")
    if out.exists() and not force:
        raise JetrlError(f"{out}: exists (a run's samples, or an earlier rollout); --force replaces it, -o writes "
                         "another file")
    job = setup(cfg, with_trainer=False)
    n = prompts or cfg.rollout.prompts_per_step
    probs = job.source.batch(0, n) if split == "train" else job.source.eval_set(n)
    t0 = time.perf_counter()
    with err_console.status(f"sampling {n} prompts x {cfg.rollout.n}", spinner="dots"):
        samples = rollout_samples(job, probs, seed)
    dt = time.perf_counter() - t0
    for s in samples:
        s.update({"model": str(job.model_dir), "flow": cfg.flow.name})
    _write_jsonl_atomic(out, samples)
    toks = sum(len(s["tokens"]) for s in samples)
    summary = {
        "file": str(out), "flow": cfg.flow.name, "prompts": n, "samples": len(samples),
        "reward_mean": sum(s["reward"] for s in samples) / len(samples),
        "accuracy": sum(s["correct"] for s in samples) / len(samples),
        "response_len": toks / len(samples),
        "stopped": sum(s["finish_reason"] == "stop" for s in samples) / len(samples),
        "seconds": dt, "tokens_per_s": toks / dt,
    }
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    from .report import print_summary

    print_summary(console, f"rollout {cfg.name}", summary)


def _ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_rollouts(path: Path, vocab: int, max_len: int | None = None, n: int | None = None,
                   step: int | None = None) -> list[dict]:
    """A rollout file's rows (``step``: only that step's), each checked field by field (no longer than
    ``max_len`` tokens, in groups of ``n``, where given). A
    run's file holds every step's groups under the same group numbers: the rows' groups are renumbered by
    (step, group)."""
    from .tasks import read_jsonl

    rows, groups = [], {}
    need = ("prompt_ids", "tokens", "logprobs", "reward", "group")
    steps = set()
    for i, r in read_jsonl(path, "rollout file"):
        if not isinstance(r, dict):
            raise JetrlError(f"{path}:{i}: expected a JSON object per line")
        miss = [k for k in need if k not in r]
        if miss:
            raise JetrlError(f"{path}:{i}: missing field {miss[0]!r} (written by jetrl rollout?)")
        for key in ("prompt_ids", "tokens"):
            if not _ids(r[key]):
                raise JetrlError(f"{path}:{i}: {key} must be a non-empty list of token ids (integers)")
        lp = r["logprobs"]
        if not isinstance(lp, list) or len(lp) != len(r["tokens"]):
            raise JetrlError(f"{path}:{i}: logprobs must be a list with one number per token ({len(r['tokens'])})")
        bad = next((x for x in lp if not _number(x) or x > 0), None)
        if bad is not None:
            raise JetrlError(f"{path}:{i}: logprobs holds {bad!r}; a token's log-probability is a finite number <= 0")
        if not _number(r["reward"]):
            raise JetrlError(f"{path}:{i}: reward is {r['reward']!r}; it must be a finite number")
        for key in ("group", "step"):
            if key in r and not (isinstance(r[key], int) and not isinstance(r[key], bool) and r[key] >= 0):
                raise JetrlError(f"{path}:{i}: {key} is {r[key]!r}; it must be an integer >= 0")
        bad = [t for t in r["prompt_ids"] + r["tokens"] if not 0 <= t < vocab]
        if bad:
            raise JetrlError(f"{path}:{i}: token id {bad[0]} is out of range for this model (vocab {vocab}); "
                             "was the file written with another model?")
        if max_len is not None and len(r["prompt_ids"]) + len(r["tokens"]) > max_len:
            raise JetrlError(f"{path}:{i}: prompt and completion are {len(r['prompt_ids']) + len(r['tokens'])} "
                             f"tokens, longer than rollout.max_len ({max_len}); set rollout.max_len to the file's")
        steps.add(r.get("step", 0))
        if step is not None and r.get("step", 0) != step:
            continue
        key = (r.get("step", 0), r["group"])
        rows.append({**r, "group": groups.setdefault(key, len(groups))})
    if not rows and step is not None:
        raise JetrlError(f"{path}: no samples of step {step} (steps in the file: "
                         f"{', '.join(map(str, sorted(steps)))})")
    if not rows:
        raise JetrlError(f"{path}: empty rollout file")
    sizes = collections.Counter(r["group"] for r in rows)
    odd = next((key for key, g in groups.items() if n is not None and sizes[g] != n), None)
    if odd is not None:
        raise JetrlError(f"{path}: step {odd[0]}'s group {odd[1]} has {sizes[groups[odd]]} samples, rollout.n is {n} "
                         "(set rollout.n to the n the file was sampled with)")
    return rows


def _run_directory(out: Path) -> bool:
    """Whether ``out`` holds a run of ``jetrl run`` (its metrics or its preset)."""
    return (out / "metrics.jsonl").exists() or (out / "preset.yaml").exists()


@app.command("train")
@user_errors
def train_cmd(
    preset: Annotated[str, typer.Argument(help="Preset file, or the name of a shipped preset.")],
    rollouts: Annotated[Path, typer.Option("--rollouts", help="JSONL written by jetrl rollout / jetrl run.")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Directory for the checkpoint (default OUT_DIR-train, beside the run's).")] = None,
    updates: Annotated[int, typer.Option("--updates", help="Policy updates to make on these rollouts.")] = 1,
    step: Annotated[Optional[int], typer.Option("--step", help="Only the samples of this step of a run's rollouts.jsonl (default: all, each step's groups apart).")] = None,
    override: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the metrics as JSON.")] = False,
    force: Annotated[bool, typer.Option("--force", metavar="", help="Replace the checkpoints of an earlier train in the output directory.")] = False,
):
    """Update the policy from saved rollouts (training precision, the preset's correction); save a checkpoint."""
    import shutil

    from .config import load_job_config
    from .rl.checkpoint import save_checkpoint
    from .rl.loop import setup, train_on_samples

    if updates <= 0:
        raise JetrlError(f"--updates must be > 0, got {updates}")
    cfg = load_job_config(preset, _overrides(override))
    out = output or _beside_out_dir(cfg, "-train")
    if _run_directory(out):  # --force too: a train's checkpoint among a run's would be resumed as the run's
        raise JetrlError(f"{out}: holds a run of jetrl run (metrics.jsonl); jetrl train writes its checkpoint "
                         "elsewhere (default OUT_DIR-train): -o names another directory")
    if out.exists() and not out.is_dir():
        raise JetrlError(f"{out}: is a file; -o names the directory for the checkpoint")
    if (out / "checkpoints").exists() and not force:
        raise JetrlError(f"{out}: holds checkpoints of an earlier train; --force replaces them, -o writes elsewhere")
    if out.is_dir() and not (out / "checkpoints").exists() and any(out.iterdir()):
        raise JetrlError(f"{out}: a directory with other files in it (not a train's output); -o names a new or "
                         "empty directory")
    if rollouts.is_dir():
        raise JetrlError(f"--rollouts {rollouts}: is a directory; give the JSONL file (a run's rollouts.jsonl)")
    job = setup(cfg, with_trainer=True)
    rows = _read_rollouts(rollouts, job.trainer.model.config.vocab_size, cfg.rollout.max_len, cfg.rollout.n, step)
    metrics = []
    for k in range(1, updates + 1):
        with err_console.status(f"update {k}/{updates}", spinner="dots"):
            m = {"update": k, **train_on_samples(job, rows, k)}
        metrics.append(m)
    aside = None
    if force and (out / "checkpoints").exists():  # kept until the new checkpoint is written
        aside = out / f".checkpoints.replaced-{os.getpid()}"
        (out / "checkpoints").rename(aside)
        (out / "latest").unlink(missing_ok=True)
    try:
        ck = save_checkpoint(out, updates, job.trainer.model, job.trainer.opt, job.model_dir,
                             {"preset": cfg.name, "invariant_scale": cfg.train.invariant_scale},
                             cfg.run.keep_checkpoints)
    except BaseException:
        if aside is not None:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            aside.rename(out / "checkpoints")
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if as_json:
        print(json.dumps({"checkpoint": str(ck), "updates": metrics}, indent=2))
        return
    from .report import print_summary

    for m in metrics:
        print_summary(console, f"train {cfg.name}: update {m['update']}", m)
    console.print(f"checkpoint: {ck}", markup=False, highlight=False)


class GateFailed(JetrlError):
    exit_code = 4


def _check_model_fits(model: Path, model_dir: Path, tok) -> None:
    """``mismatch-report --model``: the weights are scored on text tokenized by model.path's tokenizer,
    so they must be a model of that tokenizer: model.path's vocabulary size, and its tokenizer where
    they ship one (a run's checkpoint does). Otherwise ids past the vocabulary fail in the embedding,
    or another model's ids silently mean other text."""
    from .models.hf import read_config
    from .models.tokenizer import Tokenizer

    have, want = read_config(model)[0].vocab_size, read_config(model_dir)[0].vocab_size
    fix = f"to report on that model, --set model.path={model} instead of --model"
    if have < tok.vocab_size:
        raise JetrlError(f"--model {model}: vocab_size {have}, but model.path's tokenizer ({model_dir}) has "
                         f"{tok.vocab_size} tokens (a different model?); {fix}")
    if have != want:
        raise JetrlError(f"--model {model}: vocab_size {have}, but model.path ({model_dir}) has {want}: another "
                         f"model, whose token ids mean other text than model.path's tokenizer's; {fix}")
    own = Tokenizer.from_dir(model) if (model / "tokenizer.json").exists() else None
    if own is not None and own._tk.get_vocab(True) != tok._tk.get_vocab(True):
        raise JetrlError(f"--model {model}: its tokenizer.json has another vocabulary than model.path's ({model_dir}); "
                         f"the report tokenizes with model.path's; {fix}")


@app.command("mismatch-report")
@user_errors
def mismatch_report_cmd(
    preset: Annotated[str, typer.Argument(help="Preset file, or the name of a shipped preset (model, task, sampling, correction).")],
    flows: Annotated[Optional[str], typer.Option("--flows", help="Flows to compare, comma-separated: 'preset' (the preset's own) or built-in names. Default: preset, bf16, fp8-rollout, fp8-unified.")] = None,
    lengths: Annotated[Optional[str], typer.Option("--lengths", help="Completion lengths to sample, comma-separated, e.g. 64,256 (default: the preset's max_new_tokens). Stop tokens are off, so every completion has this length.")] = None,
    prompts: Annotated[Optional[int], typer.Option("--prompts", help="Prompts to sample, each with rollout.n samples (default: the preset's prompts_per_step).")] = None,
    rollouts: Annotated[Optional[Path], typer.Option("--rollouts", help="Offline: report on this JSONL (from jetrl rollout / run) without re-sampling; scored with the preset's flow.")] = None,
    step: Annotated[Optional[int], typer.Option("--step", help="Offline: only the samples of this step of a run's rollouts.jsonl.")] = None,
    model: Annotated[Optional[Path], typer.Option("--model", help="Score with these weights (a HF directory or a run checkpoint) instead of model.path.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write report.md, report.json and PNG plots into this directory.")] = None,
    fail_above: Annotated[Optional[list[str]], typer.Option("--fail-above", metavar="METRIC=VALUE", help="METRIC=VALUE: exit with code 4 if any flow's metric exceeds VALUE (repeatable).")] = None,
    no_attribution: Annotated[bool, typer.Option("--no-attribution", metavar="", help="Skip the per-layer attribution.")] = False,
    attribution_sequences: Annotated[int, typer.Option("--attribution-sequences", help="Sequences used for the per-layer attribution.")] = 32,
    attribution_layers: Annotated[int, typer.Option("--attribution-layers", help="The attribution scores each decoder layer alone in rollout precision, then each linear alone in this many decoder layers: those with the largest KL.")] = 2,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    override: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print every number as JSON instead of tables.")] = False,
):
    """Diagnose rollout-vs-training drift per flow: statistics, drift by position and length, per-layer attribution."""
    import datetime
    import shlex

    import torch

    from . import __version__
    from .config import load_job_config
    from .models.hf import load_model
    from .models.tokenizer import Tokenizer
    from .rl import mismatch as mm
    from .rl.loop import _device, correction_config, resolve_model_dir, sampling_params
    from .rl.trainer import fold_invariant_scale
    from .tasks import PromptSource

    gates = mm.parse_gates(list(fail_above or []))
    lens = mm.parse_lengths(lengths)
    if prompts is not None and prompts <= 0:
        raise JetrlError(f"--prompts must be > 0, got {prompts}")
    if attribution_sequences <= 0:
        raise JetrlError(f"--attribution-sequences must be > 0, got {attribution_sequences}")
    if attribution_layers < 0:
        raise JetrlError(f"--attribution-layers must be >= 0, got {attribution_layers}")
    if rollouts is not None and (flows or lengths):
        raise JetrlError("--rollouts reports on saved samples with the preset's flow; drop --flows / --lengths")
    if step is not None and rollouts is None:
        raise JetrlError("--step selects samples of a --rollouts file; give --rollouts too")
    if out is not None:
        _check_output(out, "--out", "directory")
    if rollouts is not None and "greedy_diverged_frac" in gates:
        raise JetrlError("--fail-above greedy_diverged_frac: greedy decoding is not measured on saved samples "
                         "(--rollouts); gate it on a report that samples")
    cfg = load_job_config(preset, _overrides(override))
    model_dir = resolve_model_dir(cfg.model.path)
    if model is not None and not model.is_dir():
        raise JetrlError(f"--model {model}: no such directory")
    tok = Tokenizer.from_dir(model_dir)
    if model is not None:
        _check_model_fits(model, model_dir, tok)
    base = load_model(model or model_dir).to(_device(cfg)).eval()
    if cfg.train.invariant_scale != 1.0 and model is None:
        fold_invariant_scale(base, cfg.train.invariant_scale)
    vocab = base.config.vocab_size
    limit = base.config.max_position_embeddings
    if lens and max(lens) >= limit:
        raise JetrlError(f"--lengths {max(lens)}: the model takes at most {limit} positions "
                         f"(max_position_embeddings in {model or model_dir}/config.json), prompt included")
    sampling = sampling_params(cfg, tok)
    report = {
        "source": cfg.name, "date": datetime.date.today().isoformat(), "jetrl_version": __version__,
        "torch": torch.__version__, "device": cfg.model.device, "model": str(model or model_dir),
        "command": "jetrl mismatch-report " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "correction": {"tis_cap": cfg.correction.tis_cap, "mis_low": cfg.correction.mis_low,
                       "mis_high": cfg.correction.mis_high},
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                     "n": sampling.n},
    }

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    def progress(msg):  # on stderr with --json too: stdout stays one JSON document
        err_console.print(Text(msg, style="dim"))

    bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=err_console, transient=True, disable=not err_console.is_terminal)
    bar_tasks: dict[str, int] = {}

    def on_pass(what: str, done: int, total: int) -> None:  # one scoring pass of the attribution
        flow_label = what.split(": ", 1)[0]
        if flow_label not in bar_tasks:
            bar_tasks[flow_label] = bar.add_task(what, total=total)
        bar.update(bar_tasks[flow_label], completed=done, total=total, description=f"attribution {what}")

    with bar:
        if rollouts is not None:
            rows = _read_rollouts(rollouts, vocab, step=step)
            inp = mm.ReportInputs(base, functools.partial(tok.decode, skip_special=False), [r["prompt_ids"] for r in rows], sampling, cfg.train,
                                  correction_config(cfg), cfg.rollout.max_batch, seed,
                                  attribution_layers=attribution_layers, on_pass=on_pass)
            progress(f"scoring {len(rows)} saved samples with {cfg.flow.name} (training precision) and fp32")
            label = cfg.flow.name if cfg.flow.name != "custom" else cfg.name
            report["rollouts"] = str(rollouts)
            report["flows"] = [mm.offline_report(label, cfg.flow, inp, rows, attribution=not no_attribution,
                                                 attribution_sequences=attribution_sequences)]
        else:
            names = flows.split(",") if flows is not None else ["preset", *mm.DEFAULT_FLOWS]
            chosen = mm.resolve_flows(names, cfg.flow, cfg.name)
            lens = lens or [cfg.rollout.max_new_tokens]
            from .rl.loop import fitted_task

            source = PromptSource(fitted_task(cfg, tok, cfg.run.seed, strict=False), cfg.run.seed)
            n = prompts or cfg.rollout.prompts_per_step
            prompt_ids = tok.encode_prompts(source.batch(0, n), source.task.chat)[1]
            longest = max(map(len, prompt_ids))
            if longest + max(lens) > limit:
                raise JetrlError(f"--lengths {max(lens)}: after prompts of up to {longest} tokens, "
                                 f"{longest + max(lens)} positions; the model takes at most {limit} "
                                 f"(max_position_embeddings in {model or model_dir}/config.json)")
            inp = mm.ReportInputs(base, functools.partial(tok.decode, skip_special=False), prompt_ids, sampling,
                                  cfg.train, correction_config(cfg), cfg.rollout.max_batch, seed,
                                  attribution_layers=attribution_layers, on_pass=on_pass)
            if cfg.rollout.backend != "embedded":
                from .engine.base import make_payload
                from .rl.loop import build_engine

                def start_engine(flow, width):
                    eng = build_engine(cfg, base, model_dir, flow=flow, width=width)
                    eng.load_weights(make_payload(base, flow))
                    return eng

                inp.engine_factory, inp.engine_name = start_engine, cfg.rollout.backend
            report["lengths"] = lens
            report["flows"] = [mm.flow_report(label, f, inp, lens, attribution=not no_attribution,
                                              attribution_sequences=attribution_sequences, progress=progress)
                               for label, f in chosen]
    failures = mm.gate_failures(report["flows"], gates)
    report["gates"] = {"limits": gates, "failures": failures}
    written = mm.write_outputs(report, out) if out is not None else []
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        mm.render(report, console)
        for p in written:
            console.print(f"wrote {p}", markup=False, highlight=False)
    if written and not any(p.suffix == ".png" for p in written):
        err_console.print("no plots: they need matplotlib (pip install 'jetrl[plot]')", markup=False,
                          highlight=False)
    if failures:
        raise GateFailed("--fail-above: " + "; ".join(failures))


@app.command("run")
@user_errors
def run_cmd(
    preset: Annotated[str, typer.Argument(help="Preset file, or the name of a shipped preset.")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Output directory (default run.out_dir or runs/<preset>).")] = None,
    resume: Annotated[bool, typer.Option("--resume", metavar="", help="Continue the run in the output directory from its last checkpoint.")] = False,
    force: Annotated[bool, typer.Option("--force", metavar="", help="Delete a previous run in the output directory and start over.")] = False,
    nproc: Annotated[Optional[int], typer.Option("--nproc", metavar="N", help="Start N processes through torchrun (one per GPU; gloo on CPU): FSDP2 trainer, data-parallel rollout.")] = None,
    override: SetOpt = None,
):
    """The RL loop: rollout -> reward -> score -> update -> sync -> eval; metrics.jsonl, checkpoints, curves.png."""
    from .config import load_job_config
    from .distributed.world import (SINGLE, CollectiveTimeout, World, dist_timeout, is_collective_timeout,
                                    launched_by_torchrun, torchrun_rank)
    from .live import RunDisplay
    from .rl.loop import run

    rank, world = torchrun_rank(), SINGLE
    try:
        if force and resume:
            raise JetrlError("--force and --resume contradict each other")
        cfg = load_job_config(preset, _overrides(override))
        out = output or cfg.out_dir
        _check_output(out, "-o", "directory")
        if cfg.rollout.backend == "vllm" and (nproc is not None or launched_by_torchrun()):
            raise JetrlError("rollout.backend: vllm does not run under torchrun (--nproc) yet: each rank's vLLM "
                             "would need distributed_executor_backend='external_launcher', untested; use "
                             "rollout.backend: embedded there, or vllm in a plain jetrl run")
        if nproc is not None:
            if nproc <= 0:
                raise JetrlError(f"--nproc must be > 0, got {nproc}")
            if launched_by_torchrun():
                raise JetrlError("--nproc starts torchrun; this process already runs under torchrun (drop --nproc)")
            from .distributed.launch import launch

            args = [preset, "-o", str(out), *(["--resume"] if resume else []), *(["--force"] if force else []),
                    *[x for o in _overrides(override) for x in ("--set", o)]]
            code = launch(nproc, args)
            if code:
                raise typer.Exit(code)
            return
        if launched_by_torchrun():
            world = World.from_env(cfg.model.device)
            world.check_same(_run_identity(cfg, out, resume, force), _SAME_RUN)
        if not world.is_writer:
            run(cfg, out, resume=resume, world=world, replace=force)
            return
        display = RunDisplay(cfg, err_console)
        with display:
            lines = run(cfg, out, resume=resume, on_step=display.step, on_eval=display.eval_samples,
                        on_resume=display.resumed, world=world, replace=force)
        display.finish(lines, out)
    except JetrlError as e:
        if rank:  # under torchrun each rank prints its own error line: say which one
            e.args = (f"rank {rank}: {e}",)
        raise
    except RuntimeError as e:
        if not (world.distributed and is_collective_timeout(e)):
            raise
        raise CollectiveTimeout(f"{f'rank {rank}: ' if rank else ''}the other ranks did not answer a collective "
                                f"within {dist_timeout():g} s (JETRL_DIST_TIMEOUT): a rank is stuck or has died; the "
                                "last complete checkpoint is kept (--resume continues from it)") from None
    finally:
        world.close()


_SAME_RUN = ("every rank must start the same run: the same preset and --set values, model and data files (on "
             "several nodes: the same paths, on shared storage)")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _run_identity(cfg, out: Path, resume: bool, force: bool) -> dict:
    """What every rank of a torchrun run must agree on: the resolved preset key by key, the command's
    own options, the model directory's files and the data files (digests of their contents), jetrl's
    and torch's versions."""
    import torch

    from .distributed.world import dir_digests, file_digest
    from .rl.loop import resolve_model_dir

    what = {"the preset": cfg.name, **_flat(cfg.raw), "-o": os.path.abspath(out), "--resume": resume,
            "--force": force, "jetrl's version": __version__, "torch's version": torch.__version__,
            "JETRL_EXACT_REDUCTION": os.environ.get("JETRL_EXACT_REDUCTION")}
    what.update(dir_digests(resolve_model_dir(cfg.model.path), "model.path"))
    for key in ("file", "eval_file"):
        files = getattr(cfg.task, key)
        for i, f in enumerate([files] if isinstance(files, str) else files or []):
            if f and Path(f).is_file():
                what[f"task.{key}'s contents" + (f" [{i}]" if isinstance(files, list) else "")] = file_digest(Path(f))
    if cfg.task.reward and ":" in cfg.task.reward:
        from .tasks import reward_source_file

        src = reward_source_file(cfg.task.reward)
        if src is not None:
            what["task.reward's source file"] = file_digest(src)
    return what


@app.command("bench")
@user_errors
def bench_cmd(
    mode: Annotated[str, typer.Argument(help="gemm, quantize, attention, rollout, train, e2e or all.")] = "all",
    flows: Annotated[Optional[str], typer.Option("--flows", help="Comma-separated flows for rollout/train/e2e (default bf16,fp8-rollout,fp8-unified); NAME+invariant for a flow's batch-invariant mode, NAME+fp8kv for it with an FP8 KV cache; train rows: NAME+graphs for its decoder layers as CUDA graphs (train.cuda_graphs); e2e takes the plain names.")] = None,
    shapes: Annotated[Optional[str], typer.Option("--shapes", help="gemm: MxNxK,... ; quantize: MxK,... (default: Llama-3-8B and Qwen2.5-7B layers); attention: BATCHxWIDTH,... (sequences x key width).")] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    model: Annotated[str, typer.Option("--model", help="attention/rollout/train/e2e model: 'tiny', a local HF directory, or a shape with random weights: qwen2.5-1.5b, qwen2.5-7b, llama-3-8b (not e2e: it runs jetrl run).")] = "tiny",
    layers: Annotated[Optional[int], typer.Option("--layers", help="rollout/train: keep the first N decoder layers (7-8B layer shapes on one GPU).")] = None,
    batch: Annotated[int, typer.Option("--batch", help="rollout: sequences decoded together.")] = 64,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="rollout: new tokens per sequence (stop tokens off).")] = 64,
    train_batch: Annotated[int, typer.Option("--train-batch", help="train: sequences per update.")] = 16,
    micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", help="train: sequences per forward and backward, their gradients accumulated (default: the whole --train-batch).")] = None,
    seq: Annotated[int, typer.Option("--seq", help="train: tokens per sequence.")] = 64,
    steps: Annotated[int, typer.Option("--steps", help="e2e: run steps per flow (the first is a warm-up).")] = 3,
    task_preset: Annotated[Optional[str], typer.Option("--task-preset", help="rollout: also time an RL-shaped batch: this preset's task prompts, groups, stop at EOS ('none': skip). Default: fp8-unified with --model tiny, none with a model of yours.")] = None,
    task_set: Annotated[Optional[list[str]], typer.Option("--task-set", metavar="KEY=VALUE", help="rollout: override the task preset (e.g. rollout.prompts_per_step=64, rollout.n=8, rollout.max_new_tokens=1024).")] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed runs per measurement (median reported).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed runs first.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the results as JSON.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", help="Also write the results to this JSON file.")] = None,
    history: Annotated[Path, typer.Option("--history", help="JSONL file every run is appended to.")] = Path("runs/bench/history.jsonl"),
    no_history: Annotated[bool, typer.Option("--no-history", metavar="", help="Do not append to the history file.")] = False,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="rollout/train: run each row once more under torch.profiler and write its ops by self time (device time on a GPU) to DIR/ROW.txt.")] = None,
    no_fuse: Annotated[bool, typer.Option("--no-fuse", metavar="", help="On a GPU: run RMSNorm, SwiGLU and RoPE op by op (model.fuse: false), to measure what fusing them gives.")] = False,
    no_cuda_graphs: Annotated[bool, typer.Option("--no-cuda-graphs", metavar="", help="rollout: the embedded engines decode eagerly (rollout.cuda_graphs: false), to measure what graphs give or to rule them out.")] = False,
    warps: Annotated[Optional[str], typer.Option("--warps", help="quantize: time the 128x128-tile Triton quantizers at each of these warp counts, e.g. 8,16 (allowed 4, 8, 16, 32; default: as timed and chosen on this device).")] = None,
    no_transformers: Annotated[bool, typer.Option("--no-transformers", metavar="", help="rollout/train: skip the transformers baseline rows (on an H100, static-cache generate() in the same process as two or more embedded engines once ended in a CUDA illegal memory access; see docs/benchmarks.md).")] = False,
):
    """Throughput per flow next to BF16: GEMMs, quantizers, attention, rollout (vs generate()), training step, end to end."""
    from . import bench

    modes = bench.parse_modes(mode)
    for name, v in (("--batch", batch), ("--new-tokens", new_tokens), ("--train-batch", train_batch), ("--seq", seq),
                    ("--steps", steps), ("--repeats", repeats), ("--micro-batch", 1 if micro_batch is None else micro_batch)):
        if v <= 0:
            raise JetrlError(f"{name} must be > 0, got {v}")
    if warmup < 0:
        raise JetrlError(f"--warmup must be >= 0, got {warmup}")
    if seq < 2:
        raise JetrlError(f"--seq must be >= 2 (prompt and completion halves), got {seq}")
    bench.check_device(device)
    if out is not None:
        _check_output(out, "--out", "file")
    if not no_history:
        _check_output(history, "--history", "file")
    if profile is not None:  # written after every row has run: its path is checked before any
        _check_output(profile, "--profile", "directory")
    if layers is not None and layers <= 0:
        raise JetrlError(f"--layers must be > 0, got {layers}")
    s = bench.Settings(device=device, repeats=repeats, warmup=warmup, model=model, layers=layers, batch=batch,
                       new_tokens=new_tokens, train_batch=train_batch, micro_batch=micro_batch, seq=seq, e2e_steps=steps,
                       task_preset=_bench_task_preset(task_preset, model), task_overrides=list(task_set or []),
                       profile_dir=None if profile is None else str(profile), transformers=not no_transformers,
                       cuda_graphs=not no_cuda_graphs)
    if warps is not None:
        if "quantize" not in modes:
            raise JetrlError("--warps applies to the quantize mode")
        s.quant_warps = bench.parse_warps(warps)
        why = bench._triton_unavailable(device)
        if why is not None:  # only the Triton quantizers take a warp count
            raise JetrlError(f"--warps times the Triton quantizers, which do not run here: {why}")
    if profile is not None and not set(modes) & {"rollout", "train"}:
        raise JetrlError("--profile applies to the rollout and train modes")
    if no_fuse:
        from .precision import fuse

        fuse.set_enabled(False)
    if flows is not None:
        if not set(modes) & {"rollout", "train", "e2e"}:
            raise JetrlError("--flows applies to the rollout, train and e2e modes")
        s.flows = tuple(f.strip() for f in flows.split(",") if f.strip())
        if not s.flows:
            raise JetrlError("--flows: no flow given")
        for f in s.flows:  # unknown names fail before anything runs
            bench.check_flow(f, modes)
    why = bench.e2e_unsupported(model, s.flows, layers) if "e2e" in modes else None
    if why is not None:  # found before any mode runs: `all` leaves e2e out and says so, `e2e` is an error
        if modes != ["e2e"]:
            modes.remove("e2e")
            s.not_run["e2e"] = why
            err_console.print(Text(f"not run: e2e: {why}", style="yellow"))
        else:
            raise JetrlError(f"bench e2e: {why}")
    if task_set and ("rollout" not in modes or s.task_preset is None):
        raise JetrlError("--task-set applies to the rollout mode's task batch (--task-preset; with --model, "
                         "give --task-preset NAME)")
    if "rollout" in modes and s.task_preset is not None:
        from .config import load_job_config

        load_job_config(s.task_preset, list(s.task_overrides))  # a bad name, key or value fails before any row is timed
    shaped = set(modes) & {"gemm", "quantize", "attention"}
    if shapes and not shaped:
        raise JetrlError("--shapes applies to the gemm, quantize and attention modes")
    if shapes and len(shaped) > 1:
        raise JetrlError("--shapes: give one mode (gemm takes MxNxK, quantize MxK, attention BATCHxWIDTH)")
    s.gemm_shapes = ([(f"{m}x{n}x{k}", m, n, k) for m, n, k in bench.parse_shapes(shapes, 3)]
                     if shapes and "gemm" in modes else bench.default_gemm_shapes(device))
    s.quant_shapes = (bench.parse_shapes(shapes, 2) if shapes and "quantize" in modes
                      else [(8192, 8192)] if device == "cuda" else [(1024, 4096)])
    s.attention_shapes = (bench.parse_shapes(shapes, 2, "BATCHxWIDTH") if shapes and "attention" in modes
                          else list(bench.ATTENTION_SHAPES) if device == "cuda" else [(4, 256)])
    if not as_json:
        s.progress = lambda msg: err_console.print(Text(msg, style="dim"))
    s.partial_out = out  # rows land there as they finish; the whole result replaces them at the end
    res = bench.run_bench(modes, s)
    if not no_history:
        bench.append_history(res, history)
    if out is not None:
        bench.write_json(res, out)
    if as_json:
        print(json.dumps(res, indent=1))
    else:
        bench.render(res, console)


def _bench_task_preset(given: str | None, model: str) -> str | None:
    """The RL-shaped rollout batch is the tiny preset's arithmetic prompts: timed by default on the
    tiny policy (what docs/benchmarks.md reports), only on request on a user's model."""
    if given is None:
        return "fp8-unified" if model == "tiny" else None
    return None if given == "none" else given


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
