"""What users do during and between steps: exceptions, changes between `train()` calls, bad arguments, checkpoints
that cannot be resumed. Stock Trainer with the standard optimizer is the reference wherever both can run."""

import shutil

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, logged, tiny_llama, train, training_args
from transformers import Trainer, TrainerCallback

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments
from layerwise_hf.bases.params import canonical_name


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class RaiseOnce(TrainerCallback):
    """Arms a tensor hook that raises in the middle of backward (after the upper layers' gradients are done) on the
    given step, once: what a Ctrl-C, an OOM or a failing hook does to a step."""

    def __init__(self, model, step: int):
        self.step, self.armed, self.fired = step, False, False
        model.model.layers[0].register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.armed and torch.is_grad_enabled():
            self.armed, self.fired = False, True

            def boom(grad):
                raise KeyboardInterrupt("simulated Ctrl-C in backward")

            (output[0] if isinstance(output, tuple) else output).register_hook(boom)

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step == self.step and not self.fired


def test_train_works_again_after_an_exception_in_backward(tmp_path):
    model = tiny_llama()
    args = training_args(tmp_path, "adamw_torch_layerwise", max_steps=4)
    trainer = LayerwiseTrainer(model=model, args=args, train_dataset=TokenDataset())
    raiser = RaiseOnce(model, step=2)
    trainer.add_callback(raiser)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert raiser.fired
    before = params(model)
    trainer.train()  # the interrupted step's window is forgotten: no "fired twice", every step runs
    assert trainer.state.global_step == 4
    assert len(logged(trainer, "loss")) == 4
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # Nothing of the first run is still hooked: each parameter has exactly one layer-wise hook during training.
    assert not trainer.layerwise_optimizer.attached


class OOMAboveBatch(TrainerCallback):
    """A forward that runs out of memory above a batch size, as on a small GPU (before any layer steps)."""

    def __init__(self, model, limit: int):
        model.register_forward_pre_hook(self._check, with_kwargs=True)
        self.limit = limit

    def _check(self, module, args, kwargs):
        if kwargs["input_ids"].shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


@pytest.mark.slow
def test_auto_find_batch_size_retries_like_stock_trainer(tmp_path):
    runs = {}
    for optim in ("adamw_torch", "adamw_torch_layerwise"):
        model = tiny_llama()
        OOMAboveBatch(model, limit=4)
        args = training_args(
            tmp_path / optim, optim, per_device_train_batch_size=8, auto_find_batch_size=True, max_grad_norm=1.0
        )
        trainer_cls = LayerwiseTrainer if optim.endswith("_layerwise") else Trainer
        trainer = trainer_cls(model=model, args=args, train_dataset=TokenDataset())
        trainer.train()
        assert trainer._train_batch_size == 4
        runs[optim] = trainer
    assert_params_equal(runs["adamw_torch"].model, runs["adamw_torch_layerwise"].model)
    assert logged(runs["adamw_torch"], "grad_norm") == logged(runs["adamw_torch_layerwise"], "grad_norm")


class OOMInBackward:
    """A backward that runs out of memory above a batch size in the middle (at the first decoder layer, after the
    upper layers' gradients are done): with layer-wise steps in backward, the upper layers could have stepped."""

    def __init__(self, model, limit: int):
        self.limit, self.raised = limit, 0
        model.model.layers[0].register_full_backward_hook(self._check)

    def _check(self, module, grad_input, grad_output):
        if grad_output[0].shape[0] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


class StepsBeforeLayer0Backward(TrainerCallback):
    """Per training step, how many inner optimizers had stepped when backward reached the first decoder layer."""

    def __init__(self, model, optimizer):
        self.counts, self.steps = [], 0
        for inner in optimizer.inner:
            inner.register_step_post_hook(self._count)
        model.model.layers[0].register_full_backward_pre_hook(lambda *_: self.counts.append(self.steps))

    def _count(self, *_):
        self.steps += 1

    def on_step_begin(self, *_, **__):
        self.steps = 0


