"""ShardedIndex: one FlatIndex or IVFIndex per rank of a ``torch.distributed`` group, used as one index.

Every method is collective: all ranks of the group call it, in the same order (SPMD, as under
``torchrun``). Each starts with :meth:`Comm.agree <tqindex.distributed.comm.Comm.agree>`, so a rank
whose input is wrong makes every rank raise the same error, and ranks that call different methods
get a DistributedIndexError instead of a hang or a silent mix-up.

State every rank holds alike (updated by each collective call, so reading it needs no communication):
the row count of each shard, a range containing each shard's ids (to skip the global uniqueness
check of new ids when ranges cannot collide) and the next default id.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import FlatIndex, IVFIndex
from ..checks import check_int, id_array
from .comm import Comm, digest
from .files import (encoder_config, file_sha256, load_shard, read_manifest, remove_stale_shards, shard_file_name,
                    write_manifest)
from .inputs import as_float32, count_rows, pad_rows, same_across_ranks
from .merge import merge_topk

_EMPTY = (np.iinfo(np.int64).max, -1)  # an id range holding nothing: lo > hi, neutral under min / max


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of rank ``rank`` when ``n`` rows are split into ``world_size`` contiguous parts
    whose sizes differ by at most one (the first ``n % world_size`` ranks get one row more)."""
    for value, name in ((n, "n"), (world_size, "world_size")):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < (name == "world_size"):
            raise ValueError(f"{name} must be an integer >= {int(name == 'world_size')}, got {value!r}")
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    base, extra = divmod(int(n), int(world_size))
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class SearchStats:
    """Where one :meth:`ShardedIndex.search` spent its time on this rank (seconds) and what it moved.

    ``comm_s`` is everything besides the local search and the merge: input checks, the agreement
    round, the query broadcast and the result gather, including waiting for slower ranks.
    ``bytes_sent`` / ``bytes_received`` count payload bytes of this rank's collectives.
    """

    nq: int
    k: int
    local_s: float
    comm_s: float
    merge_s: float
    total_s: float
    bytes_sent: int
    bytes_received: int


