"""The data-parallel route: layer-wise training under a DDP configuration without DDP's persistent buckets.

DDP's reducer allocates bucket buffers as large as all gradients when it wraps the model, and keeps them for the
whole run, so stepping each layer early frees nothing they hold. Under a DDP configuration the layer-wise path
therefore does not wrap the model in DDP (`prepare_model(..., evaluation_mode=True)`: device placement, autocast and
torch.compile only) and reduces gradients itself with torch's own collectives:

- each parameter's post-accumulate-grad hook copies its gradient, times 1/world_size (DDP's `mul_out`, so the bits
  are DDP's), into the bucket of its readiness order and frees it; a bucket holds at most `bucket_cap_mb` (a larger
  tensor is a bucket of its own, reduced in place);
- a complete bucket is all-reduced asynchronously, buckets are launched in the same order on every rank, and at
  most two are in flight; once a bucket is reduced its parameters step (the optimizer's `grad_ready`) and the
  bucket is freed;
- at the end of backward the buckets holding parameters this rank did not use are zero-filled and reduced, with a
  used-flag all-reduce (`find_unused_parameters`) so a parameter no rank used keeps `.grad = None`, as DDP does;
- inside a gradient-accumulation window nothing is reduced (as with `no_sync`) unless `sync_each_batch`;
- parameters and buffers are broadcast from rank 0 when the route attaches, and buffers before each training
  forward (`broadcast_buffers`), as DDP does.

Gradient memory is then bounded by what is in flight (about two buckets, or the largest tensor) instead of by the
model.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .routes import LocalHooks

if TYPE_CHECKING:
    from .optimizer import LayerwiseOptimizer

MAX_IN_FLIGHT = 2  # buckets all-reducing at once: overlap without letting memory grow with the model
DDP_TYPES = ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU")


@dataclasses.dataclass
class DataParallelConfig:
    """
    What the data-parallel route takes from DDP's settings.

    Args:
        bucket_cap_mb (`float`, *optional*, defaults to `25.0`):
            The most gradient megabytes (MiB) one all-reduce carries (`ddp_bucket_cap_mb`).
        find_unused_parameters (`bool`, *optional*, defaults to `False`):
            Agree across ranks on which parameters got no gradient anywhere (Trainer's default unless activation
            checkpointing is on).
        broadcast_buffers (`bool`, *optional*, defaults to `True`):
            Broadcast module buffers from rank 0 before each training forward (`ddp_broadcast_buffers`).
        sync_each_batch (`bool`, *optional*, defaults to `False`):
            Reduce on every micro-batch of a gradient-accumulation window, not only its last.

    Example:

    ```python
    >>> from layerwise_hf.data_parallel import DataParallelConfig
    >>> config = DataParallelConfig.from_accelerator(accelerator)  # Accelerate's DDP kwargs and GA plugin
    >>> DataParallelConfig(bucket_cap_mb=10).bucket_cap_bytes
    10485760
    ```
    """

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    sync_each_batch: bool = False

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 2**20)

    @classmethod
    def from_accelerator(cls, accelerator: Any) -> DataParallelConfig | None:
        """The settings Accelerate would give DDP, or `None` when `accelerator` does not run data-parallel."""
        if str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)) not in DDP_TYPES:
            return None
        handler = getattr(accelerator, "ddp_handler", None)
        kwargs = handler.to_kwargs() if handler is not None else {}
        plugin = getattr(accelerator.gradient_state, "plugin_kwargs", {}) or {}
        config = cls(sync_each_batch=bool(plugin.get("sync_each_batch", False)))
        for field in ("bucket_cap_mb", "find_unused_parameters", "broadcast_buffers"):
            if kwargs.get(field) is not None:
                setattr(config, field, type(getattr(config, field))(kwargs[field]))
        return config


class _Bucket:
    """Parameters reduced by one all-reduce, in launch order, and the buffer while it is alive."""

    def __init__(self, indices: list[int], numels: list[int], dtype: torch.dtype, device: torch.device):
        self.indices = indices
        self.numels = numels
        self.offsets = [sum(numels[:k]) for k in range(len(numels))]
        self.slot = {i: k for k, i in enumerate(indices)}
        self.dtype = dtype
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.ready = [False] * len(self.indices)
        self.count = 0
        self.work: Any = None
        self.used: torch.Tensor | None = None
        self.used_work: Any = None

    @property
    def complete(self) -> bool:
        return self.count == len(self.indices)

    def view(self, k: int, shape: torch.Size) -> torch.Tensor:
        return self.buffer[self.offsets[k] : self.offsets[k] + self.numels[k]].view(shape)


def build_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[_Bucket]:
    """
    Buckets in the order gradients become ready (the reverse of the parameters' order, as DDP assumes), at most
    `cap_bytes` each, one (device, dtype) per bucket; a tensor larger than the cap is a bucket of its own.
    """
    buckets: list[_Bucket] = []
    current: list[int] = []
    size = 0
    key = None
    for i in reversed(range(len(params))):
        p = params[i]
        local = p.to_local() if hasattr(p, "to_local") else p
        nbytes = local.numel() * local.element_size()
        this_key = (local.device, local.dtype)
        if current and (this_key != key or size + nbytes > cap_bytes):
            buckets.append(_make_bucket(params, current))
            current, size = [], 0
        current.append(i)
        size += nbytes
        key = this_key
    if current:
        buckets.append(_make_bucket(params, current))
    return buckets


def _make_bucket(params: list[torch.Tensor], indices: list[int]) -> _Bucket:
    first = params[indices[0]]
    return _Bucket(indices, [params[i].numel() for i in indices], first.dtype, first.device)


class DataParallelReducer(LocalHooks):
    """
    The route of a model replicated on every rank and not wrapped in DDP: bucketed all-reduce of each gradient as
    it becomes ready, then the layer steps and the bucket is freed (see the module docstring).

    Args:
        model (`torch.nn.Module`):
            The prepared model (for the buffers DDP would broadcast).
        config (`DataParallelConfig`):
            DDP's settings.

    Example:

    ```python
    >>> # in a plain Accelerate loop launched with a DDP config: do not let Accelerate wrap the model in DDP
    >>> model = accelerator.prepare_model(model, evaluation_mode=True)
    >>> optimizer = accelerator.prepare(optimizer)
    >>> unwrap_layerwise_optimizer(optimizer).connect(model, accelerator=accelerator)
    'data_parallel'
    ```
    """

    name = "data_parallel"
    collective_per_forward = True

    def __init__(self, model: torch.nn.Module | None, config: DataParallelConfig, process_group: Any = None):
        super().__init__()
        self.model = getattr(model, "_orig_mod", model)  # a torch.compile'd model runs its original's hooks
        self.config = config
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._buffer_hook: Any = None

    # ---- attach / detach ----

    def _entry(self, optimizer: LayerwiseOptimizer):
        return self._local_ready

    def attach(self, optimizer: LayerwiseOptimizer) -> None:
        self.optimizer = optimizer
        self.params = list(optimizer.params)
        self.buckets = build_buckets(self.params, self.config.bucket_cap_bytes)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        self._next = 0  # the next bucket to launch, in the same order on every rank
        self._in_flight: collections.deque[_Bucket] = collections.deque()
        self._in_backward = False
        self._sync_module_states()
        if self.model is not None and self.config.broadcast_buffers and any(True for _ in self.model.buffers()):
            self._buffer_hook = self.model.register_forward_pre_hook(self._broadcast_buffers)
        super().attach(optimizer)

    def detach(self) -> None:
        if self._buffer_hook is not None:
            self._buffer_hook.remove()
            self._buffer_hook = None
        for bucket in getattr(self, "buckets", []):
            bucket.reset()
        self._in_flight = collections.deque()
        self._next = 0
        self._in_backward = False
        super().detach()

    @torch.no_grad()
    def _sync_module_states(self) -> None:
        # NOTE: what DDP does when it wraps a model: every replica starts from rank 0's parameters and buffers.
        tensors = list(self.params)
        if self.model is not None:
            tensors += list(self.model.buffers())
        for t in tensors:
            dist.broadcast(t.data, src=0, group=self.process_group)

    @torch.no_grad()
    def _broadcast_buffers(self, module, args) -> None:
        if module.training and torch.is_grad_enabled():
            for buf in module.buffers():
                dist.broadcast(buf, src=0, group=self.process_group)

    # ---- backward ----

    def _local_ready(self, i: int) -> None:
        optimizer = self.optimizer
        if not (optimizer.sync_gradients() or self.config.sync_each_batch):
            optimizer.grad_ready(i)  # accumulating locally, as under no_sync: the gradient stays in .grad
            return
        if not self._in_backward:
            self._in_backward = True
            # NOTE: runs once the whole backward is done: buckets with parameters this rank did not use.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket = self.buckets[self.bucket_of[i]]
        k = bucket.slot[i]
        if bucket.ready[k]:
            raise RuntimeError(
                f"The gradient hook of {optimizer.names[i]} fired twice in one backward (reentrant activation "
                "checkpointing with a parameter in two segments?): use activation_checkpointing_kwargs="
                "{'use_reentrant': False}."
            )
        p = self.params[i]
        with torch.no_grad():
            if len(bucket.indices) == 1:
                # A tensor larger than the cap is reduced in place: the same product DDP writes, without a copy.
                bucket.buffer = p.grad.mul_(1.0 / self.world_size).view(-1)
            else:
                if bucket.buffer is None:
                    bucket.buffer = torch.empty(sum(bucket.numels), dtype=bucket.dtype, device=bucket.device)
                # NOTE: DDP's `mul_out(bucket_view, grad, 1 / world_size)`, so the reduced bits are DDP's.
                torch.mul(p.grad, 1.0 / self.world_size, out=bucket.view(k, p.shape))
        p.grad = None
        bucket.ready[k] = True
        bucket.count += 1
        self._launch_complete()

    def _launch_complete(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])
        while self._in_flight and self._in_flight[0].work.is_completed():
            self._step_bucket(self._in_flight.popleft())

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(sum(bucket.numels), dtype=bucket.dtype, device=bucket.device)
        elif not bucket.complete:
            for k, ready in enumerate(bucket.ready):
                if not ready:
                    bucket.buffer[bucket.offsets[k] : bucket.offsets[k] + bucket.numels[k]].zero_()
        if self.config.find_unused_parameters:
            bucket.used = torch.tensor(bucket.ready, dtype=torch.int32, device=bucket.device)
            bucket.used_work = dist.all_reduce(bucket.used, group=self.process_group, async_op=True)
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        self._in_flight.append(bucket)
        self._next += 1
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._step_bucket(self._in_flight.popleft())

    def _step_bucket(self, bucket: _Bucket) -> None:
        bucket.work.wait()
        used = None
        if bucket.used_work is not None:
            bucket.used_work.wait()
            used = bucket.used.tolist()
        optimizer = self.optimizer
        for k, i in enumerate(bucket.indices):
            if used is not None and used[k] == 0:
                continue  # no rank used it: .grad stays None and the optimizer skips it, as with DDP
            p = self.params[i]
            p.grad = bucket.view(k, p.shape)
            optimizer.grad_ready(i)  # steps and frees it (or holds it: exact clipping, accumulation)
        bucket.reset()  # the buffer lives on only through gradients the optimizer holds

    def _finish_backward(self) -> None:
        self._in_backward = False
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        while self._in_flight:
            self._step_bucket(self._in_flight.popleft())
        self._next = 0
