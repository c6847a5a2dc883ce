"""Hugging Face transformers integration: :class:`TQCache`, its :class:`TQLayer` and the "tqindex" attention.

``TQCache`` is a ``DynamicCache`` whose full-attention layers are :class:`TQLayer` (keys/values in a
:class:`~tqindex.kv.store.KVStore`): ``TQCache(model.config, ...)`` builds the layers ``DynamicCache(config=...)``
builds and compresses the full-attention ones, except the first and last ``protected_layers`` attention
layers; sliding-window, chunked, linear and other layer types keep transformers' own classes.
``TQCache()`` without a config adds layers as they are first updated, as ``DynamicCache()`` does.

Two attention modes, chosen per call from the model's ``config._attn_implementation``:

- ``"tqindex"`` (``model.set_attn_implementation("tqindex")`` or ``attn_implementation="tqindex"`` at
  load; importing this module registers it): a ``TQLayer`` hands :class:`CompressedTokens` to
  :func:`tq_attention_forward`, which attends from the codes (:func:`compressed_attention`); plain
  tensors from other layers and caches go to transformers' sdpa. Inside ``torch.compile`` or
  ``torch.export`` it attends over the decoded codes instead (:func:`compressed_attention_ref`, the same
  result up to float rounding), since the codes path reads the queries on the host. By default
  (``TQCache(..., layer_graphs=2)``) eager one-token steps on CUDA hold each layer's window in fixed buffers
  (:meth:`~tqindex.kv.store.KVStore.make_static`) and replay its attention from CUDA graphs of its own
  (:func:`_compressed`), so that eager decoding skips the host time of attention's several launches
  (:class:`~tqindex.kv.DecodeGraph` replays whole steps); dense layers then become :func:`dense_layer`.
- any other implementation: a ``TQLayer`` returns the decoded keys/values as dense tensors, so every
  attention implementation works, at the cost of decoding the whole history at every step.

Importing this module also registers ``TQCache`` with ``torch.utils._pytree`` (its leaves are the codes'
planes and the windows), so ``torch.export`` takes a TQCache as an input or output. Tested with
transformers 5.0 (the oldest release the ``kv`` extra allows) and the newest 5.x release.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Iterable, Iterator
from copy import deepcopy
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from transformers import AttentionInterface, PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.utils import logging

from .. import kernels
from ..checks import check_bool, check_int
from ..encoder import Encoder, encoder_names, make_encoder
from ..turboquant import MSE_BITS
from .attention import causal_sdpa, compressed_attention, compressed_attention_ref, dense_attention, _scaled_queries
from .policy import ENCODE_STRIDE, SINK_LENGTH, KVPolicy, encoder_for
from .store import CompressedTokens, KVStore, RecentTier, encoder_from_key, encoder_key, tracing

ATTN_IMPLEMENTATION = "tqindex"
"""Name of the attention implementation registered with transformers."""
LAYER_GRAPHS = 2
"""Default ``layer_graphs``: the attention shapes each compressed layer keeps recorded as CUDA graphs (one-token steps
over a static store have one shape; the second allows for a model that calls a layer's attention twice a step)."""
KEEP_ALL = 1 << 62
"""``residual_length`` of a dense layer's store (:func:`dense_layer`): no token ever leaves its window."""
STATIC_AFTER = 2
"""With ``layer_graphs``, the consecutive one-token CUDA steps (no edit between them) that make a layer's store
static."""
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
        if key.codes.shape[2] > 0 or key.lengths is not None:
            return _compressed(query, key, value, attention_mask, scaling, softcap, causal), None
        query = _scaled_queries(query, key).to(query.dtype)  # the window holds keys as the codes would
        key, value = key.window, value.window  # nothing compressed yet (prefill): all full precision
    if softcap is None:
        if attention_mask is None and causal and 1 < query.shape[2] < key.shape[2]:  # see tq_attention_mask
            return causal_sdpa(query, key, value, scaling).transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = dense_attention(query, key, value, attention_mask, scaling, softcap=softcap, causal=causal)
    return out.transpose(1, 2).contiguous(), None


def _compressed(query: Tensor, key: CompressedTokens, value: CompressedTokens, mask: Tensor | None, scaling: float,
                softcap: float | None, causal: bool) -> Tensor:
    """:func:`compressed_attention` (while tracing, :func:`compressed_attention_ref`) transposed to [B, Q, Hq, Dv]
    (contiguous); over a static store's buffers on CUDA (``key.graphs``: eager decode steps, see
    :meth:`TQLayer.update`) replayed from a CUDA graph once the same call has come ``graphs.RECORD_AT`` times: one
    launch in place of the host work of three or four kernels and their planning (eagerly 0.36-0.39 ms per layer
    and step on an H100 machine, Llama-8B shape, batch 1 x 32k)."""
    traced = tracing()
    attention = compressed_attention_ref if traced else compressed_attention

    def attend(q: Tensor) -> tuple[Tensor]:
        out = attention(q, key, value, mask, scaling, softcap=softcap, causal=causal)
        return out.transpose(1, 2).contiguous(),

    graphs = key.graphs
    if (graphs is None or traced or mask is not None or not query.is_cuda
            or torch.cuda.is_current_stream_capturing()):
        return attend(query)[0]
    return graphs.run(key.lengths, _call_key(query, key, value, scaling, softcap, causal), query, attend)[0]


def _call_key(query: Tensor, key: CompressedTokens, value: CompressedTokens, scaling: float, softcap: float | None,
              causal: bool) -> tuple:
    """What a recorded attention call depends on besides the values in its buffers: the query's layout, the
    options, and every buffer's address and shape (a code buffer that grew is another call)."""
    buffers = [t for tokens in (key, value) for _, t in tokens.codes.planes()] + [key.window, value.window]
    return (query.shape, query.stride(), query.dtype, scaling, softcap, causal, key.sink,
            *((t.data_ptr(), t.shape) for t in (*buffers, key.query_scale) if t is not None))


def _graphed_step(config: PreTrainedConfig | None, key_states: Tensor) -> bool:
    """Whether an update of key states [B, H, T, D] is an eager one-token CUDA step attended from the codes, whose
    attention ``layer_graphs`` replays (:meth:`TQLayer.update`)."""
    return (getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION and key_states.shape[2] == 1
            and key_states.is_cuda and not tracing() and not torch.cuda.is_current_stream_capturing())


def tq_attention_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """The mask of the "tqindex" attention: transformers' ``sdpa_mask``, except None (causal: query i of Q
    sees the keys up to position T - Q + i) where that mask would say no more than that:

    - one query token per sequence without padding or a local window while a CUDA graph is recorded
      (``DecodeGraph``), which ``sdpa_mask`` of some releases does not return while recording;
    - several query tokens that are the newest of the keys (a prefill or chunk over a cache), causal, no
      padding (or none masked), no local window or packed sequences (releases that pass ``q_offset``):
      :func:`tq_attention_forward` then attends with the causal bias aligned to the last key, which
      ``sdpa_mask`` spells out as a [Q, T] mask that keeps flash attention from running.
    """
    position = kwargs.get("cache_position")  # releases before q_length passed the query positions
    q_length = kwargs.get("q_length", None if position is None else position.shape[0])
    q_offset, padding = kwargs.get("q_offset"), kwargs.get("attention_mask")
    plain = (kwargs.get("local_size") is None and kwargs.get("allow_is_causal_skip", True) and not tracing()
             and kwargs.get("mask_function", causal_mask_function) is causal_mask_function)
    if (q_length == 1 and plain and padding is None and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing()):
        return None
    if (plain and isinstance(q_length, int) and q_length > 1 and type(q_offset) is int and kwargs.get("kv_offset") == 0
            and q_offset + q_length == kwargs.get("kv_length") and (padding is None or bool(padding.all()))):
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, tq_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, tq_attention_mask)


