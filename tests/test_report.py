"""A layer-wise run says what it is: at the start, one INFO line from Trainer's logger naming the optimizer, how
gradients reach it, the clipping mode and whether gradients are held; at the end, the memory summary, with the reason
when every gradient was held and the setting that holds none."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from helpers import tiny_llama, train, training_args

from layerwise_hf.integrations.report import why_held


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def trainer_log():
    # transformers' library logger does not propagate to the root logger (caplog's); listen where its handler does.
    library = logging.getLogger("transformers")
    handler = Records()
    library.addHandler(handler)
    yield handler.records
    library.removeHandler(handler)


def messages(records, start: str) -> list[str]:
    return [r.getMessage() for r in records if r.getMessage().startswith(start)]


def test_exact_clipping_run_names_itself_and_says_it_held_every_gradient(tmp_path, trainer_log):
    args = training_args(
        tmp_path, "adamw_torch_layerwise", max_grad_norm=1.0, layerwise_norm_pass="hold", max_steps=2, log_level="info"
    )
    trainer = train(tiny_llama(), args)

    (begin,) = messages(trainer_log, "Training layer-wise: adamw_torch_layerwise")
    assert "one AdamW per trainable parameter" in begin and "post-accumulate-grad hook" in begin
    assert "layerwise_clip='exact'" in begin and "holding every gradient until the step" in begin
    (summary,) = messages(trainer_log, "Layer-wise memory (adamw_torch_layerwise)")
    optimizer = trainer.layerwise_optimizer
    assert (
        optimizer.pipeline.memory.peak_grad_bytes == optimizer.pipeline.memory.full_grad_bytes()
    )  # what the summary then explains
    assert f"gradients alive at once {optimizer.pipeline.memory.full_grad_bytes() / 2**20:.3f} MiB" in summary
    assert "Exact clipping held every gradient" in summary and "layerwise_clip='previous'" in summary
    # Where Trainer's own account of the run shows, at its level: the same logger, INFO.
    running = [r for r in trainer_log if "Running training" in r.getMessage()]
    assert running and {r.name for r in running} == {"transformers.trainer"}
    assert {
        r.levelno for r in trainer_log if r.getMessage().startswith(("Training layer-wise", "Layer-wise memory"))
    } == {logging.INFO}


def test_previous_clipping_summary_shows_the_saving_and_no_excuse(tmp_path, trainer_log):
    args = training_args(
        tmp_path, "adamw_torch_layerwise", max_grad_norm=1.0, layerwise_clip="previous", max_steps=2, log_level="info"
    )
    trainer = train(tiny_llama(), args)

    (begin,) = messages(trainer_log, "Training layer-wise")
    assert "no gradient is held" in begin
    (summary,) = messages(trainer_log, "Layer-wise memory")
    optimizer = trainer.layerwise_optimizer
    assert optimizer.pipeline.memory.peak_grad_bytes < optimizer.pipeline.memory.full_grad_bytes()
    state, full, peak = (
        optimizer.pipeline.memory.state_bytes(),
        optimizer.pipeline.memory.full_grad_bytes(),
        optimizer.pipeline.memory.peak_grad_bytes,
    )
    assert f"{100 * (full - peak) / (full + state):.1f}% less" in summary
    assert "held every gradient" not in summary


def test_gradient_accumulation_summary_says_the_window_held_them(tmp_path, trainer_log):
    args = training_args(tmp_path, "sgd_layerwise", gradient_accumulation_steps=2, max_steps=1, log_level="info")
    train(tiny_llama(), args)

    (begin,) = messages(trainer_log, "Training layer-wise: sgd_layerwise")
    assert "gradient accumulation (2 micro-batches a step) holds every gradient" in begin
    (summary,) = messages(trainer_log, "Layer-wise memory (sgd_layerwise)")
    assert summary.endswith("Gradient accumulation held every gradient until each window's last micro-batch.")


def test_nothing_is_said_below_trainer_s_log_level(tmp_path, trainer_log):
    # Trainer's default on the main process keeps transformers' level (warning): its own INFO lines stay quiet too.
    args = training_args(tmp_path, "sgd_layerwise", max_steps=1, log_level="warning")
    train(tiny_llama(), args)
    assert not messages(trainer_log, "Training layer-wise") and not messages(trainer_log, "Layer-wise memory")


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"max_grad_norm": 1.0}, "layerwise_clip='previous' clips in one backward and holds none"),
        ({"max_grad_norm": 1.0, "layerwise_norm_pass": "retain"}, "layerwise_norm_pass='retain', holding no gradient"),
        ({"max_grad_norm": 1.0, "layerwise_clip": "per_param"}, "no gradient is held: clips each gradient on its own"),
        ({"max_grad_norm": 1.0, "layerwise_clip": "off"}, "no gradient is held: no clipping"),
        ({"max_grad_norm": 0.0, "fp16": True}, "fp16's inf/nan check is measured before any layer steps"),
        ({"max_grad_norm": 1.0, "layerwise_offload": "gradients"}, "wait in host memory"),
    ],
    ids=["exact", "retain", "per_param", "off", "fp16", "offload"],
)
def test_why_held_names_the_cause(settings, says):
    text = why_held(SimpleNamespace(**settings))
    assert says in text
    if settings.get("fp16"):
        assert "previous" not in text  # fp16 measures every gradient whatever the clipping mode


@pytest.mark.filterwarnings(
    "ignore:`gradient_checkpointing` is deprecated:FutureWarning"
)  # the oldest lacks the new name
def test_a_first_step_that_alone_held_every_gradient_is_told_apart(tmp_path, trainer_log):
    # layerwise_norm_pass='auto' measures the first step by holding while it learns what the graph saves; here it
    # then reruns forward+backward, holding one gradient at a time: the run's peak is the first step's alone.
    import torch
    from transformers import AutoModelForCausalLM

    from layerwise_hf.integrations.assets import make_tiny_assets
    from layerwise_hf.optim.norm_pass import NormPass
    from layerwise_hf.platform.compat import checkpointing_kwargs

    model = AutoModelForCausalLM.from_pretrained(make_tiny_assets(tmp_path / "tiny"))
    ids = (torch.arange(128) * 7 + 3) % 250
    dataset = [{"input_ids": ids, "labels": ids}] * 16
    args = training_args(
        tmp_path / "out",
        "adamw_torch_layerwise",
        max_grad_norm=1.0,
        # Non-reentrant, as transformers 5 defaults to (4.x defaults to reentrant, whose saved graph differs).
        **checkpointing_kwargs(True, {"use_reentrant": False}),
        max_steps=3,
        log_level="info",
    )
    trainer = train(model, args, dataset)

    optimizer = trainer.layerwise_optimizer
    assert optimizer.pipeline.norm_pass_choice.way is NormPass.RERUN  # the case this test is about
    full = optimizer.pipeline.memory.full_grad_bytes()
    # The whole run's figure is unchanged: the first step did hold every gradient.
    assert optimizer.pipeline.memory.peak_grad_bytes == full
    assert [e["layerwise_peak_grad_mib"] for e in trainer.state.log_history if "loss" in e] == [
        round(full / 2**20, 3)
    ] * 3
    (summary,) = messages(trainer_log, "Layer-wise memory")
    later = float(summary.split("gradients alive at once ")[1].split(" MiB at most after the first step")[0])
    assert 0 < later < full / 2**20 / 2
    assert f"The first step held {full / 2**20:.3f} MiB while layerwise_norm_pass='auto'" in summary
    assert "('rerun')" in summary
