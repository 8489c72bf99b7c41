"""The data-parallel route: layer-wise training under a DDP configuration without DDP's persistent buckets.

DDP's reducer allocates bucket buffers as large as all gradients when it wraps the model, and keeps them for the
whole run, so stepping each layer early frees nothing they hold. Under a DDP configuration the layer-wise path
therefore does not wrap the model in DDP (`prepare_model(..., evaluation_mode=True)`: device placement, autocast and
torch.compile only) and reduces gradients itself with torch's own collectives:

- each parameter's post-accumulate-grad hook copies its gradient, times 1/world_size (DDP's `mul_out`, so the bits
  are DDP's), into its bucket and frees it. Buckets follow readiness: torch's own `_compute_bucket_assignment_by_size`
  with DDP's limits (a 1 MiB first bucket, then `bucket_cap_mb`) over the parameters in reverse order for the first
  backward, then over the order their gradients became ready, as DDP rebuilds its buckets. (DDP skips that rebuild
  with `find_unused_parameters=True` and keeps buckets in parameter order, which would hold a bucket's early
  gradients until its latest member is ready; so beyond 2 ranks, where the ring sums an element in an order set by
  its place in the buffer, the last bits can differ from DDP's, as DDP's own do with another bucket cap.);
- a complete bucket is all-reduced asynchronously, buckets are launched in the same order on every rank, and at
  most two exist (one reducing, one filling); when the next is launched (or backward ends) the one reducing is
  waited on, its parameters step (the optimizer's `grad_ready`) and the bucket is freed. It is not polled for
  completion: the step's place in backward, and so the peak, stays the same on every link;
- a bucket of one tensor at least as large as the cap, followed by smaller buckets (an untied `lm_head`, first in
  backward), is delayed once reduced and steps only right before the next such tensor's gradient is computed (the
  smaller buckets drained first), or at the end of backward. A step allocates temporaries of about twice its tensor
  (AdamW's `sqrt` and division; bitsandbytes dequantizes its states on CPU): early in backward they would add to
  the activations still alive, later they come when few are left, as after DDP's backward (58M Llama, 2 ranks: the
  training peak 715 -> 659 MiB with AdamW, 664 -> 608 MiB with 8-bit). Delaying it costs its gradient while the
  smaller buckets reduce, not the temporaries;
- at the end of backward the buckets holding parameters this rank did not use are zero-filled and reduced, with a
  used-flag all-reduce (`find_unused_parameters`) so a parameter no rank used keeps `.grad = None`, as DDP does;
  a rank reads the flags back (a host sync on CUDA) only for a bucket it did not fill itself;
- inside a gradient-accumulation window nothing is reduced (as with `no_sync`) unless `sync_each_batch`;
- parameters and buffers are broadcast from rank 0 when the route attaches, and buffers before each training
  forward (`broadcast_buffers`), as DDP does.

Gradient memory is then bounded by what is in flight (about two buckets, or two of the largest tensors, plus a delayed
large one) instead of by the model: `layerwise_hf.estimate.buckets.ddp_in_flight_bound` computes it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..bases.support import check_ddp_comm_hook
from ..platform.compat import checkpointing_kwargs_name
from .hooks import DelayPlan, LocalHooks
from .sink import GradientSink

MAX_IN_FLIGHT = 1  # a bucket all-reduces while the next one fills: overlap, with memory bounded by two buckets
DDP_TYPES = ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU")


@dataclasses.dataclass
class DataParallelConfig:
    """
    What the data-parallel route takes from DDP's settings.

    Args:
        bucket_cap_mb (`float`, *optional*):
            The most gradient megabytes (MiB) one all-reduce carries (`ddp_bucket_cap_mb`); `None`: DDP's default,
            25 MiB after a first bucket of 1 MiB.
        find_unused_parameters (`bool`, *optional*, defaults to `False`):
            Agree across ranks on which parameters got no gradient anywhere (Trainer's default unless activation
            checkpointing is on).
        broadcast_buffers (`bool`, *optional*, defaults to `True`):
            Broadcast module buffers from rank 0 before each training forward (`ddp_broadcast_buffers`).
        sync_each_batch (`bool`, *optional*, defaults to `False`):
            Reduce on every micro-batch of a gradient-accumulation window, not only its last.

    Example:

    ```python
    >>> from layerwise_hf.routes.data_parallel import DataParallelConfig
    >>> config = DataParallelConfig.from_accelerator(accelerator)  # Accelerate's DDP kwargs and GA plugin
    >>> DataParallelConfig(bucket_cap_mb=10).bucket_cap_bytes
    10485760
    ```
    """

    bucket_cap_mb: float | None = None
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    sync_each_batch: bool = False

    @property
    def bucket_cap_bytes(self) -> int:
        return int((25.0 if self.bucket_cap_mb is None else self.bucket_cap_mb) * 2**20)

    @property
    def bucket_size_limits(self) -> list[int]:
        # NOTE: DDP's `_BucketConfig`: a smaller first bucket only when the cap is the default.
        cap = self.bucket_cap_bytes
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if self.bucket_cap_mb is None else cap
        return [first, cap] if first < cap else [cap]

    @classmethod
    def from_accelerator(cls, accelerator: Any) -> DataParallelConfig | None:
        """The settings Accelerate would give DDP, or `None` when `accelerator` does not run data-parallel."""
        if str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)) not in DDP_TYPES:
            return None
        handler = getattr(accelerator, "ddp_handler", None)
        check_ddp_comm_hook(getattr(handler, "comm_hook", None))
        kwargs = handler.to_kwargs() if handler is not None else {}
        plugin = getattr(accelerator.gradient_state, "plugin_kwargs", {}) or {}
        return cls(
            bucket_cap_mb=None if kwargs.get("bucket_cap_mb") is None else float(kwargs["bucket_cap_mb"]),
            find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
            broadcast_buffers=bool(kwargs.get("broadcast_buffers", True)),
            sync_each_batch=bool(plugin.get("sync_each_batch", False)),
        )


class _Bucket:
    """Parameters reduced by one all-reduce, in launch order, and the buffer while it is alive."""

    def __init__(
        self, indices: list[int], numels: list[int], dtype: torch.dtype, device: torch.device, alone: bool = False
    ):
        self.indices = indices
        self.alone = alone  # a tensor at least as large as the cap: its step may be delayed (`DelayPlan`)
        self.position = 0  # its index in launch order (_set_buckets): a delay depends on the bucket after it
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


def build_buckets(params: list[torch.Tensor], limits: list[int], ready_order: list[int]) -> list[_Bucket]:
    """
    Buckets in launch order: torch's own assignment, with DDP's size limits, of the parameters in `ready_order`,
    except that a tensor at least as large as the cap is a bucket of its own. (torch's rule closes a bucket once it
    reaches the limit, so an embedding would otherwise be copied into a bucket with the layer before it: a copy of
    the largest tensor, and that layer's gradients delayed until the embedding's is ready.)

    Args:
        params (`list[torch.Tensor]`):
            The parameters, indexed as the optimizer indexes them.
        limits (`list[int]`):
            Bucket sizes in bytes (`DataParallelConfig.bucket_size_limits`): the first bucket's, then the cap.
        ready_order (`list[int]`):
            Parameter indices in the order their gradients become ready.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.routes.data_parallel import build_buckets
    >>> params = [torch.zeros(256), torch.zeros(256), torch.zeros(4096)]  # 1 KiB, 1 KiB, 16 KiB
    >>> [bucket.indices for bucket in build_buckets(params, [4096], ready_order=[2, 1, 0])]
    [[2], [1, 0]]
    ```
    """
    cap = limits[-1]
    assignment: list[list[int]] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            # The smaller first bucket only while nothing has been bucketed yet.
            run_limits = limits if not assignment else [cap]
            tensors = [params[i] for i in run]
            # NOTE: no expect_sparse_gradient list: torch requires it as long as `tensors` but reads it at the given
            # indices, which are parameter indices here (past its end).
            indices, _ = dist._compute_bucket_assignment_by_size(tensors, run_limits, [], run)
            assignment.extend(list(b) for b in indices)
            run.clear()

    alone: set[int] = set()
    for i in ready_order:
        if params[i].numel() * params[i].element_size() >= cap:
            flush()
            alone.add(len(assignment))
            assignment.append([i])
        else:
            run.append(i)
    flush()
    return [_make_bucket(params, indices, b in alone) for b, indices in enumerate(assignment)]


def _make_bucket(params: list[torch.Tensor], indices: list[int], alone: bool) -> _Bucket:
    first = params[indices[0]]
    return _Bucket(indices, [params[i].numel() for i in indices], first.dtype, first.device, alone)


def watch_first_forward(model: torch.nn.Module, params: list[torch.Tensor], planned) -> list[Any]:
    """
    Forward hooks that call `planned(used)` once, at the end of the first training forward with grad, with the
    indices of `params` in the order the forward first used them; the caller removes the returned handles.
    """
    index = {id(p): i for i, p in enumerate(params)}
    used: list[int] = []
    done = []

    def note(module, args):
        if module.training and torch.is_grad_enabled() and not done:
            for p in module.parameters(recurse=False):
                i = index.get(id(p))
                if i is not None and i not in used:
                    used.append(i)

    def plan(module, args, output):
        if module.training and torch.is_grad_enabled() and not done:
            done.append(True)
            planned(used)

    handles = [
        module.register_forward_pre_hook(note)
        for module in model.modules()
        if any(True for _ in module.parameters(recurse=False))
    ]
    handles.append(model.register_forward_hook(plan))
    return handles


class _QueueFinishInBackward(torch.autograd.Function):
    """Identity whose backward queues the reducer's end-of-backward work on the backward it runs in."""

    @staticmethod
    def forward(ctx, reducer, tensor):
        ctx.reducer = reducer
        return tensor.clone()  # not a view: Trainer scales the loss in place

    @staticmethod
    def backward(ctx, grad):
        ctx.reducer._queue_finish()
        return None, grad


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
        self._plan_hooks: list[Any] = []
        self._output_hook: Any = None

    # ---- attach / detach ----

    def _entry(self, sink: GradientSink):
        return self._local_ready

    def attach(self, sink: GradientSink) -> None:
        self.sink = sink
        self.params = list(sink.params)
        # Until the first training forward shows the order parameters are used: the reverse of their order.
        self._set_buckets(build_buckets(self.params, self.config.bucket_size_limits, self._reversed_order()))
        self._ready_order: list[int] | None = []
        self._plan_hooks: list[Any] = []
        self._output_hook: Any = None
        self._next = 0  # the next bucket to launch, in the same order on every rank
        self._in_flight: collections.deque[_Bucket] = collections.deque()
        self._delayed: list[_Bucket] = []  # reduced, their step waiting for fewer activations (`DelayPlan`)
        self._in_backward = False
        self._sync_module_states()
        if self.model is not None and self.config.broadcast_buffers and any(True for _ in self.model.buffers()):
            self._buffer_hook = self.model.register_forward_pre_hook(self._broadcast_buffers)
        if self.model is not None:
            self._plan_from_first_forward()
            self._output_hook = self.model.register_forward_hook(self._mark_output)
        super().attach(sink)

    def _plan_from_first_forward(self) -> None:
        # Gradients become ready in about the reverse of the order the forward first uses their parameters (a
        # layer's input norm last, not first as in parameter order). Bucketing in that order from the first step
        # keeps a bucket's early gradients from waiting for a late member; after the first backward the buckets are
        # rebuilt in the order actually observed, as DDP does.
        def planned(used: list[int]) -> None:
            self._remove_plan_hooks()
            seen = set(used)
            order = used[::-1] + [i for i in self._reversed_order() if i not in seen]
            self._set_buckets(build_buckets(self.params, self.config.bucket_size_limits, self._agree(order)))

        self._plan_hooks = watch_first_forward(self.model, self.params, planned)

    def _remove_plan_hooks(self) -> None:
        for handle in self._plan_hooks:
            handle.remove()
        self._plan_hooks = []

    def _agree(self, order: list[int]) -> list[int]:
        # Every rank must bucket alike (a parameter unused on one rank changes its order): rank 0's order wins, as
        # in DDP's bucket rebuild.
        tensor = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
        dist.broadcast(tensor, src=0, group=self.process_group)
        return tensor.tolist()

    def _reversed_order(self) -> list[int]:
        return list(reversed(range(len(self.params))))

    def _set_buckets(self, buckets: list[_Bucket]) -> None:
        self.buckets = buckets
        self.bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket.indices}
        for b, bucket in enumerate(buckets):
            bucket.position = b
        # Buckets go out in launch order, the same on every rank: a large one's step is held while smaller follow.
        self._delays = DelayPlan([bucket.alone for bucket in buckets], range(len(buckets)))

    def detach(self) -> None:
        self._remove_plan_hooks()
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None
        if self._buffer_hook is not None:
            self._buffer_hook.remove()
            self._buffer_hook = None
        for bucket in getattr(self, "buckets", []):
            bucket.reset()
        self._in_flight = collections.deque()
        self._delayed = []
        if hasattr(self, "_delays"):
            self._delays.release()
        self._next = 0
        self._in_backward = False
        super().detach()

    @torch.no_grad()
    def _sync_module_states(self) -> None:
        # NOTE: what DDP does when it wraps a model: every replica starts from rank 0's parameters and buffers.
        # Frozen parameters too (a LoRA base), as DDP broadcasts every parameter.
        tensors = list(self.params) if self.model is None else [*self.model.parameters(), *self.model.buffers()]
        for t in tensors:
            dist.broadcast(t.data, src=0, group=self.process_group)

    def _broadcast_buffers(self, module, args) -> None:
        # NOTE: as DDP, only before a forward that will be reduced (training, with grad): evaluation and no_sync
        # forwards need not run in step on every rank.
        if module.training and torch.is_grad_enabled():
            with torch.no_grad():
                for buf in module.buffers():
                    dist.broadcast(buf, src=0, group=self.process_group)

    # ---- backward ----

    def _local_ready(self, i: int) -> None:
        sink = self.sink
        if not (sink.sync_gradients() or self.config.sync_each_batch):
            sink.grad_ready(i)  # accumulating locally, as under no_sync: the gradient stays in .grad
            return
        self._queue_finish()  # normally done already, by the output's backward (see _mark_output)
        if self._ready_order is not None:
            self._ready_order.append(i)
        bucket = self.buckets[self.bucket_of[i]]
        k = bucket.slot[i]
        if bucket.ready[k]:
            raise RuntimeError(
                f"The gradient hook of {sink.names[i]} fired twice in one backward (reentrant activation "
                f"checkpointing with a parameter in two segments?): use {checkpointing_kwargs_name()}="
                "{'use_reentrant': False}."
            )
        sink.merge_waiting(i)  # the window's earlier micro-batches, summed on the host: reduced together with this one
        self._put(bucket, k, self.params[i])
        self._launch_complete()

    @torch.no_grad()
    def _put(self, bucket: _Bucket, k: int, p: torch.Tensor) -> None:
        if len(bucket.indices) == 1 and p.grad.is_contiguous():
            # A tensor larger than the cap is reduced in place: the same product DDP writes, without a copy.
            bucket.buffer = p.grad.mul_(1.0 / self.world_size).view(-1)
        else:
            if bucket.buffer is None:
                bucket.buffer = torch.empty(sum(bucket.numels), dtype=bucket.dtype, device=bucket.device)
            # NOTE: DDP's `mul_out(bucket_view, grad, 1 / world_size)`, so the reduced bits are DDP's.
            torch.mul(p.grad, 1.0 / self.world_size, out=bucket.view(k, p.shape))
        # Counted from here until it steps: in flight or held in its bucket, it is alive all the same.
        self.sink.grad_delayed(bucket.indices[k])
        p.grad = None
        bucket.ready[k] = True
        bucket.count += 1

    def _queue_finish(self) -> None:
        if not self._in_backward and (self.sink.sync_gradients() or self.config.sync_each_batch):
            # NOTE: runs once the whole backward is done: buckets with parameters this rank did not use.
            self._in_backward = self.sink.backward_end.queue("route", self._finish_backward)

    def _mark_output(self, module, args, output):
        # The end-of-backward callback must belong to the outermost backward: queued from a parameter's hook inside
        # a reentrant checkpoint's nested backward, it would run when that segment ends. The backward of this
        # identity on the model's output runs first in the outer backward, and queues it there.
        if not (module.training and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return output
        # Only a loss computed by the model (a scalar: the identity copies it); without one (a loss computed outside
        # from the logits), the first parameter hook queues the work.
        loss = output.get("loss") if isinstance(output, dict) else None
        if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
            output["loss"] = _QueueFinishInBackward.apply(self, loss)
        return output

    def _launch_complete(self) -> None:
        # NOTE: a bucket retires when the in-flight bound or the end of backward says so, never on `is_completed()`:
        # polling made the step's place in backward depend on the link's speed (on gloo, lm_head stepped a few hooks
        # early, its temporaries on top of the next bucket and more activations: +6.6% over the plan), and the
        # planner's fake process group, like a busy NCCL stream, completes nothing until it is waited on.
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        for k, i in enumerate(bucket.indices):
            if not bucket.ready[k]:
                self.sink.merge_waiting(i)
            if not bucket.ready[k] and self.params[i].grad is not None:
                # Used in an earlier micro-batch of the window but not in this one: its accumulated gradient is
                # reduced too (DDP copies any defined .grad into its bucket).
                self._put(bucket, k, self.params[i])
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(sum(bucket.numels), dtype=bucket.dtype, device=bucket.device)
        elif not bucket.complete:
            for k, ready in enumerate(bucket.ready):
                if not ready:
                    bucket.buffer[bucket.offsets[k] : bucket.offsets[k] + bucket.numels[k]].zero_()
        if self.config.find_unused_parameters:
            # Every rank must join each flag all-reduce; a full bucket's flags are filled on the device, without
            # the blocking copy from host memory that a list would cost on CUDA.
            if all(bucket.ready):
                bucket.used = torch.ones(len(bucket.ready), dtype=torch.int32, device=bucket.device)
            else:
                bucket.used = torch.tensor(bucket.ready, dtype=torch.int32, device=bucket.device)
            bucket.used_work = dist.all_reduce(bucket.used, group=self.process_group, async_op=True)
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        self._in_flight.append(bucket)
        self._next += 1
        if bucket.alone:
            self._delays.delay(bucket.position)
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._retire(self._in_flight.popleft())
        if not bucket.alone and self._delays.arrived(bucket.position):
            # The next gradient is a large one, not computed yet, and few activations are left: drain the smaller
            # buckets, then step the held ones (their temporaries and that gradient never coexist).
            self._drain()

    def _retire(self, bucket: _Bucket) -> None:
        # A large tensor's step early in backward would put its temporaries on top of the activations still alive
        # (see the module docstring): held while the buckets planned after it are smaller.
        if bucket.position in self._delays.delayed:
            self._delayed.append(bucket)
        else:
            self._step_bucket(bucket)

    def _drain(self) -> None:
        while self._in_flight:
            self._step_bucket(self._in_flight.popleft())
        self._delays.release()
        while self._delayed:
            self._step_bucket(self._delayed.pop(0))

    def _step_bucket(self, bucket: _Bucket) -> None:
        bucket.work.wait()
        used = None
        if bucket.used_work is not None:
            bucket.used_work.wait()
            if not all(bucket.ready):
                # Only here can a parameter be unused by every rank: this rank used all of a full bucket's.
                used = bucket.used.tolist()
        sink = self.sink
        for k, i in enumerate(bucket.indices):
            if used is not None and used[k] == 0:
                continue  # no rank used it: .grad stays None and the optimizer skips it, as with DDP
            p = self.params[i]
            p.grad = bucket.view(k, p.shape)
            sink.grad_ready(i)  # steps and frees it (or holds it: exact clipping, accumulation)
        bucket.reset()  # the buffer lives on only through gradients the optimizer holds

    def _finish_backward(self) -> None:
        self._in_backward = False
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        self._drain()
        self._next = 0
        if self._ready_order is not None:
            # Parameters no gradient reached this time go last, in reverse order.
            seen = set(self._ready_order)
            order = self._ready_order + [i for i in self._reversed_order() if i not in seen]
            self._set_buckets(build_buckets(self.params, self.config.bucket_size_limits, self._agree(order)))
            self._ready_order = None
