"""The GPU scan (Triton; the CPU interpreter without a GPU) against the PyTorch reference scan."""

import numpy as np
import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_triton

pytestmark = needs_triton


def data(n: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g) * torch.empty(n, 1).uniform_(0.5, 2.0, generator=g)


def same_up_to_ties(D, I, D0, I0, rtol=1e-5):
    D, I, D0, I0 = (t.cpu().numpy() if isinstance(t, torch.Tensor) else t for t in (D, I, D0, I0))
    np.testing.assert_array_equal(I == -1, I0 == -1)
    np.testing.assert_allclose(D, D0, rtol=rtol, atol=1e-5 * np.abs(D0[np.isfinite(D0)]).max(initial=1))
    assert (I == I0).mean() > 0.97  # equal up to exact ties


def flat(name: str, dim: int, metric: str, x: torch.Tensor) -> tq.FlatIndex:
    index = tq.index_factory(dim, name, metric=metric, device=DEVICE, backend="torch")
    index.train(x)
    index.add(x)  # the reference codes: the scans are compared on the same codes
    return index


@pytest.mark.parametrize("name, dim, n, nq, metric", [
    ("tq4", 64, 129, 3, "ip"),
    ("tq4", 50, 127, 17, "l2"),
    ("tq2", 130, 129, 1, "cosine"),
    ("tq1", 60, 300, 2, "ip"),
    ("tq3", 50, 129, 5, "l2"),
    ("tq8", 64, 70, 2, "ip"),
    ("tq2-pca", 48, 200, 4, "l2"),
    ("tq4", 384, 65, 2, "ip"),
])
def test_flat_scan_equals_the_reference(name, dim, n, nq, metric):
    x, q = data(n, dim, 1).to(DEVICE), data(nq, dim, 2).to(DEVICE)
    index = flat(name, dim, metric, x)
    for k in (1, 10, n + 5):  # k beyond n pads with -1
        D0, I0 = index.search(q, k)
        index.backend = "triton"
        D, I = index.search(q, k)
        index.backend = "torch"
        same_up_to_ties(D, I, D0, I0)


def test_zero_query_scores_zero():
    """A query of zeros (scaled by a tiny power of two, not by 0) scores 0 against every row."""
    x = data(300, 64, 8).to(DEVICE)
    index = flat("tq4", 64, "ip", x)
    index.backend = "triton"
    D, I = index.search(torch.zeros(2, 64, device=DEVICE), 5)
    assert (D == 0).all() and ((I >= 0) & (I < 300)).all()


@pytest.mark.parametrize("name, dim, m", [("tq4", 50, 1), ("tq3", 130, 3), ("tq2-pca", 48, 17), ("tq1", 60, 2),
                                         ("tq8", 384, 5)])
def test_planar_queries_kernel_equals_the_reference(name, dim, m):
    """The one-launch planar queries equal the PyTorch reference exactly: float32 and float16 copies and the
    power-of-two scales, with a zero query and a query whose largest magnitude is a power of two."""
    from tqindex.kernels.planes import RunLayout
    from tqindex.kernels.scan_triton import _scan_tables, planar_queries, planar_queries_triton

    index = flat(name, dim, "ip", data(300, dim, 3).to(DEVICE))
    layouts = [RunLayout(*r) for r in _scan_tables(index.encoder, DEVICE)[0]]
    q = data(m, dim, 4).to(DEVICE)
    q[0] = 0
    if m > 1:
        q[1, 3] = -torch.exp2(torch.floor(torch.log2(4 * q[1].abs().max())))  # the largest, a power of two
    qp32, qp16, scale = planar_queries_triton(q, layouts)
    ref, ref_scale = planar_queries(q, layouts)
    assert torch.equal(qp32, ref) and torch.equal(scale, ref_scale) and torch.equal(qp16, ref.half())
    assert scale[0] == 2.0 ** -99 and (m == 1 or scale[1] == q[1, 3].abs())
    assert (ref.abs().amax(1) <= 1).all() and (ref[1:].abs().amax(1) > 0.5).all()


@pytest.mark.parametrize("name, dim, l2", [("tq4", 50, True), ("tq3", 130, False), ("tq8", 64, True),
                                         ("tq2-pca", 48, False), ("tq1", 60, True)])
