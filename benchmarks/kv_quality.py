"""KV-cache quality on a real causal LM under token-by-token decoding: perplexity, needle, bytes per token.

Model: SmolLM2-135M-Instruct (30 layers, 3 KV heads, head_dim 64, float32 weights), see ``_lm.py``.
Every configuration is one transformers ``Cache``; the model and the token streams are the same for all.

- **Perplexity under real decoding**, on two held-apart texts (disjoint sections of the Python Language
  Reference, :data:`_lm.PPL_TOPICS` and :data:`_lm.SECOND_TOPICS`): the first ``--prefill`` tokens go in one
  forward pass, the rest one token at a time (``--chunk 1``, the default) through the cache, so every
  scored token attends to the cache's stored history exactly as in generation, every configuration at
  the window it declares (``--chunk 64`` scores in chunks instead, labelled in the report: a chunk
  attends to itself in full precision). Reported: PPL and its relative increase over ``DynamicCache``.
- **Needle**: a passcode sentence placed early in ``--needle-tokens`` tokens of other text, asked for
  at the end through the chat template; the prompt is prefilled up to its last ``--needle-streamed`` tokens,
  which are fed one by one, then the answer is decoded greedily (up to 24 tokens) and must contain the
  code. ``needle_code_prob``: the probability of the passcode's digits after the answer prefix "The
  secret passcode is" (teacher-forced, on a copy of the cache).
- **Memory**, on the same row: bytes the cache holds at the end of the first text (codes, scales,
  windows, key offsets, full-precision layers; the model runs in float32, so windows and full-precision
  layers hold 4 bytes per element), per token, as bits per key/value element, and against a bfloat16
  ``DynamicCache`` and the ``fp8`` row.

Configurations: ``dynamic`` (float32 ``DynamicCache``, the reference); transformers' ``QuantizedCache``
with the ``fp8`` backend (E4M3, one scale per tensor frozen at the prefill) and the ``quanto`` backend
(int4 / int2, groups of 64 along head_dim, residual window N: ``quanto-int4-rN``); ``fp8-tq``, tqindex's
``FP8Cache`` (E4M3, one scale per token and head); tqindex ``TQCache`` presets tq2 / tq3 / tq4 (TurboQuant
keys and values at 2 / 3 / 4 bits), k{a}v{b} (a-bit keys, b-bit values; a, b in 1, 2, 3, 4, 8), fp4
(FP4-UE8M0), and the trellis codes tcq2 / tcq3 / tcq4 and tcqk{a}v{b} (a, b in 1-4),
named ``{preset}-r{residual_length}-p{protected_layers}[-s{sink_length}]`` (``-sN``: the first N tokens never
encoded; a ``-tN`` suffix: the newest N encoded tokens held at 4 bits of the same family, ``tq4`` or ``tcq4``,
unbiased where the configuration's are, and transcoded to the configuration's codes as they age: a recent tier,
:class:`tqindex.kv.store.RecentTier`; also on policies), keys centered (``center_keys``) unless the name ends in
``-nc``, keys stored with the scale that
makes their inner products unbiased (the ``tq{b}-unbiased`` encoders, where ``tq{b}`` keeps their norms) with
``-ku``, values likewise with ``-vu`` (attention's output is then unbiased: ``tq{b}`` values point along their
code, so each is shrunk along its own direction by the code's cosine), with key scales
(:func:`tqindex.kv.key_scales`, calibrated on the third text below) per channel with ``-ks``, a matrix per KV head
with ``-km``;
``policy-b{bits}[-r{N}][-ks|-km][-vu][-tcq]``: a per-layer policy chosen by :func:`tqindex.kv.calibrate` for an average of
at most ``bits`` bits per element at ``--tokens`` tokens of context, with ``TQCache``'s default sink tokens and a
window of N tokens in every layer (``-ks`` / ``-km``: measured and kept with those key scales; ``-vu``: values measured and
chosen among ``tq{b}-unbiased``; ``-tcq``: among the trellis codes ``tcq{b}``), measured under real decoding behind
that window and calibrated on a third text
(:data:`_lm.CALIBRATION_TOPICS`, disjoint from both). tqindex runs use the ``"tqindex"`` attention
implementation (attention computed from the codes) and encode each token as it leaves the window
(``encode_stride=1``): a window holds exactly its ``residual_length`` tokens of earlier steps (``TQCache``'s
default ``encode_stride`` would let it hold up to ``encode_stride - 1`` more).

Usage::

    python benchmarks/kv_quality.py --quick          # smoke run, ~1 min once the model is cached
    python benchmarks/kv_quality.py                  # full run (about an hour on 2 CPU cores), writes
                                                     # benchmarks/results/kv_quality_smollm2_cpu.{json,md}
    python benchmarks/kv_quality.py --configs dynamic tq4-r0-p0 policy-b3.25 --out /tmp/x
    python benchmarks/kv_quality.py --merge /tmp/a.json /tmp/b.json benchmarks/results/kv_quality_smollm2_cpu
                                                     # runs of disjoint configurations side by side -> one

The JSON and the report are rewritten after every configuration.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from tqindex.kv import TQCache, TQLayer  # also registers the "tqindex" attention with transformers
from tqindex.kv.policy import SINK_LENGTH

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm  # noqa: E402
from _env import environment  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "kv_quality_smollm2_cpu"

NEEDLE_CODE = "48213"
NEEDLE = f"Remember this: the secret passcode is {NEEDLE_CODE}."
QUESTION = "What is the secret passcode mentioned in the text above? Answer with the number only."
ANSWER_PREFIX = "The secret passcode is"
NEEDLE_MAX_NEW_TOKENS = 24  # the tokenizer splits numbers into single digits

TQ_PRESETS = ("tq2", "tq3", "tq4", "fp4", "tcq2", "tcq3", "tcq4")
TQ_BITS = "12348"
"""Bits of the TurboQuant encoders a ``k{a}v{b}`` preset names (``tcqk{a}v{b}``: trellis codes, bits 1-4)."""
ENCODE_STRIDE = 1  # every tqindex cache encodes each token as it leaves its window (module notes)
NEEDLE_BITS = 2.75  # the needle must be found by every configuration of at least this many bits per element
DEFAULT_CONFIGS = (
    "dynamic", "fp8", "quanto-int4-r128",
    "tq4-r0-p0", "tq4-r0-p0-nc", "tq4-r0-p0-ks", "tq4-r128-p0", "tq3-r0-p0", "tq3-r0-p0-ks", "tq2-r0-p0",
    "tq2-r0-p0-ks", "tq4-r8-p0-s4-ku", "tq3-r8-p0-s4-ku-vu", "policy-b3.25-r8", "policy-b2.5-r8",
)
QUICK_CONFIGS = ("dynamic", "tq4-r128-p2")
CALIBRATION: dict[str, Any] = {}
"""The key scales (``ks``: per channel, ``km``: matrices), the sensitivities (:func:`sensitivity_name`: with
unscaled or scaled keys, behind a window; measured once per run by :func:`main`) and ``context_tokens``: what
``-ks``, ``-km`` and ``policy-b*`` configurations are built from."""
SCALE_FORMS = {"ks": "per-channel key scales", "km": "key scale matrices"}


# ------------------------------------------------------------------------------ configurations

@dataclass(frozen=True)
class CacheSpec:
    """One cache configuration: how to build it and how to label it."""

    name: str
    family: str  # "reference" | "transformers" | "tqindex"
    description: str
    make: Callable[[Any], Any]  # model config -> transformers Cache
    attn_implementation: str = "sdpa"
    preset: str | None = None
    residual_length: int | None = None
    protected_layers: int | None = None
    budget_bits: float | None = None
    key_scales: str = ""  # "", or a SCALE_FORMS key
    values_unbiased: bool = False  # policies: measured and chosen among tq{b}-unbiased values
    codes: str = "tq"  # policies: the encoders chosen among (tqindex.kv.calibrate.CODE_FAMILIES)
    recent: tuple[int, str, str] | None = None  # the recent tier (recent_tier)

    def policy(self, sensitivity: Any, context_tokens: int) -> Any:
        """A policy configuration's KVPolicy for ``sensitivity`` at ``context_tokens`` tokens of context."""
        from tqindex.kv import policy_for_budget

        return policy_for_budget(sensitivity, self.budget_bits, context_tokens=context_tokens,
                                 encode_stride=ENCODE_STRIDE, recent=self.recent)