class TQLayer(CacheLayerMixin):
    """A compressed full-attention cache layer: a :class:`KVStore` behind transformers' layer interface.

    ``update`` returns :class:`CompressedTokens` when ``config._attn_implementation == "tqindex"``,
    else the decoded keys/values [B, H, T, D] in the dtype of the incoming states. ``keys`` / ``values``
    are decoded on demand (read-only). ``crop`` removes tokens exactly; tokens that had already left the
    full-precision window stay compressed. ``offload`` / ``prefetch`` move the codes and the window, never
    decoded tensors.
    """

    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        key_encoder: Encoder,
        value_encoder: Encoder,
        residual_length: int,
        config: PreTrainedConfig | None = None,
        center_keys: bool = False,
        key_scale: Tensor | None = None,
        sink_length: int = 0,
        encode_stride: int = 1,
        recent: RecentTier | None = None,
        layer_graphs: int = LAYER_GRAPHS,
    ) -> None:
        # CacheLayerMixin.__init__ is not called: it assigns ``keys`` / ``values``, which are read-only here.
        self.is_initialized = False
        self.store = KVStore(key_encoder, value_encoder, residual_length, center_keys, key_scale, sink_length,
                             encode_stride, recent)
        self.config = config
        self.settles = True  # encode the tokens beyond the window after each update (KVStore.settle)
        self.layer_graphs = layer_graphs  # attention shapes kept as CUDA graphs in eager one-token steps (update)
        self._steps = 0  # one-token CUDA steps since the store was last edited (crop, select, moves)

    def __deepcopy__(self, memo: dict[int, Any]) -> "TQLayer":
        """Copy the stored tokens; the copy shares the encoders and follows the same model config."""
        recent = self.store.recent
        tier = () if recent is None else (recent, recent.key_encoder, recent.value_encoder)
        return _deepcopy_sharing(self, memo, (self.config, self.store.key_encoder, self.store.value_encoder, *tier))

    @property
    def keys(self) -> Tensor | None:
        """Keys [B, H, T, Dk] in the dtype of the incoming states, None before the first update. Decoded on
        every access (codes, then the window): O(B·H·T·Dk) time and a dense copy in memory."""
        return self.store.materialize_keys() if self.is_initialized else None

    @property
    def values(self) -> Tensor | None:
        """Values [B, H, T, Dv], decoded on every access as :attr:`keys`."""
        return self.store.materialize_values() if self.is_initialized else None

    @keys.setter
    def keys(self, _: Any) -> None:
        raise AttributeError(_READ_ONLY)

    @values.setter
    def values(self, _: Any) -> None:
        raise AttributeError(_READ_ONLY)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Start an empty store on the device of key_states [B, H, T, Dk] (nothing of them is stored)."""
        self.device = key_states.device
        self.store.append(key_states[:, :, :0], value_states[:, :, :0])
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor] | tuple[CompressedTokens, CompressedTokens]:
        """Store key/value states [B, H, T, D]; return what the attention function reads. With ``layer_graphs``,
        the second of consecutive one-token steps on CUDA makes the store static (:meth:`KVStore.make_static`, where
        it can be) so that their attention is replayed from CUDA graphs (:func:`_compressed`); edits between steps
        (beam reorders, crops, offloading) keep it growing, as each would return it to the growing mode."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        reads_codes = getattr(self.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
        store = self.store
        if (self.layer_graphs and not store.static and store.recent is None and store.keys is not None
                and _graphed_step(self.config, key_states)):
            self._steps += 1
            if self._steps >= STATIC_AFTER:
                store.make_static(graphs=self.layer_graphs)
        store.append(key_states, value_states)
        if reads_codes:
            held = store.view()
        else:
            if not tracing():
                logger.warning_once(_decoding_warning(self.config))
            held = store.materialize(key_states.dtype)
        if self.settles:  # the chunk stays in full precision in ``held`` only, for this step's attention
            store.settle()
        return held

    def get_mask_sizes(self, query_length: int | Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next attention call, for the mask. ``query_length``: the number of
        new tokens (older 5.x releases pass ``cache_position`` [Q] instead)."""
        if isinstance(query_length, Tensor):
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.seq_length

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name in older 5.x releases

    def reset(self) -> None:
        self.store = self.store.empty_copy()
        self.is_initialized = False
        self._steps = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens as ``DynamicLayer.crop`` of the installed transformers does (a negative count
        removes that many; the meaning of 0 and positive values changed within 5.x)."""
        self.store.crop(_dynamic_crop_length(self.get_seq_length(), tokens_to_remove))
        self._steps = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select(beam_idx)
        self._steps = 0

    def batch_select_indices(self, indices: Tensor) -> None:
        self.store.select(indices)
        self._steps = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.repeat_interleave(repeats)
        self._steps = 0

    def offload(self) -> None:
        """Move the codes and the window to the CPU (non-blocking)."""
        self._steps = 0
        if self.is_initialized:
            self.store.to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        """Move offloaded codes and window back to the layer's device (non-blocking)."""
        if self.is_initialized and self.store.device != self.device:
            self.store.to(self.device, non_blocking=True)

    def nbytes(self) -> int:
        """Bytes held (codes + full-precision window)."""
        return self.store.nbytes()

    def nbytes_dense(self) -> int:
        """Bytes a bfloat16 ``DynamicLayer`` would hold for the same tokens."""
        return self.store.nbytes_dense()

    def nbytes_compressed(self) -> tuple[int, int]:
        """(bytes, tokens) of the codes alone (no window), tokens counted once per batch row."""
        return self.store.nbytes_compressed()


_READ_ONLY = (
    "TQLayer.keys and .values are decoded from the codes on demand and cannot be assigned; edit the cache "
    "with crop / batch_select_indices / reorder_cache, or build one from tensors with TQCache(ddp_cache_data=...)"
)


class TQCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers hold keys/values as tqindex codes.

    config: the model's config (``model.config``; the attention mode follows its ``_attn_implementation``,
    see the module docstring), or None to add layers as they are first updated. As ``DynamicCache``'s first
    argument it may also be ``ddp_cache_data``. key_encoder / value_encoder: encoder names for
    :func:`~tqindex.make_encoder` ("tq4", "tq8", "fp4", ...) or Encoder objects of the head dim (the default
    keys, "tq4-unbiased", scale each code for unbiased inner products with queries: see the README's
    measurements);
    residual_length: recent tokens kept in full precision; protected_layers: first and last attention
    layers kept entirely in full precision; ddp_cache_data: per-layer ``(keys, values[, sliding window
    tensor])`` to start from (``DataParallel`` gathers caches this way); offloading,
    offload_only_non_sliding: as for ``DynamicCache``; backend: the kernels of encoding and attention for
    encoders given by name ("torch", "triton", ...; None: ``$TQINDEX_BACKEND``, else auto: the GPU kernels
    on CUDA, see ``tqindex.kernels``); center_keys: store each compressed layer's keys relative to the mean
    key of its first update (per batch row and head; the attention is unchanged, the codes no longer spend
    bits on the component all keys of a head share: see :mod:`tqindex.kv.store`), except in models whose
    attention soft-caps its scores;
    policy: a :class:`~tqindex.kv.policy.KVPolicy` (or its dict, or the path of its JSON file, e.g. from
    :func:`tqindex.kv.calibrate`) choosing encoders, window and full precision per layer, in place of
    key_encoder, value_encoder, residual_length, protected_layers and center_keys (needs ``config``);
    sink_length: the first tokens of every compressed layer kept in full precision, never encoded (the
    tokens attention concentrates on whatever they hold, see :mod:`tqindex.kv.store`), policy or not; 0 encodes
    them like any other; encode_stride: tokens leaving the window are encoded once at least this many have
    left it (the window then holds up to ``encode_stride - 1`` tokens more than ``residual_length``), so a
    decode step pays the host time of encoding once every ``encode_stride`` steps (1: at every step);
    recent: None, or ``(length, key_encoder, value_encoder)``: every compressed layer holds its newest ``length``
    encoded tokens by these encoders (names or Encoder objects, e.g. ``(128, "tcq4-unbiased", "tcq4")`` beside
    2-bit codes) and transcodes them to its own codes as they age (a recent tier,
    :class:`~tqindex.kv.store.RecentTier`; no static mode, so no ``DecodeGraph``); a policy holds its tiers itself.
    layer_graphs: the attention shapes each compressed layer keeps recorded as CUDA graphs in eager one-token steps on
    CUDA (from the second of consecutive steps with no edit between them, the store held static and each layer's
    attention replayed: :func:`_compressed`; dense layers become :func:`dense_layer` at the first such step, filled
    in place and replayed the same way; 0: none, every step's attention launched anew, dense layers grown by
    concatenation as ``DynamicCache`` grows them; :class:`~tqindex.kv.DecodeGraph` replays whole steps).

    Where it differs from ``DynamicCache``, deliberately:

    - ``layers[i].keys`` / ``.values`` of a compressed layer are decoded on every access (see
      :class:`TQLayer`); to inspect memory use :meth:`nbytes`.
    - With ``layer_graphs`` (the default), eager one-token steps on CUDA turn dense layers into TQLayers that keep
      every token (:func:`dense_layer`: the same values; attended by the kernel's full-precision path, so the float
      rounding differs from SDPA's), as :class:`~tqindex.kv.DecodeGraph` does: a ``DynamicLayer`` concatenates its
      whole history at every step.
    - Layers whose key or value head dim is below 2 stay ``DynamicLayer`` (encoders need dim >= 2, and a
      1-d vector has nothing to compress).
    - Without a config the model's layer count is learned at the first update of an already-seen layer
      (the second forward pass); the last ``protected_layers`` layers are then turned into
      ``DynamicLayer``: exact, as no layer compresses anything before its second update. Without a config
      the attention implementation is unknown too, so compressed layers hand out decoded tensors.
    - Caches built from ``ddp_cache_data`` hold the given (decoded) tensors in the full-precision window;
      they are encoded again as they leave it.
    - Offloading moves codes and windows; on a CPU cache there is nothing to offload and it does nothing.
    - Keys and values are not checked for NaN or inf (see :mod:`tqindex.kv.store`).
    - A ``torch.compile``-d decode step compiles again whenever a layer's code buffer grows (O(log T) times
      for T tokens, see :class:`~tqindex.kv.store.CodesBuffer`).
    """

    def __init__(
        self,
        config: PreTrainedConfig | Iterable[tuple[Tensor | None, ...]] | None = None,
        key_encoder: str | Encoder = "tq4-unbiased",
        value_encoder: str | Encoder = "tq4",
        residual_length: int = 128,
        protected_layers: int = 2,
        *,
        ddp_cache_data: Iterable[tuple[Tensor | None, ...]] | None = None,
        offloading: bool = False,
        offload_only_non_sliding: bool = False,
        backend: str | None = None,
        center_keys: bool = True,
        policy: KVPolicy | dict | str | os.PathLike | None = None,
        sink_length: int = SINK_LENGTH,
        encode_stride: int = ENCODE_STRIDE,
        recent: tuple[int, str | Encoder, str | Encoder] | None = None,
        layer_graphs: int = LAYER_GRAPHS,
    ) -> None:
        self.backend = kernels.check_backend(backend)
        self.layer_graphs = check_int(layer_graphs, "layer_graphs", 0)
        if recent is not None:
            if not isinstance(recent, (tuple, list)) or len(recent) != 3:
                raise TypeError(f"recent must be None or (length, key_encoder, value_encoder), got {recent!r}")
            check_int(recent[0], "recent length", 1)
            for name, spec in zip(("recent key_encoder", "recent value_encoder"), recent[1:]):
                _check_encoder_spec(spec, name)
            if policy is not None:
                raise ValueError("pass either a policy or recent (a policy holds each layer's recent tier)")
        self.recent = None if recent is None else tuple(recent)
        self.center_keys = check_bool(center_keys, "center_keys")
        self.sink_length = check_int(sink_length, "sink_length", 0)
        self.encode_stride = check_int(encode_stride, "encode_stride", 1)
        if config is not None and not isinstance(config, PreTrainedConfig):
            if isinstance(config, (str, bytes, dict)) or not isinstance(config, Iterable) or ddp_cache_data is not None:
                raise TypeError(
                    "config must be a transformers PreTrainedConfig (or, as DynamicCache's first argument, "
                    f"ddp_cache_data: per-layer (keys, values) tuples), got {type(config).__name__}"
                )
            config, ddp_cache_data = None, config
        for name, spec in (("key_encoder", key_encoder), ("value_encoder", value_encoder)):
            _check_encoder_spec(spec, name)
        self.residual_length = check_int(residual_length, "residual_length", 0)
        self.protected_layers = check_int(protected_layers, "protected_layers", 0)
        check_bool(offloading, "offloading")
        check_bool(offload_only_non_sliding, "offload_only_non_sliding")
        given = (key_encoder, value_encoder, residual_length, protected_layers, center_keys)
        self.policy = _policy(policy, config, given)
        super().__init__(config=config, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
        self.layer_class_to_replicate = None  # layers are added by update (see _add_layers)
        self.config = config
        self.key_encoder, self.value_encoder = key_encoder, value_encoder
        # Number of cache layers once known: from the config, from ddp_cache_data or at the second forward pass.
        self.num_model_layers: int | None = None
        if config is not None:
            text_config = config.get_text_config(decoder=True)
            self._text_config = text_config
            if getattr(text_config, "attn_logit_softcapping", None) is not None:
                self.center_keys = False  # soft-capped scores change when every key moves by a constant
            protected = _protected(self.layers, self.protected_layers)
            dims = _head_dims(text_config)
            if self.policy is not None:
                self.layers = self._policy_layers(dims)
            else:
                if min(dims) >= 2:  # encoder objects must fit even when every layer is protected
                    _encoder(key_encoder, dims[0], "key_encoder")
                    _encoder(value_encoder, dims[1], "value_encoder")
                    if self.recent is not None:
                        _encoder(self.recent[1], dims[0], "recent key_encoder")
                        _encoder(self.recent[2], dims[1], "recent value_encoder")
                self.layers = [
                    self._layer(dims) if type(layer) is DynamicLayer and i not in protected else layer
                    for i, layer in enumerate(self.layers)
                ]
            self.num_model_layers = len(self.layers)
        else:
            self._text_config = None
        if ddp_cache_data is not None:
            self._fill(ddp_cache_data)

    def __deepcopy__(self, memo: dict[int, Any]) -> "TQCache":
        """Copy the stored tokens; the copy shares the config and the encoder objects."""
        shared = (self.config, self._text_config, self.key_encoder, self.value_encoder, *(self.recent or ()))
        return _deepcopy_sharing(self, memo, tuple(s for s in shared if not isinstance(s, str)))

    @classmethod
    def preset(cls, config: PreTrainedConfig | None, name: str, **kwargs: Any) -> "TQCache":
        """Cache from a preset name: ``"k{a}v{b}"`` (TurboQuant "tq{a}-unbiased" keys, as by default, and
        "tq{b}" values, a, b in 1, 2, 3, 4, 8; e.g. "k8v4", "k4v4", "k3v4", "k2v2") or ``"fp4"`` (FP4-UE8M0
        keys and values).
        ``kwargs`` go to the constructor (``residual_length``, ``protected_layers``, ...)."""
        match = _PRESET.fullmatch(name) if isinstance(name, str) else None
        if name == "fp4":
            return cls(config, "fp4", "fp4", **kwargs)
        if match and all(int(b) in MSE_BITS for b in match.groups()):
            return cls(config, f"tq{match[1]}-unbiased", f"tq{match[2]}", **kwargs)
        raise ValueError(f"preset must be 'fp4' or 'k{{a}}v{{b}}' with a, b in {MSE_BITS}, got {name!r}")

    # -- layers ------------------------------------------------------------------------------------
    def _layer(self, dims: tuple[int, int], protected: bool = False) -> CacheLayerMixin:
        """A new layer for key/value head dims ``dims``: a TQLayer, or a DynamicLayer when protected or
        when a head dim is below 2."""
        if protected:
            return DynamicLayer()
        if min(dims) < 2:
            logger.warning_once(f"TQCache keeps layers with head dims {dims} as DynamicLayer: encoders need dim >= 2")
            return DynamicLayer()
        keys = _encoder(self.key_encoder, dims[0], "key_encoder", self.backend)
        values = _encoder(self.value_encoder, dims[1], "value_encoder", self.backend)
        recent = None if self.recent is None else RecentTier(
            self.recent[0], _encoder(self.recent[1], dims[0], "recent key_encoder", self.backend),
            _encoder(self.recent[2], dims[1], "recent value_encoder", self.backend))
        return TQLayer(keys, values, self.residual_length, self._text_config, self.center_keys,
                       sink_length=self.sink_length, encode_stride=self.encode_stride, recent=recent,
                       layer_graphs=self.layer_graphs)

    def _policy_layers(self, dims: tuple[int, int]) -> list[CacheLayerMixin]:
        """The layers :attr:`policy` describes: its entry i for a full-attention layer i (other layer types
        keep transformers' classes, whatever their entry)."""
        if len(self.policy.layers) != len(self.layers):
            raise ValueError(f"the policy has {len(self.policy.layers)} layers, the model's cache {len(self.layers)}")
        center = self.center_keys and self.policy.center_keys
        layers = []
        for layer, entry in zip(self.layers, self.policy.layers):
            if type(layer) is not DynamicLayer or entry.dense or min(dims) < 2:
                layers.append(layer)
                continue
            keys = encoder_for(entry.key_encoder, dims[0], self.backend)
            values = encoder_for(entry.value_encoder, dims[1], self.backend)
            scale = None if entry.key_scale is None else torch.tensor(entry.key_scale)
            recent = None if not entry.recent_length else RecentTier(
                entry.recent_length, encoder_for(entry.recent_key_encoder, dims[0], self.backend),
                encoder_for(entry.recent_value_encoder, dims[1], self.backend))
            layers.append(TQLayer(keys, values, entry.residual_length, self._text_config, center, scale,
                                  sink_length=self.sink_length, encode_stride=self.encode_stride, recent=recent,
                                  layer_graphs=self.layer_graphs))
        return layers

    def _add_layers(self, layer_idx: int, key_states: Tensor, value_states: Tensor) -> None:
        """Config-less caches: add layers up to ``layer_idx`` (the first ``protected_layers`` dense), and
        protect the last ones once the number of layers is known."""
        if self.config is not None:
            return
        if layer_idx < len(self.layers):
            if self.num_model_layers is None:  # a layer seen before: the model has len(self.layers) layers
                self._protect_last_layers()
            return
        dims = (key_states.shape[-1], value_states.shape[-1])
        while len(self.layers) <= layer_idx:
            first = self.num_model_layers is None and len(self.layers) < self.protected_layers
            layer = self._layer(dims, protected=first)
            if isinstance(layer, TQLayer) and self.num_model_layers is None:  # may turn out to be a last layer
                layer.settles = False
            self.layers.append(layer)

    def _protect_last_layers(self) -> None:
        self.num_model_layers = len(self.layers)
        for i in _protected(self.layers, self.protected_layers):
            layer = self.layers[i]
            if isinstance(layer, TQLayer):
                dense = DynamicLayer()
                if layer.is_initialized:
                    assert layer.store.compressed_length == 0  # one update, not settled: all in the window
                    dense.update(layer.keys, layer.values)
                self.layers[i] = dense
        for layer in self.layers:
            if isinstance(layer, TQLayer):
                layer.settles = True

    def _fill(self, data: Iterable[tuple[Tensor | None, ...]]) -> None:
        """Start from per-layer ``(keys, values[, sliding window tensor])`` (``ddp_cache_data``)."""
        entries = [tuple(entry) for entry in data]
        for i, entry in enumerate(entries):
            if len(entry) not in (2, 3) or not all(t is None or isinstance(t, Tensor) for t in entry):
                raise TypeError(
                    f"ddp_cache_data[{i}] must be (keys, values) or (keys, values, sliding window) tensors or None, "
                    f"got {tuple(type(t).__name__ for t in entry)}"
                )
        if self.config is None:
            self.layers = [
                DynamicSlidingWindowLayer(sliding_window=int(entry[2].reshape(-1)[0]))
                if len(entry) == 3 and entry[2] is not None
                else DynamicLayer()
                for entry in entries
            ]
            protected = _protected(self.layers, self.protected_layers)
            for i, (k, v, *_) in enumerate(entries):
                if type(self.layers[i]) is DynamicLayer and k is not None and v is not None:
                    self.layers[i] = self._layer((k.shape[-1], v.shape[-1]), protected=i in protected)
            self.num_model_layers = len(self.layers)
        if len(entries) > len(self.layers):
            raise ValueError(f"ddp_cache_data has {len(entries)} layers, the config {len(self.layers)}")
        for layer, (k, v, *_) in zip(self.layers, entries):
            if k is not None and v is not None:
                layer.update(k, v)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor] | tuple[CompressedTokens, CompressedTokens]:
        """Store key/value states [B, H, T, D] of layer ``layer_idx``; return what its attention reads. With
        ``layer_graphs``, an eager one-token CUDA step turns a dense layer (``DynamicLayer``: protected) into a
        :func:`dense_layer`, whose buffer fills in place and whose attention is replayed as a compressed layer's is."""
        self._add_layers(layer_idx, key_states, value_states)
        if self.offloading and key_states.device.type == "cpu":  # nothing to offload to
            return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        layer = self.layers[layer_idx]
        if (self.layer_graphs and not self.offloading and type(layer) is DynamicLayer and layer.is_initialized
                and _graphed_step(self._text_config, key_states)):
            self.layers[layer_idx] = dense_layer(layer, self._text_config, self.layer_graphs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # -- memory ------------------------------------------------------------------------------------
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


def dense_layer(layer: DynamicLayer, config: PreTrainedConfig | None = None, layer_graphs: int = LAYER_GRAPHS
                ) -> TQLayer:
    """A TQLayer holding a DynamicLayer's keys and values [B, H, T, D] in a window that keeps every token
    (nothing is ever encoded: the same values, read by the attention kernel's full-precision path once its store is
    static, by SDPA before); its encoders only give the kernel its tables. ``config``: the model's text config, as
    for TQLayer; ``layer_graphs``: as for TQLayer."""
    keys, values = layer.keys, layer.values
    dense = TQLayer(_table_encoder(keys.shape[-1]), _table_encoder(values.shape[-1]), KEEP_ALL, config,
                    layer_graphs=layer_graphs)
    dense.lazy_initialization(keys, values)
    dense.store.append(keys, values)
    return dense


@lru_cache(maxsize=None)
def _table_encoder(dim: int) -> Encoder:
    return make_encoder("tq4", dim)


def _layer_bytes(layer: Any) -> tuple[int, int]:
    """(bytes held, bytes of the bfloat16 equivalent) of one cache layer."""
    if isinstance(layer, TQLayer):
        return layer.nbytes(), layer.nbytes_dense()
    tensors = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors), sum(2 * t.numel() for t in tensors)


