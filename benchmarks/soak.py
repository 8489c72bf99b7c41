"""Reliability soak: >= 1000 small Trainer steps, stopped and resumed from its checkpoint every segment by a new
LayerwiseTrainer on the same model object. Shows that memory stays flat (no hook, state or optimizer leak) and
that the final weights equal an uninterrupted run's.
Launch, method and last results: benchmarks/README.md."""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as h  # noqa: E402
from layerwise_hf import LayerwiseOptimizer, LayerwiseTrainer  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, seq_len=16)  # fmt: skip


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = control.should_save = True


def train(model, dataset, output_dir: str, steps: int, segment: int, stop: int, resume: bool) -> LayerwiseTrainer:
    args = h.training_args(
        "adamw_torch_layerwise", output_dir, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=10,
        weight_decay=0.1, max_grad_norm=1.0, layerwise_clip="previous",  # one pass: the soak is about lifecycles
        max_steps=steps, per_device_train_batch_size=4, save_strategy="steps", save_steps=segment, save_total_limit=2,
        logging_steps=segment, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = LayerwiseTrainer(model=model, args=args, train_dataset=dataset, callbacks=[StopAt(stop)])
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="total optimizer steps")
    parser.add_argument("--segment", type=int, default=100, help="steps between a stop and a resume")
    parser.add_argument("--output_dir", default=str(h.RESULTS), help="where soak.json goes")
    opts = parser.parse_args(argv)
    gc.freeze()  # the imported libraries are never garbage: every collection (below, train()'s end) skips them
    ids = (torch.randint(0, 64, (256, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(16)) % 64
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        reference = h.build_llama(**SIZES)
        train(reference, dataset, f"{work}/ref", opts.steps, opts.steps, opts.steps, False)
        reference_seconds, start = time.perf_counter() - start, time.perf_counter()
        soaked = h.build_llama(**SIZES)
        for end in range(opts.segment, opts.steps + 1, opts.segment):
            trainer = train(soaked, dataset, f"{work}/soak", opts.steps, opts.segment, end, end > opts.segment)
            state_bytes = trainer.layerwise_optimizer.pipeline.memory.state_bytes()
            del trainer
            gc.collect()
            hooks = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in soaked.parameters())
            alive = sum(isinstance(o, LayerwiseOptimizer) for o in gc.get_objects())
            rss = round(h.proc_status_bytes("VmRSS") / h.MIB, 1)
            rows.append({"step": end, "rss_mib": rss, "hooks_after_train": hooks, "live_layerwise_optimizers": alive,
                         "optimizer_state_bytes": state_bytes})  # fmt: skip
            print(f"step {end:5d}  rss {rss:8.1f} MiB  hooks {hooks}  live optimizers {alive}  state {state_bytes} B",
                  flush=True)  # fmt: skip
        soak_seconds = time.perf_counter() - start
    pairs = list(zip(reference.parameters(), soaked.parameters()))
    identical = all(torch.equal(a, b) for a, b in pairs)
    max_diff = max(float((a - b).detach().abs().max()) for a, b in pairs)
    # Flat memory: compare the second segment (after warm-up allocations) with the last.
    growth = rows[-1]["rss_mib"] - rows[min(1, len(rows) - 1)]["rss_mib"]
    result = {
        "steps": opts.steps, "segments": len(rows), "rows": rows,
        "rss_growth_mib_after_first_segment": round(growth, 1),
        "max_hooks_after_train": max(r["hooks_after_train"] for r in rows),
        "max_live_layerwise_optimizers": max(r["live_layerwise_optimizers"] for r in rows),
        "weights_identical_to_uninterrupted": identical, "max_abs_diff": max_diff,
        "uninterrupted_seconds": round(reference_seconds, 1), "soak_seconds": round(soak_seconds, 1),
    }  # fmt: skip
    print(
        f"\n{opts.steps} steps in {len(rows)} segments: weights identical to the uninterrupted run: {identical} "
        f"(max |diff| {max_diff:.3g}); RSS growth after the first segment {growth:+.1f} MiB; hooks left after each "
        f"train(): {result['max_hooks_after_train']}; LayerwiseOptimizers alive: "
        f"{result['max_live_layerwise_optimizers']}; {soak_seconds:.0f} s (uninterrupted {reference_seconds:.0f} s)"
    )
    h.write_report(opts.output_dir, "soak", result)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
