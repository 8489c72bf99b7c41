"""benchmarks/_thread_memory.py: the CPU allocator counted on every thread, against torch's profiler (the tensor peak
of benchmarks/plan_accuracy.py's 2-rank rows)."""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="the counting allocator needs a C++ compiler")
MIB = 2**20


def profiler_sum(prof) -> tuple[int, int]:
    """The running sum of the profiler's allocator events at the end, and its highest value."""
    running = highest = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):  # fmt: skip
        running += nbytes
        highest = max(highest, running)
    return running, highest


def in_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def test_counts_frees_and_allocations_of_other_threads_that_the_profiler_misses():
    from benchmarks._thread_memory import CountingAllocator

    counter = CountingAllocator()
    base = counter.current()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        held = [torch.empty(MIB // 4)]  # 1 MiB, allocated here
        assert counter.current() - base == MIB
        in_thread(held.clear)  # freed on another thread, as gloo's worker frees a collective's tensors
        assert counter.current() == base
        counter.reset_peak()
        made = []
        in_thread(lambda: made.append(torch.ones(MIB // 2)))  # 2 MiB allocated on another thread
        assert counter.peak() - base == 2 * MIB
        made.clear()
    assert counter.current() == base
    # The profiler never saw the 2 MiB allocated on another thread, so its peak is wrong. Whether it records the free
    # made elsewhere is not fixed even within one torch version (torch 2.13 missed it here and recorded it on CI's
    # machine), so its running sum at the end is 0 or the missed 1 MiB, less what threads left by earlier tests in
    # this worker freed meanwhile (seen once in a full run: 64 KiB; the counter saw no net change).
    running, highest = profiler_sum(prof)
    assert highest == MIB
    assert running <= MIB


def test_agrees_with_the_profiler_to_the_byte_on_one_thread():
    from benchmarks._thread_memory import CountingAllocator

    counter = CountingAllocator()
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        base = counter.current()
        counter.reset_peak()
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(32, 256)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        end, peak = counter.current() - base, counter.peak() - base
    assert (end, peak) == profiler_sum(prof)
    # Held at the end: the weights and AdamW's two states (and its step counts).
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 3 * weights <= end < 3 * weights + 4096
