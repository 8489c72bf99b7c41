"""One training step as Trainer runs it, on a model of fake tensors: the model (dtype, activation checkpointing, LoRA),
the optimizer (Trainer's standard one, or `build_layerwise_optimizer` + `connect()`), and the step (forward under
autocast, loss / grad_accum, backward, clipping, `step()`, `zero_grad()`), with `LiveBytes` counting.

The step runs twice and the second is measured: the first allocates the optimizer state, which every later step
finds in place, so the second is the steady state a run holds for its length."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from ..estimate.optimizers import OPTIMIZER_RULES
from ..estimate.units import DEFAULT_LORA_TARGETS
from ..placement.host_step import HostStepOptimizer
from ..platform.compat import dtype_kwargs, enable_activation_checkpointing
from ..platform.norms import whole
from .offload import close_offload, label_host_side, stand_ins
from .ranks import RankRoute, fake_group
from .rules import RuleOptimizer, needs_rule, tensor_spec
from .tracker import LiveBytes, Peak

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "float32"}


@dataclass(frozen=True)
class StepSetup:
    """
    What one optimizer step trains on, in Trainer's terms.

    Args:
        seq_len (`int`): tokens per sequence.
        micro_batch (`int`): sequences per forward (`per_device_train_batch_size`).
        grad_accum (`int`): micro-batches per optimizer step (`gradient_accumulation_steps`).
        max_grad_norm (`float`): clipping; `0` turns it off (layer-wise: `layerwise_clip` says how).
        clip_mode (`str`): the layer-wise clipping mode (`exact`, `previous`, `per_param`, `off`).
        bf16 (`bool`), fp16 (`bool`): Trainer's autocast (weights stay in `torch_dtype`).
        torch_dtype (`str`): the weights' dtype (`float32`, `bfloat16`, `float16`).
        gradient_checkpointing (`bool`): `gradient_checkpointing_enable(use_reentrant=False)`, as Trainer does.
        lora_r (`int`, *optional*): train LoRA adapters of this rank (peft), the base frozen.
        lora_targets (`tuple[str, ...]`): LoRA's target modules.
        weight_decay (`float`), learning_rate (`float`): Trainer's arguments (weight decay allocates nothing).
        device (`str`): `"cuda"`: torch optimizers use their CUDA default (`foreach`, which allocates step
            temporaries across all tensors), ranks run NCCL; `"cpu"`: the CPU default (a loop over tensors), ranks run
            gloo (its FSDP2 collectives' buffers counted, `layerwise_hf.plan.ranks`).
        world_size (`int`): ranks (devices) of the run; one of them is simulated (`layerwise_hf.plan.ranks`).
        sharding (`str`): `"none"` (one process), `"ddp"` or `"fsdp2"`.
        sync_each_batch (`bool`): Accelerate's `sync_each_batch`: every micro-batch of a window is reduced (no
            `no_sync`), as Trainer does from transformers 5.2 when the plugin sets it.
        dp_replicate (`int`): HSDP under `"fsdp2"` (`ParallelismConfig(dp_replicate_size=...)`): the ranks are this
            many replicas of `world_size // dp_replicate` shards; a rank is simulated in its shard group (`shards`),
            since the all-reduce across replicas runs in place (NCCL allocates nothing).
        tp (`int`): tensor parallel under `"fsdp2"`: the model sharded at its load by transformers'
            `DistributedConfig(tp_size=tp, fsdp_size=shards // tp, ...)` instead of Accelerate's FSDP2 (`fsdp_size`
            1: tensor parallel alone).
    """

    seq_len: int = 512
    micro_batch: int = 1
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    clip_mode: str = "exact"
    bf16: bool = False
    fp16: bool = False
    torch_dtype: str = "float32"
    gradient_checkpointing: bool = False
    lora_r: int | None = None
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    weight_decay: float = 0.0
    learning_rate: float = 1e-4
    device: str = "cuda"
    world_size: int = 1
    sharding: str = "none"
    sync_each_batch: bool = False
    dp_replicate: int = 1
    tp: int = 1

    def replace(self, **changes: Any) -> StepSetup:
        return dataclasses.replace(self, **changes)

    @property
    def shards(self) -> int:
        """The ranks a parameter is spread over (FSDP2's group): all of them, or one replica's under HSDP."""
        return self.world_size // self.dp_replicate


@dataclass
class SimulatedStep:
    """The measured (second) step of one optimizer: its peak and what the rule stand-in covered."""

    optimizer: str
    peak: Peak
    from_rule: bool
    steady_bytes: int  # live after the step (weights + optimizer state, and gradients a step keeps)
    steady_by_category: dict[str, int] = dataclasses.field(default_factory=dict)  # its split
    phase_peaks: dict[str, Peak] = dataclasses.field(default_factory=dict)  # the peak of each place in the step
    offload: str = "none"  # layerwise_offload: `peak` is the device side's, `host_peak` the host side's
    host_peak: Peak = dataclasses.field(default_factory=Peak)
    combined_peak: int = 0  # device + host at their joint peak (one memory, as on a CPU)
    backward_flops: int = 0  # its stepping backwards (every micro-batch), counted by FlopCounterMode in step 1


def _mixed_mesh_clip(params: list[torch.Tensor], max_norm: float) -> None:
    # NOTE: transformers 5.24's Trainer._mixed_mesh_grad_norm, which Trainer takes when tensor parallel leaves the
    # gradients on several meshes (clip_grad_norm_ cannot stack their norms): a total per mesh, made whole, clipped.
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [get_total_norm([p.grad for p in group]) for group in groups.values()]
    norms = [whole(n) for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        clip_grads_with_norm_(group, max_norm, total)


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    # NOTE: FakeTensorMode fakes CPU tensors only on a CPU build of torch; a fake CUDA device needs CUDA linked in.
    return FakeTensorMode(allow_non_fake_inputs=True)


def build_model(config: Any, setup: StepSetup, mode: Any) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_config` in `setup.torch_dtype` with fake tensors of `mode` (nothing allocated),
    LoRA adapters added by peft, prepared as Trainer prepares it."""
    from transformers import AutoModelForCausalLM

    if not setup.lora_r:
        with mode:
            model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(DTYPES[setup.torch_dtype]))
    else:
        from peft import LoraConfig, get_peft_model

        # NOTE: peft moves each adapter with `.to()`, which swaps a fake parameter and fails ("Cannot swap t1 because
        # it has weakref associated with it"): build on the meta device, then give every tensor a fake twin.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(DTYPES[setup.torch_dtype]))
        lora = LoraConfig(r=setup.lora_r, lora_alpha=2 * setup.lora_r, lora_dropout=0.0,
                          target_modules=list(setup.lora_targets), task_type="CAUSAL_LM")  # fmt: skip
        model = get_peft_model(model, lora)
        to_fake(model, mode)
    model.config.use_cache = False
    if setup.gradient_checkpointing:
        enable_checkpointing(model)
        if setup.lora_r:
            # NOTE: Trainer does this for PEFT models: with every base weight frozen, checkpointed inputs need grads.
            model.enable_input_require_grads()
    model.train()
    return model


