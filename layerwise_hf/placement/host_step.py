"""Host offload of the optimizer (`layerwise_offload="optimizer"`): each parameter's optimizer state and a host copy
of the parameter live in host memory, and a host worker steps it while backward goes on.

The path of parameter `i` once its gradient is final (after the route's reduction):

1. The pipeline steps `HostStepOptimizer` as any inner optimizer. Its `step` starts copying the device gradient into a
   host buffer (`Transfer.copy`, beside the compute), returns at once, and the pipeline frees the device gradient (the
   transfer keeps it alive until its copy has run).
2. The host worker (one thread, tasks in order) waits for that copy, steps the wrapped optimizer on the host copy of
   the parameter (its states were created there, on the host), and starts copying the updated parameter back into the
   device parameter's storage.
3. Before the next forward of a module that holds a host-stepped parameter (a forward pre-hook, `HostRunner`) the
   compute waits for every copy back (`HostRunner.wait`); so do checkpoints and the end of training. Backward does
   not wait: the host steps overlap it. Nor does the forward of another model (a reference, reward or eval model):
   only the trained model's wait.

With gradient accumulation or exact clipping the gradients wait in host buffers (`layerwise_hf.placement.offload`, the
same worker and transfer); `step()` then steps each from its host buffer (`HostStepOptimizer.step_host`), clipped by
the step's coefficient, without a copy back of the gradient.

The host copy is taken from the device parameter at the first step, and again after `load_state_dict` and when a
route is attached (`stale`): until then the device parameter may still be replaced (FSDP2's shards) or overwritten (a
checkpoint's weights), and DCP steps the optimizer once, with zero gradients, before loading a checkpoint into it.

The host copy has the parameter's dtype, so the step is the standard optimizer's bit for bit (a bf16 model keeps
bf16 weights, as without offload) with `layerwise_host_step="exact"`, the default for a CPU model. For a model on an
accelerator the default is `"fast"`: torch's fused CPU kernel where the base has one (last-bit differences from the
per-tensor loop), and the host worker gets its share of the host's cores (`layerwise_hf.placement.host_kernel`).
Checkpoints hold the wrapped optimizer's own state dict, the same format as
without offload (its class is saved, not the wrapper's), so a run resumes across offload on and off.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..bases.params import LayerwiseFactory, LayerwiseParam, StateView, share_quantization_maps
from ..platform.dtensor import local_tensor
from .host_kernel import claim_thread_share, host_kernel_flags, host_threads_for
from .offload import HostWorker
from .transfer import HostArena, Ticket, Transfer, check_device, device_of, make_transfer


class HostRunner:
    """
    What the host-stepped parameters of one optimizer share: the transfer, the host worker, and the copies back that
    the next forward waits for.

    Args:
        transfer (`Transfer`, *optional*): the device's copies; by default `make_transfer` for the device of the
            first gradient or parameter copied (chosen then, not when the optimizer is built).
    """

    def __init__(self, transfer: Transfer | None = None):
        self.transfer = transfer
        self.worker = HostWorker()
        if transfer is not None:
            self.worker.use(transfer)
        # The device-side tensors the host steps are for (`enable_offload`: the parameters' local shards), asked at the
        # first host buffer: the host copies, and the host gradients, are then views into one pinned block per dtype.
        self.reserve: Callable[[], Sequence[torch.Tensor]] | None = None
        self.arenas: dict[str, HostArena] = {}
        self.quantization_maps: dict = {}  # bitsandbytes' maps on the host, shared by the host-stepped optimizers
        self.pending: dict[int, HostStepOptimizer] = {}  # id -> optimizers whose copy back the next forward awaits
        self.stale: dict[int, HostStepOptimizer] = {}  # id -> optimizers whose host copy is taken before a forward
        self.latest: concurrent.futures.Future | None = None  # the last host step submitted: its copy back is last
        # id(module) -> (module, whether it holds a pending parameter), decided since `pending` last grew.
        self._verdicts: dict[int, tuple[torch.nn.Module, bool]] = {}
        runner = weakref.ref(self)

        def before_forward(module, args):
            alive = runner()
            if alive is None:
                return
            if alive.stale and alive.has_sum(module, alive.stale):
                alive.refresh_stale()
            if alive.pending and alive.holds_pending(module):
                alive.wait()

        # NOTE: why a global forward pre-hook that waits only for modules holding a pending parameter, not a hook on
        # the model given to `build_layerwise_optimizer` or `connect`:
        # - A global hook runs before every module's own pre-hooks. FSDP2's pre-forward all-gathers the local shards
        #   the copies back write into, so the wait must come first; a hook on the model would have to be prepended
        #   again after every `fully_shard`. A plain loop building `LayerwiseOptimizer` itself names no model at all.
        # - "Holds" means the module's own parameters or any submodule's. The trained model's root holds them all, so
        #   its first forward waits for every copy back before any of its modules runs: a parameter a parent reads
        #   (tied embeddings used by lm_head, a child's .weight read directly) is waited for like any other. A
        #   submodule called directly waits if it holds one. It waits for every copy back, not only its own: the
        #   finer wait would miss a parameter read outside the module holding it.
        # - Another model (a TRL reference or reward model, an eval model) holds none and does not wait for the host
        #   worker. Nor does a recompute under gradient checkpointing: a parameter's step starts once its gradient
        #   is final, after every use of it in that backward.
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
        weakref.finalize(self, self._hook.remove)

    def holds_pending(self, module: torch.nn.Module) -> bool:
        """Whether `module` (its own parameters or a submodule's) holds a parameter whose host step or copy back the
        next forward must wait for."""
        known = self._verdicts.get(id(module))
        if known is not None:
            return known[1]
        pending = {id(optimizer.param_groups[0]["params"][0]) for optimizer in list(self.pending.values())}
        verdict = any(id(p) in pending for p in module.parameters())
        # NOTE: a verdict holds until `pending` grows (`add`) or is emptied (`wait`); the module is kept with it so
        # that its id is not reused meanwhile.
        self._verdicts[id(module)] = (module, verdict)
        return verdict

    def has_sum(self, module: torch.nn.Module, optimizers: dict[int, HostStepOptimizer]) -> bool:
        """Whether `module` (its own parameters or a submodule's) holds a parameter of one of `optimizers`."""
        wanted = {id(optimizer.param_groups[0]["params"][0]) for optimizer in list(optimizers.values())}
        return any(id(p) in wanted for p in module.parameters())

    def refresh_stale(self) -> None:
        """
        Take every stale host copy now (`HostStepOptimizer.refresh`), before the forward that precedes the first
        backward after an attach or a resume: there each parameter's first step would take its own, and wait for it,
        in its gradient hook. The copies are started together and waited for once, and the pinned blocks they land in
        are registered now, not inside backward.
        """
        stale, self.stale = list(self.stale.values()), {}
        tickets = [optimizer.begin_refresh() for optimizer in stale]
        # NOTE: no test needs this wait today: every reader of a host copy (the host step) first waits for a copy out
        # queued after these on the same to-host stream (one copy thread on CPU). Kept so that a host copy is whole
        # once the forward starts, whatever reads it: one wait per resume, not per parameter.
        for ticket in tickets:
            ticket.wait_host()
        local = [local_tensor(o.param_groups[0]["params"][0]) for o in stale]
        if local and self.reserve is not None and "grads" not in self.arenas:
            # The host gradients' block too: its first use is a step in backward.
            self.arenas["grads"] = HostArena(self.transfer_for(local[0]), self.reserve())

    def add(self, optimizer: HostStepOptimizer) -> None:
        """`optimizer` started a host step: the next forward that reads its parameter waits for its copy back."""
        self.pending[id(optimizer)] = optimizer
        self.latest = optimizer.last
        self._verdicts.clear()

    def transfer_for(self, tensor: torch.Tensor) -> Transfer:
        """The transfer, chosen at the first copy for the device of `tensor` (a device-side tensor: every first call
        copies a gradient or into a parameter)."""
        if self.transfer is None:
            self.transfer = make_transfer(device_of(tensor))
            self.worker.use(self.transfer)
        check_device(self.transfer, tensor)
        return self.transfer

    def host_buffer(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer like `tensor` from the arena of `kind` (`"copies"`: host parameter copies; `"grads"`: the
        host gradients of steps in backward), or allocated on its own without `reserve`."""
        transfer = self.transfer_for(tensor)
        if self.reserve is None:
            return transfer.host_empty_like(tensor)
        if kind not in self.arenas:
            self.arenas[kind] = HostArena(transfer, self.reserve())
        return self.arenas[kind].empty_like(tensor)

    def wait(self) -> None:
        """Make the device wait for every host step started and its copy back (before parameters are read)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, {}
        self._verdicts.clear()
        # NOTE: one host worker runs the steps in the order they were submitted, and each issues its copy back on the
        # one transfer's to-device stream (one copy thread on CPU), so the last copy back is ordered after every
        # other: the device waits on its event once, not once per parameter. Every earlier step is done by then, and
        # asking for its result raises what it raised.
        try:
            last = self.latest.result()
        except Exception:
            # The last step failed, so it issued no copy back: the device waits for each copy back that was issued.
            for optimizer in pending.values():
                with contextlib.suppress(Exception):
                    optimizer.wait_device()
            raise
        last.wait_device()
        for optimizer in pending.values():
            optimizer.last.result()

    def close(self) -> None:
        self.wait()
        self._hook.remove()
        self.worker.close()
        if self.transfer is not None:
            self.transfer.close()


class HostStepOptimizer(StateView, torch.optim.Optimizer):
    """
    Steps `base`, an optimizer over one parameter, on a host copy of that parameter (see the module docstring).

    Args:
        base (`torch.optim.Optimizer`): the parameter's optimizer (one group, one parameter), as the factory built it.
        runner (`HostRunner`): the transfer and host worker shared by the optimizer's parameters.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.placement.host_step import HostRunner, HostStepOptimizer
    >>> weight = torch.nn.Parameter(torch.ones(4))
    >>> runner = HostRunner()
    >>> optimizer = HostStepOptimizer(torch.optim.SGD([weight], lr=0.5), runner)
    >>> weight.grad = torch.ones(4); optimizer.step(); runner.wait(); weight.data
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    ```
    """

    def __init__(self, base: torch.optim.Optimizer, runner: HostRunner, host_step: str = "auto"):
        (param,) = base.param_groups[0]["params"]
        self.base = base
        self.runner = runner
        # The host step's kernel (`layerwise_host_step`): applied to the base's group at each host step only, so the
        # wrapper's group and checkpoints keep the factory's flags. Decided by the device the model lives on when the
        # host copy is taken (`refresh`), not now: a plain Accelerate loop builds the optimizer before
        # accelerator.prepare moves the model to the GPU.
        self.host_step = host_step
        self.kernel: dict[str, Any] = {}
        self.threads: int | None = None
        self.kernel_device: torch.device | None = None  # where the parameter was when the kernel was chosen
        local = local_tensor(param).detach()
        # A stable host parameter for `base` to key its state by; its states are created like it, on the host. Its
        # values are copied from the device at the first step (`stale`), not now: until training starts the device
        # parameter is still replaced (FSDP2's prepare swaps in the local shard) and overwritten (a checkpoint's
        # weights), and a step before that (torch's `_init_optim_state`: DCP steps an optimizer without state once,
        # lr 0, before loading one) must write back the weights it found, not the ones the optimizer was built with.
        self.host = torch.nn.Parameter(torch.empty(0, dtype=local.dtype), requires_grad=False)
        base.param_groups[0]["params"] = [self.host]
        # bitsandbytes' quantization maps go where its states are made: on the host, as the host copy.
        share_quantization_maps(base, self.host.device, runner.quantization_maps)
        # NOTE: Adagrad creates its state in __init__, on the device parameter; its step creates it lazily too, so
        # dropping it lets the first host step build it on the host (and frees the device copy).
        base.state.pop(param, None)
        self.host_grad: torch.Tensor | None = None  # where a gradient stepping at once lands on the host
        self.last: concurrent.futures.Future | None = None  # this parameter's latest host step (-> its copy back)
        self.stale = True  # the device parameter may differ from the host copy: copy it before the next step
        # The device parameter's version counter as the last copy back (or refresh) left it: a different count at the
        # next step means something else wrote the weights in between (a constraint, a mask, load_state_dict).
        self.version: int | None = None
        group = {k: v for k, v in base.param_groups[0].items() if k != "params"}
        super().__init__([{**group, "params": [param]}], base.defaults)

    @property
    def stale(self) -> bool:
        """Whether the device parameter may differ from the host copy: it is copied again before the next step, or
        before the next forward of a module that holds it (`HostRunner.refresh_stale`)."""
        return self._stale

    @stale.setter
    def stale(self, value: bool) -> None:
        self._stale = value
        if value:
            self.runner.stale[id(self)] = self
        else:
            self.runner.stale.pop(id(self), None)

    @property
    def host_base(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (checkpoints name its class)."""
        return self.base

    def _state_view(self) -> dict[torch.Tensor, dict]:
        s = self.base.state.get(self.host)
        return {self.param_groups[0]["params"][0]: s} if s else {}

    # ---- stepping ----

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        if closure is not None:
            raise ValueError("A host-stepped layer-wise optimizer takes no closure.")
        param = self.param_groups[0]["params"][0]
        if param.grad is None:
            return None
        grad = local_tensor(param.grad)
        transfer = self.runner.transfer_for(grad)
        self.wait_host()  # the previous step still reads host_grad
        host_grad = self.host_grad_like(grad)
        ticket = transfer.copy(host_grad, grad)
        # The copy back waits for this copy out: it was queued after backward's last use of the parameter.
        self.step_host(host_grad, [ticket], None, after=ticket)
        return None

    def host_grad_like(self, grad: torch.Tensor) -> torch.Tensor:
        """
        The host buffer of this parameter's gradient: where a gradient stepping at once lands, and with offload where
        a window's held gradient waits too (`OffloadStage.take`). The two uses never overlap (each waits for the last
        host step before writing it), so one gradient-sized set is pinned for both, not two.
        """
        if self.host_grad is None or self.host_grad.shape != grad.shape or self.host_grad.dtype != grad.dtype:
            self.host_grad = self.runner.host_buffer("grads", grad)
        return self.host_grad

    def step_host(
        self, grad: torch.Tensor, waits: list[Any], coef: torch.Tensor | None, after: Ticket | None = None
    ) -> None:
        """Step from `grad`, a host tensor that is complete once `waits` are, scaled by `coef` (clipping) first. The
        copy back into the device parameter waits for `after` (by default a mark of the compute stream now)."""
        if self.stale or self._written_since():
            self.refresh()
        if after is None:
            after = self.runner.transfer_for(local_tensor(self.param_groups[0]["params"][0])).mark()
        # The lr and the rest are read now: the scheduler changes them before the worker may run.
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        previous = self.last
        self.last = self.runner.worker.submit(self._step_on_host, grad, [*waits], coef, hyper, previous, after)
        self.runner.add(self)

    def _step_on_host(self, grad, waits, coef, hyper, previous, after) -> Ticket:
        # On the host worker.
        for w in waits:
            w.result() if isinstance(w, concurrent.futures.Future) else w.wait_host()
        if previous is not None:
            previous.result().wait_host()  # the previous copy back still reads the host copy
        if coef is not None:
            grad.mul_(coef)
        self.base.param_groups[0].update(hyper)
        self.base.param_groups[0].update(self.kernel)
        if self.threads is not None:
            claim_thread_share(self.threads)
        self.host.grad = grad
        try:
            self.base.step()
        finally:
            self.host.grad = None
        local = local_tensor(self.param_groups[0]["params"][0])
        # NOTE: the copy's copy_ counts one write to the parameter's version, when it is issued (CUDA) or when the
        # copy thread runs it (CPU stand-in): expected from the count now, not read after it.
        self.version = local._version + 1
        return self.runner.transfer_for(self.host).copy(local, self.host, after=[after])

    def _written_since(self) -> bool:
        # Whether the device parameter was written since the last copy back: its host copy is then out of date.
        if self.version is None or self.last is None:
            return False
        self.last.result()  # the copy back was issued (the forward before this step waited for it already)
        return local_tensor(self.param_groups[0]["params"][0])._version != self.version

    def wait_host(self) -> None:
        """Block until this parameter's host step and copy back are done (before its host buffers are reused)."""
        if self.last is not None:
            self.last.result().wait_host()

    def wait_device(self) -> None:
        """Make the device wait for this parameter's latest host step and copy back."""
        if self.last is not None:
            self.last.result().wait_device()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the device parameter into the host copy (after a checkpoint or the user changed the weights)."""
        self.begin_refresh().wait_host()

    @torch.no_grad()
    def begin_refresh(self) -> Ticket:
        """Start `refresh`'s copy; the host copy may be read once the returned ticket is done."""
        self.wait_host()
        local = local_tensor(self.param_groups[0]["params"][0])
        transfer = self.runner.transfer_for(local)
        if self.kernel_device != local.device:
            self.kernel = host_kernel_flags(self.base, local.device, self.host_step)
            self.threads = host_threads_for(local.device)
            self.kernel_device = local.device
        if self.host.shape != local.shape:
            # The first refresh (the host copy is taken at the first step), or FSDP2's prepare replaced the parameter
            # by its sharded DTensor: the host copy is of the local shard.
            self.host.data = self.runner.host_buffer("copies", local)
        ticket = transfer.copy(self.host, local)
        self.version = local._version
        self.stale = False
        return ticket

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.param_groups[0]["params"][0].grad = None

    # ---- checkpoints: the wrapped optimizer's own format ----

    def state_dict(self) -> dict[str, Any]:
        self.wait_host()
        saved = self.base.state_dict()
        group = {**{k: v for k, v in self.param_groups[0].items() if k != "params"}, "params": [0]}
        return {"state": saved["state"], "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_host()
        group = {k: v for k, v in state_dict["param_groups"][0].items() if k != "params"}
        # NOTE: Optimizer.load_state_dict casts state tensors to the parameter's device and dtype: here the host's.
        self.base.load_state_dict({"state": state_dict["state"], "param_groups": [{**group, "params": [0]}]})
        self.param_groups[0].update(group)
        # The checkpoint's weights were (or will be) loaded into the model too: the host copy is taken again.
        self.stale = True


def wrap_host_steps(factory: LayerwiseFactory, runner: HostRunner, host_step: str | None = None) -> LayerwiseFactory:
    """
    The factory whose optimizers step on the host (`HostStepOptimizer`), all sharing `runner`.

    Example:

    ```python
    >>> from layerwise_hf.placement.host_step import HostRunner, wrap_host_steps
    >>> factory = wrap_host_steps(lambda lp, args: torch.optim.AdamW([lp.param]), HostRunner())
    ```
    """

    def build(lp: LayerwiseParam, args: Any) -> torch.optim.Optimizer:
        choice = getattr(args, "layerwise_host_step", "auto") if host_step is None else host_step
        return HostStepOptimizer(factory(lp, args), runner, choice)

    return build


def unwrap_host_step(inner: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a `HostStepOptimizer` wraps (any other optimizer: itself)."""
    return inner.base if isinstance(inner, HostStepOptimizer) else inner
