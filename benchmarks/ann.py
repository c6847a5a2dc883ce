#!/usr/bin/env python
"""Exhaustive (flat) ANN search over 1-4 bit codes: tqindex against faiss and turbovec.

The default run (about 2 minutes on 2 cores, data preparation included) takes GloVe-50 (100k base
vectors, the first 5k of its 10k queries) at 2 and 4 bits: tqindex's "tq{b}", trellis-coded "tcq{b}" and
trained "tq{b}-pca" against the strongest baselines (faiss PQ fast scan at tqindex's bytes, faiss RaBitQ fast
scan, faiss's TurboQuant scalar quantizer, turbovec plain and calibrated), prints a short summary (one line per
method) and writes a table and a plot. ``--full`` is the whole sweep: b = 1..4, all 10k queries, every
tqindex encoder ("tq{b}", "tq{b}-*", "tcq{b}", "tcq{b}-*", "fp4" at b = 4, "tq{b}(rescale=...)" for per-vector
scale modes no registry name selects) and every baseline of ``_baselines.py`` (faiss TurboQuant, EDEN, RaBitQ,
RaBitQ fast scan, PQ and PQ fast scan sized to tqindex's bytes, SQ4, turbovec), with more timing rounds.

Per method: the code size (codes + per-vector side data), the memory the index holds per vector (codes
as stored, ids where stored) and once (rotations, codebooks, the PCA basis: per vector at this n),
build time (train + add, the fastest of a few builds when they are quick), recall@1@k for k = 1, 2,
4, ..., 64 and recall@10@10 from exact scores (ties with the true neighbours count; one k=64 search,
sliced), and queries per second of one batched search at each thread count, the best of
``--repeats`` rounds that each time every method once. Every trained method (tq{b}-pca, faiss PQ,
RaBitQ, SQ, turbovec's calibration) trains on the same ``--train-rows`` seeded random base rows.
Cosine data are normalized and searched by inner product.

A run writes ``ann_<dataset>.json`` (environment, arguments, rows, summary; rewritten after every
step), ``.md`` and ``.png`` into a new folder ``benchmarks/runs/ann-<dataset>-<time>/``, or into
``--out``, where a run stopped by Ctrl-C or a crash continues from what it measured. The reference
results in ``benchmarks/results/`` are written only by naming that folder, from a clean tree.

    python benchmarks/ann.py                          # the default run
    python benchmarks/ann.py --full                   # every method at 1-4 bits (tens of minutes)
    python benchmarks/ann.py --dataset minilm-384 --bits 2,4 --methods tq,rabitq
    python benchmarks/ann.py --quick                  # seconds-long smoke run
"""

from __future__ import annotations

import os

# faiss must not spin-wait in OpenMP: on a loaded machine an actively spinning pool slows it badly.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _baselines as B  # noqa: E402
import _env  # noqa: E402
import _run  # noqa: E402

import tqindex as tq  # noqa: E402
from tqindex.data import GT_K, Dataset, cached_ground_truth, ground_truth, load_dataset  # noqa: E402
from tqindex.directions import RESCALE_MODES  # noqa: E402
from tqindex.metrics import recall_by_score  # noqa: E402

DEFAULT_METHODS = r"^tq\d$,^tcq\d$,^tq\d-pca$,^faiss-sq-tqmse\d$,^faiss-rabitq-fs,^faiss-pq-fs,^turbovec\d"
"""Methods of the default run (comma-separated regular expressions)."""
QUICK_METHODS = r"^tq\d(-norm)?$,^tcq\d$,tqmse\d$,eden\d$,rabitq-fs,pq-fs,^turbovec\d$"
"""Methods of a ``--quick`` run."""
DEFAULT_SKIP = r"faiss-sq-tq\d-unpadded"
"""Methods left out unless --skip says otherwise (see its help)."""
BUILD_ROUNDS = 5
"""A build is repeated, up to BUILD_ROUNDS times in all, while the builds so far took under
``--build-budget`` seconds; the fastest counts."""
PROBE_QUERIES = 200
"""Queries of the untimed-for-results search after each build that sizes the remaining work."""
PRIOR_DATA_S, PRIOR_BUILD_S, PRIOR_QPS, REPORT_S = 8.0, 2.0, 2000.0, 3.0
"""Guesses for the progress estimate: ground truth, one method's builds and probe, a search's queries
per second (each counted as one measurement beside this run's own), and the report with its plot."""


