"""Baseline indexes for ``benchmarks/ann.py``: faiss quantizers and turbovec, behind one small interface.

Each constructor returns a :class:`Baseline`: ``build(x, train)`` (train on ``train``, add x),
``search(q, k) -> (D, I)`` (faiss-style, float32 / int64 ``[nq, k]``, best first), ``code_size`` (bytes
per vector of the code format: codes plus per-vector side data), ``memory()`` (what the built index
holds: bytes per vector and bytes held once, see :class:`Memory`) and ``timed_search`` (wall time of
one batched search at a given thread count).

Every trained index trains on exactly the rows it is given: faiss's k-means would otherwise subsample
them (``max_points_per_centroid``, 256 points per centroid by default: 4,096 rows for a 4-bit PQ),
so a benchmark that hands every method the same training rows compares like with like.

All baselines score by inner product (``metric="ip"``) or squared L2 (``metric="l2"``); cosine data
must be normalized by the caller and searched with ``"ip"``.

faiss details this module handles:

- ``OMP_WAIT_POLICY=PASSIVE`` must be in the environment before faiss loads its OpenMP runtime (an
  actively spinning pool slows faiss badly on a loaded machine): set it before importing faiss
  (``ann.py`` does).
- TurboQuant scalar quantizers (``"RR,SQtqmse{b}"``, ``"RR,SQtq{b}"``) store no norm: they are only
  meaningful on unit vectors. ``SQtqmse`` exists for b = 1..4 and 8, ``SQtq`` (Q_prod) for b = 2..5.
- Scalar quantizers (``SQ{b}``, ``SQtqmse{b}``, ``SQtq{b}``) run faiss's SIMD code only when d is a
  multiple of 8, and its scalar code otherwise (several times slower): vectors are zero-padded to a
  multiple of 8 (the codes grow with the padded d), and the unpadded index is a row of its own,
  named ``...-unpadded``.
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
  run in a child process started for that thread count and kept for later timings.

Memory: faiss and turbovec indexes are measured by their serialized size (``faiss.serialize_index``,
``TurboQuantIndex.to_bytes``), which writes the arrays the index holds (codes, ids where the index
stores them, per-vector factors, codebooks, rotations): bytes per vector = growth from the trained
empty index to the full one, divided by n; bytes held once = the trained empty index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

FAISS_TQMSE_BITS = (1, 2, 3, 4)
"""Bit widths (1-4) of faiss ``SQtqmse`` (TurboQuant Q_mse) scalar quantizers."""
FAISS_TQPROD_BITS = (2, 3, 4)
"""Bit widths (1-4) of faiss ``SQtq`` (TurboQuant Q_prod: b-1 MSE bits + 1 QJL bit)."""
TURBOVEC_BITS = (2, 4)
"""Bit widths turbovec supports."""
SIMD_MULTIPLE = 8
"""faiss scalar quantizers and turbovec need d to be a multiple of this for their SIMD code."""


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


@dataclass(frozen=True)
class Memory:
    """What a built index holds: ``per_vector`` bytes for each vector it stores (codes as stored,
    with any block padding, ids where the index stores them, per-vector side data) and ``fixed``
    bytes held once whatever n (trained or seeded tensors: rotations, codebooks, a PCA basis, IVF
    centroids)."""

    per_vector: float
    fixed: int


class Baseline(ABC):
    """A baseline index: build (train + add), search, code size, memory held, timed search.

    name: method name in result rows; family: result grouping ("faiss-pq", "turbovec", ...);
    bits: the nominal bits per coordinate the row is compared at; notes: how it was built.
    """

    def __init__(self, name: str, family: str, bits: int, notes: str = "") -> None:
        self.name, self.family, self.bits, self.notes = name, family, bits, notes

    @abstractmethod
    def build(self, x: np.ndarray, train: np.ndarray | None = None) -> None:
        """Train on ``train`` [m, d] float32 (default x; methods that learn nothing ignore it), then add
        x [n, d] float32."""

    @abstractmethod
    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """q [nq, d] float32 -> (scores, ids) [nq, k] float32 / int64, best first."""

    @property
    @abstractmethod
    def code_size(self) -> float:
        """Bytes per vector of the code format, codes plus per-vector side data (valid after build)."""

    @abstractmethod
    def memory(self) -> Memory:
        """What the built index holds (see :class:`Memory`)."""

    def timed_search(self, q: np.ndarray, k: int, threads: int) -> float:
        """Wall-clock seconds of ``search(q, k)`` (one batched call) on ``threads`` threads, right after
        the same search untimed (steady state: lazily built tables, allocator, every core awake)."""
        set_threads(threads)
        self.search(q, k)
        t0 = time.perf_counter()
        self.search(q, k)
        return time.perf_counter() - t0


def _every_training_row(index: Any) -> None:
    """Make faiss's k-means (coarse quantizer and PQ codebooks) train on every row it is given."""
    faiss = _faiss()
    if isinstance(index, faiss.IndexPreTransform):
        index = faiss.downcast_index(index.index)
    for owner in (index, getattr(index, "pq", None)):
        if hasattr(owner, "cp"):
            owner.cp.max_points_per_centroid = 1 << 30


