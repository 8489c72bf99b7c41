"""`layerwise-hf plan --world-size N --sharding {ddp,fsdp2}`: one rank simulated with a fake process group. FSDP2's
shards byte-exact against the padded local shards, DDP's buckets, the layer-wise DDP route holding fewer gradients,
the layer extrapolation against the full simulation, a real 2-rank gloo run, and bad input refused before any
simulation."""

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import PLAN_LLAMA

from layerwise_hf.cli import main
from layerwise_hf.estimate import EstimateError
from layerwise_hf.plan import core as plan_core
from layerwise_hf.plan import plan

LLAMA = PLAN_LLAMA
# Gradients of several DDP buckets (25 MiB each): 4 layers of 16.8 MiB.
BIG = dict(LLAMA, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8)  # fmt: skip
SMALL = dict(seq_len=16, device="cpu", max_grad_norm=0.0, clip_mode="off")


def shapes(dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    from layerwise_hf.platform.compat import dtype_kwargs

    config = AutoConfig.for_model(**LLAMA)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(dtype))
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return params, buffers


def shard_bytes(world_size: int, element: int = 4) -> int:
    """What FSDP2 gives a rank: dim 0 cut into `world_size` chunks, every rank's padded to the first's size."""
    params, _ = shapes()
    return sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) * element for s in params.values())


def full_bytes(element: int = 4) -> int:
    params, _ = shapes()
    return sum(math.prod(s) * element for s in params.values())


def test_fsdp2_rank_holds_its_padded_shards():
    params, buffers = shapes()
    result = plan(LLAMA, ["adamw_torch"], counterparts=False, world_size=3, sharding="fsdp2", **SMALL)
    row = result.row("adamw_torch")
    between = row.between_steps
    # 3 does not divide 64-row tensors: FSDP2 pads each rank's chunk to the first's (22 rows, not 64 / 3).
    assert between["weights"] == shard_bytes(3) + buffers
    assert between["weights"] != full_bytes() // 3 + buffers
    # AdamW: exp_avg and exp_avg_sq of the local shard, and a float32 step per tensor.
    assert between["optimizer_state"] == 2 * shard_bytes(3) + 4 * len(params)
    assert between["gradients"] == 0
    # At the peak a CUDA rank (NCCL) also holds all-gathered (unsharded) weights, less than the whole model; a CPU
    # rank (gloo) holds gloo's all-gather buffers on top (test_fsdp2_collectives_hold_gloos_buffers_on_cpu_ranks_only).
    cuda = plan(
        LLAMA, ["adamw_torch"], counterparts=False, world_size=3, sharding="fsdp2", **dict(SMALL, device="cuda")
    )
    assert shard_bytes(3) < cuda.rows[0].categories["weights"]
    from importlib.metadata import version

    from packaging.version import Version

    # NOTE: with accelerate 1.10 (the oldest tested combination) the planned peak holds 897,792 bytes of weights here,
    # more than the whole model (664,832): not explained yet (its fsdp2_prepare_model differs); the bound holds from
    # the default combination's accelerate 1.15 on.
    if Version(version("accelerate")) >= Version("1.15"):
        assert cuda.rows[0].categories["weights"] < full_bytes()
    one = plan(LLAMA, ["adamw_torch"], counterparts=False, **SMALL).row("adamw_torch")
    assert row.peak_bytes < one.peak_bytes


def test_fsdp2_mixed_precision_keeps_float32_shards():
    # Accelerate upcasts trainable bf16 weights to float32 master shards under mixed precision (fsdp2_prepare_model).
    _, buffers = shapes(torch.bfloat16)
    result = plan(LLAMA, ["adamw_torch"], world_size=2, sharding="fsdp2", bf16=True, torch_dtype="bfloat16", **SMALL)
    assert result.row("adamw_torch").between_steps["weights"] == shard_bytes(2) + buffers


def test_ddp_adds_its_buckets():
    params, buffers = shapes()
    alone = plan(LLAMA, ["adamw_torch"], counterparts=False, **SMALL).row("adamw_torch")
    ddp = plan(LLAMA, ["adamw_torch"], counterparts=False, world_size=2, sharding="ddp", **SMALL).row("adamw_torch")
    # DDP's buckets hold every gradient for the whole run, and .grad another copy (gradient_as_bucket_view=False).
    assert ddp.between_steps["gradients"] == full_bytes()
    assert alone.between_steps["gradients"] == 0
    assert ddp.categories["gradients"] == alone.categories["gradients"] + full_bytes()
    assert ddp.categories["weights"] == alone.categories["weights"] == full_bytes() + buffers


