"""Merging per-shard top-k results into the global top-k, with deterministic tie breaking."""

from __future__ import annotations

import math

import torch
from torch import Tensor

_NO_ID = torch.iinfo(torch.int64).max


def merge_topk(D: Tensor, I: Tensor, k: int, metric: str) -> tuple[Tensor, Tensor]:
    """The best ``k`` of candidate results, per query row.

    D float32 [nq, m] scores ("ip", "cosine": larger is better) or squared distances ("l2": smaller is
    better), I int64 [nq, m] their ids (-1: no result), in any order, m >= k; typically the
    [nq, k] results of every shard side by side. -> (D [nq, k], I [nq, k]) best first. Equal scores
    are ordered by ascending id, and missing results (-1) come last, so the merge is a pure function
    of the set of candidates: every rank computes the same result whatever order the shards come in.
    Runs on the tensors' device.
    """
    if metric not in ("ip", "cosine", "l2"):
        raise ValueError(f"metric must be one of ('ip', 'cosine', 'l2'), got {metric!r}")
    if D.shape != I.shape or D.dim() != 2:
        raise ValueError(f"D and I must both be [nq, m], got {tuple(D.shape)} and {tuple(I.shape)}")
    if not 1 <= k <= D.shape[1]:
        raise ValueError(f"k must be in [1, {D.shape[1]}] (candidates per row), got {k}")
    by_id = torch.argsort(torch.where(I < 0, _NO_ID, I), dim=1, stable=True)  # [nq, m] ids ascending
    key = D.gather(1, by_id)
    if metric == "l2":
        key = -key
    key = key.masked_fill(I.gather(1, by_id) < 0, -math.inf)
    best = torch.argsort(key, dim=1, descending=True, stable=True)[:, :k]  # equal keys keep id order
    pick = by_id.gather(1, best)  # [nq, k] columns of D and I
    return D.gather(1, pick), I.gather(1, pick)
