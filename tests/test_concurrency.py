"""Concurrent adds, removes and searches: nothing is lost, every search sees a consistent index."""

import threading

import numpy as np
import pytest

import tqindex as tq

DIM, START, ADDS, ADD_ROWS, REMOVES, REMOVE_ROWS, SEARCHES = 32, 15_000, 15, 1000, 15, 100, 25


def vectors(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def build(kind: str):
    enc = tq.make_encoder("tq4", DIM)
    if kind == "flat":
        return tq.FlatIndex(enc, metric="l2")
    index = tq.IVFIndex(enc, nlist=16, metric="l2", nprobe=16)
    index.train(vectors(2000, 99))
    return index


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_adds_removes_and_searches_at_once(kind):
    index = build(kind)
    index.add(vectors(START, 0))
    added = [np.arange(START + i * ADD_ROWS, START + (i + 1) * ADD_ROWS) for i in range(ADDS)]
    removed = [np.arange(i * REMOVE_ROWS, (i + 1) * REMOVE_ROWS) for i in range(REMOVES)]
    done_removing: set = set()
    results, errors = [], []
    q = vectors(20, 1)

    def adder():
        for i, ids in enumerate(added):
            index.add(vectors(ADD_ROWS, 10 + i), ids=ids)

    def remover():
        for ids in removed:
            assert index.remove_ids(ids) == len(ids)
            done_removing.update(ids.tolist())

    def searcher():
        for _ in range(SEARCHES):
            gone = set(done_removing)
            try:
                results.append((gone, index.search(q, 10)))
            except Exception as err:  # noqa: BLE001 (any failure fails the test below)
                errors.append(err)

    threads = [threading.Thread(target=f) for f in (adder, remover, searcher, searcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    expected = np.setdiff1d(np.concatenate([np.arange(START)] + added), np.concatenate(removed))
    assert index.ntotal == START + ADDS * ADD_ROWS - REMOVES * REMOVE_ROWS == len(expected)
    np.testing.assert_array_equal(np.sort(index.ids), expected)
    ever = set(range(START + ADDS * ADD_ROWS))
    for gone, (D, I) in results:
        assert (I >= 0).all() and set(I.ravel().tolist()) <= ever
        assert not set(I.ravel().tolist()) & gone  # never an id removed before the search began
        assert (np.diff(D, axis=1) >= 0).all() and all(len(set(row)) == 10 for row in I.tolist())
    # the final content searches like an index built from it in one go
    fresh = build(kind)
    x_all = np.concatenate([vectors(START, 0)] + [vectors(ADD_ROWS, 10 + i) for i in range(ADDS)])
    fresh.add(x_all[expected], ids=expected)
    D, I = index.search(q, 10)
    Df, If = fresh.search(q, 10)
    np.testing.assert_allclose(D, Df, rtol=1e-5)
    assert (I == If).mean() > 0.99


def test_concurrent_adds_with_default_ids_get_distinct_ids():
    index = tq.FlatIndex(tq.make_encoder("tq2", DIM))
    threads = [threading.Thread(target=index.add, args=(vectors(500, s),)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(np.sort(index.ids), np.arange(3000))