def to_fake(model: torch.nn.Module, mode: Any) -> None:
    """Replace every parameter and buffer of a meta-device model by a fake tensor of its shape and dtype (tied
    parameters stay tied)."""
    twins: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in twins:
                    with mode:
                        fake = torch.empty(t.shape, dtype=t.dtype)
                    twins[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                table[name] = twins[id(t)]


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing as Trainer turns it on (non-reentrant, its default kwargs)."""
    enable_activation_checkpointing(model)


def training_args(optimizer: str, setup: StepSetup, output_dir: str):
    """Stock `TrainingArguments` for the base, then the layer-wise name and `layerwise_clip` set on them:
    `build_layerwise_optimizer` reads only attributes, so the plan does not need the Trainer integration's
    argument class (and `plan/` stays below `integrations/`)."""
    from transformers import TrainingArguments

    from ..bases.registry import parse_optim_name

    base = parse_optim_name(optimizer)
    args = TrainingArguments(
        output_dir=output_dir,
        optim=optimizer if base is None else base or "adamw_torch",
        report_to="none",
        use_cpu=True,
        learning_rate=setup.learning_rate,
        weight_decay=setup.weight_decay,
        max_grad_norm=setup.max_grad_norm,
        gradient_accumulation_steps=setup.grad_accum,
    )
    # NOTE: as LayerwiseTrainingArguments does: TrainingArguments validates `optim` in __post_init__ only.
    args.optim = optimizer
    args.layerwise_clip = setup.clip_mode
    return args


def _named_specs(model: torch.nn.Module) -> dict:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {id(p): tensor_spec(n, p, id(p) in embeddings) for n, p in model.named_parameters()}


def _cuda_defaults(optimizer: torch.optim.Optimizer, setup: StepSetup) -> torch.optim.Optimizer:
    # NOTE: torch optimizers pick `foreach` when every tensor is on CUDA and a per-tensor loop on CPU; the fake
    # tensors are CPU tensors, so the CUDA default is set by hand when planning for a GPU.
    if setup.device == "cuda":
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
    return optimizer


def build_standard(model: torch.nn.Module, base: str, args: Any, setup: StepSetup) -> torch.optim.Optimizer:
    """The optimizer `Trainer.create_optimizer` builds (its weight-decay split), or the rule stand-in."""
    from transformers import Trainer

    rule = OPTIMIZER_RULES[base]
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if needs_rule(rule):
        return RuleOptimizer(
            [p for _, p in named], rule, _named_specs(model), lr=setup.learning_rate, device=setup.device
        )
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": setup.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return _cuda_defaults(cls(groups, **kwargs), setup)


def build_layerwise(
    model: torch.nn.Module, base: str, args: Any, setup: StepSetup, sync: Callable[[], bool], offload: str = "none"
):
    """`build_layerwise_optimizer(model, args)` (its factory, or the rule stand-in's), clipping configured; under
    FSDP2 with `local_shards=True`, as `LayerwiseTrainer` builds it; with `offload` (`layerwise_offload`)."""
    from ..optim.optimizer import build_layerwise_optimizer
    from ..placement.local_shard import LocalShardOptimizer

    rule = OPTIMIZER_RULES[base]
    factory = None
    if needs_rule(rule):
        specs = _named_specs(model)

        # A host step (offload="optimizer") runs the base's CPU code: bitsandbytes' CPU step temporaries, host-side.
        device = "cpu" if offload == "optimizer" else setup.device

        def factory(lp, _args):
            inner = RuleOptimizer(
                [lp.param], rule, {id(lp.param): specs[id(lp.param)]}, lr=setup.learning_rate, device=device
            )
            # NOTE: under FSDP2 the real optimizers (bitsandbytes', torchao's) step the rank's local shard, with a
            # state of the shard's size: the stand-in steps it the same way.
            return LocalShardOptimizer(inner) if setup.sharding == "fsdp2" else inner

    optimizer = build_layerwise_optimizer(
        model, args, factory=factory, sync_gradients=sync, local_shards=setup.sharding == "fsdp2", offload=offload
    )
    for inner in optimizer.inner:
        if not isinstance(inner, HostStepOptimizer):  # a host step keeps the CPU default
            _cuda_defaults(inner, setup)
    optimizer.configure_clipping(setup.max_grad_norm, setup.clip_mode)
    return optimizer


def autocast(setup: StepSetup):
    if setup.bf16 or setup.fp16:
        # NOTE: the fake tensors are CPU tensors: CPU autocast's op lists stand in for CUDA's (both run matmuls and
        # linears in the low precision and losses in float32).
        return torch.autocast("cpu", dtype=torch.bfloat16 if setup.bf16 else torch.float16)
    return contextlib.nullcontext()


def run_step(model, optimizer, layerwise, setup: StepSetup, tracker: LiveBytes, window: dict, rank: RankRoute) -> None:
    """One optimizer step: `grad_accum` micro-batches of forward, loss, backward, then clip, `step()`, `zero_grad()`.
    `window["last"]` tells the layer-wise optimizer which backward ends the accumulation window; `rank` gives the
    module to call (DDP's wrapper) and Accelerate's no-sync context."""
    from ..optim.norm_pass import backward_with_norm_pass, forward_again, run_with_norm_pass

    inner = model
    model = rank.ddp if rank.ddp is not None else model
    vocab = inner.get_input_embeddings().num_embeddings
    for k in range(setup.grad_accum):
        window["last"] = k == setup.grad_accum - 1

        def forward_backward() -> None:
            tracker.phase = "forward: inputs"
            ids = torch.randint(0, vocab, (setup.micro_batch, setup.seq_len))
            with autocast(setup), unpacked_rows():
                # NOTE: Trainer's compute_loss keeps only the loss: the outputs (logits) are gone before backward.
                loss = model(input_ids=ids, labels=ids).loss / setup.grad_accum
            del ids
            tracker.phase = "backward: start, before any weight gradient"
            if layerwise is not None:
                backward_with_norm_pass(layerwise, loss, backward=_labelled_backward(tracker))
            else:
                loss.backward()

        with rank.no_sync(model, window["last"]):
            if layerwise is not None and forward_again(layerwise):
                # The plain-loop protocol of `norm_pass.forward_again`: the last step chose a second forward+backward.
                tracker.stage = "norm pass (second forward)"
                run_with_norm_pass(layerwise, forward_backward, inner)
                tracker.stage = "backward"
            else:
                forward_backward()
    if layerwise is None and setup.max_grad_norm > 0:
        tracker.phase = "clip_grad_norm_"
        params = [p for p in inner.parameters() if p.requires_grad]
        if setup.tp > 1:
            _mixed_mesh_clip(params, setup.max_grad_norm)
        else:
            torch.nn.utils.clip_grad_norm_(params, setup.max_grad_norm, foreach=setup.device == "cuda" or None)
    tracker.phase = "step: optimizer.step()"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def grouped_mm_as_the_kernels_run():
    """`torch._grouped_mm` on fake tensors of every dtype its kernels take, while the context lasts."""
    # NOTE: torch's meta kernel of `_grouped_mm` checks bfloat16 only (the CUDA fast path's rule), while the CPU kernel
    # and CUDA's fallback (ATen/native/GroupedMMUtils.h) take float32, bfloat16 and float16 and write one output of
    # mat_a's dtype in place (no other temporaries). transformers' MoE experts call it whenever `grouped_mm` is the
    # experts implementation (its default on CPU and on CUDA from sm80), so a float32 or float16 MoE model trains
    # there; the simulation gives that call the kernels' output instead of the meta kernel's refusal.
    from torch import _meta_registrations as meta

    common = getattr(meta, "_meta_grouped_mm_common", None)
    output = getattr(meta, "_create_grouped_mm_output_tensor", None)
    if common is None or output is None:
        yield
        return

    def any_float(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, **kw):
        low = (torch.float32, torch.float16)
        if scale_a is None and scale_b is None and bias is None and mat_a.dtype in low and mat_b.dtype == mat_a.dtype:
            torch._check(out_dtype in (None, mat_a.dtype), lambda: "the output dtype must be mat_a's")
            return output(mat_a, mat_b, offs, out_dtype or mat_a.dtype)
        return common(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, **kw)

    with mock.patch.object(meta, "_meta_grouped_mm_common", any_float):
        yield


@contextlib.contextmanager
def unpacked_rows():
    """The mask the real run builds for unpacked rows (one sequence each): none, SDPA's `is_causal`."""
    # NOTE: transformers' masking_utils treats a FakeTensor as tracing, so find_packed_sequence_indices keeps its
    # packed-sequence mask and every layer's SDPA gets (and saves for backward) a float mask of seq x seq. The real run
    # reads the position ids, finds one sequence per row and passes no mask: layers x seq^2 x 4 bytes the plan counted
    # and the run never holds (4 MiB on a 4-layer model at 512 tokens; 5 GiB on Llama-2-70B at 4096).
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    # A plain function, not a MagicMock: a mock keeps its calls' arguments (the position ids) alive.
    with mock.patch.object(masking, "find_packed_sequence_indices", _no_packed_sequences):
        yield


def _no_packed_sequences(*args: Any, **kwargs: Any) -> None:
    return None


def _labelled_backward(tracker: LiveBytes):
    def backward(loss: torch.Tensor, **kwargs) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        # NOTE: backward_with_norm_pass retains the graph only for its measuring pass.
        measuring = bool(kwargs.get("retain_graph"))
        tracker.stage = "norm pass" if measuring else "backward"
        # The stepping backward's FLOPs (the recompute of activation checkpointing included), from the ops' shapes:
        # what the device's backward costs, for `plan --offload`'s time per step (`offload_time.plan_times`).
        counting = tracker.count_flops and not measuring
        counter = FlopCounterMode(display=False) if counting else contextlib.nullcontext()
        try:
            with counter:
                loss.backward(**kwargs)
        finally:
            tracker.stage = "backward"
        if counting:
            tracker.backward_flops += counter.get_total_flops()

    return backward


def simulate(
    config: Any, optimizer: str, setup: StepSetup, output_dir: str = "/tmp/layerwise-hf-plan", offload: str = "none"
) -> SimulatedStep:
    """Build the fake model and `optimizer` (a Trainer name, `_layerwise` or not); run two steps, measure the 2nd.
    `offload` (`layerwise_offload`, layer-wise only) runs the real offload code with `plan.offload`'s stand-ins."""
    from ..estimate.optimizers import parse_optimizer

    base, is_layerwise = parse_optimizer(optimizer)
    args = training_args(optimizer, setup, output_dir)
    tracker = LiveBytes()
    window = {"last": True}
    mode = fake_mode()
    model = build_model(config, setup, mode)
    rank = RankRoute(setup.sharding, tracker, setup)
    # NOTE: under HSDP a rank holds what an FSDP2 rank of its replica's shard group holds: the all-reduce across
    # replicas runs in place on the reduce-scattered shard (NCCL allocates nothing), so the group is simulated alone.
    with fake_group(setup.shards, setup.sharding), warnings.catch_warnings():
        # NOTE: LocalShardOptimizer compares data pointers to follow a moved shard; a fake tensor's is 0 (with a
        # deprecation warning), and FSDP2 keeps every shard's storage in place over the simulated steps.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        model = rank.prepare(model)
        with mode, tracker, rank.labels(), stand_ins(tracker, offload), grouped_mm_as_the_kernels_run():
            handles = tracker.watch_model(model)
            layerwise = None
            if is_layerwise:
                layerwise = build_layerwise(model, base, args, setup, sync=lambda: window["last"], offload=offload)
                opt = layerwise
                for name, inner in zip(layerwise.names, layerwise.inner):
                    handles += tracker.watch_optimizer(inner, name)
                rank.connect(layerwise, model)
            else:
                opt = build_standard(model, base, args, setup)
                handles += tracker.watch_optimizer(opt, "optimizer.step()")
                rank.forward_module(model, layerwise=False)
            tracker.count_flops = True  # in the first step: the counter's own dispatch stays out of the measured one
            run_step(model, opt, layerwise, setup, tracker, window, rank)
            tracker.count_flops = False
            handles += rank.watch_unsharded(model)
            if layerwise is not None:
                label_host_side(tracker, layerwise)
            tracker.reset_peak()
            run_step(model, opt, layerwise, setup, tracker, window, rank)
            steady = tracker.current
            steady_split = dict(tracker.totals)
            if layerwise is not None:
                layerwise.detach()
                close_offload(layerwise)
            for handle in handles:
                handle.remove()
    return SimulatedStep(
        optimizer,
        tracker.peak,
        needs_rule(OPTIMIZER_RULES[base]),
        steady,
        steady_split,
        dict(tracker.phase_peaks),
        offload,
        tracker.host_peak,
        tracker.combined_peak,
        tracker.backward_flops,
    )
