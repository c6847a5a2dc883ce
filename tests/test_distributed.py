"""ShardedIndex over gloo on CPU: spawned worlds of 2 and 3 ranks on loopback, checked against one
FlatIndex / IVFIndex over all rows.

Two worlds (2 and 3 ranks) stay up for the whole module and run one scenario per test; the failure
tests (a rank that exits, a rank that stops calling) get fresh worlds, since they break their group.
A scenario is a module-level function ``fn(rank, world_size, *args)`` run on every rank; the test
compares what the ranks return.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tqindex as tq
from tqindex.distributed import (DistributedIndexError, ShardedIndex, broadcast_encoder, merge_topk, read_manifest,
                                 shard_range)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

DIM = 32
TIMEOUT = 30.0  # seconds a collective may wait inside the scenarios that should not fail
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
STARTUP = 120.0  # seconds for a world to come up (spawned interpreters import torch, faiss, tqindex)


# --------------------------------------------------------------------------------------------------
# worlds of spawned ranks


def _serve(rank: int, size: int, port: int, conn: Any) -> None:
    """A rank: join the gloo group, then run scenarios sent over ``conn`` until told to stop (None)."""
    import faiss

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=STARTUP))
    conn.send(("ready",))
    while (msg := conn.recv()) is not None:
        fn, args = msg
        try:
            conn.send(("ok", fn(rank, size, *args)))
        except Exception as e:
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
    dist.destroy_process_group()


class World:
    """``size`` spawned ranks in one gloo group on loopback."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":  # one interpreter imports torch and tqindex once; the ranks fork from it
            ctx.set_forkserver_preload(["torch.distributed", "tqindex", "tqindex.distributed", __name__])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.size, self.conns, self.procs = size, [], []
        for rank in range(size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, size, port, theirs), daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        for rank, conn in enumerate(self.conns):
            if not conn.poll(STARTUP):
                self.close()
                raise RuntimeError(f"rank {rank} did not start within {STARTUP} s")
            conn.recv()

    def outcomes(self, fn: Callable, *args: Any, limit: float = 120.0) -> list[tuple]:
        """Run ``fn(rank, size, *args)`` on every rank -> per rank ("ok", value), ("error", type name,
        message, traceback) or ("gone", exit code) for a rank that died."""
        for conn in self.conns:
            conn.send((fn, args))
        out, deadline = [], time.monotonic() + limit
        for rank, conn in enumerate(self.conns):
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    self.close()
                    raise AssertionError(f"rank {rank} did not answer within {limit} s (hung)")
                out.append(conn.recv())
            except (EOFError, ConnectionError):
                self.procs[rank].join(10)
                out.append(("gone", self.procs[rank].exitcode))
        return out

    def run(self, fn: Callable, *args: Any) -> list[Any]:
        """``fn`` on every rank -> the values returned by each rank; a rank's exception fails the test."""
        out = self.outcomes(fn, *args)
        for rank, o in enumerate(out):
            if o[0] != "ok":
                raise AssertionError(f"rank {rank} failed: {o[1:]}" if o[0] == "gone" else f"rank {rank}:\n{o[3]}")
        return [o[1] for o in out]

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (OSError, ValueError):
                    pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


@pytest.fixture(scope="module")
def world2():
    w = World(2)
    yield w
    w.close()


@pytest.fixture(scope="module")
def world3():
    w = World(3)
    yield w
    w.close()


# --------------------------------------------------------------------------------------------------
# data and the single-index reference


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


QUERIES = _data(24, seed=99)


def _local(kind: str = "flat", metric: str = "ip", encoder: str = "tq4") -> Any:
    enc = tq.make_encoder(encoder, DIM)
    return tq.FlatIndex(enc, metric=metric) if kind == "flat" else tq.IVFIndex(enc, nlist=8, metric=metric, nprobe=3)


def _offsets(sizes: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(sizes)]).tolist()


