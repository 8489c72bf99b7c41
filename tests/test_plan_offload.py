"""`plan(offload=...)` / `layerwise-hf plan --offload`: the real offload code simulated on fake tensors, with the
device side and the host side counted apart; checked against a real CPU run's host storages
(LAYERWISE_HF_OFFLOAD_SIMULATE=1: separate host buffers) and the estimator. Also: a plan leaves the caller's config
alone, and a direct call inside a launched run (rendezvous variables set) plans as one process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import PLAN_LLAMA, TokenDataset, clone, tiny_llama, train, training_args
from transformers import AutoConfig

from layerwise_hf.cli import main
from layerwise_hf.estimate import EstimateError, estimate
from layerwise_hf.estimate.units import format_bytes
from layerwise_hf.optim.optimizer import offload_of
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.host_step import HostStepOptimizer
from layerwise_hf.plan import plan

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import plan_accuracy  # noqa: E402

LLAMA = PLAN_LLAMA
MODES = ("none", "gradients", "optimizer")


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _persistent(row) -> int:
    """Host bytes that live for the whole run: buffers, parameter copies and states (temporaries aside)."""
    return sum(row.host_categories[c] for c in ("weights", "gradients", "optimizer_state"))


@pytest.mark.parametrize("mode, ga, clip", [("optimizer", 1, 0.0), ("optimizer", 2, 1.0), ("gradients", 2, 0.0)])
def test_host_side_matches_a_real_offload_run(tmp_path, monkeypatch, mode, ga, clip):
    monkeypatch.setenv(transfer_module.SIMULATE_ENV, "1")
    model = tiny_llama()
    common = dict(gradient_accumulation_steps=ga, max_grad_norm=clip, per_device_train_batch_size=2, max_steps=2)
    args = training_args(tmp_path, "adamw_torch_layerwise", layerwise_offload=mode, **common)
    trainer = train(clone(model), args, dataset=TokenDataset(n=16))
    layerwise = trainer.layerwise_optimizer
    offload = offload_of(layerwise)
    hosted = [inner for inner in layerwise.inner if isinstance(inner, HostStepOptimizer)]
    real_states = sum(_nbytes(t) for i in hosted for s in i.base.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))  # fmt: skip
    real_copies = sum(_nbytes(i.host) for i in hosted)
    real_grads = sum(_nbytes(b) for b in offload.host.values()) + offload.staging_bytes()
    shared = {id(b) for b in offload.host.values()}  # a host step's gradient buffer is the offload's, when it has one
    real_grads += sum(
        _nbytes(i.host_grad) for i in hosted if i.host_grad is not None and id(i.host_grad) not in shared
    )

    config = model.config
    seq = TokenDataset(n=1)[0]["input_ids"].numel()
    result = plan(config, ["adamw_torch_layerwise"], counterparts=False, seq_len=seq, micro_batch=2, grad_accum=ga,
                  max_grad_norm=clip, device="cpu", offload=mode)  # fmt: skip
    (row,) = result.rows
    assert row.offload == mode
    assert row.host_categories["optimizer_state"] == real_states
    assert row.host_categories["weights"] == real_copies
    # The persistent host gradient buffers, and at GA > 1 the staging buffers (kept for the run, as many as the bound).
    assert row.host_categories["gradients"] == real_grads
    assert (offload.staging_bytes() == 2 * max(_nbytes(p) for p in model.parameters())) == (ga > 1)
    if mode == "optimizer":
        assert row.categories["optimizer_state"] == 0 and real_states > 0
    est = estimate(config, optimizer="adamw_torch_layerwise", offload=mode, gradient_accumulation_steps=ga,
                   dtype="float32")  # fmt: skip
    assert _persistent(row) == est.host_bytes
    # Device gradients: only the copies in flight next to the one being computed (the estimator's bound).
    assert row.categories["gradients"] <= est.gradient_bytes


@pytest.mark.parametrize("mode, ga", [("gradients", 1), ("optimizer", 2)])
def test_device_and_host_peaks_match_a_real_offload_run(monkeypatch, mode, ga):
    # The benchmark's real run (copy thread and host worker as on a GPU), counted on every thread, sides apart.
    monkeypatch.setenv(transfer_module.SIMULATE_ENV, "1")
    plan_accuracy.MODELS["test"] = LLAMA
    try:
        cfg = plan_accuracy.Config("test", "adamw_torch_layerwise", seq_len=32, grad_accum=ga, offload=mode)
        real = plan_accuracy.measure_real(cfg, max_grad_norm=1.0)
    finally:
        del plan_accuracy.MODELS["test"]
    (row,) = plan(LLAMA, ["adamw_torch_layerwise"], counterparts=False, seq_len=32, grad_accum=ga, max_grad_norm=1.0,
                  device="cpu", offload=mode).rows  # fmt: skip
    assert abs(row.peak_bytes / real["device_peak_bytes"] - 1) < 0.02, (row.peak_bytes, real["device_peak_bytes"])
    assert abs(row.host_peak_bytes / real["host_peak_bytes"] - 1) < 0.02, (row.host_peak_bytes, real)
    assert abs(row.combined_peak_bytes / real["peak_bytes"] - 1) < 0.03


def test_offload_moves_bytes_from_the_device_to_the_host():
    options = dict(seq_len=32, grad_accum=4, max_grad_norm=1.0, device="cpu", counterparts=False)
    result = plan(LLAMA, ["adamw_torch_layerwise"], offload=MODES, **options)
    none, grads, opt = (result.row("adamw_torch_layerwise", m) for m in MODES)
    assert none.host_peak_bytes == 0 and none.combined_peak_bytes == none.peak_bytes
    every_grad = estimate(LLAMA, optimizer="adamw_torch", dtype="float32").gradient_bytes
    # GA 4 holds every gradient on the device without offload; with it they wait on the host.
    assert none.categories["gradients"] == every_grad
    assert grads.categories["gradients"] < every_grad / 4 and grads.host_categories["gradients"] >= every_grad
    assert grads.peak_bytes < none.peak_bytes
    assert grads.categories["optimizer_state"] == none.categories["optimizer_state"] > 0
    assert opt.categories["optimizer_state"] == 0 and opt.host_categories["optimizer_state"] > 0
    assert opt.peak_bytes < grads.peak_bytes < opt.host_peak_bytes
    for row in (grads, opt):
        assert sum(row.host_categories.values()) == row.host_peak_bytes
        assert max(row.peak_bytes, row.host_peak_bytes) < row.combined_peak_bytes
    payload = result.to_dict()
    assert payload["offload"] == list(MODES)
    assert [r["offload"] for r in payload["optimizers"]] == list(MODES)


def test_device_memory_judges_the_device_peak_and_host_memory_the_host_peak():
    options = dict(seq_len=32, grad_accum=4, device="cpu", counterparts=False)
    probe = plan(LLAMA, ["adamw_torch_layerwise"], offload=MODES, **options)
    none, grads, opt = (probe.row("adamw_torch_layerwise", m) for m in MODES)
    device = (opt.peak_bytes + grads.peak_bytes) // 2  # only 'optimizer' fits on the device
    host = opt.host_peak_bytes - 1  # ... but not on the host
    result = plan(LLAMA, ["adamw_torch_layerwise"], offload=MODES, device_memory=device, host_memory=host, **options)
    fits = {r.offload: (r.fits, r.host_fits) for r in result.rows}
    assert fits == {"none": (False, True), "gradients": (False, True), "optimizer": (True, False)}
    (advice,) = result.offload_advice
    assert advice.startswith("adamw_torch_layerwise: offload optimizer") and "no mode fits" in advice
    roomy = plan(LLAMA, ["adamw_torch_layerwise"], offload=MODES, device_memory=device, **options)
    assert roomy.offload_advice[0].startswith("adamw_torch_layerwise: offload optimizer (")
    assert "the least host memory among the modes that fit" in roomy.offload_advice[0]


def test_each_fsdp2_rank_offloads_its_own_shards():
    options = dict(seq_len=16, device="cpu", counterparts=False, offload="optimizer")
    one = plan(LLAMA, ["adamw_torch_layerwise"], **options).rows[0]
    rank = plan(LLAMA, ["adamw_torch_layerwise"], world_size=2, sharding="fsdp2", **options).rows[0]
    assert rank.categories["optimizer_state"] == 0
    half = one.host_categories["optimizer_state"] / 2
    assert rank.host_categories["optimizer_state"] == pytest.approx(half, rel=0.01)  # shards padded to equal size


def test_gradients_offload_that_lowers_nothing_says_what_it_buys():
    # GA 1, exact clipping, activations at the peak: the norm pass already kept gradients off the peak.
    result = plan(LLAMA, ["adamw_torch_layerwise"], seq_len=128, micro_batch=2, device="cpu", counterparts=False,
                  offload=("none", "gradients"))  # fmt: skip
    none, grads = (result.row("adamw_torch_layerwise", m) for m in ("none", "gradients"))
    assert grads.peak_bytes >= 0.99 * none.peak_bytes
    assert any("lowers no device peak here" in a and "crossover_tokens" in a for a in result.offload_advice)


def test_extrapolated_layers_equal_the_full_simulation_with_offload():
    # Six layers: the extrapolation may move up to copies of 3-5 layers. With 2 the joint (device + host) peak falls in
    # the embedding's step, with more in backward: only from 3 layers on is it one line.
    deep = dict(LLAMA, num_hidden_layers=6)
    options = dict(seq_len=16, grad_accum=2, device="cpu", counterparts=False, offload=("gradients", "optimizer"))
    fast = plan(deep, ["adamw_torch_layerwise"], **options)
    full = plan(deep, ["adamw_torch_layerwise"], extrapolate=False, **options)
    assert fast.extrapolated and not full.extrapolated
    for a, b in zip(fast.rows, full.rows):
        assert (a.peak_bytes, a.categories) == (b.peak_bytes, b.categories), a.label
        assert (a.host_peak_bytes, a.host_categories, a.combined_peak_bytes) == (
            b.host_peak_bytes,
            b.host_categories,
            b.combined_peak_bytes,
        ), a.label


def test_bad_offload_is_refused_before_simulating():
    with pytest.raises(EstimateError, match="offload='disk'.*none, gradients, optimizer"):
        plan(LLAMA, ["adamw_torch"], offload="disk")
    with pytest.raises(EstimateError, match="cannot step adamw_torch_npu_fused_layerwise on the host: its fused step"):
        plan(LLAMA, ["adamw_torch_npu_fused"], offload="optimizer")
    with pytest.raises(EstimateError, match="--host-memory"):
        plan(LLAMA, ["adamw_torch"], offload="gradients", host_memory="lots")


def test_cli_table_and_json(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    argv = ["plan", str(config), "--seq-len", "16", "--device", "cpu", "--grad-accum", "2"]
    assert main([*argv, "--offload", "none", "gradients", "--host-memory", "1GiB", "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "device peak" in out and "host peak" in out and "host fits" in out
    assert "adamw_torch_layerwise +offload gradients" in out and "Offload: adamw_torch_layerwise" in out
    assert main([*argv, "--offload", "optimizer", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    rows = {(r["optimizer"], r["offload"]): r for r in payload["optimizers"]}
    assert set(rows) == {("adamw_torch", "none"), ("adamw_torch_layerwise", "optimizer")}
    assert rows[("adamw_torch", "none")]["host_peak_bytes"] == 0
    assert rows[("adamw_torch_layerwise", "optimizer")]["host_categories"]["optimizer_state"] > 0
    # Pinned on CUDA: the buffers (staging too, at GA 2) and the parameter copies; the host states are pageable.
    hosted = rows[("adamw_torch_layerwise", "optimizer")]
    cats = hosted["host_categories"]
    assert hosted["host_pinned_bytes"] == cats["weights"] + cats["gradients"] > 0
    assert hosted["host_pageable_bytes"] == hosted["host_peak_bytes"] - hosted["host_pinned_bytes"]
    assert hosted["host_pageable_bytes"] >= cats["optimizer_state"] > 0
    assert "host_pinned_bytes" not in rows[("adamw_torch", "none")]
    assert main([*argv, "--offload", "optimizer", "--units", "decimal"]) == 0
    out = capsys.readouterr().out
    pinned, pageable = (format_bytes(hosted[k], "decimal") for k in ("host_pinned_bytes", "host_pageable_bytes"))
    kinds = "gradient buffers, staging buffers, parameter copies"
    assert "+offload optimizer, host peak " in out
    assert f"{pinned} pinned on CUDA ({kinds}), {pageable} pageable" in out
    assert "pinned on a GPU" not in out  # the states are not


def test_cli_refuses_an_unknown_mode():
    with pytest.raises(SystemExit):
        main(["plan", "llama-3-8b", "--offload", "disk"])


def test_a_config_object_is_left_as_it_was():
    config = AutoConfig.for_model(**LLAMA)
    assert config.use_cache is True
    plan(config, ["adamw_torch"], seq_len=8, device="cpu", counterparts=False)
    assert config.use_cache is True


DIRECT_CALL = """
import json, os, sys
import torch.distributed as dist
from layerwise_hf.plan import plan

