"""A fake CUDA for CPU tests, checked by torch's own CUDA sanitizer (CSAN, `torch.cuda._sanitizer`).

`FakeCuda` patches `torch.cuda` (streams, events, devices, syncs), `Tensor.record_stream` / `is_cuda` / `is_pinned` /
`get_device` and pinned allocation with recording stand-ins, and runs a `TorchDispatchMode` that reports every aten op
to CSAN's `EventHandler`, the happens-before model of CUDA streams that `enable_cuda_sanitizer()` feeds from CUDA's
trace callbacks on a GPU. CPU tensors stand in for device memory; tensors allocated with `pin_memory=True` (and what
host threads compute from them) stand in for host memory.

The model, as CUDA has it:
- each thread has a current device (0 until it sets one) and, per device, a current stream (the default stream until
  `torch.cuda.stream(s)` makes another current); entering and leaving `torch.cuda.stream(s)` sets the device, and
  every device a thread sets is recorded (`touched`), as is every device it uses without setting it (`device_uses`:
  an event's synchronize or query and `torch.cuda.synchronize()` on the current device, torch.optim's capture check,
  a stream's synchronize under a guard of its device, a kernel on its tensors' device);
- device memory lives on a device: where it was allocated (`device="cuda:1"`, `.to("cuda:1")`, the current device for
  a plain factory) or placed (`place`); `get_device()` answers it and events live on the device of their first record;
- an op that touches device memory, or that runs while a stream is made current explicitly, is a kernel launch on
  the thread's current stream of its tensors' device (not on a current stream of another device: a copy of a tensor
  on device 1 under `torch.cuda.stream(side_of_device_0)` runs on device 1's), ordered after the thread's host work so
  far (launches follow program order); a copy between two devices runs on the source's, ordered with the
  destination's current stream on both sides;
- an op on host memory only (or any op of a host thread outside `torch.cuda.stream`) is host work, reported on the
  thread's own host "stream", which a host sync (`Event.synchronize`, `Stream.synchronize`, `torch.cuda.synchronize`,
  `.item()`, `.tolist()`, a `query()` answering True) orders after what it waited for; `HostWorker` tasks are ordered
  after their submission and `Future.result()` after the task, as threads are; torch.optim's step counters
  (`torch.tensor(0.0)`) are host memory, as on a GPU;
- `query()` answers "not yet" for the first 0, 1 or 2 queries of work that is still in flight by CSAN's model (a
  schedule seeded by the test's id), so code that polls must cope with both answers;
- a storage that dies is freed at the next op (`check_reuse`): if a device stream other than the allocating one used
  it, record_stream did not name that stream and the allocating stream is not ordered after that use, it is reported
  as a write on the allocating stream (the caching allocator hands a freed block to the next allocation on its stream
  at once);
- pinned allocations are counted (`pinned_bytes`) as the caching host allocator would allocate them (rounded up to a
  power of two), memory pinned by `cudaHostRegister` (`torch.cuda.cudart()`) to the byte; `cudaHostUnregister` of
  memory never registered, or while a copy may still use it (the host is not ordered after it), is an error (kept in
  `errors`, raised at the end of the `with` block: it runs in finalizers); a `non_blocking` copy between device memory
  and pageable host memory raises (CUDA would run it synchronously, through a staging buffer);
- collectives as NCCL runs them: DDP's all-reduce on a stream of its own that waits for the caller's stream, its
  `wait()` ordering the caller's stream after that collective's end (`all_reduce_on_its_own_stream`); FSDP2's
  reduce-scatter is modelled the same way where its tests need it (`tests/test_streams_csan.py`). Without them gloo's
  collectives run on the current stream.

What it cannot model (checks that need a GPU, or another harness):
- time: device work has no duration, so a wait that only bounds memory or overlap (how many copies are in flight, a
  copy back overlapping a step) is invisible here; `ThreadTransfer` with `LAYERWISE_HF_OFFLOAD_DELAY` slows copies for
  those. "In flight" exists only as CSAN's order and the `query()` schedule;
- synchronisation CSAN does not see: locks, `threading.Event`, queues, `ThreadTransfer`'s copy thread (threads other
  than the main one and `HostWorker` tasks run outside the dispatch mode and are not checked; CSAN's mode is per
  thread on a GPU too); autograd's per-device threads (backward runs on the calling thread here, so two devices'
  hooks never run at once);
- the caching allocators: no block splitting, rounding or OOM for device memory; pinned blocks from
  `pin_memory=True` are not reuse-checked (torch's host allocator records their copies' events itself); reuse is
  checked when the storage dies, not when a later allocation really takes the block; memory freed or unregistered
  after the `with` block has ended is not checked (drop the optimizer inside it to check its host blocks);
- `tensor.device` stays `cpu`: code that branches on `.device.type` takes its CPU path (only `is_cuda`,
  `get_device()`, `is_pinned()` and factory/`.to` device arguments are faked); a kernel mixing tensors of two devices
  is not refused as CUDA would;
- other implicit syncs (`nonzero`, boolean indexing, printing) are kernels without a host wait here (stricter than
  CUDA), and graph capture is never under way; event timing and IPC are not modelled, and an event's
  `blocking` flag is only kept (a wait neither spins nor sleeps).

A missing wait raises CSAN's own `CUDASanitizerErrors` holding its `UnsynchronizedAccessError`s.

Example:

```python
>>> with FakeCuda():
...     side = torch.cuda.Stream(); x = torch.ones(4) * 2; host = torch.empty(4, pin_memory=True)
...     with torch.cuda.stream(side):
...         host.copy_(x, non_blocking=True)  # x was written on the default stream; side did not wait for it
Traceback (most recent call last):
torch.cuda._sanitizer.CUDASanitizerErrors: detected 1 errors
```
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import random
import threading
from typing import Any

import torch
import torch.cuda._sanitizer as csan
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from layerwise_hf.placement import offload as offload_module

aten = torch.ops.aten

# What CSAN must offer for this harness; `test_cuda_fake.py` checks it, so a torch that changes it fails there first.
REQUIRED_CSAN = {
    "EventHandler": ("_handle_kernel_launch", "_handle_event_record", "_handle_event_wait", "_handle_stream_creation"),
    "ArgumentHandler": ("parse_inputs", "parse_outputs", "_handle_argument"),
    "StreamSynchronizations": ("create_stream", "stream_wait_for_event", "_state_wait_for_other"),
    "UnsynchronizedAccessError": (),
    "CUDASanitizerErrors": (),
    "FACTORY_FUNCTION_REGEX": (),
}

_ids = itertools.count(1)


class CpuArgumentHandler(csan.ArgumentHandler):
    """CSAN's argument handler, taking the CPU tensors that stand in for device and host memory (it keeps CUDA
    tensors only)."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def _handle_argument(self, value, is_write, metadata_only, name=None, is_output=False):
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return
        self.seen.append(value)
        data_ptr = value.data_ptr() if value.data_ptr() else id(value)
        if is_write:
            self.dataptrs_written.add(data_ptr)
        elif not metadata_only:
            self.dataptrs_read.add(data_ptr)
        self.tensor_aliases.setdefault(data_ptr, [])
        if name is not None:
            self.tensor_aliases[data_ptr].append(name)
        if is_output:
            self.outputs.add(data_ptr)


