"""TurboQuantPCA: TurboQuant codes in a basis learned from the data, with bits where the variance is.

A random rotation spreads every direction's energy evenly, which is optimal for isotropic data but
wastes bits on anisotropic embeddings (a few principal directions hold most of the energy). This
encoder is trained once: ``train(x)`` takes the principal axes of the unit rows (second moment, no
centering), splits them, in order of decreasing variance, into blocks of 4 and gives each block a
width of 0, 1, 2 or 4 bits per coordinate (the reverse water-filling that minimizes the expected
squared error within the bytes of plain ``bits``-bit codes, with the Lloyd-Max distortions of each
width: see :func:`allocate`), then rotates each group of equal width
by a seeded Haar rotation. Coordinates of group g use the Lloyd-Max codebook for dimension
``size_g`` scaled to the group's variance. A vector is then encoded like TurboQuantMSE: the direction
search over pre-scales (one pre-scale for the whole vector, each coordinate with its group's
codebook) and ``s = ||x|| / ||c||``. Widths 1, 2 and 4 keep whole codes in each 4-bit nibble, so the
lookup-table scans serve these codes too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .checks import as_float_tensor, check_choice, unit_rows
from .codebooks import lloyd_max
from .codes import Codes
from .directions import NORM_DTYPES, CodeRun, DirectionEncoder, encode_directions, search_alphas, store_scale
from .encoder import register_class, register_name
from .packing import packed_size
from .rotation import seeded_rng

PCA_WIDTHS = (0, 1, 2, 4)
"""Bits per coordinate a group may get."""
PCA_BLOCK = 4
"""Principal directions are allocated in blocks of this many."""
TRAIN_ROWS = 200_000
"""train() uses at most this many rows (a seeded sample)."""


def allocate(variances: np.ndarray, bits: int) -> list[list[int]]:
    """Widths for principal directions with ``variances`` [d] (descending) that fit the bytes of plain
    ``bits``-bit codes, ``packed_size(d, bits)``, and minimize the expected squared error
    ``sum(variance · D(width))`` (D: the Lloyd-Max distortion per unit variance, 1 at width 0).

    Widths are in PCA_WIDTHS and constant over blocks of PCA_BLOCK directions. An optimum gives the
    larger variances the wider codes, so the widths fall along the principal order: every split into
    runs of width 4, 2 and 1 (the width-1 run as long as the bytes allow) is scored, the best kept.
    -> groups ``[[size, width], ...]`` in principal order, empty runs left out.
    """
    d = len(variances)
    dist = {w: lloyd_max(max(d, 64), w).distortion for w in PCA_WIDTHS[1:]}
    ends = np.unique(np.r_[np.arange(0, d, PCA_BLOCK), d])  # [m] possible run ends
    energy = np.r_[0.0, np.cumsum(np.asarray(variances, np.float64))][ends]  # variance before each end
    i, j = np.triu_indices(len(ends))  # width 4 up to ends[i], width 2 up to ends[j]
    n4, n2 = ends[i], ends[j] - ends[i]
    room = packed_size(d, bits) - packed_size(n4, 4) - packed_size(n2, 2)  # bytes left for width 1
    ok = room >= 0
    i, j, room = i[ok], j[ok], room[ok]
    k = np.searchsorted(ends, ends[j] + 8 * room, side="right") - 1  # width 1 up to ends[k]
    error = (energy[i] * dist[4] + (energy[j] - energy[i]) * dist[2] + (energy[k] - energy[j]) * dist[1]
             + energy[-1] - energy[k])
    best = int(np.argmin(error))
    cuts = [0, ends[i[best]], ends[j[best]], ends[k[best]], d]
    return [[int(hi - lo), w] for lo, hi, w in zip(cuts, cuts[1:], (4, 2, 1, 0)) if hi > lo]


@register_class
@dataclass(eq=False, repr=False)
class TurboQuantPCA(DirectionEncoder):
    """Trained TurboQuant (see the module notes): ``bits`` is the average budget per coordinate.

    ``groups`` ``[[size, width], ...]`` (PCA order, widths in PCA_WIDTHS) is set by :meth:`train` (or
    given, then train only learns the basis). Until trained, encoding raises. ``code_search`` and
    ``norm_dtype`` are as in TurboQuantMSE (with the "cos" scale).
    """

    dim: int
    bits: int = 2
    seed: int = 0
    groups: list | None = None
    code_search: int = 6
    norm_dtype: str = "float16"
    rotation: str = "learned"
    backend: str | None = None

    def _validate(self) -> None:
        check_choice(self.bits, "bits", (1, 2, 3, 4))
        check_choice(self.norm_dtype, "norm_dtype", NORM_DTYPES)
        check_choice(self.rotation, "rotation", ("learned",))
        if not isinstance(self.code_search, int) or self.code_search < 1:
            raise ValueError(f"code_search must be an integer >= 1, got {self.code_search!r}")
        if self.groups is not None:
            g = self.groups
            ok = isinstance(g, (list, tuple)) and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in g)
            if not ok or any(n < 1 or w not in PCA_WIDTHS for n, w in g) or sum(n for n, _ in g) != self.dim:
                raise ValueError(f"groups must be [[size, width], ...] with sizes summing to dim={self.dim} and "
                                 f"widths in {PCA_WIDTHS}, got {g!r}")
            if sum(packed_size(n, w) for n, w in g if w) > packed_size(self.dim, self.bits):
                raise ValueError(f"groups {g!r} take more than the {self.bits}-bit budget")
            self.groups = [list(p) for p in g]

    @property
    def is_trained(self) -> bool:
        return self.groups is not None and bool(self._state.get("trained", 0))

    def _build(self) -> dict[str, Tensor]:
        if self.groups is None:
            return {}
        out = {"matrix": torch.eye(self.dim), "trained": torch.zeros(1)}  # replaced by train() or a file
        for g, (n, w) in enumerate(self.groups):
            if w:
                cb = lloyd_max(max(n, 2), w)
                out[f"centroids{g}"] = torch.from_numpy(cb.centroids).float()
                out[f"boundaries{g}"] = torch.from_numpy(cb.boundaries).float()
        return out

    def train(self, x) -> None:
        """Learn the basis (and the groups, unless given) from vectors x [n, dim]."""
        t = as_float_tensor(x, self.dim).reshape(-1, self.dim).cpu()
        if len(t) < 2:
            raise ValueError(f"train needs at least 2 vectors, got {len(t)}")
        rng = seeded_rng(self.seed, 3)
        if len(t) > TRAIN_ROWS:
            t = t[torch.from_numpy(np.sort(rng.choice(len(t), TRAIN_ROWS, replace=False)))]
        u = unit_rows(t)[1].double()
        lam, vec = torch.linalg.eigh(u.T @ u / len(u))  # ascending
        lam, vec = lam.flip(0).clamp_min(0), vec.flip(1)  # principal directions, largest first
        groups = self.groups or allocate(lam.numpy(), self.bits)
        blocks, state, start = [], {}, 0
        for g, (n, w) in enumerate(groups):
            q, r = np.linalg.qr(rng.standard_normal((n, n)))
            blocks.append(torch.from_numpy(q * np.sign(np.diag(r))))  # seeded Haar rotation of the group
            if w:
                sigma = float(torch.sqrt(lam[start : start + n].mean() * n))  # group variance / codebook's
                cb = lloyd_max(max(n, 2), w)
                state[f"centroids{g}"] = torch.from_numpy(cb.centroids * sigma).float()
                state[f"boundaries{g}"] = torch.from_numpy(cb.boundaries * sigma).float()
            start += n
        matrix = (torch.block_diag(*blocks) @ vec.T).float().contiguous()  # rows: the coordinates
        self.groups = [list(p) for p in groups]
        self._validate()
        self._state = {"matrix": matrix, "trained": torch.ones(1), **state}
        self._tensors_changed()

    @property
    def code_size(self) -> int:
        return self._expected_qdata_bytes() + NORM_DTYPES[self.norm_dtype].itemsize

    def _expected_qdata_bytes(self) -> int:
        groups = self.groups or []
        return sum(packed_size(n, w) for n, w in groups if w) if groups else packed_size(self.dim, self.bits)

    def _require_trained(self) -> None:
        if not self.is_trained:
            raise ValueError("TurboQuantPCA must be trained first: call encoder.train(x) (or index.train(x))")

    def prepare_queries(self, q, device=None) -> Tensor:
        self._require_trained()
        return super().prepare_queries(q, device)

    def _encode(self, x: Tensor, backend: str | None = None) -> Codes:
        self._require_trained()
        qdata, n, _, sq = encode_directions(x, self._rotation(x.device), self.code_runs(x.device),
                                            search_alphas(self.code_search, x.device), self._backend(backend))
        scale = torch.where(n > 0, n * sq.clamp_min(1e-30).rsqrt(), torch.zeros_like(n))
        return Codes(qdata=qdata, norm=store_scale(scale, self.norm_dtype))

    def code_runs(self, device: torch.device | str = "cpu") -> list[CodeRun]:
        """One run per group, in principal order (no codebook for width 0)."""
        self._require_trained()
        s = self._on(torch.device(device))
        return [CodeRun(n, s.get(f"centroids{g}"), s.get(f"boundaries{g}")) for g, (n, _) in enumerate(self.groups)]


for _b in (1, 2, 3, 4):
    register_name(f"tq{_b}-pca", lambda dim, _b=_b, **kw: TurboQuantPCA(dim=dim, bits=_b, **kw))
