"""Every compiled path of tqindex, and the one place that decides which runs.

Backends:

- ``"torch"``: the PyTorch references (any device); every kernel is tested against them.
- ``"native"``: the C kernels in ``csrc/`` (CPU, float32), built by ``pip install`` where a C compiler
  is present and loaded through ctypes (:mod:`.native`).
- ``"triton"``: Triton kernels (CUDA tensors; with ``TRITON_INTERPRET=1`` also CPU tensors, slowly, for
  tests and machines without a GPU).
- ``"cuda"``: CUDA C++ kernels built at first use by ``torch.utils.cpp_extension`` (nvcc; today the decode
  attention over 4-bit, 8-bit and FP4 codes, :mod:`.attention_cuda`); operations without one run their Triton kernel.
- ``"auto"``: for CUDA tensors the CUDA C++ kernel where there is one and it builds, else Triton; native for
  CPU tensors; torch otherwise or where the faster backend has no kernel for the operation.

:func:`select` makes the choice: an explicit ``backend=`` argument (encoders, indexes, caches), else the
``TQINDEX_BACKEND`` environment variable, else ``"auto"``. An explicit backend that cannot run the
operation raises; only ``"auto"`` falls back.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

from . import attention_cuda, native

BACKENDS = ("auto", "torch", "native", "triton", "cuda")
ENV_VAR = "TQINDEX_BACKEND"


@cache
def triton_importable() -> bool:
    """True when the ``triton`` package imports."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_backend(backend: str | None, name: str = "backend") -> str | None:
    """``backend`` if it is None or one of BACKENDS; ValueError naming ``name`` otherwise."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS} (or None: ${ENV_VAR}, else 'auto'), got {backend!r}")
    return backend


def requested(backend: str | None = None) -> str:
    """The backend asked for: ``backend``, else ``$TQINDEX_BACKEND``, else "auto"."""
    if backend is not None:
        return check_backend(backend)
    env = os.environ.get(ENV_VAR, "").strip() or "auto"
    return check_backend(env, f"${ENV_VAR}")


@cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the Triton interpreter's programs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def can_run(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` can run kernels on tensors of ``device`` here."""
    if backend == "torch":
        return True
    if backend == "native":
        return device.type == "cpu" and native.available()
    if backend == "triton":
        return triton_importable() and (device.type == "cuda" or (device.type == "cpu" and triton_interpreted()))
    if backend == "cuda":
        return device.type == "cuda" and triton_importable() and attention_cuda.available()
    return False


def select(tensor: torch.Tensor, backend: str | None = None, kernels: tuple[str, ...] = ("native", "triton"),
           what: str = "this operation") -> str:
    """The backend that runs ``what`` on ``tensor``: "torch", "native", "triton" or "cuda".

    ``backend`` (or ``$TQINDEX_BACKEND``) as in the module notes; ``kernels``: the compiled backends
    that implement ``what`` (torch always does). "cuda" asked of an operation without a CUDA C++ kernel
    asks for its Triton one. An explicit backend that is not among them, or cannot run on the tensor's
    device here, raises ValueError; "auto" picks the CUDA C++ kernel, else Triton, for CUDA tensors and
    native for CPU tensors where available, else torch.
    """
    asked = requested(backend)
    device = tensor.device
    if asked == "cuda" and "cuda" not in kernels:
        asked = "triton"
    if asked == "auto":
        if device.type == "cuda" and "cuda" in kernels and can_run("cuda", device):
            return "cuda"
        if device.type == "cuda" and "triton" in kernels and can_run("triton", device):
            return "triton"
        if device.type == "cpu" and "native" in kernels and can_run("native", device):
            return "native"
        return "torch"
    if asked != "torch" and asked not in kernels:
        raise ValueError(f"backend {asked!r} has no kernel for {what}; it runs on {('torch',) + kernels}")
    if not can_run(asked, device):
        why = {"native": "the compiled CPU kernels are not built or the tensors are not on the CPU",
               "triton": "triton is not installed, or the tensors are on the CPU without TRITON_INTERPRET=1",
               "cuda": "the tensors are not on a CUDA device, or triton, nvcc or the kernel's build is missing"}
        raise ValueError(f"backend {asked!r} cannot run {what} on {device} tensors here: {why[asked]}")
    return asked
