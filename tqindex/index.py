"""FlatIndex (exhaustive search over codes) and what every index shares: ids, validation, add / remove /
search, re-ranking, devices and files.

The database is held only as codes (plus int64 ids where they are not 0, 1, 2, ...), on the index's
device. Queries are rotated once; the encoder's scorer (``tqindex.scorer``: lookup tables, the compiled
CPU scan or the GPU kernels, chosen by ``kernels.select``) scores the codes into a running top-k, so no
[nq, ntotal] score matrix is ever built.

Inside, scores are "larger is better": ``<q, x̂>`` for "ip" and "cosine", and for "l2"
``||q||² - ||q - x̂||² = 2<q, x̂> - ||x̂||²``; the distance is ``||q||²`` minus the score.

Concurrency: writers (add, remove_ids, train, to) are serialized by a lock and publish a new immutable
:class:`~tqindex.storage.IndexState` in one assignment; a search reads the state once, without a lock,
so it sees the index as it was before or after each write, never in between.
"""

from __future__ import annotations

import math
import os
import threading
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from . import kernels
from .kernels.graphs import SearchGraphs
from .checks import (NORM_SAFE, as_float_tensor, check_bool, check_choice, check_finite, check_int, check_norms,
                     id_array, row_norms, rows_in_range, unit_rows)
from .codes import Codes
from .encoder import Encoder, encoder_from_dict
from .io import register_index_type, write_index_file
from .scorer import Scorer
from .storage import CodeList, IndexState
from .topk import TopK, make_topk

METRICS = ("ip", "cosine", "l2")
VECTOR_DTYPES = {"float16": torch.float16, "float32": torch.float32}
INDEX_NORMS = (2.0**-60, 2.0**60)
"""Nonzero norms of the vectors and queries of "ip" and "l2" indexes: their scores, squares and
squared distances stay within float32's normal range."""
ADD_CHUNK = 1 << 16
PROGRESS_MIN_ADD = 1 << 20
"""Adds of at least this many vectors show a progress bar (unless ``progress=False``)."""
PROGRESS_MIN_SCORES = 1 << 30
"""Searches computing at least this many vector scores show a progress bar (on the CPU)."""
PROGRESS_MIN_SCORES_GPU = 1 << 38
"""The same on a CUDA device (about a second of scanning)."""
RERANK_ELEMENTS = 1 << 24


def check_device(device: Any) -> torch.device:
    """``device`` (str or torch.device; None: the CPU) as a torch.device that exists here."""
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    return torch.device("cuda", torch.cuda.current_device()) if dev == torch.device("cuda") else dev


