"""`layerwise_preflight=True`: the run's own step is planned before the first one, a warning names the planned peak and
the memory available when it will not fit, training is unchanged, and nothing of the planner loads when it is off."""

import copy
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import SEQ, TokenDataset, assert_params_equal, clone, tiny_llama, train, training_args
from transformers import Trainer, TrainingArguments

import layerwise_hf
from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments
from layerwise_hf.integrations import preflight as preflight_module
from layerwise_hf.integrations.preflight import Budget, Preflight, PreflightReport, parallelism, preflight

ROOT = Path(__file__).resolve().parent.parent
LOGGER = "layerwise_hf.integrations.preflight"
MIB = 2**20
SMALL = 64 * 1024  # below any step of the tiny model


def planned_peak(model, optim="adamw_torch_layerwise", micro_batch=4, **overrides):
    """What `layerwise_hf.plan.plan()` says for the tiny run of `helpers.training_args` (clipping off)."""
    from layerwise_hf.plan import plan

    config = copy.deepcopy(model.config)  # plan() sets use_cache on the config it is given
    options = dict(seq_len=SEQ, micro_batch=micro_batch, max_grad_norm=0.0, device="cpu")
    options.update(overrides)
    return plan(config, [optim], counterparts=False, **options).rows[0].peak_bytes


def with_budget(monkeypatch, nbytes: int) -> list:
    """The memory the device 'has'; records each device the preflight asked about."""
    asked = []

    def available(device, model=None):
        asked.append(device)
        return Budget(nbytes, f"{nbytes} bytes (test)")

    monkeypatch.setattr(preflight_module, "available_memory", available)
    return asked


def records(caplog, level=logging.WARNING):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_warns_naming_the_planned_peak_and_the_memory_when_it_does_not_fit(monkeypatch, caplog, tmp_path):
    from layerwise_hf.estimate.units import format_bytes

    model = tiny_llama()
    reference = clone(model)
    asked = with_budget(monkeypatch, SMALL)
    caplog.set_level(logging.INFO, logger=LOGGER)
    args = training_args(tmp_path, "adamw_torch_layerwise", max_steps=3, layerwise_preflight=True)
    trainer = train(model, args)

    (warning,) = records(caplog)
    peak = planned_peak(reference)
    assert peak > SMALL  # the tiny run's step (weights, states, activations) is above the budget given
    text = warning.getMessage()
    assert "will not fit" in text and format_bytes(peak) in text and format_bytes(SMALL) in text
    assert "micro-batch 4 x 16 tokens" in text  # from the first batch
    assert asked == [torch.device("cpu")]  # planned once, for the run's device
    assert trainer.state.global_step == 3  # a warning, not a stop
    # The plan ran inside the first step without changing it: the same weights as without a preflight.
    train(reference, training_args(tmp_path / "plain", "adamw_torch_layerwise", max_steps=3))
    assert_params_equal(model, reference)


def test_silent_when_it_fits(monkeypatch, caplog, tmp_path):
    with_budget(monkeypatch, 2**40)
    caplog.set_level(logging.INFO, logger=LOGGER)
    train(tiny_llama(), training_args(tmp_path, "adamw_torch", max_steps=2, layerwise_preflight=True),
          trainer_cls=LayerwiseTrainer)  # fmt: skip
    assert records(caplog) == []
    (info,) = records(caplog, logging.INFO)
    assert "adamw_torch, micro-batch 4 x 16 tokens" in info.getMessage() and "fits in 1.00 TiB" in info.getMessage()


def test_plain_loop_report_is_the_plan_of_the_run(monkeypatch):
    model = tiny_llama()
    with_budget(monkeypatch, SMALL)
    args = SimpleNamespace(optim="sgd_layerwise", gradient_accumulation_steps=2, max_grad_norm=1.0, bf16=False,
                           layerwise_clip="previous", fp16=False, activation_checkpointing=True)  # fmt: skip
    report = preflight(model, args, seq_len=SEQ, micro_batch=2)
    assert model.config.use_cache is not False  # the simulation's settings stayed on its copy of the config
    assert isinstance(report, PreflightReport) and report.fits is False
    expected = planned_peak(model, "sgd_layerwise", micro_batch=2, grad_accum=2, max_grad_norm=1.0,
                            clip_mode="previous", gradient_checkpointing=True)  # fmt: skip
    assert report.peak_bytes == expected
    assert sum(report.categories.values()) == report.peak_bytes and report.budget.total_bytes == SMALL


