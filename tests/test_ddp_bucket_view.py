"""DDP's comm-hook route with host offload and `gradient_as_bucket_view=True` (issue 28, item 10).

A model the user wrapped in DDP (a plain Accelerate loop with `DistributedDataParallelKwargs(gradient_as_bucket_view=
True)`, accumulating with `sync_each_batch=True`) all-reduces every micro-batch. On a micro-batch that does not end
the window, `.grad` is a view into DDP's bucket, and offload copies it to the host on a side stream. The reducer
rewrites the bucket in place in the next micro-batch's backward: the compute stream must not write it before that copy
has read it. Run under the fake CUDA of `tests/cuda_fake.py` (torch's CUDA sanitizer), with DDP's all-reduce on a
stream of its own as NCCL runs it.
"""

import pytest
import torch
import torch.cuda._sanitizer as csan
import torch.distributed as dist
from cuda_fake import FakeCuda, all_reduce_on_its_own_stream
from helpers import assert_params_equal, rank_comparison, spawned_results, write_rank_report

from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
from layerwise_hf.integrations.callback import end_training
from layerwise_hf.optim.optimizer import enable_offload
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.offloading import host_step_factory
from layerwise_hf.routes import ddp as ddp_module

DEVICE = torch.device("cuda", 0)
LR = 1e-2


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Linear(16, 4)
    )


def _batches(ga, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(5, 8, generator=g) for _ in range(ga)] for _ in range(steps)]


def stock_ddp(bucket_view, ga, clip, steps=3, seed=1):
    """DDP + torch AdamW, all-reducing every micro-batch (Accelerate's `sync_each_batch=True`)."""
    model = _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for window in _batches(ga, steps, seed):
        for x in window:
            (ddp(x).pow(2).sum() / ga).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model


def layerwise_ddp(mode, bucket_view, ga, clip, steps=3, seed=1, transfer=None):
    """The same loop with a layer-wise AdamW on DDP's comm hook and `layerwise_offload=mode`; `transfer` defaults to
    `CudaTransfer` (run it under `FakeCuda`)."""
    model = _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    sync = [True]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=LR), mode)
    transfer = transfer or transfer_module.CudaTransfer(DEVICE)
    if runner is not None:
        runner.transfer = transfer
    optimizer = LayerwiseOptimizer(params, factory, sync_gradients=lambda: sync[0])
    optimizer.configure_clipping(clip, "exact")
    enable_offload(optimizer, mode, transfer=transfer, runner=runner)
    assert optimizer.connect(ddp) == "ddp"
    try:
        for window in _batches(ga, steps, seed):
            for k, x in enumerate(window):
                sync[0] = k == ga - 1  # accelerator.sync_gradients under accumulate(): the comm hook runs anyway
                (ddp(x).pow(2).sum() / ga).backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        end_training(optimizer)
    return model


def copies_out(fake, to_host):
    return sum(1 for op, stream in fake.launches if stream == to_host and "copy_" in op)


@pytest.mark.parametrize(
    "mode, bucket_view, ga, clip",
    [
        ("gradients", True, 2, 0.0),
        ("optimizer", True, 2, 0.0),
        pytest.param("gradients", False, 2, 0.0, marks=pytest.mark.slow),
        pytest.param("optimizer", False, 2, 0.0, marks=pytest.mark.slow),
        # A window's last hand-over is a bucket view too: held for exact clipping (step() waits for its copy) ...
        pytest.param("gradients", True, 1, 0.5, marks=pytest.mark.slow),
        # ... or stepped on the host from its copy (the next forward waits for the copy back, issued after it).
        pytest.param("optimizer", True, 1, 0.0, marks=pytest.mark.slow),
    ],
)
def test_offload_under_ddp_matches_stock_ddp_with_no_unordered_access(one_rank_group, mode, bucket_view, ga, clip):
    steps = 2  # DDP rebuilds its buckets at the second forward: the second step rewrites the first step's buckets
    reference = stock_ddp(bucket_view, ga, clip, steps)
    init = transfer_module.CudaTransfer.__init__
    streams = []

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        streams.append(self.to_host.id)

    with FakeCuda() as fake, all_reduce_on_its_own_stream() as comm, pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer_module.CudaTransfer, "__init__", recorded)
        model = layerwise_ddp(mode, bucket_view, ga, clip, steps)
        # The all-reduces ran on their stream, and every micro-batch's gradients were copied out on the side stream.
        assert any(stream == comm.id for _, stream in fake.launches)
        assert copies_out(fake, streams[0]) >= steps * ga * len(list(model.parameters()))
    assert_params_equal(model, reference)


