"""Per-layer precision policies for compressed KV caches: what each attention layer stores, as plain JSON.

A :class:`KVPolicy` lists, for every decoder layer of a model, a :class:`LayerPolicy`: the key and
value encoders (registry names such as ``"tq4"``, or :meth:`~tqindex.Encoder.to_dict` configurations of
untrained encoders), the residual window of recent tokens kept in full precision, or ``dense`` (the
layer stays a plain full-precision layer, as a "protected" layer). ``TQCache(model.config,
policy=policy)`` builds the cache it describes; :meth:`KVPolicy.save` / :meth:`KVPolicy.load` write and
read it as a small JSON file a user can read and edit.

:func:`choose` picks one option per layer that minimizes the summed sensitivity under an average
byte budget (an exact multiple-choice knapsack over the options' bytes); ``tqindex.kv.calibrate``
measures the sensitivities on a model and calls it.

Bytes of a layer per token and batch row, for ``heads`` KV heads of key/value head dims ``Dk``/``Dv``:
``heads · (key code_size + value code_size)`` for the codes, plus the window amortized over a context
of ``context_tokens`` tokens: ``(residual_length + encode_stride - 1 + sink_length) · heads · (Dk + Dv) ·
dense_bytes / context_tokens`` (between steps the window holds at most the newest ``residual_length +
encode_stride - 1`` tokens and the cache's ``sink_length`` first tokens in full precision; ``dense_bytes``:
bytes per element of the model's dtype, which windows and dense layers hold), plus the key offset of centered keys,
``heads · Dk · 4 / context_tokens``; a recent tier of N tokens (:class:`tqindex.kv.store.RecentTier`) adds
``N · heads · (its code sizes - the layer's) / context_tokens``; a dense layer holds ``heads · (Dk + Dv) ·
dense_bytes``. Bits per element divide by ``heads · (Dk + Dv)`` elements. A layer's key scales
(``LayerPolicy.key_scale``) belong to the model, shared by every sequence, and are not counted per token.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from ..encoder import Encoder, encoder_from_dict, encoder_names, make_encoder

POLICY_FORMAT = "tqindex-kv-policy"
"""The ``format`` field of a policy file."""
POLICY_VERSION = 1
"""The ``version`` field of policy files this module writes and reads."""
OFFSET_BYTES = 4
"""Bytes per element of a centered layer's key offset (float32)."""
SINK_LENGTH = 4
"""First tokens of every compressed layer a ``TQCache`` keeps in full precision by default (sink tokens)."""
ENCODE_STRIDE = 16
"""Tokens a ``TQCache`` layer encodes at once by default once they leave its window (``encode_stride``)."""
_COST_STEP = 1 / 64
"""Byte resolution of the budget in :func:`choose` (bytes per token and layer)."""


def _check_encoder_spec(spec: Any, name: str) -> str | dict:
    """A registry name or an encoder configuration dict; ValueError / TypeError naming ``name`` otherwise."""
    if isinstance(spec, str):
        if spec not in encoder_names():
            raise ValueError(f"{name} {spec!r} is an unknown encoder name; known names: {', '.join(encoder_names())}")
        return spec
    if isinstance(spec, dict):
        enc = encoder_from_dict(spec)  # raises ValueError for unknown types or fields
        if not enc.is_trained:
            raise ValueError(f"{name} {spec!r} needs training: a policy holds configurations, not trained tensors")
        return dict(spec)
    raise TypeError(f"{name} must be an encoder name (str) or an encoder configuration (dict), got "
                    f"{type(spec).__name__}")


@lru_cache(maxsize=None)
def _encoder_of(spec: str, dim: int, backend: str | None) -> Encoder:
    """One shared encoder per (spec, dim, backend); ``spec`` a registry name or the JSON of a configuration."""
    if spec.startswith("{"):
        enc = encoder_from_dict({**json.loads(spec), "dim": dim})
        enc.backend = backend
        return enc
    return make_encoder(spec, dim, backend=backend)


