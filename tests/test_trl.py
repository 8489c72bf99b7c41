"""TRL's SFT and DPO trainers with layer-wise optimizers (`layerwise_hf.integrations.trl`): every parameter
bit-identical to the same TRL trainer with the standard optimizer, with TRL's own defaults (bf16, gradient
checkpointing, clipping), and the configs keep those defaults."""

import copy
import dataclasses
import sys

import pytest
import torch
from helpers import assert_params_equal, logged
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, TrainingArguments, set_seed

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402 (trl brings datasets)
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from layerwise_hf import LayerwiseTrainingArguments  # noqa: E402
from layerwise_hf.integrations.trl import (  # noqa: E402
    LayerwiseDPOConfig,
    LayerwiseDPOTrainer,
    LayerwiseSFTConfig,
    LayerwiseSFTTrainer,
)

WORDS = [f"w{i}" for i in range(56)]
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]


def tiny_tokenizer():
    """A word-level tokenizer built in memory (no download): 56 words and 4 special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def tiny_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def sentence(g: torch.Generator, n: int) -> str:
    # A learnable pattern (next word = previous + 1) so the loss moves.
    start = int(torch.randint(0, len(WORDS), (1,), generator=g))
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def sft_dataset(n: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(1)
    return Dataset.from_dict({"text": [sentence(g, 6 + i % 5) for i in range(n)]})


def dpo_dataset(n: int = 16) -> Dataset:
    g = torch.Generator().manual_seed(2)
    prompts = [sentence(g, 4) for _ in range(n)]
    chosen = [sentence(g, 3 + i % 3) for i in range(n)]
    rejected = [" ".join(reversed(c.split())) for c in chosen]
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


# Only what a test needs to run fast and reproducibly on CPU; learning rate, bf16, gradient checkpointing, clipping
# (max_grad_norm=1.0) and the rest stay TRL's defaults.
RUN = dict(
    max_steps=3,
    per_device_train_batch_size=4,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    seed=0,
    data_seed=0,
    disable_tqdm=True,
)


def run(trainer_cls, config_cls, tmp_path, optim, model, tokenizer, dataset, **kwargs):
    kwargs = {k: copy.deepcopy(v) if k == "ref_model" else v for k, v in kwargs.items()}
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in config_cls.__dataclass_fields__}
    args = config_cls(output_dir=str(tmp_path / optim), optim=optim, **RUN, **overrides)
    # peft draws the LoRA adapters from the global generator inside the trainer's __init__; trl 1.x seeds it
    # first, trl 0.18 does not (each run would start from adapters of a different draw).
    set_seed(args.seed)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, **kwargs)
    trainer.train()
    return trainer


PAIRS = {
    "sft": (SFTTrainer, SFTConfig, LayerwiseSFTTrainer, LayerwiseSFTConfig),
    "dpo": (DPOTrainer, DPOConfig, LayerwiseDPOTrainer, LayerwiseDPOConfig),
}


def run_pair(kind, tmp_path, model, tokenizer, dataset, **kwargs):
    """The same run with TRL's trainer + adamw_torch and with the layer-wise trainer + adamw_torch_layerwise."""
    trl_trainer, trl_config, ours, our_config = PAIRS[kind]
    standard = run(
        trl_trainer, trl_config, tmp_path, "adamw_torch", copy.deepcopy(model), tokenizer, dataset, **kwargs
    )
    layerwise = run(
        ours, our_config, tmp_path, "adamw_torch_layerwise", copy.deepcopy(model), tokenizer, dataset, **kwargs
    )
    return standard, layerwise


def assert_same_training(model, standard, layerwise):
    assert_params_equal(standard.model, layerwise.model)
    moved = max(
        (p - q).abs().max().item()
        for (_, p), (_, q) in zip(model.named_parameters(), layerwise.model.named_parameters())
        if q.requires_grad
    )
    assert moved > 1e-6, "the run must move the weights, or the comparison proves nothing"
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")
    assert logged(layerwise, "loss") == logged(standard, "loss")
    assert logged(layerwise, "learning_rate") == logged(standard, "learning_rate")


@pytest.mark.parametrize("ga", [1, 2])
def test_sft_with_trl_defaults_matches_standard(tmp_path, ga):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    standard, layerwise = run_pair("sft", tmp_path, model, tokenizer, sft_dataset(), gradient_accumulation_steps=ga)
    args = layerwise.args
    # TRL's own defaults on both sides (trl 1.x: bf16 and gradient checkpointing on; trl 0.18: both off).
    trl_defaults = SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    settings = ("bf16", "gradient_checkpointing", "max_grad_norm", "learning_rate")
    assert [getattr(args, n) for n in settings] == [getattr(trl_defaults, n) for n in settings]
    assert args.max_grad_norm == 1.0 and args.learning_rate == 2e-5
    assert layerwise.layerwise_optimizer is not None
    assert (
        standard.model.is_gradient_checkpointing
        == layerwise.model.is_gradient_checkpointing
        == args.gradient_checkpointing
    )
    assert_same_training(model, standard, layerwise)
    assert min(logged(layerwise, "grad_norm")) > args.max_grad_norm, "clipping must have scaled every step"


