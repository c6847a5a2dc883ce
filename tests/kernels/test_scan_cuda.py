"""The CUDA tile-maxima scan of few queries over 4-bit codes against the PyTorch reference (CUDA devices only)."""

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


@pytest.mark.parametrize("name, dim, n, m, l2", [
    ("tq4", 128, 1, 1, False), ("tq4", 64, 255, 3, True), ("tq4", 128, 4097, 4, False), ("tq4", 384, 257, 2, True),
    ("tq4", 128, 1000, 3, True), ("tq4", 1536, 300, 4, False), ("tq4-pca", 64, 300, 2, False)])
@needs_cuda
def test_tile_maxima_equal_the_reference(name, dim, n, m, l2):
    """Each tile's best score per query equals the exact reference's up to float16 rounding (levels, queries);
    ``tq4-pca`` (a trained basis, every coordinate 4 bits) is the same one run."""
    from tqindex.kernels import scan_cuda
    from tqindex.kernels.planes import RunLayout
    from tqindex.kernels.scan_triton import TritonScorer

    enc = tq.make_encoder(name, dim)
    x, q = data(n, dim, 1).to(DEVICE), data(m, dim, 2).to(DEVICE)
    if not enc.is_trained:
        enc.train(x)
    codes, qr = enc.encode(x), 2 * enc.rotate(q) if l2 else enc.rotate(q)
    scorer = TritonScorer(enc, qr, l2)
    assert scorer._cuda_tiles(codes, m) and not scorer._cuda_tiles(codes, scan_cuda.MAX_QUERIES + 1)
    got = scan_cuda.tile_maxima(codes, scorer.qp, RunLayout(*scorer.runs[0]), scorer.qscale, scorer.tables[:4], l2)
    ref = scan_cuda.tile_maxima_ref(tq.scorer.DecodeScorer(enc, qr, l2).scores(codes))
    tiles = -(-n // scan_cuda.TILE)
    assert got.shape == (m, tiles) and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=0, atol=3e-3 * float(ref.abs().max()))


@needs_cuda
@pytest.mark.parametrize("name, dim", [("tq4", 50), ("tq3", 128), ("tq2-pca", 64)])
def test_other_codes_are_left_to_triton(name, dim):
    """Rows not a multiple of 32 bytes, other widths and several runs are not read by the CUDA kernel."""
    from tqindex.kernels.scan_triton import TritonScorer

    index = flat(name, dim, "ip", data(300, dim, 3).to(DEVICE))
    qr = index.encoder.rotate(data(2, dim, 4).to(DEVICE))
    assert not TritonScorer(index.encoder, qr, False)._cuda_tiles(index._state.lists[0].live_codes, 2)


@needs_cuda
@pytest.mark.parametrize("nq, k, metric", [(1, 10, "ip"), (3, 5, "l2"), (4, 1, "cosine")])
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
