import os

# Busy-waiting OpenMP threads make torch many times slower on a loaded 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before triton is
# imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Statistical tests use fixed seeds; keep CPU threads modest on small CI machines.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def unit_vectors(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """n random unit vectors [n, dim] float32 (uniform on the sphere)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return x / x.norm(dim=1, keepdim=True)


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
