"""`platform/streams.py` under torch's CUDA sanitizer on CPU (`tests/cuda_fake.py`): an 8-bit local-shard step in
FSDP2's gradient hook, with FSDP2's reduce-scatter stream current, reads the gradient after the reduce-scatter wrote it
and is done before that stream reuses it; each of its waits, removed, is reported. In a backward, the step is held one
reduce-scatter group later, so the next layer's backward is not ordered after this layer's reduce-scatter."""

import pytest
import torch
import torch.cuda._sanitizer as csan
from cuda_fake import FakeCuda
from test_offload_csan import assert_csan_reports

from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
from layerwise_hf.bases.params import isolate_bnb_overrides
from layerwise_hf.placement.local_shard import LocalShardOptimizer, wrap_local_shards
from layerwise_hf.platform import streams
from layerwise_hf.routes.hooks import FSDP2Hooks

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
        stream = super().default_stream(device)
        return _NoWait(stream, self.which == "default_waits_for_current", self.which == "default_waits_for_group")

    def current_stream(self, device):
        return _NoWait(super().current_stream(device), self.which == "current_waits_for_default")


class _NoWait:
    def __init__(self, stream, drop, drop_event=False):
        self.stream, self.drop, self.drop_event = stream, drop, drop_event

    def wait_stream(self, other):
        if not self.drop:
            self.stream.wait_stream(getattr(other, "stream", other))

    def wait_event(self, event):
        if not self.drop_event:
            self.stream.wait_event(event)

    def __eq__(self, other):
        return self.stream == getattr(other, "stream", other)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _remove_wait(monkeypatch, removed):
    monkeypatch.setattr(streams, "stream_backend", _OrderedOnce(removed))
    original = streams.CudaStreams.use
    monkeypatch.setattr(streams.CudaStreams, "use", lambda self, s: original(self, getattr(s, "stream", s)))


@pytest.mark.parametrize("removed", ["default_waits_for_current", "current_waits_for_default"])
def test_each_removed_stream_wait_is_reported_by_csan(monkeypatch, removed):
    _remove_wait(monkeypatch, removed)
    with FakeCuda() as fake:
        assert_csan_reports(lambda: _shard_step(fake))


GROUPS, PER_GROUP, SHAPE = 3, 2, (64, 128)  # 8192 elements: 8-bit states


def _8bit_shards(params):
    factory = wrap_local_shards(lambda lp, args: isolate_bnb_overrides(bnb.optim.AdamW8bit([lp.param], lr=1e-2)))
    named = [LayerwiseParam(f"g{i // PER_GROUP}.w{i % PER_GROUP}", p, weight_decay=0.0) for i, p in enumerate(params)]
    return LayerwiseOptimizer(named, factory, sync_gradients=lambda: True)


def _reduce_scatter_outputs():
    torch.manual_seed(1)
    return [torch.randn(PER_GROUP * SHAPE[0] * SHAPE[1]) * 1e-2 for _ in range(GROUPS)]


class _FSDP2Backward:
    """
    A backward as FSDP2 runs it, one group (one `fully_shard` layer) at a time: the layer's backward on the default
    stream; then, on the reduce-scatter stream after it, the reduce-scatter writes the group's gradients (views of its
    one output) and FSDP2 calls their post-accumulate-grad hooks with that stream current. Launch indices are kept to
    ask CSAN's model what is ordered after what.

    `reuse`: after each group's hooks, the reduce-scatter stream writes the previous group's output again, as the
    caching allocator hands a freed block to the next allocation on the stream that allocated it.
    """

    def __init__(self, fake, params, outputs, reuse=False):
        self.fake, self.params, self.reuse = fake, params, reuse
        self.reduce_scatter = torch.cuda.Stream()
        self.inputs = [o.clone() for o in outputs]  # the unsharded gradients' stand-ins, written on the default stream
        self.flat = [None] * GROUPS
        self.compute, self.written = {}, {}

    def run(self):
        x = torch.ones(4, requires_grad=True)
        for k in reversed(range(GROUPS)):  # group 0 is the last layer: the first in backward
            x = _Layer.apply(x, k, self)
        x.sum().backward()

    def backward_of(self, k, grad_out):
        fake, stream = self.fake, self.reduce_scatter
        self.compute[k] = len(fake.launches)
        grad_in = grad_out * 2  # the layer's own backward
        stream.wait_stream(torch.cuda.current_stream())  # FSDP2: the reduce-scatter follows the backward it reduces
        with torch.cuda.stream(stream):
            flat = self.flat[k] = torch.empty_like(self.inputs[k])
            torch.mul(self.inputs[k], 1.0, out=flat)  # the reduce-scatter's write
            self.written[k] = len(fake.launches) - 1
            n = SHAPE[0] * SHAPE[1]
            for j in range(PER_GROUP):
                p = self.params[k * PER_GROUP + j]
                p.grad = flat[j * n : (j + 1) * n].view(SHAPE)
                for hook in p._post_accumulate_grad_hooks.values():
                    hook(p)
            if self.reuse and k > 0:
                self.flat[k - 1].zero_()
        return grad_in


