"""Train a small byte-level Llama from scratch with a layer-wise optimizer, then report the memory it saved.

Launch:

    python examples/train.py configs/train/tiny_llama.yaml
    python examples/train.py configs/train/tiny_llama.yaml --max_steps 20 --learning_rate 1e-3
    python examples/train.py --optim sgd_layerwise --max_steps 10 --output_dir out
    python examples/train.py --optim adamw_torch --output_dir out   # the standard optimizer, for comparison
    accelerate launch --num_processes 1 examples/train.py configs/train/tiny_llama.yaml
    accelerate launch --config_file configs/accelerate/gpu_ddp.yaml examples/train.py configs/train/tiny_llama.yaml

A config file (.yaml, .yml or .json) must come first; any `--flag value` after it overrides the file. Every field of
`ScriptArguments` and of `TrainingArguments` is a flag (`--help` lists them). The model is randomly initialised and
the corpus is generated here from a small seeded grammar, so nothing is downloaded. The same script runs on one
process, and under the DDP and FSDP2 configs in configs/accelerate/ (see the README's support table).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field, fields

import torch
import yaml
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, TrainerCallback

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments

MIB = 2**20
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")

# Applied through the parser, so a flag or a config key still wins over them.
TRAINING_DEFAULTS = {
    "optim": "adamw_8bit_layerwise",
    "learning_rate": 3e-3,
    "max_steps": 60,
    "per_device_train_batch_size": 8,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 6,
    "weight_decay": 0.1,
    # Off: a layer steps before the global norm is known, so exact clipping (layerwise_clip="exact") runs
    # forward+backward twice per step; "previous" clips in one pass. grad_norm is logged either way (pre-clip).
    "max_grad_norm": 0.0,
    "logging_steps": 5,
    "logging_first_step": True,
    # Without tqdm, Trainer prints every log dict, which is what shows the loss falling in a plain log file.
    "disable_tqdm": True,
    "use_cpu": not torch.cuda.is_available(),
    "report_to": "none",
    "save_strategy": "no",
}


@dataclass
class ScriptArguments:
    hidden_size: int = field(default=256, metadata={"help": "Width of the Llama model."})
    num_hidden_layers: int = field(default=4, metadata={"help": "Number of decoder layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Number of attention heads."})
    num_key_value_heads: int = field(
        default=2, metadata={"help": "Number of key/value heads (grouped-query attention when fewer than the heads)."}
    )
    intermediate_size: int = field(default=688, metadata={"help": "Width of the MLP."})
    seq_len: int = field(default=128, metadata={"help": "Tokens (bytes) per training block."})
    num_samples: int = field(
        default=512, metadata={"help": "Number of training blocks of seq_len bytes generated for the corpus."}
    )
    corpus_seed: int = field(default=0, metadata={"help": "Seed of the grammar that generates the corpus."})


def parse_args(argv: list[str]) -> tuple[ScriptArguments, LayerwiseTrainingArguments]:
    parser = HfArgumentParser((ScriptArguments, LayerwiseTrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    if argv and argv[0].endswith(CONFIG_SUFFIXES):
        # NOTE: parse_yaml_file/parse_json_file build the dataclasses directly, skipping the parser's defaults and
        # any flags; making the file's values parser defaults keeps both, and argparse type-converts them
        # (PyYAML reads `3e-3` as a string).
        with open(argv[0], encoding="utf-8") as f:
            config = (json.load(f) if argv[0].endswith(".json") else yaml.safe_load(f)) or {}
        known = {f.name for dtype in parser.dataclass_types for f in fields(dtype) if f.init}
        unknown = sorted(set(config) - known)
        if unknown:
            parser.exit(2, f"{parser.prog}: error: unknown keys in {argv[0]}: {', '.join(unknown)}\n")
        parser.set_defaults(**config)
        argv = argv[1:]
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:
        # Bad values (e.g. an unknown optim name) are usage errors: the message lists the valid choices.
        parser.exit(2, f"{parser.prog}: error: {e}\n")


# ---- data ----

SUBJECTS = ["the cat", "a small dog", "the old man", "my sister", "the robot", "a farmer", "the teacher", "our cook"]
VERBS = ["sees", "likes", "chases", "paints", "builds", "finds", "carries", "forgets"]
OBJECTS = ["a red ball", "the green door", "two apples", "a long letter", "the blue boat", "some bread", "a map"]
PLACES = ["in the garden", "at night", "near the river", "on monday", "under the bridge", "after lunch", "at home"]
REASONS = ["because it is warm", "because it rains", "when the bell rings", "before the market opens"]


def generate_corpus(num_bytes: int, seed: int) -> bytes:
    """Sentences from a small template grammar: regular enough that a tiny model's loss falls within a minute."""
    rng = random.Random(seed)
    sentences = []
    total = 0
    while total < num_bytes:
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(PLACES)]
        if rng.random() < 0.3:
            words.append(rng.choice(REASONS))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + ".\n"
        sentences.append(sentence)
        total += len(sentence)
    return "".join(sentences).encode("ascii")


