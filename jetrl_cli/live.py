"""The live display of ``jetrl run``: a progress bar with the latest step's numbers on a terminal,
one plain line per step otherwise (CI logs), and a summary table at the end."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from .tables import print_table


def _f(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def step_line(m: dict, eval_n: int = 1) -> str:
    passed = f"pass@{eval_n} {_f(m['eval_pass_at_n'])}" if "eval_pass_at_n" in m else ""
    if m["step"] == 0:
        return f"step 0  eval acc {_f(m.get('eval_accuracy'))}" + (f"  {passed}" if passed else "")
    parts = [
        f"step {m['step']}",
        f"reward {_f(m.get('reward_mean'))}",
        f"acc {_f(m.get('accuracy'))}",
        f"entropy {_f(m.get('entropy'))}",
        f"mismatch_kl {_f(m.get('mismatch_kl'), '.2e')}",
        f"rollout {_f(m.get('rollout_s'), '.1f')}s train {_f(m.get('train_s'), '.1f')}s sync {_f(m.get('sync_s'), '.2f')}s",
    ]
    if "eval_accuracy" in m:
        parts.insert(3, f"eval {_f(m['eval_accuracy'])}" + (f" {passed}" if passed else ""))
    return "  ".join(parts)


def backend_lines(report: dict | None) -> list[str]:
    """One line per FP8 GEMM spec: the backend it runs on and why, then any call-time fallbacks."""
    if not report:
        return []
    out = []
    for r in report.get("resolved", []):
        why = ""
        if r["asked"] == "auto":
            by_reason: dict[str, list[str]] = {}
            for name, reason in r.get("rejected", {}).items():
                by_reason.setdefault(reason, []).append(name)
            why = " (auto" + "".join(f"; not {', '.join(n)}: {reason}" for reason, n in by_reason.items()) + ")"
        tiers = "".join(f"; up to {t['rows_upto']} rows: {t['backend']}" for t in r.get("by_rows", []))
        out.append(f"gemm {r['gemm']} {r['spec']} on {r['device']}: {r['backend']}{tiers}{why}")
    for f in report.get("fallbacks", []):
        out.append(f"gemm fallback {f['gemm']} {f['spec']}: {f['from']} -> {f['to']} ({f['why']}; {f['calls']} calls)")
    fused = report.get("fused")
    if fused:
        if "fused" in fused:
            limited = fused.get("eager_variants")
            out.append(f"fused (torch.compile): {', '.join(fused['fused'])}"
                       + (f"; some calls eager past the recompile limit: {', '.join(limited)}" if limited else ""))
        elif "disabled" in fused:
            out.append(f"fusion off, eager: {fused['disabled']}")
        if fused.get("exact"):
            out.append(f"batch-invariant forward, one kernel op by op: {', '.join(fused['exact'])}")
    for k in report.get("kernels", []):
        out.append(f"{k['op']} on {k['device']}: {k['kernel']}" + (f" ({k['why']})" if k.get("why") else ""))
    return out


class RunDisplay:
    def __init__(self, cfg, console: Console):
        self.cfg, self.console = cfg, console
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn(f"[bold]{escape(cfg.name)}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), console=console, disable=not self.live,
        )
        self.task = None
        self.checked_answers = False

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task("", total=self.cfg.train.steps, info="starting")
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def note(self, msg: str, style: str = "yellow") -> None:
        self.console.print(Text(msg, style=style), soft_wrap=True)

    def resumed(self, step: int, checkpoint: Path) -> None:
        if step > self.cfg.train.steps:
            self.note(f"the run is complete (checkpoint {checkpoint}, train.steps {self.cfg.train.steps}): nothing "
                      "to do; --set train.steps=N trains it on to step N", style="bold")
        else:
            self.note(f"resuming from step {step} (checkpoint {checkpoint})", style="bold")

    def step(self, m: dict) -> None:
        for text in backend_lines(m.get("gemm_backends")):
            self.console.print(text, highlight=False, markup=False)
        if m["step"] >= 1 and not self.checked_answers:
            self.checked_answers = True
            if m.get("answer_found") == 0:
                from .tasks import ANSWER_FORMATS, answer_format_of

                self.note(f"warning: no completion of step {m['step']} had an answer that task.answer_format "
                          f"{answer_format_of(self.cfg.task)!r} can read, so none can be scored correct; make the "
                          "prompt ask for that form, or set task.answer_format "
                          f"({', '.join(ANSWER_FORMATS)})")
        line = step_line(m, self.cfg.eval.n)
        if self.live:
            self.progress.update(self.task, completed=m["step"], info=escape(line.split("  ", 1)[-1]))
        else:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def eval_samples(self, samples: list[dict]) -> None:
        k = self.cfg.run.log_samples
        for s in samples[:k]:
            mark = "[green]✓[/]" if s["correct"] else "[red]✗[/]"
            self.console.print(f"  {mark} {escape(s['prompt'])}[dim]{escape(s['completion'][:120])}[/]", soft_wrap=True)

    def finish(self, lines: list[dict], out: Path) -> None:
        from rich.table import Table

        steps = [m for m in lines if m["step"] > 0 and m.get("reward_mean") is not None]
        evals = [m for m in lines if "eval_accuracy" in m]
        m = self.cfg.model
        lora = f" lora=r{m.lora_rank}/alpha{m.lora_alpha:g}" if m.lora_rank else ""
        t = Table(title=escape(f"{self.cfg.name}: {self.cfg.flow.short_str()}{lora}"), title_justify="left")
        for c in ("", "first", "last"):
            t.add_column(c, justify="right" if c else "left")
        if steps:
            t.add_row("train reward", _f(steps[0]["reward_mean"]), _f(steps[-1]["reward_mean"]))
            ents = [m["entropy"] for m in steps if m.get("entropy") is not None]
            if ents:
                t.add_row("policy entropy", _f(ents[0]), _f(ents[-1]))
            kls = [m["mismatch_kl"] for m in steps if m.get("mismatch_kl") is not None]
            if kls:
                t.add_row("mismatch KL", _f(kls[0], ".2e"), _f(kls[-1], ".2e"))
        if evals:
            t.add_row("eval accuracy", _f(evals[0]["eval_accuracy"]), _f(evals[-1]["eval_accuracy"]))
            if "eval_pass_at_n" in evals[-1]:
                t.add_row(f"eval pass@{self.cfg.eval.n}", _f(evals[0].get("eval_pass_at_n")),
                          _f(evals[-1]["eval_pass_at_n"]))
        if steps:  # step_s excludes the evals, which eval_s times (step 0's too)
            tot = sum(m.get("step_s", 0) for m in steps) + sum(m.get("eval_s", 0) for m in lines)
            split = {k: sum(m.get(k, 0) for m in (lines if k == "eval_s" else steps)) / max(tot, 1e-9)
                     for k in ("rollout_s", "score_s", "train_s", "sync_s", "eval_s")}
            t.add_row("time", "", f"{tot:.0f}s (" + ", ".join(f"{k[:-2]} {v:.0%}" for k, v in split.items()) + ")")
        print_table(self.console, t)
        png = out / "curves.png"
        self.console.print(f"metrics: {out / 'metrics.jsonl'}" + (f"\ncurves:  {png}" if png.exists() else
                           "\ncurves:  (pip install 'jetrl[plot]' for curves.png)"), markup=False, highlight=False)
