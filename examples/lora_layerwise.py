"""PEFT LoRA with a layer-wise optimizer: only the adapters get optimizers, state and hooks; the base stays untouched.

Launch:

    python examples/lora_layerwise.py
    python examples/lora_layerwise.py --optim adamw_8bit_layerwise --lora_r 16 --max_steps 40
    python examples/lora_layerwise.py --lora_target_modules q_proj v_proj --output_dir out/lora

Every field of `ScriptArguments` and of `TrainingArguments` is a flag (`--help` lists them). A small Llama is built
from a config and randomly initialised (it stands in for a pretrained base), LoRA adapters are added with PEFT, and
the adapters are trained on a byte-level corpus generated here: nothing is downloaded, and the defaults run on a CPU
in a few seconds. The script then prints what the layer-wise optimizer holds (one optimizer per adapter tensor, their
state, the largest gradient alive) against what a full fine-tune with the same optimizer would hold, and checks that
every base weight is bit-for-bit unchanged (exit status 1 otherwise).
"""

from __future__ import annotations

import random
import sys
import tempfile
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, get_peft_model
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments
from layerwise_hf.estimate import estimate, format_bytes

# Applied through the parser, so a flag still wins over them.
TRAINING_DEFAULTS = {
    "output_dir": f"{tempfile.gettempdir()}/lora_layerwise",  # nothing is saved; Trainer still wants a directory
    "optim": "adamw_torch_layerwise",
    # LoRA B starts at zero, so adapters need a larger rate than a full fine-tune to move within a few steps.
    "learning_rate": 5e-3,
    "max_steps": 30,
    "per_device_train_batch_size": 8,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 3,
    # Off: exact clipping would run forward+backward twice per step (see docs/clipping-and-precision.md).
    "max_grad_norm": 0.0,
    "logging_steps": 10,
    "disable_tqdm": True,
    "use_cpu": not torch.cuda.is_available(),
    "report_to": "none",
    "save_strategy": "no",
    "label_names": ["labels"],  # PeftModel's forward hides them from Trainer's signature check
    "seed": 0,
}


