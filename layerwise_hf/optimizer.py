"""`LayerwiseOptimizer`: one inner optimizer per trainable parameter, stepped from gradient hooks.

The object Trainer and Accelerate see is a real `torch.optim.Optimizer`. Its `param_groups` are the inner
optimizers' own (single) param groups, shared by reference, so whatever the LR scheduler writes into a group is what
the inner optimizer reads when the hook steps it: the logged lr is the applied lr by construction.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from .checkpoint import STATE_DICT_KEY, is_layerwise_state_dict, standard_to_layerwise
from .params import LayerwiseFactory, LayerwiseParam

logger = logging.getLogger(__name__)

STATE_DICT_VERSION = 1

CLIP_MODES = ("exact", "previous", "per_param", "off")
"""How `max_grad_norm` is applied when each layer steps during backward:

- `exact`: Trainer's global `clip_grad_norm_`, bit for bit. With gradient accumulation the gradients are held
  anyway, so the step waits for the window's end (no extra cost). Without it, the driver runs forward+backward twice
  (`run_with_norm_pass`): the first pass only measures the norm, the second clips and steps.
  Without a norm pass the gradients are held until `step()` (exact, but no memory saving).
- `previous`: one pass; scale by the previous step's global norm, or by the norm of this step's gradients seen so
  far when that is larger. Every tensor's applied gradient is bounded by `max_grad_norm` even on a spike; the
  whole step is bounded by it whenever the norm does not grow past the previous step's.