@pytest.mark.parametrize("clip", ["off", "per_param"])
def test_auto_find_batch_size_after_oom_in_backward_retries_from_weights_like_stock(tmp_path, clip):
    # One-pass steps: every layer steps in backward. The reference retries from untouched weights: stock Trainer
    # without clipping; with per-parameter clipping (stock has none), a layer-wise run at the final batch size from the
    # start, without auto_find_batch_size.
    runs, ooms, initial = {}, {}, tiny_llama()
    reference = "adamw_torch" if clip == "off" else "adamw_torch_layerwise"
    for run in ("reference", "oom"):
        optim = "adamw_torch_layerwise" if run == "oom" else reference
        model = clone(initial)
        oom = ooms[run] = OOMInBackward(model, limit=4)
        auto = run == "oom" or clip == "off"
        args = training_args(
            tmp_path / run,
            optim,
            per_device_train_batch_size=8 if auto else 4,
            auto_find_batch_size=auto,
            max_steps=3,
            max_grad_norm=0.0 if clip == "off" else 0.05,
            layerwise_clip=clip,
        )
        trainer_cls = LayerwiseTrainer if optim.endswith("_layerwise") else Trainer
        trainer = trainer_cls(model=model, args=args, train_dataset=TokenDataset())
        if run == "oom":
            trainer.create_optimizer()
            seen = StepsBeforeLayer0Backward(model, trainer.layerwise_optimizer)
            trainer.add_callback(seen)
        trainer.train()
        assert oom.raised >= auto and trainer._train_batch_size == 4  # accelerate retries at smaller batches
        runs[run] = trainer
    assert_params_equal(runs["reference"].model, runs["oom"].model)
    assert logged(runs["reference"], "grad_norm") == logged(runs["oom"], "grad_norm")
    # Each attempt's first step (those that ran out of memory, and the one that fit) stepped nothing in backward;
    # the steps after it step the upper layers in backward again, before it reaches layer 0.
    attempts = ooms["oom"].raised + 1
    assert seen.counts[:attempts] == [0] * attempts
    assert len(seen.counts) == attempts + 2 and all(count > 0 for count in seen.counts[attempts:])


def test_clipping_arguments_changed_between_train_calls_are_followed(tmp_path):
    runs = {}
    base = tiny_llama()
    for optim in ("adamw_torch", "adamw_torch_layerwise"):
        model = clone(base)
        trainer_cls = LayerwiseTrainer if optim.endswith("_layerwise") else Trainer
        trainer = trainer_cls(model=model, args=training_args(tmp_path / optim, optim), train_dataset=TokenDataset())
        trainer.train()
        trainer.args.max_grad_norm = 0.05  # clips every step of the second run
        trainer.train()
        runs[optim] = trainer
    assert_params_equal(runs["adamw_torch"].model, runs["adamw_torch_layerwise"].model)
    assert logged(runs["adamw_torch"], "grad_norm") == logged(runs["adamw_torch_layerwise"], "grad_norm")


FROZEN = "model.layers.0.mlp.up_proj.weight"


def optimizer_state(trainer, name) -> dict[str, torch.Tensor]:
    """The optimizer state of one parameter, from the standard optimizer or from its layer-wise inner optimizer."""
    param = trainer.model.get_parameter(name)
    layerwise = getattr(trainer, "layerwise_optimizer", None)
    if layerwise is not None:
        return dict(layerwise.inner[layerwise.names.index(name)].state[param])
    return dict(trainer.optimizer.state[param])


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(torch.as_tensor(a[key]).float(), torch.as_tensor(b[key]).float()), key


