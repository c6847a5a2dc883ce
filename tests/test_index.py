import math

import numpy as np
import pytest
import torch

import tqindex as tq
import tqindex.index as tqi
import tqindex.scorer as tqs
from tqindex.checks import unit_rows
from tqindex.metrics import recall_at

ENCODERS = ["tq4", "tq2", "tq3-prod", "fp4", "tq1"]
METRICS = ["ip", "cosine", "l2"]


def data(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """n float32 vectors [n, dim] with varied norms."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, dim)) * rng.uniform(0.5, 2.0, (n, 1))).astype(np.float32)


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit norm, computed as the index does (the same float32 rounding)."""
    return unit_rows(torch.from_numpy(x))[1].numpy()


def brute_scores(index, metric: str, x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[nq, n] reference: scores (ip, cosine) or squared distances (l2) over vectors decoded from codes
    encoded as the index encodes them (its backend)."""
    if metric == "cosine":
        x, q = unit(x), unit(q)
    encoder = index.encoder
    xhat = encoder.decode(encoder.encode(x, index.backend)).numpy().astype(np.float64)
    q = q.astype(np.float64)
    if metric == "l2":
        return ((q[:, None, :] - xhat[None]) ** 2).sum(-1)
    return q @ xhat.T


def assert_matches(D, I, ref: np.ndarray, ids: np.ndarray, k: int, metric: str) -> None:
    """(D, I) are the best k of ``ref`` [nq, n] (columns labelled ``ids``), best first, tie-robust."""
    D, I = np.asarray(D), np.asarray(I)
    l2 = metric == "l2"
    kk = min(k, ref.shape[1])
    expect = np.sort(ref, axis=1)[:, :kk] if l2 else -np.sort(-ref, axis=1)[:, :kk]
    tol = 1e-4 * (1 + np.abs(ref).max())
    np.testing.assert_allclose(D[:, :kk], expect, atol=tol, rtol=1e-4)
    col = {int(v): j for j, v in enumerate(ids)}
    for row in range(len(I)):
        got = ref[row, [col[int(v)] for v in I[row, :kk]]]
        np.testing.assert_allclose(D[row, :kk], got, atol=tol, rtol=1e-4)
        assert len(set(I[row, :kk].tolist())) == kk
    assert (I[:, kk:] == -1).all()
    assert (D[:, kk:] == (math.inf if l2 else -math.inf)).all()


def snapshot(index, q: np.ndarray) -> tuple:
    D, I = index.search(q, 7)
    return index.ntotal, index.ids.tolist(), D.tolist(), I.tolist()


@pytest.mark.parametrize("name", ENCODERS)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("nq", [3, 40])  # PyTorch paths: lookup tables (few queries) and decode-and-GEMM
@pytest.mark.parametrize("backend", [None, "torch"])  # auto: the compiled scan where it serves the encoder
def test_search_equals_brute_force(name, metric, nq, backend):
    dim = 50
    x, q = data(600, dim, 1), data(nq, dim, 2)
    index = tq.index_factory(dim, name, metric=metric, backend=backend)
    index.add(x)
    D, I = index.search(q, 10)
    assert_matches(D, I, brute_scores(index, metric, x, q), np.arange(600), 10, metric)


@pytest.mark.parametrize("dim", [32, 130])
@pytest.mark.parametrize("nq", [1, 40])
def test_search_across_many_blocks(monkeypatch, dim, nq):
    monkeypatch.setattr(tqs, "DECODE_ELEMENTS", 300 * dim)  # decode chunks of 300 codes
    monkeypatch.setattr(tqs, "MIN_TILE", 37)
    monkeypatch.setattr(tqs, "TILE_BYTES", 1)  # score tiles of 37 codes
    x, q = data(600, dim, 3), data(nq, dim, 4)
    for metric in METRICS:
        index = tq.FlatIndex(tq.TurboQuantMSE(dim=dim, bits=4), metric=metric, backend="torch")
        index.add(x[:250])
        index.add(x[250:])
        D, I = index.search(q, 25)
        assert_matches(D, I, brute_scores(index, metric, x, q), np.arange(600), 25, metric)


def test_result_contract_numpy_and_torch():
    x, q = data(30, 50), data(4, 50, 1)
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4))
    D, I = index.search(q, 5)  # empty index
    assert D.shape == I.shape == (4, 5) and D.dtype == np.float32 and I.dtype == np.int64
    assert (I == -1).all() and (D == -np.inf).all()
    index.add(x)
    D, I = index.search(q, 40)  # k > ntotal pads
    assert isinstance(D, np.ndarray) and D.shape == (4, 40) and I.shape == (4, 40)
    assert (np.diff(D[:, :30], axis=1) <= 0).all()
    assert (I[:, 30:] == -1).all() and (D[:, 30:] == -np.inf).all()
    Dt, It = index.search(torch.from_numpy(q).double(), 40)
    assert isinstance(Dt, torch.Tensor) and Dt.dtype == torch.float32 and It.dtype == torch.int64
    np.testing.assert_array_equal(It.numpy(), I)
    D0, I0 = index.search(np.zeros((0, 50), np.float32), 3)
    assert D0.shape == I0.shape == (0, 3)
    l2 = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4), metric="l2")
    l2.add(x)
    D, I = l2.search(q, 40)
    assert (np.diff(D[:, :30], axis=1) >= 0).all() and (D[:, 30:] == np.inf).all()
    for bad_k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="k must be"):
            index.search(q, bad_k)
    with pytest.raises(ValueError, match="shape"):
        index.search(data(2, 49), 3)
    with pytest.raises(ValueError, match="2-D"):
        index.search(q[0], 3)
    assert len(index) == index.ntotal == 30


def test_ids_given_and_continued():
    x = data(20, 50)
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4))
    index.add(x[:5])
    index.add_with_ids(x[5:10], np.arange(100, 105))
    index.add(x[10:12])  # continues after the largest id
    index.add(x[12:14], ids=torch.tensor([7, 8]))
    index.add(x[14:15], ids=[50])
    assert index.ids.tolist() == [0, 1, 2, 3, 4, 100, 101, 102, 103, 104, 105, 106, 7, 8, 50]
    D, I = index.search(x[5:6], 1)
    assert I[0, 0] == 100


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (np.array([3, 4, 4]), ValueError, "distinct"),
        (np.array([0, 10, 11]), ValueError, "already in the index"),
        (np.array([10, 11]), ValueError, "one id per vector"),
        (np.array([[10, 11, 12]]), ValueError, "1-D"),
        (np.array([10.0, 11.0, 12.0]), TypeError, "integers"),
        (np.array([10, -1, 12]), ValueError, r"\[0, 2\*\*63\)"),
    ],
)
def test_bad_ids_rejected_and_index_unchanged(ids, error, match):
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4))
    index.add(data(10, 50))
    q = data(3, 50, 5)
    before = snapshot(index, q)
    with pytest.raises(error, match=match):
        index.add(data(3, 50, 1), ids=ids)
    assert snapshot(index, q) == before


@pytest.mark.parametrize(
    "x, error, match",
    [
        (np.full((3, 50), np.nan, np.float32), ValueError, "NaN"),
        (np.full((3, 50), np.inf, np.float32), ValueError, "infinite"),
        (np.zeros((3, 49), np.float32), ValueError, "shape"),
        (np.zeros((0, 50), np.float32), ValueError, "empty"),
        (np.zeros((3, 50), np.int32), TypeError, "floating"),
        (np.zeros(50, np.float32), ValueError, "2-D"),
        ([[0.0] * 50], TypeError, "numpy array or torch tensor"),
    ],
)
def test_bad_vectors_rejected_and_index_unchanged(x, error, match):
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4), metric="l2")
    index.add(data(10, 50))
    q = data(3, 50, 5)
    before = snapshot(index, q)
    with pytest.raises(error, match=match):
        index.add(x)
    assert snapshot(index, q) == before


@pytest.mark.parametrize("metric", METRICS)
def test_non_finite_queries_named(metric):
    """A query row with a NaN or an infinite value is reported as such under every metric (the "ip" and "l2"
    checks find it through its norm), a finite row too long for float32 scores by its norm."""
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4), metric=metric)
    index.add(data(10, 50))
    for bad, match in ((np.nan, "NaN or infinite"), (-np.inf, "NaN or infinite")):
        q = data(3, 50, 5)
        q[1, 7] = bad
        with pytest.raises(ValueError, match=match):
            index.search(q, 2)
    if metric != "cosine":
        q = data(3, 50, 5)
        q[2] = 3e37
        with pytest.raises(ValueError, match="norms outside"):
            index.search(q, 2)


def test_interrupted_add_leaves_index_unchanged(monkeypatch):
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4), keep_vectors=True)
    index.add(data(10, 50))
    q = data(3, 50, 5)
    before, next_id = snapshot(index, q), index._state.next_id
    monkeypatch.setattr(tqi, "ADD_CHUNK", 4)
    calls = {"n": 0}
    encode = index.encoder.encode_valid

    def interrupted(x, backend=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return encode(x, backend)

    monkeypatch.setattr(index.encoder, "encode_valid", interrupted)
    with pytest.raises(KeyboardInterrupt):
        index.add(data(10, 50, 1))
    assert snapshot(index, q) == before and index._state.next_id == next_id


@pytest.mark.parametrize("metric", METRICS)
def test_remove_ids_then_search_skips_them(metric):
    x, q = data(300, 50), data(6, 50, 1)
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=2), metric=metric)
    index.add(x)
    gone = np.arange(0, 300, 3)
    assert index.remove_ids(np.concatenate([gone, [1000, 5000]])) == len(gone)
    assert index.remove_ids(gone) == 0
    assert index.ntotal == 200
    keep = np.setdiff1d(np.arange(300), gone)
    D, I = index.search(q, 300)
    assert not np.isin(I, gone).any()
    assert_matches(D, I, brute_scores(index, metric, x[keep], q), keep, 300, metric)
    index.add(x[:2], ids=[0, 3])  # removed ids can come back
    assert index.ntotal == 202


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("nq", [2, 12])
@pytest.mark.parametrize("backend", [None, "torch"])
def test_filtered_search_equals_brute_force_over_allowed(metric, nq, backend):
    x, q = data(500, 64), data(nq, 64, 1)
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=64, bits=4), metric=metric, backend=backend)
    index.add(x, ids=np.arange(500) * 2)
    allowed_rows = np.random.default_rng(3).choice(500, 40, replace=False)
    allow = np.concatenate([allowed_rows * 2, [1, 9999]])  # unknown ids are ignored
    D, I = index.search(q, 50, allow=torch.from_numpy(allow))  # fewer allowed than k: padded
    assert isinstance(D, np.ndarray)
    ref = brute_scores(index, metric, x[allowed_rows], q)
    assert_matches(D, I, ref, allowed_rows * 2, 50, metric)
    D, I = index.search(q, 5, allow=[])
    assert (I == -1).all()


@pytest.mark.parametrize("metric", METRICS)
def test_keep_vectors_reranks_candidates_exactly(metric):
    x, q = data(800, 50), data(10, 50, 1)
    enc = tq.TurboQuantMSE(dim=50, bits=2)
    plain = tq.FlatIndex(enc, metric=metric)
    plain.add(x)
    kept = tq.FlatIndex(enc, metric=metric, keep_vectors=True, rerank_factor=3)
    kept.add(x)
    k = 8
    _, cand = plain.search(q, 3 * k)
    D, I = kept.search(q, k)
    xe, qe = (unit(x), unit(q)) if metric == "cosine" else (x, q)
    for row in range(len(q)):
        c = cand[row]
        exact = ((qe[row] - xe[c]) ** 2).sum(1) if metric == "l2" else xe[c] @ qe[row]
        order = np.argsort(exact if metric == "l2" else -exact)[:k]
        np.testing.assert_allclose(D[row], exact[order], rtol=1e-5, atol=1e-5)
        assert set(I[row].tolist()) == set(c[order].tolist())
    D, I = kept.search(q, 1000)  # k * rerank_factor beyond ntotal
    assert (I[:, 800:] == -1).all() and len(set(I[0, :800].tolist())) == 800
    f16 = tq.FlatIndex(enc, metric=metric, keep_vectors=True, vectors_dtype="float16")
    f16.add(x)
    assert f16.memory_bytes() < kept.memory_bytes()


def test_recall_sanity_tq4():
    rng = np.random.default_rng(0)
    x = unit(rng.standard_normal((2000, 64)).astype(np.float32))
    q = unit(rng.standard_normal((200, 64)).astype(np.float32))
    index = tq.index_factory(64, "tq4", metric="ip")
    index.add(x)
    _, I = index.search(q, 10)
    gt = np.argsort(-(q @ x.T), axis=1)[:, :1]
    assert recall_at(I, gt, 1, 10) >= 0.9


def test_memory_bytes_and_progress(capsys):
    x = data(1000, 50)
    index = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4))
    index.add(x, progress=True)
    fixed = sum(t.numel() * t.element_size() for t in index.encoder.tensors().values())
    assert index.memory_bytes() == 1000 * index.encoder.code_size + fixed  # ids 0..n-1: no id array
    D, I = index.search(x[:3], 5, progress=True)
    assert index.memory_bytes() == 1000 * index.encoder.code_size + fixed  # searching caches no id table
    index.remove_ids([0])  # ids no longer the rows: held, 8 bytes each
    assert index.memory_bytes() == 999 * (index.encoder.code_size + 8) + fixed
    explicit = tq.FlatIndex(tq.TurboQuantMSE(dim=50, bits=4))
    explicit.add(x, ids=np.arange(1000) + 7)
    assert explicit.memory_bytes() == 1000 * (index.encoder.code_size + 8) + fixed
    np.testing.assert_array_equal(explicit.search(x[:3], 5)[1], I + 7)
    assert "add" in capsys.readouterr().err
    with pytest.raises(TypeError, match="progress"):
        index.search(x[:3], 5, progress="yes")


def test_constructor_validation():
    enc = tq.TurboQuantMSE(dim=50, bits=4)
    with pytest.raises(ValueError, match="metric"):
        tq.FlatIndex(enc, metric="dot")
    with pytest.raises(TypeError, match="encoder"):
        tq.FlatIndex("tq4")
    with pytest.raises(ValueError, match="vectors_dtype"):
        tq.FlatIndex(enc, keep_vectors=True, vectors_dtype="int8")
    with pytest.raises(ValueError, match="rerank_factor"):
        tq.FlatIndex(enc, rerank_factor=0)
    with pytest.raises(ValueError, match="unknown encoder name"):
        tq.index_factory(50, "tq9")
    assert "FlatIndex" in repr(tq.index_factory(50, "fp4", metric="l2"))
    index = tq.FlatIndex(enc)
    assert index.cuda_graphs == 8
    index.cuda_graphs = 0
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="cuda_graphs"):
            index.cuda_graphs = bad
    assert index.cuda_graphs == 0
