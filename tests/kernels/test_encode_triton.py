"""The GPU encoder (Triton; the CPU interpreter without a GPU) against the PyTorch reference."""

import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_triton
from tqindex.directions import encode_directions, encode_directions_reference, search_alphas
from tqindex.kernels import encode_triton
from tqindex.packing import packed_size, unpack

pytestmark = needs_triton


def levels(qdata: torch.Tensor, runs) -> torch.Tensor:
    """The code levels c [N, coded coordinates] of packed rows."""
    parts, byte = [], 0
    for run in runs:
        if run.bits:
            parts.append(run.centroids[unpack(qdata[:, byte : byte + run.nbytes], run.bits, run.width).long()])
            byte += run.nbytes
    return torch.cat(parts, 1)


def check(enc: tq.Encoder, x: torch.Tensor) -> None:
    rotation, runs = enc._rotation(x.device), enc.code_runs(x.device)
    alphas = search_alphas(enc.code_search if getattr(enc, "bits", 2) > 1 else 1, x.device)
    qdata, norm, dot, sq = encode_directions(x, rotation, runs, alphas, "triton")
    ref_q, ref_norm, _, _ = encode_directions_reference(x.cpu(), enc._rotation(torch.device("cpu")), enc.code_runs(),
                                                        alphas.cpu())
    qdata, norm, dot, sq = (t.cpu() for t in (qdata, norm, dot, sq))
    assert qdata.shape == ref_q.shape == (len(x), sum(r.nbytes for r in runs)) and qdata.dtype == torch.uint8
    y = rotation.apply(x).cpu()
    u = y / y.norm(dim=1, keepdim=True).clamp_min(1e-30)
    cols = torch.cat([torch.arange(r.width) + sum(s.width for s in runs[:i]) for i, r in enumerate(runs) if r.bits])
    u = u[:, cols]
    c, ref_c = levels(qdata, enc.code_runs()), levels(ref_q, enc.code_runs())
    cos, ref_cos = (u * c).sum(1) / c.norm(dim=1), (u * ref_c).sum(1) / ref_c.norm(dim=1)
    # the same code except where float rounding decides between pre-scales of (nearly) equal cosine: with
    # 8-bit codes every pre-scale's cosine is 1 to about 1e-6, so the choice is a near tie in many rows
    bits = max(r.bits for r in runs)
    assert (qdata == ref_q).all(1).float().mean() > (0.97 if bits <= 4 else 0.7)
    assert (cos >= ref_cos - 1e-5).all()
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dot, (u * c).sum(1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sq, c.square().sum(1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, dim, n", [
    ("tq4", 64, 129), ("tq4", 50, 127), ("tq2", 130, 1), ("tq1", 60, 40), ("tq3", 50, 129), ("tq3", 45, 33),
    ("tq8", 64, 20), ("tq4", 384, 33), ("tq2", 1536, 9), ("tq4", 2048, 5), ("tq4-norm", 128, 65), ("tq2", 96, 65),
])
def test_codes_equal_the_reference(name, dim, n):
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(dim + n))
    x[0] = 0  # a zero row: zero norm, every code the same
    check(tq.make_encoder(name, dim), x.to(DEVICE))


def test_both_kernels_are_exercised_by_these_tests():
    """One-run codes of at most 4 bits up to dim 128 go to the register kernel; the cases above cover both."""
    from tqindex.kernels.encode_triton import in_registers
    from tqindex.kernels.planes import run_layouts

    def rows_kernel(name, dim):
        return in_registers(run_layouts(tq.make_encoder(name, dim).code_runs())[0], dim)

    assert all(rows_kernel(*c) for c in [("tq4", 64), ("tq4", 50), ("tq1", 60), ("tq3", 45), ("tq4-norm", 128),
                                         ("tq2", 96)])
    assert not any(rows_kernel(*c) for c in [("tq2", 130), ("tq8", 64), ("tq4", 384), ("tq2", 1536)])


@pytest.mark.parametrize("name, dim", [("tq4", 64), ("tq4", 50), ("tq2", 130)])
def test_programs_that_walk_several_row_blocks(name, dim, monkeypatch):
    """The kernels are persistent: a program takes row blocks pid, pid + programs, ... (on GPUs a few programs per
    multiprocessor; the register kernel loads each block's rows while it works on the block before). Two programs
    here, so each takes several blocks, the last one partial."""
    monkeypatch.setattr(encode_triton, "_programs", lambda blocks, device: min(blocks, 2))
    x = torch.randn(161, dim, generator=torch.Generator().manual_seed(dim))
    check(tq.make_encoder(name, dim), x.to(DEVICE))


def test_level_steps_reach_each_level():
    """The register kernel raises a magnitude level by level, ``mag + step``: each sum rounds to the next level
    exactly, or an ulp from it where no float32 step reaches it (a rounding tie), for every tq1-tq4 codebook of
    dims 2-128."""
    from tqindex.kernels.planes import run_layouts

    inexact = total = 0
    for bits in (1, 2, 3, 4):
        for dim in range(2, 129):
            _, mags, _ = run_layouts(tq.make_encoder(f"tq{bits}", dim).code_runs())
            got = mags + encode_triton.level_steps(mags)
            target = torch.cat([mags[1:], mags[-1:]])
            assert ((got == target) | (got == torch.nextafter(target, got))).all(), (bits, dim)
            inexact, total = inexact + int((got != target).sum()), total + len(mags)
    assert inexact < total / 50


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the FMA-pipe comparisons are PTX (CUDA only)")
def test_comparisons_on_either_pipe_give_the_same_codes(monkeypatch):
    """The register kernel compares |u| with the first SAT_STEPS thresholds on the FMA pipe (a saturated fused
    multiply-add), with the others on the ALU pipe: all on either give the reference's codes, and the same codes
    but where summation order decides between pre-scales of nearly equal cosine."""
    for name, dim in (("tq4", 128), ("tq3", 50), ("tq2", 64)):
        enc = tq.make_encoder(name, dim)
        rotation, runs = enc._rotation(DEVICE), enc.code_runs(DEVICE)
        alphas = search_alphas(enc.code_search, DEVICE)
        x = torch.randn(4097, dim, generator=torch.Generator().manual_seed(dim)).to(DEVICE)
        outs = []
        for sat in (0, 7):
            monkeypatch.setattr(encode_triton, "SAT_STEPS", sat)
            outs.append(encode_directions(x, rotation, runs, alphas, "triton"))
            check(enc, x)
        assert (outs[0][0] == outs[1][0]).all(1).float().mean() > 0.995, name
        assert torch.equal(outs[0][1], outs[1][1]), name  # the norms


