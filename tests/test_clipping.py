"""max_grad_norm with layer-wise optimizers: exact parity with Trainer's clipping, bounded one-pass modes, bf16."""

import pytest
import torch
from helpers import (
    TokenDataset,
    assert_params_equal,
    clone,
    held_grad_bound,
    logged,
    tiny_llama,
    train,
    training_args,
)

from layerwise_hf import (
    LayerwiseOptimizer,
    LayerwiseParam,
    LayerwiseTrainer,
    LayerwiseTrainingArguments,
    build_layerwise_optimizer,
)
from layerwise_hf.optim.norm_pass import last_norm_pass, run_with_norm_pass
from layerwise_hf.platform.compat import checkpointing_kwargs

MAX_NORM = 0.5
# lr and max_norm chosen so the pre-clip norm exceeds max_norm on every step: clipping really acts.
CLIP = dict(max_grad_norm=MAX_NORM, learning_rate=5e-2)


class ForwardCounter(LayerwiseTrainer):
    forwards = 0

    def compute_loss(self, *args, **kwargs):
        self.forwards += 1
        return super().compute_loss(*args, **kwargs)


class AppliedGradRecorder(LayerwiseTrainer):
    """Records, per inner optimizer step, the norm of the gradient it actually applies."""

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.applied = []
        for inner in optimizer.inner:
            inner.register_step_pre_hook(
                lambda opt, *_: self.applied.append(torch.linalg.vector_norm(opt.param_groups[0]["params"][0].grad))
            )
        return optimizer


@pytest.mark.parametrize(
    "ga,norm_pass", [(1, "retain"), (1, "rerun"), (1, "hold"), (1, "auto"), (2, "auto")], ids=lambda v: str(v)
)
@pytest.mark.parametrize("base", ["adamw_torch", "sgd"])
def test_exact_clipping_matches_trainer(tmp_path, base, ga, norm_pass):
    model = tiny_llama()
    standard = train(clone(model), training_args(tmp_path, base, gradient_accumulation_steps=ga, **CLIP))
    layerwise = train(
        clone(model),
        training_args(
            tmp_path, f"{base}_layerwise", gradient_accumulation_steps=ga, layerwise_norm_pass=norm_pass, **CLIP
        ),
        trainer_cls=ForwardCounter,
    )
    norms = logged(standard, "grad_norm")
    assert min(norms) > MAX_NORM, "clipping must trigger for this test to mean anything"
    assert logged(layerwise, "grad_norm") == norms
    assert_params_equal(standard.model, layerwise.model)
    optimizer = layerwise.layerwise_optimizer
    way = norm_pass if norm_pass != "auto" or ga > 1 else last_norm_pass(optimizer).value
    # One forward per micro-batch, but two where the norm pass reruns it.
    assert layerwise.forwards == (12 if way == "rerun" else 6 * ga)
    if ga == 1 and way in ("retain", "rerun"):
        # Measured first, then stepped and freed one by one (lm_head's step held): never all gradients at once.
        assert (
            optimizer.pipeline.memory.peak_grad_bytes
            == held_grad_bound(layerwise.model)
            < optimizer.pipeline.memory.full_grad_bytes()
        )
    else:
        # Held for step() (accumulation, or 'hold': this tiny model's activations outweigh its gradients).
        assert optimizer.pipeline.memory.peak_grad_bytes == optimizer.pipeline.memory.full_grad_bytes()
    if norm_pass == "auto" and ga == 1:
        assert way == "hold", "activations outweigh the gradients of this tiny model: the rule holds"


