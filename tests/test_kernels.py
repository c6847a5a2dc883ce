"""The backend decision (kernels.select) and the compiled kernels' presence."""

import os

import pytest
import torch

from tqindex import kernels
from tqindex.kernels import native

CPU = torch.zeros(1)


def test_ci_builds_the_compiled_kernels():
    """Without them every compiled=... path would silently run PyTorch: under CI their absence fails."""
    if os.environ.get("CI"):
        assert native.available(), "the compiled CPU kernels did not build (is a C compiler installed?)"
    elif not native.available():
        pytest.skip("compiled kernels not built")


def test_auto_picks_native_on_cpu_and_torch_without_a_kernel(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.select(CPU, None, ("native",)) == ("native" if native.available() else "torch")
    assert kernels.select(CPU, None, ()) == "torch"
    assert kernels.select(CPU, "torch", ("native",)) == "torch"


def test_explicit_then_environment_then_auto(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert kernels.select(CPU, None, ("native",)) == "torch"  # the environment
    if native.available():
        assert kernels.select(CPU, "native", ("native",)) == "native"  # the argument wins
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="TQINDEX_BACKEND"):
        kernels.select(CPU, None)


def test_an_explicit_backend_that_cannot_run_raises(monkeypatch):
    with pytest.raises(ValueError, match="no kernel"):
        kernels.select(CPU, "native", (), "FP4 encoding")
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.select(CPU, "gpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="cannot run"):
        kernels.select(CPU, "triton", ("triton",))  # CPU tensors need the interpreter
    with pytest.raises(ValueError, match="backend 'cuda' cannot run"):
        kernels.select(CPU, "cuda", ("triton", "cuda"))
    with pytest.raises(ValueError, match="backend 'triton' cannot run"):
        kernels.select(CPU, "cuda", ("triton",))  # no CUDA C++ kernel: its Triton one
    monkeypatch.setattr(native, "available", lambda: False)
    with pytest.raises(ValueError, match="cannot run"):
        kernels.select(CPU, "native", ("native",))
    assert kernels.select(CPU, "auto", ("native",)) == "torch"  # only auto falls back
