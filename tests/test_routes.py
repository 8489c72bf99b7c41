"""The one-process route's held step: an untied lm_head steps right before the input embedding's gradient is
computed, not first in backward; results stay bit-identical to the standard optimizer."""

import pytest
from helpers import TokenDataset, assert_params_equal, clone, tiny_llama, train, training_args

from layerwise_hf import LayerwiseTrainer, build_layerwise_optimizer
from layerwise_hf.optim.memory import tensor_bytes
from layerwise_hf.routes.hooks import LocalHooks

# lm_head and the embedding (256 x 32) are four times any layer tensor: the only "large" ones.
VOCAB = 256
MAX_NORM = 0.5


def model_and_data():
    return tiny_llama(vocab=VOCAB), TokenDataset(vocab=VOCAB)


class Recorder:
    """What happened in each backward: the order inner optimizers stepped, and the gradient bytes alive at every
    gradient hook (counted before the route sees the gradient), through public instrumentation only."""

    def __init__(self, model, optimizer):
        self.optimizer = optimizer
        self.steps: list[str] = []
        self.alive: list[int] = []
        self.held_seen: list[tuple[int, ...]] = []
        params = list(model.parameters())
        for name, inner in zip(optimizer.names, optimizer.inner):
            inner.register_step_pre_hook(lambda opt, args, kwargs, name=name: self.steps.append(name))

        def sample(param):
            self.alive.append(sum(tensor_bytes(p.grad) for p in params if p.grad is not None))
            route = optimizer.pipeline.route
            self.held_seen.append(route.delayed if route is not None else ())

        # Registered before the route's hooks, so each sample includes the gradient just computed.
        for p in params:
            p.register_post_accumulate_grad_hook(sample)


def plain_loop(model, dataset, steps: int = 3, **args):
    optimizer = build_layerwise_optimizer(model, training_args("/tmp/unused", "adamw_torch_layerwise", **args))
    recorder = Recorder(model, optimizer)
    optimizer.attach(sync_gradients=lambda: True)
    per_step = []
    for step in range(steps):
        recorder.steps.clear()
        recorder.alive.clear()
        ids = dataset.ids[4 * step : 4 * step + 4]
        model(input_ids=ids, labels=ids).loss.backward()
        assert optimizer.pipeline.route.delayed == ()  # everything released before backward returned
        per_step.append((list(recorder.steps), max(recorder.alive)))
        optimizer.step()
        optimizer.zero_grad()
    optimizer.detach()
    return per_step, optimizer


def test_lm_head_steps_right_before_the_embedding():
    model, data = model_and_data()
    per_step, optimizer = plain_loop(model, data)
    sizes = {n: tensor_bytes(p) for n, p in zip(optimizer.names, optimizer.params)}
    layer_largest = max(s for n, s in sizes.items() if n not in ("lm_head.weight", "model.embed_tokens.weight"))
    for order, alive in per_step:  # the first step too: planned from the reverse of the parameter order
        assert len(order) == len(sizes)
        # Without the hold lm_head, the first gradient ready, steps first.
        assert order[-2:] == ["lm_head.weight", "model.embed_tokens.weight"], order[:3] + order[-3:]
        # Held: lm_head's gradient next to one smaller one at a time, never next to the embedding's.
        assert alive == sizes["lm_head.weight"] + layer_largest


def test_the_hold_is_bit_identical_to_stepping_at_once():
    model, data = model_and_data()
    held = clone(model)
    plain_loop(held, data)
    at_once = clone(model)
    LocalHooks.delay_large_steps = False
    try:
        per_step, _ = plain_loop(at_once, data)
    finally:
        LocalHooks.delay_large_steps = True
    assert per_step[0][0][0] == "lm_head.weight"  # the control really steps lm_head first
    assert_params_equal(held, at_once)


class Watched(LayerwiseTrainer):
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.recorder = Recorder(self.model, optimizer)
        return optimizer


def standard_and_watched(tmp_path, **kwargs):
    """Trainer + adamw_torch, and the layer-wise run with a Recorder of what was held and stepped when."""
    model, data = model_and_data()
    standard = train(clone(model), training_args(tmp_path, "adamw_torch", **kwargs), dataset=data)
    layerwise = train(
        clone(model), training_args(tmp_path, "adamw_torch_layerwise", **kwargs), dataset=data, trainer_cls=Watched
    )
    return standard, layerwise


