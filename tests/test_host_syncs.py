"""Host syncs per training step: layer-wise must not add any to what the standard optimizer makes.

On CUDA a host sync inside a gradient hook stalls backward: the host waits for the device, and the kernels of the rest
of backward are not queued meanwhile. On CPU the same calls are visible to a `TorchDispatchMode`:
- `aten._local_scalar_dense`: `.item()`, `bool(tensor)`, `float(tensor)` (a device-to-host copy on CUDA);
- `aten.lift_fresh`: `torch.tensor(data)` from host data (on CUDA a blocking host-to-device copy);
- `Tensor.tolist()`, which on CPU reads the memory without dispatching anything (on CUDA it copies to the host first),
  so it is counted by wrapping the method.
On CPU every such read counts, also those of tensors that stay on the host under CUDA (DDP's used map, torch AdamW's
step count): the counts are an upper bound of the syncs, compared between layer-wise and the standard optimizer.
"""

import collections
import contextlib
import gc

import pytest
import torch
import torch.distributed as dist
from helpers import (
    TokenDataset,
    assert_params_equal,
    clone,
    rank_comparison,
    spawned_results,
    tiny_llama,
    train,
    training_args,
    write_rank_report,
)
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Trainer, TrainerCallback

from layerwise_hf import LayerwiseOptimizer, LayerwiseParam, build_layerwise_optimizer
from layerwise_hf.optim.norm_pass import run_with_norm_pass
from layerwise_hf.routes.data_parallel import DataParallelConfig, DataParallelReducer

KINDS = ("scalar", "tolist", "from_host")
IN_BACKWARD = tuple(f"{kind} in backward" for kind in KINDS)
BIG = {"vocab": 256, "hidden": 64}


class HostSyncs(TorchDispatchMode):
    """Counts, by kind (`KINDS`), the calls that make the host wait for the device on CUDA; those made while backward
    runs are counted again under "<kind> in backward"."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self._count("scalar")
        elif func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self._count("from_host")
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str) -> None:
        self.counts[kind] += 1
        if torch._C._current_graph_task_id() != -1:
            # NOTE: the autograd engine sets a graph task id while backward runs (gradient hooks, DDP's comm hooks
            # and end-of-backward callbacks included); it is -1 outside.
            self.counts[f"{kind} in backward"] += 1

    def __enter__(self):
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self._count("tolist")
            return tolist(tensor)

        # NOTE: a TorchFunctionMode would not see it: torch-function modes are off while `backward` runs (the mode
        # is popped around the call it intercepts), so it misses everything inside gradient hooks.
        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        del torch.Tensor.tolist  # back to TensorBase's
        return super().__exit__(*exc)

    def snapshot(self) -> dict[str, int]:
        return {k: self.counts[k] for k in KINDS + IN_BACKWARD}


def per_step(snapshots: list[dict[str, int]]) -> list[dict[str, int]]:
    return [{k: b[k] - a[k] for k in a} for a, b in zip(snapshots, snapshots[1:])]


def assert_no_more_than(layerwise: list[dict[str, int]], standard: list[dict[str, int]], what: str) -> None:
    assert len(layerwise) == len(standard) > 0, what
    for step, (lw, std) in enumerate(zip(layerwise, standard), start=1):
        for kind in KINDS:
            assert lw[kind] <= std[kind], f"{what}, step {step}: {kind} layer-wise {lw} > standard {std}"


# ---- Trainer, one process ----


class StepSnapshots(TrainerCallback):
    """The counts at the start of training and at the end of every step: a step's calls include the logging that
    follows the previous step."""

    def __init__(self, syncs: HostSyncs):
        self.syncs = syncs
        self.snapshots: list[dict[str, int]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.snapshots.append(self.syncs.snapshot())

    def on_step_end(self, args, state, control, **kwargs):
        self.snapshots.append(self.syncs.snapshot())


def trainer_syncs(model, args, dataset) -> list[dict[str, int]]:
    syncs = HostSyncs()
    recorder = StepSnapshots(syncs)
    with syncs:
        train(model, args, dataset=dataset, callbacks=[recorder])
    return per_step(recorder.snapshots)


def assert_hooks_read_only_step_counts(layerwise: list[dict[str, int]], base: str, model, what: str) -> None:
    """After the first step (the optimizers build their states there), what runs inside backward reads nothing back
    but torch AdamW's step count, one per parameter: a CPU tensor on CUDA too (not capturable), so no sync there."""
    reads = len(list(model.parameters())) if base == "adamw_torch" else 0
    for step, counts in enumerate(layerwise[1:], start=2):
        assert counts["tolist in backward"] == counts["from_host in backward"] == 0, (what, step, counts)
        assert counts["scalar in backward"] <= reads, (what, step, counts)


