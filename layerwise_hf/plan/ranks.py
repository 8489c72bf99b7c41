"""One rank of a data-parallel (DDP) or sharded (FSDP2) run, simulated in one process with a fake process group.

`torch.testing._internal.distributed.fake_pg` registers the `"fake"` backend: collectives return at once and move no
data, which is all a run on fake tensors needs. The simulated rank is rank 0; every rank holds as much (FSDP2 pads
each shard to the same size; DDP replicates). The route is the one that rank takes in a real run, through the real
code:

- `ddp`, standard optimizer: torch's `DistributedDataParallel` with DDP's default buckets; its C++ reducer allocates
  the buckets (gradient memory for the whole run) and copies them back into `.grad` (`gradient_as_bucket_view=False`,
  Accelerate's default).
- `ddp`, layer-wise: the model is not wrapped (as `LayerwiseTrainer` prepares it) and `LayerwiseOptimizer.connect()`
  picks `DataParallelReducer` from Accelerate's DDP settings: its buckets in flight.
- `fsdp2`: Accelerate's own `fsdp2_prepare_model` (`fully_shard` per decoder layer, the input embedding, the final
  norm with the head, and the root; fp32 master weights and a bf16 / fp16 `MixedPrecisionPolicy` under mixed
  precision), the optimizer built afterwards (Trainer delays it under FSDP). Each rank holds its padded shards of
  weights, gradients and state; a unit's all-gathered weights live from its all-gather to its reshard, its
  reduce-scatter buffers through the next unit's. Layer-wise: `connect()` picks `FSDP2Hooks`, with
  `LocalShardOptimizer` for optimizers that step local shards.

Categories at the peak: FSDP2's all-gather buffers and unsharded weights count as weights, its unsharded gradients
and reduce-scatter buffers as gradients; DDP's buckets as gradients.

The backend: `device="cuda"` plans NCCL, whose collectives write into the caller's buffers and allocate no tensors;
`device="cpu"` plans gloo (Accelerate's backend on CPU ranks), whose FSDP2 collectives allocate a temporary of their
own while they run (`_gloo_buffers`; DDP's and the layer-wise route's all-reduces run in place on both).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from ..bases.support import FSDP2_LOCAL_SHARD, SUFFIX, fsdp2_supports_base
from ..estimate.optimizers import parse_optimizer
from ..estimate.sharding import check_replicas, check_tensor_parallel
from ..estimate.units import SHARDINGS, EstimateError
from .tracker import GRADIENTS, WEIGHTS, LiveBytes

RANK = 0  # the simulated rank: FSDP2 pads every rank's shard to the same size, so all ranks hold the same bytes


def check_ranks(world_size: Any, sharding: Any, optimizers: list[str], dp_replicate: Any = 1, tp: Any = 1) -> None:
    """
    Refuse a world size or sharding no run could have, naming the valid choices, before anything is simulated.

    Example:

    ```python
    >>> from layerwise_hf.plan.ranks import check_ranks
    >>> check_ranks(8, "fsdp2", ["adamw_torch", "adamw_8bit_layerwise"])  # passes
    >>> check_ranks(2, "none", ["adamw_torch"])
    Traceback (most recent call last):
        ...
    layerwise_hf.estimate.units.EstimateError: world_size=2 with sharding='none': choose sharding 'ddp' or 'fsdp2' ...
    ```
    """
    if sharding not in SHARDINGS:
        raise EstimateError(f"sharding={sharding!r}: choose one of {', '.join(SHARDINGS)}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise EstimateError(f"world_size={world_size!r}: the number of ranks (devices), a whole number >= 1.")
    if sharding == "none" and world_size > 1:
        raise EstimateError(
            f"world_size={world_size} with sharding='none': choose sharding 'ddp' or 'fsdp2' for several ranks."
        )
    if sharding == "ddp" and world_size == 1:
        raise EstimateError(
            "sharding='ddp' with world_size=1: one process runs without DDP (Accelerate does not wrap it; the "
            "layer-wise route is the local one). Use sharding='none', or world_size >= 2."
        )
    check_replicas(world_size, sharding, dp_replicate)
    # Planned as transformers shards it at the load: the estimator's rule for a tensor-parallel layout.
    check_tensor_parallel(world_size, sharding, dp_replicate, tp)
    if sharding == "fsdp2":
        refused = [f"{n}: {why}" for n in optimizers if (why := fsdp2_refusal(n, tp))]
        if refused:
            from ..bases.support import FSDP2_DTENSOR_NATIVE, FSDP2_ELEMENTWISE

            good = sorted({*FSDP2_ELEMENTWISE, *FSDP2_DTENSOR_NATIVE, *(FSDP2_LOCAL_SHARD if tp == 1 else ())})
            raise EstimateError(
                f"under sharding='fsdp2', {'; '.join(refused)}. Choose one of: "
                f"{', '.join(b + SUFFIX for b in good)}, or a standard optimizer that steps DTensors "
                f"({', '.join(sorted({*FSDP2_ELEMENTWISE, *FSDP2_DTENSOR_NATIVE}))}); or sharding='ddp'."
            )


def fsdp2_refusal(name: str, tp: int = 1) -> str | None:
    """
    Why a run cannot step `name` (a Trainer optimizer name) under FSDP2, or `None`: the route table's word for a
    layer-wise name, and the standard optimizers whose kernels take no DTensor.

    Example:

    ```python
    >>> from layerwise_hf.plan.ranks import fsdp2_refusal
    >>> fsdp2_refusal("adamw_8bit_layerwise") is None, fsdp2_refusal("adamw_8bit").startswith("it cannot step")
    (True, True)
    ```
    """
    base, layerwise = parse_optimizer(name)
    if layerwise and not fsdp2_supports_base(base):
        return "the route table refuses it (its update is not per element of a shard)"
    if not layerwise and base in FSDP2_LOCAL_SHARD:
        return (
            "it cannot step FSDP2's DTensors (bitsandbytes' kernels take plain tensors; transformers' Adafactor "
            f"mixes DTensors with plain tensors), so a real run fails at its first step; {name}{SUFFIX} steps each "
            "rank's local shard"
        )
    return None


def needs_fresh_process(sharding: str) -> bool:
    """Whether this process already runs a process group (a preflight inside a real run): the fake ranks then run in
    a fresh process, since the fake group must be the default one (FSDP2's mesh, DDP and the layer-wise routes use
    the default group)."""
    return sharding != "none" and torch.distributed.is_available() and torch.distributed.is_initialized()


def in_fresh_process(function, *args):
    """`function(*args)` in a spawned Python process (nothing of this one's process group or CUDA state inherited)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


@contextlib.contextmanager
def fake_group(world_size: int, sharding: str) -> Iterator[None]:
    """The default process group as `world_size` fake ranks, this process rank `RANK`, while the context lasts."""
    if sharding == "none":
        yield
        return
    import torch.distributed as dist

    # NOTE: importing fake_pg registers the "fake" backend (torch 2.13: torch.testing._internal.distributed).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # NOTE: init_process_group prefixes "[rank0]" to every later traceback through sys.excepthook.
        sys.excepthook = hook


class RankRoute:
    """
    What one rank's run adds to the simulated step: how the model is prepared, which route the layer-wise optimizer
    takes, the no-sync context of an accumulation window, and the labels of the collectives' buffers.

    Args:
        sharding (`str`): `"none"`, `"ddp"` or `"fsdp2"`.
        tracker (`LiveBytes`): counts the step.
        setup (`StepSetup`): Trainer's arguments (mixed precision, checkpointing).

    Example:

    ```python
    >>> # inside `simulate()`, with the fake process group up:
    >>> rank = RankRoute("fsdp2", tracker, setup)
    >>> model = rank.prepare(model)  # Accelerate's fsdp2_prepare_model: this rank's shards
    >>> rank.connect(layerwise_optimizer, model)
    'fsdp2'
    ```
    """

    def __init__(self, sharding: str, tracker: LiveBytes, setup: Any):
        self.sharding = sharding
        self.tracker = tracker
        self.setup = setup
        self.ddp: torch.nn.Module | None = None

    # ---- preparing the model (before counting starts) ----

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2: Accelerate's `fsdp2_prepare_model` on the fake model (its weights become this rank's shards); with
        tensor parallel, transformers' own sharding at the load (`DistributedConfig`), which Accelerate leaves be."""
        if self.sharding != "fsdp2":
            return model
        if self.setup.tp > 1:
            from transformers import DistributedConfig

            # NOTE: what from_pretrained(distributed_config=...) does between the model's init and its weights
            # (transformers 5.24, distributed/mixin.py); the replicas of HSDP are left out as for Accelerate's HSDP.
            config = DistributedConfig(tp_size=self.setup.tp, fsdp_size=self.setup.shards // self.setup.tp)
            cls = type(model)
            config, _, meshes = cls.prepare_distribute_model(config)
            return cls.maybe_distribute_model(model, config, meshes)
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        precision = "bf16" if self.setup.bf16 else "fp16" if self.setup.fp16 else "no"
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            reshard_after_forward=True,
            cpu_ram_efficient_loading=False,
            state_dict_type="SHARDED_STATE_DICT",
        )
        if precision != "no":
            plugin.set_mixed_precision(precision)
        # NOTE: what fsdp2_prepare_model reads of the Accelerator (accelerate 1.15); no device mesh: one FSDP dim.
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(fsdp_plugin=plugin),
            mixed_precision=precision,
            is_main_process=False,
            torch_device_mesh=None,
        )
        # NOTE: outside FakeTensorMode: the device mesh reads its rank table back from a tensor, which must be real;
        # the fake parameters carry their mode into fully_shard's ops.
        return fsdp2_prepare_model(accelerator, model)

    # ---- while counting ----

    @contextlib.contextmanager
    def labels(self) -> Iterator[None]:
        """Label the collectives' buffers while the step runs (see the module docstring)."""
        if self.sharding != "fsdp2":
            yield
            return
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

        cls = group_module.FSDPParamGroup
        saved = {"unshard": cls.unshard, "wait_for_unshard": cls.wait_for_unshard}
        reduce = group_module.foreach_reduce
        tracker = self.tracker
        gloo = self.setup.device == "cpu"

        def weights(method):
            def run(*args, **kwargs):
                with tracker.labelled(WEIGHTS):
                    return method(*args, **kwargs)

            return run

        def foreach_reduce(*args, **kwargs):
            # The tracker's gradient hook ends the label: FSDP2 calls the sharded parameters' hooks (a layer-wise
            # step) from inside foreach_reduce, after its buffers are allocated.
            with tracker.labelled(GRADIENTS):
                return reduce(*args, **kwargs)

        for name, method in saved.items():
            setattr(cls, name, weights(method))
        group_module.foreach_reduce = foreach_reduce
        with _gloo_buffers(tracker) if gloo else contextlib.nullcontext():
            try:
                yield
            finally:
                for name, method in saved.items():
                    setattr(cls, name, method)
                group_module.foreach_reduce = reduce

    def forward_module(self, model: torch.nn.Module, layerwise: bool) -> torch.nn.Module:
        """The module the step calls: DDP around the model for a standard optimizer under `ddp`."""
        if self.sharding != "ddp" or layerwise:
            return model
        import torch.distributed as dist
        import torch.nn.parallel.distributed as ddp_module

        verify = ddp_module._verify_param_shape_across_processes
        # NOTE: DDP's constructor compares parameter shapes across ranks by reading their data, which fake tensors do
        # not have; the fake ranks are alike by construction.
        ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
        try:
            # NOTE: without find_unused_parameters (Trainer turns it on unless activation checkpointing is on): at
            # the end of backward the C++ reducer reads the all-reduced used flags' values, which fake tensors do
            # not have. The flags are one int per parameter; the buckets hold every gradient either way.
            with self.tracker.labelled(GRADIENTS):  # the buckets, allocated by the C++ reducer
                ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        finally:
            ddp_module._verify_param_shape_across_processes = verify
        world = dist.get_world_size()

        def allreduce(state, bucket):
            # NOTE: the fake backend's work carries no result, and DDP requires its hook to return the bucket: this
            # does in place what DDP's built-in hook does (divide by the world size, all-reduce in place).
            buffer = bucket.buffer().div_(world)
            dist.all_reduce(buffer)
            future = torch.futures.Future()
            future.set_result(buffer)
            return future

        ddp.register_comm_hook(None, allreduce)
        pre_forward = ddp._pre_forward

        def pre_forward_without_rebuild(*args, **kwargs):
            # NOTE: after the first backward DDP rebuilds its buckets in the order gradients arrived, and agrees on
            # them across ranks by reading a broadcast index tensor's values, which fake tensors do not have. The
            # rebuilt buckets split the same gradients at other boundaries: every gradient stays in one bucket.
            reducer = ddp.reducer
            ddp.reducer = _NoRebuild(reducer)
            try:
                return pre_forward(*args, **kwargs)
            finally:
                ddp.reducer = reducer

        ddp._pre_forward = pre_forward_without_rebuild
        self.ddp = ddp
        return ddp

    def connect(self, optimizer: Any, model: torch.nn.Module) -> str:
        """`LayerwiseOptimizer.connect()` as Trainer calls it for this rank: the route the run would take."""
        accelerator = None
        if self.sharding == "ddp":
            from accelerate.utils import DistributedDataParallelKwargs

            # NOTE: what DataParallelConfig.from_accelerator reads of an Accelerator under a DDP config (Trainer's
            # find_unused_parameters: off with activation checkpointing).
            handler = DistributedDataParallelKwargs(find_unused_parameters=not self.setup.gradient_checkpointing)
            accelerator = types.SimpleNamespace(
                distributed_type="MULTI_GPU",
                ddp_handler=handler,
                gradient_state=types.SimpleNamespace(plugin_kwargs={"sync_each_batch": self.setup.sync_each_batch}),
            )
        name = optimizer.connect(model, accelerator=accelerator)
        route = optimizer.pipeline.route
        if name == "data_parallel":
            # NOTE: rank 0's gradient order wins the bucket agreement (a broadcast from rank 0), and the simulated
            # rank is rank 0; a fake tensor has no values to read that order back from.
            route._agree = lambda order: order
            # A bucket's buffer is allocated where the first gradient is copied in (`_put`); not `_launch`, which
            # may step buckets (their temporaries are the step's).
            route._put = self._as_gradients(route._put)
        return name

    def _as_gradients(self, method):
        def run(*args, **kwargs):
            with self.tracker.labelled(GRADIENTS):
                return method(*args, **kwargs)

        return run

    def no_sync(self, module: torch.nn.Module, last: bool):
        """Accelerate's `no_sync` for a micro-batch that does not end the window (a layer-wise DDP route reads
        `sync_gradients` instead)."""
        if last or self.setup.sync_each_batch:
            return contextlib.nullcontext()
        if self.sharding == "fsdp2" and hasattr(module, "set_requires_gradient_sync"):  # not tensor parallel alone
            return _fsdp2_no_sync(module)
        if self.ddp is not None:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def watch_unsharded(self, model: torch.nn.Module) -> list:
        """FSDP2: gradients of the unsharded weights counted as gradients from the moment autograd makes them (the
        unsharded parameters exist once a first step has all-gathered them)."""
        if self.sharding != "fsdp2":
            return []
        handles = []
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
            for fsdp_param in getattr(group, "fsdp_params", []):
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None and unsharded.requires_grad:
                    handles.append(unsharded.register_post_accumulate_grad_hook(self.tracker.gradient_hook(
                        fsdp_param._param_fqn or "unsharded weight")))  # fmt: skip
        return handles