# ------------------------------------------------------------------------------------ methods

class TQMethod(B.Baseline):
    """A tqindex FlatIndex over one registry encoder (with optional configuration overrides, then
    named ``"encoder(field=value)"``); build time includes making (and, for learned encoders such as
    "tq{b}-pca", training) the encoder. Memory is the index's ``memory_bytes()``: what it holds
    once trained and before adding (encoder tensors) is the fixed part, the growth per added vector
    the per-vector part."""

    def __init__(self, encoder: str, dim: int, bits: int, metric: str, **overrides: Any) -> None:
        enc = tq.make_encoder(encoder, dim, **overrides)
        name = encoder + ("(" + ",".join(f"{k}={v}" for k, v in overrides.items()) + ")"
                          if overrides else "")
        super().__init__(name, "tqindex", bits, notes=repr(enc))
        self.encoder, self.overrides = encoder, overrides
        self.dim, self.metric = dim, metric
        self.index: tq.FlatIndex | None = None
        self._fixed = 0

    def build(self, x: np.ndarray, train: np.ndarray | None = None) -> None:
        enc = tq.make_encoder(self.encoder, self.dim, **self.overrides)
        self.index = tq.FlatIndex(enc, metric=self.metric)
        if not enc.is_trained:
            self.index.train(x if train is None else train)
        self._fixed = self.index.memory_bytes()
        self.index.add(x, progress=False)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        assert self.index is not None
        return self.index.search(q, k, progress=False)

    @property
    def code_size(self) -> float:
        assert self.index is not None
        return float(self.index.encoder.code_size)

    def memory(self) -> B.Memory:
        assert self.index is not None
        return B.Memory((self.index.memory_bytes() - self._fixed) / self.index.ntotal, self._fixed)


def tq_encoders(bits: int) -> list[str]:
    """Registry encoders at ``bits`` per coordinate: "tq{b}", "tq{b}-*", the trellis codes "tcq{b}", "tcq{b}-*"
    (and "fp4" at 4 bits)."""
    names = [n for n in tq.encoder_names() if re.fullmatch(rf"t(c)?q{bits}(-.+)?", n)]
    names.sort(key=lambda n: (n != f"tq{bits}", n))  # the default mode first
    if bits == 4 and "fp4" in tq.encoder_names():
        names.append("fp4")
    return names


def rescale_variants(bits: int, dim: int) -> list[dict[str, Any]]:
    """Overrides of "tq{b}" for the TurboQuantMSE per-vector scale modes that no registry name
    selects (e.g. ``{"rescale": "unbiased"}``): measured beside the registry encoders."""
    default = tq.make_encoder(f"tq{bits}", dim)
    modes = RESCALE_MODES if hasattr(default, "rescale") else ()
    named = {getattr(tq.make_encoder(n, dim), "rescale", None) for n in tq_encoders(bits) if n.startswith("tq")}
    return [{"rescale": m} for m in modes if m not in named]


def methods_for(bits: int, dim: int, metric: str, unit_norm: bool) -> list[B.Baseline]:
    """Every method compared at ``bits``: tqindex encoders first, then the baselines."""
    out: list[B.Baseline] = [TQMethod(n, dim, bits, metric) for n in tq_encoders(bits)]
    out += [TQMethod(f"tq{bits}", dim, bits, metric, **o) for o in rescale_variants(bits, dim)]
    target = tq.make_encoder(f"tq{bits}", dim).code_size
    return out + B.baselines_for(dim, bits, metric, unit_norm, target)


def selected(name: str, patterns: list[str] | None, skip: list[str] | None = None) -> bool:
    """Whether method ``name`` matches any of ``patterns`` (all when None) and none of ``skip``
    (regular expressions, searched anywhere in the name: plain substrings work)."""
    return ((patterns is None or any(re.search(p, name) for p in patterns))
            and not any(re.search(p, name) for p in skip or []))


# ------------------------------------------------------------------------------------- data

def recall_ks(k: int) -> list[int]:
    """1, 2, 4, ... up to k."""
    return [2**i for i in range(int(np.log2(k)) + 1)]


