"""The collectives a sharded index needs, over one ``torch.distributed`` process group.

Every collective is issued asynchronously and waited for with the index's timeout, so a rank that
died or stopped calling turns into :class:`DistributedIndexError` on the others instead of a hang.
Tensors are exchanged on the backend's device: CPU for gloo, ``cuda:LOCAL_RANK`` for NCCL.

:meth:`Comm.agree` is the protocol every public operation starts (and, where it can fail half way,
ends) with: each rank contributes a fixed-size int64 header (its status, the operation it is in and
a few integers); all ranks receive the same table and take every later branch from it, so they stay
in step. A rank whose local part failed makes every rank raise the same error.

Also here: :func:`init_distributed` (join the group torchrun describes, pick this rank's device) and
:func:`broadcast_encoder` (one rank's trained encoder on every rank).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .. import Encoder, encoder_from_dict
from .files import encoder_config

HEADER_FIELDS = 12
"""Integers per rank in an :meth:`Comm.agree` header, after status, operation and message length."""
OPS = ("init", "ids", "assign_ids", "add", "add:scatter", "add:done", "search", "search:done", "remove", "remove:done",
       "train", "train:done", "save", "save:done", "load", "load:shard", "encoder")
_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, FileNotFoundError)
"""Exception types raised as themselves on every rank; any other failure is a DistributedIndexError."""


class DistributedIndexError(RuntimeError):
    """A sharded operation failed on another rank, or the ranks could not communicate (a rank exited,
    stopped responding within the timeout, or made different calls)."""


def local_device(backend: str) -> torch.device:
    """The device this rank exchanges tensors on: ``cuda:LOCAL_RANK`` for "nccl" (the current CUDA
    device where LOCAL_RANK is unset), the CPU for any other backend."""
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("the nccl backend needs CUDA, which this torch build or machine does not have")
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def init_distributed(backend: str | None = None, timeout: float = 600.0) -> torch.device:
    """Join the process group that ``torchrun`` describes (env://: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK) unless one is already initialized; -> this rank's device.

    backend: "nccl", "gloo" or None (NCCL where CUDA is available, else gloo). With NCCL the device is
    ``cuda:LOCAL_RANK`` and becomes the current CUDA device. timeout: seconds a collective may wait.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    timeout = check_timeout(timeout)
    device = local_device(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return device


def check_timeout(timeout: Any) -> float:
    """``timeout`` (seconds, a positive finite real number) as a float; ValueError otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def digest(*parts: Any) -> int:
    """A signed 64-bit digest (BLAKE2b) of arrays, tensors (their bytes, dtypes and shapes; moved to the
    CPU first), strings and integers, in order; equal inputs give equal digests on every machine."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, Tensor):
            p = p.detach().cpu().contiguous().numpy()
        if isinstance(p, np.ndarray):
            a = np.ascontiguousarray(p)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.reshape(-1).view(np.uint8).data)
        else:
            h.update(repr(p).encode())
        h.update(b"\0")
    return int.from_bytes(h.digest(), "little", signed=True)


class Comm:
    """Collectives over ``group`` (None: the default group) with a per-call ``timeout`` in seconds
    (None: the group's own), counting the bytes this rank sends and receives (payload only)."""

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
                               "or tqindex.distributed.init_distributed() on every rank first")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.device = local_device(self.backend)
        self.timeout = None if timeout is None else check_timeout(timeout)
        self.failed: str | None = None  # what broke the group, once a collective failed
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- plumbing -----------------------------------------------------------------------------------
    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _run(self, what: str, call: Callable[[], Any]) -> None:
        """Issue one asynchronous collective and wait for it (with the timeout)."""
        if self.failed is not None:
            raise DistributedIndexError(f"rank {self.rank}: an earlier collective failed ({self.failed}); this "
                                        "process group cannot be used any more: restart every rank")
        try:
            work = call()
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # gloo/NCCL errors come as RuntimeError subclasses of several kinds
            text = str(e).splitlines()[0] if str(e) else ""
            timed_out = isinstance(e, TimeoutError) or "timed out" in text.lower() or "timeout" in text.lower()
            limit = "the process group's timeout" if self.timeout is None else f"the timeout of {self.timeout:g} s"
            self.failed = f"{what}: {type(e).__name__}"
            raise DistributedIndexError(
                f"rank {self.rank} of {self.world_size}: {what} "
                f"{'did not complete within ' + limit if timed_out else 'failed'} ({type(e).__name__}: {text}). "
                "Another rank exited, raised outside a ShardedIndex call, or is not making the same ShardedIndex "
                "calls in the same order; this process group cannot be used any more") from e

    # -- collectives --------------------------------------------------------------------------------
    def all_gather(self, t: Tensor, what: str = "all_gather") -> Tensor:
        """Every rank's ``t`` (same shape and dtype everywhere) -> [world_size, *t.shape] on this device."""
        t = t.to(self.device).contiguous()
        out = t.new_empty(self.world_size * t.numel())
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._run(what, lambda: gather(out, t.reshape(-1), group=self.group, async_op=True))
        self.bytes_sent += t.nbytes
        self.bytes_received += (self.world_size - 1) * t.nbytes
        return out.reshape(self.world_size, *t.shape)

    def all_gather_var(self, t: Tensor, what: str = "all_gather") -> list[Tensor]:
        """Every rank's 1-D ``t`` (lengths may differ, dtype the same) -> list of world_size tensors."""
        sizes = self.all_gather(torch.tensor([t.numel()]), what + " (sizes)")[:, 0].tolist()
        padded = t.to(self.device).reshape(-1).new_zeros(max(sizes))
        padded[: t.numel()] = t.reshape(-1)
        out = self.all_gather(padded, what)
        return [out[r, :n] for r, n in enumerate(sizes)]

    def broadcast(self, t: Tensor, src: int, what: str = "broadcast") -> Tensor:
        """``t`` of rank ``src`` on every rank (``t`` gives shape and dtype elsewhere) -> on this device."""
        t = t.to(self.device).contiguous()
        self._run(what, lambda: dist.broadcast(t, src=self._global(src), group=self.group, async_op=True))
        if self.rank == src:
            self.bytes_sent += t.nbytes
        else:
            self.bytes_received += t.nbytes
        return t

    def gather(self, t: Tensor, dst: int, what: str = "gather") -> Tensor | None:
        """Every rank's ``t`` (same shape everywhere) -> [world_size, *t.shape] on rank ``dst``, None elsewhere."""
        t = t.to(self.device).contiguous()
        out = t.new_empty((self.world_size, *t.shape)) if self.rank == dst else None
        parts = list(out.unbind(0)) if out is not None else None
        self._run(what, lambda: dist.gather(t, parts, dst=self._global(dst), group=self.group, async_op=True))
        if self.rank == dst:
            self.bytes_received += (self.world_size - 1) * t.nbytes
        else:
            self.bytes_sent += t.nbytes
        return out

    def scatter(self, parts: Sequence[Tensor] | None, out: Tensor, src: int, what: str = "scatter") -> Tensor:
        """``parts[r]`` of rank ``src`` (world_size tensors shaped like ``out``) into ``out`` on rank r."""
        out = out.to(self.device).contiguous()
        if self.rank == src:
            assert parts is not None and len(parts) == self.world_size
            parts = [p.to(self.device).contiguous() for p in parts]
        self._run(what, lambda: dist.scatter(out, parts if self.rank == src else None, src=self._global(src),
                                             group=self.group, async_op=True))
        if self.rank == src:
            self.bytes_sent += (self.world_size - 1) * out.nbytes
        else:
            self.bytes_received += out.nbytes
        return out

    def all_gather_bytes(self, data: bytes, what: str = "all_gather") -> list[bytes]:
        """Every rank's byte string -> list of world_size byte strings."""
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return [p.cpu().numpy().tobytes() for p in self.all_gather_var(t, what)]

    def broadcast_bytes(self, data: bytes | None, src: int, what: str = "broadcast") -> bytes:
        """Rank ``src``'s byte string (``data`` there; ignored elsewhere) on every rank."""
        n = self.broadcast(torch.tensor([len(data) if self.rank == src else 0]), src, what + " (size)")
        size = int(n[0])
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src and size
               else torch.zeros(size, dtype=torch.uint8))
        return self.broadcast(buf, src, what).cpu().numpy().tobytes()

    # -- the agreement protocol ---------------------------------------------------------------------
    def agree(self, op: str, fields: Sequence[int], error: BaseException | None = None) -> np.ndarray:
        """Start (or finish) operation ``op`` on every rank: exchange this rank's status (``error``, None
        when its local part succeeded) and up to HEADER_FIELDS integers -> int64 [world_size, HEADER_FIELDS].

        Raises on every rank alike when the ranks are in different operations (DistributedIndexError) or
        any rank failed (the failing rank's ValueError / TypeError / FileNotFoundError type, else
        DistributedIndexError; the message names each failing rank; chained to the local error there).
        """
        assert op in OPS and len(fields) <= HEADER_FIELDS
        message = b"" if error is None else f"{type(error).__name__}: {error}".encode()
        kind = 0 if error is None else next((i + 1 for i, t in enumerate(_ERRORS) if isinstance(error, t)),
                                            len(_ERRORS) + 1)
        head = np.zeros(3 + HEADER_FIELDS, dtype=np.int64)
        head[: 3 + len(fields)] = [kind, OPS.index(op), len(message), *(int(f) for f in fields)]
        table = self.all_gather(torch.from_numpy(head), f"ShardedIndex {op}").cpu().numpy()  # [world, 3 + FIELDS]
        ops = table[:, 1]
        if (ops != ops[0]).any():
            calls = ", ".join(f"rank {r}: {OPS[o]}" for r, o in enumerate(ops.tolist()))
            raise DistributedIndexError(f"the ranks called different ShardedIndex operations ({calls}); every rank "
                                        "must make the same calls in the same order")
        kinds = table[:, 0]
        if kinds.any():
            texts = self.all_gather_bytes(message, f"ShardedIndex {op} (errors)")
            failed = np.nonzero(kinds)[0].tolist()
            text = "; ".join(f"rank {r}: {texts[r].decode(errors='replace')}" for r in failed)
            k = int(kinds[failed[0]])
            cls = _ERRORS[k - 1] if k <= len(_ERRORS) and (kinds[failed] == k).all() else DistributedIndexError
            what = op.split(":")[0]
            raise cls(f"ShardedIndex {what} failed on {len(failed)} of {self.world_size} ranks: {text}") from error
        return table[:, 3:]


