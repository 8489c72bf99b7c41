"""The run's mesh as users write it: `--nodes` / `--gpus-per-node` or `--world-size`, `--sharding`, and the mesh's
dimensions `--dp-replicate` x `--dp-shard` x `--tp` (Accelerate's `ParallelismConfig` names), for `estimate-memory`
and `plan`. Resolved and checked before anything is counted or simulated.

What is derived when left out:

- the world size: `--nodes` x `--gpus-per-node`, else `--world-size`, else the product of the dimensions given;
- the sharding: `fsdp2` when a dimension shards or replicates (`--dp-shard`, `--tp` or `--dp-replicate` above 1),
  else `ddp` on several ranks and `none` on one;
- one missing dimension from the others (`dp_replicate x dp_shard x tp == world size`); with neither
  `--dp-replicate` nor `--dp-shard`, `dp_replicate` is 1: FSDP2 shards over every rank, across nodes too, as
  Accelerate's FSDP2 config does without a `ParallelismConfig`. HSDP (one replica per node) is `--dp-replicate
  NODES`, and the plan says so.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from .units import SHARDINGS, EstimateError


@dataclass(frozen=True)
class Mesh:
    """
    A checked mesh: `world_size` ranks as `dp_replicate` x `dp_shard` x `tp` under `sharding`.

    Args:
        world_size (`int`): ranks (devices) of the run.
        sharding (`str`): `"none"`, `"ddp"` or `"fsdp2"`.
        dp_replicate (`int`): HSDP's replicas (1: none; always 1 under `ddp`, whose replicas are every rank).
        tp (`int`): the tensor-parallel size (1: none).
        nodes (`int`, *optional*), gpus_per_node (`int`, *optional*): as given.

    Example:

    ```python
    >>> from layerwise_hf.estimate.mesh import resolve_mesh
    >>> mesh = resolve_mesh(nodes=2, gpus_per_node=8, dp_replicate=2)
    >>> mesh.sharding, mesh.world_size, mesh.dp_shard, mesh.describe()
    ('fsdp2', 16, 8, 'ParallelismConfig(dp_replicate_size=2, dp_shard_size=8) with the FSDP2 config')
    ```
    """

    world_size: int = 1
    sharding: str = "none"
    dp_replicate: int = 1
    tp: int = 1
    nodes: int | None = None
    gpus_per_node: int | None = None

    @property
    def dp_shard(self) -> int:
        """FSDP2's shards of one replica's model along the data-parallel dimension (1 unless `fsdp2`)."""
        return self.world_size // (self.dp_replicate * self.tp) if self.sharding == "fsdp2" else 1

    def describe(self) -> str:
        """What a run writes to get this mesh: transformers' `DistributedConfig` with tensor parallel (the model is
        sharded at its load), Accelerate's `ParallelismConfig` for HSDP, else its FSDP2 or DDP config."""
        if self.tp > 1:
            sizes = [f"tp_size={self.tp}", f"fsdp_size={self.dp_shard}"]
            sizes += [f"dp_replicate_size={self.dp_replicate}"] * (self.dp_replicate > 1)
            return f"from_pretrained(..., distributed_config=DistributedConfig({', '.join(sizes)}))"
        if self.dp_replicate > 1:
            return (
                f"ParallelismConfig(dp_replicate_size={self.dp_replicate}, dp_shard_size={self.dp_shard}) with the "
                "FSDP2 config"
            )
        return {"fsdp2": "the FSDP2 config", "ddp": "the DDP (multi-GPU) config"}.get(self.sharding, "one process")

    def notes(self) -> list[str]:
        """The layout in the user's words, and what crosses nodes where that costs (slow links)."""
        if self.sharding != "fsdp2":
            return []
        where = f"{self.nodes} nodes x {self.gpus_per_node} = " if self.nodes else ""
        out = [
            f"mesh: {where}{self.world_size} ranks = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
            f"tp {self.tp} ({self.describe()})."
        ]
        if (self.nodes or 1) > 1 and self.sharding == "fsdp2" and self.dp_replicate == 1 and self.dp_shard > 1:
            out.append(
                f"FSDP2 shards over all {self.world_size} ranks, so every all-gather and reduce-scatter crosses "
                f"nodes; --dp-replicate {self.nodes} plans HSDP (shards within a node, replicas across nodes), "
                "whose ranks hold more."
            )
        if self.gpus_per_node and self.tp > self.gpus_per_node:
            out.append(f"tensor parallel {self.tp} spans nodes of {self.gpus_per_node} GPUs: its collectives, one "
                       "per projection, cross the slow link.")  # fmt: skip
        return out


