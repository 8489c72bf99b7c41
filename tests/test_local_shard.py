"""`LocalShardOptimizer` on one process (the FSDP2 runs are in tests/distributed/fsdp2_8bit.py): it steps and saves
exactly as the optimizer it wraps, and only bitsandbytes optimizers are wrapped."""

import pytest
import torch
from helpers import tiny_llama, training_args
from transformers.optimization import Adafactor

from layerwise_hf import build_layerwise_optimizer
from layerwise_hf.bases.params import isolate_bnb_overrides
from layerwise_hf.bases.support import check_fsdp2_optimizers
from layerwise_hf.placement.local_shard import LocalShardOptimizer

bnb = pytest.importorskip("bitsandbytes")


def adamw_8bit(param):
    # A private override manager: the process-wide one holds the overrides earlier Trainer runs registered.
    return isolate_bnb_overrides(bnb.optim.AdamW([param], lr=1e-2, weight_decay=0.1, optim_bits=8))


def steps(optimizer, param, grads):
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        param.grad = None


def adafactor(param):
    return Adafactor([param], lr=None, weight_decay=0.1)


@pytest.mark.parametrize(
    "build,key", [(adamw_8bit, "state1"), (adafactor, "exp_avg_sq_row")], ids=["8bit", "adafactor"]
)
def test_steps_and_resumes_like_the_wrapped_optimizer(build, key):
    torch.manual_seed(0)
    start = torch.randn(64, 128)
    grads = [torch.randn(64, 128) for _ in range(6)]
    plain, wrapped = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference, optimizer = build(plain), LocalShardOptimizer(build(wrapped))
    steps(reference, plain, grads)
    steps(optimizer, wrapped, grads[:3])
    assert key in optimizer.state[wrapped]
    # A fresh wrapper loads the saved state and continues as if uninterrupted.
    resumed = LocalShardOptimizer(build(wrapped))
    resumed.load_state_dict(optimizer.state_dict())
    steps(resumed, wrapped, grads[3:])
    assert torch.equal(plain, wrapped)


def test_a_state_cut_for_another_number_of_shards_is_refused():
    param = torch.nn.Parameter(torch.randn(64, 128))
    optimizer = LocalShardOptimizer(adamw_8bit(param))
    steps(optimizer, param, [torch.randn(64, 128)])
    saved = optimizer.state_dict()
    saved["state"][0]["local_shards"] = 4
    with pytest.raises(ValueError, match="saved on 4 FSDP2 shards and cannot resume on 1.*Resume on 4 ranks"):
        LocalShardOptimizer(adamw_8bit(param)).load_state_dict(saved)


@pytest.mark.parametrize("optim", ["adamw_8bit_layerwise", "adafactor_layerwise"])
def test_only_optimizers_that_cannot_step_dtensors_step_local_shards(tmp_path, optim):
    model = tiny_llama()
    wrapped = build_layerwise_optimizer(model, training_args(tmp_path, optim), local_shards=True)
    assert all(isinstance(inner, LocalShardOptimizer) for inner in wrapped.inner)
    check_fsdp2_optimizers(wrapped.optimizer_name, wrapped.inner)  # allowed under FSDP2
    torch_adamw = build_layerwise_optimizer(model, training_args(tmp_path, "adamw_torch_layerwise"), local_shards=True)
    assert not any(isinstance(inner, LocalShardOptimizer) for inner in torch_adamw.inner)
    # Without the wrapper they cannot step a DTensor: refused, naming what works.
    unwrapped = build_layerwise_optimizer(model, training_args(tmp_path, optim))
    with pytest.raises(ValueError, match=r"cannot step FSDP2 shards.*built for local shards.*local_shards=True"):
        check_fsdp2_optimizers(unwrapped.optimizer_name, unwrapped.inner)


def test_a_checkpoint_of_0_1_names_the_wrapper_by_its_old_module_and_still_loads(tmp_path):
    # 0.1 had no package folders: its checkpoints name the class `layerwise_hf.local_shard.LocalShardOptimizer`.
    model = tiny_llama()
    args = training_args(tmp_path, "adamw_8bit_layerwise")
    optimizer = build_layerwise_optimizer(model, args, local_shards=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = optimizer.state_dict()
    classes = saved["layerwise_hf"]["optimizer_classes"]
    assert "layerwise_hf.placement.local_shard.LocalShardOptimizer" in classes
    # 0.1's path, and the path before the wrappers moved to `placement/` (`routes.local_shard`).
    for old in (".local_shard.", ".routes.local_shard."):
        saved["layerwise_hf"]["optimizer_classes"] = [c.replace(".placement.local_shard.", old) for c in classes]
        resumed = build_layerwise_optimizer(model, args, local_shards=True)
        resumed.load_state_dict(saved)
        assert all(
            torch.equal(a, b)
            for a, b in zip(resumed.state_dict()["state"][0].values(), saved["state"][0].values())
            if isinstance(a, torch.Tensor)
        )
    # Another class is still refused.
    saved["layerwise_hf"]["optimizer_classes"] = ["torch.optim.adamw.AdamW"] * len(classes)
    with pytest.raises(ValueError, match="saved optimizer torch.optim.adamw.AdamW"):
        build_layerwise_optimizer(model, args, local_shards=True).load_state_dict(saved)
