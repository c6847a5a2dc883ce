"""Scorers: an encoder's codes scored against a fixed set of prepared queries, into a running top-k.

An encoder hands out its scorer (``encoder.scorer(qs, l2, backend)``); indexes and the KV cache never
look inside codes. The queries ``qs`` [m, dim] are rotated (``encoder.rotate``), and doubled for "l2",
where a code scores ``2<q, x̂> - ||x̂||² = ||q||² - ||q - x̂||²`` (larger is better everywhere).

Every scorer computes what :meth:`Scorer.scores` computes by definition, ``qs @ decode_rotated(codes).mT``
(minus ``||x̂||²`` for "l2"): :class:`DecodeScorer` does exactly that in tiles (PyTorch, any device, any
encoder), :class:`TableScorer` by byte lookup tables for a few queries, and the compiled scorers
(``kernels/fastscan.py`` on the CPU, ``kernels/scan_triton.py`` on GPUs) fuse the scan with the top-k.
:func:`direction_scorer` picks one for direction codes (``tqindex.directions``) through ``kernels.select``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from . import kernels
from .codes import Codes
from .lut import LookupTables, lut_supported
from .topk import TopK

TILE_BYTES = 4 << 20
"""Target size of one [queries, block] float32 score tile (small enough to stay in cache)."""
DECODE_ELEMENTS = 1 << 20
"""At most this many coordinates (block rows x dim) are decoded at once."""
MIN_TILE = 256
QUERY_CHUNK = TILE_BYTES // (4 * MIN_TILE)
"""Query rows scored together by the decoding scans (more are scored chunk by chunk: bounded memory)."""
LUT_MAX_QUERIES = 32
"""Up to this many queries, lookup tables replace decode-and-GEMM where the encoder allows."""

CodeRunList = Sequence[tuple[Codes | None, Tensor | int]]
"""Lists of codes as :meth:`Scorer.push_lists` reads them: (codes [n_l] or None when empty, labels: int64
[n_l], or the int label of row 0 with one more per row)."""


def _labels(labels: Tensor | int, start: int, stop: int, device: torch.device) -> Tensor:
    """Labels of code rows [start, stop): int64 [stop - start]."""
    if isinstance(labels, int):
        return torch.arange(labels + start, labels + stop, device=device)
    return labels[start:stop]


class Scorer:
    """Scores codes of one encoder for prepared queries qs [m, dim] (module notes) into a :class:`TopK`.

    ``bar``: a progress bar advanced by the (query, code) pairs scored.
    """

    #: a scan over few query rows (at most LUT_MAX_QUERIES) scores all of them at once
    few_queries = LUT_MAX_QUERIES

    def __init__(self, encoder: Any, qs: Tensor, l2: bool, bar: Any = None) -> None:
        self.encoder, self.qs, self.l2, self.bar = encoder, qs, l2, bar

    @property
    def m(self) -> int:
        """Query rows."""
        return self.qs.shape[0]

    def _advance(self, pairs: int) -> None:
        if self.bar is not None:
            self.bar.update(pairs)

    def scores(self, codes: Codes) -> Tensor:
        """Scores [m, n] float32 of every query row for Codes [n] (the definition of every scan)."""
        return self._scores(self.qs, codes)

    def _scores(self, qs: Tensor, codes: Codes) -> Tensor:
        xr = self.encoder.decode_rotated(codes)  # [n, dim]
        return torch.addmm(xr.square().sum(1).neg_(), qs, xr.mT) if self.l2 else qs @ xr.mT

    def push(self, codes: Codes, labels: Tensor | int, top: TopK, rows: Tensor | None = None,
             offset: Tensor | None = None, shift: Tensor | None = None) -> None:
        """Merge the scores of codes [n] (row i labelled ``labels[i]``, or ``labels + i``) into ``top``:
        query rows ``rows`` (int64 [r]; all when None) into the top-k rows of the same numbers, their
        scores plus ``offset`` [r]; ``shift`` [dim] is subtracted from those queries first."""
        raise NotImplementedError

    def push_lists(self, lists: CodeRunList, probes: Tensor, top: TopK, offsets: Tensor | None = None,
                   shifts: Tensor | None = None) -> None:
        """Merge several code lists (IVF) into ``top``: query i scans the lists ``probes[i]`` (int64 [m, p],
        distinct per row), its scores of list ``probes[i, j]`` plus ``offsets[i, j]`` (float32 [m, p]) and
        its query shifted by ``shifts[l]`` (float32 [nlists, dim]) for list l, when given.

        Here a PyTorch strategy: few queries scan the union of their lists together (pairs that were not
        probed masked out), more queries scan list by list with the queries that probe each."""
        if self.m <= self.few_queries and shifts is None:
            self._push_together(lists, probes, top, offsets)
            return
        nprobe = probes.shape[1]
        order = torch.argsort(probes.reshape(-1), stable=True)  # (query, list) pairs grouped by list
        nos, counts = torch.unique_consecutive(probes.reshape(-1)[order], return_counts=True)
        rows, split = order // nprobe, counts.tolist()  # the queries of each list, ascending
        offs = [None] * len(split) if offsets is None else offsets.reshape(-1)[order].split(split)
        for no, list_rows, offset in zip(nos.tolist(), rows.split(split), offs):
            codes, labels = lists[no]
            if codes is not None and len(codes):
                self.push(codes, labels, top, list_rows, offset, None if shifts is None else shifts[no])

    def _push_together(self, lists: CodeRunList, probes: Tensor, top: TopK, offsets: Tensor | None) -> None:
        """Few queries: the probed lists scored together, DECODE_ELEMENTS coordinates at a time, for all
        query rows; a (query, list) pair that was not probed gets -inf (not in the results)."""
        device = self.qs.device
        probed = torch.unique(probes)  # sorted list numbers
        add = torch.full((self.m, len(probed)), -math.inf, device=device)  # [m, probed]: score offset per pair
        add.scatter_(1, torch.searchsorted(probed, probes), torch.zeros_like(probes, dtype=add.dtype)
                     if offsets is None else offsets.to(add.dtype))
        chunk, group, total = max(1, DECODE_ELEMENTS // self.encoder.dim), [], 0
        probed_list = probed.tolist()
        for j, no in enumerate(probed_list):
            codes, labels = lists[no]
            if codes is not None and len(codes):
                group.append((j, codes, _labels(labels, 0, len(codes), device)))
                total += len(codes)
            if group and (total >= chunk or j == len(probed_list) - 1):
                js, codes, labels = zip(*group)
                cols = torch.repeat_interleave(torch.tensor(js, device=device),
                                               torch.tensor([len(c) for c in codes], device=device))
                top.push(self.scores(Codes.cat(list(codes))) + add[:, cols], torch.cat(labels))
                self._advance(self.m * total)
                group, total = [], 0


class DecodeScorer(Scorer):
    """The reference scan (PyTorch, any device): codes decoded DECODE_ELEMENTS coordinates at a time and
    multiplied with the queries in [r, TILE_BYTES / 4r] score tiles, each tile pushed into the top-k."""

    def push(self, codes: Codes, labels: Tensor | int, top: TopK, rows: Tensor | None = None,
             offset: Tensor | None = None, shift: Tensor | None = None) -> None:
        qs = self.qs if rows is None else self.qs[rows]
        if shift is not None:
            qs = qs - shift
        for q0 in range(0, len(qs), QUERY_CHUNK):  # bounded tiles
            q1 = min(q0 + QUERY_CHUNK, len(qs))
            sub = (None if rows is None and q1 - q0 == len(qs) else
                   torch.arange(q0, q1, device=qs.device) if rows is None else rows[q0:q1])
            self._push_rows(qs[q0:q1], codes, labels, top, sub, None if offset is None else offset[q0:q1])

    def _push_rows(self, qs: Tensor, codes: Codes, labels: Tensor | int, top: TopK, rows: Tensor | None,
                   offset: Tensor | None, block_scores: Any = None) -> None:
        """Scan codes for query rows qs (heap rows ``rows``); ``block_scores(block)`` -> [len(qs), b], when
        given, replaces the tiles of decoded codes."""
        m, n = len(qs), len(codes)
        chunk = max(1, DECODE_ELEMENTS // self.encoder.dim)
        tile = max(MIN_TILE, TILE_BYTES // (4 * m) // 64 * 64)  # BLAS-friendly widths
        for i in range(0, n, chunk):
            block = codes if n <= chunk else codes[i : i + chunk]
            lab = _labels(labels, i, i + len(block), qs.device)
            if block_scores is not None:
                top.push(block_scores(block), lab, rows, offset)
            else:
                xr = self.encoder.decode_rotated(block)  # [b, dim]
                bias = xr.square().sum(1).neg_() if self.l2 else None  # -||x̂||²
                for j in range(0, len(xr), tile):
                    x = xr[j : j + tile].mT  # [dim, t]
                    s = qs @ x if bias is None else torch.addmm(bias[j : j + tile], qs, x)
                    top.push(s, lab[j : j + tile], rows, offset)
            self._advance(m * len(block))


class TableScorer(DecodeScorer):
    """:class:`DecodeScorer` with byte lookup tables (``lut.py``) for up to LUT_MAX_QUERIES query rows:
    one table lookup per code byte instead of a decode of every coordinate."""

    def __init__(self, encoder: Any, qs: Tensor, l2: bool, bar: Any = None) -> None:
        super().__init__(encoder, qs, l2, bar)
        self.lut = LookupTables(encoder.code_runs(qs.device), encoder.dim, qs.device)
        self._all = self.lut.tables(qs, l2) if self.m <= LUT_MAX_QUERIES else None  # every query row's tables

    def scores(self, codes: Codes) -> Tensor:
        if self._all is not None:
            return self.lut.scan(self._all, codes, self.l2)
        return super().scores(codes)

    def push(self, codes: Codes, labels: Tensor | int, top: TopK, rows: Tensor | None = None,
             offset: Tensor | None = None, shift: Tensor | None = None) -> None:
        qs = self.qs if rows is None else self.qs[rows]
        if shift is not None:
            qs = qs - shift
        if len(qs) > LUT_MAX_QUERIES:
            super().push(codes, labels, top, rows, offset, shift)
            return
        if self._all is not None and shift is None:  # the rows of every query row's scores
            scan = lambda block: self.lut.scan(self._all, block, self.l2) if rows is None else (  # noqa: E731
                self.lut.scan(self._all, block, self.l2)[rows])
        else:
            tables = self.lut.tables(qs, self.l2)
            scan = lambda block: self.lut.scan(tables, block, self.l2)  # noqa: E731
        self._push_rows(qs, codes, labels, top, rows, offset, scan)


def direction_scorer(encoder: Any, qs: Tensor, l2: bool, backend: str | None, shifted: bool, bar: Any) -> Scorer:
    """The scorer of direction codes (TurboQuantMSE, TurboQuantPCA): the GPU scan (triton), the compiled
    nibble scan (native: runs of 1/2/3/4 bits, unshifted queries) or, in PyTorch, byte tables for few
    queries where every run has 1, 2 or 4 bits, else decode-and-GEMM."""
    what = f"scans of {type(encoder).__name__} codes"
    runs = encoder.code_runs(qs.device)
    compiled = () if shifted else ("triton",) + (("native",) if lut_supported(runs, nibbles=True) else ())
    chosen = kernels.select(qs, encoder._backend(backend), compiled, what)
    if chosen == "native":
        from .kernels.fastscan import NativeScorer  # it imports this module

        return NativeScorer(encoder, qs, l2, bar)
    if chosen == "triton":
        from .kernels.scan_triton import TritonScorer  # imports triton

        return TritonScorer(encoder, qs, l2, bar)
    if lut_supported(runs) and len(qs) <= LUT_MAX_QUERIES:
        return TableScorer(encoder, qs, l2, bar)
    return DecodeScorer(encoder, qs, l2, bar)