def test_sft_with_peft_lora_matches_standard(tmp_path):
    from peft import LoraConfig

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    lora = dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), learning_rate=1e-3)
    standard, layerwise = run_pair("sft", tmp_path, model, tokenizer, sft_dataset(), **lora)
    names = layerwise.layerwise_optimizer.names
    assert names and all("lora_" in n for n in names)
    assert_params_equal(standard.model, layerwise.model)
    assert logged(layerwise, "grad_norm") == logged(standard, "grad_norm")


def test_dpo_matches_standard(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    # DPO's default lr 1e-6 barely moves a 3-step run. The reference model is passed in: TRL would load it from
    # the hub by the policy's name otherwise.
    common = dict(learning_rate=1e-4, ref_model=copy.deepcopy(model).requires_grad_(False))
    standard, layerwise = run_pair("dpo", tmp_path, model, tokenizer, dpo_dataset(), **common)
    # The reference model gets no optimizer: only the policy's parameters are stepped.
    assert set(layerwise.layerwise_optimizer.names) == {
        n for n, p in layerwise.model.named_parameters() if p.requires_grad
    }
    assert_same_training(model, standard, layerwise)
    assert logged(layerwise, "rewards/accuracies") == logged(standard, "rewards/accuracies")


@pytest.mark.parametrize(
    "config_cls,trl_cls", [(LayerwiseSFTConfig, SFTConfig), (LayerwiseDPOConfig, DPOConfig)], ids=["sft", "dpo"]
)
def test_configs_keep_trl_defaults(tmp_path, config_cls, trl_cls):
    # With the bases the other way round, LayerwiseTrainingArguments' copies of TrainingArguments' defaults would win:
    # learning_rate 5e-5, bf16 and gradient_checkpointing off, logging_steps 500.
    ours = config_cls(output_dir=str(tmp_path), use_cpu=True)
    theirs = trl_cls(output_dir=str(tmp_path), use_cpu=True)
    differ = {
        f.name: (getattr(ours, f.name), getattr(theirs, f.name))
        for f in dataclasses.fields(theirs)
        if getattr(ours, f.name) != getattr(theirs, f.name)
    }
    assert differ == {}
    # The defaults TRL changes (trl 1.16: learning_rate, bf16, gradient_checkpointing, logging_steps; trl 0.18:
    # learning_rate only) are the ones the order of the bases decides.
    stock = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    changed = [
        n
        for n in ("learning_rate", "bf16", "gradient_checkpointing", "logging_steps")
        if getattr(theirs, n) != getattr(stock, n)
    ]
    assert "learning_rate" in changed
    assert all(getattr(ours, n) == getattr(theirs, n) != getattr(stock, n) for n in changed)
    assert ours.layerwise_clip == "exact"
    # The layer-wise names pass where TRL's own config refuses them, from Python and from a command line.
    assert config_cls(output_dir=str(tmp_path), optim="adamw_8bit_layerwise", use_cpu=True).is_layerwise
    with pytest.raises(ValueError, match="adamw_8bit_layerwise"):
        trl_cls(output_dir=str(tmp_path), optim="adamw_8bit_layerwise", use_cpu=True)
    argv = ["--output_dir", str(tmp_path), "--optim", "adamw_8bit_layerwise", "--use_cpu", "true"]
    (parsed,) = HfArgumentParser(config_cls).parse_args_into_dataclasses(argv)
    assert parsed.optim == "adamw_8bit_layerwise" and parsed.learning_rate == theirs.learning_rate


def test_plain_layerwise_arguments_are_converted(tmp_path):
    # SFTTrainer would turn LayerwiseTrainingArguments into an SFTConfig, which refuses the layer-wise name.
    tokenizer = tiny_tokenizer()
    args = LayerwiseTrainingArguments(
        output_dir=str(tmp_path), optim="sgd_layerwise", learning_rate=1e-3, layerwise_clip="previous", **RUN
    )
    trainer = LayerwiseSFTTrainer(
        model=tiny_model(tokenizer), args=args, train_dataset=sft_dataset(), processing_class=tokenizer
    )
    assert isinstance(trainer.args, LayerwiseSFTConfig)
    assert (trainer.args.optim, trainer.args.learning_rate, trainer.args.layerwise_clip) == (
        "sgd_layerwise",
        1e-3,
        "previous",
    )
    assert trainer.create_optimizer() is trainer.layerwise_optimizer


def test_without_trl_the_import_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl now raises ImportError
    monkeypatch.delitem(sys.modules, "layerwise_hf.integrations.trl")
    with pytest.raises(ImportError, match=r"pip install 'layerwise-hf\[trl\]'"):
        import layerwise_hf.integrations.trl  # noqa: F401
