#!/usr/bin/env python
"""Inverted-file (IVF) ANN search over 1-4 bit codes: tqindex ``IVFIndex`` against faiss IVF indexes.

Every method clusters the base vectors into ``--nlist`` lists (k-means) and scans the ``nprobe``
lists nearest to each query: tqindex ``IVFIndex`` with "tq{b}" codes of the raw vectors, and faiss
``IVF{nlist},PQ{2B}x4fs`` (PQ fast scan at tqindex's B bytes per vector, d zero-padded as in
``ann.py``) and, at 4 bits, ``IVF{nlist},SQ4`` (zero-padded to a multiple of 8 for faiss's SIMD code,
and unpadded). All train on the same ``--train-rows`` seeded random base rows. Per method: code size
(what an inverted list stores per vector besides its id: faiss's ``code_size``), memory held per
vector (codes, ids) and once (centroids, codebooks, rotations; per vector at this n), build time;
for each nprobe: recall@1@k (k = 1, 4, 16, 64) and recall@10@10 from exact scores, and QPS of one
batched k=64 search of ``--timing-queries`` queries right after the same search untimed, best of
``--repeats`` rounds that each time every method once, at each thread count.

A run writes ``ivf_<dataset>.json`` and ``.md`` into a new folder ``benchmarks/runs/ivf-<dataset>-<time>/``
or into ``--out``, where a stopped run continues (as ``ann.py``).

    python benchmarks/ivf.py                       # glove-50-100k, nlist 1024, bits 2 and 4
    python benchmarks/ivf.py --nprobe 4,16 --repeats 3
    python benchmarks/ivf.py --quick               # seconds: 2000 base vectors, nlist 16
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in ann.py: no spinning OpenMP pools

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _baselines as B  # noqa: E402
import _run  # noqa: E402
import ann  # noqa: E402

import tqindex as tq  # noqa: E402
from tqindex.data import load_dataset  # noqa: E402
from tqindex.metrics import recall_by_score  # noqa: E402

KMEANS_ROWS_PER_LIST = 256
"""IVFIndex's k-means (faiss.Kmeans defaults) samples at most this many training rows per list."""


class TQIVF(B.Baseline):
    """tqindex ``IVFIndex`` over "tq{bits}" codes of the raw vectors; memory from ``memory_bytes()``
    (after training: the fixed part)."""

    def __init__(self, dim: int, bits: int, nlist: int, metric: str) -> None:
        super().__init__(f"tq{bits}-ivf", "tqindex", bits, notes=f"IVFIndex(tq{bits}, nlist={nlist})")
        self.dim, self.nlist, self.metric = dim, nlist, metric
        self.index: tq.IVFIndex | None = None
        self._fixed = 0

    def build(self, x: np.ndarray, train: np.ndarray | None = None) -> None:
        self.index = tq.IVFIndex(tq.make_encoder(f"tq{self.bits}", self.dim), self.nlist, metric=self.metric)
        self.index.train(x if train is None else train)
        self._fixed = self.index.memory_bytes()
        self.index.add(x, progress=False)

    def set_nprobe(self, nprobe: int) -> None:
        self.index.nprobe = nprobe

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(q, k, progress=False)

    @property
    def code_size(self) -> float:
        return float(self.index.encoder.code_size)

    def memory(self) -> B.Memory:
        return B.Memory((self.index.memory_bytes() - self._fixed) / self.index.ntotal, self._fixed)


class FaissIVF(B.FaissBaseline):
    """A faiss IVF index from a factory string, d zero-padded to ``pad_to`` (at ``columns``)."""

    def __init__(self, name: str, bits: int, spec: str, dim: int, metric: str, pad_to: int,
                 columns: np.ndarray | None = None, spread: bool = False) -> None:
        notes = f"index_factory({spec!r})" + (
            f", d zero-padded to {pad_to}" + (" (spread)" if spread else "") if pad_to != dim
            else ", d unpadded (faiss's scalar code path)" if dim % B.SIMD_MULTIPLE else "")
        super().__init__(name, "faiss-ivf", bits, B._factory(spec, metric), dim, pad_to=pad_to,
                         columns=columns, notes=notes)

    def set_nprobe(self, nprobe: int) -> None:
        B._faiss().extract_index_ivf(self.index).nprobe = nprobe


class AtNprobe:
    """A built IVF method searched at one nprobe (what :func:`ann.time_once` times)."""

    def __init__(self, method: Any, nprobe: int) -> None:
        self.method, self.nprobe = method, nprobe

    def timed_search(self, q: np.ndarray, k: int, threads: int) -> float:
        self.method.set_nprobe(self.nprobe)
        return self.method.timed_search(q, k, threads)


