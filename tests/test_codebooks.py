import math

import numpy as np
import pytest
import torch

from tqindex.codebooks import (
    E2M1_VALUES,
    _CoordinateDensity,
    e2m1_decode,
    e2m1_encode,
    lloyd_max,
    ue8m0_byte,
    ue8m0_exponent,
    ue8m0_scale,
)

# E||u - û||² of the Lloyd-Max quantizer for b = 1..4 in high dimension (TurboQuant's table).
PAPER = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("dim", [3, 50, 128, 1536])
def test_density_integrates_to_one(dim):
    dens = _CoordinateDensity(dim)
    assert dens.cdf(np.array([1.0]))[0] == pytest.approx(1.0, abs=1e-12)
    assert dens.cdf(np.array([0.0]))[0] == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_matches_paper_in_high_dim(bits):
    assert lloyd_max(1536, bits).distortion == pytest.approx(PAPER[bits], rel=0.01)
    assert lloyd_max(1536, bits).distortion >= 4.0**-bits  # Shannon lower bound


def test_lloyd_max_known_closed_forms():
    # d = 3: coordinates are uniform on [-1, 1]; the optimal quantizer is uniform, MSE = 3 * w²/12.
    for b in (1, 2, 3):
        cb = lloyd_max(3, b)
        w = 2.0 / 2**b
        assert np.allclose(cb.centroids, -1 + w / 2 + w * np.arange(2**b), atol=1e-9)
        assert cb.distortion == pytest.approx(3 * w**2 / 12, rel=1e-6)
    # 1 bit, large d: centroids ±sqrt(2/(pi d)).
    assert lloyd_max(1536, 1).centroids[1] * math.sqrt(1536) == pytest.approx(math.sqrt(2 / math.pi), rel=2e-3)


def test_lloyd_max_is_a_fixed_point_and_symmetric():
    cb = lloyd_max(128, 4)
    assert np.allclose(cb.centroids, -cb.centroids[::-1], atol=1e-12)
    assert np.allclose(cb.boundaries, (cb.centroids[1:] + cb.centroids[:-1]) / 2)
    assert np.all(np.diff(cb.centroids) > 0)


def test_lloyd_max_bad_args():
    with pytest.raises(ValueError, match="bits"):
        lloyd_max(64, 5)
    with pytest.raises(ValueError, match="dim"):
        lloyd_max(1, 2)


def test_e2m1_grid_and_ties():
    assert E2M1_VALUES[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    x = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.5, -2.9, -6.0, 0.3])
    expect = [0, 0, 2, 2, 4, 4, 6, 6, 7, 7, 9, 13, 15, 1]  # ties to even code, saturation at 6
    assert e2m1_encode(x).tolist() == expect
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_encode(e2m1_decode(codes))[codes != 8], codes[codes != 8])


def test_ue8m0_helpers():
    m = torch.tensor([1.0, 6.4, 0.0, 3e38])
    e_round = ue8m0_exponent(m, 0.156, "round")
    e_ceil = ue8m0_exponent(m, 0.156, "ceil")
    assert e_round.tolist()[:2] == [round(math.log2(0.156)), round(math.log2(0.156 * 6.4))]
    assert e_ceil.tolist()[:2] == [math.ceil(math.log2(0.156)), math.ceil(math.log2(0.156 * 6.4))]
    assert e_ceil[2].item() == -127 and e_ceil[3].item() == 126
    b = ue8m0_byte(e_ceil)
    assert b.dtype == torch.uint8 and b.tolist() == [125, 127, 0, 253]
    assert ue8m0_byte(torch.tensor([200, -300])).tolist() == [254, 0]
    assert ue8m0_scale(b).tolist()[:3] == [2.0**-2, 1.0, 2.0**-127]
    with pytest.raises(ValueError, match="scale_rounding"):
        ue8m0_exponent(m, 0.156, "nearest")
