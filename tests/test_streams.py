"""What a CUDA device would see of a layer-wise step, recorded on CPU: which stream bitsandbytes' kernels run on and
the waits around them (FSDP2 runs the hooks on its reduce-scatter stream), and the device syncs of a step."""

import pytest
import torch
from helpers import tiny_llama, train, training_args

from layerwise_hf.placement.local_shard import LocalShardOptimizer
from layerwise_hf.platform import streams
from layerwise_hf.platform.backward_end import BackwardEnd

bnb = pytest.importorskip("bitsandbytes")
bnb_functional = pytest.importorskip("bitsandbytes.functional")
bnb_optimizer = pytest.importorskip("bitsandbytes.optim.optimizer")


class Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait event", self.name, event.stream.name))

    def __eq__(self, other):
        return isinstance(other, Stream) and other.name == self.name

    __hash__ = None


class Event:
    def __init__(self, log):
        self.log, self.stream = log, None

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", stream.name))


class RecordedStreams:
    """A stand-in for `torch.cuda`'s streams: a current stream (FSDP2's reduce-scatter stream in the hook) and the
    default stream; it logs the waits and which stream is current when a step does its work."""

    def __init__(self, current="reduce_scatter"):
        self.log = []
        self.default = Stream("default", self.log)
        self.current = Stream(current, self.log) if current != "default" else self.default

    def current_stream(self, device):
        return self.current

    def default_stream(self, device):
        return self.default

    def event(self):
        return Event(self.log)

    def use(self, stream):
        recorder = self

        class Use:
            def __enter__(self):
                self.saved, recorder.current = recorder.current, stream

            def __exit__(self, *exc):
                recorder.current = self.saved

        return Use()


@pytest.fixture
def recorded(monkeypatch):
    """Pretends the tensors are on a CUDA device whose current stream is FSDP2's reduce-scatter stream, and logs where
    bitsandbytes launches its update (always the default stream: its CUDA wrapper passes no stream) and on which
    stream its state is zeroed (torch ops follow the current stream)."""
    recorder = RecordedStreams()
    monkeypatch.setattr(streams, "stream_backend", lambda device: recorder)
    for name in ("optimizer_update_8bit_blockwise", "optimizer_update_32bit"):
        update = getattr(bnb_functional, name)

        def launch(*args, _update=update, **kwargs):
            recorder.log.append(("kernel", "default"))
            return _update(*args, **kwargs)

        monkeypatch.setattr(bnb_functional, name, launch)
    init_state = bnb_optimizer.Optimizer2State.init_state

    def zero_state(self, *args, **kwargs):
        recorder.log.append(("zero state", recorder.current.name))
        return init_state(self, *args, **kwargs)

    monkeypatch.setattr(bnb_optimizer.Optimizer2State, "init_state", zero_state)
    return recorder


def fsdp2_hook_steps(optimizer, param, n=2):
    for _ in range(n):
        param.grad = torch.randn_like(param)  # the reduce-scatter's output, written on its stream
        optimizer.step()  # what FSDP2's post-accumulate-grad hook runs, with the reduce-scatter stream current
        param.grad = None


def test_8bit_local_shard_step_waits_for_the_reduce_scatter_and_is_waited_for(recorded):
    param = torch.nn.Parameter(torch.randn(64, 128))
    fsdp2_hook_steps(LocalShardOptimizer(bnb.optim.AdamW8bit([param], lr=1e-3)), param)
    log = recorded.log
    kernels = [k for k, entry in enumerate(log) if entry[0] == "kernel"]
    assert len(kernels) == 2
    for k in kernels:
        # The default stream waited for the reduce-scatter before the update, and nothing came between.
        before = [e for e in log[:k] if e[0] == "wait"]
        assert before and before[-1] == ("wait", "default", "reduce_scatter")
        # The reduce-scatter stream (the next bucket, the freed gradient's reuse) waits for the update after it.
        after = [e for e in log[k + 1 :] if e[0] == "wait"]
        assert after and after[0] == ("wait", "reduce_scatter", "default")
    # The first step's state is zeroed on the stream the update runs on, so the update reads zeros.
    assert ("zero state", "default") in log and ("zero state", "reduce_scatter") not in log


def test_steps_on_the_default_stream_need_no_wait(monkeypatch, recorded):
    recorded.current = recorded.default  # one process: the hooks run on the default stream
    param = torch.nn.Parameter(torch.randn(64, 128))
    fsdp2_hook_steps(LocalShardOptimizer(bnb.optim.AdamW8bit([param], lr=1e-3)), param)
    assert not [e for e in recorded.log if e[0] == "wait"]


