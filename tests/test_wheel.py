"""The package builds a wheel that installs and imports in a fresh virtual environment."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_imports(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("layerwise_hf-*.whl")
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
