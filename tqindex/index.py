"""FlatIndex (exhaustive search over codes) and what every index shares: ids, validation, block scan,
running top-k, re-ranking and file state.

The database is held only as codes (plus int64 ids). Queries are rotated once; then either the
compiled nibble lookup-table scan (``fastscan.py``: 1/2/3/4-bit TurboQuantMSE and TurboQuantPCA codes,
any number of queries) or a PyTorch scan runs: blocks of codes are decoded in the rotated domain and
multiplied with all queries (one float32 GEMM), or, for a few queries, scored by byte lookup tables
(``lut.py``). A running top-k is merged per block, so no [nq, ntotal] score matrix is ever built.

Inside, scores are "larger is better": ``<q, x̂>`` for "ip" and "cosine", and for "l2"
``||q||² - ||q - x̂||² = 2<q, x̂> - ||x̂||²``, with ``||x̂||²`` computed from the codes of each scanned
block (no side array is stored); the distance is ``||q||²`` minus the score.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import faiss
import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from .codes import Codes
from .encoder import Encoder, as_float_tensor, encoder_from_dict
from .fastscan import FastScan
from .fastscan import available as fastscan_available
from .io import register_index_type, write_index_file
from .lut import LookupTables, lut_supported

METRICS = ("ip", "cosine", "l2")
VECTOR_DTYPES = {"float16": torch.float16, "float32": torch.float32}
TILE_BYTES = 4 << 20
"""Target size of one [queries, block] float32 score tile (small enough to stay in cache)."""
DECODE_ELEMENTS = 1 << 20
"""At most this many coordinates (block rows x dim) are decoded at once."""
MIN_TILE = 256
QUERY_CHUNK = TILE_BYTES // (4 * MIN_TILE)
"""Queries searched together; more are searched chunk by chunk (bounded memory)."""
FAST_TABLE_BYTES = 32 << 20
"""Queries are searched in chunks whose compiled-scan tables take at most this many bytes."""
LUT_MAX_QUERIES = 32
"""Up to this many queries, lookup tables replace decode-and-GEMM where the encoder allows."""
ADD_CHUNK = 1 << 16
PROGRESS_MIN_ADD = 1 << 20
"""Adds of at least this many vectors show a progress bar (unless ``progress=False``)."""
PROGRESS_MIN_SCORES = 1 << 30
"""Searches computing at least this many vector scores show a progress bar."""
RERANK_ELEMENTS = 1 << 24
LIST_SHIFT = 32
"""A label is ``list_number << LIST_SHIFT | row``: a stored vector's place while a search runs."""


# --------------------------------------------------------------------------------------------------
# storage


@dataclass(frozen=True, eq=False)
class CodeList:
    """One growing run of codes with their ids and optional kept vectors; rows [0, size) are live.

    Buffers grow by doubling. A new row is written past ``size`` and becomes live only in the
    ``CodeList`` returned by :meth:`appended`, so a failed or interrupted add changes nothing live.
    """

    codes: Codes | None = None  # Codes [capacity]
    ids: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # int64 [capacity]
    vectors: Tensor | None = None  # [capacity, dim] float16/32
    size: int = 0

    @cached_property
    def live_codes(self) -> Codes:
        return self.codes[: self.size]

    @cached_property
    def live_ids(self) -> Tensor:
        return self.ids[: self.size]

    @property
    def nbytes(self) -> int:
        vec = 0 if self.vectors is None else self.vectors.numel() * self.vectors.element_size()
        return (0 if self.codes is None else self.codes.nbytes) + self.ids.numel() * 8 + vec

    def appended(self, codes: Codes, ids: Tensor, vectors: Tensor | None) -> "CodeList":
        """This list with rows appended (codes [m], ids int64 [m], vectors [m, dim] or None)."""
        need = self.size + len(ids)
        base = self
        if self.codes is None or need > self.ids.shape[0]:
            cap = max(need, 2 * self.ids.shape[0])
            base = CodeList(
                codes.empty_like(cap),
                ids.new_empty(cap),
                None if vectors is None else vectors.new_empty(cap, vectors.shape[1]),
                self.size,
            )
            if self.size:
                base.codes.copy_(slice(0, self.size), self.live_codes)
                base.ids[: self.size] = self.live_ids
                if vectors is not None:
                    base.vectors[: self.size] = self.vectors[: self.size]
        base.codes.copy_(slice(self.size, need), codes)
        base.ids[self.size : need] = ids
        if vectors is not None:
            base.vectors[self.size : need] = vectors
        return replace(base, size=need)

    def kept(self, keep: Tensor) -> "CodeList":
        """A compacted copy holding the live rows where ``keep`` (bool [size]) is true."""
        vectors = None if self.vectors is None else self.vectors[: self.size][keep]
        return CodeList(self.live_codes[keep].contiguous(), self.live_ids[keep], vectors, int(keep.sum()))


