"""Index files: HDF5 (h5py) holding a JSON header, numeric datasets and a SHA-256 checksum. No pickle.

Layout of a file:

- root attributes ``format = "tqindex"``, ``format_version = 1``, ``header`` (a JSON string: index
  type, metric, dim, ntotal, code_size, the encoder's ``to_dict()``, options, IVF settings) and
  ``checksum`` (hex SHA-256, see :func:`_checksum`);
- one numeric dataset per array, named by path: ``codes/<plane>`` (every Codes plane), ``ids``,
  ``encoder/<name>`` (rotation, codebooks: the encoder's ``tensors()``), and where present
  ``vectors`` (kept originals), ``ivf/centroids``, ``ivf/list_offsets``.

Loading reads only numbers and JSON, so it never runs code; any damage (truncation, flipped bytes,
a foreign or newer file) raises ``ValueError`` naming the problem. Saving is atomic: the file is
written beside its target as ``<path>.tmp-XXXXXXXX``, flushed to disk and renamed over ``path``
(:func:`atomic_path`); it gets the permissions of any new file of the process (``0o666`` less the
umask).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import h5py
import numpy as np

FORMAT = "tqindex"
FORMAT_VERSION = 1
_INDEX_TYPES: dict[str, Callable[[dict, dict[str, np.ndarray]], Any]] = {}


def register_index_type(name: str, loader: Callable[[dict, dict[str, np.ndarray]], Any]) -> None:
    """Make :func:`load_index` build headers with ``index_type == name`` by ``loader(header, arrays)``."""
    _INDEX_TYPES[name] = loader


def write_index_file(path: str | os.PathLike, header: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write ``header`` (JSON-serialisable dict) and numeric ``arrays`` (name -> array) to ``path`` atomically."""
    path = Path(path)
    text = json.dumps(header, sort_keys=True)
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["header"] = text
        f.attrs["checksum"] = _checksum(text, arrays)
        for name, a in arrays.items():
            f.create_dataset(name, data=a)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Write ``path`` atomically: yields a new empty file beside it to write and close; on success it is
    flushed to disk and renamed over ``path``, on any error (or interrupt) removed, leaving ``path`` as it was.

    The temporary file is created as ``open()`` creates files (mode ``0o666`` less the process umask),
    so the result has the user's normal permissions.
    """
    path = Path(path)
    for _ in range(100):
        tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {path}")
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header of an index file (no dataset is read). Raises ValueError for a non-index file."""
    with _open(path) as f:
        return _header(f, path)[0]


def read_index_file(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of an index file, checksum verified. Raises ValueError on any damage."""
    with _open(path) as f:
        header, text = _header(f, path)
        try:
            arrays = _read_arrays(f)
            stored = f.attrs.get("checksum")
        except (OSError, KeyError, RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: index file is damaged ({e})") from None
    if not isinstance(stored, str) or stored != _checksum(text, arrays):
        raise ValueError(f"{path}: checksum mismatch: the index file is corrupted")
    return header, arrays


def load_index(path: str | os.PathLike) -> Any:
    """Load an index written by ``index.save(path)`` (FlatIndex, IVFIndex); never executes code."""
    header, arrays = read_index_file(path)
    kind = header.get("index_type")
    if kind not in _INDEX_TYPES:
        raise ValueError(f"{path}: unknown index_type {kind!r}; known: {sorted(_INDEX_TYPES)}")
    try:
        return _INDEX_TYPES[kind](header, arrays)
    except (KeyError, IndexError, TypeError, RuntimeError) as e:
        raise ValueError(f"{path}: inconsistent index file ({type(e).__name__}: {e})") from None


def _open(path: str | os.PathLike) -> h5py.File:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no index file at {path}")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise ValueError(f"{path}: not a readable HDF5 index file (truncated or foreign): {e}") from None


def _header(f: h5py.File, path: str | os.PathLike) -> tuple[dict, str]:
    """Check format and version attributes; -> (parsed JSON header, its text)."""
    try:
        fmt, version, text = f.attrs.get("format"), f.attrs.get("format_version"), f.attrs.get("header")
    except (OSError, KeyError, RuntimeError, TypeError) as e:
        raise ValueError(f"{path}: index file attributes are damaged ({e})") from None
    if fmt != FORMAT:
        raise ValueError(f"{path}: not a tqindex file (format attribute {fmt!r}, expected {FORMAT!r})")
    if not isinstance(version, (int, np.integer)) or not 1 <= version <= FORMAT_VERSION:
        shown = int(version) if isinstance(version, (int, np.integer)) else repr(version)
        raise ValueError(
            f"{path}: format_version {shown} is not supported (this tqindex reads versions 1..{FORMAT_VERSION})"
        )
    try:
        header = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: index header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: index header must be a JSON object, got {type(header).__name__}")
    return header, text


def _read_arrays(f: h5py.File) -> dict[str, np.ndarray]:
    """Every dataset of the file as a numpy array, by path name (numeric datasets only)."""
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    out = {}
    for name in names:
        ds = f[name]
        if ds.dtype.kind not in "biuf":
            raise TypeError(f"dataset {name!r} has non-numeric dtype {ds.dtype}")
        out[name] = ds[()]
    return out


def _checksum(header_text: str, arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over the header, then per dataset in name order: name, dtype, shape and raw bytes."""
    h = hashlib.sha256(header_text.encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.data)
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
