#!/usr/bin/env python
"""Attention from codes on a GPU: the Triton kernel against bf16 SDPA, and TQCache against DynamicCache.

Every number comes from one run on one GPU:

- the card's streaming-read roofline, measured in the same run;
- kernel level (one decode step of one layer): batch {1, 8, 32} x context {4k, 16k, 64k, 128k} x heads
  (32 query / 8 KV heads, head_dim 128) and (9 / 3, head_dim 64): bf16 SDPA (flash backend, GQA),
  "dequantize the codes, then SDPA", and the library's kernels (backend "auto": for tq4 codes the CUDA C++
  kernel, for the others the Triton one) for tq4, tq3, k8v4 and fp4 codes, and the Triton kernel alone for tq4
  ("tq4 (Triton)"); TB/s of the
  bytes each reads (bf16 K/V, or codes with their scales) against the roofline, and the kernel's error
  against float32 attention over the decoded codes; each call timed alone (CUDA events around one call
  after the previous one finished: the host's launch time included) and as GPU time (the call replayed
  from a CUDA graph, L2 flushed before each replay: ``_gpu.gpu_time``);
- end to end, a randomly initialized Llama-8B-shaped model (32 layers, bf16): decode step time (CUDA
  events around 32 consecutive one-token steps after 16 warm-up steps, their mean: the cache grows as in
  real decoding, TQCache's layers encode the tokens that leave their windows in these steps, then it is
  cropped back) and peak memory
  of DynamicCache against TQCache presets at 8k-64k context and batch 1-32, the cache filled by a real
  chunked prefill (4096 tokens a chunk; its time reported) where ``--prefill`` allows, else by writing
  random keys and values into every layer (decode timing does not depend on the values);
- at a fixed KV budget (40 GiB by default): the tokens each cache holds (from the bytes per token it
  allocated in its last end-to-end row: codes with their spare capacity, windows, dense layers) and its
  decode throughput (tokens/s) at 32k context with the batch that fits, and the bytes it allocated there.
- ``model.generate`` (section ``generate``, not run by default): ms per new token of greedy generation over the
  same model and caches at 8k x 1 and 32k x 8 (random keys and values), as the difference of two timed
  ``generate`` calls of GENERATE_TOKENS and GENERATE_TOKENS + DECODE_STEPS new tokens (the best of two each, the
  cache cropped back after each): what a user of ``generate`` gets per token, its own host work included;
  ``+graph`` generates within ``tqindex.kv.decode_graphs``.

TQCache presets: window 128, the first and last 2 layers dense; ``-p0`` (e.g. ``tq4-p0``): no dense
layers. ``static``: transformers' StaticCache (bf16, sized for the row's tokens). A ``+graph`` suffix
(``tq4+graph``, ``tq4-p0+graph``, ``static+graph``) runs the decode steps through ``tqindex.kv.DecodeGraph``:
each step replayed from a CUDA graph (TQCache's dense layers then read by the kernel's full-precision path);
without it the steps run eagerly, with TQCache's defaults (``layer_graphs``: each layer's attention replayed from a
CUDA graph of its own, the dense layers filled in place); a ``+nolayers`` suffix (``tq4+nolayers``) decodes eagerly
with ``TQCache(..., layer_graphs=0)``: every launch of every step made by the host, dense layers concatenated.

Results: ``gpu_attention.json`` (rewritten after every measurement) and ``gpu_attention.md`` in ``--out``.

    python benchmarks/gpu_attention.py --out benchmarks/results/gpu_attention_h200
    python benchmarks/gpu_attention.py --quick
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _env  # noqa: E402
import _run  # noqa: E402
import _sdpa  # noqa: E402
from _gpu import bench, gpu_time, roofline  # noqa: E402

import tqindex as tq  # noqa: E402
from tqindex.kv import DecodeGraph, TQCache, decode_graphs  # noqa: E402
from tqindex.kv.attention import _fused, compressed_attention, dense_attention  # noqa: E402
from tqindex.kv.sessions import allocated_bytes  # noqa: E402
from tqindex.kv.store import CompressedTokens  # noqa: E402

HEADS = ((32, 8, 128), (9, 3, 64))
"""(query heads, KV heads, head dim) of the kernel-level rows."""
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 16384, 65536, 131072)
PRESETS = {"tq4": ("tq4", "tq4"), "tq3": ("tq3", "tq3"), "k8v4": ("tq8", "tq4"), "fp4": ("fp4", "fp4")}
KERNELS = {"tq4": ("tq4", "auto"), "tq4 (Triton)": ("tq4", "triton"), "tq3": ("tq3", "auto"),
           "k8v4": ("k8v4", "auto"), "fp4": ("fp4", "auto")}
"""Kernel-level columns: (preset, backend)."""
MAX_DENSE_GB = 40
"""Kernel-level shapes whose bf16 K/V exceed this many GB are left out."""
E2E = ((8192, 1), (32768, 1), (8192, 8), (32768, 8), (65536, 8), (32768, 32))
"""(context, batch) of the end-to-end rows."""
PREFILL_CHUNK = 4096
WARMUP_STEPS, DECODE_STEPS = 16, 32
"""Decode steps before the timed ones (a whole ``encode_stride`` of window lengths: what they compile is
compiled), and timed consecutive steps (:func:`decode_ms`)."""
GENERATE = ((8192, 1), (32768, 8))
"""(context, batch) of the ``generate`` rows."""
GENERATE_TOKENS = 8
"""New tokens of the shorter timed ``generate`` call (:func:`generate_ms`)."""
GiB = 1 << 30


def compressed(encoder: tq.Encoder, x: Tensor) -> CompressedTokens:
    """x [B, H, T, D] bf16 encoded one batch row at a time (bounded float32 temporaries), no window."""
    b, h, t, d = x.shape
    rows = [encoder.encode_valid(x[i].reshape(-1, d).float()).reshape(h, t) for i in range(b)]
    codes = tq.Codes.cat([c.reshape(1, h, t) for c in rows])
    return CompressedTokens(codes, x.new_empty(b, h, 0, d), encoder)


def kernel_rows(results: _run.Results, device: torch.device, quick: bool) -> None:
    """Kernel-level rows (module notes)."""
    roof = results.data["roofline"]["read_TBps"]
    batches, contexts = ((1, 2), (4096, 16384)) if quick else (BATCHES, CONTEXTS)
    for hq, hkv, d in HEADS:
        for b in batches:
            for t in contexts:
                key = f"{hq}q/{hkv}kv d{d} b{b} t{t}"
                dense_bytes = 2 * b * hkv * t * d * 2
                if key in results.data["kernel"] or dense_bytes > MAX_DENSE_GB * 1e9:
                    continue
                g = torch.Generator(device=device).manual_seed(b * t + d)
                k = torch.randn(b, hkv, t, d, generator=g, device=device, dtype=torch.bfloat16)
                v = torch.randn(b, hkv, t, d, generator=g, device=device, dtype=torch.bfloat16)
                q = torch.randn(b, hq, 1, d, generator=g, device=device, dtype=torch.bfloat16)
                scaling = d**-0.5
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)  # noqa: E731
                    sdpa_ms, sdpa_gpu_ms = bench(sdpa), gpu_time(sdpa)
                row: dict[str, Any] = {"sdpa_ms": sdpa_ms, "sdpa_TBps": dense_bytes / sdpa_ms / 1e9,
                                       "sdpa_gpu_ms": sdpa_gpu_ms, "sdpa_gpu_TBps": dense_bytes / sdpa_gpu_ms / 1e9}
                for name, (preset, backend) in KERNELS.items():
                    ke, ve = PRESETS[preset]
                    keys = compressed(tq.make_encoder(ke, d), k)  # encoded by the GPU kernels where they exist
                    values = compressed(tq.make_encoder(ve, d), v)
                    code_bytes = keys.codes.nbytes + values.codes.nbytes

                    def dequantized():
                        kd, vd = keys.materialize(torch.bfloat16), values.materialize(torch.bfloat16)
                        return F.scaled_dot_product_attention(q, kd, vd, scale=scaling, enable_gqa=True)

                    entry: dict[str, Any] = {"code_bytes": code_bytes, "dequantize_sdpa_ms": bench(dequantized)}
                    ours = lambda: compressed_attention(q, keys, values, None, scaling, backend=backend)  # noqa: E731
                    try:
                        ms = bench(ours)
                    except ValueError as err:  # no kernel reads these codes
                        entry["kernel"] = str(err)
                    else:
                        gpu_ms = gpu_time(ours)
                        out = compressed_attention(q, keys, values, None, scaling, backend=backend).float()
                        sl = slice(0, 1)  # the error on batch row 0 (the reference holds float32 copies)
                        ref = dense_attention(q[sl].float(), keys.materialize(torch.float32)[sl],
                                              values.materialize(torch.float32)[sl], None, scaling)
                        entry.update(backend=_fused(q, keys, values, None, backend), ms=ms, TBps=code_bytes / ms / 1e9,
                                     roofline_fraction=code_bytes / ms / 1e9 / roof,
                                     speedup_vs_sdpa=sdpa_ms / ms, gpu_ms=gpu_ms, gpu_TBps=code_bytes / gpu_ms / 1e9,
                                     gpu_speedup_vs_sdpa=sdpa_gpu_ms / gpu_ms,
                                     rel_error=float((out[sl] - ref).norm() / ref.norm()))
                    row[name] = entry
                    del keys, values
                results.data["kernel"][key] = row
                results.save()
                tq4 = row["tq4"]
                print(f"{key}: sdpa {sdpa_ms:.3f} ms; tq4 {tq4.get('ms', float('nan')):.3f} ms "
                      f"({tq4.get('speedup_vs_sdpa', float('nan')):.2f}x, {tq4.get('TBps', float('nan')):.2f} TB/s); "
                      f"GPU time sdpa {sdpa_gpu_ms:.3f} ms, tq4 {tq4.get('gpu_ms', float('nan')):.3f} ms", flush=True)
                del k, v, q


def llama8b(device: torch.device, layers: int) -> Any:
    """A randomly initialized Llama-8B-shaped causal LM in bf16 on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0)
    with torch.device(device):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def make_cache(kind: str, model: Any, tokens: int) -> Any:
    """The cache ``kind`` names (module notes; a ``+graph`` suffix is the decoding's, not the cache's) for
    ``tokens`` tokens per row."""
    from transformers import DynamicCache, StaticCache

    graphs = {"layer_graphs": 0} if kind.endswith("+nolayers") else {}
    kind = kind.removesuffix("+graph").removesuffix("+nolayers")
    if kind in ("dynamic", "static"):
        model.set_attn_implementation("sdpa")
        if kind == "static":
            return StaticCache(config=model.config, max_cache_len=tokens)
        return DynamicCache(config=model.config)
    model.set_attn_implementation("tqindex")
    preset, _, dense = kind.partition("-p")  # "tq4-p0": no dense layers
    return TQCache(model.config, *PRESETS[preset], residual_length=128, protected_layers=int(dense or 2), **graphs)


