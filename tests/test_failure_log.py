"""The ``JETRL_TEST_FAILURES`` hook of ``tests/conftest.py``: a failure's report is written as the
test ends, so a run cut off at its time limit (``.ci/gpu``) still says why its failures failed."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_each_failure_is_appended_to_the_named_file_as_it_ends(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_ok():\n    pass\n\n\n"
                                          "def test_bad():\n    assert 1 + 1 == 3, 'named reason'\n")
    log = tmp_path / "failures.txt"
    env = {**os.environ, "JETRL_TEST_FAILURES": str(log)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run in an xdist worker
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "-p", "no:xdist", str(tmp_path / "test_two.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr  # one failed
    text = log.read_text()
    seed = os.environ.get("JETRL_TEST_SEED")  # this session's, inherited by the subprocess
    assert text.count("=== ") == 1 and f"test_two.py::test_bad (call, JETRL_TEST_SEED={seed})" in text
    assert "named reason" in text
    assert "test_ok" not in text