def resolve_mesh(
    world_size: Any = None,
    sharding: str | None = None,
    dp_replicate: Any = None,
    dp_shard: Any = None,
    tp: Any = None,
    nodes: Any = None,
    gpus_per_node: Any = None,
) -> Mesh:
    """
    The mesh the options describe (rules in the module docstring), or an `EstimateError` naming the options that
    disagree and values that would work. Names are the command line's.

    Example:

    ```python
    >>> from layerwise_hf.estimate.mesh import resolve_mesh
    >>> resolve_mesh(nodes=2, gpus_per_node=8, tp=2).dp_shard
    8
    >>> resolve_mesh(world_size=16, dp_replicate=2, dp_shard=4)
    Traceback (most recent call last):
        ...
    layerwise_hf.estimate.units.EstimateError: --dp-replicate 2 x --dp-shard 4 x --tp 1 = 8 ranks, but the run has ...
    ```
    """
    for flag, value in (("--world-size", world_size), ("--dp-replicate", dp_replicate), ("--dp-shard", dp_shard),
                        ("--tp", tp), ("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            if flag == "--world-size":  # the words estimate() and plan() use for it
                raise EstimateError(f"world_size={value!r}: the number of devices, a whole number >= 1.")
            raise EstimateError(f"{flag} {value!r}: give a whole number >= 1.")
    if sharding is not None and sharding not in SHARDINGS:
        raise EstimateError(f"--sharding {sharding!r}: choose one of {', '.join(SHARDINGS)}.")
    world, source = _world_size(world_size, nodes, gpus_per_node, dp_replicate, dp_shard, tp)
    tp = tp or 1
    splits = (dp_shard or 1) > 1 or tp > 1 or (dp_replicate or 1) > 1
    sharding = sharding or ("fsdp2" if splits else "none" if world == 1 else "ddp")
    if sharding != "fsdp2" and splits:
        given = [f"{f} {v}" for f, v in (("--dp-replicate", dp_replicate), ("--dp-shard", dp_shard), ("--tp", tp))
                 if (v or 1) > 1]  # fmt: skip
        raise EstimateError(
            f"{' '.join(given)} with --sharding {sharding}: a mesh of several dimensions is FSDP2's (--sharding "
            f"fsdp2, or leave --sharding out); --sharding {sharding} replicates the whole model on every rank."
        )
    if sharding != "fsdp2":
        return Mesh(world, sharding, 1, 1, nodes, gpus_per_node)
    dp_replicate = _dimensions(world, source, dp_replicate, dp_shard, tp)
    return Mesh(world, sharding, dp_replicate, tp, nodes, gpus_per_node)


def _world_size(world_size, nodes, gpus_per_node, dp_replicate, dp_shard, tp) -> tuple[int, str]:
    """The ranks, and how the user gave them (for messages)."""
    if nodes is not None or gpus_per_node is not None:
        if gpus_per_node is None:
            raise EstimateError(
                f"--nodes {nodes} without --gpus-per-node: give the devices in each node, e.g. --nodes {nodes} "
                f"--gpus-per-node 8 ({nodes * 8} ranks), or --world-size."
            )
        nodes = nodes or 1
        source = f"--nodes {nodes} x --gpus-per-node {gpus_per_node}"
        if world_size is not None and world_size != nodes * gpus_per_node:
            raise EstimateError(
                f"--world-size {world_size} but {source} = {nodes * gpus_per_node} ranks: give one of them (or make "
                "them agree)."
            )
        return nodes * gpus_per_node, source
    if world_size is not None:
        return world_size, f"--world-size {world_size}"
    if dp_shard is None and dp_replicate is None and tp is None:
        return 1, "one process"
    world = (dp_replicate or 1) * (dp_shard or 1) * (tp or 1)
    return world, f"{world} ranks from the mesh's dimensions"


def _dimensions(world: int, source: str, dp_replicate, dp_shard, tp: int) -> int:
    """`dp_replicate` once the dimensions are checked against `world`; a missing one is derived."""
    product = (dp_replicate or 1) * (dp_shard or 1) * tp
    given = [f"{f} {v}" for f, v in (("--dp-replicate", dp_replicate), ("--dp-shard", dp_shard)) if v is not None]
    given.append(f"--tp {tp}")
    if dp_replicate is not None and dp_shard is not None and product != world:
        raise EstimateError(
            f"{' x '.join(given)} = {product} ranks, but the run has {world} ({source}): "
            f"{_what_works(world, dp_replicate, dp_shard, tp)}."
        )
    if world % product:
        raise EstimateError(
            f"{' x '.join(given)}{f' = {product}' if len(given) > 1 else ''} does not divide the {world} ranks "
            f"({source}): "
            f"{_what_works(world, dp_replicate, dp_shard, tp)}."
        )
    if dp_replicate is not None:
        return dp_replicate
    return world // (dp_shard * tp) if dp_shard is not None else 1


def _what_works(world: int, dp_replicate, dp_shard, tp: int) -> str:
    """Values that multiply to `world`, keeping what was given where it divides."""
    if world % tp:
        divisors = [t for t in range(2, min(world, 8) + 1) if world % t == 0]
        return f"--tp must divide the ranks ({', '.join(map(str, divisors)) or 'none above 1'})"
    options = []
    if dp_replicate and world % (dp_replicate * tp) == 0:
        options.append(f"--dp-replicate {dp_replicate} --dp-shard {world // (dp_replicate * tp)}")
    if dp_shard and world % (dp_shard * tp) == 0:
        options.append(f"--dp-replicate {world // (dp_shard * tp)} --dp-shard {dp_shard}")
    options = options or [f"--dp-shard {world // tp}"]
    with_tp = f" with --tp {tp}" if tp > 1 else ""
    return f"e.g. {' or '.join(options)}{with_tp} (or leave --dp-replicate or --dp-shard out: it is derived)"


def add_mesh_arguments(parser: argparse.ArgumentParser, sharding_help: str) -> None:
    """`--world-size`, `--nodes`, `--gpus-per-node`, `--sharding`, `--dp-replicate`, `--dp-shard`, `--tp`; read back
    with `mesh_of(args)`."""
    parser.add_argument("--world-size", type=int, default=None, help="Ranks (devices) of the run (default 1, or "
                        "--nodes x --gpus-per-node, or the product of the mesh's dimensions).")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=None, help="Machines of the run (with --gpus-per-node).")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="Devices per machine: world size = --nodes x "
                        "--gpus-per-node (e.g. 2 x 8 = 16).")  # fmt: skip
    parser.add_argument("--sharding", choices=SHARDINGS, default=None, help=sharding_help)
    parser.add_argument(
        "--dp-replicate",
        type=int,
        default=None,
        help="HSDP: the ranks as this many replicas (e.g. --nodes: one per node), each sharded over --dp-shard ranks "
        "(ParallelismConfig's dp_replicate_size; default: derived, or 1: FSDP2 over every rank).",
    )
    parser.add_argument(
        "--dp-shard",
        type=int,
        default=None,
        help="FSDP2's shards of each replica (ParallelismConfig's dp_shard_size, DistributedConfig's fsdp_size; "
        "default: world size / (dp-replicate x tp)).",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="Tensor parallel: the model sharded as transformers' DistributedConfig(tp_size=TP, fsdp_size=dp-shard) "
        "shards it at the load, its tensor-parallel plan (for Llama q/k/v/gate/up by column, o/down by row, the "
        "embedding and lm_head by vocabulary; norms replicated) (default 1).",
    )


def mesh_of(args: argparse.Namespace) -> Mesh:
    """The mesh `add_mesh_arguments`' options describe (`resolve_mesh`)."""
    names = ("world_size", "sharding", "dp_replicate", "dp_shard", "tp", "nodes", "gpus_per_node")
    return resolve_mesh(**{n: getattr(args, n, None) for n in names})


def layout_words(world_size: int, dp_replicate: int, tp: int) -> str:
    """
    The FSDP2 layout in words, e.g. `HSDP: 2 replicas x tensor parallel 2 x 4 FSDP2 shards`.

    Example:

    ```python
    >>> from layerwise_hf.estimate.mesh import layout_words
    >>> layout_words(16, 2, 1), layout_words(4, 1, 4)
    ('HSDP: 2 replicas x 8 FSDP2 shards', 'tensor parallel 4 alone')
    ```
    """
    shards = world_size // dp_replicate
    fsdp = f"{shards // tp} FSDP2 shards"
    if tp > 1:
        fsdp = f"tensor parallel {tp}" + (f" x {fsdp}" if shards > tp else " alone")
    return f"HSDP: {dp_replicate} replicas x {fsdp}" if dp_replicate > 1 else fsdp
