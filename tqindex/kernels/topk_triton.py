"""The k largest entries of rows on GPUs (Triton) for small k: one program per row of up to SMALL_COLUMNS entries,
the row held in registers, the maximum extracted k times; a longer row in two rounds (the k best of each piece of
SMALL_COLUMNS entries, then the k best of those).

``torch.topk`` on a CUDA row of a few thousand entries costs about 20 µs whatever k is (a radix selection of
several passes, each a block-wide histogram); the few-query searches of a GPU index make several such calls. A
row of at most SMALL_COLUMNS entries fits one program's registers, and k <= SMALL_K extractions of its
maximum (one reduction each) take less: on an H200, the two selections of a one-query search of 390k rows
(k = 32 of 1,524 tile maxima, k = 10 of 8,192 scores) took 19 µs together against 42 µs by ``torch.topk``
(eager profiles). The 39,063 tile maxima of a one-query search of 10M rows (k = 32) took 36 µs in two rounds
against 66 µs by ``torch.topk`` (``do_bench``, launches included). The reference is ``torch.topk(x, k, dim=1)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .planes import cdiv, next_power_of_2

SMALL_COLUMNS = 8192
"""Longest rows the kernel takes (held in one program's registers)."""
SMALL_K = 32
"""Largest k it takes (each of the k extractions is one reduction over the row)."""
LOWEST = tl.constexpr(-(2**31))
"""The key of entries past the row's end and of entries already taken: below every float's key."""


@triton.jit
def _top_columns_kernel(X, n, x_stride, k, OUT_V, OUT_I, BLOCK: tl.constexpr, KP: tl.constexpr):
    """Program per row: the k largest of X[row, :n] (float32, no NaN), best first (of equal values the earlier
    column), to OUT_V float32 / OUT_I int64 [rows, k]. Floats are compared as int32 keys that keep their order
    (negative floats' magnitude bits flipped), so taken entries can be set below every value, -inf included."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    bits = tl.load(X + row * x_stride + c, mask=c < n, other=0.0).to(tl.int32, bitcast=True)
    key = tl.where(c < n, bits ^ ((bits >> 31) & 0x7FFFFFFF), LOWEST)
    slot = tl.arange(0, KP)
    top_key = tl.zeros((KP,), tl.int32)
    top_col = tl.zeros((KP,), tl.int32)
    for i in range(k):
        best, at = tl.max(key, 0, return_indices=True)  # the first column of equal maxima
        top_key = tl.where(slot == i, best, top_key)
        top_col = tl.where(slot == i, at, top_col)
        key = tl.where(c == at, LOWEST, key)
    out = row * k + slot
    bits = top_key ^ ((top_key >> 31) & 0x7FFFFFFF)
    tl.store(OUT_V + out, bits.to(tl.float32, bitcast=True), mask=slot < k)
    tl.store(OUT_I + out, top_col.to(tl.int64), mask=slot < k)


def fits(x: Tensor, k: int) -> bool:
    """Whether :func:`top_columns_triton` takes the k largest of rows x [m, n] (k <= SMALL_K; the pieces' k best
    of a long row fit one row)."""
    return x.dim() == 2 and k <= SMALL_K and cdiv(x.shape[1], SMALL_COLUMNS) * k <= SMALL_COLUMNS


def top_columns_triton(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of x float32 [m, n] (1 <= k <= min(n, SMALL_K), n up to SMALL_COLUMNS *
    SMALL_COLUMNS / k, no NaN), best first, of equal values the earlier column first -> (values float32 [m, k],
    columns int64 [m, k]). One launch for rows of up to SMALL_COLUMNS entries, else two (pieces padded with
    -inf, which come after every column of the row); ``torch.topk(x, k, dim=1)`` is the reference."""
    if not (fits(x, k) and 1 <= k <= x.shape[1]):
        raise ValueError(f"top_columns_triton takes 1 <= k <= n, k <= {SMALL_K} and n <= {SMALL_COLUMNS} * "
                         f"{SMALL_COLUMNS} / k, got k = {k} of rows of {x.shape[-1]}")
    x = x.float()
    m, n = x.shape
    if n <= SMALL_COLUMNS:
        return _top_columns(x if x.stride(1) == 1 else x.contiguous(), k)
    pieces = cdiv(n, SMALL_COLUMNS)
    padded = torch.nn.functional.pad(x, (0, pieces * SMALL_COLUMNS - n), value=float("-inf"))
    values, columns = _top_columns(padded.view(m * pieces, SMALL_COLUMNS), k)  # [m * pieces, k]
    columns += torch.arange(0, pieces * SMALL_COLUMNS, SMALL_COLUMNS, device=x.device).repeat(m)[:, None]
    values, best = _top_columns(values.view(m, pieces * k), k)  # of equal values the earlier piece's first
    return values, columns.view(m, pieces * k).gather(1, best)


def _top_columns(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`top_columns_triton` of rows x float32 [m, n <= SMALL_COLUMNS] (unit column stride): one launch."""
    m, n = x.shape
    values = torch.empty(m, k, device=x.device)
    columns = torch.empty(m, k, dtype=torch.int64, device=x.device)
    if m:
        block = next_power_of_2(n)
        _top_columns_kernel[(m,)](x, n, x.stride(0), k, values, columns, BLOCK=block, KP=next_power_of_2(k),
                                  num_warps=8 if block >= 4096 else 4)
    return values, columns
