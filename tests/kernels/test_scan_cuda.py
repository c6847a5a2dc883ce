"""The CUDA kernels of the scan of few queries over 4-bit codes (tile maxima, exact re-scoring) against their PyTorch
references (CUDA devices only, the references on any)."""

import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_cuda, needs_triton
from test_scan_triton import data, flat, same_up_to_ties



@needs_triton
@pytest.mark.parametrize("dim", [64, 128, 1536])
def test_queries_in_coordinate_order(dim):
    """The kernel's queries: the planar queries of a 4-bit run back in coordinate order (any device)."""
    from tqindex.kernels.planes import RunLayout
    from tqindex.kernels.scan_cuda import coordinate_order
    from tqindex.kernels.scan_triton import _scan_tables, planar_queries

    enc = tq.make_encoder("tq4", dim)
    enc.train(data(10, dim, 0))
    layouts = [RunLayout(*r) for r in _scan_tables(enc, torch.device("cpu"))[0]]
    qs = data(3, dim, 1)
    qp, scale = planar_queries(qs, layouts)
    assert torch.equal(coordinate_order(qp, layouts[0]), qs / scale[:, None])


def _problem(name, dim, n, m, l2, device):
    """Codes of n rows, a scorer of m queries (doubled for l2, as every scorer takes them) and the kernel's
    arguments after the codes."""
    from tqindex.kernels.planes import RunLayout
    from tqindex.kernels.scan_triton import TritonScorer

    enc = tq.make_encoder(name, dim)
    x, q = data(n, dim, 1).to(device), data(m, dim, 2).to(device)
    if not enc.is_trained:
        enc.train(x)
    codes, qr = enc.encode(x), 2 * enc.rotate(q) if l2 else enc.rotate(q)
    scorer = TritonScorer(enc, qr, l2)
    return enc, codes, qr, scorer, (scorer.qp32, RunLayout(*scorer.runs[0]), scorer.qscale, scorer.levels_i8, l2)


CASES = [("tq4", 128, 1, 1, False), ("tq4", 64, 255, 3, True), ("tq4", 128, 4097, 4, False),
         ("tq4", 384, 257, 2, True), ("tq4", 128, 1000, 7, True), ("tq4", 1536, 300, 8, False),
         ("tq4", 192, 129, 16, True), ("tq4", 64, 1000, 12, False), ("tq4-pca", 64, 300, 2, False)]


@needs_triton
def test_int8_levels():
    """The int8 levels: code c < 8 is -level(7 - c), c >= 8 is +level(c - 8), within half a step of the float
    levels, the largest 126; magnitudes below half a step are raised to 1; the kernel's words hold them byte by
    byte."""
    from tqindex.kernels.scan_cuda import int8_levels

    enc = tq.make_encoder("tq4", 128)
    centroids = enc.code_runs()[0].centroids.float()  # the 16 levels, ascending
    lv = int8_levels(centroids[8:])
    assert lv.levels.dtype == torch.int8 and lv.levels.abs().max() == 126
    assert torch.equal(lv.levels[:8], -lv.levels[8:].flip(0))
    assert (lv.levels.float() * lv.scale - centroids).abs().max() <= lv.scale / 2 + 1e-7
    tiny = int8_levels(torch.tensor([1e-4, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 1.0]))
    assert tiny.levels[8] == 1 and tiny.levels[7] == -1 and (tiny.levels != 0).all()
    packed = torch.tensor(lv.words, dtype=torch.int64)
    got = torch.stack([(packed >> (8 * i)) & 255 for i in range(4)], 1).reshape(16)
    assert torch.equal(got, lv.levels.view(torch.uint8).long())


