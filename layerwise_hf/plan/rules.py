"""Optimizers whose kernels cannot run on fake tensors (bitsandbytes', torchao's): a stand-in that holds exactly the
state bytes the estimator's rules give (`layerwise_hf.estimate.optimizers`, byte-exact against the real optimizers in
tests/test_estimate.py) and computes nothing. Figures from it are marked as rules in the plan."""

from __future__ import annotations

import dataclasses

import torch

from ..estimate.models import TensorSpec
from ..estimate.optimizers import OptimizerRule, tensor_state_bytes, uses_qmaps
from ..estimate.units import BNB_QMAP_BYTES
from ..platform.dtensor import local_storage_tensor

# Families whose step is a compiled kernel (bitsandbytes) or a tensor subclass (torchao) that fake tensors do not run.
RULE_FAMILIES = ("bnb", "torchao")


def needs_rule(rule: OptimizerRule) -> bool:
    """Whether the plan takes this optimizer's state from its rule instead of running its step."""
    return rule.family in RULE_FAMILIES


def tensor_spec(name: str, param: torch.Tensor, is_embedding: bool) -> TensorSpec:
    """The estimator's description of one parameter."""
    return TensorSpec(
        name, tuple(param.shape), module=name.rsplit(".", 2)[-2] if "." in name else name, is_embedding=is_embedding
    )


class RuleOptimizer(torch.optim.Optimizer):
    """
    Allocates, at the first step of each parameter, the state bytes `rule` gives it (one `uint8` buffer), and the
    shared quantization maps once per optimizer as bitsandbytes does; the weights are left as they are.

    Args:
        params (`list[torch.Tensor]`): the parameters (one group).
        rule (`OptimizerRule`): the optimizer's row of `optimizer_rules.txt`.
        specs (`dict[int, TensorSpec]`): `id(param)` -> its description (embedding or not, for bitsandbytes).
        lr (`float`): kept in the group, as schedulers and `LayerwiseOptimizer` read it.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.estimate import OPTIMIZER_RULES
    >>> from layerwise_hf.plan.rules import RuleOptimizer, tensor_spec
    >>> w = torch.nn.Parameter(torch.zeros(64, 64)); w.grad = torch.zeros_like(w)
    >>> opt = RuleOptimizer([w], OPTIMIZER_RULES["adamw_8bit"], {id(w): tensor_spec("w", w, False)}, lr=1e-3)
    >>> opt.step(); opt.state[w]["rule_state"].numel()
    8320
    ```
    """

    def __init__(
        self, params, rule: OptimizerRule, specs: dict[int, TensorSpec], lr: float = 1e-3, device: str = "cuda"
    ):
        super().__init__(list(params), {"lr": lr, "weight_decay": 0.0})
        self.rule = rule
        self.specs = specs
        self._qmaps_allocated = False
        # NOTE: bitsandbytes' CPU step is torch code inside one custom op: per tensor it allocates 5 x numel float32
        # temporaries when stepped in 8 bits (dequantized moments and the update) and 3 x numel in 32 bits, all freed
        # before the next tensor (measured with the profiler on bitsandbytes 0.50). Its CUDA kernels are fused and
        # allocate none. The stand-in allocates and drops the same scratch on CPU.
        self.cpu_scratch = device == "cpu" and rule.family == "bnb"

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                spec = self._spec(p)
                if self.cpu_scratch:
                    factor = 5 if uses_qmaps(self.rule, spec, spec.is_embedding) else 3
                    scratch = torch.empty(factor * spec.numel * 4, dtype=torch.uint8, device=p.device)
                    del scratch
                if self.state[p]:
                    continue
                nbytes = tensor_state_bytes(self.rule, spec, p.element_size(), spec.is_embedding)
                self.state[p]["rule_state"] = torch.empty(nbytes, dtype=torch.uint8, device=p.device)
                if uses_qmaps(self.rule, spec, spec.is_embedding) and not self._qmaps_allocated:
                    qmaps = self.rule.qmaps * BNB_QMAP_BYTES
                    self.state[p]["rule_qmaps"] = torch.empty(qmaps, dtype=torch.uint8, device=p.device)
                    self._qmaps_allocated = True
        return None

    def _spec(self, p: torch.Tensor) -> TensorSpec:
        # A `LocalShardOptimizer` hands its inner optimizer a parameter of its own (the local shard); a DTensor's
        # state is its local shard's (FSDP2): the rule is applied to the shape this rank holds.
        spec = self.specs.get(id(p))
        if spec is None and len(self.specs) == 1:
            (spec,) = self.specs.values()
        local = local_storage_tensor(p)
        return dataclasses.replace(spec, shape=tuple(local.shape))
