"""Compressed KV caches: tqindex encoders as storage for attention keys and values.

``store`` (storage) and ``attention`` (attention over codes) need only PyTorch; ``TQCache`` and
``TQLayer`` (transformers integration, :mod:`tqindex.kv.hf`) need transformers >= 5.0, and importing
this package registers the ``"tqindex"`` attention implementation with it when it is installed, and
``TQCache`` as a torch pytree node (for ``torch.export``). ``FP8Cache`` / ``FP8Layer`` (:mod:`tqindex.kv.fp8`,
transformers too) are the FP8 baseline; ``SessionStore`` (:mod:`tqindex.kv.sessions`) serves many sessions'
caches of one model under a byte budget.
"""

from typing import Any

from .attention import compressed_attention, compressed_attention_ref, dense_attention
from .sessions import ExtendResult, SessionStore, TurnResult, allocated_bytes
from .store import CodesBuffer, CompressedTokens, KVStore

__all__ = [
    "CodesBuffer",
    "CompressedTokens",
    "ExtendResult",
    "FP8Cache",
    "FP8Layer",
    "KVStore",
    "SessionStore",
    "TQCache",
    "TQLayer",
    "TurnResult",
    "allocated_bytes",
    "compressed_attention",
    "compressed_attention_ref",
    "dense_attention",
]

try:  # importing hf registers the "tqindex" attention implementation with transformers
    from .fp8 import FP8Cache, FP8Layer
    from .hf import TQCache, TQLayer
except ImportError as err:  # transformers missing: storage and attention still work
    if not (err.name or "").startswith("transformers"):
        raise
    _HF_ERROR = err

    def __getattr__(name: str) -> Any:
        if name in ("TQCache", "TQLayer", "FP8Cache", "FP8Layer"):
            raise ImportError(
                f"tqindex.kv.{name} needs transformers >= 5.0: pip install 'tqindex[kv]' ({_HF_ERROR})"
            ) from _HF_ERROR
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
