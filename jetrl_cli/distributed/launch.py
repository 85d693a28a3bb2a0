"""``jetrl run PRESET --nproc N``: run N copies of ``jetrl run PRESET`` under torch's elastic agent.

The same as typing ``torchrun --standalone --nproc-per-node N -m jetrl_cli run PRESET ...`` (one
node, a local rendezvous on a free port, no restarts: a failed rank stops the run, and ``--resume``
continues it), started through torch's launcher API so that a failure ends in the ranks' own error
lines and an exit code rather than torchrun's traceback. On CPU each process gets ``cores // N``
threads (``OMP_NUM_THREADS``) unless the variable is set; torchrun would give each one thread.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid


def torchrun_command(nproc: int, run_args: list[str]) -> list[str]:
    """The equivalent torchrun command line (what tests and users type)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "jetrl_cli", "run", *run_args]


def launch(nproc: int, run_args: list[str]) -> int:
    """Start the ranks, wait for them; 0, or the failed rank's exit code (128 + signal if killed)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # ranks print their own errors
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "jetrl_cli", "run", *run_args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            print(f"error: rank {rank} was killed by signal {-failure.exitcode}; the last complete checkpoint "
                  "is kept (--resume continues from it)", file=sys.stderr)
            return 128 - failure.exitcode
        return failure.exitcode or 1
    except SignalException as e:  # SIGTERM/SIGHUP to this launcher (timeout, scancel, docker stop): ranks stopped
        print(f"error: jetrl run --nproc got signal {int(e.sigval)}; its ranks were stopped, the last complete "
              "checkpoint is kept (--resume continues from it)", file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 130
    return 0