@pytest.mark.parametrize("base", ["adamw_torch", "adamw_8bit"])
def test_tensor_frozen_between_train_calls_trains_on_like_stock(tmp_path, base):
    pytest.importorskip("bitsandbytes") if base == "adamw_8bit" else None
    runs = {}
    initial = tiny_llama()
    for optim in (base, f"{base}_layerwise"):
        model = clone(initial)
        args = training_args(tmp_path / optim, optim, max_steps=3, save_strategy="steps", save_steps=3)
        trainer_cls = LayerwiseTrainer if optim.endswith("_layerwise") else Trainer
        trainer = trainer_cls(model=model, args=args, train_dataset=TokenDataset())
        trainer.train()
        param = model.get_parameter(FROZEN)
        param.requires_grad_(False)
        weight, state = param.detach().clone(), optimizer_state(trainer, FROZEN)
        steps = []
        if optim.endswith("_layerwise"):
            inner = trainer.layerwise_optimizer.inner[trainer.layerwise_optimizer.names.index(FROZEN)]
            inner.register_step_pre_hook(lambda *_, steps=steps: steps.append(1))
        trainer.train()  # the same trainer, as a user would
        assert torch.equal(param, weight) and steps == []  # not stepped: no decay, no momentum
        assert_states_equal(optimizer_state(trainer, FROZEN), state)
        runs[optim] = trainer
    stock, layerwise = runs[base], runs[f"{base}_layerwise"]
    assert_params_equal(stock.model, layerwise.model)
    for name, _ in stock.model.named_parameters():
        assert_states_equal(optimizer_state(stock, name), optimizer_state(layerwise, name))
    assert logged(stock, "grad_norm") == logged(layerwise, "grad_norm")
    # The checkpoint saved after the freeze resumes on the same trainer, as stock Trainer's does.
    for trainer in runs.values():
        trainer.args.max_steps = 5
        trainer.train(resume_from_checkpoint=str(trainer.args.output_dir) + "/checkpoint-3")
    assert_params_equal(stock.model, layerwise.model)
    assert torch.equal(layerwise.model.get_parameter(FROZEN), stock.model.get_parameter(FROZEN))


def test_tensor_unfrozen_between_train_calls_is_refused_naming_it(tmp_path):
    model = tiny_llama()
    model.lm_head.weight.requires_grad_(False)
    trainer = LayerwiseTrainer(
        model=model, args=training_args(tmp_path, "adamw_torch_layerwise", max_steps=2), train_dataset=TokenDataset()
    )
    trainer.train()
    model.lm_head.weight.requires_grad_(True)
    before = params(model)
    # Stock Trainer silently never trains it: its optimizer was built without it.
    with pytest.raises(ValueError, match=r"trainable since: \['lm_head.weight'\].*trainer.optimizer = None"):
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    # What the message says works: a new optimizer and scheduler for the new set.
    trainer.optimizer, trainer.lr_scheduler = None, None
    trainer.train()
    assert trainer.layerwise_optimizer.names == [n for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0: it must be a whole number >= 1"),
        ({"optim_args": "garbage"}, "'garbage' is not key=value"),
        ({"optim_args": "rank=128,scale"}, "'scale' is not key=value"),
    ],
)
def test_arguments_trainer_reads_late_are_checked_when_made(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", **overrides)


def test_fsdp1_is_refused_before_any_wrapping(tmp_path):
    # At argument time: on CPU, Accelerate's FSDP1 plugin would otherwise fail first with an unrelated error.
    with pytest.raises(ValueError, match="needs FSDP2.*FSDP1 flattens parameters"):
        training_args(tmp_path, "adamw_torch_layerwise", fsdp=True, fsdp_config={"version": 1})
    training_args(tmp_path, "adamw_torch", fsdp=True, fsdp_config={"version": 1})  # standard optimizers: Trainer's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    args = training_args(out, "adamw_torch_layerwise", max_steps=2, save_strategy="steps", save_steps=2)
    LayerwiseTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset()).train()
    return out / "checkpoint-2"


def fresh(tmp_path):
    model = tiny_llama(seed=3)
    trainer = LayerwiseTrainer(
        model=model, args=training_args(tmp_path, "adamw_torch_layerwise", max_steps=4), train_dataset=TokenDataset()
    )
    return model, trainer


def test_missing_checkpoint_keeps_trainers_words(tmp_path):
    _, trainer = fresh(tmp_path)
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at .*checkpoint-9"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-9"))