def _protected(layers: list[Any], n: int) -> set[int]:
    """Indices of the first and last ``n`` attention layers (layers with keys and values) of ``layers``."""
    attention = [i for i, layer in enumerate(layers) if isinstance(layer, CacheLayerMixin)]
    return set(attention[:n] + attention[len(attention) - n :])


def _head_dims(text_config: PreTrainedConfig) -> tuple[int, int]:
    """(key head dim, value head dim) of a decoder config."""
    keys = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return keys, getattr(text_config, "v_head_dim", None) or keys


def _policy(
    policy: KVPolicy | dict | str | os.PathLike | None, config: PreTrainedConfig | None, given: tuple[Any, ...]
) -> KVPolicy | None:
    """The policy argument of TQCache as a KVPolicy (None stays None), checked against the other arguments
    ``given`` (key_encoder, value_encoder, residual_length, protected_layers, center_keys: at their defaults)
    and the config."""
    if policy is None:
        return None
    if isinstance(policy, (str, os.PathLike)):
        policy = KVPolicy.load(policy)
    elif isinstance(policy, dict):
        policy = KVPolicy.from_dict(policy)
    elif not isinstance(policy, KVPolicy):
        raise TypeError(f"policy must be a KVPolicy, its dict or the path of its JSON file, got "
                        f"{type(policy).__name__}")
    names = ("key_encoder", "value_encoder", "residual_length", "protected_layers", "center_keys")
    params = inspect.signature(TQCache.__init__).parameters
    if given != tuple(params[name].default for name in names):
        raise ValueError("pass either a policy or key_encoder / value_encoder / residual_length / protected_layers / "
                         "center_keys: the policy chooses them per layer")
    if config is None:
        raise TypeError("a policy describes the layers of a model: pass its config too, "
                        "TQCache(model.config, policy=...)")
    return policy


