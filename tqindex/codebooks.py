"""Scalar codebooks: Lloyd-Max for the rotated-coordinate density, the FP4 E2M1 grid, UE8M0 scales.

After a uniformly random rotation, one coordinate t of a unit vector in R^d has the density

    f(t) = Γ(d/2) / (sqrt(pi) Γ((d-1)/2)) · (1 - t²)^((d-3)/2),   t in [-1, 1].

:func:`lloyd_max` finds the 2^b-level quantizer minimizing E[(t - Q(t))²] for that exact density.
Integrals are computed in the variable θ = arcsin t, where the integrand ``cos(θ)^(d-2)`` is smooth for
every d >= 2, with composite Gauss-Legendre quadrature (accurate to ~1e-13); the first moment has the
closed form ``∫ t f(t) dt = -C (1 - t²)^((d-1)/2) / (d - 1)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import torch
from torch import Tensor

LLOYD_MAX_BITS = (1, 2, 3, 4, 8)


@dataclass(frozen=True)
class Codebook:
    """A symmetric scalar quantizer: ``centroids`` [2^b] ascending, ``boundaries`` [2^b - 1] midpoints.

    ``distortion`` is ``d · E[(t - Q(t))²]``, the expected ``||u - û||²`` of a unit vector.
    """

    dim: int
    bits: int
    centroids: np.ndarray
    boundaries: np.ndarray
    distortion: float


class _CoordinateDensity:
    """CDF and first moment of the rotated-coordinate density for one dimension d."""

    def __init__(self, dim: int, panels: int = 400, nodes: int = 24):
        self.d = dim
        self.log_c = math.lgamma(dim / 2) - math.lgamma((dim - 1) / 2) - 0.5 * math.log(math.pi)
        # θ-range holding all mass to double precision: |t| <= 40 / sqrt(d) (or the whole [-1, 1]).
        self.theta_max = math.asin(min(1.0, 40.0 / math.sqrt(dim)))
        self.edges = np.linspace(-self.theta_max, self.theta_max, panels + 1)
        self.gl_x, self.gl_w = np.polynomial.legendre.leggauss(nodes)
        widths = np.diff(self.edges)
        mids = (self.edges[:-1] + self.edges[1:]) / 2
        theta = mids[:, None] + widths[:, None] / 2 * self.gl_x[None, :]  # [panels, nodes]
        mass = (self._g(theta) * self.gl_w[None, :]).sum(1) * widths / 2
        self.cum = np.concatenate(([0.0], np.cumsum(mass)))  # mass below each panel edge

    def _g(self, theta: np.ndarray) -> np.ndarray:
        """Integrand in θ: C · cos(θ)^(d-2)."""
        with np.errstate(divide="ignore"):
            return np.exp(self.log_c + (self.d - 2) * np.log(np.cos(theta)))

    def cdf(self, t: np.ndarray) -> np.ndarray:
        """P(T <= t) for an array of t in [-1, 1]."""
        theta = np.clip(np.arcsin(np.clip(t, -1.0, 1.0)), -self.theta_max, self.theta_max)
        k = np.clip(np.searchsorted(self.edges, theta, side="right") - 1, 0, len(self.edges) - 2)
        lo = self.edges[k]
        half = (theta - lo) / 2
        nodes = lo[:, None] + half[:, None] * (self.gl_x[None, :] + 1)
        partial = (self._g(nodes) * self.gl_w[None, :]).sum(1) * half
        return self.cum[k] + partial

    def first_moment_antiderivative(self, t: np.ndarray) -> np.ndarray:
        """A(t) with A' = t f(t): ``-C (1 - t²)^((d-1)/2) / (d-1)``."""
        with np.errstate(divide="ignore"):
            log_term = (self.d - 1) / 2 * np.log1p(-np.clip(t, -1.0, 1.0) ** 2)
        return -np.exp(self.log_c + log_term) / (self.d - 1)