def _inner(index: Any) -> Any:
    """The index behind a pre-transform (rotation), else the index itself."""
    faiss = _faiss()
    return faiss.downcast_index(index.index) if isinstance(index, faiss.IndexPreTransform) else index


class FaissBaseline(Baseline):
    """A faiss index (factory string or constructor), with optional zero padding of the vectors.

    ``code_size`` is the index's ``code_size``: what its storage (flat codes, or inverted lists)
    holds per vector besides ids, without the list number ``sa_code_size`` adds for IVF indexes.
    """

    def __init__(self, name: str, family: str, bits: int, make: Callable[[int], Any], dim: int,
                 pad_to: int | None = None, columns: np.ndarray | None = None,
                 search_params: Any = None, notes: str = "") -> None:
        super().__init__(name, family, bits, notes)
        self.dim, self.pad_to, self.columns = dim, pad_to or dim, columns
        self.make = make
        self.index: Any = None  # made in build(): an unsupported configuration fails there
        self.params = search_params
        self._empty_bytes = 0

    def build(self, x: np.ndarray, train: np.ndarray | None = None) -> None:
        self.index = self.make(self.pad_to)
        if not self.index.is_trained:
            _every_training_row(self.index)
            self.index.train(_pad(x if train is None else train, self.pad_to, self.columns))
        self._empty_bytes = len(_faiss().serialize_index(self.index))
        self.index.add(_pad(x, self.pad_to, self.columns))

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = _pad(q, self.pad_to, self.columns)
        if self.params is None:
            return self.index.search(q, k)
        return self.index.search(q, k, params=self.params)

    @property
    def code_size(self) -> float:
        return float(_inner(self.index).code_size)

    def memory(self) -> Memory:
        full = len(_faiss().serialize_index(self.index))
        return Memory((full - self._empty_bytes) / self.index.ntotal, self._empty_bytes)


def _factory(spec: str, metric: str) -> Callable[[int], Any]:
    return lambda d: _faiss().index_factory(d, spec, faiss_metric(metric))


