"""Compressed KV caches: tqindex encoders as storage for attention keys and values.

``store`` (storage) and ``attention`` (attention over codes) need only PyTorch; ``TQCache`` and
``TQLayer`` (transformers integration, :mod:`tqindex.kv.hf`) import transformers on first access.
"""

from typing import Any

from .attention import compressed_attention, compressed_attention_ref, dense_attention
from .store import CodesBuffer, CompressedTokens, KVStore

__all__ = [
    "CodesBuffer",
    "CompressedTokens",
    "KVStore",
    "TQCache",
    "TQLayer",
    "compressed_attention",
    "compressed_attention_ref",
    "dense_attention",
]

_HF_NAMES = ("TQCache", "TQLayer")


def __getattr__(name: str) -> Any:
    if name in _HF_NAMES:
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
