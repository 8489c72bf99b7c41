"""`LiveBytes`: the bytes of every live tensor storage over a training step, by category, and where their peak falls.

Why not `torch.distributed._tools.mem_tracker.MemTracker`: it sorts memory by module and learns optimizer state from
a global optimizer-step hook, and it refuses a second iteration unless `reset_mod_stats()` is called. A layer-wise
step runs hundreds of inner optimizers inside backward, and the plan needs the steady-state step (the second one,
when optimizer state already exists), the moment of the peak, and the split at that moment, not per module. Tracking
storages directly does that in a few lines: a `TorchDispatchMode` sees every op's outputs; a storage it has not seen
is counted from then on, and a `weakref.finalize` on it (storages keep one Python object while they live) uncounts
it when autograd, an optimizer or Python frees it. The same tracker runs on fake tensors (the plan) and on real ones.

Categories: a storage allocated while grad mode is on (the forward, the loss, checkpointing's recompute) is an
activation; one allocated with grad mode off (backward kernels, the optimizer step) a temporary. A storage becomes a
gradient when a post-accumulate-grad hook finds it in `.grad`, optimizer state when an optimizer's step post-hook
finds it in `optimizer.state`, and weights are the parameters and buffers registered at the start.

Host offload: on fake tensors (and on a CPU) the device and the host are one memory, so each storage also carries a
side. A storage allocated inside `on_host()` (host buffers, host parameter copies, what a host optimizer step
allocates: its states and temporaries) is host-side; `current`, `totals` and `peak` are the device side's, and
`host_current`, `host_totals` and `host_peak` the host side's.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..platform.dtensor import local_storage_tensor as _local

WEIGHTS = "weights"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer_state"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"
CATEGORIES = (WEIGHTS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, TEMPORARIES)


@dataclass
class Peak:
    """The largest sum of live storage bytes since `LiveBytes.reset_peak()`, its split and when it fell."""

    total: int = 0
    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    phase: str = ""


_INDEX = re.compile(r"\.\d+(?=\.|$|\s)")


@functools.lru_cache(maxsize=4096)
def phase_key(phase: str) -> str:
    """A place in the step with its layer indices left out (`model.layers.*.mlp`)."""
    return _INDEX.sub(".*", phase)


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


def _storages(tensors: Iterable[torch.Tensor]) -> Iterable[torch.UntypedStorage]:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            yield _local(t).untyped_storage()


class LiveBytes(TorchDispatchMode):
    """
    Counts live storage bytes while active (`with tracker:`); see the module docstring for the categories.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.plan.tracker import LiveBytes
    >>> tracker = LiveBytes()
    >>> with tracker, torch.no_grad():
    ...     a = torch.empty(1000)
    ...     b = torch.empty(1000); del b
    >>> tracker.current, tracker.peak.total
    (4000, 8000)
    ```
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, list] = {}  # id(storage) -> [nbytes, category, host side?]
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.current = 0
        self.host_totals = dict.fromkeys(CATEGORIES, 0)  # host-side storages (offload), apart from the device's
        self.host_current = 0
        self.host_peak = Peak()
        self.combined_peak = 0  # the most device + host bytes alive at once (one memory: a CPU-only run)
        self.backward_flops = 0  # counted by the simulation's stepping backwards (`simulate._labelled_backward`)
        self.count_flops = False  # only in the first, unmeasured step
        self._host = threading.local()  # inside on_host() (on this thread): new storages are host-side
        # NOTE: a real offload run frees device gradients on its copy thread (a storage's finalizer runs where its last
        # reference goes) and allocates on its host worker: the counts are shared, so changes hold this lock.
        self._lock = threading.RLock()
        self.phase = "start"
        self.stage = "backward"  # what a gradient hook names: "backward", or the layer-wise norm pass
        self.peak = Peak()
        self._peak_is_now = False
        # The peak of each place in the step (layer indices aside), for the layer extrapolation: a place that is not
        # the peak in a copy of a few layers may be in the full model.
        self.phase_peaks: dict[str, Peak] = {}
        self._phase_now: str | None = None
        self.label: str | None = None  # while set, the category of every new storage (collectives' buffers)
        self._resize = None

    # ---- counting ----

    def track(self, storage: torch.UntypedStorage, category: str) -> None:
        """Count `storage` (if new; host-side inside `on_host()`) and put it in `category`."""
        with self._lock:
            self._track(storage, category)

    def _track(self, storage: torch.UntypedStorage, category: str) -> None:
        key = id(storage)
        entry = self._live.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            host = getattr(self._host, "depth", 0) > 0
            self._live[key] = [nbytes, category, host]
            weakref.finalize(storage, self._free, key)
            if host:
                self.host_totals[category] += nbytes
                self.host_current += nbytes
                self._host_rose()
                return
            self.totals[category] += nbytes
            self.current += nbytes
            self._rose()
            return
        if entry[1] != category:
            if entry[2]:
                self.host_totals[entry[1]] -= entry[0]
                self.host_totals[category] += entry[0]
                entry[1] = category
                if self.host_peak.total == self.host_current:
                    self.host_peak.by_category = dict(self.host_totals)
                return
            self.totals[entry[1]] -= entry[0]
            self.totals[category] += entry[0]
            entry[1] = category
            if self._peak_is_now:
                # Nothing was allocated or freed since the peak: it is this moment, so its split follows the label.
                self.peak.by_category = dict(self.totals)
            if self._phase_now is not None:
                self.phase_peaks[self._phase_now].by_category = dict(self.totals)

    def _same_storage(self, out: torch.Tensor, waited: torch.Tensor) -> None:
        """`out` of a functional collective's `wait_tensor` is the tensor it waited on (the real kernel returns its
        input); on fake tensors it has a storage of its own, counted here as the input's: that one lives while `out`
        does, and `out`'s views are known."""
        # NOTE: without this a tensor-parallel all-gather (DTensor's redistribute to Replicate: all_gather_into_tensor,
        # wait_tensor, split, cat) counted its output twice on fake tensors: the planned peak of a TP 2 x FSDP2 2 rank
        # was 24% above the real rank's, at the lm_head's gathered logits.
        mine, theirs = _local(out).untyped_storage(), _local(waited).untyped_storage()
        with self._lock:
            entry = self._live.get(id(theirs))
            if mine is theirs or entry is None or id(mine) in self._live:
                return
            self._live[id(mine)] = entry
            weakref.finalize(mine, self._unalias, id(mine), theirs)

    def _unalias(self, key: int, theirs: torch.UntypedStorage) -> None:
        with self._lock:
            self._live.pop(key, None)
        del theirs  # the storage it stood for may go now

    def track_tensors(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        for storage in _storages(tensors):
            self.track(storage, category)

    def _free(self, key: int) -> None:
        with self._lock:
            self._freed(key)

    def _freed(self, key: int) -> None:
        nbytes, category, host = self._live.pop(key)
        if host:
            self.host_totals[category] -= nbytes
            self.host_current -= nbytes
            return
        self.totals[category] -= nbytes
        self.current -= nbytes
        self._peak_is_now = False
        self._phase_now = None

    def _rose(self) -> None:
        self.combined_peak = max(self.combined_peak, self.current + self.host_current)
        key = phase_key(self.phase)
        best = self.phase_peaks.get(key)
        self._phase_now = None
        if best is None or self.current > best.total:
            self.phase_peaks[key] = Peak(self.current, dict(self.totals), self.phase)
            self._phase_now = key
        if self.current > self.peak.total:
            self.peak = Peak(self.current, dict(self.totals), self.phase)
            self._peak_is_now = True

    def _host_rose(self) -> None:
        self.combined_peak = max(self.combined_peak, self.current + self.host_current)
        if self.host_current > self.host_peak.total:
            self.host_peak = Peak(self.host_current, dict(self.host_totals), self.phase)

    @contextlib.contextmanager
    def on_host(self):
        """New storages are host-side while the context lasts (offload's host buffers and host steps)."""
        self._host.depth = getattr(self._host, "depth", 0) + 1
        try:
            yield
        finally:
            self._host.depth -= 1

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        # FSDP2 allocates and frees unsharded weights by resizing one storage (`alloc_storage` / `free_storage`).
        entry = self._live.get(id(storage))
        if entry is None:
            if nbytes:
                self.track(storage, self.label or (ACTIVATIONS if torch.is_grad_enabled() else TEMPORARIES))
            return
        if entry[2]:
            # NOTE: offload never resizes a host storage; counted on its side should one be resized.
            self.host_totals[entry[1]] += nbytes - entry[0]
            self.host_current += nbytes - entry[0]
            entry[0] = nbytes
            self._host_rose()
            return
        delta, entry[0] = nbytes - entry[0], nbytes
        if self.label is not None and entry[1] != self.label and delta > 0:
            self.totals[entry[1]] -= entry[0] - delta
            self.totals[self.label] += entry[0] - delta
            entry[1] = self.label
        self.totals[entry[1]] += delta
        self.current += delta
        if delta > 0:
            self._peak_is_now = False
            self._rose()
        elif delta:
            self._peak_is_now = False
            self._phase_now = None

    @contextlib.contextmanager
    def labelled(self, category: str):
        """New storages (and storages grown by a resize) go to `category` while the context lasts, or until a
        gradient hook fires."""
        previous, self.label = self.label, category
        try:
            yield
        finally:
            self.label = previous

    def __enter__(self):
        # NOTE: `UntypedStorage.resize_` does not pass through the dispatcher; torch's own MemTracker patches it too.
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            out = original(storage, size)
            tracker._resized(storage, storage.nbytes())
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = Peak(self.current, dict(self.totals), self.phase)
        self._peak_is_now = True
        self._phase_now = phase_key(self.phase)
        self.phase_peaks = {self._phase_now: Peak(self.current, dict(self.totals), self.phase)}
        self.host_peak = Peak(self.host_current, dict(self.host_totals), self.phase)
        self.combined_peak = self.current + self.host_current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _WAIT_TENSOR and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self._same_storage(out, args[0])
        category = self.label or (ACTIVATIONS if torch.is_grad_enabled() else TEMPORARIES)
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = _local(t).untyped_storage()
                if id(storage) not in self._live:
                    self.track(storage, category)
        return out

    # ---- what the step's objects say ----

    def watch_model(self, model: torch.nn.Module) -> list:
        """Weights (parameters and buffers) counted now; gradients recognised in post-accumulate-grad hooks, and the
        phase named by forward pre-hooks on the model's blocks. Register before any optimizer's hooks: a hook that
        frees `.grad` must run after this one. Returns the hook handles."""
        self.track_tensors(model.parameters(), WEIGHTS)
        self.track_tensors(model.buffers(), WEIGHTS)
        names = {id(p): n for n, p in model.named_parameters()}
        handles = []
        for p in model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(self.gradient_hook(names[id(p)])))
        for name, module in _blocks(model):
            # Before FSDP2's own pre-hook, so that its all-gather falls in this block's phase.
            handles.append(module.register_forward_pre_hook(self._forward_hook(name), prepend=True))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None:
            handles.append(head.register_forward_hook(self._loss_hook))
        return handles

    def _loss_hook(self, module, args, output) -> None:
        if not self.phase.startswith(("backward", "norm pass")):
            self.phase = "loss: logits and cross-entropy"

    def gradient_hook(self, name: str):
        """A post-accumulate-grad hook that counts `.grad` as a gradient and names the phase after `name`."""

        def hook(param: torch.Tensor) -> None:
            self.phase = f"{self.stage}: gradient of {name}"
            # FSDP2 runs the sharded parameters' hooks (a layer-wise step) inside its reduce-scatter's label.
            self.label = None
            if param.grad is not None:
                self.track(_local(param.grad).untyped_storage(), GRADIENTS)

        return hook

    def _forward_hook(self, name: str):
        def hook(module, args) -> None:
            if self.phase.startswith(("backward", "norm pass", "step")):
                # NOTE: a forward pre-hook inside backward is activation checkpointing's recompute.
                self.phase = f"{self.stage}: recomputing {name}"
            else:
                self.phase = f"forward: {name}"

        return hook

    def watch_optimizer(self, optimizer: torch.optim.Optimizer, label: str) -> list:
        """Optimizer state recognised after each step of `optimizer`; the phase named before it."""

        def pre(opt, args, kwargs) -> None:
            self.phase = f"step: {label}"

        def post(opt, args, kwargs) -> None:
            for state in opt.state.values():
                self.track_tensors(_state_tensors(state), OPTIMIZER_STATE)

        return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


def _state_tensors(obj) -> list[torch.Tensor]:
    """The tensors in one parameter's optimizer state (nested in dicts, lists, or objects such as projectors)."""
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return found


def _blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules that name a phase: each item of a `ModuleList` (decoder layers), embeddings, the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    blocks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            blocks += [(f"{name}.{i}", m) for i, m in enumerate(module)]
        elif isinstance(module, torch.nn.Embedding) or module is head:
            blocks.append((name, module))
    return blocks
