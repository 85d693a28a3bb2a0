"""Rich renderings of result objects (the same objects ``--json`` prints)."""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .precision.flow import PrecisionFlow
from .quantize_ckpt import QuantizeResult
from .tables import print_table


def _mib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.0f} {unit}" if unit == "KiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"


def flow_table(flow: PrecisionFlow) -> Table:
    kind = "[green]on-policy[/]" if flow.is_on_policy else "[yellow]off-policy[/]"
    t = Table(title=f"precision flow {escape(flow.name)}  {kind}", title_justify="left")
    for col in ("side", "GEMM", "operand a", "operand b", "out", "backend"):
        t.add_column(col)
    r = flow.rollout.linear
    t.add_row("rollout", "forward", f"input {r.a.short_str()}", f"weight {r.b.short_str()}", r.out.short, r.backend)
    lin = flow.train.linear
    names = {"fprop": ("input", "weight"), "dgrad": ("grad_output", "weight"), "wgrad": ("grad_output", "input")}
    for g in ("fprop", "dgrad", "wgrad"):
        s = getattr(lin, g)
        a, b = names[g]
        t.add_row("train", g, f"{a} {s.a.short_str()}", f"{b} {s.b.short_str()}", s.out.short, s.backend)
    t.caption = escape(
        f"KV cache {flow.rollout.kv_cache.short_str()} · master weights {flow.train.master_weights.short} · "
        f"saved activations {'fp8' if lin.save_fp8_activations else 'high precision'} · "
        f"weight sync {flow.weight_sync.payload} · kept in high precision: {', '.join(flow.skip)}"
    )
    return t


def quantize_table(result: QuantizeResult) -> tuple[Table, Text]:
    """The per-layer table and the summary lines under it."""
    fmt = result.layers[0].format if result.layers else ""
    t = Table(title=escape(f"{result.source} -> {result.output}\nformat {result.format}: weights {fmt}"),
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, just in (("layer", "left"), ("shape", "left"), ("rel err", "right"), ("SQNR dB", "right"),
                      ("before", "right"), ("after", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for row in result.layers:
        t.add_row(row.name.removeprefix("model."), "x".join(map(str, row.shape)), f"{row.rel_err:.2e}",
                  f"{row.sqnr_db:.1f}", _mib(row.bytes_before), _mib(row.bytes_after))
    n = len(result.layers)
    worst = max(result.layers, key=lambda r: r.rel_err)
    kept = ", ".join(result.ignored) if result.ignored else "none"
    summary = Text(
        f"total: {n} layers quantized · worst rel err {worst.rel_err:.2e} ({worst.name.removeprefix('model.')}) · "
        f"min SQNR {min(r.sqnr_db for r in result.layers):.1f} dB\n"
        f"size: quantized linear layers {_mib(result.bytes_before)} -> {_mib(result.bytes_after)} · "
        f"checkpoint files {_mib(result.file_bytes_before)} -> {_mib(result.file_bytes_after)}\n"
        f"kept in high precision: {kept} (linear layers on the skip list), embeddings, norms"
    )
    return t, summary


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def summary_table(title: str, values: dict) -> Table:
    t = Table(title=escape(title), title_justify="left", box=box.SIMPLE, show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    for k, v in values.items():
        t.add_row(k, _fmt(v))
    return t


def print_flow(console, flow: PrecisionFlow) -> None:
    print_table(console, flow_table(flow), keep=2)


def print_quantize(console, result: QuantizeResult) -> None:
    t, summary = quantize_table(result)
    print_table(console, t)
    console.print(summary)


def print_summary(console, title: str, values: dict) -> None:
    print_table(console, summary_table(title, values))
