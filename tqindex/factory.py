"""index_factory: an index from a short description string."""

from __future__ import annotations

from typing import Any

from .encoder import make_encoder
from .index import FlatIndex


def index_factory(dim: int, name: str, metric: str = "ip", **options: Any) -> FlatIndex:
    """FlatIndex over the registry encoder ``name`` ("tq4", "tq2", "tq3-prod", "fp4", ...) for ``dim``."""
    return FlatIndex(make_encoder(name, dim), metric=metric, **options)
