"""Byte lookup-table scan: TurboQuant Q_mse scores of a few queries without decoding the database.

For :class:`TurboQuantMSE` with 1, 2 or 4 bits a packed byte holds whole codes, and the rotated
reconstruction is ``s · c[idx]``. So for each query and each packed byte position p a 256-entry
table ``T[p][v] = Σ_i c[code_i(v)] · (R q)[p·(8/b) + i]`` gives the partial inner product of byte
value v, and ``<R q, R x̂> = s · Σ_p T[p][qdata[p]]``: one table lookup per byte instead of a decode
of every coordinate. The lookups run as one ``embedding_bag`` (sum) over int32 indices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .codes import Codes
from .encoder import Encoder
from .turboquant import TurboQuantMSE

LUT_BITS = (1, 2, 4)


def lut_supported(encoder: Encoder) -> bool:
    """True when :func:`lut_scores` can score ``encoder``'s codes (TurboQuantMSE with 1, 2 or 4 bits)."""
    return isinstance(encoder, TurboQuantMSE) and encoder.bits in LUT_BITS


def lut_scores(encoder: TurboQuantMSE, qr: Tensor, codes: Codes) -> Tensor:
    """``encoder.score_prepared(qr, codes)`` by table lookup.

    qr: [m, dim] float32 rotated queries (``encoder.prepare_queries``); codes: Codes [n] on the same
    device. Returns [m, n] float32.
    """
    return lut_scan(lut_tables(encoder, qr), codes)


def lut_tables(encoder: TurboQuantMSE, qr: Tensor, sqnorm: bool = False) -> Tensor:
    """Tables [P·256, m] float32 of rotated queries qr [m, dim]: row ``p·256 + v`` holds byte value
    v's partial inner product at byte position p (P = packed bytes per vector).

    With ``sqnorm`` a last column [P·256, m + 1] holds the partial sums of ``c²`` (for ``||x̂||²``).
    Coordinates past ``dim`` (the padding of the last byte) get zero weight.
    """
    if not lut_supported(encoder):
        raise ValueError(f"lookup tables need TurboQuantMSE with bits in {LUT_BITS}, got {encoder!r}")
    bits = encoder.bits
    per_byte = 8 // bits
    values = torch.arange(256, device=qr.device)
    idx = torch.stack([(values >> (bits * i)) & ((1 << bits) - 1) for i in range(per_byte)], -1)
    levels = encoder.tensors()["centroids"].to(qr.device)[idx]  # [256, per_byte]
    nbytes = -(-encoder.dim // per_byte)
    pad = (0, nbytes * per_byte - encoder.dim)
    q = F.pad(qr.float(), pad).reshape(-1, nbytes, per_byte).permute(1, 2, 0)  # [P, per_byte, m]
    tables = torch.matmul(levels, q)  # [P, 256, m]
    if sqnorm:
        ones = F.pad(torch.ones(encoder.dim, device=qr.device), pad).reshape(nbytes, per_byte, 1)
        tables = torch.cat((tables, torch.matmul(levels.square(), ones)), -1)  # [P, 256, m + 1]
    return tables.reshape(nbytes * 256, -1)


def lut_scan(tables: Tensor, codes: Codes, sqnorm: bool = False) -> Tensor:
    """Scores [m, n] float32 of Codes [n] from :func:`lut_tables`: ``<R q, R x̂>``, or with ``sqnorm``
    (tables built with ``sqnorm=True``) ``<R q, R x̂> - ||x̂||²``."""
    nbytes = tables.shape[0] // 256
    if not isinstance(codes, Codes) or codes.qdata.dim() != 2 or codes.qdata.shape[-1] != nbytes:
        got = tuple(codes.qdata.shape) if isinstance(codes, Codes) else type(codes).__name__
        raise ValueError(f"codes must be Codes [n] with {nbytes} code bytes per vector, got qdata {got}")
    offsets = torch.arange(0, 256 * nbytes, 256, dtype=torch.int32, device=codes.device)
    sums = F.embedding_bag(codes.qdata + offsets, tables, mode="sum")  # int32 [n, P] indices -> [n, m (+1)]
    s = codes.norm.float()[:, None]  # [n, 1]
    if sqnorm:
        return (sums[:, :-1] * s - sums[:, -1:] * s.square()).T.contiguous()
    return (sums * s).T.contiguous()