def broadcast_encoder(encoder: Encoder | None, src: int = 0, group: Any = None,
                      timeout: float | None = None) -> Encoder:
    """Rank ``src``'s encoder (configuration and tensors: a learned encoder such as TurboQuantPCA after
    training on one rank) rebuilt on every rank (collective; ``encoder`` is ignored elsewhere). Build
    each rank's local index from the returned encoder, then shard it."""
    comm = Comm(group, timeout)
    if not isinstance(src, (int, np.integer)) or isinstance(src, bool) or not 0 <= src < comm.world_size:
        raise ValueError(f"src must be a rank in [0, {comm.world_size}), got {src!r}")
    error, meta, data = None, b"", b""
    if comm.rank == src:
        try:
            if not isinstance(encoder, Encoder):
                raise TypeError(f"encoder must be a tqindex Encoder on rank {src}, got {type(encoder).__name__}")
            arrays = {name: t.detach().cpu().contiguous().numpy() for name, t in sorted(encoder.tensors().items())}
            meta = json.dumps({"config": encoder_config(encoder),
                               "tensors": [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]}).encode()
            data = b"".join(a.tobytes() for a in arrays.values())
        except Exception as e:
            error = e
    comm.agree("encoder", [], error)
    info = json.loads(comm.broadcast_bytes(meta, src, "broadcast_encoder (configuration)"))
    data = comm.broadcast_bytes(data, src, "broadcast_encoder (tensors)")
    tensors, offset = {}, 0
    for name, dtype, shape in info["tensors"]:
        a = np.frombuffer(data, dtype=np.dtype(dtype), count=int(np.prod(shape)), offset=offset).reshape(shape)
        tensors[name] = torch.from_numpy(a.copy())
        offset += a.nbytes
    return encoder_from_dict(info["config"], tensors)
