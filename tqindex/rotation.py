"""Seeded orthogonal rotations: randomized Hadamard (fast Walsh-Hadamard) and dense Haar.

A rotation acts on the last dimension of a tensor: ``apply(x) = x @ R.T`` (``y = R x`` per row) and
``inverse(y) = y @ R``. Orthogonality gives ``<q, x> = <R q, R x>``, so queries are rotated once and
database codes never need rotating back to be scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

ROTATION_KINDS = ("auto", "hadamard", "dense", "none")
DENSE_HADAMARD_MAX_DIM = 1024
"""Up to this dim a Hadamard rotation is applied as one dense matmul (faster than the O(d log d)
butterflies on CPU BLAS and on GPUs); above it, by :func:`fwht`."""
FEW_ROWS = 64
"""Up to this many rows (a batch of queries) a CUDA matmul rotation is computed as ``(R @ x.T).T``: cuBLAS picks a
slow kernel for ``x @ R.T`` at some small row counts (an H200, torch 2.11, float32, dim 128: 54 µs at 8 and 16
rows against 10 µs)."""


def is_power_of_two(n: int) -> bool:
    """True when ``n`` is 1, 2, 4, 8, ..."""
    return n > 0 and (n & (n - 1)) == 0


def seeded_rng(seed: int, stream: int) -> np.random.Generator:
    """numpy PCG64 generator for ``(seed, stream)``: identical draws in every process and machine."""
    return np.random.default_rng([int(seed), int(stream)])


def fwht(x: Tensor) -> Tensor:
    """Unnormalized Walsh-Hadamard transform over the last dim (a power of two), any leading dims.

    Returns ``x @ H`` with H the Sylvester Hadamard matrix (symmetric, entries ±1), in O(d log d).
    """
    d = x.shape[-1]
    if not is_power_of_two(d):
        raise ValueError(f"fwht needs a power-of-two last dimension, got {d}")
    shape = x.shape
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)  # [N, blocks, 2, h]
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape)


def hadamard_matrix(d: int) -> Tensor:
    """Dense Sylvester Hadamard matrix [d, d] float32 with ±1 entries (reference for :func:`fwht`)."""
    if not is_power_of_two(d):
        raise ValueError(f"hadamard_matrix needs a power of two, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@dataclass(frozen=True, eq=False)
class Rotation:
    """An orthogonal ``dim x dim`` rotation R stored as tensors.

    ``kind="hadamard"``: ``R = H diag(signs) / sqrt(dim)`` (``signs`` [dim] float32 ±1).
    ``kind="dense"``: ``R = matrix`` [dim, dim] float32, Haar-random orthogonal.
    ``kind="none"``: identity.
    """

    dim: int
    kind: str
    signs: Tensor | None = None
    matrix: Tensor | None = None

    @classmethod
    def create(cls, dim: int, seed: int = 0, kind: str = "auto") -> "Rotation":
        """Build the rotation for ``dim`` from ``seed``. ``auto``: Hadamard for powers of two, else dense."""
        if kind not in ROTATION_KINDS:
            raise ValueError(f"rotation must be one of {ROTATION_KINDS}, got {kind!r}")
        if kind == "auto":
            kind = "hadamard" if is_power_of_two(dim) else "dense"
        rng = seeded_rng(seed, 1)
        if kind == "none":
            return cls(dim, "none")
        if kind == "hadamard":
            if not is_power_of_two(dim):
                raise ValueError(f"rotation='hadamard' needs a power-of-two dim, got dim={dim}")
            signs = rng.integers(0, 2, size=dim) * 2.0 - 1.0
            return cls(dim, "hadamard", signs=torch.from_numpy(signs).float())
        g = torch.from_numpy(rng.standard_normal((dim, dim)))
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r))[None, :]  # sign fix: Haar distributed
        return cls(dim, "dense", matrix=q.float().contiguous())

    def tensors(self) -> dict[str, Tensor]:
        """The tensors that define R (to store in a file)."""
        out = {}
        if self.signs is not None:
            out["signs"] = self.signs
        if self.matrix is not None:
            out["matrix"] = self.matrix
        return out

    def to(self, device: torch.device | str) -> "Rotation":
        """A copy with its tensors on ``device``."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Rotation(self.dim, self.kind, move(self.signs), move(self.matrix))

    def apply(self, x: Tensor) -> Tensor:
        """``y = R x`` for every row: x [..., dim] float -> [..., dim]."""
        if self.kind == "none":
            return x
        if self.kind == "hadamard" and self.dim > DENSE_HADAMARD_MAX_DIM:
            return fwht(x * self.signs.to(x.dtype)) * (self.dim ** -0.5)
        if x.is_cuda and x.dim() == 2 and len(x) <= FEW_ROWS:
            return (self._matrix.to(x.dtype) @ x.T).T.contiguous()
        return x @ self._matrix.to(x.dtype).T

    def inverse(self, y: Tensor) -> Tensor:
        """``x = R^T y`` for every row: y [..., dim] float -> [..., dim]."""
        if self.kind == "none":
            return y
        if self.kind == "hadamard" and self.dim > DENSE_HADAMARD_MAX_DIM:
            return fwht(y) * (self.dim ** -0.5) * self.signs.to(y.dtype)
        return y @ self._matrix.to(y.dtype)

    @property
    def matmul_matrix(self) -> Tensor | None:
        """R [dim, dim] float32 when :meth:`apply` is one matmul by it (dense, or Hadamard up to
        DENSE_HADAMARD_MAX_DIM), else None."""
        if self.kind == "none" or (self.kind == "hadamard" and self.dim > DENSE_HADAMARD_MAX_DIM):
            return None
        return self._matrix

    @cached_property
    def _matrix(self) -> Tensor:
        """R as a dense [dim, dim] float32 matrix on the rotation's device."""
        if self.kind == "dense":
            return self.matrix
        h = hadamard_matrix(self.dim).to(self.signs.device)
        return h * self.signs[None, :] * (self.dim ** -0.5)  # H diag(s) / sqrt(d)

    def dense(self) -> Tensor:
        """R as a dense [dim, dim] float32 matrix, built through :meth:`apply` (tests)."""
        return self.apply(torch.eye(self.dim)).T.contiguous()