def _scalar_quantizer(name: str, family: str, bits: int, spec: str, dim: int, metric: str, pad: bool,
                      notes: str = "") -> FaissBaseline:
    """A faiss scalar quantizer ``index_factory(spec)``: with ``pad``, d zero-padded to a multiple of
    :data:`SIMD_MULTIPLE` (faiss's SIMD code); without, named ``name + "-unpadded"`` where that differs."""
    to = -(-dim // SIMD_MULTIPLE) * SIMD_MULTIPLE if pad else dim
    if to != dim:
        notes += f", d zero-padded to {to}"
    elif not pad and dim % SIMD_MULTIPLE:
        name += "-unpadded"
        notes += f", d = {dim} unpadded (faiss's scalar code path)"
    return FaissBaseline(name, family, bits, _factory(spec, metric), dim, pad_to=to,
                         notes=f"index_factory({spec!r})" + notes)


def faiss_tq_mse(dim: int, bits: int, metric: str, pad: bool = True) -> FaissBaseline:
    """faiss TurboQuant Q_mse scalar quantizer (``"RR,SQtqmse{bits}"``); unit-norm data only."""
    return _scalar_quantizer(f"faiss-sq-tqmse{bits}", "faiss-turboquant", bits, f"RR,SQtqmse{bits}", dim,
                             metric, pad, ", no stored norm")


def faiss_tq_prod(dim: int, bits: int, metric: str, pad: bool = True) -> FaissBaseline:
    """faiss TurboQuant Q_prod scalar quantizer (``"RR,SQtq{bits}"``); unit-norm data only."""
    return _scalar_quantizer(f"faiss-sq-tq{bits}", "faiss-turboquant", bits, f"RR,SQtq{bits}", dim,
                             metric, pad)


def faiss_sq(dim: int, bits: int, metric: str, pad: bool = True) -> FaissBaseline:
    """faiss classic per-dimension trained uniform scalar quantizer (``"SQ{bits}"``, bits 4, 6, 8)."""
    return _scalar_quantizer(f"faiss-sq{bits}", "faiss-sq", bits, f"SQ{bits}", dim, metric, pad)


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
import json, signal, sys, time
import numpy as np
from turbovec import TurboQuantIndex
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; this process ends when it does
for line in sys.stdin:
    path, qpath, k = json.loads(line)
    index = TurboQuantIndex.load(path)
    q = np.load(qpath)
    index.prepare()
    index.search(q, k)
    t0 = time.perf_counter()
    index.search(q, k)
    print(json.dumps(time.perf_counter() - t0), flush=True)
"""
_turbovec_timers: dict[int, subprocess.Popen] = {}


def _turbovec_timer(threads: int) -> subprocess.Popen:
    """The child process that times turbovec searches on ``threads`` threads (started on first use,
    after :func:`set_threads` pinned this process, whose CPUs it inherits; it reads requests until
    this process closes its input)."""
    timer = _turbovec_timers.get(threads)
    if timer is None or timer.poll() is not None:
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        timer = subprocess.Popen([sys.executable, "-c", _TURBOVEC_TIMER], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        _turbovec_timers[threads] = timer
    return timer


class TurbovecBaseline(Baseline):
    """turbovec ``TurboQuantIndex`` (inner product only), optionally calibrated ("TQ+") on the
    training rows.

    d is zero-padded to a multiple of 8. Its code size and memory are measured from the serialized
    index (a process's resident memory grows by about as much per added vector).
    """

    def __init__(self, dim: int, bits: int, calibrate: bool = False) -> None:
        name = f"turbovec{bits}" + ("-cal" if calibrate else "")
        pad = -(-dim // SIMD_MULTIPLE) * SIMD_MULTIPLE
        notes = f"turbovec.TurboQuantIndex(dim={pad}, bit_width={bits})" + (
            ", calibrate() on the training rows" if calibrate else "")
        super().__init__(name, "turbovec", bits, notes)
        if bits not in TURBOVEC_BITS:
            raise ValueError(f"turbovec bits must be one of {TURBOVEC_BITS}, got {bits}")
        self.dim, self.pad_to, self.calibrate = dim, pad, calibrate
        self.index: Any = None
        self._empty_bytes = 0
        self._files: tempfile.TemporaryDirectory | None = None  # the built index as a file, for timing

    def build(self, x: np.ndarray, train: np.ndarray | None = None) -> None:
        from turbovec import TurboQuantIndex

        self._files = None
        self.index = TurboQuantIndex(dim=self.pad_to, bit_width=self.bits)
        if self.calibrate:
            self.index.calibrate(_pad(x if train is None else train, self.pad_to))
        self._empty_bytes = len(self.index.to_bytes())
        self.index.add(_pad(x, self.pad_to))
        self.index.prepare()

    @property
    def code_size(self) -> float:
        return self.memory().per_vector

    def memory(self) -> Memory:
        return Memory((len(self.index.to_bytes()) - self._empty_bytes) / len(self.index), self._empty_bytes)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        D, I = self.index.search(_pad(q, self.pad_to), k)
        return np.asarray(D, np.float32), np.asarray(I, np.int64)

    def timed_search(self, q: np.ndarray, k: int, threads: int) -> float:
        """As :meth:`Baseline.timed_search`, in a child process whose rayon pool has ``threads``
        threads (one per thread count, kept for the next call; the index travels as a turbovec file,
        written once per build)."""
        set_threads(threads)
        if self._files is None:
            self._files = tempfile.TemporaryDirectory(prefix="tqindex-turbovec-")
            self.index.write(str(Path(self._files.name) / "index.tv"), durable=False)
        path, qpath = Path(self._files.name) / "index.tv", Path(self._files.name) / "q.npy"
        np.save(qpath, _pad(q, self.pad_to))
        timer = _turbovec_timer(threads)
        timer.stdin.write(json.dumps([str(path), str(qpath), k]) + "\n")
        timer.stdin.flush()
        reply = timer.stdout.readline()
        if not reply:
            raise RuntimeError(f"the turbovec timing process ({threads} threads) ended with status {timer.wait()}")
        return float(json.loads(reply))


def baselines_for(dim: int, bits: int, metric: str, unit_norm: bool, target_bytes: int,
                  with_turbovec: bool = True) -> list[Baseline]:
    """All baselines compared at ``bits`` per coordinate, in result-table order.

    target_bytes: the tqindex bytes per vector at this bit width; PQ is sized to match it.
    unit_norm: the data are unit vectors (faiss TurboQuant quantizers store no norm and are left
    out otherwise). Scalar quantizers come zero-padded and, where d is not a multiple of 8, unpadded
    too. turbovec is inner-product only and included when importable.
    """
    pads = (True, False) if dim % SIMD_MULTIPLE else (True,)
    out: list[Baseline] = []
    if unit_norm and metric == "ip":
        if bits in FAISS_TQMSE_BITS:
            out += [faiss_tq_mse(dim, bits, metric, pad) for pad in pads]
        if bits in FAISS_TQPROD_BITS:
            out += [faiss_tq_prod(dim, bits, metric, pad) for pad in pads]
    out.append(faiss_eden(dim, bits, metric))
    out.append(faiss_eden(dim, bits, metric, biased=True))
    out.append(faiss_rabitq(dim, bits, metric))
    out.append(faiss_rabitq_fastscan(dim, bits, metric))
    out.append(faiss_pq(dim, bits, metric, target_bytes))
    out.append(faiss_pq_fastscan(dim, bits, metric, target_bytes))
    if bits == 4:
        out += [faiss_sq(dim, 4, metric, pad) for pad in pads]
    if with_turbovec and metric == "ip" and bits in TURBOVEC_BITS and turbovec_available():
        out.append(TurbovecBaseline(dim, bits))
        out.append(TurbovecBaseline(dim, bits, calibrate=True))
    return out