# --------------------------------------------------------------------------------------------------
# scan


class TopK:
    """Running k largest scores of ``nq`` query rows with int64 labels.

    Kept as faiss min-heaps (C++, parallel over rows for large blocks): each pushed block costs about
    one comparison per score, and nothing larger than [nq, k] is held. While ``ascending`` is true every
    row is sorted ascending (a min-heap too), so :meth:`result` only reverses it; whoever writes rows
    otherwise clears it.
    """

    def __init__(self, nq: int, k: int) -> None:
        self.k = k
        # filled by numpy on one thread: a torch fill of this size wakes the intra-op thread pool
        self.values = torch.from_numpy(np.full((nq, k), -np.inf, np.float32))  # [nq, k] in heap order
        self.labels = torch.from_numpy(np.full((nq, k), -1, np.int64))  # [nq, k]
        self.ascending = True
        self._heaps = faiss.float_minheap_array_t()
        self._heaps.nh, self._heaps.k = nq, k
        self._heaps.val = faiss.cast_integer_to_float_ptr(self.values.data_ptr())
        self._heaps.ids = faiss.cast_integer_to_idx_t_ptr(self.labels.data_ptr())

    def push(self, scores: Tensor, labels: Tensor, rows: Tensor | None = None, offset: Tensor | None = None) -> None:
        """Merge a block: scores [r, B] float32 for all rows (r = nq) or for rows ``rows`` (int64 [r]);
        column j has label ``labels[j]`` (int64 [B]); ``offset`` [r] is added to every score of its row."""
        if offset is not None:
            scores = scores + offset[:, None]
        self.ascending = False
        scores, labels = scores.contiguous(), labels.contiguous()
        nj, vin = scores.shape[1], faiss.cast_integer_to_float_ptr(scores.data_ptr())
        ids = faiss.cast_integer_to_idx_t_ptr(labels.data_ptr())
        if rows is None:
            self._heaps.addn_with_ids(nj, vin, ids, 0)  # id stride 0: one label row for all query rows
        else:
            rows = rows.contiguous()
            self._heaps.addn_query_subset_with_ids(len(rows), faiss.cast_integer_to_idx_t_ptr(rows.data_ptr()),
                                                   nj, vin, ids, 0)

    def merge(self, values: Tensor, labels: Tensor, rows: Tensor) -> None:
        """Merge per-row candidates: values float32 [r, j] and labels int64 [r, j] of heap rows ``rows`` [r]."""
        values, labels, rows = values.contiguous(), labels.contiguous(), rows.contiguous()
        self.ascending = False
        self._heaps.addn_query_subset_with_ids(len(rows), faiss.cast_integer_to_idx_t_ptr(rows.data_ptr()),
                                               values.shape[1], faiss.cast_integer_to_float_ptr(values.data_ptr()),
                                               faiss.cast_integer_to_idx_t_ptr(labels.data_ptr()), values.shape[1])

    def result(self) -> tuple[Tensor, Tensor]:
        """(values [nq, k] float32, labels [nq, k] int64), best first; -inf and -1 where nothing was found.
        Sorts the heaps in place (faiss, parallel over rows): nothing may be pushed afterwards."""
        if self.ascending:
            return (torch.from_numpy(self.values.numpy()[:, ::-1].copy()),
                    torch.from_numpy(self.labels.numpy()[:, ::-1].copy()))
        self._heaps.reorder()  # pads with -FLT_MAX
        return self.values.masked_fill_(self.labels < 0, -math.inf), self.labels


