"""Encoder comparison: distortion, inner-product error and encode throughput per bit width.

tqindex encoders (every rescaling mode, Q_prod, FP4) against faiss's own TurboQuant scalar quantizers
(``RR,SQtqmse{b}`` / ``RR,SQtq{b}``; where d is not a multiple of 8 zero-padded to one, faiss's SIMD
code, and unpadded), EDEN and RaBitQ on the same vectors: random unit vectors and GloVe-50
(normalized). Inner-product estimates of near-neighbour queries against a base sample are judged by
the least-squares slope of estimated on true inner products (1 when unbiased: shrinkage shows below 1),
their mean error over each query's 10 nearest pairs (the pairs a search ranks; a mean over all pairs
sits near zero whatever the shrinkage) and their RMSE. Also the FP4-UE8M0 scale ablation of SPEC §3
on Gaussian data.

A run writes ``encoders.json`` and ``.md`` into a new folder ``benchmarks/runs/encoders-<time>/`` or
into ``--out``, where a stopped run continues (as ``ann.py``).

    python benchmarks/encoders.py            # full run
    python benchmarks/encoders.py --quick    # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # faiss on a loaded 2-core machine

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _run  # noqa: E402
import tqindex as tq  # noqa: E402
from _baselines import SIMD_MULTIPLE  # noqa: E402
from _env import environment  # noqa: E402

NEAR_PAIRS = 10
"""Nearest base vectors per query whose inner-product error is averaged (``ip_bias_nn``)."""


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def datasets(quick: bool) -> dict[str, np.ndarray]:
    """name -> [n, d] float32 unit vectors."""
    n = 4_000 if quick else 100_000
    rng = np.random.default_rng(0)
    out = {"random-128": unit(rng.standard_normal((n, 128)))}
    if not quick:
        out["random-1536"] = unit(rng.standard_normal((n // 5, 1536)))
    try:
        from tqindex.data import load_glove

        out["glove-50"] = unit(load_glove(n_base=n, with_neighbors=False).base)
    except ImportError as e:
        print(f"skipping glove-50: {e}", file=sys.stderr)
    return out


def tqindex_methods(dim: int, bits: int) -> dict[str, tq.Encoder]:
    """The tqindex variants compared at one bit width."""
    out: dict[str, tq.Encoder] = {
        f"tq{bits}-norm (paper)": tq.make_encoder(f"tq{bits}-norm", dim),
        f"tq{bits} unbiased": tq.TurboQuantMSE(dim=dim, bits=bits, rescale="unbiased", code_search=1),
        f"tq{bits} cos": tq.TurboQuantMSE(dim=dim, bits=bits, rescale="cos", code_search=1),
        f"tq{bits} unbiased+search": tq.TurboQuantMSE(dim=dim, bits=bits, rescale="unbiased"),
        f"tq{bits} (default: cos+search)": tq.make_encoder(f"tq{bits}", dim),
        f"tq{bits}-prod": tq.make_encoder(f"tq{bits}-prod", dim),
    }
    if bits == 4:
        out["fp4"] = tq.make_encoder("fp4", dim)
    return out


def faiss_methods(bits: int, dim: int) -> dict[str, tuple[str, int]]:
    """faiss (factory string, padded dim) compared at one bit width (inner-product metric, normalized
    data): scalar quantizers zero-padded to a multiple of 8 and, where that changes d, unpadded too."""
    simd = -(-dim // SIMD_MULTIPLE) * SIMD_MULTIPLE
    pads = {"": simd} | ({" unpadded": dim} if simd != dim else {})
    out = {f"faiss SQtqmse{bits}{k}": (f"RR,SQtqmse{bits}", d) for k, d in pads.items()}
    out[f"faiss EDEN{bits}"] = (f"EDEN{bits}", dim)
    if bits >= 2:
        out |= {f"faiss SQtq{bits}{k}": (f"RR,SQtq{bits}", d) for k, d in pads.items()}
    out[f"faiss RaBitQ{bits if bits > 1 else ''}"] = (f"RaBitQ{bits}" if bits > 1 else "RaBitQ", dim)
    return out


def ip_errors(est: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Inner-product estimates est against the truth, [nq, n] each: ``ip_slope``, the least-squares slope
    of est on true over all pairs; ``ip_bias_nn``, the mean error over each query's NEAR_PAIRS nearest
    pairs; ``ip_rmse`` over all pairs."""
    err = est - true
    t, e = true - true.mean(), est - est.mean()
    near = np.argpartition(-true, NEAR_PAIRS, axis=1)[:, :NEAR_PAIRS]  # [nq, NEAR_PAIRS]
    return {"ip_slope": float((t * e).sum() / (t * t).sum()),
            "ip_bias_nn": float(np.take_along_axis(err, near, axis=1).mean()),
            "ip_rmse": float(np.sqrt((err**2).mean()))}


