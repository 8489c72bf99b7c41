"""A plain Accelerate training loop (no Trainer) with a layer-wise optimizer.

Launch:

    python examples/accelerate_loop.py --output_dir out/loop
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate/cpu_ddp.yaml \
        examples/accelerate_loop.py --output_dir out/loop_ddp
    LAYERWISE_HF_FORCE_FSDP_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_fsdp2.yaml examples/accelerate_loop.py --output_dir out/loop_fsdp2
    accelerate launch --config_file configs/accelerate/gpu_ddp.yaml examples/accelerate_loop.py --output_dir out/loop

Resume: `--save_state_at K` writes `accelerator.save_state` after K steps; `--resume_from DIR` loads it and skips the
batches already seen, so the final weights equal an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer, unwrap_layerwise_optimizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True, help="where states and the final model go")
    parser.add_argument("--optim", default="adamw_torch_layerwise", help="any name of list_layerwise_optimizers()")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--weight_decay", type=float, default=0.1, help="Trainer's decay / no-decay split applies")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="exact global clipping; 0 disables")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--max_steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=4, help="per-device micro-batch size")
    parser.add_argument("--hidden_size", type=int, default=64, help="model width")
    parser.add_argument("--save_state_at", type=int, default=None, help="save_state after this many steps")
    parser.add_argument("--resume_from", default=None, help="a save_state directory to continue from")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order")
    return parser.parse_args(argv)


def make_data(n: int, seq: int = 32, vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    # A learnable pattern (each token is the previous one + a per-sample stride) so the loss visibly falls.
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % vocab
    return [{"input_ids": row, "labels": row} for row in ids]


def main(argv=None) -> None:
    opts = parse_args(argv)
    # The optimizer settings come from the same TrainingArguments a Trainer user writes. NOTE: built before the
    # Accelerator, because constructing TrainingArguments resets Accelerate's shared state.
    args = LayerwiseTrainingArguments(
        output_dir=opts.output_dir,
        optim=opts.optim,
        learning_rate=opts.learning_rate,
        weight_decay=opts.weight_decay,
        report_to="none",
    )
    accelerator = Accelerator(gradient_accumulation_steps=opts.gradient_accumulation_steps)
    set_seed(opts.seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=opts.hidden_size,
        intermediate_size=2 * opts.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)

    # The loop logs grad_norm every step, so every gradient's norm is measured (clipping or not).
    optimizer = build_layerwise_optimizer(model, args, track_grad_norm=True)
    # GA > 1 holds the gradients for the window anyway, so exact clipping costs nothing extra here.
    optimizer.configure_clipping(opts.max_grad_norm, "exact")

    micro_batches = opts.max_steps * opts.gradient_accumulation_steps
    data = make_data(micro_batches * opts.batch_size * accelerator.num_processes)
    # NOTE: no shuffling, so skipping the first batches on resume replays exactly the same order.
    loader = torch.utils.data.DataLoader(data, batch_size=opts.batch_size)
    scheduler = get_scheduler(
        "cosine",
        optimizer,
        num_warmup_steps=1,
        num_training_steps=opts.max_steps * accelerator.num_processes,
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    layerwise = unwrap_layerwise_optimizer(optimizer)
    # After prepare: under DDP the steps must run on all-reduced gradients, under FSDP2 on the sharded parameters.
    route = layerwise.connect(model)
    # fp16 (--mixed_precision fp16 on a GPU): every gradient is unscaled and inf-checked before any layer steps, and
    # the scaler skips and rescales as with a standard optimizer. None otherwise.
    layerwise.use_grad_scaler(accelerator.scaler)
    accelerator.print(f"{opts.optim}: {len(layerwise.inner)} per-parameter optimizers, gradients via {route}")

    skip_batches = 0
    if opts.resume_from:
        accelerator.load_state(opts.resume_from)
        skip_batches = int(open(os.path.join(opts.resume_from, "micro_batches.txt")).read())
    batches = accelerator.skip_first_batches(loader, skip_batches) if skip_batches else loader

    model.train()
    step = skip_batches // opts.gradient_accumulation_steps
    for i, batch in enumerate(batches, start=skip_batches):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                # The hooks already stepped each layer (and freed its gradient): report their exact global norm.
                grad_norm = layerwise.grad_norm()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            lr = scheduler.get_last_lr()[0]
            accelerator.print(f"step {step:3d}  loss {loss.item():.4f}  lr {lr:.2e}  grad_norm {float(grad_norm):.4f}")
            if opts.save_state_at == step:
                state_dir = os.path.join(opts.output_dir, f"state-{step}")
                accelerator.save_state(state_dir)
                if accelerator.is_main_process:
                    with open(os.path.join(state_dir, "micro_batches.txt"), "w") as f:
                        f.write(str(i + 1))
        if step >= opts.max_steps:
            break

    layerwise.detach()
    accelerator.wait_for_everyone()
    accelerator.save_model(model, os.path.join(opts.output_dir, "final"))
    peak = layerwise.pipeline.memory.peak_grad_bytes / 2**20
    full = layerwise.pipeline.memory.full_grad_bytes() / 2**20
    accelerator.print(
        f"peak gradient memory {peak:.3f} MiB (all gradients: {full:.3f} MiB; "
        f"GA={opts.gradient_accumulation_steps} holds them for the window), "
        f"optimizer state {layerwise.pipeline.memory.state_bytes() / 2**20:.3f} MiB, steps {math.ceil(step)}"
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
