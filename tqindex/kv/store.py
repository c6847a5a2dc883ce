"""Compressed per-layer K/V storage: a full-precision window of recent tokens, older tokens as Codes.

A :class:`KVStore` holds one attention layer's keys and values, ``[B, H, T, dim]`` each. The newest
tokens (the last ``residual_length`` of the previous steps plus the chunk of the current step) stay in
full precision in the *window*; the tokens that fall out of it are encoded once (by :meth:`KVStore.settle`
once the step's attention has read them, or by the next :meth:`KVStore.append`) and appended to a
:class:`CodesBuffer`. With ``encode_stride`` n > 1 they are encoded n or more at a time: the window then
holds between ``residual_length`` and ``residual_length + n - 1`` tokens of earlier steps, and a decode step
encodes (two encoder calls and their small operations, host time that does not shrink with the tokens) once
every n steps instead of at every step. A buffer's capacity grows by a 32nd (at least MIN_CAPACITY tokens)
when full: amortized O(1) per token, no copy of the history per step, and little of a long buffer unused.
Keys and values have their own encoders.

With ``sink_length`` s, the first s tokens of the sequence are never encoded: attention concentrates on
them whatever they hold (the "attention sinks" of language models), so their error reaches every later
token's output. They stay at the start of the window, which then holds them and the newest tokens; in the
sequence's order they come before the codes (:class:`CompressedTokens` ``sink``).

With ``center_keys``, keys are encoded relative to a per-row, per-head offset: the mean of the keys of
the first (non-empty) append, usually the prompt. Attention is ``softmax(q · kᵀ + mask)``, and a
constant subtracted from every key of a head shifts each query's scores by the same amount, so the
attention over the stored keys is unchanged, while the codes spend their bits on what varies from
token to token (keys of language models share a large common component). The window keeps the keys as
given; :meth:`KVStore.view` hands out every key minus the offset (for attention), :meth:`KVStore.materialize`
the decoded codes plus the offset and the window as held. This holds for softmax attention only: not with
soft-capped scores or extra sink logits.

With a ``key_scale`` M per head (e.g. calibrated by :func:`tqindex.kv.calibrate.key_scales`), either a scale
per channel s ([H, Dk], M = diag(s)) or an invertible matrix ([H, Dk, Dk]), the codes hold the row vectors
``(k - offset) M⁻¹`` and attention multiplies the queries by ``Mᵀ``: the scores ``q · k`` are unchanged, while
the codes' error, spread evenly over the coordinates of the held keys by the rotation, lands on the scores in
proportion to ``||q Mᵀ|| · ||k M⁻¹||`` instead of ``||q|| · ||k||``; directions where keys are large and
queries small (and the reverse) stop dominating it.

With a ``recent`` tier (:class:`RecentTier`), the tokens leaving the window are first encoded by the tier's own
encoders (more bits) and held in a second pair of buffers; once the tier holds more than its ``length`` tokens, its
oldest are decoded and encoded again by the store's encoders (transcoded: nothing of them is kept in full
precision). In the sequence's order the tier's tokens come after the older codes and before the window. Attention
reads them decoded at the start of the window's recent part (:meth:`KVStore.view`; a transient copy of at most
``length + encode_stride - 1`` tokens, like the window's own). Language models attend most to their newest tokens,
so a few of them at 4 bits cost little and remove much of the error of 2-bit codes.

Traced encoding goes through the PyTorch operator ``tqindex::encode_tokens`` (:func:`encode_tokens`),
which ``torch.compile`` and ``torch.export`` treat as one opaque call (eager code calls the encoder
directly, without the operator's dispatch): nothing in an append reads the data on the host, so a
decode step compiles into one graph and never waits for the device. The tokens are not checked for NaN
or inf (that check would read every key back from the device at every step); they come from the model,
and the codes of a non-finite vector are meaningless.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import check_int
from ..codes import Codes
from ..encoder import Encoder, encoder_from_dict
from ..kernels.graphs import SearchGraphs

DENSE_BYTES_PER_ELEMENT = 2
"""Bytes per element of the reference dense cache (bfloat16), for :meth:`KVStore.nbytes_dense`."""
MIN_CAPACITY = 256
"""Tokens a :class:`CodesBuffer` holds at least once it holds any."""
GROWTH = 1 + 1 / 32
"""Factor by which a full :class:`CodesBuffer` grows (by MIN_CAPACITY tokens at least): appended tokens are
copied about 1 / (GROWTH - 1) = 32 times in reallocations (amortized O(1); a copy of a token's codes costs
less than encoding it, and attention reads every code at every step), and at most a 33rd of a long buffer
is unused capacity (doubling leaves up to half, which a long-context cache pays in GPU memory)."""
STATIC_HEADROOM = 1024
"""Tokens of code capacity :meth:`KVStore.make_static` keeps free beyond the valid ones (growing it reallocates
the buffers, which a recorded CUDA graph cannot follow: it is then recorded again)."""
MAX_SCALE_CONDITION = 1e6
"""The largest condition number of a key scale matrix (its inverse multiplies every held key in float32)."""
_ALL = slice(None)

# -- the encode operator ----------------------------------------------------------------------------
# The operator takes the encoder as a string key (operators take tensors and plain values only): its
# configuration and a digest of its derived tensors. Live encoders are found by key; an encoder that is
# no longer alive (an exported program run later) is rebuilt from its configuration when the digest agrees.
_ENCODERS: "weakref.WeakValueDictionary[str, Encoder]" = weakref.WeakValueDictionary()
_KEYS: "weakref.WeakKeyDictionary[Encoder, str]" = weakref.WeakKeyDictionary()
_LAYOUTS: dict[str, tuple[tuple[str, tuple[int, ...], torch.dtype], ...]] = {}


def encoder_key(encoder: Encoder) -> str:
    """The key naming ``encoder`` in ``tqindex::encode_tokens`` (registers it; computed once per encoder).

    Call it outside traced code: it hashes the encoder's tensors and encodes one zero vector to learn the
    planes of its codes."""
    if not isinstance(encoder, Encoder):
        raise TypeError(f"encoder must be a tqindex Encoder, got {type(encoder).__name__}")
    key = _KEYS.get(encoder)
    if key is None:
        key = f"{json.dumps(encoder.to_dict(), sort_keys=True)}#{_digest(encoder)}@{encoder.backend or ''}"
        _KEYS[encoder] = key
        _ENCODERS.setdefault(key, encoder)
        if key not in _LAYOUTS:
            template = encoder.encode_valid(torch.zeros(1, encoder.dim), "torch")  # any backend: one layout
            _LAYOUTS[key] = tuple((name, tuple(t.shape[1:]), t.dtype) for name, t in template.planes())
    return key


def _digest(encoder: Encoder) -> str:
    h = hashlib.sha256()
    for name, t in sorted(encoder.tensors().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def encoder_from_key(key: str) -> Encoder:
    """The encoder registered under ``key``, else rebuilt from the configuration the key holds."""
    encoder = _ENCODERS.get(key)
    if encoder is None:
        config, rest = key.rsplit("#", 1)
        digest, backend = rest.split("@")
        encoder = encoder_from_dict(json.loads(config))
        encoder.backend = backend or None
        if _digest(encoder) != digest:
            raise ValueError(
                f"no live encoder has key {key!r}, and rebuilding it from its configuration gives other tensors "
                "(a trained encoder): keep the encoder object alive, e.g. in its KVStore or TQCache"
            )
        encoder_key(encoder)
    return encoder


def tracing() -> bool:
    """Whether torch.compile or torch.export is tracing the calling code."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _encode_planes(x: Tensor, encoder: str) -> list[Tensor]:
    """x [N, dim] float32 -> the planes of ``encode_valid(x)`` in :data:`_LAYOUTS` order."""
    return [t.contiguous() for _, t in encoder_from_key(encoder).encode_valid(x).planes()]