def _check_encoder_spec(spec: Any, name: str) -> None:
    if isinstance(spec, str):
        if spec not in encoder_names():
            raise ValueError(f"{name} {spec!r} is an unknown encoder name; known names: {', '.join(encoder_names())}")
    elif not isinstance(spec, Encoder):
        raise TypeError(f"{name} must be an encoder name (str) or a tqindex Encoder, got {type(spec).__name__}")


@lru_cache(maxsize=None)
def _named_encoder(name: str, dim: int, backend: str | None = None) -> Encoder:
    """The encoder ``name`` of dimension ``dim`` whose kernels follow ``backend``."""
    return make_encoder(name, dim, backend=backend)


def _encoder(spec: str | Encoder, dim: int, name: str, backend: str | None = None) -> Encoder:
    """The encoder of dimension ``dim`` from a registry name (with ``backend``) or an Encoder object (with its
    own backend)."""
    if isinstance(spec, str):
        return _named_encoder(spec, dim, backend)
    if spec.dim != dim:
        raise ValueError(f"{name} has dim {spec.dim}, the model's head dim is {dim}")
    return spec


def _decoding_warning(config: PreTrainedConfig | None) -> str:
    fix = f"build TQCache(model.config) and call model.set_attn_implementation({ATTN_IMPLEMENTATION!r})"
    if config is None:
        reason = "TQCache was built without a config, so it does not know the model's attention: it"
    elif config._attn_implementation is None:
        reason = "TQCache's config names no attention implementation (not the config of a loaded model?): it"
    else:
        reason = f"TQCache, under {config._attn_implementation!r} attention,"
    return f"{reason} decodes its compressed keys/values at every step; {fix} to attend from the codes."


