"""The fake CUDA of `tests/cuda_fake.py`: what it needs of torch's private CUDA sanitizer, and that it reports what
CSAN reports on a GPU."""

import inspect

import pytest
import torch
import torch.cuda._sanitizer as csan
from cuda_fake import REQUIRED_CSAN, FakeCuda


def test_the_private_sanitizer_api_the_harness_relies_on_is_there():
    missing = [
        f"{name}.{attr}" if attr else name
        for name, attrs in REQUIRED_CSAN.items()
        for attr in (attrs or ("",))
        if not hasattr(csan, name) or (attr and not hasattr(getattr(csan, name), attr))
    ]
    assert not missing, (
        f"torch {torch.__version__} changed torch.cuda._sanitizer (CSAN), which tests/cuda_fake.py feeds: missing "
        f"{missing}. Update the harness to the new API."
    )
    launch = inspect.signature(csan.EventHandler._handle_kernel_launch).parameters
    assert list(launch)[1:] == ["stream", "read_only", "read_write", "outputs", "operator", "tensor_aliases"], (
        f"torch {torch.__version__} changed EventHandler._handle_kernel_launch's arguments to {list(launch)[1:]}"
    )
    syncs = csan.StreamSynchronizations()
    assert isinstance(syncs.current_sync_states, dict), "StreamSynchronizations.current_sync_states changed"


