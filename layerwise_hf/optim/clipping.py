"""Gradient clipping when each layer steps during backward: the pipeline's clipping stage, one object per mode, and
the clip coefficient.

The norm kernels are torch's own (`layerwise_hf.platform.norms`, re-exported here) and the clip coefficient has the
expression of `_clip_grads_with_norm_`, so exact clipping is bit-identical to Trainer's.
"""

from __future__ import annotations

import enum

import torch

from ..bases.support import check_max_grad_norm
from ..platform.norms import grad_norm_kernel as grad_norm_kernel
from ..platform.norms import mesh_of, whole
from ..platform.norms import total_norm as total_norm


class ClipMode(str, enum.Enum):
    """
    How `max_grad_norm` is applied when each layer steps during backward. The values are the strings accepted by
    `LayerwiseTrainingArguments(layerwise_clip=...)` and `LayerwiseOptimizer.configure_clipping`.

    - `exact`: Trainer's global `clip_grad_norm_`, bit for bit. With gradient accumulation the gradients are held
      anyway, so the step waits for the window's end (no extra cost). Without it, the driver runs a norm pass first
      (`backward_with_norm_pass` / `run_with_norm_pass`): it only measures the norm, the second pass clips and steps.
      Without a norm pass the gradients are held until `step()` (exact, but no memory saving).
    - `previous`: one pass; scale by the previous step's global norm, or by the norm of this step's gradients seen
      so far when that is larger. Every tensor's applied gradient is bounded by `max_grad_norm` even on a spike.
    - `per_param`: one pass; clip each parameter's gradient to `max_grad_norm` on its own.
    - `off`: no clipping.

    Example:

    ```python
    >>> from layerwise_hf.optim.clipping import ClipMode
    >>> ClipMode("exact") is ClipMode.EXACT, ClipMode.PER_PARAM.value
    (True, 'per_param')
    ```
    """

    EXACT = "exact"
    PREVIOUS = "previous"
    PER_PARAM = "per_param"
    OFF = "off"

    @classmethod
    def parse(cls, mode: str | ClipMode, argument: str = "layerwise_clip") -> ClipMode:
        """
        The mode a string (or a `ClipMode`) names; anything else raises `ValueError` naming `argument` and the valid
        values.

        Example:

        ```python
        >>> from layerwise_hf.optim.clipping import ClipMode
        >>> ClipMode.parse("previous")
        <ClipMode.PREVIOUS: 'previous'>
        >>> ClipMode.parse(None)
        Traceback (most recent call last):
            ...
        ValueError: layerwise_clip=None is not a clipping mode: choose one of exact, previous, per_param, off ...
        ```
        """
        value = getattr(mode, "value", mode)
        if isinstance(value, str) and value in cls._value2member_map_:
            return cls(value)
        choices = ", ".join(m.value for m in cls)
        raise ValueError(
            f"{argument}={mode!r} is not a clipping mode: choose one of {choices} (how max_grad_norm is applied with "
            "a layer-wise optimizer; max_grad_norm <= 0 turns clipping off whatever the mode)."
        )


CLIP_MODES = tuple(m.value for m in ClipMode)


def clip_coef(max_grad_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """
    The factor that brings a gradient of norm `norm` down to `max_grad_norm` (at most 1: never scaled up).

    Args:
        max_grad_norm (`float`):
            The largest norm allowed.
        norm (`torch.Tensor`):
            The norm measured (one gradient's, or the step's global norm).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.clipping import clip_coef
    >>> clip_coef(1.0, torch.tensor(4.0)), clip_coef(1.0, torch.tensor(0.5))
    (tensor(0.2500), tensor(1.))
    ```
    """
    # NOTE: the expression of torch's `_clip_grads_with_norm_`, so exact clipping is bit-identical.
    return torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)


