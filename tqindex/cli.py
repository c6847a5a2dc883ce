"""The ``tqindex`` command line (also ``python -m tqindex``)::

    tqindex build vectors.npy index.tqi --factory "IVF1024,tq4" --metric cosine
    tqindex search index.tqi queries.npy results.npz -k 10
    tqindex info index.tqi
    tqindex bench --quick        # benchmarks/ann.py of a source checkout; arguments pass through

Vector files: ``.npy`` (a [n, dim] array; read in chunks through a memory map), ``.parquet`` (a
list-valued column, needs pyarrow) or HDF5 (``.h5``/``.hdf5``: a [n, dim] dataset; ann-benchmarks
files give ``train`` to build, ``test`` to search, and their ``distance`` attribute the metric).
Search results go to ``.npz`` (arrays ``ids`` int64 [nq, k] and ``scores`` float32 [nq, k]) or HDF5
(datasets of the same names). Vectors get ids 0, 1, ... in file order.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

VECTOR_SUFFIXES = (".npy", ".parquet", ".h5", ".hdf5")
RESULT_SUFFIXES = (".npz", ".h5", ".hdf5")
DEFAULT_KEYS = {"build": ("train", "embeddings", "base"), "search": ("test", "queries")}
"""HDF5 datasets tried in order when ``--key`` is not given (then the file's only 2-D dataset)."""
ADD_CHUNK = 1 << 16
"""Vectors read and added per step of ``build``."""
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "ann.py"
"""The main benchmark job, present in a source checkout (not in an installed wheel)."""


# --------------------------------------------------------------------------------------------------
# vector files

@contextmanager
def open_vectors(path: str | Path, key: str | None, role: str) -> Iterator[tuple[Any, str | None]]:
    """Open a vector file for ``role`` ("build" or "search") -> (rows, metric).

    rows: a [n, dim] array-like sliced in chunks (numpy memory map, HDF5 dataset or numpy array);
    metric: "ip" / "cosine" / "l2" from an ann-benchmarks ``distance`` attribute, else None. key:
    the HDF5 dataset or parquet column (default: see ``DEFAULT_KEYS``; the only list column of a
    parquet file). Raises FileNotFoundError, or ValueError naming the file and what it holds.
    """
    path = Path(path)
    if path.suffix not in VECTOR_SUFFIXES:
        raise ValueError(f"vector file must end in one of {VECTOR_SUFFIXES}, got {str(path)!r}")
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    if path.suffix == ".npy":
        if key is not None:
            raise ValueError(f"--key names an HDF5 dataset or parquet column; {path} is a .npy file")
        yield _matrix(np.load(path, mmap_mode="r", allow_pickle=False), str(path)), None
    elif path.suffix == ".parquet":
        from .data import _parquet_embeddings

        yield _parquet_embeddings(path, key), None
    else:
        import h5py

        from .data import ANN_BENCHMARKS_METRICS

        try:
            f = h5py.File(path, "r")
        except OSError as e:
            raise ValueError(f"{path} is not a readable HDF5 file ({e})") from None
        with f:
            distance = f.attrs.get("distance")
            distance = distance.decode() if isinstance(distance, bytes) else distance
            name = _hdf5_key(f, key, role, path)
            yield _matrix(f[name], f"{path}:{name}"), ANN_BENCHMARKS_METRICS.get(distance)


def _hdf5_key(f: Any, key: str | None, role: str, path: Path) -> str:
    """The dataset of HDF5 file f holding the vectors: ``key``, a default name, or the only 2-D dataset."""
    import h5py

    found: list[str] = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) and obj.ndim == 2 else None)
    if key is not None:
        if key not in found:
            raise ValueError(f"{path}: --key must name a 2-D dataset, one of {found}, got {key!r}")
        return key
    for name in DEFAULT_KEYS[role]:
        if name in found:
            return name
    if len(found) == 1:
        return found[0]
    raise ValueError(f"{path}: pass --key, one of the 2-D datasets {found} (none is named "
                     f"{' or '.join(DEFAULT_KEYS[role])})")


def _matrix(rows: Any, name: str) -> Any:
    """Check that rows is a non-empty numeric [n, dim] array-like."""
    if len(rows.shape) != 2 or 0 in rows.shape:
        raise ValueError(f"{name} must hold a non-empty 2-D array [n, dim], got shape {rows.shape}")
    if rows.dtype.kind not in "fiu":
        raise ValueError(f"{name} must hold numbers, got dtype {rows.dtype}")
    return rows