def test_layerwise_ddp_route_holds_fewer_gradients_than_ddp():
    result = plan(BIG, ["adamw_torch"], world_size=2, sharding="ddp", **SMALL)
    standard, layerwise = result.row("adamw_torch"), result.row("adamw_torch_layerwise")
    assert layerwise.between_steps["gradients"] == 0  # its buckets are freed once stepped
    assert layerwise.categories["gradients"] < standard.categories["gradients"] // 2
    assert layerwise.peak_bytes < standard.peak_bytes
    assert layerwise.saving_bytes == standard.peak_bytes - layerwise.peak_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, sharding, extra",
    [
        # Under DDP, layers of at least DDP's 25 MiB bucket cap each: smaller ones would share buckets differently
        # in every copy of the model (where the layer-wise route frees them), so the copies would not be on one line.
        (dict(LLAMA, hidden_size=2048, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=16), "ddp",
         {}),
        # bf16 with exact clipping: the layer-wise norm pass peaks next to the head's reduce-scatter buffer in the
        # 2-layer copy, so the copies of 3-5 layers are the ones on the line.
        (LLAMA, "fsdp2", dict(bf16=True, torch_dtype="bfloat16", max_grad_norm=1.0, clip_mode="exact")),
    ],
    ids=["ddp", "fsdp2"],
)  # fmt: skip
def test_extrapolated_layers_equal_the_full_simulation(model, sharding, extra):
    deep = dict(model, num_hidden_layers=6)
    options = dict(SMALL, world_size=2, sharding=sharding, gradient_checkpointing=True, **extra)
    quick = plan(deep, ["adamw_torch"], **options)
    full = plan(deep, ["adamw_torch"], extrapolate=False, **options)
    assert quick.extrapolated and not full.extrapolated
    for a, b in zip(quick.rows, full.rows):
        assert (a.peak_bytes, a.categories, a.when, a.between_steps) == (
            b.peak_bytes,
            b.categories,
            b.when,
            b.between_steps,
        )


def test_rule_optimizer_state_is_per_shard():
    # bitsandbytes cannot run on fake tensors: its state comes from the estimator's rule, applied to the local shard.
    ddp = plan(LLAMA, ["adamw_8bit_layerwise"], counterparts=False, world_size=2, sharding="ddp", **SMALL)
    fsdp = plan(LLAMA, ["adamw_8bit_layerwise"], counterparts=False, world_size=2, sharding="fsdp2", **SMALL)
    a = ddp.rows[0].between_steps["optimizer_state"]
    b = fsdp.rows[0].between_steps["optimizer_state"]
    assert fsdp.rows[0].optimizer_state_from_rule
    # More than half: a shard under bitsandbytes' 4096 elements keeps a 32-bit state where the whole tensor would not.
    assert a / 2 < b < a


def test_cli_json_says_world_size_and_sharding(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    args = ["plan", str(config), "--seq-len", "16", "--device", "cpu", "--world-size", "2", "--sharding", "fsdp2"]
    assert main([*args, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["world_size"], payload["sharding"], payload["rank"]) == (2, "fsdp2", 0)
    assert payload["setup"]["world_size"] == 2
    assert set(payload["optimizers"][0]["between_steps"]) == set(payload["optimizers"][0]["categories"])
    assert main(args) == 0
    assert "per rank, 1 of 2 (fsdp2)" in capsys.readouterr().out
    assert not dist.is_initialized()  # the fake process group is gone


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(world_size=0, sharding="ddp"), "world_size=0: the number of ranks"),
        (dict(world_size=2, sharding="zero3"), "sharding='zero3': choose one of none, ddp, fsdp2"),
        (dict(world_size=2), "world_size=2 with sharding='none': choose sharding 'ddp' or 'fsdp2'"),
        (dict(world_size=1, sharding="ddp"), "sharding='ddp' with world_size=1"),
        (dict(world_size=2, sharding="fsdp2", optimizers=["muon_layerwise"]), "muon_layerwise: the route table"),
        (dict(world_size=2, sharding="fsdp2", optimizers=["adafactor"]), "adafactor: it cannot step FSDP2's DTensors"),
    ],
)
def test_bad_input_is_refused_before_any_simulation(options, message, monkeypatch):
    monkeypatch.setattr(plan_core, "simulate_all", lambda *a, **k: pytest.fail("simulated"))
    optimizers = options.pop("optimizers", ["adamw_torch"])
    with pytest.raises(EstimateError, match=message):
        plan(LLAMA, optimizers, **options, **SMALL)