def test_a_copy_on_a_side_stream_without_a_wait_is_reported_and_with_one_is_not():
    with FakeCuda():
        side = torch.cuda.Stream()
        x = torch.ones(4) * 2
        host = torch.empty(4, pin_memory=True)
        with pytest.raises(csan.CUDASanitizerErrors):
            with torch.cuda.stream(side):
                host.copy_(x, non_blocking=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        with pytest.raises(csan.CUDASanitizerErrors):
            host.add_(1)  # the host reads the buffer before the copy is known to be done
        done.synchronize()
        host.add_(1)


def test_threads_keep_their_own_device_and_stream():
    import threading

    with FakeCuda() as fake:
        torch.cuda.set_device(1)
        side = torch.cuda.Stream(device=1)

        def other():
            assert torch.cuda.current_device() == 0
            with torch.cuda.stream(side):
                assert torch.cuda.current_stream(1) == side

        thread = threading.Thread(target=other, name="other")
        thread.start()
        thread.join()
        assert torch.cuda.current_stream(1) != side
        # leaving torch.cuda.stream sets the thread's device back: 0 for a thread that never set one
        assert fake.touched["other"] == {0, 1}
        assert torch.cuda.is_available() and not torch.empty(2, pin_memory=True).is_cuda


def test_implicit_device_uses_are_recorded_on_the_calling_threads_current_device():
    # cudaEventSynchronize and torch.optim's capture check run on the calling thread's current device: a thread that
    # never set one opens a context on device 0 with them, though its work is on device 1.
    import threading

    with FakeCuda() as fake:
        torch.cuda.set_device(1)
        side = torch.cuda.Stream(device=1)
        done = torch.cuda.Event()
        done.record(side)
        weight = torch.nn.Parameter(torch.ones(3))
        weight.grad = torch.ones(3)
        adam = torch.optim.AdamW([weight])

        def worker():
            done.synchronize()
            adam.step()

        thread = threading.Thread(target=worker, name="worker")
        thread.start()
        thread.join()
        side.synchronize()  # under a guard of the stream's device
        torch.cuda.synchronize()
    assert "worker" not in fake.touched  # it set no device ...
    assert fake.devices_used()["worker"] == {0}  # ... yet used device 0, twice
    whats = [what for name, _, what in fake.device_uses if name == "worker"]
    assert whats == ["event.synchronize", "stream.is_capturing"], whats
    assert fake.devices_used()[threading.current_thread().name] == {1}


def test_a_copy_runs_on_the_current_stream_of_its_tensors_device_not_on_another_devices_side_stream():
    # Finding 1's shape: a transfer made for device 0 copies a gradient on device 1. CUDA runs the copy on device 1's
    # current stream, so an event recorded on device 0's side stream says nothing about it.
    with FakeCuda() as fake:
        grad = (torch.ones(4) * 2).to("cuda:1")
        assert grad.is_cuda and grad.get_device() == 1
        assert torch.empty(2, device="cuda:1").get_device() == 1 and torch.empty(2).get_device() == 0
        side = torch.cuda.Stream(device=0)
        host = torch.empty(4, pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(0))
        with torch.cuda.stream(side):
            host.copy_(grad, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        assert fake.launches[-1][1] == torch.cuda.default_stream(1).id  # not side's
        done.synchronize()
        with pytest.raises(csan.CUDASanitizerErrors):
            host.add_(1)  # the host waited for device 0's side stream only
        placed = fake.place(torch.zeros(3), 1)
        assert placed.get_device() == 1
        with pytest.raises(RuntimeError, match="does not match recording stream's device"):
            done.record(torch.cuda.Stream(device=1))  # an event lives on the device it was first recorded on


def test_a_freed_block_used_by_another_stream_without_record_stream_is_reported_when_it_dies():
    with FakeCuda():
        side = torch.cuda.Stream()
        host = torch.empty(4, pin_memory=True)
        grad = torch.ones(4) * 2
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(grad, non_blocking=True)
        del grad
        with pytest.raises(csan.CUDASanitizerErrors, match="detected 1 errors"):
            torch.ones(1) * 1  # the next op: the block went back to the default stream while side read it
        grad = torch.ones(4) * 2
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(grad, non_blocking=True)
        grad.record_stream(side)
        del grad
        torch.ones(1) * 1


def test_unregistering_host_memory_a_copy_still_reads_or_that_was_never_registered_is_an_error():
    with pytest.raises(csan.CUDASanitizerErrors):  # raised at the end of the block
        with FakeCuda():
            cudart = torch.cuda.cudart()
            block = torch.empty(4)
            cudart.cudaHostRegister(block.data_ptr(), 16, 0)
            side = torch.cuda.Stream()
            device = torch.empty(4)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                device.copy_(block, non_blocking=True)
            cudart.cudaHostUnregister(block.data_ptr())  # the copy may still read it
    with FakeCuda() as fake:
        cudart = torch.cuda.cudart()
        block = torch.empty(4)
        cudart.cudaHostRegister(block.data_ptr(), 16, 0)
        side = torch.cuda.Stream()
        device = torch.empty(4)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            device.copy_(block, non_blocking=True)
        side.synchronize()
        cudart.cudaHostUnregister(block.data_ptr())
        assert not fake.errors
        cudart.cudaHostUnregister(block.data_ptr())
        assert "not registered" in str(fake.errors[-1])
        fake.errors.clear()


def test_a_non_blocking_copy_from_or_to_pageable_memory_is_an_error():
    with FakeCuda():
        device = torch.ones(4) * 2
        pageable = torch.empty(4, pin_memory=True).add(0)  # host memory a host op made: not pinned
        with pytest.raises(RuntimeError, match="pageable"):
            pageable.copy_(device, non_blocking=True)
        pageable.copy_(device)  # a blocking copy may use it
        torch.empty(4, pin_memory=True).copy_(device, non_blocking=True)


def test_query_answers_not_yet_on_a_seeded_schedule_and_done_after_a_wait():
    def answers(seed):
        with FakeCuda(seed=seed):
            side = torch.cuda.Stream()
            x = torch.ones(4)
            side.wait_stream(torch.cuda.current_stream())
            events = []
            for _ in range(8):
                with torch.cuda.stream(side):
                    x.add_(1)  # work the event follows: in flight until the host waits for it
                event = torch.cuda.Event()
                event.record(side)
                events.append(event)
            first = [event.query() for event in events]
            events[0].synchronize()
            return first, events[0].query()

    first, after_wait = answers("a")
    assert first == answers("a")[0]  # the same schedule for the same seed (a test's id by default)
    assert not all(first) and any(first), first
    assert after_wait
    assert any(answers(seed)[0] != first for seed in "bcdefgh")


def test_tolist_reads_on_the_current_stream_and_waits_for_it():
    with FakeCuda():
        comm = torch.cuda.Stream()
        flags = torch.ones(3)
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm):
            flags.mul_(2)  # a collective writes the flags on its own stream
        with pytest.raises(csan.CUDASanitizerErrors):
            flags.tolist()
        torch.cuda.current_stream().wait_stream(comm)
        assert flags.tolist() == [2.0, 2.0, 2.0]