def _dynamic_crop_length(length: int, tokens_to_remove: int) -> int:
    """The length ``DynamicLayer.crop(tokens_to_remove)`` leaves of ``length`` tokens in the installed
    transformers, with its errors and warnings: run on a layer of ``length`` stride-0 (memory-free) tokens."""
    probe = DynamicLayer()
    probe.keys = probe.values = torch.zeros(()).expand(1, 1, length, 1)
    probe.is_initialized = True
    DynamicLayer.crop(probe, tokens_to_remove)
    return probe.keys.shape[-2]


def _deepcopy_sharing(obj: Any, memo: dict[int, Any], shared: tuple[Any, ...]) -> Any:
    """``deepcopy(obj)`` whose copy refers to the very objects in ``shared`` (configs, encoders)."""
    for item in shared:
        memo.setdefault(id(item), item)
    copy = object.__new__(type(obj))
    memo[id(obj)] = copy
    copy.__dict__.update(deepcopy(obj.__dict__, memo))
    return copy


# -- torch pytree ----------------------------------------------------------------------------------
# A TQCache flattens to the tensors it holds: per layer, every tensor attribute of a dense layer and the
# KVStore tensors (codes' planes, windows) of a TQLayer. The context keeps everything else, comparable by
# value: classes, plain attributes, the config, encoders by their operator key, the stores' layouts.
_LEAF = "<tensor>"


