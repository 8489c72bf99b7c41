"""Gradient buckets under a DDP configuration, as `layerwise_hf.data_parallel` forms and reduces them, in plain Python
(no process group needed): which gradients share an all-reduce, and the most gradient bytes the layer-wise route holds
at once.

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
  reducing) is waited for, stepped and freed.

So the gradient bytes alive at once are at most, over consecutive buckets `k - 1`, `k`:
`size(k - 1) + size(k) + (largest tensor of k, when k holds several: its .grad during the copy)`. That is
`ddp_in_flight_bound`. It assumes every parameter is used in forward and that `.grad` is freed by each step (no
gradient accumulation, no clipping that holds gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIB = 2**20
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
    a bucket of its own.

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
            out.append(Bucket((size,)))
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


def ddp_in_flight_bound(buckets: Sequence[Bucket]) -> tuple[int, int]:
    """
    The most gradient bytes alive at once on the layer-wise data-parallel route, and the index of the bucket where it
    is reached: `max over k of size(k - 1) + size(k) + copy(k)` (see the module docstring).

    Example:

    ```python
    >>> from layerwise_hf.estimate.buckets import Bucket, ddp_in_flight_bound
    >>> ddp_in_flight_bound([Bucket((8,)), Bucket((2, 3)), Bucket((1,))])  # 8 reducing, (2, 3) filling, 3 copied
    (16, 1)
    ```
    """
    best, where, previous = 0, 0, 0
    for k, bucket in enumerate(buckets):
        alive = previous + bucket.nbytes + bucket.copy_bytes
        if alive > best:
            best, where = alive, k
        previous = bucket.nbytes
    return best, where
