"""2 ranks with the DDP config: the gradient and communication storages alive at once stay within the bucket cap plus
twice the largest tensor under the data-parallel route, and within the estimator's in-flight bound for it, while
standard DDP's persistent buckets (seen through the storages its gradients alias, `gradient_as_bucket_view=True`)
hold every gradient. Writes a JSON report (rank 0).

    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate/cpu_ddp.yaml \
        tests/distributed/ddp_memory.py REPORT.json
"""

import gc
import sys
import tempfile

import torch
from common import dataset, finish_ranks, set_ddp_settings, tiny_llama, training_args, write_report
from transformers import Trainer, TrainerCallback

from layerwise_hf import LayerwiseTrainer
from layerwise_hf.estimate import estimate

torch.set_num_threads(1)

CAP_MB = 0.02
MODEL = {"vocab": 256, "hidden": 64}


class StorageMeter:
    """The bytes of the distinct storages behind every live gradient (a view into a bucket counts the whole bucket)
    and any extra tensors given, measured whenever an optimizer is about to step and whenever a gradient arrives."""

    def __init__(self, params, extra=lambda: []):
        self.params = list(params)
        self.extra = extra
        self.peak = 0

    def measure(self, *args, **kwargs):
        tensors = [p.grad for p in self.params if p.grad is not None] + list(self.extra())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        self.peak = max(self.peak, sum(storages.values()))


def ddp_wrappers_alive() -> int:
    # Each DistributedDataParallel owns a reducer whose buckets are as large as all gradients.
    return sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())


def run(optim, out, bucket_view=False):
    model = tiny_llama(**MODEL)
    args = training_args(out, optim, max_steps=3)
    trainer_cls = LayerwiseTrainer if optim.endswith("_layerwise") else Trainer
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(vocab=MODEL["vocab"]))
    set_ddp_settings(trainer, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=bucket_view)
    params = [p for p in model.parameters() if p.requires_grad]
    routes = []
    meter = StorageMeter(params, lambda: [b.buffer for r in routes for b in r.buckets if b.buffer is not None])
    # Registered before train(), so ahead of the route's hooks: each gradient is seen before it is copied and freed.
    for p in params:
        p.register_post_accumulate_grad_hook(meter.measure)

    def on_train_begin(*a, **k):
        optimizer = getattr(trainer, "layerwise_optimizer", None)
        if optimizer is not None:
            routes.append(optimizer.pipeline.route)
            for inner in optimizer.inner:
                inner.register_step_pre_hook(meter.measure)
        else:
            trainer.optimizer.optimizer.register_step_pre_hook(meter.measure)

    callback = type("Meter", (TrainerCallback,), {"on_train_begin": lambda self, *a, **k: on_train_begin()})()
    trainer.add_callback(callback)
    # The meter must attach after the layer-wise callback has connected the route.
    trainer.callback_handler.callbacks.sort(key=lambda cb: cb is callback)
    trainer.train()
    optimizer = getattr(trainer, "layerwise_optimizer", None)
    return {
        "peak_storage_bytes": meter.peak,
        "estimated_bytes": estimate(
            model.config,
            optimizer=optim,
            dtype="float32",
            world_size=2,
            sharding="ddp",
            bucket_cap_mb=CAP_MB,
            gradient_as_bucket_view=bucket_view,
        ).gradient_bytes,
        "ddp_wrappers_alive": ddp_wrappers_alive(),
        # What the package counts and logs as alive: every gradient from its hook until it steps, buckets included.
        "package_peak_grad_bytes": optimizer.pipeline.memory.peak_grad_bytes if optimizer is not None else None,
        "logged_peak_grad_mib": max(
            (e["layerwise_peak_grad_mib"] for e in trainer.state.log_history if "layerwise_peak_grad_mib" in e),
            default=None,
        ),
        "all_grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "largest_bytes": max(p.numel() * p.element_size() for p in params),
        "cap_bytes": int(CAP_MB * 2**20),
        "wrapped": type(trainer.model_wrapped).__name__,
    }


def main(report_path):
    with tempfile.TemporaryDirectory() as d:
        layerwise = run("adamw_torch_layerwise", d)
    with tempfile.TemporaryDirectory() as d:
        standard = run("adamw_torch", d, bucket_view=True)
    write_report(report_path, {"layerwise": layerwise, "standard_bucket_view": standard})


if __name__ == "__main__":
    main(sys.argv[-1])
    finish_ranks()
