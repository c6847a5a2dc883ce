"""The trellis search on GPUs (Triton; the CPU interpreter without a GPU) against its PyTorch reference,
and trellis codes encoded through it."""

import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_triton
from tqindex.trellis import tail_biting, tail_history, trellis_levels, viterbi_reference

pytestmark = needs_triton


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("n,d", [(1, 8), (17, 50), (5, 64), (3, 130)])
def test_search_matches_the_reference(bits, n, d):
    from tqindex.kernels.trellis_triton import viterbi_triton

    t = torch.randn(n, d, generator=torch.Generator().manual_seed(n + d + bits))
    levels = trellis_levels(bits)
    free = viterbi_reference(t, levels, bits)
    assert torch.equal(viterbi_triton(t.to(DEVICE), levels.to(DEVICE), bits).cpu(), free)
    history = tail_history(free, bits)
    got = viterbi_triton(t.to(DEVICE), levels.to(DEVICE), bits, history.to(DEVICE)).cpu()
    assert torch.equal(got, viterbi_reference(t, levels, bits, history))
    got = tail_biting(t.to(DEVICE), levels.to(DEVICE), bits, viterbi_triton).cpu()
    assert torch.equal(got, tail_biting(t, levels, bits))


def test_encoder_codes_match_the_reference():
    enc = tq.make_encoder("tcq2-unbiased", 60, code_search=2)
    x = torch.randn(9, 60, generator=torch.Generator().manual_seed(3))
    want = enc.encode(x, backend="torch")
    got = enc.encode(x.to(DEVICE), backend="triton")
    assert torch.equal(got.qdata.cpu(), want.qdata) and torch.allclose(got.norm.cpu().float(), want.norm.float())
