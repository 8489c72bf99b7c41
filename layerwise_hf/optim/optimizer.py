"""`LayerwiseOptimizer`: one inner optimizer per trainable parameter, stepped as soon as its gradient is ready.

The object Trainer and Accelerate see is a real `torch.optim.Optimizer`. Its `param_groups` are the inner
optimizers' own (single) param groups, shared by reference, so whatever the LR scheduler writes into a group is what
the inner optimizer reads when it steps: the logged lr is the applied lr by construction.

The class is the Optimizer's face (docs/architecture.md draws the path of a gradient behind it):

- its `pipeline` (`layerwise_hf.optim.pipeline`) is the route's `GradientSink`: each reduced gradient goes there,
  through the step window and the stages (loss scaling, offload, clipping, the step);
- `connect` picks the route (`layerwise_hf.routes`) and attaches it to the pipeline;
- `layerwise_hf.optim.state` saves and loads the inner optimizers' states by parameter name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from ..bases.params import LayerwiseFactory, LayerwiseParam, StateView, canonical_name
from ..bases.registry import resolve_factory
from ..bases.support import check_bool_argument, check_fp16_clip_mode, check_fp16_weights, check_fsdp2_optimizers
from ..placement.host_step import HostRunner
from ..placement.local_shard import wrap_local_shards
from ..placement.offload import GradientOffload, parse_offload
from ..placement.offloading import host_step_factory
from ..placement.transfer import Transfer
from ..routes.distributed import choose_route
from ..routes.hooks import GradientRoute, LocalHooks
from . import norm_pass
from .clipping import CLIP_MODES as CLIP_MODES
from .clipping import ClipMode, make_clipper
from .grad_scaler import GradScalerBridge
from .host_offload import offload_stage
from .pipeline import NO_OFFLOAD, GradientPipeline, NoLossScaling
from .state import layerwise_state_dict, load_layerwise_state_dict

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LayerwiseOptimizer(StateView, torch.optim.Optimizer):
    """
    A proxy optimizer over one inner optimizer per trainable parameter: the `torch.optim.Optimizer` Trainer and
    Accelerate see. What happens to each gradient is its `pipeline`'s (`layerwise_hf.optim.pipeline`).

    Once a route is attached (`connect(model)`, or `attach()` for local hooks), each inner optimizer steps as soon
    as its parameter's (reduced) gradient is ready and the gradient is freed; `step()` steps what no hook consumed
    (held for exact clipping or fp16, or set by hand) and closes the step.

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
            Whether the current backward ends an accumulation window (default: Accelerate's `sync_gradients`).
        in_decay_group (`Sequence[bool]`, *optional*):
            Per parameter, whether it is in Trainer's weight-decay group (checkpoint conversion; `weight_decay != 0`).
        track_grad_norm (`bool`, *optional*, defaults to `False`):
            Measure every gradient's norm for `grad_norm()` even without clipping (Trainer's integration does).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
    >>> model = torch.nn.Linear(4, 2)
    >>> params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    >>> optimizer = LayerwiseOptimizer(params, lambda lp, args: torch.optim.SGD([lp.param], lr=0.1))
    >>> optimizer.attach()  # each parameter now steps inside backward
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> optimizer.step(); optimizer.detach()
    ```
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
        track_grad_norm: bool = False,
    ):
        params = list(params)
        _check_params(params)
        self.names = [canonical_name(lp.name) for lp in params]
        self.optimizer_name = optimizer_name
        decay = in_decay_group if in_decay_group is not None else [lp.weight_decay != 0 for lp in params]
        self.in_decay_group = list(decay)
        self.inner: list[torch.optim.Optimizer] = [_build_inner(factory, lp, args) for lp in params]
        self.pipeline = GradientPipeline(
            self.names, [lp.param for lp in params], self.inner, sync_gradients, track_grad_norm
        )
        self.steps_taken = 0
        # NOTE: some transformers schedulers read `optimizer.defaults["lr"]` (polynomial, cosine_with_min_lr).
        defaults = {"lr": self.inner[0].defaults.get("lr", self.inner[0].param_groups[0]["lr"])}
        super().__init__([inner.param_groups[0] for inner in self.inner], defaults=defaults)

    # ---- torch.optim.Optimizer surface ----

    def _state_view(self) -> dict[torch.Tensor, dict]:
        # NOTE: only populated states: DCP's `_init_optim_state` treats any truthy `optim.state` as initialised.
        return {p: s for inner in self.inner for p, s in inner.state.items() if s}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self._rebind()
        self.pipeline.step()
        self.steps_taken += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.pipeline.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """The standard layout, each group with its parameter's `name`, plus metadata (`layerwise_hf.optim.state`)."""
        self._rebind()
        return layerwise_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load by parameter name, checked before anything loads; see `state.load_layerwise_state_dict`."""
        self._rebind()
        try:
            last_grad_norm = load_layerwise_state_dict(self, state_dict)
        finally:
            # Loading replaces the inner optimizers' group dicts; keep sharing them by reference.
            self.param_groups[:] = [inner.param_groups[0] for inner in self.inner]
        if last_grad_norm is not None:
            self.pipeline.last_grad_norm = last_grad_norm.to(self.params[0].device)

    # ---- parameters and routes ----

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """The trainable parameters, in order (the ones Accelerate's prepare put in the groups, once stepped)."""
        return tuple(self.pipeline.params)

    def _rebind(self) -> None:
        # Follow parameters replaced in the groups (Accelerate's FSDP2 `prepare` swaps in DTensors): route, state.
        current = [inner.param_groups[0]["params"][0] for inner in self.inner]
        params = self.pipeline.params
        if all(a is b for a, b in zip(current, params)):
            return
        route = self.pipeline.route if self.attached else None
        if route is not None:
            route.detach()
        for inner, old, new in zip(self.inner, params, current):
            if old is not new and old in inner.state:
                inner.state[new] = inner.state.pop(old)
        params[:] = current  # in place: the pipeline's stages and the offload's reserve read this list
        if route is not None:
            route.attach(self.pipeline)

    def connect(
        self,
        model: nn.Module | None = None,
        accelerator: Any = None,
        hold_first_step: bool = False,
        route: GradientRoute | None = None,
    ) -> str:
        """
        Attach to `model` as Accelerate prepared it (local hooks, DDP comm hook, FSDP2), or through `route` when given
        (replacing the current one); returns the route's name. With `hold_first_step`, an exception in the first
        step's backward (OOM) steps nothing: it holds every gradient.
        """
        self._rebind()
        if route is None:
            route = choose_route(self.pipeline.params, model, accelerator)
        self.detach()
        if route.steps_shards:
            check_fsdp2_supported(self)
        self.pipeline.attach(route)
        self.pipeline.window.hold_all = hold_first_step
        return route.name

    def attach(self, sync_gradients: Callable[[], bool] | None = None) -> None:
        """Register local post-accumulate-grad hooks (idempotent), taking them over from another optimizer."""
        if sync_gradients is not None:
            self.pipeline.sync_gradients.source = sync_gradients
        if not self.attached:
            self.connect(route=LocalHooks())

    def detach(self) -> None:
        """Stop routing gradients to the per-layer steps (remove the hooks; a DDP comm hook goes back to averaging)."""
        route = self.pipeline.route
        if route is not None and route.attached:
            route.detach()

    @property
    def attached(self) -> bool:
        """Whether gradients reach the per-layer steps."""
        route = self.pipeline.route
        return route is not None and route.attached

    @property
    def route(self) -> str | None:
        """How gradients arrived in the last connect(): "local", "data_parallel", "ddp" or "fsdp2"."""
        route = self.pipeline.route
        return None if route is None else route.name

    # ---- clipping, fp16 and the gradient norm ----

    def configure_clipping(self, max_grad_norm: float | None, mode: str | ClipMode = "exact") -> None:
        """Apply `max_grad_norm` (`<= 0` or `None`: no clipping) the way `mode` (a `layerwise_clip` value) says."""
        clipper = make_clipper(max_grad_norm, mode)
        if self.pipeline.scaling.enabled:
            check_fp16_clip_mode(clipper.mode.value, True, clipper.max_grad_norm)
        self.pipeline.clipper = clipper

    def use_grad_scaler(self, scaler: Any) -> None:
        """Step under fp16 loss scaling with Accelerate's `accelerator.scaler` (`None`: none); see `grad_scaler`."""
        pipeline = self.pipeline
        if scaler is not None and not scaler.is_enabled():
            scaler = None
        if scaler is None:
            pipeline.scaling = NoLossScaling()
            return
        check_fp16_clip_mode(pipeline.clipper.mode.value, True, pipeline.clipper.max_grad_norm)
        check_fp16_weights(zip(self.names, pipeline.params))
        pipeline.scaling = GradScalerBridge(scaler, self, pipeline.backward_end, route=lambda: pipeline.route)

    def grad_norm(self) -> torch.Tensor | None:
        """The pre-clip global norm of this step's (or, after `step()`, the last step's) gradients, as
        `clip_grad_norm_` returns it (with fp16, of the unscaled gradients; inf/nan on a step GradScaler skips)."""
        pipeline = self.pipeline
        pipeline.close_skipped_window()
        if not pipeline.window.measured and pipeline.sync_gradients():
            pipeline.scaling.unscale_held(self, pipeline.params)
        current = pipeline.total_norm()
        if current is None and not pipeline.wants_norms():
            # Norms of gradients that already stepped were not measured: nobody asked for them until now.
            logger.warning(
                "grad_norm() was read, but gradient norms were not measured (no clipping, track_grad_norm=False); "
                "measuring from the next step on. Pass track_grad_norm=True to build_layerwise_optimizer to have it "
                "from the start."
            )
            pipeline.track_grad_norm = True
        return current if current is not None else pipeline.last_grad_norm

    def __repr__(self) -> str:
        kinds = sorted({type(inner).__name__ for inner in self.inner})
        return f"LayerwiseOptimizer({self.optimizer_name or '/'.join(kinds)}, {len(self.inner)} parameters)"


def _check_params(params: Sequence[LayerwiseParam]) -> None:
    if not params:
        raise ValueError("LayerwiseOptimizer got no trainable parameters (every parameter has requires_grad=False).")
    seen = set()
    for lp in params:
        if not lp.param.requires_grad:
            raise ValueError(f"{lp.name} has requires_grad=False: frozen parameters get no optimizer.")
        if id(lp.param) in seen:
            raise ValueError(f"{lp.name} is listed twice (tied parameters must appear once).")
        seen.add(id(lp.param))


def _build_inner(factory: LayerwiseFactory, lp: LayerwiseParam, args: Any) -> torch.optim.Optimizer:
    try:
        inner = factory(lp, args)
    except Exception as err:
        # An optimizer's own error ("Muon only supports 2D parameters") does not say which tensor it refused.
        where = f"building the {getattr(args, 'optim', 'layer-wise')} optimizer of {lp.name} {tuple(lp.param.shape)}"
        if not err.args or not isinstance(err.args[0], str):
            raise RuntimeError(f"{type(err).__name__} while {where}: {err}") from err
        err.args = (f"{err.args[0]} [{where}]", *err.args[1:])  # the same type: callers may catch it
        raise
    groups = getattr(inner, "param_groups", None)
    if not groups or len(groups) != 1 or len(groups[0]["params"]) != 1 or groups[0]["params"][0] is not lp.param:
        raise ValueError(
            f"The factory for {lp.name} must return an optimizer with exactly one param group holding exactly "
            f"that parameter; got {type(inner).__name__} with {len(groups or [])} group(s)."
        )
    groups[0]["name"] = canonical_name(lp.name)
    return inner


def check_fsdp2_supported(optimizer: LayerwiseOptimizer) -> None:
    """
    Refuse inner optimizers whose update of a shard differs from the update of the whole tensor (a route that steps
    FSDP2 shards is attached only after this check).

    Args:
        optimizer (`LayerwiseOptimizer`):
            The optimizer whose inner optimizers would step FSDP2 shards.

    Example:

    ```python
    >>> from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer
    >>> from layerwise_hf.optim.optimizer import check_fsdp2_supported
    >>> args = LayerwiseTrainingArguments("out", optim="adafactor_layerwise")
    >>> check_fsdp2_supported(build_layerwise_optimizer(model, args))
    Traceback (most recent call last):
        ...
    ValueError: adafactor_layerwise (Adafactor) cannot step FSDP2 shards: its update is not elementwise ...
    ```
    """
    # A host-stepped optimizer (layerwise_offload="optimizer") steps a plain copy of the local shard: its own update
    # is what must be elementwise.
    check_fsdp2_optimizers(optimizer.optimizer_name, [getattr(i, "host_base", i) for i in optimizer.inner])


def check_layerwise_arguments(args: Any) -> None:
    """
    Refuse a bad `layerwise_*` field of `args` (`None`, a wrong type or value) naming the field and its valid values,
    before anything is built: `LayerwiseTrainingArguments` checks them when made, and `build_layerwise_optimizer`
    again, since a dataclass field can be reassigned later. Arguments without these fields pass.

    Example:

    ```python
    >>> from types import SimpleNamespace
    >>> from layerwise_hf.optim.optimizer import check_layerwise_arguments
    >>> check_layerwise_arguments(SimpleNamespace(layerwise_clip="previous"))
    >>> check_layerwise_arguments(SimpleNamespace(layerwise_clip=None))
    Traceback (most recent call last):
        ...
    ValueError: layerwise_clip=None is not a clipping mode: choose one of exact, previous, per_param, off ...
    ```
    """
    if hasattr(args, "layerwise_clip"):
        ClipMode.parse(args.layerwise_clip, argument="layerwise_clip")
    if hasattr(args, "layerwise_accept_nonfinite_state"):
        check_bool_argument("layerwise_accept_nonfinite_state", args.layerwise_accept_nonfinite_state)
    if hasattr(args, "layerwise_norm_pass"):
        norm_pass.parse_norm_pass(args.layerwise_norm_pass, argument="layerwise_norm_pass")
    if hasattr(args, "layerwise_offload"):
        parse_offload(args.layerwise_offload)


def build_layerwise_optimizer(
    model: nn.Module,
    args: Any,
    *,
    decay_parameter_names: Iterable[str] | None = None,
    factory: LayerwiseFactory | None = None,
    sync_gradients: Callable[[], bool] | None = None,
    track_grad_norm: bool = False,
    local_shards: bool = False,
    offload: str | None = None,
    host_step: str | None = None,
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
        track_grad_norm (`bool`, *optional*, defaults to `False`):
            See `LayerwiseOptimizer`; turn it on to read `grad_norm()` without clipping.
        local_shards (`bool`, *optional*, defaults to `False`):
            The model will be FSDP2-sharded: optimizers that cannot step a DTensor (bitsandbytes', Adafactor) step
            each rank's local shard (`layerwise_hf.placement.local_shard`).
        offload (`str`, *optional*, defaults to `args.layerwise_offload` or `"none"`):
            `"gradients"`: gradients wait in host buffers for the step; `"optimizer"`: optimizer states and a copy of
            each parameter live on the host, stepped there during backward (see `enable_offload`).
        host_step (`str`, *optional*, defaults to `args.layerwise_host_step`):
            The host step's kernel (`layerwise_hf.placement.host_kernel`).

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
    ...                                      num_hidden_layers=2, num_attention_heads=4))
    >>> args = LayerwiseTrainingArguments("out", optim="adamw_torch_layerwise", learning_rate=1e-3)
    >>> optimizer = build_layerwise_optimizer(model, args)
    >>> optimizer.attach()  # plain loop: loss.backward() steps every layer; then optimizer.step()
    ```
    """
    check_layerwise_arguments(args)
    for argument, value in (("track_grad_norm", track_grad_norm), ("local_shards", local_shards)):
        check_bool_argument(argument, value)
    params, decay = _layerwise_params(model, args.weight_decay, decay_parameter_names)
    if factory is None:
        factory = resolve_factory(args, model)
    if local_shards:
        factory = wrap_local_shards(factory)
    mode = parse_offload(getattr(args, "layerwise_offload", "none") if offload is None else offload, "offload")
    factory, runner = host_step_factory(factory, mode, host_step)
    optimizer = LayerwiseOptimizer(
        params,
        factory,
        args,
        optimizer_name=str(getattr(args.optim, "value", args.optim)),
        sync_gradients=sync_gradients,
        in_decay_group=[lp.name in decay for lp in params],
        track_grad_norm=track_grad_norm,
    )
    enable_offload(optimizer, mode, runner=runner)
    return optimizer


def enable_offload(
    optimizer: LayerwiseOptimizer,
    mode: str = "gradients",
    transfer: Transfer | None = None,
    max_in_flight: int = 2,
    runner: HostRunner | None = None,
) -> None:
    """
    Hold `optimizer`'s gradients in host memory between their backward and their step (`layerwise_offload`).

    With `mode="gradients"` every gradient that would wait on the device (each micro-batch's under gradient
    accumulation; every one with exact clipping, whose step needs the global norm) is copied to a host buffer during
    backward and freed on the device; `step()` copies each back and steps it, the next copy overlapping the step
    (`layerwise_hf.placement.offload`). Exact clipping then needs one forward and one backward per micro-batch, and
    gradient accumulation keeps only the gradients in flight on the device. Without either, gradients step in
    backward as without offload. Under fp16 loss scaling every gradient waits too: each is unscaled and inf-checked
    as it is offloaded, and GradScaler gets the flags at the end of the window's last backward
    (`GradScalerBridge.publish_at_end`), so a step it skips changes no parameter and no state.

    With `mode="optimizer"` (only through `build_layerwise_optimizer(offload="optimizer")`, which wraps each inner
    optimizer in a `layerwise_hf.placement.host_step.HostStepOptimizer` before any state exists) each parameter's
    optimizer state and a host copy of the parameter live in host memory: a final gradient is copied to the host and
    freed, a host worker steps it while backward goes on, and the updated parameter is copied back before the next
    forward (`wait_for_host_steps` for reading the weights otherwise). Gradients that wait for the step (GA, exact
    clipping) wait in host buffers as with `"gradients"` and are stepped from there.

    Without CUDA offload saves nothing (one memory); it runs the same path with a copy thread for the side stream
    (`ThreadTransfer`) and warns, unless `LAYERWISE_HF_OFFLOAD_SIMULATE=1`. A model over several GPUs is refused.

    Args:
        optimizer (`LayerwiseOptimizer`): the optimizer to offload (its pipeline gets the offload stage).
        mode (`str`, *optional*, defaults to `"gradients"`): `"gradients"` (`"none"` turns offload off).
        transfer (`Transfer`, *optional*): the device's copies (`layerwise_hf.placement.transfer`); by default chosen
            at the first copy for the gradient's device (so the model may move to the GPU after this call).
        max_in_flight (`int`, *optional*, defaults to `2`): copies to the host in flight at once.
        runner (`HostRunner`, *optional*): the host steps' transfer and worker (`mode="optimizer"`).

    Example:

    ```python
    >>> from layerwise_hf.optim.optimizer import build_layerwise_optimizer
    >>> optimizer = build_layerwise_optimizer(model, args, offload="gradients")  # or args.layerwise_offload
    ```
    """
    pipeline = optimizer.pipeline
    pipeline.offload.close()
    pipeline.offload = NO_OFFLOAD
    stage = offload_stage(
        mode, optimizer.optimizer_name, pipeline.params, optimizer.inner, transfer, max_in_flight, runner
    )
    if stage is not None:
        pipeline.offload = stage


def offload_of(optimizer: LayerwiseOptimizer) -> GradientOffload | None:
    """The host offload of `optimizer` (`enable_offload`), or `None`: its host buffers and device-side counters."""
    return optimizer.pipeline.offload.buffers


def _layerwise_params(
    model: nn.Module, weight_decay: float, decay_parameter_names: Iterable[str] | None
) -> tuple[list[LayerwiseParam], set[str]]:
    if decay_parameter_names is None:
        from transformers import Trainer

        # NOTE: Trainer.get_decay_parameter_names does not use `self`; calling it keeps the split identical.
        decay_parameter_names = Trainer.get_decay_parameter_names(None, model)
    decay = set(decay_parameter_names)
    embedding_params = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and getattr(m, "weight", None) is not None
    }
    params = [
        LayerwiseParam(n, p, weight_decay if n in decay else 0.0, is_embedding=id(p) in embedding_params)
        for n, p in model.named_parameters()
        if p.requires_grad
    ]
    return params, decay


def unwrap_layerwise_optimizer(optimizer: Any) -> LayerwiseOptimizer | None:
    """
    The `LayerwiseOptimizer` inside Accelerate's (or any) `.optimizer` wrapper chain, or `None`.

    Example:

    ```python
    >>> from layerwise_hf import unwrap_layerwise_optimizer
    >>> layerwise = unwrap_layerwise_optimizer(trainer.optimizer)  # through AcceleratedOptimizer
    ```
    """
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, LayerwiseOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None
