"""Gradient accumulation with host offload: each later micro-batch's gradient is staged in a pinned host buffer until
the host worker has added it into the window's sum. A worker that falls behind must hold the hook back, not let
staging buffers pile up: at most `max_staged` are in use at once, and the pinned bytes stay what the plan counts."""

import contextlib
import threading
import time
from unittest import mock

import pytest
import torch
from cuda_fake import FakeCuda
from helpers import assert_params_equal
from test_offload_csan import _mlp, offload_loop, reference_run

from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
from layerwise_hf.estimate import offload as estimate_offload
from layerwise_hf.optim.optimizer import enable_offload, offload_of
from layerwise_hf.placement import offload as offload_module
from layerwise_hf.placement.offload import GradientOffload
from layerwise_hf.placement.transfer import ThreadTransfer

GA = 5  # 4 staged gradients per parameter and window: 24 for the 6 tensors of the MLP


class SlowAdds:
    """While it lasts, the host worker's add takes `seconds` longer; it counts the staged gradients submitted and not
    yet added (each holds its staging buffer), and samples `pinned()` whenever one is submitted or added. Enter it
    inside `FakeCuda`, whose `HostWorker.submit` it wraps."""

    def __init__(self, seconds=0.02, pinned=lambda: 0):
        self.seconds, self.pinned = seconds, pinned
        self.lock = threading.Lock()
        self.waiting = self.most = self.submitted = self.most_pinned = 0
        self.patches = contextlib.ExitStack()

    def __enter__(self):
        add, submit = offload_module._add_after, offload_module.HostWorker.submit

        def slow_add(*args):
            time.sleep(self.seconds)
            add(*args)
            with self.lock:
                self.waiting -= 1
                self.most_pinned = max(self.most_pinned, self.pinned())

        def counted(worker, fn, *args):
            if fn is slow_add:
                with self.lock:
                    self.waiting += 1
                    self.submitted += 1
                    self.most = max(self.most, self.waiting)
            future = submit(worker, fn, *args)
            with self.lock:
                self.most_pinned = max(self.most_pinned, self.pinned())
            return future

        self.patches.enter_context(mock.patch.object(offload_module, "_add_after", slow_add))
        self.patches.enter_context(mock.patch.object(offload_module.HostWorker, "submit", counted))
        return self

    def __exit__(self, *exc):
        self.patches.close()


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_a_slow_host_worker_holds_the_hook_back_instead_of_piling_up_pinned_staging_buffers(mode):
    reference = reference_run(GA, 0.5, steps=2)
    fake = FakeCuda()
    model = _mlp()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    with fake, SlowAdds(pinned=lambda: fake.pinned_bytes) as slow:
        model, optimizer = offload_loop(mode, GA, 0.5, steps=2, model=model)
    offload = offload_of(optimizer)
    assert slow.submitted == 2 * (GA - 1) * len(sizes)
    # Without the bound the hook ran ahead of the 20 ms adds: 22 of the first window's 24 were waiting at once.
    assert slow.most <= offload.max_staged, (slow.most, offload.max_staged)
    # The staging buffers are part of the pinned bytes the plan counts, which the run never exceeds.
    assert slow.most_pinned == estimate_offload.pinned_bytes(mode, sizes, GA), (slow.most_pinned, sizes)
    assert_params_equal(model, reference)


def test_the_bound_holds_with_the_cpu_stand_in_and_matches_the_unoffloaded_optimizer():
    # The path a CPU-only run takes (ThreadTransfer): the same bound, bit-identical to layer-wise without offload.

    def run(offloaded):
        model = _mlp()
        sync = [True]
        params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
        optimizer = LayerwiseOptimizer(
            params, lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), sync_gradients=lambda: sync[0]
        )
        optimizer.configure_clipping(0.5, "exact")
        if offloaded:
            enable_offload(optimizer, "gradients", transfer=ThreadTransfer(0.002))
        optimizer.attach()
        torch.manual_seed(1)
        for _ in range(2):
            for k in range(GA):
                sync[0] = k == GA - 1
                model(torch.randn(5, 8)).pow(2).sum().backward()
            optimizer.step()
        optimizer.detach()
        return model, optimizer

    plain, _ = run(False)
    with SlowAdds() as slow:
        model, optimizer = run(True)
    assert slow.submitted == 2 * (GA - 1) * 6
    assert slow.most <= offload_of(optimizer).max_staged, slow.most
    assert_params_equal(model, plain)


def test_max_staged_is_checked_and_the_planner_counts_the_default():
    with pytest.raises(ValueError, match="max_staged=0"):
        GradientOffload(max_staged=0)
    assert GradientOffload().max_staged == estimate_offload.MAX_STAGED
