"""Vectors of any scale: encoders and indexes either hold them faithfully or refuse them by name.

Scaling by a power of two is exact in floating point, so codes of 2^e·x must equal the codes of x and
every score must scale exactly; where the side data cannot hold the scale, a ValueError names the rows.
"""

import numpy as np
import pytest
import torch

import tqindex as tq
from tqindex.index import INDEX_NORMS

DIM = 64
EXPONENTS = [-100, -60, -30, -14, -4, 0, 4, 12, 14, 30, 60, 100]  # 64-d Gaussian rows: norms ~8·2^e, 1e-30..1e31
ENCODERS = ["tq1", "tq2", "tq3", "tq4", "tq8", "tq4-norm", "tq3-prod", "tq2-pca", "fp4"]  # fp4: power-of-two scales


def gaussian(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def encoder(name: str, norm_dtype: str | None) -> tq.Encoder:
    kw = {} if norm_dtype is None else {"norm_dtype": norm_dtype}
    enc = tq.make_encoder(name, DIM, **kw)
    enc.train(gaussian(500, 9))
    return enc


def fits(norms: np.ndarray, limits: tuple[float, float]) -> bool:
    return bool(((norms >= limits[0]) & (norms <= limits[1])).all())


@pytest.mark.parametrize("name, norm_dtype", [(n, d) for n in ENCODERS for d in (None, "float32") if n != "fp4" or not d])
@pytest.mark.parametrize("exp", EXPONENTS)
def test_encoder_codes_scale_exactly_or_are_refused(name, norm_dtype, exp):
    enc = encoder(name, norm_dtype)
    x = torch.from_numpy(gaussian(200))
    xs = torch.ldexp(x, torch.tensor(exp))
    norms = torch.linalg.vector_norm(xs.double(), dim=1).numpy()
    if not fits(norms, enc.norm_limits):
        with pytest.raises(ValueError, match="norms outside"):
            enc.encode(xs)
        return
    base, scaled = enc.encode(x), enc.encode(xs)
    assert torch.equal(base.qdata, scaled.qdata)  # the code of a direction does not depend on the scale
    want = torch.ldexp(enc.decode(base).double(), torch.tensor(exp))
    got = enc.decode(scaled).double()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_float16_side_data_limits_are_what_float16_holds():
    enc = tq.make_encoder("tq4", DIM)
    low, high = enc.norm_limits
    assert low >= 2.0**-14 and high * 2 <= 65504  # normal float16, with room for the scale's factor
    assert tq.make_encoder("tq4", DIM, norm_dtype="float32").norm_limits[1] >= 1e30


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("name, norm_dtype", [("tq4", None), ("tq4", "float32"), ("tq3-prod", "float32"), ("fp4", None)])
@pytest.mark.parametrize("exp", EXPONENTS)
def test_index_results_scale_exactly_or_add_is_refused(metric, name, norm_dtype, exp):
    x = torch.from_numpy(gaussian(400))
    xs = torch.ldexp(x, torch.tensor(exp))
    kw = {} if norm_dtype is None else {"norm_dtype": norm_dtype}
    base = tq.FlatIndex(tq.make_encoder(name, DIM, **kw), metric=metric)
    base.add(x)
    index = tq.FlatIndex(tq.make_encoder(name, DIM, **kw), metric=metric)
    norms = torch.linalg.vector_norm(xs.double(), dim=1).numpy()
    ok = metric == "cosine" or (fits(norms, INDEX_NORMS) and fits(norms, index.encoder.norm_limits))
    if not ok:
        with pytest.raises(ValueError, match=r"norms outside .* rows \(norms\) \d+ \("):
            index.add(xs)
        assert index.ntotal == 0
        return
    index.add(xs)
    D1, I1 = base.search(x[:40], 10)
    if metric != "cosine" and not fits(norms[:40], INDEX_NORMS):
        with pytest.raises(ValueError, match="norms outside"):
            index.search(xs[:40], 10)
        return
    D, I = index.search(xs[:40], 10)
    assert torch.equal(I, I1)  # the same ranking
    factor = {"ip": 2.0 ** (2 * exp), "l2": 2.0 ** (2 * exp), "cosine": 1.0}[metric]
    torch.testing.assert_close(D.double(), D1.double() * factor, rtol=2e-5, atol=0)
    assert (I[:, 0] == torch.arange(40)).float().mean() > 0.9  # self-recall (l2, ip at 4 bits: nearly all)


def test_the_reported_overflow_is_refused():
    x = gaussian(1000) * 2e4  # norms ~1.6e5: beyond float16 side data
    index = tq.index_factory(DIM, "tq4", metric="l2")
    with pytest.raises(ValueError, match="norm_dtype='float32'"):
        index.add(x)
    index = tq.FlatIndex(tq.make_encoder("tq4", DIM, norm_dtype="float32"), metric="l2")
    index.add(x)
    D, I = index.search(x[:50], 5)
    assert np.isfinite(D).all() and (I[:, 0] == np.arange(50)).mean() > 0.9
