"""Compiled tail-biting trellis search (``csrc/trellis.c``). Reference:
:func:`tqindex.trellis.tail_biting`."""

from __future__ import annotations

import torch
from torch import Tensor

from . import native


def tail_biting_native(t: Tensor, levels: Tensor, bits: int) -> Tensor:
    """:func:`tqindex.trellis.tail_biting` for float32 CPU targets t [N, d] by the compiled kernel
    (the same symbols), rows split over torch's thread count: -> symbols [N, d] int64."""
    rows = t.float().contiguous()
    table = levels.float().contiguous()
    n, d = rows.shape
    out = torch.empty(n, d, dtype=torch.uint8)
    lib = native.require()
    state_bits = len(table).bit_length() - 1

    def call(a: int, b: int) -> int:
        return lib.tq_trellis_tail_biting(rows[a:].data_ptr(), b - a, d, table.data_ptr(), state_bits, bits,
                                          out[a:].data_ptr())

    status = native.parallel(call, native.row_jobs(n, d * len(table)))
    if 1 in status:
        raise ValueError(f"trellis search: {len(table)} levels, {bits}-bit symbols and dim {d} do not make a trellis")
    return out.long()
