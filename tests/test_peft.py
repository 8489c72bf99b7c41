"""PEFT LoRA: only the adapters get optimizers, state and hooks; the base stays bit-identical."""

import torch
from helpers import assert_params_equal, clone, tiny_llama, train, training_args
from peft import LoraConfig, get_peft_model


def lora_model():
    return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_lora_state_is_adapters_only(tmp_path):
    model = lora_model()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)

    standard = train(clone(model), training_args(tmp_path, "adamw_torch"))
    layerwise = train(model, training_args(tmp_path, "adamw_torch_layerwise"))
    optimizer = layerwise.layerwise_optimizer

    assert optimizer.names == list(lora)
    # AdamW keeps exp_avg and exp_avg_sq (fp32, like the parameter) and a scalar step per adapter tensor.
    expected = sum(2 * p.numel() * p.element_size() + 4 for p in lora.values())
    assert optimizer.pipeline.memory.state_bytes() == expected
    assert optimizer.pipeline.memory.state_bytes() == sum(
        v.numel() * v.element_size() for s in standard.optimizer.state.values() for v in s.values()
    )
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n
            assert not getattr(p, "_post_accumulate_grad_hooks", None)
    assert_params_equal(standard.model, layerwise.model)
    # LoRA B starts at zero: the adapters really trained.
    assert all(p.abs().max() > 0 for n, p in lora.items() if "lora_B" in n)