def test_offload_run_is_planned_with_its_offload(monkeypatch, caplog):
    model = tiny_llama()
    with_budget(monkeypatch, SMALL)
    args = SimpleNamespace(optim="adamw_torch_layerwise", gradient_accumulation_steps=2, max_grad_norm=0.0,
                           layerwise_offload="gradients")  # fmt: skip
    report = preflight(model, args, seq_len=SEQ, micro_batch=2)
    without = planned_peak(model, micro_batch=2, grad_accum=2)
    assert report.offload == "gradients" and report.peak_bytes == planned_peak(
        model, micro_batch=2, grad_accum=2, offload="gradients"
    )
    assert report.peak_bytes < without  # GA 2: the gradients wait on the host, not on the device
    assert report.host_peak_bytes > 0 and report.fits is False
    (warning,) = records(caplog)
    assert "offload gradients: host peak" in warning.getMessage()


def test_lora_model_is_planned_with_its_adapters(monkeypatch):
    peft = pytest.importorskip("peft")
    with_budget(monkeypatch, 2**40)
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = SimpleNamespace(optim="adamw_torch_layerwise", max_grad_norm=0.0)
    report = preflight(model, args, seq_len=SEQ, micro_batch=2)
    full = planned_peak(tiny_llama(), micro_batch=2, grad_accum=1)
    lora = planned_peak(tiny_llama(), micro_batch=2, lora_r=4, lora_targets=("q_proj", "v_proj"))
    assert report.peak_bytes == lora != full


def test_a_failed_plan_warns_and_training_goes_on(monkeypatch, caplog, tmp_path):
    import layerwise_hf.plan

    def broken(*args, **kwargs):
        raise RuntimeError("simulation failed")

    monkeypatch.setattr(layerwise_hf.plan, "plan", broken, raising=False)  # the package's lazy attribute
    trainer = train(tiny_llama(), training_args(tmp_path, "adamw_torch_layerwise", max_steps=2,
                                                layerwise_preflight=True))  # fmt: skip
    (warning,) = records(caplog)
    assert "could not plan this run" in warning.getMessage() and "simulation failed" in warning.getMessage()
    assert trainer.state.global_step == 2


def test_through_the_launchers_patched_trainer(monkeypatch, caplog, tmp_path):
    with_budget(monkeypatch, SMALL)
    layerwise_hf.install()
    try:
        # A script's stock Trainer, made layer-wise by install(), with the field set on stock arguments ...
        stock = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", max_steps=2,
                                  per_device_train_batch_size=4, max_grad_norm=0.0, save_strategy="no",
                                  report_to="none", use_cpu=True, disable_tqdm=True)  # fmt: skip
        stock.layerwise_preflight = True
        # ... or set for every stock argument by install(layerwise_preflight=True) (`--layerwise_preflight`) ...
        layerwise_hf.install(layerwise_preflight=True)
        installed = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", max_steps=2,
                                      per_device_train_batch_size=4, max_grad_norm=0.0, save_strategy="no",
                                      report_to="none", use_cpu=True, disable_tqdm=True)  # fmt: skip
        assert installed.layerwise_preflight is True
        # ... or LayerwiseTrainingArguments given to a stock Trainer.
        explicit = training_args(tmp_path, "adamw_torch_layerwise", max_steps=2, layerwise_preflight=True)
        for args in (stock, installed, explicit):
            trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset())
            assert isinstance(trainer, layerwise_hf.LayerwiseTrainerMixin)
            trainer.train()
    finally:
        layerwise_hf.uninstall()
    assert len(records(caplog)) == 3 and all("will not fit" in r.getMessage() for r in records(caplog))