def sensitivity_name(scaled: str, window: int, values_unbiased: bool = False, codes: str = "tq") -> str:
    """The CALIBRATION entry of the sensitivity measured with key scales of form ``scaled`` (a SCALE_FORMS key) or
    none (""), behind a window of ``window``, with plain or unbiased values, of the ``codes`` encoders."""
    return "sensitivity" + (f"-r{window}" if window else "") + (f"-{scaled}" if scaled else "") + (
        "-vu" if values_unbiased else "") + (f"-{codes}" if codes != "tq" else "")


def recent_tier(length: str | None, codes: str, keys_unbiased: bool, values_unbiased: bool
                ) -> tuple[int, str, str] | None:
    """The recent tier a ``-t{length}`` suffix names: (length, key encoder, value encoder) at 4 bits of the
    ``codes`` family ("tq" or "tcq"), unbiased where the configuration's keys / values are; None without one."""
    if not length:
        return None
    return int(length), f"{codes}4" + "-unbiased" * keys_unbiased, f"{codes}4" + "-unbiased" * values_unbiased


def recent_label(tier: tuple[int, str, str] | None) -> str:
    """The description of a recent tier (:func:`recent_tier`) in a configuration's label."""
    return "" if tier is None else f", the newest {tier[0]} encoded tokens held by {tier[1]} / {tier[2]}"


