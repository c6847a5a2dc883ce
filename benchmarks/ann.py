#!/usr/bin/env python
"""Exhaustive (flat) ANN search over 1-4 bit codes: tqindex against faiss and turbovec.

For every bit width b, each tqindex encoder at b bits ("tq{b}", "tq{b}-norm", "tq{b}-prod", "tq{b}-pca"
(trained on the base vectors), "fp4" at b = 4, plus "tq{b}(rescale=...)" for per-vector scale modes no registry name selects) in a
:class:`tqindex.FlatIndex`, and the baselines of ``_baselines.py`` at the same bits or
bytes (faiss TurboQuant scalar quantizers, EDEN, RaBitQ, RaBitQ FastScan, PQ and PQ FastScan sized
to tqindex's bytes per vector, classic SQ4, turbovec), are built on the same base vectors and
searched with the same queries. Per method: bytes per vector (codes + per-vector side data), build
time (train + add; the best of up to 3 builds when they are quick), recall@1@k for k = 1, 2, 4, ...,
64 and recall@10@10 from exact scores (ties with the true neighbours count; one k=64 search, sliced),
and queries per second of one batched search at each thread count (best of a few runs).

Cosine data are normalized and searched by inner product. Full runs write ``ann_<dataset>.json``
(environment, arguments, rows, summary), ``ann_<dataset>.md`` and ``ann_<dataset>.png`` to
``benchmarks/results/``; ``--quick`` is a seconds-long smoke run into a temporary directory.

    python benchmarks/ann.py                          # glove-50-100k, b = 1..4, every method
    python benchmarks/ann.py --dataset minilm-384 --bits 2,4 --methods tq,rabitq
    python benchmarks/ann.py --quick
"""

from __future__ import annotations

import os

# faiss must not spin-wait in OpenMP: on a loaded machine an actively spinning pool slows it badly.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _baselines as B  # noqa: E402
import _env  # noqa: E402

import tqindex as tq  # noqa: E402
from tqindex.data import Dataset, ground_truth, load_dataset  # noqa: E402
from tqindex.metrics import recall_by_score  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_SKIP = r"faiss-sq-tq\d"
"""Methods left out unless --skip says otherwise (see its help)."""
QUICK_METHODS = r"^tq\d(-norm)?$,tqmse,eden\d$,rabitq-fs,pq-fs,^turbovec\d$"
"""Methods of a ``--quick`` run (comma-separated regular expressions)."""
BUILD_ROUNDS, BUILD_REPEAT_S = 5, 3.0
"""A build is repeated, up to BUILD_ROUNDS times in all, while the builds so far took under
BUILD_REPEAT_S seconds; the fastest counts."""


# ------------------------------------------------------------------------------------ methods

class TQMethod(B.Baseline):
    """A tqindex FlatIndex over one registry encoder (with optional configuration overrides, then
    named ``"encoder(field=value)"``); build time includes making (and, for learned encoders such as
    "tq{b}-pca", training) the encoder."""

    def __init__(self, encoder: str, dim: int, bits: int, metric: str, **overrides: Any) -> None:
        enc = tq.make_encoder(encoder, dim, **overrides)
        name = encoder + ("(" + ",".join(f"{k}={v}" for k, v in overrides.items()) + ")"
                          if overrides else "")
        super().__init__(name, "tqindex", bits, notes=repr(enc))
        self.encoder, self.overrides = encoder, overrides
        self.dim, self.metric = dim, metric
        self.code_size = enc.code_size
        self.index: tq.FlatIndex | None = None

    def build(self, x: np.ndarray) -> None:
        enc = tq.make_encoder(self.encoder, self.dim, **self.overrides)
        self.index = tq.FlatIndex(enc, metric=self.metric)
        if not enc.is_trained:
            self.index.train(x)
            self.code_size = enc.code_size
        self.index.add(x, progress=False)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        assert self.index is not None
        return self.index.search(q, k, progress=False)

    @property
    def bytes_per_vector(self) -> float:
        return float(self.code_size)


