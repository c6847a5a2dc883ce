import itertools

import numpy as np
import pytest
import torch

import tqindex as tq
from tqindex.directions import encode_directions_reference, search_alphas
from tqindex.kernels import native
from tqindex.packing import packed_size
from tqindex.pca import PCA_BLOCK, PCA_WIDTHS, allocate
from test_index import METRICS, assert_matches, brute_scores
from test_ivf import exact_scores, reconstructions


def anisotropic(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """Vectors whose energy decays over a random basis (like text embeddings), float32 [n, dim]."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((dim, dim)))[0]
    scales = np.exp(-np.arange(dim) / (dim / 6))
    return ((rng.standard_normal((n, dim)) * scales) @ basis.T + 0.3 * basis[:, 0]).astype(np.float32)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_allocation_spends_the_budget_on_the_largest_variances(bits):
    groups = allocate(np.exp(-np.arange(96) / 16), bits)
    widths = [w for n, w in groups for _ in range(n)]
    assert len(widths) == 96 and set(widths) <= set(PCA_WIDTHS)
    assert packed_size(96, bits) - 1 <= sum(packed_size(n, w) for n, w in groups if w) <= packed_size(96, bits)
    assert widths == sorted(widths, reverse=True)  # more bits for larger variances
    assert widths[0] > widths[-1] or bits == max(PCA_WIDTHS)
    assert allocate(np.ones(64), 2) == [[64, 2]]  # isotropic: the plain width


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_allocation_is_the_best_split_within_the_bytes(bits, seed):
    """Against every width per block (no order imposed) on 14 directions: the same least error."""
    d = 14
    variances = np.sort(np.random.default_rng(seed).exponential(size=d) ** 2)[::-1]
    dist = {0: 1.0, **{w: tq.codebooks.lloyd_max(64, w).distortion for w in PCA_WIDTHS[1:]}}
    sizes = [min(PCA_BLOCK, d - s) for s in range(0, d, PCA_BLOCK)]
    energy = np.add.reduceat(variances, np.arange(0, d, PCA_BLOCK))

    def error(widths):
        return sum(e * dist[w] for e, w in zip(energy, widths))

    def nbytes(widths):  # runs of equal width are packed together
        runs = [[n, w] for n, w in zip(sizes, widths)]
        for a, b in zip(runs[::-1][1:], runs[::-1]):
            if a[1] == b[1]:
                a[0], b[0] = a[0] + b[0], 0
        return sum(packed_size(n, w) for n, w in runs if w and n)

    best = min(error(ws) for ws in itertools.product(PCA_WIDTHS, repeat=len(sizes))
               if nbytes(ws) <= packed_size(d, bits))
    groups = allocate(variances, bits)
    widths = [w for n, w in groups for _ in range(n)][::PCA_BLOCK]
    assert sum(packed_size(n, w) for n, w in groups if w) <= packed_size(d, bits)
    assert error(widths) == pytest.approx(best, rel=1e-12)


def test_trained_codes_beat_random_rotation_at_equal_bytes():
    x = torch.from_numpy(anisotropic(3000, 64))
    pca = tq.make_encoder("tq2-pca", 64)
    assert not pca.is_trained
    pca.train(x)
    plain = tq.make_encoder("tq2", 64)
    assert pca.is_trained and pca.code_size <= plain.code_size

    def error(enc):
        return float(((enc.decode(enc.encode(x)) - x) ** 2).sum() / (x**2).sum())

    assert error(pca) < 0.7 * error(plain)
    q = x[:50]
    torch.testing.assert_close(pca.score(q, pca.encode(x)), q @ pca.decode(pca.encode(x)).T, rtol=1e-4, atol=1e-4)


def test_untrained_encoder_and_index_raise_clearly():
    enc = tq.make_encoder("tq2-pca", 32)
    with pytest.raises(ValueError, match="trained"):
        enc.encode(torch.randn(2, 32))
    index = tq.FlatIndex(enc)
    with pytest.raises(ValueError, match="train"):
        index.add(np.ones((3, 32), np.float32))
    with pytest.raises(ValueError, match="train"):
        index.search(np.ones((1, 32), np.float32), 1)
    assert index.ntotal == 0
    with pytest.raises(ValueError, match="at least 2"):
        enc.train(torch.randn(1, 32))
    with pytest.raises(ValueError, match="groups"):
        tq.TurboQuantPCA(dim=32, groups=[[16, 4], [8, 3], [8, 0]])
    with pytest.raises(ValueError, match="budget"):
        tq.TurboQuantPCA(dim=32, bits=2, groups=[[32, 4]])


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("backend", [None, "torch"])
def test_flat_search_equals_brute_force_and_survives_save_load(tmp_path, metric, backend):
    x, q = anisotropic(800, 48), anisotropic(9, 48, 1)
    index = tq.index_factory(48, "tq2-pca", metric=metric, backend=backend)
    index.train(x)
    index.add(x)
    D, I = index.search(q, 10)
    assert_matches(D, I, brute_scores(index, metric, x, q), np.arange(800), 10, metric)
    with pytest.raises(ValueError, match="before add"):
        index.train(x)
    index.save(tmp_path / "pca.tqi")
    loaded = tq.load_index(tmp_path / "pca.tqi")
    loaded.backend = backend
    assert loaded.encoder.groups == index.encoder.groups
    D2, I2 = loaded.search(q, 10)
    np.testing.assert_array_equal(I2, I)
    np.testing.assert_array_equal(D2, D)


@pytest.mark.parametrize("by_residual", [False, True])
def test_ivf_trains_the_encoder_on_what_it_stores(by_residual):
    x, q = anisotropic(1200, 32), anisotropic(7, 32, 1)
    index = tq.IVFIndex(tq.make_encoder("tq2-pca", 32), 8, by_residual=by_residual)
    index.train(x)
    assert index.encoder.is_trained
    index.add(x)
    D, I = index.search(q, 5, nprobe=8)  # every list: exact over the reconstructions
    ref = exact_scores("ip", reconstructions(index, x)[1], q) if by_residual else brute_scores(index, "ip", x, q)
    assert_matches(D, I, ref, np.arange(1200), 5, "ip")


@pytest.mark.skipif(not native.available(), reason="compiled kernels not built")
def test_compiled_encoding_equals_the_pytorch_reference():
    x = torch.from_numpy(anisotropic(2000, 64))
    enc = tq.make_encoder("tq2-pca", 64)
    enc.train(x)
    codes = enc.encode(x)
    qdata, _, _, sq = encode_directions_reference(x, enc._rotation(x.device), enc.code_runs(),
                                                  search_alphas(enc.code_search))
    same = (codes.qdata == qdata).all(1).float().mean()
    assert same > 0.99  # differences only where two pre-scales tie in float rounding
    ref_scale = (x.norm(dim=1) * sq.rsqrt()).half()
    assert (codes.norm == ref_scale).float().mean() > 0.99