def test_the_bucket_rewritten_while_its_copy_is_in_flight_is_reported_without_the_copy(one_rank_group, monkeypatch):
    # The route hands offload a copy of the bucket view; without it, offload copies the bucket itself, and the next
    # micro-batch's reducer writes the bucket (copy_ on the compute stream) with no wait for that copy. (Two steps:
    # DDP rebuilds its buckets, in new memory, at the second forward.)
    monkeypatch.setattr(ddp_module, "_sink_copy", lambda g: g)
    with FakeCuda(), all_reduce_on_its_own_stream():
        with pytest.raises(csan.CUDASanitizerErrors) as excinfo:
            layerwise_ddp("gradients", True, 2, 0.0, steps=2)
    errors = excinfo.value.errors
    assert errors and all(isinstance(e, csan.UnsynchronizedAccessError) for e in errors)
    report = "\n".join(excinfo.value.__notes__)
    assert "writing to argument(s) self" in report and "reading from argument(s) src" in report, report
    assert "_accumulate_in_view" in report  # the earlier access: offload's copy of the handed-over bucket view


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_a_delayed_copy_thread_reads_the_gradient_it_was_given(one_rank_group, mode):
    # On CPU the copy thread stands in for the side stream: a copy of the bucket that runs after the next micro-batch
    # rewrote it would add that micro-batch's gradient twice.
    ga, clip = 2, 0.0
    reference = stock_ddp(True, ga, clip)
    transfer = transfer_module.ThreadTransfer(delay=0.02)
    model = layerwise_ddp(mode, True, ga, clip, transfer=transfer)
    assert_params_equal(model, reference)


def test_a_sink_that_keeps_the_accumulated_gradient_keeps_the_bucket_view(one_rank_group, monkeypatch):
    # Without offload the accumulated gradient stays in .grad: DDP's bucket view, accumulated in place as stock DDP
    # does, copied once to learn that the sink keeps it and not again.
    batches = _batches(4, 1)[0]
    stock = _mlp()
    stock_ddp_model = torch.nn.parallel.DistributedDataParallel(stock, gradient_as_bucket_view=True)
    for x in batches:
        stock_ddp_model(x).pow(2).sum().backward()
    model = _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    optimizer = LayerwiseOptimizer(
        params, lambda lp, _: torch.optim.AdamW([lp.param], lr=LR), sync_gradients=lambda: False
    )
    optimizer.connect(ddp)
    copies = []
    sink_copy = ddp_module._sink_copy
    monkeypatch.setattr(ddp_module, "_sink_copy", lambda g: copies.append(g) or sink_copy(g))
    pointers = []
    try:
        for x in batches:
            ddp(x).pow(2).sum().backward()
            pointers.append([p.grad.data_ptr() for p in model.parameters()])
            assert all(p.grad._base is not None for p in model.parameters())  # views into the bucket
    finally:
        end_training(optimizer)
    assert pointers[1] == pointers[2] == pointers[3]  # DDP rebuilds its buckets at the second forward
    assert len(copies) == len(list(model.parameters()))
    for p, q in zip(model.parameters(), stock.parameters()):
        assert torch.equal(p.grad, q.grad)


# ---- two ranks ----


def _two_rank_worker(rank: int, store_path: str, report: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(store_path, 2))
    torch.set_num_threads(1)
    results = {}
    for mode in ("gradients", "optimizer"):
        for clip in (0.0, 0.5):
            ga = 2
            reference = stock_ddp(True, ga, clip, seed=rank)
            with FakeCuda(), all_reduce_on_its_own_stream():
                model = layerwise_ddp(mode, True, ga, clip, seed=rank)
            results[f"{mode} clip={clip}"] = {
                **rank_comparison(reference, model),
                "moved": min((p - q).abs().max().item() for p, q in zip(_mlp().parameters(), model.parameters())),
            }
    write_rank_report(rank, report, results)


@pytest.mark.slow
def test_two_ranks_match_stock_ddp_with_no_unordered_access(tmp_path):
    results = spawned_results(_two_rank_worker, tmp_path)
    assert len(results) == 4
    for case, result in results.items():
        # Stock DDP sums each micro-batch into the bucket before it is averaged; offload adds the averaged gradients on
        # the host: the same sum in another order, within a few ulps.
        assert result["ranks_agree"] and result["moved"] > 1e-4, (case, result)
        assert result["max_diff"] <= 1e-7, (case, result)  # measured: 3e-8 in every case
