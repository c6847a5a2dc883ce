"""Codes: the packed output of an encoder, a frozen set of named tensor planes.

Every plane has the same leading (batch) dims; ``qdata`` and ``scale``/``qjl`` have one trailing
byte dim, ``norm``/``gamma`` none. Indexing, concatenation and device moves act on the leading dims.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

# Planes with one trailing (byte) dimension after the leading dims.
_TRAILING = {"qdata": 1, "scale": 1, "qjl": 1, "norm": 0, "gamma": 0}


@dataclass(frozen=True, eq=False)
class Codes:
    """Packed codes of vectors with leading shape ``shape``.

    qdata: uint8 [..., B] packed per-coordinate codes (see ``packing``).
    norm:  float16/float32 [...] per-vector scale (TurboQuant) or None.
    scale: uint8 [..., G] UE8M0 group scales (FP4) or None.
    qjl:   uint8 [..., ceil(dim/8)] packed QJL sign bits (TurboQuantProd) or None.
    gamma: float16/float32 [...] residual norms (TurboQuantProd) or None.
    """

    qdata: Tensor
    norm: Tensor | None = None
    scale: Tensor | None = None
    qjl: Tensor | None = None
    gamma: Tensor | None = None

    def __post_init__(self) -> None:
        lead = self.shape
        for name, t in self.planes():
            t_lead = t.shape[: t.dim() - len(_trailing(name, t))]
            if t_lead != lead:
                raise ValueError(f"Codes plane {name!r} has leading shape {tuple(t_lead)}, expected {tuple(lead)}")

    @property
    def shape(self) -> torch.Size:
        """Leading (batch) shape: one code per element."""
        return self.qdata.shape[:-1]

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    def planes(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) for every plane that is present."""
        for name in _PLANES:
            t = getattr(self, name)
            if t is not None:
                yield name, t

    def map(self, fn: Callable[[Tensor], Tensor]) -> "Codes":
        """Apply ``fn`` to every plane (it must act on leading dims only)."""
        return replace(self, **{name: fn(t) for name, t in self.planes()})

    def __len__(self) -> int:
        return self.shape[0] if len(self.shape) else 1

    def __getitem__(self, index) -> "Codes":
        """Index the leading dims (ints, slices, tensors; no Ellipsis)."""
        idx = index if isinstance(index, tuple) else (index,)
        if any(i is Ellipsis or i is None for i in idx):
            raise IndexError("Codes indexing takes leading-dim indices only (no Ellipsis / None)")
        if len(idx) > len(self.shape):
            raise IndexError(f"too many indices for Codes with leading shape {tuple(self.shape)}")
        return self.map(lambda t: t[idx])

    def to(self, device: torch.device | str) -> "Codes":
        """Copy to ``device``."""
        return self.map(lambda t: t.to(device))

    def contiguous(self) -> "Codes":
        return self.map(lambda t: t.contiguous())

    def reshape(self, *lead: int) -> "Codes":
        """Reshape the leading dims."""
        return replace(self, **{n: t.reshape(*lead, *_trailing(n, t)) for n, t in self.planes()})

    @property
    def nbytes(self) -> int:
        """Bytes held by all planes."""
        return sum(t.numel() * t.element_size() for _, t in self.planes())

    @staticmethod
    def cat(items: Sequence["Codes"], dim: int = 0) -> "Codes":
        """Concatenate along leading dim ``dim`` (non-negative)."""
        if not items:
            raise ValueError("Codes.cat needs at least one Codes")
        first = items[0]
        names = [n for n, _ in first.planes()]
        for c in items[1:]:
            if [n for n, _ in c.planes()] != names:
                raise ValueError("Codes.cat: items come from different encoders (different planes)")
        return replace(first, **{n: torch.cat([getattr(c, n) for c in items], dim=dim) for n in names})

    def copy_(self, index, src: "Codes") -> None:
        """In-place ``self[index] = src`` for every plane (for preallocated buffers)."""
        idx = index if isinstance(index, tuple) else (index,)
        for name, t in self.planes():
            t[idx] = getattr(src, name)

    def empty_like(self, *lead: int) -> "Codes":
        """Uninitialized Codes with the same planes, dtypes and device and leading shape ``lead``."""
        return replace(self, **{n: t.new_empty((*lead, *_trailing(n, t))) for n, t in self.planes()})


_PLANES = tuple(f.name for f in fields(Codes))


def _trailing(name: str, t: Tensor) -> torch.Size:
    """The trailing (per-element) shape of plane ``name``."""
    return t.shape[t.dim() - _TRAILING[name]:]
