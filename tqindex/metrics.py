"""Search quality metrics on result ids or exact scores (pure NumPy), shared by tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_BLOCK = 1024  # queries per block, bounds the [block, k, r] comparison


def _ids(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D id array [nq, k], got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{name} must hold integer ids, got dtype {x.dtype}")
    return x


def recall_at(I: np.ndarray, gt: np.ndarray, r: int = 1, k: int | None = None) -> float:
    """recall@r@k: mean over queries of |top-r true ids ∩ first k returned ids| / r.

    I: [nq, >=k] int returned ids, best first; gt: [nq, >=r] int true neighbour ids, best first;
    k: defaults to I.shape[1]. r = 1 is the paper's recall@1@k (fraction of queries whose true
    nearest neighbour is among the k returned); r = k = 10 is recall@10@10. Ids -1 (padding) never
    match; a query with fewer than r valid true ids is scored against those it has, and queries
    with none are left out.
    """
    I, gt = _ids(I, "I"), _ids(gt, "gt")
    k = I.shape[1] if k is None else k
    if I.shape[0] != gt.shape[0]:
        raise ValueError(f"I and gt must have the same number of queries, got {I.shape[0]} and "
                         f"{gt.shape[0]}")
    if not 1 <= k <= I.shape[1]:
        raise ValueError(f"k must be in [1, {I.shape[1]}] (columns of I), got {k}")
    if not 1 <= r <= gt.shape[1]:
        raise ValueError(f"r must be in [1, {gt.shape[1]}] (columns of gt), got {r}")
    true = gt[:, :r]
    valid = (true >= 0).sum(1)  # [nq]
    hits = np.empty(len(I), np.int64)
    for start in range(0, len(I), _BLOCK):
        t = true[start:start + _BLOCK, None, :]  # [b, 1, r]
        found = (I[start:start + _BLOCK, :k, None] == t) & (t >= 0)  # [b, k, r]
        hits[start:start + _BLOCK] = found.any(1).sum(1)
    keep = valid > 0
    if not keep.any():
        raise ValueError("gt has no valid (non -1) ids in its first r columns")
    return float(np.mean(hits[keep] / valid[keep]))


def recall_curve(I: np.ndarray, gt: np.ndarray,
                 ks: Sequence[int] | None = None) -> dict[int, float]:
    """recall@1@k for each k in ks (default 1, 2, 4, ... up to I.shape[1]): {k: recall}."""
    I = _ids(I, "I")
    if ks is None:
        ks = [2**i for i in range(int(np.log2(max(I.shape[1], 1))) + 1)]
    return {int(k): recall_at(I, gt, 1, int(k)) for k in ks}


def recall_by_score(found: np.ndarray, true: np.ndarray, r: int = 1, k: int | None = None,
                    tol: float = 1e-5) -> float:
    """recall@r@k from exact scores, so that exact ties (duplicate vectors) count as found.

    found: [nq, >=k] exact scores (larger is better, e.g. inner product or minus squared distance) of
    the returned ids, best first, -inf for padding; true: [nq, >=r] exact scores of the true
    neighbours, best first. A returned vector counts when its score is at least the r-th true score
    minus ``tol · max(1, |that score|)`` (the ann-benchmarks rule); a query scores min(count, r) / r.
    """
    found, true = np.asarray(found, np.float64), np.asarray(true, np.float64)
    k = found.shape[1] if k is None else k
    if found.ndim != 2 or true.ndim != 2 or found.shape[0] != true.shape[0]:
        raise ValueError(f"found and true must be [nq, *] with the same nq, got {found.shape} and {true.shape}")
    if not 1 <= k <= found.shape[1]:
        raise ValueError(f"k must be in [1, {found.shape[1]}] (columns of found), got {k}")
    if not 1 <= r <= true.shape[1]:
        raise ValueError(f"r must be in [1, {true.shape[1]}] (columns of true), got {r}")
    bar = true[:, r - 1 : r]
    hits = (found[:, :k] >= bar - tol * np.maximum(1.0, np.abs(bar))).sum(1)
    return float(np.mean(np.minimum(hits, r) / r))
