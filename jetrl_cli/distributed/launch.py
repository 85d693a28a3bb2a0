"""``jetrl run PRESET --nproc N``: start ``torchrun`` with N copies of ``jetrl run PRESET`` and wait.

The same as typing ``torchrun --standalone --nproc-per-node N -m jetrl_cli run PRESET ...``: one
node, a local rendezvous, one process per GPU (or N gloo processes on CPU). On CPU each process
gets ``cores // N`` threads (``OMP_NUM_THREADS``) unless the variable is already set; torchrun
would otherwise give each one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_command(nproc: int, run_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "jetrl_cli", "run", *run_args]


def launch(nproc: int, run_args: list[str]) -> int:
    """Run torchrun in the foreground; its exit code (non-zero if any rank failed)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        return subprocess.call(torchrun_command(nproc, run_args), env=env)
    except KeyboardInterrupt:
        return 130
