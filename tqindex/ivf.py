"""IVFIndex: a coarse k-means partition (faiss) with one growing run of codes per list.

A vector x goes to its nearest centroid c_l. With ``by_residual=True`` the code stores r = x - c_l
and x̂ = c_l + r̂, so ``<q, x̂> = <q, c_l> + <q, r̂>`` and
``||q - x̂||² = ||q - c_l||² - 2<q - c_l, r̂> + ||r̂||²``: the coarse search gives the first term,
the list scan (the same block scan as FlatIndex) the rest. With ``by_residual=False`` x itself is
encoded and lists are scanned as in FlatIndex.

Where the compiled kernel serves the codes (``fastscan.py``), codes of raw vectors are searched in one
kernel call: each query's candidates from all the lists it probes share one reservoir and are re-scored
once; the coarse step's top-``nprobe`` selection and the grouping of (query, list) pairs by list are
compiled too. Otherwise many queries are scanned list by list, each list with the queries that probe
it, and few queries (at most ``LUT_MAX_QUERIES``) over the union of their probed lists at once, in
blocks, with the (query, list) pairs that were not probed masked out: far fewer, larger steps for
latency-bound search.
"""

from __future__ import annotations

import math
from itertools import repeat
from typing import Any

import faiss
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .codes import Codes
from .encoder import Encoder
from .fastscan import CodeLists, group_pairs, top_columns
from .index import DECODE_ELEMENTS, LIST_SHIFT, TILE_BYTES, BaseIndex, BlockScan, check_int, selected_rows
from .io import register_index_type