class ShardedIndex:
    """A sharded index: ``ShardedIndex(local_index)`` on every rank after
    ``torch.distributed.init_process_group(...)`` (or :func:`init_distributed`).

    ``local`` is this rank's FlatIndex or IVFIndex (empty, or already holding its shard); every rank's
    must have the same type, metric, dim and encoder (configuration and tensors), and IVF shards the
    same centroids or none yet; shard ids must be unique across ranks. ``group``: the process group
    (None: the default one). ``timeout``: seconds any one collective may wait for the other ranks
    (None: the group's timeout); after a timeout or a lost rank every rank raises
    :class:`DistributedIndexError` and the group is not used again.

    Tensors are exchanged on the backend's device (CPU for gloo, ``cuda:LOCAL_RANK`` for NCCL),
    whatever device the local index keeps its codes on.
    """

    def __init__(self, local: FlatIndex | IVFIndex, group: Any = None, timeout: float | None = None) -> None:
        if not isinstance(local, (FlatIndex, IVFIndex)):
            raise TypeError(f"local must be a tqindex FlatIndex or IVFIndex, got {type(local).__name__}")
        self.local = local
        self._comm = Comm(group, timeout)
        self.last_search: SearchStats | None = None
        """What the latest :meth:`search` on this rank cost."""
        self._sizes = np.zeros(self.world_size, dtype=np.int64)
        self._ranges = np.tile(np.array(_EMPTY, dtype=np.int64), (self.world_size, 1))
        self._next_id = 0
        self._join()

    # -- properties ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """Number of ranks (= shards)."""
        return self._comm.world_size

    @property
    def device(self) -> torch.device:
        """Where this rank's exchanged tensors live (CPU for gloo, ``cuda:LOCAL_RANK`` for NCCL)."""
        return self._comm.device

    @property
    def ntotal(self) -> int:
        """Vectors in all shards (as of the latest collective call; no communication)."""
        return int(self._sizes.sum())

    def __len__(self) -> int:
        return self.ntotal

    @property
    def shard_sizes(self) -> list[int]:
        """Vectors in each rank's shard, by rank."""
        return self._sizes.tolist()

    @property
    def dim(self) -> int:
        return self.local.encoder.dim

    @property
    def metric(self) -> str:
        return self.local.metric

    @property
    def encoder(self) -> Any:
        """The encoder every shard shares."""
        return self.local.encoder

    @property
    def is_trained(self) -> bool:
        """Whether the shards can be added to (IVF: centroids set; encoders trained)."""
        return self.local.is_trained

    def __repr__(self) -> str:
        return (f"ShardedIndex({type(self.local).__name__}, metric={self.metric!r}, ntotal={self.ntotal}, "
                f"shard_sizes={self.shard_sizes}, rank={self.rank} of {self.world_size})")

    # -- joining ------------------------------------------------------------------------------------
    def _describe(self) -> dict[str, Any]:
        """What must agree across shards (plus this shard's size and id range)."""
        local, enc = self.local, self.local.encoder
        ids = local.ids
        centroids = local.centroids if isinstance(local, IVFIndex) else None
        return {
            "same": {"index_type": type(local).__name__, "metric": local.metric, "dim": enc.dim,
                     "encoder": encoder_config(enc), "encoder_trained": enc.is_trained,
                     "encoder_tensors": digest(*(x for kv in sorted(enc.tensors().items()) for x in kv)),
                     "nlist": getattr(local, "nlist", None),
                     "centroids": None if centroids is None else digest(centroids)},
            "ntotal": local.ntotal,
            "ids": [int(ids.min()), int(ids.max())] if len(ids) else list(_EMPTY),
        }

    def _join(self) -> None:
        """Check that the shards fit together and learn their sizes and id ranges (collective)."""
        error, text = None, b""
        try:
            text = json.dumps(self._describe(), sort_keys=True).encode()
        except Exception as e:  # a broken local index must not leave the other ranks waiting
            error = e
        self._comm.agree("init", [], error)
        shards = [json.loads(t) for t in self._comm.all_gather_bytes(text, "ShardedIndex init")]
        for key in shards[0]["same"]:
            values = [s["same"][key] for s in shards]
            if any(v != values[0] for v in values):
                shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                raise ValueError(f"the shards' {key} differ ({shown}): every rank needs the same index type, "
                                 "metric, encoder and (IVF) centroids")
        self._sizes = np.array([s["ntotal"] for s in shards], dtype=np.int64)
        self._ranges = np.array([s["ids"] for s in shards], dtype=np.int64)
        if self._ranges_collide(self._ranges, np.tile(np.array(_EMPTY), (self.world_size, 1))):
            self._check_ids(self.local.ids, against_stored=False)
        self._next_id = max(self._next_id, int(self._ranges[:, 1].max()) + 1)

    # -- ids ----------------------------------------------------------------------------------------
    @staticmethod
    def _ranges_collide(new: np.ndarray, stored: np.ndarray) -> bool:
        """Whether id ranges [world, 2] of new ids of different ranks overlap each other, or any new range
        overlaps any stored range; False proves the new ids unique (empty ranges have lo > hi)."""
        live = [(lo, hi, r) for r, (lo, hi) in enumerate(new.tolist()) if lo <= hi]
        held = [(lo, hi) for lo, hi in stored.tolist() if lo <= hi]
        for i, (lo, hi, r) in enumerate(live):
            if any(lo <= h and l <= hi for l, h in held):
                return True
            if any(lo <= h and l <= hi for l, h, s in live[i + 1 :] if s != r):
                return True
        return False

    def _check_ids(self, ids: np.ndarray, against_stored: bool) -> None:
        """Raise ValueError on every rank unless the ids of all ranks (this rank's: ``ids`` int64 [n]) are
        distinct and, with ``against_stored``, none is already in a shard (collective)."""
        parts = self._comm.all_gather_var(torch.from_numpy(ids), "ShardedIndex ids")
        every = torch.cat(parts).cpu().numpy()
        values, counts = np.unique(every, return_counts=True)
        if (counts > 1).any():  # every rank sees this alike
            raise ValueError(f"ids must be unique across ranks; given on more than one rank: "
                             f"{values[counts > 1][:5].tolist()}")
        error = None
        if against_stored and self.local.ntotal:
            present = every[np.isin(every, self.local.ids)]
            if len(present):
                error = ValueError(f"ids already in the shard of rank {self.rank}: {present[:5].tolist()}")
        self._comm.agree("ids", [], error)

    # -- add ----------------------------------------------------------------------------------------
    def add(self, x: Any = None, ids: Any = None, *, src: int | None = None, progress: bool | None = None) -> None:
        """Add vectors (collective).

        SPMD (``src=None``): each rank adds its own rows x [n_r, dim] (numpy or torch float; None or
        n_r = 0 for none) to its shard, with ``ids`` int64 [n_r] unique across all ranks, or, on every
        rank, ids=None: then ids are assigned as one index would, to the rows of all ranks in rank
        order (rank 0's rows first), starting after the largest id so far.
        ``src=r``: rank r's x [n, dim] (and ids [n], or None: ``next ids`` in row order) are split into
        contiguous near-equal parts (:func:`shard_range`), one per rank; x and ids are ignored elsewhere.
        A failure on any rank (bad input, duplicate ids) raises on every rank and adds nothing anywhere.
        """
        error, n, given, lo, hi = None, 0, False, *_EMPTY
        try:
            src = self._check_rank(src, "src")
        except ValueError as e:  # raised on every rank by the agreement below
            error, src = e, None
        if src is not None:
            x, ids = self._scatter(x, ids, src)
        try:
            if error is not None:
                raise error
            n = count_rows(x, self.dim, "x")
            given = ids is not None
            if given:
                ids = id_array(ids, "ids", n)
                lo, hi = (int(ids.min()), int(ids.max())) if n else _EMPTY
        except (ValueError, TypeError) as e:
            error = e
        table = self._comm.agree("add", [n, given, lo, hi], error)
        counts, given_by = table[:, 0], table[:, 1].astype(bool)
        if given_by.any() and not given_by.all():
            raise ValueError(f"ids were given on ranks {np.nonzero(given_by)[0].tolist()} only: pass ids on "
                             "every rank (each for its own rows) or on none")
        if not given_by.any():  # the same ids one index would give the concatenated rows
            start = self._next_id + int(counts[: self.rank].sum())
            ids = np.arange(start, start + n, dtype=np.int64)
            new_ranges = np.stack([self._next_id + np.concatenate([[0], counts.cumsum()[:-1]]),
                                   self._next_id + counts.cumsum() - 1], 1)
        else:
            new_ranges = table[:, 2:4]
            if self._ranges_collide(new_ranges, self._ranges):
                self._check_ids(ids, against_stored=True)
        error = None
        try:
            if n:
                self.local.add(x, ids=ids, progress=progress if self.rank == 0 else False)
        except Exception as e:  # roll the other ranks back, then raise everywhere
            error = e
        try:
            done = self._comm.agree("add:done", [self.local.ntotal], error)
        except Exception:
            if error is None and n:
                self.local.remove_ids(ids)
            raise
        self._sizes = done[:, 0].copy()
        self._ranges = np.stack([np.minimum(self._ranges[:, 0], new_ranges[:, 0]),
                                 np.maximum(self._ranges[:, 1], new_ranges[:, 1])], 1)
        self._next_id = max(self._next_id, int(new_ranges[:, 1].max()) + 1)

    def add_with_ids(self, x: Any, ids: Any, *, src: int | None = None, progress: bool | None = None) -> None:
        """faiss-style alias of ``add(x, ids=ids, src=src)``."""
        self.add(x, ids=ids, src=src, progress=progress)

    def assign_ids(self, n: int) -> np.ndarray:
        """Global ids for this rank's next ``n`` rows (collective; nothing is added): the ids ``add`` would
        give them, every rank's rows in rank order after the largest id so far. -> int64 [n]. Use them
        to label rows before adding (then pass them as ``ids``)."""
        error = None
        try:
            n = check_int(n, "n", 0)
        except ValueError as e:
            error, n = e, 0
        counts = self._comm.agree("assign_ids", [n], error)[:, 0]
        start = self._next_id + int(counts[: self.rank].sum())
        self._next_id += int(counts.sum())
        return np.arange(start, start + n, dtype=np.int64)

    def _scatter(self, x: Any, ids: Any, src: int) -> tuple[Tensor, np.ndarray]:
        """Rank ``src``'s rows and ids split into contiguous parts -> (this rank's rows float32
        [n_r, dim] on the exchange device, their ids int64 [n_r])."""
        error, n, given = None, 0, False
        if self.rank == src:
            try:
                n = count_rows(x, self.dim, "x")
                given = ids is not None
                if given:
                    ids = id_array(ids, "ids", n)
            except (ValueError, TypeError) as e:
                error = e
        table = self._comm.agree("add:scatter", [n, given, src], error)
        same_across_ranks(table[:, 2], "src")
        n, given = int(table[src, 0]), bool(table[src, 1])
        if n == 0:
            return torch.empty(0, self.dim), np.empty(0, np.int64)
        world = self.world_size
        bounds = [shard_range(n, r, world) for r in range(world)]
        width = max(b - a for a, b in bounds)
        parts_x = parts_ids = None
        if self.rank == src:
            xt = as_float32(x)
            all_ids = torch.from_numpy(ids) if given else torch.arange(self._next_id, self._next_id + n)
            parts_x = [pad_rows(xt[a:b], width) for a, b in bounds]
            parts_ids = [pad_rows(all_ids[a:b], width) for a, b in bounds]
        start, stop = bounds[self.rank]
        mine = self._comm.scatter(parts_x, torch.empty(width, self.dim), src, "ShardedIndex add (rows)")
        my_ids = self._comm.scatter(parts_ids, torch.empty(width, dtype=torch.int64), src, "ShardedIndex add (ids)")
        return mine[: stop - start], my_ids[: stop - start].cpu().numpy()

    # -- search -------------------------------------------------------------------------------------
    def search(self, q: Any, k: int, allow: Any = None, *, src: int | None = None, dst: int | None = None,
               progress: bool | None = None, **options: Any) -> tuple[Any, Any]:
        """Global top-k search (collective).

        q [nq, dim] float queries: the same on every rank (``src=None``; checked), or given on rank
        ``src`` only and broadcast (``q`` is ignored elsewhere and may be None); ``allow`` (ids) likewise.
        Each rank searches its shard; the per-rank (D, I) are gathered and merged (equal scores:
        smaller id first). ``options`` go to the local search (e.g. ``nprobe`` for IVF; the same on
        every rank). Returns (D float32 [nq, k], I int64 [nq, k]) as a local index does (numpy in,
        numpy out; torch in, torch out on q's device, or on :attr:`device` on ranks that were not
        given q), ids -1 and scores -inf (+inf for "l2") where fewer than k vectors exist; on every
        rank, or with ``dst=r`` on rank r only ((None, None) elsewhere).
        """
        comm, t0 = self._comm, time.perf_counter()
        sent0, received0 = comm.bytes_sent, comm.bytes_received
        error, nq, qdig, alen, adig, odig, kind = None, 0, 0, -1, 0, 0, 0
        qt = allowed = None
        try:
            k = check_int(k, "k", 1)
            src, dst = self._check_rank(src, "src"), self._check_rank(dst, "dst")
            if isinstance(self.local, IVFIndex) and "nprobe" not in options:
                options["nprobe"] = self.local.nprobe
            odig = digest(json.dumps(options, sort_keys=True, default=repr))
            if src is None or self.rank == src:
                nq = count_rows(q, self.dim, "q", allow_empty=True, allow_none=False)
                kind = isinstance(q, Tensor)
                allowed = None if allow is None else id_array(allow, "allow")
                alen = -1 if allowed is None else len(allowed)
                if src is None:
                    qdig, adig = digest(q), digest(allowed)
                else:
                    qt = as_float32(q)
        except (ValueError, TypeError) as e:
            error, k, src, dst = e, 0, None, None
        table = comm.agree("search", [nq, k, qdig, alen, adig, odig, -1 if src is None else src,
                                      -1 if dst is None else dst, kind], error)
        for col, name in ((1, "k"), (5, "search options"), (6, "src"), (7, "dst")):
            same_across_ranks(table[:, col], name)
        if src is None:
            same_across_ranks(table[:, 2], "q (pass the same queries on every rank, or src=rank to broadcast "
                                           "one rank's)")
            same_across_ranks(table[:, 3:5], "allow")
            local_q = q
        else:
            nq, alen, kind = (int(v) for v in table[src, [0, 3, 8]])
            local_q = comm.broadcast(qt if qt is not None else torch.empty(nq, self.dim), src,
                                     "ShardedIndex search (queries)")
            if alen >= 0:
                got = torch.from_numpy(allowed) if allowed is not None else torch.empty(alen, dtype=torch.int64)
                allowed = comm.broadcast(got, src, "ShardedIndex search (allow)").cpu().numpy()
        t1, error = time.perf_counter(), None
        try:
            D, I = self.local.search(local_q, k, allowed, progress=progress if self.rank == 0 else False, **options)
            D, I = torch.as_tensor(D), torch.as_tensor(I)
        except Exception as e:  # reported to every rank below
            error = e
            D, I = torch.zeros(nq, k), torch.zeros(nq, k, dtype=torch.int64)
        t2 = time.perf_counter()
        payload = torch.cat([I.to(comm.device, torch.int64).reshape(-1).view(torch.int32),
                             D.to(comm.device, torch.float32).reshape(-1).view(torch.int32),
                             torch.tensor([error is not None], dtype=torch.int32, device=comm.device)])
        if dst is None:
            rows = comm.all_gather(payload, "ShardedIndex search (results)")  # [world, 3 nq k + 1]
            if bool(rows[:, -1].any()):
                comm.agree("search:done", [], error)
        else:
            comm.agree("search:done", [], error)
            rows = comm.gather(payload, dst, "ShardedIndex search (results)")
        t3 = time.perf_counter()
        out: tuple[Any, Any] = (None, None)
        if rows is not None:
            nk, world = nq * k, self.world_size
            ids = rows[:, : 2 * nk].reshape(-1).view(torch.int64).reshape(world, nq, k)  # a copy unless world = 1
            scores = rows[:, 2 * nk : 3 * nk].reshape(-1).view(torch.float32).reshape(world, nq, k)
            D, I = merge_topk(scores.permute(1, 0, 2).reshape(nq, world * k),
                              ids.permute(1, 0, 2).reshape(nq, world * k), k, self.metric) if nq else (
                torch.empty(0, k), torch.empty(0, k, dtype=torch.int64))
            if kind:
                device = q.device if isinstance(q, Tensor) and (src is None or self.rank == src) else comm.device
                out = (D.to(device), I.to(device))
            else:
                out = (D.cpu().numpy(), I.cpu().numpy())
        t4 = time.perf_counter()
        self.last_search = SearchStats(nq, k, t2 - t1, (t1 - t0) + (t3 - t2), t4 - t3, t4 - t0,
                                       comm.bytes_sent - sent0, comm.bytes_received - received0)
        return out

    # -- remove -------------------------------------------------------------------------------------
    def remove_ids(self, ids: Any, *, src: int | None = None) -> int:
        """Remove vectors by id from whichever shard holds them (collective) -> number removed in all shards.

        ``src=None``: the union of the ids given on all ranks is removed (pass the same ids everywhere,
        or each rank some); ``src=r``: rank r's ids (ignored elsewhere). Unknown ids are ignored.
        """
        error, n, dig = None, 0, 0
        try:
            src = self._check_rank(src, "src")
            if src is None or self.rank == src:
                ids = id_array(ids, "ids")
                n, dig = len(ids), digest(ids)
        except (ValueError, TypeError) as e:
            error, src = e, None
        table = self._comm.agree("remove", [n, dig, -1 if src is None else src], error)
        same_across_ranks(table[:, 2], "src")
        if src is not None:
            got = torch.from_numpy(ids) if self.rank == src else torch.empty(int(table[src, 0]), dtype=torch.int64)
            ids = self._comm.broadcast(got, src, "ShardedIndex remove_ids").cpu().numpy()
        elif (table[:, :2] != table[0, :2]).any():  # different lists: every rank removes the union
            parts = self._comm.all_gather_var(torch.from_numpy(ids), "ShardedIndex remove_ids")
            ids = np.unique(torch.cat(parts).cpu().numpy())
        error, removed = None, 0
        try:
            removed = self.local.remove_ids(ids) if len(ids) else 0
        except Exception as e:
            error = e
        table = self._comm.agree("remove:done", [removed, self.local.ntotal], error)
        self._sizes = table[:, 1].copy()
        return int(table[:, 0].sum())

    # -- train --------------------------------------------------------------------------------------
    def train(self, x: Any = None, *, src: int = 0) -> None:
        """Train once, on rank ``src`` with its x [n, dim] (ignored elsewhere), and share the result
        (collective). IVF: the coarse centroids are learned there and set on every shard. Flat: there is
        nothing to train (encoders are trained before sharding; see :func:`broadcast_encoder`)."""
        error = None
        try:
            src = self._check_rank(src, "src")
            if src is None:
                raise ValueError(f"src must be a rank in [0, {self.world_size}), got None")
            if not self.local.encoder.is_trained:
                raise ValueError("the encoder is not trained: train it once, share it with broadcast_encoder(), "
                                 "and build every rank's index from it before sharding")
            if self.ntotal:
                raise ValueError(f"train must come before add: the shards already hold {self.ntotal} vectors")
            if self.rank == src and isinstance(self.local, IVFIndex):
                self.local.train(x)
        except (ValueError, TypeError) as e:
            error, src = e, -1
        table = self._comm.agree("train", [src], error)
        same_across_ranks(table[:, 0], "src")
        if not isinstance(self.local, IVFIndex):
            return
        nlist = self.local.nlist
        got = self.local.centroids if self.rank == src else torch.empty(nlist, self.dim)
        centroids = self._comm.broadcast(got, src, "ShardedIndex train (centroids)").cpu()
        error = None
        try:
            if self.rank != src:
                self.local.set_centroids(centroids)
        except Exception as e:
            error = e
        self._comm.agree("train:done", [], error)

    # -- files --------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the sharded index to directory ``path`` (collective; created if needed): one index file per
        rank and ``manifest.json`` (see ``tqindex.distributed.files``), written last by rank 0. Every rank
        must see the directory (a shared file system), or rank 0 must see all shard files."""
        directory, error, entry = Path(path), None, b""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            name = shard_file_name(self.rank, self.world_size)
            self.local.save(directory / name)
            entry = json.dumps({"rank": self.rank, "file": name, "ntotal": self.local.ntotal,
                                "bytes": (directory / name).stat().st_size,
                                "sha256": file_sha256(directory / name)}).encode()
        except Exception as e:
            error = e
        self._comm.agree("save", [], error)
        shards = [json.loads(t) for t in self._comm.all_gather_bytes(entry, "ShardedIndex save")]
        error = None
        if self.rank == 0:
            try:
                enc = self.local.encoder
                write_manifest(directory, {"world_size": self.world_size, "index_type": type(self.local).__name__,
                                           "metric": self.metric, "dim": self.dim, "code_size": enc.code_size,
                                           "encoder": encoder_config(enc), "ntotal": self.ntotal,
                                           "next_id": self._next_id, "shards": shards})
                remove_stale_shards(directory, {s["file"] for s in shards})
            except Exception as e:
                error = e
        self._comm.agree("save:done", [], error)

    @classmethod
    def load(cls, path: str | os.PathLike, group: Any = None, timeout: float | None = None) -> "ShardedIndex":
        """Open the sharded index that :meth:`save` wrote to directory ``path`` (collective): rank 0 reads
        the manifest and sends it to all ranks; each rank loads its own shard file, checked against the
        manifest (SHA-256, type, encoder, row count). The group must have as many ranks as the index
        has shards, else every rank raises ValueError."""
        comm = Comm(group, timeout)
        error, text = None, b""
        if comm.rank == 0:
            try:
                text = json.dumps(read_manifest(path)).encode()
            except (OSError, ValueError) as e:
                error = e
        comm.agree("load", [], error)
        manifest = json.loads(comm.broadcast_bytes(text, 0, "ShardedIndex load (manifest)"))
        if manifest["world_size"] != comm.world_size:
            raise ValueError(f"{path} holds {manifest['world_size']} shards, saved by {manifest['world_size']} ranks, "
                             f"but this group has {comm.world_size} ranks: run with {manifest['world_size']} ranks")
        error, local = None, None
        try:
            local = load_shard(path, manifest, comm.rank)
        except Exception as e:
            error = e
        comm.agree("load:shard", [], error)
        index = cls(local, group, timeout)
        index._next_id = max(index._next_id, manifest["next_id"])
        return index

    # -- helpers ------------------------------------------------------------------------------------
    def _check_rank(self, value: Any, name: str) -> int | None:
        if value is None:
            return None
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < self.world_size:
            raise ValueError(f"{name} must be None or a rank in [0, {self.world_size}), got {value!r}")
        return int(value)