def held_bytes(cache: Any) -> int:
    """Bytes of the tokens a cache holds: TQCache's own count (codes, window, dense layers), else the
    storages behind its tensors (DynamicCache grows exactly, so the two agree there)."""
    return cache.nbytes() if hasattr(cache, "nbytes") else allocated_bytes(cache)


def cache_kw(model: Any) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def fill(model: Any, cache: Any, batch: int, context: int, prefill: bool, device: torch.device) -> float:
    """Fill ``cache`` to ``context`` tokens per row: a chunked prefill through the model (-> its seconds) or
    random keys and values written into every layer (-> 0)."""
    cfg = model.config
    if prefill:
        ids = torch.randint(2, cfg.vocab_size, (batch, context), device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, context, PREFILL_CHUNK):
            model(input_ids=ids[:, i : i + PREFILL_CHUNK], **{cache_kw(model): cache}, logits_to_keep=1)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    g = torch.Generator(device=device).manual_seed(0)
    for layer in range(cfg.num_hidden_layers):
        for i in range(0, context, PREFILL_CHUNK):
            n = min(PREFILL_CHUNK, context - i)
            kv = [torch.randn(batch, cfg.num_key_value_heads, n, cfg.head_dim, generator=g, device=device,
                              dtype=torch.bfloat16) for _ in range(2)]
            cache.update(kv[0], kv[1], layer, {"cache_position": torch.arange(i, i + n, device=device)})
    return 0.0


