"""Compiled CPU encoding (``csrc/quantize.c``, ``csrc/packing.c``): direction codes in one pass per row, and
bit packing. References: :func:`tqindex.directions.encode_directions_reference`,
:func:`tqindex.packing.pack_reference`."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..packing import packed_size
from . import native


def encode_directions_native(x: Tensor, rotation: Any, runs: Sequence[Any], alphas: Tensor,
                             simd: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`tqindex.directions.encode_directions` for float32 CPU rows x [N, d] and runs of symmetric
    codebooks (``CodeRun``) by the compiled kernel: rotation (unless it is a large-dim Hadamard, which torch
    applies first), norm, direction search and packing per row, rows split over torch's thread count;
    ``simd=False`` runs the kernel's portable loops."""
    matrix = rotation.matmul_matrix
    if matrix is not None:
        matrix = matrix.float().contiguous()  # referenced here until the kernel has returned
    elif rotation.kind != "none":
        x = rotation.apply(x)
    x, alphas = x.contiguous(), alphas.float().contiguous()
    seg_len = torch.tensor([r.width for r in runs], dtype=torch.int64)
    seg_h = torch.tensor([0 if r.centroids is None else len(r.centroids) // 2 for r in runs], dtype=torch.int64)
    levels, bounds = torch.zeros(len(runs), 8), torch.zeros(len(runs), 8)
    for i, (_, c, b) in enumerate(runs):  # the positive halves
        if c is not None:
            h = len(c) // 2
            levels[i, :h], bounds[i, : h - 1] = c[h:].float().cpu(), b[h:].float().cpu()
    n, d = x.shape
    row_bytes = sum(r.nbytes for r in runs)
    qdata = torch.empty(n, row_bytes, dtype=torch.uint8)
    norm, dot, sq = torch.empty(n), torch.empty(n), torch.empty(n)
    rot = 0 if matrix is None else matrix.data_ptr()
    lib = native.require()

    def call(a: int, b: int) -> int:
        return lib.tq_encode_directions(x[a:].data_ptr(), b - a, d, rot, alphas.data_ptr(), len(alphas), len(runs),
                                        seg_len.data_ptr(), seg_h.data_ptr(), levels.data_ptr(), bounds.data_ptr(),
                                        qdata[a:].data_ptr(), row_bytes, norm[a:].data_ptr(), dot[a:].data_ptr(),
                                        sq[a:].data_ptr(), int(simd))

    if -1 in native.parallel(call, native.row_jobs(n, d)):
        raise ValueError("encode_directions: runs do not cover the columns or a codebook is not 2^bits levels")
    return qdata, norm, dot, sq


def pack_native(codes: Tensor, bits: int) -> Tensor:
    """:func:`tqindex.packing.pack` of uint8 CPU codes [..., dim] (bits 1, 2, 3, 4) by the compiled kernel,
    rows split over torch's thread count."""
    rows = codes.reshape(-1, codes.shape[-1]).contiguous()
    out = torch.empty(len(rows), packed_size(codes.shape[-1], bits), dtype=torch.uint8)
    lib = native.require()
    native.parallel(lambda a, b: lib.tq_pack(rows[a:].data_ptr(), b - a, rows.shape[1], bits, out[a:].data_ptr()),
                    native.row_jobs(*rows.shape))
    return out.reshape(*codes.shape[:-1], out.shape[-1])