def test_bad_value_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="layerwise_preflight='yes' must be True or False"):
        LayerwiseTrainingArguments(output_dir=str(tmp_path), layerwise_preflight="yes")
    args = training_args(tmp_path, "adamw_torch_layerwise", max_steps=1)
    args.layerwise_preflight = 1  # set after the arguments were made: refused when training starts
    model = tiny_llama()
    before = clone(model)
    with pytest.raises(ValueError, match="layerwise_preflight=1 must be True or False"):
        train(model, args)
    assert_params_equal(model, before)


def test_off_by_default_does_not_import_the_planner(tmp_path):
    code = (
        "import sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from helpers import tiny_llama, train, training_args\n"
        f"train(tiny_llama(), training_args({str(tmp_path)!r}, 'adamw_torch_layerwise', max_steps=1{{}}))\n"
        "print('PLAN_IMPORTED', 'layerwise_hf.plan' in sys.modules)\n"
    )
    for extra, imported in (("", False), (", layerwise_preflight=True", True)):
        result = subprocess.run([sys.executable, "-c", code.format(extra)], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"PLAN_IMPORTED {imported}" in result.stdout


def test_cuda_first_step_is_logged_next_to_the_plan(monkeypatch, caplog):
    # No GPU here: the CUDA device and its allocator's peak are stood in for.
    check = Preflight(torch.nn.Linear(2, 2), SimpleNamespace(layerwise_preflight=True))
    check.report = PreflightReport("adamw_torch", SEQ, 4, 1000 * MIB, {}, "step", None, None, [])
    monkeypatch.setattr(preflight_module, "model_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1250 * MIB)
    check.after_step()
    check.after_step()  # once only
    (warning,) = records(caplog)  # 25% above the plan: worth a warning
    assert "measured max_memory_allocated 1.22 GiB, planned 1000.00 MiB (measured / planned 1.250" in (
        warning.getMessage()
    )
    assert check.report.measured_peak_bytes == 1250 * MIB


def test_one_process_without_an_accelerator():
    assert parallelism(SimpleNamespace(num_processes=1, distributed_type="DistributedType.NO")) == (1, "none")
    assert parallelism(SimpleNamespace(num_processes=8, distributed_type="DistributedType.MULTI_GPU")) == (8, "ddp")
    fsdp = SimpleNamespace(num_processes=8, distributed_type="DistributedType.FSDP", is_fsdp2=True)
    assert parallelism(fsdp) == (8, "fsdp2")


RANKS_SCRIPT = """
import json, logging, sys, tempfile
import torch.distributed as dist
from common import dataset, finish_ranks, max_diff, params, tiny_llama, training_args
from layerwise_hf import LayerwiseTrainer
from layerwise_hf.integrations import preflight

preflight.available_memory = lambda device, model=None: preflight.Budget(64 * 1024, "test")
messages = []
handler = logging.Handler()
handler.emit = lambda record: messages.append([record.levelname, record.getMessage()])
logging.getLogger("layerwise_hf.integrations.preflight").addHandler(handler)

def run(flag):
    model = tiny_llama()
    with tempfile.TemporaryDirectory() as out:
        args = training_args(out, "adamw_torch_layerwise", layerwise_preflight=flag)
        LayerwiseTrainer(model=model, args=args, train_dataset=dataset()).train()
    return params(model)

# The guard matters: the plan of one rank of a running process group runs in a spawned process, which imports this
# file again.
if __name__ == "__main__":
    diff = max_diff(run(True), run(False))
    with open(f"{sys.argv[1]}.{dist.get_rank()}", "w") as f:
        json.dump({"messages": messages, "max_diff": diff}, f)
    finish_ranks()
"""


@pytest.mark.slow
def test_two_ranks_plan_one_rank_of_the_run_and_train_as_without(tmp_path):
    import os
    import socket

    script = tmp_path / "preflight_ranks.py"
    script.write_text(RANKS_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "distributed"), str(ROOT)])}  # fmt: skip
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(port), str(script),
           str(tmp_path / "report")]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    import json

    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    assert all(r["max_diff"] == 0.0 for r in reports)  # each rank trained exactly as without a preflight
    (warning,) = [m for level, m in reports[0]["messages"] if level == "WARNING"]
    assert "per rank of 2 (ddp)" in warning and "will not fit" in warning
    assert reports[1]["messages"] == []  # one plan per machine: the local main process's