@torch.no_grad()
def decode_ms(model: Any, cache: Any, batch: int, device: torch.device, graph: bool = False) -> float:
    """Mean ms of one decode step over DECODE_STEPS consecutive one-token steps (after WARMUP_STEPS), as real
    decoding runs them: the cache grows, and a TQCache encodes what leaves its windows (``encode_stride``
    divides DECODE_STEPS: every layer encodes the same number of times in any such span); ``graph``: through
    :class:`DecodeGraph` (the warm-up steps include its eager first step and its recording). A growing cache is
    then cropped back to its length before the warm-up."""
    ids = torch.randint(2, model.config.vocab_size, (batch, 1), device=device)
    kw = {cache_kw(model): cache}
    from transformers import StaticCache

    step = DecodeGraph(model, cache) if graph else lambda x: model(input_ids=x, **kw, logits_to_keep=1)
    growing = not isinstance(cache, StaticCache)
    length = cache.get_seq_length() if growing else 0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(WARMUP_STEPS + DECODE_STEPS):
        if i == WARMUP_STEPS:
            a.record()
        step(ids)
    b.record()
    b.synchronize()
    if growing:
        cache.crop(length - cache.get_seq_length())  # a negative count removes that many tokens (every 5.x)
    return a.elapsed_time(b) / DECODE_STEPS