def exact_scores(base: np.ndarray, queries: np.ndarray, ids: np.ndarray, metric: str) -> np.ndarray:
    """Exact scores (larger is better: <q, x>, or -||q - x||² for "l2") of base rows ``ids`` [nq, m]
    for each query; -inf where an id is -1."""
    out = np.full(ids.shape, -np.inf)
    for i in range(0, len(ids), 1000):
        idx, q = ids[i : i + 1000], queries[i : i + 1000, None, :].astype(np.float64)
        x = base[np.maximum(idx, 0)].astype(np.float64)  # [b, m, dim]
        s = -((x - q) ** 2).sum(-1) if metric == "l2" else (x * q).sum(-1)
        out[i : i + 1000] = np.where(idx >= 0, s, -np.inf)
    return out


def vectors(ds: Dataset, n_base: int | None, n_queries: int | None
            ) -> tuple[np.ndarray, np.ndarray, str, bool]:
    """(base, queries, search metric, unit_norm) of a dataset, first n_base / n_queries rows.

    Cosine data are normalized and searched by inner product ("ip").
    """
    base, queries = ds.base[:n_base], ds.queries[:n_queries]
    if ds.metric == "cosine":
        base = base / np.maximum(np.linalg.norm(base, axis=1, keepdims=True), 1e-30)
        queries = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-30)
    unit_norm = bool(np.allclose(np.linalg.norm(base, axis=1), 1.0, atol=1e-3))
    search_metric = "ip" if ds.metric == "cosine" else ds.metric
    return (np.ascontiguousarray(base, np.float32), np.ascontiguousarray(queries, np.float32),
            search_metric, unit_norm)