def build_dataset(script_args: ScriptArguments) -> list[dict[str, torch.Tensor]]:
    num_tokens = script_args.num_samples * script_args.seq_len
    ids = torch.frombuffer(bytearray(generate_corpus(num_tokens, script_args.corpus_seed)), dtype=torch.uint8)
    blocks = ids[:num_tokens].long().view(script_args.num_samples, script_args.seq_len)
    # The model shifts labels by one itself.
    return [{"input_ids": block, "labels": block} for block in blocks]


def build_model(script_args: ScriptArguments) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,  # one token per byte
        hidden_size=script_args.hidden_size,
        intermediate_size=script_args.intermediate_size,
        num_hidden_layers=script_args.num_hidden_layers,
        num_attention_heads=script_args.num_attention_heads,
        num_key_value_heads=script_args.num_key_value_heads,
        max_position_embeddings=script_args.seq_len,
    )
    return LlamaForCausalLM(config)


# ---- reporting ----


class LogLastStep(TrainerCallback):
    """Log the final step too, so the last loss is shown whatever max_steps and logging_steps are."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == state.max_steps:
            control.should_log = True


def optim_name(args: LayerwiseTrainingArguments) -> str:
    # TrainingArguments turns standard names into OptimizerNames members; layer-wise names stay strings.
    return getattr(args.optim, "value", args.optim)


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def print_log_table(log_history: list[dict]) -> None:
    print(f"\n{'step':>6} {'loss':>9} {'learning_rate':>14} {'grad_norm':>10}")
    for entry in log_history:
        if "loss" in entry:
            grad_norm = entry.get("grad_norm")
            grad_norm = f"{grad_norm:10.4f}" if grad_norm is not None else f"{'-':>10}"
            print(f"{entry['step']:>6} {entry['loss']:>9.4f} {entry['learning_rate']:>14.3e} {grad_norm}")


def print_memory_table(trainer: LayerwiseTrainer, model: torch.nn.Module) -> None:
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = trainer.layerwise_optimizer
    row = "{:<42} {:>12} {:>12}"

    def mib(n: int) -> str:
        return f"{n / MIB:.3f}"

    print(f"\nMemory (MiB), optim={optim_name(trainer.args)}")
    if optimizer is None:
        # A standard optimizer holds every trainable gradient at its step.
        all_grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        state_bytes = tensor_bytes(list(trainer.optimizer.state.values()))
        row = "{:<42} {:>12}"
        print(row.format("", "standard"))
        print(row.format("gradients alive at once (all of them)", mib(all_grad_bytes)))
        print(row.format("optimizer state", mib(state_bytes)))
        print(row.format("gradients + optimizer state", mib(all_grad_bytes + state_bytes)))
        print(row.format("parameters", mib(param_bytes)))
        return

    state_bytes = optimizer.pipeline.memory.state_bytes()
    full_grad_bytes = optimizer.pipeline.memory.full_grad_bytes()
    layerwise_total = optimizer.pipeline.memory.peak_grad_bytes + state_bytes
    # The same per-parameter states, stepped once for the whole model, with every gradient alive at the step.
    standard_total = full_grad_bytes + state_bytes
    saving = standard_total - layerwise_total
    print(row.format("", "layer-wise", "standard"))
    print(
        row.format(
            "gradients alive at once (layer-wise: peak)",
            mib(optimizer.pipeline.memory.peak_grad_bytes),
            mib(full_grad_bytes),
        )
    )
    print(row.format("optimizer state", mib(state_bytes), mib(state_bytes)))
    print(row.format("gradients + optimizer state", mib(layerwise_total), mib(standard_total)))
    print(row.format("parameters", mib(param_bytes), mib(param_bytes)))
    print(f"saving on gradients + optimizer state: {saving / MIB:.3f} MiB ({100 * saving / standard_total:.1f}%)")


def main(argv: list[str]) -> None:
    script_args, training_args = parse_args(argv)
    torch.manual_seed(training_args.seed)
    model = build_model(script_args)
    dataset = build_dataset(script_args)
    # LayerwiseTrainer leaves standard optimizer names to Trainer, so one code path serves both.
    trainer = LayerwiseTrainer(model=model, args=training_args, train_dataset=dataset, callbacks=[LogLastStep()])
    if trainer.is_world_process_zero():
        num_params = sum(p.numel() for p in model.parameters())
        print(
            f"optim={optim_name(training_args)} params={num_params / 1e6:.2f}M "
            f"blocks={len(dataset)}x{script_args.seq_len} device={training_args.device}"
        )

    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start

    if trainer.is_world_process_zero():
        print_log_table(trainer.state.log_history)
        print_memory_table(trainer, model)
        print(f"\ntrained {trainer.state.global_step} steps in {elapsed:.1f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