- `per_param`: one pass; clip each parameter's gradient to `max_grad_norm` on its own.
- `off`: no clipping.
"""

T = TypeVar("T")

# id(param) -> the LayerwiseOptimizer whose hooks are on it. A second optimizer attaching to the same parameter
# (a second Trainer on the same model, or one whose train() died before detaching) takes the hooks over, so a
# parameter can never be stepped twice per backward. Kept off the Parameter itself so models still pickle.
_OWNERS: weakref.WeakValueDictionary[int, LayerwiseOptimizer] = weakref.WeakValueDictionary()


def _accelerate_sync_gradients() -> bool:
    # NOTE: accelerate sets `sync_gradients` before the backward of each micro-batch (False on all but the last of
    # a gradient-accumulation window), and Trainer sets it explicitly; outside Accelerate it stays True.
    from accelerate.state import GradientState

    return GradientState().sync_gradients


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        # A DTensor's numel() is the global size; this rank holds only its local shard.
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        # Objects kept in optimizer state (GaLore's projector holds its projection matrix).
        return sum(_tensor_bytes(v) for v in vars(obj).values())
    return 0


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor norm (FSDP2) is replicated: its local value is the global norm.
    return t.to_local() if hasattr(t, "to_local") else t


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class LayerwiseOptimizer(torch.optim.Optimizer):
    """
    A proxy optimizer over one inner optimizer per trainable parameter.

    Each inner optimizer is stepped inside the parameter's post-accumulate-grad hook (once `attach` has been
    called) and the gradient is freed right after, so at most about one gradient is alive at a time. `step()` only
    steps parameters whose gradient no hook consumed (hooks detached, gradients set by hand) and closes the step;
    with hooks attached it does no per-layer work.

    Args:
        params (`Sequence[LayerwiseParam]`):
            The trainable parameters, in `model.named_parameters()` order, with their weight decay.
        factory (`Callable[[LayerwiseParam, TrainingArguments], torch.optim.Optimizer]`):
            Builds the inner optimizer of one parameter (see `registry.resolve_factory`).
        args (`TrainingArguments`, *optional*):
            Passed to `factory`.
        optimizer_name (`str`, *optional*):
            Recorded in checkpoints (e.g. `"adamw_8bit_layerwise"`).
        sync_gradients (`Callable[[], bool]`, *optional*):
            Whether the current backward ends an accumulation window. Defaults to Accelerate's
            `GradientState().sync_gradients`, which is always `True` outside gradient accumulation.
        in_decay_group (`Sequence[bool]`, *optional*):
            Per parameter, whether Trainer's standard optimizer would put it in its weight-decay group; lets
            checkpoints convert to and from the standard layout. Defaults to `weight_decay != 0`.
    """

    def __init__(
        self,
        params: Sequence[LayerwiseParam],
        factory: LayerwiseFactory,
        args: Any = None,
        *,
        optimizer_name: str | None = None,
        sync_gradients: Callable[[], bool] | None = None,
        in_decay_group: Sequence[bool] | None = None,
    ):
        params = list(params)
        if not params:
            raise ValueError(
                "LayerwiseOptimizer got no trainable parameters (every parameter has requires_grad=False)."
            )
        seen = set()
        for lp in params:
            if not lp.param.requires_grad:
                raise ValueError(f"{lp.name} has requires_grad=False: frozen parameters get no optimizer.")
            if id(lp.param) in seen:
                raise ValueError(f"{lp.name} is listed twice (tied parameters must appear once).")
            seen.add(id(lp.param))
        self.names = [lp.name for lp in params]
        self.optimizer_name = optimizer_name
        self.in_decay_group = (
            list(in_decay_group) if in_decay_group is not None else [lp.weight_decay != 0 for lp in params]
        )
        self.inner: list[torch.optim.Optimizer] = []
        for lp in params:
            inner = factory(lp, args)
            groups = getattr(inner, "param_groups", None)
            if (
                not groups
                or len(groups) != 1
                or len(groups[0]["params"]) != 1
                or groups[0]["params"][0] is not lp.param
            ):
                raise ValueError(
                    f"The factory for {lp.name} must return an optimizer with exactly one param group holding exactly "
                    f"that parameter; got {type(inner).__name__} with {len(groups or [])} group(s)."
                )
            groups[0]["name"] = lp.name
            self.inner.append(inner)
        self._params = [lp.param for lp in params]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._sync_gradients = sync_gradients or _accelerate_sync_gradients
        self._handles: list[Any] = []
        # Per step window: which parameters were stepped, their gradient norms, the gradient bytes alive.
        self._stepped = [False] * len(self._params)
        self._norms: list[tuple[torch.dtype, torch.Tensor] | None] = [None] * len(self._params)
        self._held: dict[int, int] = {}
        self._held_bytes = 0
        self.peak_grad_bytes = 0
        self.last_grad_norm: torch.Tensor | None = None
        self.steps_taken = 0
        self.max_grad_norm = 0.0
        self.clip_mode = "off"
        self._in_norm_pass = False
        self._measured = False  # a norm pass has measured (and, with a scaler, inf-checked) this window
        self._fired = [False] * len(self._params)  # hooks seen in this window's final backward
        self._accumulating = False
        self._clip_coef: torch.Tensor | None = None
        self._running_sq: torch.Tensor | None = None
        # fp16 loss scaling (`use_grad_scaler`): the scaler, this window's per-device found-inf flags and inverse
        # scales, and the scaler's record of this optimizer for the open window (replaced by `scaler.update()`).
        self._scaler: Any = None
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        self._inv_scale: dict[torch.device, torch.Tensor] = {}
        self._scaler_record: dict | None = None
        # Set by distributed.connect when something other than the local hooks (a DDP comm hook) feeds the steps.
        self._external_route: Any = None
        self.route: str | None = None  # how gradients arrived in the last connect(): "local", "ddp" or "fsdp2"
        # NOTE: some transformers schedulers read `optimizer.defaults["lr"]` (polynomial, cosine_with_min_lr).
        defaults = {"lr": self.inner[0].defaults.get("lr", self.inner[0].param_groups[0]["lr"])}
        super().__init__([inner.param_groups[0] for inner in self.inner], defaults=defaults)

    # ---- torch.optim.Optimizer surface ----

    @property
    def state(self) -> dict[torch.Tensor, dict]:
        # NOTE: only populated states: DCP's `_init_optim_state` treats any truthy `optim.state` as initialised.
        merged = {}
        for inner in self.inner:
            for p, s in inner.state.items():
                if s:
                    merged[p] = s
        return merged

    @state.setter
    def state(self, value) -> None:
        # torch.optim.Optimizer.__init__ assigns an empty defaultdict; the real state lives in the inner optimizers.
        if value:
            raise AttributeError("LayerwiseOptimizer.state is a view of the per-parameter optimizers' states.")

    def _relink_groups(self) -> None:
        # `load_state_dict` of the inner optimizers replaces their group dicts; keep sharing them by reference.
        self.param_groups[:] = [inner.param_groups[0] for inner in self.inner]

    def rebind(self) -> None:
        """
        Follow parameters replaced inside the param groups. Accelerate's FSDP2 `prepare` swaps every group's
        parameter for its sharded DTensor; the inner optimizers see that through the shared groups, and this moves
        the hooks, the bookkeeping and any existing state along. Called by every entry point, so it is rarely
        needed by hand.
        """
        current = [inner.param_groups[0]["params"][0] for inner in self.inner]
        if all(a is b for a, b in zip(current, self._params)):
            return
        was_attached = self.attached
        self.detach()
        for inner, old, new in zip(self.inner, self._params, current):
            if old is not new and old in inner.state:
                inner.state[new] = inner.state.pop(old)
        self._params = current
        self._index = {id(p): i for i, p in enumerate(current)}
        if was_attached:
            self.attach()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.rebind()
        self._close_skipped_window()
        pending = [i for i, p in enumerate(self._params) if p.grad is not None and not self._stepped[i]]
        if pending:
            # With a scaler, GradScaler.step has unscaled these held gradients before calling this step().
            for i in pending:
                self._record_norm(i)
            if self._clips_exactly():
                self._clip_coef = self._coef(self._total_norm())
            for i in pending:
                self._step_one(i)
        self._end_window()
        self.steps_taken += 1
        return loss

    def _end_window(self) -> None:
        total = self._total_norm()
        if total is not None:
            self.last_grad_norm = total
        n = len(self._params)
        self._stepped = [False] * n
        self._fired = [False] * n
        self._norms = [None] * n
        self._held.clear()
        self._held_bytes = 0
        self._accumulating = False
        self._measured = False
        self._clip_coef = None
        self._running_sq = None
        # New dicts, not clear(): step() runs inside GradScaler.step, and update() reads the flags afterwards.
        self._found_inf = {}
        self._inv_scale = {}
        self._scaler_record = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._held.clear()
        self._held_bytes = 0

    def state_dict(self) -> dict[str, Any]:
        """
        The standard layout (integer keys, one param group per parameter) with each group's parameter `name`, plus a
        `layerwise_hf` entry (names, shapes, inner optimizer classes) for validated, name-keyed loading.
        Only tensors and plain values: loads with `torch.load(weights_only=True)`.
        """
        self.rebind()
        state: dict[int, Any] = {}
        groups = []
        for i, inner in enumerate(self.inner):
            sd = inner.state_dict()
            (saved_id,) = sd["param_groups"][0]["params"]
            if sd["state"].get(saved_id):
                state[i] = sd["state"][saved_id]
            groups.append({**sd["param_groups"][0], "params": [i]})
        meta = {
            "version": STATE_DICT_VERSION,
            "optimizer_name": self.optimizer_name,
            "names": list(self.names),
            "shapes": [list(p.shape) for p in self._params],
            "optimizer_classes": [_qualname(inner) for inner in self.inner],
            "in_decay_group": list(self.in_decay_group),
            # layerwise_clip="previous" scales the first step after a resume by it.
            "last_grad_norm": None if self.last_grad_norm is None else _local(self.last_grad_norm).detach().clone(),
        }
        return {"state": state, "param_groups": groups, STATE_DICT_KEY: meta}

    def standard_groups_names(self) -> list[list[str]]:
        """The names in each param group of Trainer's standard optimizer: the weight-decay group, then the rest."""
        return [
            [n for n, d in zip(self.names, self.in_decay_group) if d],
            [n for n, d in zip(self.names, self.in_decay_group) if not d],
        ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """
        Load by parameter name; a standard optimizer's state (Trainer's two groups) is converted first. Everything is
        checked before anything is loaded, and a failure while loading restores the previous state.

        A parameter the state does not mention (newly made trainable) starts fresh, with a warning naming it; a state
        for a parameter that is not trainable here, or a state from another model, is an error.
        """
        self.rebind()
        if not is_layerwise_state_dict(state_dict):
            state_dict = standard_to_layerwise(state_dict, self.standard_groups_names())
            logger.warning(
                "Converted a standard optimizer state to the layer-wise layout (%d parameters).", len(self.names)
            )
        groups = state_dict["param_groups"]
        saved_names = [g["name"] for g in groups]
        by_name = {n: i for i, n in enumerate(saved_names)}
        ours = set(self.names)
        unexpected = [n for n in saved_names if n not in ours]
        missing = [n for n in self.names if n not in by_name]
        if unexpected or len(missing) == len(self.names):
            raise ValueError(
                "Optimizer state does not match the trainable parameters (another model, or a changed set of "
                f"trainable parameters). Saved but not trainable here: {unexpected or 'none'}. "
                f"Trainable here but not saved: {missing or 'none'}."
            )
        meta = state_dict.get(STATE_DICT_KEY, {})
        shapes = meta.get("shapes")
        classes = meta.get("optimizer_classes")
        errors = []
        for i, name in enumerate(self.names):
            j = by_name.get(name)
            if j is None:
                continue
            if shapes is not None and list(shapes[j]) != list(self._params[i].shape):
                errors.append(f"{name}: saved shape {list(shapes[j])}, parameter shape {list(self._params[i].shape)}")
            if classes is not None and classes[j] != _qualname(self.inner[i]):
                errors.append(f"{name}: saved optimizer {classes[j]}, current optimizer {_qualname(self.inner[i])}")
        if errors:
            raise ValueError("Optimizer state does not fit this optimizer: " + "; ".join(errors))
        if meta.get("last_grad_norm") is not None:
            self.last_grad_norm = meta["last_grad_norm"].to(self._params[0].device)
        if missing:
            logger.warning(
                "No saved optimizer state for %d newly trainable parameter(s); they start fresh: %s",
                len(missing),
                missing,
            )

        previous = [inner.state_dict() for inner in self.inner]
        loaded = []
        try:
            for i, name in enumerate(self.names):
                if name not in by_name:
                    continue
                group = groups[by_name[name]]
                (saved_id,) = group["params"]
                saved_state = state_dict["state"].get(saved_id)
                inner_sd = {
                    "state": {0: saved_state} if saved_state else {},
                    "param_groups": [{**group, "params": [0]}],
                }
                self.inner[i].load_state_dict(inner_sd)
                loaded.append(i)
        except Exception as err:
            for i in loaded:
                self.inner[i].load_state_dict(previous[i])
            self._relink_groups()
            raise ValueError(
                f"Loading the optimizer state of {self.names[len(loaded)]} failed; nothing was loaded: {err}"
            ) from err
        self._relink_groups()

    # ---- hooks ----

    def attach(self, sync_gradients: Callable[[], bool] | None = None) -> None:
        """
        Register the post-accumulate-grad hooks (idempotent). A parameter whose hooks belong to another
        `LayerwiseOptimizer` is taken over from it, with a warning.
        """
        if sync_gradients is not None:
            self._sync_gradients = sync_gradients
        if self._handles:
            return
        self.rebind()
        taken_from = set()
        for p in self._params:
            other = _OWNERS.get(id(p))
            if other is not None and other is not self and other._owns(p):
                other.detach()
                taken_from.add(id(other))
        if taken_from:
            logger.warning(
                "Layer-wise hooks of %d other optimizer(s) were still attached to these parameters (a previous "
                "train() did not finish?); they were removed so no parameter is stepped twice.",
                len(taken_from),
            )
        for i, p in enumerate(self._params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))
            _OWNERS[id(p)] = self

    def detach(self) -> None:
        """Remove every hook this optimizer registered (and release a DDP comm hook routing to it)."""
        if self._external_route is not None:
            self._external_route.close()
            self._external_route = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for p in self._params:
            if _OWNERS.get(id(p)) is self:
                del _OWNERS[id(p)]

    @property
    def attached(self) -> bool:
        """Whether gradients reach the per-layer steps (local hooks or a DDP comm hook)."""
        return bool(self._handles) or self._external_route is not None

    def connect(self, model: nn.Module | None = None) -> str:
        """
        Attach to `model` as prepared by Accelerate: local hooks, a DDP comm hook for a DDP-wrapped model (so every
        layer steps on the all-reduced gradient), or the FSDP2 shards' hooks. Returns the route taken.
        """
        from .distributed import connect

        return connect(self, model)

    def _owns(self, p: torch.Tensor) -> bool:
        i = self._index.get(id(p))
        return i is not None and self._params[i] is p

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._close_skipped_window()
            if not self._sync_gradients():
                # Accumulating: the gradient stays in .grad until the window's last micro-batch.
                self._accumulating = True
                self._hold(i, param.grad)
                return
            if self._scaler is not None and self._scaler_record is None:
                self._scaler_record = self._scaler._per_optimizer_states[id(self)]
            if self._in_norm_pass:
                if self._norms[i] is not None:
                    self._double_fire(i)
                self._hold(i, param.grad)
                self._unscale(i)
                self._record_norm(i)
                param.grad = None
                self._held_bytes -= self._held.pop(i, 0)
                return
            if self._stepped[i] or self._fired[i]:
                self._double_fire(i)
            self._fired[i] = True
            if self._needs_whole_step() and not self._measured:
                # No norm pass ran for this window: hold the gradient; step() clips and steps exactly (with a
                # scaler, after GradScaler has unscaled and inf-checked every held gradient).
                self._hold(i, param.grad)
                if self._scaler is None:
                    self._record_norm(i)
                return
            self._unscale(i)
            self._step_one(i)

        return hook

    def _double_fire(self, i: int) -> None:
        raise RuntimeError(
            f"The gradient hook of {self.names[i]} fired twice before optimizer.step(): it would be stepped "
            "twice. This happens with reentrant activation checkpointing when a parameter is used in two "
            "checkpointed segments (use activation_checkpointing_kwargs={'use_reentrant': False}), or with "
            "several backward passes per step outside gradient accumulation (use accelerator.accumulate or "
            "gradient_accumulation_steps)."
        )

    def _hold(self, i: int, grad: torch.Tensor | None) -> None:
        if grad is None or i in self._held:
            return
        self._held[i] = _tensor_bytes(grad)
        self._held_bytes += self._held[i]
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._held_bytes)

    def _record_norm(self, i: int) -> None:
        grad = self._params[i].grad
        if self._norms[i] is None and grad is not None:
            self._norms[i] = (grad.dtype, self._norm(grad))

    @torch.no_grad()
    def _step_one(self, i: int) -> None:
        p = self._params[i]
        grad = p.grad
        self._hold(i, grad)
        self._record_norm(i)
        coef = self._step_coef(i)
        if coef is not None:
            grad.mul_(coef.to(grad.device))
        self.inner[i].step()
        self._stepped[i] = True
        p.grad = None
        self._held_bytes -= self._held.pop(i, 0)

    # ---- clipping ----

    def configure_clipping(self, max_grad_norm: float | None, mode: str = "exact") -> None:
        """Apply `max_grad_norm` (`<= 0` or `None`: no clipping) the way `mode` says; see `CLIP_MODES`."""
        if mode not in CLIP_MODES:
            raise ValueError(f"Unknown clipping mode {mode!r}; choose one of {', '.join(CLIP_MODES)}.")
        max_grad_norm = float(max_grad_norm or 0.0)
        resolved = mode if max_grad_norm > 0 else "off"
        if self._scaler is not None:
            _check_scaler_compatible(self, resolved)
        self.max_grad_norm = max_grad_norm
        self.clip_mode = resolved

    def _clips_exactly(self) -> bool:
        return self.clip_mode == "exact"

    def _needs_whole_step(self) -> bool:
        # Exact clipping needs the global norm, and fp16 loss scaling every gradient's inf check, before any layer
        # steps: from a norm pass, or by holding the gradients until step().
        return self._clips_exactly() or self._scaler is not None

    def _coef(self, norm: torch.Tensor) -> torch.Tensor:
        # NOTE: the expression of torch's `_clip_grads_with_norm_`, so exact clipping is bit-identical.
        return torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)

    def _step_coef(self, i: int) -> torch.Tensor | None:
        if self.clip_mode == "exact":
            return self._clip_coef
        if self.clip_mode == "per_param":
            return self._coef(self._norms[i][1])
        if self.clip_mode == "previous":
            sq = self._norms[i][1].float().square()
            self._running_sq = sq if self._running_sq is None else self._running_sq + sq.to(self._running_sq.device)
            bound = self._running_sq.sqrt()
            if self.last_grad_norm is not None:
                bound = torch.maximum(bound, self.last_grad_norm.float().to(bound.device))
            return self._coef(bound)
        return None

    def needs_norm_pass(self) -> bool:
        """
        Whether the coming backward ends a window (no accumulation) that exact clipping or fp16 loss scaling wants
        measured first.
        """
        self._close_skipped_window()
        return self.attached and self._needs_whole_step() and self._sync_gradients() and not self._accumulating

    @contextlib.contextmanager
    def norm_pass(self) -> Iterator[None]:
        """
        Within it, hooks only measure gradient norms (of unscaled gradients, checked for inf/nan with a scaler) and
        free the gradients; after it, the clip is known and `step_will_be_skipped` says whether any was not finite.
        """
        self._close_skipped_window()
        self._in_norm_pass = True
        try:
            yield
        finally:
            self._in_norm_pass = False
        total = self._total_norm()
        self._measured = True
        self._clip_coef = self._coef(total) if total is not None and self._clips_exactly() else None
        if self._scaler is not None:
            self._publish_found_inf()

    @property
    def step_will_be_skipped(self) -> bool:
        """After a norm pass with a scaler: some gradient was inf/nan, so GradScaler will skip this step."""
        return any(bool(t.item()) for t in self._found_inf.values())

    def backward_with_norm_pass(self, loss: torch.Tensor, backward: Callable[..., Any] | None = None, **kwargs):
        """
        `backward(loss)`, preceded (when exact clipping needs the global norm first) by a measuring backward over the
        same graph, kept with `retain_graph=True`: one forward, two backwards. Only for a single process and an
        uncompiled model: DDP and FSDP2 run their collectives once per forward, and a torch.compile'd backward refuses
        `retain_graph`, so use `run_with_norm_pass` there.
        """
        backward = backward or (lambda tensor, **kw: tensor.backward(**kw))
        # First: a window GradScaler skipped must be closed before this one notes its accumulation.
        self._close_skipped_window()
        if not self._sync_gradients():
            self._accumulating = True
            return backward(loss, **kwargs)
        if not self.needs_norm_pass():
            return backward(loss, **kwargs)
        with self.norm_pass():
            result = backward(loss, retain_graph=True, **kwargs)
        if self.step_will_be_skipped:
            return result  # nothing will step: the second backward would be wasted
        return backward(loss, **kwargs)

    def run_with_norm_pass(self, forward_backward: Callable[[], T]) -> T:
        """
        Run `forward_backward` (forward + backward of one micro-batch) twice when exact clipping needs the global
        norm before any layer steps: first to measure, then to clip and step. The RNG state is replayed so dropout
        draws the same masks. Otherwise run it once.
        """
        # First: a window GradScaler skipped must be closed before this one notes its accumulation (under DDP's
        # no_sync no hook fires that would close it).
        self._close_skipped_window()
        if not self._sync_gradients():
            # Under DDP's no_sync no hook fires on this micro-batch, so note the accumulation here.
            self._accumulating = True
            return forward_backward()
        if not self.needs_norm_pass():
            return forward_backward()
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        with self.norm_pass():
            result = forward_backward()
        if self.step_will_be_skipped:
            return result  # every rank agrees (reduced gradients): no second pass anywhere
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        return forward_backward()

    # ---- fp16 loss scaling ----

    def use_grad_scaler(self, scaler: Any) -> None:
        """
        Step under fp16 loss scaling with `scaler` (Accelerate's `accelerator.scaler`, a `torch.amp.GradScaler`;
        `None` or a disabled scaler: none). Every gradient is then unscaled and checked for inf/nan before any layer
        steps: in a norm pass without gradient accumulation (so each step runs backward twice, like exact
        clipping), or by holding the gradients until step() with it. A step with an inf/nan anywhere changes no
        parameter and no optimizer state, and the scaler backs off / grows exactly as with a standard optimizer,
        because `GradScaler.step` / `update` make those decisions from the flags recorded here.
        """
        if scaler is not None and not scaler.is_enabled():
            scaler = None
        if scaler is not None:
            _check_scaler_compatible(self, self.clip_mode)
        self._scaler = scaler

    def _unscale(self, i: int) -> None:
        if self._scaler is None:
            return
        # NOTE: the kernel GradScaler.unscale_ runs (elementwise, so one tensor at a time is bit-identical), on the
        # local shard of an FSDP2 DTensor: found-inf is all-reduced once per step, not once per parameter.
        grad = _local(self._params[i].grad)
        device = grad.device
        if device not in self._found_inf:
            if self._scaler._scale is None:
                raise RuntimeError(
                    "fp16: the loss was not scaled by the GradScaler given to use_grad_scaler (call "
                    "accelerator.backward(loss), or scaler.scale(loss).backward())."
                )
            # GradScaler's own inverse: double reciprocal, then float.
            inv_scale = self._scaler._scale.double().reciprocal().float()
            self._inv_scale[device] = inv_scale.to(device)
            self._found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], self._found_inf[device], self._inv_scale[device])

    def _publish_found_inf(self) -> None:
        # NOTE: GradScaler keeps, per optimizer, a stage and the found-inf flags unscale_() produced; step() skips
        # optimizer.step() when any flag is set and update() backs off from them. The gradients are gone by the
        # time Trainer calls scaler.step, so the flags the hooks produced are recorded there as unscale_() would.
        from torch.amp.grad_scaler import OptState

        if not self._found_inf:
            # No gradient reached a hook (nothing trainable was used): a flag of 0, as unscale_ over no grads gives
            # none and GradScaler.step would assert.
            device = self._scaler._scale.device
            self._found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        if self.route == "fsdp2" and _dist_ready():
            # Each rank checked its own shards; GradScaler's DTensor handler all-reduces the flag the same way. Every
            # rank gets here once per step (the norm pass runs everywhere), so the collectives line up.
            import torch.distributed as dist

            for flag in self._found_inf.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        record = self._scaler._per_optimizer_states[id(self)]
        if record["stage"] is OptState.UNSCALED and record["found_inf_per_device"] is not self._found_inf:
            raise RuntimeError("GradScaler.unscale_() was called on the layer-wise optimizer during its norm pass.")
        record["found_inf_per_device"] = self._found_inf
        record["stage"] = OptState.UNSCALED
        self._scaler_record = record

    def _close_skipped_window(self) -> None:
        # GradScaler.step skips our step() on inf/nan, and update() then replaces its per-optimizer records; seeing
        # ours replaced while a window is still open means that window was skipped: forget it without stepping.
        record = self._scaler_record
        if record is None or self._scaler is None:
            return
        if self._scaler._per_optimizer_states.get(id(self)) is record:
            return
        self._end_window()

    # ---- gradient norm ----

    @staticmethod
    def _norm(grad: torch.Tensor) -> torch.Tensor:
        # NOTE: the same kernel `clip_grad_norm_` picks for this device, so the total is bit-identical to Trainer's.
        from torch.utils._foreach_utils import _device_has_foreach_support

        if _device_has_foreach_support(grad.device):
            return torch._foreach_norm([grad], 2.0)[0]
        return torch.linalg.vector_norm(grad, 2.0)

    def _total_norm(self) -> torch.Tensor | None:
        norms = []
        for i, p in enumerate(self._params):
            if self._norms[i] is not None:
                norms.append((self._norms[i][0], p.device, self._norms[i][1]))
            elif p.grad is not None:
                norms.append((p.grad.dtype, p.device, self._norm(p.grad)))
        if not norms:
            return None
        # `clip_grad_norm_` groups gradients by (device, dtype) in order of first appearance before stacking.
        ordered: dict[tuple, list[torch.Tensor]] = {}
        for dtype, device, norm in norms:
            ordered.setdefault((device, dtype), []).append(norm)
        flat = [n for group in ordered.values() for n in group]
        first_device = flat[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in flat]), 2.0)

    def grad_norm(self) -> torch.Tensor | None:
        """
        The pre-clip global L2 norm of the gradients of the current step (accumulated in the hooks), or of the last
        completed step once `step()` has run. Identical to what `clip_grad_norm_` would have returned (with fp16, of
        the unscaled gradients, inf/nan on a step GradScaler skips).
        """
        self._close_skipped_window()
        if self._scaler is not None and not self._measured and self._sync_gradients():
            # Held gradients are still scaled: unscale them the way Trainer's clip_grad_norm_ path does.
            from torch.amp.grad_scaler import OptState

            record = self._scaler._per_optimizer_states[id(self)]
            if record["stage"] is OptState.READY and any(p.grad is not None for p in self._params):
                self._scaler.unscale_(self)
        current = self._total_norm()
        return current if current is not None else self.last_grad_norm

    # ---- memory ----

    def state_bytes(self) -> int:
        """Bytes held by every inner optimizer's state."""
        return sum(_tensor_bytes(s) for inner in self.inner for s in inner.state.values())

    def full_grad_bytes(self) -> int:
        """Bytes all trainable gradients take at once (what a standard optimizer holds at its step)."""
        return sum(_tensor_bytes(p) for p in self._params)

    def parameters(self) -> Iterable[torch.Tensor]:
        return iter(self._params)

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return zip(self.names, self._params)

    def __repr__(self) -> str:
        kinds = sorted({type(inner).__name__ for inner in self.inner})
        return f"LayerwiseOptimizer({self.optimizer_name or '/'.join(kinds)}, {len(self.inner)} parameters)"


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _check_scaler_compatible(optimizer: LayerwiseOptimizer, clip_mode: str) -> None:
    if clip_mode in ("previous", "per_param"):
        raise ValueError(
            f"layerwise_clip={clip_mode!r} cannot run with fp16 loss scaling: it steps each layer during the single "
            "backward, before later gradients are checked for inf/nan, so an overflowing step would still change "
            "parameters. Use layerwise_clip='exact' (or 'off') with fp16, or bf16=True with any mode."
        )
    fp16 = [n for n, p in zip(optimizer.names, optimizer._params) if p.dtype == torch.float16]
    if fp16:
        raise ValueError(
            f"fp16 loss scaling needs fp32 trainable weights (GradScaler refuses to unscale fp16 gradients); "
            f"{len(fp16)} parameter(s) are float16, e.g. {fp16[0]}. Load the model in float32 and let fp16=True "
            "autocast, or use bf16."
        )