def test_checkpoint_with_weights_only_is_file_not_found_as_with_trainer(checkpoint, tmp_path):
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    shutil.copy(checkpoint / "model.safetensors", weights_only)
    shutil.copy(checkpoint / "config.json", weights_only)
    model, trainer = fresh(tmp_path / "out")
    before = params(model)
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        trainer.train(resume_from_checkpoint=str(weights_only))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("name", ["scheduler.pt", "rng_state.pth"])
def test_unloadable_file_is_named_before_anything_loads(checkpoint, tmp_path, name):
    broken = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, broken)
    data = (broken / name).read_bytes()
    (broken / name).write_bytes(data[: len(data) // 2])
    model, trainer = fresh(tmp_path / "out")
    before = params(model)
    with pytest.raises(ValueError, match=rf"{name} cannot be loaded"):
        trainer.train(resume_from_checkpoint=str(broken))
    # The model's weights were not loaded from the checkpoint before the error.
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_nonfinite_optimizer_state_is_refused_unless_accepted(checkpoint, tmp_path):
    broken = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, broken)
    state = torch.load(broken / "optimizer.pt", weights_only=True)
    index = next(g["params"][0] for g in state["param_groups"] if g["name"] == "lm_head.weight")
    state["state"][index]["exp_avg_sq"][0, 0] = float("nan")
    torch.save(state, broken / "optimizer.pt")
    model, trainer = fresh(tmp_path / "out")
    before = params(model)
    with pytest.raises(
        ValueError, match=r"NaN or inf .*lm_head\.weight\.exp_avg_sq.*layerwise_accept_nonfinite_state"
    ):
        trainer.train(resume_from_checkpoint=str(broken))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    model, trainer = fresh(tmp_path / "accepting")
    trainer.args.layerwise_accept_nonfinite_state = True
    trainer.train(resume_from_checkpoint=str(broken))  # what the user asked for: the NaN comes through
    assert torch.isnan(model.lm_head.weight).any()


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt"])
def test_missing_optimizer_or_scheduler_state_is_warned_about(checkpoint, tmp_path, caplog, name):
    partial = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, partial)
    (partial / name).unlink()
    _, trainer = fresh(tmp_path / "out")
    with caplog.at_level("WARNING", logger="layerwise_hf.integrations.checkpoint"):
        trainer.train(resume_from_checkpoint=str(partial))
    assert any(name in r.getMessage() and "fresh" in r.getMessage() for r in caplog.records)


def test_optimizer_step_after_train_does_not_clip_like_torch(tmp_path):
    # A user's own loop after train(): torch's step() never clips, so Trainer's max_grad_norm must not follow.
    model = tiny_llama()
    batch = TokenDataset()[0]
    inputs = {k: v[None] for k, v in batch.items()}
    runs = {}
    for optim in ("sgd", "sgd_layerwise"):
        args = training_args(tmp_path / optim, optim, max_steps=2, max_grad_norm=0.01, lr_scheduler_type="constant")
        trainer = train(clone(model), args)
        trainer.model(**inputs).loss.backward()
        trainer.optimizer.step()
        runs[optim] = trainer
    assert_params_equal(runs["sgd"].model, runs["sgd_layerwise"].model)
    optimizer = runs["sgd_layerwise"].layerwise_optimizer
    assert (optimizer.pipeline.clipper.mode.value, optimizer.attached) == ("off", False)


class AuxiliaryBackward:
    """compute_loss runs the backward of an auxiliary loss itself (retain_graph=True), before Trainer's backward."""

    via_accelerator = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        aux = outputs.logits.float().pow(2).mean() * 1e-2
        if self.via_accelerator:
            self.accelerator.backward(aux, retain_graph=True)
        else:
            aux.backward(retain_graph=True)
        return outputs.loss


class AuxStock(AuxiliaryBackward, Trainer):
    pass


class AuxLayerwise(AuxiliaryBackward, LayerwiseTrainer):
    pass


