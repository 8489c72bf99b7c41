"""Two `accelerate launch` processes as two nodes of 2 ranks on one machine (`--num_machines 2 --machine_rank r
--main_process_ip 127.0.0.1`), FSDP2 over the 4 gloo ranks: LayerwiseTrainer equals stock Trainer bit for bit."""

import json
import os
import subprocess
import sys
import time

import pytest
from test_distributed import ROOT, free_port


@pytest.mark.slow
def test_two_launchers_as_two_nodes_match_stock_trainer(tmp_path):
    report = tmp_path / "r.json"
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "distributed"), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "LAYERWISE_HF_FORCE_FSDP_CPU": "1",
    }
    port = str(free_port())
    launchers = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
        cmd += [str(ROOT / "configs/accelerate/cpu_fsdp2.yaml"), "--num_machines", "2", "--machine_rank", str(node)]
        cmd += ["--main_process_ip", "127.0.0.1", "--main_process_port", port, "--num_processes", "4"]
        cmd += [str(ROOT / "tests/distributed/two_nodes.py"), str(report)]
        with open(tmp_path / f"node{node}.log", "w") as log:
            launchers.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 600
    try:
        while any(p.poll() is None for p in launchers) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in launchers):
                break  # one node failed: the other would wait for it until its rendezvous times out
            time.sleep(1)
    finally:
        # torchrun's agent ends its ranks (each in a session of its own) on SIGTERM; SIGKILL would orphan them.
        for p in launchers:
            if p.poll() is None:
                p.terminate()
        for p in launchers:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    codes = [p.returncode for p in launchers]
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert codes == [0, 0], logs
    result = json.loads(report.read_text())
    assert result["world_size"] == 4
    # Two launchers of 2 ranks each: ranks 0-1 on node 0, ranks 2-3 on node 1.
    ranks = result["ranks"]
    assert [(r["RANK"], r["GROUP_RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) for r in ranks] == [
        (0, 0, 0, 2),
        (1, 0, 1, 2),
        (2, 1, 0, 2),
        (3, 1, 1, 2),
    ], ranks
    assert ranks[0]["launcher"] == ranks[1]["launcher"] != ranks[2]["launcher"] == ranks[3]["launcher"], ranks
    assert [c["case"] for c in result["results"]] == ["adamw_torch ga1", "adamw_torch ga2 clip1.0"]
    for case in result["results"]:
        standard_norms, layerwise_norms = case["grad_norm"]
        assert case["max_diff"] == 0.0 and standard_norms == layerwise_norms and len(layerwise_norms) == 3, case
        assert case["lr_equal"] and case["ranks_agree"] and case["fully_sharded"], case
        assert case["route"] == "fsdp2", case
        if case["max_grad_norm"]:
            assert max(standard_norms) > case["max_grad_norm"], case  # the clip really scaled the gradients
