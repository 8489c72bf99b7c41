"""Real 2-rank launches (gloo on CPU) through `accelerate launch` with the shipped configs."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerwise_hf import LayerwiseTrainingArguments

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    config: str, script: str, report: Path, extra_env: dict | None = None, launch_args=(), script_args=()
) -> dict:
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",  # the multi-process launcher does not forward `use_cpu`
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "distributed"), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / config)]
    cmd += [*launch_args, "--main_process_port", str(free_port()), str(ROOT / script), *script_args, str(report)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(report.read_text())


def assert_exact(report: dict, route: str):
    assert report["world_size"] == 2
    for case in report["results"]:
        assert case["route"] == route, case
        assert case["max_diff"] == 0.0, case
        assert case["grad_norm_equal"] and case["lr_equal"], case
        assert case["ranks_agree"], case
        assert case["steps_logged"] == 4, case


# NOTE: the script's --quick cases are a subset of these; the fast tier runs no launched ranks, so only the whole set
# runs (in the full suite).
@pytest.mark.slow
def test_data_parallel_matches_standard_ddp_and_resumes(tmp_path):
    report = launch("configs/accelerate/cpu_ddp.yaml", "tests/distributed/ddp_trainer.py", tmp_path / "r.json")
    # Under the DDP config the layer-wise path does not wrap the model in DDP: it reduces the gradients itself.
    assert all(case["wrapped"] in ("LlamaForCausalLM", "OptimizedModule") for case in report["results"])
    names = {c["case"] for c in report["results"]}
    assert names >= {"adamw_torch ga2 sync_each_batch", "adamw_torch ga1 unused parameters", "resume"}
    assert names >= {
        "adamw_8bit ga2 exact clip",
        "adafactor ga2",
        "sgd ga1 exact clip",
        "adamw_torch ga1 small buckets",
    }
    unused = next(c for c in report["results"] if c["case"] == "adamw_torch ga1 unused parameters")
    assert unused["unused_everywhere_unchanged"]
    old = next(c for c in report["results"] if c["case"] == "resume from the DDP comm-hook route")
    assert old["saved_by"] == "ddp"
    assert_exact(report, "data_parallel")


def test_data_parallel_gradient_memory_is_bounded_by_what_is_in_flight(tmp_path):
    report = launch("configs/accelerate/cpu_ddp.yaml", "tests/distributed/ddp_memory.py", tmp_path / "r.json")
    layerwise, standard = report["layerwise"], report["standard_bucket_view"]
    # Distinct storages behind live gradients and buckets, at every layer's step: the bucket cap plus twice the
    # largest tensor, not the model's gradients ...
    bound = layerwise["cap_bytes"] + 2 * layerwise["largest_bytes"]
    assert layerwise["peak_storage_bytes"] <= bound < layerwise["all_grad_bytes"], layerwise
    # The estimator replays the route's launches, holds and steps: its gradient term is an upper bound that is reached.
    assert 0.9 * layerwise["estimated_bytes"] <= layerwise["peak_storage_bytes"] <= layerwise["estimated_bytes"]
    assert layerwise["ddp_wrappers_alive"] == 0 and layerwise["wrapped"] == "LlamaForCausalLM"
    # The logged peak counts the buckets in flight and held (not only the one stepping): it meets the storages,
    # less at most the gradient the meter sees just before the route copies it into its bucket.
    package = layerwise["package_peak_grad_bytes"]
    assert layerwise["peak_storage_bytes"] - layerwise["largest_bytes"] <= package <= layerwise["peak_storage_bytes"]
    assert layerwise["logged_peak_grad_mib"] == round(package / 2**20, 3)
    # ... while DDP's persistent buckets, which its gradients alias with gradient_as_bucket_view, hold all of them.
    assert standard["peak_storage_bytes"] >= standard["all_grad_bytes"] > bound, standard
    assert standard["ddp_wrappers_alive"] >= 1


@pytest.mark.slow
def test_data_parallel_on_three_ranks_is_standard_ddp_within_its_own_rounding(tmp_path):
    report = launch(
        "configs/accelerate/cpu_ddp.yaml",
        "tests/distributed/ddp_trainer.py",
        tmp_path / "r.json",
        launch_args=["--num_processes", "3"],
        script_args=["--quick"],
    )
    assert report["world_size"] == 3
    for case in report["results"]:
        assert case["route"] == "data_parallel" and case["ranks_agree"], case
        assert case["lr_equal"] and case["steps_logged"] == 4, case
        # Beyond 2 ranks gloo's ring sums an element in an order set by its place in the bucket, and the route's
        # buckets follow readiness where DDP's (with find_unused_parameters) follow parameter order: the last bits
        # may differ, by what standard DDP differs from itself with another bucket cap.
        scale = case.get("standard_vs_other_bucket_cap", 0.0)
        assert case["max_diff"] <= max(2 * scale, 1e-6), case
    assert any(case.get("standard_vs_other_bucket_cap", 0.0) > 0.0 for case in report["results"])


@pytest.mark.slow
def test_fsdp2_matches_standard_fsdp2_and_resumes(tmp_path):
    report = launch(
        "configs/accelerate/cpu_fsdp2.yaml",
        "tests/distributed/fsdp2_trainer.py",
        tmp_path / "r.json",
        {"LAYERWISE_HF_FORCE_FSDP_CPU": "1"},
    )
    # Never a silent DDP fallback: the model must really be fully_shard'ed with DTensor parameters.
    assert all(case["fully_sharded"] for case in report["results"])
    assert_exact(report, "fsdp2")
    assert "cannot step FSDP2 shards" in report["refusal"] and "adamw_torch_layerwise" in report["refusal"]
    if importlib.util.find_spec("torchao") is not None:  # torchao's 8-bit AdamW: equal to standard FSDP2, resumes
        assert sum("torchao" in case["case"] for case in report["results"]) == 2


@pytest.mark.slow
def test_fsdp2_with_accelerates_activation_checkpointing(tmp_path):
    # Its wrapper renames the decoder layers' parameters after the optimizer was built: names are compared unwrapped.
    config = tmp_path / "fsdp2_checkpointing.yaml"
    base = (ROOT / "configs/accelerate/cpu_fsdp2.yaml").read_text()
    config.write_text(base.replace("fsdp_config:\n", "fsdp_config:\n  fsdp_activation_checkpointing: true\n"))
    report = launch(
        str(config),
        "tests/distributed/fsdp2_activation_checkpointing.py",
        tmp_path / "r.json",
        {"LAYERWISE_HF_FORCE_FSDP_CPU": "1"},
    )
    assert report["wrapped"], report
    assert report["max_diff"] == 0.0 and report["grad_norm_equal"], report
    assert report["resume_max_diff"] == 0.0, report


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_on_another_number_of_ranks(tmp_path):
    def fsdp2(ranks, mode, report):
        return launch(
            "configs/accelerate/cpu_fsdp2.yaml",
            "tests/distributed/fsdp2_reshard.py",
            tmp_path / report,
            {"LAYERWISE_HF_FORCE_FSDP_CPU": "1"},
            launch_args=["--num_processes", str(ranks)],
            script_args=[mode],
        )

    assert fsdp2(2, "save", "saved.json")["world_size"] == 2
    report = fsdp2(3, "resume", "report.json")
    assert (report["saved_world_size"], report["resumed_world_size"]) == (2, 3)
    # Every per-parameter AdamW state was resharded and loaded: 2 saved steps + 2 resumed ones.
    assert report["adam_steps"] == [4.0]
    # Same samples per step, summed in another order: equal to rounding, far below what the two steps changed.
    assert report["param_rel_change"] > 0.01
    assert report["param_rel_diff"] < 1e-5 and report["exp_avg_rel_diff"] < 1e-5, report
    assert report["grad_norm"][:2] == report["reference_grad_norm"][:2]  # from the checkpoint's log history
    assert report["grad_norm"][2:] == pytest.approx(report["reference_grad_norm"][2:], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_fp16_gradscaler_matches_standard(tmp_path, engine):
    report = launch(
        f"configs/accelerate/cpu_{engine}.yaml",
        "tests/distributed/fp16_trainer.py",
        tmp_path / "r.json",
        {"LAYERWISE_HF_FORCE_FSDP_CPU": "1"} if engine == "fsdp2" else {},
        launch_args=["--mixed_precision", "fp16"],
    )
    assert report["world_size"] == 2
    for case in report["results"]:
        # Under the DDP config the layer-wise path reduces the gradients itself (no DDP wrapper, no buckets).
        assert case["route"] == {"ddp": "data_parallel", "fsdp2": "fsdp2"}[engine], case
        # Exact, every rank the same, and the run really skipped (injected on rank 0 only) and grew the scale.
        assert case["max_diff"] == 0.0 and case["ranks_agree"], case
        assert case["grad_norm_equal"] and case["lr_equal"] and case["scales_equal"], case
        assert case["injected_step_skipped"] and case["scale_grew"], case
        assert case["layerwise_steps_taken"] == case["steps_logged"] - case["skipped_steps"] > 0, case


def test_deepspeed_is_refused_with_alternatives(tmp_path):
    with pytest.raises(ValueError, match="DeepSpeed.*'adamw_8bit'.*DDP or FSDP2"):
        LayerwiseTrainingArguments(
            output_dir=str(tmp_path), optim="adamw_8bit_layerwise", deepspeed={"zero_optimization": {"stage": 2}}
        )


def _loop(config, out, *extra, env=None):
    base_env = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / config)]
    cmd += ["--main_process_port", str(free_port()), str(ROOT / "examples" / "accelerate_loop.py")]
    cmd += ["--output_dir", str(out), *extra]
    result = subprocess.run(
        cmd, cwd=ROOT, env={**base_env, **(env or {})}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_accelerate_loop_save_state_load_state(tmp_path, engine):
    from safetensors.torch import load_file

    config = f"configs/accelerate/cpu_{engine}.yaml"
    env = {"LAYERWISE_HF_FORCE_FSDP_CPU": "1"} if engine == "fsdp2" else {}
    first = _loop(config, tmp_path / "a", "--save_state_at", "4", env=env)
    assert f"gradients via {engine}" in first
    second = _loop(config, tmp_path / "b", "--resume_from", str(tmp_path / "a" / "state-4"), env=env)
    assert "step   5" in second and "step   1 " not in second
    a = load_file(tmp_path / "a" / "final" / "model.safetensors")
    b = load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