def truth(ds: Dataset, base: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Ids of the true neighbours [nq, <=100] int64 of ``queries`` (the first rows of ds.queries) in
    ``base`` (the first rows of ds.base): the dataset's own where it has them, else exact search, cached
    (see :func:`tqindex.data.cached_ground_truth`) for the whole base, computed afresh for a subset."""
    nq = len(queries)
    if len(base) < len(ds.base):
        return ground_truth(base, queries, min(GT_K, len(base)), metric="ip" if ds.metric == "cosine" else ds.metric)
    if ds.neighbors is not None:
        return np.asarray(ds.neighbors[:nq], np.int64)
    return cached_ground_truth(ds.name, ds.base, ds.queries[:nq], min(GT_K, len(ds.base)), metric=ds.metric)


def prepare_data(ds: Dataset, n_base: int | None, n_queries: int | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, str, bool]:
    """(base, queries, ground truth [nq, <=100], search metric, unit_norm): :func:`vectors` and
    :func:`truth` in one call."""
    base, queries, metric, unit_norm = vectors(ds, n_base, n_queries)
    return base, queries, truth(ds, base, queries), metric, unit_norm


def training_rows(base: np.ndarray, rows: int) -> np.ndarray:
    """The training rows every trained method gets: ``rows`` seeded random base rows in base order
    (all of them when base has no more)."""
    if rows >= len(base):
        return base
    return base[np.sort(np.random.default_rng(0).choice(len(base), rows, replace=False))]


# ------------------------------------------------------------------------------- measurement

@dataclass
class Job:
    """One method of a run and its result row; ``qps``: its measured search speed at the most threads
    (0 until measured), which sizes its timed searches and the progress estimate."""

    method: B.Baseline
    row: dict[str, Any]
    qps: float = 0.0
    built: bool = False

    def needs(self, args: argparse.Namespace) -> str | None:
        """What this job measures next: "build", "recall", "timing" or None (done or failed)."""
        r = self.row
        if "error" in r:
            return None
        if "recall@10@10" not in r:
            return "build" if not self.built else "recall"
        if min(len(r.get(f"qps_rounds_{t}t", [])) for t in args.threads) < args.repeats:
            return "build" if not self.built else "timing"
        return None


def timing_batch(qps: float, args: argparse.Namespace) -> int:
    """Queries per timed search: ``--timing-queries``, fewer (down to 100) for a method so slow that
    one search would take more than half of ``--time-budget`` at ``qps``."""
    floor = min(100, args.timing_queries)
    return max(floor, min(args.timing_queries, int(qps * args.time_budget / 2)))


def build(job: Job, base: np.ndarray, train: np.ndarray, queries: np.ndarray,
          args: argparse.Namespace) -> None:
    """Build the job's method (at the most threads). A first build of a row is repeated while quick
    (see BUILD_ROUNDS) and writes build time, code size and memory into the row; a rebuild (a resumed
    run) only restores the index for timing. Then ``job.qps`` from a probe search (or the recall search
    of the row)."""
    B.set_threads(max(args.threads))
    row, times = job.row, []
    while not times or ("build_s" not in row and len(times) < BUILD_ROUNDS and sum(times) < args.build_budget):
        t0 = time.perf_counter()
        job.method.build(base, train)
        times.append(time.perf_counter() - t0)
    job.built = True
    if "build_s" not in row:
        memory = job.method.memory()
        row.update({"build_s": round(min(times), 4), "builds": len(times),
                    "code_size": round(job.method.code_size, 3),
                    "memory_per_vector": round(memory.per_vector, 3), "trained_bytes": memory.fixed,
                    "trained_per_vector": round(memory.fixed / len(base), 3)})
    if "recall_search_s" in row:
        job.qps = len(queries) / row["recall_search_s"]
    else:
        probe = queries[:PROBE_QUERIES]
        t0 = time.perf_counter()
        job.method.search(probe, args.k)
        job.qps = len(probe) / (time.perf_counter() - t0)


def recall(job: Job, base: np.ndarray, queries: np.ndarray, true: np.ndarray, metric: str,
           args: argparse.Namespace) -> None:
    """Search every query once (at the most threads) and write recall (scored against the exact scores
    ``true`` [nq, >=10] of the true neighbours, so ties count) and the timing batch into the row."""
    B.set_threads(max(args.threads))
    t0 = time.perf_counter()
    _, ids = job.method.search(queries, args.k)
    seconds = time.perf_counter() - t0
    found = exact_scores(base, queries, np.asarray(ids, dtype=np.int64), metric)
    job.qps = len(queries) / seconds
    job.row.update({
        "recall@1@k": {str(k): round(recall_by_score(found, true, 1, k), 4) for k in recall_ks(args.k)},
        "recall@10@10": round(recall_by_score(found, true, 10, 10), 4),
        "recall_search_s": round(seconds, 4), "timing_queries": timing_batch(job.qps, args)})


def time_once(method: B.Baseline, row: dict[str, Any], queries: np.ndarray, args: argparse.Namespace) -> None:
    """One timing round of one row: QPS of one batched search of the row's ``timing_queries`` queries
    at each thread count (right after the same search untimed), appended to ``qps_rounds_{t}t``; the
    best so far in ``qps_{t}t``. All thread counts or none are written (an interrupt leaves none)."""
    timing = queries[: row["timing_queries"]]
    qps = {t: round(len(timing) / method.timed_search(timing, args.k, t), 1) for t in args.threads}
    for t, v in qps.items():
        row.setdefault(f"qps_rounds_{t}t", []).append(v)
        row[f"qps_{t}t"] = max(row[f"qps_rounds_{t}t"])


def estimate_left(jobs: list[Job], args: argparse.Namespace, n_queries: int, build_s: list[float]) -> float:
    """Seconds the rest of the run should take: builds (the mean so far), recall searches and timing
    rounds at each job's measured speed (the mean speed until measured; 1 thread at half the speed of
    2), and the report. The means start from the PRIOR_* guesses."""
    speeds = [PRIOR_QPS] + [j.qps for j in jobs if j.qps]
    mean_qps = len(speeds) / sum(1 / s for s in speeds)  # per query: the mean time
    per_build = float(np.mean([PRIOR_BUILD_S, *build_s]))
    left = REPORT_S
    for j in jobs:
        step = j.needs(args)
        if step is None:
            continue
        qps = j.qps or mean_qps
        left += per_build if step == "build" else 0.0
        left += n_queries / qps if "recall@10@10" not in j.row else 0.0
        batch = j.row.get("timing_queries") or timing_batch(qps, args)
        for t in args.threads:
            rounds = args.repeats - len(j.row.get(f"qps_rounds_{t}t", []))
            left += rounds * 2 * batch / (qps * t / max(args.threads))
    return left


# ------------------------------------------------------------------------------------ reports

def environment(threads: list[int]) -> dict[str, Any]:
    """The shared benchmark environment block (``_env.py``) plus faiss's OpenMP wait policy."""
    env = _env.environment(threads=max(threads))
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY")
    return env


