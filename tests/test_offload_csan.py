"""The CUDA code of host offload (`CudaTransfer`, `platform/streams.py`) run on CPU under torch's CUDA sanitizer
(`tests/cuda_fake.py`): bit-exact with the standard optimizer and free of unordered accesses, and each wait the code
has, removed, is reported by CSAN."""

import pytest
import torch
import torch.cuda._sanitizer as csan
from cuda_fake import FakeCuda
from helpers import assert_params_equal

from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
from layerwise_hf.integrations.callback import end_training
from layerwise_hf.optim.optimizer import enable_offload
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.offloading import host_step_factory

DEVICE = torch.device("cuda", 0)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Linear(16, 4)
    )


def reference_run(ga, clip, steps=3):
    """torch's AdamW + clip_grad_norm_ (outside the fake CUDA: it is not what is checked)."""
    reference = _mlp()
    standard = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for window in _batches(ga, steps):
        for x in window:
            reference(x).pow(2).sum().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        standard.step()
        standard.zero_grad()
    return reference


def _batches(ga, steps):
    torch.manual_seed(1)
    return [[torch.randn(5, 8) for _ in range(ga)] for _ in range(steps)]


def offload_loop(mode, ga, clip, steps=3, device=DEVICE, model=None, read_between=False):
    """Layer-wise AdamW with offload through `CudaTransfer` (run it under `FakeCuda`). `read_between`: the compute
    stream reads every parameter between each window's backward and `step()` (a user logging weight norms)."""
    model = model if model is not None else _mlp()
    sync = [True]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), mode)
    transfer = transfer_module.CudaTransfer(device)
    if runner is not None:
        runner.transfer = transfer
    optimizer = LayerwiseOptimizer(params, factory, sync_gradients=lambda: sync[0])
    optimizer.configure_clipping(clip, "exact")
    enable_offload(optimizer, mode, transfer=transfer, runner=runner)
    optimizer.attach()
    for window in _batches(ga, steps):
        for k, x in enumerate(window):
            sync[0] = k == ga - 1
            model(x).pow(2).sum().backward()
        if read_between:
            probes = [p.detach().sum() for p in model.parameters()]  # noqa: F841 - queued on the compute stream
        optimizer.step()
    end_training(optimizer)
    return model, optimizer


@pytest.mark.parametrize("clip", [0.0, 0.5])
@pytest.mark.parametrize("ga", [1, 4])
@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_cuda_transfer_matches_standard_with_no_unordered_access(mode, ga, clip):
    reference = reference_run(ga, clip)
    with FakeCuda() as fake:
        model, _ = offload_loop(mode, ga, clip, read_between=ga > 1)
        if mode == "optimizer" or ga > 1 or clip:  # else every gradient steps in backward: nothing to offload
            assert any(stream != fake.default_stream().id for _, stream in fake.launches)  # the side stream ran
    assert_params_equal(model, reference)


def assert_csan_reports(run):
    """`run()` raises CSAN's report of an unordered access (possibly re-raised by a waiter)."""
    with pytest.raises(Exception) as excinfo:  # noqa: PT011 - the report may come back wrapped; checked below
        run()
    error = excinfo.value
    while error is not None and not isinstance(error, csan.CUDASanitizerErrors):
        error = error.__cause__ or error.__context__
    assert isinstance(error, csan.CUDASanitizerErrors), f"not CSAN's report: {excinfo.value!r}"
    assert any(isinstance(e, csan.UnsynchronizedAccessError) for e in error.errors)
    assert "CSAN detected a possible data race" in "\n".join(getattr(error, "__notes__", []))


def _without_compute_wait(direction):
    def remove(monkeypatch):
        init = transfer_module.CudaTransfer.__init__

        def no_wait(self, *args, **kwargs):
            init(self, *args, **kwargs)
            getattr(self, direction).wait_stream = lambda other: None

        monkeypatch.setattr(transfer_module.CudaTransfer, "__init__", no_wait)

    return remove


def _without_waits_for_earlier_copies(monkeypatch):
    copy = transfer_module.CudaTransfer.copy
    monkeypatch.setattr(
        transfer_module.CudaTransfer,
        "copy",
        lambda self, dst, src, after=None: copy(self, dst, src, None if after is None else []),
    )