def tq_encoders(bits: int) -> list[str]:
    """Registry encoders at ``bits`` per coordinate: "tq{b}", "tq{b}-*" (and "fp4" at 4 bits)."""
    names = [n for n in tq.encoder_names() if re.fullmatch(rf"tq{bits}(-.+)?", n)]
    names.sort(key=lambda n: (n != f"tq{bits}", n))  # the default mode first
    if bits == 4 and "fp4" in tq.encoder_names():
        names.append("fp4")
    return names


def rescale_variants(bits: int, dim: int) -> list[dict[str, Any]]:
    """Overrides of "tq{b}" for the TurboQuantMSE per-vector scale modes that no registry name
    selects (e.g. ``{"rescale": "unbiased"}``): measured beside the registry encoders."""
    default = tq.make_encoder(f"tq{bits}", dim)
    modes = getattr(sys.modules[type(default).__module__], "RESCALE_MODES", ())
    named = {getattr(tq.make_encoder(n, dim), "rescale", None) for n in tq_encoders(bits)}
    return [{"rescale": m} for m in modes if m not in named]


def methods_for(bits: int, dim: int, metric: str, unit_norm: bool,
                train_rows: int | None = None) -> list[B.Baseline]:
    """Every method compared at ``bits``: tqindex encoders first, then the baselines."""
    out: list[B.Baseline] = [TQMethod(n, dim, bits, metric) for n in tq_encoders(bits)]
    out += [TQMethod(f"tq{bits}", dim, bits, metric, **o) for o in rescale_variants(bits, dim)]
    target = tq.make_encoder(f"tq{bits}", dim).code_size
    return out + B.baselines_for(dim, bits, metric, unit_norm, target, train_rows=train_rows)


def selected(name: str, patterns: list[str] | None, skip: list[str] | None = None) -> bool:
    """Whether method ``name`` matches any of ``patterns`` (all when None) and none of ``skip``
    (regular expressions, searched anywhere in the name: plain substrings work)."""
    return ((patterns is None or any(re.search(p, name) for p in patterns))
            and not any(re.search(p, name) for p in skip or []))


# ------------------------------------------------------------------------------- measurement

def recall_ks(k: int) -> list[int]:
    """1, 2, 4, ... up to k."""
    return [2**i for i in range(int(np.log2(k)) + 1)]


def timing_batch(qps_estimate: float, args: argparse.Namespace) -> int:
    """Queries per timed search: ``--timing-queries``, fewer (down to 100) for a method so slow that
    one search would take more than half of ``--time-budget`` at its recall-search speed."""
    floor = min(100, args.timing_queries)
    fit = int(qps_estimate * args.time_budget / 2)
    return max(floor, min(args.timing_queries, fit))


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


def measure(method: B.Baseline, base: np.ndarray, queries: np.ndarray, true: np.ndarray, metric: str,
            args: argparse.Namespace) -> dict[str, Any]:
    """Build ``method`` on base and search queries once for recall (scored against the exact scores
    ``true`` [nq, >=10] of the true neighbours, so ties count); QPS comes later (:func:`time_rounds`)."""
    B.set_threads(max(args.threads))
    builds: list[float] = []
    while len(builds) < BUILD_ROUNDS and sum(builds) < BUILD_REPEAT_S:
        t0 = time.perf_counter()
        method.build(base)
        builds.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    _, ids = method.search(queries, args.k)
    recall_s = time.perf_counter() - t0
    found = exact_scores(base, queries, np.asarray(ids, dtype=np.int64), metric)
    return {
        "method": method.name, "family": method.family, "bits": method.bits,
        "bytes_per_vector": round(float(method.bytes_per_vector), 3),
        "build_s": round(min(builds), 4),
        "recall@1@k": {str(k): round(recall_by_score(found, true, 1, k), 4) for k in recall_ks(args.k)},
        "recall@10@10": round(recall_by_score(found, true, 10, 10), 4),
        "timing_queries": timing_batch(len(queries) / recall_s, args),
        "notes": method.notes,
    }


