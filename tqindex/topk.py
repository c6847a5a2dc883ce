"""Running top-k of query rows: the k largest scores seen so far and their int64 labels.

One interface, two implementations chosen by device (:func:`make_topk`): :class:`HeapTopK` keeps
faiss min-heaps (C++, parallel over rows; the compiled CPU scan writes into them directly) and
:class:`TensorTopK` keeps sorted torch tensors on any device (GPU scans push per-block candidates).
Scores are "larger is better"; empty places hold ``-inf`` and label ``-1``.
"""

from __future__ import annotations

import math

import faiss
import numpy as np
import torch
from torch import Tensor

from . import kernels


class TopK:
    """The k largest scores per query row and their labels."""

    k: int

    def push(self, scores: Tensor, labels: Tensor, rows: Tensor | None = None, offset: Tensor | None = None) -> None:
        """Merge a block: scores [r, B] float32 for all rows (r = nq) or for rows ``rows`` (int64 [r]);
        column j has label ``labels[j]`` (int64 [B]); ``offset`` [r] is added to every score of its row."""
        raise NotImplementedError

    def merge(self, values: Tensor, labels: Tensor, rows: Tensor | None = None) -> None:
        """Merge per-row candidates: values float32 [r, j] and labels int64 [r, j] (-1: none) of rows
        ``rows`` [r] (all rows when None)."""
        raise NotImplementedError

    def result(self) -> tuple[Tensor, Tensor]:
        """(values [nq, k] float32, labels [nq, k] int64), best first; -inf and -1 where nothing was found.
        Nothing may be pushed afterwards."""
        raise NotImplementedError


def make_topk(nq: int, k: int, device: torch.device, backend: str | None = None) -> TopK:
    """A running top-k for ``nq`` rows on ``device`` (faiss heaps on the CPU); ``backend``: of its
    selections (:func:`top_columns`)."""
    return HeapTopK(nq, k) if device.type == "cpu" else TensorTopK(nq, k, device, backend)


def top_columns(x: Tensor, k: int, backend: str | None = None, labels: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of x float32 [m, n] (k <= n, no NaN), best first -> (values [m, k],
    columns int64 [m, k]). With integer ``labels`` [m, n]: entries of a negative label count as -inf, and their
    labels come out instead of the columns, -1 for -inf. ``torch.topk``, or for a few rows the Triton kernel
    where ``kernels.select`` picks Triton (``kernels/topk_triton.py``)."""
    if kernels.select(x, backend, ("triton",), "a top-k") == "triton":
        from .kernels.topk_triton import fits, top_columns_triton  # imports triton

        if fits(x, k):
            return top_columns_triton(x, k, labels)
    if labels is None:
        return torch.topk(x, k, dim=1)
    v, j = torch.topk(x.masked_fill(labels < 0, -math.inf), k, dim=1)
    return v, labels.gather(1, j).masked_fill(v == -math.inf, -1)


class HeapTopK(TopK):
    """CPU top-k kept as faiss min-heaps: each pushed block costs about one comparison per score.

    While ``ascending`` is true every row is sorted ascending (a min-heap too), so :meth:`result` only
    reverses it; whoever writes rows otherwise (the compiled scan) clears it.
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

    def merge(self, values: Tensor, labels: Tensor, rows: Tensor | None = None) -> None:
        rows = torch.arange(len(values)) if rows is None else rows
        values, labels, rows = values.contiguous(), labels.contiguous(), rows.contiguous()
        values = values.masked_fill(labels < 0, -math.inf)
        self.ascending = False
        self._heaps.addn_query_subset_with_ids(len(rows), faiss.cast_integer_to_idx_t_ptr(rows.data_ptr()),
                                               values.shape[1], faiss.cast_integer_to_float_ptr(values.data_ptr()),
                                               faiss.cast_integer_to_idx_t_ptr(labels.data_ptr()), values.shape[1])

    def result(self) -> tuple[Tensor, Tensor]:
        if self.ascending:
            return (torch.from_numpy(self.values.numpy()[:, ::-1].copy()),
                    torch.from_numpy(self.labels.numpy()[:, ::-1].copy()))
        self._heaps.reorder()  # pads with -FLT_MAX
        return self.values.masked_fill_(self.labels < 0, -math.inf), self.labels


class TensorTopK(TopK):
    """Top-k kept as tensors on any device, each row sorted best first; a merge takes the top k of the
    current rows and the candidates together (:func:`top_columns`). Nothing is allocated before the first merge,
    and a first merge of every row needs no concatenation (fewer kernels for a search that merges once)."""

    def __init__(self, nq: int, k: int, device: torch.device | str, backend: str | None = None) -> None:
        self.k, self.nq, self.device, self.backend = k, nq, torch.device(device), backend
        self.values: Tensor | None = None  # [nq, k] once merged into
        self.labels: Tensor | None = None

    def push(self, scores: Tensor, labels: Tensor, rows: Tensor | None = None, offset: Tensor | None = None) -> None:
        if offset is not None:
            scores = scores + offset[:, None]
        self.merge(scores, labels.to(scores.device).expand(scores.shape[0], -1), rows)

    def merge(self, values: Tensor, labels: Tensor, rows: Tensor | None = None) -> None:
        values = values.float()
        if self.values is not None or rows is not None or values.shape[1] < self.k:
            self._start()
            old_v = self.values if rows is None else self.values[rows]
            old_l = self.labels if rows is None else self.labels[rows]
            values, labels = torch.cat([old_v, values], 1), torch.cat([old_l, labels], 1)
        v, lab = top_columns(values, self.k, self.backend, labels)
        if rows is None:
            self.values, self.labels = v, lab
        else:
            self.values[rows], self.labels[rows] = v, lab

    def result(self) -> tuple[Tensor, Tensor]:
        self._start()
        return self.values, self.labels

    def _start(self) -> None:
        """Empty places (-inf, label -1) where nothing was merged yet."""
        if self.values is None:
            self.values = torch.full((self.nq, self.k), -math.inf, device=self.device)
            self.labels = torch.full((self.nq, self.k), -1, dtype=torch.int64, device=self.device)
