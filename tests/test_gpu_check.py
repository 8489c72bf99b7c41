"""The GPU check's CPU dry run: `benchmarks/gpu_check.py --tiny` runs every check's code path on CPU (tiny models, the
CPU GradScaler, FSDP2 on gloo ranks, memory not measured) and writes the JSON a GPU run would; its parity comparison
fails a clip that is 1% off, which the former tolerance let pass; and `gpu_check.sh` picks the project's .venv, hands
its preflight's findings to the check, and refuses to start without CUDA. Nothing here needs or uses a GPU."""

import importlib.util
import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SHELL = ROOT / "benchmarks" / "gpu_check.sh"


def env():
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_gpu_check_sh_is_valid_bash():
    subprocess.run(["bash", "-n", str(SHELL)], check=True)


def test_gpu_check_sh_uses_the_venv_python_unless_python_is_set(tmp_path):
    # A checkout with gpu_check.sh and a .venv whose python only says who it is (and fails the preflight).
    shutil.copy(SHELL, executable(tmp_path / "benchmarks" / "gpu_check.sh", ""))
    executable(tmp_path / ".venv" / "bin" / "python", '#!/bin/sh\necho "venv python: $0" >&2\nexit 3\n')
    other = executable(tmp_path / "other" / "python", '#!/bin/sh\necho "other python: $0" >&2\nexit 3\n')
    clean = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    for extra, chosen in (({}, tmp_path / ".venv" / "bin" / "python"), ({"PYTHON": str(other)}, other)):
        result = subprocess.run(
            ["bash", str(tmp_path / "benchmarks" / "gpu_check.sh")],
            cwd=tmp_path / "other",
            env={**clean, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stdout + result.stderr  # the preflight failed: exit 2, nothing ran
        assert f"with {chosen}" in result.stdout
        assert f"python: {chosen}" in result.stderr


@pytest.mark.slow
def test_gpu_check_sh_refuses_to_start_without_cuda():
    result = subprocess.run(
        ["bash", str(SHELL)],
        env={**env(), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "torch.cuda.is_available() is False" in result.stderr
    # The preflight names the torch build it found, so a CPU wheel is told apart from a missing GPU.
    build = "CPU build" if torch.version.cuda is None else "CUDA build"
    assert f"torch {torch.__version__}, {build}" in result.stderr


@pytest.mark.slow
def test_gpu_check_sh_hands_its_preflight_to_the_check(tmp_path):
    # A python whose preflight reports two GPUs, then the real interpreter runs the check (on CPU: --device cpu).
    stub = executable(
        tmp_path / "python",
        f'#!/bin/sh\nif [ "$1" = "-" ]; then cat >/dev/null; echo GPU_CHECK_DEVICE_COUNT=2; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n',
    )
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        ["bash", str(SHELL), "--device", "cpu", "--tiny", "--checks", "fp16_norm_pass", "--output", str(out)],
        env={**env(), "PYTHON": str(stub), "CUDA_VISIBLE_DEVICES": "3,5", "GPU_CHECK_TIMEOUT": "300"},
        capture_output=True,
        text=True,
        timeout=320,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    environment = report["environment"]
    assert environment["cuda_visible_devices"] == "3"  # the checks run on one device ...
    # ... and the FSDP2 launches get back what the script saw.
    assert environment["gpu_check_sh"] == {"GPU_CHECK_DEVICE_COUNT": "2", "GPU_CHECK_CUDA_VISIBLE_DEVICES": "3,5"}
    assert report["argv"][report["argv"].index("--time_limit") + 1] == "290"
    assert report["checks"]["fp16_norm_pass"]["status"] == "PASS"


def test_update_comparison_sees_a_clip_that_is_one_percent_off():
    check = gpu_check()
    torch.manual_seed(0)
    before, standard, layerwise = (torch.nn.Linear(64, 64) for _ in range(3))
    layerwise.load_state_dict(before.state_dict())
    standard.load_state_dict(before.state_dict())
    with torch.no_grad():
        update = torch.randn(64, 64) * 1e-5  # an SGD-sized step: far below a 1e-4 tolerance on the weights
        standard.weight += update
        layerwise.weight += 0.99 * update
    diff = check.update_diff(before, standard, layerwise)
    assert diff["update_worst_param"] == "weight"
    # 1% off, up to float32 rounding of updates this small (the weights are ~0.1, the updates ~1e-5).
    assert diff["update_max_rel_diff"] == pytest.approx(0.01, rel=1e-2)
    assert check.param_diff(standard, layerwise)[0] < 1e-6
    same = check.update_diff(before, standard, standard)
    assert same["update_max_rel_diff"] == 0.0 and same["update_model_rel_diff"] == 0.0


def test_memory_check_sets_the_measured_peak_next_to_the_plan(monkeypatch):
    # The GPU runs stood in for (no GPU here): the comparison itself, the plan included, runs as on CUDA.
    from layerwise_hf.plan import plan

    check = gpu_check()
    sizes = check.SIZES["tiny"]
    measured = {"adamw_8bit": 3_000_000, "adamw_8bit_layerwise": 2_500_000}

    def launch_case(spec, opts, timeout, device_sync=None):
        peak = measured[spec["optim"]]
        return {"measured": True, "peak_allocated_bytes": peak, "peak_reserved_bytes": peak, "grad_norm": [1.0],
                "estimate": {"total_bytes": 1}}  # fmt: skip

    monkeypatch.setattr(check, "launch_case", launch_case)
    result = check.check_memory(SimpleNamespace(deadline=None), sizes, "cpu", lambda partial: None)

    config = check.llama_config(sizes["memory_model"], sizes["memory_seq"], attn="sdpa")
    expected = plan(config, ["adamw_8bit"], seq_len=sizes["memory_seq"], micro_batch=sizes["memory_batch"],
                    torch_dtype="bfloat16", gradient_checkpointing=True, device="cpu")  # fmt: skip
    assert "error" not in result["plan"], result["plan"]
    assert result["plan"]["device"] == "cpu"
    for case in result["cases"]:
        planned = expected.row(case["optim"]).peak_bytes
        assert case["planned_peak_bytes"] == planned
        assert case["measured_over_planned"] == round(measured[case["optim"]] / planned, 4)
    ratio = result["cases"][0]["measured_over_planned"]
    rows = dict((name, detail) for name, _, detail in check.table_rows({"memory": result}))
    assert f"measured_over_planned={ratio:.4g}" in rows["memory adamw_8bit"]
    assert check.summary_line("memory", result).startswith("  => memory: PASS")


def test_fsdp2_launches_see_what_gpu_check_sh_saw(monkeypatch):
    check = gpu_check()
    monkeypatch.setenv("GPU_CHECK_DEVICE_COUNT", "2")
    monkeypatch.setenv("GPU_CHECK_CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert check.visible_devices("cuda") == (2, "3,5")
    assert check.visible_devices("cpu") == (2, None)  # gloo ranks need no device


@pytest.mark.slow
def test_a_clip_one_percent_off_fails_parity_and_passed_the_former_tolerance(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--checks", "parity", "--parity_optims", "adamw_torch,sgd"]
        + ["--inject_clip_error", "0.01", "--output", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-4000:]
    parity = json.loads(out.read_text())["checks"]["parity"]
    assert parity["inject_clip_error"] == 0.01 and parity["status"] == "FAIL"
    assert {(c["optim"], c["ga"]) for c in parity["cases"]} == {
        (o, ga) for o in ("adamw_torch", "sgd") for ga in (1, 2)
    }
    for c in parity["cases"]:
        assert "error" not in c, c
        assert c["passed_former_atol"] and c["max_abs_param_diff"] <= parity["former_atol"], c  # the old check passed
        assert not c["passed"] and not c["exact"], c  # the new one fails
        assert c["update_max_rel_diff"] > 1e-6, c  # and so would a comparison of the updates
        assert c["clipped_steps"] > 0
    sgd = [c for c in parity["cases"] if c["optim"] == "sgd"]
    assert all(c["update_max_rel_diff"] > 1e-3 for c in sgd)  # SGD's update moves by about the clip's error


@pytest.mark.slow
def test_gpu_check_tiny_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--output", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "all passed: True" in result.stdout
    report = json.loads(out.read_text())

    assert report["tiny"] is True and report["passed"] is True
    assert report["environment"]["device"] == "cpu"
    assert report["environment"]["torch_build"] == ("CUDA" if torch.version.cuda else "CPU")
    assert set(report["checks"]) == {
        "parity", "fp16", "fp16_norm_pass", "fsdp2_8bit", "memory", "step_time", "offload"
    }  # fmt: skip
    for name, check in report["checks"].items():
        assert check["status"] == "PASS", (name, check)
        assert "error" not in check

    # Parity: every optimizer x GA, bit-identical on CPU, with the same logged norms, and clipping really applied.
    parity = report["checks"]["parity"]
    assert parity["inject_clip_error"] == 0.0
    cases = parity["cases"]
    assert {(c["optim"], c["ga"]) for c in cases} == {
        (o, ga) for o in ("adamw_torch", "adamw_8bit", "sgd") for ga in (1, 2)
    }
    for c in cases:
        assert c["passed"] and c["exact"] and c["criterion"] == "bit-exact", c
        assert c["max_abs_param_diff"] == 0.0 and c["grad_norm_max_abs_diff"] == 0.0
        assert c["update_max_rel_diff"] == 0.0
        assert c["grad_norm_layerwise"] == c["grad_norm_standard"]
        assert len(c["grad_norm_standard"]) == report["sizes"]["parity_steps"]
        assert c["clipped_steps"] > 0

    # fp16: the injected overflow step is skipped by both (non-finite norm, nothing moved, scale halved).
    fp16 = report["checks"]["fp16"]
    at = fp16["overflow_step"]
    assert [c["ga"] for c in fp16["cases"]] == [1, 2]
    for c in fp16["cases"]:
        assert c["passed"] and c["overflow_step_skipped"] and c["exact"] and c["scales_equal"], c
        assert c["criterion"] == "update_rtol" and c["update_max_rel_diff"] == 0.0
        assert c["max_abs_param_diff"] == 0.0
        for kind in ("standard", "layerwise"):
            run = c[kind]
            assert run["injected_step_nonfinite"] and run["params_changed_on_injected_step"] == []
            assert run["scales"][at] == run["scales"][at - 1] / 2
            assert isinstance(run["grad_norm"][at], str) and math.isnan(float(run["grad_norm"][at]))
        finite = sum(isinstance(n, float) for n in c["layerwise"]["grad_norm"])
        assert c["layerwise"]["inner_steps_taken"] == finite  # the skipped step never reached a layer's optimizer

    # fp16, overflow in the stepping backward only: what stepped before it stays, nothing after it steps, no nan/inf.
    second = report["checks"]["fp16_norm_pass"]
    at = second["overflow_step"]
    assert second["hook_calls_on_overflow_step"] == 2
    stepped, changed = second["stepped_on_overflow_step"], second["params_changed_on_overflow_step"]
    assert stepped and set(changed) == set(stepped)
    assert set(stepped) <= set(second["computed_before_overflow"]) and second["overflow_param"] not in changed
    assert len(changed) < second["params"] - 1
    assert second["scales"][at] == second["scales"][at - 1] / 2
    assert second["nonfinite_params_at_end"] == [] and second["nonfinite_params_after_overflow_step"] == []
    assert second["lr_held_on_skipped_step"]

    # FSDP2 + bitsandbytes on gloo: 1 and 2 ranks, each rank's shards equal the same optimizer stepped by hand.
    fsdp = report["checks"]["fsdp2_8bit"]
    assert [r["world_size"] for r in fsdp["runs"]] == [1, 2]
    for run in fsdp["runs"]:
        assert run["passed"] and not run.get("skipped"), run
        assert {c["case"] for c in run["cases"]} == {"ga1 exact clip", "ga2 no clip"}
        for c in run["cases"]:
            assert c["route"] == "fsdp2" and c["fsdp_version"] == 2 and c["wrapped_local_shard"], c
            assert c["hand_bit_exact"] and c["hand_max_diff"] == 0.0, c
            assert 0 < c["eight_bit_states_rank0"] < c["states_rank0"], c  # 8-bit shards, and small ones in 32-bit
            assert c["stepped_params"] == run["world_size"] * c["states_rank0"]

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
    # The plan of the same runs, next to them (nothing measured to divide by on CPU).
    assert set(memory["plan"]["rows"]) == set(by) and memory["plan"]["device"] == "cpu"
    for c in by.values():
        assert c["planned_peak_bytes"] == memory["plan"]["rows"][c["optim"]]["peak_bytes"] > 0
        assert "measured_over_planned" not in c

    # Step time: bitsandbytes' per-parameter syncs where they belong (counted; the CPU times mean nothing).
    step_time = report["checks"]["step_time"]
    by = {c["run"]: c for c in step_time["cases"]}
    steps = report["sizes"]["step_time_steps"]
    tensors = by["adamw_8bit"]["num_tensors"]
    assert by["adamw_8bit"]["bnb_device_syncs"] == steps * tensors
    assert by["adamw_8bit_layerwise"]["bnb_device_syncs"] == 0
    assert by["adamw_8bit_layerwise bnb sync"]["bnb_device_syncs"] == steps * tensors
    assert by["adamw_8bit_layerwise bnb sync"]["LAYERWISE_HF_BNB_DEVICE_SYNC"] == "1"
    for c in by.values():
        assert c["steps_run"] == steps and c["median_step_ms"] > 0
    assert step_time["syncs_where_expected"] and "sync_removed_saves_ms" in step_time
    assert_offload_rows(report["checks"]["offload"], report["sizes"])


def assert_offload_rows(offload: dict, sizes: dict) -> None:
    """The offload check's rows from a CPU dry run: parity of both modes, where the states went, the ~1B runs."""
    assert offload["status"] == "PASS", offload
    cases = offload["cases"]
    assert {(c["mode"], c["ga"]) for c in cases} == {(m, ga) for m in ("gradients", "optimizer") for ga in (1, 2)}
    for c in cases:
        # On CPU both modes are bit-exact with stock Trainer + adamw_torch, and the clip really bit.
        assert c["passed"] and c["exact"] and c["criterion"] == "bit-exact", c
        assert c["max_abs_param_diff"] == 0.0 and c["grad_norm_max_abs_diff"] == 0.0 and c["clipped_steps"] > 0
        # The CPU stand-in of the side stream ran the copies, and every gradient waited in a host buffer.
        assert c["transfer"] == "ThreadTransfer" and c["host_gradient_buffer_bytes"] > 0
        if c["mode"] == "optimizer":
            assert c["host_stepped_tensors"] > 0 and c["host_parameter_copy_bytes"] > 0
    runs = {r["run"]: r for r in offload["runs"]}
    assert list(runs) == ["adamw_torch", "adamw_torch_layerwise", "adamw_torch_layerwise offload=gradients",
                          "adamw_torch_layerwise offload=optimizer"]  # fmt: skip
    for r in runs.values():
        assert "error" not in r, r
        assert r["steps_run"] == sizes["offload_steps"] and r["median_step_ms"] > 0 and r["vs_standard"] > 0
        assert r["measured"] is False and "peak_allocated_bytes" not in r
        # The same batches from the same weights: the logged norms agree (bf16 weights; not judged on a GPU).
        assert r["grad_norm_max_abs_diff_vs_standard"] is not None
    none, host = runs["adamw_torch_layerwise"], runs["adamw_torch_layerwise offload=optimizer"]
    grads = runs["adamw_torch_layerwise offload=gradients"]
    assert host["state_bytes_by_device"] == {"cpu": none["state_bytes_by_device"]["cpu"]}  # all of it, on the host
    assert host["host_parameter_copy_bytes"] == 2 * host["num_parameters"]  # a bf16 copy of every parameter
    assert grads["host_gradient_buffer_bytes"] == 2 * grads["num_parameters"]  # every gradient waited on the host
    assert "host_gradient_buffer_bytes" not in none and "host_stepped_tensors" not in none  # no offload there
    assert host["host_stepped_tensors"] == host["num_tensors"]
    assert offload["measured"] is False and "note" in offload


@pytest.mark.slow
def test_gpu_check_tiny_offload_rows_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--checks", "offload", "--output", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert_offload_rows(report["checks"]["offload"], report["sizes"])
    assert "offload parity optimizer GA2" in result.stdout and "offload adamw_torch_layerwise offload=optimizer" in (
        result.stdout
    )


def test_offload_check_judges_memory_and_where_the_states_are(monkeypatch):
    # The GPU runs stood in for (no GPU here): what the check concludes from them, as on CUDA.
    check = gpu_check()
    sizes = check.SIZES["tiny"]
    steps = sizes["offload_steps"]
    monkeypatch.setattr(check, "offload_parity", lambda opts, sizes, device, cases, record: cases.append(
        {"mode": "gradients", "ga": 1, "passed": True}))  # fmt: skip

    def runs(optimizer_peak, optimizer_states):
        def launch_cases(specs, opts, timeout):
            peaks = {"none": 10_000, "gradients": 9_000, "optimizer": optimizer_peak, None: 12_000}
            states = {"none": {"cuda": 4_000}, "gradients": {"cuda": 4_000}, "optimizer": optimizer_states}
            return [
                {"label": s["label"], "optim": s["optim"], "measured": True, "step_seconds": [0.1 + k] * steps,
                 "grad_norm": [1.0] * steps, "peak_allocated_bytes": peaks[s["offload"]], "num_tensors": 3,
                 "host_stepped_tensors": 3 if s["offload"] == "optimizer" else None,
                 **({"state_bytes_by_device": states[s["offload"]]} if s["offload"] else {})}
                for k, s in enumerate(specs)
            ]  # fmt: skip

        monkeypatch.setattr(check, "launch_cases", launch_cases)
        opts = SimpleNamespace(deadline=None, offload_rtol=1e-4)
        return check.check_offload(opts, sizes, "cuda", lambda partial: None)

    result = runs(6_000, {"cpu": 4_000})
    assert result["passed"] and result["measured"]
    by = {r["run"]: r for r in result["runs"]}
    assert by["adamw_torch_layerwise offload=optimizer"]["peak_allocated_saved_vs_no_offload_bytes"] == 4_000
    assert by["adamw_torch_layerwise offload=gradients"]["peak_allocated_saved_vs_no_offload_bytes"] == 1_000
    assert by["adamw_torch_layerwise offload=optimizer"]["vs_standard"] == round(3.1 / 0.1, 3)
    rows = dict((name, detail) for name, _, detail in check.table_rows({"offload": result}))
    assert "vs_standard=31 peak_allocated_bytes=" in rows["offload adamw_torch_layerwise offload=optimizer"]
    assert "peak_allocated_saved_vs_no_offload_bytes=" in rows["offload adamw_torch_layerwise offload=optimizer"]
    assert not runs(10_000, {"cpu": 4_000})["passed"]  # no lower than without offload
    assert not runs(6_000, {"cpu": 3_000, "cuda": 1_000})["passed"]  # a state left on the device
