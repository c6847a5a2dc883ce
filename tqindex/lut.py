"""Byte lookup-table scan: TurboQuant Q_mse scores of a few queries without decoding the database.

For :class:`TurboQuantMSE` with 1, 2 or 4 bits (and :class:`TurboQuantPCA`, whose groups of 1, 2 or
4 bits are runs of whole bytes) a packed byte holds whole codes, and the rotated reconstruction is
``s · c[idx]``. So for each query and each packed byte position p a 256-entry
table ``T[p][v] = Σ_i c[code_i(v)] · (R q)[p·(8/b) + i]`` gives the partial inner product of byte
value v, and ``<R q, R x̂> = s · Σ_p T[p][qdata[p]]``: one table lookup per byte instead of a decode
of every coordinate. The lookups run as one ``embedding_bag`` (sum) over int32 indices.

A byte's table is the sum of the tables of its two 4-bit nibbles (:meth:`LookupTables.nibble_tables`),
which the compiled scan (``fastscan.py``) uses directly. It also reads 3-bit codes (8 codes in 3 bytes,
so no byte holds whole codes); they have no byte tables. Their exact nibble tables take one code per
nibble (8 of 16 entries in use). The compiled scan's first, approximate stage reads them in a split
layout with fewer nibbles (``scan_runs``): with code ``2t + l`` and the additive approximation
``c[2t + l] ≈ A[t] + (l - 1/2)·D`` (A[t] = the mean of levels 2t and 2t + 1, D = the mean step between
them), ``ceil(d/2)`` nibbles hold the ``t`` of two coordinates each and ``ceil(d/4)`` nibbles the ``l``
of four, 3/4 of the lookups; the candidates it keeps are re-scored with the exact tables.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .codes import Codes
from .packing import unpack

LUT_BITS = (1, 2, 4)
STREAM_BITS = 3
"""Codes of this width have nibble tables only (when they are the encoder's one run)."""


class NibbleRun(NamedTuple):
    """How one run of codes fills nibbles: coordinates [start, start + width), ``per_nibble`` codes in each of
    ``nibbles`` nibbles, and the levels [16, per_nibble] of the codes of every nibble value."""

    start: int
    width: int
    per_nibble: int
    nibbles: int
    levels: Tensor


def lut_supported(runs: Sequence, nibbles: bool = False) -> bool:
    """True when :class:`LookupTables` can score codes of these runs (``tqindex.directions.CodeRun``) by
    byte tables: runs of 1, 2 or 4 bits (or 0, stored as nothing). With ``nibbles``: by nibble tables,
    which also serve one run of 3-bit codes."""
    widths = [r.bits for r in runs]
    return all(w in LUT_BITS or w == 0 for w in widths) or (nibbles and widths == [STREAM_BITS])


def lut_scores(runs: Sequence, qr: Tensor, codes: Codes) -> Tensor:
    """``encoder.score_prepared(qr, codes)`` by table lookup for an encoder with these code runs.

    qr: [m, dim] float32 rotated queries (``encoder.prepare_queries``); codes: Codes [n] on the same
    device. Returns [m, n] float32.
    """
    lut = LookupTables(runs, qr.shape[-1], qr.device)
    return lut.scan(lut.tables(qr), codes)


class LookupTables:
    """Builds per-query byte tables for codes of one set of runs and scores codes with them."""

    def __init__(self, runs: Sequence, dim: int, device: torch.device | str = "cpu") -> None:
        if not lut_supported(runs, nibbles=True):
            raise ValueError(f"lookup tables need codes of {LUT_BITS} bits per coordinate, or {STREAM_BITS} in "
                             f"one run, got runs of {[r.bits for r in runs]} bits")
        self.dim = dim
        self.runs: list[NibbleRun] = []
        # 4: every nibble holds whole codes; 3: one run of 3-bit codes (a bit stream), one per nibble read
        self.code_bits = STREAM_BITS if [r.bits for r in runs] == [STREAM_BITS] else 4
        start = 0
        for run in runs:
            if run.bits:
                per_nibble = max(1, 4 // run.bits)
                nibbles = unpack(torch.arange(16, dtype=torch.uint8, device=device)[:, None], run.bits, per_nibble)
                self.runs.append(NibbleRun(start, run.width, per_nibble, 2 * -(-run.width // (2 * per_nibble)),
                                           run.centroids.to(device)[nibbles.int()]))
            start += run.width
        # P: nibble-packed bytes per vector (more than stored for 3 bits)
        self.nbytes = sum(r.nibbles for r in self.runs) // 2
        # the runs of the compiled scan's approximate stage, and its bytes per row
        self.scan_runs = self._split_runs(runs) if self.code_bits == STREAM_BITS else self.runs
        self.scan_nbytes = -(-sum(r.nibbles for r in self.scan_runs) // 2)
        self.offsets = torch.arange(0, 256 * self.nbytes, 256, dtype=torch.int32, device=device)  # [P]
        self.sq_tables = self._bytes(self.nibble_tables(None)[None])  # [P, 256, 1]: sums of c² (1/2/4 bits)

    def _split_runs(self, runs: Sequence) -> list[NibbleRun]:
        """The split layout of 3-bit codes (module docstring): pair nibbles, then low-bit nibbles."""
        (n, c, _), = runs
        pairs = c.to(self.runs[0].levels.device).float().reshape(4, 2)  # [t, l]
        a, d = pairs.mean(1), (pairs[:, 1] - pairs[:, 0]).mean()
        v = torch.arange(16, device=a.device)
        shifts = torch.arange(4, device=a.device)
        low = (((v[:, None] >> shifts) & 1) - 0.5) * d  # [16, 4]
        return [NibbleRun(0, n, 2, -(-n // 2), a[torch.stack((v & 3, v >> 2), 1)]), NibbleRun(0, n, 4, -(-n // 4), low)]

    def nibble_tables(self, q: Tensor | None, scan: bool = False) -> Tensor:
        """Nibble tables of rotated queries q [m, dim] -> [m, 2P, 16]: entry ``[i, t, v]`` is the partial
        inner product of q[i] with the codes of nibble value v at nibble t (t = 2p: low nibble of byte p,
        2p + 1: high nibble). ``q=None`` gives the partial sums of ``c²`` ([2P, 16]). Coordinates past
        a run's end (the padding of its last byte) get zero weight. ``scan``: the tables of
        ``scan_runs`` instead ([m, 2 scan_nbytes, 16]; for 3-bit codes the approximate split layout)."""
        parts = []
        for start, n, per_nibble, nibbles, levels in self.scan_runs if scan else self.runs:
            lv = levels if q is not None else levels.square()
            w = q[:, start : start + n] if q is not None else torch.ones(1, n, device=levels.device)
            w = F.pad(w, (0, nibbles * per_nibble - n)).reshape(len(w), -1, per_nibble)
            parts.append(w @ lv.T)  # [m, nibbles, 16]
        t = torch.cat(parts, 1)
        if t.shape[1] % 2:  # a last, empty nibble completes the byte
            t = F.pad(t, (0, 0, 0, 1))
        return t if q is not None else t[0]

    def tables(self, qr: Tensor, sqnorm: bool = False) -> Tensor:
        """Byte tables [P·256, m] float32 of rotated queries qr [m, dim]: row ``p·256 + v`` holds byte
        value v's partial inner product at byte position p.

        With ``sqnorm`` a last column (-> [P·256, m + 1]) holds the partial sums of ``c²`` (for
        ``||x̂||²``). ValueError for 3-bit codes (no byte holds whole codes).
        """
        if self.code_bits == STREAM_BITS:
            raise ValueError("byte tables need 1, 2 or 4-bit codes: a byte of 3-bit codes holds parts of codes")
        t = self._bytes(self.nibble_tables(qr.float()))  # [P, 256, m]
        if sqnorm:
            t = torch.cat((t, self.sq_tables), -1)
        return t.reshape(self.nbytes * 256, -1)

    def _bytes(self, nib: Tensor) -> Tensor:
        """Nibble tables [m, 2P, 16] -> byte tables [P, 256, m] (byte v = low nibble v & 15, high v >> 4),
        written row-major (no transpose copy)."""
        nib = nib.reshape(len(nib), self.nbytes, 2, 16).permute(1, 2, 3, 0)  # [P, 2, 16, m]
        out = nib.new_empty(self.nbytes, 16, 16, nib.shape[-1])  # plain strides, also for m = 1
        torch.add(nib[:, 1, :, None], nib[:, 0, None, :], out=out)
        return out.reshape(self.nbytes, 256, -1)

    def scan(self, tables: Tensor, codes: Codes, sqnorm: bool = False) -> Tensor:
        """Scores [m, n] float32 of Codes [n] from :meth:`tables`: ``<R q, R x̂>``, or with ``sqnorm``
        (tables built with ``sqnorm=True``) ``<R q, R x̂> - ||x̂||²``."""
        if not isinstance(codes, Codes) or codes.qdata.dim() != 2 or codes.qdata.shape[-1] != self.nbytes:
            got = tuple(codes.qdata.shape) if isinstance(codes, Codes) else type(codes).__name__
            raise ValueError(f"codes must be Codes [n] with {self.nbytes} code bytes per vector, got qdata {got}")
        sums = F.embedding_bag(codes.qdata + self.offsets, tables, mode="sum")  # int32 [n, P] -> [n, m(+1)]
        s = codes.norm.float()[:, None]  # [n, 1]
        if sqnorm:
            return (sums[:, :-1] * s - sums[:, -1:] * s.square()).T.contiguous()
        return (sums * s).T.contiguous()