def main():
    llama = json.loads(sys.argv[1])
    before = dict(os.environ)
    # One process in the role of rank 0 of 2 (torchrun's variables); the other rank never comes.
    one = plan(llama, ["adamw_torch"], seq_len=8, device="cpu", counterparts=False).rows[0].peak_bytes
    # With this run's process group up, a per-rank plan runs in a spawned process, which inherits the environment.
    dist.init_process_group("gloo", rank=0, world_size=1)
    ranks = plan(llama, ["adamw_torch"], seq_len=8, device="cpu", counterparts=False, world_size=2, sharding="ddp")
    dist.destroy_process_group()
    print(json.dumps({"one": one, "ranks": ranks.rows[0].peak_bytes, "environ_kept": dict(os.environ) == before}))

# The spawned process imports this file again: only the launched one plans.
if __name__ == "__main__":
    main()
"""


def test_a_direct_call_inside_a_launched_run_plans_as_one_process(tmp_path):
    script = tmp_path / "direct.py"
    script.write_text(DIRECT_CALL)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "test",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    # Without the rendezvous variables hidden, accelerate's state joins (waits for) the missing rank: a timeout.
    result = subprocess.run([sys.executable, str(script), json.dumps(LLAMA)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["environ_kept"] and report["one"] > 0 and report["ranks"] > 0


def test_fsdp2_accumulation_offloads_shards_only_when_each_micro_batch_is_reduced():
    # Under FSDP2 a window not reduced per micro-batch is accumulated by FSDP2 itself, unsharded: offload has
    # nothing to move before the last micro-batch. Reduce-scattered per micro-batch, each shard leaves as it comes.
    unsharded = sum(p.numel() * 4 for p in tiny_llama_from(LLAMA).parameters())
    options = dict(seq_len=32, grad_accum=4, world_size=2, sharding="fsdp2", counterparts=False)
    rows = {
        each: plan(LLAMA, ["adamw_torch_layerwise"], offload="gradients", sync_each_batch=each, **options).rows[0]
        for each in (False, True)
    }
    assert rows[False].categories["gradients"] == unsharded, rows[False].categories
    assert any("--sync-each-batch" in text for text in rows[False].advice), rows[False].advice
    # Reduced per micro-batch: what is in flight (a unit's unsharded gradients and its reduce-scatter), not the model.
    assert rows[True].categories["gradients"] < unsharded, rows[True].categories
    assert rows[True].peak_bytes < rows[False].peak_bytes, (rows[True].peak_bytes, rows[False].peak_bytes)
    assert not any("--sync-each-batch" in text for text in rows[True].advice), rows[True].advice


def tiny_llama_from(config: dict) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