@needs_triton
@pytest.mark.parametrize("name, dim, n, m, l2", CASES)
def test_int8_reference_within_its_rounding_bound(name, dim, n, m, l2):
    """The int8 maxima (the kernel's reference, any device) lie within the rounding bound of the exact maxima
    (the reference scan's float32 scores)."""
    from tqindex.kernels import scan_cuda

    enc, codes, qr, scorer, args = _problem(name, dim, n, m, l2, DEVICE)
    got = scan_cuda.tile_maxima_ref(codes, *args)
    exact = scan_cuda.tile_max(tq.scorer.DecodeScorer(enc, qr, l2).scores(codes))
    mags = scorer.mags[: 8]
    bound = scan_cuda.rounding_bound(*args[:4], mags, float(codes.norm.float().max()), l2)
    assert got.shape == exact.shape == (m, -(-n // scan_cuda.TILE))
    assert ((got - exact).abs() <= bound[:, None] * (1 + 1e-4) + 1e-5 * exact.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("name, dim, n, m, l2", CASES)
@pytest.mark.parametrize("split", [0, 1])
@needs_cuda
def test_tile_maxima_equal_the_reference(name, dim, n, m, l2, split):
    """The kernel's maxima equal its int8 reference's up to float32 rounding, with the kernel's choice of warps per
    tile (here: eight) and with one; ``tq4-pca`` (a trained basis, every coordinate 4 bits) is the same one run."""
    from tqindex.kernels import scan_cuda

    enc, codes, qr, scorer, args = _problem(name, dim, n, m, l2, DEVICE)
    assert scorer._cuda_tiles(codes, m) and not scorer._cuda_tiles(codes, scan_cuda.MAX_QUERIES + 1)
    got = scan_cuda.tile_maxima(codes, *args, split=split)
    ref = scan_cuda.tile_maxima_ref(codes, *args)
    assert got.shape == (m, -(-n // scan_cuda.TILE)) and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_cuda
@pytest.mark.parametrize("name, dim", [("tq4", 50), ("tq3", 128), ("tq2-pca", 64)])
def test_other_codes_are_left_to_triton(name, dim):
    """Rows not a multiple of 32 bytes, other widths and several runs are not read by the CUDA kernel."""
    from tqindex.kernels.scan_triton import TritonScorer

    index = flat(name, dim, "ip", data(300, dim, 3).to(DEVICE))
    qr = index.encoder.rotate(data(2, dim, 4).to(DEVICE))
    assert not TritonScorer(index.encoder, qr, False)._cuda_tiles(index._state.lists[0].live_codes, 2)


@needs_cuda
@pytest.mark.parametrize("nq, k, metric", [(1, 10, "ip"), (3, 5, "l2"), (4, 1, "cosine"), (16, 10, "l2")])
def test_search_of_few_queries_through_the_cuda_kernel(monkeypatch, nq, k, metric):
    """A flat search of few queries over enough rows takes the best tiles of the CUDA kernel's maxima and scores
    their rows exactly: the reference's results."""
    from tqindex.kernels import scan_cuda

    calls = []
    real = scan_cuda.tile_maxima
    monkeypatch.setattr(scan_cuda, "tile_maxima", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, q = data(140_001, 128, 5).to(DEVICE), data(nq, 128, 6).to(DEVICE)
    index = flat("tq4", 128, metric, x)
    D0, I0 = index.search(q, k)
    index.backend = "triton"
    same_up_to_ties(*index.search(q, k), D0, I0)
    assert calls


def _candidates(n, m, span, seed):
    """Candidate tiles (span rows) or rows [m, 5] of n rows, with the last (partial) tile or row and a -1."""
    g = torch.Generator().manual_seed(seed)
    last = -(-n // span) - 1
    cand = torch.randint(0, last + 1, (m, 5), generator=g)
    cand[:, 0], cand[:, 1] = last, -1
    return cand.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("name, dim, n, m, l2", CASES[:4] + CASES[-1:])
def test_rescore_reference_is_the_exact_score(name, dim, n, m, l2):
    """The re-scoring reference (any device) gives every candidate row the exact float32 score (the decoding
    scorer's), -inf and row -1 where there is none or past the last row."""
    from tqindex.kernels import scan_cuda

    enc, codes, qr, scorer, args = _problem(name, dim, n, m, l2, DEVICE)
    exact = tq.scorer.DecodeScorer(enc, qr, l2).scores(codes)  # [m, n]
    cand = _candidates(n, m, scan_cuda.TILE, 0)
    v, rows = scan_cuda.rescore_ref(codes, *args, None, cand, scan_cuda.TILE)
    place = torch.arange(5 * scan_cuda.TILE, device=DEVICE)
    want = cand[:, place // scan_cuda.TILE] * scan_cuda.TILE + place % scan_cuda.TILE
    want = torch.where((cand[:, place // scan_cuda.TILE] >= 0) & (want < n), want, -1)
    assert torch.equal(rows, want)
    ok = rows >= 0
    assert (v[~ok] == float("-inf")).all()
    # float32 rounding of the scores' terms: scores near 0 (l2: 2 <q, x> - ||x||², terms in the hundreds) are exact only
    # to about 1e-7 of the largest terms, not of themselves
    scale = float(exact.abs().max())
    torch.testing.assert_close(v[ok], exact.gather(1, rows.clamp_min(0))[ok], rtol=1e-5, atol=1e-6 * scale)


@needs_cuda
@pytest.mark.parametrize("name, dim, n, m, l2", CASES)
@pytest.mark.parametrize("span, subset", [(256, False), (1, True)])
def test_rescore_equals_the_reference(name, dim, n, m, l2, span, subset):
    """The re-scoring kernel's scores equal its reference's up to float32 summation order, its rows exactly, for
    tiles and for single rows, all queries or a subset of them; the Triton kernel's scores are the same."""
    from tqindex.kernels import scan_cuda
    from tqindex.kernels.scan_triton import TritonScorer

    enc, codes, qr, scorer, args = _problem(name, dim, n, m, l2, DEVICE)
    qrows = torch.arange(m - 1, -1, -2, device=DEVICE) if subset else None
    cand = _candidates(n, m if qrows is None else len(qrows), span, 1)
    v, rows = scan_cuda.rescore(codes, *args, qrows, cand, span)
    rv, rrows = scan_cuda.rescore_ref(codes, *args, qrows, cand, span)
    assert torch.equal(rows, rrows) and torch.equal(v == float("-inf"), rrows < 0)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5 * float(rv[rrows >= 0].abs().max()))
    tv, trows = TritonScorer(enc, qr, l2, cuda=False).rescore(qrows, codes, cand, span)
    assert torch.equal(trows, rows)
    torch.testing.assert_close(tv, v, rtol=1e-5, atol=1e-5 * float(rv[rrows >= 0].abs().max()))


@needs_cuda
@pytest.mark.parametrize("m", [4, 40])
def test_search_rescores_through_the_cuda_kernel(monkeypatch, m):
    """A search re-scores its best tiles with the CUDA kernel where it reads the codes (here also below the rows from
    which it does so by default), after the CUDA tile maxima of few queries or the Triton ones of a batch."""
    from tqindex.kernels import scan_cuda

    monkeypatch.setattr(scan_cuda, "RESCORE_MIN_ROWS", 1)
    calls = []
    real = scan_cuda.rescore
    monkeypatch.setattr(scan_cuda, "rescore", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, q = data(140_001, 128, 5).to(DEVICE), data(m, 128, 6).to(DEVICE)
    index = flat("tq4", 128, "ip", x)
    D0, I0 = index.search(q, 10)
    index.backend = "triton"
    same_up_to_ties(*index.search(q, 10), D0, I0)
    assert calls
