"""The device's asynchrony behind one small interface: copies between device and host that run beside the compute.

Host offload (`layerwise_hf.placement.offload`) moves gradients to host buffers while backward goes on and brings them
back while the steps go on. Everything it needs from the device is here:

- `Transfer.copy(dst, src)` starts `dst.copy_(src)` after the work queued so far on the calling (compute) stream and
  returns a `Ticket`; `src` and `dst` must not be touched until the ticket says the copy is done. Freeing `src` right
  away is allowed: the transfer keeps it alive until the copy has run. `copy(dst, src, after=tickets)` starts it after
  those tickets' copies (or marks) instead: how the host worker, whose own current stream is not the compute's, copies
  a parameter back.
- `Transfer.mark()` is a `Ticket` for the work queued so far on the calling thread's current stream.
- `Ticket.wait_host()` blocks the calling thread until the copy is done (before the host reads or writes a buffer);
  `Ticket.wait_device()` makes the compute stream wait for it (before the device uses the copied tensor);
  `Ticket.done()` asks without waiting.
- `Transfer.host_empty_like(t)` allocates a host buffer (pinned where the device supports it); `HostArena` carves the
  buffers of a known set of tensors out of one host block per dtype (`Transfer.host_block`), so that what is pinned
  is what they hold: torch's caching host allocator rounds each pinned block up to a power of two and keeps it.

Two implementations:

- `CudaTransfer`: a side stream per direction (a copy back does not queue behind the copies out of the backward going
  on, nor they behind it), CUDA events, `non_blocking` copies from and to pinned memory, and `record_stream` so the
  caching allocator does not hand out a freed source while a side stream still reads it.
- `ThreadTransfer`: the CPU stand-in. A copy thread really runs the copies, in order, each after an injectable delay,
  and signals each with a `threading.Event`. A missing `wait_*` then reads a buffer before its copy has run and fails
  the CPU tests, instead of first showing up as wrong weights on a GPU. It is what a CPU-only machine runs (there the
  device and the host are the same memory) and what `LAYERWISE_HF_OFFLOAD_SIMULATE=1` selects everywhere.

Environment (read by `make_transfer`): `LAYERWISE_HF_OFFLOAD_SIMULATE=1` uses `ThreadTransfer` even on CUDA;
`LAYERWISE_HF_OFFLOAD_DELAY=<seconds>` delays each of its copies (tests use a few milliseconds).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..platform.dtensor import local_tensor
from .host_kernel import claim_thread_share, host_threads

SIMULATE_ENV = "LAYERWISE_HF_OFFLOAD_SIMULATE"
DELAY_ENV = "LAYERWISE_HF_OFFLOAD_DELAY"


class Ticket:
    """One copy started by a `Transfer`: ask whether it is done, or wait for it on the host or on the device."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait_host(self) -> None:
        raise NotImplementedError

    def wait_device(self) -> None:
        raise NotImplementedError