def bytes_held(row: dict[str, Any]) -> float:
    """All the memory a method's index holds, per vector at the run's n: per-vector bytes plus the
    bytes held once spread over the vectors."""
    return row["memory_per_vector"] + row["trained_per_vector"]


def summarize(rows: list[dict[str, Any]], threads: list[int]) -> list[dict[str, Any]]:
    """Per bit width with a "tq{b}" row: every finished method at that width, best recall@1@1 first,
    against "tq{b}" (tqindex's default encoder): ``recall_gain`` = tq{b}'s R@1@1 - the method's,
    ``qps_ratio_{t}t`` = tq{b}'s best QPS / the method's (> 1: tq{b} faster) and
    ``qps_ratio_paired_{t}t`` the median over rounds of the two QPS measured in the same round (less
    moved by a slow spell that caught one method's best)."""
    done = [r for r in rows if "error" not in r and f"qps_{threads[-1]}t" in r]
    out = []
    for bits in sorted({r["bits"] for r in done}):
        ref = next((r for r in done if r["method"] == f"tq{bits}"), None)
        if ref is None:
            continue
        for r in sorted((r for r in done if r["bits"] == bits), key=lambda r: -r["recall@1@k"]["1"]):
            item = {"bits": bits, "method": r["method"], "family": r["family"], "reference": ref["method"],
                    "r1@1": r["recall@1@k"]["1"], "r10@10": r["recall@10@10"],
                    "bytes_per_vector": round(bytes_held(r), 2),
                    "recall_gain": round(ref["recall@1@k"]["1"] - r["recall@1@k"]["1"], 4)}
            for t in threads:
                item[f"qps_{t}t"] = r[f"qps_{t}t"]
                item[f"qps_ratio_{t}t"] = round(ref[f"qps_{t}t"] / r[f"qps_{t}t"], 3)
                paired = [a / b for a, b in zip(ref[f"qps_rounds_{t}t"], r[f"qps_rounds_{t}t"])]
                item[f"qps_ratio_paired_{t}t"] = round(float(np.median(paired)), 3)
            out.append(item)
    return out