def methods_for(dim: int, bits: int, nlist: int, metric: str) -> list[Any]:
    """tqindex IVF at ``bits`` and the faiss IVF indexes at its bytes per vector (and SQ4, padded to a
    multiple of 8 and, where that changes d, unpadded, at 4 bits)."""
    m = 2 * tq.make_encoder(f"tq{bits}", dim).code_size
    pad, cols = B.spread_layout(dim, m)
    out = [TQIVF(dim, bits, nlist, metric),
           FaissIVF(f"faiss-ivf-pq-fs{m}x4", bits, f"IVF{nlist},PQ{m}x4fs", dim, metric, pad, cols, spread=True)]
    if bits == 4:
        simd = -(-dim // B.SIMD_MULTIPLE) * B.SIMD_MULTIPLE
        out.append(FaissIVF("faiss-ivf-sq4", bits, f"IVF{nlist},SQ4", dim, metric, simd))
        if simd != dim:
            out.append(FaissIVF("faiss-ivf-sq4-unpadded", bits, f"IVF{nlist},SQ4", dim, metric, dim))
    return out


def markdown(result: dict[str, Any]) -> str:
    """The results as a markdown table, one row per (method, nprobe)."""
    d, a, env = result["dataset"], result["args"], result["env"]
    threads = a["threads"]
    state = "" if result.get("complete") else " **Unfinished run: rows without QPS are still to be timed.**"
    lines = [f"# IVF benchmark: {d['name']}", "",
             f"{d['n_base']} base vectors, {d['n_queries']} queries, dim {d['dim']}, metric {d['metric']}; "
             f"nlist {a['nlist']}; every method trains on the same {d['train_rows']:,} seeded random base rows "
             f"(faiss's own subsampling off). QPS of one batched k={a['k']} search of {a['timing_queries']} "
             f"queries right after the same search untimed, best of {a['repeats']} rounds (each times every "
             "method once). code B: bytes an inverted list stores per vector besides its id; held B/vec: "
             "what the index holds per vector (codes, ids, block padding); trained B/vec: what it holds once "
             "(centroids, codebooks, rotations) divided by n." + state, "",
             f"git {env['git_sha'][:10]}{' (dirty tree)' if env['git_dirty'] else ''}, {env['cpu']}, "
             f"{env['nproc']} CPUs, torch {env['versions'].get('torch')}, faiss {env['versions'].get('faiss-cpu')}, "
             f"{env['date_utc']}.", "",
             "| method | bits | code B | held B/vec | trained B/vec | build s | nprobe | R@1@1 | R@1@16 | R@1@64 | "
             "R@10@10 | " + " | ".join(f"QPS {t}t" for t in threads) + " |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + "--:|" * len(threads)]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['bits']} | {r['code_size']:g} | {r['memory_per_vector']:g} | "
                     f"{r['trained_per_vector']:g} | {r['build_s']:.2f} | {r['nprobe']} | "
                     + " | ".join(f"{r['recall@1@k'][k]:.3f}" for k in ("1", "16", "64"))
                     + f" | {r['recall@10@10']:.3f} | "
                     + " | ".join(f"{r[f'qps_{t}t']:,.0f}" if f"qps_{t}t" in r else "-" for t in threads) + " |")
    lines += ["", "## How each method was built", ""]
    lines += [f"- {name}: {notes}" for name, notes in dict((r["method"], r["notes"]) for r in result["rows"]).items()]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="glove-50-100k", help="a dataset name of tqindex.data (default glove-50-100k)")
    p.add_argument("--bits", default="2,4", help="comma-separated bit widths (default 2,4)")
    p.add_argument("--nlist", type=int, default=1024, help="lists (default 1024)")
    p.add_argument("--nprobe", default="1,4,16,64", help="comma-separated nprobe values (default 1,4,16,64)")
    p.add_argument("--n-base", type=int, default=None, help="use the first n base vectors (default all)")
    p.add_argument("--n-queries", type=int, default=None, help="use the first n queries for recall (default all)")
    p.add_argument("--train-rows", type=int, default=None,
                   help=f"every method trains on these many seeded random base rows (default and most: "
                        f"{KMEANS_ROWS_PER_LIST} per list, what IVFIndex's k-means uses)")
    p.add_argument("--timing-queries", type=int, default=1000, help="queries in each timed search (default 1000)")
    p.add_argument("--threads", default="1,2", help="thread counts for QPS (default 1,2)")
    p.add_argument("--repeats", type=int, default=5, help="timing rounds (default 5)")
    p.add_argument("--k", type=int, default=64, help="results per query (default 64)")
    p.add_argument("--out", default=None, help="run folder (default: a new benchmarks/runs/ivf-<dataset>-<time>/); "
                   "one holding an unfinished run of the same arguments continues it")
    p.add_argument("--restart", action="store_true", help="measure afresh even where --out holds results")
    p.add_argument("--quick", action="store_true", help="smoke run: glove-50-20k, 2000 base vectors, 200 queries, "
                   "4 bits, nlist 16, nprobe 1,4, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.dataset, args.n_base, args.n_queries, args.bits = "glove-50-20k", 2000, 200, "4"
        args.nlist, args.nprobe, args.repeats, args.timing_queries = 16, "1,4", 1, 200
    args.bits = [int(b) for b in args.bits.split(",")]
    args.nprobe = [int(n) for n in args.nprobe.split(",")]
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    most = KMEANS_ROWS_PER_LIST * args.nlist
    args.train_rows = args.train_rows or most
    if not 1 <= args.train_rows <= most:
        p.error(f"--train-rows must be in [1, {most}] ({KMEANS_ROWS_PER_LIST} per list), got {args.train_rows}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    label = ann.dataset_label(args)
    env = ann.environment(args.threads)
    out = _run.run_folder(args.out, f"ivf-{label}", env)
    stem = out / f"ivf_{label}"
    results = _run.Results(stem.with_suffix(".json"), {"benchmark": "ivf", "complete": False, "env": env,
                                                        "args": dict(vars(args)), "rows": []}, restart=args.restart)
    data = results.data

    def save() -> None:
        results.save()
        _run.write_atomic(stem.with_suffix(".md"), markdown(data))

    def where() -> str:
        return (f"{len(data['rows'])} rows measured, saved in {stem}.json; resume with:\n  "
                + _run.resume_command(os.path.relpath(__file__), argv, out))

    print(f"run folder {out}" + (" (resumed)" if results.resumed else ""))
    with _run.interruptible(where):
        ds = load_dataset(args.dataset, with_neighbors=False)
        base, queries, gt, metric, _ = ann.prepare_data(ds, args.n_base, args.n_queries)
        true = ann.exact_scores(base, queries, gt[:, :10], metric)
        train = ann.training_rows(base, args.train_rows)
        data["dataset"] = {"name": label, "n_base": len(base), "n_queries": len(queries), "dim": base.shape[1],
                           "metric": ds.metric, "search_metric": metric, "train_rows": len(train)}
        rows = {(r["method"], r["nprobe"]): r for r in data["rows"]}
        timed: list[tuple[AtNprobe, dict[str, Any]]] = []
        for m in tqdm([m for b in args.bits for m in methods_for(base.shape[1], b, args.nlist, metric)],
                      desc="build and recall", unit="method"):
            mine = [rows.get((m.name, n)) for n in args.nprobe]
            if all(r is not None and min(len(r.get(f"qps_rounds_{t}t", [])) for t in args.threads) >= args.repeats
                   for r in mine):
                continue  # measured in full by the run this one resumes
            B.set_threads(max(args.threads))
            t0 = time.perf_counter()
            m.build(base, train)
            build_s = time.perf_counter() - t0
            memory = m.memory()
            for nprobe, row in zip(args.nprobe, mine):
                if row is None:
                    m.set_nprobe(nprobe)
                    found = ann.exact_scores(base, queries, np.asarray(m.search(queries, args.k)[1], np.int64), metric)
                    row = {"method": m.name, "family": m.family, "bits": m.bits, "nprobe": nprobe, "notes": m.notes,
                           "code_size": m.code_size, "memory_per_vector": round(memory.per_vector, 3),
                           "trained_bytes": memory.fixed, "trained_per_vector": round(memory.fixed / len(base), 3),
                           "build_s": round(build_s, 3), "timing_queries": args.timing_queries,
                           "recall@1@k": {str(k): round(recall_by_score(found, true, 1, k), 4)
                                          for k in ann.recall_ks(args.k)},
                           "recall@10@10": round(recall_by_score(found, true, 10, 10), 4)}
                    rows[(m.name, nprobe)] = row
                    data["rows"].append(row)
                    save()
                timed.append((AtNprobe(m, nprobe), row))
        for r in tqdm(range(args.repeats), desc="timing rounds", unit="round"):
            for at, row in timed:
                if len(row.get(f"qps_rounds_{args.threads[0]}t", [])) <= r:
                    ann.time_once(at, row, queries, args)
                    save()
        data["complete"] = True
        save()
    print(markdown(data))
    print(f"wrote {stem}.json, .md")
    return data


if __name__ == "__main__":
    main()