_encode_tokens_op = torch.library.custom_op("tqindex::encode_tokens", _encode_planes, mutates_args=())


@_encode_tokens_op.register_fake
def _encode_tokens_fake(x: Tensor, encoder: str) -> list[Tensor]:
    return [x.new_empty((x.shape[0], *shape), dtype=dtype) for _, shape, dtype in _LAYOUTS[encoder]]


def encode_tokens(encoder: Encoder, x: Tensor, key: str | None = None) -> Codes:
    """Encode float vectors x [..., dim] -> Codes [...] by ``encoder.encode_valid`` (inside the operator
    ``tqindex::encode_tokens`` while torch.compile or torch.export traces): no checks of the values (see
    the module docstring). ``key``: ``encoder_key(encoder)`` when already known."""
    key = encoder_key(encoder) if key is None else key
    rows = x.reshape(-1, encoder.dim).float().contiguous()
    planes = torch.ops.tqindex.encode_tokens(rows, key) if tracing() else _encode_planes(rows, key)
    return _codes(key, planes).reshape(*x.shape[:-1])


def empty_codes(key: str, lead: tuple[int, ...], device: torch.device) -> Codes:
    """Uninitialized Codes of the encoder with key ``key`` (:func:`encoder_key`), leading shape ``lead``."""
    return Codes(**{name: torch.empty((*lead, *shape), dtype=dtype, device=device)
                    for name, shape, dtype in _LAYOUTS[key]})


@dataclass(frozen=True, eq=False)
class CompressedTokens:
    """Keys or values of one layer as attention reads them: ``codes`` (oldest tokens), then ``window``.

    codes:   Codes [B, H, Tc] from ``encoder``.
    window:  [B, H, W, dim] full-precision tokens: the ``sink`` first tokens of the sequence, then the
             most recent ones; in the sequence's order [window[:sink], codes, window[sink:]].
    encoder: the encoder of ``codes`` (``dim == encoder.dim``).
    query_scale: None, or keys only: what attention multiplies the queries of KV head h by (scores unchanged,
             :class:`KVStore` ``key_scale``): [1, H, 1, dim] channel by channel, or [H, dim, dim] from the right.
    lengths: None, or int64 [2] on the window's device: the valid codes and window tokens, when ``codes``
             and ``window`` are fixed-capacity buffers filled on the device (a CUDA-graph decode step, see
             :meth:`KVStore.make_static`); the attention kernel reads them there, :meth:`valid` on the host.
    graphs:  None, or with ``lengths``: the CUDA graphs of attention calls over these very buffers (a static store's,
             kept while they stay the same; see :func:`tqindex.kv.hf.tq_attention_forward`).
    """

    codes: Codes
    window: Tensor
    encoder: Encoder
    query_scale: Tensor | None = None
    sink: int = 0
    lengths: Tensor | None = None
    graphs: SearchGraphs | None = None

    @property
    def shape(self) -> torch.Size:
        """``[B, H, Tc + W, dim]``: the shape of the equivalent dense tensor (with ``lengths``: the capacity)."""
        b, h, w, d = self.window.shape
        return torch.Size((b, h, self.codes.shape[2] + w, d))

    def valid(self) -> "CompressedTokens":
        """These tokens without ``lengths``: the buffers cut to the valid tokens (reads the lengths on the host,
        a device synchronization); self when there are no lengths."""
        if self.lengths is None:
            return self
        tc, tw = self.lengths.tolist()
        return CompressedTokens(self.codes.map(lambda t: t.narrow(2, 0, tc)), self.window.narrow(2, 0, tw),
                                self.encoder, self.query_scale, self.sink)

    def materialize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The tokens in the sequence's order, codes decoded: -> [B, H, Tc + W, dim] in ``dtype`` (default: the
        window's)."""
        if self.lengths is not None:
            return self.valid().materialize(dtype)
        dtype = self.window.dtype if dtype is None else dtype
        return in_order(self.window.to(dtype), self.encoder.decode(self.codes).to(dtype), self.sink)


