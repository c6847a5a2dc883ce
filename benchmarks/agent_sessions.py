"""Many long agent sessions under one KV-memory budget: time to first token per round, per cache.

A seeded workload of ``--sessions`` multi-turn sessions runs through :class:`tqindex.kv.SessionStore`, once
per cache, every cache under the same ``--budget`` of resident KV bytes (measured: the allocated bytes of
the caches, see :func:`tqindex.kv.allocated_bytes`). Sessions whose caches do not fit are evicted (least
recently used first) and re-prefill their whole history at their next turn; a smaller cache keeps more of
them resident.

Workload (the same for every cache): session s starts with a system prompt of ``--system-tokens`` tokens;
in each of ``--rounds`` rounds it sends a user turn of ``--user-tokens`` tokens, after the first round
preceded with probability ``--tool-prob`` by a tool output of ``--tool-tokens`` tokens, and gets an answer of
``--answer-tokens`` tokens. Lengths are log-uniform between their bounds (chat logs are skewed to short
turns), so contexts grow by about user + answer + tool-prob x tool tokens per round. Of each answer, the first
``--decode-tokens`` are generated one step at a time (timed: TTFT, decode rate) and the rest is appended as
generated text would be (``SessionStore.extend``, prefilled at once, not part of the TTFT). Within a round
sessions are served in a seeded random order (``--order random``, the same for every cache) or in order
(``round-robin``, where LRU eviction always evicts the session served next once they do not all fit).
Tokens: Python's language reference (``pydoc_data.topics``) in ChatML turns for SmolLM2, random ids for
random-weight models.

The ``--reference`` cache (``dynamic``) generates the answers and runs first; every other cache is fed the
same answer tokens one per step (forced: the same computation as generating), so all caches serve the same
histories, and their own greedy tokens at those steps give the next-token agreement with the reference.
With SmolLM2 the run also measures that agreement under the streamed protocol of ``kv_quality.py``
(``--stream-tokens`` of its text, a 512-token prefill, then chunks of 64) for comparison.

Caches: ``dynamic`` (``DynamicCache``, the model's dtype), ``fp8`` (:class:`tqindex.kv.FP8Cache`), TQCache
presets ``k8v4``, ``tq4`` (k4v4), ``fp4``, ``tq3`` (k3v3), ``k3v4``, with an optional ``-r{N}-p{N}`` suffix
(full-precision window, protected layers; default ``--residual-length`` / ``--protected-layers``), an
optional ``-sdpa`` suffix and an optional ``-graph`` suffix. The model attends through the "tqindex"
attention: from the codes for TQCache, sdpa for dense tensors; a ``-sdpa`` cache's prefills (and extends)
read its history decoded, through sdpa (``SessionStore(prefill_attention="sdpa")``), its one-token steps
still from the codes; a ``-graph`` cache's one-token steps are replayed from CUDA graphs
(``SessionStore(decode_graph=True)``).

Models: ``smollm2`` (SmolLM2-135M-Instruct, ``tqindex.data.load_smollm2``, CPU), ``llama8b-random`` (random
weights of the Llama-3-8B shape: 32 layers, 32 query / 8 KV heads, head_dim 128; for a GPU),
``tiny-random`` (a 4-layer Llama, for tests). Each model has its default workload and budget (``--quick``
shrinks them to a seconds-long smoke run).

Reported per cache: P50/P90 TTFT per round and over the late rounds (``--late-round`` on), hit rate,
tokens re-prefilled, decode tokens/s, bytes per token, peak KV bytes and peak device memory, agreement;
a PNG of P50 TTFT per round per cache. Results go to a run folder as the other benchmarks (``--out``
resumes: finished caches are kept, an unfinished one runs again from its start). ``--caches`` is not part of
a run's configuration: calls with the same ``--out`` and other caches add their runs to the same file (one
cache per call where a call's time is limited).

    python benchmarks/agent_sessions.py --quick                                   # CI smoke run, CPU
    python benchmarks/agent_sessions.py --out benchmarks/results                  # SmolLM2 on the CPU
    for c in dynamic fp8 k8v4 tq4 fp4 tq3; do                                     # 32 sessions, 48 GB
        python benchmarks/agent_sessions.py --model llama8b-random --device cuda --caches $c \\
            --out benchmarks/results; done
"""

from __future__ import annotations

import argparse
import gc
import inspect
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _env  # noqa: E402
import _lm  # noqa: E402
import _run  # noqa: E402
import _sdpa  # noqa: E402

from tqindex.kv import FP8Cache, SessionStore, TQCache  # noqa: E402  (registers the "tqindex" attention)

