"""One-token decode steps replayed from a CUDA graph: a model step's host time paid once, not at every token.

A decode step of a transformers model launches hundreds of small kernels from Python; on a fast GPU the
host's launch work, not the GPU, sets the step time (a Llama-8B-shaped model spends about 20 ms of host time
on a step whose kernels need a few). :class:`DecodeGraph` records the step of a given batch size as a CUDA
graph and replays it for every later token: one launch, and between replays only the host work the graph
cannot do.

A graph replays the same kernels on the same memory, so every cache layer must fill in place:

- TQCache's compressed layers (``TQLayer``, attention implementation "tqindex"): their stores are made
  static at the first step (:meth:`tqindex.kv.store.KVStore.make_static`: a fixed-capacity window written
  at a position held on the device, the attention kernel reading the valid lengths there). Between replays
  the host makes room in each window (encoding the tokens that leave it, once every ``encode_stride`` steps)
  and counts the appended token; the step is recorded again when a code buffer had to grow (every
  ``headroom`` tokens) or an edit (``crop``, ``reorder_cache``, ...) returned a store to the growing mode.
  Attention reads the same tokens as without the graph (after a ``crop``, a store may keep up to
  ``encode_stride`` tokens more in full precision: it encodes before the step that needs the room; window keys
  times a matrix key scale differ by float rounding, see ``make_static``).
- TQCache's dense layers (``DynamicLayer``: protected layers): turned into TQLayers whose window keeps every
  token (:func:`~tqindex.kv.hf.dense_layer`: the same keys and values, in place of the DynamicLayer in
  ``cache.layers``, as TQCache's eager steps on CUDA do with ``layer_graphs``),
  attended by the kernel's full-precision path instead of SDPA (the float rounding differs); their buffer
  leaves ``headroom`` tokens free, and the step is recorded again when it fills.
- transformers' ``StaticLayer`` (``StaticCache``): its update writes at positions on the device.

Other layers (a ``DynamicCache``'s, which transformers' own code expects to stay DynamicLayers, sliding
windows, linear attention) cannot be replayed: ValueError naming the layer. On a device
other than CUDA the steps run eagerly, in the same static mode (how the CPU tests check it). Between steps,
other forward passes over the cache are allowed where its layers are TQLayers (their lengths are read from
the stores), not for a StaticCache (its length is counted here).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..checks import check_int
from .hf import ATTN_IMPLEMENTATION, TQCache, TQLayer, dense_layer
from .store import STATIC_HEADROOM, KVStore


class DecodeGraph:
    """One-token decode steps of ``model`` over ``cache``, recorded as a CUDA graph and replayed (module notes).

    model: a transformers causal LM on its device; cache: a prefilled ``TQCache`` (its dense layers are turned
    into TQLayers, module notes) or a ``StaticCache``, not used by other code between steps except as the
    module notes allow; headroom: tokens of code (and dense window) capacity reserved at a time, >= 1.
    ``recordings`` counts the graphs recorded so far.
    """

    def __init__(self, model: torch.nn.Module, cache: Any, *, headroom: int = STATIC_HEADROOM) -> None:
        self.model, self.cache = model, cache
        self.headroom = check_int(headroom, "headroom", 1)
        self._kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._graph: torch.cuda.CUDAGraph | None = None
        self._key: tuple | None = None
        self._steps = 0
        self._position: int | None = None  # tokens held, counted here for caches without TQLayers
        self.recordings = 0

    @torch.no_grad()
    def __call__(self, input_ids: Tensor) -> Tensor:
        """Append one token per sequence: input_ids long [B, 1] on the model's device -> the logits of the next
        token, [B, vocab] in the model's dtype (a new tensor)."""
        device = self.model.device
        if not isinstance(input_ids, Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2 \
                or input_ids.shape[1] != 1:
            raise ValueError(f"input_ids must be a long tensor [B, 1], got {_describe(input_ids)}")
        if input_ids.device != device:
            raise ValueError(f"input_ids must be on the model's device {device}, got {input_ids.device}")
        stores = self._prepare()
        position = stores[0].seq_length if stores else self._position
        key = (input_ids.shape[0], *(store.static_state() for store in stores), *self._static_layers())
        if device.type != "cuda" or self._steps == 0:  # the first step runs eagerly: kernels compile, libraries load
            self._steps += 1
            self._position = position + 1
            self._new_inputs(input_ids, position)
            return self._forward()
        if key != self._key:
            self._record(input_ids, position, key, stores)  # runs the model code once: stores count the token
        else:
            self._inputs(input_ids, position)
            self._graph.replay()
            for store in stores:
                store.advance(1)
        self._steps += 1
        self._position = position + 1
        return self._logits.clone()

    # -- steps -------------------------------------------------------------------------------------
    def _prepare(self) -> list[KVStore]:
        """Check the cache's layers; turn DynamicLayers into dense TQLayers; make the TQLayers' stores static,
        with room for this step's token."""
        refusal = _refusal(self.model, self.cache)  # all checked before any layer is changed
        if refusal:
            raise ValueError(refusal)
        layers = self.cache.layers
        stores = []
        for i, layer in enumerate(layers):
            if isinstance(layer, StaticLayer):
                continue
            if not isinstance(layer, TQLayer):
                layer = layers[i] = dense_layer(layer, self.cache._text_config)
            layer.store.make_static(self.headroom)  # with room for this step's token
            stores.append(layer.store)
        if not stores and self._position is None:
            self._position = int(self.cache.get_seq_length())  # once (a device read on some releases)
        return stores

    def _static_layers(self) -> tuple[int, ...]:
        """Addresses of the StaticLayers' buffers (allocated at their first update)."""
        return tuple(layer.keys.data_ptr() for layer in self.cache.layers
                     if isinstance(layer, StaticLayer) and layer.is_initialized)

    def _inputs(self, input_ids: Tensor, position: int) -> None:
        self._ids.copy_(input_ids)
        self._cache_position.fill_(position)

    def _new_inputs(self, input_ids: Tensor, position: int) -> None:
        """Fresh input tensors of the step (a recording keeps their addresses)."""
        self._ids = input_ids.clone()
        self._cache_position = torch.full((1,), position, dtype=torch.long, device=input_ids.device)

    def _forward(self) -> Tensor:
        """The model's step over the input tensors -> logits [B, vocab]."""
        ids, cache_position = self._ids, self._cache_position
        out = self.model(input_ids=ids, position_ids=cache_position.view(1, 1).expand(ids.shape[0], 1),
                         cache_position=cache_position, use_cache=True, logits_to_keep=1, **{self._kw: self.cache})
        return out.logits[:, -1]

    def _record(self, input_ids: Tensor, position: int, key: tuple, stores: list[KVStore]) -> None:
        """Record the step as a CUDA graph (replacing the previous one) and run it once. A recording that fails
        leaves the stores' counts as they were (its appends were recorded, not run)."""
        self._graph = self._logits = None
        self._new_inputs(input_ids, position)
        held = [store.window_length for store in stores]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):  # its own memory pool: the previous graph's was freed with it
                self._logits = self._forward()
        except BaseException:
            for store, n in zip(stores, held):
                store.advance(n - store.window_length)
            raise
        graph.replay()
        self._graph, self._key = graph, key
        self.recordings += 1


