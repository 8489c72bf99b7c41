"""The package builds a wheel that installs and imports in a fresh virtual environment."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(tmp_path: Path) -> Path:
    # NOTE: built from a clean copy: an in-tree build reuses build/lib, which keeps modules deleted since (such as the
    # estimate.py the estimate package replaced) and would ship them.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("layerwise_hf-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_installs_and_imports(tmp_path):
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], capture_output=True, text=True
    )
    assert install.returncode == 0, install.stderr[-3000:]
    # Dependencies (torch, transformers, ...) come from this environment; the package itself only from the wheel.
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    probe = (
        f"import layerwise_hf; assert layerwise_hf.__file__.startswith({str(venv)!r}), layerwise_hf.__file__; "
        "from layerwise_hf import LayerwiseTrainer, list_layerwise_optimizers; "
        "assert 'adamw_8bit_layerwise' in list_layerwise_optimizers(); print('ok')"
    )
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    cli = subprocess.run([str(venv / "bin" / "layerwise-hf"), "--help"], capture_output=True, text=True, env=env)
    assert cli.returncode == 0 and "estimate-memory" in cli.stdout and "convert-checkpoint" in cli.stdout


@pytest.mark.slow
def test_wheel_ships_the_estimator_data(tmp_path):
    from layerwise_hf.estimate import list_presets

    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "layerwise_hf/estimate/optimizer_rules.txt" in names and "layerwise_hf/estimate.py" not in names
    assert {f"layerwise_hf/estimate/presets/{p}.json" for p in list_presets()} <= names