TQ_PRESETS = {"k8v4": "k8v4", "tq4": "k4v4", "fp4": "fp4", "tq3": "k3v3", "k3v4": "k3v4"}
"""Cache name -> TQCache.preset name."""
DEFAULT_CACHES = ("dynamic", "fp8", "k8v4", "tq4", "fp4", "tq3")
_CACHE_NAME = re.compile(r"(?P<base>[a-z0-9]+)(?:-r(?P<r>\d+))?(?:-p(?P<p>\d+))?(?P<sdpa>-sdpa)?(?P<graph>-graph)?")

# Per model: (workload defaults, --quick overrides). Lengths are "lo-hi" token ranges.
PRESETS: dict[str, dict[str, Any]] = {
    "llama8b-random": dict(sessions=32, rounds=10, system_tokens="4000-8000", user_tokens="200-1500",
                           answer_tokens="100-600", tool_prob=0.3, tool_tokens="2000-8000", decode_tokens=16,
                           budget="48GB", late_round=6, dtype="bf16", stream_tokens=0, residual_length=128,
                           protected_layers=2),
    "smollm2": dict(sessions=6, rounds=6, system_tokens="200-600", user_tokens="60-300", answer_tokens="30-120",
                    tool_prob=0.3, tool_tokens="200-800", decode_tokens=6, budget="120MB", late_round=4,
                    dtype="bf16", stream_tokens=2048, residual_length=128, protected_layers=2),
    "tiny-random": dict(sessions=4, rounds=4, system_tokens="40-80", user_tokens="10-40", answer_tokens="8-16",
                        tool_prob=0.3, tool_tokens="30-60", decode_tokens=4, budget="400KB", late_round=3,
                        dtype="fp32", stream_tokens=0, residual_length=8, protected_layers=1),
}
QUICK = dict(sessions=3, rounds=3, system_tokens="40-80", user_tokens="16-48", answer_tokens="8-16",
             tool_prob=0.3, tool_tokens="30-60", decode_tokens=3, late_round=2, stream_tokens=0, residual_length=16)
QUICK_BUDGET = {"llama8b-random": "2GB", "smollm2": "16MB", "tiny-random": "600KB"}
QUICK_CACHES = ("dynamic", "fp8", "tq4")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
STREAM_PREFILL, STREAM_CHUNK = 512, 64  # kv_quality.py --prefill 512 --chunk 64


# ------------------------------------------------------------------------------ workload

@dataclass(frozen=True)
class Turn:
    """One session's turn in one round: tokens of the tool output (0: none), the user message, the answer."""

    tool: int
    user: int
    answer: int


def span(text: str, name: str) -> tuple[int, int]:
    """'lo-hi' -> (lo, hi) with 1 <= lo <= hi (argparse errors name the option)."""
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise argparse.ArgumentTypeError(f"--{name} must be 'lo-hi' with 1 <= lo <= hi, got {text!r}")
    return int(m[1]), int(m[2])


def parse_bytes(text: str) -> int:
    """'48GB', '120MB', '64MiB', '1000' -> bytes (decimal KB/MB/GB, binary KiB/MiB/GiB)."""
    m = re.fullmatch(r"([0-9.]+)\s*([KMG]i?B|B)?", text.strip())
    if not m or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"--budget must be a positive size like 48GB or 64MiB, got {text!r}")
    return int(float(m[1]) * UNITS[m[2] or "B"])


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def make_workload(args: argparse.Namespace) -> tuple[list[int], list[list[Turn]], list[tuple[int, int]]]:
    """-> (system prompt tokens per session, turns [session][round], serving order [(round, session)])."""
    rng = random.Random(args.seed)
    system = [log_uniform(rng, *args.system_tokens) for _ in range(args.sessions)]
    turns = [[Turn(tool=log_uniform(rng, *args.tool_tokens) if r > 0 and rng.random() < args.tool_prob else 0,
                   user=log_uniform(rng, *args.user_tokens), answer=log_uniform(rng, *args.answer_tokens))
              for r in range(args.rounds)] for _ in range(args.sessions)]
    order = []
    for r in range(args.rounds):
        sessions = list(range(args.sessions))
        if args.order == "random":
            rng.shuffle(sessions)
        order += [(r, s) for s in sessions]
    return system, turns, order