MODELS = {"adamw_torch": {}, "adamw_8bit": BIG}  # bitsandbytes quantizes tensors of >= 4096 elements


@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip", "noclip"])
@pytest.mark.parametrize("base", ["adamw_torch", "adamw_8bit"])
def test_trainer_step_makes_no_more_host_syncs_than_standard(tmp_path, base, max_grad_norm, ga):
    model = tiny_llama(**MODELS[base])
    dataset = TokenDataset(n=8 * ga, vocab=model.config.vocab_size)
    kwargs = dict(max_steps=2, warmup_steps=1, max_grad_norm=max_grad_norm, gradient_accumulation_steps=ga)
    standard = trainer_syncs(clone(model), training_args(tmp_path, base, **kwargs), dataset)
    layerwise = trainer_syncs(clone(model), training_args(tmp_path, f"{base}_layerwise", **kwargs), dataset)
    what = f"{base} max_grad_norm={max_grad_norm} ga={ga}"
    # Trainer's own logging reads the loss and the grad norm every step: the counter must have seen them.
    assert len(standard) == 2 and all(step["scalar"] > 0 for step in standard), standard
    assert_no_more_than(layerwise, standard, what)
    assert_hooks_read_only_step_counts(layerwise, base, model, what)


# ---- a one-rank gloo group: the DDP comm-hook route and the data-parallel route in this process ----