def cache_spec(name: str) -> CacheSpec:
    """Parse a configuration name (see the module docstring) into a :class:`CacheSpec`.

    Raises:
        ValueError: unknown name.
    """
    from transformers import DynamicCache, QuantizedCache

    from tqindex.kv import FP8Cache, KVPolicy

    if name == "dynamic":
        return CacheSpec(name, "reference", "DynamicCache, float32 (full precision)",
                         lambda cfg: DynamicCache(config=cfg))
    if name == "fp8":
        return CacheSpec(name, "transformers",
                         "QuantizedCache fp8: E4M3, one scale per tensor frozen at the prefill",
                         lambda cfg: QuantizedCache("fp8", cfg))
    if name == "fp8-tq":
        return CacheSpec(name, "tqindex", "tqindex FP8Cache: E4M3, one scale per token and head",
                         lambda cfg: FP8Cache(cfg))
    if name.startswith("policy-b"):
        policy_match = re.fullmatch(r"policy-b(\d+(?:\.\d+)?)(?:-r(\d+))?(?:-(ks|km))?(-vu)?(-tcq)?(?:-t(\d+))?",
                                    name)
        if not policy_match:
            raise ValueError("policy configuration must look like 'policy-b3.25[-r8][-ks|-km][-vu][-tcq][-t128]', "
                             f"got {name!r}")
        bits, window = float(policy_match[1]), int(policy_match[2] or 0)
        scaled, values_unbiased = policy_match[3] or "", bool(policy_match[4])
        codes = "tcq" if policy_match[5] else "tq"
        measured = sensitivity_name(scaled, window, values_unbiased, codes)
        tier = recent_tier(policy_match[6], codes, True, values_unbiased)

        def make_policy(cfg: Any) -> Any:
            if measured not in CALIBRATION:
                raise RuntimeError("policy configurations need the sensitivity measured by main()")
            return TQCache(cfg, policy=spec.policy(CALIBRATION[measured], CALIBRATION["context_tokens"]),
                           encode_stride=ENCODE_STRIDE)

        spec = CacheSpec(name, "tqindex", f"TQCache with a per-layer policy calibrated for <= {bits:g} bits "
                         f"per element, window {window}, the first {SINK_LENGTH} tokens never encoded"
                         + (f", calibrated {SCALE_FORMS[scaled]}" if scaled else "")
                         + (", values scaled to be unbiased" if values_unbiased else "")
                         + (", trellis codes" if codes == "tcq" else "") + recent_label(tier), make_policy, "tqindex",
                         residual_length=window, budget_bits=bits, key_scales=scaled, values_unbiased=values_unbiased,
                         codes=codes, recent=tier)
        return spec
    if name.startswith("quanto-int"):
        try:
            bits_s, res_s = name.removeprefix("quanto-int").split("-r")
            bits, res = int(bits_s), int(res_s)
        except ValueError:
            raise ValueError(f"quanto configuration must look like 'quanto-int4-r128', got {name!r}") from None
        return CacheSpec(name, "transformers",
                         f"QuantizedCache quanto int{bits}, groups of 64, residual {res}",
                         lambda cfg: QuantizedCache("quanto", cfg, nbits=bits, residual_length=res),
                         residual_length=res)
    cfg_match = re.fullmatch(r"(\w+)-r(\d+)-p(\d+)(?:-s(\d+))?(-nc)?(-ku)?(-vu)?(?:-(ks|km))?(?:-t(\d+))?", name)
    pair = cfg_match and re.fullmatch(f"(tcq)?k([{TQ_BITS}])v([{TQ_BITS}])", cfg_match[1])
    if cfg_match and (cfg_match[1] in TQ_PRESETS or pair):
        preset, res, prot, sink = (cfg_match[1], *(int(g or 0) for g in cfg_match.groups()[1:4]))
        center, unbiased, values_unbiased = not cfg_match[5], bool(cfg_match[6]), bool(cfg_match[7])
        scaled = cfg_match[8] or ""
        codes = (pair[1] or "tq") if pair else ""
        kenc, venc = (preset, preset) if not pair else (f"{codes}{pair[2]}", f"{codes}{pair[3]}")
        if (unbiased or values_unbiased) and preset == "fp4":
            raise ValueError(f"configuration {name!r}: -ku / -vu rescale TurboQuant codes, fp4 has none")
        kenc += "-unbiased" if unbiased else ""
        venc += "-unbiased" if values_unbiased else ""
        if cfg_match[9] and preset == "fp4":
            raise ValueError(f"configuration {name!r}: -t holds the newest tokens at 4-bit TurboQuant codes, fp4 has "
                             "none")
        tier = recent_tier(cfg_match[9], "tcq" if preset.startswith("tcq") else "tq", unbiased, values_unbiased)

        def make(cfg: Any) -> Any:
            if not scaled and not tier:
                return TQCache(cfg, key_encoder=kenc, value_encoder=venc, residual_length=res,
                               protected_layers=prot, center_keys=center, sink_length=sink,
                               encode_stride=ENCODE_STRIDE)
            if scaled and scaled not in CALIBRATION:
                raise RuntimeError(f"-{scaled} configurations need the key scales measured by main()")
            policy = KVPolicy.uniform(len(DynamicCache(config=cfg).layers), kenc, venc, res, prot, center)
            policy = policy.with_key_scales(CALIBRATION[scaled]) if scaled else policy
            return TQCache(cfg, policy=policy.with_recent(*tier) if tier else policy, sink_length=sink,
                           encode_stride=ENCODE_STRIDE)

        kv = f"{codes}{pair[2]} keys, {codes}{pair[3]} values" if pair else (
            "FP4-UE8M0 keys + values" if preset == "fp4" else f"{preset} keys + values")
        keys = (("centered keys" if center else "keys not centered")
                + (f", calibrated {SCALE_FORMS[scaled]}" if scaled else "")
                + (", keys scaled for unbiased inner products" if unbiased else "")
                + (", values scaled to be unbiased" if values_unbiased else ""))
        sinks = f", the first {sink} tokens never encoded" if sink else ""
        return CacheSpec(name, "tqindex",
                         f"TQCache {kv}, residual {res}, {prot}+{prot} protected layers, {keys}{sinks}"
                         f"{recent_label(tier)}", make,
                         "tqindex", preset, res, prot, key_scales=scaled)
    known = ("dynamic, fp8, fp8-tq, quanto-int{2,4}-r{N}, {" + ",".join(TQ_PRESETS) + f",[tcq]k[{TQ_BITS}]v[{TQ_BITS}]"
             + "}-r{N}-p{N}[-s{N}][-nc][-ku][-vu][-ks|-km][-t{N}], policy-b{bits}[-r{N}][-ks|-km][-vu][-tcq][-t{N}]")
    raise ValueError(f"unknown configuration {name!r}; known forms: {known}")


# ------------------------------------------------------------------------------ measurements

