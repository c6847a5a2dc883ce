"""The compiled CPU kernels (``csrc/``: the nibble lookup-table scan with the IVF coarse step's selection,
the Q_mse direction codes, the trellis search and bit packing).

They are built by ``pip install`` when a C compiler is present (``setup.py``) and called through
ctypes, which releases the GIL, so the kernels run in parallel on a thread pool. :func:`available`
says whether they loaded; every caller keeps a PyTorch path for when they did not.
"""

from __future__ import annotations

import ctypes
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any, Callable, Sequence

import torch

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int
_SIGNATURES = {
    "tq_fastscan": (_C, [_P, _I, _I, _I, _C, _P, _P, _P, _I, _I, _P, _I, _P, _P, _P, _P, _I, _P, _I, _P, _P, _C]),
    "tq_fastscan_candidates": (_C, [_P, _I, _I, _I, _C, _P, _P, _I, _P, _P, _P, _P, _I, _P, _P, _C]),
    "tq_fastscan_lists": (_C, [_I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _C, _P, _I, _I, _P, _I, _P, _P, _P, _I, _I, _P,
                               _P, _C]),
    "tq_fastscan_simd": (_C, []),
    "tq_nibble_tables": (None, [_P, _I, _I, _P, _P, _P, _I, _P]),
    "tq_quantize_tables": (None, [_P, _I, _I, _P, _P, _P]),
    "tq_top_columns": (_C, [_P, _I, _I, _I, _P, _P]),
    "tq_group_pairs": (None, [_P, _I, _I, _I, _P, _P]),
    "tq_encode_directions": (_C, [_P, _I, _I, _P, _P, _I, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P, _C]),
    "tq_pack": (_C, [_P, _I, _I, _I, _P]),
    "tq_trellis_tail_biting": (_C, [_P, _I, _I, _P, _C, _C, _P]),
}


@cache
def library() -> ctypes.CDLL | None:
    """The kernel library, or None when the extension was not built."""
    spec = importlib.util.find_spec("tqindex.kernels._native")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def available() -> bool:
    """True when the compiled kernels loaded."""
    return library() is not None


def require() -> ctypes.CDLL:
    """The kernel library; RuntimeError when it was not built."""
    lib = library()
    if lib is None:
        raise RuntimeError("the compiled kernels are not built (reinstall tqindex where a C compiler is available)")
    return lib


MIN_JOB_ELEMENTS = 1 << 18
"""Row-wise kernels split their rows into jobs of at least this many input elements (and no more jobs
than threads)."""


def row_jobs(n: int, row_elements: int) -> list[tuple[int, int]]:
    """(first, end) ranges splitting n rows of ``row_elements`` elements over torch's thread count, each
    MIN_JOB_ELEMENTS elements or more."""
    parts = max(1, min(torch.get_num_threads(), n * row_elements // MIN_JOB_ELEMENTS))
    cuts = [round(i * n / parts) for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


@cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="tqindex")


def parallel(call: Callable[..., int], jobs: Sequence[tuple[Any, ...]], threads: int | None = None) -> list[int]:
    """Run ``call(*job)`` for every job on ``threads`` threads (default: one per job; each takes the
    next job when it is done, so a thread slowed by other work takes fewer) and return their kernel
    statuses; a negative one (out of memory) raises MemoryError."""
    threads = min(threads or len(jobs), len(jobs))
    if threads == 1:
        status = [call(*job) for job in jobs]
    else:
        status = list(_pool(threads).map(lambda job: call(*job), jobs))
    if any(s < 0 for s in status):
        raise MemoryError("a compiled kernel could not allocate its buffers")
    return status