def test_trained_runs_of_several_widths():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(300, 48, generator=g) * torch.exp(-torch.arange(48) / 8)).to(DEVICE)
    enc = tq.make_encoder("tq2-pca", 48)
    enc.train(x.cpu())
    assert len([r for r in enc.code_runs() if r.bits]) > 1
    check(enc, x[:129])


def test_index_on_the_device_encodes_with_the_kernel():
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(9))
    index = tq.FlatIndex(tq.make_encoder("tq4", 64), device=DEVICE, backend="triton")
    index.add(x.to(DEVICE))
    ref = tq.FlatIndex(tq.make_encoder("tq4", 64), backend="torch")
    ref.add(x)
    D, I = index.search(x[:5].to(DEVICE), 5)
    D0, I0 = ref.search(x[:5], 5)
    assert (I.cpu() == I0).float().mean() > 0.95 and (I.cpu()[:, 0] == torch.arange(5)).all()
    assert index.memory_bytes() == 200 * (packed_size(64, 4) + 2) + index._fixed_bytes()


@pytest.mark.parametrize("dim", [64, 50])
def test_rows_of_any_scale_encode_exactly_without_a_host_rescue(dim, monkeypatch):
    """The kernel scales each row by a power of two itself: codes of 2^e x equal the codes of x and norms
    scale exactly for norms from 1e-32 to 1e37, with no rescue pass (which would wait for the device)."""
    import tqindex.directions as directions

    enc = tq.make_encoder("tq4", dim)
    rotation, runs = enc._rotation(DEVICE), enc.code_runs(DEVICE)
    alphas = search_alphas(enc.code_search, DEVICE)
    x = torch.randn(40, dim, generator=torch.Generator().manual_seed(dim)).to(DEVICE)
    q0, n0, d0, s0 = encode_directions(x, rotation, runs, alphas, "triton")
    monkeypatch.setattr(directions.torch, "nonzero", None)  # the rescue's first step: must not run
    for e in (-110, -100, -60, 0, 60, 120):  # every coordinate stays a normal float
        xs = torch.ldexp(x, torch.tensor(e, device=DEVICE))
        q, n, d, s = encode_directions(xs, rotation, runs, alphas, "triton")
        assert torch.equal(q, q0) and torch.equal(d, d0) and torch.equal(s, s0), e
        torch.testing.assert_close(n.double(), torch.ldexp(n0.double(), torch.tensor(e, device=DEVICE)),
                                   rtol=1e-6, atol=0)


def test_rows_of_any_scale_with_the_rotation_applied_by_torch():
    """Large dims: torch rotates the rows first, so the rows it overflows are encoded again, scaled."""
    enc = tq.make_encoder("tq4", 2048)
    rotation, runs = enc._rotation(DEVICE), enc.code_runs(DEVICE)
    assert rotation.matmul_matrix is None
    alphas = search_alphas(enc.code_search, DEVICE)
    x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    q0, n0, _, _ = encode_directions(x, rotation, runs, alphas, "triton")
    for e in (-100, 120):
        q, n, _, _ = encode_directions(torch.ldexp(x, torch.tensor(e, device=DEVICE)), rotation, runs, alphas,
                                       "triton")
        assert torch.equal(q, q0), e
        torch.testing.assert_close(n.double(), torch.ldexp(n0.double(), torch.tensor(e, device=DEVICE)),
                                   rtol=1e-6, atol=0)


@pytest.mark.parametrize("n, dim", [(1, 130), (129, 384), (33, 1536)])
def test_split_rotation_has_float32_accuracy(n, dim):
    """Large dense rotations are applied by three float16 products (split_rotate): about as close to the exact product
    as a float32 matrix product on the same device, for rows of any scale inside the encoder's safe norms."""
    from tqindex.checks import NORM_SAFE
    from tqindex.kernels.encode_triton import split_rotate

    rotation = tq.make_encoder("tq4", dim)._rotation(DEVICE)
    assert rotation.kind == "dense"
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    x[0, : dim // 2] *= 1e-6  # rows of very different coordinates
    if n > 2:
        x[1] *= NORM_SAFE[1] / x[1].norm() / 2
        x[2] *= NORM_SAFE[0] / x[2].norm() * 2
    exact = x.double() @ rotation.matmul_matrix.double().T

    def error(y):
        return float(((y.double() - exact).norm(dim=1) / exact.norm(dim=1)).max())

    # float32 sums over up to 1536 terms (with the rotation unscaled, its low float16 piece was subnormal: 2.0e-6).
    # The float16 tensor-core products sum less exactly than a float32 product, more so with more terms: 1.9e-6 at
    # 1536 dims on an H200, where cuBLAS's float32 product reads 2.3e-7
    bound = max(3 * error(x @ rotation.matmul_matrix.T), 1e-6, dim / 16 * 2.0**-24)
    assert error(split_rotate(x, rotation)) < bound