def summary_lines(summary: list[dict[str, Any]], threads: list[int]) -> list[str]:
    """The summary as text, one line per method: its recall, bytes and speed, and how tq{b} compares."""
    t = max(threads)
    lines: list[str] = []
    for bits in sorted({s["bits"] for s in summary}):
        items = [s for s in summary if s["bits"] == bits]
        ref = items[0]["reference"]
        lines.append(f"{bits} bits, best recall@1@1 first (B/vec: all index memory / n; QPS: {t} threads, "
                     f"batched; against {ref}):")
        width = max(len(s["method"]) for s in items)
        for s in items:
            vs = "" if s["method"] == ref else (
                f"  {ref} {s['recall_gain']:+.3f} recall at {s[f'qps_ratio_{t}t']:.2f}x the QPS")
            lines.append(f"  {s['method']:<{width}}  R@1@1 {s['r1@1']:.3f}  {s['bytes_per_vector']:6.2f} B/vec  "
                         f"{s[f'qps_{t}t']:>9,.0f} QPS{vs}")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The results as markdown: the summary, a per-method table and how each method was built."""
    args, env, ds = result["args"], result["env"], result["dataset"]
    threads, ks = args["threads"], ["1", "4", "16", "64"]
    versions = env.get("versions", env)
    state = "" if result.get("complete") else " **Unfinished run: rows without QPS are still to be timed.**"
    lines = [
        f"# ANN benchmark: {ds['name']}", "",
        f"{ds['n_base']} base vectors, {ds['n_queries']} queries, dim {ds['dim']}, metric {ds['metric']} "
        f"(searched as {ds['search_metric']}). Flat (exhaustive) search; QPS of one batched k={args['k']} "
        f"search of {args['timing_queries']} queries (fewer, down to 100, for methods too slow to search them "
        f"in {args['time_budget'] / 2:g} s: see the JSON's timing_queries) right after the same search "
        f"untimed, best of {args['repeats']} rounds that each time every method once (a slower spell of the "
        f"machine falls on all methods alike), the process pinned to as many CPUs as threads. Build time "
        f"(train + add, {max(threads)} threads): the fastest of up to {BUILD_ROUNDS} builds while they took "
        f"under {args['build_budget']:g} s in all. Every trained method (tq{{b}}-pca, faiss PQ / RaBitQ / SQ, "
        f"turbovec's calibration) trains on the same {ds['train_rows']:,} seeded random base rows (faiss's "
        f"own subsampling off). code B: bytes per vector of the code format (codes + per-vector side data); "
        f"held B/vec: what the index holds per vector (codes as stored, ids where stored); trained B/vec: "
        f"what it holds once (rotations, codebooks, PCA basis) divided by n. Recall counts a returned "
        f"vector whose exact score ties the true neighbour's (duplicates); with {ds['n_queries']} queries "
        f"a recall near 0.8 has a standard error of {(0.16 / ds['n_queries']) ** 0.5:.4f}."
        + (f" Left out (--skip): {', '.join(args['skip'])}." if args.get('skip') else "") + state, "",
        f"git {env['git_sha'][:10]}{' (dirty tree)' if env['git_dirty'] else ''}, {env['cpu']}, "
        f"{env['nproc']} CPUs (load {env['load_average_at_start']}), torch {versions.get('torch')}, "
        f"faiss {versions.get('faiss-cpu')}, turbovec {versions.get('turbovec')}, {env['date_utc']}"
        + (f", resumed {len(env['resumed'])}x" if env.get("resumed") else "") + ".", ""]
    if result["summary"]:
        lines += ["## Summary", "", "```", *summary_lines(result["summary"], threads), "```", ""]
    lines += ["## All methods", "",
              "| method | family | bits | code B | held B/vec | trained B/vec | build s | "
              + " | ".join(f"R@1@{k}" for k in ks) + " | R@10@10 | " + " | ".join(f"QPS {t}t" for t in threads) + " |",
              "|---|---|--:|--:|--:|--:|--:|" + "--:|" * (len(ks) + 1 + len(threads))]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['family']} | {r['bits']} | error: {r['error']} |")
        elif "recall@10@10" in r:
            lines.append(
                f"| {r['method']} | {r['family']} | {r['bits']} | {r['code_size']:g} | {r['memory_per_vector']:g} | "
                f"{r['trained_per_vector']:g} | {r['build_s']:.3f} | "
                + " | ".join(f"{r['recall@1@k'][k]:.3f}" for k in ks if k in r["recall@1@k"])
                + f" | {r['recall@10@10']:.3f} | "
                + " | ".join(f"{r[f'qps_{t}t']:,.0f}" if f"qps_{t}t" in r else "-" for t in threads) + " |")
    lines += ["", "## How each method was built", ""]
    lines += [f"- {r['method']}: {r['notes']}" for r in result["rows"] if r.get("notes")]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    """recall@1@1 against bytes held per vector (left) and QPS at the most threads (right), PNG.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tqindex[bench]')")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = max(result["args"]["threads"])
    rows = [r for r in result["rows"] if "error" not in r and f"qps_{t}t" in r]
    families = sorted({r["family"] for r in rows}, key=lambda f: (f != "tqindex", f))
    markers = {1: "v", 2: "s", 3: "D", 4: "o"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    for i, fam in enumerate(families):
        color = f"C{i}"
        for r in (r for r in rows if r["family"] == fam):
            y = r["recall@1@k"]["1"]
            kw = dict(color=color, marker=markers.get(r["bits"], "x"), s=60 if fam == "tqindex" else 35,
                      alpha=0.9, edgecolors="k" if fam == "tqindex" else "none")
            ax1.scatter(bytes_held(r), y, **kw)
            ax2.scatter(r[f"qps_{t}t"], y, **kw)
            ax1.annotate(r["method"], (bytes_held(r), y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax1.scatter([], [], color=color, label=fam)
    for b, m in markers.items():
        ax1.scatter([], [], color="gray", marker=m, label=f"{b} bit")
    env = result["env"]
    ax1.set(xlabel="bytes per vector held in memory (all index memory / n)", ylabel="recall@1@1",
            title=f"{result['dataset']['name']}: recall@1@1 vs bytes")
    ax2.set(xscale="log", xlabel=f"queries per second ({t} threads, batched)", ylabel="recall@1@1",
            title="recall@1@1 vs QPS")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="lower right")
    fig.text(0.99, 0.005, f"git {env['git_sha'][:10]}{' (dirty tree)' if env['git_dirty'] else ''}, "
             f"{env['date_utc']}", ha="right", va="bottom", fontsize=7, color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true",
                   help="the whole sweep: bits 1-4, every method (but --skip), 5 timing rounds")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: glove-50-20k, 2000 base / 200 queries, bits 2,4, a few methods")
    p.add_argument("--dataset", default=None,
                   help="glove-50-100k (default), glove-50-20k, glove-50, minilm-384, or an "
                        ".hdf5/.h5/.parquet path")
    p.add_argument("--bits", default=None, help="comma-separated bit widths (default 2,4; --full 1,2,3,4)")
    p.add_argument("--methods", default=None,
                   help="comma-separated regular expressions (plain substrings work); keep methods "
                        f"whose name matches any (default {DEFAULT_METHODS!r}; --full: all)")
    p.add_argument("--skip", default=DEFAULT_SKIP,
                   help="comma-separated regular expressions; leave out methods whose name matches any "
                        f"(default {DEFAULT_SKIP!r}: faiss's Q_prod scalar quantizers at an unpadded d search "
                        "at 7-15 queries/s on one core here, tens of minutes each for 10,000 queries; pass '' "
                        "to include them)")
    p.add_argument("--n-base", type=int, default=None, help="use the first n base vectors")
    p.add_argument("--n-queries", type=int, default=None,
                   help="use the first n queries for recall (default 5000; --full: all)")
    p.add_argument("--timing-queries", type=int, default=None,
                   help="queries in each timed batched search (default 1000; fewer, down to 100, "
                        "for methods too slow to search them within half of --time-budget)")
    p.add_argument("--threads", default="1,2", help="thread counts for QPS (default 1,2)")
    p.add_argument("--repeats", type=int, default=None, help="timing rounds; each times every method once "
                   "per thread count and the best is kept (default 3; --full 5)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="a timed search of a slow method uses fewer queries, so it takes at most half of "
                        "this many seconds (default 1.5; --full 3)")
    p.add_argument("--train-rows", type=int, default=None,
                   help="every trained method trains on these many seeded random base rows (default 10000; "
                        "--full 65536, the rows faiss itself samples for an 8-bit PQ codebook)")
    p.add_argument("--build-budget", type=float, default=None,
                   help=f"a build is repeated (up to {BUILD_ROUNDS} builds) while the builds so far took "
                        "under this many seconds, and the fastest counts (default 1; --full 3)")
    p.add_argument("--k", type=int, default=64, help="results per query (default 64)")
    p.add_argument("--out", default=None, help="run folder (default: a new benchmarks/runs/ann-<dataset>-<time>/); "
                   "one holding an unfinished run of the same arguments continues it")
    p.add_argument("--restart", action="store_true", help="measure afresh even where --out holds results")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    q, full = args.quick, args.full
    if q and full:
        p.error("--quick and --full exclude each other")
    args.dataset = args.dataset or ("glove-50-20k" if q else "glove-50-100k")
    args.bits = [int(b) for b in (args.bits or ("1,2,3,4" if full else "2,4")).split(",")]
    methods = args.methods or (QUICK_METHODS if q else None if full else DEFAULT_METHODS)
    args.methods = None if methods is None else [m for m in methods.split(",") if m]
    args.skip = [m for m in (args.skip or "").split(",") if m]
    args.n_base = args.n_base or (2000 if q else None)
    args.n_queries = args.n_queries or (200 if q else None if full else 5000)
    args.timing_queries = min(args.timing_queries or (200 if q else 1000), args.n_queries or 1000)
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    args.repeats = args.repeats or (1 if q else 5 if full else 3)
    args.time_budget = args.time_budget or (3.0 if full else 1.5)
    args.train_rows = args.train_rows or (65536 if full else 10000)
    args.build_budget = args.build_budget or (3.0 if full else 1.0)
    if any(b not in (1, 2, 3, 4) for b in args.bits):
        p.error(f"--bits must be in 1..4, got {args.bits}")
    if args.k < 16 or args.k & (args.k - 1):
        p.error(f"--k must be a power of two >= 16 (recall@10@10 and recall@1@k), got {args.k}")
    if min(args.threads) < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.train_rows < 2:
        p.error(f"--train-rows must be >= 2, got {args.train_rows}")
    return args


def dataset_label(args: argparse.Namespace) -> str:
    """Name used in file names: the registry name or file stem, plus -n{n} for a base subset."""
    name = args.dataset if not Path(args.dataset).suffix else Path(args.dataset).stem
    return name + (f"-n{args.n_base}" if args.n_base else "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    label = dataset_label(args)
    env = environment(args.threads)
    out_dir = _run.run_folder(args.out, f"ann-{label}", env)
    stem = out_dir / f"ann_{label}"
    results = _run.Results(stem.with_suffix(".json"), {
        "benchmark": "ann", "complete": False, "env": env, "args": dict(vars(args)), "rows": [],
        "summary": []}, restart=args.restart)
    data = results.data

    def save() -> None:
        data["summary"] = summarize(data["rows"], args.threads)
        results.save()
        if "dataset" in data:
            _run.write_atomic(stem.with_suffix(".md"), markdown(data))

    bar: _run.Progress | None = None

    def where() -> str:
        if bar is not None:
            bar.close()
        done = sum("recall@10@10" in r for r in data["rows"])
        return (f"{done} methods measured, saved in {stem}.json; resume with:\n  "
                + _run.resume_command(os.path.relpath(__file__), argv, out_dir))

    print(f"run folder {out_dir}" + (" (resumed)" if results.resumed else ""))
    with _run.interruptible(where):
        ds = load_dataset(args.dataset, with_neighbors=False)  # the ground truth is the first step below
        base, queries, metric, unit_norm = vectors(ds, args.n_base, args.n_queries)
        train = training_rows(base, args.train_rows)
        methods = [m for b in args.bits for m in methods_for(b, base.shape[1], metric, unit_norm)
                   if selected(m.name, args.methods, args.skip)]
        if not methods:
            raise SystemExit(f"no method matches --methods {args.methods} (and --skip {args.skip})")
        old = {r["method"]: r for r in data["rows"]}
        jobs = [Job(m, old.get(m.name) or {"method": m.name, "family": m.family, "bits": m.bits,
                                           "notes": m.notes}) for m in methods]
        data["rows"] = [j.row for j in jobs]
        build_s: list[float] = []
        bar = _run.Progress(label, PRIOR_DATA_S + estimate_left(jobs, args, len(queries), build_s), "ground truth")
        true = exact_scores(base, queries, truth(ds, base, queries)[:, :10], metric)
        data["dataset"] = {"name": label, "source": args.dataset, "n_base": len(base), "n_queries": len(queries),
                           "dim": base.shape[1], "metric": ds.metric, "search_metric": metric,
                           "unit_norm": unit_norm, "train_rows": len(train)}
        save()
        bar.step(estimate_left(jobs, args, len(queries), build_s))

        def attempt(job: Job, step: str, fn: Any, *a: Any) -> None:
            """Run one step of a job; an exception marks the row failed (one broken baseline must not
            lose the others); then save and update the bar."""
            bar.doing(f"{step} {job.method.name}")
            try:
                t0 = time.perf_counter()
                fn(job, *a)
                if step == "build":
                    build_s.append(time.perf_counter() - t0)
            except Exception as e:
                bar.write(f"{job.method.name}: {type(e).__name__}: {e}")
                job.row["error"] = f"{type(e).__name__}: {e}"
                job.method.index = None
            save()
            bar.step(estimate_left(jobs, args, len(queries), build_s))

        for job in jobs:
            if job.needs(args) == "build":
                attempt(job, "build", build, base, train, queries, args)
        for job in jobs:
            if job.needs(args) == "recall":
                attempt(job, "recall", recall, base, queries, true, metric, args)
        for r in range(args.repeats):
            for job in jobs:
                if job.needs(args) == "timing" and len(job.row.get(f"qps_rounds_{args.threads[0]}t", [])) <= r:
                    attempt(job, f"timing round {r + 1}", lambda j: time_once(j.method, j.row, queries, args))
        for job in jobs:
            job.method.index = None
        data["complete"] = True
        bar.doing("report")
        save()
        plotted = not args.no_plot and plot(data, stem.with_suffix(".png"))
        bar.step(0.0)
        bar.close()
    print("\n".join(summary_lines(data["summary"], args.threads)))
    print(f"wrote {stem}.json, .md" + (", .png" if plotted else ""))
    return data


if __name__ == "__main__":
    main()
