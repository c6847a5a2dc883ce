"""Builds the optional compiled CPU kernels; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tqindex._native",
            ["tqindex/csrc/module.c", "tqindex/csrc/fastscan.c", "tqindex/csrc/quantize.c",
             "tqindex/csrc/packing.c"],
            extra_compile_args=["-O3"],
            optional=True,  # without a C compiler the PyTorch code paths are used
        )
    ]
)
