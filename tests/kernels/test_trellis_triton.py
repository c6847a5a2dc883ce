"""The tail-biting trellis search on GPUs (Triton; the CPU interpreter without a GPU) against its PyTorch reference,
and trellis codes encoded through it."""

import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_triton
from tqindex.trellis import tail_biting_reference, trellis_levels

pytestmark = needs_triton


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("n,d", [(1, 8), (17, 50), (5, 64), (3, 130)])
def test_search_matches_the_reference(bits, n, d):
    from tqindex.kernels.trellis_triton import tail_biting_triton

    t = torch.randn(n, d, generator=torch.Generator().manual_seed(n + d + bits))
    levels = trellis_levels(bits)
    got = tail_biting_triton(t.to(DEVICE), levels.to(DEVICE), bits).cpu()
    assert torch.equal(got, tail_biting_reference(t, levels, bits))


def test_encoder_codes_match_the_reference():
    enc = tq.make_encoder("tcq2-unbiased", 60, code_search=2)
    x = torch.randn(9, 60, generator=torch.Generator().manual_seed(3))
    want = enc.encode(x, backend="torch")
    got = enc.encode(x.to(DEVICE), backend="triton")
    assert torch.equal(got.qdata.cpu(), want.qdata) and torch.allclose(got.norm.cpu().float(), want.norm.float())