@dataclass(frozen=True)
class _EncoderRef:
    key: str  # encoder_key(encoder)


@dataclass(frozen=True)
class _StoreSpec:
    key_encoder: str
    value_encoder: str
    residual_length: int
    tensors: int
    center_keys: bool
    scaled: bool  # the store's key_scale follows its tensors
    sink_length: int
    encode_stride: int
    recent: tuple[int, str, str] | None  # the recent tier's length and encoders' keys


def _flatten_object(obj: Any, path: str, leaves: list[tuple[str, Tensor]]) -> tuple[type, tuple]:
    """(class, ((attribute, value or marker), ...)) of ``obj``; its tensors appended to ``leaves``."""
    items = []
    for name, value in sorted(vars(obj).items()):
        if name == "prefetch_stream":  # a CUDA stream: made again when unflattening
            continue
        if isinstance(value, Tensor):
            leaves.append((f"{path}{name}", value))
            value = _LEAF
        elif isinstance(value, KVStore):
            tensors = value.tensors()
            leaves += [(f"{path}{name}.{j}", t) for j, t in enumerate(tensors)]
            scaled = value.key_scale is not None
            if scaled:
                leaves.append((f"{path}{name}.key_scale", value.key_scale))
            recent = None if value.recent is None else (value.recent.length, *value._recent_ids)
            value = _StoreSpec(value._key_id, value._value_id, value.residual_length, len(tensors), value.center_keys,
                               scaled, value.sink_length, value.encode_stride, recent)
        elif isinstance(value, Encoder):
            value = _EncoderRef(encoder_key(value))
        elif name == "layers":
            value = tuple(_flatten_object(layer, f"layers.{i}.", leaves) for i, layer in enumerate(value))
        elif isinstance(value, (list, tuple, dict)) and any(isinstance(t, Tensor) for t in pytree.tree_leaves(value)):
            raise TypeError(f"{type(obj).__name__}.{name} holds tensors in a container: TQCache flattens tensors "
                            "that are attributes of its layers only")
        items.append((name, value))
    return type(obj), tuple(items)