class Tokens:
    """Token ids of the workload's segments: ChatML turns of real text when the tokenizer has the markers,
    else random ids. Every segment is a function of (seed, session, round, part): the same for every cache."""

    def __init__(self, tokenizer: Any, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed
        self.chat = tokenizer is not None and "<|im_start|>" in tokenizer.get_vocab()
        if self.chat:
            from pydoc_data.topics import topics

            self.pool = tokenizer("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False).input_ids
            self.encode = lambda s: tokenizer(s, add_special_tokens=False).input_ids

    def _rng(self, *key: int) -> random.Random:
        return random.Random(hash((self.seed, *key)) & 0xFFFFFFFF)

    def _text(self, rng: random.Random, n: int) -> list[int]:
        if not self.chat:
            return [rng.randrange(4, self.vocab) for _ in range(n)]
        start = rng.randrange(len(self.pool))
        return (self.pool[start:] + self.pool)[:n]

    def segment(self, role: str, n: int, *key: int) -> list[int]:
        """A ``role`` message of n tokens (more when n is below the markers' length; a user message ends with
        the assistant header), or the n last tokens of an answer (role "answer": text, then the end marker)."""
        rng = self._rng(*key)
        if not self.chat:
            return self._text(rng, n)
        head = [] if role == "answer" else self.encode(f"<|im_start|>{role}\n")
        tail = self.encode("<|im_end|>\n" + ("<|im_start|>assistant\n" if role == "user" else ""))
        body = self._text(rng, max(n - len(head) - len(tail), 1))
        return (head + body + tail)[-n:] if role == "answer" else head + body + tail


# ------------------------------------------------------------------------------ model and caches

def load_model(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """-> (model on args.device in args.dtype, tokenizer or None, description)."""
    dtype = DTYPES[args.dtype]
    t0 = time.perf_counter()
    if args.model == "smollm2":
        from tqindex.data import load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype)
        model = model.to(args.device)
        info = {"name": "SmolLM2-135M-Instruct (Q4_1 GGUF weights, dequantized)"}
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0)
                 if args.model == "llama8b-random" else
                 dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.1))
        config = LlamaConfig(max_position_embeddings=262144, tie_word_embeddings=False, **shape)
        torch.manual_seed(args.seed)
        with torch.device(args.device):
            model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
        tokenizer = None
        info = {"name": f"{args.model} (LlamaForCausalLM, random weights, seed {args.seed})"}
    model.set_attn_implementation("tqindex")
    c = model.config
    info.update(layers=c.num_hidden_layers, q_heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                dtype=args.dtype, device=str(args.device), load_s=round(time.perf_counter() - t0, 2),
                weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    return model, tokenizer, info


def cache_factory(name: str, config: Any, args: argparse.Namespace) -> tuple[Callable[[], Any], str, str | None]:
    """A cache name (see the module notes) -> (factory, description, attention implementation of prefills:
    None for the model's). ValueError for unknown names."""
    m = _CACHE_NAME.fullmatch(name)
    base = m["base"] if m else None
    if base in ("dynamic", "fp8") and m["r"] is None and m["p"] is None and m["sdpa"] is None and m["graph"] is None:
        if base == "dynamic":
            from transformers import DynamicCache

            return (lambda: DynamicCache(config=config)), f"DynamicCache ({args.dtype})", None
        return (lambda: FP8Cache(config)), "FP8Cache: E4M3 codes, one float32 scale per token and head", None
    if base in TQ_PRESETS:
        r = args.residual_length if m["r"] is None else int(m["r"])
        p = args.protected_layers if m["p"] is None else int(m["p"])
        preset = TQ_PRESETS[base]
        sdpa = m["sdpa"] is not None
        return ((lambda: TQCache.preset(config, preset, residual_length=r, protected_layers=p)),
                f"TQCache {preset}, window {r}, {p}+{p} protected layers"
                + (", prefills attend the decoded history (sdpa)" if sdpa else "")
                + (", one-token steps replayed from CUDA graphs (DecodeGraph)" if m["graph"] else ""),
                "sdpa" if sdpa else None)
    raise ValueError(f"unknown cache {name!r}: dynamic, fp8 or one of {', '.join(TQ_PRESETS)} with optional "
                     "-r{window}, -p{protected layers}, -sdpa and -graph suffixes")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ one cache

def warm_up(model: Any, factory: Callable[[], Any], vocab: int, prefill_attention: str | None,
            decode_graph: bool) -> None:
    """Short turns through a throwaway store: first-call costs (kernel compilation, allocator) are paid
    before anything is timed. Turn and context lengths of every residue class Triton specializes integer
    arguments on (1, multiples of 16, others), so the timed turns meet no new kernel variant."""
    store = SessionStore(model, factory, 2**62, prefill_attention=prefill_attention, decode_graph=decode_graph)
    store.open(0)
    for n in (256, 64, 37, 129, 1):
        store.turn(0, [(7 * i) % vocab for i in range(n)], max_new_tokens=17)


def run_cache(name: str, model: Any, tokens: Tokens, workload: tuple, args: argparse.Namespace,
              reference: dict[str, list[int]] | None, on_turn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Serve the whole workload with one cache. ``reference``: answers to force ('s:r' -> ids), None to
    generate them. ``on_turn(row)`` after every turn. -> the run's summary fields (rows are on_turn's)."""
    factory, _, prefill_attention = cache_factory(name, model.config, args)
    decode_graph = name.endswith("-graph")
    device = torch.device(args.device)
    warm_up(model, factory, tokens.vocab, prefill_attention, decode_graph)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    store = SessionStore(model, factory, args.budget, offload=args.offload, host_budget_bytes=args.host_budget,
                         prefill_chunk=args.prefill_chunk, prefill_attention=prefill_attention,
                         decode_graph=decode_graph)
    system, turns, order = workload
    for s in range(args.sessions):
        store.open(s)
    t0 = time.perf_counter()
    for r, s in order:
        turn = turns[s][r]
        new = ((tokens.segment("system", system[s], s, -1, 0) if r == 0 else [])
               + (tokens.segment("tool", turn.tool, s, r, 1) if turn.tool else [])
               + tokens.segment("user", turn.user, s, r, 2))
        context_before = len(store.history(s))
        decode = min(args.decode_tokens, turn.answer)
        key = f"{s}:{r}"
        if reference is None:
            result = store.turn(s, new, max_new_tokens=decode)
        else:
            result = store.turn(s, new, answer_ids=reference[key])
        rest = turn.answer - len(result.output_ids)
        extend = store.extend(s, tokens.segment("answer", rest, s, r, 3)) if rest > 0 else None
        expected = reference[key] if reference else None
        on_turn({
            "round": r + 1, "session": s, "status": result.status, "ttft_s": result.ttft_s,
            "prefill_tokens": result.prefill_tokens, "reprefill_tokens": result.reprefill_tokens,
            "new_tokens": result.new_tokens, "transfer_s": result.transfer_s, "decode_tokens": result.decode_tokens,
            "decode_s": result.decode_s, "context_before": context_before, "context_tokens": len(store.history(s)),
            "cache_bytes": extend.cache_bytes if extend else result.cache_bytes,
            "cached_tokens": store.cache(s).get_seq_length(), "resident_bytes": store.resident_bytes,
            "evicted": len(result.evicted) + (len(extend.evicted) if extend else 0),
            "extend_tokens": extend.prefill_tokens if extend else 0, "extend_s": extend.seconds if extend else 0.0,
            "answer": result.output_ids if reference is None else None, "positions": len(result.predicted_ids),
            "agree": sum(a == b for a, b in zip(result.predicted_ids, expected)) if expected else None,
            "agree_first": result.predicted_ids[0] == expected[0] if expected else None,
        })
    stats = store.stats()
    return {"stats": stats, "seconds": round(time.perf_counter() - t0, 2),
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def stream_agreement(model: Any, ids: torch.Tensor, factory: Callable[[], Any]) -> list[int]:
    """kv_quality.py's chunked protocol (--prefill 512 --chunk 64): ids [1, T] fed as a STREAM_PREFILL-token
    prefill, then chunks of STREAM_CHUNK, through a new cache (under the model's attention: the chunks attend
    from the codes). -> greedy next-token predictions for positions STREAM_PREFILL-1 .. T-2."""
    cache = factory()
    kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    preds = []
    with torch.inference_mode():
        out = model(input_ids=ids[:, :STREAM_PREFILL], use_cache=True, logits_to_keep=1, **kw)
        preds.append(out.logits[0, -1].argmax())
        for s in range(STREAM_PREFILL, ids.shape[1] - 1, STREAM_CHUNK):
            logits = model(input_ids=ids[:, s:min(s + STREAM_CHUNK, ids.shape[1] - 1)], use_cache=True, **kw).logits
            preds.extend(logits[0].argmax(-1))
    return torch.stack(preds).tolist()


# ------------------------------------------------------------------------------ summaries and report

def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of values, linear between order statistics; None when empty."""
    if not values:
        return None
    v = sorted(values)
    x = q * (len(v) - 1)
    lo = int(x)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo)