@torch.no_grad()
def generate_ms(model: Any, cache: Any, batch: int, device: torch.device, graph: bool = False) -> tuple[float, int]:
    """ms per new token of greedy ``model.generate`` over the filled ``cache`` (module notes; ``graph``: within
    ``decode_graphs``) -> (ms, the steps that went through a DecodeGraph). The cache is cropped back after each call."""
    length = cache.get_seq_length()
    ids = torch.randint(3, model.config.vocab_size, (batch, length + 1), device=device)  # the last one is new

    def timed(tokens: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **{cache_kw(model): cache})
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        cache.crop(length - cache.get_seq_length())
        return seconds

    with decode_graphs(model) if graph else nullcontext() as steps:
        timed(GENERATE_TOKENS)  # compiles, records
        short = min(timed(GENERATE_TOKENS) for _ in range(2))
        long = min(timed(GENERATE_TOKENS + DECODE_STEPS) for _ in range(2))
    return (long - short) / DECODE_STEPS * 1e3, steps.replayed if graph else 0


def generate_rows(results: _run.Results, device: torch.device, args: argparse.Namespace) -> None:
    """The ``generate`` rows (module notes)."""
    model = llama8b(device, 4 if args.quick else 32)
    for context, batch in ((2048, 1),) if args.quick else GENERATE:
        for kind in args.caches.split(","):
            key = f"{kind} t{context} b{batch}"
            if key in results.data["generate"] or kind.startswith("static"):
                continue
            torch.cuda.empty_cache()
            cache = make_cache(kind, model, context + GENERATE_TOKENS + DECODE_STEPS)
            try:
                with _sdpa.backends(args.sdpa):
                    fill(model, cache, batch, context, False, device)
                    ms, replayed = generate_ms(model, cache, batch, device, kind.endswith("+graph"))
                row = {"context": context, "batch": batch, "ms_per_token": ms, "tokens_per_s": batch / ms * 1e3,
                       "replayed": replayed}
            except torch.OutOfMemoryError:
                row = {"oom": True}
            results.data["generate"][key] = row
            results.save()
            print(f"{key}: generate {row.get('ms_per_token', float('nan')):.2f} ms per new token", flush=True)
            del cache