def test_torch_optimizers_step_on_the_current_stream_as_they_are(recorded):
    # Elementwise torch optimizers (the other bases FSDP2 steps) launch on the current stream: nothing to order.
    param = torch.nn.Parameter(torch.randn(64, 128))
    fsdp2_hook_steps(LocalShardOptimizer(torch.optim.AdamW([param], lr=1e-3)), param)
    assert recorded.log == []


def test_ordered_steps_are_bit_identical_to_plain_ones(recorded):
    torch.manual_seed(0)
    start, grads = torch.randn(64, 128), [torch.randn(64, 128) for _ in range(3)]
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    plain, ordered = bnb.optim.AdamW8bit([a], lr=1e-2), bnb.optim.AdamW8bit([b], lr=1e-2)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        plain.step()
        streams.step_in_backward(ordered, b)
    assert torch.equal(a, b)


def in_backward(work):
    """Run `work` inside a backward (in the autograd engine, as FSDP2 calls the hooks)."""

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            work()
            return grad

    Node.apply(torch.ones(1, requires_grad=True)).sum().backward()


def fsdp2_hook(holder, optimizer, param, log):
    """One FSDP2 hook through `holder`: the reduce-scatter's gradient handed to the local-shard step, then freed."""

    param.grad = torch.randn_like(param)
    optimizer.step(steps=holder)  # the pipeline hands the route's holder on to the local-shard step
    param.grad = None
    log.append(("hook returned",))


def test_an_8bit_step_is_held_only_in_a_backward_and_off_the_default_stream(recorded):
    param = torch.nn.Parameter(torch.randn(64, 128))
    optimizer = LocalShardOptimizer(bnb.optim.AdamW8bit([param], lr=1e-3))
    holder, log = streams.GroupSteps(BackwardEnd()), recorded.log
    # In a backward, from the reduce-scatter stream: held past the hook, run at the end of backward after the event
    # the hook recorded on the reduce-scatter stream (not after a wait for the whole stream).
    in_backward(lambda: fsdp2_hook(holder, optimizer, param, log))
    kernel = log.index(("kernel", "default"))
    assert log.index(("hook returned",)) < kernel and ("record", "reduce_scatter") in log[:kernel]
    assert [e for e in log[:kernel] if e[0].startswith("wait")] == [("wait event", "default", "reduce_scatter")]
    assert ("wait", "reduce_scatter", "default") in log[kernel:] and not holder.deferred
    # A hook called by hand (outside the autograd engine): at once, nothing would run a held step.
    log.clear()
    fsdp2_hook(holder, optimizer, param, log)
    assert log.index(("kernel", "default")) < log.index(("hook returned",))
    # On the default stream (one process): at once, with no wait, nothing to overlap.
    log.clear()
    recorded.current = recorded.default
    in_backward(lambda: fsdp2_hook(holder, optimizer, param, log))
    assert log.index(("kernel", "default")) < log.index(("hook returned",))
    assert not [e for e in log if e[0].startswith("wait")]


def cut_short_backward(holder, optimizers, params, log):
    """One FSDP2 group's hooks (their gradients views of one reduce-scatter output), then an exception (an OOM):
    the backward ends without its end-of-backward callback."""
    flat = torch.randn(sum(p.numel() for p in params))
    grads = flat.split([p.numel() for p in params])

    def hooks():
        for optimizer, param, grad in zip(optimizers, params, grads):
            param.grad = grad.view_as(param)
            optimizer.step(steps=holder)
            param.grad = None
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(torch.OutOfMemoryError):
        in_backward(hooks)


@pytest.mark.parametrize("between", ["step", "nothing"])
def test_steps_held_by_a_backward_cut_short_never_run(recorded, between):
    # An out-of-memory batch skipped by the loop: the 8-bit steps FSDP2's hooks handed over before the error belong to
    # the aborted backward. Run in the next backward, they would step those parameters twice, with stale gradients.
    params = [torch.nn.Parameter(torch.randn(64, 128)) for _ in range(3)]
    optimizers = [LocalShardOptimizer(bnb.optim.AdamW8bit([p], lr=1e-3)) for p in params]
    end = BackwardEnd()
    holder = streams.GroupSteps(end)
    cut_short_backward(holder, optimizers, params, recorded.log)
    assert len(holder.deferred) == 3 and ("kernel", "default") not in recorded.log
    if between == "step":
        end.outside_backward()  # what LayerwiseOptimizer.step() and zero_grad() call
        assert not holder.deferred
    recorded.log.clear()
    # The next backward: the same group's hooks again, completed; its end runs its own three steps, and only those.
    in_backward(lambda: [fsdp2_hook(holder, optimizer, param, []) for optimizer, param in zip(optimizers, params)])
    assert recorded.log.count(("kernel", "default")) == 3 and not holder.deferred
    assert [optimizer.base.state[optimizer.local]["step"] for optimizer in optimizers] == [1, 1, 1]


