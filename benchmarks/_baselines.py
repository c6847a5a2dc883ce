"""Baseline indexes for ``benchmarks/ann.py``: faiss quantizers and turbovec, behind one small interface.

Each constructor returns a :class:`Baseline`: ``build(x)`` (train + add), ``search(q, k) -> (D, I)``
(faiss-style, float32 / int64 ``[nq, k]``, best first), ``bytes_per_vector`` (the codes plus the
per-vector side data the index stores, read from the index after ``build``) and ``timed_search``
(wall time of one batched search at a given thread count).

All baselines score by inner product (``metric="ip"``) or squared L2 (``metric="l2"``); cosine data
must be normalized by the caller and searched with ``"ip"``.

faiss details this module handles:

- ``OMP_WAIT_POLICY=PASSIVE`` must be in the environment before faiss loads its OpenMP runtime (an
  actively spinning pool slows faiss badly on a loaded machine): set it before importing faiss
  (``ann.py`` does).
- TurboQuant scalar quantizers (``"RR,SQtqmse{b}"``, ``"RR,SQtq{b}"``) store no norm: they are only
  meaningful on unit vectors. ``SQtqmse`` exists for b = 1..4 and 8, ``SQtq`` (Q_prod) for b = 2..5.
- ``IndexPQ`` / ``IndexPQFastScan`` need the sub-quantizer count M to divide d; to match a byte budget
  exactly, vectors are zero-padded to a multiple of M (zeros change no inner product or distance),
  the zeros spread over the sub-vectors (appending them all at the end would leave whole
  sub-quantizers coding zeros: PQ42x4 on d=50 padded to 84 = PQ25x4 + 17 wasted sub-quantizers).
- ``index_factory("PQ{M}x8")`` turns on polysemous training (a slow code-reordering step that only
  Hamming-filtered search uses); it is turned off here.
- ``IndexRaBitQ`` quantizes queries to ``qb`` bits (faiss default 4 for the flat index, 8 for
  FastScan); ``qb=0`` keeps them in float (measured: same recall, several times slower).
- turbovec needs d to be a multiple of 8 (zero-padded here), supports 2 and 4 bits, and sizes its
  thread pool (rayon) once per process from ``RAYON_NUM_THREADS``: its timings at a given thread count
  run in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import numpy as np

FAISS_TQMSE_BITS = (1, 2, 3, 4)
"""Bit widths (1-4) of faiss ``SQtqmse`` (TurboQuant Q_mse) scalar quantizers."""
FAISS_TQPROD_BITS = (2, 3, 4)
"""Bit widths (1-4) of faiss ``SQtq`` (TurboQuant Q_prod: b-1 MSE bits + 1 QJL bit)."""
TURBOVEC_BITS = (2, 4)
"""Bit widths turbovec supports."""


def _faiss():
    import faiss

    return faiss


def faiss_metric(metric: str) -> int:
    """faiss metric constant for ``"ip"`` or ``"l2"``."""
    faiss = _faiss()
    if metric == "ip":
        return faiss.METRIC_INNER_PRODUCT
    if metric == "l2":
        return faiss.METRIC_L2
    raise ValueError(f"metric must be 'ip' or 'l2' (normalize cosine data first), got {metric!r}")


def _pad(x: np.ndarray, dim: int, columns: np.ndarray | None = None) -> np.ndarray:
    """x [n, d] float32 -> [n, dim] float32 (dim >= d): x's columns at ``columns`` (default the
    first d), zeros elsewhere."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[1] == dim:
        return x
    out = np.zeros((x.shape[0], dim), np.float32)
    out[:, slice(0, x.shape[1]) if columns is None else columns] = x
    return out


