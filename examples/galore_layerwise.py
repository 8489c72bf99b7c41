"""GaLore layer-wise on a tiny Llama: this plugin's `galore_adamw_layerwise` next to transformers' built-in one.

Launch (CPU, about 20 seconds; nothing is downloaded):

    python examples/galore_layerwise.py
    python examples/galore_layerwise.py --max_steps 12 --output_dir out/galore

Both runs start from the same randomly initialised Llama, see the same batches and ask for the same thing:
`optim="galore_adamw_layerwise"`, rank-4 projections of the attention and MLP weights, warmup + cosine schedule,
`weight_decay=0.1`, `max_grad_norm=1.0`, a checkpoint at the end.

- transformers: a plain `transformers.Trainer` with `TrainingArguments(optim="galore_adamw_layerwise")`.
- layerwise_hf: `LayerwiseTrainer` with `LayerwiseTrainingArguments(optim="galore_adamw_layerwise")`.

It prints, per step, the lr Trainer logs and the lr each run's per-parameter optimizers actually applied, the
logged grad_norm, then the weight decay applied and how many optimizer states `optimizer.pt` holds.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments

VOCAB = 256
SEQ = 32


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


class CountingDataset(torch.utils.data.Dataset):
    """Sequences that count up (mod VOCAB) from a random start, with a little noise: a pattern the model can learn."""

    def __init__(self, n: int = 128, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB
        noise = torch.rand(n, SEQ, generator=g) < 0.1
        self.ids[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The per-parameter optimizers behind Trainer's optimizer, for either path."""
    while optimizer is not None:
        if hasattr(optimizer, "inner"):  # layerwise_hf.LayerwiseOptimizer
            return list(optimizer.inner)
        if getattr(optimizer, "optimizer_dict", None) is not None:  # transformers' LayerWiseDummyOptimizer
            return list(optimizer.optimizer_dict.values())
        optimizer = getattr(optimizer, "optimizer", None)
    raise TypeError("no per-parameter optimizers found")


class AppliedSettings(TrainerCallback):
    """Records the lr and weight decay every per-parameter optimizer reads at the moment it steps."""

    def __init__(self):
        self.lr: dict[int, set[float]] = {}
        self.weight_decay: set[float] = set()
        self.state = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.state = state
        for inner in inner_optimizers(optimizer):
            inner.register_step_pre_hook(self._record)

    def _record(self, optimizer, args, kwargs):
        group = optimizer.param_groups[0]
        self.lr.setdefault(self.state.global_step + 1, set()).add(group["lr"])
        self.weight_decay.add(group["weight_decay"])


def run(trainer_cls, args_cls, output_dir: Path, max_steps: int):
    settings = dict(
        output_dir=str(output_dir),
        optim="galore_adamw_layerwise",
        optim_target_modules=["self_attn", "mlp"],
        optim_args="rank=4,update_proj_gap=4",
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_steps=max_steps,
        max_grad_norm=1.0,
        per_device_train_batch_size=8,
        logging_steps=1,
        save_strategy="steps",
        save_steps=max_steps,
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    recorder = AppliedSettings()
    trainer = trainer_cls(
        model=tiny_llama(), args=args_cls(**settings), train_dataset=CountingDataset(), callbacks=[recorder]
    )
    trainer.remove_callback(PrinterCallback)  # the table below shows what the per-step log lines would
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    optimizer_pt = torch.load(output_dir / f"checkpoint-{max_steps}" / "optimizer.pt", weights_only=True)
    trainable = sum(p.requires_grad for p in trainer.model.parameters())
    return {
        "logged_lr": [e["learning_rate"] for e in logs],
        "grad_norm": [e["grad_norm"] for e in logs],
        "loss": [e["loss"] for e in logs],
        "applied_lr": [sorted(recorder.lr.get(e["step"], ())) for e in logs],
        "weight_decay": sorted(recorder.weight_decay),
        "state_entries": len(optimizer_pt["state"]),
        "trainable": trainable,
    }


def fmt_lrs(lrs: list[float]) -> str:
    return ",".join(f"{lr:.4e}" for lr in lrs) if lrs else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--output_dir", type=Path, default=None, help="default: a temporary directory")
    cli = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = cli.output_dir or Path(tmp)
        theirs = run(Trainer, TrainingArguments, root / "transformers", cli.max_steps)
        ours = run(LayerwiseTrainer, LayerwiseTrainingArguments, root / "layerwise_hf", cli.max_steps)

    print("optim=galore_adamw_layerwise, warmup_steps=2 + cosine, weight_decay=0.1, max_grad_norm=1.0")
    print("transformers = transformers.Trainer(TrainingArguments(...)); layerwise_hf = LayerwiseTrainer(...)")
    print()
    columns = [
        ("step", 4),
        ("logged lr", 10),
        ("applied lr [transformers]", 25),
        ("applied lr [layerwise_hf]", 25),
        ("grad_norm [transformers]", 24),
        ("grad_norm [layerwise_hf]", 24),
    ]
    print("  ".join(f"{title:>{width}}" for title, width in columns))
    for i, logged_lr in enumerate(ours["logged_lr"]):
        cells = [
            str(i + 1),
            f"{logged_lr:.4e}",
            fmt_lrs(theirs["applied_lr"][i]),
            fmt_lrs(ours["applied_lr"][i]),
            f"{theirs['grad_norm'][i]:.4f}",
            f"{ours['grad_norm'][i]:.4f}",
        ]
        print("  ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns)))
    print()
    print(f"logged lr identical in both runs: {theirs['logged_lr'] == ours['logged_lr']}")
    print(f"weight decay applied: transformers={theirs['weight_decay']} layerwise_hf={ours['weight_decay']}")
    print(
        f"optimizer.pt state entries: transformers={theirs['state_entries']} layerwise_hf={ours['state_entries']} "
        f"(trainable tensors: {ours['trainable']})"
    )
    print(f"final loss: transformers={theirs['loss'][-1]:.4f} layerwise_hf={ours['loss'][-1]:.4f}")


if __name__ == "__main__":
    main()
