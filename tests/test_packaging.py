"""The package ships kernels/ and presets/ inside jetrl_cli, never as generic top-level names."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_installed_package_maps_kernels_and_presets():
    import jetrl_cli.kernels
    import jetrl_cli.presets

    installed = {p.name for p in Path(jetrl_cli.presets.__file__).parent.glob("*.yaml")}
    assert installed == {p.name for p in (ROOT / "presets").glob("*.yaml")}
    assert Path(jetrl_cli.kernels.__file__).name == "__init__.py"


@pytest.mark.slow
def test_wheel_contains_kernels_and_presets(tmp_path):
    pytest.importorskip("build")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "-o", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("jetrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {p.name for p in (ROOT / "presets").glob("*.yaml")}
    assert {n.rsplit("/", 1)[-1] for n in names if n.startswith("jetrl_cli/presets/")} >= shipped
    assert "jetrl_cli/kernels/__init__.py" in names
    for f in ("model.safetensors", "config.json", "tokenizer.json"):  # the shipped tiny policy
        assert f"jetrl_cli/assets/tiny-policy/{f}" in names
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"jetrl_cli", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
