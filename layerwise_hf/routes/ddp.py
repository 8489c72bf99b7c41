"""The DDP route: a comm hook that all-reduces each bucket and hands the reduced gradients to the optimizer.

DDP's post-accumulate-grad hooks fire BEFORE the all-reduce, so stepping there would diverge the replicas. The comm
hook scales and all-reduces the bucket as DDP does, then calls the sink's `grad_ready(i)` for each of its
parameters on the reduced gradient; the reducer is told that the optimizer runs in backward, so it does not copy
the bucket back into `.grad`.

With `gradient_as_bucket_view=True` a gradient handed over on a synced micro-batch that does not end the window is
DDP's bucket memory, which the reducer rewrites in place in the next micro-batch's backward. A sink that takes such a
gradient off the device (host offload copies it on a side stream and frees `.grad`) is handed a copy of it instead,
so that no copy still in flight reads the bucket while it is rewritten (`_accumulate_in_view`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .hooks import GradientRoute
from .sink import GradientSink


def find_ddp(model):
    """
    The `DistributedDataParallel` in `model`'s `.module` chain, or `None`.

    Args:
        model (`torch.nn.Module`):
            The model as prepared (possibly wrapped, e.g. by DDP or `torch.compile`).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.routes.ddp import find_ddp
    >>> find_ddp(torch.nn.Linear(2, 2)) is None  # not wrapped in DDP
    True
    ```
    """
    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        model = getattr(model, "module", None)
        seen += 1
    return None


class _CommState:
    """What the comm hook reads. DDP cannot drop a comm hook, so detaching points it at no optimizer: a plain
    averaging hook."""

    def __init__(self, ddp_model):
        self.sink: GradientSink | None = None
        self.index: dict[int, int] = {}  # id(param) -> its index in the sink
        self.process_group = ddp_model.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.gradient_as_bucket_view = ddp_model.gradient_as_bucket_view
        self.check_unused = bool(ddp_model.find_unused_parameters or ddp_model.static_graph)
        # Parameters whose .grad a synced, non-final micro-batch left aliasing the bucket (bucket-view mode only).
        self.aliased: set[int] = set()
        # Bucket-view mode: parameters whose accumulated gradient the sink was seen to keep in .grad (handed the view
        # itself from then on), learned again at each attach.
        self.keeps: set[int] = set()


class DDPCommHook(GradientRoute):
    """
    The route of a DDP-wrapped model.

    Args:
        ddp_model (`torch.nn.parallel.DistributedDataParallel`):
            The DDP wrapper whose comm hook all-reduces the buckets (see `find_ddp`).

    Example:

    ```python
    >>> # after `model, optimizer = accelerator.prepare(model, optimizer)` under `accelerate launch` (DDP):
    >>> from layerwise_hf import unwrap_layerwise_optimizer
    >>> unwrap_layerwise_optimizer(optimizer).connect(model)  # picks DDPCommHook
    'ddp'
    ```
    """

    name = "ddp"
    collective_per_forward = True

    def __init__(self, ddp_model):
        super().__init__()
        self.ddp_model = ddp_model

    def attach(self, sink: GradientSink) -> None:
        state = getattr(self.ddp_model, "_layerwise_comm_state", None)
        if state is None:
            state = _CommState(self.ddp_model)
            try:
                self.ddp_model.register_comm_hook(state, _layerwise_comm_hook)
            except RuntimeError as err:
                raise RuntimeError(
                    "A layer-wise optimizer needs its own DDP comm hook, and this model already has one (e.g. "
                    "DistributedDataParallelKwargs(comm_hook=...)). Remove that comm hook."
                ) from err
            # NOTE: a one-way reducer flag: finalize_bucket_dense stops writing the bucket into .grad, so the
            # gradients the per-layer steps freed stay freed.
            self.ddp_model.reducer._set_optimizer_in_backward()
            self.ddp_model._layerwise_comm_state = state
        # The same DDP model trained again (second train()): the existing hook now feeds this optimizer.
        state.sink = sink
        state.index = {id(p): i for i, p in enumerate(sink.params)}
        state.keeps = set()
        self.state = state
        self.attached = True

    def detach(self) -> None:
        if self.attached:
            self.state.sink = None
            self.state.index = {}
        self.attached = False


def _scale(state: _CommState, bucket: dist.GradBucket) -> None:
    # NOTE: DDP averages with mul_(1/world_size) while copying gradients into the bucket (div_ only for gradients
    # accumulated in place in the bucket view); matching that operation, not dividing, keeps 3+ ranks bit-exact.
    if not state.aliased:
        bucket.buffer().mul_(1.0 / state.world_size)
        return
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        if id(p) in state.aliased and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
            g.div_(state.world_size)
        else:
            g.mul_(1.0 / state.world_size)


def _finish(state: _CommState, bucket: dist.GradBucket, used: torch.Tensor | None) -> torch.Tensor:
    sink = state.sink
    sync = sink.sync_gradients() if sink is not None else False
    used_list = used.tolist() if used is not None else None
    for k, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
        if used_list is not None and used_list[k] == 0:
            continue  # unused on every rank: DDP leaves .grad None and a standard optimizer skips it
        i = state.index.get(id(p)) if sink is not None else None
        if i is not None and sink.params[i] is not p:
            i = None  # not the tensor the sink was built on (an id reused after it was replaced)
        if sync and i is not None:
            p.grad = g  # a view into the reduced bucket
            sink.grad_ready(i)
            state.aliased.discard(id(p))
            continue
        # Not stepping now: do what DDP's finalize_bucket_dense would have done without the optimizer-in-backward
        # flag.
        if p.grad is None:
            p.grad = g if state.gradient_as_bucket_view else g.clone()
        elif p.grad.data_ptr() != g.data_ptr():
            p.grad.copy_(g)
        if not state.gradient_as_bucket_view:
            if i is not None:
                sink.grad_ready(i)  # accumulation bookkeeping only
            continue
        state.aliased.add(id(p))
        if i is not None:
            _accumulate_in_view(state, sink, i, p, g)
    return bucket.buffer()


def _accumulate_in_view(state: _CommState, sink: GradientSink, i: int, p: torch.Tensor, g: torch.Tensor) -> None:
    # Bucket-view mode, a micro-batch that does not end the window: `g` is DDP's bucket memory, which the reducer
    # rewrites in place when this parameter's next gradient is ready. A sink that takes the gradient off the device
    # (host offload: a copy on a side stream, then .grad = None) gets a copy, so its copy reads memory it owns.
    if id(p) in state.keeps:
        sink.grad_ready(i)
        if p.grad is None:  # taken after all (offload enabled after connect): copy from the next micro-batch on
            state.keeps.discard(id(p))
            state.aliased.discard(id(p))
        return
    copy = _sink_copy(g)
    p.grad = copy
    sink.grad_ready(i)
    if p.grad is None:
        # NOTE: the next micro-batch's gradient is then copied into the bucket, not accumulated in the view: DDP
        # scales a copied gradient with mul_, not div_ (`_scale`).
        state.aliased.discard(id(p))
    elif p.grad is copy:
        p.grad = g  # kept in .grad: the bucket view again, as DDP leaves it (the same values)
        state.keeps.add(id(p))


def _sink_copy(g: torch.Tensor) -> torch.Tensor:
    # NOTE: on CUDA the copy runs on the compute stream, ordered before the bucket is written again; a side stream
    # that reads it is recorded on it (record_stream), so freeing it is safe. The bucket itself is rewritten in place,
    # which record_stream does not guard.
    return g.clone()


def _layerwise_comm_hook(state, bucket):
    _scale(state, bucket)
    buffer = bucket.buffer()
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    used = used_work = None
    read_used = False
    if state.check_unused:
        # Locally used <=> .grad defined when DDP marks the parameter ready (it zero-fills the slot otherwise); only
        # used-on-no-rank parameters are skipped, exactly as DDP leaves their .grad None.
        local = [p.grad is not None for p in bucket.parameters()]
        # Every rank must join the flags' all-reduce, but only a bucket this rank did not fill itself can hold a
        # parameter no rank used: a full bucket's flags are filled on the device and never read back (on CUDA a
        # tensor built from a list is a blocking host-to-device copy, and reading it back a host sync).
        read_used = not all(local)
        if read_used:
            used = torch.tensor(local, dtype=torch.int32, device=buffer.device)
        else:
            used = torch.ones(len(local), dtype=torch.int32, device=buffer.device)
        used_work = dist.all_reduce(used, group=state.process_group, async_op=True)
    # Waiting here keeps every step on the autograd thread, in bucket order (as torch's optimizer-in-backward does).
    work.wait()
    if used_work is not None:
        used_work.wait()
    future = torch.futures.Future()
    future.set_result(_finish(state, bucket, used if read_used else None))
    return future


# NOTE: DDP checks this hook's annotations, so they are given as real objects (this module postpones annotations).
_layerwise_comm_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
