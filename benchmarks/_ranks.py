"""The harness of the multi-process benchmarks: launch a benchmark's worker on CPU ranks under an Accelerate config,
gather what every rank measured and end the ranks cleanly."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_gathered_and_finish(path: str, result: dict) -> None:
    """Every rank's result in one JSON (written by rank 0), then the process group ends on every rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # A DDP reducer freed after destroy_process_group can crash or hang the rank in gloo's destructor, now and then:
    # fail every time instead, while the group can still say so.
    gc.collect()
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    if alive:
        raise RuntimeError(f"{alive} DistributedDataParallel model(s) still alive at the end of the worker")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    # Without C++ static destructors: a rank was seen to abort at interpreter teardown while gloo threads wound down
    # (tests/helpers.finish_ranks), which would fail a run whose results are all written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children first found, then theirs)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return children + [d for child in children for d in descendants(child)]


def launch_ranks(script: Path, config_file: Path, args: list[str], result: Path, timeout: float, env: dict) -> list:
    """
    Run `script args` under `accelerate launch --config_file config_file` (its ranks on this machine's CPU), and return
    what the ranks wrote to `result` (`write_gathered_and_finish`). Raises with the ranks' output on failure or after
    `timeout` seconds, killing every rank left.
    """
    env = {**env, "ACCELERATE_USE_CPU": "true"}  # the multi-process launcher does not forward use_cpu
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file)]
    cmd += ["--main_process_port", str(free_port()), str(script), *args]
    label = " ".join(args)
    # Output goes to a file, not a pipe: ranks left behind by a killed launcher would hold a pipe open.
    log = result.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # The ranks run in sessions of their own: kill them by id, then the launcher.
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{label} timed out after {timeout}s:\n{log.read_text()[-4000:]}") from None
    stderr = log.read_text()
    if proc.returncode != 0 or not result.is_file():
        # The ranks' lines carry a Python error; a rank that died without one (a signal) shows only in the
        # launcher's closing summary, which names each rank's exit code.
        rank_lines = [line for line in stderr.splitlines() if line.startswith("[rank")]
        summary = stderr[stderr.rfind("Failures:") :] if "Failures:" in stderr else stderr[-3000:]
        detail = "\n".join(rank_lines[-60:]) + "\n" + summary
        raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{detail}")
    return json.loads(result.read_text())
