"""Meshes past flat FSDP2: global norms over DTensors of several meshes (as Trainer's `_mixed_mesh_grad_norm`), the
clip coefficient on plain and DTensor gradients, the CPU shim for Accelerate's `ParallelismConfig` check, and real
4-rank launches (tensor parallel x FSDP2, tensor parallel alone, HSDP 2x2 made at the load and through
`ParallelismConfig`) against stock Trainer; 8-bit and factored states under tensor parallel against the same optimizer
applied by hand on each shard."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_distributed import ROOT, launch

from layerwise_hf.platform.norms import grad_norm_kernel, scale_grad, total_norm


@pytest.mark.slow
def test_tensor_parallel_and_hsdp_match_stock_trainer_on_four_ranks(tmp_path):
    report = launch(
        "configs/accelerate/cpu_ddp.yaml",
        "tests/distributed/meshes.py",
        tmp_path / "r.json",
        {"LAYERWISE_HF_FORCE_FSDP_CPU": "1", "LAYERWISE_HF_FORCE_MESH_CPU": "1"},
        launch_args=["--num_processes", "4"],
    )
    assert report["world_size"] == 4
    compared = [c for c in report["results"] if "max_diff" in c]
    assert len(compared) == 14, [c["case"] for c in compared]
    meshes = {
        "tp_fsdp": [("fsdp",), ("fsdp", "tp")],  # norm weights on (fsdp,), projections on (fsdp, tp)
        "tp": [(), ("tp",)],  # norm weights stay plain tensors
        "hsdp_load": [("dp_replicate", "fsdp")],  # DistributedConfig(dp_replicate_size=2, fsdp_size=2)
        "hsdp": [("dp_replicate", "dp_shard_cp")],  # ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    }
    for case in compared:
        standard_norms, layerwise_norms = case["grad_norm"]
        assert case["max_diff"] == 0.0, case
        assert standard_norms == layerwise_norms and len(layerwise_norms) == 3, case
        assert case["loss_equal"] and case["lr_equal"] and case["ranks_agree"], case
        expected = meshes[case["case"].split()[0]]
        assert case["meshes"] == [[list(m) for m in expected]] * 2, case
        if case["max_grad_norm"]:
            # The clip coefficient really scaled the gradients (a norm above max_grad_norm) in every case that clips.
            assert max(standard_norms) > case["max_grad_norm"], case
    # The planner's rank against the real rank 0: its optimizer state (AdamW's moments and steps on its local shards)
    # byte for byte, for each layout as `layerwise-hf plan` takes it.
    from layerwise_hf.plan import plan

    layouts = {"tp_fsdp": dict(tp=2), "tp": dict(tp=4), "hsdp": dict(dp_replicate=2)}
    options = dict(seq_len=8, micro_batch=2, device="cpu", max_grad_norm=0.0, clip_mode="off", counterparts=False)
    for mesh, layout in layouts.items():
        real = next(c for c in compared if c["case"] == f"{mesh} adamw_torch ga1 clip0.0")["standard_state_bytes"]
        planned = plan(report["model"], ["adamw_torch"], world_size=4, sharding="fsdp2", **layout, **options)
        assert planned.row("adamw_torch").categories["optimizer_state"] == real > 0, (mesh, real)
    previous = next(c for c in report["results"] if c["case"] == "previous tp_fsdp")
    assert previous["ranks_agree"] and len(previous["loss"]) == 3, previous
    assert all(torch.isfinite(torch.tensor(previous["loss"] + previous["grad_norm"]))), previous
    check_local_shards([c for c in report["results"] if c["case"].startswith("local_shard")])


def check_local_shards(cases):
    # Stock bitsandbytes and Adafactor cannot step these DTensors: each rank's shard is checked against the same
    # optimizer applied by hand on that shard and its gradients instead, for every trainable parameter.
    assert [c["case"].split()[1:3] for c in cases] == [
        ["tp_fsdp", "adamw_8bit"],
        ["tp", "adamw_8bit"],
        ["tp_fsdp", "adafactor"],
    ]
    for case in cases:
        assert case["hand_max_diff"] == 0.0 and case["stepped"] == 21 and case["ranks_agree"], case
        assert all(torch.isfinite(torch.tensor(case["loss"] + case["grad_norm"]))), case
        # State saved (DCP) at step 2 and loaded into optimizers that had dropped theirs: the same weights at step 3.
        assert case["resume_max_diff"] == 0.0, case
    eight_bit_tp_fsdp, eight_bit_tp, _ = cases
    assert eight_bit_tp_fsdp["meshes"] == [["fsdp"], ["fsdp", "tp"]] and eight_bit_tp["meshes"] == [[], ["tp"]]
    # lm_head's shards (256 x 32) reach min_8bit_size; the embedding keeps 32-bit states, as Trainer sets.
    assert eight_bit_tp_fsdp["eight_bit_states"] == eight_bit_tp["eight_bit_states"] == 1
    # The same number of shards (4) cut another way: TP 2 x FSDP2 2's state refused on TP 4, before anything loads.
    (refusal,) = eight_bit_tp["refusals"]
    assert "nothing was loaded" in refusal and "cannot resume on shards cut as Shard(dim=0)x4" in refusal, refusal


def test_norms_on_two_meshes_are_totalled_per_mesh_as_trainer_does(tmp_path):
    # One process stands in for a mesh: DTensors on two 1-rank meshes of one gloo group are still two meshes.
    script = textwrap.dedent(
        """
        import json, sys
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.nn.utils import get_total_norm
        from layerwise_hf.platform.norms import grad_norm_kernel, scale_grad, total_norm

        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
        two_d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("fsdp", "tp"))
        one_d = two_d["fsdp"]
        g = torch.Generator().manual_seed(0)
        plain = [torch.randn(5, generator=g), torch.randn(3, 2, generator=g)]
        grads = [
            DTensor.from_local(torch.randn(4, 4, generator=g), two_d, [Shard(0), Shard(1)]),
            DTensor.from_local(torch.randn(4, generator=g), one_d, [Shard(0)]),
            plain[0],
            DTensor.from_local(torch.randn(2, 4, generator=g), two_d, [Shard(0), Replicate()]),
            plain[1],
        ]
        cpu = torch.device("cpu")
        ours = total_norm([(cpu, t.dtype, grad_norm_kernel(t)) for t in grads])
        # transformers 5.24's Trainer._mixed_mesh_grad_norm, written out: meshes in first-gradient order.
        groups = {}
        for t in grads:
            groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
        norms = [get_total_norm(ts) for ts in groups.values()]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        theirs = torch.linalg.vector_norm(torch.stack(norms))
        coef = torch.clamp(1.0 / (ours + 1e-6), max=1.0)
        for t in grads:
            scale_grad(t, coef)
        # A DTensor coefficient (one mesh's) on a plain gradient and on another mesh's gradient.
        one_mesh = total_norm([(cpu, t.dtype, grad_norm_kernel(t)) for t in grads[:1]])
        scale_grad(plain[0], one_mesh)
        scale_grad(grads[1], one_mesh)
        json.dump({
            "ours": ours.item(), "theirs": theirs.item(), "plain_result": type(ours).__name__,
            "plain_grad_still_plain": not isinstance(plain[0], DTensor),
        }, open(sys.argv[2], "w"))
        dist.destroy_process_group()
        """
    )
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script, str(port), str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ours"] == report["theirs"], report
    assert report["plain_result"] == "Tensor" and report["plain_grad_still_plain"], report


def test_one_mesh_keeps_clip_grad_norm_order_and_scale_grad_matches_mul():
    grads = [torch.randn(7), torch.randn(3, 3).bfloat16(), torch.randn(2)]
    cpu = torch.device("cpu")
    ours = total_norm([(cpu, t.dtype, grad_norm_kernel(t)) for t in grads])
    copies = [t.clone().requires_grad_() for t in grads]
    for c, t in zip(copies, grads):
        c.grad = t.clone()
    assert torch.equal(ours, torch.nn.utils.clip_grad_norm_(copies, 1.0))
    coef = torch.clamp(1.0 / (ours + 1e-6), max=1.0)
    for c, t in zip(copies, grads):
        scale_grad(t, coef)
        assert torch.equal(t, c.grad)


def test_mesh_shim_lets_parallelism_config_through_on_cpu_ranks_only_for_a_mesh(tmp_path):
    # Accelerate refuses a ParallelismConfig on MULTI_CPU; the shim widens that check alone, in a fresh process (it
    # patches a class for the process's life).
    script = textwrap.dedent(
        """
        import types
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DistributedType

        def accelerator():
            return types.SimpleNamespace(
                distributed_type=DistributedType.MULTI_CPU, multi_device=False, is_fsdp2=False, num_processes=4,
                is_main_process=True,
            )

        config = ParallelismConfig(dp_shard_size=2, tp_size=2)
        try:
            config._validate_accelerator(accelerator())
            print("stock accepted")
        except ValueError as err:
            print("stock refused:", "MULTI_CPU" in str(err))
        from layerwise_hf.routes.distributed import force_mesh_on_cpu
        force_mesh_on_cpu(); force_mesh_on_cpu()
        config._validate_accelerator(accelerator())
        print("shim accepted", config.dp_shard_size, config.tp_size)
        single = ParallelismConfig()
        single._validate_accelerator(accelerator())
        print("size 1 untouched", single.dp_replicate_size)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines == ["stock refused: True", "shim accepted 2 2", "size 1 untouched 1"], result.stdout


