"""Learning curves as PNG (matplotlib, the ``plot`` extra): reward, eval accuracy, mismatch KL, entropy."""

from __future__ import annotations

from pathlib import Path


def curves_figure(runs: list[tuple[str, list[dict]]], title: str = ""):
    """One figure, four panels; ``runs``: (label, metrics lines) per run, drawn side by side. The
    mismatch-KL axis is symlog (0 and 1e-3 on one axis) starting at 0: KL is never negative."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    panels = (("reward_mean", "train reward (mean)"), ("eval_accuracy", "eval accuracy"),
              ("mismatch_kl", "mismatch KL(rollout || trainer)"), ("entropy", "policy entropy (nats per token)"))
    for ax, (key, label) in zip(axes, panels):
        for name, lines in runs:
            pts = [(m["step"], m[key]) for m in lines if m.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if key == "eval_accuracy" else None, markersize=3, label=name)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "mismatch_kl":
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.set_ylim(bottom=0)
    if axes[0].get_legend_handles_labels()[1]:  # no legend without a curve (train.steps=0: nothing to plot)
        axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_curves(runs: list[tuple[str, list[dict]]], path: Path, title: str = "") -> Path:
    """``curves_figure`` written to ``path`` (PNG, atomically)."""
    fig = curves_figure(runs, title)
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Plot several jetrl runs side by side (the README's table of "
                                             "the same runs: docs/preset_table.py).")
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="PNG to write")
    args = ap.parse_args()
    missing = [d for d in args.runs if not (d / "metrics.jsonl").is_file()]
    if missing:
        ap.error(f"{missing[0]}: no metrics.jsonl (not a jetrl run directory)")
    runs = [(d.name, [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()])
            for d in args.runs]
    plot_curves(runs, args.output)
