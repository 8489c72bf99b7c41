"""`--max-batch-size`: the largest micro-batch whose simulated step fits, by doubling then bisection."""

from __future__ import annotations

from collections.abc import Callable

from .core import Plan

MAX_PROBE = 1 << 16


def max_micro_batch(run: Callable[[int], Plan], optimizer: str, limit: int = MAX_PROBE) -> tuple[int, int]:
    """
    The largest micro-batch (at most `limit`) for which `run(micro_batch).row(optimizer).fits`, 0 when 1 does not
    fit; and the number of simulations it took. The peak grows with the micro-batch, so doubling brackets the answer
    and bisection finds it.

    Example:

    ```python
    >>> from layerwise_hf.plan import max_micro_batch, plan
    >>> run = lambda b: plan("llama-3.2-1b", seq_len=1024, micro_batch=b, device_memory="24GiB")
    >>> max_micro_batch(run, "adamw_torch_layerwise")  # doctest: +SKIP
    (6, 6)
    ```
    """
    probes = 0

    def fits(batch: int) -> bool:
        nonlocal probes
        probes += 1
        return bool(run(batch).row(optimizer).fits)

    if not fits(1):
        return 0, probes
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, probes