def forward_stream(model: Any, ids: torch.Tensor, cache: Any, prefill: int, chunk: int,
                   desc: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Feed ``ids`` [1, T] through ``cache``: ``prefill`` tokens at once, then chunks of ``chunk``.

    Returns ``(nll_parts, last_logits)``: the negative log-likelihoods (float64 [n]) of tokens
    ``ids[prefill:]``, each predicted by a position that attended to the cache, and the logits
    [vocab] after the last token.
    """
    nll: list[torch.Tensor] = []
    out = model(input_ids=ids[:, :prefill], cache=cache, use_cache=True, logits_to_keep=1)
    prev = out.logits[:, -1:]  # [1, 1, vocab] predicts ids[prefill]
    starts = range(prefill, ids.shape[1], chunk)
    for s in tqdm(starts, desc=desc, leave=False, unit="chunk", file=sys.stderr):
        piece = ids[:, s:s + chunk]  # [1, c]
        logits = model(input_ids=piece, cache=cache, use_cache=True).logits  # [1, c, vocab]
        pred = torch.cat([prev, logits[:, :-1]], dim=1)  # [1, c, vocab] predicts piece
        logp = torch.log_softmax(pred.float(), dim=-1).gather(-1, piece[..., None])[0, :, 0]
        nll.append(-logp.double())
        prev = logits[:, -1:]
    return nll, prev[0, -1]


def perplexity(model: Any, ids: torch.Tensor, cache: Any, prefill: int, chunk: int,
               desc: str) -> tuple[float, int]:
    """Streamed perplexity of ``ids[prefill:]`` -> (ppl, scored tokens)."""
    nll, _ = forward_stream(model, ids, cache, prefill, chunk, desc)
    all_nll = torch.cat(nll)
    return math.exp(all_nll.mean().item()), all_nll.numel()


def needle_prompt(tokenizer: Any, filler: str, filler_tokens: int, depth: float) -> tuple[torch.Tensor, int]:
    """Chat prompt: ``filler_tokens`` tokens of ``filler`` with :data:`NEEDLE` inserted at the paragraph
    boundary nearest to fraction ``depth``, then :data:`QUESTION`.

    Returns ``(ids [1, T], needle_token_position)``.
    """
    words = tokenizer(filler, add_special_tokens=False).input_ids[:filler_tokens]
    text = tokenizer.decode(words)
    cut = int(len(text) * depth)
    para = text.rfind("\n\n", 0, cut)
    cut = para if para > 0 else cut
    user = f"{text[:cut]}\n\n{NEEDLE}\n\n{text[cut:]}\n\n{QUESTION}"
    messages = [{"role": "user", "content": user}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    position = len(tokenizer(prompt[:prompt.index(NEEDLE)], add_special_tokens=False).input_ids)
    return ids, position


def fork_cache(cache: Any) -> Any:
    """An independent copy of ``cache``, to score a continuation without touching the original.

    quanto's quantized tensors cannot be deep-copied; transformers' quantized layers only ever
    reassign their tensors (never write into them), so those layers are copied shallowly.
    """
    from transformers.cache_utils import BaseQuantizedLayer

    if any(isinstance(layer, BaseQuantizedLayer) for layer in cache.layers):
        clone = copy.copy(cache)
        clone.layers = [copy.copy(layer) for layer in cache.layers]
        return clone
    return copy.deepcopy(cache)


def needle_answer(model: Any, tokenizer: Any, ids: torch.Tensor, cache: Any, prefill: int,
                  chunk: int, desc: str) -> tuple[str, float]:
    """Feed the prompt as in :func:`forward_stream`, then decode greedily (at most
    :data:`NEEDLE_MAX_NEW_TOKENS` tokens, stopping at end of turn).

    Returns ``(answer text, passcode probability)``; the probability is that of the passcode's tokens
    after :data:`ANSWER_PREFIX`, scored on a deep copy of the cache taken after the prompt.
    """
    _, logits = forward_stream(model, ids, cache, min(prefill, ids.shape[1] - 1), chunk, desc)
    forced = tokenizer(f"{ANSWER_PREFIX} {NEEDLE_CODE}", add_special_tokens=False, return_tensors="pt").input_ids
    prefix = tokenizer(ANSWER_PREFIX, add_special_tokens=False, return_tensors="pt").input_ids
    n_code = forced.shape[1] - prefix.shape[1]
    scored = model(input_ids=forced, cache=fork_cache(cache), use_cache=True).logits  # [1, n, vocab]
    pred = torch.cat([logits[None, None], scored[:, :-1]], dim=1)[0, -n_code:]  # [n_code, vocab]
    code_logp = torch.log_softmax(pred.float(), dim=-1).gather(-1, forced[0, -n_code:, None]).sum().item()
    stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    answer: list[int] = []
    for _ in range(NEEDLE_MAX_NEW_TOKENS):
        token = int(logits.argmax())
        if token in stop:
            break
        answer.append(token)
        logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    return tokenizer.decode(answer).strip(), math.exp(code_logp)


def _tensor_bytes(obj: Any) -> int:
    """Bytes of a tensor, a tuple of tensors or a tensor subclass (quanto) made of inner tensors."""
    if obj is None:
        return 0
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(x) for x in obj)
    if isinstance(obj, torch.Tensor) and type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(obj, n)) for n in names)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    raise TypeError(f"cannot count the bytes of {type(obj).__name__}")


def cache_memory(cache: Any, model_config: Any) -> dict[str, Any]:
    """Bytes held by ``cache`` (all layers) and of its compressed storage alone.

    Returns a dict: ``tokens``, ``bytes``, ``bytes_bf16`` (a bfloat16 DynamicCache of the same tokens),
    ``compressed_bytes`` and ``compressed_tokens`` (summed over layers: storage that is not a
    full-precision tensor, and the tokens it holds) and ``compressed_layers``.
    """
    heads = model_config.num_key_value_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    bf16_per_token_layer = 2 * 2 * heads * head_dim  # K and V, 2 bytes each
    held = dense = comp_bytes = comp_tokens = comp_layers = 0
    tokens = cache.get_seq_length()
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):  # tqindex's layers (TQLayer, FP8Layer) count their own bytes
            held += layer.nbytes()
            dense += layer.nbytes_dense()
            codes, n = (layer.nbytes_compressed() if isinstance(layer, TQLayer)
                        else (layer.nbytes(), layer.get_seq_length()))
            if n:
                comp_bytes += codes
                comp_tokens += n
                comp_layers += 1
            continue
        residual = _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(getattr(layer, "values", None))
        quantized = (_tensor_bytes(getattr(layer, "_quantized_keys", None))
                     + _tensor_bytes(getattr(layer, "_quantized_values", None)))
        n = layer.get_seq_length()
        held += residual + quantized
        dense += bf16_per_token_layer * n
        if quantized:
            keys = getattr(layer, "keys", None)
            window = keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
            comp_bytes += quantized
            comp_tokens += n - window
            comp_layers += 1
    return {"tokens": tokens, "bytes": held, "bytes_bf16": dense, "compressed_bytes": comp_bytes,
            "compressed_tokens": comp_tokens, "compressed_layers": comp_layers,
            "bf16_bytes_per_token_layer": bf16_per_token_layer}


# ------------------------------------------------------------------------------ rows and report

def run_config(spec: CacheSpec, model: Any, tokenizer: Any, texts: dict[str, torch.Tensor],
               needle_ids: torch.Tensor | None, args: argparse.Namespace) -> dict[str, Any]:
    """Perplexity on every text, memory (after the first text) and needle for one configuration -> a result
    row (without the comparisons to other rows)."""
    model.set_attn_implementation(spec.attn_implementation)
    t0 = time.perf_counter()
    ppl, mem = {}, None
    for label, ids in texts.items():
        cache = spec.make(model.config)
        with torch.inference_mode():
            ppl[label], scored = perplexity(model, ids, cache, args.prefill, args.chunk, f"{spec.name} {label}")
        mem = mem or cache_memory(cache, model.config)
        del cache
    cfg = model.config
    elements = mem["tokens"] * cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    row: dict[str, Any] = {
        "config": spec.name, "family": spec.family, "description": spec.description,
        "preset": spec.preset, "residual_length": spec.residual_length,
        "protected_layers": spec.protected_layers, "budget_bits": spec.budget_bits,
        "attn_implementation": spec.attn_implementation, "ppl": ppl, "scored_tokens": scored,
        "ppl_time_s": round(time.perf_counter() - t0, 2),
        "bytes_per_token": mem["bytes"] / mem["tokens"], "bits_per_element": 8 * mem["bytes"] / elements,
        "bytes_per_token_bf16": mem["bytes_bf16"] / mem["tokens"],
        "compression_ratio": mem["bytes_bf16"] / mem["bytes"],
        "compressed_layer_ratio": (mem["bf16_bytes_per_token_layer"] * mem["compressed_tokens"]
                                   / mem["compressed_bytes"] if mem["compressed_bytes"] else None),
        "memory": mem,
    }
    if needle_ids is not None:
        t1 = time.perf_counter()
        cache = spec.make(model.config)
        with torch.inference_mode():
            answer, code_prob = needle_answer(model, tokenizer, needle_ids, cache,
                                              needle_ids.shape[1] - args.needle_streamed, args.chunk,
                                              f"{spec.name} needle")
        row.update(needle_found=NEEDLE_CODE in answer, needle_answer=answer, needle_code_prob=code_prob,
                   needle_time_s=round(time.perf_counter() - t1, 2))
        del cache
    else:
        row.update(needle_found=None, needle_answer=None, needle_code_prob=None, needle_time_s=None)
    row["time_s"] = round(time.perf_counter() - t0, 2)
    return row


def compare(rows: list[dict[str, Any]]) -> None:
    """Add to every row its perplexity increase over ``dynamic`` per text (``ppl_increase_pct``), the worst
    of them (``worst_increase_pct``) and its bytes against the ``fp8`` row's (``bytes_vs_fp8``)."""
    ref = next(r for r in rows if r["config"] == "dynamic")
    fp8 = next((r for r in rows if r["config"] == "fp8"), None)
    for r in rows:
        r["ppl_increase_pct"] = {t: 100.0 * (p / ref["ppl"][t] - 1.0) for t, p in r["ppl"].items()}
        r["worst_increase_pct"] = max(r["ppl_increase_pct"].values())
        r["bytes_vs_fp8"] = r["bytes_per_token"] / fp8["bytes_per_token"] if fp8 else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets of real decoding (module notes) and which rows meet them."""
    by = {r["config"]: r for r in rows}
    fp8 = by.get("fp8")
    out: dict[str, Any] = {}
    bare = [r for r in rows if r["family"] == "tqindex" and r["residual_length"] == 0 and r["protected_layers"] == 0]
    if fp8 and bare:  # the best of the rows at half fp8's bytes or less, else the best of all
        small = [r for r in bare if r["bytes_vs_fp8"] <= 0.5]
        row = min(small or bare, key=lambda r: r["worst_increase_pct"])
        better = all(row["ppl_increase_pct"][t] <= fp8["ppl_increase_pct"][t] for t in row["ppl"])
        out["half_fp8_bytes"] = {"row": row["config"], "ppl_at_most_fp8": better, "bytes_vs_fp8": row["bytes_vs_fp8"],
                                 "met": better and row["bytes_vs_fp8"] <= 0.5}
    for key, bits, limit in (("at_3.25_bits", 3.25, 1.0), ("at_2.5_bits", 2.5, 5.0)):
        fit = [r for r in rows if r["family"] == "tqindex" and r["bits_per_element"] <= bits]
        best = min(fit, key=lambda r: r["worst_increase_pct"], default=None)
        out[key] = {"bits": bits, "limit_pct": limit, "best_row": best and best["config"],
                    "best_worst_increase_pct": best and best["worst_increase_pct"],
                    "met": best is not None and best["worst_increase_pct"] <= limit}
    needle = [r for r in rows if r["family"] == "tqindex" and r["bits_per_element"] >= NEEDLE_BITS
              and r["needle_found"] is not None]
    out["needle"] = {"checked": [r["config"] for r in needle],
                     "failed": [r["config"] for r in needle if not r["needle_found"]],
                     "met": all(r["needle_found"] for r in needle)}
    return out


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown report: setup, one table row per configuration, targets."""
    env, a = result["env"], result["args"]
    labels = list(result["texts"])
    protocol = ("token by token (real decoding)" if a["chunk"] == 1 else
                f"in chunks of {a['chunk']} tokens (each chunk attends to itself in full precision: not real "
                "decoding)")
    needle = result["needle"]
    lines = [
        f"# KV-cache quality: {result['model']['name']} on CPU",
        "",
        f"Perplexity over {a['tokens']} tokens of each text ({', '.join(labels)}: "
        + "; ".join(f"{t}: {', '.join(info['topics'])}" for t, info in result["texts"].items())
        + f"), the first {a['prefill']} prefilled, the {result['rows'][0]['scored_tokens']} others scored "
        f"{protocol}. Needle: passcode at token {needle['position'] if needle else '-'} of a "
        f"{needle['prompt_tokens'] if needle else '-'}-token chat prompt, its last {a['needle_streamed']} tokens "
        f"fed one by one, greedy answer; p(code) = probability of the passcode after {ANSWER_PREFIX!r}. Bytes "
        "held at the end of the first text (codes, scales, windows, key offsets, full-precision layers; the "
        "model runs in float32, so windows and full-precision layers hold 4 bytes per element); bits per "
        "key/value element; x bf16 = a bfloat16 DynamicCache's bytes over the row's; vs fp8 = the row's bytes "
        "over the fp8 row's.",
        "",
        f"git {env['git_sha'][:12] if env['git_sha'] else '?'}{' (dirty)' if env['git_dirty'] else ''}, "
        f"torch {env['versions']['torch']}, transformers {env['versions']['transformers']}, "
        f"{env['cpu']} ({env['threads']} thread), total {result['total_time_s']:.0f} s"
        + (f" ({len(result['merged_from'])} runs of disjoint configurations side by side, merged)."
           if result.get("merged_from") else "."),
        "",
        "| config | bits/elem | B/token | x bf16 | vs fp8 | " + " | ".join(f"ΔPPL % {t}" for t in labels)
        + " | needle | p(code) | time s |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(labels) + ":---:|---:|---:|",
    ]
    for r in result["rows"]:
        found = "-" if r["needle_found"] is None else ("yes" if r["needle_found"] else f"no ({r['needle_answer']!r})")
        lines.append(
            f"| {r['config']} | {r['bits_per_element']:.2f} | {r['bytes_per_token']:.0f} | "
            f"{r['compression_ratio']:.2f} | {_fmt(r['bytes_vs_fp8'], '.2f')} | "
            + " | ".join(f"{r['ppl_increase_pct'][t]:+.2f}" for t in labels)
            + f" | {found} | {_fmt(r['needle_code_prob'], '.3f')} | {r['time_s']:.0f} |")
    lines += ["", "Configurations:", ""]
    lines += [f"- `{r['config']}`: {r['description']}" for r in result["rows"]]
    s = result["summary"]
    lines += ["", "Targets (every text):", ""]
    if "half_fp8_bytes" in s:
        t = s["half_fp8_bytes"]
        lines.append(f"- no window (sink tokens aside) and no full-precision layer, at half fp8's bytes or less "
                     f"(4 bits per element): perplexity increase at most fp8's (best `{t['row']}`: "
                     f"{'yes' if t['ppl_at_most_fp8'] else 'no'}, at {t['bytes_vs_fp8']:.2f} of its bytes): "
                     f"{'met' if t['met'] else 'not met'}")
    for key in ("at_3.25_bits", "at_2.5_bits"):
        t = s[key]
        best = (f"best `{t['best_row']}`, {t['best_worst_increase_pct']:+.2f} %" if t["best_row"]
                else "no row that small")
        lines.append(f"- at most {t['bits']:g} bits per element: increase <= {t['limit_pct']:g} % "
                     f"({best}): {'met' if t['met'] else 'not met'}")
    t = s["needle"]
    lines.append(f"- needle found by every configuration of >= {NEEDLE_BITS:g} bits per element: "
                 + ("met" if t["met"] else f"not met by {', '.join(t['failed'])}")
                 + f" ({len(t['checked'])} rows checked)")
    if result.get("calibration"):
        c = result["calibration"]
        what = "Policies" if c["policies"] else "Key scales"
        scored = f", the last {c['scored']} scored" if c["policies"] and c.get("scored") else ""
        lines += ["", f"{what} calibrated on {c['text']['topics']} ({c['tokens']} tokens{scored}, "
                      f"{c['time_s']:.0f} s)" + (f"; key scales on its first {c['scale_tokens']} tokens"
                                                 if c.get("key_scales") and "scale_tokens" in c else "")
                  + ("; layer by layer:" if c["policies"] else "."), ""]
        for name, policy in c["policies"].items():
            lines += [f"`{name}` ({policy['bits']:.2f} bits per element at {c['context_tokens']} tokens):", "",
                      "```", policy["describe"], "```", ""]
    lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 384 tokens, prefill 320, 256-token needle, configs " + " ".join(QUICK_CONFIGS))
    p.add_argument("--configs", nargs="+", default=None,
                   help="configuration names (default: the full list, see the module docstring)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of each text (prefill + scored)")
    p.add_argument("--prefill", type=int, default=1024, help="tokens fed at once before decoding")
    p.add_argument("--chunk", type=int, default=1, help="tokens per forward pass after the prefill (1: real "
                   "decoding)")
    p.add_argument("--needle-tokens", type=int, default=1600, help="filler tokens of the needle prompt (0: skip)")
    p.add_argument("--needle-depth", type=float, default=0.1, help="needle position as a fraction of the filler")
    p.add_argument("--needle-streamed", type=int, default=64, help="last tokens of the needle prompt fed one "
                   "by one (in --chunk pieces)")
    p.add_argument("--calibration-tokens", type=int, default=448, help="tokens of the calibration text "
                   "(prefix + scored)")
    p.add_argument("--calibration-scored", type=int, default=64, help="tokens of the calibration text a policy's "
                   "measurement predicts, one at a time (the others are its prefix)")
    p.add_argument("--scale-tokens", type=int, default=None, help="tokens of the calibration text key scales "
                   "(-ks, -km) are measured on (default: --calibration-tokens)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 is much faster than 2 on a loaded 2-core machine)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output path without suffix (default: {DEFAULT_OUT.relative_to(ROOT)} for full "
                        "runs; --quick writes nothing unless given)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prefill, args.needle_tokens = 384, 320, 256
        args.configs = args.configs or list(QUICK_CONFIGS)
    args.configs = args.configs or list(DEFAULT_CONFIGS)
    if args.out is None and not args.quick:
        args.out = DEFAULT_OUT
    if not 0 < args.prefill < args.tokens:
        p.error(f"--prefill must be in (0, --tokens={args.tokens}), got {args.prefill}")
    if args.chunk < 1:
        p.error(f"--chunk must be >= 1, got {args.chunk}")
    if not 0.0 <= args.needle_depth <= 1.0:
        p.error(f"--needle-depth must be in [0, 1], got {args.needle_depth}")
    if args.needle_streamed < 1:
        p.error(f"--needle-streamed must be >= 1, got {args.needle_streamed}")
    args.scale_tokens = args.scale_tokens or args.calibration_tokens
    if args.scale_tokens < 2:
        p.error(f"--scale-tokens must be >= 2, got {args.scale_tokens}")
    if not 0 < args.calibration_scored < args.calibration_tokens:
        p.error(f"--calibration-scored must be in (0, --calibration-tokens={args.calibration_tokens}), "
                f"got {args.calibration_scored}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the markdown table; write ``--out``.json/.md if set. -> the result."""
    from tqindex.kv import key_scales, measure_sensitivity, sensitivity_template

    args = parse_args(argv)
    specs = [cache_spec(name) for name in ["dynamic", *(c for c in args.configs if c != "dynamic")]]  # the
    # reference first; a bad name fails here
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    env = environment(args.threads)  # tqindex is imported already: the sources digest is of the code that runs
    model, tokenizer, model_info = _lm.load_model()
    sources = {"A": (_lm.reference_text(), _lm.PPL_TOPICS), "B": (_lm.second_text(), _lm.SECOND_TOPICS)}
    texts, text_info = {}, {}
    for label, (text, topics) in sources.items():
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :args.tokens]
        if ids.shape[1] < args.tokens:
            raise ValueError(f"text {label} has only {ids.shape[1]} tokens, --tokens asks for {args.tokens}")
        texts[label], text_info[label] = ids, _lm.text_info(text, topics)
    needle_ids, needle = None, None
    if args.needle_tokens > 0:
        needle_ids, position = needle_prompt(tokenizer, _lm.filler_text(), args.needle_tokens, args.needle_depth)
        needle = {"sentence": NEEDLE, "question": QUESTION, "position": position,
                  "prompt_tokens": needle_ids.shape[1], "filler": _lm.text_info(_lm.filler_text(), _lm.FILLER_TOPICS)}
    for spec in specs:  # a budget below its cheapest choice fails now, not after the calibration
        if spec.budget_bits is not None:
            try:
                spec.policy(sensitivity_template(model, residual_length=spec.residual_length,
                                                 unbiased_values=spec.values_unbiased, codes=spec.codes), args.tokens)
            except ValueError as e:
                raise SystemExit(f"{spec.name}: {e} at {args.tokens} tokens of context") from None
    calibration = None
    if any(spec.budget_bits is not None or spec.key_scales for spec in specs):
        t1 = time.perf_counter()
        text = _lm.calibration_text()
        text_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        ids, scale_ids = text_ids[:, :args.calibration_tokens], text_ids[:, :args.scale_tokens]
        CALIBRATION.update({form: key_scales(model, scale_ids, per_channel=form == "ks", context_tokens=args.tokens)
                            for form in {s.key_scales for s in specs} - {""}}, context_tokens=args.tokens)
        for scaled, window, unbiased, codes in sorted({(s.key_scales, s.residual_length, s.values_unbiased, s.codes)
                                                       for s in specs if s.budget_bits is not None}):
            CALIBRATION[sensitivity_name(scaled, window, unbiased, codes)] = measure_sensitivity(
                model, ids, prefix=ids.shape[1] - args.calibration_scored, scored=args.calibration_scored,
                key_scales=CALIBRATION[scaled] if scaled else None, residual_length=window,
                unbiased_values=unbiased, codes=codes)
        policies = {spec.name: spec.policy(CALIBRATION[sensitivity_name(spec.key_scales, spec.residual_length,
                                                                        spec.values_unbiased, spec.codes)],
                                           args.tokens)
                    for spec in specs if spec.budget_bits is not None}
        calibration = {"text": _lm.text_info(text, _lm.CALIBRATION_TOPICS), "tokens": ids.shape[1],
                       "scored": args.calibration_scored,
                       "context_tokens": args.tokens, "time_s": time.perf_counter() - t1,
                       **{m: v.to_dict() for m, v in CALIBRATION.items() if m.startswith("sensitivity")},
                       "key_scales": {form: _digest(CALIBRATION[form]) for form in SCALE_FORMS if form in CALIBRATION},
                       "scale_tokens": scale_ids.shape[1],
                       "policies": {name: {"bits": p.calibration["bits"], "predicted_kl": p.calibration["predicted_kl"],
                                           "describe": p.describe(), "policy": p.to_dict()}
                                    for name, p in policies.items()}}

    result = {
        "benchmark": "kv_quality", "env": env,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": model_info, "texts": text_info, "needle": needle, "calibration": calibration, "rows": [],
    }
    for spec in tqdm(specs, desc="configs", unit="config", file=sys.stderr):
        result["rows"].append(run_config(spec, model, tokenizer, texts, needle_ids, args))
        result["total_time_s"] = round(time.perf_counter() - t0, 1)
        report = write(result, args.out)  # after every configuration: an interrupted run keeps what it measured
    print(report)
    return result


def _digest(scales: list[Any]) -> dict[str, Any]:
    """Key scales as the JSON records them (the matrices would take megabytes; main() computes them again from
    the model and the calibration text): per layer the shape or None, and the SHA-256 of their float32 bytes."""
    h = hashlib.sha256()
    for t in scales:
        if t is not None:
            h.update(t.float().contiguous().numpy().tobytes())
    return {"shapes": [None if t is None else list(t.shape) for t in scales], "sha256": h.hexdigest()}


def _without_scales(calibration: dict[str, Any] | None) -> dict[str, Any] | None:
    """The calibration record with the key scales of its sensitivities and policies left out (see :func:`_digest`):
    a policy layer's ``key_scale`` becomes True, a sensitivity's ``key_scales`` None."""
    if calibration is None:
        return None

    def sensitivity(entry: dict[str, Any]) -> dict[str, Any]:
        return {**entry, "key_scales": None} if entry.get("key_scales") else entry

    def policy(entry: dict[str, Any]) -> dict[str, Any]:
        layers = [{**layer, "key_scale": True} if "key_scale" in layer else layer for layer in entry["layers"]]
        inner = entry.get("calibration", {})
        inner = {**inner, "sensitivity": sensitivity(inner["sensitivity"])} if "sensitivity" in inner else inner
        return {**entry, "layers": layers, "calibration": inner}

    return {**{k: sensitivity(v) if k.startswith("sensitivity") else v for k, v in calibration.items()},
            "policies": {name: {**p, "policy": policy(p["policy"])} for name, p in calibration["policies"].items()}}


def write(result: dict[str, Any], out: Path | None) -> str:
    """Compare the rows, summarize, write ``out``.json/.md if given. -> the markdown report."""
    compare(result["rows"])
    result["summary"] = summarize(result["rows"])
    report = markdown(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {**result, "calibration": _without_scales(result.get("calibration"))}
        out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
        out.with_suffix(".md").write_text(report)
    return report


def merge(paths: list[Path], out: Path) -> dict[str, Any]:
    """One result from runs of disjoint configurations at the same code and settings (e.g. run side by side
    on two cores): their rows (each configuration once, ``dynamic`` from the first), written to ``out``."""
    runs = [json.loads(p.read_text()) for p in paths]
    first = runs[0]
    same = ("git_sha", "git_dirty", "tqindex_sources_sha256", "benchmarks_sources_sha256")
    settings = [k for k in first["args"] if k not in ("configs", "out", "merge")]
    for path, run in zip(paths[1:], runs[1:]):
        if any(run["env"].get(k) != first["env"].get(k) for k in same) or \
                any(run["args"].get(k) != first["args"].get(k) for k in settings):
            raise SystemExit(f"{path} ran at other code or settings than {paths[0]}: not merged")
    rows, seen = [], set()
    for run in runs:
        rows += [r for r in run["rows"] if r["config"] not in seen]
        seen |= {r["config"] for r in run["rows"]}
    calibrations = [r["calibration"] for r in runs if r.get("calibration")]
    calibration = None
    if calibrations:  # the same text and settings: every run's policies and measurements, their times summed
        calibration = {**calibrations[0], "time_s": sum(c["time_s"] for c in calibrations),
                       "policies": {name: p for c in calibrations for name, p in c["policies"].items()}}
        for c in calibrations[1:]:
            calibration.update({k: v for k, v in c.items() if k.startswith("sensitivity") and k not in calibration})
    result = {**first, "rows": rows, "merged_from": [str(p) for p in paths], "calibration": calibration,
              "total_time_s": max(r["total_time_s"] for r in runs)}
    result["args"] = {**first["args"], "configs": [r["config"] for r in rows], "out": str(out)}
    print(write(result, out))
    return result

if __name__ == "__main__":
    if sys.argv[1:2] == ["--merge"]:
        *parts, target = sys.argv[2:]
        merge([Path(p) for p in parts], Path(target))
    else:
        main()