def test_exact_clipping_without_norm_pass_holds_gradients_and_stays_exact():
    # A plain loop that does not call run_with_norm_pass still clips exactly: step() clips the held gradients.
    model, reference = tiny_llama(), tiny_llama()
    args = LayerwiseTrainingArguments(output_dir="unused", optim="sgd_layerwise", learning_rate=0.1, report_to="none")
    optimizer = build_layerwise_optimizer(model, args)
    optimizer.configure_clipping(MAX_NORM, "exact")
    optimizer.attach()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    batch = TokenDataset()[0:4]
    for _ in range(2):
        model(**batch).loss.backward()
        optimizer.step()
        reference(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        sgd.step()
        sgd.zero_grad()
    assert_params_equal(reference, model)
    optimizer.detach()


@pytest.mark.parametrize("mode", ["previous", "per_param"])
def test_one_pass_modes_bound_every_applied_gradient(tmp_path, mode):
    model = tiny_llama()
    exact = train(clone(model), training_args(tmp_path, "sgd_layerwise", **CLIP))
    trainer = train(
        clone(model),
        training_args(tmp_path, "sgd_layerwise", layerwise_clip=mode, **CLIP),
        trainer_cls=AppliedGradRecorder,
    )
    assert max(trainer.applied) <= MAX_NORM * (1 + 1e-5)
    # The logged norm is the true pre-clip one whatever the mode: the first step saw identical gradients.
    assert logged(trainer, "grad_norm")[0] == logged(exact, "grad_norm")[0]
    if mode == "previous":
        # When the norm does not grow past the previous step's, one scale (max_norm / previous norm) applies to
        # every tensor, so the whole step is bounded too.
        per_step = len(trainer.layerwise_optimizer.inner)
        norms = logged(trainer, "grad_norm")
        calm = [k for k in range(1, 6) if norms[k] <= norms[k - 1]]
        assert calm, "the run should have at least one step whose norm did not grow"
        for k in calm:
            step_norm = torch.linalg.vector_norm(torch.stack(trainer.applied[k * per_step : (k + 1) * per_step]))
            assert step_norm <= MAX_NORM * (1 + 1e-4)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_exact_clipping_with_gradient_checkpointing_matches_trainer(tmp_path, reentrant):
    # The measuring backward runs over a retained graph whose checkpointed segments recompute their forward.
    checkpointing = checkpointing_kwargs(True, {"use_reentrant": reentrant})
    model = tiny_llama()
    standard = train(clone(model), training_args(tmp_path, "adamw_torch", **checkpointing, **CLIP))
    layerwise = train(clone(model), training_args(tmp_path, "adamw_torch_layerwise", **checkpointing, **CLIP))
    assert min(logged(standard, "grad_norm")) > MAX_NORM
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")
    assert_params_equal(standard.model, layerwise.model)
    optimizer = layerwise.layerwise_optimizer
    assert optimizer.pipeline.memory.peak_grad_bytes < optimizer.pipeline.memory.full_grad_bytes()


@pytest.mark.slow
def test_exact_clipping_with_torch_compile(tmp_path):
    # A compiled backward refuses retain_graph, so the norm is measured with a second forward+backward instead.
    model = tiny_llama()
    kwargs = dict(torch_compile=True, max_steps=3, **CLIP)
    standard = train(clone(model), training_args(tmp_path, "adamw_torch", **kwargs))
    layerwise = train(
        clone(model), training_args(tmp_path, "adamw_torch_layerwise", **kwargs), trainer_cls=ForwardCounter
    )
    assert layerwise.forwards == 2 * 3
    norms = logged(standard, "grad_norm")
    assert min(norms) > MAX_NORM
    # Inductor's CPU embedding backward accumulates repeated tokens in a run-dependent order, so two compiled
    # standard runs already differ by float rounding: compare within it.
    assert logged(layerwise, "grad_norm") == pytest.approx(norms, rel=1e-6)
    assert_params_equal(standard.model, layerwise.model, atol=1e-6)


def test_bf16_autocast_matches_standard(tmp_path):
    model = tiny_llama()
    standard = train(clone(model), training_args(tmp_path, "adamw_torch", bf16=True, **CLIP))
    layerwise = train(clone(model), training_args(tmp_path, "adamw_torch_layerwise", bf16=True, **CLIP))
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")
    assert_params_equal(standard.model, layerwise.model)


@pytest.mark.parametrize("base", ["adamw_torch", "adamw_8bit"])
def test_pure_bf16_weights_match_standard(tmp_path, base):
    model = tiny_llama(vocab=256, hidden=64).to(torch.bfloat16)
    dataset = TokenDataset(vocab=256)
    standard = train(clone(model), training_args(tmp_path, base, **CLIP), dataset=dataset)
    layerwise = train(clone(model), training_args(tmp_path, f"{base}_layerwise", **CLIP), dataset=dataset)
    assert next(layerwise.model.parameters()).dtype == torch.bfloat16
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")
    assert_params_equal(standard.model, layerwise.model)


def test_unknown_clip_mode_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="exact, previous, per_param, off"):
        LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="sgd_layerwise", layerwise_clip="global")


def test_forward_twice_for_the_norm_pass_counts_running_statistics_once():
    # Where the norm pass reruns forward (DDP, FSDP2, torch.compile), BatchNorm must see the micro-batch once.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    reference = clone(model)
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    optimizer = LayerwiseOptimizer(params, lambda lp, _: torch.optim.SGD([lp.param], lr=0.1))
    optimizer.configure_clipping(0.1, "exact")
    optimizer.attach()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        run_with_norm_pass(optimizer, lambda x=x: model(x).pow(2).mean().backward(), model)
        optimizer.step()
        reference(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        sgd.step()
        sgd.zero_grad()
    optimizer.detach()
    assert_params_equal(model, reference)
    for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("max_grad_norm, fp16", [(1.0, False), (1.0, True), (0.0, True)])
def test_offload_runs_are_not_told_about_a_second_backward(caplog, max_grad_norm, fp16):
    # With layerwise_offload every gradient waits on the host for the norm and the inf check: one backward, so the
    # message about a second backward or holding every gradient would send users the wrong way.
    from layerwise_hf.integrations.trainer import _explain_clipping

    with caplog.at_level("WARNING", logger="layerwise_hf.integrations.trainer"):
        _explain_clipping(max_grad_norm, "exact", 1, fp16=fp16, offload="gradients")
    assert "second backward" not in caplog.text
    with caplog.at_level("WARNING", logger="layerwise_hf.integrations.trainer"):
        _explain_clipping(max_grad_norm, "exact", 1, fp16=fp16, offload="none")
    assert "second backward" in caplog.text
