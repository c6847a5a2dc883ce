"""Tiny random transformers models and calls that work on every supported transformers release.

The cache argument of ``forward`` / ``generate`` is ``cache=`` since transformers 5.24 and
``past_key_values=`` before (:data:`CACHE_KW`).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, Gemma2Config, LlamaConfig, LlamaForCausalLM

from tqindex.kv import TQCache
from tqindex.kv.hf import ATTN_IMPLEMENTATION, TQLayer

VOCAB = 128
CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
"""Name of the cache argument of the installed transformers."""
MARGIN = 0.05
"""Top-2 logit gap of the exact model under which a tq8 cache's greedy token may differ (its logits stay within
2e-2 of the exact ones): greedy comparisons stop at the first such near tie."""
CLEAR = 28
"""A :func:`prompt` seed whose 20 greedy tokens on the tiny Llama have no near tie (gaps >= 0.09), so that the
comparisons cover them all; near ties are frequent in so small a model and flip with the CPU's arithmetic."""


def seeded(model_cls: type, config) -> torch.nn.Module:
    """``model_cls(config)`` with weights from seed 0, in eval mode."""
    torch.manual_seed(0)
    return model_cls(config).eval()


_TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, initializer_range=0.1, pad_token_id=0, eos_token_id=None,
)  # fmt: skip
"""The tiny models' common shape: 4 layers, 4 query heads, 2 KV heads, hidden size 64."""


def llama_config(**overrides) -> LlamaConfig:
    """Tiny Llama with GQA: 4 layers, 4 query heads, 2 KV heads, head_dim 32."""
    return LlamaConfig(**{**_TINY, "head_dim": 32, "bos_token_id": 1, **overrides})


def gemma2_config(**overrides) -> Gemma2Config:
    """Tiny Gemma2: 4 layers alternating sliding-window (8 tokens) and full attention, soft-capped scores."""
    return Gemma2Config(**{**_TINY, "head_dim": 16, "sliding_window": 8, **overrides})


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


def exact_greedy(model, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, int]:
    """Greedy decoding with a DynamicCache under sdpa: (the sequences, the steps before the first near tie of
    any row, :data:`MARGIN`)."""
    out = generate(model, DynamicCache(config=model.config), "sdpa", input_ids=ids, output_scores=True,
                   return_dict_in_generate=True, **kw)
    return out.sequences, clear_steps(list(out.scores))


def clear_steps(logits: list[torch.Tensor]) -> int:
    """Steps (logits [B, vocab] each) before the first whose top-2 logits of some row are within MARGIN."""
    for i, step in enumerate(logits):
        top = step.topk(2).values
        if bool((top[:, 0] - top[:, 1] < MARGIN).any()):
            return i
    return len(logits)


def assert_greedy_matches(got: torch.Tensor, exact: torch.Tensor, clear: int, prompt_length: int, least: int = 8):
    """``got`` [B, T] has ``exact``'s tokens up to the exact model's first near tie (``clear`` steps after the
    prompt), which leaves at least ``least`` tokens to compare."""
    assert clear >= least, f"only {clear} greedy steps before a near tie"
    n = prompt_length + clear
    assert torch.equal(got[:, :n], exact[:, :n])


def forward(model, ids: torch.Tensor, cache, **kw):
    """One forward pass of ids [B, T] with ``cache`` (no grad); returns the model output."""
    with torch.no_grad():
        return model(ids, **{CACHE_KW: cache}, use_cache=True, **kw)


def compressed_layers(cache) -> list[TQLayer]:
    return [layer for layer in cache.layers if isinstance(layer, TQLayer)]