REMOVED_WAITS = {
    # the copy-out stream waits for the compute stream before copying what it produced (CudaTransfer.copy)
    "copy_waits_for_compute": _without_compute_wait("to_host"),
    # the copy-back stream waits for the compute stream before writing memory allocated there (GradientOffload)
    "copy_back_waits_for_compute": _without_compute_wait("to_device"),
    # the host worker's copy back waits for the copy out of its gradient, or a mark of the compute stream taken
    # when step() handed the parameter over (not for the worker's own current stream)
    "copy_back_waits_for_its_copy": _without_waits_for_earlier_copies,
    # the compute stream waits for a copy back before using it (Ticket.wait_device)
    "wait_device": lambda mp: mp.setattr(transfer_module._CudaTicket, "wait_device", lambda self: None),
    # the host waits for a copy to the host before reading the buffer (Ticket.wait_host)
    "wait_host": lambda mp: mp.setattr(transfer_module._CudaTicket, "wait_host", lambda self: None),
}


@pytest.mark.parametrize(
    "removed, mode, ga, clip",
    [
        ("copy_waits_for_compute", "gradients", 4, 0.0),
        ("copy_waits_for_compute", "optimizer", 1, 0.0),
        ("copy_back_waits_for_compute", "gradients", 1, 0.5),
        ("copy_back_waits_for_compute", "gradients", 4, 0.0),
        ("copy_back_waits_for_its_copy", "optimizer", 4, 0.0),
        ("wait_device", "gradients", 1, 0.5),
        ("wait_device", "optimizer", 1, 0.0),
        ("wait_host", "gradients", 4, 0.0),
        ("wait_host", "optimizer", 1, 0.0),
    ],
)
def test_each_removed_wait_is_reported_by_csan(monkeypatch, removed, mode, ga, clip):
    REMOVED_WAITS[removed](monkeypatch)
    # A copy back that the host worker issues after waiting (on the host) for the copy out of its gradient is ordered
    # by that wait as well; what only its own waits order is a read of the parameter between backward and step().
    read_between = removed == "copy_back_waits_for_its_copy"
    with FakeCuda():
        assert_csan_reports(lambda: offload_loop(mode, ga, clip, read_between=read_between))


@pytest.mark.parametrize("mode, ga, clip", [("optimizer", 1, 0.0), ("optimizer", 4, 0.5), ("gradients", 4, 0.5)])
def test_no_thread_uses_a_device_other_than_its_ranks(mode, ga, clip):
    # Any CUDA call of a thread that never set its device (an event's synchronize, torch.optim's capture check) opens
    # a context on GPU 0: every rank's host worker would hold memory there. In "gradients" mode the worker never
    # copies, so only binding it to the device when it starts keeps it off GPU 0.
    rank_device = torch.device("cuda", 1)
    with FakeCuda() as fake:
        torch.cuda.set_device(rank_device)
        offload_loop(mode, ga, clip, device=rank_device)
    used = fake.devices_used()
    assert any(name.startswith("layerwise-host") for name in used), used  # the host worker ran, and used a device
    assert all(devices == {1} for devices in used.values()), used


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_optimizer_built_before_the_model_is_on_the_device_copies_on_the_side_stream(mode, caplog):
    # examples/accelerate_loop.py builds the optimizer before accelerator.prepare moves the model to the GPU: the
    # transfer must follow the gradients' device at the first copy, not the parameters' when the optimizer is built.
    from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer
    from layerwise_hf.optim.optimizer import offload_of

    model = _mlp()
    args = LayerwiseTrainingArguments("out", optim="adamw_torch_layerwise", learning_rate=1e-2, weight_decay=0.0)
    optimizer = build_layerwise_optimizer(
        model, args, factory=lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), offload=mode, host_step="exact"
    )
    clip = 0.0 if mode == "optimizer" else 0.5  # "gradients" offloads only what waits for the step: clip exactly
    optimizer.configure_clipping(clip, "exact")
    reference = reference_run(1, clip)
    with FakeCuda() as fake:
        optimizer.attach()
        for (x,) in _batches(1, 3):
            model(x).pow(2).sum().backward()
            optimizer.step()
        end_training(optimizer)
        side = {stream for _, stream in fake.launches} - {fake.default_stream().id}
    used = optimizer.inner[0].runner.transfer if mode == "optimizer" else offload_of(optimizer).transfer
    assert isinstance(used, transfer_module.CudaTransfer)
    assert side, "no copy ran on CudaTransfer's side stream"
    assert_params_equal(model, reference)


