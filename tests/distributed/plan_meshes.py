"""4 gloo ranks: what a rank really holds during a training step under HSDP 2x2 (Accelerate's `ParallelismConfig` with
the FSDP2 config) and tensor parallel 2 x FSDP2 2 (transformers' `DistributedConfig` at the load), with stock Trainer +
adamw_torch and LayerwiseTrainer + adamw_torch_layerwise, for `layerwise-hf plan` to be checked against
(tests/test_plan_meshes.py).

    LAYERWISE_HF_FORCE_FSDP_CPU=1 LAYERWISE_HF_FORCE_MESH_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_ddp.yaml --num_processes 4 tests/distributed/plan_meshes.py REPORT.json

Per rank and step: the peak of the bytes torch's CPU allocator holds, counted on every thread from before any model
exists (benchmarks/_thread_memory.py: gloo frees on its worker threads), and from the second step on the RSS training
peak (VmHWM less the runtime: the RSS at rest less the tensors held then), as benchmarks/plan_accuracy.py measures
them. Also the local bytes of parameters the allocator never saw (`outside_bytes`): on CPU, transformers' load under
tensor parallel leaves each rank's shards as views into the memory-mapped checkpoint (a GPU rank copies its shard to
the device).
"""

# ruff: noqa: E402 - the counter goes in before torch allocates anything it should count
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks import _common as h
from benchmarks._thread_memory import CountingAllocator

h.limit_mmap_threshold()
COUNTER = CountingAllocator()

import tempfile

import torch
import torch.distributed as dist
from common import finish_ranks, mesh_args, training_args, write_report
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback

# applies LAYERWISE_HF_FORCE_FSDP_CPU and LAYERWISE_HF_FORCE_MESH_CPU
from layerwise_hf import LayerwiseTrainer

torch.set_num_threads(1)
# Large enough that Trainer's own small tensors are noise next to weights, states and activations; 4 key/value heads
# so that tensor parallel 2 splits every projection.
MODEL = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
SEQ, BATCH, STEPS = 64, 2, 5
MESHES = ("hsdp", "tp_fsdp")
OPTIMIZERS = ("adamw_torch", "adamw_torch_layerwise")
MAX_GRAD_NORM = 1.0  # Trainer's default (layer-wise: exact clipping)


def save_model(folder: str) -> str:
    """The model written by every rank to its own folder before any process group exists (`save_pretrained` then
    writes from the main process only)."""
    path = os.path.join(folder, f"model-rank{os.environ['RANK']}")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"})).save_pretrained(path)
    return path


def dataset(n: int) -> list:
    g = torch.Generator().manual_seed(123)
    rows = [torch.randint(0, MODEL["vocab_size"], (SEQ,), generator=g) for _ in range(n)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


class Meter(TrainerCallback):
    """Each step's allocator peak (and what was held when it began) and, from the second step on (the states exist),
    its RSS training peak."""

    def __init__(self):
        self.steps = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = {}
        # NOTE: Trainer counts finished steps: global_step is k - 1 when step k begins.
        if state.global_step >= 1:
            rest = h.rss_at_rest()  # settles and resets VmHWM
            # Memory-mapped shards are in the RSS at rest: they are tensors held, not runtime.
            step["rss_runtime_bytes"] = rest - COUNTER.current() - outside(model)
            step["outside_bytes"] = outside(model)
        step["start_bytes"] = COUNTER.current()
        self.steps.append(step)
        COUNTER.reset_peak()

    def on_step_end(self, args, state, control, **kwargs):
        step = self.steps[-1]
        step.update(peak_bytes=COUNTER.peak(), end_bytes=COUNTER.current())
        if "rss_runtime_bytes" in step:
            step["rss_training_peak_bytes"] = h.proc_status_bytes("VmHWM") - step["rss_runtime_bytes"]


def outside(model) -> int:
    """Local bytes of the parameters whose storage the CPU allocator did not make: a storage that wraps memory it was
    given (a memory-mapped file) cannot be resized, one the allocator made can."""
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local if not t.untyped_storage().resizable())


def model_for(mesh: str, path: str):
    if mesh == "hsdp":
        return LlamaForCausalLM.from_pretrained(path)
    from transformers import DistributedConfig

    return LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))


def run(mesh: str, optim: str, folder: str, model_path: str) -> dict:
    environ = dict(os.environ)
    meter = Meter()
    args = training_args(os.path.join(folder, "out"), optim, max_grad_norm=MAX_GRAD_NORM, max_steps=STEPS,
                         per_device_train_batch_size=BATCH, logging_steps=STEPS, **mesh_args(mesh))  # fmt: skip
    cls = LayerwiseTrainer if optim.endswith("_layerwise") else Trainer
    trainer = cls(model=model_for(mesh, model_path), args=args, train_dataset=dataset(4 * BATCH * STEPS),
                  callbacks=[meter])  # fmt: skip
    trainer.train()
    optimizer = getattr(trainer, "layerwise_optimizer", None)
    result = {"steps": meter.steps, "route": optimizer.route if optimizer is not None else None}
    trainer.accelerator.free_memory()
    del trainer, optimizer
    os.environ.clear()
    os.environ.update(environ)
    h.settle()
    return result


def main(report_path: str) -> None:
    model_path = save_model(os.path.join(os.path.dirname(os.path.abspath(report_path)), "model"))
    results = []
    # The FSDP2 config's case (HSDP through ParallelismConfig) last: Accelerate leaves ACCELERATE_USE_FSDP behind.
    for mesh in ("tp_fsdp", "hsdp"):
        for optim in OPTIMIZERS:
            with tempfile.TemporaryDirectory() as d:
                mine = run(mesh, optim, d, model_path)
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            results.append({"mesh": mesh, "optim": optim, "ranks": ranks})
            if dist.get_rank() == 0:
                peaks = [[s["peak_bytes"] for s in r["steps"]] for r in ranks]
                rss = [[s.get("rss_training_peak_bytes") for s in r["steps"]] for r in ranks]
                print(mesh, optim, peaks, rss, flush=True)
    write_report(report_path, {"results": results, "model": MODEL, "seq_len": SEQ, "micro_batch": BATCH,
                               "max_grad_norm": MAX_GRAD_NORM})  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
    finish_ranks()
