"""Host offload of gradients (`layerwise_offload="gradients"`): each final gradient goes to a host buffer during
backward, and comes back to the device one at a time for its step.

What it buys: with gradient accumulation, every micro-batch's gradient is added into its host buffer and freed on the
device, so the device holds only the gradients in flight (at most `max_in_flight` copies) at any GA; with exact
clipping (and without accumulation) the step needs the global norm before any layer steps, and the gradients wait for
it on the host instead of on the device, so one forward and one backward per micro-batch suffice (no norm pass).

The path of gradient `i` (the route has reduced it; `GradientPipeline.grad_ready` hands it over):

1. `stash`: the device gradient is copied to the host (`Transfer.copy`, beside the compute) and freed. The first
   gradient of a window lands in the buffer itself; a later micro-batch's lands in a staging buffer that the host
   worker adds into it once the copy is done (`buffer += staged`: the order autograd accumulates `.grad` in, so the
   sum is bit-identical to the standard optimizer's). At most `max_staged` staging buffers are in use: when the
   host worker falls behind, the next stash waits for its oldest add (`StagingBuffers`), so pinned memory is bounded.
   Without accumulation the gradient's norm is taken on the device before the copy (the pipeline does it); with
   accumulation the norm of the sum is taken by the host worker. Under fp16 loss scaling the inf check and unscale go
   the same way: on the device before the copy, or by the host worker on the sum once the window's last micro-batch is
   in (`found_inf`, the host's flag; GradScalerBridge gathers it).
2. `settle`: the end of the window's last backward waits for every copy and host task and records the host norms in
   the step window, so the global norm is known.
3. `restore_each`: each held gradient is copied back into a fresh device tensor, the next one's copy started before
   the current one steps (the copy back overlaps the steps), and stepped by the pipeline (clip, inner step, free).

The device's asynchrony is `layerwise_hf.placement.transfer`'s (a side stream on CUDA, a copy thread on CPU).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..platform.dtensor import local_tensor
from ..platform.norms import grad_norm_kernel, moved_together
from .transfer import HostArena, Ticket, Transfer, check_device, device_of, make_transfer

logger = logging.getLogger(__name__)

OFFLOAD_MODES = ("none", "gradients", "optimizer")


def parse_offload(value: Any, argument: str = "layerwise_offload") -> str:
    """
    `value` as an offload mode (`"none"`, `"gradients"`, `"optimizer"`), or a `ValueError` naming `argument`.

    Example:

    ```python
    >>> from layerwise_hf.placement.offload import parse_offload
    >>> parse_offload("gradients")
    'gradients'
    ```
    """
    if isinstance(value, str) and value in OFFLOAD_MODES:
        return value
    raise ValueError(
        f"{argument}={value!r} is not an offload mode: choose one of {', '.join(OFFLOAD_MODES)} ('gradients': "
        "gradients wait in host memory for the step; 'optimizer': optimizer states and the step live on the host)."
    )


def shard_norm(param: torch.Tensor, local_norm: torch.Tensor) -> torch.Tensor:
    """`local_norm`, the norm of this rank's shard of `param`'s gradient, as the device kernel gives it for the whole
    gradient: a plain parameter's as is; a DTensor's as a partial norm (`_NormPartial`) that the global norm reduces
    across ranks, so a sum measured on the host counts every rank's shard, as `clip_grad_norm_` does."""
    if not hasattr(param, "device_mesh"):
        return local_norm
    from torch.distributed.tensor import DTensor, Shard

    # NOTE: private; the placement torch's own norm of a Shard dimension takes (checked on torch 2.13 and 2.14), so the
    # global norm runs the very ops of the standard optimizer's clip_grad_norm_ over DTensor gradients.
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    placements = [_NormPartial(2.0) if isinstance(p, Shard) else p for p in param.placements]
    local = local_norm.to(local_tensor(param).device)
    return DTensor.from_local(local, param.device_mesh, placements, run_check=False)