@pytest.mark.parametrize("max_grad_norm", [0.0, MAX_NORM])
@pytest.mark.parametrize("ga", [1, 2])
def test_trainer_matches_standard_with_the_hold(tmp_path, ga, max_grad_norm):
    # 'retain': the backward after the norm pass steps in backward (the rule would hold this activation-heavy model).
    kwargs = dict(
        gradient_accumulation_steps=ga, max_grad_norm=max_grad_norm, learning_rate=5e-2, layerwise_norm_pass="retain"
    )
    standard, layerwise = standard_and_watched(tmp_path, **kwargs)
    assert_params_equal(standard.model, layerwise.model)
    held = [h for h in layerwise.recorder.held_seen if h]
    if max_grad_norm and ga > 1:
        # Exact clipping after accumulation: every gradient waits for step(), none steps in backward to be held.
        assert not held
    else:
        # Without clipping, and with exact clipping in the backward that follows the norm pass (Trainer's default).
        lm_head = layerwise.layerwise_optimizer.names.index("lm_head.weight")
        assert held and all(h == (lm_head,) for h in held)


def test_no_hold_while_accumulating_or_measuring():
    model, data = model_and_data()
    optimizer = build_layerwise_optimizer(model, training_args("/tmp/unused", "adamw_torch_layerwise"))
    recorder = Recorder(model, optimizer)
    sync = {"value": False}
    optimizer.attach(sync_gradients=lambda: sync["value"])
    ids = data.ids[:4]
    model(input_ids=ids, labels=ids).loss.backward()  # accumulating
    assert not any(recorder.held_seen)
    optimizer.step()
    optimizer.zero_grad()
    optimizer.configure_clipping(MAX_NORM, "exact")
    sync["value"] = True
    recorder.held_seen.clear()
    with optimizer.pipeline.norm_pass():
        model(input_ids=ids, labels=ids).loss.backward()  # measuring: every gradient is freed at once
    assert recorder.held_seen and not any(recorder.held_seen)
    optimizer.detach()


def test_a_backward_cut_short_leaves_nothing_held():
    model, data = model_and_data()
    optimizer = build_layerwise_optimizer(model, training_args("/tmp/unused", "adamw_torch_layerwise"))
    recorder = Recorder(model, optimizer)
    optimizer.attach(sync_gradients=lambda: True)
    norm = model.model.norm.weight
    failing = {"armed": True}

    def fail(param):
        if failing["armed"]:
            failing["armed"] = False
            raise RuntimeError("boom")

    handle = norm.register_post_accumulate_grad_hook(fail)
    ids = data.ids[:4]
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    assert optimizer.pipeline.route.delayed  # lm_head was held when the backward died
    optimizer.zero_grad()
    # A new Trainer-style attach, or the next backward, starts clean: held again, released by its end.
    optimizer.connect(route=LocalHooks())
    recorder.held_seen.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    assert optimizer.pipeline.route.delayed == () and any(recorder.held_seen)
    optimizer.step()
    optimizer.zero_grad()
    # Without a new route: the next backward notices the one cut short and drops its notes.
    handle = norm.register_post_accumulate_grad_hook(fail)
    failing["armed"] = True
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    optimizer.step()  # steps what the dead backward left in .grad (lm_head's) and closes the window
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    assert optimizer.pipeline.route.delayed == () and all(p.grad is None for p in model.parameters())
    optimizer.detach()


@pytest.mark.parametrize("reentrant", [False, True])
def test_hold_under_activation_checkpointing_matches_standard(tmp_path, reentrant):
    # Reentrant checkpointing runs the checkpointed layers' hooks inside nested backwards: the end callback must still
    # belong to the outer one, so lm_head is held through them and released before the embedding's gradient.
    kwargs = dict(
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant}, learning_rate=5e-2
    )
    standard, layerwise = standard_and_watched(tmp_path, **kwargs)
    assert_params_equal(standard.model, layerwise.model)
    steps = layerwise.recorder.steps
    assert steps[-2:] == ["lm_head.weight", "model.embed_tokens.weight"]
    assert any(layerwise.recorder.held_seen)