def encoder_for(spec: str | dict, dim: int, backend: str | None = None) -> Encoder:
    """The encoder of ``spec`` (a registry name or a configuration dict) for vectors of dimension ``dim``
    (a dict's own ``dim``, if any, must equal ``dim``), its kernels following ``backend`` (see
    ``tqindex.kernels``); one shared object per (spec, dim, backend)."""
    if isinstance(spec, dict):
        if "dim" in spec and spec["dim"] != dim:
            raise ValueError(f"encoder configuration {spec!r} has dim {spec['dim']}, the head dim is {dim}")
        spec = json.dumps({k: v for k, v in spec.items() if k != "dim"}, sort_keys=True)
    return _encoder_of(spec, dim, backend)


def _check_key_scale(rows: Any) -> tuple:
    """A layer's key scale as nested tuples of floats: heads x channels (positive) or heads x channels x
    channels (a matrix per head); ValueError naming the problem. The store checks that matrices are invertible."""
    def nested(x: Any) -> tuple[Any, tuple[int, ...]]:  # (tuples of floats, shape)
        if isinstance(x, (list, tuple)) and x:
            inner = [nested(v) for v in x]
            if any(shape != inner[0][1] for _, shape in inner):
                raise ValueError("key_scale must be equally long lists at every level")
            return tuple(v for v, _ in inner), (len(x), *inner[0][1])
        if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
            return float(x), ()
        raise ValueError(f"key_scale must hold finite numbers in non-empty lists, got {x!r}")

    scale, shape = nested(rows)
    if len(shape) == 2 and not all(v > 0 for r in scale for v in r):
        raise ValueError("key_scale must hold positive numbers per channel")
    if len(shape) not in (2, 3) or (len(shape) == 3 and shape[1] != shape[2]):
        raise ValueError(f"key_scale must be heads x channels, or heads x channels x channels (square matrices), "
                         f"got {' x '.join(map(str, shape)) or 'a number'}")
    return scale


def _lists(x: Any) -> Any:
    """Nested tuples as nested lists (JSON)."""
    return [_lists(v) for v in x] if isinstance(x, tuple) else x


