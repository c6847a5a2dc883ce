"""Trellis search on GPUs (Triton), the search of :func:`tqindex.trellis.viterbi_reference` (the same symbols:
float32 costs summed in its order without fused multiply-adds, ties to the lowest state).

A program takes ROWS rows and holds their costs of every state [ROWS, states] in registers: per coordinate the
least cost over each state's predecessors (a reshape to [ROWS, 2^bits, states / 2^bits] and a min over the
middle axis), its back pointer stored as a byte, then the new costs. After the last coordinate the program
walks its rows' back pointers from the end. :func:`tqindex.trellis.tail_biting` makes a tail-biting search of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .planes import cdiv

ROWS = 16
"""Rows per program."""


@triton.jit
def _search_kernel(T, LEVELS, HISTORY, BACK, SYM, n, d, ROWS: tl.constexpr, BITS: tl.constexpr,
                   STATE_BITS: tl.constexpr):
    """Rows ``row`` of targets T [n, d]: the least-squares symbols SYM [n, d] (uint8), starting and ending in
    states whose low STATE_BITS - BITS bits are HISTORY[row] (< 0: a free start). BACK [n, d, states >> BITS]:
    back pointers (scratch)."""
    S: tl.constexpr = 1 << STATE_BITS
    FAN: tl.constexpr = 1 << BITS
    LOWS: tl.constexpr = S >> BITS
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = row < n
    row64 = row.to(tl.int64)
    state = tl.arange(0, S)
    lo = tl.arange(0, LOWS)
    levels = tl.load(LEVELS + state)
    history = tl.load(HISTORY + row, mask=live, other=-1)
    held = (history[:, None] < 0) | ((state[None, :] & (LOWS - 1)) == history[:, None])
    cost = tl.where(held, 0.0, float("inf"))
    for i in range(0, d):
        x = tl.load(T + row64 * d + i, mask=live, other=0.0)
        by_high = tl.reshape(cost, [ROWS, FAN, LOWS])
        best = tl.min(by_high, axis=1)
        arg = tl.argmin(by_high, axis=1)
        tl.store(BACK + (row64[:, None] * d + i) * LOWS + lo[None, :], arg.to(tl.uint8), mask=live[:, None])
        e = x[:, None] - levels[None, :]
        err = e * e
        cost = tl.reshape(tl.broadcast_to(best[:, :, None], [ROWS, LOWS, FAN]), [ROWS, S]) + err
    cost = tl.where(held, cost, float("inf"))
    last = tl.argmin(cost, axis=1).to(tl.int64)
    tl.debug_barrier()  # the back pointers other threads stored
    for j in range(0, d):
        i = d - 1 - j
        tl.store(SYM + row64 * d + i, (last & (FAN - 1)).to(tl.uint8), mask=live)
        high = tl.load(BACK + (row64 * d + i) * LOWS + (last >> BITS), mask=live, other=0).to(tl.int64)
        last = (high << (STATE_BITS - BITS)) | (last >> BITS)


def viterbi_triton(t: Tensor, levels: Tensor, bits: int, history: Tensor | None = None) -> Tensor:
    """:func:`tqindex.trellis.viterbi_reference` by the kernel of the module notes: float32 targets t [N, d] on a
    CUDA device (or the CPU under TRITON_INTERPRET=1), history [N] or None -> symbols [N, d] int64 (the same)."""
    rows, table = t.float().contiguous(), levels.float().contiguous()
    n, d = rows.shape
    if history is None:
        history = torch.full((n,), -1, dtype=torch.int64, device=rows.device)
    back = torch.empty(n, d, len(table) >> bits, dtype=torch.uint8, device=rows.device)
    out = torch.empty(n, d, dtype=torch.uint8, device=rows.device)
    if n:
        _search_kernel[(cdiv(n, ROWS),)](rows, table, history.contiguous(), back, out, n, d, ROWS=ROWS, BITS=bits,
                                         STATE_BITS=len(table).bit_length() - 1, num_warps=4, enable_fp_fusion=False)
    return out.long()