@pytest.mark.parametrize("optimizer", ["adamw_torch", "adamw_torch_layerwise"])
def test_plan_advice_names_only_optimizers_the_plan_itself_runs(optimizer):
    import re

    from layerwise_hf.plan.advice import advise
    from layerwise_hf.plan.core import PlanRow
    from layerwise_hf.plan.ranks import fsdp2_refusal
    from layerwise_hf.plan.simulate import StepSetup

    cats = dict(weights=4, gradients=4, optimizer_state=30, activations=1, temporaries=1)
    row = PlanRow(optimizer, 40, cats, "step", False)

    def named(setup):
        (text,) = [t for t in advise(row, setup) if t.startswith("optimizer state dominates")]
        return re.findall(r"\b(?:adamw_8bit|adafactor)\w*", text)

    sharded = named(StepSetup(world_size=8, sharding="fsdp2"))
    assert sharded and all(fsdp2_refusal(name) is None for name in sharded), sharded
    # Under tensor parallel too LayerwiseTrainer steps the local shards, where stock bitsandbytes fails.
    assert named(StepSetup(world_size=8, sharding="fsdp2", tp=2)) == sharded
    # On one process the standard row keeps the standard names: stock bitsandbytes runs there.
    assert named(StepSetup()) == (["adamw_8bit", "adafactor"] if optimizer == "adamw_torch" else sharded)


