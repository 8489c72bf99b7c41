"""`platform/streams.py` under torch's CUDA sanitizer on CPU (`tests/cuda_fake.py`): an 8-bit local-shard step in
FSDP2's gradient hook, with FSDP2's reduce-scatter stream current, reads the gradient after the reduce-scatter wrote it
and is done before that stream reuses it; each of its waits, removed, is reported."""

import pytest
import torch
import torch.cuda._sanitizer as csan
from cuda_fake import FakeCuda
from test_offload_csan import assert_csan_reports

from layerwise_hf.placement.local_shard import LocalShardOptimizer
from layerwise_hf.platform import streams

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture
def fake(monkeypatch):
    # The parameter is a CPU tensor standing in for a CUDA one: give streams.py the (fake) CUDA streams.
    monkeypatch.setattr(streams, "stream_backend", lambda device: streams.CudaStreams())
    with FakeCuda() as fake:
        yield fake


def fsdp2_hook_steps(optimizer, param, reduce_scatter, n=2):
    """What FSDP2's post-accumulate-grad hook runs: the reduce-scatter writes the gradient on its stream, the step
    runs with that stream current, and the stream's next bucket reuses the gradient's memory."""
    for _ in range(n):
        reduce_scatter.wait_stream(torch.cuda.current_stream())  # FSDP2: after the backward that produced the input
        with torch.cuda.stream(reduce_scatter):
            param.grad = param.detach() * 0.01  # the reduce-scatter's output (a factory writes nothing in CSAN)
            optimizer.step()
            param.grad.zero_()  # the next reduce-scatter writes the same memory


def _shard_step(fake):
    param = torch.nn.Parameter(torch.randn(64, 128))
    optimizer = LocalShardOptimizer(bnb.optim.AdamW8bit([param], lr=1e-3))
    reduce_scatter = torch.cuda.Stream()
    fsdp2_hook_steps(optimizer, param, reduce_scatter)
    return fake


def test_8bit_local_shard_step_is_ordered_with_the_reduce_scatter(fake):
    _shard_step(fake)
    # the update ran on the default stream (bitsandbytes passes no stream to its kernels)
    assert any(stream == fake.default_stream().id for _, stream in fake.launches)


class _OrderedOnce:
    """`ordered_on_default_stream` with one of its waits removed."""

    def __init__(self, which):
        self.which = which

    def __call__(self, device):
        return _Streams(self.which)


class _Streams(streams.CudaStreams):
    def __init__(self, which):
        self.which = which

    def default_stream(self, device):
        return _NoWait(super().default_stream(device), self.which == "default_waits_for_current")

    def current_stream(self, device):
        return _NoWait(super().current_stream(device), self.which == "current_waits_for_default")


class _NoWait:
    def __init__(self, stream, drop):
        self.stream, self.drop = stream, drop

    def wait_stream(self, other):
        if not self.drop:
            self.stream.wait_stream(getattr(other, "stream", other))

    def __eq__(self, other):
        return self.stream == getattr(other, "stream", other)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@pytest.mark.parametrize("removed", ["default_waits_for_current", "current_waits_for_default"])
def test_each_removed_stream_wait_is_reported_by_csan(monkeypatch, removed):
    monkeypatch.setattr(streams, "stream_backend", _OrderedOnce(removed))
    original = streams.CudaStreams.use
    monkeypatch.setattr(streams.CudaStreams, "use", lambda self, s: original(self, getattr(s, "stream", s)))
    with FakeCuda() as fake:
        assert_csan_reports(lambda: _shard_step(fake))


def test_a_step_that_raises_still_orders_the_current_stream_after_it(fake):
    param = torch.nn.Parameter(torch.randn(64, 128))

    class Failing(bnb.optim.AdamW8bit):
        def step(self, closure=None):
            param.grad.sum()  # the step read the gradient on the default stream, then failed
            raise ValueError("a failing step")

    optimizer = Failing([param], lr=1e-3)
    reduce_scatter = torch.cuda.Stream()
    reduce_scatter.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(reduce_scatter):
        param.grad = param.detach() * 0.01
        with pytest.raises(ValueError, match="a failing step"):
            streams.step_in_backward(optimizer, param)
        try:
            param.grad.zero_()  # the reduce-scatter stream goes on, reusing the memory the step read
        except csan.CUDASanitizerErrors as error:
            pytest.fail(f"the reduce-scatter stream was not ordered after the failed step: {error}")