def build_layerwise_optimizer(
    model: nn.Module,
    args: Any,
    *,
    decay_parameter_names: Iterable[str] | None = None,
    factory: LayerwiseFactory | None = None,
    sync_gradients: Callable[[], bool] | None = None,
) -> LayerwiseOptimizer:
    """
    Build the layer-wise optimizer for `model` from `args.optim` (e.g. `"adamw_8bit_layerwise"`).

    Args:
        model (`nn.Module`):
            Only parameters with `requires_grad=True` get an optimizer.
        args (`TrainingArguments`):
            Supplies `optim`, `learning_rate`, `weight_decay` and the optimizer's own settings.
        decay_parameter_names (`Iterable[str]`, *optional*):
            Names that get `args.weight_decay`; defaults to Trainer's own split (no decay for biases and norms).
        factory (*optional*):
            Overrides the factory resolved from `args.optim`.
        sync_gradients (`Callable[[], bool]`, *optional*):
            See `LayerwiseOptimizer`.
    """
    from .registry import resolve_factory

    if decay_parameter_names is None:
        from transformers import Trainer

        # NOTE: Trainer.get_decay_parameter_names does not use `self`; calling it keeps the split identical.
        decay_parameter_names = Trainer.get_decay_parameter_names(None, model)
    decay = set(decay_parameter_names)
    embedding_params = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and getattr(m, "weight", None) is not None
    }
    params = [
        LayerwiseParam(
            name=n,
            param=p,
            weight_decay=args.weight_decay if n in decay else 0.0,
            is_embedding=id(p) in embedding_params,
        )
        for n, p in model.named_parameters()
        if p.requires_grad
    ]
    if factory is None:
        factory = resolve_factory(args, model)
    return LayerwiseOptimizer(
        params,
        factory,
        args,
        optimizer_name=str(getattr(args.optim, "value", args.optim)),
        sync_gradients=sync_gradients,
        in_decay_group=[lp.name in decay for lp in params],
    )


def unwrap_layerwise_optimizer(optimizer: Any) -> LayerwiseOptimizer | None:
    """The `LayerwiseOptimizer` inside Accelerate's (or any) `.optimizer` wrapper chain, or `None`."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, LayerwiseOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None