def test_copies_back_run_on_their_own_stream_and_do_not_wait_for_compute_queued_after_the_step(monkeypatch):
    # The host worker's copy back once waited for the worker's current stream (the device's default stream, where
    # the backward queued meanwhile runs) on the copies out's stream: it could start only after that backward.
    import threading

    from layerwise_hf.placement.host_step import HostStepOptimizer

    go = threading.Event()
    step_on_host = HostStepOptimizer._step_on_host

    def held(self, *args):
        go.wait(30)  # the host step is handed over; the compute stream goes on before it runs
        return step_on_host(self, *args)

    monkeypatch.setattr(HostStepOptimizer, "_step_on_host", held)
    copy, streams = transfer_module.CudaTransfer.copy, {}

    def recorded(self, dst, src, after=None):
        n = len(FakeCuda.active.launches)
        ticket = copy(self, dst, src) if after is None else copy(self, dst, src, after)
        launched = [k for k in range(n, len(FakeCuda.active.launches)) if "copy_" in FakeCuda.active.launches[k][0]]
        streams.setdefault("back" if dst.is_cuda else "out", []).extend(launched)
        return ticket

    monkeypatch.setattr(transfer_module.CudaTransfer, "copy", recorded)
    with FakeCuda() as fake:
        model = _mlp()
        params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
        factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), "optimizer")
        optimizer = LayerwiseOptimizer(params, factory)
        enable_offload(optimizer, "optimizer", runner=runner)
        optimizer.attach()
        model(torch.randn(5, 8)).pow(2).sum().backward()
        later = len(fake.launches)
        torch.ones(64).mul(2)  # compute queued after every host step was handed over
        go.set()
        optimizer.step()
        end_training(optimizer)
        out = {fake.launches[k][1] for k in streams["out"]}
        back = {fake.launches[k][1] for k in streams["back"]}
        assert out.isdisjoint(back) and fake.default_stream().id not in out | back, (out, back)
        assert not [k for k in streams["back"] if fake.ordered_after(k, later)]


@pytest.mark.parametrize("ga", [1, 4])
@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_pinned_bytes_are_what_the_plan_counts(mode, ga):
    # torch's caching host allocator rounds each pinned block up to a power of two and keeps it: the buffers are views
    # into one registered block per dtype, and at GA > 1 the staging buffers are a bounded set of registered blocks,
    # so what is pinned, at every moment of the run, is what the plan and the offload's own counts say.
    from layerwise_hf.estimate import estimate
    from layerwise_hf.estimate.offload import pinned_bytes
    from layerwise_hf.optim.optimizer import offload_of

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 12), torch.nn.Linear(12, 4)
    )
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    most = [0]
    fake = FakeCuda()
    track = fake._track_storage

    def tracked(*args, **kwargs):
        track(*args, **kwargs)
        most[0] = max(most[0], fake.pinned_bytes)

    fake._track_storage = tracked  # every allocation: the most pinned at once
    with fake:
        _, optimizer = offload_loop(mode, ga, 0.5, steps=2, model=model)
        pinned = fake.pinned_bytes
    offload = offload_of(optimizer)
    copies = sum(inner.host.numel() * inner.host.element_size() for inner in optimizer.inner if mode == "optimizer")
    planned = pinned_bytes(mode, sizes, ga)
    assert most[0] == pinned == planned == offload.host_bytes() + offload.staging_bytes() + copies, (most, planned)
    assert (offload.staging_bytes() > 0) == (ga > 1)
    # Pageable: with "optimizer" the host optimizer states, created like any CPU tensor, outside the pinned blocks.
    states = [t for inner in optimizer.inner for s in inner.state.values() for t in s.values()]
    in_pinned = [t for t in states for ptr, n in fake.pinned.items() if ptr <= t.data_ptr() < ptr + n]
    assert states and not in_pinned
    pageable = sum(t.numel() * t.element_size() for t in states) if mode == "optimizer" else 0
    est = estimate(model, optimizer="adamw_torch_layerwise", offload=mode, gradient_accumulation_steps=ga)
    assert est.host_bytes == pinned + pageable, (est.host_bytes, pinned, pageable)  # the estimator's host term


