"""`LocalShardOptimizer` on one process (the FSDP2 runs are in tests/distributed/fsdp2_8bit.py): it steps and saves
exactly as the optimizer it wraps, and only bitsandbytes optimizers are wrapped."""

import pytest
import torch
from helpers import tiny_llama, training_args

from layerwise_hf import build_layerwise_optimizer
from layerwise_hf.local_shard import LocalShardOptimizer
from layerwise_hf.params import isolate_bnb_overrides
from layerwise_hf.support import check_fsdp2_optimizers

bnb = pytest.importorskip("bitsandbytes")


def adamw_8bit(param):
    # A private override manager: the process-wide one holds the overrides earlier Trainer runs registered.
    return isolate_bnb_overrides(bnb.optim.AdamW([param], lr=1e-2, weight_decay=0.1, optim_bits=8))


def steps(optimizer, param, grads):
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        param.grad = None


def test_steps_and_resumes_like_the_wrapped_optimizer():
    torch.manual_seed(0)
    start = torch.randn(64, 128)
    grads = [torch.randn(64, 128) for _ in range(6)]
    plain, wrapped = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference, optimizer = adamw_8bit(plain), LocalShardOptimizer(adamw_8bit(wrapped))
    steps(reference, plain, grads)
    steps(optimizer, wrapped, grads[:3])
    assert optimizer.state[wrapped]["state1"].dtype == torch.uint8
    # A fresh wrapper loads the saved state and continues as if uninterrupted.
    resumed = LocalShardOptimizer(adamw_8bit(wrapped))
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


def test_only_bitsandbytes_optimizers_step_local_shards(tmp_path):
    model = tiny_llama()
    eight_bit = build_layerwise_optimizer(model, training_args(tmp_path, "adamw_8bit_layerwise"), local_shards=True)
    assert all(isinstance(inner, LocalShardOptimizer) for inner in eight_bit.inner)
    check_fsdp2_optimizers(eight_bit.optimizer_name, eight_bit.inner)  # allowed under FSDP2
    torch_adamw = build_layerwise_optimizer(model, training_args(tmp_path, "adamw_torch_layerwise"), local_shards=True)
    assert not any(isinstance(inner, LocalShardOptimizer) for inner in torch_adamw.inner)
    # Without the wrapper bitsandbytes cannot step a DTensor: refused, naming what works.
    unwrapped = build_layerwise_optimizer(model, training_args(tmp_path, "adamw_8bit_layerwise"))
    with pytest.raises(
        ValueError, match="cannot step FSDP2 shards.*adamw_8bit_layerwise \\(blocks of the local shard"
    ):
        check_fsdp2_optimizers(unwrapped.optimizer_name, unwrapped.inner)