def time_rounds(built: list[tuple[B.Baseline, dict[str, Any]]], queries: np.ndarray,
                args: argparse.Namespace) -> None:
    """QPS of one batched search of each built method's ``timing_queries`` queries, per thread count,
    in ``args.repeats`` rounds, each of which times every method once, so a slower spell of the
    machine falls on all methods alike. Writes each round's QPS (``qps_rounds_{t}t``) and the best
    (``qps_{t}t``) into each row."""
    live = list(built)
    for _ in tqdm(range(args.repeats), desc="timing rounds", unit="round"):
        for method, row in list(live):
            timing = queries[: row["timing_queries"]]
            try:
                for t in args.threads:
                    seconds = method.timed_search(timing, args.k, t)
                    row.setdefault(f"qps_rounds_{t}t", []).append(round(len(timing) / seconds, 1))
                    row[f"qps_{t}t"] = max(row[f"qps_rounds_{t}t"])
            except Exception as e:  # one broken baseline must not lose the others
                tqdm.write(f"{method.name}: {type(e).__name__}: {e}")
                row["error"] = f"{type(e).__name__}: {e}"
                live.remove((method, row))


def prepare_data(ds: Dataset, n_base: int | None, n_queries: int | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, str, bool]:
    """(base, queries, ground truth [nq, >=64], search metric, unit_norm) for a dataset.

    Cosine data are normalized and searched by inner product. A base subset (n_base) gets exact
    ground truth recomputed; a query subset keeps the stored ground truth rows.
    """
    base, queries, gt = ds.base, ds.queries, ds.neighbors
    if n_queries is not None:
        queries = queries[:n_queries]
        gt = None if gt is None else gt[:n_queries]
    if n_base is not None and n_base < len(base):
        base, gt = base[:n_base], None
    metric = ds.metric
    if metric == "cosine":
        base = base / np.maximum(np.linalg.norm(base, axis=1, keepdims=True), 1e-30)
        queries = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-30)
    if gt is None:
        gt = ground_truth(base, queries, min(100, len(base)), metric=metric)
    norms = np.linalg.norm(base, axis=1)
    unit_norm = bool(np.allclose(norms, 1.0, atol=1e-3))
    search_metric = "ip" if metric == "cosine" else metric
    return (np.ascontiguousarray(base, np.float32), np.ascontiguousarray(queries, np.float32),
            np.asarray(gt, np.int64), search_metric, unit_norm)


# ------------------------------------------------------------------------------------ reports

def environment(threads: list[int]) -> dict[str, Any]:
    """The shared benchmark environment block (``_env.py``) plus faiss's OpenMP wait policy."""
    env = _env.environment(threads=max(threads))
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY")
    return env


def summarize(rows: list[dict[str, Any]], threads: list[int]) -> list[dict[str, Any]]:
    """Per bit width: tqindex's default encoder "tq{b}" against every other method at that width, and
    the trained "tq{b}-pca" against every method of another family.

    ``qps_ratio_{t}t`` = best QPS of the tqindex method / best QPS of the other (> 1: tqindex faster), and
    ``qps_ratio_paired_{t}t`` the median over rounds of the two QPS measured in the same round (less
    moved by a slow spell that caught one method's best), beside both recalls.
    """
    out = []
    by_name = {r["method"]: r for r in rows if "error" not in r}
    for bits in sorted({r["bits"] for r in rows}):
        for ref in (by_name.get(f"tq{bits}"), by_name.get(f"tq{bits}-pca")):
            if ref is None:
                continue
            out += [_compare(ref, r, threads) for r in rows if r["bits"] == bits and "error" not in r
                    and r["method"] != ref["method"]
                    and (ref["method"] == f"tq{bits}" or r["family"] != ref["family"])]
    return out


