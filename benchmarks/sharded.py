#!/usr/bin/env python
"""Sharded search over torch.distributed: build time, QPS and communication against the rank count,
and a projection to a billion vectors on many GPUs.

Measured (gloo on this machine's CPUs, loopback, one spawned process per rank, the cores split
between them): n random unit vectors (default 1M x 128, "tq4") are split evenly over the ranks, each
rank encodes and adds its own rows (:class:`tqindex.distributed.ShardedIndex`, SPMD); query batches
(default 1 and 1000 queries, k = 10) are broadcast from rank 0, searched on every shard, and the
per-rank results are gathered and merged on every rank. Per rank count: build time (slowest rank),
QPS of each batch (best of --repeats; a search ends when the slowest rank has its results), the
payload bytes each rank sends and receives per batch, and the share of search time spent outside
the local scan (agreement round, query broadcast, result gather, merge), taken on the rank whose
scan was slowest (the others also wait for it, which is imbalance, not exchange cost). The ids
found with more ranks are compared with those of one rank.

Projected (a model, not a measurement): 1B x 768-d vectors at 4 bits on 8 and 64 GPUs: memory per
shard, scan time per batch from a per-GPU bandwidth and compute model, and the time to broadcast
the queries and all-gather the results at NVLink and 100-400 Gb/s network speeds.

Writes ``sharded_<n>x<dim>_<encoder>.json`` and ``.md`` to ``benchmarks/results/``; ``--quick`` is a
seconds-long smoke run into a temporary directory.

    python benchmarks/sharded.py             # 1M x 128 tq4, ranks 1 and 2, batches 1 and 1000
    python benchmarks/sharded.py --quick
"""

from __future__ import annotations

import os

# faiss must not spin-wait in OpenMP: on a loaded machine an actively spinning pool slows it badly.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _env  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 1 << 16
"""Rows are generated in blocks of this many, each from its own seed, so any rank makes its rows alone."""
TARGET_SHARE = 0.10
"""Target: exchange + merge under this share of the search time (1M x 128 tq4, 1000 queries, 2 ranks)."""

# Projection parameters (defaults; each is a command-line option). Nominal figures of an H200 SXM and
# its links; the efficiencies are assumptions, to be replaced by measured single-GPU scan numbers.
GPU_MEMORY_GB = 141.0
GPU_BANDWIDTH_GBS = 4800.0
GPU_BANDWIDTH_EFFICIENCY = 0.6
GPU_TFLOPS = 989.0  # dense bf16
GPU_FLOPS_EFFICIENCY = 0.5
LINKS_GBS = {"NVLink 4 (within a node)": 450.0, "400 Gb/s": 50.0, "200 Gb/s": 25.0, "100 Gb/s": 12.5}
"""Per-GPU bandwidth, one direction, in GB/s."""
LINK_LATENCY_S = {"NVLink 4 (within a node)": 5e-6, "400 Gb/s": 15e-6, "200 Gb/s": 15e-6, "100 Gb/s": 15e-6}
"""Latency of one step of a ring collective."""


# --------------------------------------------------------------------------------------------------
# data


