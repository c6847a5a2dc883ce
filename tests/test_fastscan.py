from functools import partialmethod

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tqindex as tq
import tqindex.kernels.fastscan as fs
from tqindex.kernels import native
from tqindex.lut import LookupTables
from tqindex.packing import pack, unpack

pytestmark = pytest.mark.skipif(not native.available(), reason="compiled kernels not built")


def setup(bits: int, dim: int, n: int, nq: int, l2: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    enc = tq.TurboQuantMSE(dim=dim, bits=bits)
    codes = enc.encode(torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 3)
    scan = fs.FastScan(LookupTables(enc.code_runs(), enc.dim))
    qs = enc.prepare_queries(torch.randn(nq, dim, generator=g)) * (2 if l2 else 1)
    return enc, codes, scan, fs.compiled_quantize_tables(scan.lut.nibble_tables(qs, scan=True)), (scan.sq if l2 else None)


def test_quantized_tables_bound_the_error():
    t = torch.randn(3, 40, 16) * torch.rand(3, 1, 1)
    u8, mul, add = fs.quantize_tables(t)
    assert u8.dtype == torch.uint8 and int(u8.max()) <= fs.TABLE_MAX
    low = t.amin(-1, keepdim=True)
    err = (u8.float() * mul[:, None, None] + low - t).abs()
    assert (err <= mul[:, None, None] / 2 + 1e-6).all()
    torch.testing.assert_close(add, low.sum((1, 2)))
    u8, mul, add = fs.quantize_tables(torch.ones(1, 4, 16))  # constant tables: all zero, exact offset
    assert int(u8.max()) == 0 and float(add[0]) == 4.0


@pytest.mark.parametrize("shape", [(5, 50, 16), (1, 3, 16)])
def test_compiled_table_quantization_equals_the_reference(shape):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * torch.rand(shape[0], 1, 1) * 4
    t[-1] = 0.5  # a constant query: step 1, all entries 0
    for got, want in zip(fs.compiled_quantize_tables(t), fs.quantize_tables(t)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,dim", [("tq1", 70), ("tq2", 33), ("tq3", 50), ("tq4", 50), ("tq4", 7),
                                      ("tq2-pca", 48), ("tq3-pca", 50), ("tq1-pca", 30)])
