#!/usr/bin/env python
"""Inverted-file (IVF) ANN search over 1-4 bit codes: tqindex ``IVFIndex`` against faiss IVF indexes.

Every method clusters the base vectors into ``--nlist`` lists (faiss k-means) and scans the ``nprobe``
lists nearest to each query: tqindex ``IVFIndex`` with "tq{b}" codes of the raw vectors, and faiss
``IVF{nlist},PQ{2B}x4fs`` (PQ fast scan at tqindex's B bytes per vector, d zero-padded as in
``ann.py``) and ``IVF{nlist},SQ{b}``. For each nprobe: recall@1@k (k = 1, 4, 16, 64) and recall@10@10
from exact scores, and QPS of one batched k=64 search of ``--timing-queries`` queries right after the
same search untimed, best of ``--repeats`` rounds that each time every method once, at 1 and 2
threads. Writes ``ivf_<dataset>.json`` and ``.md`` to ``benchmarks/results/``.

    python benchmarks/ivf.py                       # glove-50-100k, nlist 1024, bits 2 and 4
    python benchmarks/ivf.py --nprobe 4,16 --repeats 3
    python benchmarks/ivf.py --quick               # seconds: 2000 base vectors, nlist 16, into a temporary directory
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in ann.py: no spinning OpenMP pools

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _baselines as B  # noqa: E402
import ann  # noqa: E402

import tqindex as tq  # noqa: E402
from tqindex.data import load_dataset  # noqa: E402
from tqindex.metrics import recall_by_score  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class TQIVF(B.Baseline):
    """tqindex ``IVFIndex`` over "tq{bits}" codes of the raw vectors."""

    def __init__(self, dim: int, bits: int, nlist: int, metric: str) -> None:
        super().__init__(f"tq{bits}-ivf", "tqindex", bits)
        self.index = tq.IVFIndex(tq.make_encoder(f"tq{bits}", dim), nlist, metric=metric)

    def build(self, x: np.ndarray) -> None:
        self.index.train(x)
        self.index.add(x, progress=False)

    def set_nprobe(self, nprobe: int) -> None:
        self.index.nprobe = nprobe

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(q, k, progress=False)

    @property
    def bytes_per_vector(self) -> float:
        return float(self.index.encoder.code_size)


class FaissIVF(B.FaissBaseline):
    """A faiss IVF index from a factory string (d zero-padded to ``pad`` columns spread as in ann.py)."""

    def __init__(self, name: str, bits: int, spec: str, dim: int, metric: str, m: int | None = None) -> None:
        pad, cols = B.spread_layout(dim, m) if m else (dim, None)
        super().__init__(name, "faiss-ivf", bits, B._factory(spec, metric), dim, pad_to=pad, columns=cols,
                         notes=f"index_factory({spec!r})" + (f", d zero-padded to {pad} (spread)" if m else ""))

    def set_nprobe(self, nprobe: int) -> None:
        B._faiss().extract_index_ivf(self.index).nprobe = nprobe


def methods_for(dim: int, bits: int, nlist: int, metric: str) -> list[Any]:
    """tqindex IVF at ``bits`` and the faiss IVF indexes at its bytes per vector (and SQ4 at 4 bits)."""
    target = tq.make_encoder(f"tq{bits}", dim).code_size
    m = 2 * target
    out = [TQIVF(dim, bits, nlist, metric),
           FaissIVF(f"faiss-ivf-pq-fs{m}x4", bits, f"IVF{nlist},PQ{m}x4fs", dim, metric, m)]
    return out + ([FaissIVF("faiss-ivf-sq4", bits, f"IVF{nlist},SQ4", dim, metric)] if bits == 4 else [])


def markdown(result: dict[str, Any]) -> str:
    """The results as a markdown table, one row per (method, nprobe)."""
    d, a, env = result["dataset"], result["args"], result["env"]
    lines = [f"# IVF benchmark: {d['name']}", "",
             f"{d['n_base']} base vectors, {d['n_queries']} queries, dim {d['dim']}, metric {d['metric']}; "
             f"nlist {a['nlist']}. QPS of one batched k={a['k']} search of {a['timing_queries']} queries right "
             f"after the same search untimed, best of {a['repeats']} rounds (each times every method once).", "",
             f"git {env['git_sha'][:10]}{' (dirty)' if env['git_dirty'] else ''}, {env['cpu']}, {env['nproc']} CPUs, "
             f"torch {env['versions'].get('torch')}, faiss {env['versions'].get('faiss-cpu')}, {env['date_utc']}.", "",
             "| method | bits | B/vec | build s | nprobe | R@1@1 | R@1@16 | R@1@64 | R@10@10 | QPS 1t | QPS 2t |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['bits']} | {r['bytes_per_vector']:g} | {r['build_s']:.2f} | "
                     f"{r['nprobe']} | "
                     + " | ".join(f"{r['recall@1@k'][k]:.3f}" for k in ("1", "16", "64"))
                     + f" | {r['recall@10@10']:.3f} | {r['qps_1t']:,.0f} | {r['qps_2t']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="glove-50-100k", help="a dataset name of tqindex.data (default glove-50-100k)")
    p.add_argument("--bits", default="2,4", help="comma-separated bit widths (default 2,4)")
    p.add_argument("--nlist", type=int, default=1024, help="lists (default 1024)")
    p.add_argument("--nprobe", default="1,4,16,64", help="comma-separated nprobe values (default 1,4,16,64)")
    p.add_argument("--n-base", type=int, default=None, help="use the first n base vectors (default all)")
    p.add_argument("--n-queries", type=int, default=None, help="use the first n queries for recall (default all)")
    p.add_argument("--timing-queries", type=int, default=1000, help="queries in each timed search (default 1000)")
    p.add_argument("--repeats", type=int, default=5, help="timing rounds (default 5)")
    p.add_argument("--k", type=int, default=64, help="results per query (default 64)")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/, a temporary "
                   "directory with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: glove-50-20k, 2000 base vectors, 200 queries, "
                   "4 bits, nlist 16, nprobe 1,4, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.dataset, args.n_base, args.n_queries, args.bits = "glove-50-20k", 2000, 200, "4"
        args.nlist, args.nprobe, args.repeats, args.timing_queries = 16, "1,4", 1, 200
        args.out = args.out or tempfile.mkdtemp(prefix="tqindex-ivf-")
    bits = [int(b) for b in args.bits.split(",")]
    nprobes = [int(n) for n in args.nprobe.split(",")]
    ds = load_dataset(args.dataset)
    base, queries, gt, metric, _ = ann.prepare_data(ds, args.n_base, args.n_queries)
    true = ann.exact_scores(base, queries, gt[:, :10], metric)
    timing = queries[: args.timing_queries]
    methods = [m for b in bits for m in methods_for(base.shape[1], b, args.nlist, metric)]
    rows: list[dict[str, Any]] = []
    for m in tqdm(methods, desc="build and recall", unit="method"):
        B.set_threads(2)
        t0 = time.perf_counter()
        m.build(base)
        build_s = time.perf_counter() - t0
        for nprobe in nprobes:
            m.set_nprobe(nprobe)
            found = ann.exact_scores(base, queries, np.asarray(m.search(queries, args.k)[1], np.int64), metric)
            rows.append({"method": m.name, "family": m.family, "bits": m.bits, "nprobe": nprobe,
                         "bytes_per_vector": m.bytes_per_vector, "build_s": round(build_s, 3),
                         "recall@1@k": {str(k): round(recall_by_score(found, true, 1, k), 4)
                                        for k in ann.recall_ks(args.k)},
                         "recall@10@10": round(recall_by_score(found, true, 10, 10), 4)})
    for _ in tqdm(range(args.repeats), desc="timing rounds", unit="round"):
        for row in rows:
            m = next(x for x in methods if x.name == row["method"])
            m.set_nprobe(row["nprobe"])
            for t in (1, 2):
                qps = round(len(timing) / m.timed_search(timing, args.k, t), 1)
                row.setdefault(f"qps_rounds_{t}t", []).append(qps)
                row[f"qps_{t}t"] = max(row[f"qps_rounds_{t}t"])
    result = {"benchmark": "ivf",
              "dataset": {"name": ann.dataset_label(args, len(base), len(ds.base)), "n_base": len(base),
                          "n_queries": len(queries),
                          "dim": base.shape[1], "metric": ds.metric, "search_metric": metric},
              "env": ann.environment([1, 2]), "args": vars(args), "rows": rows}
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = str(out / f"ivf_{result['dataset']['name']}")
    Path(stem + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(stem + ".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {stem}.json, .md")
    return result


if __name__ == "__main__":
    main()