def test_plan_hsdp_rank_is_an_fsdp2_rank_of_its_shard_group_and_takes_tensor_parallel():
    from helpers import PLAN_LLAMA

    from layerwise_hf.estimate import EstimateError
    from layerwise_hf.plan import plan

    small = dict(seq_len=16, device="cpu", max_grad_norm=0.0, clip_mode="off")
    hsdp = plan(PLAN_LLAMA, ["adamw_torch"], world_size=4, sharding="fsdp2", dp_replicate=2, **small)
    fsdp2 = {n: plan(PLAN_LLAMA, ["adamw_torch"], world_size=n, sharding="fsdp2", **small) for n in (2, 4)}
    for name in ("adamw_torch", "adamw_torch_layerwise"):
        row = hsdp.row(name)
        # Shards of 2, not of 4: a replica holds the whole model over its 2 ranks.
        assert row.categories == fsdp2[2].row(name).categories, name
        assert row.categories != fsdp2[4].row(name).categories, name
    assert "per rank, 1 of 4 (HSDP: 2 replicas x 2 FSDP2 shards)" in hsdp.format()
    bad_layouts = [("ddp", 4, 2), ("fsdp2", 4, 3), ("fsdp2", 2, 2)]  # not FSDP2; not a multiple; 1 shard per replica
    for sharding, world_size, dp_replicate in bad_layouts:
        bad = dict(world_size=world_size, sharding=sharding, dp_replicate=dp_replicate)
        with pytest.raises(EstimateError, match="dp_replicate"):
            plan(PLAN_LLAMA, ["adamw_torch"], **bad, **small)
    for bad in (dict(world_size=4, sharding="ddp", tp=2), dict(world_size=6, sharding="fsdp2", tp=4)):
        with pytest.raises(EstimateError, match="tp="):
            plan(PLAN_LLAMA, ["adamw_torch"], **bad, **small)
    import transformers

    if not hasattr(transformers, "DistributedConfig"):  # transformers 4.x: no tensor parallel at load to simulate
        with pytest.raises(EstimateError, match="DistributedConfig"):
            plan(PLAN_LLAMA, ["adamw_torch"], world_size=4, sharding="fsdp2", tp=2, counterparts=False, **small)
        return
    tp = plan(PLAN_LLAMA, ["adamw_torch"], world_size=4, sharding="fsdp2", tp=2, counterparts=False, **small)
    assert "per rank, 1 of 4 (tensor parallel 2 x 2 FSDP2 shards)" in tp.format()
    eight_bit = plan(PLAN_LLAMA, ["adamw_8bit_layerwise"], world_size=4, sharding="fsdp2", tp=2, **small)
    assert eight_bit.row("adamw_8bit_layerwise").categories["optimizer_state"] > 0


def test_estimate_hsdp_device_holds_its_replicas_share():
    from layerwise_hf.estimate import EstimateError, estimate

    for optimizer in ("adamw_torch", "adamw_8bit_layerwise", "adamw_torch_layerwise"):
        hsdp = estimate("llama-3-70b", optimizer=optimizer, world_size=16, sharding="fsdp2", dp_replicate=2)
        eight = estimate("llama-3-70b", optimizer=optimizer, world_size=8, sharding="fsdp2")
        sixteen = estimate("llama-3-70b", optimizer=optimizer, world_size=16, sharding="fsdp2")
        assert hsdp.per_gpu_bytes == eight.per_gpu_bytes > sixteen.per_gpu_bytes, optimizer
        assert hsdp.total_bytes == sixteen.total_bytes and hsdp.to_dict()["dp_replicate"] == 2
    with pytest.raises(EstimateError, match="dp_replicate"):
        estimate("llama-3-70b", world_size=16, sharding="ddp", dp_replicate=2)