def time_best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run_tqindex(name: str, enc: tq.Encoder, x: np.ndarray, base: np.ndarray, q: np.ndarray, repeats: int) -> dict:
    xt = torch.from_numpy(x)
    codes = enc.encode(xt)
    mse = float(((enc.decode(codes) - xt) ** 2).sum(1).mean())
    est = enc.score(torch.from_numpy(q), enc.encode(torch.from_numpy(base))).numpy()
    secs = time_best(lambda: enc.encode(xt), repeats)
    return {"method": name, "library": "tqindex", "bytes_per_vector": enc.code_size, "mse": mse,
            **ip_errors(est, q @ base.T), "encode_vec_per_s": len(x) / secs}


def run_faiss(name: str, spec: tuple[str, int], x: np.ndarray, base: np.ndarray, q: np.ndarray,
              repeats: int) -> dict:
    factory, d = spec
    x, base, q = (np.pad(a, ((0, 0), (0, d - a.shape[1]))) for a in (x, base, q))  # zero columns
    index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    index.train(x[: min(len(x), 20_000)])
    codes = index.sa_encode(x)
    mse = float(((index.sa_decode(codes) - x) ** 2).sum(1).mean()) if "RaBitQ" not in factory else float("nan")
    index.add(base)
    scores, ids = index.search(q, len(base))
    est = np.empty_like(scores)
    np.put_along_axis(est, ids, scores, axis=1)
    secs = time_best(lambda: index.sa_encode(x), repeats)
    return {"method": name, "library": "faiss", "factory": factory, "dim": d, "bytes_per_vector": index.sa_code_size(),
            "mse": mse, **ip_errors(est, q @ base.T), "encode_vec_per_s": len(x) / secs}


def fp4_ablation(quick: bool) -> list[dict]:
    """Relative MSE of FP4-UE8M0 on Gaussian data (groups of 32, no rotation) per scale rule."""
    x = torch.randn(2_000 if quick else 32_768, 256, generator=torch.Generator().manual_seed(0))
    rows = []
    for rounding in ("round", "ceil", "floor"):
        for c in (0.156, 0.195, 1.0):
            enc = tq.FP4UE8M0(dim=256, rotation="none", scale_constant=c, scale_rounding=rounding)
            rel = float(((enc.decode(enc.encode(x)) - x) ** 2).sum() / (x**2).sum())
            rows.append({"scale_rounding": rounding, "scale_constant": c, "relative_mse": rel})
    return rows