def summarize(rows: list[dict[str, Any]], late_round: int) -> dict[str, Any]:
    """Per round and over the late rounds (>= late_round): TTFT P50/P90, hit rate (turns with a history whose
    cache was resident or restored), tokens re-prefilled, decode tokens/s, context; and totals."""
    def block(rs: list[dict[str, Any]]) -> dict[str, Any]:
        ttft = [r["ttft_s"] for r in rs]
        with_history = [r for r in rs if r["status"] != "new"]
        decode_s = sum(r["decode_s"] for r in rs)
        agree = [r for r in rs if r["agree"] is not None]
        return {
            "turns": len(rs), "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
            "hit_rate": (sum(r["status"] in ("hit", "restored") for r in with_history) / len(with_history)
                         if with_history else None),
            "reprefill_tokens": sum(r["reprefill_tokens"] for r in rs),
            "prefill_tokens": sum(r["prefill_tokens"] for r in rs),
            "decode_tokens_per_s": sum(r["decode_tokens"] for r in rs) / decode_s if decode_s > 0 else None,
            "context_median": median(r["context_before"] for r in rs) if rs else None,
            "agreement": (sum(r["agree"] for r in agree) / sum(r["positions"] for r in agree)) if agree else None,
            "first_token_agreement": sum(r["agree_first"] for r in agree) / len(agree) if agree else None,
        }

    rounds = sorted({r["round"] for r in rows})
    out = {"rounds": {str(k): block([r for r in rows if r["round"] == k]) for k in rounds},
           "late": block([r for r in rows if r["round"] >= late_round]), "all": block(rows)}
    last = [r for r in rows if r["round"] == rounds[-1]] if rows else []
    cached = sum(r["cached_tokens"] for r in last)
    out["bytes_per_token"] = sum(r["cache_bytes"] for r in last) / cached if cached else None
    out["peak_resident_bytes"] = max((r["resident_bytes"] for r in rows), default=0)
    return out


