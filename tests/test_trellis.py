import itertools
import math

import pytest
import torch

import tqindex as tq
from tqindex.codebooks import lloyd_max
from tqindex.kernels import native
from tqindex.packing import packed_size, unpack
from tqindex.trellis import (STATE_BITS, search_directions, state_symbols, tail_biting, tail_history,
                             trellis_levels, trellis_states, viterbi_reference)

from conftest import unit_vectors

needs_native = pytest.mark.skipif(not native.available(), reason="compiled CPU kernels not built")
RATE_DISTORTION = {b: 4.0**-b for b in (1, 2, 3, 4)}
"""The Gaussian source's distortion-rate bound per coordinate, D(R) = 2^(-2R): no code of b bits beats it."""


def _path_error(t, levels, symbols, bits):
    return (t - levels[trellis_states(symbols, bits)]).square().sum(-1)


def test_states_read_the_last_symbols_circularly():
    bits, d = 2, 6
    symbols = torch.tensor([[1, 2, 3, 0, 1, 2]])
    m = state_symbols(bits)
    want = [sum(int(symbols[0, (i - j) % d]) << (bits * j) for j in range(m)) for i in range(d)]
    assert trellis_states(symbols, bits)[0].tolist() == want


@pytest.mark.parametrize("bits,d", [(1, 8), (2, 5), (3, 3), (4, 3)])
def test_viterbi_is_the_least_squares_string_with_that_history(bits, d):
    # Brute force over every string of d symbols whose last symbols are the history: the search's string is one
    # of least error (the tail-biting search is that search for the history it chose).
    levels = trellis_levels(bits)
    g = torch.Generator().manual_seed(bits)
    t = torch.randn(3, d, generator=g)
    strings = torch.tensor(list(itertools.product(range(1 << bits), repeat=d)))
    errors = _path_error(t[:, None], levels, strings, bits)  # [3, strings]
    histories = tail_history(strings, bits)
    for h in range(1 << (STATE_BITS[bits] - bits)):
        if not (histories == h).any():
            continue
        got = viterbi_reference(t, levels, bits, torch.full((3,), h))
        assert (tail_history(got, bits) == h).all()
        best = torch.where(histories == h, errors, math.inf).min(1).values
        assert torch.allclose(_path_error(t, levels, got, bits), best, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("n,d", [(1, 8), (127, 9), (129, 50), (33, 64), (5, 130), (2, 1536)])
def test_native_search_equals_reference(bits, n, d):
    from tqindex.kernels.trellis_native import tail_biting_native

    t = torch.randn(n, d, generator=torch.Generator().manual_seed(n + d))
    levels = trellis_levels(bits)
    assert torch.equal(tail_biting_native(t, levels, bits), tail_biting(t, levels, bits))


def test_levels_are_deterministic_and_trained():
    # The table is trained from a seed (same values every time) and fits Gaussian coordinates: about zero mean,
    # unit spread, and the trained table beats the Gaussian quantiles it starts from.
    for bits in (1, 2, 3, 4):
        levels = trellis_levels(bits)
        assert levels.shape == (1 << STATE_BITS[bits],)
        trellis_levels.cache_clear()
        assert torch.equal(trellis_levels(bits), levels)
        assert abs(levels.mean().item()) < 0.05 and 0.8 < levels.std().item() < 1.1


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_distortion_between_the_bound_and_scalar_codes(bits):
    # Unit vectors in d = 128: the trellis codes' squared error lies above the distortion-rate bound and below
    # the scalar Lloyd-Max codes of the same bits (the paper's Q_mse) and below tq{b} with its direction search.
    dim = 128
    u = unit_vectors(2000, dim, seed=bits)
    trellis = tq.make_encoder(f"tcq{bits}", dim, norm_dtype="float32")
    mse = ((trellis.decode(trellis.encode(u)) - u) ** 2).sum(1).mean().item()
    scalar = tq.make_encoder(f"tq{bits}", dim, norm_dtype="float32")
    mse_scalar = ((scalar.decode(scalar.encode(u)) - u) ** 2).sum(1).mean().item()
    # measured: 0.86, 0.69, 0.60, 0.62 of Lloyd-Max and 0.78, 0.68, 0.64, 0.72 of tq{b} for 1, 2, 3, 4 bits
    assert RATE_DISTORTION[bits] < mse < {1: 0.9, 2: 0.73, 3: 0.65, 4: 0.66}[bits] * lloyd_max(dim, bits).distortion
    assert mse < {1: 0.82, 2: 0.72, 3: 0.68, 4: 0.76}[bits] * mse_scalar


def test_layout_and_decoding():
    enc = tq.make_encoder("tcq3", 50, norm_dtype="float32")
    x = torch.randn(7, 50)
    codes = enc.encode(x)
    assert codes.qdata.shape == (7, packed_size(50, 3)) and codes.qdata.dtype == torch.uint8
    assert enc.code_size == packed_size(50, 3) + 4 and enc.code_size == tq.make_encoder("tq3", 50,
                                                                                          norm_dtype="float32").code_size
    symbols = unpack(codes.qdata, 3, 50)
    levels = trellis_levels(3)[trellis_states(symbols, 3)] / math.sqrt(50)
    assert torch.allclose(enc.decode_rotated(codes), levels * codes.norm[:, None], atol=1e-6)


@pytest.mark.parametrize("rescale", ["norm", "unbiased", "cos"])
def test_rescale_modes(rescale):
    enc = tq.make_encoder("tcq2", 64, rescale=rescale, norm_dtype="float32")
    x = torch.randn(300, 64) * 3
    xh = enc.decode(enc.encode(x))
    n = x.norm(dim=1)
    if rescale == "unbiased":  # the reconstruction's projection on x is x's norm
        assert torch.allclose((xh * x).sum(1) / n, n, rtol=1e-4)
    elif rescale == "cos":  # the reconstruction keeps the norm
        assert torch.allclose(xh.norm(dim=1), n, rtol=1e-4)
    else:
        assert torch.allclose(enc.decode(enc.encode(x)).norm(dim=1) / n, xh.norm(dim=1) / n)


def test_search_keeps_the_closest_direction():
    u = unit_vectors(500, 64, seed=3)
    levels = trellis_levels(2)
    one = search_directions(u, levels, 2, torch.ones(1), "torch")
    many = search_directions(u, levels, 2, torch.tensor([1.0, 0.9, 1.1]), "torch")
    cos = lambda r: r[1] * r[2].rsqrt()  # noqa: E731
    assert (cos(many) >= cos(one) - 1e-6).all() and cos(many).mean() > cos(one).mean()


def test_zero_and_tiny_vectors():
    enc = tq.make_encoder("tcq4", 16, norm_dtype="float32")
    x = torch.zeros(3, 16)
    x[1] = 1e-30
    x[2, 0] = 1e20
    xh = enc.decode(enc.encode(x))
    assert torch.equal(xh[0], torch.zeros(16))
    assert torch.allclose(xh[1:].norm(dim=1), x[1:].norm(dim=1), rtol=1e-3)


@pytest.mark.parametrize("bad,match", [({"bits": 8}, "bits"), ({"dim": 3, "bits": 1}, "dim must be at least 8"),
                                       ({"rescale": "x"}, "rescale"), ({"code_search": 0}, "code_search")])
def test_bad_configuration(bad, match):
    with pytest.raises(ValueError, match=match):
        tq.TrellisMSE(**{"dim": 16, **bad})


def test_backends_agree_and_round_trip():
    enc = tq.make_encoder("tcq2-unbiased", 60)
    x = torch.randn(40, 60)
    torch_codes = enc.encode(x, backend="torch")
    if native.available():
        assert torch.equal(enc.encode(x, backend="native").qdata, torch_codes.qdata)
    again = tq.encoder_from_dict(enc.to_dict(), enc.tensors())
    assert torch.equal(again.decode(torch_codes), enc.decode(torch_codes))


def test_flat_index_search_and_file(tmp_path):
    x = unit_vectors(3000, 64, seed=7)
    q = unit_vectors(20, 64, seed=8)
    index = tq.index_factory(64, "tcq4")
    index.add(x)
    _, ids = index.search(q, 10)
    exact = (q @ x.T).topk(10).indices
    recall = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, exact)) / exact.numel()
    assert recall > 0.8
    path = tmp_path / "tcq.tqi"
    index.save(path)
    _, again = tq.load_index(path).search(q, 10)
    assert torch.equal(torch.as_tensor(again), torch.as_tensor(ids))