@dataclass
class ScriptArguments:
    hidden_size: int = field(default=128, metadata={"help": "Width of the base Llama."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Decoder layers of the base Llama."})
    num_attention_heads: int = field(default=4, metadata={"help": "Attention heads."})
    num_key_value_heads: int = field(default=2, metadata={"help": "Key/value heads (grouped-query attention)."})
    intermediate_size: int = field(default=344, metadata={"help": "MLP width."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "Linear modules that get adapters."},
    )
    seq_len: int = field(default=64, metadata={"help": "Tokens (bytes) per training block."})
    num_samples: int = field(default=256, metadata={"help": "Training blocks generated for the corpus."})
    cpu_threads: int = field(
        default=1,
        metadata={
            "help": "torch threads when training on CPU (0: torch's default). The default model is too small to gain "
            "from more, and busy-waiting threads make it many times slower when other processes share the cores."
        },
    )


# ---- data and model ----

WORDS = {
    "subject": ["the cat", "a robot", "my aunt", "the pilot", "our dog", "a child"],
    "verb": ["draws", "finds", "moves", "opens", "paints", "reads"],
    "object": ["a red box", "the old map", "two letters", "a blue door", "the lamp", "some seeds"],
    "place": ["at dawn", "in the hall", "near the sea", "after school", "on the roof"],
}


def build_dataset(script_args: ScriptArguments, seed: int) -> list[dict[str, torch.Tensor]]:
    """Byte-level blocks of sentences from a small seeded grammar (one token per byte, vocab 256)."""
    rng = random.Random(seed)
    num_tokens = script_args.num_samples * script_args.seq_len
    text = bytearray()
    while len(text) < num_tokens:
        words = [rng.choice(WORDS[k]) for k in ("subject", "verb", "object", "place")]
        text += (" ".join(words).capitalize() + ".\n").encode("ascii")
    ids = torch.tensor(list(text[:num_tokens]), dtype=torch.long).view(script_args.num_samples, script_args.seq_len)
    return [{"input_ids": block, "labels": block} for block in ids]


def build_config(script_args: ScriptArguments) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=script_args.hidden_size,
        intermediate_size=script_args.intermediate_size,
        num_hidden_layers=script_args.num_hidden_layers,
        num_attention_heads=script_args.num_attention_heads,
        num_key_value_heads=script_args.num_key_value_heads,
        max_position_embeddings=script_args.seq_len,
    )


# ---- run ----


def main(argv: list[str]) -> int:
    parser = HfArgumentParser((ScriptArguments, LayerwiseTrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    try:
        script_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if not training_args.is_layerwise:
        parser.exit(
            2, f"{parser.prog}: error: this example shows layer-wise optimizers; use a <name>_layerwise optim\n"
        )

    if script_args.cpu_threads > 0 and training_args.device.type == "cpu":
        torch.set_num_threads(script_args.cpu_threads)
    torch.manual_seed(training_args.seed)
    config = build_config(script_args)
    lora = LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=0.0,
        target_modules=script_args.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(LlamaForCausalLM(config), lora)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    num_total = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in trainable.values())
    print(
        f"LoRA r={script_args.lora_r} on {', '.join(script_args.lora_target_modules)} of a "
        f"{script_args.num_hidden_layers}-layer Llama (hidden {script_args.hidden_size})"
    )
    print(
        f"parameters: {num_trainable:,} trainable / {num_total:,} total ({100 * num_trainable / num_total:.2f}%), "
        f"{len(trainable)} trainable tensors, {len(frozen)} frozen"
    )

    trainer = LayerwiseTrainer(
        model=model, args=training_args, train_dataset=build_dataset(script_args, training_args.seed)
    )
    result = trainer.train()
    optimizer = trainer.layerwise_optimizer
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]

    base = training_args.optim.removesuffix("_layerwise")
    adapters_only = sorted(optimizer.names) == sorted(trainable) and all("lora_" in n for n in optimizer.names)
    print(
        f"optimizer: {training_args.optim}, {len(optimizer.inner)} per-parameter optimizers, "
        f"{'all on LoRA adapters' if adapters_only else 'NOT only on the adapters'}"
    )
    if losses:
        print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {result.global_step} steps")

    # What a full fine-tune of the same base with the same optimizer would hold, from the estimator (whose
    # optimizer-state rules are checked against real optimizers in tests/test_estimate.py), and the estimator's figure
    # for this very run next to the measured one.
    full = estimate(config, optimizer=base, dtype="float32")
    this_run = estimate(model, optimizer=training_args.optim)
    memory = optimizer.pipeline.memory
    state = memory.state_bytes()
    print(
        f"optimizer state: {format_bytes(state)} measured (estimate {format_bytes(this_run.optimizer_state_bytes)}); "
        f"a full fine-tune with {base} would hold {format_bytes(full.optimizer_state_bytes)} "
        f"({full.optimizer_state_bytes / max(state, 1):.0f}x more)"
    )
    print(
        f"gradients alive at once: {format_bytes(memory.peak_grad_bytes)} (largest adapter tensor) vs "
        f"{format_bytes(memory.full_grad_bytes())} for all adapters, {format_bytes(full.all_gradient_bytes)} for "
        "a full fine-tune"
    )

    changed = [n for n, p in model.named_parameters() if n in frozen and not torch.equal(p, frozen[n])]
    hooked = [
        n for n, p in model.named_parameters() if n in frozen and getattr(p, "_post_accumulate_grad_hooks", None)
    ]
    moved = all(p.abs().max() > 0 for n, p in trainable.items() if "lora_B" in n)
    print(
        f"base weights unchanged: {'yes' if not changed else 'NO'} ({len(frozen)} frozen tensors compared bit for bit)"
    )
    print(f"adapters trained: {'yes' if moved else 'NO'} (every lora_B moved from its zero init)")
    ok = adapters_only and not changed and not hooked and moved and state == this_run.optimizer_state_bytes
    if not ok:
        print(f"FAILED: changed={changed[:5]} hooked={hooked[:5]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