class FakeStream:
    """A CUDA stream on a fake device: an id in CSAN's model."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        # NOTE: kept, not looked up: a finalizer may use a stream or event after the `with` block has ended.
        self.fake = fake = FakeCuda.active
        self.device = fake.as_device(device)
        self.id = fake.new_stream()
        self.cuda_stream = self.id

    def wait_stream(self, other: FakeStream) -> None:
        event = FakeEvent()
        event.record(other)
        self.wait_event(event)

    def wait_event(self, event: FakeEvent) -> None:
        fake = self.fake
        if event.recorded:
            with fake.lock:
                fake.handler._handle_event_wait(event.id, self.id)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        fake = self.fake
        fake.use_device(self.device.index, "stream.synchronize")  # CUDAStream::synchronize guards the stream's device
        fake.host_waits_for_stream(self.id)

    def query(self) -> bool:
        fake = self.fake
        fake.use_device(self.device.index, "stream.query")
        with fake.lock:
            position = fake.handler.syncs.current_sync_states[self.id].get(self.id, 0)
        if fake.still_running(("stream", self.id, position)):
            return False
        self.synchronize()  # True means done: the host may rely on it
        return True

    def is_capturing(self) -> bool:
        self.fake.use_device(self.device.index, "stream.is_capturing")
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"FakeStream(id={self.id}, device={self.device})"


class FakeEvent:
    """A CUDA event: records a stream's position in CSAN's model."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.fake = fake = FakeCuda.active
        self.id = next(_ids)
        self.blocking = blocking  # a host thread waiting on it sleeps (True) or spins on a core (False)
        self.recorded = False
        self.records = 0
        self.device: torch.device | None = None  # CUDA creates an event on the device of the stream it first records
        self.key = fake.creation_key()
        with fake.lock:
            fake.handler._handle_event_creation(self.id)

    def record(self, stream: FakeStream | None = None) -> None:
        fake = self.fake
        stream = stream or fake.current_stream()
        if self.device is None:
            self.device = stream.device
        elif self.device != stream.device:
            raise RuntimeError(
                f"Event device {self.device.index} does not match recording stream's device {stream.device.index}"
            )
        fake.use_device(stream.device.index, "event.record")  # under a guard of the event's device
        with fake.lock:
            fake.order_after_host(stream.id)
            fake.handler._handle_event_record(self.id, stream.id)
        self.recorded = True
        self.records += 1

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.fake.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        fake = self.fake
        if self.recorded:
            # NOTE: cudaEventSynchronize / cudaEventQuery run under no device guard: the calling thread's current
            # device, whose context the runtime creates if the thread has none (a thread that never set one: device 0).
            fake.use_device(fake.current_device(), "event.synchronize")
            with fake.lock:
                fake.handler.syncs.stream_wait_for_event(fake.host_stream(), self.id)

    def query(self) -> bool:
        fake = self.fake
        if self.recorded:
            fake.use_device(fake.current_device(), "event.query")
            if not fake.host_after_event(self.id) and fake.still_running(("event", *self.key, self.records)):
                return False
        self.synchronize()  # True means done: the host may rely on it
        return True


