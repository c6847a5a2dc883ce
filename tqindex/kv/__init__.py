"""Compressed KV caches: tqindex encoders as storage for attention keys and values.

``store`` (storage) and ``attention`` (attention over codes) need only PyTorch; ``TQCache`` and
``TQLayer`` (transformers integration, :mod:`tqindex.kv.hf`) need transformers >= 5.0, and importing
this package registers the ``"tqindex"`` attention implementation with it when it is installed, and
``TQCache`` as a torch pytree node (for ``torch.export``). ``FP8Cache`` / ``FP8Layer`` (:mod:`tqindex.kv.fp8`,
transformers too) are the FP8 baseline; ``SessionStore`` (:mod:`tqindex.kv.sessions`) serves many sessions'
caches of one model under a byte budget; ``DecodeGraph`` (:mod:`tqindex.kv.decode_graph`, transformers too)
replays one-token decode steps from a CUDA graph, and ``decode_graphs`` puts it under ``model.generate``.
``KVPolicy`` (:mod:`tqindex.kv.policy`) describes a cache layer by layer, and ``calibrate``
(:mod:`tqindex.kv.calibrate`, transformers too) chooses one for a model under a bit budget.
"""

from typing import Any

from .attention import compressed_attention, compressed_attention_ref, dense_attention
from .policy import KVPolicy, LayerPolicy
from .sessions import ExtendResult, SessionStore, TurnResult, allocated_bytes
from .store import CodesBuffer, CompressedTokens, KVStore, RecentTier

__all__ = [
    "CodesBuffer",
    "CompressedTokens",
    "DecodeGraph",
    "ExtendResult",
    "FP8Cache",
    "FP8Layer",
    "KVPolicy",
    "KVStore",
    "LayerPolicy",
    "RecentTier",
    "Sensitivity",
    "SessionStore",
    "TQCache",
    "TQLayer",
    "TurnResult",
    "allocated_bytes",
    "calibrate",
    "compressed_attention",
    "compressed_attention_ref",
    "decode_graphs",
    "dense_attention",
    "key_scales",
    "measure_sensitivity",
    "policy_for_budget",
    "sensitivity_template",
]

try:  # importing hf registers the "tqindex" attention implementation with transformers
    from .calibrate import (Sensitivity, calibrate, key_scales, measure_sensitivity, policy_for_budget,
                            sensitivity_template)
    from .decode_graph import DecodeGraph, decode_graphs
    from .fp8 import FP8Cache, FP8Layer
    from .hf import TQCache, TQLayer
except ImportError as err:  # transformers missing: storage and attention still work
    if not (err.name or "").startswith("transformers"):
        raise
    _HF_ERROR = err

    def __getattr__(name: str) -> Any:
        if name in ("TQCache", "TQLayer", "FP8Cache", "FP8Layer", "calibrate", "key_scales", "measure_sensitivity",
                    "policy_for_budget", "sensitivity_template", "Sensitivity", "DecodeGraph", "decode_graphs"):
            raise ImportError(
                f"tqindex.kv.{name} needs transformers >= 5.0: pip install 'tqindex[kv]' ({_HF_ERROR})"
            ) from _HF_ERROR
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
