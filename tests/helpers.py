"""Tiny models and data for tests: built from configs, nothing downloaded."""

from __future__ import annotations

import copy
import gc
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments

VOCAB = 64
SEQ = 16


def freeze_imported_objects() -> None:
    """Take what is alive now (the imported libraries) out of the garbage collector's walk, once per process.

    Trainer.train() and Accelerator.free_memory() call gc.collect(), which walks every object the process holds:
    after importing transformers' Trainer (torchao, accelerate, ...) that is ~500k objects, 0.28 s per call on a CPU
    core of the CI machine and 70% of the lifecycle fuzz's time. The modules live as long as the process; what a test
    creates afterwards is collected as before.
    """
    gc.freeze()


def tiny_llama(seed: int = 0, tie: bool = False, vocab: int = VOCAB, hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seed: int = 1, vocab: int = VOCAB):
        g = torch.Generator().manual_seed(seed)
        # A learnable pattern (next token = previous + 1) plus noise, so losses move.
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % vocab
        noise = torch.rand(n, SEQ, generator=g) < 0.1
        self.ids[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(tmp_path, optim: str, **overrides) -> LayerwiseTrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path),
        optim=optim,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return LayerwiseTrainingArguments(**kwargs)


def train(model, args, dataset=None, trainer_cls=None, resume_from_checkpoint=None, **trainer_kwargs):
    trainer_cls = trainer_cls or (LayerwiseTrainer if args.is_layerwise else Trainer)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset or TokenDataset(), **trainer_kwargs)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def clone(model):
    return copy.deepcopy(model)


def hook_count(p: torch.Tensor) -> int:
    """How many post-accumulate-grad hooks (what a layer-wise optimizer registers) `p` carries."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    return len(hooks) if hooks else 0


def held_grad_bound(model) -> int:
    """The most gradient bytes a one-process layer-wise step keeps alive: the estimator's term, which replays the
    route's held step (an untied lm_head's gradient next to the largest smaller tensor)."""
    from layerwise_hf.estimate import estimate

    return estimate(model, optimizer="sgd_layerwise").gradient_bytes


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


def assert_params_equal(a, b, atol: float = 0.0):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        if atol == 0.0:
            assert torch.equal(pa[name], pb[name]), f"{name} differs: max {(pa[name] - pb[name]).abs().max()}"
        else:
            torch.testing.assert_close(pa[name], pb[name], atol=atol, rtol=0, msg=f"{name} differs")


def finish_ranks() -> None:
    """
    End of a launched test script, once its results are written: every rank leaves together, and the process exits
    without running C++ static destructors. A rank that exits while another still holds the gloo group open was seen
    to abort at interpreter teardown ("terminate called without an active exception", once, under heavy load), which
    would fail a run whose results were all correct.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The planner tests' model (a config dict): small enough for seconds, large enough that no category is noise.
PLAN_LLAMA = dict(
    model_type="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)


def rank_comparison(reference, model) -> dict:
    """On each rank of a process group: the largest difference of `model`'s weights from `reference`'s, and whether
    every rank holds the same weights (a collective: every rank calls it)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {n: p.detach() for n, p in model.named_parameters()})
    return {
        "max_diff": max((p - q).abs().max().item() for p, q in zip(reference.parameters(), model.parameters())),
        "ranks_agree": all(torch.equal(gathered[0][n], other[n]) for other in gathered[1:] for n in gathered[0]),
    }


def spawned_results(worker, tmp_path, nprocs: int = 2) -> dict:
    """Run `worker(rank, store_path, report_path)` on `nprocs` processes (`torch.multiprocessing.spawn`, each joining
    a gloo group through the file store) and return the report rank 0 wrote (`write_rank_report`)."""
    import json

    report = tmp_path / "report.json"
    torch.multiprocessing.spawn(worker, args=(str(tmp_path / "store"), str(report)), nprocs=nprocs)
    return json.loads(report.read_text())


def write_rank_report(rank: int, report: str, results: dict) -> None:
    """Rank 0 writes `results` to `report` as JSON; then every rank leaves the process group together."""
    import json

    import torch.distributed as dist

    if rank == 0:
        with open(report, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
