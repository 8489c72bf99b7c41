"""The one table of what is supported: every consumer reads it, and its FSDP2 allowlist names the classes Trainer
really builds."""

import pytest
import torch
from helpers import tiny_llama, training_args

from layerwise_hf import build_layerwise_optimizer
from layerwise_hf.bases import support
from layerwise_hf.estimate import estimate


@pytest.mark.parametrize("base", sorted(support.FSDP2_ELEMENTWISE))
def test_fsdp2_allowlist_names_the_class_trainer_builds(tmp_path, base):
    optimizer = build_layerwise_optimizer(tiny_llama(), training_args(tmp_path, f"{base}_layerwise"))
    assert {support.qualname(inner) for inner in optimizer.inner} == {support.FSDP2_ELEMENTWISE[base]}
    support.check_fsdp2_optimizers(optimizer.optimizer_name, optimizer.inner)  # allowed


def test_fsdp2_refusal_names_the_alternatives(tmp_path):
    optimizer = build_layerwise_optimizer(tiny_llama(), training_args(tmp_path, "adafactor_layerwise"))
    with pytest.raises(ValueError, match="cannot step FSDP2 shards.*adamw_torch_layerwise"):
        support.check_fsdp2_optimizers(optimizer.optimizer_name, optimizer.inner)


@pytest.mark.parametrize("base", ["adamw_torch", "adafactor", "adamw_8bit"])
def test_estimator_reads_the_same_fsdp2_table(base):
    result = estimate("llama-3-8b", optimizer=f"{base}_layerwise", sharding="fsdp2", world_size=8)
    refused = any("refused under FSDP2" in note for note in result.notes)
    assert refused == (not support.fsdp2_supports_base(base))


def test_refusals_have_one_message_each():
    with pytest.raises(ValueError, match="DeepSpeed, which owns the optimizer step"):
        support.check_deepspeed("adamw_torch_layerwise", True)
    with pytest.raises(ValueError, match="FSDP1 flattens parameters"):
        support.check_fsdp_version("adamw_torch_layerwise", 1)
    with pytest.raises(ValueError, match="cannot run with fp16 loss scaling"):
        support.check_fp16_clip_mode("previous", True, 1.0)
    support.check_fp16_clip_mode("previous", True, 0.0)  # no clipping: nothing steps early
    with pytest.raises(ValueError, match="fp32 trainable weights"):
        support.check_fp16_weights([("w", torch.zeros(2, dtype=torch.float16))])


def test_grokadamw_is_refused_with_why_and_what_instead(tmp_path):
    with pytest.raises(ValueError, match=r"'grokadamw_layerwise' is not supported: GrokAdamW scales") as err:
        training_args(tmp_path, "grokadamw_layerwise")
    assert "Use grokadamw (standard)" in str(err.value) and "adamw_torch_layerwise" in str(err.value)
    assert support.base_status("grokadamw").startswith("refused: GrokAdamW")


def test_grokadamw_really_is_not_per_tensor():
    # What the refusal says, checked against the package: a parameter's update depends on its position in the group,
    # and the state is not in optimizer.state (so optimizer.pt would hold none of it).
    grokadamw = pytest.importorskip("grokadamw")
    torch.manual_seed(0)
    first, second = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4))
    alone = torch.nn.Parameter(second.detach().clone())
    for p in (first, second, alone):
        p.grad = torch.ones_like(p)
    together = grokadamw.GrokAdamW([first, second], lr=0.1)
    per_parameter = grokadamw.GrokAdamW([alone], lr=0.1)
    for _ in range(2):
        together.step()
        per_parameter.step()
    assert not torch.equal(second, alone)
    assert not together.state and together.param_groups[0]["state"]


@pytest.mark.parametrize("hook", ["fp16", "power_sgd"])
def test_ddp_comm_hook_is_refused_under_the_data_parallel_route(hook):
    # The route reduces gradients itself: a compression hook the user configured would silently not apply.
    from types import SimpleNamespace

    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from layerwise_hf.routes.data_parallel import DataParallelConfig

    def accelerator(comm_hook):
        return SimpleNamespace(
            distributed_type="MULTI_CPU",
            ddp_handler=DistributedDataParallelKwargs(comm_hook=comm_hook),
            gradient_state=SimpleNamespace(plugin_kwargs={}),
        )

    with pytest.raises(ValueError, match=f"comm_hook='{hook}'.*Remove the comm hook"):
        DataParallelConfig.from_accelerator(accelerator(DDPCommunicationHookType(hook)))
    assert DataParallelConfig.from_accelerator(accelerator(DDPCommunicationHookType.NO)) is not None
