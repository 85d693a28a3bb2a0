"""Test set-up: Triton kernels run in Triton's interpreter on machines without a GPU. Random inputs
are drawn fresh in every session, and reproducibly: one seed a session (``JETRL_TEST_SEED``, printed
in the header and beside each failure; set it to draw the same inputs again) and the test's id seed
the global generators, ``fresh_seed()`` and Hypothesis. Shared helpers: ``triton_runs``,
``fresh_seed`` and the ``forced_native`` fixture (the GPU code path on CPU tensors)."""

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

# Property tests draw other examples in each session (Hypothesis seeded with the session's seed, below)
# and print a failing one.
settings.register_profile("jetrl", derandomize=False, print_blob=True)
settings.load_profile("jetrl")

SEED_ENV = "JETRL_TEST_SEED"


def session_seed() -> int:
    return int(os.environ[SEED_ENV])


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """The session's seed: ``JETRL_TEST_SEED`` if set, else a fresh one, put in the environment here
    so that xdist's workers (started after this hook) draw with the same one; Hypothesis takes it too
    (its ``--hypothesis-seed``, read in its own ``pytest_configure``, after this one)."""
    value = os.environ.get(SEED_ENV) or str(random.SystemRandom().randrange(2**31))
    try:
        seed = int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV} must be an integer, got {value!r}") from None
    os.environ[SEED_ENV] = str(seed)
    if getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(seed)


def pytest_report_header(config):
    return f"random inputs: {SEED_ENV}={session_seed()} (set it to draw the same inputs again)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("random inputs", f"drawn with {SEED_ENV}={session_seed()}"))


def pytest_runtest_logreport(report):
    """With ``JETRL_TEST_FAILURES=FILE``, each failure's report is appended to FILE as the test ends
    (the controller's copy under xdist), so a run cut off at a time limit (``.ci/gpu``) keeps the
    reasons that pytest would print only in its closing summary."""
    path = os.environ.get("JETRL_TEST_FAILURES")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when}, {SEED_ENV}={session_seed()})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def seeded_generators(request):
    """torch's, numpy's and Python's global generators seeded from the session's seed and the test's
    id: a test that draws from them (``torch.randn(...)`` with no generator, ``fresh_seed()``) draws
    other numbers in each session, the same again under the same ``JETRL_TEST_SEED``, whatever ran
    before it."""
    seed = zlib.crc32(f"{session_seed()}:{request.node.nodeid}".encode()) % 2**31
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    yield


def fresh_seed() -> int:
    """A seed for a test's own generator, drawn from the global one (``seeded_generators``): fresh in
    each session, reproduced by ``JETRL_TEST_SEED``."""
    return int(torch.randint(0, 2**31 - 1, ()))


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
