"""Compiled nibble lookup-table scan of 1/2/3/4-bit codes (TurboQuantMSE, TurboQuantPCA; ``csrc/fastscan.c``).

Each 4-bit nibble of a packed code row holds whole codes, so a query's score is ``s · Σ_t T[t][nibble_t]``
over the row's 2·P nibbles (:meth:`LookupTables.nibble_tables`). Rows of 3-bit codes (the index keeps
3 bits per code) are scored exactly by pairs of codes (64-entry tables summed from the nibble tables),
and expanded in the kernel to the split layout of :mod:`tqindex.lut` (3/4 of the nibbles, approximate)
for the first stage. The kernel builds
these float tables from the rotated queries itself (:func:`table_layout` says how;
:func:`compiled_nibble_tables` runs that step alone), turns the first stage's into uint8 tables plus a
per-query affine map (:func:`quantize_tables` is the reference of that rule), sums 32 rows at a time
with byte shuffles (AVX2; a portable C loop elsewhere gives the same integers), keeps ``depth``
approximate candidates per query, re-scores them exactly with the float tables and merges them into a
:class:`~tqindex.index.TopK` (an empty heap row gets its best k in ascending order, so a search of one
run needs no heap sort). Work is split over ``torch.get_num_threads()`` threads (by queries, or by rows
for a few queries). :meth:`FastScan.run_lists` scans IVF lists in one call: each query's candidates from
all the lists it probes share one reservoir and are re-scored once; :func:`top_columns` (its top-nprobe
lists) and :func:`group_pairs` (the (query, list) pairs by list) prepare that call.

The kernel is built by ``pip install`` when a C compiler is present (``native.py``); :class:`NativeScorer`
is the scorer of direction codes that uses it (``tqindex.scorer.direction_scorer`` picks it).
:func:`reference_scores` is the numpy reference of the approximate scores over the rows
:func:`reference_rows` gives (:func:`kernel_candidates` runs that stage alone).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from ..codes import Codes
from ..lut import LookupTables
from ..packing import unpack
from ..scorer import CodeRunList, Scorer
from ..topk import HeapTopK
from . import native

if TYPE_CHECKING:
    from ..topk import TopK


def simd() -> bool:
    """True when the kernel's AVX2 path serves this CPU (else a portable loop with equal sums)."""
    return native.available() and bool(native.require().tq_fastscan_simd())


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


MIN_THREAD_SCORES = 1 << 16
"""A scan uses another thread only for at least this many more (row, query) scores."""
JOBS_PER_THREAD = 4
"""A flat scan splits the queries into up to this many jobs per thread (of at least MIN_JOB_QUERIES),
which the threads take in turn: a thread slowed by other work takes fewer."""
MIN_JOB_QUERIES = 64
LIST_ROW_BITS = 32
"""A list scanned by :meth:`FastScan.run_lists` holds fewer than 2**LIST_ROW_BITS rows."""
FAST_TABLE_BYTES = 32 << 20
"""Queries are scanned in chunks whose tables take at most this many bytes."""
TABLE_MAX = 127
"""Largest quantized table entry: a byte's two lookups then add in 8 bits without overflow."""


