"""The GPU check without a GPU: `benchmarks/gpu_check.py --tiny` runs every check's code path on CPU (tiny models, the
CPU GradScaler, FSDP2 on gloo ranks, memory not measured, CSAN off) and writes the JSON a GPU run would; its parity
comparison fails a clip that is 1% off; `--checks` runs the chosen checks alone and, without bitsandbytes, skips the
ones that need it, saying so in the JSON; and `gpu_check.sh` uses the first interpreter whose torch sees CUDA, passing
over a .venv without torch. Nothing here needs or uses a GPU."""

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
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SHELL = ROOT / "benchmarks" / "gpu_check.sh"
# A python that passes gpu_check.sh's probe: its torch is a CUDA build that sees a device.
CUDA_PROBE = (
    'if [ "$1" = "-c" ]; then echo "torch 2.13.0 (CUDA 12.8 build), torch.cuda.is_available() is True"; exit 0; fi'
)


def env(**extra):
    path = os.pathsep.join(filter(None, [extra.pop("PYTHONPATH", None), os.environ.get("PYTHONPATH"), str(ROOT)]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        **extra,
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


def without_bitsandbytes(tmp_path: Path) -> str:
    """A folder for PYTHONPATH in which `import bitsandbytes` fails, as on a machine that does not have it."""
    executable(tmp_path / "no_bnb" / "bitsandbytes.py", "raise ImportError(\"No module named 'bitsandbytes'\")\n")
    return str(tmp_path / "no_bnb")


def run_shell(checkout: Path, cwd: Path, **extra) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    return subprocess.run(
        ["bash", str(checkout / "benchmarks" / "gpu_check.sh")],
        cwd=cwd,
        env={**clean, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpu_check_sh_is_valid_bash():
    subprocess.run(["bash", "-n", str(SHELL)], check=True)


def test_gpu_check_sh_passes_over_a_venv_without_torch(tmp_path):
    # What scripts/setup.sh leaves on a machine without package access: a .venv whose python has no torch. The
    # machine's own python3 has a CUDA torch; once chosen it runs gpu_check.py, which the stub ends here (exit 2).
    shutil.copy(SHELL, executable(tmp_path / "benchmarks" / "gpu_check.sh", ""))
    venv = executable(
        tmp_path / ".venv" / "bin" / "python",
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n",
    )
    cuda = executable(tmp_path / "bin" / "python3", f'#!/bin/sh\n{CUDA_PROBE}\necho "check run by $0"\nexit 2\n')
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    result = run_shell(tmp_path, tmp_path / "bin", PATH=path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"not {venv}: ModuleNotFoundError: No module named 'torch'" in result.stdout
    assert f"using {cuda}: torch 2.13.0 (CUDA 12.8 build)" in result.stdout
    assert f"check run by {cuda}" in result.stdout  # the chosen one runs the rest, not the .venv

    # PYTHON names the only candidate: without CUDA there, nothing else is tried.
    result = run_shell(tmp_path, tmp_path, PATH=path, PYTHON=str(venv))
    assert result.returncode == 2 and "FAILED TO START" in result.stderr, result.stdout + result.stderr
    assert f"not {venv}" in result.stdout and "using" not in result.stdout


@pytest.mark.slow
def test_gpu_check_sh_refuses_to_start_without_cuda():
    result = run_shell(ROOT, ROOT, PYTHON=sys.executable)
    assert result.returncode == 2, result.stdout + result.stderr
    # It names the torch build it found, so a CPU wheel is told apart from a missing GPU.
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    assert f"not {sys.executable}: torch {torch.__version__} ({build}), torch.cuda.is_available() is False" in (
        result.stdout
    )
    assert "FAILED TO START: no interpreter whose torch sees CUDA" in result.stderr


@pytest.mark.slow
def test_gpu_check_sh_runs_the_chosen_checks_and_skips_those_needing_bitsandbytes(tmp_path):
    # An interpreter that says it has CUDA, then really runs the check (on CPU: --device cpu), without bitsandbytes.
    stub = executable(tmp_path / "python", f'#!/bin/sh\n{CUDA_PROBE}\nexec "{sys.executable}" "$@"\n')
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        ["bash", str(SHELL), "--device", "cpu", "--tiny", "--checks", "fsdp2_8bit", "--output", str(out)],
        env=env(
            PYTHON=str(stub),
            CUDA_VISIBLE_DEVICES="3,5",
            GPU_CHECK_TIMEOUT="300",
            PYTHONPATH=without_bitsandbytes(tmp_path),
        ),
        capture_output=True,
        text=True,
        timeout=320,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bitsandbytes not importable" in result.stdout and "SKIPPED" in result.stdout
    report = json.loads(out.read_text())
    assert report["checks_selected"] == ["fsdp2_8bit"] and report["checks_run"] == []
    assert "bitsandbytes not importable" in report["checks_skipped"]["fsdp2_8bit"]
    assert report["checks"]["fsdp2_8bit"]["status"] == "SKIP" and report["passed"] is True
    environment = report["environment"]
    assert environment["cuda_visible_devices"] == "3"  # the checks run on one device
    assert environment["gpu_check_sh_interpreter"] == str(stub)
    assert environment["layerwise_hf_from"] == str(ROOT / "layerwise_hf")  # the checkout's, through PYTHONPATH
    assert report["argv"][report["argv"].index("--time_limit") + 1] == "290"


def test_a_missing_package_stops_the_check_before_it_starts(tmp_path):
    # transformers, accelerate and the checkout are needed (bitsandbytes is not): without one, exit 2 as without CUDA.
    executable(tmp_path / "gone" / "transformers.py", "raise ImportError(\"No module named 'transformers'\")\n")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny"],
        cwd=ROOT,
        env=env(PYTHONPATH=str(tmp_path / "gone")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FAILED TO START: cannot import what the check needs: ImportError" in result.stderr


def test_checks_run_in_their_order_and_unknown_ones_are_refused(capsys):
    check = gpu_check()
    assert check.parse_args(["--checks", "memory,parity"]).checks == ["parity", "memory"]
    assert check.parse_args(["--tiny"]).checks == list(check.CHECKS)
    with pytest.raises(SystemExit):
        check.parse_args(["--checks", "parity,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err


@pytest.mark.slow
def test_without_bitsandbytes_its_checks_and_cases_are_skipped_the_rest_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--checks",
            "parity,fsdp2_8bit",
            "--parity_optims",
            "adamw_8bit,sgd",
            "--output",
            str(out),
        ],
        cwd=ROOT,
        env=env(PYTHONPATH=without_bitsandbytes(tmp_path)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["checks_run"] == ["parity"] and list(report["checks_skipped"]) == ["fsdp2_8bit"]
    cases = {(c["optim"], c["ga"]): c for c in report["checks"]["parity"]["cases"]}
    for ga in (1, 2):
        assert cases["adamw_8bit", ga]["skipped"] and "bitsandbytes" in cases["adamw_8bit", ga]["reason"]
        assert cases["sgd", ga]["passed"] and cases["sgd", ga]["exact"]


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
    assert check.update_diff(before, standard, standard)["update_max_rel_diff"] == 0.0


class WrongClip(TrainerCallback):
    """Scales every layer-wise step's gradient by `factor` (step pre-hooks on each inner optimizer, after the clip was
    applied): a clip coefficient off by `1 - factor`."""

    def __init__(self, factor: float):
        self.factor, self.trainer = factor, None

    def on_train_begin(self, args, state, control, **kwargs):
        for inner in self.trainer.layerwise_optimizer.inner:
            inner.register_step_pre_hook(self._pre)

    def _pre(self, inner, args, kwargs):
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.factor)


@pytest.mark.slow
def test_a_clip_one_percent_off_fails_parity(monkeypatch):
    check = gpu_check()
    make_trainer = check.make_trainer

    def with_wrong_clip(model, args, dataset, callbacks=(), device="cuda"):
        wrong = [WrongClip(0.99)] if args.is_layerwise else []
        return make_trainer(model, args, dataset, [*callbacks, *wrong], device)

    monkeypatch.setattr(check, "make_trainer", with_wrong_clip)
    opts = SimpleNamespace(parity_optims=["adamw_torch", "sgd"], no_bnb=None, update_rtol=1e-6)
    parity = check.check_parity(opts, check.SIZES["tiny"], "cpu", lambda partial: None)
    assert parity["passed"] is False
    assert {(c["optim"], c["ga"]) for c in parity["cases"]} == {
        (o, ga) for o in ("adamw_torch", "sgd") for ga in (1, 2)
    }
    for c in parity["cases"]:
        assert "error" not in c, c
        assert not c["passed"] and not c["exact"] and c["clipped_steps"] > 0, c
        assert c["update_max_rel_diff"] > 1e-6, c
    assert all(c["update_max_rel_diff"] > 1e-3 for c in parity["cases"] if c["optim"] == "sgd")  # ~ the clip's error


def memory_runs(check, steps, peak, states_on_host=True):
    """The memory check's runs as launch_cases would return them from a GPU: `peak[label]` bytes each."""

    def launch_cases(specs, opts, timeout, env=None, warmup=0):
        runs = []
        for spec in specs:
            label = spec["label"].removeprefix("memory ")
            eight_bit = "8bit" in spec["optim"]
            syncs = steps * 3 if spec["optim"] == "adamw_8bit" or spec["device_sync"] else 0
            run = {
                "name": spec["label"],
                "optim": spec["optim"],
                "offload": spec["offload"],
                "steps_run": steps,
                "measured": True,
                "median_step_ms": 100.0 + len(runs),
                "num_tensors": 3,
                "loss": [1.0] * steps,
                "peak_allocated_bytes": peak[label],
                "bnb_device_syncs": syncs if eight_bit else None,
                "implicit_syncs_in_backward": 0,
                check.KEEP_DEVICE_SYNC_ENV: "1" if spec["device_sync"] else None,
            }
            if spec["offload"] == "optimizer":
                run.update(
                    host_stepped_tensors=3, state_bytes_by_device={"cpu": 10} if states_on_host else {"cuda": 1}
                )
            runs.append(run)
        return runs

    return launch_cases


def test_memory_check_judges_the_runs_and_sets_the_plan_beside_them(monkeypatch):
    # The GPU runs stood in for (no GPU here): what the check concludes from them, and the plan, as on CUDA.
    from layerwise_hf.plan import plan

    check = gpu_check()
    sizes = check.SIZES["tiny"]
    steps = sizes["memory_steps"]
    peak = {
        "adamw_8bit": 3_000_000,
        "adamw_8bit_layerwise": 2_500_000,
        "adamw_8bit_layerwise bnb sync": 2_500_000,
        "adamw_torch": 5_000_000,
        "adamw_torch_layerwise": 4_000_000,
        "adamw_torch_layerwise offload=gradients": 3_800_000,
        "adamw_torch_layerwise offload=optimizer": 2_000_000,
    }
    opts = SimpleNamespace(deadline=None, no_bnb=None)

    def judged(peak, **kwargs):
        monkeypatch.setattr(check, "launch_cases", memory_runs(check, steps, peak, **kwargs))
        return check.check_memory(opts, sizes, "cuda", lambda partial: None)

    result = judged(peak)
    assert result["passed"], result
    assert "error" not in result["plan"], result["plan"]
    expected = plan(
        check.llama_config(sizes["memory_model"], sizes["memory_seq"], attn="sdpa"),
        ["adamw_8bit"],
        seq_len=sizes["memory_seq"],
        micro_batch=sizes["memory_batch"],
        max_grad_norm=0.0,
        torch_dtype="bfloat16",
        gradient_checkpointing=True,
        device="cuda",
    )
    runs = {r["name"]: r for r in result["runs"]}
    for optim in ("adamw_8bit", "adamw_8bit_layerwise"):
        planned = expected.row(optim).peak_bytes
        assert runs[f"memory {optim}"]["planned_peak_bytes"] == planned
        assert runs[f"memory {optim}"]["measured_over_planned"] == round(peak[optim] / planned, 4)
    assert runs["memory adamw_torch_layerwise offload=optimizer"]["vs_standard"] == round(106 / 103, 3)
    rows = {name: detail for name, _, detail in check.table_rows({"memory": result})}
    assert "measured_over_planned=" in rows["memory adamw_8bit"]

    assert not judged({**peak, "adamw_torch_layerwise offload=optimizer": 4_000_000})["offload_optimizer_lower"]
    assert not judged({**peak, "adamw_8bit_layerwise": 3_000_000})["passed"]
    assert not judged(peak, states_on_host=False)["offload_states_on_host"]


@pytest.mark.slow
def test_gpu_check_tiny_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--output", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "all passed: True" in result.stdout
    report = json.loads(out.read_text())

    assert report["tiny"] is True and report["passed"] is True
    assert report["environment"]["device"] == "cpu"
    assert report["environment"]["torch_build"] == ("CUDA" if torch.version.cuda else "CPU")
    assert report["checks_run"] == ["parity", "offload", "fsdp2_8bit", "sanitizer", "memory"]
    assert report["checks_skipped"] == {}
    for name, check in report["checks"].items():
        assert check["status"] == "PASS", (name, check)

    # Parity: every optimizer x GA bit-identical on CPU, with the same logged norms, and clipping really applied; fp16:
    # the injected overflow step skipped by both (non-finite norm, nothing moved, scale halved).
    cases = report["checks"]["parity"]["cases"]
    assert {(c["optim"], c["ga"]) for c in cases} == {
        (o, ga) for o in ("adamw_torch", "adamw_8bit", "sgd", "fp16") for ga in (1, 2)
    }
    for c in cases:
        assert c["passed"] and c["exact"] and c["max_abs_param_diff"] == 0.0 and c["update_max_rel_diff"] == 0.0, c
        assert c["grad_norm_max_abs_diff"] == 0.0 and c["grad_norm_layerwise"] == c["grad_norm_standard"]
        assert len(c["grad_norm_standard"]) == report["sizes"]["parity_steps"] and c["clipped_steps"] > 0
        if c["optim"] == "fp16":
            assert c["criterion"] == "update_rtol" and c["overflow_step_skipped"] and c["scales_equal"], c
            for kind in ("standard", "layerwise"):
                run = c[kind]
                assert run["changed_on_injected_step"] == [] and math.isnan(float(run["injected_grad_norm"]))

    # Offload parity: bit-exact on CPU, the CPU stand-in of the side stream ran the copies, and the arenas pinned what
    # the plan counts; with clipping off the host steps ran in backward.
    offload = report["checks"]["offload"]["cases"]
    assert {(c["mode"], c["ga"], c["max_grad_norm"]) for c in offload} == {
        ("gradients", 1, 1.0),
        ("optimizer", 1, 1.0),
        ("gradients", 2, 1.0),
        ("optimizer", 2, 1.0),
        ("optimizer", 1, 0.0),
    }
    for c in offload:
        assert c["passed"] and c["exact"] and c["criterion"] == "bit-exact", c
        assert c["transfer"] == c["transfer_expected"] == "ThreadTransfer"
        assert c["pinned_as_planned"] and c["pinned_arena_bytes"] == c["pinned_planned_bytes"] > 0
        if c["mode"] == "optimizer":
            assert c["host_stepped_tensors"] > 0 and c["host_parameter_copy_bytes"] > 0
        if c["max_grad_norm"]:
            assert c["host_gradient_buffer_bytes"] > 0 and c["clipped_steps"] > 0
        else:
            assert c["host_gradient_buffer_bytes"] == 0 and c["steps_logged"] == report["sizes"]["parity_steps"]

    # FSDP2 + bitsandbytes on gloo: 1 and 2 ranks, every gradient made late before its step, each rank's shards equal
    # to the same optimizer stepped by hand.
    fsdp = report["checks"]["fsdp2_8bit"]["runs"]
    assert [r["world_size"] for r in fsdp] == [1, 2]
    for run in fsdp:
        assert run["passed"] and {c["case"] for c in run["cases"]} == {"ga1 exact clip", "ga2 no clip"}, run
        for c in run["cases"]:
            assert c["route"] == "fsdp2" and c["fsdp_version"] == 2 and c["wrapped_local_shard"], c
            assert c["hand_bit_exact"] and c["hand_max_diff"] == 0.0, c
            assert c["delayed_steps"] > 0 and not c["wait_tested"]  # no streams on CPU: the delay cannot show there
            assert 0 < c["eight_bit_states_rank0"] < c["states_rank0"], c  # 8-bit shards, and small ones in 32-bit
            assert c["stepped_params"] == run["world_size"] * c["states_rank0"]

    # The sanitizer's runs: the same code paths, CSAN off on CPU.
    sanitizer = report["checks"]["sanitizer"]
    assert sanitizer["enabled"] is False and len(sanitizer["runs"]) == 3
    assert all(r["passed"] for r in sanitizer["runs"]) and sanitizer["runs"][-1]["cases"][0]["csan"] is False

    # Memory: the ~1B runs finished (tiny here, not measured on CPU); bitsandbytes' syncs where they belong; every
    # state of 'optimizer' offload on the host; the plan beside the 8-bit pair.
    memory = report["checks"]["memory"]
    runs = {r["name"].removeprefix("memory "): r for r in memory["runs"]}
    assert len(runs) == 7 and all(r["steps_run"] == report["sizes"]["memory_steps"] for r in runs.values())
    tensors, steps = runs["adamw_8bit"]["num_tensors"], report["sizes"]["memory_steps"]
    assert (
        runs["adamw_8bit"]["bnb_device_syncs"]
        == runs["adamw_8bit_layerwise bnb sync"]["bnb_device_syncs"]
        == (steps * tensors)
    )
    assert runs["adamw_8bit_layerwise"]["bnb_device_syncs"] == 0
    assert all(r["implicit_syncs_in_backward"] is None and r["measured"] is False for r in runs.values())
    host = runs["adamw_torch_layerwise offload=optimizer"]
    assert host["host_stepped_tensors"] == host["num_tensors"] and host["transfer"] == "ThreadTransfer"
    assert host["host_parameter_copy_bytes"] == 2 * host["num_parameters"]  # a bf16 copy of every parameter
    grads = runs["adamw_torch_layerwise offload=gradients"]
    assert grads["host_gradient_buffer_bytes"] == 2 * grads["num_parameters"]  # every gradient waited on the host
    assert set(memory["plan"]["rows"]) == {"adamw_8bit", "adamw_8bit_layerwise"}
    assert runs["adamw_8bit"]["planned_peak_bytes"] == memory["plan"]["rows"]["adamw_8bit"]["peak_bytes"] > 0
    assert memory["bnb_syncs_where_expected"] and memory["offload_states_on_host"]


def test_the_sanitizer_sees_the_host_workers_ops_too(monkeypatch):
    # torch's CUDA sanitizer is a dispatch mode of the thread that enabled it: the host worker's copies back and host
    # steps went unchecked. A stand-in for CSAN's mode records which thread each op came from.
    import threading

    from torch.utils._python_dispatch import TorchDispatchMode

    from layerwise_hf.placement.offload import HostWorker

    seen = []

    class Recorded(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((threading.current_thread().name, func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(HostWorker, "submit", HostWorker.submit)  # restored after the test
    monkeypatch.setattr(Recorded, "__torch_dispatch__", Recorded.__torch_dispatch__)
    gpu_check().sanitize_host_worker(SimpleNamespace(cuda_sanitizer=SimpleNamespace(dispatch=Recorded())))
    worker = HostWorker()
    try:
        assert worker.submit(lambda: torch.ones(3).mul(2).sum().item()).result() == 6.0
    finally:
        worker.close()
    assert [(name.startswith("layerwise-host"), func) for name, func in seen] == [
        (True, torch.ops.aten.ones.default), (True, torch.ops.aten.mul.Tensor), (True, torch.ops.aten.sum.default),
        (True, torch.ops.aten._local_scalar_dense.default),
    ]  # fmt: skip


def test_the_verdict_names_what_the_run_could_not_exercise():
    module = gpu_check()
    bare = {"environment": {"device": "cuda", "bitsandbytes": "bitsandbytes not importable", "gpu_count": 1,
                            "cuda_host_register": "refused: RuntimeError: operation not permitted"}}  # fmt: skip
    said = " | ".join(module.not_exercised(bare))
    assert "no bitsandbytes" in said and "one GPU visible" in said and "cudaHostRegister refused" in said
    full = {"environment": {"device": "cuda", "bitsandbytes": "0.50.2", "gpu_count": 2, "cuda_host_register": "ok"}}
    assert module.not_exercised(full) == []
