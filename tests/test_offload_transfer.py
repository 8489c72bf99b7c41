"""The device-asynchrony interface of host offload: the CPU stand-in really copies on another thread, late."""

import gc
import weakref

import pytest
import torch

from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.transfer import CudaTransfer, ThreadTransfer, make_transfer


def test_copy_runs_later_on_another_thread_and_the_ticket_says_when():
    transfer = ThreadTransfer(delay=0.05)
    src = torch.arange(6.0)
    dst = torch.zeros(6)
    ticket = transfer.copy(dst, src)
    # Read before waiting: the stand-in has not copied yet, as a side stream would not have.
    assert not ticket.done() and torch.equal(dst, torch.zeros(6))
    ticket.wait_host()
    assert ticket.done() and torch.equal(dst, src)
    transfer.close()


def test_copies_run_in_the_order_they_were_started():
    # One side stream: a copy back into a buffer is ordered after the copy out of it.
    transfer = ThreadTransfer(delay=0.002)
    buffer = torch.zeros(4)
    out = torch.zeros(4)
    transfer.copy(buffer, torch.full((4,), 3.0))
    last = transfer.copy(out, buffer)
    last.wait_device()
    assert torch.equal(out, torch.full((4,), 3.0))
    transfer.close()


def test_a_freed_source_lives_until_its_copy_has_run():
    transfer = ThreadTransfer(delay=0.05)
    src = torch.full((1000,), 7.0)
    alive = weakref.ref(src)
    dst = torch.zeros(1000)
    ticket = transfer.copy(dst, src)
    del src
    gc.collect()
    assert alive() is not None  # as record_stream keeps a freed CUDA block from reuse
    ticket.wait_host()
    assert torch.equal(dst, torch.full((1000,), 7.0))
    transfer.close()
    gc.collect()
    assert alive() is None


def test_a_failed_copy_raises_where_it_is_waited_for():
    transfer = ThreadTransfer()
    ticket = transfer.copy(torch.zeros(3), torch.zeros(4))
    with pytest.raises(RuntimeError, match="offload copy failed"):
        ticket.wait_host()
    transfer.close()


def test_make_transfer_reads_the_environment(monkeypatch):
    monkeypatch.setenv(transfer_module.DELAY_ENV, "0.004")
    chosen = make_transfer(torch.device("cpu"))
    assert isinstance(chosen, ThreadTransfer) and chosen.delay == 0.004
    monkeypatch.setenv(transfer_module.DELAY_ENV, "soon")
    with pytest.raises(ValueError, match="LAYERWISE_HF_OFFLOAD_DELAY='soon'"):
        make_transfer(torch.device("cpu"))
    with pytest.raises(ValueError, match="delay=-1"):
        ThreadTransfer(delay=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_through_pinned_memory():
    transfer = CudaTransfer(torch.device("cuda"))
    src = torch.randn(1 << 20, device="cuda")
    expected = src.clone()
    host = transfer.host_empty_like(src)
    assert host.is_pinned()
    transfer.copy(host, src).wait_host()
    del src  # freed while nothing reads it any more
    back = torch.empty_like(expected)
    transfer.copy(back, host).wait_device()
    assert torch.equal(back, expected)
    transfer.close()