def _unflatten_object(context: tuple[type, tuple], leaves: Iterator[Tensor]) -> Any:
    cls, items = context
    obj = object.__new__(cls)
    for name, value in items:
        if isinstance(value, str) and value == _LEAF:
            value = next(leaves)
        elif isinstance(value, _StoreSpec):
            tensors = [next(leaves) for _ in range(value.tensors)]
            scale = next(leaves) if value.scaled else None
            encoders = encoder_from_key(value.key_encoder), encoder_from_key(value.value_encoder)
            recent = None if value.recent is None else RecentTier(value.recent[0], *map(encoder_from_key,
                                                                                        value.recent[1:]))
            value = KVStore.from_tensors(*encoders, value.residual_length, tensors, value.center_keys, scale,
                                         value.sink_length, value.encode_stride, recent)
        elif isinstance(value, _EncoderRef):
            value = encoder_from_key(value.key)
        elif name == "layers":
            value = [_unflatten_object(layer, leaves) for layer in value]
        obj.__dict__[name] = value
    if getattr(obj, "offloading", False):
        obj.prefetch_stream = torch.Stream()
    return obj


def _flatten_with_keys(cache: TQCache) -> tuple[list[tuple[Any, Tensor]], Any]:
    leaves: list[tuple[str, Tensor]] = []
    context = _flatten_object(cache, "", leaves)
    return [(pytree.MappingKey(path), t) for path, t in leaves], context


def _flatten(cache: TQCache) -> tuple[list[Tensor], Any]:
    pairs, context = _flatten_with_keys(cache)
    return [t for _, t in pairs], context


def _unflatten(values: Iterable[Tensor], context: Any) -> TQCache:
    return _unflatten_object(context, iter(values))


pytree.register_pytree_node(
    TQCache,
    _flatten,
    _unflatten,
    serialized_type_name=f"{TQCache.__module__}.{TQCache.__qualname__}",
    flatten_with_keys_fn=_flatten_with_keys,
)