def _chunk(rows: Any, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) as a new float32 array [m, dim] (a writable copy, also of a read-only memory map)."""
    return np.array(rows[start:stop], dtype=np.float32, order="C")


# --------------------------------------------------------------------------------------------------
# commands

def build(args: argparse.Namespace) -> int:
    """``tqindex build``: vectors file -> index file."""
    from tqdm.auto import tqdm

    from .factory import index_factory

    start = time.perf_counter()
    say = _printer(args.quiet)
    with open_vectors(args.vectors, args.key, "build") as (rows, file_metric):
        metric = args.metric or file_metric or "ip"
        n, dim = rows.shape
        options = {} if args.nprobe is None else {"nprobe": args.nprobe}
        if args.by_residual:
            options["by_residual"] = True
        index = index_factory(dim, args.factory, metric=metric, **options)
        if not index.is_trained:
            take = min(n, args.train_size)
            sample = np.sort(np.random.default_rng(args.seed).choice(n, take, replace=False))
            say(f"training {args.factory} on {take:,} of {n:,} vectors")
            index.train(np.ascontiguousarray(rows[sample], dtype=np.float32))
        with tqdm(total=n, unit="vec", unit_scale=True, desc="add", disable=args.quiet) as bar:
            for i in range(0, n, ADD_CHUNK):
                chunk = _chunk(rows, i, i + ADD_CHUNK)
                index.add(chunk, progress=False)
                bar.update(len(chunk))
    index.save(args.index)
    size = Path(args.index).stat().st_size
    say(f"wrote {args.index}: {type(index).__name__} {args.factory!r}, metric {metric}, {n:,} vectors x {dim}, "
        f"{index.encoder.code_size} bytes/vector, {size / 1e6:.1f} MB file, {time.perf_counter() - start:.1f} s")
    return 0


def search(args: argparse.Namespace) -> int:
    """``tqindex search``: index file + queries file -> ids/scores file."""
    import h5py

    from .io import atomic_path, load_index

    out = Path(args.output)
    if out.suffix not in RESULT_SUFFIXES:
        raise ValueError(f"output must end in one of {RESULT_SUFFIXES}, got {str(out)!r}")
    index = load_index(args.index)
    options = {}
    if args.nprobe is not None:
        if not hasattr(index, "nprobe"):
            raise ValueError(f"--nprobe applies to IVF indexes; {args.index} holds a {type(index).__name__}")
        options["nprobe"] = args.nprobe
    with open_vectors(args.queries, args.key, "search") as (rows, _):
        queries = _chunk(rows, 0, rows.shape[0])
    if queries.shape[1] != index.dim:
        raise ValueError(f"queries have dim {queries.shape[1]}, the index {args.index} has dim {index.dim}")
    start = time.perf_counter()
    scores, ids = index.search(queries, args.k, progress=False if args.quiet else None, **options)
    seconds = time.perf_counter() - start
    with atomic_path(out) as tmp:
        if out.suffix == ".npz":
            with open(tmp, "wb") as f:
                np.savez(f, ids=ids, scores=scores)
        else:
            with h5py.File(tmp, "w") as f:
                f["ids"], f["scores"] = ids, scores
    kind = "distances" if index.metric == "l2" else "scores"
    _printer(args.quiet)(f"wrote {out}: ids and scores [{len(queries):,}, {args.k}] ({index.metric} {kind}), "
                         f"{len(queries) / seconds:,.0f} queries/s")
    return 0


def info(args: argparse.Namespace) -> int:
    """``tqindex info``: the header of an index file (no codes are read)."""
    from .io import read_header

    header = read_header(args.index)
    if args.json:
        print(json.dumps(header, indent=2, sort_keys=True))
        return 0
    encoder = dict(header.get("encoder", {}))
    kind = encoder.pop("type", "?")
    dim, ntotal, code_size = header.get("dim"), header.get("ntotal"), header.get("code_size")
    rows = [
        ("file", f"{args.index} ({Path(args.index).stat().st_size / 1e6:.2f} MB)"),
        ("index", f"{header.get('index_type')}, metric {header.get('metric')}"),
        ("vectors", f"{ntotal:,} x {dim}" if isinstance(ntotal, int) else repr(ntotal)),
        ("encoder", f"{kind}({', '.join(f'{k}={v!r}' for k, v in encoder.items())})"),
        ("code size", f"{code_size} bytes/vector ({8 * code_size / dim:.2f} bits/coordinate)"
         if isinstance(code_size, int) and isinstance(dim, int) and dim else repr(code_size)),
        ("options", ", ".join(f"{k}={v!r}" for k, v in header.get("options", {}).items())),
    ]
    if "ivf" in header:
        rows.append(("ivf", ", ".join(f"{k}={v!r}" for k, v in header["ivf"].items())))
    for name, value in rows:
        print(f"{name:<10} {value}")
    return 0


def bench(argv: list[str]) -> int:
    """``tqindex bench ARGS``: run the main benchmark job ``benchmarks/ann.py ARGS`` of the source checkout."""
    if not BENCH_SCRIPT.is_file():
        print(f"tqindex bench: error: the benchmark runs from a source checkout of tqindex and {BENCH_SCRIPT} "
              "does not exist (this tqindex is installed without its repository). Clone the repository, "
              "install it with `pip install -e '.[bench]'` and run `tqindex bench` (or "
              "`python benchmarks/ann.py`) from there.", file=sys.stderr)
        return 2
    proc = subprocess.Popen([sys.executable, str(BENCH_SCRIPT), *argv])
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the benchmark got the same Ctrl-C: let it save its results and exit
            continue


# --------------------------------------------------------------------------------------------------
# parser

def _printer(quiet: bool) -> Callable[[str], None]:
    """Print a message to stderr, or nothing when quiet."""
    return (lambda message: None) if quiet else (lambda message: print(message, file=sys.stderr))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tqindex`` command."""
    from . import __version__

    p = argparse.ArgumentParser(prog="tqindex", description="Vectors compressed to 1-4 bits per coordinate: "
                                "build, search and inspect index files, run the benchmark.")
    p.add_argument("--version", action="version", version=f"tqindex {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    key_help = ("HDF5 dataset or parquet column holding the vectors (default: {defaults} or the only 2-D "
                "dataset; the only list-valued parquet column)")

    b = sub.add_parser("build", help="vectors file (.npy, .parquet, .h5/.hdf5) -> index file",
                       description="Build an index from a vectors file and save it (HDF5 index file). "
                       "Vectors get ids 0, 1, ... in file order.")
    b.add_argument("vectors", help="vectors file: .npy, .parquet or .h5/.hdf5 ([n, dim] numbers)")
    b.add_argument("index", help="index file to write (e.g. vectors.tqi)")
    b.add_argument("-f", "--factory", default="tq4", help="index description for tqindex.index_factory: "
                   "[IVF<nlist>,]<encoder>[,RFlat], e.g. tq4, tq2-pca, IVF1024,tq4, IVF256,tq4,RFlat "
                   "(RFlat keeps the vectors for exact re-ranking); default tq4")
    b.add_argument("-m", "--metric", choices=("ip", "cosine", "l2"), default=None,
                   help="default: the distance attribute of an ann-benchmarks file, else ip")
    b.add_argument("--key", default=None, help=key_help.format(defaults=", ".join(DEFAULT_KEYS["build"])))
    b.add_argument("--nprobe", type=_positive, default=None, help="IVF: lists searched per query, stored as "
                   "the index's default (default 8)")
    b.add_argument("--by-residual", action="store_true", help="IVF: encode vectors minus their centroid")
    b.add_argument("--train-size", type=_positive, default=200_000,
                   help="vectors sampled to train IVF centroids or a trained encoder (default 200000)")
    b.add_argument("--seed", type=int, default=0, help="seed of the training sample (default 0)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    b.set_defaults(run=build)

    s = sub.add_parser("search", help="index file + queries file -> ids/scores file (.npz or .h5)",
                       description="Search an index with every query of a file; write ids int64 [nq, k] and "
                       "scores float32 [nq, k] (squared distances for l2), best first, -1 ids where fewer "
                       "than k vectors exist.")
    s.add_argument("index", help="index file written by tqindex build or index.save")
    s.add_argument("queries", help="queries file: .npy, .parquet or .h5/.hdf5")
    s.add_argument("output", help="results file: .npz (arrays ids, scores) or .h5/.hdf5 (datasets ids, scores)")
    s.add_argument("-k", type=_positive, default=10, help="results per query (default 10)")
    s.add_argument("--nprobe", type=_positive, default=None, help="IVF: lists searched per query "
                   "(default: the index's)")
    s.add_argument("--key", default=None, help=key_help.format(defaults=", ".join(DEFAULT_KEYS["search"])))
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    s.set_defaults(run=search)

    i = sub.add_parser("info", help="header of an index file (reads no codes)",
                       description="Print the header of an index file: type, metric, size, encoder, options.")
    i.add_argument("index", help="index file")
    i.add_argument("--json", action="store_true", help="print the header as JSON")
    i.set_defaults(run=info)

    sub.add_parser("bench", add_help=False, help="run the main benchmark job (benchmarks/ann.py of a source "
                   "checkout); its arguments pass through: tqindex bench --help lists them")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``tqindex`` command with ``argv`` (default ``sys.argv[1:]``); -> exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError, ImportError) as e:
        print(f"tqindex {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tqindex {args.command}: interrupted; no file was written", file=sys.stderr)
        return 130