@contextmanager
def decode_graphs(model: torch.nn.Module, *, headroom: int = STATIC_HEADROOM) -> Iterator["GraphedSteps"]:
    """Within the block, ``model``'s one-token decode steps over a TQCache go through a :class:`DecodeGraph` of that
    cache, so that ``model.generate(..., cache=TQCache(...))`` (or any loop of forward calls) replays its steps from
    a CUDA graph with no other change; ``model.forward`` is itself again after the block. Yields the
    :class:`GraphedSteps` that stands in for ``model.forward`` (its counts say how the steps ran).

    A call runs the model's own forward where a DecodeGraph would not give its result: more than one token (a
    prefill) or an empty cache, input embeddings, a cache that is not a TQCache, an attention mask with a zero
    anywhere (padding: one device read per step), outputs beyond the logits and the cache (attentions, hidden
    states, ``return_dict=False``), a model without the "tqindex" attention; and, for the rest of a cache's life, a
    cache that DecodeGraph refuses when it first comes (offloading, layers it cannot replay such as sliding windows)
    or over which two consecutive steps each had to be recorded anew (edits between steps such as beam
    search's reorders return its stores to the growing mode every time; TQCache's own eager steps follow them
    better). ``headroom``: as for DecodeGraph."""
    check_int(headroom, "headroom", 1)
    had = model.__dict__.get("forward")
    steps = GraphedSteps(model, model.forward, headroom)
    model.forward = steps
    try:
        yield steps
    finally:
        if had is None:
            del model.forward
        else:
            model.forward = had