class Transfer:
    """
    Copies between a device and host memory that run beside the device's compute (see the module docstring).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.placement.transfer import ThreadTransfer
    >>> transfer = ThreadTransfer(delay=0.01)
    >>> src = torch.ones(4); dst = transfer.host_empty_like(src)
    >>> ticket = transfer.copy(dst, src)
    >>> ticket.wait_host(); dst
    tensor([1., 1., 1., 1.])
    >>> transfer.close()
    ```
    """

    simulated = False
    device: torch.device | None = None  # the one device whose tensors it copies (None: the host's own, on CPU)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Ticket] | None = None) -> Ticket:
        raise NotImplementedError

    def mark(self) -> Ticket:
        """A ticket done once the calling thread's current stream has run what is queued on it now."""
        raise NotImplementedError

    def host_empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")

    def host_block(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host tensor of `numel` elements for a `HostArena` (pinned, to the byte, where the device has it)."""
        return torch.empty(numel, dtype=dtype, device="cpu")

    def close(self) -> None:
        """Wait for every copy started and release what runs them."""

    def bind_thread(self) -> None:
        """Make the calling thread use this transfer's device for what it does next (a host thread's first call)."""


class HostArena:
    """
    Host buffers for the tensors named when it is made, as views into one `Transfer.host_block` per dtype, handed out
    in the order they are asked for; a buffer that does not fit (a tensor not named) is allocated on its own.

    Args:
        transfer (`Transfer`): allocates the blocks.
        tensors (`Sequence[torch.Tensor]`): the device-side tensors the buffers are for (their sizes and dtypes).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.placement.transfer import HostArena, ThreadTransfer
    >>> arena = HostArena(ThreadTransfer(), [torch.ones(2, 3), torch.ones(4)])
    >>> a = arena.empty_like(torch.ones(2, 3)); b = arena.empty_like(torch.ones(4))
    >>> a.shape, a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(), arena.nbytes
    (torch.Size([2, 3]), True, 40)
    ```
    """

    def __init__(self, transfer: Transfer, tensors: Sequence[torch.Tensor]):
        self.transfer = transfer
        sizes: dict[torch.dtype, int] = {}
        for tensor in tensors:
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
        self.blocks = {dtype: transfer.host_block(numel, dtype) for dtype, numel in sizes.items() if numel}
        self.used = dict.fromkeys(self.blocks, 0)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks."""
        return sum(block.numel() * block.element_size() for block in self.blocks.values())

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        block, start, numel = self.blocks.get(tensor.dtype), self.used.get(tensor.dtype, 0), tensor.numel()
        if block is None or start + numel > block.numel():
            return self.transfer.host_empty_like(tensor)
        self.used[tensor.dtype] = start + numel
        return block[start : start + numel].view(tensor.shape)


def _unregister(cudart: Any, ptr: int, last_use: dict[int, Any]) -> None:
    # NOTE: the block's memory is freed right after: a copy still reading or writing it must end first.
    event = last_use.pop(ptr, None)
    if event is not None:
        event.synchronize()
    cudart.cudaHostUnregister(ptr)


class _CudaTicket(Ticket):
    __slots__ = ("event", "device")

    def __init__(self, event: Any, device: torch.device):
        self.event = event
        self.device = device

    def done(self) -> bool:
        return self.event.query()

    def wait_host(self) -> None:
        self.event.synchronize()

    def wait_device(self) -> None:
        # NOTE: queues the wait on the current stream; the host goes on at once.
        torch.cuda.current_stream(self.device).wait_event(self.event)


class CudaTransfer(Transfer):
    """
    `Transfer` on a CUDA device: a side stream, events, `non_blocking` copies from and to pinned host buffers.

    Args:
        device (`torch.device`): the CUDA device whose compute stream the copies follow.
    """

    def __init__(self, device: torch.device):
        device = torch.device(device)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.to_host = torch.cuda.Stream(device=self.device)
        self.to_device = torch.cuda.Stream(device=self.device)
        self._last_use: dict[int, Any] = {}  # registered host block -> the event of the last copy that used it

    def _own_device(self) -> None:
        if torch.cuda.current_device() != self.device.index:
            # NOTE: the current device is per thread, 0 in a thread that never set it (the host worker), and leaving
            # torch.cuda.stream sets it back: without this every rank's host worker opens a context on GPU 0.
            torch.cuda.set_device(self.device)

    def bind_thread(self) -> None:
        # NOTE: the host worker's first CUDA call may be an event's synchronize or torch.optim's capture check, which
        # use the thread's current device (0 until set) before any copy would set it: set it when the thread starts.
        self._own_device()
        # Every host task (the adds of accumulated micro-batches, norms, unscales, steps) gets the worker's share of
        # the cores: under torchrun / accelerate launch (OMP_NUM_THREADS=1) a new thread starts with one, and backward
        # waits on single-threaded adds once the staging buffers are full.
        claim_thread_share(host_threads())

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Ticket] | None = None) -> Ticket:
        self._own_device()
        stream = self.to_device if dst.is_cuda else self.to_host
        if after is None:
            # NOTE: the side stream must not start before the compute stream has produced `src` (or finished with the
            # memory of a device `dst`): wait_stream orders it after everything queued on compute so far.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            # NOTE: the host worker's current stream is the device's default stream, not the compute's: waiting for
            # it would hold a copy back until whatever backward queued meanwhile has run. It waits for the events of
            # what it depends on (the copy out of the gradient it stepped, or a mark on the compute stream).
            for ticket in after:
                stream.wait_event(ticket.event)
        # NOTE: grad mode is per thread and on in a fresh one: the host worker's copy back into a leaf parameter
        # would raise without no_grad (ThreadTransfer's copy thread has it too).
        with torch.no_grad(), torch.cuda.stream(stream):
            # NOTE: non_blocking is asynchronous only between a device tensor and pinned host memory; the host must
            # not read or write the pinned side until the event has completed.
            dst.copy_(src, non_blocking=True)
            # NOTE: blocking: a host thread waiting on it (the hook, the host worker) sleeps instead of spinning on the
            # cores the host step was given.
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        host = dst if src.is_cuda else src
        ptr = host.untyped_storage().data_ptr()
        if ptr in self._last_use:
            self._last_use[ptr] = event
        for tensor in (src, dst):
            if tensor.is_cuda:
                # NOTE: the caching allocator reuses a freed block as soon as its allocating stream is done with it;
                # record_stream makes it wait for the side stream's use too, so `src` may be freed right away.
                tensor.record_stream(stream)
        return _CudaTicket(event, self.device)

    def mark(self) -> Ticket:
        self._own_device()
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return _CudaTicket(event, self.device)

    def host_empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        # NOTE: registered to the byte like an arena's block, not pin_memory=True (the caching host allocator's
        # power-of-two rounding, kept for the run): buffers outside an arena are the ones nobody planned for.
        return self.host_block(tensor.numel(), tensor.dtype).view(tensor.shape)

    def host_block(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        block = torch.empty(numel, dtype=dtype, device="cpu")
        nbytes = block.numel() * block.element_size()
        if nbytes:
            # NOTE: pin_memory=True goes through torch's caching host allocator, which rounds the block up to a power
            # of two (up to 2x) and keeps it; registering plain memory pins exactly its bytes, unregistered when the
            # block is freed (its views keep it alive), after the last copy that used it (`_unregister`).
            cudart = torch.cuda.cudart()
            torch.cuda.check_error(cudart.cudaHostRegister(block.data_ptr(), nbytes, 0))
            self._last_use[block.data_ptr()] = None
            weakref.finalize(block.untyped_storage(), _unregister, cudart, block.data_ptr(), self._last_use)
        return block

    def close(self) -> None:
        # NOTE: Transfer.close's promise (every copy started has ended), not what frees memory safely: every copy out
        # is waited for on the host before offload closes (the window's end, each host step), and a host block
        # waits for its own last copy before it is unregistered (`_unregister`). Kept for callers of close alone.
        self.to_host.synchronize()
        self.to_device.synchronize()


class _ThreadTicket(Ticket):
    __slots__ = ("event", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.event.is_set()

    def wait_host(self) -> None:
        self.event.wait()
        if self.error is not None:
            raise RuntimeError("an offload copy failed on the copy thread") from self.error

    # On CPU the compute "stream" is the calling thread itself: waiting on the device is waiting on the host.
    wait_device = wait_host


class ThreadTransfer(Transfer):
    """
    The CPU stand-in for `CudaTransfer`: one copy thread runs the copies in the order they were started (as one side
    stream would), each after `delay` seconds, and signals each with an event.

    Args:
        delay (`float`, *optional*, defaults to `0.0`): seconds to sleep before each copy.
    """

    simulated = True

    def __init__(self, delay: float = 0.0):
        if delay < 0:
            raise ValueError(f"delay={delay!r}: it must be >= 0 seconds.")
        self.delay = float(delay)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # copies are started from the host worker too: one copy thread, one order

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Ticket] | None = None) -> Ticket:
        ticket = _ThreadTicket()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="layerwise-offload-copy", daemon=True)
                self._thread.start()
            # The queued item holds `src`: like record_stream, a freed source lives until its copy has run.
            self._queue.put((dst, src, ticket, list(after or ())))
        return ticket

    def mark(self) -> Ticket:
        # On CPU the compute "stream" is the calling thread: what it queued has run.
        ticket = _ThreadTicket()
        ticket.event.set()
        return ticket

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            dst, src, ticket, after = item
            try:
                for earlier in after:
                    earlier.wait_host()
                if self.delay:
                    time.sleep(self.delay)
                with torch.no_grad():
                    dst.copy_(src)
            except BaseException as err:  # surfaced to whoever waits on the ticket
                ticket.error = err
            finally:
                del dst, src, item, after
                ticket.event.set()

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None and thread.is_alive():
                self._queue.put(None)
        if thread is not None:
            thread.join()


def offload_simulated() -> bool:
    """Whether `LAYERWISE_HF_OFFLOAD_SIMULATE` asks for the CPU stand-in (`ThreadTransfer`) on every device."""
    return os.environ.get(SIMULATE_ENV, "").strip().lower() in ("1", "true", "yes", "thread")


def device_of(tensor: torch.Tensor) -> torch.device:
    """
    The device whose `Transfer` copies `tensor`: its CUDA device if it is a CUDA tensor, else its own device. Offload
    asks this of the first device-side tensor it copies (a gradient, or the parameter it is stepped into), not of the
    parameters when the optimizer is built: a plain Accelerate loop builds it before `accelerator.prepare` moves the
    model to the GPU.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.placement.transfer import device_of
    >>> device_of(torch.ones(2))
    device(type='cpu')
    ```
    """
    # NOTE: is_cuda and get_device, not .device: the fake CUDA of the tests (tests/cuda_fake.py) answers them for the
    # CPU tensors that stand in for device memory, so its runs choose CudaTransfer as a GPU does.
    if tensor.is_cuda:
        return torch.device("cuda", tensor.get_device())
    return tensor.device


def several_devices_error(devices: Sequence[Any]) -> ValueError:
    """The error for host offload of a model spread over several GPUs of one process (`device_map="auto"`)."""
    return ValueError(
        f"layerwise_offload with a model spread over several GPUs in one process ({', '.join(map(str, devices))}: "
        "device_map='auto' or Trainer's model parallelism) is not supported: each device's copies would need side "
        "streams and host buffers of their own, and one set would give wrong weights. Put the model on one GPU per "
        "process (DDP or FSDP2 through `accelerate launch`) to offload, or set layerwise_offload='none'."
    )


def check_one_device(params: Sequence[torch.Tensor]) -> None:
    """Refuse offload for parameters on more than one CUDA device (`several_devices_error`)."""
    local = [local_tensor(p) for p in params]
    devices = sorted({device_of(p) for p in local if p.is_cuda}, key=str)
    if len(devices) > 1:
        raise several_devices_error(devices)


def check_device(transfer: Transfer, tensor: torch.Tensor) -> None:
    """Refuse a device-side `tensor` on another device than `transfer`'s: its copy would run on its own device's
    stream, not the side stream whose event says it is done, and the host would read the buffer too early."""
    if transfer.device is not None and tensor.is_cuda and device_of(tensor) != transfer.device:
        raise several_devices_error([transfer.device, device_of(tensor)])


def make_transfer(device: torch.device) -> Transfer:
    """
    The `Transfer` for parameters on `device`: `CudaTransfer` on CUDA, else (or with
    `LAYERWISE_HF_OFFLOAD_SIMULATE=1`) `ThreadTransfer` with the delay of `LAYERWISE_HF_OFFLOAD_DELAY`.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.placement.transfer import make_transfer
    >>> type(make_transfer(torch.device("cpu"))).__name__
    'ThreadTransfer'
    ```
    """
    device = torch.device(device)
    if device.type == "cuda" and not offload_simulated():
        return CudaTransfer(device)
    raw = os.environ.get(DELAY_ENV, "0") or "0"
    try:
        delay = float(raw)
    except ValueError:
        raise ValueError(f"{DELAY_ENV}={raw!r}: it must be a number of seconds (e.g. 0.002).") from None
    return ThreadTransfer(delay)
