"""Checks at the public boundaries: integers, choices, float vectors, and the range of their norms.

Errors name the argument, what is allowed and what was received. Norms are computed so that they
neither overflow nor underflow for any finite float32 input (:func:`row_norms`), which is what lets
encoders and indexes refuse, rather than silently corrupt, vectors whose scale they cannot hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import kernels
from .kernels.graphs import any_true

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NORM_SAFE = (2.0**-40, 2.0**40)
"""Rows whose float32 sum of squares is exact enough: norms in this range need no rescaling."""


def check_int(value: Any, name: str, minimum: int) -> int:
    """``value`` (int or numpy integer, not bool) as an int >= ``minimum``; ValueError naming ``name`` otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_choice(value: Any, name: str, allowed: tuple | dict) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def check_bool(value: Any, name: str) -> bool:
    """``value`` when it is a bool; TypeError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def id_array(ids: Any, name: str, n: int | None = None) -> np.ndarray:
    """ids (numpy, torch or a sequence of integers) -> int64 [m] ids in [0, 2**63); with ``n``: exactly n,
    distinct (the ids of n new vectors)."""
    a = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
    if a.size == 0:
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int64 ids), got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of ids, got shape {a.shape}")
    if a.size and (int(a.min()) < 0 or int(a.max()) > np.iinfo(np.int64).max):
        raise ValueError(f"{name} must be in [0, 2**63), got values in [{a.min()}, {a.max()}]")
    a = a.astype(np.int64)
    if n is not None:
        if len(a) != n:
            raise ValueError(f"{name} must hold one id per vector ({n}), got {len(a)}")
        uniq, counts = np.unique(a, return_counts=True)
        if len(uniq) != n:
            raise ValueError(f"{name} must be distinct; repeated: {uniq[counts > 1][:5].tolist()}")
    return a


def as_float_tensor(x: Any, dim: int, name: str = "x", allow_empty: bool = False, finite: bool = True) -> Tensor:
    """Validate vectors ``x`` [..., dim] (numpy or torch, floating) and return them as float32 torch.

    Raises TypeError for non-array or non-float input, ValueError for a wrong last dimension, an
    empty batch (unless ``allow_empty``) or NaN/inf values (also values beyond float32's range; not checked
    with ``finite=False``, for callers whose :func:`check_norms` of the rows does).
    """
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"{name} must hold floating-point values (float16/32/64), got dtype {x.dtype}")
        with np.errstate(over="ignore"):  # a float64 too large for float32 becomes inf, reported below
            t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    elif isinstance(x, Tensor):
        t = x
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got dtype {t.dtype}")
    else:
        raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    if t.dim() == 0 or t.shape[-1] != dim:
        raise ValueError(f"{name} must have shape [..., {dim}] (dim={dim}), got {tuple(t.shape)}")
    if t.numel() == 0 and not allow_empty:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): nothing to encode")
    t = t.detach().float()
    if finite:
        check_finite(t, name)
    return t


def check_finite(t: Tensor, name: str) -> None:
    """ValueError if float32 t holds NaN or infinite values (or values beyond float32's range)."""
    if t.device.type == "cpu":  # numpy: one thread, so no torch worker threads are woken to spin
        finite = bool(np.isfinite(t.numpy()).all())
    else:  # NaN propagates; one pass
        finite = not t.numel() or not any_true(~torch.isfinite(torch.stack(torch.aminmax(t))))
    if not finite:
        raise ValueError(f"{name} contains NaN or infinite values (or values beyond float32's range)")


def row_norms(t: Tensor) -> Tensor:
    """Euclidean norms of the rows of float32 t [..., d] -> float32 [...], the float64 sum of the (exact)
    squares rounded once: right for any finite input (inf only where the norm exceeds float32's range) and
    exactly scaled with its row by powers of two."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.device.type == "cpu":  # numpy: one thread, so no torch worker threads are woken to spin
        a = rows.numpy()
        out = torch.from_numpy(np.sqrt(np.einsum("ij,ij->i", a, a, dtype=np.float64)))
    else:
        out = torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float64)
    with np.errstate(over="ignore"):
        return out.float().reshape(t.shape[:-1])


def unit_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """float32 t [N, d] -> (norms [N] by :func:`row_norms`, t / norms), zero rows left zero; exact for any
    finite input: rows outside NORM_SAFE are scaled by a power of two first, which gives them the very
    quotients their safe multiples get."""
    n = row_norms(t)
    unsafe = (n.clamp(*NORM_SAFE) != n) & (n > 0)
    u = t / torch.where(n > 0, n, torch.ones_like(n))[:, None]
    if any_true(unsafe):
        unsafe = torch.nonzero(unsafe).squeeze(1)
        exp = torch.round(torch.log2(n[unsafe].double())).int()
        scaled = torch.ldexp(t[unsafe].double(), -exp[:, None]).float()  # exact: norms near 1
        u[unsafe] = scaled / row_norms(scaled)[:, None]
    return n, u


def rows_in_range(t: Tensor, unit: bool, low: float, high: float, backend: str | None) -> tuple[Tensor, Tensor] | None:
    """Float32 t [n, d] checked in one Triton launch where ``kernels.select`` picks Triton for ``backend``
    (``kernels/checks_triton.py``): (t / norms where ``unit``, else t; :func:`row_norms`) where every row is finite
    and its nonzero norm within [low, high]. None where another backend runs or a row is flagged: then the checks
    above run (they raise, or rescale unit rows exactly)."""
    if kernels.select(t, backend, ("native", "triton"), "row checks") != "triton":
        return None
    from .kernels.checks_triton import checked_rows_triton  # imports triton

    rows, norms, flags = checked_rows_triton(t, unit, low, high)
    return None if any_true(flags) else (rows, norms)


def check_norms(norms: Tensor, low: float, high: float, name: str, holder: str, remedy: str,
                vectors: Tensor | None = None) -> None:
    """ValueError naming the rows whose nonzero norm (float32 [n]) is outside [low, high]: ``holder`` is
    what cannot hold them, ``remedy`` what the caller can do. A row with NaN or infinite values has a NaN or
    infinite norm: given the ``vectors`` themselves, those are reported as such (:func:`check_finite`)."""
    bad = (norms.clamp(low, high) != norms) & (norms != 0)  # NaN too (few kernels: searches validate queries)
    if any_true(bad):
        if vectors is not None:
            check_finite(vectors, name)
        rows = torch.nonzero(bad).squeeze(1)
        shown = ", ".join(f"{int(r)} ({float(norms[r]):.3g})" for r in rows[:5])
        raise ValueError(f"{name} has {len(rows)} vectors with norms outside [{low:.3g}, {high:.3g}], the range "
                         f"{holder} holds faithfully: rows (norms) {shown}{', ...' if len(rows) > 5 else ''}; {remedy}")
