"""The ``jetrl`` command line. Start-up imports only typer and rich; torch loads inside commands."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from . import __version__
from .errors import JetrlError

app = typer.Typer(
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

QUANT_FORMATS = ("fp8-block", "fp8-tensor", "fp8-channel", "int8-channel")


def user_errors(fn):
    """A JetrlError becomes one red line on stderr and exit code 2; anything else is a bug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JetrlError as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]: nothing was written")
            raise typer.Exit(130) from None

    return wrapper


def _version(value: bool):
    if value:
        console.print(f"jetrl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
):
    """Reinforcement learning of language models in low precision, on-policy."""


@app.command("flow")
@user_errors
def flow_cmd(
    preset: Annotated[str, typer.Argument(help="Preset file, or the name of a shipped preset or flow.")],
    override: Annotated[
        Optional[list[str]], typer.Option("--set", help="Override a preset value: key.sub=value (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the flow as JSON.")] = False,
):
    """Check a preset's precision flow and show which format every GEMM, the KV cache and the sync use."""
    from .precision.flow import NAMED_FLOWS, named_flow
    from .presets_io import load_preset, resolve_preset_path

    try:
        resolve_preset_path(preset)
        flow = load_preset(preset, override or []).flow
    except JetrlError:
        if preset in NAMED_FLOWS and not override:
            flow = named_flow(preset)
        else:
            raise
    if as_json:
        print(json.dumps({"name": flow.name, "on_policy": flow.is_on_policy, "short": flow.short_str(),
                          **flow.to_dict()}, indent=2))
        return
    from .report import flow_table

    console.print(flow_table(flow))


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
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the per-layer results as JSON.")] = False,
):
    """Quantize a checkpoint into a format vLLM loads, with jetrl's own quantizers; print per-layer errors."""
    from .precision.flow import DEFAULT_SKIP

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
        TextColumn("quantizing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
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
    from .report import quantize_table

    console.print(quantize_table(result))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