def quantize_tables(tables: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Float tables [m, T, 16] -> (uint8 tables [m, T, 16] in [0, TABLE_MAX], mul [m], add [m]) with
    ``Σ_t tables[i, t, v_t] ≈ mul[i] · Σ_t u8[i, t, v_t] + add[i]`` (each entry off by at most mul/2).
    The PyTorch reference of :func:`compiled_quantize_tables`."""
    low = tables.amin(-1, keepdim=True)  # [m, T, 1]
    span = tables - low
    mul = span.amax(dim=(1, 2)) / TABLE_MAX  # [m]
    mul = torch.where(mul > 0, mul, torch.ones_like(mul))
    u8 = span.mul_((1 / mul)[:, None, None]).round_().clamp_(0, TABLE_MAX).to(torch.uint8)
    return u8, mul, low.sum((1, 2))


SLOTS = 4
"""Codes one nibble holds at most (1-bit codes)."""


def table_layout(lut: LookupTables) -> tuple[Tensor, Tensor, Tensor]:
    """How the kernel builds ``lut``'s nibble tables from rotated queries q [dim]: (coord int32 [T, SLOTS],
    bank_of int32 [T], bank float32 [banks, SLOTS, 16]) with ``T[t][v] = Σ_j q[coord[t, j]] ·
    bank[bank_of[t], j, v]``; ``coord = dim`` stands for no coordinate (a slot past the codes a nibble
    holds, or past its run's end). The T = 2P rows of the exact tables come first, then for 3-bit codes
    the 2 ``scan_nbytes`` rows of the approximate stage (``lut.nibble_tables(q, scan=True)``)."""
    coord, bank_of, bank = [], [], []
    for runs in [lut.runs] + ([lut.scan_runs] if lut.scan_runs is not lut.runs else []):
        for start, n, per_nibble, nibbles, levels in runs:
            local = torch.arange(nibbles)[:, None] * per_nibble + torch.arange(SLOTS)  # [nibbles, SLOTS]
            used = (torch.arange(SLOTS) < per_nibble) & (local < n)
            coord.append(torch.where(used, local + start, lut.dim))
            bank_of.append(torch.full((nibbles,), len(bank)))
            b = torch.zeros(SLOTS, 16)
            b[:per_nibble] = levels.T.float().cpu()  # levels [16, per_nibble]
            bank.append(b)
        if sum(r.nibbles for r in runs) % 2:  # the empty nibble that completes the last byte
            coord.append(torch.full((1, SLOTS), lut.dim))
            bank_of.append(torch.zeros(1, dtype=torch.int64))
    return (torch.cat(coord).int().contiguous(), torch.cat(bank_of).int().contiguous(),
            torch.stack(bank).contiguous())


def compiled_nibble_tables(lut: LookupTables, qs: Tensor) -> Tensor:
    """The float tables [m, T, 16] the kernel builds (``tq_nibble_tables``, inside every scan) for rotated
    queries qs [m, dim]: ``lut.nibble_tables(qs)``, then for 3-bit codes ``lut.nibble_tables(qs, scan=True)``
    (see :func:`table_layout`)."""
    qs = qs.float().contiguous()
    coord, bank_of, bank = table_layout(lut)
    out = torch.empty(qs.shape[0], len(bank_of), 16)
    native.require().tq_nibble_tables(qs.data_ptr(), qs.shape[0], lut.dim, coord.data_ptr(), bank_of.data_ptr(),
                                      bank.data_ptr(), len(bank_of), out.data_ptr())
    return out


def compiled_quantize_tables(tables: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`quantize_tables` as the kernel does it (``tq_quantize_tables``, inside every scan)."""
    tables = tables.float().contiguous()
    m, T = tables.shape[0], tables.shape[1]
    u8, mul, add = torch.empty(m, T, 16, dtype=torch.uint8), torch.empty(m), torch.empty(m)
    native.require().tq_quantize_tables(tables.data_ptr(), m, T, u8.data_ptr(), mul.data_ptr(), add.data_ptr())
    return u8, mul, add


def reference_rows(lut: LookupTables, qdata: Tensor) -> np.ndarray:
    """The nibble rows uint8 [n, scan_nbytes] the kernel's approximate stage reads from the codes qdata
    [n, code bytes] of ``lut``'s encoder: the codes themselves, or for 3-bit codes their split layout
    (:mod:`tqindex.lut`): nibble t < ceil(d/2) holds ``code >> 1`` of coordinates 2t (bits 0-1) and 2t + 1
    (bits 2-3), the next ceil(d/4) hold ``code & 1`` of four coordinates each (bit j: coordinate 4u + j)."""
    if lut.code_bits != 3:
        return qdata.numpy()
    c = unpack(qdata, 3, lut.dim).numpy().astype(np.uint8)  # [n, d]
    pairs = np.pad(c >> 1, ((0, 0), (0, -lut.dim % 2)))
    lows = np.pad(c & 1, ((0, 0), (0, -lut.dim % 4))).reshape(len(c), -1, 4)
    nib = np.concatenate([pairs[:, 0::2] | pairs[:, 1::2] << 2, (lows << np.arange(4, dtype=np.uint8)).sum(-1)], 1)
    nib = np.pad(nib, ((0, 0), (0, nib.shape[1] % 2))).astype(np.uint8)
    return nib[:, 0::2] | nib[:, 1::2] << 4


def reference_scores(rows: np.ndarray, scale: np.ndarray, sqnorm: np.ndarray | None, qtab: np.ndarray,
                     mul: np.ndarray, add: np.ndarray) -> np.ndarray:
    """Numpy reference of the kernel's approximate scores [nq, n] (float64): nibble rows uint8 [n, P]
    (:func:`reference_rows`), scale [n], sqnorm (||c||² of each row, float [n]) or None, quantized tables
    qtab uint8 [nq, 2P, 16] with mul and add [nq]: ``scale · (mul · Σ_p (qtab[2p, lo_p] + qtab[2p+1, hi_p])
    + add) - scale² · sqnorm``."""
    p = np.arange(rows.shape[1])
    lo, hi = (rows & 15).astype(np.int64), (rows >> 4).astype(np.int64)
    t = qtab.astype(np.int64)
    sums = (t[:, 2 * p, lo] + t[:, 2 * p + 1, hi]).sum(-1)  # [nq, n]
    s = scale.astype(np.float64)
    out = s * (mul[:, None] * sums + add[:, None])
    if sqnorm is not None:
        out -= s**2 * sqnorm
    return out


def kernel_candidates(lut: LookupTables, qdata: Tensor, scale: Tensor, sq_table: Tensor | None, qtab: Tensor,
                      mul: Tensor, add: Tensor, depth: int, simd: bool = True) -> tuple[Tensor, Tensor]:
    """The kernel's approximate stage alone: the ``depth`` best approximate scores of the code rows qdata
    uint8 [n, code bytes] of ``lut``'s encoder (scale float32 [n]; sq_table: ``lut.nibble_tables(None)`` for
    "l2" scores, or None) per query, for quantized tables of ``lut.nibble_tables(q, scan=True)`` (qtab uint8
    [m, 2 scan_nbytes, 16], mul and add float32 [m], from :func:`quantize_tables`) -> (scores float32
    [m, depth], rows int64 [m, depth]), best first."""
    lib = native.require()
    qdata, scale, qtab = qdata.contiguous(), scale.float().contiguous(), qtab.contiguous()
    mul, add = mul.float().contiguous(), add.float().contiguous()
    m = qtab.shape[0]
    val, row = torch.empty(m, depth), torch.empty(m, depth, dtype=torch.int64)
    status = lib.tq_fastscan_candidates(
        qdata.data_ptr(), qdata.shape[0], qdata.shape[1], lut.nbytes, lut.code_bits, scale.data_ptr(),
        _ptr(None if sq_table is None else sq_table.contiguous()), m, qtab.data_ptr(), mul.data_ptr(),
        add.data_ptr(), None, depth, val.data_ptr(), row.data_ptr(), int(simd))
    if status != 0:
        raise MemoryError("the scan kernel could not allocate its buffers")
    val, order = torch.sort(val, dim=1, descending=True)
    return val, row.gather(1, order)


def top_columns(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of x float32 [m, n] (1 <= k <= n, no NaN), best first, found by
    the compiled kernel on up to ``torch.get_num_threads()`` threads -> (values float32 [m, k], columns
    int64 [m, k]); of equal values the earlier column comes first. ``torch.topk(x, k)`` is the reference."""
    lib, x = native.require(), x.float().contiguous()
    m, n = x.shape
    val, col = torch.empty(m, k), torch.empty(m, k, dtype=torch.int64)
    threads = max(1, min(torch.get_num_threads(), m * n // MIN_THREAD_SCORES))
    cuts = np.linspace(0, m, threads + 1).astype(int).tolist()

    def call(a: int, b: int) -> int:
        return lib.tq_top_columns(x[a:].data_ptr(), b - a, n, k, val[a:].data_ptr(), col[a:].data_ptr())

    native.parallel(call, [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a], threads)
    return val, col


def group_pairs(lists: Tensor, nl: int) -> tuple[Tensor, Tensor]:
    """The (query, list) pairs of lists int64 [m, p] (query i probes lists[i], distinct numbers < nl) grouped
    by list in one counting pass of the kernel -> (start int64 [nl + 1], queries int64 [m·p]): list l is
    probed by queries[start[l]:start[l + 1]], ascending. The reference is a stable argsort of lists."""
    lists = lists.contiguous()
    start, queries = torch.empty(nl + 1, dtype=torch.int64), torch.empty(lists.numel(), dtype=torch.int64)
    native.require().tq_group_pairs(lists.data_ptr(), lists.shape[0], lists.shape[1], nl, start.data_ptr(),
                                    queries.data_ptr())
    return start, queries


def candidate_depth(k: int, code_bits: int) -> int:
    """Approximate candidates kept per query for an exact top-k: a margin of max(16, k / 2) over k, or of
    max(16, k) for 3-bit codes, whose approximate stage reads the coarser split layout. On GloVe-50 (20k
    and 100k rows, k = 64, 2000 queries) the exact top 64 of these candidates differed from that of
    k + 512 candidates in 0.013 % of places at 4 bits and 0.001 % or less at 1 and 2 bits."""
    return k + max(16, k if code_bits == 3 else k // 2)


def _query_cuts(m: int, threads: int, per_thread: int = JOBS_PER_THREAD) -> list[int]:
    """Where m queries are cut into jobs: one on one thread, else up to ``per_thread`` per thread of at
    least MIN_JOB_QUERIES (and at least one per thread)."""
    jobs = 1 if threads == 1 else max(threads, min(threads * per_thread, m // MIN_JOB_QUERIES))
    return np.linspace(0, m, jobs + 1).astype(int).tolist()


class FastScan:
    """Scores 1/2/3/4-bit codes with the compiled kernel into a running top-k."""

    def __init__(self, lut: LookupTables, simd: bool = True) -> None:
        native.require()
        self.lut, self.simd = lut, simd
        self.sq = lut.nibble_tables(None).contiguous()  # [T, 16] partial sums of c² ("l2" scores)
        self.layout = table_layout(lut)
        # one query's tables in the kernel: float32 (exact, then for 3-bit codes scan tables) + uint8 scan tables
        self.table_bytes = len(self.layout[1]) * 16 * 4 + lut.scan_nbytes * 32

    def run(self, qs: Tensor, codes: Codes, labels: Tensor | int, top: "TopK", rows: Tensor | None, l2: bool,
            offset: Tensor | None = None) -> None:
        """Merge the exact top-k of codes [n] for rotated queries qs [m, dim] (already doubled for "l2")
        into ``top`` (a TopK [*, k]). Row i is labelled ``labels[i]`` (int64 tensor) or ``labels + i``
        (int); query j merges into heap row ``rows[j]`` (j when None), its scores plus ``offset[j]``."""
        n, m = len(codes), qs.shape[0]
        if n == 0 or m == 0:
            return
        lib = native.require()
        qs, (coord, bank_of, bank) = qs.float().contiguous(), self.layout
        qdata, scale = codes.qdata.contiguous(), codes.norm.float().contiguous()
        base, labels = (labels, None) if isinstance(labels, int) else (0, labels.contiguous())
        rows = None if rows is None else rows.contiguous()
        offset = None if offset is None else offset.float().contiguous()
        threads = max(1, min(torch.get_num_threads(), math.ceil(n * m / MIN_THREAD_SCORES)))
        depth, k, sq = candidate_depth(top.k, self.lut.code_bits), top.k, self.sq if l2 else None

        def call(r0: int, r1: int, q0: int, q1: int, heap_rows: Tensor | None, val: Tensor, ids: Tensor) -> int:
            """Rows [r0, r1) against queries [q0, q1), merged into heap rows heap_rows[q0:q1] (val/ids
            rows q0.. when None)."""
            hv, hi = (val, ids) if heap_rows is not None else (val[q0:], ids[q0:])
            return lib.tq_fastscan(
                qdata[r0:].data_ptr(), r1 - r0, qdata.shape[1], self.lut.nbytes, self.lut.code_bits,
                scale[r0:].data_ptr(), _ptr(sq),
                None if labels is None else labels[r0:].data_ptr(), base + r0, q1 - q0, qs[q0:].data_ptr(),
                self.lut.dim, coord.data_ptr(), bank_of.data_ptr(), bank.data_ptr(),
                None if offset is None else offset[q0:].data_ptr(), depth,
                None if heap_rows is None else heap_rows[q0:].data_ptr(), k, hv.data_ptr(), hi.data_ptr(),
                int(self.simd))

        if threads == 1 or m >= threads:  # split the queries, into several jobs per thread when they are many
            cuts = _query_cuts(m, threads)
            status = native.parallel(call, [(0, n, a, b, rows, top.values, top.labels)
                                            for a, b in zip(cuts[:-1], cuts[1:])], threads)
            top.ascending &= not any(status)  # the kernel fills empty heap rows in ascending order
            return
        # few queries: split the rows, one private top-k per part, merged afterwards
        cuts = np.linspace(0, n, threads + 1).astype(int).tolist()
        parts = [(torch.full((m, k), -math.inf), torch.full((m, k), -1, dtype=torch.int64)) for _ in range(threads)]
        native.parallel(call, [(a, b, 0, m, None, v, i) for a, b, (v, i) in zip(cuts[:-1], cuts[1:], parts)])
        merge_rows = torch.arange(m) if rows is None else rows
        for v, i in parts:
            top.merge(v, i, merge_rows)

    def run_lists(self, qs: Tensor, lists: "CodeLists", start: Tensor, queries: Tensor, top: "TopK",
                  l2: bool) -> int:
        """Merge the exact top-k of several code lists (IVF) for rotated queries qs [m, dim] (already
        doubled for "l2") into ``top`` (a TopK [m, k], query j into heap row j). List l is probed by the
        queries ``queries[start[l]:start[l + 1]]`` (int64, ascending). Each query's candidates from all
        its lists are re-scored once. Returns the number of (query, row) pairs scanned."""
        m = qs.shape[0]
        work = int((lists.sizes * start.diff()).sum())
        if m == 0 or not work:
            return work
        lib = native.require()
        qs, (coord, bank_of, bank) = qs.float().contiguous(), self.layout
        start, queries = start.contiguous(), queries.contiguous()
        threads = max(1, min(torch.get_num_threads(), math.ceil(work / MIN_THREAD_SCORES), m))
        depth, k, sq = candidate_depth(top.k, self.lut.code_bits), top.k, self.sq if l2 else None

        def call(q0: int, q1: int) -> int:
            """Queries [q0, q1) against every list they probe."""
            return lib.tq_fastscan_lists(
                len(lists.sizes), lists.codes_p.data_ptr(), lists.sizes.data_ptr(), lists.scale_p.data_ptr(),
                lists.labels_p.data_ptr(), lists.base.data_ptr(), start.data_ptr(), queries.data_ptr(),
                lists.row_bytes, self.lut.nbytes, self.lut.code_bits, _ptr(sq), q0, q1 - q0, qs.data_ptr(),
                self.lut.dim, coord.data_ptr(), bank_of.data_ptr(), bank.data_ptr(), depth, k,
                top.values.data_ptr(), top.labels.data_ptr(), int(self.simd))

        cuts = _query_cuts(m, threads, 1)  # each job transposes every list its queries probe: one per thread
        status = native.parallel(call, list(zip(cuts[:-1], cuts[1:])), threads)
        top.ascending &= not any(status)
        return work


class CodeLists:
    """Code lists as :meth:`FastScan.run_lists` reads them: each list's (codes [n_l] or None for an
    empty list, labels: int64 tensor [n_l] or the int label of row 0, then one per row)."""

    def __init__(self, lists: list[tuple[Codes | None, Tensor | int]]) -> None:
        sizes = [0 if c is None else len(c) for c, _ in lists]
        if max(sizes, default=0) >> LIST_ROW_BITS:
            raise ValueError(f"a list holds {max(sizes)} rows, more than the scan's 2**{LIST_ROW_BITS}")
        self._qdata = [None if c is None else c.qdata.contiguous() for c, _ in lists]  # kept alive
        self._scale = [None if c is None else c.norm.float().contiguous() for c, _ in lists]
        self._labels = [None if isinstance(lab, int) else lab.contiguous() for _, lab in lists]
        ptrs = lambda ts: torch.tensor([0 if t is None else t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
        self.codes_p, self.scale_p, self.labels_p = ptrs(self._qdata), ptrs(self._scale), ptrs(self._labels)
        self.sizes = torch.tensor(sizes, dtype=torch.int64)
        self.base = torch.tensor([lab if isinstance(lab, int) else 0 for _, lab in lists], dtype=torch.int64)
        self.row_bytes = next((q.shape[1] for q in self._qdata if q is not None), 0)


class NativeScorer(Scorer):
    """The scorer of direction codes (runs of 1/2/3/4 bits) by the compiled nibble scan, into
    :class:`~tqindex.topk.HeapTopK` heaps (CPU); ``simd=False`` runs the kernel's portable loops."""

    def __init__(self, encoder: Any, qs: Tensor, l2: bool, bar: Any = None, simd: bool = True) -> None:
        super().__init__(encoder, qs, l2, bar)
        self.fast = FastScan(LookupTables(encoder.code_runs(), encoder.dim), simd)
        self.step = max(1, FAST_TABLE_BYTES // self.fast.table_bytes)  # queries per kernel call

    def push(self, codes: Codes, labels: Tensor | int, top: "TopK", rows: Tensor | None = None,
             offset: Tensor | None = None, shift: Tensor | None = None) -> None:
        if shift is not None:
            raise ValueError("the compiled scan takes unshifted queries (residual IVF lists are scanned in PyTorch)")
        qs = self.qs if rows is None else self.qs[rows]
        for q0 in range(0, len(qs), self.step):
            q1 = min(q0 + self.step, len(qs))
            sub = rows[q0:q1] if rows is not None else (None if q1 - q0 == len(qs) else torch.arange(q0, q1))
            self.fast.run(qs[q0:q1], codes, labels, top, sub, self.l2, None if offset is None else offset[q0:q1])
        self._advance(len(qs) * len(codes))

    def push_lists(self, lists: CodeRunList, probes: Tensor, top: "TopK", offsets: Tensor | None = None,
                   shifts: Tensor | None = None) -> None:
        """All probed lists in one kernel call per chunk of queries (each query's candidates from all its lists
        re-scored once); with ``offsets`` the list-by-list strategy (:meth:`Scorer.push_lists`)."""
        if offsets is not None or shifts is not None:
            super().push_lists(lists, probes, top, offsets, shifts)
            return
        code_lists = getattr(lists, "native", None)
        if code_lists is None:
            code_lists = CodeLists(lists)
            if hasattr(lists, "__dict__"):  # a view cached with its index state keeps its prepared form
                lists.native = code_lists
        for q0 in range(0, self.m, self.step):
            q1 = min(q0 + self.step, self.m)
            start, queries = group_pairs(probes[q0:q1], len(lists))
            sub = _RowsTopK(top, q0) if (q0, q1) != (0, self.m) else top
            self._advance(self.fast.run_lists(self.qs[q0:q1], code_lists, start, queries, sub, self.l2))


class _RowsTopK:
    """Heap rows [q0, ...) of a :class:`HeapTopK` as the heaps of a scan of queries q0, q0 + 1, ..."""

    def __init__(self, top: HeapTopK, q0: int) -> None:
        self.top, self.k = top, top.k
        self.values, self.labels = top.values[q0:], top.labels[q0:]

    @property
    def ascending(self) -> bool:
        return self.top.ascending

    @ascending.setter
    def ascending(self, value: bool) -> None:
        self.top.ascending &= value
