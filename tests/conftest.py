"""Test set-up: Triton kernels run in Triton's interpreter on machines without a GPU; every test
starts from seeded random generators, so a failure reproduces when the test is run again. Shared
helpers: ``triton_runs`` and the ``forced_native`` fixture (the GPU code path on CPU tensors)."""

import importlib
import os
import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated: set before any import
    try:  # Triton's own library (tl.max, tl.clamp, ...) is decorated when triton is imported: do it now,
        importlib.import_module("triton.language")  # so a test that unsets the variable cannot be the first
    except ImportError:
        pass
from .triton_interp_fix import install_row_independent_dot  # noqa: E402

install_row_independent_dot()  # a tile's rows multiplied apart, as on a GPU (the batch-invariant tests)

# Property tests draw the same examples on every run (a failure is not a one-off) and print the
# failing example; a seed per test keeps their coverage different from each other.
settings.register_profile("jetrl", derandomize=True, print_blob=True)
settings.load_profile("jetrl")


def pytest_runtest_logreport(report):
    """With ``JETRL_TEST_FAILURES=FILE``, each failure's report is appended to FILE as the test ends
    (the controller's copy under xdist), so a run cut off at a time limit (``.ci/gpu``) keeps the
    reasons that pytest would print only in its closing summary."""
    path = os.environ.get("JETRL_TEST_FAILURES")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def seeded_generators(request):
    """torch's, numpy's and Python's global generators seeded from the test's id: a test that draws
    from them (``torch.randn(...)`` with no generator) draws the same numbers on every run."""
    seed = zlib.crc32(request.node.nodeid.encode()) % 2**31
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    yield


def triton_runs(*also: str) -> bool:
    """Whether Triton kernels can run here (a GPU, or the interpreter) and the modules ``also`` import."""
    try:
        for name in ("triton", *also):
            importlib.import_module(name)
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def forced_native():
    """The native (GPU) code path -- bf16 tensors, real low-precision GEMMs -- forced on CPU tensors."""
    from jetrl_cli.precision import gemm

    gemm.set_force_native(True)
    gemm.reset_resolutions()
    yield
    gemm.set_force_native(False)
    gemm.reset_resolutions()