@pytest.mark.parametrize("call", ["step", "zero_grad"])
def test_the_layerwise_optimizer_drops_steps_held_by_a_backward_cut_short(recorded, call):
    from layerwise_hf import LayerwiseOptimizer, LayerwiseParam

    params = [torch.nn.Parameter(torch.randn(64, 128)) for _ in range(2)]
    layerwise = LayerwiseOptimizer(
        [LayerwiseParam(f"w{i}", p, weight_decay=0.0) for i, p in enumerate(params)],
        lambda lp, _: torch.optim.SGD([lp.param], lr=0.1),
    )
    optimizers = [LocalShardOptimizer(bnb.optim.AdamW8bit([p], lr=1e-3)) for p in params]
    holder = streams.GroupSteps(layerwise.pipeline.backward_end)  # as the FSDP2 route makes it, on the optimizer's end
    cut_short_backward(holder, optimizers, params, recorded.log)
    getattr(layerwise, call)()
    assert not holder.deferred and ("kernel", "default") not in recorded.log


def test_on_cpu_an_8bit_step_runs_in_its_hook():
    param = torch.nn.Parameter(torch.randn(64, 128))
    optimizer = LocalShardOptimizer(bnb.optim.AdamW8bit([param], lr=1e-3))
    holder, start, log = streams.GroupSteps(BackwardEnd()), param.detach().clone(), []
    in_backward(lambda: (fsdp2_hook(holder, optimizer, param, log), log.append(not torch.equal(param, start))))
    assert log == [("hook returned",), True] and not holder.deferred


def count_device_syncs(monkeypatch):
    calls = []
    sync_gpu = bnb_optimizer.sync_gpu
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda t: (calls.append("sync_gpu"), sync_gpu(t))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("torch.cuda.synchronize"))
    return calls


@pytest.mark.parametrize("optim", ["adamw_8bit", "lion_8bit", "rmsprop_bnb_32bit"])
def test_non_paged_bitsandbytes_steps_make_no_device_sync_in_backward(tmp_path, monkeypatch, optim):
    calls = count_device_syncs(monkeypatch)
    train(tiny_llama(), training_args(tmp_path / "standard", optim, max_steps=1))
    standard = len(calls)
    calls.clear()
    train(tiny_llama(), training_args(tmp_path / "layerwise", f"{optim}_layerwise", max_steps=1))
    # The counter works: the standard step syncs once per parameter (after backward, where it costs less).
    assert standard >= len(list(tiny_llama().parameters()))
    assert calls == []


def test_paged_bitsandbytes_keeps_its_device_sync(tmp_path, monkeypatch):
    calls = count_device_syncs(monkeypatch)
    train(tiny_llama(), training_args(tmp_path, "paged_adamw_8bit_layerwise", max_steps=1))
    assert "sync_gpu" in calls


def test_the_device_sync_can_be_restored_for_measuring(tmp_path, monkeypatch):
    monkeypatch.setenv(streams.KEEP_DEVICE_SYNC_ENV, "1")
    calls = count_device_syncs(monkeypatch)
    train(tiny_llama(), training_args(tmp_path, "adamw_8bit_layerwise", max_steps=1))
    assert len(calls) >= len(list(tiny_llama().parameters()))


def test_galore_8bit_on_cuda_skips_its_per_parameter_synchronize(tmp_path, monkeypatch):
    pytest.importorskip("galore_torch")
    calls = count_device_syncs(monkeypatch)
    # Takes the CUDA branch of the step (the tensors stay on CPU): GaLore's own torch.cuda.synchronize() per parameter.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = training_args(
        tmp_path, "galore_adamw_8bit_layerwise", max_steps=1, optim_target_modules=["q_proj", "v_proj"]
    )
    train(tiny_llama(), args)
    assert calls == []
