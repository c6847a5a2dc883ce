"""The row checks in one Triton launch against tqindex.checks, and an index's errors with them."""

import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_triton
from tqindex.checks import NORM_SAFE, row_norms, unit_rows
from tqindex.index import INDEX_NORMS

pytestmark = needs_triton


def rows(n, d, seed):
    """Gaussian rows with norms spread over many octaves, the first row zero."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())
    t[0] = 0
    return t


@pytest.mark.parametrize("n, d", [(1, 50), (127, 60), (129, 130), (4097, 64), (3, 384), (5, 1536), (2, 2500)])
def test_rows_and_norms_equal_the_reference(n, d):
    """Norms bit-equal row_norms (float64 sums, one rounding), unit rows bit-equal unit_rows (zero rows zero); rows
    of any stride; no flag where every row is finite and in range."""
    from tqindex.kernels.checks_triton import checked_rows_triton

    t = rows(n, d, n * d).to(DEVICE)
    for x in (t, torch.cat([t, t], 1)[:, d // 2 : d // 2 + d]):  # the second: a row stride of 2d
        u, norms, flags = checked_rows_triton(x, True, *NORM_SAFE)
        assert torch.equal(norms, row_norms(x)) and torch.equal(u, unit_rows(x)[1]) and not flags.any()
        same, norms, flags = checked_rows_triton(x, False, *INDEX_NORMS)
        assert same is x and torch.equal(norms, row_norms(x)) and not flags.any()


@pytest.mark.parametrize("bad", ["nan", "inf", "overflow", "large", "small"])
def test_a_bad_row_sets_its_programs_flag(bad):
    """NaN, inf, a norm beyond float32 and nonzero norms outside [low, high] set the flag of their row's program
    only; zero rows never do."""
    from tqindex.kernels.checks_triton import ELEMENTS, checked_rows_triton

    t = rows(300, 50, 1)
    t /= row_norms(t).clamp_min(1e-30)[:, None]  # unit rows, the first zero
    i = 257
    if bad == "nan":
        t[i, 3] = float("nan")
    elif bad == "inf":
        t[i, 7] = -float("inf")
    elif bad == "overflow":
        t[i, :2] = 3e38  # finite values, norm past float32's range
    else:
        t[i] *= 2.0**70 if bad == "large" else 2.0**-70
    _, _, flags = checked_rows_triton(t.to(DEVICE), False, *INDEX_NORMS)
    assert flags.sum() == 1 and flags[i // (ELEMENTS // 64)]  # programs of ELEMENTS // 64 rows (64 padded columns)


def test_an_index_refuses_bad_rows_and_rescales_unsafe_ones():
    """With the Triton row checks an index raises the reference's errors and is left as it was; cosine queries of
    norms outside NORM_SAFE get the same answers as with the torch backend."""
    x = rows(129, 50, 7)[1:] / 8
    queries = x[:5].clone()
    queries[1] *= 2.0**60  # cosine: rescaled exactly, not refused
    queries[2] *= 2.0**-60
    answers = {}
    for backend in ("torch", "triton"):
        index = tq.FlatIndex(tq.make_encoder("tq4", 50), metric="cosine", device=DEVICE, backend=backend)
        index.add(x.to(DEVICE))
        answers[backend] = index.search(queries.to(DEVICE), 5)
        nan = queries.clone()
        nan[3, 0] = float("nan")
        for call in (lambda: index.search(nan.to(DEVICE), 5), lambda: index.add(nan.to(DEVICE))):
            with pytest.raises(ValueError, match="contains NaN or infinite values"):
                call()
        assert index.ntotal == len(x)
        ip = tq.FlatIndex(tq.make_encoder("tq4", 50), metric="ip", device=DEVICE, backend=backend)
        for call in (lambda: ip.add((x * 2.0**64).to(DEVICE)), lambda: ip.add((x * 2.0**10).to(DEVICE))):
            with pytest.raises(ValueError, match="norms outside"):  # the index's range, then float16 side data
                call()
        assert ip.ntotal == 0
    assert torch.equal(answers["torch"][1], answers["triton"][1])
    torch.testing.assert_close(answers["torch"][0], answers["triton"][0], rtol=1e-5, atol=1e-6)