class Clipper:
    """
    One clipping mode, the clipping stage of the pipeline: what it computes for a step (exact clipping's factor,
    `previous` clipping's running sum) is its own, forgotten by `end_window()`. A mode that `needs_global_norm` is
    given the step's total first (`start_step`).

    Args:
        max_grad_norm (`float`, *optional*, defaults to `0.0`):
            The norm to clip to; build one with `make_clipper`, which turns `<= 0` into no clipping.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.clipping import make_clipper
    >>> clipper = make_clipper(1.0, "per_param")
    >>> clipper.coef(torch.tensor(4.0), None)
    tensor(0.2500)
    ```
    """

    mode = ClipMode.OFF
    needs_global_norm = False  # every gradient's norm before any layer steps (exact)
    needs_param_norm = False  # each gradient's own norm as it steps

    def __init__(self, max_grad_norm: float = 0.0):
        self.max_grad_norm = max_grad_norm
        self.end_window()

    def end_window(self) -> None:
        """Forget what this step computed (the window ended, or was cut short)."""

    def start_step(self, total: torch.Tensor | None) -> None:
        """Called once the step's global norm is known."""

    def coef(self, norm: torch.Tensor | None, last_norm: torch.Tensor | None) -> torch.Tensor | None:
        """The factor for the gradient whose norm is `norm`, or `None` to leave it as it is."""
        return None


class _NoClip(Clipper):
    pass


class _ExactClip(Clipper):
    mode = ClipMode.EXACT
    needs_global_norm = True
    needs_param_norm = True

    def end_window(self):
        self.factor: torch.Tensor | None = None  # the step's one factor

    def start_step(self, total):
        self.factor = clip_coef(self.max_grad_norm, total) if total is not None else None

    def coef(self, norm, last_norm):
        return self.factor


class _PerParamClip(Clipper):
    mode = ClipMode.PER_PARAM
    needs_param_norm = True

    def coef(self, norm, last_norm):
        return clip_coef(self.max_grad_norm, norm)


class _PreviousClip(Clipper):
    mode = ClipMode.PREVIOUS
    needs_param_norm = True

    def end_window(self):
        self.running_sq: torch.Tensor | None = None  # squares of the norms seen so far this step

    def coef(self, norm, last_norm):
        sq = norm.float().square()
        running = self.running_sq
        if running is not None and mesh_of(running) != mesh_of(sq):
            # Norms on two meshes (tensor parallel x FSDP2) or a DTensor's and a plain one cannot be added.
            running, sq = whole(running), whole(sq)
        self.running_sq = sq if running is None else running + sq.to(running.device)
        bound = self.running_sq.sqrt()
        if last_norm is not None:
            bound = torch.maximum(bound, last_norm.float().to(bound.device))
        return clip_coef(self.max_grad_norm, bound)


_CLIPPERS = {c.mode: c for c in (_NoClip, _ExactClip, _PerParamClip, _PreviousClip)}


def make_clipper(max_grad_norm: float | None, mode: str | ClipMode = ClipMode.EXACT) -> Clipper:
    """
    The clipper for `mode`; `max_grad_norm <= 0` or `None` clips nothing whatever the mode.

    Args:
        max_grad_norm (`float`, *optional*):
            Trainer's `max_grad_norm`; `None` or `<= 0`: no clipping.
        mode (`str` or `ClipMode`, *optional*, defaults to `"exact"`):
            One of `"exact"`, `"previous"`, `"per_param"`, `"off"`.

    Example:

    ```python
    >>> from layerwise_hf.optim.clipping import make_clipper
    >>> make_clipper(1.0, "per_param").mode.value
    'per_param'
    >>> make_clipper(None, "exact").mode.value  # nothing to clip to
    'off'
    ```
    """
    mode = ClipMode.parse(mode)
    max_grad_norm = float(check_max_grad_norm(max_grad_norm) or 0.0)
    resolved = mode if max_grad_norm > 0 else ClipMode.OFF
    return _CLIPPERS[resolved](max_grad_norm)