@dataclass(frozen=True)
class LayerPolicy:
    """What one decoder layer stores: ``key_encoder`` / ``value_encoder`` (registry names or configuration
    dicts) with ``residual_length`` recent tokens in full precision, or ``dense=True`` (no encoders: a
    full-precision layer). ``key_scale``: None, or per KV head the positive scale of each key channel
    (``[[float] * key head dim] * heads``; the keys are held divided by it) or an invertible matrix
    (``[[[float] * key head dim] * key head dim] * heads``; the keys are held times its inverse), see
    :mod:`tqindex.kv.store`. ``recent_length`` N > 0: the newest N encoded tokens held by ``recent_key_encoder`` /
    ``recent_value_encoder`` instead (a recent tier, :class:`tqindex.kv.store.RecentTier`)."""

    key_encoder: str | dict | None = None
    value_encoder: str | dict | None = None
    residual_length: int = 0
    dense: bool = False
    key_scale: tuple[tuple[float, ...], ...] | None = None
    recent_length: int = 0
    recent_key_encoder: str | dict | None = None
    recent_value_encoder: str | dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dense, bool):
            raise TypeError(f"dense must be a bool, got {type(self.dense).__name__}")
        for name in ("residual_length", "recent_length"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {n!r}")
        if self.key_scale is not None:
            object.__setattr__(self, "key_scale", _check_key_scale(self.key_scale))
        tier = (self.recent_key_encoder, self.recent_value_encoder)
        if self.dense:
            if self.key_encoder is not None or self.value_encoder is not None or self.key_scale is not None \
                    or self.recent_length or tier != (None, None):
                raise ValueError("a dense layer has no encoders, key scale or recent tier: leave key_encoder, "
                                 "value_encoder, key_scale and the recent_* fields out")
            return
        if self.key_encoder is None or self.value_encoder is None:
            raise ValueError("a compressed layer needs key_encoder and value_encoder (or dense=True)")
        object.__setattr__(self, "key_encoder", _check_encoder_spec(self.key_encoder, "key_encoder"))
        object.__setattr__(self, "value_encoder", _check_encoder_spec(self.value_encoder, "value_encoder"))
        if (tier != (None, None) if not self.recent_length else None in tier):
            raise ValueError("a recent tier needs recent_length >= 1, recent_key_encoder and recent_value_encoder "
                             f"together, got {self.recent_length!r}, {tier[0]!r}, {tier[1]!r}")
        for name, spec in zip(("recent_key_encoder", "recent_value_encoder"), tier):
            if spec is not None:
                object.__setattr__(self, name, _check_encoder_spec(spec, name))

    def to_dict(self) -> dict[str, Any]:
        """``{"dense": true}`` or ``{"key_encoder": ..., "value_encoder": ..., "residual_length": n}`` (with
        ``key_scale`` and the ``recent_*`` fields where set)."""
        if self.dense:
            return {"dense": True}
        scale = {} if self.key_scale is None else {"key_scale": _lists(self.key_scale)}
        recent = {} if not self.recent_length else {
            "recent_length": self.recent_length, "recent_key_encoder": self.recent_key_encoder,
            "recent_value_encoder": self.recent_value_encoder}
        return {"key_encoder": self.key_encoder, "value_encoder": self.value_encoder,
                "residual_length": self.residual_length, **scale, **recent}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayerPolicy":
        """Inverse of :meth:`to_dict` (ValueError for unknown fields)."""
        if not isinstance(data, dict):
            raise TypeError(f"a layer entry must be a dict, got {type(data).__name__}")
        known = ("key_encoder", "value_encoder", "residual_length", "dense", "key_scale", "recent_length",
                 "recent_key_encoder", "recent_value_encoder")
        unknown = set(data) - set(known)
        if unknown:
            raise ValueError(f"unknown layer fields {sorted(unknown)}; known: {', '.join(known)}")
        return cls(**data)

    def bytes_per_token(self, heads: int, key_dim: int, value_dim: int, context_tokens: int, dense_bytes: int,
                        center_keys: bool = False, sink_length: int = 0, encode_stride: int = 1) -> float:
        """Bytes this layer holds per token and batch row at a context of ``context_tokens`` tokens (module
        notes), at most."""
        if self.dense:
            return heads * (key_dim + value_dim) * dense_bytes
        codes = heads * (encoder_for(self.key_encoder, key_dim).code_size
                         + encoder_for(self.value_encoder, value_dim).code_size)
        if self.recent_length:
            tier = heads * (encoder_for(self.recent_key_encoder, key_dim).code_size
                            + encoder_for(self.recent_value_encoder, value_dim).code_size)
            codes += self.recent_length * (tier - codes) / context_tokens
        window = (self.residual_length + encode_stride - 1 + sink_length) * heads * (key_dim + value_dim) * dense_bytes
        offset = heads * key_dim * OFFSET_BYTES if center_keys else 0
        return codes + (window + offset) / context_tokens


@dataclass
class KVPolicy:
    """One :class:`LayerPolicy` per decoder layer (``layers[i]`` for layer i), whether compressed layers
    center their keys (see :mod:`tqindex.kv.store`), and ``calibration``: a free-form record of how the
    policy was chosen (budget, measured sensitivities), kept in the file for reference."""

    layers: list[LayerPolicy]
    center_keys: bool = True
    calibration: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (list, tuple)) or not self.layers:
            raise ValueError(f"layers must be a non-empty list of LayerPolicy, got {self.layers!r}")
        self.layers = [layer if isinstance(layer, LayerPolicy) else LayerPolicy.from_dict(layer)
                       for layer in self.layers]
        if not isinstance(self.center_keys, bool):
            raise TypeError(f"center_keys must be a bool, got {type(self.center_keys).__name__}")
        if not isinstance(self.calibration, dict):
            raise TypeError(f"calibration must be a dict, got {type(self.calibration).__name__}")

    @classmethod
    def uniform(cls, num_layers: int, key_encoder: str | dict, value_encoder: str | dict, residual_length: int = 0,
                protected_layers: int = 0, center_keys: bool = True) -> "KVPolicy":
        """The same encoders and window in every layer, the first and last ``protected_layers`` dense."""
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        if not isinstance(protected_layers, int) or protected_layers < 0:
            raise ValueError(f"protected_layers must be an integer >= 0, got {protected_layers!r}")
        layer = LayerPolicy(key_encoder, value_encoder, residual_length)
        dense = set(range(protected_layers)) | set(range(num_layers - protected_layers, num_layers))
        return cls([LayerPolicy(dense=True) if i in dense else layer for i in range(num_layers)], center_keys)

    def with_recent(self, length: int, key_encoder: str | dict, value_encoder: str | dict) -> "KVPolicy":
        """A copy whose compressed layers hold their newest ``length`` encoded tokens by ``key_encoder`` /
        ``value_encoder`` (a recent tier, :class:`LayerPolicy` ``recent_length``)."""
        layers = [layer if layer.dense else replace(layer, recent_length=length, recent_key_encoder=key_encoder,
                                                    recent_value_encoder=value_encoder) for layer in self.layers]
        return KVPolicy(layers, self.center_keys, dict(self.calibration))

    def with_key_scales(self, scales: Sequence[Any]) -> "KVPolicy":
        """A copy whose compressed layer i holds its keys scaled by ``scales[i]`` ([KV heads, key head dim] or
        [KV heads, key head dim, key head dim] tensors or nested lists, e.g. from
        :func:`tqindex.kv.calibrate.key_scales`; None leaves a layer unscaled)."""
        if len(scales) != len(self.layers):
            raise ValueError(f"{len(scales)} key scales for a policy of {len(self.layers)} layers")
        layers = []
        for layer, scale in zip(self.layers, scales):
            if not layer.dense and scale is not None:
                scale = scale.tolist() if hasattr(scale, "tolist") else scale
                layer = replace(layer, key_scale=scale)
            layers.append(layer)
        return KVPolicy(layers, self.center_keys, dict(self.calibration))

    # -- files -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: format, version, center_keys, layers, calibration."""
        return {"format": POLICY_FORMAT, "version": POLICY_VERSION, "center_keys": self.center_keys,
                "layers": [layer.to_dict() for layer in self.layers], "calibration": self.calibration}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVPolicy":
        """Inverse of :meth:`to_dict`; ValueError for another format or version or unknown fields."""
        if not isinstance(data, dict) or data.get("format") != POLICY_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a KV policy: format must be {POLICY_FORMAT!r}, got {got!r}")
        if data.get("version") != POLICY_VERSION:
            raise ValueError(f"KV policy version {data.get('version')!r} is not supported (this is version "
                             f"{POLICY_VERSION})")
        unknown = set(data) - {"format", "version", "center_keys", "layers", "calibration"}
        if unknown:
            raise ValueError(f"unknown KV policy fields {sorted(unknown)}")
        if not isinstance(data.get("layers"), list):
            raise ValueError("a KV policy needs a list of layers")
        return cls([LayerPolicy.from_dict(layer) for layer in data["layers"]], data.get("center_keys", True),
                    data.get("calibration") or {})

    def save(self, path: str | os.PathLike) -> None:
        """Write the policy as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KVPolicy":
        """Read a policy written by :meth:`save` (or by hand)."""
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not a JSON KV policy: {err}") from None
        return cls.from_dict(data)

    # -- accounting --------------------------------------------------------------------------------
    def bits_per_element(self, heads: int, key_dim: int, value_dim: int, context_tokens: int,
                         dense_bytes: int, sink_length: int = 0, encode_stride: int = 1) -> float:
        """Average stored bits per key/value element over all layers at ``context_tokens`` tokens (module
        notes) in a cache keeping ``sink_length`` first tokens in full precision and encoding ``encode_stride``
        tokens at a time: the most that ``8 * cache.nbytes()`` divided by the elements held comes to, up to
        the window tokens not yet held at short contexts."""
        total = sum(layer.bytes_per_token(heads, key_dim, value_dim, context_tokens, dense_bytes, self.center_keys,
                                          sink_length, encode_stride) for layer in self.layers)
        return 8 * total / (len(self.layers) * heads * (key_dim + value_dim))

    def describe(self) -> str:
        """One line per run of equal layers, e.g. ``layers 0-1: dense``, ``layers 2-9: tq4 keys, tq2 values,
        window 0``."""
        lines, start = [], 0
        for i in range(1, len(self.layers) + 1):
            if i == len(self.layers) or self.layers[i] != self.layers[start]:
                layer = self.layers[start]
                what = "dense" if layer.dense else (f"{_short(layer.key_encoder)} keys"
                                                    f"{' (scaled)' if layer.key_scale else ''}, "
                                                    f"{_short(layer.value_encoder)} values, "
                                                    f"window {layer.residual_length}"
                                                    + (f", the newest {layer.recent_length} encoded by "
                                                       f"{_short(layer.recent_key_encoder)} / "
                                                       f"{_short(layer.recent_value_encoder)}"
                                                       if layer.recent_length else ""))
                span = f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}"
                lines.append(f"{span}: {what}")
                start = i
        return "\n".join(lines)


def _short(spec: str | dict) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)


def choose(costs: Sequence[Sequence[float]], losses: Sequence[Sequence[float]], budget: float) -> list[int]:
    """One option per layer minimizing the summed loss with summed cost at most ``budget``.

    costs / losses: per layer, per option (same shapes; costs in bytes per token, >= 0); budget: the
    total cost allowed. Exact multiple-choice knapsack (dynamic programming over costs rounded up to
    1/64 byte, so a choice never exceeds the budget). -> the chosen option index of each layer.
    ValueError when even the cheapest options exceed the budget.
    """
    if len(costs) != len(losses) or any(len(c) != len(lo) or not c for c, lo in zip(costs, losses)):
        raise ValueError("costs and losses need the same number of layers and options per layer (>= 1)")
    cheapest = sum(min(c) for c in costs)
    if cheapest > budget + 1e-9:
        raise ValueError(f"the budget ({budget:.2f} bytes per token) is below the cheapest choice ({cheapest:.2f})")
    units = [[math.ceil(c / _COST_STEP - 1e-6) for c in layer] for layer in costs]
    cap = int(math.floor(budget / _COST_STEP + 1e-6))
    best = np.zeros(cap + 1)  # best[u]: least loss of the layers so far within u units
    picks = []
    for layer_units, layer_losses in zip(units, losses):
        new = np.full(cap + 1, np.inf)
        pick = np.full(cap + 1, -1, dtype=np.int64)
        for j, (u, loss) in enumerate(zip(layer_units, layer_losses)):
            if u > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[u:] = best[: cap + 1 - u] + loss
            better = cand < new
            new[better], pick[better] = cand[better], j
        best = new
        picks.append(pick)
    u = int(np.argmin(best))
    if not np.isfinite(best[u]):
        raise ValueError("no choice fits the budget")
    chosen = []
    for layer_units, pick in zip(reversed(units), reversed(picks)):
        j = int(pick[u])
        chosen.append(j)
        u -= layer_units[j]
    return chosen[::-1]
