"""Where the GPU-kernel tests run: compiled on CUDA, else in Triton's CPU interpreter (``tests/conftest.py``
chooses it before triton is imported). Not a conftest: ``tests/conftest.py`` is imported by name elsewhere."""

import pytest
import torch

from tqindex import kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not kernels.can_run("triton", DEVICE), reason="triton cannot run here")
needs_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA C++ kernels need a CUDA device")