def unit_rows(start: int, stop: int, dim: int, seed: int) -> np.ndarray:
    """Rows [start, stop) of a deterministic set of random unit vectors (float32 [stop - start, dim])."""
    out = np.empty((stop - start, dim), np.float32)
    for block in range(start // BLOCK, -(-stop // BLOCK)):
        a, b = max(start, block * BLOCK), min(stop, (block + 1) * BLOCK)
        rows = np.random.default_rng([seed, block]).standard_normal((BLOCK, dim), dtype=np.float32)
        part = rows[a - block * BLOCK : b - block * BLOCK]
        out[a - start : b - start] = part / np.linalg.norm(part, axis=1, keepdims=True)
    return out


# --------------------------------------------------------------------------------------------------
# one world of ranks


def _rank_main(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    """A spawned rank: join the gloo group, build and search its shard, report to the parent."""
    threads = max(1, (os.cpu_count() or 1) // world)
    import faiss
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args["timeout"]))
    try:
        queue.put((rank, "ok", _rank_work(rank, world, threads, args)))
    except Exception:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _rank_work(rank: int, world: int, threads: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import tqindex as tq
    from tqindex.distributed import ShardedIndex, shard_range

    def say(text: str) -> None:
        if rank == 0:
            print(f"[{world} rank{'s' if world > 1 else ''}] {text}", flush=True)

    n, dim, k = args["n"], args["dim"], args["k"]
    start, stop = shard_range(n, rank, world)
    say(f"generating {n:,} x {dim} unit vectors ({stop - start:,} per rank)")
    x = unit_rows(start, stop, dim, args["seed"])
    index = ShardedIndex(tq.FlatIndex(tq.make_encoder(args["encoder"], dim), metric="ip"), timeout=args["timeout"])
    say("adding")
    dist.barrier()
    t0 = time.perf_counter()
    index.add(x)
    build_s = time.perf_counter() - t0
    del x
    nq_max = max(args["batches"])
    queries = unit_rows(0, nq_max, dim, args["seed"] + 1) if rank == 0 else None
    out: dict[str, Any] = {"rank": rank, "threads": threads, "rows": stop - start, "build_s": build_s,
                           "code_size": index.encoder.code_size, "searches": {}, "local_only_s": {}}
    for nq in args["batches"]:
        q = queries[:nq] if rank == 0 else None
        repeats = args["repeats"] * (10 if nq < 100 else 1)
        say(f"searching {nq} queries, k={k}, {repeats} times")
        D, I = index.search(q, k, src=0)  # warm-up; its ids are compared across rank counts
        if rank == 0 and nq == nq_max:
            out["ids"] = I
        stats, alone = [], []
        for _ in range(repeats):
            dist.barrier()
            index.search(q, k, src=0)
            stats.append(asdict(index.last_search))
            if world == 1:  # the local index alone, without the sharding layer, in the same rounds
                t0 = time.perf_counter()
                index.local.search(q, k)
                alone.append(time.perf_counter() - t0)
        out["searches"][nq] = stats
        if alone:
            out["local_only_s"][nq] = alone
    return out


def run_world(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks on loopback, run the build and searches -> each rank's report."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":  # one interpreter imports torch and tqindex once; the ranks fork from it
        ctx.set_forkserver_preload(["__main__", "torch.distributed", "tqindex.distributed"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    settings = {key: getattr(args, key) for key in ("n", "dim", "encoder", "k", "batches", "repeats", "seed",
                                                    "timeout")}
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, settings, queue)) for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, Any] = {}
    try:
        while len(reports) < world:
            try:
                rank, status, value = queue.get(timeout=5)
            except Exception:  # queue.Empty: check that the ranks are still alive
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reports]
                if dead:
                    raise RuntimeError(f"ranks {dead} of {world} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})") from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            reports[rank] = value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [reports[r] for r in range(world)]


def summarize_world(world: int, reports: list[dict[str, Any]], args: argparse.Namespace,
                    one_rank_ids: np.ndarray | None) -> list[dict[str, Any]]:
    """One row per query batch for a world of ``world`` ranks."""
    rows = []
    for nq in args.batches:
        per_rank = [r["searches"][nq] for r in reports]  # [rank][repeat] stats
        totals, shares, exchange = [], [], []
        for rep in range(len(per_rank[0])):
            stats = [s[rep] for s in per_rank]
            slow = max(stats, key=lambda s: s["local_s"])  # its wait in the gather is exchange cost only
            totals.append(max(s["total_s"] for s in stats))
            exchange.append(slow["comm_s"] + slow["merge_s"])
            shares.append(exchange[-1] / slow["total_s"])
        best = min(range(len(totals)), key=totals.__getitem__)
        local = [statistics.median(s["local_s"] for s in r) for r in per_rank]
        row = {
            "ranks": world, "threads_per_rank": reports[0]["threads"], "nq": nq, "k": args.k,
            "rows_per_rank": [r["rows"] for r in reports],
            "build_s": round(max(r["build_s"] for r in reports), 3),
            "qps": round(nq / totals[best], 1),
            "qps_median": round(nq / statistics.median(totals), 1),
            "search_ms_best": round(1e3 * totals[best], 3),
            "search_ms_median": round(1e3 * statistics.median(totals), 3),
            "local_scan_ms_median_by_rank": [round(1e3 * t, 3) for t in local],
            "exchange_merge_ms_median": round(1e3 * statistics.median(exchange), 3),
            "exchange_merge_share_median": round(statistics.median(shares), 4),
            "exchange_merge_share_by_repeat": [round(s, 4) for s in shares],
            "bytes_sent_by_rank": [r["searches"][nq][0]["bytes_sent"] for r in reports],
            "bytes_received_by_rank": [r["searches"][nq][0]["bytes_received"] for r in reports],
            "repeats": len(totals),
        }
        if reports[0]["local_only_s"]:
            row["local_index_alone_qps"] = round(nq / min(reports[0]["local_only_s"][nq]), 1)
            row["local_index_alone_qps_median"] = round(nq / statistics.median(reports[0]["local_only_s"][nq]), 1)
        if nq == max(args.batches) and one_rank_ids is not None:
            row["ids_equal_to_1_rank"] = round(float((reports[0]["ids"] == one_rank_ids).mean()), 5)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# projection


def ring_seconds(volume_bytes: float, gpus: int, link: str) -> float:
    """Ring all-gather (or pipelined broadcast) of ``volume_bytes`` in all over ``gpus`` GPUs: each GPU
    receives (G - 1)/G of the volume over its link, in G - 1 steps of the link's latency."""
    if gpus == 1:
        return 0.0
    return (gpus - 1) * LINK_LATENCY_S[link] + (gpus - 1) / gpus * volume_bytes / (LINKS_GBS[link] * 1e9)


def project(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The paper projection: ``--project-n`` x ``--project-dim`` vectors, ``--project-encoder`` codes,
    over each of ``--project-gpus``, per query batch of ``--project-batches`` (k = ``--project-k``)."""
    import tqindex as tq

    code_size = tq.make_encoder(args.project_encoder, args.project_dim).code_size
    rows = []
    for gpus in args.project_gpus:
        per_gpu = math.ceil(args.project_n / gpus)
        shard_gb = per_gpu * (code_size + 8) / 1e9  # codes + int64 ids
        for nq in args.project_batches:
            for k in args.project_k:
                read_s = per_gpu * code_size / (args.gpu_bandwidth * 1e9 * args.gpu_bandwidth_efficiency)
                flop_s = 2 * nq * per_gpu * args.project_dim / (args.gpu_tflops * 1e12 * args.gpu_flops_efficiency)
                scan_s = max(read_s, flop_s)
                gather_bytes = gpus * nq * k * 12  # float32 score + int64 id per result, every GPU's
                query_bytes = nq * args.project_dim * 4
                comm = {link: ring_seconds(gather_bytes, gpus, link) + ring_seconds(query_bytes, gpus, link)
                        for link in LINKS_GBS}
                rows.append({
                    "gpus": gpus, "nq": nq, "k": k, "rows_per_gpu": per_gpu, "code_size": code_size,
                    "shard_gb": round(shard_gb, 2), "fits": shard_gb < GPU_MEMORY_GB,
                    "scan_ms": round(1e3 * scan_s, 3), "scan_bound": "memory" if read_s >= flop_s else "compute",
                    "gather_bytes_per_gpu": (gpus - 1) * gather_bytes // gpus,  # received from the others
                    "query_broadcast_bytes": query_bytes,
                    "comm_ms": {link: round(1e3 * t, 4) for link, t in comm.items()},
                    "comm_share": {link: round(t / (t + scan_s), 4) for link, t in comm.items()},
                    "qps": {link: round(nq / (t + scan_s), 1) for link, t in comm.items()},
                })
    return rows


# --------------------------------------------------------------------------------------------------
# report


def markdown(result: dict[str, Any]) -> str:
    a, env = result["args"], result["env"]
    lines = [f"# Sharded search: {a['n']:,} x {a['dim']} {a['encoder']}, gloo on CPU", "",
             f"Random unit vectors split evenly over the ranks (one process each, the {env['nproc']} cores "
             f"divided between them); queries broadcast from rank 0, k = {a['k']}, results gathered and merged "
             "on every rank. QPS: best and median of the repeats; times: medians. Exchange + merge: the time "
             "outside the local scan on the rank whose scan was slowest, and its share of that rank's search "
             "time. Bytes: payload per rank per batch.", "",
             f"git {env['git_sha'][:10]}{' (dirty)' if env['git_dirty'] else ''}, {env['cpu']}, {env['nproc']} CPUs, "
             f"torch {env['versions']['torch']}, {env['date_utc']}, load average at start "
             f"{env['load_average_at_start']}.", "",
             "| ranks | threads/rank | build s | queries | QPS best / median | search ms | local scan ms (by rank) | "
             "exchange+merge ms | share | bytes sent / received (rank 0) | ids = 1 rank |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in result["rows"]:
        same = r.get("ids_equal_to_1_rank")
        lines.append(f"| {r['ranks']} | {r['threads_per_rank']} | {r['build_s']:.2f} | {r['nq']} | "
                     f"{r['qps']:,.0f} / {r['qps_median']:,.0f} | "
                     f"{r['search_ms_median']:.2f} | "
                     f"{' / '.join(f'{t:.2f}' for t in r['local_scan_ms_median_by_rank'])} | "
                     f"{r['exchange_merge_ms_median']:.2f} | {100 * r['exchange_merge_share_median']:.1f} % | "
                     f"{r['bytes_sent_by_rank'][0]:,} / {r['bytes_received_by_rank'][0]:,} | "
                     f"{'' if same is None else f'{100 * same:.2f} %'} |")
    alone = [r for r in result["rows"] if "local_index_alone_qps" in r]
    if alone:
        lines += ["", "The local FlatIndex alone (1 process, no sharding layer, timed in the same rounds), QPS best / "
                  "median: " + ", ".join(f"{r['nq']} queries {r['local_index_alone_qps']:,.0f} / "
                                         f"{r['local_index_alone_qps_median']:,.0f}" for r in alone) + "."]
    t = result.get("target")
    if t:
        lines += ["", f"Target: exchange + merge < {100 * TARGET_SHARE:.0f} % of the search time at {t['setting']}: "
                  f"measured {100 * t['share']:.1f} % ({'met' if t['met'] else 'missed'})."]
    p = result["projection"]
    links = list(LINKS_GBS)
    lines += ["", f"## Projection: {a['project_n']:,} x {a['project_dim']} {a['project_encoder']} "
              f"({p[0]['code_size']} B/vector + 8 B id)", "",
              f"A model, not a measurement: scan = max(code bytes / ({a['gpu_bandwidth']:g} GB/s x "
              f"{a['gpu_bandwidth_efficiency']:g}), 2 nq rows dim / ({a['gpu_tflops']:g} TFLOP/s x "
              f"{a['gpu_flops_efficiency']:g})) per GPU; exchange = ring all-gather of nq k x 12 B per GPU plus "
              "the float32 query broadcast, (G-1) steps of 5 us (NVLink) / 15 us (network) latency (a ring; "
              "NCCL's tree algorithms need fewer steps for small messages). Link speeds per GPU and direction: "
              + ", ".join(f"{link} {LINKS_GBS[link]:g} GB/s" for link in links) + ".", "",
              "| GPUs | rows/GPU | GB/shard | queries | k | scan ms | bound | gathered per GPU | queries sent | "
              + " | ".join(f"exchange ms, {link}" for link in links) + " | QPS at 100 Gb/s |",
              "|--:|--:|--:|--:|--:|--:|--|--:|--:|" + "--:|" * len(links) + "--:|"]
    for r in p:
        lines.append(f"| {r['gpus']} | {r['rows_per_gpu']:,} | {r['shard_gb']:.1f} | {r['nq']} | {r['k']} | "
                     f"{r['scan_ms']:.3f} | {r['scan_bound']} | {_size(r['gather_bytes_per_gpu'])} | "
                     f"{_size(r['query_broadcast_bytes'])} | "
                     + " | ".join(f"{r['comm_ms'][link]:.3f} ({100 * r['comm_share'][link]:.1f} %)" for link in links)
                     + f" | {r['qps']['100 Gb/s']:,.0f} |")
    return "\n".join(lines) + "\n"


def _size(n: float) -> str:
    """Bytes as B / kB / MB (decimal)."""
    return f"{n:,.0f} B" if n < 1e3 else f"{n / 1e3:,.1f} kB" if n < 1e6 else f"{n / 1e6:,.1f} MB"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=None, help="vectors in all shards (default 1,000,000)")
    p.add_argument("--dim", type=int, default=None, help="dimension (default 128)")
    p.add_argument("--encoder", default="tq4", help="registry encoder (default tq4)")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    p.add_argument("--batches", default=None, help="comma-separated query batch sizes (default 1,1000)")
    p.add_argument("--k", type=int, default=10, help="results per query (default 10)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed searches per batch of >= 100 queries, 10x that for smaller ones (default 5)")
    p.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait (default 600)")
    p.add_argument("--project-n", type=int, default=1_000_000_000, help="projection: vectors (default 1e9)")
    p.add_argument("--project-dim", type=int, default=768, help="projection: dimension (default 768)")
    p.add_argument("--project-encoder", default="tq4", help="projection: encoder (default tq4)")
    p.add_argument("--project-gpus", default="8,64", help="projection: GPU counts (default 8,64)")
    p.add_argument("--project-batches", default="1,4096", help="projection: query batches (default 1,4096)")
    p.add_argument("--project-k", default="10,100", help="projection: k values (default 10,100)")
    p.add_argument("--gpu-bandwidth", type=float, default=GPU_BANDWIDTH_GBS,
                   help=f"projection: GPU memory bandwidth, GB/s (default {GPU_BANDWIDTH_GBS:g}, H200)")
    p.add_argument("--gpu-bandwidth-efficiency", type=float, default=GPU_BANDWIDTH_EFFICIENCY,
                   help=f"projection: fraction of it a scan reaches (default {GPU_BANDWIDTH_EFFICIENCY:g})")
    p.add_argument("--gpu-tflops", type=float, default=GPU_TFLOPS,
                   help=f"projection: dense bf16 TFLOP/s (default {GPU_TFLOPS:g}, H200)")
    p.add_argument("--gpu-flops-efficiency", type=float, default=GPU_FLOPS_EFFICIENCY,
                   help=f"projection: fraction of it a batched scan reaches (default {GPU_FLOPS_EFFICIENCY:g})")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/, a temporary "
                   "directory with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 20,000 x 64, batches 1 and 200, 2 repeats")
    args = p.parse_args(argv)
    q = args.quick
    args.n = args.n or (20_000 if q else 1_000_000)
    args.dim = args.dim or (64 if q else 128)
    args.batches = sorted({int(b) for b in (args.batches or ("1,200" if q else "1,1000")).split(",")})
    args.repeats = args.repeats or (2 if q else 5)
    args.ranks = sorted({int(r) for r in args.ranks.split(",")})
    for name in ("project_gpus", "project_batches", "project_k"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",")])
    if args.quick:
        args.out = args.out or tempfile.mkdtemp(prefix="tqindex-sharded-")
    if min(args.ranks) < 1 or min(args.batches) < 1 or args.n < max(args.ranks) or args.k < 1:
        p.error("--ranks, --batches and --k must be >= 1 and --n at least the largest rank count")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = _env.environment()
    rows, one_rank_ids = [], None
    for world in args.ranks:
        t0 = time.perf_counter()
        reports = run_world(world, args)
        if world == 1:
            one_rank_ids = reports[0]["ids"]
        rows += summarize_world(world, reports, args, one_rank_ids)
        print(f"[{world} rank{'s' if world > 1 else ''}] done in {time.perf_counter() - t0:.1f} s", flush=True)
    target = None
    main_row = [r for r in rows if r["ranks"] == 2 and r["nq"] == max(args.batches)]
    if main_row:
        share = main_row[0]["exchange_merge_share_median"]
        target = {"setting": f"{args.n:,} x {args.dim} {args.encoder}, {max(args.batches)} queries, 2 ranks",
                  "share": share, "met": share < TARGET_SHARE}
    result = {"benchmark": "sharded", "env": env, "args": vars(args), "rows": rows, "target": target,
              "projection": project(args)}
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    n = args.n
    size = f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)
    stem = str(out / f"sharded_{size}x{args.dim}_{args.encoder}")
    Path(stem + ".json").write_text(json.dumps(result, indent=1, default=lambda o: o.tolist()) + "\n")
    Path(stem + ".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {stem}.json, .md")
    return result


if __name__ == "__main__":
    main()
