"""Shared by the 2-rank scripts: a tiny model, rank-aware data, cross-rank checks."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import finish_ranks  # noqa: E402, F401  (re-exported for the scripts)

VOCAB = 64
SEQ = 8


def tiny_llama(seed: int = 0, vocab: int = VOCAB, hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def dataset(n: int = 64, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(123)
    return [{"input_ids": (ids := torch.randint(0, vocab, (SEQ,), generator=g)), "labels": ids} for _ in range(n)]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def params(model) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def ranks_agree(tensors: dict[str, torch.Tensor]) -> bool:
    flat = torch.cat([t.flatten().float() for t in tensors.values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)