def in_order(window: Tensor, codes: Tensor, sink: int) -> Tensor:
    """The window's ``sink`` first tokens, the tokens ``codes``, then the rest of the window (dim 2)."""
    return torch.cat([window[:, :, :sink], codes, window[:, :, sink:]], dim=2)


@dataclass(frozen=True, eq=False)
class RecentTier:
    """The second tier of a :class:`KVStore` (module notes): its newest ``length`` encoded tokens held by
    ``key_encoder`` / ``value_encoder`` (of the store's key / value dims; keys as the store holds them)."""

    length: int
    key_encoder: Encoder
    value_encoder: Encoder

    def __post_init__(self) -> None:
        check_int(self.length, "recent length", 1)
        for name in ("key_encoder", "value_encoder"):
            if not isinstance(getattr(self, name), Encoder):
                raise TypeError(f"the recent tier's {name} must be a tqindex Encoder, "
                                f"got {type(getattr(self, name)).__name__}")


class CodesBuffer:
    """Codes [B, H, capacity] growing along the token axis (dim 2); the first ``length`` tokens are valid.

    An append that would fill the buffer reallocates it to ``max(needed + 1, capacity + max(MIN_CAPACITY,
    (GROWTH - 1) * capacity))`` tokens, so T appended tokens cost O(log T) reallocations (counted in
    ``reallocations``), and the valid tokens never span the whole buffer: their memory layout, on which
    compiled code specializes, stays the same as the buffer fills. A ``torch.compile``-d decode step
    compiles again only when the buffer grows.
    """

    def __init__(self, data: Codes, length: int = 0) -> None:
        """Buffer over ``data`` (Codes [B, H, capacity]) whose first ``length`` tokens are valid."""
        if not 0 <= length <= data.shape[2]:
            raise ValueError(f"length must be in [0, {data.shape[2]}], got {length!r}")
        self._data = data
        self._view: Codes | None = None  # the last view, while the length and the storage are the same
        # The number of valid tokens is the size of this zero-byte tensor, not a Python int: torch.compile
        # turns a changing tensor size into a dynamic size, while it compiles again for every new int.
        self._length = data.qdata.new_empty(length, 0)
        self.reallocations = 0

    @property
    def length(self) -> int:
        """Valid tokens."""
        return self._length.shape[0]

    @property
    def capacity(self) -> int:
        """Tokens the buffer holds without reallocating."""
        return self._data.shape[2]

    def view(self) -> Codes:
        """The valid codes, Codes [B, H, length] (a view of the storage: no copy; the same object while the
        length and the storage stay the same, as in the decode steps between two encodes)."""
        length = self.length
        if self._view is None or self._view.shape[2] != length:
            self._view = self._data.map(lambda t: t.narrow(2, 0, length))
        return self._view

    @property
    def data(self) -> Codes:
        """The whole storage, Codes [B, H, capacity] (tokens past ``length`` are not valid)."""
        return self._data

    @property
    def nbytes(self) -> int:
        """Bytes of the valid codes (the unused capacity is not counted)."""
        return self.view().nbytes

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` more tokens than the valid ones (reallocating now, at least as growth would)."""
        needed = self.length + tokens
        if needed >= self.capacity:
            capacity = max(needed + 1, self.capacity + max(MIN_CAPACITY, int((GROWTH - 1) * self.capacity)))
            grown = self._data.empty_like(*self._data.shape[:2], capacity)
            grown.copy_((_ALL, _ALL, slice(0, self.length)), self.view())
            self._data, self._view = grown, None
            self.reallocations += 1

    def append(self, codes: Codes) -> None:
        """Append Codes [B, H, n] after the valid tokens."""
        length = self.length
        needed = length + codes.shape[2]
        self.reserve(codes.shape[2])
        self._data.copy_((_ALL, _ALL, slice(length, needed)), codes)
        self._length = self._length.new_empty(needed, 0)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (the capacity is kept)."""
        self._length = self._length[:length]

    def drop(self, tokens: int) -> None:
        """Remove the first ``tokens`` valid tokens (the others move to the front, in place)."""
        rest = self.length - tokens
        if tokens and rest:
            self._data.copy_((_ALL, _ALL, slice(0, rest)), self.view().map(lambda t: t[:, :, tokens:].clone()))
        self._length, self._view = self._length[:rest], None

    def select(self, index: Tensor) -> None:
        """Keep (or repeat, reorder) batch rows: ``index`` is a long or bool tensor indexing dim 0."""
        self._data, self._view = self._data[index], None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> None:
        """Move the valid codes to ``device`` (the unused capacity is dropped)."""
        self._data, self._view = self.view().map(lambda t: t.to(device, non_blocking=non_blocking)), None
        self._length = self._length.to(device)


class KVStore:
    """One layer's keys and values: Codes buffers for old tokens plus a full-precision window.

    ``residual_length``: tokens of previous steps kept in full precision (the current step's chunk is
    always in full precision too). ``append`` first encodes the window tokens beyond that into the
    buffers (:meth:`settle`), then adds the new chunk to the window; ``encode_stride``: tokens beyond
    ``residual_length`` are encoded once there are at least this many (module notes); ``sink_length``:
    first tokens never encoded (module notes). ``center_keys``: store keys minus :attr:`key_offset`;
    ``key_scale``: [H, Dk] per channel or [H, Dk, Dk] per head, store keys times its inverse (module notes);
    ``recent``: a second tier of codes for the newest encoded tokens (module notes).
    """

    def __init__(
        self, key_encoder: Encoder, value_encoder: Encoder, residual_length: int, center_keys: bool = False,
        key_scale: Tensor | None = None, sink_length: int = 0, encode_stride: int = 1,
        recent: RecentTier | None = None,
    ) -> None:
        for name, enc in (("key_encoder", key_encoder), ("value_encoder", value_encoder)):
            if not isinstance(enc, Encoder):
                raise TypeError(f"{name} must be a tqindex Encoder, got {type(enc).__name__}")
        if not isinstance(center_keys, bool):
            raise TypeError(f"center_keys must be a bool, got {type(center_keys).__name__}")
        if recent is not None and not isinstance(recent, RecentTier):
            raise TypeError(f"recent must be a RecentTier or None, got {type(recent).__name__}")
        if recent is not None and (recent.key_encoder.dim, recent.value_encoder.dim) != (key_encoder.dim,
                                                                                          value_encoder.dim):
            raise ValueError(f"the recent tier's encoders have dims {recent.key_encoder.dim} / "
                             f"{recent.value_encoder.dim}, the store's {key_encoder.dim} / {value_encoder.dim}")
        self.key_encoder = key_encoder
        self.value_encoder = value_encoder
        self.residual_length = check_int(residual_length, "residual_length", 0)
        self.sink_length = check_int(sink_length, "sink_length", 0)
        self.encode_stride = check_int(encode_stride, "encode_stride", 1)
        self.center_keys = center_keys
        self.key_offset: Tensor | None = None  # [B, H, 1, Dk] float32, set by the first non-empty append
        self.key_scale = _check_scale(key_scale, key_encoder.dim)  # [H, Dk] or [H, Dk, Dk] float32, or None
        self._key_unscale = _unscale(self.key_scale)  # what held keys are multiplied by: 1 / s, or M⁻¹
        self.recent = recent
        self.keys: CodesBuffer | None = None
        self.values: CodesBuffer | None = None
        self.recent_keys: CodesBuffer | None = None  # the recent tier's codes (with ``recent``)
        self.recent_values: CodesBuffer | None = None
        self._key_window: Tensor | None = None  # [B, H, W, Dk] (static: [B, H, capacity, Dk])
        self._value_window: Tensor | None = None  # [B, H, W, Dv]
        self._static: _Static | None = None  # set by make_static
        self._register()

    def _register(self) -> None:
        """Operator keys of the encoders, kept as plain strings so that traced appends read no registry."""
        self._key_id = encoder_key(self.key_encoder)
        self._value_id = encoder_key(self.value_encoder)
        recent = self.recent
        self._recent_ids = None if recent is None else (encoder_key(recent.key_encoder),
                                                        encoder_key(recent.value_encoder))

    def __setstate__(self, state: dict) -> None:
        """Unpickling (and deepcopy): register the encoders again (a new process has no registry)."""
        self.__dict__.update(state)
        self._register()

    @classmethod
    def from_tensors(
        cls,
        key_encoder: Encoder,
        value_encoder: Encoder,
        residual_length: int,
        tensors: list[Tensor],
        center_keys: bool = False,
        key_scale: Tensor | None = None,
        sink_length: int = 0,
        encode_stride: int = 1,
        recent: RecentTier | None = None,
    ) -> "KVStore":
        """Inverse of :meth:`tensors`: a store holding exactly those codes, windows and key offset."""
        store = cls(key_encoder, value_encoder, residual_length, center_keys, key_scale, sink_length, encode_stride,
                    recent)
        if tensors:
            ids = [store._key_id, store._value_id, *(store._recent_ids or ())]
            counts = [len(_LAYOUTS[i]) for i in ids]
            n = sum(counts)
            if len(tensors) not in (n + 2, n + 3) or (len(tensors) == n + 3 and not center_keys):
                tier = ", recent key and value planes" if recent is not None else ""
                offset = ", or one more (the key offset) with center_keys" if center_keys else ""
                raise ValueError(f"expected {n + 2} tensors (key planes, value planes{tier}, 2 windows){offset}, "
                                 f"got {len(tensors)}")
            buffers, at = [], 0
            for key, count in zip(ids, counts):
                codes = _codes(key, tensors[at : at + count])
                buffers.append(CodesBuffer(codes, codes.shape[2]))
                at += count
            store.keys, store.values = buffers[:2]
            if recent is not None:
                store.recent_keys, store.recent_values = buffers[2:]
            store._key_window, store._value_window = tensors[n : n + 2]
            store.key_offset = tensors[n + 2] if len(tensors) == n + 3 else None
        return store

    def empty_copy(self) -> "KVStore":
        """A store of the same configuration (encoders, window, sinks, centering, key scale, tier) holding nothing."""
        return KVStore(self.key_encoder, self.value_encoder, self.residual_length, self.center_keys, self.key_scale,
                       self.sink_length, self.encode_stride, self.recent)

    # -- state -------------------------------------------------------------------------------------
    @property
    def compressed_length(self) -> int:
        """Tokens held as codes (the recent tier's included)."""
        return 0 if self.keys is None else self.keys.length + self.recent_length

    @property
    def recent_length(self) -> int:
        """Tokens held in the recent tier (0 without one)."""
        return 0 if self.recent_keys is None else self.recent_keys.length

    @property
    def window_length(self) -> int:
        """Tokens held in full precision."""
        if self._static is not None:
            return self._static.window
        return 0 if self._key_window is None else self._key_window.shape[2]

    @property
    def sink_held(self) -> int:
        """Sink tokens at the start of the window: all ``sink_length`` once any token is encoded (sinks are
        never encoded), else as many as the window holds (its tokens are then the first of the sequence)."""
        if not self.sink_length:
            return 0
        return self.sink_length if self.compressed_length else min(self.sink_length, self.window_length)

    @property
    def seq_length(self) -> int:
        """Tokens held in total."""
        return self.compressed_length + self.window_length

    @property
    def device(self) -> torch.device | None:
        """Device of the held tokens (None while empty)."""
        return None if self._key_window is None else self._key_window.device

    def tensors(self) -> list[Tensor]:
        """Everything held, as plain tensors: the planes of the valid key codes [B, H, Tc, ...], of the value
        codes, with a recent tier those of its key and value codes, then the key window [B, H, W, Dk] and the
        value window [B, H, W, Dv], then the key offset [B, H, 1, Dk] once set; [] while empty."""
        if self.keys is None:
            return []
        planes = [t for codes in self._buffers() for _, t in codes.view().planes()]
        offset = [] if self.key_offset is None else [self.key_offset]
        return [*planes, *self._windows(), *offset]

    def nbytes(self) -> int:
        """Bytes held: the valid code planes of keys and values, the full-precision window and the key offset."""
        if self.keys is None:
            return 0
        dense = [t for t in (*self._windows(), self.key_offset) if t is not None]
        return self.nbytes_compressed()[0] + sum(t.numel() * t.element_size() for t in dense)

    def nbytes_compressed(self) -> tuple[int, int]:
        """(bytes, tokens) of the compressed tokens alone: the valid code planes of keys and values (with
        their scales/norms; the recent tier's too; no window) and the tokens they encode, counted once per batch
        row."""
        if self.keys is None:
            return 0, 0
        return sum(codes.nbytes for codes in self._buffers()), self._key_window.shape[0] * self.compressed_length

    def nbytes_dense(self) -> int:
        """Bytes a bfloat16 dense cache holds for the same tokens: 2 bytes per key and value element."""
        if self.keys is None:
            return 0
        b, h = self._key_window.shape[:2]
        dims = self.key_encoder.dim + self.value_encoder.dim
        return DENSE_BYTES_PER_ELEMENT * b * h * self.seq_length * dims

    # -- updates -----------------------------------------------------------------------------------
    def append(self, key: Tensor, value: Tensor) -> None:
        """Add the tokens of one step: key [B, H, T, Dk], value [B, H, T, Dv] (floating, same B, H, T;
        shapes and dtypes are checked, values are not: see the module docstring)."""
        self._check(key, value)
        if self.key_scale is not None and self.key_scale.device != key.device:
            self.key_scale, self._key_unscale = self.key_scale.to(key.device), self._key_unscale.to(key.device)
        if self.center_keys and key.shape[2] and self.key_offset is None:  # the first tokens fix the offset
            self.key_offset = key.float().mean(2, keepdim=True)  # [B, H, 1, Dk]
        if self.keys is None:
            b, h = key.shape[:2]
            self.keys = CodesBuffer(empty_codes(self._key_id, (b, h, 0), key.device))
            self.values = CodesBuffer(empty_codes(self._value_id, (b, h, 0), value.device))
            if self.recent is not None:
                self.recent_keys, self.recent_values = (CodesBuffer(empty_codes(i, (b, h, 0), key.device))
                                                        for i in self._recent_ids)
            self._key_window, self._value_window = key, value
            return
        if self._static is not None:
            if self.prepare(key.shape[2]):
                self._write(key, value)
                return
            self.make_dynamic()
        self.settle()
        self._key_window = torch.cat([self._key_window, key], dim=2)
        self._value_window = torch.cat([self._value_window, value], dim=2)

    def settle(self) -> None:
        """Encode the window's tokens beyond the sinks and the newest ``residual_length`` into the buffers
        now, where there are at least ``encode_stride`` of them (``append`` does it first otherwise). Views
        taken before keep what they hold: a cache layer takes the step's view, then settles, so that between
        steps it holds fewer than ``encode_stride`` full-precision tokens beyond the window (a prefill
        chunk's are encoded once its attention has read them). A static store (:meth:`make_static`) encodes in
        :meth:`prepare` instead, when its window is full: this does nothing there."""
        if self.keys is None or self._static is not None:
            return
        sink = self.sink_held
        old = self.window_length - sink - self.residual_length
        if old < self.encode_stride:  # (nothing beyond the window, old <= 0, included: encode_stride >= 1)
            return
        leaving, rest = slice(sink, sink + old), slice(sink + old, None)  # sinks stay at the window's start
        keys, values = self._held_keys(self._key_window[:, :, leaving]), self._value_window[:, :, leaving]
        if self.recent is None:
            self.keys.append(encode_tokens(self.key_encoder, keys, self._key_id))
            self.values.append(encode_tokens(self.value_encoder, values, self._value_id))
        else:
            self._settle_recent(keys, values)
        self._key_window = torch.cat([self._key_window[:, :, :sink], self._key_window[:, :, rest]], dim=2)
        self._value_window = torch.cat([self._value_window[:, :, :sink], self._value_window[:, :, rest]], dim=2)

    def _settle_recent(self, keys: Tensor, values: Tensor) -> None:
        """Tokens leaving the window (held keys [B, H, n, Dk] float32, values [B, H, n, Dv]) into the recent tier;
        what it then holds beyond its length into the older codes, its own tokens transcoded (module notes), those
        of the n that would not stay in it encoded once."""
        n, length = keys.shape[2], self.recent.length
        direct = max(0, n - length)  # the oldest of the n, which would leave the tier at once
        moved = max(0, self.recent_length + n - direct - length)  # the tier's oldest tokens leaving it
        if moved or direct:
            older = []
            for side, buffer, tokens in ((self.recent.key_encoder, self.recent_keys, keys),
                                         (self.recent.value_encoder, self.recent_values, values)):
                decoded = side.decode(buffer.view()[:, :, :moved]).float()
                older.append(torch.cat([decoded, tokens[:, :, :direct].float()], dim=2))
                buffer.drop(moved)
            self.keys.append(encode_tokens(self.key_encoder, older[0], self._key_id))
            self.values.append(encode_tokens(self.value_encoder, older[1], self._value_id))
        k_id, v_id = self._recent_ids
        self.recent_keys.append(encode_tokens(self.recent.key_encoder, keys[:, :, direct:], k_id))
        self.recent_values.append(encode_tokens(self.recent.value_encoder, values[:, :, direct:], v_id))

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (``0 <= length``; longer than held is a no-op)."""
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be an integer >= 0, got {length!r}")
        if self.keys is None:
            return
        self.make_dynamic()
        sink = min(self.sink_held, length)
        rest = length - sink
        for keys, values in ((self.keys, self.values), (self.recent_keys, self.recent_values)):
            if keys is not None:  # the older codes, then the recent tier's
                keys.crop(rest)
                values.crop(rest)
                rest = max(0, rest - keys.length)
        keep = sink + rest
        self._key_window = self._key_window[:, :, :keep]
        self._value_window = self._value_window[:, :, :keep]

    def select(self, index: Tensor) -> None:
        """Reorder, keep or repeat batch rows (beam search): ``index`` long [B'] or bool [B] on dim 0."""
        if self.keys is None:
            return
        self.make_dynamic()
        index = index.to(self._key_window.device)
        for codes in self._buffers():
            codes.select(index)
        self._key_window = self._key_window[index]
        self._value_window = self._value_window[index]
        if self.key_offset is not None:
            self.key_offset = self.key_offset[index]

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (``num_return_sequences``)."""
        if self.keys is None:
            return
        rows = torch.arange(self._key_window.shape[0], device=self._key_window.device)
        self.select(rows.repeat_interleave(repeats))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> None:
        """Move the codes and windows to ``device`` (offloading; nothing is decoded), ``non_blocking`` as in
        :meth:`torch.Tensor.to`."""
        if self.keys is None:
            return
        self.make_dynamic()
        for codes in self._buffers():
            codes.to(device, non_blocking)
        self._key_window = self._key_window.to(device, non_blocking=non_blocking)
        self._value_window = self._value_window.to(device, non_blocking=non_blocking)
        if self.key_offset is not None:
            self.key_offset = self.key_offset.to(device, non_blocking=non_blocking)
        if self.key_scale is not None:
            self.key_scale = self.key_scale.to(device, non_blocking=non_blocking)
            self._key_unscale = self._key_unscale.to(device, non_blocking=non_blocking)

    # -- reads -------------------------------------------------------------------------------------
    def view(self) -> tuple[CompressedTokens, CompressedTokens]:
        """(keys, values) as :class:`CompressedTokens` views of the held tokens (no copy of the codes, no
        decode); keys as the codes hold them (the window's in a copy): minus :attr:`key_offset` once set,
        which leaves softmax attention unchanged, and times the inverse of :attr:`key_scale`, which the keys hand
        to attention as the queries' ``query_scale``."""
        if self.keys is None:
            raise ValueError("the KVStore is empty: append tokens before reading it")
        if self._static is None:
            return self._tokens(self.keys.view(), self.values.view(), self._key_window, self._value_window)
        # static: the whole buffers, the valid lengths on the device (the same tensors at every step)
        return self._tokens(self.keys.data, self.values.data, self._key_window, self._value_window, self._static)

    def _tokens(self, key_codes: Codes, value_codes: Codes, key_window: Tensor, value_window: Tensor,
                static: _Static | None = None) -> tuple[CompressedTokens, CompressedTokens]:
        """(keys, values) CompressedTokens of these codes and windows, keys as the codes hold them (:meth:`view`;
        a static store's ``static`` state: its lengths, its buffer of held keys, its graphs); the recent tier's tokens
        decoded into the windows after their sinks."""
        sink = self.sink_held
        lengths, graphs = (None, None) if static is None else (static.lengths, static.graphs)
        if static is not None and static.held is not None:
            key_window = static.held
        elif self.recent_length:  # (never static)
            held = [self._held_keys(key_window), value_window]
            for i, (side, buffer) in enumerate(((self.recent.key_encoder, self.recent_keys),
                                                (self.recent.value_encoder, self.recent_values))):
                held[i] = in_order(held[i].float(), side.decode(buffer.view()).float(), sink)
            key_window, value_window = held[0].to(key_window.dtype), held[1].to(value_window.dtype)
        elif self.key_offset is not None or self.key_scale is not None:
            key_window = self._held_keys(key_window).to(key_window.dtype)
        scale = self.key_scale
        if scale is not None:
            scale = scale[None, :, None, :] if scale.dim() == 2 else scale.mT
        return (
            CompressedTokens(key_codes, key_window, self.key_encoder, scale, sink, lengths, graphs),
            CompressedTokens(value_codes, value_window, self.value_encoder, sink=sink, lengths=lengths),
        )

    def materialize(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Decoded keys [B, H, T, Dk] and values [B, H, T, Dv] in ``dtype`` (default: the window's)."""
        return self.materialize_keys(dtype), self.materialize_values(dtype)

    def materialize_keys(self, dtype: torch.dtype | None = None) -> Tensor:
        """Decoded keys [B, H, T, Dk] in ``dtype`` (default: the window's), in the sequence's order: the codes'
        plus :attr:`key_offset`, the window as held."""
        if self.keys is None:
            raise ValueError("the KVStore is empty: append tokens before reading it")
        window = self._windows()[0]
        dtype = window.dtype if dtype is None else dtype
        codes = _times(self._decoded(0), self.key_scale)
        codes = codes if self.key_offset is None else codes + self.key_offset
        return in_order(window.to(dtype), codes.to(dtype), self.sink_held)

    def materialize_values(self, dtype: torch.dtype | None = None) -> Tensor:
        """Decoded values [B, H, T, Dv] in ``dtype`` (default: the window's)."""
        if self.keys is None:
            raise ValueError("the KVStore is empty: append tokens before reading it")
        window = self._windows()[1]
        dtype = window.dtype if dtype is None else dtype
        return in_order(window.to(dtype), self._decoded(1).to(dtype), self.sink_held)

    def _decoded(self, side: int) -> Tensor:
        """The codes of keys (side 0, as held) or values (1) decoded, float32 [B, H, Tc, D]: the older ones, then
        the recent tier's."""
        buffers = self._buffers()
        encoders = [self.key_encoder, self.value_encoder, *((self.recent.key_encoder, self.recent.value_encoder)
                                                            if self.recent is not None else ())]
        return torch.cat([enc.decode(buffer.view()).float()
                          for enc, buffer in zip(encoders[side::2], buffers[side::2])], dim=2)

    # -- fixed-capacity mode (CUDA-graph decoding) -------------------------------------------------
    @property
    def static(self) -> bool:
        """Whether the window is a fixed-capacity buffer (:meth:`make_static`)."""
        return self._static is not None

    def make_static(self, headroom: int = STATIC_HEADROOM, room: int = 1, graphs: int = 0) -> None:
        """Hold the window in a buffer of ``sink_length + residual_length + encode_stride`` tokens (at most
        ``headroom`` beyond those it holds: a store whose window keeps every token is a dense layer) and the
        numbers of valid codes and window tokens on the device too (``CompressedTokens.lengths``), the code
        buffers with room for ``headroom`` more tokens: appends then write at positions read on the device and
        :meth:`view` hands out the same tensors at every step, so that a decode step can be recorded as a CUDA
        graph and replayed as the store fills (the keys as the codes hold them, centered or scaled, are kept in a
        window buffer of their own, each token converted as it arrives: with a matrix ``key_scale``, the growing
        store's view up to float32 rounding, the product being taken token by token). Then make room for
        ``room`` new tokens (:meth:`prepare`; a static store is given a larger buffer where its window must grow).
        Tokens leave the window as in the growing mode (attention reads the same tokens at every step), encoded by
        :meth:`prepare` before the step that would overflow it. ``crop``, ``select``, ``to`` and appends that do
        not fit return to the growing mode (as does :meth:`make_dynamic`). ``graphs``: shapes of attention calls
        over the buffers kept recorded as CUDA graphs (``CompressedTokens.graphs`` of the keys; 0: none).
        ValueError on an empty store, and on a store with a recent tier (it has no static mode)."""
        check_int(headroom, "headroom", 1)
        check_int(room, "room", 0)
        check_int(graphs, "graphs", 0)
        if self.recent is not None:
            raise ValueError("a KVStore with a recent tier has no static mode (CUDA-graph decoding): its tier moves "
                             "tokens to the older codes at every step")
        if self._static is not None:
            if self.prepare(room):
                return
            self.make_dynamic()
        if self.keys is None:
            raise ValueError("the KVStore is empty: append tokens before make_static")
        self.settle()  # the window now holds fewer than encode_stride tokens beyond its sinks and residual_length
        held = self.window_length
        capacity = min(self.sink_length + self.residual_length + self.encode_stride, held + max(headroom, room))

        def fixed(window: Tensor) -> Tensor:  # window in a buffer of the capacity
            buffer = window.new_empty(*window.shape[:2], capacity, window.shape[3])
            buffer[:, :, :held] = window
            return buffer

        held_keys = None
        if self.key_offset is not None or self.key_scale is not None:
            held_keys = fixed(self._held_keys(self._key_window).to(self._key_window.dtype))
        self._key_window, self._value_window = fixed(self._key_window), fixed(self._value_window)
        for codes in (self.keys, self.values):
            codes.reserve(headroom)
        lengths = torch.tensor([self.compressed_length, held], dtype=torch.int64).to(self._key_window.device)
        self._static = _Static(lengths, held, headroom, held_keys, SearchGraphs(graphs) if graphs else None)
        self.prepare(room)

    def make_dynamic(self) -> None:
        """Back to the growing mode (the window cut to its valid tokens); does nothing on a growing store."""
        static, self._static = self._static, None
        if static is not None:
            self._key_window = self._key_window[:, :, : static.window]
            self._value_window = self._value_window[:, :, : static.window]

    def prepare(self, tokens: int = 1) -> bool:
        """Static store: make room in the window for ``tokens`` new tokens, encoding its tokens beyond the sinks
        and the newest ``residual_length`` where it is full and they are ``encode_stride`` at least (the code
        buffers grow by ``headroom`` when they must). Returns whether the tokens fit (False: the buffer is too
        small; :meth:`make_dynamic` then :meth:`make_static` gives a larger one where the window may grow)."""
        static = self._static
        if static is None:
            raise ValueError("prepare needs a static store: call make_static first")
        capacity = self._key_window.shape[2]
        if static.window + tokens <= capacity:
            return True
        sink = self.sink_held
        old = static.window - sink - self.residual_length
        if old >= self.encode_stride:  # as settle does (a window below its full capacity waits)
            leaving = slice(sink, sink + old)
            encoded = (encode_tokens(self.key_encoder, self._held_keys(self._key_window[:, :, leaving]), self._key_id),
                       encode_tokens(self.value_encoder, self._value_window[:, :, leaving], self._value_id))
            for codes, new in zip((self.keys, self.values), encoded):
                if codes.length + old >= codes.capacity:
                    codes.reserve(old + static.headroom)
                codes.append(new)
            rest = static.window - sink - old
            for window in [w for w in (self._key_window, self._value_window, static.held) if w is not None]:
                window[:, :, sink : sink + rest] = window[:, :, sink + old : static.window].clone()
            static.window = sink + rest
            static.lengths[0].fill_(self.compressed_length)
            static.lengths[1].fill_(static.window)
        return static.window + tokens <= capacity

    def static_state(self) -> tuple:
        """What a recorded step over this static store depends on besides the lengths: its buffers (compared by
        identity and address) and the sink count."""
        return self._static, self.keys.data.qdata.data_ptr(), self.values.data.qdata.data_ptr(), self.sink_held

    def advance(self, tokens: int = 1) -> None:
        """Static store: count ``tokens`` appended on the device alone (a replayed CUDA graph's append)."""
        if self._static is None:
            raise ValueError("advance needs a static store: call make_static first")
        self._static.window += tokens

    def _write(self, key: Tensor, value: Tensor) -> None:
        """Static store with room: write key / value [B, H, n, D] at the window's valid length read on the device."""
        static, n = self._static, key.shape[2]
        at = static.lengths[1:] if n == 1 else static.lengths[1:] + torch.arange(n, device=key.device)
        self._key_window.index_copy_(2, at, key.to(self._key_window.dtype))
        self._value_window.index_copy_(2, at, value.to(self._value_window.dtype))
        if static.held is not None:
            static.held.index_copy_(2, at, self._held_keys(key).to(static.held.dtype))
        static.lengths[1:] += n
        static.window += n

    def _windows(self) -> tuple[Tensor, Tensor]:
        """The valid window tokens (key [B, H, W, Dk], value [B, H, W, Dv]), views in the static mode."""
        if self._static is None:
            return self._key_window, self._value_window
        n = self._static.window
        return self._key_window[:, :, :n], self._value_window[:, :, :n]

    # -- helpers -----------------------------------------------------------------------------------
    def _buffers(self) -> list[CodesBuffer]:
        """The code buffers: keys, values, then the recent tier's keys and values where it has them."""
        recent = [] if self.recent_keys is None else [self.recent_keys, self.recent_values]
        return [self.keys, self.values, *recent]

    def _held_keys(self, keys: Tensor) -> Tensor:
        """Keys [B, H, n, Dk] as the codes hold them: float32, minus the offset, times the scale's inverse (both
        float32: each operation promotes the keys to float32 itself)."""
        keys = keys if self.key_offset is None else keys - self.key_offset
        return _times(keys, self._key_unscale).float()

    def _check(self, key: Tensor, value: Tensor) -> None:
        for name, t, enc in (("key", key, self.key_encoder), ("value", value, self.value_encoder)):
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point torch tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[-1] != enc.dim:
                raise ValueError(f"{name} must have shape [B, H, T, {enc.dim}], got {tuple(t.shape)}")
        if key.shape[:3] != value.shape[:3]:
            raise ValueError(f"key and value need the same [B, H, T], got {tuple(key.shape)} and {tuple(value.shape)}")
        if self._key_window is not None and key.shape[:2] != self._key_window.shape[:2]:
            raise ValueError(
                f"key has [B, H] = {tuple(key.shape[:2])}, the store holds {tuple(self._key_window.shape[:2])}"
            )


@dataclass(eq=False)
class _Static:
    """A static store's state (:meth:`KVStore.make_static`)."""

    lengths: Tensor  # int64 [2] on the store's device: valid codes, valid window tokens
    window: int  # valid window tokens, on the host
    headroom: int  # tokens of code capacity reserved at a time
    held: Tensor | None = None  # the key window as the codes hold them (centered or scaled keys), kept as it fills
    graphs: SearchGraphs | None = None  # CUDA graphs of attention over the buffers


def _check_scale(scale: Tensor | None, dim: int) -> Tensor | None:
    """A key scale as float32 [H, dim] of positive finite values or [H, dim, dim] of finite invertible matrices,
    or None; ValueError naming the problem."""
    if scale is None:
        return None
    if not isinstance(scale, Tensor) or scale.dim() not in (2, 3) or scale.shape[1:] not in ((dim,), (dim, dim)):
        raise ValueError(f"key_scale must be a tensor [heads, {dim}] or [heads, {dim}, {dim}], got "
                         f"{tuple(scale.shape) if isinstance(scale, Tensor) else type(scale).__name__}")
    scale = scale.detach().float()
    if not torch.isfinite(scale).all():
        raise ValueError("key_scale must hold finite values")
    if scale.dim() == 2 and not (scale > 0).all():
        raise ValueError("key_scale must hold positive values per channel")
    if scale.dim() == 3 and not (torch.linalg.cond(scale.double()) < MAX_SCALE_CONDITION).all():
        raise ValueError(f"key_scale must hold invertible matrices (condition number below {MAX_SCALE_CONDITION:g})")
    return scale


def _unscale(scale: Tensor | None) -> Tensor | None:
    """What held keys are multiplied by (:func:`_times`): 1 / s per channel, or the matrices' inverses."""
    if scale is None:
        return None
    return 1 / scale if scale.dim() == 2 else torch.linalg.inv(scale.double()).float()


def _times(x: Tensor, scale: Tensor | None) -> Tensor:
    """Rows x [B, H, n, D] times the scale of their head: [H, D] channel by channel, [H, D, D] from the right."""
    if scale is None:
        return x
    return x * scale[:, None, :] if scale.dim() == 2 else x.float() @ scale


def _codes(key: str, planes: list[Tensor]) -> Codes:
    """Codes from the planes of an encoder's codes, in :data:`_LAYOUTS` order."""
    return Codes(**{name: t for (name, _, _), t in zip(_LAYOUTS[key], planes)})