class GraphedSteps:
    """``model.forward`` within :func:`decode_graphs`: one DecodeGraph at a time, for the cache of the latest step
    it served (a new cache replaces it). ``replayed`` counts the steps that went through a DecodeGraph, ``eager``
    the calls passed to the model's own forward."""

    _PLAIN = {"input_ids", "cache", "past_key_values", "position_ids", "cache_position", "attention_mask",
              "inputs_embeds", "logits_to_keep", "use_cache", "return_dict"}
    """Arguments a one-token step may carry (``attention_mask`` without padding, ``inputs_embeds`` None,
    ``use_cache`` and ``return_dict`` not False); any other argument set to something but None or False makes
    the call eager."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any], headroom: int) -> None:
        self.model, self.forward, self.headroom = model, forward, headroom
        self.replayed = self.eager = 0
        self._cache: Any = None  # the cache of the latest step served
        self._graph: DecodeGraph | None = None  # its graph; None once given up (or never replayable)
        self._recorded = False  # whether the latest step over it was recorded anew
        self._inside = False  # a DecodeGraph's own forward call
        functools.update_wrapper(self, forward)  # the signature transformers inspects

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._inside:
            return self.forward(*args, **kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not self._replayable(args, kwargs, cache):
            self.eager += 1
            return self.forward(*args, **kwargs)
        graph, before = self._graph, self._graph.recordings
        self._inside = True
        try:
            logits = graph(kwargs["input_ids"])
        finally:
            self._inside = False
        recorded = graph.recordings > before
        if recorded and self._recorded:
            self._graph = None  # given up on this cache: its later steps run eagerly
        self._recorded = recorded
        self.replayed += 1
        return CausalLMOutputWithPast(logits=logits[:, None], **{graph._kw: cache})

    def _replayable(self, args: tuple, kwargs: dict[str, Any], cache: Any) -> bool:
        """Whether this call is a step the cache's DecodeGraph replays (made here for a new cache)."""
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if (args or not isinstance(cache, TQCache) or not cache.get_seq_length()
                or not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[1] != 1
                or kwargs.get("inputs_embeds") is not None or kwargs.get("use_cache") is False
                or kwargs.get("return_dict") is False
                or getattr(self.model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION  # may change
                or any(v is not None and v is not False for k, v in kwargs.items() if k not in self._PLAIN)):
            return False
        if cache is not self._cache:  # DecodeGraph's own checks, once per cache
            self._cache, self._recorded = cache, False
            refused = _refusal(self.model, cache)
            self._graph = None if refused else DecodeGraph(self.model, cache, headroom=self.headroom)
        return self._graph is not None and (mask is None or bool(mask.all()))


def _refusal(model: torch.nn.Module, cache: Any) -> str | None:
    """Why DecodeGraph cannot replay steps of ``model`` over ``cache`` now, or None where it can."""
    if getattr(cache, "offloading", False):
        return ("DecodeGraph needs a cache without offloading (its layers move between devices at every step, which a "
                "recorded graph cannot follow)")
    tq_cache = isinstance(cache, TQCache)
    if tq_cache and getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return (f"DecodeGraph over a TQCache needs the {ATTN_IMPLEMENTATION!r} attention "
                f"(model.set_attn_implementation({ATTN_IMPLEMENTATION!r}))")
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, StaticLayer):
            continue
        if not (isinstance(layer, TQLayer) or tq_cache and type(layer) is DynamicLayer):
            return (f"cache layer {i} is a {type(layer).__name__}, which DecodeGraph cannot replay: the layers of a "
                    "TQCache (its dense ones too) and of a StaticCache can be")
        if not layer.is_initialized:
            return f"prefill the cache before decoding with DecodeGraph (layer {i} is empty)"
    return None


def _describe(x: Any) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