def size(n: float) -> str:
    """Bytes in decimal units: '48.0 GB', '120.0 MB', '400.0 KB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:.0f} B"


def _fmt(x: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def targets(data: dict[str, Any]) -> list[str]:
    """The late-round TTFT and decode-rate comparisons of the 4-bit caches against fp8 and dynamic."""
    runs = {n: r for n, r in data["runs"].items() if r.get("complete")}
    late = {n: r["summary"]["late"] for n, r in runs.items()}
    lines = []
    for name in [n for n in runs if n.split("-")[0] in ("tq4", "fp4")]:
        for base, need in (("fp8", 3.5), ("dynamic", 5.0)):
            if base in late and late[name]["ttft_p50_s"] and late[base]["ttft_p50_s"]:
                ratio = late[base]["ttft_p50_s"] / late[name]["ttft_p50_s"]
                lines.append(f"- late-round P50 TTFT, {base} / {name}: {ratio:.2f}x (target >= {need}x: "
                             f"{'met' if ratio >= need else 'not met'})")
        if "fp8" in late and late[name]["decode_tokens_per_s"] and late["fp8"]["decode_tokens_per_s"]:
            ratio = late[name]["decode_tokens_per_s"] / late["fp8"]["decode_tokens_per_s"]
            lines.append(f"- late-round decode tokens/s, {name} / fp8: {ratio:.2f} (target >= 1: "
                         f"{'met' if ratio >= 1 else 'not met'})")
    return lines


def markdown(data: dict[str, Any]) -> str:
    env, a, w, m = data["env"], data["args"], data["workload"], data["model"]
    runs = {n: r for n, r in data["runs"].items() if r.get("summary")}
    hw = env.get("gpu") or f"{env['cpu']} ({env['threads']} threads)"
    lines = [
        f"# Agent sessions under a KV budget: {m['name']} on {hw}", "",
        f"{a['sessions']} sessions x {a['rounds']} rounds ({a['order']} order within a round), budget "
        f"{size(a['budget'])} of resident KV ({'offload to host' if a['offload'] else 'evicted caches dropped'}). "
        f"Per turn: user {a['user_tokens'][0]}-{a['user_tokens'][1]} tokens (mean {w['mean_user']:.0f}), tool "
        f"output {a['tool_tokens'][0]}-{a['tool_tokens'][1]} with probability {a['tool_prob']} (mean "
        f"{w['mean_tool']:.0f} per turn), answer {a['answer_tokens'][0]}-{a['answer_tokens'][1]} (mean "
        f"{w['mean_answer']:.0f}; {a['decode_tokens']} decoded one by one, the rest appended); system prompt "
        f"{a['system_tokens'][0]}-{a['system_tokens'][1]}. Contexts reach {w['final_context_median']:,} tokens "
        f"(median; max {w['final_context_max']:,}). Late rounds: {a['late_round']} on. Model {m['name']}, "
        f"{m['layers']} layers, {m['kv_heads']} KV heads x {m['head_dim']}, {m['dtype']}, {m['device']}; SDPA "
        f"backends: {a.get('sdpa', 'default')} (`--sdpa`).",
        "",
        f"git {env['git_sha'][:12]}{' (dirty)' if env['git_dirty'] else ''}, torch {env['versions']['torch']}, "
        f"transformers {env['versions']['transformers']}, {hw}, {env['date_utc']}."
        + ("" if data.get("complete") else " **Unfinished run.**"), "",
        "| cache | B/token | hit rate | re-prefilled tokens | P50 TTFT s | P90 TTFT s | late P50 s | late P90 s "
        "| decode tok/s | peak KV MB | peak device GB | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    turns = a["sessions"] * a["rounds"]
    for name, r in runs.items():
        s, al, lt = r["summary"], r["summary"]["all"], r["summary"]["late"]
        label = name if r.get("complete") else f"{name} (unfinished: {len(r['rows'])} of {turns} turns)"
        lines.append(
            f"| {label} | {_fmt(s['bytes_per_token'], ',.0f')} | {_fmt(al['hit_rate'], '.2f')} "
            f"| {al['reprefill_tokens']:,} | {_fmt(al['ttft_p50_s'], '.3f')} | {_fmt(al['ttft_p90_s'], '.3f')} "
            f"| {_fmt(lt['ttft_p50_s'], '.3f')} | {_fmt(lt['ttft_p90_s'], '.3f')} "
            f"| {_fmt(al['decode_tokens_per_s'], '.1f')} | {_fmt(s['peak_resident_bytes'], ',.1f', 1e-6)} "
            f"| {_fmt(r.get('peak_device_bytes'), '.1f', 1e-9)} | {_fmt(al['agreement'], '.3f')} |")
    rounds = sorted({int(k) for r in runs.values() for k in r["summary"]["rounds"]})
    names = list(runs)
    lines += ["", "P50 / P90 TTFT (s) and hit rate per round; context = median tokens before the turn:", "",
              "| round | context | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    for k in rounds:
        cells = []
        for n in names:
            b = runs[n]["summary"]["rounds"].get(str(k))
            cells.append("-" if b is None else f"{_fmt(b['ttft_p50_s'], '.3f')} / {_fmt(b['ttft_p90_s'], '.3f')} "
                                                f"({_fmt(b['hit_rate'], '.2f')})")
        ctx = next((runs[n]["summary"]["rounds"][str(k)]["context_median"] for n in names
                    if str(k) in runs[n]["summary"]["rounds"]), None)
        lines.append(f"| {k} | {_fmt(ctx, ',.0f')} | " + " | ".join(cells) + " |")
    lines += ["", "Caches:", ""] + [f"- `{n}`: {r['description']}" for n, r in data["runs"].items()]
    ref = next(iter(data["runs"]), None)
    lines += ["", f"Agreement: the fraction of answer positions where the cache's greedy token equals the one "
              f"`{ref}` generated, all caches fed the same tokens."]
    if data.get("stream"):
        lines += ["", f"Next-token agreement with `{ref}` under kv_quality.py's streamed protocol "
                  f"({data['stream_info']['tokens']} tokens of its text, prefill {STREAM_PREFILL}, chunks of "
                  f"{STREAM_CHUNK}) beside the sessions' agreement:", "",
                  "| cache | sessions | streamed |", "|---|---:|---:|"]
        for n, v in data["stream"].items():
            sess = runs.get(n, {}).get("summary", {}).get("all", {}).get("agreement")
            lines.append(f"| {n} | {_fmt(sess, '.3f')} | {v['agreement']:.3f} |")
    if "random weights" in m["name"]:
        lines += ["", "With random weights the greedy tokens are near ties: agreement says nothing about quality "
                  "here (quality is measured on SmolLM2, on the CPU)."]
    tl = targets(data)
    if tl:
        target = PRESETS["llama8b-random"]
        same = a["sessions"] == target["sessions"] and a["budget"] == parse_bytes(target["budget"])
        where = ("" if same else f" (the targets' protocol is {target['sessions']} sessions under {target['budget']}; "
                 f"this run is smaller: {a['sessions']} sessions x {a['rounds']} rounds under "
                 f"{size(a['budget'])})")
        lines += ["", f"Targets of the H200 configuration, over the late rounds ({a['late_round']} on){where}:",
                  ""] + tl
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> bool:
    """P50 TTFT per round per cache (P90 dashed), log scale. False (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tqindex[bench]')")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, run) in enumerate(r for r in data["runs"].items() if r[1].get("summary")):
        rounds = sorted(int(k) for k in run["summary"]["rounds"])
        p50 = [run["summary"]["rounds"][str(k)]["ttft_p50_s"] for k in rounds]
        p90 = [run["summary"]["rounds"][str(k)]["ttft_p90_s"] for k in rounds]
        color = f"C{i}"
        ax.plot(rounds, p50, marker="o", color=color, label=f"{name} P50")
        ax.plot(rounds, p90, linestyle="--", color=color, alpha=0.6, linewidth=1)
    a = data["args"]
    ax.set_yscale("log")
    ax.set_xticks(sorted({int(k) for r in data["runs"].values() if r.get("summary") for k in r["summary"]["rounds"]}))
    ax.set_xlabel("round")
    ax.set_ylabel("time to first token (s), P50 (P90 dashed)")
    ax.set_title(f"{data['model']['name']}: {a['sessions']} sessions, {size(a['budget'])} KV budget", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(PRESETS), default="smollm2")
    p.add_argument("--device", default="cpu", help="torch device of the model and caches (cuda for a GPU run)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="model dtype (default: per model)")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run: 3 sessions x 3 rounds, short turns, "
                   "caches " + " ".join(QUICK_CACHES))
    p.add_argument("--caches", nargs="+", default=None, help="caches to run (default: "
                   f"{' '.join(DEFAULT_CACHES)}); a call with --out runs those its file does not hold yet, so one "
                   "file can gather caches run by several calls")
    p.add_argument("--reference", default="dynamic", help="the cache that generates the answers (run first when "
                   "the file does not hold it yet); the others are fed them"),
    p.add_argument("--sessions", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--order", choices=("random", "round-robin"), default="random")
    for name, what in (("system-tokens", "system prompt"), ("user-tokens", "user message"),
                       ("answer-tokens", "answer"), ("tool-tokens", "tool output")):
        p.add_argument(f"--{name}", type=lambda t, n=name: span(t, n), default=None,
                       help=f"tokens of a {what}, lo-hi (log-uniform)")
    p.add_argument("--tool-prob", type=float, default=None, help="probability of a tool output before a user turn")
    p.add_argument("--decode-tokens", type=int, default=None, help="answer tokens decoded one by one per turn")
    p.add_argument("--budget", type=parse_bytes, default=None, help="resident KV bytes, e.g. 48GB, 120MB")
    p.add_argument("--offload", action="store_true", help="offload evicted caches to host memory")
    p.add_argument("--host-budget", type=parse_bytes, default=None, help="host bytes for offloaded caches")
    p.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill forward pass (default: one)")
    p.add_argument("--residual-length", type=int, default=None, help="TQCache full-precision window (default: "
                   "per model)")
    p.add_argument("--protected-layers", type=int, default=None, help="TQCache dense first and last layers "
                   "(default: per model)")
    p.add_argument("--late-round", type=int, default=None, help="first round counted as late")
    p.add_argument("--stream-tokens", type=int, default=None, help="tokens of the streamed agreement check "
                   "(SmolLM2 only; 0: skip)")
    p.add_argument("--sdpa", choices=_sdpa.BACKENDS, default=None, help="SDPA backends of the sdpa attention "
                   "(dense caches, TQCache's dense layers and -sdpa prefills): flash (flash, memory-efficient for "
                   "masked prefills) or torch's default choice (default: flash on CUDA, torch's choice elsewhere)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default=None, help="run folder (default: a new benchmarks/runs/agent_sessions-<time>/); "
                   "one holding an unfinished run of the same arguments continues it")
    p.add_argument("--restart", action="store_true", help="measure afresh even where --out holds results")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    defaults = {**PRESETS[args.model], **(QUICK if args.quick else {})}
    if args.quick:
        defaults["budget"] = QUICK_BUDGET[args.model]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, span(value, key) if key.endswith("_tokens") and isinstance(value, str)
                    else parse_bytes(value) if key == "budget" else value)
    args.caches = args.caches or list(QUICK_CACHES if args.quick else DEFAULT_CACHES)
    args.sdpa = args.sdpa or ("flash" if torch.device(args.device).type == "cuda" else "default")
    if args.model != "smollm2":
        args.stream_tokens = 0
    for name in ("sessions", "rounds", "decode_tokens", "late_round", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.tool_prob <= 1.0:
        p.error(f"--tool-prob must be in [0, 1], got {args.tool_prob}")
    if args.stream_tokens and args.stream_tokens <= STREAM_PREFILL + 1:
        p.error(f"--stream-tokens must be 0 or > {STREAM_PREFILL + 1}, got {args.stream_tokens}")
    if args.host_budget is not None and not args.offload:
        p.error("--host-budget needs --offload")
    if len(set(args.caches)) != len(args.caches):
        p.error(f"--caches names a cache twice: {args.caches}")
    for name in [args.reference, *args.caches]:
        try:
            cache_factory(name, None, args)
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device} needs a CUDA GPU: torch sees none")
    env = _env.named_commit(_env.environment(args.threads))  # a GPU machine's copy of the tree names its commit
    label = f"agent_sessions_{args.model}_{torch.device(args.device).type}" + ("_quick" if args.quick else "")
    out = _run.run_folder(args.out, label.replace("_", "-"), env)
    stem = out / label
    results = _run.Results(stem.with_suffix(".json"), {
        "benchmark": "agent_sessions", "complete": False, "env": env,
        "args": {k: v for k, v in vars(args).items() if k != "caches"}, "runs": {}, "stream": {}},
        restart=args.restart)  # --caches is not part of the configuration: one file gathers runs of several calls
    data = results.data

    def save() -> None:
        results.save()
        if "model" in data:
            _run.write_atomic(stem.with_suffix(".md"), markdown(data))

    bar: _run.Progress | None = None

    def where() -> str:
        if bar is not None:
            bar.close()
        done = [n for n, r in data["runs"].items() if r.get("complete")]
        return (f"caches done: {', '.join(done) or 'none'}; saved in {stem}.json; resume with:\n  "
                + _run.resume_command(os.path.relpath(__file__), argv, out))

    print(f"run folder {out}" + (" (resumed)" if results.resumed else ""))
    with _run.interruptible(where):
        model, tokenizer, info = load_model(args)
        vocab = model.get_input_embeddings().num_embeddings
        tokens = Tokens(tokenizer, vocab, args.seed)
        workload = make_workload(args)
        system, turns, _ = workload
        final = [system[s] + sum(t.tool + t.user + t.answer for t in turns[s]) for s in range(args.sessions)]
        flat = [t for ts in turns for t in ts]
        data["model"] = info
        data["workload"] = {
            "system": system, "turns": [[asdict(t) for t in ts] for ts in turns],
            "mean_user": sum(t.user for t in flat) / len(flat), "mean_answer": sum(t.answer for t in flat) / len(flat),
            "mean_tool": sum(t.tool for t in flat) / len(flat), "final_context_median": int(median(final)),
            "final_context_max": max(final), "tool_outputs": sum(t.tool > 0 for t in flat)}
        names = [args.reference] + [n for n in args.caches if n != args.reference]
        todo = [n for n in names if not data["runs"].get(n, {}).get("complete")]
        turns_per_run = args.sessions * args.rounds
        per_turn = [1.0]
        bar = _run.Progress(label, len(todo) * turns_per_run * per_turn[0], "")
        reference: dict[str, list[int]] | None = None
        for i, name in enumerate(names):
            run = data["runs"].get(name)
            if name in todo:
                factory_desc = cache_factory(name, model.config, args)[1]
                run = data["runs"][name] = {"description": factory_desc, "complete": False, "rows": []}
                bar.doing(name)
                t_start = time.perf_counter()

                def on_turn(row: dict[str, Any], run: dict[str, Any] = run, t_start: float = t_start) -> None:
                    run["rows"].append(row)
                    per_turn[0] = (time.perf_counter() - t_start) / len(run["rows"])
                    left = sum(turns_per_run - len(data["runs"].get(n, {}).get("rows", [])) for n in todo)
                    bar.step(left * per_turn[0])
                    if len(run["rows"]) % args.sessions == 0:  # partial results once a round
                        run["summary"] = summarize(run["rows"], args.late_round)
                        save()

                with _sdpa.backends(args.sdpa):
                    run.update(run_cache(name, model, tokens, workload, args, reference, on_turn))
                run["summary"] = summarize(run["rows"], args.late_round)
                run["complete"] = True
                save()
            if i == 0:  # the answers the other caches are fed
                reference = {f"{r['session']}:{r['round'] - 1}": r["answer"] for r in run["rows"]}
        missing = [n for n in names if n not in data["stream"]]
        if args.stream_tokens and missing:
            bar.doing("streamed agreement")
            text_ids = tokenizer(_lm.reference_text(), return_tensors="pt", add_special_tokens=False).input_ids
            ids = text_ids[:, :args.stream_tokens].to(args.device)
            data["stream_info"] = {"tokens": ids.shape[1], **_lm.text_info(_lm.reference_text(), _lm.PPL_TOPICS)}
            ref = stream_agreement(model, ids, cache_factory(args.reference, model.config, args)[0])
            for name in missing:
                preds = stream_agreement(model, ids, cache_factory(name, model.config, args)[0])
                data["stream"][name] = {"agreement": sum(x == y for x, y in zip(preds, ref)) / len(ref),
                                        "positions": len(ref)}
                save()
        data["complete"] = all(r.get("complete") for r in data["runs"].values())
        bar.doing("report")
        save()
        plotted = not args.no_plot and plot(data, stem.with_suffix(".png"))
        bar.step(0.0)
        bar.close()
    print(markdown(data))
    print(f"wrote {stem}.json, .md" + (", .png" if plotted else ""))
    return data


if __name__ == "__main__":
    main()
