"""The row checks of :mod:`tqindex.checks` in one Triton launch: a search of a few queries on a GPU otherwise spends
a dozen small kernels (finiteness, float64 norms, their range, the division, the flags) on validating them.

:func:`checked_rows_triton` computes each row's norm as :func:`tqindex.checks.row_norms` does (float64 sum of the
exact squares, one rounding to float32), the unit rows as :func:`tqindex.checks.unit_rows` divides them (IEEE
float32 division; zero rows stay zero), and one flag per program: a row that is not finite or whose nonzero norm
lies outside [low, high]. Where a flag is set, :func:`tqindex.checks.rows_in_range` leaves the rows to the PyTorch
checks, which raise the error (or, for unit rows outside NORM_SAFE, rescale them exactly); elsewhere both give the
same rows and norms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import cdiv, next_power_of_2

ELEMENTS = 4096
"""Elements a program loads at a time (rows x columns of a chunk)."""
CHUNK = 1024
"""Columns a program loads at a time at most (wider rows take several chunks, read twice)."""


@triton.jit
def _checked_rows_kernel(x, n, d, stride, out, norms, flags, low, high, UNIT: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    live = r < n
    at = x + r[:, None].to(tl.int64) * stride
    squares = tl.zeros([BLOCK_R], dtype=tl.float64)
    for c0 in range(0, d, BLOCK_D):
        w = tl.load(at + c0 + c[None, :], mask=live[:, None] & (c0 + c[None, :] < d), other=0.0).to(tl.float64)
        squares += tl.sum(w * w, axis=1)
    norm = tl.sqrt(squares).to(tl.float32)  # float64 sqrt: correctly rounded; NaN or inf where a value is
    ok = ((norm >= low) & (norm <= high)) | (norm == 0.0)  # False for NaN
    tl.store(flags + tl.program_id(0), tl.max(tl.where(live & ~ok, 1, 0), axis=0).to(tl.int1))
    tl.store(norms + r, norm, mask=live)
    if UNIT:
        den = tl.where(norm > 0.0, norm, 1.0)[:, None]
        to = out + r[:, None].to(tl.int64) * d
        for c0 in range(0, d, BLOCK_D):
            mask = live[:, None] & (c0 + c[None, :] < d)
            tl.store(to + c0 + c[None, :], tl.div_rn(tl.load(at + c0 + c[None, :], mask=mask, other=0.0), den),
                     mask=mask)


def checked_rows_triton(t: Tensor, unit: bool, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of float32 t [n, d] (any row stride, unit column stride) -> (rows float32 [n, d]: t / norms where
    ``unit`` (zero rows stay zero), else t itself; norms float32 [n]; flags bool [programs]: some row is not finite
    or has a nonzero norm outside [low, high]). The rows and norms are meaningful only where no flag is set."""
    if t.dim() != 2 or t.dtype != torch.float32 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"checked_rows_triton takes float32 [n, d] rows of unit column stride, got {t.dtype} "
                         f"{tuple(t.shape)}")
    n, d = t.shape
    block_d = min(next_power_of_2(max(d, 1)), CHUNK)
    block_r = min(next_power_of_2(max(n, 1)), ELEMENTS // block_d)
    programs = max(1, cdiv(n, block_r))
    out = torch.empty_like(t, memory_format=torch.contiguous_format) if unit else t
    norms = torch.empty(n, device=t.device)
    flags = torch.empty(programs, dtype=torch.bool, device=t.device)
    _checked_rows_kernel[(programs,)](t, n, d, t.stride(0), out, norms, flags, low, high, UNIT=unit,
                                      BLOCK_R=block_r, BLOCK_D=block_d)
    return out, norms, flags
