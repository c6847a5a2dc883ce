import subprocess
import sys

import pytest
import torch

from tqindex.rotation import DENSE_HADAMARD_MAX_DIM, Rotation, fwht, hadamard_matrix


@pytest.mark.parametrize("dim,kind", [(64, "hadamard"), (128, "auto"), (2048, "hadamard"), (50, "auto"), (130, "dense")])
def test_rotation_is_orthogonal(dim, kind):
    r = Rotation.create(dim, seed=3, kind=kind)
    m = r.dense().double()
    assert torch.allclose(m @ m.T, torch.eye(dim, dtype=torch.float64), atol=1e-5)
    x = torch.randn(5, 7, dim)
    assert torch.allclose(r.inverse(r.apply(x)), x, atol=1e-5)
    assert torch.allclose(r.apply(x), x @ m.float().T, atol=1e-4)


def test_auto_kind():
    assert Rotation.create(128).kind == "hadamard"
    assert Rotation.create(50).kind == "dense"


@pytest.mark.parametrize("dim", [1, 2, 8, 64, 256])
def test_fwht_equals_dense_hadamard(dim):
    x = torch.randn(3, 4, dim, dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ hadamard_matrix(dim).double(), atol=1e-10)


def test_large_hadamard_uses_fwht_and_matches_dense():
    dim = 2 * DENSE_HADAMARD_MAX_DIM
    r = Rotation.create(dim, seed=1)
    x = torch.randn(3, dim, dtype=torch.float64)
    ref = (x * r.signs.double()) @ hadamard_matrix(dim).double() / dim**0.5
    assert torch.allclose(r.apply(x), ref, atol=1e-9)


def test_seeded_and_deterministic_across_processes():
    a = Rotation.create(50, seed=7).matrix
    assert torch.equal(a, Rotation.create(50, seed=7).matrix)
    assert not torch.equal(a, Rotation.create(50, seed=8).matrix)
    code = "from tqindex.rotation import Rotation; print(Rotation.create(50, seed=7).matrix.double().sum().item())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert float(out) == a.double().sum().item()


def test_bad_kind_and_non_power_of_two():
    with pytest.raises(ValueError, match="rotation"):
        Rotation.create(64, kind="fourier")
    with pytest.raises(ValueError, match="power-of-two"):
        Rotation.create(50, kind="hadamard")
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.randn(3, 6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 16, 64, 65])
def test_few_cuda_rows_rotate_as_many(rows):
    """Up to FEW_ROWS query rows on CUDA (computed as (R @ x.T).T) rotate as x @ R.T does, contiguous."""
    rot = Rotation.create(128, seed=3, kind="dense")
    x = torch.randn(rows, 128, device="cuda")
    y = rot.to("cuda").apply(x)
    assert y.is_contiguous()
    torch.testing.assert_close(y, x @ rot.dense().cuda().T, rtol=1e-5, atol=1e-5)