class BaseIndex(ABC):
    """Ids, validation, add / search / remove, re-ranking, devices and files shared by every index.

    Subclasses hold ``nlists`` :class:`~tqindex.storage.CodeList` runs and implement :meth:`_scan` (and,
    for IVF, :meth:`_assign` / :meth:`_residuals`).
    """

    index_type = "BaseIndex"

    def __init__(self, encoder: Encoder, metric: str, keep_vectors: bool, vectors_dtype: str,
                 rerank_factor: int, nlists: int, device: Any = None, backend: str | None = None) -> None:
        if not isinstance(encoder, Encoder):
            raise TypeError(f"encoder must be a tqindex Encoder, got {type(encoder).__name__}")
        check_choice(metric, "metric", METRICS)
        check_bool(keep_vectors, "keep_vectors")
        check_choice(vectors_dtype, "vectors_dtype", VECTOR_DTYPES)
        self.encoder = encoder
        self.metric = metric
        self.keep_vectors = keep_vectors
        self.vectors_dtype = vectors_dtype
        self.rerank_factor = check_int(rerank_factor, "rerank_factor", 1)
        self.device = check_device(device)
        self.backend = kernels.check_backend(backend)
        self._state = IndexState(tuple(CodeList() for _ in range(nlists)))
        self._writer = threading.RLock()
        self._graphs = SearchGraphs()

    @property
    def cuda_graphs(self) -> int:
        """How many search shapes (queries, k, options) an index on a CUDA device keeps recorded as CUDA
        graphs (default 8, each holding its search's buffers; searches of up to 256 queries are recorded the
        third time their shape comes); 0 records none. Not saved in index files."""
        return self._graphs.limit

    @cuda_graphs.setter
    def cuda_graphs(self, limit: int) -> None:
        self._graphs.resize(check_int(limit, "cuda_graphs", 0))

    def _check_trained(self) -> None:
        if not self.is_trained:
            raise ValueError(f"the index must be trained first: call index.train(x) ({self.encoder!r})")

    # -- properties ---------------------------------------------------------------------------------
    @property
    @abstractmethod
    def is_trained(self) -> bool:
        """False while :meth:`train` is still needed."""

    @property
    def dim(self) -> int:
        return self.encoder.dim

    @property
    def ntotal(self) -> int:
        """Number of stored vectors."""
        return self._state.ntotal

    def __len__(self) -> int:
        return self.ntotal

    @property
    def ids(self) -> np.ndarray:
        """All stored ids (int64 [ntotal], storage order; a copy)."""
        return self._state.all_ids().cpu().numpy().copy()

    def memory_bytes(self) -> int:
        """Bytes held: code, id (and kept vector) buffers as allocated + encoder tensors (+ IVF centroids).

        Ids are held only where they are not the row numbers: a FlatIndex filled with the default ids (and
        no removal) holds none. Buffers grow by doubling; after one add into an empty index, and after
        :func:`~tqindex.load_index`, they hold exactly ``ntotal`` rows.
        """
        return self._state.nbytes + self._fixed_bytes()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.encoder!r}, metric={self.metric!r}, ntotal={self.ntotal}, "
                f"device={self.device})")

    def to(self, device: Any) -> "BaseIndex":
        """Move codes, ids and kept vectors to ``device`` ("cpu", "cuda", ...) in place; -> this index."""
        device = check_device(device)
        with self._writer:
            state = self._state
            self._moved(device)
            self._state = IndexState(tuple(c.to(device) for c in state.lists), state.next_id)
            self.device = device
        return self

    # -- add / remove -------------------------------------------------------------------------------
    def add(self, x: Any, ids: Any = None, progress: bool | None = None) -> None:
        """Add vectors x [n, dim] (numpy or torch float) with int64 ``ids`` [n] (default: the ids after
        the largest one so far, i.e. ``ntotal, ntotal+1, ...`` for an index that never had ids given
        or removed). Invalid input raises and leaves the index unchanged; so does an interrupt.
        Vectors with norms outside what the index holds faithfully (see ``tqindex.checks``) are refused,
        naming them."""
        self._check_trained()
        xt = self._vectors_in(x, "x", allow_empty=False, stored=True)
        n = xt.shape[0]
        given = None if ids is None else torch.from_numpy(id_array(ids, "ids", n))
        assign = self._assign(xt)  # [n] int64 list numbers
        show = _show(progress, n >= PROGRESS_MIN_ADD)
        parts = []
        with tqdm(total=n, unit="vec", desc="add", disable=not show) as bar:
            for i in range(0, n, ADD_CHUNK):
                block = self._residuals(xt[i : i + ADD_CHUNK], assign[i : i + ADD_CHUNK])
                parts.append(self.encoder.encode_valid(block, self.backend))
                bar.update(len(parts[-1]))
        codes = parts[0] if len(parts) == 1 else Codes.cat(parts)
        vectors = xt.to(VECTOR_DTYPES[self.vectors_dtype]) if self.keep_vectors else None
        with self._writer:
            state = self._state
            new_ids = self._new_ids(state, given, n)
            lists = list(state.lists)
            if len(lists) == 1:
                lists[0] = lists[0].appended(codes, new_ids, vectors)
            else:
                order = torch.argsort(assign, stable=True)
                counts = torch.bincount(assign, minlength=len(lists)).tolist()
                start = 0
                for no, count in enumerate(counts):
                    if count:
                        rows = order[start : start + count]
                        vec = None if vectors is None else vectors[rows]
                        lists[no] = lists[no].appended(codes[rows], new_ids[rows], vec)
                        start += count
            self._state = IndexState(tuple(lists), max(state.next_id, int(new_ids.max()) + 1))

    def add_with_ids(self, x: Any, ids: Any, progress: bool | None = None) -> None:
        """faiss-style alias of ``add(x, ids=ids)``."""
        self.add(x, ids=ids, progress=progress)

    def remove_ids(self, ids: Any) -> int:
        """Remove the vectors with these ids (unknown ids are ignored); -> number removed."""
        gone = torch.from_numpy(np.unique(id_array(ids, "ids"))).to(self.device)
        with self._writer:
            state = self._state
            lists, removed = list(state.lists), 0
            for no, lst in enumerate(lists):
                if lst.size:
                    keep = ~torch.isin(lst.live_ids, gone)
                    kept = int(keep.sum())
                    if kept < lst.size:
                        removed += lst.size - kept
                        lists[no] = lst.kept(keep)
            if removed:
                self._state = IndexState(tuple(lists), state.next_id)
        return removed

    # -- search -------------------------------------------------------------------------------------
    def search(self, q: Any, k: int, allow: Any = None, progress: bool | None = None) -> tuple[Any, Any]:
        """Top-k search. q [nq, dim] float (numpy -> numpy out, torch -> torch out on q's device).

        Returns (D, I): D float32 [nq, k] scores ("ip": <q, x̂>, "cosine": cosine of q and x̂, "l2":
        squared distance), I int64 [nq, k] ids, best first; ``-1`` ids and ``-inf`` (``+inf`` for
        "l2") where fewer than k vectors exist. ``allow`` (ids, any order) restricts the search to
        those vectors inside the scan. With ``keep_vectors`` the top ``k * rerank_factor``
        candidates are re-ranked by exact scores of the kept vectors.
        """
        return self._search(q, k, allow, progress, {})

    def _search(self, q: Any, k: int, allow: Any, progress: bool | None, opts: dict[str, Any]) -> tuple[Any, Any]:
        """:meth:`search` with subclass scan options ``opts`` (passed to :meth:`_scan`, :meth:`_search_work`).
        On a CUDA device, a search without ``allow`` or progress bar is recorded as a CUDA graph when its
        shape keeps coming and replayed after that, validation included (:mod:`tqindex.kernels.graphs`)."""
        k = check_int(k, "k", 1)
        if not self.encoder.is_trained:  # an index without vectors (an untrained IVF) answers with padding
            self._check_trained()
        state = self._state  # one consistent snapshot for the whole search
        allowed = None if allow is None else torch.from_numpy(np.unique(id_array(allow, "allow"))).to(self.device)
        if self.device.type == "cuda" and allowed is None:
            raw = (q if isinstance(q, Tensor) else as_float_tensor(q, self.dim, "q", allow_empty=True)).to(self.device)
            rows = len(raw) if raw.dim() == 2 and state.ntotal else 0  # 0: nothing to record
            if rows and not self._shows_progress(self._search_work(state, rows, **opts), progress):
                key = (tuple(raw.shape), raw.dtype, k, *sorted(opts.items()))
                D, I = self._graphs.run(state, key, raw, lambda r: self._search_on(state, r, k, None, progress, opts))
            else:
                D, I = self._search_on(state, raw, k, None, progress, opts)
        else:
            D, I = self._search_on(state, q, k, allowed, progress, opts)
        if isinstance(q, Tensor):
            return D.to(q.device), I.to(q.device)
        return D.cpu().numpy(), I.cpu().numpy()

    def _search_on(self, state: IndexState, q: Any, k: int, allowed: Tensor | None, progress: bool | None,
                   opts: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """Validate queries q [nq, dim] and search ``state`` -> (D float32 [nq, k], I int64 [nq, k]) on the
        index's device."""
        qt = self._vectors_in(q, "q", allow_empty=True)
        work = self._search_work(state, len(qt), **opts)
        show = self._shows_progress(work, progress)
        depth = k * self.rerank_factor if self.keep_vectors else k
        l2 = self.metric == "l2"
        top = make_topk(len(qt), depth, self.device, self.backend)
        with tqdm(total=work, unit="score", unit_scale=True, desc="search", disable=not show) as bar:
            if len(qt) and state.ntotal:
                qr = self.encoder.rotate(qt)  # [nq, dim]
                scorer = self.encoder.scorer(2 * qr if l2 else qr, l2, self.backend, self._shifted_scan(l2),
                                             bar if show else None)
                labels_are_ids = self._scan(state, scorer, top, qt, allowed, **opts)
            else:
                labels_are_ids = False
            bar.total = bar.n  # the work estimate is exact only without ``allow``
        values, labels = top.result()
        if self.keep_vectors:
            values, labels = self._rerank(state, qt, values, labels, k)
        D = qt.square().sum(1, keepdim=True) - values if l2 else values
        return D, labels if labels_are_ids else state.ids_of(labels)

    def _shows_progress(self, work: int, progress: bool | None) -> bool:
        """Whether a search of ``work`` scores shows a progress bar (``progress``, else by its work)."""
        return _show(progress, work >= (PROGRESS_MIN_SCORES_GPU if self.device.type == "cuda" else PROGRESS_MIN_SCORES))

    def _rerank(self, state: IndexState, qt: Tensor, values: Tensor, labels: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Exact scores of the candidates from the kept vectors -> (values [m, k], labels [m, k]) best first."""
        step = max(1, RERANK_ELEMENTS // (max(1, labels.shape[1]) * self.dim))
        out_v, out_l = [], []
        for i in range(0, len(qt), step):
            lab = labels[i : i + step]
            vec = state.vectors_of(lab, self.dim, VECTOR_DTYPES[self.vectors_dtype]).float()  # [m, depth, dim]
            q = qt[i : i + step, None, :]  # [m, 1, dim]
            exact = (vec * (2 * q - vec) if self.metric == "l2" else vec * q).sum(-1)  # [m, depth]
            exact.masked_fill_(lab < 0, -math.inf)
            v, j = torch.topk(exact, min(k, exact.shape[1]), dim=1)
            out_v.append(v)
            out_l.append(lab.gather(1, j))
        if not out_v:
            return values[:, :k], labels[:, :k]
        values, labels = torch.cat(out_v), torch.cat(out_l)
        pad = k - values.shape[1]
        return (torch.nn.functional.pad(values, (0, pad), value=-math.inf),
                torch.nn.functional.pad(labels, (0, pad), value=-1))

    # -- helpers ------------------------------------------------------------------------------------
    def _vectors_in(self, x: Any, name: str, allow_empty: bool, stored: bool = False) -> Tensor:
        """Validate [n, dim] input -> float32 tensor on the index's device (unit rows for "cosine").
        Norms must suit the metric, and, for ``stored`` vectors, the encoder's side data (one Triton launch where
        it runs: :func:`~tqindex.checks.rows_in_range`)."""
        cosine = self.metric == "cosine"
        t = as_float_tensor(x, self.dim, name, allow_empty=allow_empty, finite=False)
        if t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D array [n, {self.dim}], got shape {tuple(t.shape)}")
        t = t.to(self.device)
        if not len(t):
            return t
        checked = rows_in_range(t, cosine, *(NORM_SAFE if cosine else INDEX_NORMS), self.encoder._backend(self.backend))
        if checked is not None:
            if stored and not cosine:
                self.encoder.check_norms(checked[1], name)
            return checked[0]
        if cosine:
            check_finite(t, name)
            return unit_rows(t)[1]
        norms = row_norms(t)
        check_norms(norms, *INDEX_NORMS, name, f"an {self.metric!r} index",
                    "rescale the vectors (scores and squared distances are float32)", t)
        if stored:
            self.encoder.check_norms(norms, name)
        return t

    def _new_ids(self, state: IndexState, given: Tensor | None, n: int) -> Tensor:
        """The ids of n new vectors: ``given`` (distinct int64 [n]) when none is stored yet, else the next ones."""
        if given is None:
            return torch.arange(state.next_id, state.next_id + n, device=self.device)
        given = given.to(self.device)
        if int(given.min()) < state.next_id:  # ids above every id ever added need no lookup
            present = given[given < state.ntotal] if state.rows_are_ids else given[torch.isin(given, state.all_ids())]
            if len(present):
                raise ValueError(f"ids already in the index: {present[:5].tolist()}")
        return given

    def _fixed_bytes(self) -> int:
        """Bytes of tensors that do not grow with ntotal (encoder rotation and codebooks, ...)."""
        return sum(t.numel() * t.element_size() for t in self.encoder.tensors().values())

    # -- subclass hooks -----------------------------------------------------------------------------
    def _assign(self, x: Tensor) -> Tensor:
        """List number of each vector x [n, dim] -> int64 [n]."""
        return torch.zeros(len(x), dtype=torch.int64, device=x.device)

    def _residuals(self, x: Tensor, assign: Tensor) -> Tensor:
        """What is encoded for vectors x [n, dim] assigned to lists ``assign`` [n]."""
        return x

    def _shifted_scan(self, l2: bool) -> bool:
        """Whether scans shift the queries per list (residual IVF lists under "l2")."""
        return False

    def _moved(self, device: torch.device) -> None:
        """Move what the subclass holds besides the lists to ``device``."""

    def _search_work(self, state: IndexState, nq: int, **opts: Any) -> int:
        """Vector scores a search of nq queries computes (decides the progress bar)."""
        return nq * state.ntotal

    @abstractmethod
    def _scan(self, state: IndexState, scorer: Scorer, top: TopK, q: Tensor, allowed: Tensor | None,
              **opts: Any) -> bool:
        """Push the scores of the lists of ``state`` for queries q [m, dim] (``scorer`` holds them prepared)
        into ``top``; allowed: sorted int64 ids or None. -> whether the labels pushed are ids."""

    # -- files --------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the index to ``path`` (HDF5, see ``tqindex.io``), atomically."""
        state = self._state
        header = {
            "index_type": self.index_type,
            "metric": self.metric,
            "dim": self.dim,
            "ntotal": state.ntotal,
            "code_size": self.encoder.code_size,
            "encoder": self.encoder.to_dict(),
            "options": {**self._options(), "next_id": state.next_id},
        }
        live = [c for c in state.lists if c.size]
        arrays = {f"encoder/{name}": t.numpy() for name, t in self.encoder.tensors().items()}
        arrays["ids"] = state.all_ids().cpu().numpy()
        if live:
            codes = Codes.cat([c.live_codes for c in live])
            arrays.update({f"codes/{name}": t.cpu().numpy() for name, t in codes.planes()})
            if self.keep_vectors:
                arrays["vectors"] = torch.cat([c.vectors[: c.size] for c in live]).cpu().numpy()
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
        next_id = int(header["options"]["next_id"])
        if not n:
            self._state = IndexState(self._state.lists, next_id)
            return
        codes = Codes(**planes)
        if codes.shape != (n,) or codes.nbytes != n * self.encoder.code_size:
            raise ValueError(f"codes of shape {tuple(codes.shape)} and {codes.nbytes} bytes do not match "
                             f"ntotal={n} x code_size={self.encoder.code_size}")
        expected = ((n, self.dim), VECTOR_DTYPES[self.vectors_dtype])
        if vectors is not None and (tuple(vectors.shape), vectors.dtype) != expected:
            raise ValueError(f"kept vectors {tuple(vectors.shape)} {vectors.dtype} do not match the header")
        lists = []
        for a, b in zip(offsets[:-1], offsets[1:]):  # views of the loaded arrays: capacity = size
            row_ids = None if torch.equal(ids[a:b], torch.arange(b - a)) else ids[a:b]
            vec = None if vectors is None else vectors[a:b]
            lists.append(CodeList(codes[a:b], row_ids, vec, b - a) if b > a else CodeList())
        self._state = IndexState(tuple(lists), next_id)


class FlatIndex(BaseIndex):
    """Exhaustive search over codes: ``FlatIndex(TurboQuantMSE(dim=50, bits=4), metric="ip")``.

    metric: "ip" (score = the encoder's inner-product estimate), "cosine" (x and q normalized
    first) or "l2" (squared distance to the reconstruction). keep_vectors: also keep the original
    vectors (``vectors_dtype``) and re-rank the top ``k * rerank_factor`` candidates exactly.
    device: where codes, ids and kept vectors live and searches run ("cpu", "cuda"; see :meth:`to`).
    backend: the kernels of encoding and scans ("torch", "native", "triton", "auto"; None: the encoder's,
    else ``$TQINDEX_BACKEND``, else auto; see ``tqindex.kernels``).

    Thread safety: any number of threads may search, add and remove at once. Adds and removes are
    serialized and never lost; each search sees the index as it was before or after each of them (never
    a partial write), never raises because of them and never returns a removed id.
    """

    index_type = "FlatIndex"

    def __init__(self, encoder: Encoder, metric: str = "ip", keep_vectors: bool = False,
                 vectors_dtype: str = "float32", rerank_factor: int = 4, device: Any = None,
                 backend: str | None = None) -> None:
        super().__init__(encoder, metric, keep_vectors, vectors_dtype, rerank_factor, 1, device, backend)

    def train(self, x: Any) -> None:
        """Fit a learned encoder (TurboQuantPCA) to vectors x [n, dim]; others need no training."""
        with self._writer:
            if self.ntotal:
                raise ValueError(f"train must come before add: the index already holds {self.ntotal} vectors")
            self.encoder.train(self._vectors_in(x, "x", allow_empty=False).cpu())

    @property
    def is_trained(self) -> bool:
        return self.encoder.is_trained

    def _scan(self, state: IndexState, scorer: Scorer, top: TopK, q: Tensor, allowed: Tensor | None) -> bool:
        lst = state.lists[0]
        if lst.size:
            if allowed is None:
                scorer.push(lst.live_codes, 0, top)
            else:
                rows = selected_rows(lst.live_ids, allowed)
                scorer.push(lst.live_codes[rows], rows, top)
        return False

    @classmethod
    def _from_file(cls, header: dict, arrays: dict[str, np.ndarray]) -> "FlatIndex":
        index = cls(cls._encoder_from_file(header, arrays), header["metric"], **cls._options_from_file(header))
        index._restore(header, arrays, [0, int(header["ntotal"])])
        return index


def selected_rows(ids: Tensor, allowed: Tensor | None) -> Tensor | None:
    """Rows (int64) of ids [n] that are in ``allowed`` (sorted int64 ids), or None (all) when allowed is None."""
    return None if allowed is None else torch.nonzero(torch.isin(ids, allowed)).squeeze(1)


def _show(progress: bool | None, large: bool) -> bool:
    """Progress bar decision: explicit ``progress`` wins, else shown for large work."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None, got {progress!r}")
    return large if progress is None else progress


register_index_type(FlatIndex.index_type, FlatIndex._from_file)
