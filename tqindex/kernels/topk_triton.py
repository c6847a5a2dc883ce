"""The k largest entries of a few rows on GPUs (Triton): bitonic top-k of packed keys, in rounds of pieces.

Each entry becomes one int64 key: the float's order-preserving int32 image (negative floats' magnitude bits
flipped) in the high half, ``2^31 - 1 - column`` in the low half, so keys order as (value, earlier column) and
carry their column. A program takes a piece of PIECE keys of one row and keeps its K best (``tl.topk``, a
bitonic network in registers; K = k rounded up to a power of two, at least 2); the pieces' bests form a row of
keys that the next round treats the same way, until one piece is left, whose k best are written as values and
columns.

``torch.topk`` on a CUDA row costs 40-55 µs whatever k is (a radix selection of several passes); the searches
of a few queries make one to three such calls. On an H200 (CUDA graphs, launches included; pieces of 1024 keys,
PIECE notes) one row of 39,063 tile maxima took 12.7 µs for k = 32 (``torch.topk`` 46.8) and 26.5 µs for k = 128
(54.4), 16 such rows 29 and 51 µs (69 and 71), one row of 8,192 scores 6.4 µs for k = 10 (20.6 as a single piece of
8,192). For many rows ``torch.topk`` is faster (256 rows of 39,063: 187 µs against 270), so :func:`fits` takes at
most MAX_ROWS rows. The reference is ``torch.topk(x, k, dim=1)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .planes import cdiv, next_power_of_2

MAX_ROWS = 16
"""Most rows :func:`top_columns_triton` takes."""
MAX_K = 256
"""Largest k it takes."""
PIECE = 512
"""Keys per program in a round of several pieces (fewer, larger pieces wait on one long bitonic network). On an H100
(CUDA graphs, L2 flushed) 16 rows of 39,063 took 24.5 us for k = 32 and 43.5 for k = 128 in pieces of 512 against
32.8 and 54.3 in pieces of 1024 (pieces of 256: 23.4 and 48.5), one such row 13.9 against 19.4 for k = 32, 16 rows of
8,192 9.8 against 11.1 for k = 10 and of 32,768 31.7 against 37.0 for k = 100."""
LOWEST = tl.constexpr(-(2**63))
"""The key of places past the row's end: below every entry's key."""


@triton.jit
def _top_keys_kernel(X, n, x_stride, col_stride, LABELS, l_stride, l_col_stride, piece, OUT_K, out_stride, OUT_V,
                     OUT_I, k, KEYS: tl.constexpr, LAST: tl.constexpr, HAS_LABELS: tl.constexpr, BLOCK: tl.constexpr,
                     K: tl.constexpr):
    """Program (row, piece): the K best keys of entries [piece * p, piece * (p + 1)) of row X[row] (< n) -> OUT_K
    [rows, pieces * K] at p * K (best first); KEYS: X holds a previous round's int64 keys, else float32 values
    (no NaN) at column stride ``col_stride``, taken as -inf where HAS_LABELS and their integer label
    (LABELS[row * l_stride + column * l_col_stride]) is negative. LAST (one piece): the k best as values OUT_V
    float32 and columns OUT_I int64 [rows, k] instead (HAS_LABELS: their labels, -1 for -inf)."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    c = p * piece + tl.arange(0, BLOCK)
    inside = (tl.arange(0, BLOCK) < piece) & (c < n)
    if KEYS:
        key = tl.load(X + row * x_stride + c, mask=inside, other=LOWEST)
    else:
        x = tl.load(X + row * x_stride + c.to(tl.int64) * col_stride, mask=inside, other=0.0)
        if HAS_LABELS:
            label = tl.load(LABELS + row * l_stride + c.to(tl.int64) * l_col_stride, mask=inside, other=-1)
            x = tl.where(label < 0, float("-inf"), x)
        bits = x.to(tl.int32, bitcast=True)
        order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        key = tl.where(inside, (order << 32) | (2147483647 - c).to(tl.int64), LOWEST)
    top = tl.topk(key, K)
    slot = tl.arange(0, K)
    if LAST:
        order = (top >> 32).to(tl.int32)
        values = (order ^ ((order >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        col = (2147483647 - top.to(tl.int32)).to(tl.int64)
        if HAS_LABELS:
            label = tl.load(LABELS + row * l_stride + col * l_col_stride, mask=slot < k, other=-1)
            col = tl.where(values == float("-inf"), -1, label)
        tl.store(OUT_V + row * k + slot, values, mask=slot < k)
        tl.store(OUT_I + row * k + slot, col, mask=slot < k)
    else:
        tl.store(OUT_K + row * out_stride + p * K + slot, top)


def fits(x: Tensor, k: int) -> bool:
    """Whether :func:`top_columns_triton` takes the k largest of rows x [m, n]."""
    return x.dim() == 2 and x.shape[0] <= MAX_ROWS and 1 <= k <= min(MAX_K, x.shape[1])


def top_columns_triton(x: Tensor, k: int, labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of x float32 [m, n] (any strides; m <= MAX_ROWS, 1 <= k <= min(n, MAX_K),
    no NaN), best first, of equal values the earlier column first -> (values float32 [m, k], columns int64
    [m, k]); ``torch.topk(x, k, dim=1)`` is the reference (module notes). With integer ``labels`` [m, n] (any
    strides): entries of a negative label count as -inf, and their labels come out instead of the columns, -1
    for -inf."""
    if not fits(x, k):
        raise ValueError(f"top_columns_triton takes at most {MAX_ROWS} rows and 1 <= k <= min(n, {MAX_K}), got k = "
                         f"{k} of {tuple(x.shape)}")
    x = x.float()
    m, n = x.shape
    kp = max(2, next_power_of_2(k))  # tl.topk of Triton 3.6 fails for k = 1
    values = torch.empty(m, k, device=x.device)
    columns = torch.empty(m, k, dtype=torch.int64, device=x.device)
    if not m:
        return values, columns
    src, keys, width = x, False, n
    piece = max(PIECE, 2 * kp)
    while True:
        pieces = cdiv(width, piece)
        last = pieces == 1
        block = max(next_power_of_2(width), kp) if last else piece
        out = values if last else torch.empty(m, pieces * kp, dtype=torch.int64, device=x.device)
        _top_keys_kernel[(m, pieces)](src, width, src.stride(0), 1 if keys else src.stride(1),
                                      columns if labels is None else labels, 0 if labels is None else labels.stride(0),
                                      0 if labels is None else labels.stride(1), block, out, out.stride(0), values,
                                      columns, k, KEYS=keys, LAST=last, HAS_LABELS=labels is not None, BLOCK=block,
                                      K=kp, num_warps=8 if block >= 4096 else 4)
        if last:
            return values, columns
        src, keys, width = out, True, pieces * kp
