"""Optimizer state per tensor, as the optimizers allocate it. The rules are data (`optimizer_rules.txt`, beside this
file, says where each comes from); whether a layer-wise form can step FSDP2 shards is `layerwise_hf.bases.support`'s
call."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..bases import support
from .models import TensorSpec
from .units import BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE, SCALAR_BYTES, TORCHAO_BLOCKSIZE, EstimateError, blocks

RULES_FILE = Path(__file__).with_name("optimizer_rules.txt")
FAMILIES = ("torch", "optimi", "bnb", "torchao", "adafactor", "muon")
# Bases with no standard Trainer name: only their layer-wise form trains (layerwise_hf.bases.registry.PLUGIN_NAMES).
LAYERWISE_ONLY = ("muon",)


@dataclass(frozen=True)
class OptimizerRule:
    """
    Per-tensor optimizer state of one Trainer optimizer: one row of `optimizer_rules.txt`.

    Args:
        name (`str`):
            The Trainer optimizer name (`"adamw_8bit"`).
        states (`int`):
            Full-size state buffers per parameter (AdamW: exp_avg and exp_avg_sq).
        bits (`int`):
            `0`: the parameter's dtype (torch optimizers); `32`: float32; `8` / `4`: quantized (blockwise).
        family (`str`):
            `"torch"`, `"optimi"`, `"bnb"`, `"torchao"`, `"adafactor"` or `"muon"`: how small tensors, embeddings
            and scalars are kept (`"muon"`: Muon for hidden matrices, AdamW for the rest).
        qmaps (`int`, *optional*, defaults to `0`):
            bitsandbytes 8-bit quantization maps referenced per state (256 float32 each).
        extra16 (`int`, *optional*, defaults to `0`):
            Extra full-size buffers for parameters under 32 bits (torch-optimi's Kahan summation in stable_adamw).
        exact (`bool`, *optional*, defaults to `True`):
            Checked against the optimizer's real state here; `False` for packages not installed in the tests.

    Example:

    ```python
    >>> from layerwise_hf.estimate import OPTIMIZER_RULES
    >>> rule = OPTIMIZER_RULES["adamw_8bit"]
    >>> rule.states, rule.bits, rule.fsdp2
    (2, 8, False)
    ```
    """

    name: str
    states: int
    bits: int
    family: str
    qmaps: int = 0
    extra16: int = 0
    exact: bool = True

    @property
    def fsdp2(self) -> bool:
        """Elementwise: the layer-wise path can step FSDP2 shards with it (`support.fsdp2_supports_base`)."""
        return support.fsdp2_supports_base(self.name)


def load_rules(path: Path = RULES_FILE) -> dict[str, OptimizerRule]:
    """
    Read a rules table: whitespace-separated columns under a header row, `#` comments.

    Args:
        path (`Path`, *optional*, defaults to `optimizer_rules.txt` beside this module):
            The table.

    Example:

    ```python
    >>> from layerwise_hf.estimate.optimizers import load_rules
    >>> load_rules()["sgd"].states
    0
    ```
    """
    rows = [line.split() for line in path.read_text(encoding="utf-8").splitlines()]
    rows = [row for row in rows if row and not row[0].startswith("#")]
    header, body = rows[0], rows[1:]
    rules = {}
    for row in body:
        values = dict(zip(header, row, strict=True))
        rule = OptimizerRule(
            name=values["name"],
            states=int(values["states"]),
            bits=int(values["bits"]),
            family=values["family"],
            qmaps=int(values["qmaps"]),
            extra16=int(values["extra16"]),
            exact=values["exact"] == "yes",
        )
        if rule.family not in FAMILIES or values["exact"] not in ("yes", "no") or rule.name in rules:
            raise ValueError(f"{path}: bad row {' '.join(row)!r}")
        rules[rule.name] = rule
    return rules


OPTIMIZER_RULES: dict[str, OptimizerRule] = load_rules()
"""Trainer optimizer name -> `OptimizerRule`, read from `optimizer_rules.txt` (which cites the sources)."""


def known_names() -> str:
    """The names the estimate takes, for help texts and errors."""
    standard = ", ".join(sorted(set(OPTIMIZER_RULES) - set(LAYERWISE_ONLY)))
    only = ", ".join(b + support.SUFFIX for b in LAYERWISE_ONLY)
    return f"{standard} (each also as <name>{support.SUFFIX}); layer-wise only: {only}"


def parse_optimizer(name: str) -> tuple[str, bool]:
    """
    Split an optimizer name into its base and whether it is layer-wise; raises `EstimateError` listing the known
    names.

    Args:
        name (`str` or `OptimizerNames`):
            `"adamw_torch"` or `"adamw_torch_layerwise"`.

    Example:

    ```python
    >>> from layerwise_hf.estimate import parse_optimizer
    >>> parse_optimizer("adamw_torch_layerwise")
    ('adamw_torch', True)
    ```
    """
    name = str(getattr(name, "value", name))
    layerwise = name.endswith(support.SUFFIX)
    base = name.removesuffix(support.SUFFIX)
    if layerwise and base in support.REFUSED_BASES:
        raise EstimateError(f"{name} is refused, as training refuses it: {support.REFUSED_BASES[base]}.")
    if base not in OPTIMIZER_RULES:
        raise EstimateError(f"Unknown optimizer {name!r} for the estimate; choose one of {known_names()}.")
    if base in LAYERWISE_ONLY and not layerwise:
        raise EstimateError(f"{name!r} has no standard Trainer form; estimate {name}{support.SUFFIX}.")
    return base, layerwise


def tensor_state_bytes(rule: OptimizerRule, tensor: TensorSpec, param_bytes: int, is_embedding: bool) -> int:
    """
    State bytes of one tensor (quantization maps excluded: they are shared, see `estimate`).

    Args:
        rule (`OptimizerRule`):
            The optimizer's rule.
        tensor (`TensorSpec`):
            The parameter (its `count` is not applied).
        param_bytes (`int`):
            Bytes per element of the parameter.
        is_embedding (`bool`):
            An `nn.Embedding` weight (bitsandbytes 8-bit keeps it in 32-bit state).

    Example:

    ```python
    >>> from layerwise_hf.estimate import OPTIMIZER_RULES, TensorSpec, tensor_state_bytes
    >>> tensor_state_bytes(OPTIMIZER_RULES["adamw_torch"], TensorSpec("w", (1024, 1024)), 2, False)
    4194308
    ```
    """
    numel = tensor.numel
    if rule.family in ("torch", "optimi"):
        element = param_bytes if rule.bits == 0 else rule.bits // 8
        states = rule.states + (rule.extra16 if param_bytes < 4 else 0)
        # torch keeps a float32 `step`; torch-optimi an `eps_sq` scalar in the parameter's dtype.
        scalar = (SCALAR_BYTES if rule.family == "torch" else param_bytes) if rule.states else 0
        return states * numel * element + scalar
    if rule.family == "muon":
        # layerwise_hf.bases.muon.uses_muon: a 2-D tensor that is neither an embedding nor the output head.
        if len(tensor.shape) == 2 and not (is_embedding or tensor.tied or tensor.module == "lm_head"):
            return rule.states * numel * param_bytes
        return tensor_state_bytes(OPTIMIZER_RULES["adamw_torch"], tensor, param_bytes, is_embedding)
    if rule.family == "adafactor":
        if len(tensor.shape) >= 2:
            rows = math.prod(tensor.shape[:-1])
            cols = math.prod(tensor.shape[:-2]) * tensor.shape[-1]
            return 4 * (rows + cols) + SCALAR_BYTES
        return 4 * numel + SCALAR_BYTES
    if rule.family == "bnb":
        if rule.bits == 32 or numel < BNB_MIN_8BIT_SIZE or is_embedding:
            return 4 * rule.states * numel
        return rule.states * (numel + 4 * blocks(numel, BNB_BLOCKSIZE))
    if rule.family == "torchao":
        if numel < 4096 or numel % TORCHAO_BLOCKSIZE:
            return rule.states * numel * param_bytes + SCALAR_BYTES
        # Codes, a float32 scale per block, and each state's own float32 code map (2**bits entries).
        codes = numel * rule.bits // 8 + 4 * blocks(numel, TORCHAO_BLOCKSIZE) + 4 * 2**rule.bits
        return rule.states * codes + SCALAR_BYTES
    raise AssertionError(rule.family)


def uses_qmaps(rule: OptimizerRule, tensor: TensorSpec, is_embedding: bool) -> bool:
    """Whether bitsandbytes keeps this tensor's state in 8 bits (so it references the shared quantization maps)."""
    return rule.family == "bnb" and rule.bits == 8 and tensor.numel >= BNB_MIN_8BIT_SIZE and not is_embedding


def fsdp2_refusal(base: str) -> str | None:
    """
    Why `<base>_layerwise` cannot run under FSDP2, in the words the training path raises; `None` when it can.

    Args:
        base (`str`):
            The Trainer optimizer name without `_layerwise`.

    Example:

    ```python
    >>> from layerwise_hf.estimate.optimizers import fsdp2_refusal
    >>> fsdp2_refusal("adamw_torch") is None, "not elementwise" in fsdp2_refusal("adafactor")
    (True, True)
    ```
    """
    if support.fsdp2_supports_base(base):
        return None
    # NOTE: support.check_fsdp2_optimizers holds the one refusal message but takes optimizer objects; a stand-in
    # named after the base gets the same words without building the real optimizer (bitsandbytes may be absent).
    stand_in = type(base, (), {})()
    try:
        support.check_fsdp2_optimizers(f"{base}{support.SUFFIX}", [stand_in])
    except ValueError as e:
        return str(e)
    raise AssertionError(f"support.py accepts {base!r} by class but refuses it by name")
