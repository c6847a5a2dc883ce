"""KV-cache quality on a real causal LM: streamed perplexity, needle retrieval and bytes per token.

Model: SmolLM2-135M-Instruct (30 layers, 3 KV heads, head_dim 64, float32 weights), see ``_lm.py``.
Every configuration is one transformers ``Cache``; the model and the token stream are the same for all.

- **Streamed perplexity**: the first ``--prefill`` tokens of the text go in one forward pass, the rest
  in chunks of ``--chunk`` tokens through the cache (``model(input_ids=chunk, cache=cache)``), so every
  scored prediction attends to the cache's (compressed) history; the ``--tokens - --prefill`` tokens
  after the prefill are scored. Reported: PPL and its relative increase over ``DynamicCache``.
- **Needle**: a passcode sentence placed early in ``--needle-tokens`` tokens of other text, asked for
  at the end through the chat template. The prompt is fed as above (prefill, then chunks), so the
  question attends to the compressed needle; the greedy answer (up to 24 tokens) must contain it.
  ``needle_code_prob`` is a continuous companion: the probability of the passcode's digits after the
  prompt and the answer prefix "The secret passcode is" (teacher-forced, on a copy of the cache).
- **Memory**: bytes the cache holds at the end of the perplexity run, over all layers, per token, and
  the ratio to a bfloat16 ``DynamicCache`` of the same tokens; ``compressed_layer_ratio`` is the same
  ratio for the compressed storage alone (codes and their scales/norms; no window, no protected layer).
  The model runs in float32, so full-precision windows and protected layers hold 4 bytes per element.

Configurations: ``dynamic`` (float32 ``DynamicCache``, the reference); transformers' ``QuantizedCache``
with the ``fp8`` backend (E4M3, one scale per tensor frozen at the prefill) and the ``quanto``
backend (int4 / int2, groups of 64 along head_dim, residual window 128); tqindex ``TQCache`` presets
tq2 / tq3 / tq4 (TurboQuant keys and values at 2 / 3 / 4 bits), k8v4, k3v4 (8- or 3-bit keys, 4-bit
values) and fp4 (FP4-UE8M0), named ``{preset}-r{residual_length}-p{protected_layers}``; tqindex runs
use the ``"tqindex"`` attention implementation (attention computed from the codes).

Usage::

    python benchmarks/kv_quality.py --quick          # smoke run, ~30 s once the model is cached
    python benchmarks/kv_quality.py                  # full run (~20 min on 2 CPU cores), writes
                                                     # benchmarks/results/kv_quality_smollm2_cpu.{json,md}
    python benchmarks/kv_quality.py --configs dynamic tq4-r128-p2 k3v4-r0-p2 --out /tmp/x
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from tqindex.kv import TQCache, TQLayer  # also registers the "tqindex" attention with transformers

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

TQ_PRESETS = ("tq2", "tq3", "tq4", "k8v4", "k3v4", "fp4")
# Targets: relative PPL increase (percent) by preset; the 2-bit one only with a residual window.
PPL_TARGET_PCT = {"tq4": 1.0, "k8v4": 1.0, "fp4": 1.0, "tq3": 4.0, "k3v4": 4.0, "tq2": 25.0}
RATIO_TARGET = 3.7  # compressed layers vs bfloat16, for presets of at most ~4 bits per element
NEEDLE_REQUIRED = ("tq4", "k8v4", "fp4", "tq3", "k3v4")  # every 3- and 4-bit configuration

DEFAULT_CONFIGS = (
    "dynamic", "fp8", "quanto-int4-r128", "quanto-int2-r128",
    *(f"{p}-r128-p2" for p in TQ_PRESETS),
    *(f"{p}-r0-p0" for p in TQ_PRESETS),
    "tq2-r128-p0", "tq2-r0-p2",
)
QUICK_CONFIGS = ("dynamic", "tq4-r128-p2")


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


def cache_spec(name: str) -> CacheSpec:
    """Parse a configuration name (see the module docstring) into a :class:`CacheSpec`.

    Raises:
        ValueError: unknown name.
    """
    from transformers import DynamicCache, QuantizedCache

    if name == "dynamic":
        return CacheSpec(name, "reference", "DynamicCache, float32 (full precision)",
                         lambda cfg: DynamicCache(config=cfg))
    if name == "fp8":
        return CacheSpec(name, "transformers",
                         "QuantizedCache fp8: E4M3, one scale per tensor frozen at the prefill",
                         lambda cfg: QuantizedCache("fp8", cfg))
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
    parts = name.split("-")
    if (len(parts) == 3 and parts[0] in TQ_PRESETS and parts[1][:1] == "r" and parts[2][:1] == "p"
            and parts[1][1:].isdigit() and parts[2][1:].isdigit()):
        preset, res, prot = parts[0], int(parts[1][1:]), int(parts[2][1:])

        def make(cfg: Any) -> Any:
            if preset.startswith("tq"):
                return TQCache(cfg, key_encoder=preset, value_encoder=preset,
                               residual_length=res, protected_layers=prot)
            return TQCache.preset(cfg, preset, residual_length=res, protected_layers=prot)

        kv = {"tq2": "tq2 keys + values", "tq3": "tq3 keys + values", "tq4": "tq4 keys + values",
              "k8v4": "tq8 keys, tq4 values", "k3v4": "tq3 keys, tq4 values",
              "fp4": "FP4-UE8M0 keys + values"}[preset]
        return CacheSpec(name, "tqindex", f"TQCache {kv}, residual {res}, {prot}+{prot} protected layers",
                         make, "tqindex", preset, res, prot)
    known = "dynamic, fp8, quanto-int{2,4}-r{N}, {" + ",".join(TQ_PRESETS) + "}-r{N}-p{N}"
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
    n_code = forced.shape[1] - tokenizer(ANSWER_PREFIX, add_special_tokens=False, return_tensors="pt").input_ids.shape[1]
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
        if isinstance(layer, TQLayer):
            held += layer.nbytes()
            dense += layer.nbytes_dense()
            codes, n = layer.nbytes_compressed()
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

def targets(spec: CacheSpec, ppl_pct: float, ratio: float | None, found: bool | None) -> dict[str, Any]:
    """The project's quality targets that apply to ``spec`` and whether each is met."""
    out: dict[str, Any] = {}
    if spec.family != "tqindex":
        return out
    limit = PPL_TARGET_PCT[spec.preset]
    if spec.preset != "tq2" or spec.residual_length:
        out["ppl_increase_max_pct"] = limit
        out["ppl_met"] = ppl_pct <= limit
    if spec.preset != "k8v4" and ratio is not None:
        out["compressed_ratio_min"] = RATIO_TARGET
        out["ratio_met"] = ratio >= RATIO_TARGET
    if spec.preset in NEEDLE_REQUIRED and found is not None:
        out["needle_met"] = found
    return out


