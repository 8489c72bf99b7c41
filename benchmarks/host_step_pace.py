"""Does each base's host step keep pace with backward? (`layerwise_offload="optimizer"`, issue 19 item 6.)

With `layerwise_offload="optimizer"` a host worker steps each parameter while backward goes on with the layers
below it. That overlap pays only if stepping a layer's parameters on the host takes no longer than that layer's
backward; otherwise the worker falls behind and the next forward waits for it.

Launch (single process, CPU; the host is the CPU here, as on a GPU machine):

    python benchmarks/host_step_pace.py                     # hidden 2048, 1 x 512 tokens, 5 repeats
    python benchmarks/host_step_pace.py --hidden 4096 --repeats 3
    python benchmarks/host_step_pace.py --small             # smoke run (hidden 256)

Model: one randomly initialised Llama decoder layer (hidden `--hidden`, intermediate 2.75 x hidden, heads
hidden / 128), fp32, a micro-batch of 1 x `--tokens` random activations. Measured, median of `--repeats` after one
warm-up:

- `backward`: the layer's backward (forward untimed);
- per base: one `step()` of the optimizer the plugin builds for the layer's `q_proj` weight (hidden x hidden; the
  optimizer `build_layerwise_optimizer` gives it, so GaLore and Muon see their real target modules), on the CPU.
  The layer's host step is that time scaled by the layer's parameter count over the tensor's (the steps are
  per-element work), and `ratio` = layer host step / layer backward. `ratio <= 1`: the host keeps pace.

A base that raises on a CPU tensor is listed with its error (it cannot step on the host at all).
Writes `<output_dir>/host_step_pace.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BASES = (
    "adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop", "adamw_bnb_8bit", "adamw_8bit",
    "paged_adamw_32bit", "paged_adamw_8bit", "lion_32bit", "lion_8bit", "ademamix", "ademamix_8bit",
    "adamw_torch_8bit", "adamw_torch_4bit", "galore_adamw", "galore_adamw_8bit", "galore_adafactor",
    "apollo_adamw", "muon",
)  # fmt: skip


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: lazy state, kernels, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _layer(hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=1,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 128),
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config), config


def backward_time(model, config, tokens: int, repeats: int) -> float:
    layer = model.model.layers[0]
    x = torch.randn(1, tokens, config.hidden_size)
    position_ids = torch.arange(tokens)[None]
    position_embeddings = model.model.rotary_emb(x, position_ids)

    def once():
        out = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        loss = out.float().pow(2).mean()
        start = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    once()
    return statistics.median(once() for _ in range(repeats))


def step_time(base: str, model, repeats: int) -> float:
    from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer

    extra = {"optim_target_modules": ["attn", "mlp"]} if base.startswith(("galore", "apollo")) else {}
    args = LayerwiseTrainingArguments("/tmp/host_step_pace", optim=f"{base}_layerwise", learning_rate=1e-4, **extra)
    weight = model.model.layers[0].self_attn.q_proj.weight
    optimizer = build_layerwise_optimizer(model, args, offload="none")
    index = next(i for i, p in enumerate(optimizer.params) if p is weight)
    inner = optimizer.inner[index]
    weight.grad = torch.randn_like(weight) * 1e-3
    try:
        return _median_time(inner.step, repeats)
    finally:
        weight.grad = None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bases", nargs="*", default=list(BASES))
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    opts = parser.parse_args(argv)
    if opts.small:
        opts.hidden, opts.tokens, opts.repeats = 256, 64, 2
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    model, config = _layer(opts.hidden)
    layer_numel = sum(p.numel() for p in model.model.layers[0].parameters())
    tensor_numel = opts.hidden * opts.hidden
    backward = backward_time(model, config, opts.tokens, opts.repeats)
    rows = []
    for base in opts.bases:
        row = {"base": base}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                seconds = step_time(base, model, opts.repeats)
            layer_step = seconds * layer_numel / tensor_numel
            row |= {"tensor_step_s": seconds, "layer_step_s": layer_step, "ratio": layer_step / backward}
        except Exception as error:  # noqa: BLE001 - a base that cannot step on the CPU is a result here
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        rows.append(row)
    result = {
        "hidden": opts.hidden, "tokens": opts.tokens, "repeats": opts.repeats, "threads": torch.get_num_threads(),
        "layer_params": layer_numel, "tensor": [opts.hidden, opts.hidden], "layer_backward_s": backward, "rows": rows,
    }  # fmt: skip
    threads = torch.get_num_threads()
    print(f"Llama layer, hidden {opts.hidden} ({layer_numel / 1e6:.1f}M params), 1 x {opts.tokens} tokens, "
          f"{threads} threads: backward {backward * 1e3:.1f} ms (median of {opts.repeats})")  # fmt: skip
    print(f"{'base':<20} {'step/tensor ms':>14} {'step/layer ms':>14} {'ratio':>7}  keeps pace")
    for row in rows:
        if "error" in row:
            print(f"{row['base']:<20} {'-':>14} {'-':>14} {'-':>7}  cannot step on the CPU: {row['error']}")
        else:
            pace = "yes" if row["ratio"] <= 1 else "no"
            print(f"{row['base']:<20} {row['tensor_step_s'] * 1e3:>14.1f} {row['layer_step_s'] * 1e3:>14.1f} "
                  f"{row['ratio']:>7.2f}  {pace}")  # fmt: skip
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_step_pace.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
