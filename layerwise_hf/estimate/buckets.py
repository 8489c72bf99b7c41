"""Gradient buckets under a DDP configuration, as `layerwise_hf.routes.data_parallel` forms and reduces them, in plain
Python (no process group needed): which gradients share an all-reduce, and the most gradient bytes the layer-wise route
holds at once; and, on one process, the gradient bytes the local route holds when it holds a large tensor's step
(`held_step_bound`).

The route's policy (`DataParallelReducer`):

- buckets follow the order gradients become ready, the reverse of the order parameters are first used in forward
  (for a decoder-only model: the reverse of `named_parameters()` order, lm_head first, the input embedding last);
- they are cut by torch's `_compute_bucket_assignment_by_size` with DDP's limits: a 1 MiB first bucket then
  `bucket_cap_mb` (25 MiB by default; an explicit `bucket_cap_mb` applies to every bucket). A bucket closes as soon
  as it reaches its limit, so it can exceed the cap by its last tensor; a tensor at least as large as the cap is a
  bucket of its own (the route's one exception to torch's rule, so the embedding is not copied into a bucket with
  the layer before it);
- a bucket of one tensor is all-reduced in place in that tensor's `.grad`; a bucket of several is one buffer of their
  sum, allocated at its first gradient, into which each gradient is copied (its `.grad` is freed after the copy);
- at most one bucket is reducing while the next fills: when a bucket is launched, the one before it (if still
  reducing) is waited for, stepped and freed;
- except a bucket of one tensor at least as large as the cap whose next bucket is smaller (an untied `lm_head`):
  once reduced it is held, unstepped, until the bucket before the next such tensor is launched; then the bucket in
  flight and the held one step (so its step's temporaries come when few activations are left, not early in
  backward).

So the gradient bytes alive at once are at most, over the buckets `k` in launch order:
`held + size(k - 1) + size(k) + (largest tensor of k, when k holds several: its .grad during the copy)`, where
`held` is the large bucket waiting for its step, and `k - 1` is not counted right after the held one stepped (the
bucket in flight stepped with it). That is `ddp_in_flight_bound`. It assumes every parameter is used in forward and
that `.grad` is freed by each step (no gradient accumulation, no clipping that holds gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIB = 2**20
# `layerwise_hf.routes.hooks.LARGE_FRACTION` (the estimator does not import torch): on one process a gradient at least
# this fraction of the largest is "large", and its step is held while the gradients after it are smaller.
LARGE_FRACTION = 0.5
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def bucket_size_limits(bucket_cap_mb: float | None = None) -> list[int]:
    """
    DDP's bucket size limits in bytes: `[1 MiB, 25 MiB]` by default, `[cap]` for an explicit `bucket_cap_mb`.

    Example:

    ```python
    >>> from layerwise_hf.estimate.buckets import bucket_size_limits
    >>> bucket_size_limits(), bucket_size_limits(10)
    ([1048576, 26214400], [10485760])
    ```
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
    first = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    return [first, cap] if first < cap else [cap]


@dataclass(frozen=True)
class Bucket:
    """One all-reduce: the bytes of its gradients, in the order they were added."""

    sizes: tuple[int, ...]
    alone: bool = False  # one tensor at least as large as the cap (the route may hold its step)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @property
    def copy_bytes(self) -> int:
        # The `.grad` being copied in: none for a bucket of one tensor, reduced in place.
        return max(self.sizes) if len(self.sizes) > 1 else 0


