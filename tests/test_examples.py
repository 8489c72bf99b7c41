"""The examples run as a user would launch them (small settings)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def _env():
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def test_main_job_smoke_config(tmp_path):
    result = run("examples/train.py", "configs/train/smoke.yaml", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "adamw_8bit_layerwise" in out
    assert "grad_norm" in out and "learning_rate" in out
    assert "layerwise" in out.lower() and "MiB" in out


def test_cli_sgd_layerwise(tmp_path):
    result = run(
        "examples/train.py",
        "--optim",
        "sgd_layerwise",
        "--max_steps",
        "3",
        "--hidden_size",
        "64",
        "--num_hidden_layers",
        "1",
        "--intermediate_size",
        "128",
        "--num_samples",
        "16",
        "--output_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sgd_layerwise" in result.stdout


def test_cli_bad_optimizer_name_lists_valid_ones(tmp_path):
    result = run("examples/train.py", "--optim", "adamw_9bit_layerwise", "--output_dir", str(tmp_path))
    assert result.returncode != 0
    assert "adamw_9bit_layerwise" in result.stderr
    for valid in ("adamw_8bit_layerwise", "sgd_layerwise", "adafactor_layerwise"):
        assert valid in result.stderr
    assert "Traceback" not in result.stderr


def test_accelerate_loop_single_process(tmp_path):
    result = run("examples/accelerate_loop.py", "--output_dir", str(tmp_path), "--max_steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gradients via local" in result.stdout and "step   3" in result.stdout
    assert (tmp_path / "final" / "model.safetensors").is_file()