def run_config(spec: CacheSpec, model: Any, tokenizer: Any, ids: torch.Tensor,
               needle_ids: torch.Tensor | None, args: argparse.Namespace) -> dict[str, Any]:
    """Perplexity, memory and needle for one configuration -> a result row (without the ratios to
    the reference)."""
    model.set_attn_implementation(spec.attn_implementation)
    t0 = time.perf_counter()
    cache = spec.make(model.config)
    with torch.inference_mode():
        ppl, scored = perplexity(model, ids, cache, args.prefill, args.chunk, f"{spec.name} ppl")
    ppl_s = time.perf_counter() - t0
    mem = cache_memory(cache, model.config)
    del cache
    row: dict[str, Any] = {
        "config": spec.name, "family": spec.family, "description": spec.description,
        "preset": spec.preset, "residual_length": spec.residual_length,
        "protected_layers": spec.protected_layers, "attn_implementation": spec.attn_implementation,
        "ppl": ppl, "scored_tokens": scored, "ppl_time_s": round(ppl_s, 2),
        "bytes_per_token": mem["bytes"] / mem["tokens"],
        "bytes_per_token_bf16": mem["bytes_bf16"] / mem["tokens"],
        "compression_ratio": mem["bytes_bf16"] / mem["bytes"],
        "compressed_bytes_per_token_layer": (mem["compressed_bytes"] / mem["compressed_tokens"]
                                             if mem["compressed_tokens"] else None),
        "compressed_layer_ratio": (mem["bf16_bytes_per_token_layer"] * mem["compressed_tokens"]
                                   / mem["compressed_bytes"] if mem["compressed_bytes"] else None),
        "memory": mem,
    }
    if needle_ids is not None:
        t1 = time.perf_counter()
        cache = spec.make(model.config)
        with torch.inference_mode():
            answer, code_prob = needle_answer(model, tokenizer, needle_ids, cache, args.prefill, args.chunk,
                                   f"{spec.name} needle")
        row.update(needle_found=NEEDLE_CODE in answer, needle_answer=answer, needle_code_prob=code_prob,
                   needle_time_s=round(time.perf_counter() - t1, 2))
        del cache
    else:
        row.update(needle_found=None, needle_answer=None, needle_code_prob=None, needle_time_s=None)
    row["time_s"] = round(time.perf_counter() - t0, 2)
    return row


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown report: setup, one table row per configuration, targets."""
    env, a = result["env"], result["args"]
    lines = [
        f"# KV-cache quality: {result['model']['name']} on CPU",
        "",
        f"Streamed perplexity over {a['tokens']} tokens of {result['text']['source']} "
        f"(prefill {a['prefill']}, then chunks of {a['chunk']}; {result['rows'][0]['scored_tokens']} "
        f"scored tokens). Needle: passcode at token {result['needle']['position'] if result['needle'] else '-'} "
        f"of a {result['needle']['prompt_tokens'] if result['needle'] else '-'}-token chat prompt, "
        "fed the same way, greedy answer; p(code) = probability of the passcode after the answer prefix "
        f"{ANSWER_PREFIX!r}. Memory at the end of the perplexity run; ratios vs a bfloat16 "
        "DynamicCache (the model runs in float32, so full-precision windows and protected layers hold "
        "4 bytes per element). `comp. ratio` = compressed storage alone (no window, no protected layer).",
        "",
        f"git {env['git_sha'][:12] if env['git_sha'] else '?'}{' (dirty)' if env['git_dirty'] else ''}, "
        f"torch {env['versions']['torch']}, transformers {env['versions']['transformers']}, "
        f"{env['cpu']} ({env['threads']} thread), total {result['total_time_s']:.0f} s.",
        "",
        "| config | PPL | ΔPPL % | needle | p(code) | B/token | ratio vs bf16 | comp. B/token/layer | comp. ratio "
        "| time s | targets |",
        "|---|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        needle = "-" if r["needle_found"] is None else ("yes" if r["needle_found"] else f"no ({r['needle_answer']!r})")
        t = r["targets"]
        marks = []
        if "ppl_met" in t:
            marks.append(f"PPL≤{t['ppl_increase_max_pct']:g}% {'✓' if t['ppl_met'] else '✗'}")
        if "ratio_met" in t:
            marks.append(f"ratio≥{t['compressed_ratio_min']:g} {'✓' if t['ratio_met'] else '✗'}")
        if "needle_met" in t:
            marks.append(f"needle {'✓' if t['needle_met'] else '✗'}")
        lines.append(
            f"| {r['config']} | {r['ppl']:.3f} | {r['ppl_increase_pct']:+.2f} | {needle} | {_fmt(r['needle_code_prob'], '.3f')} "
            f"| {r['bytes_per_token']:.0f} | {r['compression_ratio']:.2f} "
            f"| {_fmt(r['compressed_bytes_per_token_layer'], '.1f')} | {_fmt(r['compressed_layer_ratio'], '.2f')} "
            f"| {r['time_s']:.0f} | {', '.join(marks)} |")
    lines += ["", "Configurations:", ""]
    lines += [f"- `{r['config']}`: {r['description']}" for r in result["rows"]]
    s = result["summary"]
    lines += ["", "Targets:", ""]
    for key, label in (("ppl", "PPL increase (4-bit <= 1 %, 3-bit <= 4 %, 2-bit with window <= 25 %)"),
                       ("ratio", f"compressed layers >= {RATIO_TARGET}x smaller than bf16 (<= 4.25-bit presets)"),
                       ("needle", "needle found by every 3- and 4-bit configuration")):
        item = s[key]
        status = "met" if item["met"] else f"not met by {', '.join(item['failed'])}"
        lines.append(f"- {label}: {status} ({item['checked']} rows checked)")
    lines.append("")
    return "\n".join(lines)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per target: rows checked, rows failing, met."""
    out = {}
    for key in ("ppl", "ratio", "needle"):
        checked = [r for r in rows if f"{key}_met" in r["targets"]]
        failed = [r["config"] for r in checked if not r["targets"][f"{key}_met"]]
        out[key] = {"checked": len(checked), "failed": failed, "met": not failed}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 384 tokens, prefill 128, 256-token needle, configs " + " ".join(QUICK_CONFIGS))
    p.add_argument("--configs", nargs="+", default=None,
                   help="configuration names (default: the full list, see the module docstring)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of text (prefill + scored)")
    p.add_argument("--prefill", type=int, default=512, help="tokens fed at once before streaming")
    p.add_argument("--chunk", type=int, default=64, help="tokens per streamed forward pass")
    p.add_argument("--needle-tokens", type=int, default=1600, help="filler tokens of the needle prompt (0: skip)")
    p.add_argument("--needle-depth", type=float, default=0.1, help="needle position as a fraction of the filler")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 is much faster than 2 on a loaded 2-core machine)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output path without suffix (default: {DEFAULT_OUT.relative_to(ROOT)} for full "
                        "runs; --quick writes nothing unless given)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prefill, args.needle_tokens = 384, 128, 256
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
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the markdown table; write ``--out``.json/.md if set. -> the result."""
    args = parse_args(argv)
    specs = [cache_spec(name) for name in args.configs]  # fail early on a bad name
    if "dynamic" not in args.configs:
        specs.insert(0, cache_spec("dynamic"))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    env = environment(args.threads)  # tqindex is imported already: the sources digest is of the code that runs
    model, tokenizer, model_info = _lm.load_model()
    text = _lm.reference_text()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :args.tokens]
    if ids.shape[1] < args.tokens:
        raise ValueError(f"the text has only {ids.shape[1]} tokens, --tokens asks for {args.tokens}")
    needle_ids, needle = None, None
    if args.needle_tokens > 0:
        needle_ids, position = needle_prompt(tokenizer, _lm.filler_text(), args.needle_tokens, args.needle_depth)
        needle = {"sentence": NEEDLE, "question": QUESTION, "position": position,
                  "prompt_tokens": needle_ids.shape[1], "filler": _lm.text_info(_lm.filler_text(), _lm.FILLER_TOPICS)}

    rows = []
    for spec in tqdm(specs, desc="configs", unit="config", file=sys.stderr):
        rows.append(run_config(spec, model, tokenizer, ids, needle_ids, args))
    ref = next(r for r in rows if r["config"] == "dynamic")
    for r in rows:
        r["ppl_increase_pct"] = 100.0 * (r["ppl"] / ref["ppl"] - 1.0)
        r["targets"] = targets(cache_spec(r["config"]), r["ppl_increase_pct"], r["compressed_layer_ratio"],
                               r["needle_found"])
    result = {
        "benchmark": "kv_quality", "env": env,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": model_info, "text": _lm.text_info(text, _lm.PPL_TOPICS), "needle": needle,
        "rows": rows, "summary": summarize(rows), "total_time_s": round(time.perf_counter() - t0, 1),
    }
    report = markdown(result)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(report)
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