def assign_buckets(
    sizes: Sequence[int], limits: Sequence[int], keys: Sequence[object] | None = None, large_alone: bool = True
) -> list[Bucket]:
    """
    torch's `_compute_bucket_assignment_by_size` over gradient byte sizes in ready order: per key (dtype), add each
    tensor to the open bucket and close it once it reaches the current limit (then move to the next limit); open
    buckets are closed at the end. Buckets come in the order they close, the order they are launched. With
    `large_alone` (the route's layout), a tensor at least as large as the last limit closes the open buckets and is
    a bucket of its own (`alone`).

    Example:

    ```python
    >>> from layerwise_hf.estimate.buckets import assign_buckets
    >>> [b.sizes for b in assign_buckets([3, 1, 1, 2, 9, 1], [2, 4], large_alone=False)]
    [(3,), (1, 1, 2), (9,), (1,)]
    >>> [b.sizes for b in assign_buckets([1, 1, 9, 1, 2, 3], [2, 4])]
    [(1, 1), (9,), (1, 2, 3)]
    ```
    """
    keys = list(keys) if keys is not None else [None] * len(sizes)
    open_buckets: dict[object, list[int]] = {}
    limit_index: dict[object, int] = {}
    out: list[Bucket] = []
    started = False
    for size, key in zip(sizes, keys):
        if large_alone and size >= limits[-1]:
            out += [Bucket(tuple(b)) for b in open_buckets.values() if b]
            out.append(Bucket((size,), alone=True))
            open_buckets, limit_index, started = {}, {}, True
            continue
        bucket = open_buckets.setdefault(key, [])
        bucket.append(size)
        # After a tensor of its own, the smaller first limit no longer applies (the route restarts torch's rule).
        k = limit_index.setdefault(key, len(limits) - 1 if started else 0)
        if sum(bucket) >= limits[k]:
            out.append(Bucket(tuple(bucket)))
            open_buckets[key] = []
            limit_index[key] = min(k + 1, len(limits) - 1)
    out += [Bucket(tuple(b)) for b in open_buckets.values() if b]
    return out


def ddp_in_flight_bound(buckets: Sequence[Bucket]) -> tuple[int, int, int]:
    """
    The most gradient bytes alive at once on the layer-wise data-parallel route, the index of the bucket filling
    when it is reached, and the bytes of the held large bucket in that sum: `max over k of held + size(k - 1) +
    size(k) + copy(k)` (see the module docstring), replaying the route's launches, steps and holds.

    Example:

    ```python
    >>> from layerwise_hf.estimate.buckets import Bucket, ddp_in_flight_bound
    >>> ddp_in_flight_bound([Bucket((2,)), Bucket((2, 3)), Bucket((1,))])  # 2 reducing, (2, 3) filling, 3 copied
    (10, 1, 0)
    >>> # 8 held (its successor is smaller) while (2, 3) reduces and (4,) fills; both step before (9,) fills
    >>> ddp_in_flight_bound([Bucket((8,), True), Bucket((2, 3)), Bucket((4,)), Bucket((9,), True)])
    (17, 2, 8)
    ```
    """
    best, where, best_held = 0, 0, 0
    flying, held = 0, 0
    for k, bucket in enumerate(buckets):
        alive = held + flying + bucket.nbytes + bucket.copy_bytes
        if alive > best:
            best, where, best_held = alive, k, held
        # Launching k retires the bucket in flight: held when it is a large one followed by a smaller one.
        if k and buckets[k - 1].alone and not bucket.alone and flying:
            held += flying
        flying = bucket.nbytes
        if held and k + 1 < len(buckets) and buckets[k + 1].alone:
            flying, held = 0, 0  # drained: the bucket in flight, then the held one, step before the next fills
    return best, where, best_held


def held_step_bound(sizes: Sequence[int]) -> tuple[int, int]:
    """
    One process (`layerwise_hf.routes.hooks.LocalHooks`): the most gradient bytes alive at once, and the held bytes in
    that sum, over gradient sizes in ready order. Each gradient steps and is freed in its own hook, except a large one
    (at least `LARGE_FRACTION` of the largest) followed by a smaller one: its step is held until the gradients before
    the next large one have stepped, so it is alive next to each of them, never next to that large one.

    Example:

    ```python
    >>> from layerwise_hf.estimate.buckets import held_step_bound
    >>> held_step_bound([8, 1, 3, 2, 8])  # 8 held next to 3; released before the last 8 is computed
    (11, 8)
    >>> held_step_bound([8, 8, 3])  # the first 8 is followed by a large one: stepped at once
    (11, 8)
    >>> held_step_bound([3, 8])
    (8, 0)
    ```
    """
    if not sizes:
        return 0, 0
    large = [s >= LARGE_FRACTION * max(sizes) for s in sizes]
    best, best_held, held = 0, 0, 0
    for k, size in enumerate(sizes):
        if large[k]:
            held = 0  # released before this one was computed
        if held + size > best:
            best, best_held = held + size, held
        if large[k] and k + 1 < len(sizes) and not large[k + 1]:
            held = size
    return best, best_held