@functools.lru_cache(maxsize=None)
def lloyd_max(dim: int, bits: int, tol: float = 1e-13) -> Codebook:
    """Lloyd-Max codebook with 2^bits levels for the rotated-coordinate density of dimension ``dim``.

    Deterministic, data-free, cached per (dim, bits). Levels are in coordinate units of a unit vector.
    Iterates to ``tol · sigma`` for bits <= 4; 8 bits (256 levels, where Lloyd converges slowly from
    the already near-optimal start) stops after 500 iterations.
    """
    if not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    if bits not in LLOYD_MAX_BITS:
        raise ValueError(f"bits must be one of {LLOYD_MAX_BITS}, got {bits!r}")
    dens = _CoordinateDensity(dim)
    levels = 2**bits
    sigma = 1.0 / math.sqrt(dim)
    # High-resolution start: centroid density ∝ f^(1/3), i.e. Gaussian quantiles at sqrt(3)·sigma.
    nd = NormalDist(0.0, math.sqrt(3.0) * sigma)
    c = np.array([nd.inv_cdf((i + 0.5) / levels) for i in range(levels)])
    c = np.clip(c, -0.999, 0.999)
    edges = np.concatenate(([-1.0], np.zeros(levels - 1), [1.0]))
    for _ in range(100_000 if bits <= 4 else 500):
        edges[1:-1] = (c[:-1] + c[1:]) / 2
        mass = np.diff(dens.cdf(edges))
        moment = np.diff(dens.first_moment_antiderivative(edges))
        new = np.where(mass > 0, moment / np.maximum(mass, 1e-300), c)
        done = np.max(np.abs(new - c)) < tol * sigma
        c = new
        if done:
            break
    c = (c - c[::-1]) / 2  # exactly symmetric (the density is): then so are the midpoints, with 0 in the middle
    edges[1:-1] = (c[:-1] + c[1:]) / 2
    mass = np.diff(dens.cdf(edges))
    moment = np.diff(dens.first_moment_antiderivative(edges))
    # E[(t - Q(t))²] = E[t²] - 2 Σ c_i M1_i + Σ c_i² P_i, with E[t²] = 1/d.
    distortion = dim * (1.0 / dim - float(np.sum(2 * c * moment - c**2 * mass)))
    return Codebook(dim, bits, c, edges[1:-1].copy(), distortion)


def lookup(table: Tensor, idx: Tensor) -> Tensor:
    """``table[idx]`` for a 1-D table and an integer index tensor of any shape (any int dtype).

    Uses ``index_select``, several times faster on CPU than advanced indexing with int64 indices.
    """
    return table.index_select(0, idx.reshape(-1).to(torch.int32)).reshape(idx.shape)


# --------------------------------------------------------------------------------------------------
# FP4 E2M1 and UE8M0

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitude by the low 3 bits of a code; bit 3 is the sign."""
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES))
"""Value of each of the 16 FP4 E2M1 codes (code 8 is -0.0)."""
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
UE8M0_BIAS = 127
SCALE_ROUNDINGS = ("round", "ceil", "floor")


def e2m1_encode(x: Tensor) -> Tensor:
    """Nearest FP4 E2M1 code of each element of x (float), ties to the even code, saturating at ±6.

    Returns uint8 codes in [0, 15] with the same shape: low 3 bits magnitude index, bit 3 the sign.
    """
    a = x.abs().float()
    mids = _E2M1_MIDPOINTS.to(a.device)
    idx = torch.bucketize(a, mids)  # a == mids[i] -> i (rounds down)
    # Ties round to the even code: midpoints 0.75, 1.75, 3.5 sit below an even code, so round up there.
    tie_up = (a == mids[1]) | (a == mids[3]) | (a == mids[5])
    idx = idx + tie_up.to(idx.dtype)
    sign = (x < 0) | ((x == 0) & torch.signbit(x))
    return (idx | (sign.to(idx.dtype) << 3)).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """FP4 E2M1 codes (uint8 in [0, 15]) -> float32 values, exactly."""
    return lookup(E2M1_VALUES.to(codes.device), codes)


def ue8m0_exponent(absmax: Tensor, scale_constant: float, rounding: str = "ceil") -> Tensor:
    """Power-of-two exponent E (int32) for groups with absolute maximum ``absmax`` (float).

    ``E = rounding(log2(scale_constant · absmax))``, clamped to the UE8M0 range [-127, 127], computed exactly from
    the float64 product's exponent and mantissa (no logarithm); an all-zero group gets E = -127.
    """
    if rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding must be one of {SCALE_ROUNDINGS}, got {rounding!r}")
    v = absmax.double() * scale_constant
    mant, e = torch.frexp(v)  # v = mant 2^e, mant in [0.5, 1): log2(v) in [e - 1, e), exactly e - 1 at mant 0.5
    if rounding == "ceil":
        e = e - (mant == 0.5).int()
    elif rounding == "floor":
        e = e - 1
    else:  # round(log2 v): up where 2 mant >= sqrt(2) (log2 v is never exactly e - 1/2)
        e = e - 1 + (2 * mant >= math.sqrt(2)).int()
    e = torch.where(v > 0, e, -UE8M0_BIAS)
    e = torch.where(torch.isinf(v), UE8M0_BIAS, torch.where(torch.isnan(v), -UE8M0_BIAS, e))
    return e.clamp(-UE8M0_BIAS, UE8M0_BIAS).to(torch.int32)


def ue8m0_byte(exponent: Tensor) -> Tensor:
    """Exponent E (int) -> UE8M0 scale byte ``E + 127`` (uint8 in [0, 254])."""
    return (exponent + UE8M0_BIAS).clamp(0, 254).to(torch.uint8)


def ue8m0_scale(byte: Tensor) -> Tensor:
    """UE8M0 scale byte (uint8) -> float32 ``2^(byte - 127)``, exact."""
    return torch.exp2(byte.double() - UE8M0_BIAS).float()
