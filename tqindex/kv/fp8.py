"""FP8 baseline KV cache: float8 E4M3 keys and values with one scale per token and head.

The format serving stacks deploy by default, as a transformers cache to compare the tqindex caches against.
:class:`FP8Cache` is a ``DynamicCache`` whose full-attention layers are :class:`FP8Layer`; sliding-window,
chunked and other layer types keep transformers' own classes (as in :class:`~tqindex.kv.TQCache`).

Format, per layer and for keys and values alike: codes [B, H, T, D] ``torch.float8_e4m3fn`` and scales
[B, H, T, 1] float32, one per token and head: ``scale = absmax / 448`` of the token's D-element head vector,
``code = e4m3(x / scale)`` (round to nearest even, clamped to +-448, the largest E4M3 value), decoded as
``code * scale``. Bytes per token, head and tensor: D + 4 (132 for head_dim 128, where bfloat16 takes 256).

Attention: ``update`` stores the new states as FP8 and returns the earlier tokens decoded to the dtype of the
incoming states, followed by those states as they came, [B, H, T, D]: any attention implementation (sdpa,
eager, "tqindex") reads the history as the cache stores it and the current chunk in full precision, as
``TQCache`` keeps the current chunk in its window (later steps read those tokens from the FP8 codes).
Appends concatenate, as ``DynamicLayer``: the allocated bytes are the held bytes, and each step copies the
history once (1 byte per element), besides decoding it for attention (1 byte read, 2 written per bfloat16
element).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .hf import _dynamic_crop_length

FP8_DTYPE = torch.float8_e4m3fn
"""Storage dtype of the codes."""
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""Largest finite E4M3 value (448): a head vector's absmax maps to it."""
SCALE_DTYPE = torch.float32
"""Storage dtype of the per-token-per-head scales."""


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] floating -> (codes [..., D] float8_e4m3fn, scales [..., 1] float32), one scale per vector.

    Zero vectors get the smallest normal float32 scale and zero codes. Values are not checked for NaN or inf.
    The codes carry no gradient (rounding has none worth keeping).
    """
    x32 = x.detach().float()
    scales = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(SCALE_DTYPE).tiny)
    codes = (x32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def dequantize_fp8(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """(codes [..., D] float8_e4m3fn, scales [..., 1]) -> [..., D] in ``dtype``: ``code * scale``.

    E4M3 values are exact in float16, bfloat16 and float32; the product is rounded once, to ``dtype``.
    """
    return codes.to(dtype) * scales.to(dtype)


class FP8Layer(CacheLayerMixin):
    """A full-attention cache layer holding keys and values as FP8 codes with per-token-per-head scales.

    ``key_codes`` / ``value_codes``: [B, H, T, D] float8_e4m3fn; ``key_scales`` / ``value_scales``: [B, H, T, 1]
    float32. ``keys`` / ``values`` are decoded on every access to the dtype of the states the layer was
    first updated with (read-only, as ``TQLayer``'s).
    """

    is_sliding = False
    is_croppable = True

    def __init__(self) -> None:
        # CacheLayerMixin.__init__ is not called: it assigns ``keys`` / ``values``, which are read-only here.
        self.is_initialized = False
        self.dtype: torch.dtype | None = None
        self.key_codes: Tensor | None = None
        self.key_scales: Tensor | None = None
        self.value_codes: Tensor | None = None
        self.value_scales: Tensor | None = None

    def _tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.key_codes, self.key_scales, self.value_codes, self.value_scales

    def _apply(self, fn: Any) -> None:
        """Replace each held tensor t by fn(t)."""
        self.key_codes, self.key_scales, self.value_codes, self.value_scales = map(fn, self._tensors())

    @property
    def keys(self) -> Tensor | None:
        """Keys [B, H, T, D], decoded on every access; None before the first update."""
        return dequantize_fp8(self.key_codes, self.key_scales, self.dtype) if self.is_initialized else None

    @property
    def values(self) -> Tensor | None:
        """Values [B, H, T, D], decoded on every access; None before the first update."""
        return dequantize_fp8(self.value_codes, self.value_scales, self.dtype) if self.is_initialized else None

    @keys.setter
    def keys(self, _: Any) -> None:
        raise AttributeError(_READ_ONLY)

    @values.setter
    def values(self, _: Any) -> None:
        raise AttributeError(_READ_ONLY)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Start empty on the device of key_states [B, H, T, Dk], decoding to its dtype."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.key_codes, self.key_scales = quantize_fp8(key_states[:, :, :0])
        self.value_codes, self.value_scales = quantize_fp8(value_states[:, :, :0])
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Store key/value states [B, H, T, D] as FP8; return what attention reads, [B, H, T', D]: the earlier
        tokens decoded, then the given states as they are."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self.get_seq_length()
        new = (*quantize_fp8(key_states), *quantize_fp8(value_states))
        self.key_codes, self.key_scales, self.value_codes, self.value_scales = (
            torch.cat([old, t], dim=-2) for old, t in zip(self._tensors(), new)
        )
        return (_history_then(self.key_codes, self.key_scales, past, key_states),
                _history_then(self.value_codes, self.value_scales, past, value_states))

    def get_mask_sizes(self, query_length: int | Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next attention call. ``query_length``: the number of new tokens (older
        5.x releases pass ``cache_position`` [Q] instead)."""
        if isinstance(query_length, Tensor):
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.key_codes.shape[-2] if self.is_initialized else 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name in older 5.x releases

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens as ``DynamicLayer.crop`` of the installed transformers does (a negative count removes
        that many; the meaning of 0 and positive values changed within 5.x)."""
        if self.is_initialized:
            length = _dynamic_crop_length(self.get_seq_length(), tokens_to_remove)
            self._apply(lambda t: t[:, :, :length])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            index = beam_idx.to(self.key_codes.device)
            self._apply(lambda t: t.index_select(0, index))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._apply(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self) -> None:
        """Move codes and scales to the CPU (non-blocking)."""
        if self.is_initialized:
            self._apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        """Move offloaded codes and scales back to the layer's device (non-blocking)."""
        if self.is_initialized and self.key_codes.device != self.device:
            self._apply(lambda t: t.to(self.device, non_blocking=True))

    def nbytes(self) -> int:
        """Bytes held: codes and scales of keys and values."""
        return sum(t.numel() * t.element_size() for t in self._tensors()) if self.is_initialized else 0

    def nbytes_dense(self) -> int:
        """Bytes a bfloat16 ``DynamicLayer`` would hold for the same tokens (2 bytes per element)."""
        return 2 * (self.key_codes.numel() + self.value_codes.numel()) if self.is_initialized else 0


def _history_then(codes: Tensor, scales: Tensor, past: int, states: Tensor) -> Tensor:
    """The first ``past`` tokens of codes [B, H, T', D] / scales [B, H, T', 1] decoded to the dtype of
    states [B, H, T, D], then states: [B, H, T', D] (T' = past + T), written once."""
    out = states.new_empty((*states.shape[:2], past + states.shape[2], states.shape[3]))
    torch.mul(codes[:, :, :past].to(states.dtype), scales[:, :, :past].to(states.dtype), out=out[:, :, :past])
    out[:, :, past:] = states
    return out


_READ_ONLY = (
    "FP8Layer.keys and .values are decoded from the FP8 codes on demand and cannot be assigned; edit the cache "
    "with crop / batch_select_indices / reorder_cache, or build one from tensors with FP8Cache(ddp_cache_data=...)"
)


class FP8Cache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers hold keys and values in FP8 E4M3 (see the module notes).

    config: the model's config (``model.config``), or None to add layers as they are first updated, as
    ``DynamicCache()`` does. ddp_cache_data: per-layer ``(keys, values[, sliding window tensor])`` to start
    from (quantized as they are stored). offloading, offload_only_non_sliding: as for ``DynamicCache``.
    """

    def __init__(
        self,
        config: PreTrainedConfig | None = None,
        *,
        ddp_cache_data: Iterable[tuple[Tensor | None, ...]] | None = None,
        offloading: bool = False,
        offload_only_non_sliding: bool = False,
    ) -> None:
        if config is not None and not isinstance(config, PreTrainedConfig):
            raise TypeError(f"config must be a transformers PreTrainedConfig or None, got {type(config).__name__}")
        super().__init__(config=config, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        if config is None:
            self.layer_class_to_replicate = FP8Layer
        else:
            self.layers = [FP8Layer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        if ddp_cache_data is not None:
            self._fill([tuple(entry) for entry in ddp_cache_data], config is None)

    def _fill(self, entries: list[tuple[Tensor | None, ...]], new_layers: bool) -> None:
        """Store per-layer ``(keys, values[, sliding window tensor])`` (``ddp_cache_data``)."""
        if new_layers:
            self.layer_class_to_replicate = None
            self.layers = [
                DynamicSlidingWindowLayer(sliding_window=int(entry[2].reshape(-1)[0]))
                if len(entry) == 3 and entry[2] is not None else FP8Layer()
                for entry in entries
            ]
        if len(entries) > len(self.layers):
            raise ValueError(f"ddp_cache_data has {len(entries)} layers, the config {len(self.layers)}")
        for i, (layer, entry) in enumerate(zip(self.layers, entries)):
            if len(entry) not in (2, 3):
                raise ValueError(
                    f"ddp_cache_data[{i}] must be (keys, values[, sliding window]), got {len(entry)} items"
                )
            if entry[0] is not None and entry[1] is not None:
                layer.update(entry[0], entry[1])

    def nbytes(self) -> int:
        """Bytes held by all layers: codes and scales of FP8 layers, tensors of the others."""
        return sum(_layer_bytes(layer)[0] for layer in self.layers)

    def nbytes_dense(self) -> int:
        """Bytes a bfloat16 ``DynamicCache`` would hold for the same tokens (2 bytes per element)."""
        return sum(_layer_bytes(layer)[1] for layer in self.layers)


def _layer_bytes(layer: Any) -> tuple[int, int]:
    """(bytes held, bytes of the bfloat16 equivalent) of one cache layer."""
    if isinstance(layer, FP8Layer):
        return layer.nbytes(), layer.nbytes_dense()
    tensors = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors), sum(2 * t.numel() for t in tensors)
