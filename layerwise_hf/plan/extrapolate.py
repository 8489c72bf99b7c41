"""Identical decoder layers simulated a few at a time: the step of a 2-, 3- and 4-layer copy of the model, the peak
taken as linear in the number of layers from the first two, and used only when the third agrees to the byte (else the
full model is simulated). What each layer adds at the peak (its weights, gradients, state, saved activations) is the
same for every layer, so a peak that keeps its place in the step grows by the same bytes per layer."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from .simulate import SimulatedStep
from .tracker import CATEGORIES, Peak

POINTS = (2, 3, 4)
_INDEX = re.compile(r"\.\d+(?=\.|$|\s)")


def with_layers(config: Any, n: int) -> Any | None:
    """A copy of `config` with `n` decoder layers, or `None` when its layers are not all alike (per-layer lists such
    as `layer_types` with different entries) or it names no layer count."""
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        return None
    total = config.num_hidden_layers
    values = config.to_dict()
    per_layer = {k: v for k, v in values.items() if isinstance(v, list) and len(v) == total and total > 1}
    if any(len({repr(x) for x in v}) > 1 for v in per_layer.values()):
        return None
    smaller = copy.deepcopy(config)
    smaller.num_hidden_layers = n
    for key, value in per_layer.items():
        setattr(smaller, key, value[:n])
    return smaller


def _line(a: SimulatedStep, b: SimulatedStep, n_a: int, n_b: int, n: int) -> Peak:
    """The peak of `n` layers on the line through the peaks of `n_a` and `n_b` layers."""
    k = (n - n_a) // (n_b - n_a)
    by = {c: a.peak.by_category[c] + k * (b.peak.by_category[c] - a.peak.by_category[c]) for c in CATEGORIES}
    return Peak(sum(by.values()), by, a.peak.phase)


def _same_place(steps: list[SimulatedStep]) -> bool:
    # The peak falls at the same point of the step (layer indices aside) in every copy.
    return len({_INDEX.sub(".*", s.peak.phase) for s in steps}) == 1


def simulate_layers(config: Any, run: Callable[[Any], SimulatedStep]) -> tuple[SimulatedStep, bool]:
    """
    `run(config)`'s result for the full model, from copies of 2, 3 and 4 layers when that is exact; returns it and
    whether it was extrapolated.

    Args:
        config (`PretrainedConfig`): the full model's config.
        run (`Callable[[PretrainedConfig], SimulatedStep]`): simulates one step of a model built from a config.
    """
    total = getattr(config, "num_hidden_layers", 0)
    configs = [with_layers(config, n) for n in POINTS] if isinstance(total, int) and total > POINTS[-1] else []
    if not configs or any(c is None for c in configs):
        return run(config), False
    steps = [run(c) for c in configs]
    check = _line(steps[0], steps[1], POINTS[0], POINTS[1], POINTS[2])
    if not _same_place(steps) or check.by_category != steps[2].peak.by_category:
        return run(config), False
    a, b = steps[0], steps[1]
    peak = _line(a, b, POINTS[0], POINTS[1], total)
    peak.phase = _renumber(steps[2].peak.phase, POINTS[2], total)
    steady = a.steady_bytes + (total - POINTS[0]) * (b.steady_bytes - a.steady_bytes)
    return SimulatedStep(a.optimizer, peak, a.from_rule, steady), True


def _renumber(phase: str, n_small: int, n_full: int) -> str:
    """A phase named after layer `i` of the `n_small`-layer copy, named after the same place of the full model: the
    last layers keep their distance from the end, the first ones their index."""

    def sub(match: re.Match) -> str:
        i = int(match.group(0)[1:])
        return f".{i + n_full - n_small}" if i >= n_small // 2 else match.group(0)

    return _INDEX.sub(sub, phase)
