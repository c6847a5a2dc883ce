"""Checks of what one rank passes to a ShardedIndex method; the methods turn their errors into
collective ones (raised on every rank)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor


def same_across_ranks(values: np.ndarray, name: str) -> None:
    """ValueError unless every rank's row of ``values`` [world, ...] is equal (raised alike on every rank)."""
    if (values != values[0]).any():
        shown = ", ".join(f"rank {r}: {v.tolist()}" for r, v in enumerate(values))
        raise ValueError(f"{name} differs across ranks ({shown}): every rank must pass the same")


def count_rows(x: Any, dim: int, name: str, allow_empty: bool = True, allow_none: bool = True) -> int:
    """Rows of vectors x [n, dim] (numpy or torch, floating; None: 0 rows where ``allow_none``)."""
    if x is None and allow_none:
        return 0
    if not isinstance(x, (np.ndarray, Tensor)):
        raise TypeError(f"{name} must be a numpy array or torch tensor{' or None' if allow_none else ''}, "
                        f"got {type(x).__name__}")
    floating = np.issubdtype(x.dtype, np.floating) if isinstance(x, np.ndarray) else x.is_floating_point()
    if not floating:
        raise TypeError(f"{name} must hold floating-point values, got dtype {x.dtype}")
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{name} must have shape [n, {dim}] (dim={dim}), got {tuple(x.shape)}")
    if not allow_empty and x.shape[0] == 0:
        raise ValueError(f"{name} is empty")
    return int(x.shape[0])


def as_float32(x: Any) -> Tensor:
    """Vectors (numpy or torch) as a contiguous float32 tensor (on x's device)."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return x.detach().float().contiguous()


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """t [m, ...] with zero rows appended up to ``rows``."""
    return torch.cat([t, t.new_zeros(rows - len(t), *t.shape[1:])]) if len(t) < rows else t
