"""What the launched scripts check local-shard optimizers (bitsandbytes', Adafactor: `placement/local_shard.py`)
against: the same optimizer applied by hand on each rank's shard and its gradients (`HandRun`), and their state saved
and loaded through torch's distributed checkpoint in the middle of a run (`SaveStateAt`, `LoadStateAt`), as a plain
Accelerate loop would where Trainer cannot checkpoint (a model sharded at its load)."""

from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import TrainerCallback

from layerwise_hf import unwrap_layerwise_optimizer
from layerwise_hf.bases.params import isolate_bnb_overrides


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def shard_of_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The part of the whole gradient that the parameter's local shard holds, cut by DTensor's own layout."""
    if isinstance(grad, DTensor) and (grad.placements != param.placements or grad.device_mesh != param.device_mesh):
        # Under tensor parallel alone the embedding's gradient is Replicate while its weight is Shard(0): a rank's
        # shard steps with its own rows of the whole gradient (src_data_rank=None: each rank cuts its own, no scatter).
        whole = grad.full_tensor()
        grad = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    return local(grad)


def rebuild(base, param):
    """The optimizer `base` is, built anew over `param` from its settings (bitsandbytes keeps some in `args`)."""
    accepted = inspect.signature(type(base).__init__).parameters
    kwargs = {k: v for k, v in base.defaults.items() if k in accepted}
    settings = getattr(base, "args", None)
    kwargs.update({k: getattr(settings, k) for k in accepted if settings is not None and hasattr(settings, k)})
    # A private override manager, as the layer-wise factory gives: the process-wide one holds Trainer's overrides.
    return isolate_bnb_overrides(type(base)([param], **kwargs))


class HandRun(TrainerCallback):
    """Builds each wrapped optimizer anew before its first step, over a copy of the starting shard, and records every
    step's local gradient and hyperparameters; `max_diff` replays them on it."""

    def __init__(self):
        self.records = {}

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        optimizer = unwrap_layerwise_optimizer(optimizer)
        for name, inner in zip(optimizer.names, optimizer.inner):
            inner.register_step_pre_hook(self._pre(name))

    def _pre(self, name):
        def hook(inner, args, kwargs):
            param = inner.param_groups[0]["params"][0]
            if name not in self.records:
                start = torch.nn.Parameter(local(param).detach().clone())
                self.records[name] = {"by_hand": rebuild(inner.base, start), "inner": inner, "steps": []}
            group = {k: v for k, v in inner.param_groups[0].items() if k not in ("params", "name")}
            self.records[name]["steps"].append((shard_of_grad(param, param.grad).detach().clone(), group))

        return hook

    def max_diff(self) -> float:
        worst = 0.0
        for record in self.records.values():
            by_hand = record["by_hand"]
            shard = by_hand.param_groups[0]["params"][0]
            for grad, group in record["steps"]:
                by_hand.param_groups[0].update(group)
                shard.grad = grad
                by_hand.step()
            final = local(record["inner"].param_groups[0]["params"][0])
            worst = max(worst, float((final - shard.detach()).abs().max()) if final.numel() else 0.0)
        return worst

    def eight_bit_states(self) -> int:
        states = [r["inner"].base.state.get(r["inner"].local, {}) for r in self.records.values()]
        return sum(s.get("state1", torch.empty(0)).dtype == torch.uint8 for s in states)


def _state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # What Accelerate's FSDP2 checkpointing saves and loads (`save_fsdp_optimizer`, `load_fsdp_optimizer`).
    return {"optimizer": get_optimizer_state_dict(model, optimizer)}


class SaveStateAt(TrainerCallback):
    """Saves the layer-wise optimizer's state with DCP at the end of step `step`."""

    def __init__(self, step: int, folder: str):
        self.step, self.folder = step, folder

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.step:
            import torch.distributed.checkpoint as dcp

            dcp.save(_state(model, unwrap_layerwise_optimizer(optimizer)), checkpoint_id=self.folder)


def load_state(model, optimizer, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


class LoadStateAt(TrainerCallback):
    """At the end of step `step`, first tries each of `refused` (a state saved on another mesh: the refusal is kept),
    then drops every inner optimizer's state, as a fresh optimizer at a resume has none, and loads `folder`'s."""

    def __init__(self, step: int, folder: str, refused: tuple[str, ...] = ()):
        self.step, self.folder, self.refused, self.refusals = step, folder, refused, []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step != self.step:
            return
        optimizer = unwrap_layerwise_optimizer(optimizer)
        for folder in self.refused:
            try:
                load_state(model, optimizer, folder)
                self.refusals.append(None)
            except ValueError as err:
                self.refusals.append(str(err))
        for inner in optimizer.inner:
            getattr(inner, "base", inner).state.clear()
        load_state(model, optimizer, self.folder)
