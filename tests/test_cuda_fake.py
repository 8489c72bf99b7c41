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
