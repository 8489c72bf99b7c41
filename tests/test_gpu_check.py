"""The GPU check's CPU dry run: `benchmarks/gpu_check.py --tiny` runs every check's code path on CPU (tiny models, the
CPU GradScaler, memory not measured) and writes the JSON a GPU run would; and `gpu_check.sh` is valid bash that
refuses to start without CUDA. Nothing here needs or uses a GPU."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def env():
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }


def test_gpu_check_sh_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout not found")
@pytest.mark.slow
def test_gpu_check_sh_refuses_to_start_without_cuda():
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        env={**env(), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "torch.cuda.is_available() is False" in result.stderr


@pytest.mark.slow
def test_gpu_check_py_refuses_cuda_without_cuda(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--output", str(out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "torch.cuda.is_available() is False" in result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_gpu_check_tiny_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--output", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "all passed: True" in result.stdout
    report = json.loads(out.read_text())

    assert report["tiny"] is True and report["passed"] is True
    assert report["environment"]["device"] == "cpu"
    assert set(report["checks"]) == {"parity", "fp16", "memory"}
    for name, check in report["checks"].items():
        assert check["status"] == "PASS", (name, check)
        assert "error" not in check

    # Parity: every optimizer x GA, bit-identical on CPU, with the same logged norms, and clipping really applied.
    cases = report["checks"]["parity"]["cases"]
    assert {(c["optim"], c["ga"]) for c in cases} == {
        (o, ga) for o in ("adamw_torch", "adamw_8bit", "sgd") for ga in (1, 2)
    }
    for c in cases:
        assert c["passed"] and c["exact"], c
        assert c["max_abs_param_diff"] == 0.0 and c["grad_norm_max_abs_diff"] == 0.0
        assert c["grad_norm_layerwise"] == c["grad_norm_standard"]
        assert len(c["grad_norm_standard"]) == report["sizes"]["parity_steps"]
        assert c["clipped_steps"] > 0

    # fp16: the injected overflow step is skipped by both (non-finite norm, nothing moved, scale halved).
    fp16 = report["checks"]["fp16"]
    at = fp16["overflow_step"]
    assert [c["ga"] for c in fp16["cases"]] == [1, 2]
    for c in fp16["cases"]:
        assert c["passed"] and c["overflow_step_skipped"] and c["exact"] and c["scales_equal"], c
        assert c["max_abs_param_diff"] == 0.0
        for kind in ("standard", "layerwise"):
            run = c[kind]
            assert run["injected_step_nonfinite"] and run["params_changed_on_injected_step"] == []
            assert run["scales"][at] == run["scales"][at - 1] / 2
            assert isinstance(run["grad_norm"][at], str) and math.isnan(float(run["grad_norm"][at]))
        finite = sum(isinstance(n, float) for n in c["layerwise"]["grad_norm"])
        assert c["layerwise"]["inner_steps_taken"] == finite  # the skipped step never reached a layer's optimizer

    # Memory: both runs finished, not measured on CPU, the estimator's terms next to them.
    memory = report["checks"]["memory"]
    assert memory["measured"] is False
    by = {c["optim"]: c for c in memory["cases"]}
    assert set(by) == {"adamw_8bit", "adamw_8bit_layerwise"}
    for c in by.values():
        assert c["measured"] is False and "peak_allocated_bytes" not in c
        assert c["param_dtypes"] == ["torch.bfloat16"] and c["activation_checkpointing"] is True
        assert set(c["estimate"]) >= {"weight_bytes", "gradient_bytes", "optimizer_state_bytes"}
    std, lw = by["adamw_8bit"], by["adamw_8bit_layerwise"]
    assert lw["estimate"]["gradient_bytes"] < std["estimate"]["gradient_bytes"]
    assert lw["layerwise_peak_grad_bytes"] == lw["estimate"]["gradient_bytes"]  # held lm_head + largest, as predicted
    assert lw["optimizer_state_bytes_measured"] == lw["estimate"]["optimizer_state_bytes"]
    assert std["optimizer_state_bytes_measured"] == std["estimate"]["optimizer_state_bytes"]
    assert memory["grad_norm_max_abs_diff"] == 0.0
