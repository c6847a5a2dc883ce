"""Compressed per-layer K/V storage: a full-precision window of recent tokens, older tokens as Codes.

A :class:`KVStore` holds one attention layer's keys and values, ``[B, H, T, dim]`` each. The newest
tokens (the last ``residual_length`` of the previous steps plus the chunk of the current step) stay in
full precision in the *window*; on the next :meth:`KVStore.append` the tokens that fell out of it are
encoded once and appended to a :class:`CodesBuffer`, whose capacity doubles when full (amortized O(1)
per token, no copy of the history per step). Keys and values have their own encoders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..codes import Codes
from ..encoder import Encoder

DENSE_BYTES_PER_ELEMENT = 2
"""Bytes per element of the reference dense cache (bfloat16), for :meth:`KVStore.nbytes_dense`."""
_ALL = slice(None)


@dataclass(frozen=True, eq=False)
class CompressedTokens:
    """Keys or values of one layer as attention reads them: ``codes`` (oldest tokens), then ``window``.

    codes:   Codes [B, H, Tc] from ``encoder``.
    window:  [B, H, W, dim] full-precision tensor of the W most recent tokens.
    encoder: the encoder of ``codes`` (``dim == encoder.dim``).
    """

    codes: Codes
    window: Tensor
    encoder: Encoder

    @property
    def shape(self) -> torch.Size:
        """``[B, H, Tc + W, dim]``: the shape of the equivalent dense tensor."""
        b, h, w, d = self.window.shape
        return torch.Size((b, h, self.codes.shape[2] + w, d))

    def materialize(self, dtype: torch.dtype | None = None) -> Tensor:
        """Decode the codes and append the window: -> [B, H, Tc + W, dim] in ``dtype`` (default: the window's)."""
        dtype = self.window.dtype if dtype is None else dtype
        return torch.cat([self.encoder.decode(self.codes).to(dtype), self.window.to(dtype)], dim=2)


class CodesBuffer:
    """Codes [B, H, capacity] growing along the token axis (dim 2); the first ``length`` tokens are valid.

    Appending past the capacity reallocates to ``max(needed, 2 * capacity)`` tokens, so T appended
    tokens cost O(log T) reallocations (counted in ``reallocations``).
    """

    def __init__(self, template: Codes, batch: int, heads: int) -> None:
        """Empty buffer with the planes, dtypes and device of ``template`` (any Codes of the encoder)."""
        self._data = template.empty_like(batch, heads, 0)
        self.length = 0
        self.reallocations = 0

    @property
    def capacity(self) -> int:
        """Tokens the buffer holds without reallocating."""
        return self._data.shape[2]

    def view(self) -> Codes:
        """The valid codes, Codes [B, H, length] (a view: no copy)."""
        return self._data[:, :, : self.length]

    @property
    def nbytes(self) -> int:
        """Bytes of the valid codes (the unused capacity is not counted)."""
        return self.view().nbytes

    def append(self, codes: Codes) -> None:
        """Append Codes [B, H, n] after the valid tokens."""
        needed = self.length + codes.shape[2]
        if needed > self.capacity:
            grown = self._data.empty_like(*self._data.shape[:2], max(needed, 2 * self.capacity))
            grown.copy_((_ALL, _ALL, slice(0, self.length)), self.view())
            self._data = grown
            self.reallocations += 1
        self._data.copy_((_ALL, _ALL, slice(self.length, needed)), codes)
        self.length = needed

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (the capacity is kept)."""
        self.length = min(self.length, length)

    def select(self, index: Tensor) -> None:
        """Keep (or repeat, reorder) batch rows: ``index`` is a long or bool tensor indexing dim 0."""
        self._data = self._data[index]


class KVStore:
    """One layer's keys and values: Codes buffers for old tokens plus a full-precision window.

    ``residual_length``: tokens of previous steps kept in full precision (the current step's chunk is
    always in full precision too). ``append`` first encodes the window tokens beyond that into the
    buffers, then adds the new chunk to the window.
    """

    def __init__(self, key_encoder: Encoder, value_encoder: Encoder, residual_length: int) -> None:
        for name, enc in (("key_encoder", key_encoder), ("value_encoder", value_encoder)):
            if not isinstance(enc, Encoder):
                raise TypeError(f"{name} must be a tqindex Encoder, got {type(enc).__name__}")
        if not isinstance(residual_length, int) or isinstance(residual_length, bool) or residual_length < 0:
            raise ValueError(f"residual_length must be an integer >= 0, got {residual_length!r}")
        self.key_encoder = key_encoder
        self.value_encoder = value_encoder
        self.residual_length = residual_length
        self.keys: CodesBuffer | None = None
        self.values: CodesBuffer | None = None
        self._key_window: Tensor | None = None  # [B, H, W, Dk]
        self._value_window: Tensor | None = None  # [B, H, W, Dv]

    # -- state -------------------------------------------------------------------------------------
    @property
    def compressed_length(self) -> int:
        """Tokens held as codes."""
        return 0 if self.keys is None else self.keys.length

    @property
    def window_length(self) -> int:
        """Tokens held in full precision."""
        return 0 if self._key_window is None else self._key_window.shape[2]

    @property
    def seq_length(self) -> int:
        """Tokens held in total."""
        return self.compressed_length + self.window_length

    def nbytes(self) -> int:
        """Bytes held: the valid code planes of keys and values plus the full-precision window."""
        if self.keys is None:
            return 0
        window = sum(t.numel() * t.element_size() for t in (self._key_window, self._value_window))
        return self.nbytes_compressed()[0] + window

    def nbytes_compressed(self) -> tuple[int, int]:
        """(bytes, tokens) of the compressed tokens alone: the valid code planes of keys and values (with
        their scales/norms; no window) and the tokens they encode, counted once per batch row."""
        if self.keys is None:
            return 0, 0
        return self.keys.nbytes + self.values.nbytes, self._key_window.shape[0] * self.compressed_length

    def nbytes_dense(self) -> int:
        """Bytes a bfloat16 dense cache holds for the same tokens: 2 bytes per key and value element."""
        if self.keys is None:
            return 0
        b, h = self._key_window.shape[:2]
        dims = self.key_encoder.dim + self.value_encoder.dim
        return DENSE_BYTES_PER_ELEMENT * b * h * self.seq_length * dims

    # -- updates -----------------------------------------------------------------------------------
    def append(self, key: Tensor, value: Tensor) -> None:
        """Add the tokens of one step: key [B, H, T, Dk], value [B, H, T, Dv] (floating, same B, H, T)."""
        self._check(key, value)
        if self.keys is None:
            b, h = key.shape[:2]
            self.keys = CodesBuffer(self._template(self.key_encoder, key), b, h)
            self.values = CodesBuffer(self._template(self.value_encoder, value), b, h)
            self._key_window, self._value_window = key, value
            return
        old = self.window_length - self.residual_length
        if old > 0:  # tokens that left the window: encode once, append to the buffers
            self.keys.append(self.key_encoder.encode(self._key_window[:, :, :old]))
            self.values.append(self.value_encoder.encode(self._value_window[:, :, :old]))
        keep = slice(max(old, 0), None)
        self._key_window = torch.cat([self._key_window[:, :, keep], key], dim=2)
        self._value_window = torch.cat([self._value_window[:, :, keep], value], dim=2)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (``0 <= length``; longer than held is a no-op)."""
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be an integer >= 0, got {length!r}")
        if self.keys is None:
            return
        self.keys.crop(length)
        self.values.crop(length)
        keep = max(0, length - self.compressed_length)
        self._key_window = self._key_window[:, :, :keep]
        self._value_window = self._value_window[:, :, :keep]

    def select(self, index: Tensor) -> None:
        """Reorder, keep or repeat batch rows (beam search): ``index`` long [B'] or bool [B] on dim 0."""
        if self.keys is None:
            return
        index = index.to(self._key_window.device)
        self.keys.select(index)
        self.values.select(index)
        self._key_window = self._key_window[index]
        self._value_window = self._value_window[index]

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (``num_return_sequences``)."""
        if self.keys is None:
            return
        rows = torch.arange(self._key_window.shape[0], device=self._key_window.device)
        self.select(rows.repeat_interleave(repeats))

    # -- reads -------------------------------------------------------------------------------------
    def view(self) -> tuple[CompressedTokens, CompressedTokens]:
        """(keys, values) as :class:`CompressedTokens` views of the held tokens (no copy, no decode)."""
        if self.keys is None:
            raise ValueError("the KVStore is empty: append tokens before reading it")
        return (
            CompressedTokens(self.keys.view(), self._key_window, self.key_encoder),
            CompressedTokens(self.values.view(), self._value_window, self.value_encoder),
        )

    def materialize(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Decoded keys [B, H, T, Dk] and values [B, H, T, Dv] in ``dtype`` (default: the window's)."""
        keys, values = self.view()
        return keys.materialize(dtype), values.materialize(dtype)

    # -- helpers -----------------------------------------------------------------------------------
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

    @staticmethod
    def _template(encoder: Encoder, x: Tensor) -> Codes:
        """Codes of one zero vector: the planes, dtypes and device the buffers need."""
        return encoder.encode(x.new_zeros(1, encoder.dim, dtype=torch.float32))
