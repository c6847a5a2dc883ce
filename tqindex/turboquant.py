"""TurboQuant encoders: Q_mse (rotation + Lloyd-Max codebook) and Q_prod (Q_mse + 1-bit QJL residual)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .codebooks import lloyd_max
from .codes import Codes
from .encoder import Encoder, register_class, register_name
from .packing import pack, packed_size, unpack
from .rotation import ROTATION_KINDS, seeded_rng

RESCALE_MODES = ("norm", "unbiased", "ls")
NORM_DTYPES = {"float16": torch.float16, "float32": torch.float32}
MSE_BITS = (1, 2, 3, 4, 8)


def _check_choice(name: str, value: object, allowed: tuple | dict) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def _quantize_rotated(y: Tensor, centroids: Tensor, boundaries: Tensor) -> tuple[Tensor, Tensor]:
    """Nearest codebook level of each coordinate: y [N, d] -> (idx int64 [N, d], levels float [N, d])."""
    idx = torch.bucketize(y, boundaries)
    return idx, centroids[idx]


def _unit_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [N, d] -> (norms [N], x / norms with zero rows left zero)."""
    n = torch.linalg.vector_norm(x, dim=-1)
    return n, x / torch.where(n > 0, n, torch.ones_like(n))[:, None]


@register_class
@dataclass(eq=False, repr=False)
class TurboQuantMSE(Encoder):
    """TurboQuant Q_mse: ``x̂ = s · Rᵀ c[idx]``, b bits per coordinate plus one scalar s per vector.

    ``rescale`` chooses s: ``"norm"`` s = ||x|| (the paper), ``"unbiased"`` s = ||x|| / <R u, c[idx]>
    (inner products with unit u unbiased to first order, as RaBitQ/EDEN do), ``"ls"`` the least-squares
    s = ||x|| <R u, c> / ||c||². ``norm_dtype`` is the storage type of s ("float16": 2 bytes).
    """

    dim: int
    bits: int = 4
    seed: int = 0
    rescale: str = "unbiased"
    norm_dtype: str = "float16"
    rotation: str = "auto"

    def _validate(self) -> None:
        _check_choice("bits", self.bits, MSE_BITS)
        _check_choice("rescale", self.rescale, RESCALE_MODES)
        _check_choice("norm_dtype", self.norm_dtype, NORM_DTYPES)
        _check_choice("rotation", self.rotation, ROTATION_KINDS)

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

    def _expected_qdata_bytes(self) -> int:
        return packed_size(self.dim, self.bits)

    def _encode(self, x: Tensor) -> Codes:
        s = self._on(x.device)
        n, u = _unit_rows(x)
        y = self._rotation(x.device).apply(u)  # [N, d]
        idx, c = _quantize_rotated(y, s["centroids"], s["boundaries"])
        if self.rescale == "norm":
            scale = n
        else:
            yc = (y * c).sum(-1)
            ratio = 1.0 / yc if self.rescale == "unbiased" else yc / (c * c).sum(-1)
            scale = torch.where(n > 0, n * ratio, torch.zeros_like(n))
        return Codes(qdata=pack(idx, self.bits), norm=scale.to(NORM_DTYPES[self.norm_dtype]))

    def _decode_rotated(self, codes: Codes) -> Tensor:
        c = self._on(codes.device)["centroids"]
        idx = unpack(codes.qdata, self.bits, self.dim)
        return c[idx.long()] * codes.norm.float()[..., None]


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

    def _validate(self) -> None:
        _check_choice("bits", self.bits, (1, 2, 3, 4, 5))
        _check_choice("norm_dtype", self.norm_dtype, NORM_DTYPES)
        _check_choice("rotation", self.rotation, ROTATION_KINDS)

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

    def _expected_qdata_bytes(self) -> int:
        return packed_size(self.dim, self.bits - 1) if self.bits > 1 else 0

    def _encode(self, x: Tensor) -> Codes:
        s = self._on(x.device)
        n, u = _unit_rows(x)
        y = self._rotation(x.device).apply(u)  # [N, d]
        if self.bits > 1:
            idx, c = _quantize_rotated(y, s["centroids"], s["boundaries"])
            qdata = pack(idx, self.bits - 1)
            r = y - c
        else:
            qdata = torch.empty(x.shape[0], 0, dtype=torch.uint8, device=x.device)
            r = y
        z = (r @ s["qjl_matrix"].T) >= 0  # [N, d] sign bits of S r
        dt = NORM_DTYPES[self.norm_dtype]
        gamma = torch.linalg.vector_norm(r, dim=-1)
        return Codes(qdata=qdata, norm=n.to(dt), qjl=pack(z, 1), gamma=gamma.to(dt))

    def _decode_rotated(self, codes: Codes) -> Tensor:
        s = self._on(codes.device)
        signs = unpack(codes.qjl, 1, self.dim).float() * 2 - 1  # [..., d] in {-1, +1}
        qjl = (signs @ s["qjl_matrix"]) * (codes.gamma.float() * math.sqrt(math.pi / 2) / self.dim)[..., None]
        if self.bits > 1:
            qjl = qjl + s["centroids"][unpack(codes.qdata, self.bits - 1, self.dim).long()]
        return qjl * codes.norm.float()[..., None]


for _b in MSE_BITS:
    register_name(f"tq{_b}", lambda dim, _b=_b, **kw: TurboQuantMSE(dim=dim, bits=_b, **kw))
    register_name(
        f"tq{_b}-norm", lambda dim, _b=_b, **kw: TurboQuantMSE(dim=dim, bits=_b, **{"rescale": "norm", **kw})
    )
for _b in (1, 2, 3, 4):
    register_name(f"tq{_b}-prod", lambda dim, _b=_b, **kw: TurboQuantProd(dim=dim, bits=_b, **kw))