def e2e_rows(results: _run.Results, device: torch.device, args: argparse.Namespace) -> None:
    """End-to-end and fixed-budget rows (module notes)."""
    layers = 4 if args.quick else 32
    model = llama8b(device, layers)
    kinds = args.caches.split(",")
    configs = ((2048, 1), (4096, 2)) if args.quick else E2E
    for context, batch in configs:
        for kind in kinds:
            key = f"{kind} t{context} b{batch}"
            if key in results.data["e2e"]:
                continue
            prefill = args.prefill or (context, batch) == (32768, 8)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            cache = make_cache(kind, model, context + WARMUP_STEPS + DECODE_STEPS)
            try:
                with _sdpa.backends(args.sdpa):
                    prefill_s = fill(model, cache, batch, context, prefill, device)
                    step = decode_ms(model, cache, batch, device, kind.endswith("+graph"))
            except torch.OutOfMemoryError:
                results.data["e2e"][key] = {"oom": True}
                results.save()
                del cache
                continue
            nbytes = held_bytes(cache)
            row = {"context": context, "batch": batch, "step_ms": step, "tokens_per_s": batch / step * 1e3,
                   "peak_GiB": torch.cuda.max_memory_allocated() / GiB, "cache_GiB": nbytes / GiB,
                   "allocated_GiB": allocated_bytes(cache) / GiB, "prefill": prefill, "prefill_s": prefill_s}
            results.data["e2e"][key] = row
            results.save()
            print(f"{key}: step {step:.2f} ms, peak {row['peak_GiB']:.1f} GiB, cache {row['cache_GiB']:.2f} GiB"
                  + (f", prefill {prefill_s:.1f} s" if prefill else ""), flush=True)
            del cache
    budget = args.budget_gib * GiB
    context = 4096 if args.quick else 32768
    per_token = {}  # each cache's allocated bytes per token at its last measured configuration (resumed too)
    for key, row in results.data["e2e"].items():
        if not row.get("oom"):
            per_token[key.split()[0]] = row["allocated_GiB"] * GiB / (row["batch"] * row["context"])
    for kind, bytes_per_token in per_token.items():
        key = f"{kind} budget"
        if key in results.data["budget"]:
            continue
        tokens = int(budget // bytes_per_token)
        batch = max(1, tokens // context)
        torch.cuda.empty_cache()
        cache = make_cache(kind, model, context + WARMUP_STEPS + DECODE_STEPS)
        try:
            with _sdpa.backends(args.sdpa):
                fill(model, cache, batch, context, False, device)
                step = decode_ms(model, cache, batch, device, kind.endswith("+graph"))
            row = {"tokens_held": tokens, "batch": batch, "context": context, "step_ms": step,
                   "tokens_per_s": batch / step * 1e3, "cache_GiB": held_bytes(cache) / GiB,
                   "allocated_GiB": allocated_bytes(cache) / GiB}
        except torch.OutOfMemoryError:
            row = {"tokens_held": tokens, "batch": batch, "context": context, "oom": True}
        results.data["budget"][key] = row
        results.save()
        print(f"{key}: {tokens} tokens, batch {batch} x {context}: {row.get('tokens_per_s', 0):.0f} tokens/s",
              flush=True)
        del cache


def markdown(data: dict) -> str:
    """The results as a Markdown page: the sections this run measured (``--sections``)."""
    env = data["env"]
    lines = [f"# Attention from codes on {env.get('gpu', '?')}", "",
             f"git {str(env['git_sha'])[:10]}{' (dirty)' if env['git_dirty'] else ''}, torch "
             f"{env['versions'].get('torch')}, triton {env['versions'].get('triton')}, transformers "
             f"{env['versions'].get('transformers')}, {env['date_utc']}", "",
             f"Roofline (measured in this run): streaming read {data['roofline']['read_TBps']:.2f} TB/s.", ""]
    if data["kernel"]:
        first = next(iter(data["kernel"].values()))
        columns = [c for c in KERNELS if c in first]  # (older runs: no Triton column)
        ran = ["Kernels that ran: " + ", ".join(f"{c}: {first[c]['backend']}" for c in columns) + ".", ""] if all(
            "backend" in first[c] for c in columns) else []  # (older runs: Triton only)
        lines += ["## Kernel level: one decode step of one layer", "", *ran,
                  "| shape | bf16 SDPA ms (TB/s) | " + " | ".join(f"{p} ms (TB/s, x SDPA, error)" for p in columns)
                  + " | dequantize + SDPA tq4 ms |", "|---|--:|" + "--:|" * len(columns) + "--:|"]
        for key, row in data["kernel"].items():
            cells = [f"{e['ms']:.3f} ({e['TBps']:.2f}, {e['speedup_vs_sdpa']:.2f}x, {e['rel_error']:.1e})"
                     for e in (row[p] for p in columns)]
            lines.append(f"| {key} | {row['sdpa_ms']:.3f} ({row['sdpa_TBps']:.2f}) | " + " | ".join(cells)
                         + f" | {row['tq4']['dequantize_sdpa_ms']:.3f} |")
        timed = {key: row for key, row in data["kernel"].items() if "sdpa_gpu_ms" in row}  # (older runs: none)
        if timed:
            lines += ["", "Above: each call timed alone (the host's launch time included). Below: GPU time, the call "
                      "replayed from a CUDA graph with L2 flushed before each replay (median of 50).", "",
                      "| shape | bf16 SDPA ms (TB/s) | " + " | ".join(f"{p} ms (TB/s, x SDPA)" for p in columns) + " |",
                      "|---|--:|" + "--:|" * len(columns)]
            for key, row in timed.items():
                cells = [f"{e['gpu_ms']:.3f} ({e['gpu_TBps']:.2f}, {e['gpu_speedup_vs_sdpa']:.2f}x)"
                         for e in (row[p] for p in columns)]
                lines.append(f"| {key} | {row['sdpa_gpu_ms']:.3f} ({row['sdpa_gpu_TBps']:.2f}) | "
                             + " | ".join(cells) + " |")
        lines.append("")
    if data["e2e"]:
        backends = data["args"].get("sdpa", "default")
        lines += ["## End to end: Llama-8B shape, one decode step", "",
                  f"SDPA backends (DynamicCache, TQCache's dense layers): {backends} (`--sdpa`).", "",
                  "| cache, context, batch | step ms | tokens/s | peak GiB | cache GiB | allocated GiB | filled by |",
                  "|---|--:|--:|--:|--:|--:|---|"]
        for key, r in data["e2e"].items():
            if r.get("oom"):
                lines.append(f"| {key} | out of memory | | | | | |")
            else:
                how = f"prefill ({r['prefill_s']:.1f} s)" if r["prefill"] else "random K/V"
                lines.append(f"| {key} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_GiB']:.1f} | "
                             f"{r['cache_GiB']:.2f} | {r['allocated_GiB']:.2f} | {how} |")
        lines.append("")
    if data["budget"]:
        lines += [f"## At a {data['args']['budget_gib']} GiB KV budget", "",
                  "| cache | tokens held | batch x context | decode tokens/s | allocated GiB |",
                  "|---|--:|--:|--:|--:|"]
        for key, r in data["budget"].items():
            tps = "out of memory" if r.get("oom") else f"{r['tokens_per_s']:.0f}"
            held = f"{r['allocated_GiB']:.2f}" if "allocated_GiB" in r else ""
            lines.append(f"| {key} | {r['tokens_held']} | {r['batch']} x {r['context']} | {tps} | {held} |")
        lines.append("")
    if data.get("generate"):  # (older runs: no such section)
        lines += ["## model.generate: ms per new token", "",
                  "| cache, context, batch | ms per new token | tokens/s | steps through a DecodeGraph |",
                  "|---|--:|--:|--:|"]
        for key, r in data["generate"].items():
            lines.append(f"| {key} | out of memory | | |" if r.get("oom") else
                         f"| {key} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.0f} | {r['replayed']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for gpu_attention.json/.md (default: a new run folder)")
    p.add_argument("--quick", action="store_true", help="small sizes, 4 layers")
    p.add_argument("--prefill", action="store_true", help="fill every end-to-end cache by a real prefill")
    p.add_argument("--budget-gib", type=float, default=40.0, help="the fixed KV budget (GiB)")
    p.add_argument("--sections", default="kernel,e2e", help="kernel, e2e, generate (comma-separated)")
    p.add_argument("--caches", default="dynamic,tq4,tq4-p0,k8v4,tq3",
                   help="caches of the end-to-end rows: dynamic, static, or a TQCache preset (" + ", ".join(PRESETS)
                   + ") with an optional -pN (N dense layers at each end; default 2); a +graph suffix decodes "
                   "through DecodeGraph (CUDA graphs), a +nolayers suffix eagerly with TQCache's layer_graphs=0")
    p.add_argument("--sdpa", choices=_sdpa.BACKENDS, default="flash",
                   help="SDPA backends of the end-to-end rows (DynamicCache, TQCache's dense layers): flash (flash, "
                   "memory-efficient for masked prefill chunks) or torch's default choice")
    p.add_argument("--restart", action="store_true", help="measure afresh instead of continuing --out's run")
    args = p.parse_args(argv)
    unknown = {c for c in args.caches.split(",") if not re.fullmatch(
        f"(dynamic|static\\+graph|({'|'.join(PRESETS)})(-p[0-9]+)?(\\+graph|\\+nolayers)?)", c)}
    if unknown:
        p.error(f"unknown caches {', '.join(sorted(unknown))} (dynamic, static+graph, or a preset "
                f"{', '.join(PRESETS)} with an optional -pN: N dense layers at each end, and +graph or +nolayers)")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_attention.py needs a CUDA GPU")
    device = torch.device("cuda")
    env = _env.named_commit(_env.environment(torch.get_num_threads()))
    out = _run.run_folder(args.out, "gpu_attention", env)
    results = _run.Results(out / "gpu_attention.json", {"env": env, "args": vars(args), "roofline": {}, "kernel": {},
                                                        "e2e": {}, "budget": {}, "generate": {}}, args.restart)
    results.data.setdefault("generate", {})  # (a run continued from before the section)
    if not results.data["roofline"]:
        results.data["roofline"] = roofline(device)
        results.save()
    sections = args.sections.split(",")
    if "kernel" in sections:
        kernel_rows(results, device, args.quick)
    if "e2e" in sections:
        e2e_rows(results, device, args)
    if "generate" in sections:
        generate_rows(results, device, args)
    results.data["complete"] = True
    results.save()
    (out / "gpu_attention.md").write_text(markdown(results.data))
    print(markdown(results.data))


if __name__ == "__main__":
    main()
