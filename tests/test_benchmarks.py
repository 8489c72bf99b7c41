"""The benchmark scripts run end to end with their smallest settings (no timing or memory thresholds here), and the
results table of docs/benchmarks.md comes from the committed JSON alone."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    # The caller's PYTHONPATH first, as the benchmarks' own workers do: a checkout it points at is the one measured.
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
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


def report_of(out: Path, name: str, png: bool = False) -> dict:
    if png:
        assert (out / f"{name}.png").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


def load_gen_readme():
    spec = importlib.util.spec_from_file_location("gen_readme", ROOT / "scripts" / "gen_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_benchmark_patches_private_optimizer_names():
    # Benchmarks observe the optimizer through public instrumentation only (torch's step hooks on `inner`).
    for path in (ROOT / "benchmarks").glob("*.py"):
        text = path.read_text()
        for private in ("lw._", "optimizer._", "._step_one", "._record_norm", "._params"):
            assert private not in text, f"{path.name} uses {private}"


def test_gen_readme_reads_only_the_json():
    source = (ROOT / "scripts" / "gen_readme.py").read_text()
    assert "spec_from_file_location" not in source and "import memory_suite" not in source


@pytest.mark.slow
def test_step_time_small(tmp_path):
    result = run_script(
        "step_time.py", "--small", "--warmup", "1", "--rounds", "2", "--steps_per_round", "1", "--output_dir",
        str(tmp_path),
    )  # fmt: skip
    report = report_of(tmp_path, "step_time")
    assert {"description", "model", "settings", "timing", "breakdown", "ratio"} <= report.keys()
    timing = report["timing"]
    assert set(timing) == {"standard", "layerwise"}
    for entry in timing.values():
        assert len(entry["times_s"]) == 2 and len(entry["paired_ratios"]) == 2 and entry["median_s"] > 0
    assert timing["standard"]["ratio"] == 1.0 and math.isfinite(report["ratio"])
    assert report["breakdown"]["layerwise"]["backwards_per_step"] == 1
    assert "layer-wise / standard" in result.stdout


@pytest.mark.slow
def test_step_time_offload_rows_small(tmp_path):
    result = run_script(
        "step_time.py", "--small", "--warmup", "1", "--rounds", "2", "--steps_per_round", "2", "--offload_only",
        "--output_dir", str(tmp_path), "--name", "offload",
    )  # fmt: skip
    report = report_of(tmp_path, "offload")
    timing, parts = report["timing"], report["breakdown"]
    rows = {"standard", "offload_optimizer", "offload_optimizer_after", "standard_clip", "layerwise_norm_pass",
            "offload_gradients"}  # fmt: skip
    assert set(timing) == set(parts) == rows
    assert {k: timing[k]["reference"] for k in rows} == {
        "standard": "standard", "offload_optimizer": "standard", "offload_optimizer_after": "standard",
        "standard_clip": "standard_clip", "layerwise_norm_pass": "standard_clip", "offload_gradients": "standard_clip",
    }  # fmt: skip
    # Exact clipping: the norm pass runs a second backward, gradients offload one.
    assert parts["layerwise_norm_pass"]["backwards_per_step"] == 2
    assert parts["offload_gradients"]["backwards_per_step"] == 1 == parts["standard_clip"]["backwards_per_step"]
    # The host worker stepped every step; held until backward returned, none of it ran during backward.
    assert parts["offload_optimizer"]["host_step_s"] > 0 and parts["offload_optimizer_after"]["host_step_s"] > 0
    assert parts["offload_optimizer_after"]["host_step_in_backward_fraction"] == 0.0
    assert "host_step_s" not in parts["offload_gradients"] and "host_step_s" not in parts["standard"]
    assert set(report["offload_pairs"]) == {
        "offload_optimizer/offload_optimizer_after", "offload_gradients/layerwise_norm_pass"
    }  # fmt: skip
    assert report["copy_one_direction_s"] > 0 and report["trainable_bytes"] > 0
    assert report["cost_model"]["measured_mode"] in ("gradients", "none")
    assert "where the time goes" in result.stdout and "offload_gradients/layerwise_norm_pass" in result.stdout


@pytest.mark.slow
def test_memory_suite_small(tmp_path):
    run_script("memory_suite.py", "--small", "--output_dir", str(tmp_path))
    report = report_of(tmp_path, "memory_suite")
    assert {"description", "model", "settings", "environment", "targets", "configs", "goals", "wall_time_s"} <= set(
        report
    )
    assert [c["name"] for c in report["configs"]] == report["settings"]["configs"]
    assert len(report["configs"]) == 18
    for c in report["configs"]:
        if "error" in c:
            # GaLore may be refused while its routing through the registry changes; the suite reports and goes on.
            assert c["config"]["galore"], c["error"]
            continue
        assert {"memory", "analysis", "estimate", "timing"} <= set(c)
        analysis = c["analysis"]
        assert analysis["peak_rss_bytes"] > 0 and analysis["floor_ratio"] > 0
        assert analysis["state_counted_bytes"] >= 0 and analysis["grads_counted_bytes"] > 0
        # The plan of every configuration it models, beside the measured peak.
        modeled = not c["config"]["galore"] and c["config"]["norm_pass"] == "auto"
        assert (analysis["plan_error"] is not None) == modeled == ("plan" in c["estimate"])
        assert len(c["memory"]["steps"]) == 2
        assert len(c["timing"]["times_s"]) == 2
        if c["config"]["standard"]:
            assert c["timing"]["ratio"] > 0 and len(c["timing"]["paired_ratios"]) == 2
    # Layer-wise without accumulation holds one gradient at a time: fewer gradient bytes than its standard twin.
    by_name = {c["name"]: c for c in report["configs"]}
    lw, std = by_name["adamw_torch_layerwise"]["analysis"], by_name["adamw_torch"]["analysis"]
    assert lw["grads_counted_bytes"] < std["grads_counted_bytes"]
    assert {g["kind"] for g in report["goals"]} >= {"floor", "time", "plan"}

    table = load_gen_readme().results_table(tmp_path / "memory_suite.json")
    lines = table.strip().splitlines()
    assert lines[0].startswith("| config |") and set(lines[1]) <= {"|", "-"}
    assert len(lines) == 2 + len(report["configs"])
    assert all(line.count("|") == lines[0].count("|") for line in lines)


# One engine per test: each launches several 2-rank process groups, which is most of the time on 2 cores.
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_distributed_memory_small(tmp_path, engine):
    args = ["--small", "--steps", "2", "--engines", engine, "--output_dir", str(tmp_path)]
    if engine == "ddp":
        # One optimizer's three runs in one launch (FSDP2's launch one run each, as a full run does), and the step-time
        # launch (two rounds, profiled).
        args += ["--ddp_optims", "adamw_torch", "--one_launch"]
        args += ["--time", "--rounds", "2", "--time_steps", "3", "--profile"]
    result = run_script("distributed_memory.py", *args, timeout=600)
    # A report of FSDP2 runs alone is a file of its own, as results/distributed_memory_fsdp2.json.
    report = report_of(tmp_path, "distributed_memory" + ("" if engine == "ddp" else "_fsdp2"))
    assert {"model", "environment", "runs", "wall_time_s"} <= report.keys()
    assert {"ddp_runs", "ddp_targets", "ddp_goal_pass", "estimator_check", "step_time"} <= report.keys()
    if engine == "ddp":
        runs = report["ddp_runs"]
        assert {(r["kind"], r["rank"]) for r in runs} == {(k, r) for k in ("standard", "bucket_view", "layerwise")
                                                          for r in (0, 1)}  # fmt: skip
        for r in runs:
            assert r["engine"] == "ddp" and r["world_size"] == 2 and len(r["step_times_s"]) == 2
            assert r["training_peak_bytes"] > 0 and r["grad_live_peak_bytes"] > 0 and r["optimizer_state_bytes"] > 0
            assert (r["wrapped"] == "DistributedDataParallel") == (r["kind"] != "layerwise")
        layerwise = [r for r in runs if r["kind"] == "layerwise"]
        assert {r["route"] for r in layerwise} == {"data_parallel"} and {r["optim"] for r in layerwise} == {
            "adamw_torch_layerwise"
        }
        assert all(r["ddp_bucket_bytes"] > 0 for r in runs if r["kind"] != "layerwise")
        (target,) = report["ddp_targets"]
        assert target["base_optim"] == "adamw_torch" and target["pass"] in (True, False)
        assert len(report["estimator_check"]) == 3
        assert {"standard:adamw_torch", "layerwise:adamw_torch"} == set(report["step_time"]["configs"])
        assert report["step_time"]["ratios"]["adamw_torch"]["wall_ratio"] > 0
        assert set(report["step_time"]["profiles"]) == {"standard:adamw_torch", "layerwise:adamw_torch"}
        assert "Target: layer-wise training peak" in result.stdout and "goal <= 1.10" in result.stdout
        return
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
    standard_samples = next(r["grad_samples"] for r in runs if r["optim"] == "adamw_torch")
    # The inner steps add samples (torch's step pre-hooks).
    assert all(r["grad_samples"] > standard_samples for r in layerwise)
    # Layer-wise holds about one local shard of gradients at a time, the standard optimizer all of them.
    standard = next(r for r in runs if r["optim"] == "adamw_torch")
    assert all(r["grad_storage_peak_bytes"] < standard["grad_storage_peak_bytes"] for r in layerwise)
    assert "FSDP2, plain loop" in result.stdout


@pytest.mark.slow
def test_step_time_fp16_small(tmp_path):
    run_script("step_time.py", "--fp16", "--small", "--warmup", "1", "--rounds", "2", "--output_dir", str(tmp_path))
    report = report_of(tmp_path, "step_time_fp16")
    timing, parts = report["timing"], report["breakdown"]
    rows = {f"{kind} ga{ga}" for kind in ("standard_clip", "layerwise_norm_pass") for ga in (1, 4)}
    assert set(timing) == set(parts) == rows and report["settings"]["fp16"] is True
    for name, entry in timing.items():
        assert entry["reference"] == name.replace("layerwise_norm_pass", "standard_clip")
        assert len(entry["times_s"]) == 2 and math.isfinite(entry["median_s"]) and entry["median_s"] > 0
        assert math.isfinite(entry["ratio"]) and 0 <= parts[name]["skipped_steps"] <= 3
    # Without accumulation the inf check runs a second backward over the same forward.
    layerwise, standard = parts["layerwise_norm_pass ga1"], parts["standard_clip ga1"]
    assert layerwise["forwards_per_step"] == 1 and layerwise["backwards_per_step"] == 2
    assert 0 < layerwise["peak_grad_bytes"] < standard["peak_grad_bytes"] == report["trainable_bytes"]
    ga4 = parts["layerwise_norm_pass ga4"]
    assert ga4["forwards_per_step"] == 4 == ga4["backwards_per_step"]


@pytest.mark.slow
def test_soak_small(tmp_path):
    run_script("soak.py", "--steps", "20", "--segment", "10", "--output_dir", str(tmp_path))
    report = report_of(tmp_path, "soak")
    assert report["steps"] == 20 and report["segments"] == 2
    assert report["weights_identical_to_uninterrupted"] is True
    assert report["max_hooks_after_train"] == 0 and report["max_live_layerwise_optimizers"] == 0


def test_results_table_matches_committed_docs():
    # The generated table of docs/benchmarks.md is the committed memory_suite.json, read as JSON (no benchmark import).
    table = load_gen_readme().results_table()
    assert table in (ROOT / "docs" / "benchmarks.md").read_text()


def test_plan_accuracy_quick(tmp_path):
    # Two tiny configurations: the real run's two meters and the plan, side by side. The allocator's peak and the
    # peak of the plan's tracker run over the real tensors (--split) are two ways of measuring the same step.
    result = run_script("plan_accuracy.py", "--quick", "--split", "--output_dir", str(tmp_path), timeout=240)
    report = report_of(tmp_path, "plan_accuracy", png=True)
    assert report["configurations"] == report["compared"] == 2
    assert "within 5% of the tensor peak" in result.stdout
    for row in report["rows"]:
        real, plan = row["real"], row["plan"]
        assert real["start_bytes"] > 0 and real["peak_bytes"] > real["start_bytes"]
        assert abs(real["split"]["peak_bytes"] / real["peak_bytes"] - 1) < 0.01, row["name"]
        # What the allocator holds at rest is every tensor Python can reach (in the other run of the same
        # configuration; a few bytes of lazily created module globals aside): no allocation was missed.
        assert real["held_bytes_at_rest"] == real["start_bytes"]
        assert abs(real["held_bytes_at_rest"] - real["live_tensor_bytes_at_rest"]) < 4096
        assert real["rss_training_peak_bytes"] > 0 and real["rss_runtime_bytes"] > 100 * 2**20
        assert sum(plan["categories"].values()) == plan["peak_bytes"]
        assert row["error"] == plan["peak_bytes"] / real["peak_bytes"] - 1


def test_plan_accuracy_only_selects_by_name():
    result = run_script("plan_accuracy.py", "--list", "--only", "ga4", "--only", "fsdp2")
    names = result.stdout.split("\n")[:-1]
    assert names and all("ga4" in n or "fsdp2" in n for n in names)
    assert any(n.startswith("opt ") for n in names) and any(n.endswith("fsdp2x2") for n in names)
