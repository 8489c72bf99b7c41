"""X_layerwise must train exactly like X: every parameter, the logged lr and grad_norm, with GA 1 and 2."""

import importlib.util
import os

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, logged, tiny_llama, train, training_args

from layerwise_hf import LayerwiseTrainer
from layerwise_hf.bases import support

# All of these run the same per-tensor arithmetic in both set-ups, so the comparison is exact (no tolerance).
BASES = ["adamw_torch", "adamw_8bit", "sgd", "adafactor", "lion_32bit", "rmsprop"]


class LrRecorder:
    """Records the lr each inner optimizer actually reads at the moment it steps."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.applied: dict[int, set[float]] = {}

    def __call__(self, optimizer, args, kwargs):
        step = self.trainer.state.global_step + 1
        self.applied.setdefault(step, set()).add(optimizer.param_groups[0]["lr"])


class RecordingTrainer(LayerwiseTrainer):
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.lr_recorder = LrRecorder(self)
        for inner in optimizer.inner:
            inner.register_step_pre_hook(self.lr_recorder)
        return optimizer


@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("base", BASES)
def test_layerwise_matches_standard(tmp_path, base, ga):
    model = tiny_llama()
    standard = train(clone(model), training_args(tmp_path, base, gradient_accumulation_steps=ga))
    layerwise = train(
        clone(model),
        training_args(tmp_path, f"{base}_layerwise", gradient_accumulation_steps=ga),
        trainer_cls=RecordingTrainer,
    )

    assert_params_equal(standard.model, layerwise.model)
    # The run must have moved the weights, or the comparison above proves nothing.
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), layerwise.model.parameters()))
    assert moved > 1e-4

    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")
    lrs = logged(standard, "learning_rate")
    assert logged(layerwise, "learning_rate") == lrs
    assert len(set(lrs)) > 3, "the schedule should warm up and decay"
    steps = [e["step"] for e in layerwise.state.log_history if "learning_rate" in e]
    applied = layerwise.lr_recorder.applied
    assert sorted(applied) == steps
    for step, lr in zip(steps, lrs):
        assert applied[step] == {lr}, f"step {step}: inner optimizers applied {applied[step]}, Trainer logged {lr}"


def test_adamw_8bit_keeps_embeddings_in_32bit(tmp_path):
    # Large enough that bitsandbytes quantizes (>= 4096 elements), so the 8-bit path and the embedding rule run.
    model = tiny_llama(vocab=256, hidden=64)
    dataset = TokenDataset(vocab=256)
    standard = train(clone(model), training_args(tmp_path, "adamw_8bit"), dataset=dataset)
    layerwise = train(clone(model), training_args(tmp_path, "adamw_8bit_layerwise"), dataset=dataset)
    assert_params_equal(standard.model, layerwise.model)

    optimizer = layerwise.layerwise_optimizer
    dtypes = {
        name: inner.state[p]["state1"].dtype
        for (name, p), inner in zip(zip(optimizer.names, optimizer.params), optimizer.inner)
    }
    assert dtypes["model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == torch.uint8
    assert dtypes["lm_head.weight"] == torch.uint8


def test_tied_embeddings_match(tmp_path):
    model = tiny_llama(tie=True)
    standard = train(clone(model), training_args(tmp_path, "adamw_torch"))
    layerwise = train(clone(model), training_args(tmp_path, "adamw_torch_layerwise"))
    assert_params_equal(standard.model, layerwise.model)
    names = layerwise.layerwise_optimizer.names
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.fixture
def fresh_bnb_manager(monkeypatch):
    # Earlier 8-bit Trainer runs in this process leave (group, index) overrides in bitsandbytes' process-wide
    # manager, which a standard optimizer applies to whatever parameter sits at that index.
    from bitsandbytes.optim import GlobalOptimManager

    fresh = GlobalOptimManager.__new__(GlobalOptimManager)
    fresh.initialize()
    monkeypatch.setattr(GlobalOptimManager, "_instance", fresh)


def _other_bases():
    from layerwise_hf.bases.registry import describe_layerwise_optimizers

    for _name, base, package in describe_layerwise_optimizers():
        if base in BASES or base in support.LOW_RANK_BASES:
            continue  # covered in depth above / in test_galore.py (they need optim_target_modules)
        if base in support.NOT_INSTALLABLE_BASES:
            reason = support.NOT_INSTALLABLE_BASES[base]
        else:
            module = {"torch-optimi": "optimi"}.get(package, package)
            reason = None if not package or importlib.util.find_spec(module) else f"needs {package}"
        yield pytest.param(base, marks=[pytest.mark.skip(reason=reason)] if reason else [], id=base)


@pytest.mark.slow
@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("base", list(_other_bases()))
def test_every_other_base_matches_standard(tmp_path, base, ga, fresh_bnb_manager):
    # Large enough that bitsandbytes (>= 4096 elements) and torchao (>= 4096, in 256-element blocks) quantize.
    model = tiny_llama(vocab=256, hidden=64)
    dataset = TokenDataset(vocab=256)
    overrides = dict(max_steps=4, gradient_accumulation_steps=ga)
    standard = train(clone(model), training_args(tmp_path, base, **overrides), dataset=dataset)
    layerwise = train(clone(model), training_args(tmp_path, f"{base}_layerwise", **overrides), dataset=dataset)
    assert_params_equal(standard.model, layerwise.model)
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), layerwise.model.parameters()))
    assert moved > 1e-4
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")


def test_every_served_base_has_a_status():
    # The optimizer table (docs/optimizers.md) says per row how a base compares with its standard form; "tested" must
    # mean a parity test runs it: BASES above, the sweep, or test_galore.py for the low-rank ones.
    from layerwise_hf.bases.registry import describe_layerwise_optimizers

    swept = {p.values[0] for p in _other_bases()}
    for _name, base, _package in describe_layerwise_optimizers():
        status = support.base_status(base)
        if status.startswith(support.BIT_EXACT):
            assert base in BASES or base in swept or base in support.LOW_RANK_BASES, base
        else:
            assert status.startswith("not installable here: "), (base, status)
    for base in support.REFUSED_BASES:
        assert support.base_status(base).startswith("refused: ")
        with pytest.raises(ValueError, match=f"'{base}_layerwise' is not supported"):
            training_args("unused", f"{base}_layerwise")


SCHEDULERS = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine_with_restarts", {"num_cycles": 2}),
    ("polynomial", {"power": 2.0, "lr_end": 1e-4}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("inverse_sqrt", {}),
    ("cosine_with_min_lr", {"min_lr": 1e-3}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 2}),
]


@pytest.mark.parametrize("scheduler,kwargs", SCHEDULERS, ids=[s for s, _ in SCHEDULERS])
def test_every_scheduler_drives_every_layer(tmp_path, scheduler, kwargs):
    model = tiny_llama()
    overrides = dict(lr_scheduler_type=scheduler, lr_scheduler_kwargs=kwargs, max_steps=5)
    standard = train(clone(model), training_args(tmp_path, "sgd", **overrides))
    layerwise = train(
        clone(model), training_args(tmp_path, "sgd_layerwise", **overrides), trainer_cls=RecordingTrainer
    )
    assert_params_equal(standard.model, layerwise.model)
    lrs = logged(standard, "learning_rate")
    assert logged(layerwise, "learning_rate") == lrs
    assert [layerwise.lr_recorder.applied[step] for step in sorted(layerwise.lr_recorder.applied)] == [
        {lr} for lr in lrs
    ]


def test_evaluation_and_best_model_match_standard(tmp_path):
    # Evaluation between steps (no backward, so no hook fires) and load_best_model_at_end leave training unchanged.
    model = tiny_llama()
    kwargs = dict(
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        max_grad_norm=1.0,
    )
    runs = {}
    for optim in ("adamw_torch", "adamw_torch_layerwise"):
        args = training_args(tmp_path / optim, optim, **kwargs)
        runs[optim] = train(clone(model), args, eval_dataset=TokenDataset(n=16, seed=5))
    standard, layerwise = runs.values()
    assert len(logged(layerwise, "eval_loss")) == 3
    assert logged(layerwise, "eval_loss") == logged(standard, "eval_loss")
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")
    best = [os.path.basename(run.state.best_model_checkpoint) for run in (standard, layerwise)]
    assert best[0] == best[1]
    assert_params_equal(standard.model, layerwise.model)