@pytest.mark.parametrize("via_accelerator", [False, True], ids=["loss.backward", "accelerator.backward"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
@pytest.mark.parametrize("ga", [1, 2])
def test_second_backward_in_compute_loss_accumulates_like_the_standard_optimizer(
    tmp_path, ga, max_grad_norm, via_accelerator, monkeypatch
):
    monkeypatch.setattr(AuxiliaryBackward, "via_accelerator", via_accelerator)
    model = tiny_llama()
    kwargs = dict(max_steps=3, gradient_accumulation_steps=ga, max_grad_norm=max_grad_norm)
    standard = train(clone(model), training_args(tmp_path / "s", "adamw_torch", **kwargs), trainer_cls=AuxStock)
    layerwise = train(
        clone(model), training_args(tmp_path / "l", "adamw_torch_layerwise", **kwargs), trainer_cls=AuxLayerwise
    )
    assert_params_equal(standard.model, layerwise.model)
    assert logged(standard, "grad_norm") == logged(layerwise, "grad_norm")


def test_checkpoint_of_transformers_own_galore_resumes_with_a_fresh_optimizer(tmp_path, caplog):
    pytest.importorskip("galore_torch")
    galore = dict(optim_target_modules=["q_proj", "v_proj"], weight_decay=0.0, max_steps=4)
    args = training_args(tmp_path / "stock", "galore_adamw_layerwise", save_strategy="steps", save_steps=2, **galore)
    try:
        train(tiny_llama(), args, trainer_cls=Trainer)  # transformers' own layer-wise GaLore: a dummy optimizer state
    except ValueError as error:
        # transformers 4.x's LayerWiseDummyScheduler has one lr for no param group, which torch 2.13's
        # scheduler refuses (zip(..., strict=True)): that stack cannot write such a checkpoint at all.
        if "zip() argument 2 is longer than argument 1" not in str(error):
            raise
        pytest.skip(f"transformers' own layer-wise GaLore does not train on this transformers/torch: {error}")
    uninterrupted = train(tiny_llama(), training_args(tmp_path / "whole", "galore_adamw_layerwise", **galore))
    model = tiny_llama()
    before = params(model)
    with caplog.at_level("WARNING", logger="layerwise_hf.integrations.trainer"):
        resumed = train(
            model,
            training_args(tmp_path / "resumed", "galore_adamw_layerwise", **galore),
            resume_from_checkpoint=str(tmp_path / "stock" / "checkpoint-2"),
        )
    assert any("saves no optimizer state" in r.getMessage() for r in caplog.records)
    # The schedule goes on from step 2, as in an uninterrupted run; the weights trained on from the checkpoint.
    assert logged(resumed, "learning_rate")[-2:] == logged(uninterrupted, "learning_rate")[-2:]
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if "proj" in n)


def checkpoint_wrap_layers(model):
    # What accelerate's fsdp_activation_checkpointing does to each decoder layer: a wrapper renaming its parameters.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    # transformers 4.x keeps a KV cache in training unless told not to (its own gradient checkpointing turns it
    # off; a wrapper applied from outside does not), and each recomputed layer would append to it a second time.
    model.config.use_cache = False
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())


def test_activation_checkpoint_wrapper_applied_after_the_optimizer_trains_like_stock(tmp_path):
    model = tiny_llama()
    standard = clone(model)
    checkpoint_wrap_layers(standard)
    standard = train(standard, training_args(tmp_path / "s", "adamw_torch", max_steps=3), trainer_cls=Trainer)
    layerwise = LayerwiseTrainer(
        model=clone(model),
        args=training_args(tmp_path / "l", "adamw_torch_layerwise", max_steps=3),
        train_dataset=TokenDataset(),
    )
    layerwise.create_optimizer()
    checkpoint_wrap_layers(layerwise.model)  # after the optimizer was built, as a wrapping engine would
    layerwise.train()
    assert_params_equal(standard.model, layerwise.model)
    assert "model.layers.0.mlp.up_proj.weight" in layerwise.layerwise_optimizer.names


def test_checkpoint_saved_unwrapped_resumes_into_a_checkpoint_wrapped_model(tmp_path):
    args = dict(max_steps=4, save_strategy="steps", save_steps=2)
    unwrapped_model = tiny_llama()
    # as checkpoint_wrap_layers sets it: on transformers 4.55, use_cache on and off differ in the last bits
    unwrapped_model.config.use_cache = False
    whole = train(unwrapped_model, training_args(tmp_path / "whole", "adamw_torch_layerwise", **args))
    model = tiny_llama()
    checkpoint_wrap_layers(model)
    resumed = train(
        model,
        training_args(tmp_path / "resumed", "adamw_torch_layerwise", max_steps=4),
        resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"),
    )
    unwrapped = {canonical_name(n): p for n, p in resumed.model.named_parameters()}
    for name, p in whole.model.named_parameters():
        assert torch.equal(p, unwrapped[name]), name