def test_fsdp2_leaves_out_a_counterpart_it_cannot_step(monkeypatch):
    # Asked for by name, a form FSDP2 cannot step is refused; as the other form's counterpart, it is left out.
    assert plan_core.fsdp2_counterparts(["adamw_torch_4bit", "adamw_torch_4bit_layerwise"], "adamw_torch_4bit",
                                        "fsdp2") == ["adamw_torch_4bit"]  # fmt: skip
    result = plan(LLAMA, ["adafactor_layerwise"], world_size=2, sharding="fsdp2", **SMALL)
    assert [r.optimizer for r in result.rows] == ["adafactor_layerwise"]
    assert result.notes and result.notes[0].startswith("adafactor left out: under FSDP2 it cannot step")
    monkeypatch.setattr(plan_core, "simulate_all", lambda *a, **k: pytest.fail("simulated"))
    with pytest.raises(EstimateError, match="adamw_torch_4bit_layerwise: the route table refuses it"):
        plan(LLAMA, ["adamw_torch_4bit_layerwise"], world_size=2, sharding="fsdp2", **SMALL)


@pytest.mark.slow
def test_inside_a_running_process_group(monkeypatch):
    # A preflight plans from inside a real run, whose process group is the default one: the fake ranks run in a
    # fresh process and give the same figures.
    expected = plan(LLAMA, ["adamw_torch"], counterparts=False, world_size=2, sharding="fsdp2", **SMALL).rows[0]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        row = plan(LLAMA, ["adamw_torch"], counterparts=False, world_size=2, sharding="fsdp2", **SMALL).rows[0]
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1  # the run's own group is untouched
    finally:
        dist.destroy_process_group()
    assert (row.peak_bytes, row.categories, row.between_steps) == (
        expected.peak_bytes,
        expected.categories,
        expected.between_steps,
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fsdp2_collectives_hold_gloos_buffers_on_cpu_ranks_only(device):
    # CPU ranks run gloo: its reduce-scatter all-reduces a clone of the whole input, its all-gather fills a flat
    # tensor of the output's size, each alive while the collective runs. NCCL (CUDA ranks) allocates neither.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    from layerwise_hf.plan.ranks import RankRoute, fake_group
    from layerwise_hf.plan.simulate import StepSetup
    from layerwise_hf.plan.tracker import LiveBytes

    tracker = LiveBytes()
    rank = RankRoute("fsdp2", tracker, StepSetup(device=device, world_size=2, sharding="fsdp2"))
    gloo = device == "cpu"
    with fake_group(2, "fsdp2"), tracker, rank.labels(), torch.no_grad():
        full, shard = torch.empty(3000), torch.empty(1500)  # 12000 and 6000 bytes
        tracker.reset_peak()
        DefaultReduceScatter()(output_tensor=shard, input_tensor=full, group=dist.group.WORLD, op=dist.ReduceOp.SUM)
        assert tracker.peak.total - tracker.current == (12000 if gloo else 0)  # the input's clone
        assert tracker.peak.by_category["gradients"] == (12000 if gloo else 0)
        tracker.reset_peak()
        DefaultAllGather()(output_tensor=full, input_tensor=shard, group=dist.group.WORLD)
        assert tracker.peak.total - tracker.current == (12000 if gloo else 0)  # the output's size, not the input's
        assert tracker.peak.by_category["weights"] == (12000 if gloo else 0)
    # Outside the plan's step, FSDP2's collectives are torch's own again.
    assert {DefaultReduceScatter.__call__.__module__, DefaultAllGather.__call__.__module__} == {
        DefaultAllGather.__module__
    }


# ---- against a real 2-rank run (gloo) ----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_rank(rank: int, world_size: int, port: int, sharding: str, out: str) -> None:
    """A real rank: the model on real tensors, FSDP2 (fully_shard per decoder layer, then the root) or DDP, one AdamW
    step; what stays alive between steps, measured on the tensors themselves."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA))
    forward, buckets = model, {}
    if sharding == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        forward = torch.nn.parallel.DistributedDataParallel(model)

        def hook(group, bucket):
            # DDP's buckets: the reducer's flat gradient buffers, alive for the run.
            buckets[bucket.index()] = bucket.buffer().untyped_storage().nbytes()
            return allreduce_hook(group, bucket)

        forward.register_comm_hook(None, hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 16))
    for _ in range(2):
        forward(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def nbytes(t):
        t = getattr(t, "_local_tensor", t)
        return t.untyped_storage().nbytes()

    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storages[id(getattr(t, "_local_tensor", t).untyped_storage())] = nbytes(t)
    state = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    if rank == 0:
        with open(out, "w") as f:
            result = {"weights": sum(storages.values()), "optimizer_state": state, "gradients": sum(buckets.values())}
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["fsdp2", "ddp"])
def test_matches_a_real_two_rank_run(sharding, tmp_path):
    out = str(tmp_path / "real.json")
    # Ranks started from a fresh interpreter: forked from this one (threads of earlier tests alive) they can deadlock.
    subprocess.run([sys.executable, __file__, sharding, out], check=True, timeout=600)
    real = json.loads(open(out).read())
    row = plan(LLAMA, ["adamw_torch"], counterparts=False, world_size=2, sharding=sharding, **SMALL).rows[0]
    for category in ("weights", "optimizer_state", "gradients"):
        assert row.between_steps[category] == real[category], category


def _real_peak_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """A real FSDP2 rank prepared as Accelerate prepares it (the plan's own `RankRoute.prepare`), eight AdamW steps as
    Trainer runs them; each later step's peak of the CPU allocator counted on every thread (gloo's worker threads
    included), from before the model exists."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._thread_memory import CountingAllocator

    counter = CountingAllocator()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from transformers import AutoConfig, AutoModelForCausalLM

    from layerwise_hf.plan.ranks import RankRoute
    from layerwise_hf.plan.simulate import StepSetup

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA))
    model = RankRoute("fsdp2", None, StepSetup(device="cpu", world_size=2, sharding="fsdp2")).prepare(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks = []
    for _ in range(8):
        counter.reset_peak()
        ids = torch.randint(0, LLAMA["vocab_size"], (1, SMALL["seq_len"]))
        model(input_ids=ids, labels=ids).loss.backward()
        del ids
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peaks.append(counter.peak())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_peaks": peaks[1:]}, f)  # the first step creates AdamW's states
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(not __import__("shutil").which("c++"), reason="the counting allocator needs a C++ compiler")
@pytest.mark.skipif(
    not torch.__version__.startswith("2.13"),
    reason="gloo's collective buffers were measured on torch 2.13; torch 2.14's gloo rank peaks 6% higher here (not "
    "modelled yet)",
)
def test_cpu_plan_matches_the_peak_of_a_real_gloo_fsdp2_run(tmp_path):
    # The peak of a real gloo rank includes gloo's collective buffers; the plan for CPU ranks counts them.
    out = str(tmp_path / "real.json")
    subprocess.run([sys.executable, __file__, "peak", out], check=True, timeout=600)
    peaks = json.loads(open(out).read())["step_peaks"]
    row = plan(LLAMA, ["adamw_torch"], counterparts=False, world_size=2, sharding="fsdp2", **SMALL).rows[0]
    # gloo frees a collective's buffers on its worker thread, a little after the collective, so a step where that
    # thread runs late holds them on top of the next allocations (8% here on a quiet machine, 11.5% on a loaded one).
    # The plan frees them when the collective ends, which the least of seven steps' peaks shows.
    assert abs(row.peak_bytes / min(peaks) - 1) <= 0.01, (row.peak_bytes, peaks)


@pytest.mark.slow
def test_llama_2_70b_on_8_fsdp2_ranks_is_fast():
    # Issue 18's target: at most 60 s and 2 GiB RSS on a 2-core CPU. CPU seconds, not wall time: on a shared machine
    # the wall clock measures the neighbours.
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    command = [sys.executable, "-m", "layerwise_hf.cli", "plan", "llama-2-70b", "--optim", "adamw_torch",
               "adamw_8bit_layerwise", "--seq-len", "4096", "--bf16", "--torch-dtype", "bfloat16",
               "--gradient-checkpointing", "--world-size", "8", "--sharding", "fsdp2", "--json"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    payload = json.loads(out)
    assert payload["extrapolated_layers"]
    assert [r["optimizer"] for r in payload["optimizers"]] == [
        "adamw_torch",
        "adamw_torch_layerwise",
        "adamw_8bit_layerwise",
    ]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu <= 60, cpu
    assert after.ru_maxrss * 1024 <= 2 * 2**30  # kilobytes on Linux


@pytest.mark.slow
def test_extrapolation_follows_a_peak_that_moves_with_the_layers():
    # A large vocabulary and small layers under FSDP2: the copies of a few layers peak in backward (the unsharded
    # embedding's gradient), the 16-layer model at the foreach step, whose temporaries grow with every layer.
    model = dict(LLAMA, vocab_size=4096, num_hidden_layers=16)
    options = dict(SMALL, device="cuda", world_size=2, sharding="fsdp2", gradient_checkpointing=True)
    quick = plan(model, ["adamw_torch"], counterparts=False, **options)
    full = plan(model, ["adamw_torch"], counterparts=False, extrapolate=False, **options)
    assert quick.extrapolated
    assert full.rows[0].when == "step: optimizer.step()"
    assert (quick.rows[0].peak_bytes, quick.rows[0].categories, quick.rows[0].when) == (
        full.rows[0].peak_bytes,
        full.rows[0].categories,
        full.rows[0].when,
    )


if __name__ == "__main__":  # the real ranks: SHARDING OUT (test_matches_a_real_two_rank_run), or peak OUT
    worker, args = (_real_peak_rank, ()) if sys.argv[1] == "peak" else (_real_rank, (sys.argv[1],))
    mp.start_processes(worker, args=(2, _free_port(), *args, sys.argv[2]), nprocs=2, start_method="spawn")
