"""Shared by the 2-rank scripts: a tiny model, rank-aware data, cross-rank checks."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import finish_ranks, tiny_llama  # noqa: E402, F401  (re-exported for the scripts)

VOCAB = 64  # as helpers.tiny_llama
SEQ = 8


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