def _sharded(rank: int, sizes: list[int], metric: str = "ip", kind: str = "flat") -> ShardedIndex:
    """Rank ``rank``'s ShardedIndex holding rows offsets[rank]:offsets[rank+1] of _data(sum(sizes)) with
    the default ids (row numbers); IVF centroids trained on rank 0 from all rows."""
    x, off = _data(sum(sizes)), _offsets(sizes)
    index = ShardedIndex(_local(kind, metric), timeout=TIMEOUT)
    if kind == "ivf":
        index.train(x if rank == 0 else None)
    index.add(x[off[rank] : off[rank + 1]] if sizes[rank] else None)
    return index


def _reference(x: np.ndarray, ids: np.ndarray | None = None, metric: str = "ip", kind: str = "flat",
               centroids: np.ndarray | None = None) -> Any:
    index = _local(kind, metric)
    if kind == "ivf":
        index.set_centroids(centroids)
    index.add(x, ids=ids)
    return index


def assert_same(got: tuple, want: tuple, tol: float = 1e-4) -> None:
    """Equal results up to ties: scores close, the same missing entries, and per query the same ids
    apart from those whose score ties (within ``tol``) with the k-th one."""
    (D, I), (Dr, Ir) = got, want
    assert D.shape == Dr.shape and I.shape == Ir.shape
    np.testing.assert_array_equal(I == -1, Ir == -1)
    np.testing.assert_allclose(D, Dr, rtol=tol, atol=tol)
    for row in range(len(I)):
        live = Ir[row] >= 0
        if not live.any():
            continue
        last = Dr[row][live][-1]
        keep = live & (np.abs(Dr[row] - last) > tol)
        assert set(I[row][keep]) == set(Ir[row][keep]), f"query {row}: ids differ beyond ties"


def assert_ranks_agree(results: list) -> None:
    """Every rank returned bit-identical (D, I)."""
    for D, I in results[1:]:
        np.testing.assert_array_equal(D, results[0][0])
        np.testing.assert_array_equal(I, results[0][1])


# --------------------------------------------------------------------------------------------------
# scenarios (run on every rank)


def _w_search(rank: int, size: int, sizes: list[int], metric: str, kind: str, ks: list[int]) -> dict:
    index = _sharded(rank, sizes, metric, kind)
    out = {"ntotal": index.ntotal, "sizes": index.shard_sizes, "results": [index.search(QUERIES, k) for k in ks]}
    D, I = index.search(torch.from_numpy(QUERIES), 5)
    out["torch"] = (type(D).__name__, D.numpy(), I.numpy())
    if kind == "ivf":
        out["centroids"] = index.local.centroids.numpy()
    return out


def _w_add_modes(rank: int, size: int) -> dict:
    x = _data(120, seed=5)
    ids = np.random.default_rng(3).permutation(10_000)[:120] * 3 + 7  # distinct, unordered
    a, b = shard_range(120, rank, size)
    out = {}
    spmd = ShardedIndex(_local(), timeout=TIMEOUT)
    spmd.add_with_ids(x[a:b], ids[a:b])
    out["ids"] = spmd.search(QUERIES, 30)
    scattered = ShardedIndex(_local(), timeout=TIMEOUT)
    scattered.add(x if rank == 0 else None, src=0)  # default ids: row numbers
    scattered.add(torch.from_numpy(x[:10]) if rank == 0 else None, ids=np.arange(500, 510) if rank == 0 else None,
                  src=0)
    scattered.add(x[:2] if rank == 0 else None, src=0)  # fewer rows than ranks: ids 510, 511 on ranks 0, 1
    out["scatter"] = scattered.search(QUERIES, 30)
    out["scatter_sizes"] = scattered.shard_sizes
    assigned = ShardedIndex(_local(), timeout=TIMEOUT)
    mine = assigned.assign_ids(b - a)
    assigned.add(x[a:b], ids=mine)
    assigned.add(x[a:b])  # default ids continue after the assigned ones
    out["assigned"] = (mine, assigned.search(QUERIES, 30), assigned.ntotal)
    return out


