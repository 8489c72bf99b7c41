"""Norm passes: how a driver gets every gradient measured (and fp16-checked) before any layer steps.

Exact clipping needs the global gradient norm, and fp16 loss scaling every gradient's inf/nan check, before the
first layer steps. Without gradient accumulation there are three ways to get it, exact alike (the same weights as a
standard optimizer, bit for bit); they differ in memory and time:

- `retain`: a measuring backward over the graph kept with `retain_graph=True`, then the stepping one (1 forward,
  2 backward); every saved activation stays alive through the whole first backward.
- `rerun`: a measuring forward+backward, then the stepping one (`run_with_norm_pass`: 2 forward, 2 backward); each
  backward frees the activations as it goes.
- `hold`: one backward keeps every gradient, `step()` clips and steps them (1 forward, 1 backward); every gradient
  is alive at once, as with a standard optimizer.

`backward_with_norm_pass` measures what the graph saves and chooses (`choose_norm_pass`, whose docstring gives the
rule and the measurements behind it); a driver that can run forward twice asks `forward_again` before the forward.
`run_with_norm_pass` is the only way where collectives run once per forward (DDP, FSDP2) or the backward is compiled.

A rerun calls `forward` twice per micro-batch where stock Trainer calls it once. Before the second call it puts back
what the first changed on the model (`ForwardState`): every buffer by module and name (updated in place, as
BatchNorm's running statistics, or replaced, as `self.seen = torch.cat([self.seen, ids])`), and every plain attribute
of a module that the first call replaced (a counter, a tensor reassigned) or changed in place (a tensor kept outside
buffers, such as a router's load statistics). What it cannot see is repeated: a forward hook's own state, lists or
dicts changed in place, anything outside the model. So where the model has forward hooks of its own, `auto` does
not rerun (`rerun_repeats`): it holds the gradients, as the standard optimizer does.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NormPass(str, enum.Enum):
    """How a step gets its gradients measured before any layer steps (the module docstring lists them)."""

    AUTO = "auto"
    RETAIN = "retain"
    RERUN = "rerun"
    HOLD = "hold"


# Measured (torch profiler allocation events: peak of live CPU-allocator bytes over Trainer.train(), weights not
# counted; adamw_torch, GA 1, max_grad_norm=1.0; Llama 20.3M with vocab 8000 / hidden 384 / 6 layers, and the 58.1M
# of benchmarks/_common.py; MiB):
#
# | model, tokens          |   act |    G |    L |   std | retain |  hold | rerun | chosen |
# |------------------------|------:|-----:|-----:|------:|-------:|------:|------:|--------|
# | 20M tied, 1 x 64       |  16.9 | 65.7 | 11.7 | 220.7 |  183.5 | 220.7 | 166.6 | retain |
# | 20M tied, 1 x 128      |  33.8 | 65.7 | 11.7 | 220.7 |  200.4 | 220.7 | 179.5 | rerun  |
# | 20M tied, 2 x 128      |  67.6 | 65.7 | 11.7 | 220.7 |  234.2 | 220.7 | 214.7 | hold   |
# | 20M tied, 2 x 256      | 135.1 | 65.7 | 11.7 | 297.8 |  301.7 | 297.8 | 297.8 | hold   |
# | 20M tied, 2 x 512      | 270.2 | 65.7 | 11.7 | 464.2 |  464.2 | 464.2 | 464.2 | hold   |
# | 20M tied, 2 x 128, ckpt |   8.9 | 65.7 | 11.7 | 220.7 |  177.9 | 220.7 | 166.6 | retain |
# | 20M untied, 1 x 64     |  16.9 | 77.5 | 11.7 | 258.1 |  190.4 | 255.8 | 190.4 | retain |
# | 20M untied, 1 x 128    |  33.8 | 77.5 | 11.7 | 258.1 |  204.5 | 255.8 | 202.9 | retain |
# | 20M untied, 2 x 128    |  67.6 | 77.5 | 11.7 | 258.1 |  242.4 | 255.8 | 238.1 | rerun  |
# | 20M untied, 2 x 256    | 135.1 | 77.5 | 11.7 | 321.3 |  321.3 | 321.3 | 321.3 | hold   |
# | 58M untied, 1 x 256    | 116.0 |221.5 | 62.5 | 792.3 |  653.3 | 789.6 | 632.1 | rerun  |
# | 58M tied, 1 x 256      | 116.0 |159.0 | 62.5 | 602.1 |  621.5 | 602.1 | 505.6 | rerun  |
#
# act: the bytes the graph saves (`saved_activation_bytes`), G: all gradients, L: the largest gradient, std: the
# standard optimizer (Trainer + adamw_torch, clip_grad_norm_). The retained first backward peaks at the optimizer
# state + act + X, X = 1.3-1.7 L untied and 3.0 L tied (at the embedding's backward, the tied gradient's two parts
# and their sum), while the standard peaks at least at state + G (every gradient before its step). Hence:
RETAIN_EXTRA_LARGEST = 3  # X <= 3 L in every run above: retaining fits when act + 3 L <= G
# The rerun's second pass is the one-pass layer-wise step; it lowers the peak below hold's (= the standard's) when
# the gradients outweigh the activations, and saves nothing when they do not (both then peak at the activations, at
# the start of backward): with act >= G, one pass (hold) costs the least time and the same memory (2 x 128 tied:
# 6 MiB more than rerun; 2 x 256 and up: equal).


def parse_norm_pass(value: Any, argument: str = "norm_pass") -> NormPass:
    """`value` as a `NormPass`, or a `ValueError` naming `argument` and the valid ways."""
    try:
        return NormPass(value)
    except ValueError:
        raise ValueError(
            f"{argument}={value!r} is not a way to measure gradients before a step: choose one of "
            f"{', '.join(v.value for v in NormPass)} ('auto' picks per step the fastest whose peak stays at or below "
            "the standard optimizer's)."
        ) from None


def choose_norm_pass(activation_bytes: int, grad_bytes: int, largest_grad_bytes: int) -> NormPass:
    """
    The way (`NormPass`) whose peak stays at or below the standard optimizer's, fastest first, for a step whose graph
    saves `activation_bytes` and whose trainable gradients take `grad_bytes` (the largest `largest_grad_bytes`).

    - `retain` (1 forward, 2 backward) when `activation_bytes + 3 * largest_grad_bytes <= grad_bytes`: keeping the
      graph through the first backward costs less than keeping every gradient would.
    - `hold` (1 forward, 1 backward) when `activation_bytes >= grad_bytes`: the activations outweigh the gradients,
      so no way peaks lower than holding the gradients does.
    - `rerun` (2 forward, 2 backward) in between.

    The numbers behind the rule are in the comment above this function (`layerwise_hf/optim/norm_pass.py`).

    Example:

    ```python
    >>> from layerwise_hf.optim.norm_pass import choose_norm_pass
    >>> mib = 2**20
    >>> choose_norm_pass(17 * mib, 66 * mib, 12 * mib).value, choose_norm_pass(68 * mib, 66 * mib, 12 * mib).value
    ('retain', 'hold')
    ```
    """
    if activation_bytes + RETAIN_EXTRA_LARGEST * largest_grad_bytes <= grad_bytes:
        return NormPass.RETAIN
    if activation_bytes >= grad_bytes:
        return NormPass.HOLD
    return NormPass.RERUN


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def saved_activation_bytes(loss: torch.Tensor, exclude: Any = ()) -> int:
    """
    Bytes of the distinct storages the autograd graph of `loss` saves for backward, less those of `exclude` (the
    parameters, alive anyway): what `retain_graph=True` keeps alive through a whole backward. Read without unpacking
    (a checkpointed or offloaded tensor counts what its pack hook kept, not what unpacking would recompute).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.norm_pass import saved_activation_bytes
    >>> w = torch.ones(4, 4, requires_grad=True)
    >>> x = torch.ones(8, 4)
    >>> saved_activation_bytes((x @ w).sin().sum(), exclude=[w])  # x (for w's gradient) and x @ w (for sin)
    256
    ```
    """
    if loss.grad_fn is None:
        return 0
    # NOTE: a storage is keyed by its StorageImpl (`_cdata`), not its data pointer: a FakeTensor's is 0 (the memory
    # planner walks fake graphs), and views of one tensor share one StorageImpl.
    skip = {p.untyped_storage()._cdata for p in exclude}
    storages: dict[int, int] = {}
    seen: set = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names = _SAVED_NAMES.get(type(node))
        if names is None:
            names = _SAVED_NAMES[type(node)] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
        for name in names:
            raw = getattr(node, name)
            for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
                # NOTE: SavedTensor.data is what autograd stored (the pack hook's result when there is one),
                # without running the unpack hook.
                data = getattr(saved, "data", None)
                if isinstance(data, torch.Tensor) and data.device.type != "meta":
                    storage = data.untyped_storage()
                    storages[storage._cdata] = storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(n for ptr, n in storages.items() if ptr not in skip)


@dataclasses.dataclass
class NormPassChoice:
    """
    What `layerwise_norm_pass="auto"` decided for one optimizer, kept on it (`LayerwiseOptimizer.norm_pass_choice`).

    Attributes:
        way (`NormPass`, *optional*): the way its last measured step chose (`forward_again` reads it before the next
            forward).
        repeats (`str`, *optional*): why a rerun would repeat a side effect of its model's forward; `auto` then holds.
    """

    way: NormPass | None = None
    repeats: str | None = None


def _pipeline(optimizer: Any) -> Any:
    # A `LayerwiseOptimizer` or its `GradientPipeline`: the driver's functions below take either.
    return getattr(optimizer, "pipeline", optimizer)


def _choice(optimizer: Any) -> NormPassChoice:
    pipeline = _pipeline(optimizer)
    choice = getattr(pipeline, "norm_pass_choice", None)
    if choice is None:  # made at the first choice (or a stand-in in a test)
        choice = pipeline.norm_pass_choice = NormPassChoice()
    return choice


def _choose(optimizer: Any, loss: torch.Tensor) -> NormPass:
    params = _pipeline(optimizer).params
    activations = saved_activation_bytes(loss, params)
    sizes = [p.numel() * p.element_size() for p in params] or [0]
    chosen = choose_norm_pass(activations, sum(sizes), max(sizes))
    if chosen is NormPass.RERUN and _choice(optimizer).repeats:
        # A second forward would repeat what `run_with_norm_pass` cannot put back (`rerun_repeats`).
        chosen = NormPass.HOLD
    if _choice(optimizer).way is not chosen:
        logger.info(
            "Exact clipping / fp16 check without gradient accumulation: the graph saves %.1f MiB of activations, "
            "the gradients take %.1f MiB (largest %.1f MiB): measuring by '%s' (%s).",
            activations / 2**20,
            sum(sizes) / 2**20,
            max(sizes) / 2**20,
            chosen.value,
            {
                NormPass.RETAIN: "a second backward over the retained graph",
                NormPass.RERUN: "a second forward+backward from the next step on, where the driver runs it "
                "(LayerwiseTrainer does); this step holds the gradients",
                NormPass.HOLD: "one backward holding every gradient, as a standard optimizer",
            }[chosen],
        )
    _choice(optimizer).way = chosen
    return chosen


def last_norm_pass(optimizer: Any) -> NormPass | None:
    """
    The way `optimizer`'s last step measured by the rule chose (`backward_with_norm_pass` with `norm_pass="auto"`),
    or None before any.

    Example:

    ```python
    >>> from layerwise_hf.optim.norm_pass import last_norm_pass
    >>> last_norm_pass(optimizer)  # after a step of an activation-dominated model
    <NormPass.HOLD: 'hold'>
    ```
    """
    return _choice(optimizer).way


def forward_again(optimizer: Any) -> bool:
    """
    Whether the coming step should measure with a second forward+backward (`run_with_norm_pass`) rather than
    `backward_with_norm_pass`: its last measured step chose `rerun` (see `choose_norm_pass`). False before any step
    was measured.

    Example:

    ```python
    >>> from layerwise_hf.optim.norm_pass import backward_with_norm_pass, forward_again, run_with_norm_pass
    >>> if forward_again(optimizer):
    ...     run_with_norm_pass(optimizer, forward_backward, model)
    ... else:
    ...     backward_with_norm_pass(optimizer, model(**batch).loss)
    ```
    """
    return last_norm_pass(optimizer) is NormPass.RERUN


def backward_with_norm_pass(
    optimizer: Any,
    loss: torch.Tensor,
    backward: Callable[..., Any] | None = None,
    *,
    norm_pass: str | NormPass = NormPass.AUTO,
    **kwargs,
):
    """
    `backward(loss)`, with every gradient measured (exact clipping) or inf-checked (fp16) before any layer steps when
    the step needs it, in the way `choose_norm_pass` picks from what this graph saves: `retain` (a measuring backward
    over the graph kept with `retain_graph=True`, then the stepping one), or `hold` (this one backward keeps the
    gradients; `step()` clips and steps them). Where the rule picks `rerun`, this step holds and `forward_again`
    tells the driver to run the next one with `run_with_norm_pass`. Only for a single process and an uncompiled
    model: DDP and FSDP2 run their collectives once per forward, and a torch.compile'd backward refuses
    `retain_graph`, so use `run_with_norm_pass` there.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The attached layer-wise optimizer.
        loss (`torch.Tensor`):
            The micro-batch's loss.
        backward (`Callable[..., Any]`, *optional*):
            Runs the backward, e.g. `accelerator.backward`; defaults to `loss.backward`.
        norm_pass (`str` or `NormPass`, *optional*, defaults to `"auto"`):
            `"auto"` (the rule), or `"retain"` / `"hold"` to force one way.
        **kwargs:
            Passed to `backward`.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
    >>> from layerwise_hf.optim.norm_pass import backward_with_norm_pass
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> optimizer = LayerwiseOptimizer([LayerwiseParam("w", w, 0.0)], lambda lp, _: torch.optim.SGD([lp.param], lr=1))
    >>> optimizer.configure_clipping(1.0, "exact"); optimizer.attach()
    >>> backward_with_norm_pass(optimizer, (2 * w).sum(), norm_pass="retain")  # measures the norm (4), then steps
    >>> w.data
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    ```
    """
    way = _norm_pass_arg(norm_pass)
    backward = backward or (lambda tensor, **kw: tensor.backward(**kw))
    pipeline = _pipeline(optimizer)
    # First: a window GradScaler skipped must be closed before this one notes its accumulation.
    pipeline.close_skipped_window()
    if not pipeline.sync_gradients():
        pipeline.note_accumulation()
        return backward(loss, **kwargs)
    if not pipeline.needs_norm_pass():
        return backward(loss, **kwargs)
    if way is NormPass.AUTO:
        way = _choose(optimizer, loss)
    if way is not NormPass.RETAIN:
        # No norm pass: every gradient is held (the step window's HOLD), and step() clips and steps them.
        return backward(loss, **kwargs)
    with pipeline.norm_pass():
        result = backward(loss, retain_graph=True, **kwargs)
    if pipeline.scaling.will_skip():
        return result  # nothing will step: the second backward would be wasted
    return backward(loss, **kwargs)


def _norm_pass_arg(value: str | NormPass) -> NormPass:
    valid = (NormPass.AUTO, NormPass.RETAIN, NormPass.HOLD)
    try:
        way = NormPass(value)
    except ValueError:
        way = None
    if way not in valid:
        raise ValueError(
            f"norm_pass={value!r} is not valid here; use one of {[v.value for v in valid]} ('rerun' is "
            "run_with_norm_pass: it must run the forward too)."
        )
    return way


def run_with_norm_pass(optimizer: Any, forward_backward: Callable[[], T], model: nn.Module | None = None) -> T:
    """
    Run `forward_backward` (forward + backward of one micro-batch) twice when exact clipping or fp16 needs every
    gradient before any layer steps: first to measure, then to clip and step. The RNG state is replayed so
    dropout draws the same masks, and what the first forward changed on `model` is put back (`ForwardState`: buffers
    by module and name, whether updated in place or replaced, and modules' plain attributes), so that running
    statistics (BatchNorm), counters and recorded batches count the micro-batch once, as with stock Trainer.
    Otherwise run it once.

    Where the rerun was `auto`'s choice (`forward_again`) and the model has forward hooks of its own, whose state
    cannot be put back (`rerun_repeats`), it runs once and holds every gradient for `step()`, as the standard
    optimizer does, and `auto` does not choose a rerun again for this optimizer. Under DDP and FSDP2 (a collective
    per forward) a norm pass is always a rerun.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The connected layer-wise optimizer.
        forward_backward (`Callable[[], T]`):
            Runs forward and backward of one micro-batch; what it returns (e.g. the loss) is returned.
        model (`nn.Module`, *optional*):
            The model `forward_backward` runs, whose buffers the measuring pass must leave as they were.

    Example:

    ```python
    >>> # a plain Accelerate loop under DDP or FSDP2 with exact clipping
    >>> from layerwise_hf.optim.norm_pass import run_with_norm_pass
    >>> def forward_backward():
    ...     loss = model(**batch).loss
    ...     accelerator.backward(loss)
    ...     return loss
    >>> loss = run_with_norm_pass(unwrap_layerwise_optimizer(optimizer), forward_backward, model)
    >>> optimizer.step(); optimizer.zero_grad()
    ```
    """
    # First: a window GradScaler skipped must be closed before this one notes its accumulation (under DDP's
    # no_sync no hook fires that would close it).
    pipeline = _pipeline(optimizer)
    pipeline.close_skipped_window()
    if not pipeline.sync_gradients():
        # Under DDP's no_sync no hook fires on this micro-batch, so note the accumulation here.
        pipeline.note_accumulation()
        return forward_backward()
    if not pipeline.needs_norm_pass():
        return forward_backward()
    route = pipeline.route
    collective = route is not None and getattr(route, "collective_per_forward", False)
    if model is not None and not collective and _choice(optimizer).way is NormPass.RERUN:
        repeats = rerun_repeats(model)
        if repeats:
            _choice(optimizer).repeats = repeats
            _choice(optimizer).way = NormPass.HOLD
            logger.info(
                "Exact clipping / fp16 check: a second forward would repeat what the model's %s keep, which cannot "
                "be put back; measuring by 'hold' (one forward, every gradient held for step()) instead of 'rerun'.",
                repeats,
            )
            # No norm pass: every gradient is held (the step window's HOLD), and step() clips and steps them.
            return forward_backward()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    state = ForwardState(model) if model is not None else None
    with pipeline.norm_pass():
        result = forward_backward()
    if pipeline.scaling.will_skip():
        return result  # every rank agrees (reduced gradients): no second pass anywhere
    if state is not None:
        state.restore()
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    return forward_backward()


# Modules whose hooks keep no state across calls that a second forward would change: transformers' output capture
# and input-grad hooks, peft's, accelerate's, torch's own (FSDP2 runs a rerun anyway), and this package's.
_STATELESS_HOOK_MODULES = ("torch.", "transformers.", "peft.", "accelerate.", "layerwise_hf.")


def rerun_repeats(model: nn.Module) -> str:
    """
    What a second forward of `model` would repeat that `ForwardState` cannot put back: forward hooks (and global
    module forward hooks) other than torch's, transformers', peft's, accelerate's and this package's, whose state
    (collected activations, statistics) lives in the hook. An empty string when there are none.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.norm_pass import rerun_repeats
    >>> model = torch.nn.Linear(2, 2)
    >>> rerun_repeats(model)
    ''
    >>> _ = model.register_forward_hook(lambda module, args, output: None)
    >>> rerun_repeats(model)
    'forward hooks (on the module Linear: <lambda>)'
    ```
    """
    from torch.nn.modules import module as torch_module

    found = []
    tables = [
        ("", "global", torch_module._global_forward_hooks),
        ("", "global", torch_module._global_forward_pre_hooks),
    ]
    for name, module in model.named_modules():
        where = f"{name or 'the module'} {type(module).__name__}"
        tables += [(name, where, module._forward_hooks), (name, where, module._forward_pre_hooks)]
    for _, where, table in tables:
        for hook in table.values():
            function = getattr(hook, "func", hook)  # functools.partial
            owner = getattr(function, "__module__", None) or type(function).__module__ or ""
            if not owner.startswith(_STATELESS_HOOK_MODULES):
                label = getattr(function, "__qualname__", type(function).__name__)
                found.append(f"on {where}: {label}")
    return f"forward hooks ({'; '.join(dict.fromkeys(found))})" if found else ""


# What an nn.Module keeps in its __dict__ for itself (hooks, parameters, buffers, submodules, `training`).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


class ForwardState:
    """
    What a forward may change on a model, taken before the measuring forward of a rerun and put back after it, so the
    second forward starts from the same model as the first: each buffer by module and name (a clone of its values,
    and the tensor itself, which `forward` may replace), and each module's plain attributes (the objects, and a clone
    of the values of a tensor outside autograd that aliases no parameter or buffer). Modules of torch itself (DDP's
    and FSDP's wrappers, whose attributes track their collectives) keep their attributes.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.norm_pass import ForwardState
    >>> model = torch.nn.BatchNorm1d(2)
    >>> state = ForwardState(model)
    >>> _ = model(torch.randn(4, 2))
    >>> state.restore()
    >>> int(model.num_batches_tracked)
    0
    ```
    """

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules()]
        self.registered = {m: dict(m._buffers) for m in self.modules}  # names, with buffers registered as None
        self.buffers = {
            (m, name): (b, b.detach().clone()) for m in self.modules for name, b in m._buffers.items() if b is not None
        }
        aliases = {
            t.untyped_storage()._cdata
            for m in self.modules
            for t in (*m._parameters.values(), *m._buffers.values())
            if t is not None
        }
        self.attributes: dict[nn.Module, dict[str, Any]] = {}
        self.values: dict[tuple[nn.Module, str], torch.Tensor] = {}
        for m in self.modules:
            if type(m).__module__.startswith("torch."):
                continue
            plain = {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS}
            self.attributes[m] = plain
            for key, value in plain.items():
                # Statistics and counters: tensors outside autograd. A tensor of the graph (an activation kept on the
                # module) is put back by identity only, never cloned: that would hold a second copy at the peak.
                if isinstance(value, torch.Tensor) and not value.requires_grad:
                    if value.untyped_storage()._cdata not in aliases:
                        self.values[(m, key)] = value.detach().clone()

    def restore(self) -> None:
        """Put every buffer and plain attribute back as it was when this state was taken."""
        with torch.no_grad():
            for m, registered in self.registered.items():
                for name in [n for n in m._buffers if n not in registered]:
                    del m._buffers[name]  # registered by the forward: the second one registers it again
                    m._non_persistent_buffers_set.discard(name)
                m._buffers.update(registered)  # the forward may have replaced one with a new tensor
            for tensor, value in self.buffers.values():
                tensor.copy_(value)
            for m, plain in self.attributes.items():
                for key in [k for k in vars(m) if k not in _MODULE_INTERNALS and k not in plain]:
                    del m.__dict__[key]
                for key, value in plain.items():
                    if m.__dict__.get(key, _MISSING) is not value:
                        m.__dict__[key] = value
            for (m, key), value in self.values.items():
                m.__dict__[key].copy_(value)


_MISSING = object()
