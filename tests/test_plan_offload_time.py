"""How long host offload takes per step in the plan (`layerwise_hf.plan.offload_time`, `layerwise-hf plan --offload`):
the host step's seconds, the PCIe bytes and seconds, the bottleneck; and the host seconds against a real host step."""

import json

import pytest
from helpers import PLAN_LLAMA

from layerwise_hf.cli import main
from layerwise_hf.plan.offload_time import HostRate, offload_time


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
