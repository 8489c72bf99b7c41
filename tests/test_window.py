"""The step window's decision table and its single reset, and the clipping modes, as parts of their own."""

import pytest
import torch

from layerwise_hf.optim.clipping import CLIP_MODES, ClipMode, clip_coef, make_clipper
from layerwise_hf.optim.grad_scaler import GradScalerBridge
from layerwise_hf.optim.window import Action, StepWindow
from layerwise_hf.platform.backward_end import BackwardEnd
from layerwise_hf.platform.norms import grad_norm_kernel


def test_decision_table():
    window = StepWindow(3)
    assert window.action(0, sync=False, whole_step=False) is Action.ACCUMULATE
    assert window.accumulating
    assert window.action(0, sync=True, whole_step=False) is Action.STEP
    assert window.action(0, sync=True, whole_step=False) is Action.REPEATED  # stepping twice is refused
    assert window.action(1, sync=True, whole_step=True) is Action.HOLD
    window.in_norm_pass = True
    assert window.action(2, sync=True, whole_step=True) is Action.MEASURE
    assert window.action(2, sync=True, whole_step=True) is Action.REPEATED
    window.in_norm_pass = False
    window.measured = True
    assert window.action(2, sync=True, whole_step=True) is Action.STEP  # measured: steps in the second pass


def test_reset_forgets_every_field():
    window = StepWindow(2)
    fresh = vars(StepWindow(2)).copy()
    window.action(0, sync=False, whole_step=False)
    window.action(1, sync=True, whole_step=True)
    window.stepped[0] = True
    window.measured = window.in_norm_pass = True
    _record(window, 0, _param_with_grad([3.0, 4.0]))
    window.reset()
    after = vars(window)
    assert set(after) == set(fresh)
    for key, value in fresh.items():
        assert after[key] == value, key


def test_each_stage_forgets_its_part_of_the_window():
    exact, previous = make_clipper(1.0, "exact"), make_clipper(1.0, "previous")
    exact.start_step(torch.tensor(4.0))
    previous.coef(torch.tensor(3.0), None)
    exact.end_window()
    previous.end_window()
    assert exact.coef(None, None) is None and previous.running_sq is None
    weight = torch.nn.Parameter(torch.ones(2))
    bridge = GradScalerBridge(torch.amp.GradScaler("cpu"), torch.optim.SGD([weight], lr=1.0), BackwardEnd())
    bridge.found_inf[torch.device("cpu")] = torch.tensor(1.0)
    bridge.capture()
    found_inf = bridge.found_inf
    bridge.end_window()
    assert bridge.scaler_record is None and not bridge.found_inf and not bridge.inv_scale
    # A new dict, not a cleared one: GradScaler.update() may still read the skipped window's flags.
    assert found_inf and bridge.found_inf is not found_inf


def _record(window, i, param):
    # What the pipeline's record_norm writes: the gradient's norm by clip_grad_norm_'s kernel, once per window.
    window.norms[i] = (param.device, param.grad.dtype, grad_norm_kernel(param.grad))


def _param_with_grad(values):
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values)
    return p


def test_total_norm_matches_clip_grad_norm():
    params = [_param_with_grad([3.0, 4.0]), _param_with_grad([1.0, 2.0, 2.0])]
    window = StepWindow(2)
    _record(window, 0, params[0])  # measured already; the other is still held in .grad
    expected = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    assert torch.equal(window.total_norm(params), expected)


@pytest.mark.parametrize("mode", CLIP_MODES)
def test_modes_parse_from_their_strings(mode):
    assert ClipMode.parse(mode).value == mode
    assert make_clipper(1.0, mode).mode is ClipMode(mode)
    assert make_clipper(0.0, mode).mode is ClipMode.OFF  # max_grad_norm <= 0 clips nothing whatever the mode


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="exact, previous, per_param, off"):
        ClipMode.parse("global")


def test_clippers():
    norm = torch.tensor(4.0)
    assert make_clipper(0.0).coef(norm, None) is None
    assert torch.equal(make_clipper(1.0, "per_param").coef(norm, None), clip_coef(1.0, norm))
    exact = make_clipper(1.0, "exact")
    exact.start_step(torch.tensor(10.0))
    assert torch.equal(exact.coef(norm, None), clip_coef(1.0, torch.tensor(10.0)))
    previous = make_clipper(1.0, "previous")
    # Bounded by the larger of the running norm of this step (sqrt(4^2 + 3^2) = 5) and the last step's norm.
    previous.coef(norm, None)
    assert torch.equal(previous.coef(torch.tensor(3.0), torch.tensor(2.0)), clip_coef(1.0, torch.tensor(5.0)))


@pytest.mark.parametrize(
    ("other", "seed"),
    [(torch.bfloat16, 5), (torch.bfloat16, 9), (torch.complex64, 1), (torch.complex64, 2), (torch.float64, 3)],
)
def test_total_norm_of_mixed_dtypes_is_clip_grad_norms(other, seed):
    # torch groups gradients by (device, dtype) in an order of its own (not first appearance) before stacking the
    # per-tensor norms: the total must be stacked in that order to be bit-identical. These seeds give a different
    # total in first-appearance order.
    g = torch.Generator().manual_seed(seed)
    params = []
    for k in range(40):
        dtype = other if k % 7 == 0 else torch.float32
        size = int(torch.randint(1, 3000, (1,), generator=g))
        scale = float(torch.rand(1, generator=g)) * 1000
        p = torch.nn.Parameter(torch.zeros(size, dtype=dtype))
        p.grad = (torch.randn(size, generator=g) * scale).to(dtype)
        params.append(p)
    window = StepWindow(len(params))
    for i, p in enumerate(params):
        _record(window, i, p)
    expected = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    assert torch.equal(window.total_norm(params), expected)