def _w_filter(rank: int, size: int, sizes: list[int], allow: np.ndarray) -> dict:
    index = _sharded(rank, sizes)
    everywhere = index.search(QUERIES, 12, allow=allow)
    broadcast = index.search(QUERIES if rank == 0 else None, 12, allow=allow if rank == 0 else None, src=0, dst=1)
    return {"everywhere": everywhere, "broadcast": broadcast, "stats": index.last_search}


def _w_remove(rank: int, size: int, sizes: list[int], gone: np.ndarray) -> dict:
    index = _sharded(rank, sizes, metric="l2")
    first = index.remove_ids(gone[:10] if rank == 0 else np.empty(0, np.int64))  # union of what the ranks give
    second = index.remove_ids(gone[10:] if rank == size - 1 else None, src=size - 1)
    again = index.remove_ids(gone)  # already gone: nothing removed
    return {"removed": (first, second, again), "ntotal": index.ntotal, "sizes": index.shard_sizes,
            "local": index.local.ntotal, "results": index.search(QUERIES, 40)}


def _w_save(rank: int, size: int, sizes: list[int], path: str, kind: str) -> dict:
    index = _sharded(rank, sizes, kind=kind)
    index.remove_ids([0])
    before = index.search(QUERIES, 20)
    index.save(path)
    loaded = ShardedIndex.load(path, timeout=TIMEOUT)
    after, sizes = loaded.search(QUERIES, 20), (index.shard_sizes, loaded.shard_sizes)
    loaded.add(_data(3, seed=7) if rank == 0 else None)  # ids continue after the saved ones
    return {"before": before, "after": after, "sizes": sizes,
            "type": type(loaded.local).__name__, "new_ids": loaded.local.ids.tolist() if rank == 0 else None,
            "ntotal": loaded.ntotal}


def _w_save_only(rank: int, size: int, sizes: list[int], path: str) -> None:
    _sharded(rank, sizes).save(path)


def _w_load(rank: int, size: int, path: str) -> ShardedIndex:
    return ShardedIndex.load(path, timeout=TIMEOUT)


def _w_errors(rank: int, size: int) -> dict:
    """Wrong input on one rank, disagreeing arguments and different calls: every rank raises the same
    error and the group stays usable."""
    index = _sharded(rank, [40] * size)
    out = {}

    def catch(fn: Callable) -> tuple[str, str]:
        try:
            fn()
        except Exception as e:
            return type(e).__name__, str(e)
        return "none", ""

    bad = _data(5)[:, :3] if rank == 1 else _data(5)
    out["bad_x"] = catch(lambda: index.add(bad))
    out["bad_k"] = catch(lambda: index.search(QUERIES, 5 + rank))
    out["bad_q"] = catch(lambda: index.search(QUERIES + rank, 5))
    dup = np.arange(1000, 1005)  # the same ids on every rank
    out["dup_ids"] = catch(lambda: index.add(_data(5), ids=dup))
    taken = np.arange(5) if rank == size - 1 else np.arange(2000, 2005) + 10 * rank  # 0..4 are in rank 0's shard
    out["taken_ids"] = catch(lambda: index.add(_data(5), ids=taken))
    nan = _data(5)
    nan[2, 3] = np.nan if rank == 1 else 0.0
    out["nan_x"] = catch(lambda: index.add(nan))  # fails inside rank 1's local add: rank 0 rolls back
    out["local_error"] = catch(lambda: index.search(QUERIES, 5, nprobe=2))  # FlatIndex.search has no nprobe
    out["calls"] = catch(lambda: index.search(QUERIES, 5) if rank == 0 else index.remove_ids([1]))
    out["encoders"] = catch(lambda: ShardedIndex(_local(encoder="tq4" if rank == 0 else "tq2"), timeout=TIMEOUT))
    out["ntotal"] = index.ntotal
    out["after"] = index.search(QUERIES, 5)
    return out


