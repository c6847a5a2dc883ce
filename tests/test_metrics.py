import numpy as np
import pytest

from tqindex.metrics import recall_at, recall_by_score, recall_curve


def test_recall_at_1_counts_true_top1_among_k():
    gt = np.array([[5, 1], [7, 2], [9, 3]])
    I = np.array([[5, 0, 0], [0, 7, 0], [0, 0, 1]])
    assert recall_at(I, gt, 1, 1) == pytest.approx(1 / 3)
    assert recall_at(I, gt, 1, 2) == pytest.approx(2 / 3)
    assert recall_at(I, gt) == pytest.approx(2 / 3)  # k defaults to I.shape[1]


def test_recall_at_r_k_counts_distinct_true_ids():
    gt = np.array([[1, 2, 3, 4]])
    I = np.array([[2, 2, 9, 1]])  # duplicate 2 counts once
    assert recall_at(I, gt, r=2, k=2) == pytest.approx(0.5)
    assert recall_at(I, gt, r=2, k=4) == pytest.approx(1.0)
    assert recall_at(I, gt, r=4, k=4) == pytest.approx(0.5)


def test_recall_ignores_minus_one():
    gt = np.array([[3, -1], [4, 5]])
    I = np.array([[-1, 3], [-1, -1]])
    assert recall_at(I, gt, r=2, k=2) == pytest.approx((1 / 1 + 0 / 2) / 2)
    with pytest.raises(ValueError, match="no valid"):
        recall_at(np.full((1, 2), -1), np.full((1, 1), -1))


def test_recall_matches_set_definition_on_random_ids():
    rng = np.random.default_rng(0)
    nq, k, r = 2500, 20, 10  # more queries than one block
    gt = np.stack([rng.permutation(50)[:r] for _ in range(nq)])
    I = np.stack([rng.permutation(50)[:k] for _ in range(nq)])
    expected = np.mean([len(set(gt[i]) & set(I[i, :k])) / r for i in range(nq)])
    assert recall_at(I, gt, r, k) == pytest.approx(expected)


def test_recall_curve_default_ks_and_monotone():
    rng = np.random.default_rng(1)
    gt = rng.integers(0, 100, size=(200, 1))
    I = rng.permutation(100 * 200).reshape(200, 100) % 100
    curve = recall_curve(I[:, :64], gt)
    assert list(curve) == [1, 2, 4, 8, 16, 32, 64]
    values = list(curve.values())
    assert values == sorted(values)
    assert recall_curve(I, gt, ks=(3,)) == {3: recall_at(I, gt, 1, 3)}


@pytest.mark.parametrize("kw, match", [({"k": 0}, "k must be"), ({"k": 4}, "k must be"),
                                       ({"r": 3}, "r must be"), ({"r": 0}, "r must be")])
def test_recall_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        recall_at(np.zeros((2, 3), np.int64), np.zeros((2, 2), np.int64), **kw)


def test_recall_bad_inputs():
    with pytest.raises(ValueError, match="same number of queries"):
        recall_at(np.zeros((2, 3), np.int64), np.zeros((3, 1), np.int64))
    with pytest.raises(ValueError, match="2-D"):
        recall_at(np.zeros(3, np.int64), np.zeros((3, 1), np.int64))
    with pytest.raises(TypeError, match="integer"):
        recall_at(np.zeros((2, 3)), np.zeros((2, 1), np.int64))


def test_recall_by_score_counts_ties_and_caps_at_r():
    true = np.array([[0.9, 0.8, 0.7], [0.5, 0.5, 0.1]])
    found = np.array([[0.8, 0.9, -np.inf], [0.5, 0.4, 0.3]])  # row 1 returned a duplicate of the best
    assert recall_by_score(found, true, 1, 1) == pytest.approx(0.5)  # row 0's first result is 2nd best
    assert recall_by_score(found, true, 1, 2) == pytest.approx(1.0)
    assert recall_by_score(found, true, 2, 2) == pytest.approx((2 / 2 + 1 / 2) / 2)
    assert recall_by_score(found, true, 1, 1, tol=0.2) == pytest.approx(1.0)  # within tolerance
    with pytest.raises(ValueError, match="k must"):
        recall_by_score(found, true, 1, 4)