@dataclass
class BlockScan:
    """Scores runs of codes against prepared queries, block by block, into a :class:`TopK`.

    ``qs`` [nq, dim] are the rotated queries ``R q`` ("ip"/"cosine") or ``2 R q`` ("l2": a code then
    scores ``2<q, x̂> - ||x̂||² = ||q||² - ||q - x̂||²``). With ``fast`` (the compiled scan) every run
    goes to it. Otherwise codes are decoded DECODE_ELEMENTS coordinates at a time and multiplied with
    the queries in [r, TILE_BYTES / 4r] score tiles; up to LUT_MAX_QUERIES queries on 1/2/4-bit codes
    are scored by byte lookup tables instead.
    """

    encoder: Encoder
    l2: bool
    qs: Tensor
    top: TopK
    lut: LookupTables | None = None  # the encoder's tables builder, where it has one
    bar: tqdm | None = None
    fast: FastScan | None = None  # the compiled scan, where it serves the encoder
    labels_are_ids: bool = False  # ``top`` holds ids, not labels (set by a scan that labels rows by id)

    def __post_init__(self) -> None:
        lut_all = self.lut is not None and self.few and self.fast is None
        self._all_tables = self.lut.tables(self.qs, self.l2) if lut_all else None  # serve every run of few queries

    @property
    def few(self) -> bool:
        """At most LUT_MAX_QUERIES query rows: :meth:`all_scores` scores them all at once."""
        return self.qs.shape[0] <= LUT_MAX_QUERIES

    def all_scores(self, codes: Codes) -> Tensor:
        """Scores [nq, n] of every query row for Codes [n] (for few queries: one [nq, n] tile)."""
        if self._all_tables is not None:
            return self.lut.scan(self._all_tables, codes, self.l2)
        xr = self.encoder.decode_rotated(codes)  # [n, dim]
        return torch.addmm(xr.square().sum(1).neg_(), self.qs, xr.mT) if self.l2 else self.qs @ xr.mT

    def run(self, codes: Codes, label_base: int = 0, select: Tensor | None = None, rows: Tensor | None = None,
            offset: Tensor | None = None, shift: Tensor | None = None) -> None:
        """Scan codes [n] (only rows ``select``, int64, when given; code row i has label
        ``label_base + i``) with query rows ``rows`` (int64, all when None) minus ``shift`` [dim];
        ``offset`` [r] is added to each query row's scores."""
        qs = self.qs if rows is None else self.qs[rows]
        if shift is not None:
            qs = qs - shift
        m, n = qs.shape[0], len(codes) if select is None else len(select)
        if self.fast is not None:
            if select is not None:
                codes = codes[select]
            labels = label_base if select is None else select + label_base
            self.fast.run(qs, codes, labels, self.top, rows, self.l2, offset)
            if self.bar is not None:
                self.bar.update(m * n)
            return
        tables, pick = None, None  # lookup tables, and the rows of their scores to keep
        if self._all_tables is not None and shift is None:
            tables, pick = self._all_tables, rows
        elif self.lut is not None and m <= LUT_MAX_QUERIES:
            tables = self.lut.tables(qs, self.l2)
        chunk = max(1, DECODE_ELEMENTS // self.encoder.dim)
        tile = max(MIN_TILE, TILE_BYTES // (4 * m) // 64 * 64)  # BLAS-friendly widths
        for i in range(0, n, chunk):
            if select is None:
                block = codes if n <= chunk else codes[i : i + chunk]
                labels = torch.arange(label_base + i, label_base + i + len(block))
            else:
                sel = select[i : i + chunk]
                block, labels = codes[sel], sel + label_base
            if tables is not None:
                s = self.lut.scan(tables, block, self.l2)  # [m or nq, b]
                self.top.push(s if pick is None else s[pick], labels, rows, offset)
            else:
                xr = self.encoder.decode_rotated(block)  # [b, dim]
                bias = xr.square().sum(1).neg_() if self.l2 else None  # -||x̂||²
                for j in range(0, len(xr), tile):
                    x = xr[j : j + tile].mT  # [dim, t]
                    s = qs @ x if bias is None else torch.addmm(bias[j : j + tile], qs, x)
                    self.top.push(s, labels[j : j + tile], rows, offset)
            if self.bar is not None:
                self.bar.update(m * len(block))


# --------------------------------------------------------------------------------------------------
# indexes


class BaseIndex(ABC):
    """Ids, validation, add / search / remove, re-ranking and file state shared by every index.

    Subclasses hold ``nlists`` :class:`CodeList` runs and implement :meth:`_scan` (and, for IVF,
    :meth:`_assign` / :meth:`_residuals`).
    """

    index_type = "BaseIndex"

    def __init__(self, encoder: Encoder, metric: str, keep_vectors: bool, vectors_dtype: str,
                 rerank_factor: int, nlists: int) -> None:
        if not isinstance(encoder, Encoder):
            raise TypeError(f"encoder must be a tqindex Encoder, got {type(encoder).__name__}")
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        if not isinstance(keep_vectors, bool):
            raise TypeError(f"keep_vectors must be a bool, got {type(keep_vectors).__name__}")
        if vectors_dtype not in VECTOR_DTYPES:
            raise ValueError(f"vectors_dtype must be one of {tuple(VECTOR_DTYPES)}, got {vectors_dtype!r}")
        rerank_factor = check_int(rerank_factor, "rerank_factor", 1)
        self.encoder = encoder
        self.metric = metric
        self.keep_vectors = keep_vectors
        self.vectors_dtype = vectors_dtype
        self.rerank_factor = rerank_factor
        self._lists = [CodeList() for _ in range(nlists)]
        # Score 1/2/3/4-bit codes with the compiled kernel where it is built (False: the PyTorch scans).
        self.compiled_scan = fastscan_available()
        self._scan_tools()
        self._id_cache: tuple = (None,)
        self._next_id = 0

    def _scan_tools(self) -> None:
        """Lookup tables and the compiled scan for the encoder, where they serve it (once it is trained)."""
        lut = LookupTables(self.encoder) if lut_supported(self.encoder, nibbles=True) else None
        self._lut = lut if lut_supported(self.encoder) else None  # byte tables (not for 3-bit codes)
        self._fast = FastScan(lut) if lut is not None and fastscan_available() else None

    def _check_trained(self) -> None:
        if not self.encoder.is_trained:
            raise ValueError(f"the encoder {type(self.encoder).__name__} must be trained first: call index.train(x)")

    # -- properties ---------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self.encoder.dim

    @property
    def ntotal(self) -> int:
        """Number of stored vectors."""
        return sum(c.size for c in self._lists)

    def __len__(self) -> int:
        return self.ntotal

    @property
    def ids(self) -> np.ndarray:
        """All stored ids (int64 [ntotal], storage order; a copy)."""
        return self._all_ids().numpy().copy()

    def memory_bytes(self) -> int:
        """Bytes held: code, id (and kept vector) buffers as allocated + encoder tensors (+ IVF centroids).

        Buffers grow by doubling; after one add into an empty index, and after :func:`load_index`,
        they hold exactly ``ntotal`` rows: ``ntotal * (code_size + 8)`` plus fixed tensors.
        """
        return sum(c.nbytes for c in self._lists) + self._fixed_bytes()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.encoder!r}, metric={self.metric!r}, ntotal={self.ntotal})"

    # -- add / remove -------------------------------------------------------------------------------
    def add(self, x: Any, ids: Any = None, progress: bool | None = None) -> None:
        """Add vectors x [n, dim] (numpy or torch float) with int64 ``ids`` [n] (default: the ids after
        the largest one so far, i.e. ``ntotal, ntotal+1, ...`` for an index that never had ids given
        or removed). Invalid input raises and leaves the index unchanged; so does an interrupt."""
        self._check_trained()
        xt = self._vectors_in(x, "x", allow_empty=False)
        n = xt.shape[0]
        new_ids = self._new_ids(ids, n)
        assign = self._assign(xt)  # [n] int64 list numbers
        show = _show(progress, n >= PROGRESS_MIN_ADD)
        parts = []
        with tqdm(total=n, unit="vec", desc="add", disable=not show) as bar:
            for i in range(0, n, ADD_CHUNK):
                parts.append(self.encoder.encode_valid(self._residuals(xt[i : i + ADD_CHUNK], assign[i : i + ADD_CHUNK])))
                bar.update(len(parts[-1]))
        codes = parts[0] if len(parts) == 1 else Codes.cat(parts)
        vectors = xt.to(VECTOR_DTYPES[self.vectors_dtype]) if self.keep_vectors else None
        lists = list(self._lists)
        if len(lists) == 1:
            lists[0] = lists[0].appended(codes, new_ids, vectors)
        else:
            order = torch.argsort(assign, stable=True)
            counts = torch.bincount(assign, minlength=len(lists)).tolist()
            start = 0
            for no, count in enumerate(counts):
                if count:
                    rows = order[start : start + count]
                    lists[no] = lists[no].appended(codes[rows], new_ids[rows], None if vectors is None else vectors[rows])
                    start += count
        self._lists, self._next_id = lists, max(self._next_id, int(new_ids.max()) + 1)

    def add_with_ids(self, x: Any, ids: Any, progress: bool | None = None) -> None:
        """faiss-style alias of ``add(x, ids=ids)``."""
        self.add(x, ids=ids, progress=progress)

    def remove_ids(self, ids: Any) -> int:
        """Remove the vectors with these ids (unknown ids are ignored); -> number removed."""
        gone = torch.from_numpy(np.unique(_int_array(ids, "ids")))
        lists, removed = list(self._lists), 0
        for no, lst in enumerate(lists):
            if lst.size:
                keep = ~torch.isin(lst.live_ids, gone)
                if not bool(keep.all()):
                    removed += lst.size - int(keep.sum())
                    lists[no] = lst.kept(keep)
        self._lists = lists
        return removed

    # -- search -------------------------------------------------------------------------------------
    def search(self, q: Any, k: int, allow: Any = None, progress: bool | None = None) -> tuple[Any, Any]:
        """Top-k search. q [nq, dim] float (numpy -> numpy out, torch -> torch out).

        Returns (D, I): D float32 [nq, k] scores ("ip": <q, x̂>, "cosine": cosine of q and x̂, "l2":
        squared distance), I int64 [nq, k] ids, best first; ``-1`` ids and ``-inf`` (``+inf`` for
        "l2") where fewer than k vectors exist. ``allow`` (ids, any order) restricts the search to
        those vectors inside the scan. With ``keep_vectors`` the top ``k * rerank_factor``
        candidates are re-ranked by exact scores of the kept vectors.
        """
        return self._search(q, k, allow, progress, {})

    def _search(self, q: Any, k: int, allow: Any, progress: bool | None, opts: dict[str, Any]) -> tuple[Any, Any]:
        """:meth:`search` with subclass scan options ``opts`` (passed to :meth:`_scan`, :meth:`_search_work`)."""
        k = check_int(k, "k", 1)
        self._check_trained()
        qt = self._vectors_in(q, "q", allow_empty=True)
        allowed = None if allow is None else torch.from_numpy(np.unique(_int_array(allow, "allow")))
        depth = k * self.rerank_factor if self.keep_vectors else k
        parts = []  # (D, I) of each chunk of queries
        work = self._search_work(len(qt), **opts)
        show = _show(progress, work >= PROGRESS_MIN_SCORES)
        with tqdm(total=work, unit="score", unit_scale=True, desc="search",
                  disable=not show) as bar:
            fast = self._fast if self.compiled_scan else None
            step = QUERY_CHUNK if fast is None else min(QUERY_CHUNK, max(1, FAST_TABLE_BYTES // fast.table_bytes))
            for i in range(0, len(qt), step):
                chunk = qt[i : i + step]
                qr = self.encoder.rotate(chunk)  # [m, dim]; chunk is validated
                l2 = self.metric == "l2"
                scan = BlockScan(self.encoder, l2, 2 * qr if l2 else qr, TopK(len(chunk), depth), self._lut,
                                 bar if show else None, fast)
                self._scan(scan, chunk, allowed, **opts)
                values, labels = scan.top.result()
                if self.keep_vectors:
                    values, labels = self._rerank(chunk, values, labels, k)
                parts.append((chunk.square().sum(1, keepdim=True) - values if scan.l2 else values,
                              labels if scan.labels_are_ids else self._ids_of(labels)))
            bar.total = bar.n  # the work estimate is exact only without ``allow``
        if len(parts) == 1:
            D, I = parts[0]
        else:
            D = torch.cat([d for d, _ in parts]) if parts else torch.empty(0, k)
            I = torch.cat([i for _, i in parts]) if parts else torch.empty(0, k, dtype=torch.int64)
        if isinstance(q, Tensor):
            return D.to(q.device), I.to(q.device)
        return D.numpy(), I.numpy()

    def _rerank(self, qt: Tensor, values: Tensor, labels: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Exact scores of the candidates from the kept vectors -> (values [m, k], labels [m, k]) best first."""
        step = max(1, RERANK_ELEMENTS // (labels.shape[1] * self.dim))
        out_v, out_l = [], []
        for i in range(0, len(qt), step):
            lab = labels[i : i + step]
            vec = self._vectors_of(lab).float()  # [m, depth, dim]
            q = qt[i : i + step, None, :]  # [m, 1, dim]
            exact = (vec * (2 * q - vec) if self.metric == "l2" else vec * q).sum(-1)  # [m, depth]
            exact.masked_fill_(lab < 0, -math.inf)
            v, j = torch.topk(exact, min(k, exact.shape[1]), dim=1)
            out_v.append(v)
            out_l.append(lab.gather(1, j))
        values, labels = torch.cat(out_v), torch.cat(out_l)
        pad = k - values.shape[1]
        return (torch.nn.functional.pad(values, (0, pad), value=-math.inf),
                torch.nn.functional.pad(labels, (0, pad), value=-1))

    # -- helpers ------------------------------------------------------------------------------------
    def _vectors_in(self, x: Any, name: str, allow_empty: bool) -> Tensor:
        """Validate [n, dim] input -> float32 CPU tensor (unit rows for "cosine")."""
        t = as_float_tensor(x, self.dim, name, allow_empty=allow_empty)
        if t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D array [n, {self.dim}], got shape {tuple(t.shape)}")
        t = t.cpu()
        return torch.nn.functional.normalize(t, dim=1) if self.metric == "cosine" else t

    def _new_ids(self, ids: Any, n: int) -> Tensor:
        """Validated new ids int64 [n]: no repeats, none already stored."""
        if ids is None:
            return torch.arange(self._next_id, self._next_id + n, dtype=torch.int64)
        a = _int_array(ids, "ids")
        if a.shape != (n,):
            raise ValueError(f"ids must be a 1-D array with one id per vector ({n}), got shape {a.shape}")
        uniq, counts = np.unique(a, return_counts=True)
        if len(uniq) != n:
            raise ValueError(f"ids must be distinct; repeated: {uniq[counts > 1][:5].tolist()}")
        t = torch.from_numpy(a)
        if int(t.min()) < self._next_id:  # ids above every id ever added need no lookup
            present = t[torch.isin(t, self._all_ids())]
            if len(present):
                raise ValueError(f"ids already in the index: {present[:5].tolist()}")
        return t

    def _all_ids(self) -> Tensor:
        """Every stored id, list after list: int64 [ntotal]."""
        return self._id_table()[0][:-1]

    def _id_table(self) -> tuple[Tensor, Tensor, bool]:
        """(all ids list after list and then a -1, int64 [ntotal + 1]; start of each list int64 [nlists];
        whether one list holds ids 0, 1, ..., so that a row is its id), rebuilt when the lists change
        (add and remove replace ``_lists``)."""
        if self._id_cache[0] is not self._lists:
            sizes = torch.tensor([c.size for c in self._lists])
            ids = torch.cat([c.live_ids for c in self._lists] + [torch.full((1,), -1)])
            rows_are_ids = len(self._lists) == 1 and torch.equal(ids[:-1], torch.arange(len(ids) - 1))
            self._id_cache = (self._lists, ids, sizes.cumsum(0) - sizes, rows_are_ids)
        return self._id_cache[1:]

    def _ids_of(self, labels: Tensor) -> Tensor:
        """Ids of labels (any shape; -1 stays -1)."""
        ids, starts, rows_are_ids = self._id_table()
        if rows_are_ids:
            return labels
        if len(starts) == 1:  # labels are rows; -1 picks the trailing -1
            return torch.take(ids, labels)
        pos = starts[labels >> LIST_SHIFT] + (labels & ((1 << LIST_SHIFT) - 1))
        return ids[torch.where(labels >= 0, pos, -1)]

    def _vectors_of(self, labels: Tensor) -> Tensor:
        """Kept vectors of labels [m, depth] -> [m, depth, dim] (zeros for label -1)."""
        flat = labels.reshape(-1)
        valid = torch.nonzero(flat >= 0).squeeze(1)
        lab = flat[valid]
        out = torch.zeros(len(flat), self.dim, dtype=VECTOR_DTYPES[self.vectors_dtype])
        nos, rows = lab >> LIST_SHIFT, lab & ((1 << LIST_SHIFT) - 1)
        order = torch.argsort(nos)
        uniq, counts = torch.unique_consecutive(nos[order], return_counts=True)
        for no, part in zip(uniq.tolist(), torch.split(order, counts.tolist())):
            out[valid[part]] = self._lists[no].vectors[rows[part]]
        return out.reshape(*labels.shape, self.dim)

    def _fixed_bytes(self) -> int:
        """Bytes of tensors that do not grow with ntotal (encoder rotation and codebooks, ...)."""
        return sum(t.numel() * t.element_size() for t in self.encoder.tensors().values())

    # -- subclass hooks -----------------------------------------------------------------------------
    def _assign(self, x: Tensor) -> Tensor:
        """List number of each vector x [n, dim] -> int64 [n]."""
        return torch.zeros(len(x), dtype=torch.int64)

    def _residuals(self, x: Tensor, assign: Tensor) -> Tensor:
        """What is encoded for vectors x [n, dim] assigned to lists ``assign`` [n]."""
        return x

    def _search_work(self, nq: int, **opts: Any) -> int:
        """Vector scores a search of nq queries computes (decides the progress bar)."""
        return nq * self.ntotal

    @abstractmethod
    def _scan(self, scan: BlockScan, q: Tensor, allowed: Tensor | None, **opts: Any) -> None:
        """Run ``scan`` (prepared from queries q [m, dim]) over the lists; allowed: sorted int64 ids or None."""

    # -- files --------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the index to ``path`` (HDF5, see ``tqindex.io``), atomically."""
        header = {
            "index_type": self.index_type,
            "metric": self.metric,
            "dim": self.dim,
            "ntotal": self.ntotal,
            "code_size": self.encoder.code_size,
            "encoder": self.encoder.to_dict(),
            "options": {**self._options(), "next_id": self._next_id},
        }
        live = [c for c in self._lists if c.size]
        arrays = {f"encoder/{name}": t.numpy() for name, t in self.encoder.tensors().items()}
        arrays["ids"] = self._all_ids().numpy()
        if live:
            codes = Codes.cat([c.live_codes for c in live])
            arrays.update({f"codes/{name}": t.numpy() for name, t in codes.planes()})
            if self.keep_vectors:
                arrays["vectors"] = torch.cat([c.vectors[: c.size] for c in live]).numpy()
        write_index_file(path, {**header, **self._header_extra()}, {**arrays, **self._arrays_extra()})

    def _options(self) -> dict[str, Any]:
        return {"keep_vectors": self.keep_vectors, "vectors_dtype": self.vectors_dtype,
                "rerank_factor": self.rerank_factor}

    def _header_extra(self) -> dict[str, Any]:
        return {}

    def _arrays_extra(self) -> dict[str, np.ndarray]:
        return {}

    @staticmethod
    def _encoder_from_file(header: dict, arrays: dict[str, np.ndarray]) -> Encoder:
        tensors = {n[len("encoder/"):]: torch.from_numpy(a) for n, a in arrays.items() if n.startswith("encoder/")}
        encoder = encoder_from_dict(header["encoder"], tensors)
        if encoder.code_size != header["code_size"] or encoder.dim != header["dim"]:
            raise ValueError(f"encoder {encoder!r} does not match the header's dim/code_size")
        return encoder

    @staticmethod
    def _options_from_file(header: dict) -> dict[str, Any]:
        """Constructor options from a file header (``next_id`` is state, not an option)."""
        return {k: v for k, v in header["options"].items() if k != "next_id"}

    def _restore(self, header: dict, arrays: dict[str, np.ndarray], offsets: list[int]) -> None:
        """Fill the lists from file arrays; list i holds stored rows [offsets[i], offsets[i+1])."""
        n = int(header["ntotal"])
        ids = torch.from_numpy(arrays["ids"])
        if ids.dtype != torch.int64 or ids.shape != (n,) or len(torch.unique(ids)) != n:
            raise ValueError(f"ids must be {n} distinct int64 values (ntotal={n}), got {ids.dtype} {tuple(ids.shape)}")
        if offsets[-1] != n:
            raise ValueError(f"list offsets end at {offsets[-1]}, expected ntotal={n}")
        planes = {name[len("codes/"):]: torch.from_numpy(a) for name, a in arrays.items() if name.startswith("codes/")}
        vectors = torch.from_numpy(arrays["vectors"]) if self.keep_vectors and n else None
        self._next_id = int(header["options"]["next_id"])
        if not n:
            return
        codes = Codes(**planes)
        if codes.shape != (n,) or codes.nbytes != n * self.encoder.code_size:
            raise ValueError(f"codes of shape {tuple(codes.shape)} and {codes.nbytes} bytes do not match "
                             f"ntotal={n} x code_size={self.encoder.code_size}")
        if vectors is not None and (vectors.shape != (n, self.dim) or vectors.dtype != VECTOR_DTYPES[self.vectors_dtype]):
            raise ValueError(f"kept vectors {tuple(vectors.shape)} {vectors.dtype} do not match the header")
        # Views of the loaded arrays: each list's capacity equals its size, so an add reallocates.
        self._lists = [
            CodeList(codes[a:b], ids[a:b], None if vectors is None else vectors[a:b], b - a) if b > a else CodeList()
            for a, b in zip(offsets[:-1], offsets[1:])
        ]


class FlatIndex(BaseIndex):
    """Exhaustive search over codes: ``FlatIndex(TurboQuantMSE(dim=50, bits=4), metric="ip")``.

    metric: "ip" (score = the encoder's inner-product estimate), "cosine" (x and q normalized
    first) or "l2" (squared distance to the reconstruction). keep_vectors: also keep the original
    vectors (``vectors_dtype``) and re-rank the top ``k * rerank_factor`` candidates exactly.
    """

    index_type = "FlatIndex"

    def __init__(self, encoder: Encoder, metric: str = "ip", keep_vectors: bool = False,
                 vectors_dtype: str = "float32", rerank_factor: int = 4) -> None:
        super().__init__(encoder, metric, keep_vectors, vectors_dtype, rerank_factor, nlists=1)

    def train(self, x: Any) -> None:
        """Fit a learned encoder (TurboQuantPCA) to vectors x [n, dim]; others need no training."""
        if self.ntotal:
            raise ValueError(f"train must come before add: the index already holds {self.ntotal} vectors")
        self.encoder.train(self._vectors_in(x, "x", allow_empty=False))
        self._scan_tools()

    @property
    def is_trained(self) -> bool:
        return self.encoder.is_trained

    def _scan(self, scan: BlockScan, q: Tensor, allowed: Tensor | None) -> None:
        lst = self._lists[0]
        if lst.size:
            scan.run(lst.live_codes, select=selected_rows(lst.live_ids, allowed))

    @classmethod
    def _from_file(cls, header: dict, arrays: dict[str, np.ndarray]) -> "FlatIndex":
        index = cls(cls._encoder_from_file(header, arrays), header["metric"], **cls._options_from_file(header))
        index._restore(header, arrays, [0, int(header["ntotal"])])
        return index


def selected_rows(ids: Tensor, allowed: Tensor | None) -> Tensor | None:
    """Rows (int64) of ids [n] that are in ``allowed`` (sorted int64 ids), or None (all) when allowed is None."""
    return None if allowed is None else torch.nonzero(torch.isin(ids, allowed)).squeeze(1)


def check_int(value: Any, name: str, minimum: int) -> int:
    """``value`` (int or numpy integer, not bool) as an int >= ``minimum``; ValueError naming ``name`` otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _int_array(ids: Any, name: str) -> np.ndarray:
    """ids (numpy, torch or sequence of integers) -> 1-D int64 numpy array of non-negative ids."""
    a = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
    if a.size == 0:
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int64 ids), got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of ids, got shape {a.shape}")
    if a.size and (int(a.min()) < 0 or int(a.max()) > np.iinfo(np.int64).max):
        raise ValueError(f"{name} must be in [0, 2**63), got values in [{a.min()}, {a.max()}]")
    return a.astype(np.int64)


def _show(progress: bool | None, large: bool) -> bool:
    """Progress bar decision: explicit ``progress`` wins, else shown for large work."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None, got {progress!r}")
    return large if progress is None else progress


register_index_type(FlatIndex.index_type, FlatIndex._from_file)