class _Layer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, backward):
        ctx.k, ctx.backward = k, backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.backward.backward_of(ctx.k, grad_out), None, None


def _fsdp2_backward(fake, reuse=False):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(SHAPE)) for _ in range(GROUPS * PER_GROUP)]
    optimizer = _8bit_shards(params)
    optimizer.connect(route=FSDP2Hooks())
    run = _FSDP2Backward(fake, params, _reduce_scatter_outputs(), reuse)
    run.run()
    return run, params


def test_held_8bit_steps_leave_the_next_layers_backward_unordered_after_this_reduce_scatter(fake):
    run, params = _fsdp2_backward(fake)
    for k in range(GROUPS - 1):
        # The default stream did not wait for group k's reduce-scatter before the next layer's backward ...
        assert not fake.ordered_after(run.compute[k + 1], run.written[k]), f"group {k + 1} waited for {k}"
    # ... and every update read its gradient after the reduce-scatter wrote it (CSAN would have raised otherwise),
    # on the default stream, once per parameter, the same updates as stepping each shard by hand.
    updates = [op for op, stream in fake.launches if "optimizer_update" in op and stream == fake.default_stream().id]
    assert len(updates) == len(params)
    torch.manual_seed(0)
    reference = [torch.nn.Parameter(torch.randn(SHAPE)) for _ in range(GROUPS * PER_GROUP)]
    by_hand = _8bit_shards(reference)
    for k, output in enumerate(_reduce_scatter_outputs()):
        for j, grad in enumerate(output.view(PER_GROUP, *SHAPE)):
            reference[k * PER_GROUP + j].grad = grad.clone()
            by_hand.inner[k * PER_GROUP + j].step()
    for a, b in zip(params, reference):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("removed", ["default_waits_for_group", "current_waits_for_default"])
def test_each_removed_wait_of_a_held_step_is_reported_by_csan(monkeypatch, removed):
    _remove_wait(monkeypatch, removed)
    with FakeCuda() as fake:
        assert_csan_reports(lambda: _fsdp2_backward(fake, reuse=True))


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


class _End:
    """A `BackwardEnd` stand-in that takes every stage (the held steps are run by hand)."""

    def queue(self, stage, work):
        return True

    def when_cut_short(self, drop):
        pass


def test_a_held_step_that_raises_still_orders_the_current_stream_after_it(fake):
    param = torch.nn.Parameter(torch.randn(64, 128))

    class Failing(bnb.optim.AdamW8bit):
        def step(self, closure=None):
            param.grad.sum()  # the step read the gradient on the default stream, then failed
            raise ValueError("a failing step")

    holder = streams.GroupSteps(_End())
    reduce_scatter = torch.cuda.Stream()
    reduce_scatter.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(reduce_scatter):
        grad = param.detach() * 0.01
        optimizer = Failing([param], lr=1e-3)
        streams.step_in_backward(optimizer, param, grad, holder)  # a hook of the group
        assert len(holder.deferred) == 1
        with pytest.raises(ValueError, match="a failing step"):
            holder.flush()  # as the next group's hook does
        try:
            grad.zero_()  # the reduce-scatter stream goes on, reusing the memory the step read
        except csan.CUDASanitizerErrors as error:
            pytest.fail(f"the reduce-scatter stream was not ordered after the failed step: {error}")
