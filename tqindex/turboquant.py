"""TurboQuant encoders: Q_mse (rotation + Lloyd-Max codebook) and Q_prod (Q_mse + 1-bit QJL residual)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import kernels
from .checks import check_choice, unit_rows
from .codebooks import lloyd_max, lookup
from .codes import Codes
from .directions import (NORM_DTYPES, NORM_LIMITS, CodeRun, DirectionEncoder, check_scale_options,
                         direction_scale, encode_directions, search_alphas, store_scale)
from .encoder import Encoder, register_class, register_name
from .packing import pack, packed_size, unpack_values
from .rotation import ROTATION_KINDS, seeded_rng

MSE_BITS = (1, 2, 3, 4, 8)
_SIGNS = torch.tensor([-1.0, 1.0])


def _quantize_rotated(y: Tensor, centroids: Tensor, boundaries: Tensor) -> tuple[Tensor, Tensor]:
    """Nearest codebook level of each coordinate: y [N, d] -> (idx [N, d] int32, levels float [N, d])."""
    idx = torch.bucketize(y, boundaries, out_int32=True)
    return idx, lookup(centroids, idx)


@register_class
@dataclass(eq=False, repr=False)
class TurboQuantMSE(DirectionEncoder):
    """TurboQuant Q_mse: ``x̂ = s · Rᵀ c[idx]``, b bits per coordinate plus one scalar s per vector.

    ``rescale`` chooses s: ``"norm"`` s = ||x|| (the paper), ``"unbiased"`` s = ||x|| / <R u, c[idx]>
    (inner products with unit u unbiased to first order, as RaBitQ/EDEN do), ``"cos"`` s = ||x|| / ||c||
    (the reconstruction keeps the norm of x exactly, and <q, x̂> is ||x|| ||q|| times the cosine of q and
    the code direction). ``code_search`` > 1 (with "unbiased"/"cos") picks, among the nearest-level codes
    of ``alpha · R u`` for that many alphas, the one whose direction is closest to ``R u``.
    ``norm_dtype`` is the storage type of s ("float16": 2 bytes).
    """

    dim: int
    bits: int = 4
    seed: int = 0
    rescale: str = "cos"
    code_search: int = 6
    norm_dtype: str = "float16"
    rotation: str = "auto"
    backend: str | None = None

    def _validate(self) -> None:
        check_choice(self.bits, "bits", MSE_BITS)
        check_scale_options(self.rescale, self.code_search, self.norm_dtype)
        if self.code_search > 1 and self.rescale == "norm":
            raise ValueError("code_search > 1 needs rescale='unbiased' or 'cos' "
                             "(rescale='norm' keeps the paper's codes)")
        check_choice(self.rotation, "rotation", ROTATION_KINDS)

    def _build(self) -> dict[str, Tensor]:
        cb = lloyd_max(self.dim, self.bits)
        return {
            **super()._build(),
            "centroids": torch.from_numpy(cb.centroids).float(),
            "boundaries": torch.from_numpy(cb.boundaries).float(),
        }

    @property
    def code_size(self) -> int:
        return packed_size(self.dim, self.bits) + NORM_DTYPES[self.norm_dtype].itemsize

    def code_runs(self, device: torch.device | str = "cpu") -> list[CodeRun]:
        """One run: every coordinate with the Lloyd-Max codebook of ``bits`` bits."""
        s = self._on(torch.device(device))
        return [CodeRun(self.dim, s["centroids"], s["boundaries"])]

    def _encode(self, x: Tensor, backend: str | None = None) -> Codes:
        search = self.code_search if self.bits > 1 else 1  # 1-bit codes are signs: nothing to search
        qdata, n, ydotc, csq = encode_directions(x, self._rotation(x.device), self.code_runs(x.device),
                                                 search_alphas(search, x.device), self._backend(backend))
        return Codes(qdata=qdata, norm=store_scale(direction_scale(n, ydotc, csq, self.rescale), self.norm_dtype))


@register_class
@dataclass(eq=False, repr=False)
class TurboQuantProd(Encoder):
    """TurboQuant Q_prod: (bits-1)-bit Q_mse of the unit vector + 1-bit QJL of its residual.

    Stores ``n = ||x||``, the Q_mse codes of ``u = x/n`` (rotated: y = R u), ``γ = ||y - c[idx]||``
    and ``z = sign(S (y - c[idx]))`` with S a seeded [dim, dim] N(0, 1) matrix. The estimate
    ``n (<R q, c[idx]> + γ sqrt(pi/2)/dim <S R q, z>)`` is unbiased for ``<q, x>``. bits=1 is pure QJL.
    """

    dim: int
    bits: int = 4
    seed: int = 0
    norm_dtype: str = "float16"
    rotation: str = "auto"
    backend: str | None = None

    def _validate(self) -> None:
        check_choice(self.bits, "bits", (1, 2, 3, 4, 5))
        check_choice(self.norm_dtype, "norm_dtype", NORM_DTYPES)
        check_choice(self.rotation, "rotation", ROTATION_KINDS)

    def _build(self) -> dict[str, Tensor]:
        out = super()._build()
        if self.bits > 1:
            cb = lloyd_max(self.dim, self.bits - 1)
            out["centroids"] = torch.from_numpy(cb.centroids).float()
            out["boundaries"] = torch.from_numpy(cb.boundaries).float()
        s = seeded_rng(self.seed, 2).standard_normal((self.dim, self.dim))
        out["qjl_matrix"] = torch.from_numpy(s).float()
        return out

    @property
    def code_size(self) -> int:
        return self._expected_qdata_bytes() + packed_size(self.dim, 1) + 2 * NORM_DTYPES[self.norm_dtype].itemsize

    @property
    def norm_limits(self) -> tuple[float, float]:
        return NORM_LIMITS[self.norm_dtype]

    def _expected_qdata_bytes(self) -> int:
        return packed_size(self.dim, self.bits - 1) if self.bits > 1 else 0

    def _encode(self, x: Tensor, backend: str | None = None) -> Codes:
        kernels.select(x, backend, (), "Q_prod encoding")  # PyTorch on every device
        s = self._on(x.device)
        n, u = unit_rows(x)
        y = self._rotation(x.device).apply(u)  # [N, d]
        if self.bits > 1:
            idx, c = _quantize_rotated(y, s["centroids"], s["boundaries"])
            qdata = pack(idx, self.bits - 1)
            r = y - c
        else:
            qdata = torch.empty(x.shape[0], 0, dtype=torch.uint8, device=x.device)
            r = y
        z = (r @ s["qjl_matrix"].T) >= 0  # [N, d] sign bits of S r
        gamma = torch.linalg.vector_norm(r, dim=-1)  # of a unit vector's residual: in [0, 2]
        return Codes(qdata=qdata, norm=store_scale(n, self.norm_dtype), qjl=pack(z, 1),
                     gamma=store_scale(gamma, self.norm_dtype))

    def _decode_rotated(self, codes: Codes) -> Tensor:
        s = self._on(codes.device)
        signs = unpack_values(codes.qjl, 1, self.dim, _SIGNS.to(codes.device))  # [..., d] in {-1, +1}
        qjl = (signs @ s["qjl_matrix"]) * (codes.gamma.float() * math.sqrt(math.pi / 2) / self.dim)[..., None]
        if self.bits > 1:
            qjl = qjl + unpack_values(codes.qdata, self.bits - 1, self.dim, s["centroids"])
        return qjl * codes.norm.float()[..., None]


for _b in MSE_BITS:
    register_name(f"tq{_b}", lambda dim, _b=_b, **kw: TurboQuantMSE(dim=dim, bits=_b, **kw))
    register_name(
        f"tq{_b}-norm",
        lambda dim, _b=_b, **kw: TurboQuantMSE(dim=dim, bits=_b, **{"rescale": "norm", "code_search": 1, **kw}),
    )
    register_name(
        f"tq{_b}-unbiased", lambda dim, _b=_b, **kw: TurboQuantMSE(dim=dim, bits=_b, **{"rescale": "unbiased", **kw})
    )
for _b in (1, 2, 3, 4):
    register_name(f"tq{_b}-prod", lambda dim, _b=_b, **kw: TurboQuantProd(dim=dim, bits=_b, **kw))
