"""Hugging Face transformers integration: :class:`TQCache`, its :class:`TQLayer` and the "tqindex" attention.

``TQCache(model.config, ...)`` builds one cache layer per decoder layer, as ``DynamicCache(config=...)``
does: full-attention layers become :class:`TQLayer` (keys/values in a :class:`~tqindex.kv.store.KVStore`),
except the first and last ``protected_layers`` attention layers, which stay plain ``DynamicLayer``;
sliding-window, chunked, linear and other layer types keep transformers' own layer classes.

Two attention modes, chosen per call from the model's ``config._attn_implementation``:

- ``"tqindex"`` (``model.set_attn_implementation("tqindex")`` or ``attn_implementation="tqindex"`` at
  load; importing this module registers it): a ``TQLayer`` hands :class:`CompressedTokens` to
  :func:`tq_attention_forward`, which attends from the codes (:func:`compressed_attention`); plain
  tensors from other layers and caches go to transformers' sdpa.
- any other implementation: a ``TQLayer`` returns the decoded keys/values as dense tensors, so every
  attention implementation works, at the cost of decoding the whole history at every step.
"""

from __future__ import annotations

import re
from copy import deepcopy
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    get_layer_types_and_kwargs,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import logging

from ..encoder import Encoder, make_encoder
from ..turboquant import MSE_BITS
from .attention import compressed_attention, dense_attention
from .store import CompressedTokens, KVStore

