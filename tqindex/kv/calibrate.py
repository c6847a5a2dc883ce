"""Per-layer precision of a TQCache chosen by measurement: :func:`calibrate` (:func:`measure_sensitivity`,
then :func:`policy_for_budget`, which a user may call apart to try several budgets on one measurement).

Every layer's sensitivity is measured alone: the model reads a calibration text of ``prefix + scored`` tokens, its
first ``prefix`` tokens go through a cache in which one layer stores its keys at ``b`` bits (``tq{b}-unbiased``, the
keys of ``TQCache``'s default; its values at 8 bits, nearly exact) behind a window of ``residual_length``
full-precision tokens and every other layer stays in full precision, the next ``scored`` tokens are predicted
``chunk`` at a time over that growing history (1, the default: real decoding, each new token encoded once it leaves
the window), and the sensitivity is the mean KL divergence of those predictions from a full-precision cache's, in
nats. The prefill runs once; the trials (every layer, side and width) then read the scored tokens ``batch`` at a
time as the rows of one batch of the model, each row's measured layer holding its tokens as that trial's ``TQCache``
layer does (appended, read decoded, encoded once beyond the window: the attention the model runs sees the codes'
values, as a ``TQCache`` read by attention other than ``"tqindex"``), its other layers and the other rows' that
layer in full precision. Values (``tq{b}``, or ``tq{b}-unbiased`` with ``unbiased_values``: codes scaled so that
attention's output is unbiased) are measured the same way (keys at 8 bits). A layer's loss for ``b_k``-bit keys and
``b_v``-bit values is the sum of the two (errors of different layers and of keys and values add up, to first order),
a full-precision layer's is 0, and :func:`tqindex.kv.policy.choose` picks per layer the option of least summed loss
whose bytes fit the budget (every option with the measured window). Scored in larger chunks, a chunk's tokens attend
to each other in full precision, as a chunked prefill does, which hides the error of the newest tokens' codes that
real decoding reads: on SmolLM2-135M under real decoding an 8-token window took ``tq4`` (4 sinks, unbiased keys)
from +2.5 % / +3.6 % perplexity to +0.8 % / +1.8 % (``benchmarks/results/kv_quality_smollm2_cpu_small_windows.md``,
one run).

``codes="tcq"`` measures and chooses among the trellis codes (:class:`~tqindex.trellis.TrellisMSE`:
``tcq{b}-unbiased`` keys, ``tcq{b}`` values), the same bytes with less error: on SmolLM2-135M under real decoding
the 3.25-bit policy behind 16 tokens with key scale matrices lost +0.93 % / +1.14 % with them
(``benchmarks/results/kv_quality_smollm2_cpu_trellis.md``), +2.22 % / +1.56 % with ``tq`` codes (an earlier run,
``..._key_matrices_4096.md``).

The calibration text should be unrelated to the text the cache will be judged on. The result is a plain
:class:`~tqindex.kv.policy.KVPolicy`: save it, read it, edit it, pass it to ``TQCache(config, policy=...)``.

:func:`key_scales` measures the other calibrated option, key scales (see :mod:`tqindex.kv.store`): for each
layer and KV head, from the second moments of the queries (of the heads sharing that KV head) and of the keys
(centered) over a calibration text, each token turned by the model's rotary embedding to positions spread over
the context, the matrix M that minimizes ``||q Mᵀ|| · ||k M⁻¹||``, the size of the score error of codes spread
evenly over the held key's coordinates (``per_channel``: the diagonal M of least error,
``s_i = sqrt(rms(k_i) / rms(q_i))`` by Cauchy-Schwarz). Measured on SmolLM2-135M under real decoding
(``benchmarks/results/kv_quality_smollm2_cpu_key_matrices_rope.md``) the matrices lower the worse text's
perplexity increase at 4.31, 3.21 and 2.48 bits per element (+3.6 % to +2.0 %, +4.3 % to +1.8 %, +23.6 % to
+14.0 %); per-channel scales, measured before the rotary turning, did not help on balance
(``..._key_scales.md``). An option (``scale_keys``), not a default.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..checks import check_bool, check_choice, check_int
from ..trellis import TRELLIS_BITS
from ..turboquant import MSE_BITS
from .policy import ENCODE_STRIDE, SINK_LENGTH, KVPolicy, LayerPolicy, choose

NEAR_EXACT = "tq8"
"""The encoder of the side (keys or values) not under measurement."""
CODE_FAMILIES = {"tq": MSE_BITS, "tcq": TRELLIS_BITS}
"""The encoders a measurement chooses among: ``"tq"`` (TurboQuantMSE, ``TQCache``'s default) or ``"tcq"``
(trellis codes, TrellisMSE), with the bit widths each has; keys ``{family}{b}-unbiased``, values ``{family}{b}``
(``{family}{b}-unbiased`` with ``unbiased_values``)."""
SCALE_RIDGE = 1e-3
"""Ridge added to the moments behind key scale matrices, as a fraction of their mean diagonal (directions the
calibration text never used get a bounded scale)."""
ROPE_DRAWS = 8
"""Positions each calibration token's key and query is turned to by :func:`key_scales`."""
TRIAL_BATCH = 16
"""Trials measured together: the batch rows of one pass of the model over the scored tokens."""


@dataclass(frozen=True)
class Sensitivity:
    """What :func:`measure_sensitivity` measured: ``key_kl[w][i]`` / ``value_kl[w][i]``, the mean KL divergence
    (nats per scored token) with layer i's keys / values stored by encoder ``w`` (e.g. ``"tq3-unbiased"`` /
    ``"tq3"``), and the model's cache shape: layers, KV heads, key and value head dims, bytes per element of
    its dtype;
    ``key_scales``: the per-layer key scales the measurement ran with (nested lists, None per unscaled
    layer), which the chosen policies keep, or None; ``residual_length``: the window of the measured layer,
    which the chosen policies keep; ``chunk``: tokens per forward pass of the scored part."""

    key_kl: dict[str, list[float]]
    value_kl: dict[str, list[float]]
    layers: int
    heads: int
    key_dim: int
    value_dim: int
    dense_bytes: int
    prefix: int
    scored: int
    center_keys: bool
    key_scales: list[Any] | None = None
    residual_length: int = 0
    chunk: int = 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


def measure_sensitivity(
    model: Any,
    tokens: Tensor,
    *,
    bits: tuple[int, ...] = (2, 3, 4),
    prefix: int = 384,
    scored: int = 64,
    center_keys: bool = True,
    backend: str | None = None,
    key_scales: Sequence[Any] | None = None,
    residual_length: int = 0,
    chunk: int = 1,
    unbiased_values: bool = False,
    batch: int = TRIAL_BATCH,
    codes: str = "tq",
) -> Sensitivity:
    """Each layer's sensitivity to ``"tq{b}-unbiased"`` keys and ``"tq{b}"`` values (``"tq{b}-unbiased"`` with
    ``unbiased_values``; ``codes="tcq"``: the trellis codes ``"tcq{b}..."``, see :data:`CODE_FAMILIES`), for b in
    ``bits``, behind a window of ``residual_length`` tokens, the ``scored`` tokens fed ``chunk`` at a time (module
    notes).

    model: a transformers causal LM; tokens: calibration token ids [1, T] (or [T]) with T >= prefix +
    scored; backend: the kernels of the trial caches' encoders; key_scales: per-layer key scales
    (:func:`key_scales`) the trial caches hold their keys with, or None; batch: trials per pass of the model
    (its batch rows). Runs one prefill of ``prefix`` tokens, then the ``2 · layers · len(bits)`` trials and the
    full-precision reference, ``batch`` at a time, each through ``ceil(scored / chunk)`` steps of the model (a
    progress bar counts the trials).
    """
    from .hf import TQCache, TQLayer

    tokens = tokens.reshape(1, -1) if isinstance(tokens, Tensor) and tokens.dim() == 1 else tokens
    check_int(prefix, "prefix", 1)
    check_int(scored, "scored", 1)
    check_int(residual_length, "residual_length", 0)
    check_int(chunk, "chunk", 1)
    check_int(batch, "batch", 1)
    check_bool(unbiased_values, "unbiased_values")
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.shape[0] != 1 \
            or tokens.shape[1] < prefix + scored:
        got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be ids [1, T] with T >= prefix + scored = {prefix + scored}, got {got}")
    template = sensitivity_template(model, bits=bits, prefix=prefix, scored=scored, center_keys=center_keys,
                                    key_scales=key_scales, residual_length=residual_length, chunk=chunk,
                                    unbiased_values=unbiased_values, codes=codes)
    layers = template.layers
    tokens = tokens.to(next(model.parameters()).device)
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def trial_store(layer: int, keys: str, values: str) -> Any:  # layer's KVStore in the trial's TQCache, or None
        entries = [LayerPolicy(dense=True)] * layers
        entries[layer] = LayerPolicy(keys, values, residual_length)
        policy = KVPolicy(entries, center_keys)
        policy = policy if key_scales is None else policy.with_key_scales(key_scales)
        held = TQCache(model.config, policy=policy, backend=backend, encode_stride=1).layers[layer]
        return held.store if isinstance(held, TQLayer) else None  # (a layer type TQCache keeps dense: no loss)

    kl = {"keys": template.key_kl, "values": template.value_kl}  # filled in place
    runs = [(i, name, side) for i in range(layers) for side in kl for name in kl[side]]
    with torch.inference_mode():
        prefilled = DynamicCache(config=model.config)
        model(input_ids=tokens[:, :prefix], **{kwarg: prefilled}, use_cache=True, logits_to_keep=1)
        reference = _scored(model, _trial_cache(prefilled, [None]), 1, tokens, prefix, scored, chunk, kwarg)[0]
        with tqdm(total=len(runs), desc="calibrating", unit="trial") as progress:
            for first in range(0, len(runs), batch):
                part = runs[first : first + batch]
                stores = [trial_store(i, spec, NEAR_EXACT) if side == "keys" else trial_store(i, NEAR_EXACT, spec)
                          for i, spec, side in part]
                cache = _trial_cache(prefilled, [None if s is None else (i, s) for (i, _, _), s in zip(part, stores)])
                logp = _scored(model, cache, len(part), tokens, prefix, scored, chunk, kwarg)
                for (i, spec, side), row in zip(part, logp):
                    kl[side][spec][i] = max(float((reference.exp() * (reference - row)).sum(-1).mean()), 0.0)
                progress.update(len(part))
    return template


class _TrialLayer(DynamicLayer):
    """A full-precision cache layer over a batch of trials whose rows ``stores`` maps to KVStores (of the trials'
    TQCache layers) hold their tokens there too and read them from there, decoded, as a TQCache layer hands its
    tokens to attention other than ``"tqindex"``: appended, read, then settled (encoded beyond the window)."""

    def __init__(self, stores: dict[int, Any]) -> None:
        super().__init__()
        self.stores = stores

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        for row, store in self.stores.items():
            store.append(key_states[row : row + 1], value_states[row : row + 1])
            held = store.materialize(keys.dtype)
            keys[row], values[row] = held[0][0], held[1][0]  # the layer's own rows: rewritten at every step
            store.settle()
        return keys, values


def _trial_cache(prefilled: Any, trials: list[tuple[int, Any] | None]) -> Any:
    """The one-row cache ``prefilled`` repeated for a batch row per trial, the row of trial (layer i, KVStore)
    holding layer i's tokens in that store (:class:`_TrialLayer`; the prefill's tokens appended there as a
    TQCache layer takes them), a None trial's row in full precision everywhere."""
    cache = copy.deepcopy(prefilled)
    cache.batch_repeat_interleave(len(trials))
    by_layer: dict[int, dict[int, Any]] = {}
    for row, trial in enumerate(trials):
        if trial is not None:
            by_layer.setdefault(trial[0], {})[row] = trial[1]
    for i, stores in by_layer.items():
        layer = _TrialLayer(stores)
        layer.update(cache.layers[i].keys, cache.layers[i].values)
        cache.layers[i] = layer
    return cache


def _scored(model: Any, cache: Any, rows: int, tokens: Tensor, prefix: int, scored: int, chunk: int,
            kwarg: str) -> Tensor:
    """Log-probabilities float32 [rows, scored, vocab] of the scored tokens, fed ``chunk`` at a time to each of the
    ``rows`` rows of ``cache`` (prefilled with the first ``prefix`` tokens)."""
    logits = [model(input_ids=tokens[:, i : min(i + chunk, prefix + scored)].expand(rows, -1), **{kwarg: cache},
                    use_cache=True).logits for i in range(prefix, prefix + scored, chunk)]
    return torch.log_softmax(torch.cat(logits, 1).float(), dim=-1)


def sensitivity_template(model: Any, *, bits: tuple[int, ...] = (2, 3, 4), prefix: int = 384, scored: int = 64,
                         center_keys: bool = True, key_scales: Sequence[Any] | None = None, residual_length: int = 0,
                         chunk: int = 1, unbiased_values: bool = False, codes: str = "tq") -> Sensitivity:
    """What :func:`measure_sensitivity` returns for ``model`` with these arguments (the same names), every KL 0,
    without running the model: the options and their bytes, so that a budget can be checked
    (:func:`policy_for_budget` raises where it is below the cheapest choice) before a long measurement."""
    from .hf import _head_dims

    check_choice(codes, "codes", CODE_FAMILIES)
    if not bits or any(b not in CODE_FAMILIES[codes] for b in bits):
        raise ValueError(f"bits must be widths among {CODE_FAMILIES[codes]} ({codes!r} codes), got {bits!r}")
    config = model.config.get_text_config(decoder=True)
    layers = len(DynamicCache(config=model.config).layers)
    key_dim, value_dim = _head_dims(config)
    value = "-unbiased" if unbiased_values else ""
    return Sensitivity({f"{codes}{b}-unbiased": [0.0] * layers for b in bits},
                       {f"{codes}{b}{value}": [0.0] * layers for b in bits}, layers, config.num_key_value_heads, key_dim,
                       value_dim, next(model.parameters()).element_size(), prefix, scored, center_keys,
                       None if key_scales is None else
                       [None if t is None else torch.as_tensor(t).tolist() for t in key_scales],
                       residual_length, chunk)


def policy_for_budget(sensitivity: Sensitivity, budget_bits: float, *, allow_dense: bool = True,
                      context_tokens: int = 2048, sink_length: int = SINK_LENGTH,
                      encode_stride: int = ENCODE_STRIDE, recent: tuple[int, str, str] | None = None) -> KVPolicy:
    """The policy of least predicted loss (summed KL) whose layers store at most ``budget_bits`` bits per key/value
    element on average, side data and full-precision layers included, at a context of ``context_tokens`` tokens in a
    cache that keeps its first ``sink_length`` tokens in full precision and encodes ``encode_stride`` tokens at a
    time (``TQCache``'s defaults; :meth:`KVPolicy.bits_per_element`). Options per layer: every pair of the measured
    key encoders with every measured value encoder behind the measured window, and full precision if
    ``allow_dense``; ``recent`` (length, key encoder, value encoder): every compressed option holds its newest
    ``length`` encoded tokens by those encoders (:meth:`KVPolicy.with_recent`; their bytes are counted, the
    sensitivities are those measured without). The policy's ``calibration`` records the budget, the bits reached,
    the predicted KL and the measurement. ValueError when the budget is below the cheapest choice."""
    check_int(context_tokens, "context_tokens", 1)
    check_int(sink_length, "sink_length", 0)
    check_int(encode_stride, "encode_stride", 1)
    s = sensitivity
    tier = {} if recent is None else dict(zip(("recent_length", "recent_key_encoder", "recent_value_encoder"), recent))
    options = [LayerPolicy(k, v, s.residual_length, **tier) for k in s.key_kl for v in s.value_kl]
    if allow_dense:
        options.append(LayerPolicy(dense=True))
    per_token = [o.bytes_per_token(s.heads, s.key_dim, s.value_dim, context_tokens, s.dense_bytes, s.center_keys,
                                   sink_length, encode_stride)
                 for o in options]
    losses = [[0.0 if o.dense else s.key_kl[o.key_encoder][i] + s.value_kl[o.value_encoder][i] for o in options]
              for i in range(s.layers)]
    budget = budget_bits / 8 * s.heads * (s.key_dim + s.value_dim) * s.layers
    chosen = choose([per_token] * s.layers, losses, budget)
    policy = KVPolicy([options[j] for j in chosen], s.center_keys)
    if s.key_scales is not None:
        policy = policy.with_key_scales(s.key_scales)
    policy.calibration = {
        "method": "per-layer KL divergence, keys and values measured apart (tqindex.kv.calibrate)",
        "budget_bits": budget_bits, "context_tokens": context_tokens, "sink_length": sink_length,
        "encode_stride": encode_stride, **({} if recent is None else {"recent": list(recent)}),
        "bits": policy.bits_per_element(s.heads, s.key_dim, s.value_dim, context_tokens, s.dense_bytes, sink_length,
                                        encode_stride),
        "predicted_kl": sum(losses[i][j] for i, j in enumerate(chosen)), "sensitivity": s.to_dict(),
    }
    return policy


def calibrate(model: Any, tokens: Tensor, budget_bits: float, *, bits: tuple[int, ...] = (2, 3, 4),
              allow_dense: bool = True, prefix: int = 384, scored: int = 64, context_tokens: int = 2048,
              sink_length: int = SINK_LENGTH, encode_stride: int = ENCODE_STRIDE, center_keys: bool = True,
              backend: str | None = None, scale_keys: bool = False, residual_length: int = 0,
              chunk: int = 1, unbiased_values: bool = False, batch: int = TRIAL_BATCH, codes: str = "tq",
              recent: tuple[int, str, str] | None = None) -> KVPolicy:
    """A :class:`KVPolicy` for ``model`` at most ``budget_bits`` bits per stored key/value element on
    average: :func:`measure_sensitivity` on calibration ids ``tokens`` [1, T], then :func:`policy_for_budget`
    (arguments as there); with ``scale_keys``, key scales measured on the same tokens first
    (:func:`key_scales`), which the measurement and the policy use. Save it with :meth:`KVPolicy.save`; use it
    as ``TQCache(model.config, policy=p)``; ``recent``: as in :func:`policy_for_budget`."""
    # a budget below the cheapest choice fails now, not after the measurement
    policy_for_budget(sensitivity_template(model, bits=bits, center_keys=center_keys, residual_length=residual_length,
                                           unbiased_values=unbiased_values, codes=codes),
                      budget_bits, allow_dense=allow_dense, context_tokens=context_tokens, sink_length=sink_length,
                      encode_stride=encode_stride, recent=recent)
    scales = key_scales(model, tokens, context_tokens=context_tokens) if check_bool(scale_keys, "scale_keys") else None
    sensitivity = measure_sensitivity(model, tokens, bits=bits, prefix=prefix, scored=scored,
                                      center_keys=center_keys, backend=backend, key_scales=scales,
                                      residual_length=residual_length, chunk=chunk, unbiased_values=unbiased_values,
                                      batch=batch, codes=codes)
    return policy_for_budget(sensitivity, budget_bits, allow_dense=allow_dense, context_tokens=context_tokens,
                             sink_length=sink_length, encode_stride=encode_stride, recent=recent)


_CAPTURE = "tqindex-calibrate-capture"


def key_scales(model: Any, tokens: Tensor, strength: float | None = None, per_channel: bool = False,
               context_tokens: int = 4096) -> list[Tensor | None]:
    """Key scales of every layer (module notes) from one pass of the model over calibration ids ``tokens``
    [1, T]: per KV head a float32 matrix [KV heads, Dk, Dk] (determinant 1), or with ``per_channel`` a scale
    per key channel [KV heads, Dk] (geometric mean 1); None for layers without keys of their own. ``strength``
    in [0, 1] raises them to that power (0: no scaling, 1: the optimum for the calibration text's statistics;
    between: less reliance on them); None: 0.5 for matrices, 1 per channel (the better on SmolLM2-135M).

    Keys and queries are taken at positions spread over ``context_tokens`` (each calibration token's key and
    query turned by the model's rotary embedding from its own position to ROPE_DRAWS seeded positions below
    ``context_tokens``): rotary embeddings turn them into other directions at every position, so scales fitted
    at a text's first positions would not hold at later ones. Models without a rotary embedding over whole
    heads (rotate-half layout, found as the first module whose class name ends in ``RotaryEmbedding``) are
    measured at the calibration positions. Use the scales through a policy
    (:meth:`~tqindex.kv.policy.KVPolicy.with_key_scales`). The model's attention implementation is restored
    afterwards."""
    check_bool(per_channel, "per_channel")
    strength = (1.0 if per_channel else 0.5) if strength is None else strength
    if not isinstance(strength, (int, float)) or isinstance(strength, bool) or not 0 <= strength <= 1:
        raise ValueError(f"strength must be a number in [0, 1], got {strength!r}")
    context_tokens = check_int(context_tokens, "context_tokens", 1)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tokens = tokens.reshape(1, -1) if isinstance(tokens, Tensor) and tokens.dim() == 1 else tokens
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.shape[1] < 2:
        got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be ids [1, T] with T >= 2, got {got}")
    device = next(model.parameters()).device
    turns = _rope_turns(model, tokens.shape[1], context_tokens, device)
    moments: dict[int, tuple[Tensor, Tensor]] = {}

    def capture(module: Any, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
        hkv, d = key.shape[1], key.shape[-1]
        q2, k1, k2, n = 0, 0, 0, 0
        for q, k in _turned(query[0].double(), key[0].double(), turns):
            q = q.reshape(hkv, -1, d)  # [Hkv, G * T, D]: the query heads of each KV head
            q2, k1, k2, n = q2 + q.mT @ q / q.shape[1], k1 + k.mean(1), k2 + k.mT @ k / k.shape[1], n + 1
        mean = k1 / n
        moments[module.layer_idx] = (q2 / n, k2 / n - mean[:, :, None] * mean[:, None, :])  # [Hkv, D, D] each
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(_CAPTURE, capture)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE)
    try:
        with torch.inference_mode():
            model(input_ids=tokens.to(device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    layers = len(DynamicCache(config=model.config).layers)
    return [None if i not in moments else _scale(*moments[i], strength, per_channel) for i in range(layers)]


def _rope_turns(model: Any, length: int, context_tokens: int, device: torch.device) -> list[tuple[Tensor, Tensor]]:
    """[(cos, sin)] float64 [length, D] of the model's rotary embedding: first at positions 0 ... length - 1, then
    ROPE_DRAWS times at seeded positions below ``context_tokens``; [] for a model without one."""
    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is None:
        return []
    g = torch.Generator().manual_seed(0)
    positions = [torch.arange(length)] + [torch.randint(0, context_tokens, (length,), generator=g)
                                          for _ in range(ROPE_DRAWS)]
    probe = torch.zeros(1, device=device)
    turns = []
    for p in positions:
        cos, sin = rotary(probe, p[None].to(device))
        turns.append((cos[0].double(), sin[0].double()))
    return turns


def _turned(q: Tensor, k: Tensor, turns: list[tuple[Tensor, Tensor]]) -> Iterator[tuple[Tensor, Tensor]]:
    """Queries [Hq, T, D] and keys [Hkv, T, D] at the positions of ``turns`` (:func:`_rope_turns`: back from the
    first, to each other), one pair at a time, or as they are when there are no turns or they do not cover the
    head."""
    if not turns or turns[0][0].shape[-1] != k.shape[-1]:
        yield q, k
        return
    cos0, sin0 = turns[0]
    q, k = (x * cos0 - _rotate_half(x) * sin0 for x in (q, k))  # back to no rotation
    for cos, sin in turns[1:]:
        yield q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: Tensor) -> Tensor:
    """The rotary embedding's quarter turn of each channel pair (i, i + D/2): (a, b) -> (-b, a)."""
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def _scale(a: Tensor, c: Tensor, strength: float, per_channel: bool) -> Tensor:
    """Key scales of one layer from the queries' second moments ``a`` and the centered keys' covariance ``c``
    (float64 [Hkv, D, D]). Held keys ``k M⁻¹`` and queries ``q Mᵀ`` give score errors of size
    ``tr(M⁻¹ C M⁻ᵀ) · tr(Mᵀ A M)``; per channel the least is at ``s = (c / a)^(1/4)`` (Cauchy-Schwarz),
    over matrices at ``M = W^(-1/2)`` for W the geometric mean of C⁻¹ and A,
    ``C^(-1/2) (C^(1/2) A C^(1/2))^(1/2) C^(-1/2)``. Raised to ``strength``, normalized (geometric mean of the
    channels' scales, or determinant, 1), float32 on the CPU."""
    if per_channel:
        floor = torch.finfo(torch.float32).tiny
        a, c = a.diagonal(dim1=-2, dim2=-1).clamp_min(floor), c.diagonal(dim1=-2, dim2=-1).clamp_min(floor)
        log_s = 0.25 * strength * (c.log() - a.log())
        return (log_s - log_s.mean(-1, keepdim=True)).exp().float().cpu()
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    a, c = (m + SCALE_RIDGE * m.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * eye for m in (a, c))
    c_half, c_inv_half = _power(c, 0.5), _power(c, -0.5)
    w = c_inv_half @ _power(c_half @ a @ c_half, 0.5) @ c_inv_half
    m = _power(w, -0.5 * strength)
    return (m / torch.linalg.det(m)[:, None, None] ** (1 / m.shape[-1])).float().cpu()


def _power(m: Tensor, p: float) -> Tensor:
    """Symmetric positive definite matrices [..., D, D] to the power p (float64)."""
    lam, vec = torch.linalg.eigh((m + m.mT) / 2)
    return (vec * lam.clamp_min(torch.finfo(m.dtype).tiny)[..., None, :] ** p) @ vec.mT
