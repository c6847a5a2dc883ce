import math

import numpy as np
import pytest
import torch

import tqindex as tq
from tqindex.kernels import native
from tqindex.codebooks import lloyd_max
from tqindex.packing import packed_size, unpack
from tqindex.rotation import Rotation
from tqindex.directions import CodeRun, encode_directions_reference, search_alphas
from tqindex.kernels.encode_native import encode_directions_native

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


def _levels(qdata, runs):
    """The code levels c [N, coded columns] of packed qdata over runs (reference unpacking)."""
    parts, byte = [], 0
    for width, c, _ in runs:
        if c is not None:
            bits = len(c).bit_length() - 1
            nb = packed_size(width, bits)
            parts.append(c[unpack(qdata[:, byte : byte + nb], bits, width).long()])
            byte += nb
    return torch.cat(parts, 1)


def _check_against_reference(x, rotation, runs, alphas, simd):
    qdata, norm, dot, sq = encode_directions_native(x, rotation, runs, alphas, simd=simd)
    ref_q, ref_norm, ref_dot, ref_sq = encode_directions_reference(x, rotation, runs, alphas)
    y = rotation.apply(x)
    u = y / y.norm(dim=1, keepdim=True).clamp_min(1e-30)
    u = torch.cat([u[:, a : a + w] for a, (w, c, _) in zip(np.cumsum([0] + [r[0] for r in runs]), runs) if c is not None], 1)
    c, ref_c = _levels(qdata, runs), _levels(ref_q, runs)
    assert qdata.shape == ref_q.shape and qdata.dtype == torch.uint8
    # The same code but where float rounding (of ||y||, of a pre-scale's cosine) decides a tie, and as good
    assert (qdata == ref_q).all(1).float().mean() > 0.99
    assert ((u * c).sum(1) / c.norm(dim=1) >= (u * ref_c).sum(1) / ref_c.norm(dim=1) - 5e-3).all()
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dot, (u * c).sum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sq, c.square().sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.available(), reason="compiled kernels not built")
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim,kind", [(7, "dense"), (50, "dense"), (130, "dense"), (64, "hadamard"), (24, "none"),
                                      (2048, "hadamard")])
@pytest.mark.parametrize("candidates", [1, 6])
@pytest.mark.parametrize("simd", [True, False])
def test_compiled_direction_codes_equal_reference(bits, dim, kind, candidates, simd):
    s = tq.TurboQuantMSE(dim=dim, bits=bits).tensors()
    x = torch.randn(300 if dim > 1000 else 2000, dim, generator=torch.Generator().manual_seed(dim + bits)) * (bits / 2)
    x[3] = 0  # a zero row: zero norm, a code all the same
    rotation = Rotation.create(dim, seed=bits, kind=kind)
    _check_against_reference(x, rotation, [CodeRun(dim, s["centroids"], s["boundaries"])], search_alphas(candidates), simd)


@pytest.mark.skipif(not native.available(), reason="compiled kernels not built")
@pytest.mark.parametrize("simd", [True, False])
def test_compiled_direction_codes_over_runs_of_any_length(simd):
    """Runs of 4, 2, 1 and 3 bits (each with its own codebook) and one left out, of lengths not
    multiples of 8, in a dense rotation."""
    runs = []
    for n, bits in [(5, 4), (13, 2), (4, 0), (3, 1), (9, 3)]:
        s = tq.TurboQuantMSE(dim=64, bits=max(bits, 1)).tensors()
        runs.append(CodeRun(n, s["centroids"], s["boundaries"]) if bits else CodeRun(n, None, None))
    x = torch.randn(3000, 34, generator=torch.Generator().manual_seed(34))
    _check_against_reference(x, Rotation.create(34, seed=1), runs, search_alphas(6), simd)


def test_codebooks_are_symmetric():  # the compiled direction search relies on it
    for bits in (1, 2, 3, 4, 8):
        s = tq.TurboQuantMSE(dim=50, bits=bits).tensors()
        assert torch.equal(s["centroids"], -s["centroids"].flip(0))
        assert torch.equal(s["boundaries"], -s["boundaries"].flip(0))
