"""4 gloo ranks on meshes past flat FSDP2: LayerwiseTrainer + X_layerwise equals stock Trainer + X (every parameter,
the logged grad_norm and lr) in the same launch, under tensor parallel x FSDP2, tensor parallel alone and HSDP 2x2 (a
model sharded at load by transformers' `DistributedConfig`), and HSDP 2x2 through Accelerate's `ParallelismConfig`
with FSDP2. Under tensor parallel x FSDP2 and tensor parallel alone, `adamw_8bit_layerwise` and `adafactor_layerwise`
(which stock cannot run on DTensors) against the same optimizer applied by hand on each rank's shard, with their
state saved and loaded through DCP mid-run, and an 8-bit state of another mesh refused.

    LAYERWISE_HF_FORCE_FSDP_CPU=1 LAYERWISE_HF_FORCE_MESH_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_ddp.yaml --num_processes 4 tests/distributed/meshes.py REPORT.json [CASES]

CASES (comma-separated prefixes of case names, or `previous`; default all) picks cases. The launch config is the DDP
one: each case brings its own mesh (the model's load, or `parallelism_config` and `fsdp` in its TrainingArguments), so
one launch runs them all; the FSDP2 (HSDP) cases run after the stock comparisons at the load because Accelerate leaves
`ACCELERATE_USE_FSDP=true` in the environment behind it (each run restores the environment too).
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from common import (
    SEQ,
    VOCAB,
    dataset,
    finish_ranks,
    max_diff,
    mesh_args,
    params,
    ranks_agree,
    training_args,
    write_report,
)
from local_shards import HandRun, LoadStateAt, SaveStateAt
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, Trainer

# applies LAYERWISE_HF_FORCE_FSDP_CPU and LAYERWISE_HF_FORCE_MESH_CPU
from layerwise_hf import LayerwiseTrainer

torch.set_num_threads(1)
# 4 key/value heads: tensor parallel over all 4 ranks splits every projection.
MODEL = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=SEQ,
)


def save_model(folder: str, **changes) -> str:
    """A tiny Llama written by every rank to its own folder (same seed, same weights), for `from_pretrained`; before
    any process group exists, since `save_pretrained` then writes from the main process only."""
    suffix = "".join(f"-{k}{v}" for k, v in changes.items())
    path = os.path.join(folder, f"model{suffix}-rank{os.environ['RANK']}")
    if not os.path.exists(path):
        torch.manual_seed(0)
        config = LlamaConfig(**{k: v for k, v in {**MODEL, **changes}.items() if k != "model_type"})
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def model_for(mesh: str, path: str):
    from transformers import DistributedConfig

    if mesh == "hsdp":
        return LlamaForCausalLM.from_pretrained(path)
    sizes = {
        "tp_fsdp": dict(tp_size=2, fsdp_size=2),
        "tp": dict(tp_size=4),
        "hsdp_load": dict(dp_replicate_size=2, fsdp_size=2),
    }[mesh]
    return LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**sizes))


def run(
    trainer_cls, mesh, optim, folder, model_path, *, ga=1, max_grad_norm=0.0, layerwise_clip="exact", callbacks=()
):
    environ = dict(os.environ)
    model = model_for(mesh, model_path)
    overrides = {"layerwise_clip": layerwise_clip} if optim.endswith("_layerwise") else {}
    # One sample a micro-batch under GA 2 (two per step, as at GA 1), so that a norm above 1.0 is clipped there too.
    args = training_args(
        os.path.join(folder, "out"),
        optim,
        ga=ga,
        max_grad_norm=max_grad_norm,
        max_steps=3,
        per_device_train_batch_size=2 // ga,
        **overrides,
        **mesh_args(mesh),
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(), callbacks=list(callbacks))
    trainer.train()
    wrapped = trainer.model_wrapped
    meshes = {tuple(p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else () for p in wrapped.parameters()}
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    optimizer = getattr(trainer, "layerwise_optimizer", None)
    # This rank's optimizer-state bytes (its local shards), what `layerwise-hf plan` predicts for one rank.
    states = trainer.optimizer.state_dict()["state"].values() if optimizer is None else []
    local = [getattr(v, "_local_tensor", v) for state in states for v in state.values() if torch.is_tensor(v)]
    result = {
        "params": params(wrapped),
        "grad_norm": [float(h["grad_norm"]) for h in logs],
        "loss": [float(h["loss"]) for h in logs],
        "lr": [h["learning_rate"] for h in logs],
        "route": optimizer.route if optimizer is not None else None,
        "meshes": sorted(meshes),
        "state_bytes": sum(t.numel() * t.element_size() for t in local),
    }
    os.environ.clear()
    os.environ.update(environ)
    return result


def cases(mesh: str, settings) -> list:
    return [(f"{mesh} adamw_torch ga{ga} clip{clip}", mesh, "adamw_torch", ga, clip) for ga, clip in settings]


EVERY = [(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)]
# (name, mesh, optim, GA, max_grad_norm); the FSDP2 config's (HSDP through ParallelismConfig) last, see the docstring.
# HSDP made by transformers at the load takes the same route as through ParallelismConfig: two settings of the four.
CASES = [
    *cases("tp_fsdp", EVERY),
    *cases("tp", EVERY),
    *cases("hsdp_load", [(1, 0.0), (2, 1.0)]),
    *cases("hsdp", EVERY),
]

# Optimizers stock Trainer cannot run on DTensors, stepped on each rank's local shard: (name, mesh, optim, GA,
# max_grad_norm), compared with the same optimizer applied by hand. A larger vocabulary puts the embedding's and
# lm_head's shards over bitsandbytes' min_8bit_size (4096 elements), so some states are 8-bit, the rest 32-bit.
LOCAL_SHARD_MODEL = dict(vocab_size=1024)
LOCAL_SHARD_CASES = [
    ("local_shard tp_fsdp adamw_8bit ga1 clip1.0", "tp_fsdp", "adamw_8bit_layerwise", 1, 1.0),
    ("local_shard tp adamw_8bit ga2 clip0.0", "tp", "adamw_8bit_layerwise", 2, 0.0),
    ("local_shard tp_fsdp adafactor ga1 clip0.0", "tp_fsdp", "adafactor_layerwise", 1, 0.0),
]


def local_shard_case(case, model_path, states: str, saved: dict) -> dict:
    """Trains `case` twice: once by hand beside it, saving the optimizer's state (DCP) at step 2; once dropping every
    state at step 2 and loading the saved one instead (after trying the states other meshes saved, which must be
    refused). Both must end on the same weights."""
    name, mesh, optim, ga, clip = case
    folder = os.path.join(states, name.replace(" ", "_"))
    by_hand, save, load = HandRun(), SaveStateAt(2, folder), LoadStateAt(2, folder, refused=tuple(saved.values()))
    with tempfile.TemporaryDirectory() as d:
        whole = run(LayerwiseTrainer, mesh, optim, d, model_path, ga=ga, max_grad_norm=clip, callbacks=[by_hand, save])
    with tempfile.TemporaryDirectory() as d:
        loaded = run(LayerwiseTrainer, mesh, optim, d, model_path, ga=ga, max_grad_norm=clip, callbacks=[load])
    saved[mesh] = folder
    return {
        "case": name,
        "hand_max_diff": by_hand.max_diff(),
        "stepped": len(by_hand.records),
        "eight_bit_states": by_hand.eight_bit_states(),
        "ranks_agree": ranks_agree(whole["params"]),
        "loss": whole["loss"],
        "grad_norm": whole["grad_norm"],
        "meshes": whole["meshes"],
        "resume_max_diff": max_diff(whole["params"], loaded["params"]),
        "refusals": load.refusals,
    }


def main(report_path, selected=None):
    results, folder = [], os.path.dirname(os.path.abspath(report_path))
    model_path = save_model(os.path.join(folder, "model"))
    local_shard_path = save_model(os.path.join(folder, "model"), **LOCAL_SHARD_MODEL)
    for name, mesh, optim, ga, clip in CASES:
        if selected and not any(name.startswith(s) for s in selected):
            continue
        with tempfile.TemporaryDirectory() as d:
            standard = run(Trainer, mesh, optim, d, model_path, ga=ga, max_grad_norm=clip)
            layerwise = run(LayerwiseTrainer, mesh, f"{optim}_layerwise", d, model_path, ga=ga, max_grad_norm=clip)
        results.append(
            {
                "case": name,
                "max_grad_norm": clip,
                "max_diff": max_diff(standard["params"], layerwise["params"]),
                "grad_norm": [standard["grad_norm"], layerwise["grad_norm"]],
                "loss_equal": standard["loss"] == layerwise["loss"],
                "lr_equal": standard["lr"] == layerwise["lr"],
                "ranks_agree": ranks_agree(layerwise["params"]),
                "route": layerwise["route"],
                "meshes": [standard["meshes"], layerwise["meshes"]],
                "standard_state_bytes": standard["state_bytes"],
            }
        )
        if dist.get_rank() == 0:
            print(results[-1], flush=True)
    if not selected or "previous" in selected:
        # One-pass clipping adds norms of the two meshes as it goes: no stock run to compare with, but it must train
        # (no collective out of step between ranks) and keep the ranks in agreement.
        with tempfile.TemporaryDirectory() as d:
            previous = run(
                LayerwiseTrainer,
                "tp_fsdp",
                "adamw_torch_layerwise",
                d,
                model_path,
                max_grad_norm=1.0,
                layerwise_clip="previous",
            )
        results.append(
            {
                "case": "previous tp_fsdp",
                "ranks_agree": ranks_agree(previous["params"]),
                "loss": previous["loss"],
                "grad_norm": previous["grad_norm"],
            }
        )
    saved = {}
    for case in LOCAL_SHARD_CASES:
        if selected and not any(case[0].startswith(s) for s in selected):
            continue
        # Only 8-bit states are offered to another mesh's run: Adafactor's are not tried there.
        offered = saved if "8bit" in case[2] else {}
        results.append(local_shard_case(case, local_shard_path, os.path.join(folder, "states"), offered))
        if dist.get_rank() == 0:
            print(results[-1], flush=True)
    write_report(report_path, {"results": results, "model": MODEL})


if __name__ == "__main__":
    main(sys.argv[1], [s for s in sys.argv[2].split(",") if s] if len(sys.argv) > 2 else None)
    finish_ranks()