def _compare(ref: dict[str, Any], r: dict[str, Any], threads: list[int]) -> dict[str, Any]:
    """One summary item: tqindex method ``ref`` against method ``r`` (see :func:`summarize`)."""
    item = {"bits": r["bits"], "tqindex": ref["method"], "baseline": r["method"],
            "tqindex_bytes": ref["bytes_per_vector"], "baseline_bytes": r["bytes_per_vector"],
            "tqindex_r1@1": ref["recall@1@k"]["1"], "baseline_r1@1": r["recall@1@k"]["1"],
            "tqindex_r10@10": ref["recall@10@10"], "baseline_r10@10": r["recall@10@10"]}
    for t in threads:
        item[f"qps_ratio_{t}t"] = round(ref[f"qps_{t}t"] / r[f"qps_{t}t"], 3)
        paired = [a / b for a, b in zip(ref[f"qps_rounds_{t}t"], r[f"qps_rounds_{t}t"])]
        item[f"qps_ratio_paired_{t}t"] = round(float(np.median(paired)), 3)
    return item


def markdown(result: dict[str, Any]) -> str:
    """The results as markdown: a per-method table and the per-bit-width comparisons (:func:`summarize`)."""
    args, env, threads = result["args"], result["env"], result["args"]["threads"]
    versions = env.get("versions", env)
    ks = ["1", "4", "16", "64"]
    lines = [f"# ANN benchmark: {result['dataset']['name']}", "",
             f"{result['dataset']['n_base']} base vectors, {result['dataset']['n_queries']} queries, "
             f"dim {result['dataset']['dim']}, metric {result['dataset']['metric']} "
             f"(searched as {result['dataset']['search_metric']}). Flat (exhaustive) search; QPS of one "
             f"batched k={args['k']} search of {args['timing_queries']} queries (fewer, down to 100, "
             f"for the slowest methods: see the JSON's timing_queries) right after the same search untimed, "
             f"best of {args['repeats']} rounds that each time every method once (a slower spell of the "
             f"machine falls on all methods alike), the process pinned to as many CPUs as threads. Build time (train + add, "
             f"{max(threads)} threads): the fastest of up to {BUILD_ROUNDS} builds while they took under "
             f"{BUILD_REPEAT_S:g} s in all. Recall counts a returned vector whose exact "
             f"score ties the true neighbour's (duplicates); with {result['dataset']['n_queries']} queries a "
             f"recall near 0.8 has a standard error of "
             f"{(0.16 / result['dataset']['n_queries']) ** 0.5:.4f}."
             + (f" Left out (--skip): {', '.join(args['skip'])}." if args.get('skip') else ""), "",
             f"git {env['git_sha'][:10]}{' (dirty)' if env['git_dirty'] else ''}, {env['cpu']}, "
             f"{env['nproc']} CPUs (load {env['load_average_at_start']}), torch {versions.get('torch')}, "
             f"faiss {versions.get('faiss-cpu')}, turbovec {versions.get('turbovec')}, {env['date_utc']}.",
             "",
             "| method | family | bits | B/vec | build s | " + " | ".join(f"R@1@{k}" for k in ks)
             + " | R@10@10 | " + " | ".join(f"QPS {t}t" for t in threads) + " |",
             "|---|---|--:|--:|--:|" + "--:|" * (len(ks) + 1 + len(threads))]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['family']} | {r['bits']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['method']} | {r['family']} | {r['bits']} | {r['bytes_per_vector']:g} | "
            f"{r['build_s']:.3f} | " + " | ".join(f"{r['recall@1@k'][k]:.3f}" for k in ks if k in r['recall@1@k'])
            + f" | {r['recall@10@10']:.3f} | "
            + " | ".join(f"{r[f'qps_{t}t']:,.0f}" for t in threads) + " |")
    if result["summary"]:
        lines += ["", "## tq{b} and tq{b}-pca against each method at the same bit width", "",
                  "QPS ratio > 1: tqindex is faster: best QPS over best QPS, then (paired) the median "
                  "over rounds of the ratio of the two searches timed in the same round. Recall R@1@1 / "
                  "R@10@10.", "",
                  "| bits | tqindex | method | B/vec (tq / it) | R@1@1 (tq / it) | R@10@10 (tq / it) | "
                  + " | ".join(f"QPS ratio {t}t | paired {t}t" for t in threads) + " |",
                  "|--:|---|---|--:|--:|--:|" + "--:|" * (2 * len(threads))]
        for s in result["summary"]:
            lines.append(
                f"| {s['bits']} | {s['tqindex']} | {s['baseline']} | {s['tqindex_bytes']:g} / {s['baseline_bytes']:g} | "
                f"{s['tqindex_r1@1']:.3f} / {s['baseline_r1@1']:.3f} | "
                f"{s['tqindex_r10@10']:.3f} / {s['baseline_r10@10']:.3f} | "
                + " | ".join(f"{s[f'qps_ratio_{t}t']:.2f} | {s[f'qps_ratio_paired_{t}t']:.2f}" for t in threads)
                + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    """recall@1@1 against bytes per vector (left) and QPS at the most threads (right), PNG.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tqindex[bench]')")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    t = max(result["args"]["threads"])
    families = sorted({r["family"] for r in rows}, key=lambda f: (f != "tqindex", f))
    markers = {1: "v", 2: "s", 3: "D", 4: "o"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    for i, fam in enumerate(families):
        color = f"C{i}"
        for r in (r for r in rows if r["family"] == fam):
            y = r["recall@1@k"]["1"]
            kw = dict(color=color, marker=markers.get(r["bits"], "x"), s=60 if fam == "tqindex" else 35,
                      alpha=0.9, edgecolors="k" if fam == "tqindex" else "none")
            ax1.scatter(r["bytes_per_vector"], y, **kw)
            ax2.scatter(r[f"qps_{t}t"], y, **kw)
            if fam == "tqindex":
                ax1.annotate(r["method"], (r["bytes_per_vector"], y), fontsize=7,
                             xytext=(3, 3), textcoords="offset points")
        ax1.scatter([], [], color=color, label=fam)
    for b, m in markers.items():
        ax1.scatter([], [], color="gray", marker=m, label=f"{b} bit")
    ax1.set(xlabel="bytes per vector (codes + side data)", ylabel="recall@1@1",
            title=f"{result['dataset']['name']}: recall@1@1 vs bytes")
    ax2.set(xscale="log", xlabel=f"queries per second ({t} threads, batched)", ylabel="recall@1@1",
            title="recall@1@1 vs QPS")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=None,
                   help="glove-50-100k (default), glove-50-20k, glove-50, minilm-384, or an "
                        ".hdf5/.h5/.parquet path")
    p.add_argument("--bits", default=None, help="comma-separated bit widths (default 1,2,3,4)")
    p.add_argument("--methods", default=None,
                   help="comma-separated regular expressions (plain substrings work); keep methods "
                        "whose name matches any (default: all)")
    p.add_argument("--skip", default=DEFAULT_SKIP,
                   help="comma-separated regular expressions; leave out methods whose name matches any "
                        f"(default {DEFAULT_SKIP!r}: faiss's Q_prod scalar quantizers search at 10-25 "
                        "queries/s here, half an hour per bit width for 10,000 queries; pass '' to include them)")
    p.add_argument("--n-base", type=int, default=None, help="use the first n base vectors")
    p.add_argument("--n-queries", type=int, default=None,
                   help="use the first n queries for recall (default: all)")
    p.add_argument("--timing-queries", type=int, default=None,
                   help="queries in each timed batched search (default 1000; fewer, down to 100, "
                        "for methods too slow to search them within half of --time-budget)")
    p.add_argument("--threads", default="1,2", help="thread counts for QPS (default 1,2)")
    p.add_argument("--repeats", type=int, default=None, help="timing rounds; each times every method once "
                   "per thread count and the best is kept (default 5)")
    p.add_argument("--time-budget", type=float, default=3.0,
                   help="a timed search of a slow method uses fewer queries, so it takes at most half of "
                        "this many seconds (default 3)")
    p.add_argument("--train-rows", type=int, default=None,
                   help="faiss indexes train on at most this many random base rows (default: all; "
                        "faiss then samples 256 per centroid)")
    p.add_argument("--k", type=int, default=64, help="results per query (default 64)")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/, "
                   "a temporary directory with --quick)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: glove-50-20k, 2000 base / 200 queries, bits 2,4, a few methods")
    args = p.parse_args(argv)
    q = args.quick
    args.dataset = args.dataset or ("glove-50-20k" if q else "glove-50-100k")
    args.bits = [int(b) for b in (args.bits or ("2,4" if q else "1,2,3,4")).split(",")]
    methods = args.methods or (QUICK_METHODS if q else None)
    args.methods = None if methods is None else [m for m in methods.split(",") if m]
    args.skip = [m for m in (args.skip or "").split(",") if m]
    args.n_base = args.n_base or (2000 if q else None)
    args.n_queries = args.n_queries or (200 if q else None)
    args.timing_queries = min(args.timing_queries or (200 if q else 1000), args.n_queries or 1000)
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    args.repeats = args.repeats or (1 if q else 5)
    if any(b not in (1, 2, 3, 4) for b in args.bits):
        p.error(f"--bits must be in 1..4, got {args.bits}")
    if args.k < 16 or args.k & (args.k - 1):
        p.error(f"--k must be a power of two >= 16 (recall@10@10 and recall@1@k), got {args.k}")
    if min(args.threads) < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def dataset_label(args: argparse.Namespace, n_base: int, full_n: int) -> str:
    """Name used in file names: the registry name or file stem, plus -n{n} for a base subset."""
    name = args.dataset if not Path(args.dataset).suffix else Path(args.dataset).stem
    return name + (f"-n{n_base}" if n_base < full_n else "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    ds = load_dataset(args.dataset, with_neighbors=args.n_base is None)  # a subset gets its own
    base, queries, gt, metric, unit_norm = prepare_data(ds, args.n_base, args.n_queries)
    true = exact_scores(base, queries, gt[:, :10], metric)
    label = dataset_label(args, len(base), len(ds.base))
    out_dir = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="tqindex-ann-")) if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(args.threads)
    dim = base.shape[1]
    methods = [m for b in args.bits for m in methods_for(b, dim, metric, unit_norm, args.train_rows)
               if selected(m.name, args.methods, args.skip)]
    if not methods:
        raise SystemExit(f"no method matches --methods {args.methods}")
    rows, built = [], []
    bar = tqdm(methods, desc=label, unit="method")
    for m in bar:
        bar.set_postfix_str(m.name)
        try:
            rows.append(measure(m, base, queries, true, metric, args))
            built.append((m, rows[-1]))
        except Exception as e:  # one broken baseline must not lose the others
            tqdm.write(f"{m.name}: {type(e).__name__}: {e}")
            rows.append({"method": m.name, "family": m.family, "bits": m.bits,
                         "error": f"{type(e).__name__}: {e}"})
            m.index = None
    time_rounds(built, queries, args)
    for m, _ in built:
        m.index = None
    result = {
        "benchmark": "ann",
        "dataset": {"name": label, "source": args.dataset, "n_base": len(base),
                    "n_queries": len(queries), "dim": dim, "metric": ds.metric,
                    "search_metric": metric, "unit_norm": unit_norm},
        "env": env,
        "args": {k: v for k, v in vars(args).items()},
        "rows": rows,
        "summary": summarize(rows, args.threads),
    }
    stem = str(out_dir / f"ann_{label}")
    Path(stem + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(stem + ".md").write_text(markdown(result))
    plotted = not args.no_plot and plot(result, Path(stem + ".png"))
    print(markdown(result))
    print(f"wrote {stem}.json, .md" + (", .png" if plotted else ""))
    return result


if __name__ == "__main__":
    main()
