"""Builds the optional compiled CPU kernels; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tqindex.kernels._native",
            ["tqindex/kernels/csrc/module.c", "tqindex/kernels/csrc/fastscan.c", "tqindex/kernels/csrc/quantize.c",
             "tqindex/kernels/csrc/packing.c", "tqindex/kernels/csrc/trellis.c"],
            extra_compile_args=["-O3"],
            optional=True,  # without a C compiler the PyTorch code paths are used
        )
    ]
)
