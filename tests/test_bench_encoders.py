"""benchmarks/encoders.py: the inner-product error measures and the faiss configurations it compares."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("faiss")

import encoders  # noqa: E402


def test_inner_product_errors_see_shrinkage_where_a_mean_over_all_pairs_does_not():
    rng = np.random.default_rng(0)
    true = 0.1 * rng.standard_normal((50, 400))  # [nq, n]: mostly pairs near zero ...
    true[:, :encoders.NEAR_PAIRS] += 0.8  # ... and each query's near neighbours
    shrunk = encoders.ip_errors(0.6 * true, true)
    assert shrunk["ip_slope"] == pytest.approx(0.6)
    near = true[:, :encoders.NEAR_PAIRS].mean()
    assert shrunk["ip_bias_nn"] == pytest.approx(-0.4 * near) and abs(np.mean(0.6 * true - true)) < 0.1 * 0.4 * near
    noisy = encoders.ip_errors(true + 0.01 * rng.standard_normal(true.shape), true)
    assert noisy["ip_slope"] == pytest.approx(1.0, abs=0.01) and abs(noisy["ip_bias_nn"]) < 0.002
    assert noisy["ip_rmse"] == pytest.approx(0.01, rel=0.05)


def test_faiss_scalar_quantizers_run_padded_to_a_multiple_of_8_and_unpadded():
    at50 = encoders.faiss_methods(4, 50)
    assert at50["faiss SQtqmse4"] == ("RR,SQtqmse4", 56) and at50["faiss SQtqmse4 unpadded"] == ("RR,SQtqmse4", 50)
    assert at50["faiss SQtq4"] == ("RR,SQtq4", 56) and at50["faiss EDEN4"] == ("EDEN4", 50)
    assert not any("unpadded" in name for name in encoders.faiss_methods(4, 128))