class Net(torch.nn.Module):
    """Three layers (several DDP buckets under a small cap), and optionally a parameter the forward never uses."""

    def __init__(self, unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 4)
        self.unused = torch.nn.Parameter(torch.ones(4, 4)) if unused else None

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def ddp_syncs(model, make_optimizer, layerwise: bool, steps: int = 3, **ddp_kwargs):
    """Trains `model` wrapped in DDP, with the standard optimizer or the layer-wise one on DDP's comm hook; returns
    the calls per step (forward, backward, step) and the number of gradient buckets."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01, **ddp_kwargs)
    if layerwise:
        params = [LayerwiseParam(n, p, weight_decay=0.1) for n, p in model.named_parameters()]
        optimizer = LayerwiseOptimizer(
            params, lambda lp, args: make_optimizer([lp.param]), sync_gradients=lambda: True
        )
        assert optimizer.connect(ddp) == "ddp"
    else:
        optimizer = make_optimizer(list(model.parameters()))
    g = torch.Generator().manual_seed(0)
    syncs = HostSyncs()
    snapshots = [syncs.snapshot()]
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        with syncs:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        snapshots.append(syncs.snapshot())
    buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    if layerwise:
        optimizer.detach()  # the comm hook's state no longer points at the optimizer (a cycle through C++)
    return per_step(snapshots), buckets


def sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1)


@pytest.mark.parametrize(
    "ddp_kwargs", [{"find_unused_parameters": True}, {"static_graph": True}], ids=lambda k: "-".join(k)
)
def test_ddp_comm_hook_adds_no_host_sync_when_every_parameter_is_used(one_rank_group, ddp_kwargs):
    model = Net()
    standard_model, layerwise_model = clone(model), clone(model)
    standard, buckets = ddp_syncs(standard_model, sgd, layerwise=False, **ddp_kwargs)
    layerwise, _ = ddp_syncs(layerwise_model, sgd, layerwise=True, **ddp_kwargs)
    assert buckets >= 2
    # Each bucket's used flags are all-reduced (every rank must take part) but neither built from a list nor read
    # back: the route adds nothing to what DDP and SGD make.
    assert all(step["tolist"] == step["from_host"] == 0 for step in standard), standard
    assert layerwise == standard
    assert_params_equal(standard_model, layerwise_model)
    assert not torch.equal(next(model.parameters()), next(layerwise_model.parameters()))


def test_ddp_comm_hook_skips_a_parameter_no_rank_used_as_ddp_does(one_rank_group):
    model = Net(unused=True)
    standard_model, layerwise_model = clone(model), clone(model)
    standard, buckets = ddp_syncs(standard_model, sgd, layerwise=False, find_unused_parameters=True)
    layerwise, _ = ddp_syncs(layerwise_model, sgd, layerwise=True, find_unused_parameters=True)
    assert buckets >= 2
    # Weight decay would move a parameter stepped on a zero gradient: DDP leaves its .grad None.
    assert_params_equal(standard_model, layerwise_model)
    assert torch.equal(layerwise_model.unused, torch.ones(4, 4))
    assert not torch.equal(model.a.weight, layerwise_model.a.weight)
    # Only the bucket holding the unused parameter builds its flags from a list and reads them back.
    once = ("tolist", "from_host", "tolist in backward", "from_host in backward")
    for step, (lw, std) in enumerate(zip(layerwise, standard), start=1):
        assert lw == {**std, **{kind: std[kind] + 1 for kind in once}}, (step, lw, std)


# ---- the data-parallel route (the DDP config) ----


def data_parallel_syncs(model, args, layerwise: bool, steps: int = 2) -> list[dict[str, int]]:
    """Trainer's step under a DDP config, in a plain loop on the one-rank group. Layer-wise: the route that
    `choose_route` picks with more than one rank (`DataParallelReducer`, DDP's settings as Trainer passes them), each
    micro-batch through `run_with_norm_pass` as `LayerwiseTrainer.training_step` does. Standard: the model in DDP, no
    sync on a window's first micro-batches, `clip_grad_norm_`, the optimizer Trainer would build."""
    ga, clip = args.gradient_accumulation_steps, args.max_grad_norm
    final = [True]
    if layerwise:
        optimizer = build_layerwise_optimizer(model, args, sync_gradients=lambda: final[0], track_grad_norm=True)
        optimizer.configure_clipping(clip, "exact")
        # Trainer's find_unused_parameters without activation checkpointing: the route's used-flag all-reduces run.
        optimizer.connect(route=DataParallelReducer(model, DataParallelConfig(find_unused_parameters=True)))
        wrapped = model
    else:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        decay = set(Trainer.get_decay_parameter_names(None, model))
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        optimizer = cls(groups, **kwargs)
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    batches = TokenDataset(n=steps * ga * 4, vocab=model.config.vocab_size).ids.split(4)
    syncs = HostSyncs()
    snapshots = [syncs.snapshot()]
    for step in range(steps):
        with syncs:
            for micro in range(ga):
                ids = batches[step * ga + micro]
                final[0] = micro == ga - 1

                def forward_backward(ids=ids):
                    # As Trainer: no KV cache in training.
                    loss = wrapped(input_ids=ids, labels=ids, use_cache=False).loss / ga
                    loss.backward()
                    return loss

                if layerwise:
                    run_with_norm_pass(optimizer, forward_backward, model)
                elif final[0]:
                    forward_backward()
                else:
                    with wrapped.no_sync():
                        forward_backward()
            if layerwise:
                grad_norm = optimizer.grad_norm()
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            optimizer.step()
            optimizer.zero_grad()
            float(grad_norm)  # Trainer logs it
        snapshots.append(syncs.snapshot())
    if layerwise:
        optimizer.detach()
    return per_step(snapshots)


@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip", "noclip"])
@pytest.mark.parametrize("base", ["adamw_torch", "adamw_8bit"])
def test_data_parallel_step_makes_no_more_host_syncs_than_ddp(one_rank_group, tmp_path, base, max_grad_norm, ga):
    model = tiny_llama(**MODELS[base])
    standard_model, layerwise_model = clone(model), clone(model)
    kwargs = dict(max_grad_norm=max_grad_norm, gradient_accumulation_steps=ga)
    standard = data_parallel_syncs(standard_model, training_args(tmp_path, base, **kwargs), layerwise=False)
    layerwise = data_parallel_syncs(
        layerwise_model, training_args(tmp_path, f"{base}_layerwise", **kwargs), layerwise=True
    )
    what = f"{base} max_grad_norm={max_grad_norm} ga={ga}"
    # Once per run, in the first step: the ranks agree on the bucket order (rank 0's, broadcast and read back) after
    # the first forward and after the first backward, as DDP rebuilds its buckets once.
    first = {**layerwise[0], "tolist": layerwise[0]["tolist"] - 2, "from_host": layerwise[0]["from_host"] - 2}
    assert_no_more_than([first, *layerwise[1:]], standard, what)
    # Every parameter is used: no bucket's used flags are built from a list or read back.
    assert_hooks_read_only_step_counts(layerwise, base, model, what)
    if base == "adamw_torch":  # the route really trained (8-bit: Trainer's 32-bit embedding override is not here)
        assert_params_equal(standard_model, layerwise_model)
    assert not torch.equal(model.model.norm.weight, layerwise_model.model.norm.weight)


# ---- two ranks: the DDP comm-hook route skips exactly what DDP skips ----


class TwoRankNet(Net):
    """`Net` with a parameter no rank uses and one only rank 0 uses (the other ranks' flags say unused, the
    all-reduced ones say used: its averaged gradient must step)."""

    def __init__(self):
        super().__init__(unused=True)
        self.used_on_rank0 = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        out = super().forward(x)
        return out + 1e-2 * self.used_on_rank0 if dist.get_rank() == 0 else out


def _two_rank_worker(rank: int, store_path: str, report: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(store_path, 2))
    torch.set_num_threads(1)
    results = {}
    for ga in (1, 2):
        for bucket_view in (False, True):
            models = {}
            for layerwise in (False, True):
                model = TwoRankNet()
                ddp = torch.nn.parallel.DistributedDataParallel(
                    model, bucket_cap_mb=0.01, find_unused_parameters=True, gradient_as_bucket_view=bucket_view
                )
                final = [True]
                if layerwise:
                    params = [LayerwiseParam(n, p, weight_decay=0.1) for n, p in model.named_parameters()]
                    optimizer = LayerwiseOptimizer(
                        params, lambda lp, args: sgd([lp.param]), sync_gradients=lambda final=final: final[0]
                    )
                    optimizer.connect(ddp)
                else:
                    optimizer = sgd(list(model.parameters()))
                g = torch.Generator().manual_seed(rank)
                for _ in range(3):
                    for micro in range(ga):
                        final[0] = micro == ga - 1
                        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
                        with contextlib.nullcontext() if final[0] else ddp.no_sync():
                            (torch.nn.functional.mse_loss(ddp(x), y) / ga).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                if layerwise:
                    optimizer.detach()
                models[layerwise] = model
            standard, layerwise = models[False], models[True]
            results[f"ga{ga} bucket_view={bucket_view}"] = {
                **rank_comparison(standard, layerwise),
                "unused_unchanged": torch.equal(layerwise.unused, torch.ones(4, 4)),
                "rank0_only_stepped": not torch.equal(layerwise.used_on_rank0, torch.ones(4)),
            }
    gc.collect()
    write_rank_report(rank, report, results)


@pytest.mark.slow
def test_ddp_comm_hook_on_two_ranks_skips_and_steps_what_ddp_does(tmp_path):
    results = spawned_results(_two_rank_worker, tmp_path)
    assert len(results) == 4
    for case, result in results.items():
        assert result == {
            "max_diff": 0.0,
            "ranks_agree": True,
            "unused_unchanged": True,
            "rank0_only_stepped": True,
        }, case