def _w_prefilled(rank: int, size: int) -> tuple:
    """Shards built before sharding: interleaved distinct ids are accepted, a shared id is refused."""
    x = _data(20, seed=2)
    local = _local()
    local.add(x[rank::size], ids=np.arange(rank, 20, size))  # ranges overlap, ids do not
    index = ShardedIndex(local, timeout=TIMEOUT)
    clash = _local()
    clash.add(x[:3], ids=[7, 8, 9 + rank])
    try:
        ShardedIndex(clash, timeout=TIMEOUT)
    except ValueError as e:
        return index.ntotal, index.search(QUERIES, 8), str(e)
    raise AssertionError("shards sharing ids 7 and 8 were accepted")


def _w_readme(rank: int, size: int, path: str) -> tuple:
    """The README's sharding example, run on every rank in ``path``."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "ShardedIndex(" in b]
    here, scope = os.getcwd(), {}
    os.chdir(path)
    try:
        exec(compile(block, "README.md", "exec"), scope)
    finally:
        os.chdir(here)
    return scope["I"][:, 0].tolist(), scope["index"].ntotal, scope["index"].shard_sizes, scope["D"].shape


def _w_exit(rank: int, size: int) -> tuple[float, str]:
    """Rank 1 raises out of the program (its process exits); rank 0 is searching."""
    index = _sharded(rank, [30, 30])
    if rank == 1:
        os._exit(1)
    t0 = time.monotonic()
    try:
        index.search(QUERIES, 5)
    except DistributedIndexError as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError("search succeeded without rank 1")


def _w_stall(rank: int, size: int, timeout: float) -> tuple[float, str]:
    """Rank 1 stops calling (alive, busy elsewhere) while rank 0 searches."""
    index = ShardedIndex(_local(), timeout=timeout)
    t0 = time.monotonic()
    if rank == 1:
        time.sleep(timeout + 1.0)
        return 0.0, "slept"
    try:
        index.search(QUERIES, 5)
    except DistributedIndexError as e:
        return time.monotonic() - t0, str(e)
    raise AssertionError("search succeeded without rank 1")


def _w_broadcast_encoder(rank: int, size: int) -> tuple:
    x = _data(200, seed=11)
    enc = None
    if rank == 0:
        enc = tq.make_encoder("tq2-pca", DIM)
        enc.train(x)
    shared = broadcast_encoder(enc, src=0, timeout=TIMEOUT)
    index = ShardedIndex(tq.FlatIndex(shared), timeout=TIMEOUT)
    a, b = shard_range(200, rank, size)
    index.add(x[a:b])
    return shared.to_dict(), {k: v.numpy() for k, v in shared.tensors().items()}, index.search(QUERIES, 10)


# --------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_search_equals_one_flat_index_2_ranks(world2: World, metric: str) -> None:
    sizes, ks = [150, 90], [1, 10, 120, 300]  # k below, between and above the shard sizes (and ntotal)
    results = world2.run(_w_search, sizes, metric, "flat", ks)
    ref = _reference(_data(240), metric=metric)
    for r in results:
        assert r["ntotal"] == 240 and r["sizes"] == sizes
        for k, got in zip(ks, r["results"]):
            assert_same(got, ref.search(QUERIES, k))
        assert r["torch"][0] == "Tensor"
        assert_same(r["torch"][1:], ref.search(QUERIES, 5))
    for i in range(len(ks)):
        assert_ranks_agree([r["results"][i] for r in results])
    D, I = results[0]["results"][-1]
    assert (I[:, 240:] == -1).all() and np.isinf(D[:, 240:]).all()  # fewer than k vectors exist


def test_search_equals_one_flat_index_3_ranks_with_an_empty_shard(world3: World) -> None:
    sizes, ks = [100, 0, 57], [3, 60, 157, 200]
    results = world3.run(_w_search, sizes, "cosine", "flat", ks)
    ref = _reference(_data(157), metric="cosine")
    for r in results:
        assert r["sizes"] == sizes
        for k, got in zip(ks, r["results"]):
            assert_same(got, ref.search(QUERIES, k))
    for i in range(len(ks)):
        assert_ranks_agree([r["results"][i] for r in results])


def test_ivf_centroids_trained_once_and_shared(world3: World) -> None:
    sizes = [70, 50, 60]
    results = world3.run(_w_search, sizes, "ip", "ivf", [10, 100])
    centroids = results[0]["centroids"]
    for r in results[1:]:
        np.testing.assert_array_equal(r["centroids"], centroids)
    ref = _reference(_data(180), kind="ivf", centroids=centroids)
    for r in results:
        for k, got in zip([10, 100], r["results"]):
            assert_same(got, ref.search(QUERIES, k, nprobe=3))


def test_add_with_ids_scatter_and_assigned_ids(world3: World) -> None:
    results = world3.run(_w_add_modes)
    x = _data(120, seed=5)
    ids = np.random.default_rng(3).permutation(10_000)[:120] * 3 + 7
    for r in results:
        assert_same(r["ids"], _reference(x, ids).search(QUERIES, 30))
        scattered = _reference(np.concatenate([x, x[:10], x[:2]]),
                               np.concatenate([np.arange(120), np.arange(500, 512)]))
        assert_same(r["scatter"], scattered.search(QUERIES, 30))
        assert r["scatter_sizes"] == [45, 44, 43]  # 40 + 4 + 1, 40 + 3 + 1, 40 + 3 rows
        assert_same(r["assigned"][1], _reference(np.concatenate([x, x]), np.arange(240)).search(QUERIES, 30))
        assert r["assigned"][2] == 240
    assert np.concatenate([r["assigned"][0] for r in results]).tolist() == list(range(120))


def test_filtered_search_and_broadcast_queries(world2: World) -> None:
    sizes = [80, 70]
    allow = np.random.default_rng(4).choice(150, 40, replace=False)
    results = world2.run(_w_filter, sizes, allow)
    want = _reference(_data(150)).search(QUERIES, 12, allow=allow)
    for r in results:
        assert_same(r["everywhere"], want)
        assert set(r["everywhere"][1].ravel()) <= set(allow.tolist()) | {-1}
    assert results[0]["broadcast"] == (None, None)  # dst=1: results on rank 1 only
    assert_same(results[1]["broadcast"], want)
    stats = results[1]["stats"]
    assert stats.nq == len(QUERIES) and stats.k == 12 and stats.bytes_received > 0
    assert 0 <= stats.local_s <= stats.total_s and stats.comm_s + stats.merge_s <= stats.total_s + 1e-6


def test_remove_ids_routed_to_their_shards(world3: World) -> None:
    sizes = [60, 45, 30]
    gone = np.random.default_rng(8).choice(135, 25, replace=False)
    results = world3.run(_w_remove, sizes, gone)
    ref = _reference(_data(135), metric="l2")
    assert ref.remove_ids(gone) == 25
    for r in results:
        assert r["removed"] == (10, 15, 0) and r["ntotal"] == 110 == sum(r["sizes"])
        assert_same(r["results"], ref.search(QUERIES, 40))
    off = _offsets(sizes)
    for rank, r in enumerate(results):
        assert r["sizes"][rank] == r["local"] == sizes[rank] - int(((gone >= off[rank]) & (gone < off[rank + 1])).sum())


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_save_load_round_trip(world3: World, tmp_path: Path, kind: str) -> None:
    sizes = [50, 0, 40]
    results = world3.run(_w_save, sizes, str(tmp_path), kind)
    for r in results:
        assert_same(r["after"], r["before"])
        np.testing.assert_array_equal(r["after"][1], r["before"][1])
        assert r["sizes"] == ([49, 0, 40], [49, 0, 40]) and r["type"] == {"flat": "FlatIndex", "ivf": "IVFIndex"}[kind]
        assert r["ntotal"] == 92
    assert sorted(results[0]["new_ids"])[-4:] == [49, 90, 91, 92]  # ids 0..89 were used (0 removed)
    manifest = read_manifest(tmp_path)
    assert manifest["world_size"] == 3 and [s["ntotal"] for s in manifest["shards"]] == [49, 0, 40]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["manifest.json"] + [f"shard-0000{r}-of-00003.tqi" for r in range(3)]


def test_load_with_another_world_size_fails_clearly(world2: World, world3: World, tmp_path: Path) -> None:
    world3.run(_w_save_only, [20, 20, 20], str(tmp_path))
    out = world2.outcomes(_w_load, str(tmp_path))
    for o in out:
        assert o[0] == "error" and o[1] == "ValueError", o
        assert "3 shards" in o[2] and "2 ranks" in o[2]


def test_load_refuses_a_shard_from_another_save(world2: World, tmp_path: Path) -> None:
    world2.run(_w_save_only, [20, 20], str(tmp_path / "a"))
    world2.run(_w_save_only, [20, 25], str(tmp_path / "b"))
    (tmp_path / "b" / "shard-00001-of-00002.tqi").replace(tmp_path / "a" / "shard-00001-of-00002.tqi")
    out = world2.outcomes(_w_load, str(tmp_path / "a"))
    assert all(o[0] == "error" and o[1] == "ValueError" and "rank 1" in o[2] and "SHA-256" in o[2] for o in out), out
    (tmp_path / "a" / "manifest.json").write_text("{not json")
    assert all(o[1] == "ValueError" and "manifest" in o[2] for o in world2.outcomes(_w_load, str(tmp_path / "a")))


def test_errors_raise_on_every_rank_and_the_group_survives(world2: World) -> None:
    results = world2.run(_w_errors)
    for r in results:
        assert r["bad_x"][0] == "ValueError" and "rank 1" in r["bad_x"][1] and "[n, 32]" in r["bad_x"][1]
        assert r["bad_k"][0] == "ValueError" and "k differs" in r["bad_k"][1]
        assert r["bad_q"][0] == "ValueError" and "q " in r["bad_q"][1]
        assert r["dup_ids"][0] == "ValueError" and "unique across ranks" in r["dup_ids"][1]
        assert r["taken_ids"][0] == "ValueError" and "already in the shard of rank 0" in r["taken_ids"][1]
        assert r["nan_x"][0] == "ValueError" and "rank 1" in r["nan_x"][1] and "NaN" in r["nan_x"][1]
        assert r["local_error"][0] == "TypeError" and "nprobe" in r["local_error"][1]
        assert r["calls"][0] == "DistributedIndexError" and "rank 0: search, rank 1: remove" in r["calls"][1]
        assert r["encoders"][0] == "ValueError" and "encoder" in r["encoders"][1]
        assert r["ntotal"] == 80  # nothing of the failed adds stayed anywhere
    for r in results:
        assert_same(r["after"], _reference(_data(80)).search(QUERIES, 5))


def test_prefilled_shards(world2: World) -> None:
    results = world2.run(_w_prefilled)
    x = _data(20, seed=2)
    want = _reference(np.concatenate([x[0::2], x[1::2]]), np.concatenate([np.arange(0, 20, 2), np.arange(1, 20, 2)]))
    for ntotal, got, message in results:
        assert ntotal == 20
        assert_same(got, want.search(QUERIES, 8))
        assert "unique across ranks" in message and "[7, 8]" in message


def test_readme_example_runs(world2: World, tmp_path: Path) -> None:
    for first, ntotal, sizes, shape in world2.run(_w_readme, str(tmp_path)):
        assert first == [0, 1, 2, 3, 4] and ntotal == 20_000 and sizes == [10_000, 10_000] and shape == (5, 10)
    assert read_manifest(tmp_path / "shards")["world_size"] == 2


def test_a_rank_that_exits_makes_the_others_raise() -> None:
    world = World(2)
    try:
        out = world.outcomes(_w_exit, limit=60)
    finally:
        world.close()
    assert out[1][0] == "gone"
    assert out[0][0] == "ok", out[0]
    seconds, message = out[0][1]
    assert seconds < TIMEOUT and "search" in message and "cannot be used any more" in message


def test_a_rank_that_stops_calling_times_out() -> None:
    world = World(2)
    try:
        out = world.outcomes(_w_stall, 2.0, limit=60)
    finally:
        world.close()
    assert out[1] == ("ok", (0.0, "slept"))
    seconds, message = out[0][1]
    assert 1.9 <= seconds < 10 and "within the timeout of 2 s" in message


def test_broadcast_encoder_shares_a_trained_encoder(world2: World) -> None:
    results = world2.run(_w_broadcast_encoder)
    config, tensors, _ = results[0]
    assert config == results[1][0] and config["type"] == "TurboQuantPCA"
    for name, t in tensors.items():
        np.testing.assert_array_equal(t, results[1][1][name])
    enc = tq.encoder_from_dict(config, {k: torch.from_numpy(v) for k, v in tensors.items()})
    ref = tq.FlatIndex(enc)
    ref.add(_data(200, seed=11))
    for r in results:
        assert_same(r[2], ref.search(QUERIES, 10))


# --------------------------------------------------------------------------------------------------
# without processes


def test_merge_topk_orders_ties_by_id_and_puts_missing_last() -> None:
    inf = float("inf")
    D = torch.tensor([[0.5, 0.9, -inf, 0.5, 0.9, 0.1]])
    I = torch.tensor([[7, 3, -1, 2, 8, 4]])
    d, i = merge_topk(D, I, 5, "ip")
    assert i.tolist() == [[3, 8, 2, 7, 4]] and d[0].tolist() == pytest.approx([0.9, 0.9, 0.5, 0.5, 0.1])
    # the order of the candidates does not matter
    perm = torch.tensor([5, 2, 4, 0, 3, 1])
    assert torch.equal(merge_topk(D[:, perm], I[:, perm], 5, "ip")[1], i)
    d, i = merge_topk(torch.tensor([[2.0, inf, 1.0, 2.0]]), torch.tensor([[5, -1, 9, 1]]), 4, "l2")
    assert i.tolist() == [[9, 1, 5, -1]] and d[0, -1] == inf
    with pytest.raises(ValueError, match="metric"):
        merge_topk(D, I, 2, "dot")
    with pytest.raises(ValueError, match="k must be"):
        merge_topk(D, I, 7, "ip")


def test_shard_range_splits_evenly() -> None:
    parts = [shard_range(10, r, 3) for r in range(3)]
    assert parts == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    with pytest.raises(ValueError, match="rank"):
        shard_range(10, 3, 3)
    with pytest.raises(ValueError, match="world_size"):
        shard_range(10, 0, 0)


def test_needs_an_initialized_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedIndex(_local())
    with pytest.raises(TypeError, match="FlatIndex or IVFIndex"):
        ShardedIndex("index")


def test_read_manifest_refuses_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a tqindex-sharded manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "tqindex-sharded", "format_version": 1,
                                                        "world_size": 1, "index_type": "FlatIndex", "metric": "ip",
                                                        "dim": 4, "code_size": 4, "encoder": {}, "ntotal": 1,
                                                        "next_id": 1, "shards": [{"rank": 0, "file": "../x.tqi",
                                                                                  "ntotal": 1, "bytes": 1,
                                                                                  "sha256": ""}]}))
    with pytest.raises(ValueError, match="shard entry 0 is malformed"):
        read_manifest(tmp_path)
