"""How reduced gradients reach the per-parameter optimizers: local hooks, a DDP comm hook, or FSDP2 shards.

- Single process: the parameters' post-accumulate-grad hooks step each layer.
- DDP: those hooks fire BEFORE the all-reduce, so stepping there would diverge the replicas. A comm hook all-reduces
  each bucket and runs the optimizer's per-parameter hook body on the reduced gradients; the reducer is told that
  the optimizer runs in backward so it does not copy the bucket back into `.grad`.
- FSDP2 (`fully_shard`): FSDP itself calls the sharded parameters' post-accumulate-grad hooks after the
  reduce-scatter, with the reduced local shard, so the local hooks are right as they are. Only elementwise optimizers
  give the same result on a shard as on the whole tensor; others are refused.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .optimizer import LayerwiseOptimizer

# Optimizers whose update of an element depends only on that element's gradient and state, so stepping the local
# FSDP2 shard equals stepping the whole tensor. Adafactor (factored row/column moments) and bitsandbytes' blockwise
# 8-bit state are not in it.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.AdamW,
    torch.optim.Adam,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
)


def connect(optimizer: LayerwiseOptimizer, model: torch.nn.Module | None = None) -> str:
    """
    Route gradients of `model` (as prepared: plain, DDP-wrapped or FSDP2-sharded) to `optimizer`'s per-parameter
    optimizers. Idempotent. Returns the route taken: `"local"`, `"ddp"` or `"fsdp2"`.
    """
    optimizer.rebind()
    ddp = _find_ddp(model)
    if ddp is not None:
        optimizer.detach()
        _install_ddp_comm_hook(ddp, optimizer)
        route = "ddp"
    elif _is_sharded(optimizer):
        check_fsdp2_supported(optimizer)
        optimizer.attach()
        route = "fsdp2"
    else:
        optimizer.attach()
        route = "local"
    optimizer.route = route
    return route


def _find_ddp(model):
    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        model = getattr(model, "module", None)
        seen += 1
    return None


def _is_sharded(optimizer: LayerwiseOptimizer) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in optimizer.parameters())


def check_fsdp2_supported(optimizer: LayerwiseOptimizer) -> None:
    """Refuse inner optimizers whose update of a shard differs from the update of the whole tensor."""
    bad = sorted({type(inner).__name__ for inner in optimizer.inner if not isinstance(inner, ELEMENTWISE_OPTIMIZERS)})
    if bad:
        raise ValueError(
            f"{optimizer.optimizer_name or '/'.join(bad)} ({', '.join(bad)}) cannot step FSDP2 shards: its update "
            "is not elementwise (factored or blockwise state would be computed per shard). Under FSDP2 use "
            "adamw_torch_layerwise, sgd_layerwise, rmsprop_layerwise or adagrad_layerwise, or run this optimizer "
            "under DDP / on one process."
        )


# ---- DDP ----


class _DDPRoute:
    """State of the comm hook. DDP cannot drop a comm hook, so `close()` turns it into a plain averaging hook."""

    def __init__(self, ddp_model, optimizer: LayerwiseOptimizer):
        self.optimizer: LayerwiseOptimizer | None = optimizer
        self.process_group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.gradient_as_bucket_view = ddp_model.gradient_as_bucket_view
        self.check_unused = bool(ddp_model.find_unused_parameters or ddp_model.static_graph)
        self.param_hooks = [optimizer._make_hook(i) for i in range(len(optimizer.inner))]
        # Parameters whose .grad a synced, non-final micro-batch left aliasing the bucket (bucket-view mode only).
        self.aliased: set[int] = set()

    def close(self) -> None:
        self.optimizer = None


def _install_ddp_comm_hook(ddp_model, optimizer: LayerwiseOptimizer) -> None:
    route = getattr(ddp_model, "_layerwise_route", None)
    if route is not None:
        # The same DDP model trained again (second train()): point the existing hook at this optimizer.
        route.optimizer = optimizer
        route.param_hooks = [optimizer._make_hook(i) for i in range(len(optimizer.inner))]
    else:
        route = _DDPRoute(ddp_model, optimizer)
        try:
            ddp_model.register_comm_hook(route, _layerwise_comm_hook)
        except RuntimeError as err:
            raise RuntimeError(
                "A layer-wise optimizer needs its own DDP comm hook, and this model already has one (e.g. "
                "DistributedDataParallelKwargs(comm_hook=...)). Remove that comm hook."
            ) from err
        # NOTE: a one-way reducer flag: finalize_bucket_dense stops writing the bucket into .grad, so the gradients
        # the per-layer steps freed stay freed.
        ddp_model.reducer._set_optimizer_in_backward()
        ddp_model._layerwise_route = route
    optimizer._external_route = route


def _scale(route: _DDPRoute, bucket: dist.GradBucket) -> None:
    # NOTE: DDP averages with mul_(1/world_size) while copying gradients into the bucket (div_ only for gradients
    # accumulated in place in the bucket view); matching that operation, not dividing, keeps 3+ ranks bit-exact.
    if not route.aliased:
        bucket.buffer().mul_(1.0 / route.world_size)
        return
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        if id(p) in route.aliased and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
            g.div_(route.world_size)
        else:
            g.mul_(1.0 / route.world_size)


def _finish(route: _DDPRoute, bucket: dist.GradBucket, used: torch.Tensor | None) -> torch.Tensor:
    optimizer = route.optimizer
    sync = optimizer._sync_gradients() if optimizer is not None else False
    used_list = used.tolist() if used is not None else None
    for k, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
        if used_list is not None and used_list[k] == 0:
            continue  # unused on every rank: DDP leaves .grad None and a standard optimizer skips it
        i = optimizer._index.get(id(p)) if optimizer is not None else None
        if i is not None and optimizer._params[i] is not p:
            i = None
        if sync and i is not None:
            p.grad = g  # a view into the reduced bucket
            route.param_hooks[i](p)  # the optimizer's own per-parameter logic, as if its hook had fired
            route.aliased.discard(id(p))
            continue
        # Not stepping now: do what DDP's finalize_bucket_dense would have done without the optimizer-in-backward flag.
        if p.grad is None:
            p.grad = g if route.gradient_as_bucket_view else g.clone()
        elif p.grad.data_ptr() != g.data_ptr():
            p.grad.copy_(g)
        if route.gradient_as_bucket_view:
            route.aliased.add(id(p))
        if i is not None:
            route.param_hooks[i](p)  # accumulation bookkeeping only
    return bucket.buffer()


# NOTE: no `from __future__ import annotations` effect here matters: DDP checks this hook's annotations, so they are
# given as real objects through __annotations__ below.
def _layerwise_comm_hook(route, bucket):
    _scale(route, bucket)
    buffer = bucket.buffer()
    work = dist.all_reduce(buffer, group=route.process_group, async_op=True)
    used = used_work = None
    if route.check_unused:
        # Locally used <=> .grad defined when DDP marks the parameter ready (it zero-fills the slot otherwise); only
        # used-on-no-rank parameters are skipped, exactly as DDP leaves their .grad None.
        used = torch.tensor([p.grad is not None for p in bucket.parameters()], dtype=torch.int32, device=buffer.device)
        used_work = dist.all_reduce(used, group=route.process_group, async_op=True)
    # Waiting here keeps every step on the autograd thread, in bucket order (as torch's optimizer-in-backward does).
    work.wait()
    if used_work is not None:
        used_work.wait()
    future = torch.futures.Future()
    future.set_result(_finish(route, bucket, used))
    return future


_layerwise_comm_hook.__annotations__ = {
    "route": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


# ---- FSDP2 on CPU (tests and CPU demos) ----

FORCE_FSDP_CPU_ENV = "LAYERWISE_HF_FORCE_FSDP_CPU"


def force_fsdp_on_cpu() -> None:
    """
    Let Accelerate run its FSDP path on CPU / gloo, which it otherwise silently turns into DDP: accelerate 1.15's
    `AcceleratorState.__init__` only keeps an FSDP plugin for accelerator device types. Call before the first
    `Accelerator` / `Trainer` of the process, or set `LAYERWISE_HF_FORCE_FSDP_CPU=1` (applied on import).
    Meant for CPU tests of the FSDP2 path; GPUs need none of this.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_layerwise_fsdp_cpu", False):
        return
    original = AcceleratorState.__init__

    @functools.wraps(original)
    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        fresh = not self.__class__._shared_state
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fresh and fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # What state.py does for the accelerator device types.
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            # Later `AcceleratorState()` calls copy PartialState's shared dict: keep the two in step.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    __init__._layerwise_fsdp_cpu = True
    AcceleratorState.__init__ = __init__


if os.environ.get(FORCE_FSDP_CPU_ENV, "").lower() in ("1", "true", "yes"):
    force_fsdp_on_cpu()
