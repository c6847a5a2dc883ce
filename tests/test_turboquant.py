import math

import pytest
import torch

import tqindex as tq
from tqindex import native
from tqindex.codebooks import lloyd_max
from tqindex.turboquant import _quantize_direction_native, quantize_direction_reference, search_alphas

from conftest import unit_vectors

PAPER = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("dim,n", [(128, 4000), (1536, 600)])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_qmse_distortion_matches_paper(dim, n, bits):
    u = unit_vectors(n, dim, seed=bits)
    enc = tq.make_encoder(f"tq{bits}-norm", dim, norm_dtype="float32")
    mse = ((enc.decode(enc.encode(u)) - u) ** 2).sum(1).mean().item()
    assert mse == pytest.approx(lloyd_max(dim, bits).distortion, rel=0.03)
    assert mse == pytest.approx(PAPER[bits], rel=0.03)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_direction_search_improves_cosine(bits):
    u = unit_vectors(2000, 64, seed=5)
    plain = tq.make_encoder(f"tq{bits}-norm", 64)
    best = tq.make_encoder(f"tq{bits}", 64)
    cos = lambda e: torch.cosine_similarity(e.decode(e.encode(u)), u).mean().item()  # noqa: E731
    assert cos(best) > cos(plain) + 1e-4
    # "cos" rescaling keeps every norm (up to float16 storage).
    x = torch.randn(100, 64) * 3
    assert torch.allclose(best.decode(best.encode(x)).norm(dim=1), x.norm(dim=1), rtol=2e-3)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_qprod_unbiased_with_bounded_variance(bits):
    dim, seeds = 128, 300
    x = unit_vectors(1, dim, seed=11)[0]
    q = unit_vectors(1, dim, seed=12)[0] * 2.0
    true = float(q @ x)
    encoders = [tq.TurboQuantProd(dim=dim, bits=bits, seed=s, norm_dtype="float32") for s in range(seeds)]
    est = torch.tensor([e.score(q[None], e.encode(x[None])).item() for e in encoders])
    stderr = est.std().item() / math.sqrt(seeds)
    assert abs(est.mean().item() - true) < 4 * stderr
    bound = math.sqrt(3) * math.pi**2 * float(q @ q) / dim * 4.0**-bits
    assert est.var().item() <= bound


def test_qmse_norm_mode_is_biased_and_prod_is_not():
    # Q_mse shrinks inner products by about (1 - distortion); Q_prod corrects it on average.
    dim = 128
    x = unit_vectors(2000, dim, seed=1)
    q = x + 0.1 * unit_vectors(2000, dim, seed=2)
    true = (q * x).sum(1)
    mse = tq.make_encoder("tq2-norm", dim)
    prod = tq.make_encoder("tq3-prod", dim)
    ratio_mse = (torch.diagonal(mse.score(q, mse.encode(x))) / true).mean().item()
    ratio_prod = (torch.diagonal(prod.score(q, prod.encode(x))) / true).mean().item()
    assert ratio_mse == pytest.approx(1 - lloyd_max(dim, 2).distortion, abs=0.02)
    assert ratio_prod == pytest.approx(1.0, abs=0.02)


def test_zero_vector_encodes_to_zero():
    for name in ("tq4", "tq4-norm", "tq3-prod"):
        enc = tq.make_encoder(name, 64)
        assert torch.equal(enc.decode(enc.encode(torch.zeros(2, 64))), torch.zeros(2, 64))


def test_bad_options():
    with pytest.raises(ValueError, match="bits"):
        tq.TurboQuantMSE(dim=64, bits=5)
    with pytest.raises(ValueError, match="bits"):
        tq.TurboQuantProd(dim=64, bits=0)
    with pytest.raises(ValueError, match="rescale"):
        tq.TurboQuantMSE(dim=64, rescale="max")
    with pytest.raises(ValueError, match="code_search"):
        tq.TurboQuantMSE(dim=64, rescale="norm", code_search=4)
    with pytest.raises(ValueError, match="norm_dtype"):
        tq.TurboQuantMSE(dim=64, norm_dtype="bfloat8")
    with pytest.raises(ValueError, match="dim"):
        tq.TurboQuantMSE(dim=1)


@pytest.mark.skipif(not native.available(), reason="compiled kernels not built")
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [7, 50, 130])
@pytest.mark.parametrize("candidates", [1, 6])
@pytest.mark.parametrize("simd", [True, False])
def test_compiled_direction_search_equals_reference(bits, dim, candidates, simd):
    s = tq.TurboQuantMSE(dim=dim, bits=bits).tensors()
    c, b = s["centroids"], s["boundaries"]
    y = unit_vectors(2000, dim, seed=dim + bits)
    alphas = search_alphas(candidates)
    idx, dot, sq = _quantize_direction_native(y, [(dim, c, b)], alphas, allow_simd=simd)
    ref_idx, _, _ = quantize_direction_reference(y, [(dim, c, b)], alphas)
    ref_c = c[ref_idx.long()]
    got_c = c[idx.long()]
    cos, ref_cos = (y * got_c).sum(1) / got_c.norm(dim=1), (y * ref_c).sum(1) / ref_c.norm(dim=1)
    assert (cos >= ref_cos - 1e-6).all()  # the same best code, up to float ties between alphas
    assert (idx.int() == ref_idx).all(1).float().mean() > 0.99
    torch.testing.assert_close(dot, (y * got_c).sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sq, got_c.square().sum(1), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not native.available(), reason="compiled kernels not built")
@pytest.mark.parametrize("simd", [True, False])
def test_compiled_direction_search_over_runs_of_any_length(simd):
    """Runs of 4, 2 and 1 bits (each with its own codebook) whose lengths are not multiples of 8."""
    runs = []
    for n, bits in [(5, 4), (13, 2), (3, 1), (9, 3)]:
        s = tq.TurboQuantMSE(dim=64, bits=bits).tensors()
        runs.append((n, s["centroids"], s["boundaries"]))
    y = unit_vectors(3000, 30, seed=3)
    alphas = search_alphas(6)
    idx, dot, sq = _quantize_direction_native(y, runs, alphas, allow_simd=simd)
    ref_idx, ref_dot, ref_sq = quantize_direction_reference(y, runs, alphas)
    c = torch.cat([runs[r][1][idx[:, a:b].long()] for r, (a, b) in enumerate([(0, 5), (5, 18), (18, 21), (21, 30)])], 1)
    assert (dot / sq.sqrt() >= ref_dot / ref_sq.sqrt() - 1e-6).all()
    assert (idx.int() == ref_idx).all(1).float().mean() > 0.99
    torch.testing.assert_close(dot, (y * c).sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sq, c.square().sum(1), rtol=1e-5, atol=1e-6)


def test_codebooks_are_symmetric():  # the compiled direction search relies on it
    for bits in (1, 2, 3, 4, 8):
        s = tq.TurboQuantMSE(dim=50, bits=bits).tensors()
        assert torch.equal(s["centroids"], -s["centroids"].flip(0))
        assert torch.equal(s["boundaries"], -s["boundaries"].flip(0))
