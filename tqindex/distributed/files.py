"""Files of a sharded index: a directory holding one index file per rank and a JSON manifest.

Layout of ``<directory>/``:

- ``shard-RRRRR-of-WWWWW.tqi``: rank R's local index (an ordinary index file, ``tqindex.io``), for a
  group of W ranks;
- ``manifest.json``: ``format = "tqindex-sharded"``, ``format_version``, ``world_size``, the index type,
  metric, dim, code size and encoder configuration shared by every shard, the global ``ntotal`` and
  ``next_id``, and per shard its rank, file name, row count, size in bytes and SHA-256.

The manifest is written last (atomically), so it only ever names complete shard files; the SHA-256
ties each shard file to the save that wrote it (a shard left over from another save is refused).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .. import load_index

MANIFEST = "manifest.json"
FORMAT = "tqindex-sharded"
FORMAT_VERSION = 1
_SHARD = re.compile(r"shard-(\d{5})-of-(\d{5})\.tqi")


def shard_file_name(rank: int, world_size: int) -> str:
    """File name of rank ``rank``'s shard in a group of ``world_size`` ranks."""
    return f"shard-{rank:05d}-of-{world_size:05d}.tqi"


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes (read in 4 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()


def encoder_config(encoder: Any) -> dict[str, Any]:
    """An encoder's configuration as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(encoder.to_dict()))


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` to ``directory/manifest.json`` atomically (temporary file, fsync, rename)."""
    path = Path(directory) / MANIFEST
    fd, tmp = tempfile.mkstemp(prefix=MANIFEST + ".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "format_version": FORMAT_VERSION, **manifest}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_stale_shards(directory: str | os.PathLike, keep: set[str]) -> None:
    """Delete shard files of earlier saves (names of the shard pattern not in ``keep``) from ``directory``."""
    for p in Path(directory).iterdir():
        if _SHARD.fullmatch(p.name) and p.name not in keep:
            p.unlink(missing_ok=True)


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The validated manifest of the sharded index in ``directory``.

    Raises FileNotFoundError where there is none and ValueError for a foreign, newer or inconsistent one.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no sharded index at {directory}: {MANIFEST} is missing")
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {m.get('format_version')!r} is not supported "
                         f"(this tqindex reads version {FORMAT_VERSION})")
    need = {"world_size": int, "index_type": str, "metric": str, "dim": int, "code_size": int, "encoder": dict,
            "ntotal": int, "next_id": int, "shards": list}
    for key, kind in need.items():
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            raise ValueError(f"{path}: field {key!r} must be a {kind.__name__}, got {m.get(key)!r}")
    world, shards = m["world_size"], m["shards"]
    if world < 1 or len(shards) != world:
        raise ValueError(f"{path}: world_size {world} does not match its {len(shards)} shard entries")
    for rank, s in enumerate(shards):
        ok = (isinstance(s, dict) and s.get("rank") == rank and s.get("file") == shard_file_name(rank, world)
              and all(isinstance(s.get(f), int) and s[f] >= 0 for f in ("ntotal", "bytes"))
              and isinstance(s.get("sha256"), str))
        if not ok:
            raise ValueError(f"{path}: shard entry {rank} is malformed: {s!r}")
    if sum(s["ntotal"] for s in shards) != m["ntotal"]:
        raise ValueError(f"{path}: the shards' row counts do not add up to ntotal={m['ntotal']}")
    return m


def load_shard(directory: str | os.PathLike, manifest: dict[str, Any], rank: int) -> Any:
    """Load rank ``rank``'s shard named in ``manifest`` (from :func:`read_manifest`), checking that the file
    is the one the manifest was written with and that the index matches the manifest."""
    entry = manifest["shards"][rank]
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise FileNotFoundError(f"shard file {path} of rank {rank} is missing")
    if path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
        raise ValueError(f"{path} is not the shard file {MANIFEST} names (size or SHA-256 differ): it was "
                         "damaged or written by another save")
    index = load_index(path)
    found = {"index_type": type(index).__name__, "metric": index.metric, "dim": index.encoder.dim,
             "code_size": index.encoder.code_size, "encoder": encoder_config(index.encoder)}
    for key, value in found.items():
        if manifest[key] != value:
            raise ValueError(f"{path}: {key} {value!r} differs from the manifest's {manifest[key]!r}")
    if index.ntotal != entry["ntotal"]:
        raise ValueError(f"{path} holds {index.ntotal} vectors, the manifest says {entry['ntotal']}")
    return index
