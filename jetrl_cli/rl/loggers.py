"""Where a run's per-step numbers go, chosen by ``run.loggers``.

- ``jsonl`` (always on): one JSON object per step in ``OUT/metrics.jsonl``. It is the run's record:
  ``--resume``, the live display, ``curves.png`` and ``docs/preset_table.py`` read it, so a list
  without it is refused.
- ``tensorboard``: the same scalars (every number of the ``metrics.jsonl`` line, under the same
  name, at the line's ``step``) as TensorBoard event files in ``OUT/tensorboard/``, written with
  ``torch.utils.tensorboard.SummaryWriter`` on top of the ``tensorboard`` package (the optional
  extra ``jetrl[tensorboard]``). Each step is flushed, so a killed run loses no event; a resumed run
  starts its writer with ``purge_step`` at its first step, and TensorBoard hides the events the
  killed run wrote past its checkpoint, as ``--resume`` truncates ``metrics.jsonl``.

- ``wandb``: the same scalars to Weights & Biases (the optional extra ``jetrl[wandb]``), in project
  ``run.wandb_project``, the run named after its output directory, the preset as its config and
  ``OUT/wandb/`` for wandb's files. Online or offline as wandb's own settings say (``wandb login``,
  ``WANDB_MODE=offline``). Each start of a run process is one wandb run, grouped by the output
  directory: a ``--resume`` starts the next one in the group at its first step (as verl's
  trainer does), and the steps a killed run logged past its checkpoint stay in the killed one's.

``open_loggers`` checks the optional packages at once, before the run loads anything, so a missing
one stops the run with the ``pip install`` that fixes it.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..config import LOGGERS  # noqa: F401  (the names run.loggers accepts)
from ..errors import JetrlError

TENSORBOARD_DIR = "tensorboard"


def _summary_writer_class():
    try:
        import tensorboard  # noqa: F401  (torch's writer needs it; checked first, by name)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise JetrlError("run.loggers: tensorboard needs the tensorboard package: "
                         "pip install 'jetrl[tensorboard]'") from None
    return SummaryWriter


def scalars(m: dict) -> dict[str, float]:
    """The numbers of a metrics line, ``step`` excepted (flags, strings, None and NaN left out)."""
    return {k: float(v) for k, v in m.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)}


class TensorBoardLogger:
    def __init__(self, writer_class, log_dir: Path, first_step: int):
        # purge_step: events at or after the first step of a resumed run are hidden by TensorBoard
        self.writer = writer_class(log_dir=str(log_dir), purge_step=first_step if first_step > 1 else None)

    def log(self, m: dict) -> None:
        for k, v in scalars(m).items():
            self.writer.add_scalar(k, v, global_step=m["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _wandb_module():
    try:
        import wandb
    except ImportError:
        raise JetrlError("run.loggers: wandb needs the wandb package: pip install 'jetrl[wandb]'") from None
    return wandb


class WandbLogger:
    def __init__(self, wandb, out: Path, first_step: int, project: str, config: dict):
        name = out.resolve().name
        self.run = wandb.init(project=project, name=name if first_step <= 1 else f"{name}-from-step-{first_step}",
                              group=name, dir=str(out), config=config, job_type="train")

    def log(self, m: dict) -> None:
        self.run.log(scalars(m), step=m["step"])

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """The extra loggers of one run (``metrics.jsonl`` itself is written by the loop)."""

    def __init__(self, names: list[str], wandb_project: str = "jetrl"):
        self.names = list(names)
        self.wandb_project = wandb_project
        self._tb_class = _summary_writer_class() if "tensorboard" in self.names else None
        self._wandb = _wandb_module() if "wandb" in self.names else None
        self.active: list = []

    def start(self, out: Path, first_step: int, config: dict | None = None) -> None:
        if self._tb_class is not None:
            self.active.append(TensorBoardLogger(self._tb_class, out / TENSORBOARD_DIR, first_step))
        if self._wandb is not None:
            self.active.append(WandbLogger(self._wandb, out, first_step, self.wandb_project, config or {}))

    def log(self, m: dict) -> None:
        for lg in self.active:
            lg.log(m)

    def close(self) -> None:
        for lg in self.active:
            lg.close()
        self.active = []


def open_loggers(names: list[str], wandb_project: str = "jetrl") -> Loggers:
    """``run.loggers`` -> the run's loggers; a missing optional package is a one-line error now."""
    return Loggers(names, wandb_project)