@pytest.mark.parametrize("span", [1, 16])
def test_rescore_is_exact(name, dim, l2, span):
    """Candidates re-scored in float32 (rows or tiles of ``span`` rows, -1 for none, the last tile partial, a
    subset of the queries) equal the encoder's decode times the query."""
    from tqindex.kernels.scan_triton import TritonScorer

    n = 129
    x, q = data(n, dim, 5).to(DEVICE), data(5, dim, 6).to(DEVICE)
    index = flat(name, dim, "l2" if l2 else "ip", x)
    enc, codes = index.encoder, index._state.lists[0].live_codes
    qs = enc.rotate(q) * (2 if l2 else 1)
    g = torch.Generator().manual_seed(7)
    cand = torch.randint(-1, (n + span - 1) // span, (3, 11), generator=g).to(DEVICE)
    qrows = torch.tensor([4, 0, 2], device=DEVICE)
    vals, rows = TritonScorer(enc, qs, l2).rescore(qrows, codes, cand, span)
    expect_rows = torch.where(cand[:, :, None] >= 0, cand[:, :, None] * span + torch.arange(span, device=DEVICE), -1)
    expect_rows = torch.where(expect_rows < n, expect_rows, -1).reshape(3, -1)
    assert rows.dtype == torch.int64 and torch.equal(rows, expect_rows)
    xr = enc.decode_rotated(codes)
    ref = qs[qrows] @ xr.T - (xr.square().sum(1) if l2 else 0)
    ref = torch.where(expect_rows >= 0, ref.gather(1, expect_rows.clamp_min(0)), float("-inf"))
    torch.testing.assert_close(vals, ref, rtol=1e-5, atol=1e-5 * float(ref[ref > float("-inf")].abs().max()))


@pytest.mark.parametrize("decode", [0, 1] + ([2] if DEVICE.type == "cuda" else []))  # 2: inline PTX, CUDA only
def test_decodes_agree(decode):
    from tqindex.kernels.scan_triton import TritonScorer
    from tqindex.topk import make_topk

    enc = tq.make_encoder("tq4", 64)
    x, q = data(150, 64, 3).to(DEVICE), data(4, 64, 4).to(DEVICE)
    codes, qr = enc.encode(x), enc.rotate(q)
    top = make_topk(4, 8, DEVICE)
    TritonScorer(enc, qr, False, decode=decode).push(codes, 0, top)
    ref = make_topk(4, 8, DEVICE)
    tq.scorer.DecodeScorer(enc, qr, False).push(codes, 0, ref)
    same_up_to_ties(*top.result(), *ref.result())


def test_filtered_and_explicit_ids():
    x, q = data(200, 64, 5).to(DEVICE), data(3, 64, 6).to(DEVICE)
    index = tq.FlatIndex(tq.make_encoder("tq4", 64), device=DEVICE, backend="torch")
    index.add(x, ids=torch.arange(200) * 3 + 1)
    out = []
    for backend in ("triton", "torch"):
        index.backend = backend
        out.append(index.search(q, 20, allow=torch.arange(0, 600, 2) + 1))
    same_up_to_ties(*out[0], *out[1])
    assert (out[0][1][out[0][1] >= 0] % 6 == 1).all()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_ivf_scan_equals_the_reference(metric):
    x, q = data(600, 32, 7), data(9, 32, 8)
    index = tq.IVFIndex(tq.make_encoder("tq4", 32), 8, metric=metric, nprobe=3, device=DEVICE, backend="torch")
    index.train(x)
    index.add(x.to(DEVICE), ids=torch.arange(600) + 1000)
    index.remove_ids(torch.arange(1000, 1100))
    out = []
    for backend in ("triton", "torch"):
        index.backend = backend
        out.append(index.search(q.to(DEVICE), 15))
    same_up_to_ties(*out[0], *out[1])


def small_tiles(monkeypatch):
    """16-row tiles (enough of them in 1500 rows to sample or to keep the best few), one sampled tile per
    candidate."""
    import tqindex.kernels.scan_triton as st

    monkeypatch.setattr(st.scan_cuda, "reads", lambda *a: False)  # the Triton kernel's tiles (CUDA: 256 rows)
    monkeypatch.setattr(st, "SAMPLE_TILES", 1)
    for tiles in ("TILES", "TILES_FILTER", "TILES_TILE_MAX", "TILES_TILE_MAX_SHORT"):
        monkeypatch.setattr(st, tiles, {q: (16, warps) for q, (_, warps) in getattr(st, tiles).items()})
    return st


# queries: FMAs, then MMAs of 16, 64 and 256 queries per program; room (0, 0): every query scanned again
@pytest.mark.parametrize("nq, room", [(nq, room) for nq in (1, 3, 40) for room in ((3, 256), (0, 0))]
                         + [(200, (3, 256))])
def test_sampled_bound_then_filter(monkeypatch, room, nq):
    """Large scans bound each query's k-th best by the top-k of a sample, keep the rows that reach it, and
    scan overflowing queries again with a running top-k: the same results as the reference."""
    st = small_tiles(monkeypatch)
    monkeypatch.setattr(st, "TILE_QUERIES", 0)
    monkeypatch.setattr(st, "SAMPLE_FRACTION", 8)
    monkeypatch.setattr(st, "CAPACITY_FACTOR", room[0])
    monkeypatch.setattr(st, "CAPACITY_EXTRA", room[1])
    x, q = data(1500, 64, 11).to(DEVICE), data(nq, 64, 12).to(DEVICE)
    index = flat("tq4", 64, "l2", x)
    D0, I0 = index.search(q, 10)
    index.backend = "triton"
    same_up_to_ties(*index.search(q, 10), D0, I0)


@pytest.mark.parametrize("nq", [1, 3, 40])
def test_filtering_scan_keeps_exactly_the_rows_reaching_the_threshold(monkeypatch, nq):
    """The filtering scan keeps each row once whose score reaches its query's threshold, and no other; it counts
    the rows past its room (which it does not write)."""
    st = small_tiles(monkeypatch)
    x, q = data(1000, 50, 21).to(DEVICE), data(nq, 50, 22).to(DEVICE)
    index = flat("tq4", 50, "ip", x)
    codes = index._state.lists[0].live_codes
    scorer = st.TritonScorer(index.encoder, index.encoder.rotate(q), False)
    monkeypatch.setattr(st, "CAPACITY_EXTRA", 1000)  # room for every row: all scores, by the lowest threshold
    every, rows, over = scorer.scan(codes, 5, mode=st.MODE_FILTER, threshold=torch.full((nq,), -1e30, device=DEVICE))
    assert not over.any() and torch.equal(rows[:, :1000].sort(1)[0].cpu(), torch.arange(1000).expand(nq, -1))
    scores = torch.empty(nq, 1000, device=DEVICE).scatter_(1, rows[:, :1000].long(), every[:, :1000])
    bound = scores.kthvalue(1000 - 30, 1)[0]  # about 31 rows of each query reach it
    monkeypatch.setattr(st, "CAPACITY_EXTRA", 0)
    monkeypatch.setattr(st, "CAPACITY_FACTOR", 1)  # room for 16 x 8 rows: none overflows
    vals, kept, over = scorer.scan(codes, 5, mode=st.MODE_FILTER, threshold=bound)
    assert vals.shape[1] == st.candidate_depth(5) * st.SAMPLE_FRACTION and not over.any()
    for i in range(nq):
        got = kept[i][vals[i] > float("-inf")].long()
        assert torch.equal(got.sort()[0], torch.nonzero(scores[i] >= bound[i]).squeeze(1))
        assert torch.equal(vals[i][vals[i] > float("-inf")], scores[i, got])
    tight = scores.kthvalue(1000 - 500, 1)[0]  # 500 rows reach it: 128 fit
    vals, kept, over = scorer.scan(codes, 5, mode=st.MODE_FILTER, threshold=tight)
    assert over.all() and (vals > float("-inf")).sum(1).eq(vals.shape[1]).all()
    assert all((scores[i, kept[i].long()] >= tight[i]).all() for i in range(nq))


def test_batch_best_tiles_rescored(monkeypatch):
    """Past TILE_QUERIES queries, tiles of rows (groups of the kernel's row blocks; the last partial)
    keep each query's maximum where the rows re-scored are few enough: the maxima equal those of single blocks
    grouped, and the search equals the reference."""
    st = small_tiles(monkeypatch)
    monkeypatch.setattr(st, "SAMPLE_FRACTION", 3)
    monkeypatch.setattr(st, "TILE_ROWS_MAX", 64)
    monkeypatch.setattr(st, "BATCH_TILE_SHARE", 1)
    monkeypatch.setattr(st, "BATCH_TILE_LIMIT", 1)
    x, q = data(1999, 64, 15).to(DEVICE), data(40, 64, 16).to(DEVICE)
    index = flat("tq4", 64, "ip", x)
    D0, I0 = index.search(q, 5)
    index.backend = "triton"
    same_up_to_ties(*index.search(q, 5), D0, I0)
    codes = index._state.lists[0].live_codes
    scorer = st.TritonScorer(index.encoder, index.encoder.rotate(q), False)
    single = scorer.scan(codes, 5, mode=st.MODE_TILE_MAX)[0]  # [40, 125] blocks of 16 rows
    grouped = scorer.scan(codes, 5, mode=st.MODE_TILE_MAX, group=4)[0]
    ref = torch.nn.functional.pad(single, (0, 3), value=float("-inf")).view(40, 32, 4).amax(2)
    assert torch.equal(grouped, ref)
    vals, cand, exact = scorer.candidates(codes, 5)
    assert exact and vals.shape == (40, st.candidate_depth(5) * 64)


def test_batch_tile_rows():
    """A batch's tiles: the largest up to TILE_ROWS_MAX whose kept tiles hold at most RESCORE_ROWS rows per query and
    at most 1 / BATCH_TILE_SHARE of the index, never below TILE_ROWS."""
    from tqindex.kernels.scan_triton import batch_tile_rows, candidate_depth

    assert [batch_tile_rows(10_000_000, candidate_depth(k)) for k in (10, 100, 1000)] == [512, 256, 32]
    assert batch_tile_rows(2_000_000, candidate_depth(10)) == 256  # 32 tiles of 512 rows: over 1 / 128 of the rows
    assert [batch_tile_rows(390_000, candidate_depth(k)) for k in (10, 100)] == [64, 32]


@pytest.mark.parametrize("nq, k, metric", [(1, 10, "l2"), (2, 1, "ip"), (5, 5, "cosine")])
def test_best_tiles_rescored(monkeypatch, nq, k, metric):
    """Few queries keep each tile's maximum; the rows of a query's best candidate_depth(k) tiles (the last
    tile partial; at most as many rows as a third of the index, the sample) are scored exactly: the same
    results as the reference."""
    st = small_tiles(monkeypatch)
    monkeypatch.setattr(st, "SAMPLE_FRACTION", 3)
    from tqindex.kernels.scan_triton import TritonScorer

    x, q = data(3999, 64, 13).to(DEVICE), data(nq, 64, 14).to(DEVICE)
    index = flat("tq4", 64, metric, x)
    D0, I0 = index.search(q, k)
    index.backend = "triton"
    same_up_to_ties(*index.search(q, k), D0, I0)
    codes = index._state.lists[0].live_codes
    vals, cand, exact = TritonScorer(index.encoder, index.encoder.rotate(q), metric == "l2").candidates(codes, k)
    assert exact and vals.shape == (nq, st.candidate_depth(k) * 16) and (cand < 3999).all()  # best tiles only


@pytest.mark.parametrize("n, nq, way", [(100, 3, "topk"), (3999, 2, "tiles"), (3999, 40, "filter")])
def test_candidates_never_read_device_values(monkeypatch, n, nq, way):
    """Finding the candidates only launches kernels (a CUDA graph can hold it): no path reads a device value on the
    host, the filtering scan's overflow included (every query overflows here: room for candidate_depth(k) rows)."""
    st = small_tiles(monkeypatch)
    monkeypatch.setattr(st, "SAMPLE_FRACTION", 3)
    monkeypatch.setattr(st, "CAPACITY_FACTOR", 0)
    monkeypatch.setattr(st, "CAPACITY_EXTRA", 0)
    index = flat("tq4", 64, "ip", data(n, 64, 17).to(DEVICE))
    codes = index._state.lists[0].live_codes
    q = data(nq, 64, 18).to(DEVICE)
    scorer = st.TritonScorer(index.encoder, index.encoder.rotate(q), False)
    assert scorer._candidates_plan(codes, 5, nq)[0] == way

    def read(*args):
        raise AssertionError("a device value read on the host")

    with monkeypatch.context() as m:
        for name in ("__bool__", "item", "tolist"):
            m.setattr(torch.Tensor, name, read)
        scorer.candidates(codes, 5)
    index.backend = "triton"
    D, I = index.search(q, 5)
    index.backend = "torch"
    same_up_to_ties(D, I, *index.search(q, 5))
