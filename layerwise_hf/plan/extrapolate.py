"""Identical decoder layers simulated a few at a time: the step of a 2-, 3- and 4-layer copy of the model (or 3-5,
and so on up to `MAX_LAYERS`), the peak taken as linear in the number of layers from the first two, and used only when
the third agrees to the byte (else the full model is simulated). What each layer adds at the peak (its weights,
gradients, state, saved activations) is the same for every layer, so a peak that keeps its place in the step grows by
the same bytes per layer."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from .simulate import SimulatedStep
from .tracker import CATEGORIES, Peak

POINTS = (2, 3, 4)
MAX_LAYERS = 8  # the largest copy tried before the full model
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


def _line(a: Peak, b: Peak, n_a: int, n_b: int, n: int) -> Peak:
    """The peak of `n` layers on the line through the peaks of `n_a` and `n_b` layers."""
    k = (n - n_a) // (n_b - n_a)
    by = {c: a.by_category[c] + k * (b.by_category[c] - a.by_category[c]) for c in CATEGORIES}
    return Peak(sum(by.values()), by, a.phase)


def _on_line(a: SimulatedStep, b: SimulatedStep, c: SimulatedStep, points: tuple[int, int, int]) -> bool:
    # Every place in the step (layer indices aside) has its peak on one line through the three copies, and what
    # stays between steps too: then the full model's peak is the largest of the places' lines.
    if not (a.phase_peaks.keys() == b.phase_peaks.keys() == c.phase_peaks.keys()):
        return False
    for key, peak in c.phase_peaks.items():
        if _line(a.phase_peaks[key], b.phase_peaks[key], *points).by_category != peak.by_category:
            return False
    steady = {k: 2 * b.steady_by_category[k] - a.steady_by_category[k] for k in a.steady_by_category}
    # Offload's host side (its buffers, copies and states, one set per layer) and the joint peak on a line too.
    host = _line(a.host_peak, b.host_peak, *points).by_category == c.host_peak.by_category
    joint = 2 * b.combined_peak - a.combined_peak == c.combined_peak
    return steady == c.steady_by_category and host and joint


def simulate_layers(config: Any, run: Callable[[Any], SimulatedStep]) -> tuple[SimulatedStep, bool]:
    """
    `run(config)`'s result for the full model, from copies of a few layers when that is exact; returns it and whether
    it was extrapolated. Copies of 2, 3 and 4 layers first; when the first copy is not on the line yet (its peak
    meets the model's edge: under FSDP2 a reduce-scatter buffer of the head's unit instead of a layer's), the window
    moves up by one layer, up to `MAX_LAYERS`, before the full model is simulated. Each place in the step is
    extended on its own line, and the largest is the full model's peak: the place of the peak can move with the
    number of layers (under FSDP2 a standard optimizer's step, whose temporaries grow with every layer, overtakes
    backward, whose unsharded units do not).

    Args:
        config (`PretrainedConfig`): the full model's config.
        run (`Callable[[PretrainedConfig], SimulatedStep]`): simulates one step of a model built from a config.
    """
    total = getattr(config, "num_hidden_layers", 0)
    if not isinstance(total, int) or total <= POINTS[-1] or any(with_layers(config, n) is None for n in POINTS):
        return run(config), False
    steps: dict[int, SimulatedStep] = {}
    for first in range(POINTS[0], min(MAX_LAYERS, total - 1) - 1):
        points = (first, first + 1, first + 2)
        for n in points:
            if n not in steps:
                steps[n] = run(with_layers(config, n))
        a, b, c = (steps[n] for n in points)
        if not _on_line(a, b, c, points):
            continue
        lines = {key: _line(a.phase_peaks[key], b.phase_peaks[key], points[0], points[1], total)
                 for key in c.phase_peaks}  # fmt: skip
        key = max(lines, key=lambda k: lines[k].total)
        peak = lines[key]
        peak.phase = _renumber(b.phase_peaks[key].phase, c.phase_peaks[key].phase, points[2], total)
        k = total - points[0]
        split = {x: a.steady_by_category[x] + k * (b.steady_by_category[x] - a.steady_by_category[x])
                 for x in a.steady_by_category}  # fmt: skip
        host = _line(a.host_peak, b.host_peak, points[0], points[1], total)
        host.phase = _renumber(b.host_peak.phase, c.host_peak.phase, points[2], total)
        joint = a.combined_peak + k * (b.combined_peak - a.combined_peak)
        step = SimulatedStep(a.optimizer, peak, a.from_rule, sum(split.values()), split, offload=a.offload)
        step.host_peak, step.combined_peak = host, joint
        step.backward_flops = a.backward_flops + k * (b.backward_flops - a.backward_flops)  # each layer adds its own
        return step, True
    return run(config), False


def _renumber(previous: str, phase: str, n_small: int, n_full: int) -> str:
    """A phase named after layer `i` of the `n_small`-layer copy, named after the same place of the full model. The
    copy one layer smaller names it `previous`: an index that stays keeps its distance from the first layer (under
    FSDP2 on gloo the norm pass peaks at layer 2 of 5, 6 or 7), one that moves with the layers its distance from the
    last; where the two copies do not tell, the last layers keep their distance from the end, the first ones their
    index."""
    before = [int(m.group(0)[1:]) for m in _INDEX.finditer(previous)]
    indices = iter(before if len(before) == len(_INDEX.findall(phase)) else [None] * len(_INDEX.findall(phase)))

    def sub(match: re.Match) -> str:
        i, j = int(match.group(0)[1:]), next(indices)
        from_end = i == j + 1 if j is not None and j in (i, i - 1) else i >= n_small // 2
        return f".{i + n_full - n_small}" if from_end else match.group(0)

    return _INDEX.sub(sub, phase)