@contextlib.contextmanager
def _gloo_buffers(tracker: LiveBytes) -> Iterator[None]:
    """FSDP2's collectives allocate what gloo's do while they run: the reduce-scatter's clone of its input (counted
    as a gradient), the all-gather's flat output (weights)."""
    # NOTE: what gloo allocates inside a collective (torch 2.13, ProcessGroupGloo.cpp): the reduce-scatter
    # (reduce_scatter_tensor_coalesced) clones its whole input, all-reduces the clone and copies this rank's chunk
    # out; the all-gather into one tensor gathers into a flat tensor of the output's size and copies it into the
    # output's chunks. Measured on 2 real gloo ranks with the CPU allocator counted on every thread: a reduce-scatter
    # of a 16 MiB input peaks 16 MiB above its input and output, an all-gather into a 16 MiB output 16 MiB above,
    # neither holds anything afterwards, and an all-reduce allocates nothing. NCCL does neither and the fake process
    # group allocates nothing, so a CUDA plan adds nothing. Without these the 2-rank FSDP2 rows of
    # benchmarks/plan_accuracy.py were 6.3% (standard) and 3.4% (layer-wise) under the measured peak; with them 0.03%.
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    gather, scatter = collectives.DefaultAllGather.__call__, collectives.DefaultReduceScatter.__call__

    def with_buffer(call, category: str, like: str):
        def run(comm, output_tensor, input_tensor, *args, **kwargs):
            with tracker.labelled(category):
                buffer = torch.empty_like(output_tensor if like == "output" else input_tensor)
            try:
                return call(comm, output_tensor, input_tensor, *args, **kwargs)
            finally:
                del buffer

        return run

    collectives.DefaultAllGather.__call__ = with_buffer(gather, WEIGHTS, "output")
    collectives.DefaultReduceScatter.__call__ = with_buffer(scatter, GRADIENTS, "input")
    try:
        yield
    finally:
        collectives.DefaultAllGather.__call__ = gather
        collectives.DefaultReduceScatter.__call__ = scatter


class _NoRebuild:
    """DDP's C++ reducer, but `_rebuild_buckets()` keeps the buckets (see `RankRoute.forward_module`)."""

    def __init__(self, reducer: Any):
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


@contextlib.contextmanager
def _fsdp2_no_sync(module: torch.nn.Module) -> Iterator[None]:
    # NOTE: Accelerator.no_sync under FSDP2: set_requires_gradient_sync(False), so unsharded gradients accumulate.
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
