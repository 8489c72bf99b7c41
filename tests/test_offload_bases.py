"""layerwise_offload="optimizer" with bases whose step cannot run on the host (refused before training) or runs there
slower than the backward it should overlap (a warning with the measured ratio, benchmarks/host_step_pace.py)."""

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama, training_args

from layerwise_hf import LayerwiseTrainingArguments
from layerwise_hf.optim.optimizer import build_layerwise_optimizer
from layerwise_hf.placement import offloading
from layerwise_hf.placement import transfer as transfer_module

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "host_step_pace.json"


@pytest.fixture(autouse=True)
def simulated_offload(monkeypatch):
    monkeypatch.setenv(transfer_module.SIMULATE_ENV, "1")
    monkeypatch.setattr(offloading, "_warned", set())  # each test sees the first warning of a base


def test_a_base_that_cannot_step_on_the_host_is_refused_by_the_arguments():
    with pytest.raises(ValueError) as refused:
        LayerwiseTrainingArguments(
            "/tmp/unused",
            optim="galore_adamw_8bit_layerwise",
            optim_target_modules=["attn", "mlp"],
            layerwise_offload="optimizer",
        )
    message = str(refused.value)
    assert "galore_adamw_8bit_layerwise" in message and "on the host" in message
    assert "layerwise_offload='gradients'" in message and "adamw_torch_layerwise" in message


def test_a_base_that_cannot_step_on_the_host_is_refused_before_any_step():
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    args = training_args("/tmp/unused", "galore_adamw_8bit_layerwise", optim_target_modules=["attn", "mlp"])
    with pytest.raises(ValueError, match="cannot step optim='galore_adamw_8bit_layerwise' on the host"):
        build_layerwise_optimizer(model, args, offload="optimizer")
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    # The same base is fine when only the gradients are offloaded: its step stays on the device.
    build_layerwise_optimizer(model, args, offload="gradients")


def test_a_slow_base_warns_once_naming_it_and_its_measured_ratio(caplog):
    model = tiny_llama()
    with caplog.at_level(logging.WARNING, logger=offloading.__name__):
        args = training_args("/tmp/unused", "adamw_8bit_layerwise", layerwise_offload="optimizer")
        build_layerwise_optimizer(model, args)
    warnings = [r.getMessage() for r in caplog.records if "host (CPU) step" in r.getMessage()]
    assert len(warnings) == 1  # once, though the arguments and the optimizer both check
    assert "'adamw_8bit_layerwise'" in warnings[0] and f"{offloading.SLOW_ON_HOST['adamw_8bit']:.1f}x" in warnings[0]
    assert "layerwise_offload='gradients'" in warnings[0]


@pytest.mark.parametrize("optim", ["adamw_torch_layerwise", "sgd_layerwise", "adafactor_layerwise"])
def test_bases_that_keep_pace_build_without_a_warning(caplog, optim):
    with caplog.at_level(logging.WARNING, logger=offloading.__name__):
        build_layerwise_optimizer(tiny_llama(), training_args("/tmp/unused", optim, layerwise_offload="optimizer"))
    assert "host (CPU) step" not in caplog.text


def test_the_refused_and_warned_bases_are_the_measured_ones():
    measured = json.loads(RESULTS.read_text())
    failed = {row["base"] for row in measured["rows"] if "error" in row}
    slow = {row["base"]: round(row["ratio"], 2) for row in measured["rows"] if row.get("ratio", 0) > 1}
    assert failed <= set(offloading.NOT_ON_HOST)
    assert slow == offloading.SLOW_ON_HOST
