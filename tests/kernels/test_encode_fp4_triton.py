"""The Triton FP4-UE8M0 encoder against the PyTorch encoding, exactly."""

import pytest
import torch

import tqindex as tq
from devices import DEVICE, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("n, dim, group, rounding", [(1, 32, 32, "ceil"), (127, 50, 32, "round"),
                                                     (129, 128, 32, "floor"), (65, 96, 16, "ceil"),
                                                     (3, 17, 8, "round")])
def test_fp4_encode_equals_the_reference(n, dim, group, rounding):
    """Codes and scale bytes equal the PyTorch path's: odd dims (a partial group, an odd last byte), ties at the
    E2M1 midpoints, exact powers of two as group maxima, zero groups and -0.0, tiny and huge rows."""
    enc = tq.FP4UE8M0(dim=dim, group_size=group, scale_rounding=rounding, rotation="none")
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(n, dim, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())
    x[0, :group] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * group)[:group] * 0.5  # ties, max 3.0
    x[0, 3] = -x[0, 3]
    if n > 2:
        x[1] = 0.0
        x[1, -1] = -0.0
        x[2] *= 2.0**-60
    x = x.to(DEVICE)
    ref = enc.encode(x, backend="torch")
    out = enc.encode(x, backend="triton")
    assert torch.equal(out.qdata, ref.qdata) and torch.equal(out.scale, ref.scale)
    assert torch.equal(enc.decode(out), enc.decode(ref))


def edge_maxima() -> torch.Tensor:
    """float32 group maxima at, just above and just below powers of two and sqrt(2) times them."""
    pts = torch.tensor([2.0**-3, 1.0, 2.0**10, 2.0**0.5, 2.0**-4.5])
    up = torch.nextafter(pts, torch.tensor(float("inf")))
    down = torch.nextafter(pts, torch.tensor(0.0))
    return torch.cat([pts, up, down])


@pytest.mark.parametrize("rounding", ["ceil", "floor", "round"])
def test_group_exponents_are_exact(rounding):
    """With scale_constant 1 the exponent is rounding(log2(absmax)) exactly, also where a float64 logarithm
    would round to an integer; the Triton encoder gives the same scale bytes."""
    from tqindex.codebooks import ue8m0_exponent

    a = edge_maxima()
    exact = {"ceil": lambda m, e: e - (m == 0.5).int(), "floor": lambda m, e: e - 1,
             "round": lambda m, e: e - 1 + (2 * m >= 2**0.5).int()}[rounding](*torch.frexp(a.double()))
    assert torch.equal(ue8m0_exponent(a, 1.0, rounding), exact.int())
    assert ue8m0_exponent(torch.tensor([0.0]), 1.0, rounding).item() == -127
    enc = tq.FP4UE8M0(dim=32, scale_constant=1.0, scale_rounding=rounding, rotation="none")
    x = torch.zeros(len(a), 32)
    x[:, 5] = -a
    x[:, 9] = a / 3
    ref = enc.encode(x.to(DEVICE), backend="torch")
    out = enc.encode(x.to(DEVICE), backend="triton")
    assert torch.equal(out.scale, ref.scale) and torch.equal(out.qdata, ref.qdata)
    assert torch.equal(ref.scale.cpu()[:, 0].int(), exact.int() + 127)