class _Mode(TorchDispatchMode):
    def __init__(self, fake: FakeCuda) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.fake.dispatch(func, args, kwargs or {})


class FakeCuda:
    """Patches torch's CUDA API with the stand-ins above and reports to CSAN (see the module docstring).

    Args:
        device_count (`int`, *optional*, defaults to `2`): fake devices.

    Attributes:
        handler: CSAN's `EventHandler`.
        touched (`dict[str, set[int]]`): thread name -> devices it set (as `cudaSetDevice` would).
        device_uses (`list[tuple[str, int, str]]`): (thread name, device, what) for every device a thread used: set
            (`set_device`, `torch.cuda.stream`) or used implicitly, on its current device (an event's synchronize or
            query, `torch.cuda.synchronize()`, a capture check, torch.optim's included) or under a device guard (a
            stream's synchronize). Each opens a context on that device on a GPU; `devices_used()` sums them up.
        pinned_bytes (`int`): pinned host bytes alive, as the host holds them: a `pin_memory=True` allocation rounded
            up to a power of two (torch's caching host allocator), memory pinned by `cudaHostRegister` to the byte.
        pinned_blocks (`list[int]`): each pinned allocation's requested bytes.
        launches (`list[tuple[str, int]]`): (op, stream id) of every kernel launch (`ordered_after` compares two).
    """

    active: FakeCuda | None = None

    def __init__(self, device_count: int = 2, check_reuse: bool = True, seed: Any = None) -> None:
        self.device_count = device_count
        # Checked when a storage dies (at the next op), not when malloc happens to reuse its block: deterministic.
        self.check_reuse = check_reuse
        # The schedule of `query()` answers: by default the running test's id, so each test sees the same answers.
        self.seed = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0] if seed is None else seed
        self.queries: dict[tuple, int] = {}
        self.created: dict[str, int] = {}  # thread name -> events it created (an event's key in the schedule)
        self.devices: dict[int, int] = {}  # storage data_ptr -> the fake device it lives on (device memory only)
        self.kernel_devices: set[tuple[str, int]] = set()
        self.registered: dict[int, int] = {}  # cudaHostRegister'ed pointer -> bytes
        self.errors: list[Exception] = []  # found where nothing can raise (a finalizer): raised at exit
        self.handler = csan.EventHandler()
        self.lock = threading.RLock()
        self.local = threading.local()
        self.defaults: dict[int, FakeStream] = {}
        self.host_streams: dict[int, int] = {}
        self.touched: dict[str, set[int]] = {}
        self.device_uses: list[tuple[str, int, str]] = []
        self.pinned: dict[int, int] = {}  # storage data_ptr -> bytes
        self.pinned_blocks: list[int] = []
        self.host_ptrs: set[int] = set()  # storages standing in for host memory
        self.storages: dict[int, tuple[StorageWeakRef, int, int, set[int]]] = {}  # ptr -> (ref, nbytes, stream, rs)
        self.launches: list[tuple[str, int]] = []
        self.launch_states: list[tuple[int, dict[int, int]]] = []  # each launch's sequence number and what it follows
        self.main = threading.get_ident()
        self._patches = contextlib.ExitStack()

    # ---- the model's state ----

    def as_device(self, device: Any) -> torch.device:
        if device is None:
            return torch.device("cuda", self.current_device())
        if isinstance(device, int):
            return torch.device("cuda", device)
        device = torch.device(device)
        return torch.device("cuda", self.current_device() if device.index is None else device.index)

    def new_stream(self) -> int:
        sid = next(_ids)
        with self.lock:
            self.handler._handle_stream_creation(sid)
        return sid

    def default_stream(self, device: Any = None) -> FakeStream:
        index = self.as_device(device).index
        if index not in self.defaults:
            self.defaults[index] = FakeStream(index)
        return self.defaults[index]

    def _streams(self) -> dict[int, FakeStream]:
        if not hasattr(self.local, "streams"):
            self.local.streams = {}
        return self.local.streams

    def current_stream(self, device: Any = None) -> FakeStream:
        index = self.as_device(device).index
        return self._streams().get(index) or self.default_stream(index)

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def set_device(self, device: Any) -> None:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= self.device_count:
            raise RuntimeError(f"fake CUDA: device {index} of {self.device_count}")
        self.local.device = index
        self.touched.setdefault(threading.current_thread().name, set()).add(index)
        self.use_device(index, "set_device")

    def use_device(self, index: int, what: str) -> None:
        """Record that the calling thread used device `index` (`device_uses`)."""
        self.device_uses.append((threading.current_thread().name, index, what))  # NOTE: list.append is atomic

    def devices_used(self) -> dict[str, set[int]]:
        """Thread name -> every device it used (`device_uses`): where each thread has a CUDA context on a GPU."""
        used: dict[str, set[int]] = {}
        for name, index, _ in list(self.device_uses):
            used.setdefault(name, set()).add(index)
        return used

    def is_current_stream_capturing(self) -> bool:
        # NOTE: torch.cuda.is_current_stream_capturing asks the current device's current stream (no context is made
        # where none exists; the caller had one or is about to make one with its next call).
        return self.current_stream().is_capturing()

    def capture_health_check(self, optimizer: torch.optim.Optimizer) -> None:
        # torch.optim's Optimizer._accelerator_graph_capture_health_check, as it runs where CUDA is available: every
        # Adam/AdamW/... step asks whether the current device's current stream is capturing (cudaStreamIsCapturing,
        # under a guard of that device): a host thread stepping a host optimizer uses its current device.
        if torch.compiler.is_compiling():
            return
        if self.current_stream().is_capturing() and not all(g.get("capturable") for g in optimizer.param_groups):
            raise RuntimeError("fake CUDA: graph capture of step() without capturable")

    def host_stream(self) -> int:
        tid = threading.get_ident()
        if tid not in self.host_streams:
            self.host_streams[tid] = next(_ids)
            self.handler._handle_stream_creation(self.host_streams[tid])
        return self.host_streams[tid]

    def order_after_host(self, stream: int) -> None:
        # A launch (or event record) follows the launching thread's host work in program order.
        syncs = self.handler.syncs
        host = self.host_stream()
        syncs._state_wait_for_other(syncs.current_sync_states[stream], syncs.current_sync_states[host])

    def host_waits_for_stream(self, stream: int) -> None:
        with self.lock:
            syncs = self.handler.syncs
            syncs._state_wait_for_other(
                syncs.current_sync_states[self.host_stream()], syncs.current_sync_states[stream]
            )

    def host_state(self) -> dict[int, int]:
        with self.lock:
            return dict(self.handler.syncs.current_sync_states[self.host_stream()])

    def host_waits_for_state(self, state: dict[int, int]) -> None:
        with self.lock:
            self.handler.syncs._state_wait_for_other(self.handler.syncs.current_sync_states[self.host_stream()], state)

    def synchronize(self, device: Any = None) -> None:
        self.use_device(self.as_device(device).index, "torch.cuda.synchronize")
        with self.lock:
            for sid in list(self.handler.syncs.current_sync_states):
                self.host_waits_for_stream(sid)

    # ---- ops ----

    def _explicit_stream(self) -> bool:
        return bool(getattr(self.local, "explicit", 0))

    def dispatch(self, func, args, kwargs):
        if func is aten.record_stream.default:
            return None
        pin = kwargs.get("pin_memory") is True
        if pin:
            kwargs = {**kwargs, "pin_memory": False}
        # `device="cuda:1"` (a factory) or `.to("cuda:1")`: CPU memory standing in for that device's.
        target = kwargs.get("device")
        asked = None
        if target is not None and torch.device(target).type == "cuda":
            asked = self.as_device(target).index
            kwargs = {**kwargs, "device": torch.device("cpu")}
        is_factory = bool(csan.FACTORY_FUNCTION_REGEX.match(func._schema.name))
        seen: list[torch.Tensor] = []
        handler = CpuArgumentHandler(seen)
        handler.parse_inputs(func._schema, args, kwargs, is_factory=is_factory)
        inputs = list(seen)
        input_ids = {id(t) for t in inputs}
        with self.lock:
            self._sweep()
            if func is aten.copy_.default:
                self._check_pinned(args, kwargs)
        outputs = func(*args, **kwargs)
        handler.parse_outputs(func._schema, outputs, is_factory=is_factory)
        with self.lock:
            host_thread = threading.get_ident() != self.main
            explicit = self._explicit_stream()
            if asked is not None:
                host = False
            elif pin or getattr(self.local, "force_host", False):
                host = True
            elif func is aten.lift_fresh.default and getattr(self.local, "host_scalars", False):
                host = True  # torch.optim's `torch.tensor(0.0)` step counter: a CPU tensor on a GPU too
            elif explicit:
                host = False
            elif host_thread:
                host = True
            elif inputs:
                host = all(self._storage_ptr(t) in self.host_ptrs for t in inputs)
            else:
                host = False
            device = peer = None
            if not host:
                # NOTE: a kernel runs on its tensors' device (a copy between host and device: the device side's), on
                # the calling thread's current stream of that device, whatever stream of another device is current.
                device = asked if asked is not None else self._op_device(inputs)
                peer = self._copy_peer(func, args, device)
                if peer is not None:
                    device, peer = peer, device  # a copy between devices runs on the source's
                name = threading.current_thread().name
                if (name, device) not in self.kernel_devices:
                    self.kernel_devices.add((name, device))
                    self.use_device(device, "kernel")
            stream = self.host_stream() if host else self.current_stream(device).id
            if peer is not None:
                # NOTE: torch's copy between two devices runs on the source device's current stream after the
                # destination's current stream, which then waits for it (copy_device_to_device).
                syncs = self.handler.syncs
                other = self.current_stream(peer).id
                syncs._state_wait_for_other(syncs.current_sync_states[stream], syncs.current_sync_states[other])
            if host and host_thread:
                # NOTE: a host thread cannot read device memory: on a GPU a device tensor it uses (a clip coefficient)
                # was copied to the host synchronously, which waits for the stream that wrote it.
                for tensor in inputs:
                    if self._storage_ptr(tensor) not in self.host_ptrs:
                        info = self.handler.tensors_accessed.accesses.get(tensor.data_ptr())
                        if info is not None and info.write is not None:
                            self.host_waits_for_stream(info.write.stream)
            for tensor in seen:
                new_host = host and (id(tensor) not in input_ids or func is aten.lift_fresh.default)
                self._track_storage(tensor, stream, new_host=new_host, pinned=pin, device=device)
                if asked is not None and id(tensor) not in input_ids:
                    self.devices[self._storage_ptr(tensor)] = asked
            if not host:
                if is_factory:
                    # NOTE: CSAN reads `empty` as a write of its output but `empty_like` / `new_*` as metadata only. An
                    # allocation belongs to its stream's order either way (the caching allocator hands a block freed
                    # on that stream to it at once): another stream must wait for it before writing there.
                    handler.dataptrs_written |= handler.outputs
                self.order_after_host(stream)
                self.launches.append((str(func), stream))
                state = dict(self.handler.syncs.current_sync_states[stream])
                self.launch_states.append((self.handler.seq_num + 1, state))
            errors = self.handler._handle_kernel_launch(
                stream,
                handler.dataptrs_read - handler.dataptrs_written,
                handler.dataptrs_written,
                handler.outputs,
                func._schema,
                handler.tensor_aliases,
            )
        if peer is not None:
            with self.lock:
                syncs = self.handler.syncs
                other = self.current_stream(peer).id
                syncs._state_wait_for_other(syncs.current_sync_states[other], syncs.current_sync_states[stream])
        if errors:
            raise _report(errors)
        if func is aten._local_scalar_dense.default and not host:
            self.host_waits_for_stream(stream)  # .item() waits for the stream that computed it
        return outputs

    def _op_device(self, inputs: list[torch.Tensor]) -> int:
        for tensor in inputs:
            ptr = self._storage_ptr(tensor)
            if ptr not in self.host_ptrs:
                return self.devices.get(ptr, self.current_device())
        return self.current_device()

    def _copy_peer(self, func: Any, args: tuple, device: int) -> int | None:
        # The source's device of a copy between two devices (`device` is the destination's), else None.
        if func is aten._to_copy.default:
            src = args[0]
        elif func is aten.copy_.default:
            src = args[1]
        else:
            return None
        ptr = self._storage_ptr(src)
        if ptr in self.host_ptrs:
            return None
        source = self.devices.get(ptr, self.current_device())
        return source if source != device else None

    def _check_pinned(self, args: tuple, kwargs: dict) -> None:
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if not non_blocking:
            return
        dst, src = args[0], args[1]
        kinds = [self._storage_ptr(t) in self.host_ptrs for t in (dst, src)]
        if kinds[0] == kinds[1]:
            return
        host = dst if kinds[0] else src
        if self._storage_ptr(host) not in self.pinned:
            # NOTE: CUDA stages a copy from or to pageable memory through a pinned buffer and returns only once the
            # host side has been read or written: non_blocking then overlaps nothing.
            raise RuntimeError(
                "fake CUDA: a non_blocking copy between device memory and pageable (unpinned) host memory "
                f"({tuple(host.shape)} {host.dtype}); pin the host side"
            )

    @staticmethod
    def _storage_ptr(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    def _track_storage(
        self, tensor: torch.Tensor, stream: int, new_host: bool, pinned: bool, device: int | None = None
    ) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr:
            return
        known = self.storages.get(ptr)
        if known is not None and known[0].expired():
            self._forget(ptr, known, stream)
            known = None
        if known is None:
            self.storages[ptr] = (StorageWeakRef(storage), storage.nbytes(), stream, set())
            self.host_ptrs.discard(ptr)
            self.pinned.pop(ptr, None)
            if new_host:
                self.host_ptrs.add(ptr)
            else:
                self.devices[ptr] = self.current_device() if device is None else device
            if pinned:
                # NOTE: the caching host allocator rounds each pinned block up to a power of two (and keeps it).
                self.pinned[ptr] = _power_of_two(storage.nbytes())
                self.pinned_blocks.append(storage.nbytes())

    def _sweep(self) -> None:
        # Storages that died since the last op: freed now, before this op can allocate their memory again.
        dead = [(ptr, known) for ptr, known in self.storages.items() if known[0].expired()]
        for ptr, known in dead:
            self._forget(ptr, known, known[2])

    def _forget(self, ptr: int, known: tuple, stream: int) -> None:
        self.storages.pop(ptr, None)
        try:
            self._free(ptr, known)
        finally:
            self.host_ptrs.discard(ptr)
            self.pinned.pop(ptr, None)
            self.devices.pop(ptr, None)

    def _free(self, ptr: int, known: tuple) -> None:
        _, nbytes, alloc_stream, recorded = known
        accesses = self.handler.tensors_accessed.accesses
        keys = [k for k in accesses if ptr <= k < ptr + max(nbytes, 1)]
        # NOTE: host memory needs no record_stream: the caching host allocator records an event on the stream of each
        # copy that uses a pinned block and reuses it after that event, and host threads free it after their use.
        if self.check_reuse and ptr not in self.host_ptrs and ptr not in self.pinned:
            # The freed block goes to the next allocation on its stream at once: a use by another device stream that
            # the allocating stream is not ordered after, and that record_stream did not name, races with that reuse.
            # (A host thread's use of device memory was a synchronous copy: done when it returned.)
            syncs = self.handler.syncs
            hosts = set(self.host_streams.values())
            unordered = [
                access
                for k in keys
                for access in [*accesses[k].reads, accesses[k].write]
                if access is not None
                and access.stream not in recorded | hosts | {alloc_stream}
                and not syncs.is_ordered_after(alloc_stream, access.seq_num, access.stream)
            ]
            if unordered:
                errors = self.handler._handle_kernel_launch(
                    alloc_stream, set(), set(keys), set(), "free and reuse (no record_stream)", {k: [] for k in keys}
                )
                if errors:
                    raise _report(errors)
        for k in keys:
            self.handler._handle_memory_deallocation(k)

    def host_register(self, ptr: int, nbytes: int, flags: int = 0) -> int:
        """`cudaHostRegister`: plain host memory pinned as is, to the byte."""
        with self.lock:
            # NOTE: `torch.empty(device="cpu")` was host work, which the fake could only take for a device allocation
            # on the current stream before the memory was registered: forget that access.
            for k in [k for k in self.handler.tensors_accessed.accesses if ptr <= k < ptr + max(nbytes, 1)]:
                self.handler._handle_memory_deallocation(k)
            self.host_ptrs.add(ptr)
            self.pinned[ptr] = nbytes
            self.registered[ptr] = nbytes
            self.pinned_blocks.append(nbytes)
        return 0

    def host_unregister(self, ptr: int) -> int:
        """`cudaHostUnregister`: an error unless `ptr` was registered; the host must be done waiting for every copy
        that reads or writes the memory (it is then pageable again, and freed right after by its owner)."""
        with self.lock:
            nbytes = self.registered.pop(ptr, None)
            if nbytes is None:
                self.errors.append(RuntimeError(f"fake CUDA: cudaHostUnregister of {ptr:#x}, which is not registered"))
                return 1  # cudaErrorInvalidValue
            self.pinned.pop(ptr, None)
            accesses = self.handler.tensors_accessed.accesses
            keys = {k for k in accesses if ptr <= k < ptr + max(nbytes, 1)}
            errors = self.handler._handle_kernel_launch(
                self.host_stream(), set(), keys, set(), "cudaHostUnregister (then free)", {k: [] for k in keys}
            )
            for k in keys:
                self.handler._handle_memory_deallocation(k)
        if errors:
            # Called from a finalizer, where raising is lost: kept for the end of the `with` block.
            self.errors.append(_report(errors))
        return 0

    def tolist(self, tensor: torch.Tensor, original: Any) -> Any:
        # NOTE: on CPU `.tolist()` dispatches nothing; on a GPU it copies the tensor to the host on the current stream
        # of its device and waits for that stream.
        if tensor.is_cuda:
            with torch.no_grad():
                tensor.detach().clone()  # the device read, on the current stream of the tensor's device
            self.host_waits_for_stream(self.current_stream(self.device_index(tensor)).id)
        return original(tensor)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        known = self.storages.get(self._storage_ptr(tensor))
        if known is not None:
            known[3].add(stream.id)

    def ordered_after(self, later: int, earlier: int) -> bool:
        """Whether launch `later` (an index into `launches`) is ordered after launch `earlier` in CSAN's model."""
        seq, _ = self.launch_states[earlier]
        return self.launch_states[later][1].get(self.launches[earlier][1], -1) >= seq

    def place(self, tensor: torch.Tensor, device: int) -> torch.Tensor:
        """Say that `tensor` (a CPU tensor standing in for device memory) lives on fake device `device`; returns it."""
        with self.lock:
            ptr = self._storage_ptr(tensor)
            if ptr not in self.storages:
                self._track_storage(
                    tensor, self.current_stream(device).id, new_host=False, pinned=False, device=device
                )
            self.host_ptrs.discard(ptr)
            self.devices[ptr] = device
        return tensor

    def device_index(self, tensor: torch.Tensor) -> int:
        """The fake device of a device tensor: where it was allocated or placed (the current device if unknown)."""
        return self.devices.get(self._storage_ptr(tensor), self.current_device())

    def creation_key(self) -> tuple[str, int]:
        name = threading.current_thread().name
        with self.lock:
            self.created[name] = self.created.get(name, 0) + 1
            return name, self.created[name]

    def still_running(self, key: tuple) -> bool:
        """The seeded schedule of `query()`: "not yet" for the first 0, 1 or 2 queries of each recorded position."""
        with self.lock:
            asked = self.queries.get(key, 0)
            self.queries[key] = asked + 1
        return asked < random.Random(f"{self.seed}/{key}").randrange(3)

    def host_after_event(self, event: int) -> bool:
        with self.lock:
            recorded = self.handler.syncs.recorded_sync_states.get(event, {})
            host = self.handler.syncs.current_sync_states[self.host_stream()]
            return all(host.get(stream, -1) >= seq for stream, seq in recorded.items())

    @property
    def pinned_bytes(self) -> int:
        alive = 0
        for ptr, nbytes in self.pinned.items():
            known = self.storages.get(ptr)
            if known is not None and not known[0].expired():
                alive += nbytes
        return alive

    # ---- patching ----

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None):
        if stream is None:
            yield
            return
        streams = self._streams()
        saved_device = self.current_device()
        saved = streams.get(stream.device.index)
        self.set_device(stream.device.index)
        streams[stream.device.index] = stream
        self.local.explicit = getattr(self.local, "explicit", 0) + 1
        try:
            yield
        finally:
            self.local.explicit -= 1
            if saved is None:
                streams.pop(stream.device.index, None)
            else:
                streams[stream.device.index] = saved
            # NOTE: torch's StreamContext sets the device back on exit: a thread that never set one gets device 0.
            self.set_device(saved_device)

    @contextlib.contextmanager
    def device(self, device: Any):
        saved = self.current_device()
        self.set_device(self.as_device(device).index)
        try:
            yield
        finally:
            self.set_device(saved)

    def _host_scalars(self, init_group):
        fake = self

        def wrapped(*args, **kwargs):
            fake.local.host_scalars = True
            try:
                return init_group(*args, **kwargs)
            finally:
                fake.local.host_scalars = False

        return wrapped

    def _submit(self, original):
        fake = self

        def submit(worker, fn, *args):
            state = fake.host_state()

            def task():
                with _Mode(fake):
                    fake.host_waits_for_state(state)
                    result = fn(*args)
                    future_state[0] = fake.host_state()
                    return result

            future_state: list = [None]
            future = original(worker, task)
            future._fake_cuda_state = future_state
            return future

        return submit

    def __enter__(self) -> FakeCuda:
        if FakeCuda.active is not None:
            raise RuntimeError("FakeCuda is already active")
        FakeCuda.active = self
        fake = self
        patch = self._patches.enter_context
        from unittest import mock

        cuda = torch.cuda
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: fake.device_count,
            "current_device": fake.current_device,
            "set_device": fake.set_device,
            "device": fake.device,
            "Stream": FakeStream,
            "Event": FakeEvent,
            "current_stream": fake.current_stream,
            "default_stream": fake.default_stream,
            "stream": fake.stream,
            "synchronize": fake.synchronize,
            "cudart": lambda: _FakeCudart(fake),
            "check_error": lambda res: None,
            "is_current_stream_capturing": fake.is_current_stream_capturing,
            "get_device_capability": lambda device=None: (9, 0),  # an H100 / H200 (c10d's broadcast asks)
        }.items():
            patch(mock.patch.object(cuda, name, value))
        patch(mock.patch.object(torch.cuda.graphs, "is_current_stream_capturing", fake.is_current_stream_capturing))
        patch(
            mock.patch.object(
                torch.optim.Optimizer,
                "_accelerator_graph_capture_health_check",
                lambda optimizer: fake.capture_health_check(optimizer),
            )
        )
        # NOTE: a CUDA build of torch on a machine without a GPU (CI's newest combination) would take the fake CUDA
        # for the accelerator and ask the real driver for its current stream (Optimizer.step's graph-capture check);
        # the CPU build answers no accelerator, as here.
        patch(mock.patch.object(torch.accelerator, "current_accelerator", lambda check_available=False: None))
        patch(mock.patch.object(torch.Tensor, "record_stream", lambda t, s: fake.record_stream(t, s), create=True))
        patch(
            mock.patch.object(
                torch.Tensor, "is_cuda", property(lambda t: fake._storage_ptr(t) not in fake.host_ptrs), create=True
            )
        )
        patch(mock.patch.object(torch.Tensor, "is_pinned", lambda t, device=None: fake._storage_ptr(t) in fake.pinned))
        # NOTE: CPU tensors carry no device index: the fake keeps one per storage (`place`, `device_index`).
        get_device = torch.Tensor.get_device
        patch(
            mock.patch.object(
                torch.Tensor, "get_device", lambda t: fake.device_index(t) if t.is_cuda else get_device(t)
            )
        )
        tolist = torch.Tensor.tolist
        patch(mock.patch.object(torch.Tensor, "tolist", lambda t: fake.tolist(t, tolist)))
        # `.to("cuda:1")` and `device="cuda:1"` reach the dispatch (which keeps them on the CPU) once CUDA "is there".
        patch(mock.patch.object(cuda, "_lazy_init", lambda: None))
        patch(mock.patch.object(offload_module.HostWorker, "submit", self._submit(offload_module.HostWorker.submit)))
        # NOTE: torch.optim keeps a step counter made by `torch.tensor(0.0)` on the CPU (unless capturable or fused),
        # so reading it (`_get_value`, an `.item()`) syncs nothing on a GPU: here it would wait for the compute stream.
        for cls in vars(torch.optim).values():
            if isinstance(cls, type) and "_init_group" in vars(cls):
                patch(mock.patch.object(cls, "_init_group", self._host_scalars(vars(cls)["_init_group"])))
        result = concurrent.futures.Future.result

        def result_after(future, timeout=None):
            value = result(future, timeout)
            state = getattr(future, "_fake_cuda_state", None)
            if state is not None and state[0] is not None:
                fake.host_waits_for_state(state[0])
            return value

        patch(mock.patch.object(concurrent.futures.Future, "result", result_after))
        self.set_device(0)
        self.touched.clear()
        self.device_uses.clear()
        patch(_Mode(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._patches.close()
        finally:
            FakeCuda.active = None
        if self.errors and exc[0] is None:
            raise self.errors[0]


def _power_of_two(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


class _FakeCudart:
    def __init__(self, fake: FakeCuda) -> None:
        self.cudaHostRegister = fake.host_register
        self.cudaHostUnregister = fake.host_unregister


def _report(errors: list) -> csan.CUDASanitizerErrors:
    # CSAN prints each error (with both stacks) to stderr and raises the count; the text goes into the exception too.
    report = csan.CUDASanitizerErrors(errors)
    report.add_note("\n".join(str(error) for error in errors))
    return report


def csan_report(excinfo: Any) -> str:
    """The text of CSAN's report held by a `CUDASanitizerErrors` (for asserting on it)."""
    return str(excinfo.value)


class _CommWork:
    # An all-reduce's work handle as NCCL's: waiting on it orders the caller's stream after this collective.
    def __init__(self, work, end):
        self.work = work
        self.end = end

    def wait(self):
        self.work.wait()
        # NOTE: NCCL's Work.wait() makes the caller's current stream wait for the event recorded at the end of this
        # collective on its stream, not for what was queued there after it (the next collective).
        torch.cuda.current_stream().wait_event(self.end)
        return True


@contextlib.contextmanager
def all_reduce_on_its_own_stream():
    """DDP's all-reduce as NCCL runs it, under the fake CUDA: on a stream of its own that first waits for the caller's
    current stream; the bucket is written there, and `wait()` orders the caller's stream after it."""
    original = dist.all_reduce
    comm = torch.cuda.Stream()

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm):
            work = original(tensor, op=op, group=group, async_op=True)
            end = torch.cuda.Event()
            end.record(comm)
        # NOTE: ProcessGroupNCCL keeps its tensors for the caching allocator until the collective is done.
        tensor.record_stream(comm)
        work = _CommWork(work, end)
        if async_op:
            return work
        work.wait()
        return None

    dist.all_reduce = all_reduce
    try:
        yield comm
    finally:
        dist.all_reduce = original