ATTN_IMPLEMENTATION = "tqindex"
"""Name of the attention implementation registered with transformers."""
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""Layer types counted as attention layers for ``protected_layers``."""
_PRESET = re.compile(r"k(\d)v(\d)")

logger = logging.get_logger(__name__)


def tq_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor | CompressedTokens,
    value: Tensor | CompressedTokens,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: query [B, Hq, Q, D] -> ([B, Q, Hq, Dv], None).

    Compressed keys/values are attended from their codes (dropout is not applied: inference only);
    dense ones (protected, sliding or other cache layers) go to transformers' sdpa, or to
    :func:`dense_attention` when the model soft-caps its scores.
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if isinstance(key, CompressedTokens):
        if key.codes.shape[2] > 0:
            out = compressed_attention(query, key, value, attention_mask, scaling, softcap=softcap, causal=causal)
            return out.transpose(1, 2).contiguous(), None
        key, value = key.window, value.window  # nothing compressed yet (prefill): all full precision
    if softcap is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = dense_attention(query, key, value, attention_mask, scaling, softcap=softcap, causal=causal)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, tq_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


class TQLayer(CacheLayerMixin):
    """A compressed full-attention cache layer: a :class:`KVStore` behind transformers' layer interface.

    ``update`` returns :class:`CompressedTokens` when ``config._attn_implementation == "tqindex"``,
    else the decoded keys/values [B, H, T, D] in the dtype of the incoming states. ``crop`` removes
    tokens exactly; tokens that had already left the full-precision window stay compressed.
    """

    is_sliding = False
    is_croppable = True

    def __init__(
        self, key_encoder: Encoder, value_encoder: Encoder, residual_length: int, config: PreTrainedConfig
    ) -> None:
        super().__init__()
        self.store = KVStore(key_encoder, value_encoder, residual_length)
        self.config = config

    def __deepcopy__(self, memo: dict[int, Any]) -> "TQLayer":
        """Copy the stored tokens; the copy shares the encoders and follows the same model config."""
        for shared in (self.config, self.store.key_encoder, self.store.value_encoder):
            memo.setdefault(id(shared), shared)
        copy = object.__new__(type(self))
        memo[id(self)] = copy
        copy.__dict__.update(deepcopy(self.__dict__, memo))
        return copy

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor] | tuple[CompressedTokens, CompressedTokens]:
        """Store key/value states [B, H, T, D]; return what the attention function reads."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.store.append(key_states, value_states)
        if self.config._attn_implementation == ATTN_IMPLEMENTATION:
            return self.store.view()
        logger.warning_once(
            f"TQCache decodes its compressed keys/values for {self.config._attn_implementation!r} attention at every "
            f"step; call model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) to attend from the codes."
        )
        return self.store.materialize(key_states.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next attention call, for the mask."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.seq_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = KVStore(self.store.key_encoder, self.store.value_encoder, self.store.residual_length)
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a count <= 0, as for ``DynamicLayer``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a number of tokens to remove <= 0 (e.g. -3), got {tokens_to_remove}")
        self.store.crop(max(0, self.store.seq_length + tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.store.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.repeat_interleave(repeats)

    def nbytes(self) -> int:
        """Bytes held (codes + full-precision window)."""
        return self.store.nbytes()

    def nbytes_dense(self) -> int:
        """Bytes a bfloat16 ``DynamicLayer`` would hold for the same tokens."""
        return self.store.nbytes_dense()

    def nbytes_compressed(self) -> tuple[int, int]:
        """(bytes, tokens) of the codes alone (no window), tokens counted once per batch row."""
        return self.store.nbytes_compressed()


class TQCache(Cache):
    """transformers Cache whose full-attention layers hold keys/values as tqindex codes.

    config: the model's config object (``model.config``: the attention mode follows its
    ``_attn_implementation``, see the module docstring); key_encoder / value_encoder: encoder names for
    :func:`~tqindex.make_encoder` ("tq4", "tq8", "fp4", ...) or Encoder objects of dim head_dim;
    residual_length: recent tokens kept in full precision; protected_layers: first and last attention
    layers kept entirely in full precision.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        key_encoder: str | Encoder = "tq4",
        value_encoder: str | Encoder = "tq4",
        residual_length: int = 128,
        protected_layers: int = 2,
    ) -> None:
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(f"config must be a transformers PreTrainedConfig, got {type(config).__name__}")
        if not isinstance(protected_layers, int) or isinstance(protected_layers, bool) or protected_layers < 0:
            raise ValueError(f"protected_layers must be an integer >= 0, got {protected_layers!r}")
        text_config = config.get_text_config(decoder=True)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        keys = _encoder(key_encoder, head_dim, "key_encoder")
        values = _encoder(value_encoder, head_dim, "value_encoder")
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        attention = [i for i, kind in enumerate(layer_types) if kind in ATTENTION_LAYER_TYPES]
        protected = set(attention[:protected_layers] + attention[len(attention) - protected_layers :])
        layers: list[Any] = []
        for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention" and i not in protected:
                layers.append(TQLayer(keys, values, residual_length, text_config))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
        super().__init__(layers=layers)

    @classmethod
    def preset(cls, config: PreTrainedConfig, name: str, **kwargs: Any) -> "TQCache":
        """Cache from a preset name: ``"k{a}v{b}"`` (TurboQuant "tq{a}" keys, "tq{b}" values, a, b in
        1, 2, 3, 4, 8; e.g. "k8v4", "k4v4", "k3v4", "k2v2") or ``"fp4"`` (FP4-UE8M0 keys and values).
        ``kwargs`` go to the constructor (``residual_length``, ``protected_layers``)."""
        match = _PRESET.fullmatch(name) if isinstance(name, str) else None
        if name == "fp4":
            return cls(config, "fp4", "fp4", **kwargs)
        if match and all(int(b) in MSE_BITS for b in match.groups()):
            return cls(config, f"tq{match[1]}", f"tq{match[2]}", **kwargs)
        raise ValueError(f"preset must be 'fp4' or 'k{{a}}v{{b}}' with a, b in {MSE_BITS}, got {name!r}")

    def nbytes(self) -> int:
        """Bytes held by all layers: codes and windows of compressed layers, tensors of the others."""
        return sum(_layer_bytes(layer)[0] for layer in self.layers)

    def nbytes_dense(self) -> int:
        """Bytes a bfloat16 ``DynamicCache`` would hold for the same tokens (2 bytes per element)."""
        return sum(_layer_bytes(layer)[1] for layer in self.layers)

    def nbytes_compressed(self) -> tuple[int, int]:
        """(bytes, tokens) of the compressed storage alone, summed over the compressed layers: codes of
        keys and values with their scales/norms (no full-precision window, no protected or other dense
        layer) and the tokens they hold, counted once per layer and batch row. ``bytes / tokens`` is the
        compressed size of one token in one layer: ``kv_heads * (key_encoder.code_size +
        value_encoder.code_size)``."""
        parts = [layer.nbytes_compressed() for layer in self.layers if isinstance(layer, TQLayer)]
        return sum(b for b, _ in parts), sum(n for _, n in parts)


def _layer_bytes(layer: Any) -> tuple[int, int]:
    """(bytes held, bytes of the bfloat16 equivalent) of one cache layer."""
    if isinstance(layer, TQLayer):
        return layer.nbytes(), layer.nbytes_dense()
    tensors = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors), sum(2 * t.numel() for t in tensors)


def _encoder(spec: str | Encoder, dim: int, name: str) -> Encoder:
    """An encoder from a registry name or an Encoder object of dimension ``dim``."""
    if isinstance(spec, str):
        return make_encoder(spec, dim)
    if not isinstance(spec, Encoder):
        raise TypeError(f"{name} must be an encoder name (str) or a tqindex Encoder, got {type(spec).__name__}")
    if spec.dim != dim:
        raise ValueError(f"{name} has dim {spec.dim}, the model's head_dim is {dim}")
    return spec