class HostWorker:
    """One host thread that runs tasks in the order they were submitted (host adds, norms, host optimizer steps).
    `use(transfer)` binds the thread to the transfer's device before its first task (or, once running, before the
    next one)."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._bind: Callable[[], None] | None = None

    def use(self, transfer: Transfer) -> None:
        """Run the worker's tasks on `transfer`'s device (`Transfer.bind_thread`)."""
        if self._bind == transfer.bind_thread:
            return
        self._bind = transfer.bind_thread
        if self._pool is not None:
            self._pool.submit(self._bind)  # FIFO: before any task submitted from now on

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="layerwise-host", initializer=self._bind or (lambda: None)
            )
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class StagingBuffers:
    """
    The host buffers a later micro-batch's gradient is copied into before the host worker adds it into its sum: at
    most `bound` in use at once. `allocate` makes them `bound` blocks of the largest gradient's bytes, kept for the
    run (pinned to the byte by `Transfer.host_block`), so the pinned bytes are what the plan counts; a gradient that
    does not fit, or any before `allocate`, gets a buffer of its own (`Transfer.host_empty_like`), counted against the
    same bound.

    Args:
        bound (`int`): staging buffers in use at once.

    Example:

    ```python
    >>> import concurrent.futures, torch
    >>> from layerwise_hf.placement.offload import StagingBuffers
    >>> from layerwise_hf.placement.transfer import ThreadTransfer
    >>> staging, add = StagingBuffers(2), concurrent.futures.Future()
    >>> staging.allocate(ThreadTransfer(), [torch.ones(4), torch.ones(2)])
    >>> buffer, block = staging.take(ThreadTransfer(), torch.ones(3))
    >>> staging.hold(block, add); buffer.shape, staging.in_use, staging.nbytes
    (torch.Size([3]), 1, 32)
    ```
    """

    def __init__(self, bound: int):
        self.bound = bound
        self.blocks: list[torch.Tensor] = []  # flat uint8 host blocks, reused
        self.free: list[torch.Tensor] = []
        # Buffers in use, oldest first: (its block, or None for one of its own; the add that reads it).
        self.busy: collections.deque[tuple[torch.Tensor | None, concurrent.futures.Future]] = collections.deque()

    @property
    def in_use(self) -> int:
        """Buffers whose add may not have run yet."""
        return len(self.busy)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks kept for the run."""
        return sum(block.numel() for block in self.blocks)

    def allocate(self, transfer: Transfer, tensors: Sequence[torch.Tensor]) -> None:
        """Make the blocks, for gradients like `tensors` (the device-side tensors offload may hold)."""
        largest = max((t.numel() * t.element_size() for t in tensors), default=0)
        if largest and not self.blocks:
            self.blocks = [transfer.host_block(largest, torch.uint8) for _ in range(self.bound)]
            self.free = list(self.blocks)

    def take(self, transfer: Transfer, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(buffer, block)`: a host buffer like `grad`, a view into `block` (or `None`: a buffer of its own), for
        `hold`. While `bound` are in use it blocks the caller (the gradient hook) until the oldest add has run."""
        while self.busy and (len(self.busy) >= self.bound or self.busy[0][1].done()):
            block, add = self.busy.popleft()
            # NOTE: result(), not a bare wait: the next copy into this block must come after the worker's read of it
            # (on CUDA it is queued after this wait returns; the tests' fake CUDA orders it by result() too).
            add.result()
            if block is not None:
                self.free.append(block)
        nbytes = grad.numel() * grad.element_size()
        if self.free and nbytes <= self.free[-1].numel():
            block = self.free.pop()
            return block[:nbytes].view(grad.dtype).view(grad.shape), block
        return transfer.host_empty_like(grad), None

    def hold(self, block: torch.Tensor | None, add: concurrent.futures.Future) -> None:
        """The buffer `take` gave with `block` is in use until `add` has run."""
        self.busy.append((block, add))

    def reset(self) -> None:
        """At the window's end (which waited for its adds through their buffers' waits): every block is free."""
        concurrent.futures.wait([add for _, add in self.busy])
        self.busy.clear()
        self.free = list(self.blocks)


class GradientOffload:
    """
    Gradients held in host buffers between their backward and their step (see the module docstring).

    Args:
        transfer (`Transfer`, *optional*):
            The device's copies; by default chosen at the first copy: `choose(gradient)`, or `make_transfer` for the
            first gradient's device.
        max_in_flight (`int`, *optional*, defaults to `2`):
            Copies out allowed in flight at once; the next stash waits for the oldest. The device side then holds at
            most this many gradients being copied, next to the one autograd is computing.
        max_staged (`int`, *optional*, defaults to `2`):
            Gradient accumulation: staging buffers in use at once (a later micro-batch's gradient waits in one until
            the host worker has added it into its sum). When the worker falls behind, the next stash waits for its
            oldest add, so the host holds at most this many, each the size of the largest gradient.
        worker (`HostWorker`, *optional*):
            The host thread for adds and norms (`layerwise_offload="optimizer"` shares its host steps' one).
        host_steps (`bool`, *optional*, defaults to `False`):
            The gradients are stepped on the host from their buffers (`HostStepOptimizer.step_host`), not copied back.
        choose (`Callable[[torch.Tensor], Transfer]`, *optional*):
            Gives the transfer at the first copy when `transfer` is not given (`HostRunner.transfer_for`: the host
            steps' copies and these share one).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.placement.offload import GradientOffload
    >>> offload = GradientOffload()
    >>> weight = torch.nn.Parameter(torch.ones(3)); weight.grad = torch.full((3,), 2.0)
    >>> offload.stash(0, weight, measure=False); weight.grad is None, offload.pending()
    (True, [0])
    ```
    """

    def __init__(
        self,
        transfer: Transfer | None = None,
        max_in_flight: int = 2,
        worker: HostWorker | None = None,
        host_steps: bool = False,
        choose: Callable[[torch.Tensor], Transfer] | None = None,
        max_staged: int = 2,
    ):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight!r}: at least one copy must be allowed in flight.")
        if max_staged < 1:
            raise ValueError(f"max_staged={max_staged!r}: at least one staging buffer must be allowed.")
        self.transfer = transfer
        self.choose = choose
        self.max_in_flight = max_in_flight
        self.worker = worker or HostWorker()
        if transfer is not None:
            self.worker.use(transfer)
        self.host_steps = host_steps  # layerwise_offload="optimizer": step() steps from the host buffers
        self.host: dict[int, torch.Tensor] = {}  # persistent host buffers, one per parameter that was offloaded
        # The device-side tensors whose buffers `host` may hold (`enable_offload`: the parameters' local shards), asked
        # at the first buffer: the buffers are then views into one pinned block per dtype (`HostArena`).
        self.reserve: Callable[[], Sequence[torch.Tensor]] | None = None
        self.arena: HostArena | None = None
        self.staging = StagingBuffers(max_staged)
        self.filled: dict[int, bool] = {}  # whether this window's buffer holds a gradient (else it is stale)
        self.accumulated: set[int] = set()  # buffers holding a sum of micro-batches: norm taken on the host
        self.waits: dict[int, list[Ticket | concurrent.futures.Future]] = {}  # what must finish before reading i
        self.host_norms: dict[int, concurrent.futures.Future] = {}
        self.in_flight: collections.deque[tuple[Ticket, int]] = collections.deque()
        self.device_bytes = 0  # device gradient bytes being copied out now
        self.peak_device_bytes = 0
        self.final: set[int] = set()  # the window's last micro-batch's gradient is in (or finish() closed it)
        self.found_inf: torch.Tensor | None = None  # fp16: the host worker's inf/nan flag for this window's sums

    # ---- during backward ----

    def has_sum(self, i: int) -> bool:
        """Whether gradient `i` of this window is (partly) in its host buffer."""
        return self.filled.get(i, False)

    @property
    def active(self) -> bool:
        """Whether any gradient of this window is held on the host."""
        return any(self.filled.values())

    def _transfer_for(self, tensor: torch.Tensor) -> Transfer:
        # Chosen at the first copy, for the device of a device-side tensor (a gradient, or the parameter copied into).
        if self.transfer is None:
            self.transfer = make_transfer(device_of(tensor)) if self.choose is None else self.choose(tensor)
            self.worker.use(self.transfer)
        check_device(self.transfer, tensor)
        return self.transfer

    @torch.no_grad()
    def stash(
        self, i: int, param: torch.Tensor, measure: bool, final: bool = True, inv_scale: torch.Tensor | None = None
    ) -> None:
        """Copy `param.grad` into (or, later in the window, add it to) `i`'s host buffer and free it on the device.
        `final`: the window's last micro-batch's gradient; for a sum, `measure`: the step wants its norm and
        `inv_scale` (fp16, a host tensor): unscale and inf-check it, both by the host worker."""
        grad = local_tensor(param.grad)
        transfer = self._transfer_for(grad)
        self._make_room()
        buffer = self.host.get(i)
        if not final and self.reserve is not None and not self.staging.blocks:
            # A window of several micro-batches: its later ones stage. Made at its first stash, before any peak of
            # the run, and kept: what is pinned stays the same from here on. (With "optimizer" the buffers may exist
            # already: the host step's, shared, `OffloadStage.take`.)
            self.staging.allocate(transfer, self.reserve())
        if buffer is None:
            if self.arena is None and self.reserve is not None:
                self.arena = HostArena(transfer, self.reserve())
            buffer = self.host[i] = (
                transfer.host_empty_like(grad) if self.arena is None else self.arena.empty_like(grad)
            )
        waits = self.waits.setdefault(i, [])
        if not self.filled.get(i, False):
            ticket = transfer.copy(buffer, grad)
            waits.append(ticket)
            self.filled[i] = True
        else:
            staged, block = self.staging.take(transfer, grad)
            ticket = transfer.copy(staged, grad)
            # NOTE: the add waits for what came before into `buffer` too, though today the order already gives it:
            # an earlier copy into it ran on the same to-host stream (one copy thread), an earlier add or unscale on
            # the one worker thread. Kept (each is done: a cheap wait) so that neither order is load-bearing.
            before = list(waits)
            waits.clear()
            waits.append(self.worker.submit(_add_after, buffer, staged, [*before, ticket]))
            self.staging.hold(block, waits[-1])
            self.accumulated.add(i)
        param.grad = None
        self._track(ticket, grad.numel() * grad.element_size())
        if final:
            self.final.add(i)
            if i in self.accumulated:
                self._host_checks(i, measure, inv_scale)

    def _host_checks(self, i: int, measure: bool, inv_scale: torch.Tensor | None) -> None:
        # After everything queued for buffer i: unscale it (fp16), then measure it.
        waits = self.waits.setdefault(i, [])
        buffer = self.host[i]
        if inv_scale is not None:
            if self.found_inf is None:
                self.found_inf = torch.zeros((), dtype=torch.float32, device=buffer.device)
            checked = self.worker.submit(_unscale_after, buffer, list(waits), self.found_inf, inv_scale)
            waits[:] = [checked]
        if measure:
            self.host_norms[i] = self.worker.submit(_norm_after, buffer, list(waits))

    def unfinished(self) -> list[int]:
        """Buffers filled in earlier micro-batches whose parameter got no gradient in the window's last one."""
        return [i for i in self.pending() if i not in self.final]

    def finish(self, measure: bool, inv_scale: torch.Tensor | None = None) -> None:
        """At the end of the window's last backward: give each `unfinished()` buffer what a final gradient would
        have (the host worker's norm of the sum when `measure`, its unscale and inf check with `inv_scale`)."""
        for i in self.unfinished():
            self.final.add(i)
            self._host_checks(i, measure, inv_scale)

    def _make_room(self) -> None:
        # Before a new copy starts: at most max_in_flight - 1 others may still read device gradients.
        while self.in_flight and (len(self.in_flight) >= self.max_in_flight or self.in_flight[0][0].done()):
            oldest, size = self.in_flight.popleft()
            oldest.wait_host()
            self.device_bytes -= size

    def _track(self, ticket: Ticket, nbytes: int) -> None:
        self.in_flight.append((ticket, nbytes))
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    # ---- the step ----

    def settle(self, window: Any, params: Sequence[torch.Tensor]) -> None:
        """Wait for every copy out and host task; record the host-measured norms in `window` (`StepWindow`)."""
        for waits in self.waits.values():
            _wait_all(waits)
            waits.clear()
        # NOTE: no wait for the copies in flight: each is in its buffer's `waits` (or in the add that waits for it),
        # all waited for above. Only the count of device bytes being copied is settled.
        while self.in_flight:
            self.device_bytes -= self.in_flight.popleft()[1]
        ready = [(i, future.result()) for i, future in self.host_norms.items() if window.norms[i] is None]
        sharded = [k for k, (i, _) in enumerate(ready) if hasattr(params[i], "device_mesh")]
        if sharded:
            # FSDP2: each shard's norm becomes a partial DTensor norm on the device; moved together, one copy (and
            # one stream sync for its pageable source) per step instead of one per parameter.
            device = local_tensor(params[ready[sharded[0]][0]]).device
            moved = moved_together([ready[k][1] for k in sharded], device)
            for k, norm in zip(sharded, moved):
                ready[k] = (ready[k][0], norm)
        for i, norm in ready:
            window.norms[i] = (params[i].device, self.host[i].dtype, shard_norm(params[i], norm))
        self.host_norms.clear()

    def pending(self) -> list[int]:
        """The parameters whose gradient of this window waits on the host for its step, in parameter order."""
        return sorted(i for i, filled in self.filled.items() if filled)

    @torch.no_grad()
    def restore_each(
        self, indices: Sequence[int], params: Sequence[torch.Tensor], step: Callable[[int], None], window: Any
    ) -> None:
        """For each of `indices`: copy its gradient back into `params[i].grad` and call `step(i)`; the next copy
        back is started before `step(i)` runs, so the transfers overlap the steps."""
        self.settle(window, params)
        if not indices:
            return
        started = self._copy_back(indices[0], params[indices[0]])
        for k, i in enumerate(indices):
            device_grad, ticket = started
            if k + 1 < len(indices):
                started = self._copy_back(indices[k + 1], params[indices[k + 1]])
            ticket.wait_device()
            params[i].grad = device_grad
            self.filled[i] = False
            step(i)

    @torch.no_grad()
    def merge_into(self, i: int, param: torch.Tensor) -> None:
        """Bring `i`'s host sum back into `param.grad` (added to it, if any) before a reduction that must see the
        whole window's gradient (the data-parallel route reduces once per window); its buffer is free again."""
        _wait_all(self.waits.pop(i, []))
        self.host_norms.pop(i, None)
        device_sum, ticket = self._copy_back(i, param)
        ticket.wait_device()
        if param.grad is None:
            param.grad = device_sum
        else:
            param.grad.add_(device_sum)  # the last micro-batch's + the earlier ones': addition commutes, bit for bit
        self.filled[i] = False
        self.accumulated.discard(i)

    def _copy_back(self, i: int, param: torch.Tensor) -> tuple[torch.Tensor, Ticket]:
        device_grad = torch.empty_like(param)
        ticket = self._transfer_for(local_tensor(param)).copy(local_tensor(device_grad), self.host[i])
        return device_grad, ticket

    def end_window(self) -> None:
        """Forget this window's gradients (stepped, or dropped with a skipped or abandoned step); keep the buffers."""
        for waits in self.waits.values():
            _wait_all(waits)
        while self.in_flight:
            self.in_flight.popleft()[0].wait_host()
        self.device_bytes = 0
        self.waits.clear()
        self.host_norms.clear()
        self.filled.clear()
        self.accumulated.clear()
        self.final.clear()
        self.found_inf = None
        self.staging.reset()

    @property
    def max_staged(self) -> int:
        """Staging buffers in use at once (gradient accumulation)."""
        return self.staging.bound

    def host_bytes(self) -> int:
        """Bytes of the host buffers (each parameter's; the staging buffers apart: `staging_bytes()`)."""
        return sum(b.numel() * b.element_size() for b in self.host.values())

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers kept for the run (gradient accumulation; 0 before the first is needed)."""
        return self.staging.nbytes

    def close(self) -> None:
        self.end_window()
        self.worker.close()
        if self.transfer is not None:
            self.transfer.close()


def _wait_all(waits: Sequence[Ticket | concurrent.futures.Future]) -> None:
    for w in waits:
        if isinstance(w, concurrent.futures.Future):
            w.result()
        else:
            w.wait_host()


def _add_after(buffer: torch.Tensor, staged: torch.Tensor, waits: Sequence[Any]) -> None:
    _wait_all(waits)
    with torch.no_grad():
        buffer.add_(staged)


def _unscale_after(buffer: torch.Tensor, waits: Sequence[Any], found_inf: torch.Tensor, inv: torch.Tensor) -> None:
    _wait_all(waits)
    # NOTE: GradScaler.unscale_'s kernel, on the host sum: the same product as on the device, elementwise.
    torch._amp_foreach_non_finite_check_and_unscale_([buffer], found_inf, inv)


def _norm_after(buffer: torch.Tensor, waits: Sequence[Any]) -> torch.Tensor:
    _wait_all(waits)
    with torch.no_grad():
        return grad_norm_kernel(buffer)
