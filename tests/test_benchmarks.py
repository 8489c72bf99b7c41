"""The benchmark scripts run end to end with their smallest settings (no timing or memory thresholds here)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


# One engine per test: each launches two 2-rank process groups, which is most of the time on 2 cores.
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_distributed_memory_small(tmp_path, engine):
    result = run_script(
        "distributed_memory.py", "--small", "--steps", "2", "--engines", engine, "--output_dir", str(tmp_path)
    )
    report = json.loads((tmp_path / "distributed_memory.json").read_text())
    assert (tmp_path / "distributed_memory.png").stat().st_size > 0
    assert {"model", "environment", "runs", "fsdp2_checks", "fsdp2_goal_pass", "wall_time_s"} <= report.keys()
    runs = report["runs"]
    assert {(r["optim"], r["rank"]) for r in runs} == {
        (o, k) for o in ("adamw_torch", "adamw_torch_layerwise") for k in (0, 1)
    }
    for r in runs:
        assert r["engine"] == engine and r["world_size"] == 2
        assert r["peak_rss_bytes"] > 0 and r["grad_tensor_peak_bytes"] > 0 and r["optimizer_state_bytes"] > 0
        assert len(r["step_peak_rss_bytes"]) == 2 and len(r["step_grad_peaks_bytes"]) == 2
    layerwise = [r for r in runs if r["optim"] == "adamw_torch_layerwise"]
    assert {r["route"] for r in layerwise} == {engine}
    if engine == "fsdp2":
        assert len(report["fsdp2_checks"]) == 2 and report["fsdp2_goal_pass"] in (True, False)
        assert "PASS" in result.stdout or "FAIL" in result.stdout
    else:
        assert all(r["ddp_bucket_bytes"] > 0 for r in runs)


def test_clipping_speed_small(tmp_path):
    run_script(
        "clipping_speed.py",
        "--small",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--accuracy_steps",
        "3",
        "--output_dir",
        str(tmp_path),
    )
    report = json.loads((tmp_path / "clipping_speed.json").read_text())
    assert (tmp_path / "clipping_speed.png").stat().st_size > 0
    assert {"config", "timing", "goals", "all_goals_pass", "accuracy", "wall_time_s"} <= report.keys()
    expected = {f"{mode} ga{ga}" for mode in ("none", "exact", "previous", "per_param", "off") for ga in (1, 4)}
    assert set(report["timing"]) == expected
    for entry in report["timing"].values():
        assert len(entry["times_s"]) == 2 and entry["ratio"] > 0
    # Exact clipping without accumulation measures the norm with a second backward over the same forward.
    assert report["timing"]["exact ga1"]["forwards_per_step"] == 1
    assert report["timing"]["exact ga4"]["forwards_per_step"] == 4
    modes = report["accuracy"]["modes"]
    assert set(modes) == {"exact", "previous", "per_param", "none"}
    assert modes["exact"]["max_rel_param_diff_vs_exact"] == 0.0
    assert all(len(m["losses"]) == 3 for m in modes.values())


def test_fp16_speed_small(tmp_path):
    run_script("fp16_speed.py", "--small", "--warmup", "1", "--rounds", "2", "--output_dir", str(tmp_path))
    report = json.loads((tmp_path / "fp16_speed.json").read_text())
    assert (tmp_path / "fp16_speed.png").stat().st_size > 0
    assert {"config", "timing", "wall_time_s"} <= report.keys()
    timing = report["timing"]
    assert set(timing) == {f"{kind} ga{ga}" for kind in ("standard", "layerwise") for ga in (1, 4)}
    for entry in timing.values():
        assert len(entry["times_s"]) == 2 and math.isfinite(entry["median_s"]) and entry["median_s"] > 0
        assert math.isfinite(entry["ratio"]) and entry["steps"] == 3 and 0 <= entry["skipped_steps"] <= 3
    # Without accumulation the inf check runs a second backward over the same forward.
    layerwise = timing["layerwise ga1"]
    assert layerwise["forwards_per_step"] == 1
    assert 0 < layerwise["peak_grad_bytes"] < layerwise["full_grad_bytes"]
    assert layerwise["full_grad_bytes"] == timing["standard ga1"]["full_grad_bytes"]
    assert timing["layerwise ga4"]["forwards_per_step"] == 4
