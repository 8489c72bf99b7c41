"""The registry: built-in bases resolve through Trainer; third-party optimizers register and train."""

import importlib.util

import pytest
import torch
from helpers import assert_params_equal, clone, tiny_llama, train, training_args
from transformers import Trainer

from layerwise_hf import register_layerwise_optimizer, unregister_layerwise_optimizer
from layerwise_hf.bases.registry import resolve_factory


@pytest.fixture
def adam_l2():
    def factory(lp, args):
        return torch.optim.Adam([lp.param], lr=args.learning_rate, weight_decay=lp.weight_decay, betas=(0.8, 0.9))

    register_layerwise_optimizer("adam_l2_layerwise", factory)
    yield factory
    unregister_layerwise_optimizer("adam_l2_layerwise")


def test_third_party_optimizer_trains_like_its_standard_form(tmp_path, adam_l2):
    model = tiny_llama()
    standard = train(
        clone(model),
        training_args(tmp_path, "adamw_torch"),
        trainer_cls=Trainer,
        optimizer_cls_and_kwargs=(torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.9)}),
    )
    layerwise = train(clone(model), training_args(tmp_path, "adam_l2_layerwise"))
    assert_params_equal(standard.model, layerwise.model)
    assert all(type(inner) is torch.optim.Adam for inner in layerwise.layerwise_optimizer.inner)


def test_registration_is_validated(adam_l2):
    with pytest.raises(ValueError, match="already registered"):
        register_layerwise_optimizer("adam_l2_layerwise", adam_l2)
    with pytest.raises(ValueError, match="end in '_layerwise'"):
        register_layerwise_optimizer("Adam_L2", adam_l2)
    with pytest.raises(ValueError, match="built-in"):
        register_layerwise_optimizer("sgd_layerwise", adam_l2)
    with pytest.raises(TypeError, match="callable"):
        register_layerwise_optimizer("other_layerwise", "not a factory")


def test_trainer_settings_reach_the_inner_optimizers(tmp_path):
    args = training_args(tmp_path, "adamw_torch_layerwise", adam_beta1=0.7, adam_beta2=0.8, adam_epsilon=1e-5)
    factory = resolve_factory(args)
    assert factory.optimizer_cls is torch.optim.AdamW
    assert factory.kwargs["betas"] == (0.7, 0.8) and factory.kwargs["eps"] == 1e-5
    sgd = resolve_factory(training_args(tmp_path, "sgd_layerwise", optim_args="momentum=0.9,nesterov=true"))
    stock_cls, stock_kwargs = Trainer.get_optimizer_cls_and_kwargs(
        training_args(tmp_path, "sgd", optim_args="momentum=0.9,nesterov=true")
    )
    assert sgd.optimizer_cls is stock_cls and sgd.kwargs == stock_kwargs
    # transformers reads SGD's optim_args from 5.2 (the `trainer_optimizer` module); 4.x ignores them for SGD.
    if importlib.util.find_spec("transformers.trainer_optimizer") is not None:
        assert sgd.kwargs["momentum"] == 0.9 and sgd.kwargs["nesterov"] is True


def test_bitsandbytes_private_manager_ignores_global_overrides(tmp_path):
    # Trainer's standard 8-bit path registers embedding overrides on the process-wide manager; they must not leak
    # into per-parameter optimizers (all of which are group 0, index 0).
    import bitsandbytes as bnb

    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.index2config[(0, 0)] = {"optim_bits": 32}
    try:
        model = tiny_llama(vocab=256, hidden=64)
        args = training_args(tmp_path, "adamw_8bit_layerwise")
        from layerwise_hf import build_layerwise_optimizer

        optimizer = build_layerwise_optimizer(model, args)
        assert all(inner.mng is not manager for inner in optimizer.inner)
        model(
            input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)
        ).loss.backward()
        optimizer.step()
        up = optimizer.names.index("model.layers.0.mlp.up_proj.weight")
        assert optimizer.inner[up].state[optimizer.param_groups[up]["params"][0]]["state1"].dtype == torch.uint8
    finally:
        del manager.index2config[(0, 0)]


def test_factory_errors_name_the_parameter_and_the_optimizer(tmp_path):
    from layerwise_hf import build_layerwise_optimizer

    register_layerwise_optimizer("muon_2d_only_layerwise", lambda lp, args: torch.optim.Muon([lp.param], lr=0.1))
    try:
        args = training_args(tmp_path, "muon_2d_only_layerwise")
        match = r"Muon only supports 2D.*muon_2d_only_layerwise optimizer of model\.layers\.0\.input_layernorm"
        with pytest.raises(ValueError, match=match):
            build_layerwise_optimizer(tiny_llama(), args)
    finally:
        unregister_layerwise_optimizer("muon_2d_only_layerwise")


@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_8bit_layerwise_states_share_one_quantization_map_as_the_standard_optimizers_do(tmp_path, offload):
    # bitsandbytes makes its maps on the host and copies them to the parameter's device at its first step: one
    # standard optimizer once, one optimizer per parameter once per parameter, inside the first backward (two device
    # syncs each: 310 on an H200 for a 1.1B Llama). Moved when the optimizer is built (to the host for host-stepped
    # parameters) and shared, the first step finds them where it needs them, and the weights are the standard ones.
    pytest.importorskip("bitsandbytes")
    from layerwise_hf import unwrap_layerwise_optimizer

    model, reference = tiny_llama(hidden=64), tiny_llama(hidden=64)  # 64 x 64 matrices: 8-bit states
    trainer = train(model, training_args(tmp_path, "adamw_8bit_layerwise", layerwise_offload=offload))
    optimizer = unwrap_layerwise_optimizer(trainer.optimizer)
    maps = {id(s["qmap1"]) for inner in optimizer.inner for s in inner.state.values() if "qmap1" in s}
    assert len(maps) == 1
    train(reference, training_args(tmp_path / "reference", "adamw_8bit"))
    assert_params_equal(model, reference)
