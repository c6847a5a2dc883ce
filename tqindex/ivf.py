"""IVFIndex: a coarse k-means partition (faiss) with one growing run of codes per list.

A vector x goes to its nearest centroid c_l. With ``by_residual=True`` the code stores r = x - c_l
and x̂ = c_l + r̂, so ``<q, x̂> = <q, c_l> + <q, r̂>`` and
``||q - x̂||² = ||q - c_l||² - 2<q - c_l, r̂> + ||r̂||²``: the coarse search gives the first term,
the list scan the rest. With ``by_residual=False`` x itself is encoded and lists are scanned as in
FlatIndex.

The list scans belong to the encoder's scorer (``Scorer.push_lists``): the compiled CPU scan searches
every probed list of a query in one kernel call, the GPU scan one program per (list, queries) group,
and the PyTorch scan list by list (many queries) or over the union of the probed lists (few queries).
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np
import torch
from torch import Tensor

from . import kernels
from .checks import check_bool, check_int
from .encoder import Encoder
from .index import BaseIndex, selected_rows
from .io import register_index_type
from .scorer import TILE_BYTES, Scorer
from .storage import LIST_SHIFT, IndexState
from .topk import TopK


class _ListsView(list):
    """The lists of one index state as scorers read them; compiled scans cache their own form on it."""


class IVFIndex(BaseIndex):
    """Inverted-file index: ``IVFIndex(make_encoder("tq4", 50), nlist=1024, metric="cosine")``.

    ``train(x)`` runs seeded k-means (spherical for "ip"/"cosine", on normalized vectors; plain
    for "l2"); ``search(q, k, nprobe=...)`` scans the ``nprobe`` lists nearest to each query (by
    inner product, or by L2 distance for "l2"). Ids, filtering, removal, re-ranking, devices, backends
    and files work as in :class:`~tqindex.index.FlatIndex`, and so does thread safety: concurrent
    searches, adds and removes lose nothing and each search sees a consistent index.

    ``by_residual`` encodes x - c_l instead of x. The encoders keep one scale per vector, so the
    residual's smaller norm buys little: on GloVe-50 (tq4, nlist=1024) residual codes had 23 % less
    reconstruction error but the same recall (R@1@1 0.827 vs 0.831 raw at nprobe=128), hence the
    default False, whose list scans need no per-list query shift.
    """

    index_type = "IVFIndex"

    def __init__(self, encoder: Encoder, nlist: int, metric: str = "ip", by_residual: bool = False,
                 nprobe: int = 8, seed: int = 0, niter: int = 20, keep_vectors: bool = False,
                 vectors_dtype: str = "float32", rerank_factor: int = 4, device: Any = None,
                 backend: str | None = None) -> None:
        nlist = check_int(nlist, "nlist", 1)
        by_residual = check_bool(by_residual, "by_residual")
        super().__init__(encoder, metric, keep_vectors, vectors_dtype, rerank_factor, nlist, device, backend)
        self.nlist, self.by_residual = nlist, by_residual
        self.seed, self.niter = check_int(seed, "seed", 0), check_int(niter, "niter", 1)
        self.nprobe = nprobe
        self._coarse_state: tuple[Tensor, Tensor, Tensor] | None = None  # centroids, R c, ||c||² on the device

    @property
    def nprobe(self) -> int:
        """Lists scanned per query (default for :meth:`search`)."""
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        self._nprobe = check_int(value, "nprobe", 1)

    @property
    def centroids(self) -> Tensor | None:
        """The coarse centroids, float32 [nlist, dim] on the CPU (None before training)."""
        return None if self._coarse_state is None else self._coarse_state[0].cpu()

    @property
    def is_trained(self) -> bool:
        return self._coarse_state is not None and self.encoder.is_trained

    def train(self, x: Any) -> None:
        """Learn the ``nlist`` centroids from x [n, dim] (n >= nlist) by seeded faiss k-means (on the CPU)."""
        with self._writer:
            if self.ntotal:
                raise ValueError(f"train must come before add: the index already holds {self.ntotal} vectors")
            xt = self._vectors_in(x, "x", allow_empty=False).cpu()
            if len(xt) < self.nlist:
                raise ValueError(f"train needs at least nlist={self.nlist} vectors, got {len(xt)}")
            spherical = self.metric != "l2"
            xk = torch.nn.functional.normalize(xt, dim=1) if self.metric == "ip" else xt
            km = faiss.Kmeans(self.dim, self.nlist, niter=self.niter, seed=self.seed, spherical=spherical,
                              verbose=False)
            km.train(np.ascontiguousarray(xk.numpy()))
            centroids = torch.from_numpy(km.centroids.astype(np.float32))
            if not self.encoder.is_trained:  # a learned encoder fits what the lists will hold
                _, near = km.index.search(np.ascontiguousarray(xk.numpy()), 1)
                self.encoder.train(xt - centroids[torch.from_numpy(near[:, 0])] if self.by_residual else xt)
            self.set_centroids(centroids)

    def set_centroids(self, centroids: Any) -> None:
        """Use these coarse centroids (float32 [nlist, dim], numpy or torch, e.g. trained elsewhere) instead
        of training; the index must be empty."""
        if isinstance(centroids, np.ndarray):
            centroids = torch.from_numpy(centroids)
        if not isinstance(centroids, Tensor):
            raise TypeError(f"centroids must be a numpy array or torch tensor, got {type(centroids).__name__}")
        if tuple(centroids.shape) != (self.nlist, self.dim) or centroids.dtype != torch.float32:
            raise ValueError(f"centroids must be float32 [{self.nlist}, {self.dim}], "
                             f"got {centroids.dtype} {tuple(centroids.shape)}")
        with self._writer:
            if self.ntotal:
                raise ValueError(f"set_centroids must come before add: the index already holds {self.ntotal} vectors")
            self._moved(self.device, centroids.detach())

    def search(self, q: Any, k: int, allow: Any = None, progress: bool | None = None,
               nprobe: int | None = None) -> tuple[Any, Any]:
        """:meth:`FlatIndex.search <tqindex.index.BaseIndex.search>` over the ``nprobe`` nearest lists
        (default: the ``nprobe`` attribute)."""
        nprobe = self.nprobe if nprobe is None else check_int(nprobe, "nprobe", 1)
        return self._search(q, k, allow, progress, {"nprobe": min(nprobe, self.nlist)})

    def list_sizes(self) -> np.ndarray:
        """Vectors per list, int64 [nlist]."""
        return np.array([c.size for c in self._state.lists], dtype=np.int64)

    # -- hooks --------------------------------------------------------------------------------------
    def _moved(self, device: torch.device, centroids: Tensor | None = None) -> None:
        """Hold the coarse state (``centroids``, or the current ones) on ``device``."""
        if centroids is None:
            if self._coarse_state is None:
                return
            centroids = self._coarse_state[0]
        c = centroids.to(device)
        self._coarse_state = (c, self.encoder.rotate(c.float()), c.square().sum(1))

    def _coarse(self, x: Tensor, nprobe: int) -> tuple[Tensor, Tensor]:
        """The ``nprobe`` lists nearest to each of x [n, dim], nearest first: (coarse scores float32
        [n, nprobe]: <x, c>, or ||x - c||² for "l2"; list numbers int64 [n, nprobe])."""
        centroids, _, norms2 = self._coarse_state
        step = max(1, TILE_BYTES // (4 * self.nlist))
        if kernels.select(x, self.backend, ("native", "triton"), "coarse list selection") == "native":
            from .kernels.fastscan import top_columns as top
        else:
            top = lambda s, k: torch.topk(s, k, dim=1)  # noqa: E731
        scores, lists = [], []
        for i in range(0, len(x), step):
            xb = x[i : i + step]
            if self.metric == "l2":  # 2<x, c> - ||c||² = ||x||² - ||x - c||²
                s = torch.addmm(norms2, xb, centroids.T, beta=-1, alpha=2)
            else:
                s = xb @ centroids.T  # [b, nlist]
            v, j = top(s, nprobe)
            scores.append(xb.square().sum(1, keepdim=True) - v if self.metric == "l2" else v)
            lists.append(j)
        return torch.cat(scores), torch.cat(lists)

    def _assign(self, x: Tensor) -> Tensor:
        return self._coarse(x, 1)[1][:, 0]

    def _residuals(self, x: Tensor, assign: Tensor) -> Tensor:
        return x - self._coarse_state[0][assign] if self.by_residual else x

    def _shifted_scan(self, l2: bool) -> bool:
        return self.by_residual and l2

    def _search_work(self, state: IndexState, nq: int, nprobe: int) -> int:
        return nq * state.ntotal * nprobe // self.nlist

    def _scan(self, state: IndexState, scorer: Scorer, top: TopK, q: Tensor, allowed: Tensor | None,
              nprobe: int) -> bool:
        coarse, probes = self._coarse(q, nprobe)  # [m, nprobe]
        by_id = not self.keep_vectors  # rows labelled by id, unless re-ranking needs their place
        if allowed is None:
            lists = self._lists_view(state, by_id)
        else:  # the probed lists, their rows in ``allowed``
            lists = [(None, 0)] * self.nlist
            for no in torch.unique(probes).tolist():
                lst = state.lists[no]
                if lst.size:
                    rows = selected_rows(lst.live_ids, allowed)
                    lists[no] = (lst.live_codes[rows], lst.live_ids[rows] if by_id else rows + (no << LIST_SHIFT))
        offsets = shifts = None
        if self.by_residual:  # <q, x̂> = <q, c> + <q, r̂>;  "l2": ||q||² - ||q - x̂||² = ||q||² - ||q - c||² + ...
            offsets = q.square().sum(1, keepdim=True) - coarse if scorer.l2 else coarse
            shifts = 2 * self._coarse_state[1] if scorer.l2 else None  # ... + 2<q - c, r̂> - ||r̂||²
        scorer.push_lists(lists, probes, top, offsets, shifts)
        return by_id

    def _lists_view(self, state: IndexState, by_id: bool) -> _ListsView:
        """Every list of ``state`` as scorers read it (rows labelled by id, or by list and row), cached with
        the state."""
        key = ("lists", by_id)
        if key not in state.cache:
            state.cache[key] = _ListsView(
                (lst.live_codes, lst.live_ids if by_id else no << LIST_SHIFT) if lst.size else (None, 0)
                for no, lst in enumerate(state.lists))
        return state.cache[key]

    def _fixed_bytes(self) -> int:
        """Encoder tensors + centroids, rotated centroids and their norms."""
        return super()._fixed_bytes() + (0 if self._coarse_state is None else (2 * self.dim + 1) * self.nlist * 4)

    # -- files --------------------------------------------------------------------------------------
    def _header_extra(self) -> dict[str, Any]:
        return {"ivf": {"nlist": self.nlist, "by_residual": self.by_residual, "nprobe": self.nprobe,
                        "seed": self.seed, "niter": self.niter, "trained": self._coarse_state is not None}}

    def _arrays_extra(self) -> dict[str, np.ndarray]:
        offsets = np.concatenate([[0], np.cumsum(self.list_sizes())]).astype(np.int64)
        out = {"ivf/list_offsets": offsets}
        if self._coarse_state is not None:
            out["ivf/centroids"] = self.centroids.numpy()
        return out

    @classmethod
    def _from_file(cls, header: dict, arrays: dict[str, np.ndarray]) -> "IVFIndex":
        ivf = header["ivf"]
        index = cls(cls._encoder_from_file(header, arrays), ivf["nlist"], header["metric"],
                    by_residual=ivf["by_residual"], nprobe=ivf["nprobe"], seed=ivf["seed"], niter=ivf["niter"],
                    **cls._options_from_file(header))
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
