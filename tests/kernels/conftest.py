"""GPU kernels run compiled on CUDA and, without a GPU, in Triton's CPU interpreter (set before any
kernel module is imported: the interpreter is chosen when a kernel is defined)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tqindex import kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not kernels.can_run("triton", DEVICE), reason="triton cannot run here")
