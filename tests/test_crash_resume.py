"""A run SIGKILLed anywhere (also while writing a checkpoint) resumes from the last complete checkpoint and ends
bit-identical to an uninterrupted run."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "scripts" / "crash_train.py"


def run(out, *extra):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.run([sys.executable, str(SCRIPT), str(out), *extra], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    result = run(out)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(out / "final" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["step:5", "save:6"])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, uninterrupted, kill):
    crashed = run(tmp_path, "--kill", kill)
    assert crashed.returncode == -signal.SIGKILL
    if kill.startswith("save"):
        # The interrupted checkpoint exists but is incomplete (half an optimizer.pt, no marker).
        assert (tmp_path / "checkpoint-6").is_dir()
        assert not (tmp_path / "checkpoint-6" / "layerwise_complete.json").exists()
    resumed = run(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Killed at step 5: the last checkpoint is 4. Killed while writing 6: 6 is incomplete, so 4 again.
    assert f"resuming from {tmp_path / 'checkpoint-4'}" in resumed.stdout
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert final.keys() == uninterrupted.keys()
    for name in final:
        assert torch.equal(final[name], uninterrupted[name]), name


def launch(engine, out, *extra):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(root / "configs/accelerate/cpu_ddp.yaml"),
    ]
    cmd += ["--main_process_port", str(port), str(SCRIPT), str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_ranks_sigkill_during_checkpoint_write_then_resume(tmp_path, engine):
    full = launch(engine, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    crashed = launch(engine, tmp_path / "run", "--kill", "save:6")
    assert crashed.returncode != 0
    assert (tmp_path / "run" / "checkpoint-4" / "layerwise_complete.json").exists()
    assert not (tmp_path / "run" / "checkpoint-6" / "layerwise_complete.json").exists()
    resumed = launch(engine, tmp_path / "run", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path / 'run' / 'checkpoint-4'}" in resumed.stdout
    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