def markdown(result: dict) -> str:
    """The results as markdown: a table per dataset, then the FP4 ablation."""
    env = result["env"]
    lines = [f"# Encoder comparison ({env['cpu']}, {env['threads']} threads)", "",
             f"git {env['git_sha'][:10]}{' (dirty tree)' if env['git_dirty'] else ''}, torch "
             f"{env['versions'].get('torch')}, faiss {env['versions'].get('faiss-cpu')}, {env['date_utc']}."
             + ("" if result.get("complete") else " **Unfinished run.**"), ""]
    for ds, rows in result["datasets"].items():
        if not rows:
            continue
        lines += [f"## {ds} ({rows[0]['n']} unit vectors)", "",
                  f"IP slope: least-squares slope of estimated on true inner products (1: unbiased); IP bias "
                  f"{NEAR_PAIRS} NN: mean error of the estimates over each query's {NEAR_PAIRS} nearest base "
                  "vectors.", "",
                  f"| bits | method | B/vec | MSE | IP slope | IP bias {NEAR_PAIRS} NN | IP RMSE | encode vec/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['bits']} | {r['method']} | {r['bytes_per_vector']} | {r['mse']:.5f} | "
                         f"{r['ip_slope']:.3f} | {r['ip_bias_nn']:+.5f} | {r['ip_rmse']:.5f} | "
                         f"{r['encode_vec_per_s']:,.0f} |")
        lines.append("")
    if not result.get("fp4_ablation"):
        return "\n".join(lines) + "\n"
    lines += ["## FP4-UE8M0 scale ablation (Gaussian, groups of 32, relative MSE)", "",
              "| rounding | c = 0.156 | c = 0.195 | c = 1.0 |", "|---|---|---|---|"]
    for rounding in ("round", "ceil", "floor"):
        vals = [r["relative_mse"] for r in result["fp4_ablation"] if r["scale_rounding"] == rounding]
        lines.append(f"| {rounding} | " + " | ".join(f"{v:.4f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, seconds-long")
    ap.add_argument("--bits", default="1,2,3,4", help="comma-separated bit widths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="run folder (default: a new benchmarks/runs/encoders-<time>/); "
                    "one holding an unfinished run of the same arguments continues it")
    ap.add_argument("--restart", action="store_true", help="measure afresh even where --out holds results")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    bits_list = [int(b) for b in args.bits.split(",")]
    repeats = 1 if args.quick else 3
    env = environment(args.threads)
    out = _run.run_folder(args.out, "encoders" + ("-quick" if args.quick else ""), env)
    stem = out / "encoders"
    results = _run.Results(stem.with_suffix(".json"), {"complete": False, "env": env, "args": dict(vars(args)),
                                                        "datasets": {}}, restart=args.restart)
    result = results.data

    def save() -> None:
        results.save()
        _run.write_atomic(stem.with_suffix(".md"), markdown(result))

    def where() -> str:
        return (f"saved in {stem}.json; resume with:\n  "
                + _run.resume_command(os.path.relpath(__file__), argv, out))

    print(f"run folder {out}" + (" (resumed)" if results.resumed else ""))
    with _run.interruptible(where):
        for ds, x in datasets(args.quick).items():
            rng = np.random.default_rng(1)
            base = x[rng.choice(len(x), 2_000 if not args.quick else 500, replace=False)]
            q = unit(base[:200] + 0.5 * unit(rng.standard_normal(base[:200].shape)))  # near-neighbour queries
            rows = result["datasets"].setdefault(ds, [])
            done = {(r["bits"], r["method"]) for r in rows}
            jobs = [(b, n, e) for b in bits_list for n, e in tqindex_methods(x.shape[1], b).items()]
            jobs += [(b, n, f) for b in bits_list for n, f in faiss_methods(b, x.shape[1]).items()]
            for b, name, m in tqdm([j for j in jobs if j[:2] not in done], desc=ds):
                run = run_tqindex if isinstance(m, tq.Encoder) else run_faiss
                rows.append({"bits": b, "n": len(x), **run(name, m, x, base, q, repeats)})
                save()
        result["fp4_ablation"] = fp4_ablation(args.quick)
        result["complete"] = True
        save()
    print(markdown(result))
    print(f"wrote {stem}.json, .md")
    return result


if __name__ == "__main__":
    main()
