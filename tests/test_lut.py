import pytest
import torch

import tqindex as tq
from tqindex.lut import LookupTables, lut_scores, lut_supported


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("dim", [33, 50, 64, 130])
def test_lut_scores_equal_score_prepared(bits, dim):
    g = torch.Generator().manual_seed(dim * bits)
    enc = tq.TurboQuantMSE(dim=dim, bits=bits)
    codes = enc.encode(torch.randn(257, dim, generator=g) * 3)
    qr = enc.prepare_queries(torch.randn(5, dim, generator=g))
    ref = enc.score_prepared(qr, codes)
    torch.testing.assert_close(lut_scores(enc.code_runs(), qr, codes), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    sq = enc.decode_rotated(codes).square().sum(-1)  # with sqnorm: <R q, R x̂> - ||x̂||²
    lut = LookupTables(enc.code_runs(), enc.dim)
    torch.testing.assert_close(lut.scan(lut.tables(qr, sqnorm=True), codes, sqnorm=True), ref - sq,
                               rtol=1e-5, atol=1e-5 * (ref - sq).abs().max().item())


def test_lut_supported_encoders():
    assert lut_supported(tq.make_encoder("tq4", 50).code_runs()) and lut_supported(tq.make_encoder("tq1-norm", 50).code_runs())
    for name in ("tq3", "tq8"):
        assert not lut_supported(tq.make_encoder(name, 64).code_runs())
        assert lut_supported(tq.make_encoder(name, 64).code_runs(), nibbles=True) == (name == "tq3")  # the compiled scan's
    enc = tq.make_encoder("tq3", 64)
    with pytest.raises(ValueError, match="byte tables need"):
        lut_scores(enc.code_runs(), torch.zeros(1, 64), enc.encode(torch.randn(2, 64)))
    enc4 = tq.make_encoder("tq4", 64)
    with pytest.raises(ValueError, match="code bytes"):
        lut_scores(enc4.code_runs(), torch.zeros(1, 64), tq.make_encoder("tq2", 64).encode(torch.randn(2, 64)))


def test_tables_are_row_major():  # embedding_bag's fast path needs plain strides, also for one query
    lut = LookupTables(tq.TurboQuantMSE(dim=50, bits=4).code_runs(), 50)
    for m, sqnorm in ((1, False), (1, True), (3, False)):
        t = lut.tables(torch.randn(m, 50), sqnorm=sqnorm)
        assert t.shape == (25 * 256, m + sqnorm) and t.stride() == (t.shape[1], 1)