def test_compiled_nibble_tables_equal_the_reference(name, dim):
    g = torch.Generator().manual_seed(dim)
    enc = tq.make_encoder(name, dim)
    if not enc.is_trained:
        enc.train(torch.randn(500, dim, generator=g) * torch.linspace(0.2, 2, dim))
    lut = LookupTables(enc.code_runs(), enc.dim)
    qs = enc.prepare_queries(torch.randn(9, dim, generator=g))
    want = lut.nibble_tables(qs)
    if lut.code_bits == 3:  # then the approximate stage's tables
        want = torch.cat((want, lut.nibble_tables(qs, scan=True)), 1)
    torch.testing.assert_close(fs.compiled_nibble_tables(lut, qs), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m,n", [(300, 1024), (7, 33), (5, 1)])
def test_top_columns_equal_torch_topk(m, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, n, generator=g)
    for k in sorted({1, 2, 16, 64, n} & set(range(1, n + 1))):
        val, col = fs.top_columns(x, k)
        want = torch.topk(x, k, dim=1)
        assert torch.equal(val, want.values) and torch.equal(x.gather(1, col), val)
    ties = torch.randint(0, 3, (40, n), generator=g).float()  # of equal values the earlier column first
    val, col = fs.top_columns(ties, min(7, n))
    for i in range(40):
        assert col[i].tolist() == sorted(range(n), key=lambda j: (-ties[i, j].item(), j))[: min(7, n)]


@pytest.mark.parametrize("m,p,nl", [(1000, 16, 1024), (3, 5, 5), (1, 1, 4)])
def test_group_pairs_equals_a_stable_sort(m, p, nl):
    g = torch.Generator().manual_seed(m)
    lists = torch.rand(m, nl, generator=g).argsort(1)[:, :p]  # distinct lists per query
    start, queries = fs.group_pairs(lists, nl)
    order = torch.argsort(lists.reshape(-1), stable=True)
    assert torch.equal(queries, order // p)
    assert torch.equal(start, F.pad(torch.bincount(lists.reshape(-1), minlength=nl), (1, 0)).cumsum(0))


@pytest.mark.parametrize("dim", [50, 5, 8, 13, 600])
def test_split_layout_approximates_3_bit_scores(dim):
    """The approximate stage's rows and tables of 3-bit codes give sum_i q_i (A[t_i] + (l_i - 1/2) D) for
    codes 2 t_i + l_i: within max|c[2t + l] - A[t] - (l - 1/2) D| * sum_i |q_i| of the exact score, and
    they take 3/4 of the nibbles."""
    g = torch.Generator().manual_seed(dim)
    enc = tq.TurboQuantMSE(dim=dim, bits=3)
    lut = LookupTables(enc.code_runs(), enc.dim)
    assert lut.scan_nbytes == -(-(-(-dim // 2) + -(-dim // 4)) // 2)
    codes = enc.encode(torch.randn(40, dim, generator=g))
    qs = enc.prepare_queries(torch.randn(7, dim, generator=g))
    rows = torch.from_numpy(fs.reference_rows(lut, codes.qdata)).long()  # [n, scan_nbytes]
    nib = torch.stack((rows & 15, rows >> 4), -1).flatten(1)  # [n, 2 scan_nbytes]
    tables = lut.nibble_tables(qs, scan=True)  # [m, 2 scan_nbytes, 16]
    approx = tables.gather(2, nib.T[None].expand(len(qs), -1, -1)).sum(1)  # [m, n]
    c = unpack(codes.qdata, 3, dim).long()
    (_, levels, _), = enc.code_runs()
    pairs = levels.reshape(4, 2)
    a, d = pairs.mean(1), (pairs[:, 1] - pairs[:, 0]).mean()
    torch.testing.assert_close(approx, qs @ (a[c // 2] + (c % 2 - 0.5) * d).T, rtol=1e-5, atol=1e-5)
    bound = (pairs - a[:, None] - torch.tensor([-0.5, 0.5]) * d).abs().max() * qs.abs().sum(1, keepdim=True)
    assert ((approx - qs @ levels[c].T).abs() <= bound + 1e-5).all()


def approximate_stage_inputs(scan: fs.FastScan, codes: tq.Codes, sq: torch.Tensor | None) -> tuple:
    """(rows the approximate stage reads, ||c||² of each row or None) for :func:`fs.reference_scores`."""
    lut = scan.lut
    if sq is None:
        return fs.reference_rows(lut, codes.qdata), None
    exact = pack(unpack(codes.qdata, 3, lut.dim), 4) if lut.code_bits == 3 else codes.qdata  # one code per nibble
    nib = torch.stack((exact & 15, exact >> 4), -1).flatten(1).long()  # [n, 2P]
    return fs.reference_rows(lut, codes.qdata), sq[torch.arange(nib.shape[1]), nib].sum(1).double().numpy()


# 600: > 256 byte positions; 3-bit rows of 19 bytes (50), 2 (5: the last nibble past the row) and 225 (600)
@pytest.mark.parametrize("bits,dim", [(4, 50), (2, 33), (1, 70), (4, 600), (3, 50), (3, 5), (3, 600)])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("simd", [True, False])
def test_candidates_equal_the_numpy_reference(bits, dim, l2, simd):
    n = 300  # not a multiple of the 32-row blocks
    # 600 dims: one block transposed at a time, and 45 queries' tables fill more than 3/4 of a 512 KB L2
    enc, codes, scan, (qtab, mul, add), sq = setup(bits, dim, n, 45 if dim == 600 else 6, l2)
    scale = codes.norm.float()
    val, row = fs.kernel_candidates(scan.lut, codes.qdata, scale, sq, qtab, mul, add, n, simd=simd)
    assert sorted(row[0].tolist()) == list(range(n))  # depth = n: every row, best first
    assert (val[:, 1:] <= val[:, :-1]).all()
    rows, sqnorm = approximate_stage_inputs(scan, codes, sq)
    ref = fs.reference_scores(rows, scale.numpy(), sqnorm, qtab.numpy(), mul.double().numpy(), add.double().numpy())
    got = np.take_along_axis(ref, row.numpy(), 1)
    # one unit of the integer sum moves a score by mul * scale: the tolerance is a fraction of that
    tol = 0.25 * mul.numpy()[:, None] * scale.numpy()[row.numpy()] + 1e-5 * np.abs(ref).max()
    assert (np.abs(val.numpy() - got) <= tol).all()
    # a smaller depth keeps the best approximate scores
    val20, row20 = fs.kernel_candidates(scan.lut, codes.qdata, scale, sq, qtab, mul, add, 20, simd=simd)
    torch.testing.assert_close(val20, val[:, :20])


def test_simd_and_portable_loops_agree():
    if not fs.simd():
        pytest.skip("no AVX2 on this CPU")
    _, codes, scan, (qtab, mul, add), _ = setup(4, 64, 1000, 9, False)
    scale = codes.norm.float()
    a = fs.kernel_candidates(scan.lut, codes.qdata, scale, None, qtab, mul, add, 1000, simd=True)
    b = fs.kernel_candidates(scan.lut, codes.qdata, scale, None, qtab, mul, add, 1000, simd=False)
    va = torch.empty_like(a[0]).scatter_(1, a[1], a[0])  # scores by row
    vb = torch.empty_like(b[0]).scatter_(1, b[1], b[0])
    # the same integer sums; only float rounding (fused or not) differs
    assert ((va - vb).abs() <= 0.1 * mul[:, None] * scale).all()


@pytest.mark.parametrize("adversarial", [False, True])
def test_sampled_threshold_keeps_the_exact_candidates(adversarial):
    """depth 128 over 20,000 rows: the kernel first takes the best score of every 16th block to start at
    a high threshold. When every sampled block holds one of the best rows, that estimate is too high
    and the query is rescanned; either way the candidates are the depth best approximate scores."""
    n, depth, bits, dim = 20_000, 128, 4, 32
    enc, codes, scan, (qtab, mul, add), _ = setup(bits, dim, n, 5, False)
    scale = codes.norm.float()
    ref = fs.reference_scores(codes.qdata.numpy(), scale.numpy(), None, qtab.numpy(), mul.double().numpy(),
                              add.double().numpy())
    qdata = codes.qdata
    if adversarial:  # query 0's best rows, one at the head of each sampled block (0, 16, 32, ...)
        heads = np.arange(0, n, 32 * 16)
        best = np.argsort(-ref[0])[: len(heads)]
        rest = np.setdiff1d(np.arange(n), best)
        perm = np.empty(n, np.int64)
        perm[heads] = best
        perm[np.setdiff1d(np.arange(n), heads)] = rest
        qdata, scale, ref = qdata[perm], scale[perm], ref[:, perm]
    val, row = fs.kernel_candidates(scan.lut, qdata, scale, None, qtab, mul, add, depth)
    want = -np.sort(-ref, axis=1)[:, :depth]
    tol = 0.25 * mul.numpy()[:, None] * scale.numpy().max() + 1e-6
    assert (np.abs(val.numpy() - want) <= tol).all()  # the depth best, in order
    got = np.take_along_axis(ref, row.numpy(), 1)
    assert (np.abs(val.numpy() - got) <= tol).all()


@pytest.mark.parametrize("nq", [1, 3, 37])
@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize("name,dim", [("tq4", 48), ("tq3", 48), ("tq3", 45)])  # 45: a last 3-bit pair alone
@pytest.mark.parametrize("simd", [True, False])
def test_compiled_search_equals_pytorch_search(monkeypatch, nq, metric, name, dim, simd):
    monkeypatch.setattr(fs, "MIN_THREAD_SCORES", 64)  # split rows (few queries) or queries over threads
    portable(monkeypatch, simd)
    g = torch.Generator().manual_seed(nq)
    x, q = torch.randn(5000, dim, generator=g), torch.randn(nq, dim, generator=g)
    index = tq.index_factory(dim, name, metric=metric, backend="native")
    index.add(x)
    D, I = index.search(q, 64)
    index.backend = "torch"
    D0, I0 = index.search(q, 64)
    assert (I == I0).float().mean() > 0.999  # equal up to exact ties
    torch.testing.assert_close(D, D0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("simd", [True, False])
def test_tied_scores_come_out_sorted(monkeypatch, simd):
    """500 distinct vectors, each 8 times: every score is tied; the candidates ranked into an empty
    top-k keep the best scores, best first."""
    portable(monkeypatch, simd)
    g = torch.Generator().manual_seed(5)
    x, q = torch.randn(500, 32, generator=g).repeat(8, 1), torch.randn(20, 32, generator=g)
    index = tq.index_factory(32, "tq4", backend="native")
    index.add(x)
    D, I = index.search(q, 64)
    index.backend = "torch"
    D0, _ = index.search(q, 64)
    torch.testing.assert_close(D, D0, rtol=1e-5, atol=1e-5)
    assert (D[:, 1:] <= D[:, :-1]).all() and len(set(I[0].tolist())) == 64
    scores = index.encoder.decode(index.encoder.encode(x, "native")) @ q.T  # [4000, 20]
    torch.testing.assert_close(D, scores.T.gather(1, I), rtol=1e-5, atol=1e-5)


def test_scan_without_kernel(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)
    index = tq.index_factory(16, "tq4")  # auto: PyTorch
    index.add(torch.randn(100, 16))
    assert index.search(torch.randn(2, 16), 3)[1].shape == (2, 3)
    index.backend = "native"  # asked for explicitly: an error naming it
    with pytest.raises(ValueError, match="native"):
        index.search(torch.randn(2, 16), 3)


def portable(monkeypatch, simd: bool) -> None:
    """Scans through the kernel's portable loops unless ``simd``."""
    if not simd:
        monkeypatch.setattr(fs.NativeScorer, "__init__", partialmethod(fs.NativeScorer.__init__, simd=False))
