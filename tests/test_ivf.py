from functools import partialmethod

import numpy as np
import pytest
import torch

import tqindex as tq
import tqindex.kernels.fastscan as fs
from test_index import METRICS, assert_matches, brute_scores, data, snapshot, unit

NLIST = 16


def trained(metric: str, by_residual: bool, x: np.ndarray, name: str = "tq4", **kw) -> tq.IVFIndex:
    index = tq.IVFIndex(tq.make_encoder(name, x.shape[1]), NLIST, metric=metric, by_residual=by_residual, **kw)
    index.train(x)
    return index


def reconstructions(index: tq.IVFIndex, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(assigned list [n], x̂ = c_list + decode(encode(x - c_list)) [n, dim]) as the index computes them."""
    xe = unit(x) if index.metric == "cosine" else x
    c = index.centroids.numpy()
    if index.metric == "l2":
        assign = np.argmin(((xe[:, None, :] - c[None]) ** 2).sum(-1), axis=1)
    else:
        assign = np.argmax(xe @ c.T, axis=1)
    r = torch.from_numpy(xe) - index.centroids[torch.from_numpy(assign)]
    return assign, (index.centroids[torch.from_numpy(assign)] + index.encoder.decode(index.encoder.encode(r))).numpy()


def exact_scores(metric: str, xhat: np.ndarray, q: np.ndarray) -> np.ndarray:
    qe = (unit(q) if metric == "cosine" else q).astype(np.float64)
    xhat = xhat.astype(np.float64)
    return ((qe[:, None] - xhat[None]) ** 2).sum(-1) if metric == "l2" else qe @ xhat.T


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("nq", [2, 40])  # lookup tables / decode-and-GEMM per list
def test_all_lists_without_residual_equals_flat(metric, nq):
    x, q = data(1500, 50), data(nq, 50, 1)
    ivf = trained(metric, False, x)
    ivf.add(x)
    flat = tq.FlatIndex(ivf.encoder, metric=metric)
    flat.add(x)
    D, I = ivf.search(q, 20, nprobe=NLIST)
    Df, If = flat.search(q, 20)
    np.testing.assert_allclose(D, Df, rtol=1e-5, atol=1e-5)
    assert_matches(D, I, brute_scores(ivf, metric, x, q), np.arange(1500), 20, metric)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("name", ["tq4", "tq3", "tq2-pca"])
@pytest.mark.parametrize("nq, simd, allow", [(1, True, False), (50, True, False), (50, False, False), (50, True, True)])
def test_compiled_list_scan_equals_pytorch_scan(monkeypatch, metric, name, nq, simd, allow):
    """Raw codes: every probed list in one kernel call (queries split over jobs and threads), each
    query's candidates re-scored once; the same results as the PyTorch list-by-list scan."""
    monkeypatch.setattr(fs, "MIN_THREAD_SCORES", 64)
    monkeypatch.setattr(fs, "MIN_JOB_QUERIES", 4)
    if not simd:  # the kernel's portable loops
        monkeypatch.setattr(fs.NativeScorer, "__init__", partialmethod(fs.NativeScorer.__init__, simd=False))
    x, q = data(3000, 48, 6), data(nq, 48, 7)
    ivf = trained(metric, False, x, name, nprobe=5)
    ivf.add(x, ids=np.arange(3000) * 3 + 7)
    ivf.remove_ids(np.arange(100) * 3 + 7)  # rows no longer live
    allowed = np.arange(0, 9000, 2) + 1 if allow else None  # ids 3i + 7 with i even
    D, I = ivf.search(q, 40, allow=allowed)
    ivf.backend = "torch"
    D0, I0 = ivf.search(q, 40, allow=allowed)
    np.testing.assert_allclose(D, D0, rtol=1e-5, atol=1e-5)
    assert (I == I0).mean() > 0.999  # equal up to exact ties
    if allow:
        assert np.isin(I[I >= 0], allowed).all()


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("name, nq", [("tq4", 9), ("tq4", 40), ("tq3", 40), ("tq3-prod", 9), ("fp4", 9)])
@pytest.mark.parametrize("backend", [None, "torch"])
def test_residual_search_equals_brute_force_over_reconstructions(metric, name, nq, backend):
    x, q = data(1200, 50, 2), data(nq, 50, 3)
    ivf = trained(metric, True, x, name, backend=backend)
    ivf.add(x)
    _, xhat = reconstructions(ivf, x)
    D, I = ivf.search(q, 15, nprobe=NLIST)
    assert_matches(D, I, exact_scores(metric, xhat, q), np.arange(1200), 15, metric)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("nq", [1, 10, 40])
def test_nprobe_scans_the_nearest_lists(metric, nq):
    x, q = data(1200, 50, 4), data(nq, 50, 5)
    ivf = trained(metric, True, x, nprobe=3)
    ivf.add(x)
    assign, xhat = reconstructions(ivf, x)
    qe = unit(q) if metric == "cosine" else q
    c = ivf.centroids.numpy()
    coarse = ((qe[:, None] - c[None]) ** 2).sum(-1) if metric == "l2" else -(qe @ c.T)
    D, I = ivf.search(q, 10)  # nprobe attribute
    ref = exact_scores(metric, xhat, q)
    for row in range(nq):
        probed = np.isin(assign, np.argsort(coarse[row])[:3])
        assert_matches(D[row : row + 1], I[row : row + 1], ref[row : row + 1, probed], np.flatnonzero(probed), 10, metric)
    D1, _ = ivf.search(q, 10, nprobe=1)
    assert ivf.nprobe == 3
    tol = 1e-5 * np.abs(D1).max()  # the same pair may round differently in another batch of queries
    better = (D <= D1 + tol) if metric == "l2" else (D >= D1 - tol)
    assert better[:, 0].all()  # more lists never give a worse best result


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("nq", [7, 40])  # few queries: probed lists scanned together; more: list by list
def test_ids_remove_and_filter(metric, nq):
    x, q = data(900, 64), data(nq, 64, 1)
    ivf = trained(metric, True, x)
    ids = np.arange(900) * 3 + 1
    ivf.add(x[:500], ids=ids[:500])
    ivf.add_with_ids(x[500:], ids[500:])
    assert ivf.list_sizes().sum() == ivf.ntotal == 900
    with pytest.raises(ValueError, match="already in the index"):
        ivf.add(x[:2], ids=ids[:2])
    gone = ids[::4]
    assert ivf.remove_ids(gone) == len(gone)
    _, xhat = reconstructions(ivf, x)
    keep = ~np.isin(ids, gone)
    D, I = ivf.search(q, 30, nprobe=NLIST)
    assert not np.isin(I, gone).any()
    ref = exact_scores(metric, xhat, q)
    assert_matches(D, I, ref[:, keep], ids[keep], 30, metric)
    allowed = np.flatnonzero(keep)[::7]
    D, I = ivf.search(q, 30, nprobe=NLIST, allow=ids[allowed])
    assert_matches(D, I, ref[:, allowed], ids[allowed], 30, metric)


@pytest.mark.parametrize("by_residual", [True, False])  # False: the compiled list scan, rows by place
def test_keep_vectors_rerank_exact(by_residual):
    x, q = data(1000, 50), data(5, 50, 1)
    ivf = trained("l2", by_residual, x, keep_vectors=True, rerank_factor=4)
    ivf.add(x, ids=np.arange(1000) * 2 + 5)
    D, I = ivf.search(q, 6, nprobe=NLIST)
    exact = ((q[:, None] - x[(I - 5) // 2]) ** 2).sum(-1)
    np.testing.assert_allclose(D, exact, rtol=1e-5, atol=1e-4)
    assert (np.diff(D, axis=1) >= 0).all()


def test_training_and_argument_errors():
    x = data(300, 50)
    ivf = tq.IVFIndex(tq.make_encoder("tq4", 50), NLIST)
    with pytest.raises(ValueError, match="trained"):
        ivf.add(x)
    D, I = ivf.search(x[:2], 3)  # nothing stored: padding
    assert (I == -1).all()
    with pytest.raises(ValueError, match="at least nlist"):
        ivf.train(x[:10])
    ivf.train(x)
    ivf.add(x)
    with pytest.raises(ValueError, match="before add"):
        ivf.train(x)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="nprobe"):
            ivf.search(x[:2], 3, nprobe=bad)
        with pytest.raises(ValueError, match="nprobe"):
            ivf.nprobe = bad
    with pytest.raises(ValueError, match="nlist"):
        tq.IVFIndex(tq.make_encoder("tq4", 50), 0)
    before = snapshot(ivf, x[:3])
    with pytest.raises(ValueError, match="NaN"):
        ivf.add(np.full((4, 50), np.nan, np.float32))
    with pytest.raises(ValueError, match="distinct"):
        ivf.add(x[:2], ids=[1000, 1000])
    assert snapshot(ivf, x[:3]) == before
    D, I = ivf.search(torch.from_numpy(x[:2]), 3, nprobe=100)  # nprobe > nlist scans everything
    assert isinstance(I, torch.Tensor) and I.shape == (2, 3)


@pytest.mark.parametrize("nq", [3, 40])
def test_empty_lists_are_skipped(nq):
    x = data(400, 50)
    ivf = trained("ip", False, x)
    ivf.add(x[:5])  # most lists stay empty
    D, I = ivf.search(data(nq, 50, 1), 8, nprobe=NLIST)
    assert (np.sort(I[:, :5], axis=1) == np.arange(5)).all() and (I[:, 5:] == -1).all()
