"""fp16 loss scaling with layer-wise optimizers: Trainer's GradScaler skips and rescales exactly as with the standard
optimizer, and an overflowing step changes no parameter and no optimizer state.

Accelerate only creates a GradScaler (and fp16 autocast) on accelerator devices, so on CPU the tests give the
Trainer's accelerator a `torch.amp.GradScaler("cpu")` and turn its autocast on: the same object and calls Trainer
uses with CUDA (`accelerator.backward` -> `scaler.scale(loss)`, `scaler.step`, `scaler.update`, step-skip detection).
"""

import copy
import math

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, held_grad_bound, logged, tiny_llama, training_args
from transformers import Trainer, TrainerCallback

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments, build_layerwise_optimizer
from layerwise_hf.optim.norm_pass import backward_with_norm_pass
from layerwise_hf.platform.compat import checkpointing_kwargs, trainer_logs_grad_norm

MAX_NORM = 0.5
# Scale 2**20 overflows fp16 activations' gradients now and then on this model, and growth_interval=2 makes the
# scale grow again: a run sees skips, back-offs and growths.
SCALER = dict(init_scale=2.0**20, growth_interval=2)


def fp16_train(model, args, callbacks=(), resume_from_checkpoint=None, scaler=SCALER):
    trainer_cls = LayerwiseTrainer if args.is_layerwise else Trainer
    trainer = trainer_cls(model=model, args=args, train_dataset=TokenDataset(), callbacks=list(callbacks))
    for callback in callbacks:
        callback.trainer = trainer
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", **scaler)
    trainer.accelerator.native_amp = True  # accelerate's prepare() then wraps forward in fp16 autocast
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def same_floats(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


class Overflow(TrainerCallback):
    """
    Makes the gradient of the input embedding inf/nan on one optimizer step. That gradient is the last one backward
    computes, so every other layer's gradient is finite and ready before the overflow shows up. Records what the
    step changed.
    """

    def __init__(self, model, at_step):
        self.model, self.at_step = model, at_step
        self.active = False
        self.changed_params = self.changed_state = None
        model.model.embed_tokens.weight.register_hook(lambda g: g * float("inf") if self.active else g)

    def _optimizer_state(self, optimizer):
        inner = getattr(optimizer, "optimizer", optimizer)
        return copy.deepcopy(inner.state_dict()["state"])

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.active = state.global_step == self.at_step
        if self.active:
            self.params_before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            self.state_before = self._optimizer_state(optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if not self.active:
            return
        self.active = False
        self.changed_params = [
            n for n, p in self.model.named_parameters() if not torch.equal(p.detach(), self.params_before[n])
        ]
        after = self._optimizer_state(optimizer)
        self.changed_state = [
            k
            for k in set(after) | set(self.state_before)
            if k not in after
            or k not in self.state_before
            or any(not torch.equal(after[k][s], self.state_before[k][s]) for s in after[k])
        ]


class ScaleRecorder(TrainerCallback):
    """The scale after every optimizer step (`trainer` is set by `fp16_train`)."""

    def __init__(self):
        self.trainer = None
        self.scales = []

    def on_step_end(self, args, state, control, **kwargs):
        self.scales.append(self.trainer.accelerator.scaler.get_scale())


def run_pair(tmp_path, ga, max_grad_norm, base="adamw_torch", inject_at=None, **overrides):
    model = tiny_llama()
    out = {}
    for optim in (base, f"{base}_layerwise"):
        m = clone(model)
        args = training_args(
            tmp_path / optim,
            optim,
            fp16=True,
            max_grad_norm=max_grad_norm,
            learning_rate=5e-2,
            gradient_accumulation_steps=ga,
            **overrides,
        )
        callbacks = [ScaleRecorder()]
        if inject_at is not None:
            callbacks.append(Overflow(m, inject_at))
        out[optim] = (fp16_train(m, args, callbacks), callbacks)
    return out[base], out[f"{base}_layerwise"]


@pytest.mark.parametrize("max_grad_norm", [MAX_NORM, 0.0], ids=["exact_clip", "no_clip"])
@pytest.mark.parametrize("ga", [1, 2])
def test_fp16_matches_standard_gradscaler(tmp_path, ga, max_grad_norm):
    # 'retain': checked in a norm pass, then stepped in backward (the rule would hold this activation-heavy model).
    (standard, (std_scales,)), (layerwise, (lw_scales,)) = run_pair(
        tmp_path, ga, max_grad_norm, layerwise_norm_pass="retain"
    )
    norms = logged(standard, "grad_norm")
    finite = [n for n in norms if math.isfinite(n)]
    # GradScaler halves the scale at each skipped (overflowed) step.
    skipped = sum(b < a for a, b in zip([SCALER["init_scale"], *std_scales.scales], std_scales.scales))
    # The run must exercise what it claims: skipped steps, a growing scale, and (with clipping) real clipping.
    assert skipped > 0, "no step overflowed"
    if trainer_logs_grad_norm(max_grad_norm):
        assert len(norms) == len(std_scales.scales) and len(norms) - len(finite) == skipped
    assert any(b > a for a, b in zip(std_scales.scales, std_scales.scales[1:])), "the scale never grew"
    if max_grad_norm:
        assert min(finite) > max_grad_norm, "clipping must trigger"
    assert same_floats(logged(layerwise, "grad_norm"), norms)
    assert logged(layerwise, "learning_rate") == logged(standard, "learning_rate")
    assert lw_scales.scales == std_scales.scales
    assert_params_equal(standard.model, layerwise.model)
    optimizer = layerwise.layerwise_optimizer
    assert optimizer.steps_taken == len(std_scales.scales) - skipped  # skipped steps never reached the optimizers
    if ga == 1:
        # Checked and stepped layer by layer (lm_head's step held): never all gradients at once.
        assert (
            optimizer.pipeline.memory.peak_grad_bytes
            == held_grad_bound(layerwise.model)
            < optimizer.pipeline.memory.full_grad_bytes()
        )


@pytest.mark.parametrize("max_grad_norm", [MAX_NORM, 0.0], ids=["exact_clip", "no_clip"])
@pytest.mark.parametrize("ga", [1, 2])
def test_fp16_overflow_changes_nothing_and_halves_the_scale(tmp_path, ga, max_grad_norm):
    (standard, (std_scales, std_overflow)), (layerwise, (lw_scales, overflow)) = run_pair(
        tmp_path, ga, max_grad_norm, inject_at=2, max_steps=4
    )
    # The injected step: finite gradients everywhere except the last one backward produces, and yet nothing moved.
    assert overflow.changed_params == [] and overflow.changed_state == []
    assert std_overflow.changed_params == [] and std_overflow.changed_state == []
    scales = lw_scales.scales  # after each step
    assert len(scales) == 4 and scales[2] == scales[1] / 2
    if trainer_logs_grad_norm(max_grad_norm):
        assert math.isnan(logged(layerwise, "grad_norm")[2]) or math.isinf(logged(layerwise, "grad_norm")[2])
    lrs = logged(layerwise, "learning_rate")
    assert lrs[3] == lrs[2], "the scheduler does not advance on a skipped step"
    # The steps after it train again, exactly as the standard optimizer.
    assert same_floats(logged(layerwise, "grad_norm"), logged(standard, "grad_norm"))
    assert scales == std_scales.scales
    assert_params_equal(standard.model, layerwise.model)


def test_fp16_with_gradient_checkpointing_matches_standard(tmp_path):
    (standard, (std_scales,)), (layerwise, (lw_scales,)) = run_pair(
        tmp_path, 1, MAX_NORM, **checkpointing_kwargs(True, {"use_reentrant": False})
    )
    norms = logged(standard, "grad_norm")
    assert not all(math.isfinite(n) for n in norms), "no step overflowed"
    assert same_floats(logged(layerwise, "grad_norm"), norms)
    assert lw_scales.scales == std_scales.scales
    assert_params_equal(standard.model, layerwise.model)


def test_fp16_resume_matches_uninterrupted(tmp_path):
    model = tiny_llama()
    common = dict(fp16=True, max_grad_norm=MAX_NORM, learning_rate=5e-2, save_strategy="steps")
    full = fp16_train(clone(model), training_args(tmp_path / "a", "adamw_torch_layerwise", save_steps=3, **common))
    resumed = fp16_train(
        clone(model),
        training_args(tmp_path / "b", "adamw_torch_layerwise", save_steps=100, **common),
        resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"),
    )
    assert (tmp_path / "a" / "checkpoint-3" / "scaler.pt").exists()
    assert resumed.accelerator.scaler.get_scale() == full.accelerator.scaler.get_scale()
    assert same_floats(logged(resumed, "grad_norm"), logged(full, "grad_norm"))
    assert_params_equal(full.model, resumed.model)


@pytest.mark.parametrize("norm_pass", [True, False], ids=["norm_pass", "held"])
def test_plain_loop_with_gradscaler_matches_standard(norm_pass):
    # Outside Trainer: scaler.scale(loss) -> backward (with or without the measuring pass) -> scaler.step/update.
    model, reference = tiny_llama(), tiny_llama()
    args = LayerwiseTrainingArguments(output_dir="unused", optim="sgd_layerwise", learning_rate=0.1, report_to="none")
    optimizer = build_layerwise_optimizer(model, args)
    optimizer.configure_clipping(MAX_NORM, "exact")
    optimizer.attach()
    scaler, ref_scaler = torch.amp.GradScaler("cpu", **SCALER), torch.amp.GradScaler("cpu", **SCALER)
    optimizer.use_grad_scaler(scaler)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = TokenDataset()
    norms, ref_norms = [], []
    for k in range(6):
        batch = data[4 * k : 4 * k + 4]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        if norm_pass:
            backward_with_norm_pass(optimizer, scaler.scale(loss))
        else:
            scaler.scale(loss).backward()
        norms.append(float(optimizer.grad_norm()))
        scaler.step(optimizer)
        scaler.update()
        model.zero_grad()

        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = reference(**batch).loss
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.unscale_(sgd)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        ref_scaler.step(sgd)
        ref_scaler.update()
        sgd.zero_grad()
    assert not all(math.isfinite(n) for n in ref_norms), "no step overflowed"
    assert same_floats(norms, ref_norms)
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert_params_equal(reference, model)
    optimizer.detach()


@pytest.mark.parametrize("mode", ["previous", "per_param"])
def test_fp16_one_pass_modes_are_refused_with_alternatives(tmp_path, mode):
    with pytest.raises(ValueError, match=f"fp16=True and layerwise_clip='{mode}'.*'exact'.*bf16=True"):
        LayerwiseTrainingArguments(
            output_dir=str(tmp_path), optim="adamw_torch_layerwise", fp16=True, layerwise_clip=mode
        )
    # Without clipping there is nothing one-pass about the mode: fp16 runs (checked like 'off').
    LayerwiseTrainingArguments(
        output_dir=str(tmp_path), optim="adamw_torch_layerwise", fp16=True, layerwise_clip=mode, max_grad_norm=0.0
    )
    # The plain API refuses the same combination, whichever is set first.
    optimizer = build_layerwise_optimizer(tiny_llama(), training_args(tmp_path, "sgd_layerwise"))
    optimizer.configure_clipping(1.0, mode)
    with pytest.raises(ValueError, match="cannot run with fp16 loss scaling"):
        optimizer.use_grad_scaler(torch.amp.GradScaler("cpu"))
    optimizer.configure_clipping(1.0, "exact")
    optimizer.use_grad_scaler(torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="cannot run with fp16 loss scaling"):
        optimizer.configure_clipping(1.0, mode)
    assert optimizer.pipeline.clipper.mode.value == "exact"


def test_fp16_weights_are_refused_before_any_step(tmp_path):
    model = tiny_llama().half()
    optimizer = build_layerwise_optimizer(model, training_args(tmp_path, "sgd_layerwise"))
    with pytest.raises(ValueError, match="fp32 trainable weights.*float16.*Load the model in float32"):
        optimizer.use_grad_scaler(torch.amp.GradScaler("cpu"))
    # A disabled scaler is no scaler.
    optimizer.use_grad_scaler(torch.amp.GradScaler("cpu", enabled=False))


class SecondPassOverflow(Overflow):
    """
    Makes one gradient inf/nan in the stepping backward only (the norm pass saw it finite), as non-deterministic CUDA
    kernels can. `param_name` is a tensor in the middle of backward: some layers step before it.
    """

    def __init__(self, model, at_step, param_name):
        self.model, self.at_step = model, at_step
        self.active, self.calls, self.order = False, 0, []
        self.changed_params = self.changed_state = None
        for name, param in model.named_parameters():
            param.register_hook(lambda grad, name=name: self.order.append(name) if self.active else None)
        self.target = param_name
        dict(model.named_parameters())[param_name].register_hook(self._second_call_overflows)

    def _second_call_overflows(self, grad):
        if not self.active:
            return grad
        self.calls += 1
        return grad * float("inf") if self.calls == 2 else grad

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.calls, self.order = 0, []
        super().on_step_begin(args, state, control, optimizer=optimizer, **kwargs)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self.active:
            self.calls_in_step = self.calls
            stepping_pass = self.order[len(self.order) // 2 :]  # each gradient is computed once per pass
            self.computed_before_overflow = stepping_pass[: stepping_pass.index(self.target)]
        super().on_step_end(args, state, control, optimizer=optimizer, **kwargs)


@pytest.mark.parametrize("norm_pass", ["retain", "rerun"])
def test_fp16_overflow_in_the_stepping_pass_only_steps_nothing_after_it(tmp_path, norm_pass):
    model = tiny_llama()
    names = [n for n, _ in model.named_parameters()]
    target = "model.layers.0.mlp.down_proj.weight"
    args = training_args(
        tmp_path,
        "adamw_torch_layerwise",
        fp16=True,
        max_grad_norm=MAX_NORM,
        learning_rate=5e-2,
        layerwise_norm_pass=norm_pass,
    )
    overflow, scales = SecondPassOverflow(model, 2, target), ScaleRecorder()
    # A scale that never overflows by itself here: the only inf/nan is the injected one.
    trainer = fp16_train(model, args, [overflow, scales], scaler=dict(init_scale=2.0**8, growth_interval=1000))
    assert overflow.calls_in_step == 2, "the norm pass and the stepping pass each computed the gradient once"
    # What the stepping backward computed before the overflow stepped; the rest did not move.
    assert overflow.computed_before_overflow and len(overflow.computed_before_overflow) < len(names) - 1
    assert set(overflow.changed_params) == set(overflow.computed_before_overflow)
    assert target not in overflow.changed_params
    # No weight took the inf/nan; GradScaler counted the step as skipped and halved the scale.
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert scales.scales[2] == scales.scales[1] / 2
    lrs = logged(trainer, "learning_rate")
    assert lrs[3] == lrs[2], "the scheduler does not advance on a skipped step"


def test_fp16_stepping_pass_flags_are_reduced_again_after_its_backward(tmp_path, monkeypatch):
    # Under FSDP2 each rank checks only its own shards: after the stepping backward the flags go through the route's
    # reduction again (on every rank), so a shard-local overflow there makes every rank's GradScaler skip.
    from layerwise_hf.routes.hooks import LocalHooks

    seen = []
    monkeypatch.setattr(
        LocalHooks, "reduce_found_inf", lambda self, flags: seen.append(sum(float(f) for f in flags.values()))
    )
    model = tiny_llama()
    args = training_args(
        tmp_path,
        "adamw_torch_layerwise",
        fp16=True,
        max_grad_norm=MAX_NORM,
        learning_rate=5e-2,
        layerwise_norm_pass="retain",
        max_steps=4,
    )
    overflow = SecondPassOverflow(model, 2, "model.layers.0.mlp.down_proj.weight")
    fp16_train(model, args, [overflow], scaler=dict(init_scale=2.0**8, growth_interval=1000))
    # Per step: after the norm pass (0: finite there), after the stepping pass (1 at the injected step only).
    assert seen == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
