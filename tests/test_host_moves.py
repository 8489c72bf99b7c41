"""Host-device moves per step with host offload stay O(1), not O(parameters) (issue 28, item 8).

On CUDA each move of a scalar between host and device is a copy that waits for the device. Two places made one per
parameter: the global norm stacked each parameter's norm on the first gradient's device one at a time (the norms of
host sums live on the host), and a host step moved the window's clip coefficient to the host for every parameter.
Without a GPU the devices are told apart with the meta device, and copies are counted as aten `_to_copy` calls.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layerwise_hf.optim.host_offload import HostCoefficient
from layerwise_hf.platform.norms import total_norm


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_the_global_norm_moves_the_norms_once_per_device_they_live_on():
    device = torch.device("meta")  # stands in for the accelerator: the parameters' device
    # The first norm was taken on the device; the next 40 on the host (gradients summed in host buffers).
    norms = [(device, torch.float32, torch.empty((), device=device))]
    norms += [(device, torch.float32, torch.tensor(float(k))) for k in range(40)]
    with CountCopies() as counted:
        result = total_norm(norms)
    assert result.device == device
    assert counted.copies == 1  # one stacked copy of the 40 host norms; one per norm before


def test_the_global_norm_of_norms_on_one_device_is_the_stacked_norm_bit_for_bit():
    cpu = torch.device("cpu")
    values = torch.randn(40).abs()
    norms = [(cpu, torch.float32, v) for v in values]
    with CountCopies() as counted:
        result = total_norm(norms)
    assert counted.copies == 0
    assert torch.equal(result, torch.linalg.vector_norm(values, 2.0))


def test_a_host_step_moves_the_windows_clip_coefficient_to_the_host_once():
    class DeviceScalar:
        """A clip coefficient on the device: each `.to(host)` is a device-to-host copy."""

        moves = 0

        def to(self, device):
            DeviceScalar.moves += 1
            return torch.tensor(0.5, device=device)

    on_host = HostCoefficient()  # what OffloadStage.step moves the coefficient with
    coef = DeviceScalar()
    host = [on_host(coef, torch.device("cpu")) for _ in range(50)]  # 50 parameters stepped on the host
    assert DeviceScalar.moves == 1 and all(h is host[0] for h in host)
    next_window = DeviceScalar()
    on_host(next_window, torch.device("cpu"))
    assert DeviceScalar.moves == 2  # a new step's coefficient is moved again