class IVFIndex(BaseIndex):
    """Inverted-file index: ``IVFIndex(make_encoder("tq4", 50), nlist=1024, metric="cosine")``.

    ``train(x)`` runs seeded k-means (spherical for "ip"/"cosine", on normalized vectors; plain
    for "l2"); ``search(q, k, nprobe=...)`` scans the ``nprobe`` lists nearest to each query (by
    inner product, or by L2 distance for "l2"). Ids, filtering, removal, re-ranking and files work
    as in :class:`~tqindex.index.FlatIndex`.

    ``by_residual`` encodes x - c_l instead of x. The encoders keep one scale per vector, so the
    residual's smaller norm buys little: on GloVe-50 (tq4, nlist=1024) residual codes had 23 % less
    reconstruction error but the same recall (R@1@1 0.827 vs 0.831 raw at nprobe=128), hence the
    default False, whose list scans need no per-list query shift.
    """

    index_type = "IVFIndex"

    def __init__(self, encoder: Encoder, nlist: int, metric: str = "ip", by_residual: bool = False,
                 nprobe: int = 8, seed: int = 0, niter: int = 20, keep_vectors: bool = False,
                 vectors_dtype: str = "float32", rerank_factor: int = 4) -> None:
        nlist = check_int(nlist, "nlist", 1)
        if not isinstance(by_residual, bool):
            raise TypeError(f"by_residual must be a bool, got {type(by_residual).__name__}")
        super().__init__(encoder, metric, keep_vectors, vectors_dtype, rerank_factor, nlists=nlist)
        self.nlist, self.by_residual = nlist, by_residual
        self.seed, self.niter = check_int(seed, "seed", 0), check_int(niter, "niter", 1)
        self.nprobe = nprobe
        self._code_lists_cache: tuple = (None,)
        self.centroids: Tensor | None = None  # [nlist, dim] float32
        self._centroids_rot: Tensor | None = None  # R c, [nlist, dim]
        self._centroid_norms2: Tensor | None = None  # ||c||², [nlist]

    @property
    def nprobe(self) -> int:
        """Lists scanned per query (default for :meth:`search`)."""
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        self._nprobe = check_int(value, "nprobe", 1)

    @property
    def is_trained(self) -> bool:
        return self.centroids is not None

    def train(self, x: Any) -> None:
        """Learn the ``nlist`` centroids from x [n, dim] (n >= nlist) by seeded faiss k-means."""
        if self.ntotal:
            raise ValueError(f"train must come before add: the index already holds {self.ntotal} vectors")
        xt = self._vectors_in(x, "x", allow_empty=False)
        if len(xt) < self.nlist:
            raise ValueError(f"train needs at least nlist={self.nlist} vectors, got {len(xt)}")
        spherical = self.metric != "l2"
        xk = torch.nn.functional.normalize(xt, dim=1) if self.metric == "ip" else xt
        km = faiss.Kmeans(self.dim, self.nlist, niter=self.niter, seed=self.seed, spherical=spherical, verbose=False)
        km.train(np.ascontiguousarray(xk.numpy()))
        centroids = torch.from_numpy(km.centroids.astype(np.float32))
        if not self.encoder.is_trained:  # a learned encoder fits what the lists will hold
            _, near = km.index.search(np.ascontiguousarray(xk.numpy()), 1)
            self.encoder.train(xt - centroids[torch.from_numpy(near[:, 0])] if self.by_residual else xt)
            self._scan_tools()
        self.set_centroids(centroids)

    def search(self, q: Any, k: int, allow: Any = None, progress: bool | None = None,
               nprobe: int | None = None) -> tuple[Any, Any]:
        """:meth:`FlatIndex.search <tqindex.index.BaseIndex.search>` over the ``nprobe`` nearest lists
        (default: the ``nprobe`` attribute)."""
        nprobe = self.nprobe if nprobe is None else check_int(nprobe, "nprobe", 1)
        return self._search(q, k, allow, progress, {"nprobe": min(nprobe, self.nlist)})

    def list_sizes(self) -> np.ndarray:
        """Vectors per list, int64 [nlist]."""
        return np.array([c.size for c in self._lists], dtype=np.int64)

    # -- hooks --------------------------------------------------------------------------------------
    def set_centroids(self, centroids: Any) -> None:
        """Use these coarse centroids (float32 [nlist, dim], numpy or torch, e.g. trained elsewhere) instead
        of training; the index must be empty and its encoder trained."""
        if isinstance(centroids, np.ndarray):
            centroids = torch.from_numpy(centroids)
        if not isinstance(centroids, Tensor):
            raise TypeError(f"centroids must be a numpy array or torch tensor, got {type(centroids).__name__}")
        centroids = centroids.detach().cpu()
        if self.ntotal:
            raise ValueError(f"set_centroids must come before add: the index already holds {self.ntotal} vectors")
        if tuple(centroids.shape) != (self.nlist, self.dim) or centroids.dtype != torch.float32:
            raise ValueError(f"centroids must be float32 [{self.nlist}, {self.dim}], "
                             f"got {centroids.dtype} {tuple(centroids.shape)}")
        self.centroids = centroids
        self._centroids_rot = self.encoder.prepare_queries(centroids)
        self._centroid_norms2 = centroids.square().sum(1)

    def _coarse(self, x: Tensor, nprobe: int) -> tuple[Tensor, Tensor]:
        """The ``nprobe`` lists nearest to each of x [n, dim], nearest first: (coarse scores float32
        [n, nprobe]: <x, c>, or ||x - c||² for "l2"; list numbers int64 [n, nprobe])."""
        if self.centroids is None:
            raise ValueError("IVFIndex must be trained (index.train(x)) before add or search")
        step = max(1, TILE_BYTES // (4 * self.nlist))
        top = top_columns if self.compiled_scan else lambda s, k: torch.topk(s, k, dim=1)
        scores, lists = [], []
        for i in range(0, len(x), step):
            xb = x[i : i + step]
            if self.metric == "l2":  # 2<x, c> - ||c||² = ||x||² - ||x - c||²
                s = torch.addmm(self._centroid_norms2, xb, self.centroids.T, beta=-1, alpha=2)
            else:
                s = xb @ self.centroids.T  # [b, nlist]
            v, j = top(s, nprobe)
            scores.append(xb.square().sum(1, keepdim=True) - v if self.metric == "l2" else v)
            lists.append(j)
        return torch.cat(scores), torch.cat(lists)

    def _assign(self, x: Tensor) -> Tensor:
        return self._coarse(x, 1)[1][:, 0]

    def _residuals(self, x: Tensor, assign: Tensor) -> Tensor:
        return x - self.centroids[assign] if self.by_residual else x

    def _search_work(self, nq: int, nprobe: int) -> int:
        return nq * self.ntotal * nprobe // self.nlist

    def _scan(self, scan: BlockScan, q: Tensor, allowed: Tensor | None, nprobe: int) -> None:
        if not self.is_trained:
            return
        coarse, lists = self._coarse(q, nprobe)  # [m, nprobe]
        if scan.fast is not None and not self.by_residual:  # one set of tables per query serves all lists
            self._scan_compiled(scan, lists, allowed)
            return
        if scan.few and not (self.by_residual and scan.l2):
            self._scan_together(scan, coarse, lists, allowed)
            return
        order = torch.argsort(lists.reshape(-1), stable=True)  # (query, list) pairs grouped by list
        nos, counts = torch.unique_consecutive(lists.reshape(-1)[order], return_counts=True)
        rows, split = order // nprobe, counts.tolist()  # the queries of each list, ascending
        offsets = repeat(None)
        if self.by_residual:  # <q, x̂> = <q, c> + <q, r̂>;  "l2": ||q||² - ||q - x̂||² = ||q||² - ||q - c||² + ...
            coarse = coarse.reshape(-1)[order]  # <q, c>, or ||q - c||² for "l2"
            offsets = (q.square().sum(1)[rows] - coarse if scan.l2 else coarse).split(split)
        for no, list_rows, offset in zip(nos.tolist(), rows.split(split), offsets):
            lst = self._lists[no]
            if lst.size:
                select = selected_rows(lst.live_ids, allowed)
                shift = 2 * self._centroids_rot[no] if self.by_residual and scan.l2 else None  # ... + 2<q - c, r̂> - ||r̂||²
                scan.run(lst.live_codes, no << LIST_SHIFT, select, list_rows, offset, shift)

    def _scan_compiled(self, scan: BlockScan, lists: Tensor, allowed: Tensor | None) -> None:
        """Raw codes, every probed list [m, nprobe] in one call of the compiled scan; its rows labelled by id
        unless re-ranking needs their place."""
        start, queries = group_pairs(lists, self.nlist)  # the queries of list l: queries[start[l]:start[l + 1]]
        scan.labels_are_ids = not self.keep_vectors
        if allowed is None:  # every list, each probed by its queries (none for most)
            code_lists = self._code_lists(scan.labels_are_ids)
        else:  # the probed lists, their rows in ``allowed``
            counts = start.diff()
            runs = []
            for no in counts.nonzero()[:, 0].tolist():
                lst, base = self._lists[no], no << LIST_SHIFT
                select = selected_rows(lst.live_ids, allowed) if lst.size else None
                labels = (lst.live_ids[select] if scan.labels_are_ids else select + base) if lst.size else base
                runs.append((lst.live_codes[select] if lst.size else None, labels))
            code_lists, start = CodeLists(runs), F.pad(counts[counts > 0], (1, 0)).cumsum(0)
        work = scan.fast.run_lists(scan.qs, code_lists, start, queries, scan.top, scan.l2)
        if scan.bar is not None:
            scan.bar.update(work)

    def _code_lists(self, by_id: bool) -> CodeLists:
        """Every list as the compiled scan reads it, its rows labelled by id (``by_id``) or by list and row,
        rebuilt when the lists change (add and remove replace ``_lists``)."""
        if self._code_lists_cache[0] is not self._lists or self._code_lists_cache[1] != by_id:
            runs = [(lst.live_codes, lst.live_ids if by_id else no << LIST_SHIFT) if lst.size else (None, 0)
                    for no, lst in enumerate(self._lists)]
            self._code_lists_cache = (self._lists, by_id, CodeLists(runs))
        return self._code_lists_cache[2]

    def _scan_together(self, scan: BlockScan, coarse: Tensor, lists: Tensor, allowed: Tensor | None) -> None:
        """Few queries: the probed lists are scanned together, DECODE_ELEMENTS coordinates at a time, for
        all query rows; a (query, list) pair that was not probed gets -inf (not in the results)."""
        probed = torch.unique(lists)  # sorted list numbers
        add = torch.full((len(lists), len(probed)), -math.inf)  # [m, probed]: score offset per (query, list)
        add.scatter_(1, torch.searchsorted(probed, lists), coarse if self.by_residual else torch.zeros_like(coarse))
        chunk, group, total = max(1, DECODE_ELEMENTS // self.dim), [], 0
        for j, no in enumerate(probed.tolist()):
            lst = self._lists[no]
            if lst.size:
                if allowed is None:
                    group.append((j, no, lst.size, None, lst.live_codes))
                else:
                    rows = selected_rows(lst.live_ids, allowed)
                    group.append((j, no, len(rows), rows, lst.live_codes[rows]))
                total += group[-1][2]
            if group and (total >= chunk or j == len(probed) - 1):
                self._push_together(scan, add, group)
                group, total = [], 0

    @staticmethod
    def _push_together(scan: BlockScan, add: Tensor, group: list[tuple]) -> None:
        """Score the codes of ``group`` [(probed index, list number, count, selected rows or None, codes)]
        in one block."""
        js, nos, counts, selected, codes = zip(*group)
        sizes = torch.tensor(counts)
        if sum(counts) == 0:
            return
        cols = torch.repeat_interleave(torch.tensor(js), sizes)  # probed index per code
        if selected[0] is None:  # every row of each list: row = position - start of its list
            rows = torch.arange(sum(counts)) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
        else:
            rows = torch.cat(selected)
        labels = torch.repeat_interleave(torch.tensor(nos) << LIST_SHIFT, sizes) + rows
        scan.top.push(scan.all_scores(Codes.cat(codes)) + add[:, cols], labels)
        if scan.bar is not None:
            scan.bar.update(len(add) * sum(counts))

    def _fixed_bytes(self) -> int:
        """Encoder tensors + centroids, rotated centroids and their norms."""
        return super()._fixed_bytes() + (0 if self.centroids is None else (2 * self.dim + 1) * self.nlist * 4)

    # -- files --------------------------------------------------------------------------------------
    def _header_extra(self) -> dict[str, Any]:
        return {"ivf": {"nlist": self.nlist, "by_residual": self.by_residual, "nprobe": self.nprobe,
                        "seed": self.seed, "niter": self.niter, "trained": self.is_trained}}

    def _arrays_extra(self) -> dict[str, np.ndarray]:
        offsets = np.concatenate([[0], np.cumsum(self.list_sizes())]).astype(np.int64)
        out = {"ivf/list_offsets": offsets}
        if self.centroids is not None:
            out["ivf/centroids"] = self.centroids.numpy()
        return out

    @classmethod
    def _from_file(cls, header: dict, arrays: dict[str, np.ndarray]) -> "IVFIndex":
        ivf = header["ivf"]
        index = cls(cls._encoder_from_file(header, arrays), ivf["nlist"], header["metric"], by_residual=ivf["by_residual"],
                    nprobe=ivf["nprobe"], seed=ivf["seed"], niter=ivf["niter"], **cls._options_from_file(header))
        if ivf["trained"]:
            index.set_centroids(torch.from_numpy(arrays["ivf/centroids"]))
        offsets = arrays["ivf/list_offsets"]
        if offsets.shape != (index.nlist + 1,) or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise ValueError(f"ivf/list_offsets must be non-decreasing [{index.nlist + 1}] from 0, got {offsets.shape}")
        if offsets[-1] and not ivf["trained"]:
            raise ValueError("an untrained IVF index cannot hold vectors")
        index._restore(header, arrays, offsets.tolist())
        return index


register_index_type(IVFIndex.index_type, IVFIndex._from_file)
