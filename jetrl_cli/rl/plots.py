"""Learning curves as PNG (matplotlib, the ``plot`` extra): reward, eval accuracy, mismatch KL."""

from __future__ import annotations

from pathlib import Path


def plot_curves(runs: list[tuple[str, list[dict]]], path: Path, title: str = "") -> Path:
    """One figure, three panels; ``runs``: (label, metrics lines) per run, drawn side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("reward_mean", "train reward (mean)"), ("eval_accuracy", "eval accuracy (greedy)"),
              ("mismatch_kl", "mismatch KL(rollout || trainer)"))
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
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def summary_rows(runs: list[tuple[str, list[dict]]]) -> list[dict]:
    """First/last numbers of each run, for the README table."""
    rows = []
    for name, lines in runs:
        steps = [m for m in lines if m["step"] > 0 and m.get("reward_mean") is not None]
        evals = [m for m in lines if m.get("eval_accuracy") is not None]
        kls = [m["mismatch_kl"] for m in steps if m.get("mismatch_kl") is not None]
        k = min(5, len(steps))
        rows.append({
            "run": name, "steps": len(steps),
            "reward_first5": sum(m["reward_mean"] for m in steps[:k]) / max(k, 1),
            "reward_last5": sum(m["reward_mean"] for m in steps[-k:]) / max(k, 1),
            "eval_first": evals[0]["eval_accuracy"] if evals else None,
            "eval_last": evals[-1]["eval_accuracy"] if evals else None,
            "mismatch_kl_mean": sum(kls) / len(kls) if kls else None,
            "seconds": sum(m.get("step_s", 0) for m in steps),
        })
    return rows


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Plot several jetrl runs side by side; print a Markdown table.")
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="PNG to write")
    args = ap.parse_args()
    runs = [(d.name, [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()])
            for d in args.runs]
    plot_curves(runs, args.output)
    print("| preset | train reward, first 5 steps | last 5 steps | eval acc, start | end | mismatch KL (mean) | time |")
    print("|---|---|---|---|---|---|---|")
    for r in summary_rows(runs):
        kl = "0 (bitwise equal)" if r["mismatch_kl_mean"] == 0 else f"{r['mismatch_kl_mean']:.2e}"
        print(f"| `{r['run']}` | {r['reward_first5']:.3f} | {r['reward_last5']:.3f} | {r['eval_first']:.3f} | "
              f"{r['eval_last']:.3f} | {kl} | {r['seconds']:.0f} s |")
