"""How long host offload takes per step in the plan (`layerwise_hf.plan.offload_time`, `layerwise-hf plan --offload`):
the host step's seconds, the PCIe bytes and seconds, the bottleneck; and the host seconds against a real host step."""

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import PLAN_LLAMA

from layerwise_hf.cli import main
from layerwise_hf.placement.offload import HostWorker
from layerwise_hf.plan import offload_time as offload_time_module
from layerwise_hf.plan.offload_time import (
    CALIBRATION_CAP,
    HostRate,
    host_step_seconds,
    offload_time,
    stepped_tensors,
    worker_seconds,
)


def model_shapes(config: dict) -> list[tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return [tuple(p.shape) for p in model.parameters()]


@pytest.fixture
def pool_cost(monkeypatch, tmp_path):
    """The calibration's measurement replaced by a known cost: 50 us per tensor + 1 ns per element; calls recorded."""
    calls = []

    def fake(optimizer, dtype, shape, pool, threads, repeats):
        calls.append((shape, pool))
        return 50e-6 + math.prod(shape) * 1e-9

    monkeypatch.setattr(offload_time_module, "_pool_seconds", fake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return calls


def test_the_optimizer_row_costs_its_elements_at_the_rate_and_names_the_bottleneck():
    gib = 2**30
    slow = offload_time("optimizer", elements=8 * 10**9, tensors=291, grad_bytes=16 * gib, param_bytes=16 * gib,
                        rate=HostRate(7.5, 50.0), backward_s=1.0)  # fmt: skip
    assert slow.host_step_s == pytest.approx(8e9 * 7.5e-9 + 291 * 50e-6)
    assert (slow.bytes_out, slow.bytes_in) == (16 * gib, 16 * gib)
    assert slow.copy_out_s == pytest.approx(16 * gib / 25e9)
    assert slow.bottleneck == "host step" and "the host step, 60.0 s per step, sets the pace" in slow.advice()
    fast = offload_time("optimizer", elements=10**6, tensors=1, grad_bytes=2 * 10**6, param_bytes=2 * 10**6,
                        rate=HostRate(1.0), backward_s=1.0)  # fmt: skip
    assert fast.bottleneck == "backward" and fast.advice() is None
    link = offload_time("gradients", elements=10**9, tensors=1, grad_bytes=100 * gib, param_bytes=0,
                        rate=HostRate(1.0), backward_s=0.1, grad_accum=2)  # fmt: skip
    assert link.host_step_s == 0 and link.bytes_out == 200 * gib and link.bytes_in == 100 * gib
    assert link.bottleneck == "PCIe" and link.advice().startswith("PCIe")
    assert (
        offload_time("optimizer", elements=1, tensors=1, grad_bytes=1, param_bytes=1, rate=HostRate(1.0)).advice()
        is None
    )


def test_gradient_accumulation_adds_the_host_workers_adds_to_its_time():
    # Each later micro-batch's gradients are added into their host sums by the host worker, the one that steps: at
    # 7-8B under DDP, seconds per micro-batch, which the host step alone did not show.
    gib = 2**30
    rows = {ga: offload_time("optimizer", elements=8 * 10**9, tensors=291, grad_bytes=32 * gib, param_bytes=32 * gib,
                             rate=HostRate(0.2), backward_s=2.0 * ga, grad_accum=ga, add_ns_per_element=0.4)
            for ga in (1, 4)}  # fmt: skip
    assert rows[1].host_add_s == 0 and rows[1].bottleneck == "backward"
    assert rows[4].host_add_s == pytest.approx(3 * 8e9 * 0.4e-9) and rows[4].host_step_s == pytest.approx(1.6)
    assert rows[4].bottleneck == "host step" and "adds of accumulated gradients, 9.6 s" in rows[4].advice()
    assert "host adds 9.60 s" in rows[4].describe()
    gradients = offload_time("gradients", elements=10**9, tensors=1, grad_bytes=4 * gib, param_bytes=0,
                             rate=HostRate(0.0), grad_accum=3, add_ns_per_element=0.5)  # fmt: skip
    assert gradients.host_add_s == pytest.approx(1.0)


def test_the_host_add_rate_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(offload_time_module, "CALIBRATION_CAP", 2**20)
    rate = offload_time_module.host_add_rate()
    assert 0.0 < rate < 100.0  # ns per element: a memory-bound add
    measured = []
    monkeypatch.setattr(offload_time_module, "worker_seconds", lambda *a: measured.append(a) or 1.0)
    assert offload_time_module.host_add_rate() == rate and not measured


def test_cli_gives_each_offload_row_its_time(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PLAN_LLAMA))
    argv = ["plan", str(config), "--seq-len", "16", "--device", "cpu", "--offload", "optimizer", "gradients"]
    rate = ["--host-step-rate", "2.0", "--pcie-gbps", "10"]
    assert main([*argv, *rate, "--device-tflops", "1e-6", "--json"]) == 0
    rows = {(r["optimizer"], r["offload"]): r for r in json.loads(capsys.readouterr().out)["optimizers"]}
    timed = rows[("adamw_torch_layerwise", "optimizer")]["offload_time"]
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PLAN_LLAMA))
    elements = sum(p.numel() for p in model.parameters())
    assert timed["host_elements"] == elements and timed["host_step_s"] == pytest.approx(elements * 2e-9)
    assert timed["bytes_in"] == 4 * elements and timed["pcie_gbps"] == 10 and timed["bottleneck"] == "backward"
    assert "offload_time" not in rows[("adamw_torch", "none")]
    assert main([*argv, *rate]) == 0
    out = capsys.readouterr().out
    assert "offload optimizer: host step" in out and "backward not estimated" in out