def _spread(fake, model):
    """Place the model's first layer on fake device 0 and the rest on device 1, as device_map="auto" would."""
    for k, p in enumerate(model.parameters()):
        fake.place(p, 0 if k < 2 else 1)
    return model


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_offload_of_a_model_over_two_gpus_is_refused_at_setup(mode):
    # One transfer's side stream cannot order a copy of a tensor on another device (it runs on that device's
    # stream): the host would read buffers before their copies ended and train on stale values, silently.
    with FakeCuda() as fake:
        model = _spread(fake, _mlp())
        params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
        factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), mode)
        optimizer = LayerwiseOptimizer(params, factory)
        with pytest.raises(ValueError, match=r"several GPUs in one process \(cuda:0, cuda:1.*offload='none'"):
            enable_offload(optimizer, mode, runner=runner)


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_a_model_moved_over_two_gpus_after_setup_is_refused_at_its_first_copy(mode):
    # A plain loop builds the optimizer before the model is placed: the transfer follows the first gradient's device,
    # and a gradient on another device is refused before its copy starts.
    with FakeCuda() as fake:
        model = _mlp()
        for p in model.parameters():
            fake.place(p, 0)
        params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
        factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), mode)
        optimizer = LayerwiseOptimizer(params, factory)
        optimizer.configure_clipping(0.5, "exact")  # every gradient goes to the host
        enable_offload(optimizer, mode, runner=runner)
        optimizer.attach()
        weights = list(model.parameters())
        weights[-1].grad = fake.place(torch.ones_like(weights[-1]), 0)
        optimizer.pipeline.offload.buffers.stash(len(weights) - 1, weights[-1], measure=False)
        weights[0].grad = fake.place(torch.ones_like(weights[0]), 1)
        with pytest.raises(ValueError, match="several GPUs in one process"):
            optimizer.pipeline.offload.buffers.stash(0, weights[0], measure=False)
        end_training(optimizer)


def test_a_host_buffer_outside_an_arena_pins_its_own_bytes():
    # pin_memory=True would round 3 floats up to 16 bytes and keep them; registered, a buffer pins what it holds.
    with FakeCuda() as fake:
        transfer = transfer_module.CudaTransfer(DEVICE)
        buffer = transfer.host_empty_like(torch.ones(3))
        assert buffer.shape == (3,) and fake.pinned_bytes == 12
        del buffer
        assert fake.pinned_bytes == 0  # unregistered with its last view


def test_a_host_block_freed_while_a_copy_still_reads_it_waits_for_the_copy():
    # Freeing the last view of a registered block unregisters and frees it; a copy to the device still reading it must
    # end first (only close()'s synchronize covered that before).
    with FakeCuda():
        transfer = transfer_module.CudaTransfer(DEVICE)
        block = transfer.host_block(1024, torch.float32)
        block.fill_(1.0)
        device = torch.empty(1024)
        ticket = transfer.copy(device, block)
        del block  # nobody waits for the copy on the host
        ticket.wait_device()
        assert device.sum().item() == 1024


def test_threads_that_wait_for_a_copy_sleep_instead_of_spinning():
    # A non-blocking event makes cudaEventSynchronize spin: the hook and the host worker would eat the cores the
    # host step was given while they wait.
    with FakeCuda():
        transfer = transfer_module.CudaTransfer(DEVICE)
        host = transfer.host_empty_like(torch.ones(4))
        tickets = [transfer.copy(host, torch.ones(4)), transfer.mark()]
        tickets[0].wait_host()
        tickets.append(transfer.copy(torch.empty(4), host))
        assert [ticket.event.blocking for ticket in tickets] == [True, True, True]
        tickets[-1].wait_host()


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_every_host_task_runs_on_the_host_workers_share_of_the_cores(monkeypatch, mode):
    # Under torchrun / accelerate launch a new thread starts with OMP_NUM_THREADS=1: only the host step claimed its
    # share, so the adds of accumulated micro-batches and the norms of their sums ran on one thread while backward
    # waited for a staging buffer.
    from layerwise_hf.placement import offload as offload_module

    monkeypatch.setenv("LAYERWISE_HF_HOST_THREADS", "3")
    threads = {}
    for name in ("_add_after", "_norm_after"):
        task = getattr(offload_module, name)

        def counted(*args, _task=task, _name=name):
            threads.setdefault(_name, set()).add(torch.get_num_threads())
            return _task(*args)

        monkeypatch.setattr(offload_module, name, counted)
    with FakeCuda():
        offload_loop(mode, 4, 0.5)
    assert threads == {"_add_after": {3}, "_norm_after": {3}}