def spread_layout(dim: int, m: int) -> tuple[int, np.ndarray]:
    """Zero padding of d = ``dim`` coordinates for m equal sub-vectors, spread evenly.

    Returns (padded dim m * ceil(d / m), destination column of each input coordinate [d] int64):
    every sub-vector gets floor(d / m) or ceil(d / m) real coordinates (1 or 0 when m > d), so no
    sub-quantizer is spent on zeros while another codes a full sub-vector.
    """
    dsub = -(-dim // m)
    counts = [dim // m + (j < dim % m) for j in range(m)] if m <= dim else [1] * dim + [0] * (m - dim)
    cols = [j * dsub + i for j, c in enumerate(counts) for i in range(c)]
    return m * dsub, np.asarray(cols, np.int64)


_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def set_threads(n: int) -> None:
    """Use n threads in faiss (OpenMP) and torch, on the first n of the CPUs this process started
    with (pinned, so timings do not move with the scheduler; child processes inherit it)."""
    import torch

    _faiss().omp_set_num_threads(n)
    torch.set_num_threads(n)
    if _CPUS:
        os.sched_setaffinity(0, _CPUS[: max(1, n)])


class Baseline(ABC):
    """A baseline index: build (train + add), search, bytes per vector, timed search.

    name: method name in result rows; family: result grouping ("faiss-pq", "turbovec", ...);
    bits: the nominal bits per coordinate the row is compared at; notes: how it was built.
    """

    def __init__(self, name: str, family: str, bits: int, notes: str = "") -> None:
        self.name, self.family, self.bits, self.notes = name, family, bits, notes

    @abstractmethod
    def build(self, x: np.ndarray) -> None:
        """Train on and add x [n, d] float32."""

    @abstractmethod
    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """q [nq, d] float32 -> (scores, ids) [nq, k] float32 / int64, best first."""

    @property
    @abstractmethod
    def bytes_per_vector(self) -> float:
        """Stored bytes per vector, codes plus per-vector side data (valid after build)."""

    def timed_search(self, q: np.ndarray, k: int, threads: int) -> float:
        """Wall-clock seconds of ``search(q, k)`` (one batched call) on ``threads`` threads, right after
        the same search untimed (steady state: lazily built tables, allocator, every core awake)."""
        set_threads(threads)
        self.search(q, k)
        t0 = time.perf_counter()
        self.search(q, k)
        return time.perf_counter() - t0


class FaissBaseline(Baseline):
    """A faiss index (factory string or constructor), with optional zero padding of the vectors."""

    def __init__(self, name: str, family: str, bits: int, make: Callable[[int], Any], dim: int,
                 pad_to: int | None = None, columns: np.ndarray | None = None,
                 search_params: Any = None, notes: str = "") -> None:
        super().__init__(name, family, bits, notes)
        self.dim, self.pad_to, self.columns = dim, pad_to or dim, columns
        self.make = make
        self.index: Any = None  # made in build(): an unsupported configuration fails there
        self.params = search_params
        self.train_rows: int | None = None
        """Train on at most this many (seeded random) rows; None: all rows, faiss samples itself."""

    def build(self, x: np.ndarray) -> None:
        x = _pad(x, self.pad_to, self.columns)
        self.index = self.make(self.pad_to)
        if not self.index.is_trained:
            train = x
            if self.train_rows is not None and len(x) > self.train_rows:
                rows = np.random.default_rng(0).choice(len(x), self.train_rows, replace=False)
                train = x[np.sort(rows)]
            self.index.train(train)
        self.index.add(x)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = _pad(q, self.pad_to, self.columns)
        if self.params is None:
            return self.index.search(q, k)
        return self.index.search(q, k, params=self.params)

    @property
    def bytes_per_vector(self) -> float:
        return float(self.index.sa_code_size())


def _factory(spec: str, metric: str) -> Callable[[int], Any]:
    return lambda d: _faiss().index_factory(d, spec, faiss_metric(metric))


def faiss_tq_mse(dim: int, bits: int, metric: str) -> FaissBaseline:
    """faiss TurboQuant Q_mse scalar quantizer (``"RR,SQtqmse{bits}"``); unit-norm data only."""
    return FaissBaseline(f"faiss-sq-tqmse{bits}", "faiss-turboquant", bits,
                         _factory(f"RR,SQtqmse{bits}", metric), dim,
                         notes=f"index_factory('RR,SQtqmse{bits}'), no stored norm")


def faiss_tq_prod(dim: int, bits: int, metric: str) -> FaissBaseline:
    """faiss TurboQuant Q_prod scalar quantizer (``"RR,SQtq{bits}"``); unit-norm data only."""
    return FaissBaseline(f"faiss-sq-tq{bits}", "faiss-turboquant", bits,
                         _factory(f"RR,SQtq{bits}", metric), dim,
                         notes=f"index_factory('RR,SQtq{bits}')")


def faiss_sq(dim: int, bits: int, metric: str) -> FaissBaseline:
    """faiss classic per-dimension trained uniform scalar quantizer (``"SQ{bits}"``, bits 4, 6, 8)."""
    return FaissBaseline(f"faiss-sq{bits}", "faiss-sq", bits, _factory(f"SQ{bits}", metric), dim,
                         notes=f"index_factory('SQ{bits}')")


def faiss_eden(dim: int, bits: int, metric: str, biased: bool = False) -> FaissBaseline:
    """faiss ``IndexEDEN`` via ``"EDEN{bits}"``: rotation + Lloyd-Max codes + one per-vector scale,
    unbiased for inner products (factory default) or, with ``biased``, the MSE-optimal scale."""
    faiss = _faiss()

    def make(d: int):
        index = faiss.index_factory(d, f"EDEN{bits}", faiss_metric(metric))
        index.scale_type = faiss.EDENScaleType_BIASED if biased else faiss.EDENScaleType_UNBIASED
        return index

    kind = "biased" if biased else "unbiased"
    return FaissBaseline(f"faiss-eden{bits}" + ("-biased" if biased else ""), "faiss-eden", bits,
                         make, dim, notes=f"index_factory('EDEN{bits}'), scale_type {kind}")


def _qb(make: Callable[[int], Any], dim: int, qb: int | None = None) -> str:
    """The query bits a RaBitQ index searches with: qb, else the default of a freshly made index."""
    if qb is not None:
        return str(qb)
    try:
        return str(make(dim).qb)
    except RuntimeError:
        return "?"


def faiss_rabitq(dim: int, bits: int, metric: str, qb: int | None = None) -> FaissBaseline:
    """faiss ``IndexRaBitQ(d, metric, nb_bits)``; qb: query bits (None: faiss default, 0: float)."""
    faiss = _faiss()
    params, suffix = None, ""
    if qb is not None:
        params = faiss.RaBitQSearchParameters()
        params.qb = qb
        suffix = f"-qb{qb}"

    def make(d: int):
        index = faiss.IndexRaBitQ(d, faiss_metric(metric), bits)
        if qb is not None:
            index.qb = qb
        return index

    return FaissBaseline(f"faiss-rabitq{bits}{suffix}", "faiss-rabitq", bits, make, dim,
                         search_params=params,
                         notes=f"IndexRaBitQ(d, metric, nb_bits={bits}), qb={_qb(make, dim, qb)}")


def faiss_rabitq_fastscan(dim: int, bits: int, metric: str) -> FaissBaseline:
    """faiss ``IndexRaBitQFastScan`` via ``"RaBitQfs{bits}"`` (``"RaBitQfs"`` for 1 bit)."""
    spec = "RaBitQfs" if bits == 1 else f"RaBitQfs{bits}"
    make = _factory(spec, metric)
    return FaissBaseline(f"faiss-rabitq-fs{bits}", "faiss-rabitq", bits, make, dim,
                         notes=f"index_factory('{spec}'), qb={_qb(make, dim)}")


def faiss_pq(dim: int, bits: int, metric: str, target_bytes: int) -> FaissBaseline:
    """faiss ``IndexPQ`` with M = target_bytes sub-quantizers of 8 bits (d zero-padded to k*M,
    padding spread over the sub-vectors: :func:`spread_layout`)."""
    m = target_bytes
    pad, cols = spread_layout(dim, m)

    def make(d: int):
        index = _faiss().index_factory(d, f"PQ{m}x8", faiss_metric(metric))
        index.do_polysemous_training = False  # the factory turns it on; it only serves Hamming search
        return index

    return FaissBaseline(f"faiss-pq{m}x8", "faiss-pq", bits, make, dim, pad_to=pad, columns=cols,
                         notes=f"index_factory('PQ{m}x8'), no polysemous training, d zero-padded "
                               f"to {pad} (spread)")


def faiss_pq_fastscan(dim: int, bits: int, metric: str, target_bytes: int) -> FaissBaseline:
    """faiss ``IndexPQFastScan`` with M = 2 * target_bytes sub-quantizers of 4 bits (d zero-padded
    as in :func:`faiss_pq`)."""
    m = 2 * target_bytes
    pad, cols = spread_layout(dim, m)
    return FaissBaseline(f"faiss-pq-fs{m}x4", "faiss-pq", bits, _factory(f"PQ{m}x4fs", metric), dim,
                         pad_to=pad, columns=cols,
                         notes=f"index_factory('PQ{m}x4fs'), d zero-padded to {pad} (spread)")


# ------------------------------------------------------------------------------------- turbovec

def turbovec_available() -> bool:
    """Whether the turbovec package imports."""
    try:
        import turbovec  # noqa: F401
    except ImportError:
        return False
    return True


_TURBOVEC_TIMER = r"""
import json, sys, time
import numpy as np
from turbovec import TurboQuantIndex
path, qpath, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
index = TurboQuantIndex.load(path)
q = np.load(qpath)
index.prepare()
index.search(q, k)
t0 = time.perf_counter()
index.search(q, k)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


class TurbovecBaseline(Baseline):
    """turbovec ``TurboQuantIndex`` (inner product only), optionally calibrated ("TQ+") on a sample.

    d is zero-padded to a multiple of 8. bytes_per_vector is measured from the serialized index
    (size growth per added vector), i.e. what turbovec really stores.
    """

    def __init__(self, dim: int, bits: int, calibrate: bool = False, seed: int = 0,
                 calibration_rows: int = 1024) -> None:
        name = f"turbovec{bits}" + ("-cal" if calibrate else "")
        pad = -(-dim // 8) * 8
        notes = f"turbovec.TurboQuantIndex(dim={pad}, bit_width={bits})" + (
            f", calibrate() on {calibration_rows} random base rows" if calibrate else "")
        super().__init__(name, "turbovec", bits, notes)
        if bits not in TURBOVEC_BITS:
            raise ValueError(f"turbovec bits must be one of {TURBOVEC_BITS}, got {bits}")
        self.dim, self.pad_to, self.calibrate = dim, pad, calibrate
        self.seed, self.calibration_rows = seed, calibration_rows
        self.index: Any = None
        self._bytes = float("nan")

    def _new(self, x: np.ndarray):
        from turbovec import TurboQuantIndex

        index = TurboQuantIndex(dim=self.pad_to, bit_width=self.bits)
        if self.calibrate:
            rng = np.random.default_rng(self.seed)
            rows = rng.choice(len(x), min(len(x), self.calibration_rows), replace=False)
            index.calibrate(x[np.sort(rows)])
        return index

    def build(self, x: np.ndarray) -> None:
        x = _pad(x, self.pad_to)
        self.index = self._new(x)
        self.index.add(x)
        self.index.prepare()

    @property
    def bytes_per_vector(self) -> float:
        if self._bytes != self._bytes:  # NaN: not measured yet
            blob = self.index.to_bytes()
            empty = type(self.index).from_bytes(blob)  # same configuration and calibration
            for i in reversed(range(len(empty))):
                empty.swap_remove(i)
            # everything the vectors add to the serialized index, per vector
            self._bytes = (len(blob) - len(empty.to_bytes())) / len(self.index)
        return self._bytes

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        D, I = self.index.search(_pad(q, self.pad_to), k)
        return np.asarray(D, np.float32), np.asarray(I, np.int64)

    def timed_search(self, q: np.ndarray, k: int, threads: int) -> float:
        """As :meth:`Baseline.timed_search`, in a child process whose rayon pool has ``threads``
        threads (the index travels as a turbovec file)."""
        set_threads(threads)
        with tempfile.TemporaryDirectory() as tmp:
            path, qpath = Path(tmp) / "index.tv", Path(tmp) / "q.npy"
            self.index.write(str(path), durable=False)
            np.save(qpath, _pad(q, self.pad_to))
            env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
            out = subprocess.run([sys.executable, "-c", _TURBOVEC_TIMER, str(path), str(qpath),
                                  str(k)], env=env, check=True, capture_output=True, text=True)
        return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def baselines_for(dim: int, bits: int, metric: str, unit_norm: bool, target_bytes: int,
                  with_turbovec: bool = True, train_rows: int | None = None) -> list[Baseline]:
    """All baselines compared at ``bits`` per coordinate, in result-table order.

    target_bytes: the tqindex bytes per vector at this bit width; PQ is sized to match it.
    unit_norm: the data are unit vectors (faiss TurboQuant quantizers store no norm and are left
    out otherwise). turbovec is inner-product only and included when importable. train_rows:
    faiss indexes train on at most that many seeded random rows (None: all).
    """
    out: list[Baseline] = []
    if unit_norm and metric == "ip":
        if bits in FAISS_TQMSE_BITS:
            out.append(faiss_tq_mse(dim, bits, metric))
        if bits in FAISS_TQPROD_BITS:
            out.append(faiss_tq_prod(dim, bits, metric))
    out.append(faiss_eden(dim, bits, metric))
    out.append(faiss_eden(dim, bits, metric, biased=True))
    out.append(faiss_rabitq(dim, bits, metric))
    out.append(faiss_rabitq_fastscan(dim, bits, metric))
    out.append(faiss_pq(dim, bits, metric, target_bytes))
    out.append(faiss_pq_fastscan(dim, bits, metric, target_bytes))
    if bits == 4:
        out.append(faiss_sq(dim, 4, metric))
    if with_turbovec and metric == "ip" and bits in TURBOVEC_BITS and turbovec_available():
        out.append(TurbovecBaseline(dim, bits))
        out.append(TurbovecBaseline(dim, bits, calibrate=True))
    for b in out:
        if isinstance(b, FaissBaseline):
            b.train_rows = train_rows
    return out