def test_the_host_step_costs_each_tensor_at_its_own_shape_and_measures_each_shape_once(pool_cost):
    shapes = [4096] * 10 + [(1024, 1024)] * 3 + [(3 * 4096, 4096)]
    seconds, source = host_step_seconds(shapes)
    # A fixed cost per tensor, elements at their shape's rate; beyond the cap, its first rows' step scaled by size.
    rows = 50e-6 + CALIBRATION_CAP * 1e-9
    assert seconds == pytest.approx(10 * (50e-6 + 4096e-9) + 3 * (50e-6 + 2**20 * 1e-9) + 3 * rows)
    assert source == "measured" and len(pool_cost) == 3
    # Each shape is stepped with as many elements in play as the model's step has (up to the cap): caches as in a run.
    assert dict(pool_cost) == {(4096,): 256, (1024, 1024): 16, (CALIBRATION_CAP // 4096, 4096): 1}
    assert host_step_seconds(shapes) == (seconds, "cached") and len(pool_cost) == 3


def test_the_plan_times_the_models_own_tensors(pool_cost, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PLAN_LLAMA))
    shapes = model_shapes(PLAN_LLAMA)
    elements = sum(math.prod(s) for s in shapes)
    setup = SimpleNamespace(lora_r=None, lora_targets=(), sharding="none", world_size=1, shards=1)
    result = SimpleNamespace(source=str(config), model="tiny", setup=setup)
    assert stepped_tensors(result, elements) == shapes
    assert stepped_tensors(result, 2 * elements) is None  # the sizes must add up to what the simulation kept
    assert stepped_tensors(SimpleNamespace(source="", model="no-such-model", setup=setup), elements) is None
    sharded = SimpleNamespace(**{**vars(setup), "sharding": "fsdp2", "world_size": 2, "shards": 2})
    halves = stepped_tensors(SimpleNamespace(source=str(config), model="tiny", setup=sharded), elements // 2)
    assert halves == [(s[0] // 2, *s[1:]) for s in shapes]  # this rank's dim-0 shard of each
    lora = SimpleNamespace(lora_r=4, lora_targets=("q_proj", "v_proj"), sharding="none", world_size=1, shards=1)
    adapters = stepped_tensors(SimpleNamespace(source=str(config), model="tiny", setup=lora), 2 * 2 * 4 * 128)
    assert adapters == [(4, 64), (64, 4)] * 4  # lora_A and lora_B on q and v of 2 layers


def test_cli_plans_the_host_step_from_the_models_tensors(pool_cost, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PLAN_LLAMA))
    argv = ["plan", str(config), "--seq-len", "16", "--device", "cpu", "--offload", "optimizer", "--json"]
    assert main(argv) == 0
    rows = {(r["optimizer"], r["offload"]): r for r in json.loads(capsys.readouterr().out)["optimizers"]}
    timed = rows[("adamw_torch_layerwise", "optimizer")]["offload_time"]
    sizes = [math.prod(s) for s in model_shapes(PLAN_LLAMA)]
    assert timed["host_tensors"] == len(sizes) and timed["host_elements"] == sum(sizes)
    assert timed["host_step_s"] == pytest.approx(sum(50e-6 + n * 1e-9 for n in sizes))


def test_worker_seconds_counts_the_workers_cpu_time_on_one_thread_and_wall_time_on_several():
    # A task that waits uses no CPU: on one thread the pass costs what the host's core does, not what the clock
    # shows (on a shared machine other processes' time slices are in the clock).
    worker = HostWorker()
    try:
        assert worker_seconds(worker, [lambda: time.sleep(0.05)], threads=1, repeats=1) < 0.01
        assert worker_seconds(worker, [lambda: time.sleep(0.05)], threads=2, repeats=1) >= 0.05
    finally:
        worker.close()


def real_backward_flops(config: dict, seq_len: int, checkpointing: bool) -> int:
    """FLOPs of one backward of the model built from `config`, real tensors, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, config["vocab_size"], (1, seq_len))
    loss = model(input_ids=ids, labels=ids).loss
    counter = FlopCounterMode(display=False)
    with counter:
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("layers, checkpointing", [(2, True), (8, False)], ids=["checkpointed", "extrapolated"])
def test_backward_seconds_are_the_counted_flops_of_the_models_backward(tmp_path, capsys, layers, checkpointing):
    # The device's backward in the time per step: the simulated step's backward FLOPs, counted from the ops' shapes on
    # fake tensors, equal those of a real backward of the model (activation checkpointing's recompute counted; 8
    # layers: on the line of the 2-, 3- and 4-layer copies).
    config = {**PLAN_LLAMA, "num_hidden_layers": layers}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["plan", str(path), "--seq-len", "16", "--device", "cpu", "--offload", "optimizer", "--json"]
    argv += ["--host-step-rate", "2.0", "--device-tflops", "1e-6"] + (
        ["--gradient-checkpointing"] if checkpointing else []
    )
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["extrapolated_layers"] is (layers == 8)
    row = next(r for r in payload["optimizers"] if r["offload"] == "optimizer")
    flops = real_backward_flops(config, 16, checkpointing)
    assert row["backward_flops"] == flops
    assert row["offload_time"]["backward_s"] == pytest.approx(flops / 1e6)
