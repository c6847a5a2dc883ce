"""Tiny random transformers models and calls that work on every supported transformers release.

The cache argument of ``forward`` / ``generate`` is ``cache=`` since transformers 5.24 and
``past_key_values=`` before (:data:`CACHE_KW`).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tqindex.kv import TQCache
from tqindex.kv.hf import ATTN_IMPLEMENTATION, TQLayer

VOCAB = 128
CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
"""Name of the cache argument of the installed transformers."""


def seeded(model_cls: type, config) -> torch.nn.Module:
    """``model_cls(config)`` with weights from seed 0, in eval mode."""
    torch.manual_seed(0)
    return model_cls(config).eval()


def llama_config(**overrides) -> LlamaConfig:
    """Tiny Llama with GQA: 4 layers, 4 query heads, 2 KV heads, head_dim 32."""
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    return LlamaConfig(**{**kw, **overrides})


def prompt(batch: int = 1, length: int = 12, seed: int = 1) -> torch.Tensor:
    """Random token ids [batch, length] (no pad or bos ids)."""
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def tq8(model_or_config, **kw) -> TQCache:
    """Near-lossless TQCache: 8-bit keys and values, a 4-token window (each token encoded as it leaves it), one
    protected layer at each end."""
    config = getattr(model_or_config, "config", model_or_config)
    return TQCache(config, "tq8", "tq8", **{"residual_length": 4, "protected_layers": 1, "encode_stride": 1, **kw})


def make_cache(kind: str, model_or_config=None, **kw) -> DynamicCache:
    """``"dynamic"``: DynamicCache(config=...); ``"tq8"``: :func:`tq8`. Without a model or config: lazy layers."""
    if kind == "dynamic":
        return DynamicCache(config=getattr(model_or_config, "config", model_or_config), **kw)
    return tq8(model_or_config, **kw)


def attention_for(kind: str) -> str:
    """The attention implementation each kind of cache is used with."""
    return "sdpa" if kind == "dynamic" else ATTN_IMPLEMENTATION


def generate(model, cache, impl: str = ATTN_IMPLEMENTATION, seed: int | None = None, **kw):
    """``model.generate`` with ``cache`` under attention ``impl`` (greedy, 20 new tokens unless given)."""
    model.set_attn_implementation(impl)
    if seed is not None:
        torch.manual_seed(seed)
    kw = {"max_new_tokens": 20, "do_sample": False, **kw}
    return model.generate(**{CACHE_KW: cache}, **kw)


def forward(model, ids: torch.Tensor, cache, **kw):
    """One forward pass of ids [B, T] with ``cache`` (no grad); returns the model output."""
    with torch.no_grad():
        return model(ids, **{CACHE_KW: cache}, use_cache=True, **kw)


def compressed_layers(cache) -> list[TQLayer]:
    return [layer for layer in cache.layers if isinstance(layer, TQLayer)]
