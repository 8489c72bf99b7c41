"""A stock training script in the shape of transformers' examples/pytorch/language-modeling/run_clm.py: model, data and
training dataclasses through `HfArgumentParser` (command line, or one .json / .yaml file), a plain `Trainer`. Nothing
here knows about layerwise_hf:
`python -m layerwise_hf tests/scripts/run_clm_like.py --optim adamw_torch_layerwise ...`.

No network: a tiny Llama from `LlamaConfig` (random init, `--seed`), generated token data.

`main(trainer_cls, args_cls)` is the same program with other classes, for the tests' explicit runs
(`LayerwiseTrainer`, `LayerwiseTrainingArguments`).
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


@dataclass
class ModelArguments:
    hidden_size: int = field(default=32, metadata={"help": "Hidden size of the tiny Llama."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Number of decoder layers."})
    vocab_size: int = field(default=64, metadata={"help": "Vocabulary size."})
    loss: str = field(
        default="standard",
        metadata={"help": "'standard': Trainer's loss; 'z_loss': a Trainer subclass adding a z-loss in compute_loss."},
    )


@dataclass
class DataTrainingArguments:
    num_samples: int = field(default=64, metadata={"help": "Generated sequences."})
    block_size: int = field(default=16, metadata={"help": "Tokens per sequence."})
    data_seed_value: int = field(default=1, metadata={"help": "Seed of the generated data."})


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, block: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        # Next token = previous + 1, with 10% noise: a pattern the model learns, so losses move.
        self.ids = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(block)) % vocab
        noise = torch.rand(n, block, generator=g) < 0.1
        self.ids[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def z_loss_trainer(base):
    class ZLossTrainer(base):
        """A user's Trainer subclass: the loss plus 1e-3 * logsumexp(logits)^2 (PaLM's z-loss)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            loss = loss + 1e-3 * torch.logsumexp(outputs.logits, dim=-1).pow(2).mean()
            return (loss, outputs) if return_outputs else loss

    return ZLossTrainer


def main(trainer_cls=Trainer, args_cls=TrainingArguments, argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, args_cls))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    elif len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        model_args, data_args, training_args = parser.parse_yaml_file(yaml_file=os.path.abspath(argv[0]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    torch.manual_seed(training_args.seed)
    config = LlamaConfig(
        vocab_size=model_args.vocab_size,
        hidden_size=model_args.hidden_size,
        intermediate_size=2 * model_args.hidden_size,
        num_hidden_layers=model_args.num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=data_args.block_size,
    )
    model = LlamaForCausalLM(config)
    train_dataset = TokenDataset(
        data_args.num_samples, data_args.block_size, model_args.vocab_size, data_args.data_seed_value
    )
    if model_args.loss == "z_loss":
        trainer_cls = z_loss_trainer(trainer_cls)
    trainer = trainer_cls(model=model, args=training_args, train_dataset=train_dataset)
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_state()
    return trainer


if __name__ == "__main__":
    main()
