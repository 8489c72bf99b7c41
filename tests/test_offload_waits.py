"""The waits of host offload that only a slow copy, a late free or another stream's collective can show (issue 36,
"Waits no test needs"): each test here fails when the wait it names is removed from `layerwise_hf`, and passes with
it. Run under the fake CUDA of `tests/cuda_fake.py` (torch's CUDA sanitizer) or with `ThreadTransfer`'s slow copies.
"""

import gc
import time

import pytest
import torch
from cuda_fake import FakeCuda, all_reduce_on_its_own_stream
from helpers import assert_params_equal
from test_offload_csan import _batches, _mlp, offload_loop, reference_run

from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
from layerwise_hf.integrations.callback import end_training
from layerwise_hf.optim.optimizer import enable_offload
from layerwise_hf.placement import offload as offload_module
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.routes.data_parallel import DataParallelConfig, DataParallelReducer

# ---- CudaTransfer.copy's record_stream ----


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_a_gradient_freed_while_its_copy_out_reads_it_is_not_handed_out_again(mode):
    # Offload frees each gradient as soon as its copy out is queued on the side stream; the caching allocator must
    # not give the block to the compute stream before that copy has read it (CudaTransfer.copy's record_stream).
    with FakeCuda() as fake:
        assert fake.check_reuse
        model, _ = offload_loop(mode, 4, 0.0, steps=2)
    assert_params_equal(model, reference_run(4, 0.0, steps=2))


# ---- CudaTransfer.close()'s synchronize ----


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_host_blocks_freed_after_offload_is_turned_off_are_not_read_by_a_copy_back(mode):
    # Turning offload off closes it (`enable_offload(..., "none")`); the pinned blocks are unregistered and freed
    # when the optimizer goes. The last copies back were waited for on the device only: close() must wait for them
    # on the host, or the host frees memory a copy back may still read.
    with FakeCuda() as fake:
        _, optimizer = offload_loop(mode, 4, 0.0, steps=1)
        assert fake.registered
        enable_offload(optimizer, "none")
        del optimizer
        gc.collect()
        assert not fake.registered  # every block was unregistered inside the fake
        assert not fake.errors, fake.errors[0]


# ---- GradientOffload._make_room's wait ----


def test_the_device_holds_at_most_max_in_flight_gradients_being_copied_out():
    # Each gradient is freed on the device once its copy out is queued, but its memory lives until the copy has run
    # (record_stream; the copy thread's reference here). With slow copies, the hook must wait for the oldest copy
    # before starting another, or every gradient of the backward is alive at once.
    transfer = transfer_module.ThreadTransfer(delay=0.02)
    copy, started, most = transfer.copy, [], [0]

    def counted(dst, src, after=None):
        alive = [t for t, out in started if out and not t.done()]
        most[0] = max(most[0], len(alive) + (after is None))
        ticket = copy(dst, src, after)
        started.append((ticket, after is None))
        return ticket

    transfer.copy = counted
    model = _mlp()
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    optimizer = LayerwiseOptimizer(params, lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2))
    optimizer.configure_clipping(0.5, "exact")  # every gradient waits on the host for the global norm
    enable_offload(optimizer, "gradients", transfer=transfer, max_in_flight=2)
    optimizer.attach()
    for (x,) in _batches(1, 2):
        model(x).pow(2).sum().backward()
        optimizer.step()
    end_training(optimizer)
    assert len(started) >= 2 * 2 * len(params)  # out and back, each step
    assert most[0] <= 2, most[0]
    assert_params_equal(model, reference_run(1, 0.5, steps=2))


# ---- GradientOffload.merge_into's wait (the data-parallel route under a DDP config) ----


def data_parallel_offload(ga, steps=2, transfer=None):
    model = _mlp()
    sync = [True]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    optimizer = LayerwiseOptimizer(
        params, lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), sync_gradients=lambda: sync[0]
    )
    enable_offload(optimizer, "gradients", transfer=transfer or transfer_module.CudaTransfer(torch.device("cuda", 0)))
    optimizer.connect(route=DataParallelReducer(model, DataParallelConfig()))
    optimizer.attach()
    try:
        for window in _batches(ga, steps):
            for k, x in enumerate(window):
                sync[0] = k == ga - 1  # reduced once per window: the earlier micro-batches wait summed on the host
                model(x).pow(2).sum().backward()
            optimizer.step()
    finally:
        end_training(optimizer)
    return model


def test_the_window_sum_is_brought_back_for_the_reduction_after_the_host_adds_into_it(one_rank_group):
    # Under a DDP config the route reduces once per window: each parameter's host sum of the earlier micro-batches is
    # copied back and added to the last one's gradient before the all-reduce (merge_into). The copy back must wait
    # for the host worker's adds into that sum.
    with FakeCuda():
        model = data_parallel_offload(3)
    assert_params_equal(model, reference_run(3, 0.0, steps=2))


def test_the_window_sum_with_slow_host_adds_is_the_standard_sum(one_rank_group, monkeypatch):
    # The CPU stand-in: adds slower than the copies (a busy host), so the copy back would read a partial sum.
    add = offload_module._add_after

    def slow_add(*args):
        time.sleep(0.01)
        add(*args)

    monkeypatch.setattr(offload_module, "_add_after", slow_add)
    model = data_parallel_offload(3, transfer=transfer_module.ThreadTransfer(delay=0.001))
    assert_params_equal(model, reference_run(3, 0.0, steps=2))


# ---- the DDP route's wait for the used-parameter flags ----


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_the_used_flags_are_read_after_their_all_reduce(one_rank_group):
    # With find_unused_parameters DDP all-reduces which parameters each rank used; the comm hook reads the flags
    # back (.tolist()) to skip a parameter no rank used. NCCL runs the all-reduce on its own stream: the read must
    # wait for that collective, not only for the bucket's.
    model = _WithUnused()
    with FakeCuda(), all_reduce_on_its_own_stream():
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        params = [LayerwiseParam(n, p, weight_decay=0.1) for n, p in model.named_parameters()]
        optimizer = LayerwiseOptimizer(params, lambda lp, _: torch.optim.SGD([lp.param], lr=1e-2, weight_decay=0.1))
        assert optimizer.connect(ddp) == "ddp"
        try:
            for (x,) in _batches(1, 2):
                ddp(x).pow(2).sum().backward()
                optimizer.step()
        finally:
            optimizer.detach()
    assert torch.equal(model.unused, torch.ones(4, 4))  # skipped: weight decay would have moved it
    assert not torch.equal(model.a.weight, _WithUnused().a.weight)
