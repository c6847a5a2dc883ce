"""Decode attention over 4-bit direction codes by a CUDA C++ kernel (``csrc/attention_decode.cu``, whose notes
describe it), built at first use by ``torch.utils.cpp_extension`` (nvcc; cached by torch between processes).

It computes the compressed splits of :func:`tqindex.kernels.attention_triton.compressed_attention_triton`'s
split-K decode step and writes their partial softmaxes where the Triton kernel would; the query rotation, the
window's splits and the merge stay Triton. It reads keys and values that are both one 4-bit run of direction
codes over every coordinate with float16 norms (``tq4`` and its variants) at head dims 64, 128 and 256, with no
mask and no soft cap. The PyTorch reference is :func:`tqindex.kv.attention.compressed_attention_ref`.
"""

from __future__ import annotations

import math
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

DIMS = (64, 128, 256)
"""Head dims the kernel is built for."""
MAX_ROWS = 16
"""Query rows per KV head (query heads x positions) up to which a step runs the kernel: it takes blocks of 8 rows,
each reading all codes, where the Triton kernel's blocks of 64 read them fewer times."""
SOURCE = Path(__file__).parent / "csrc" / "attention_decode.cu"
_DECLARATION = """
void tq4_decode_launch(int64_t qp, int64_t qsc, int64_t kc, int64_t kn, int64_t vc, int64_t vn, int64_t out,
                       int64_t m_out, int64_t l_out, int64_t lengths, int64_t bh, int64_t rows, int64_t tc,
                       int64_t splits_c, int64_t nsplit, int64_t tokens_per_split, int64_t kc_stride,
                       int64_t vc_stride, int64_t kn_stride, int64_t vn_stride, int64_t pw, int64_t gp,
                       double scale_log2, const std::vector<int64_t>& ktab, const std::vector<int64_t>& vtab,
                       int64_t dim, int64_t stream);
"""


@cache
def _module() -> Any:
    """The compiled extension (built on the first call of the process; torch reuses a build of the same source)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline("tqindex_attention_decode", cpp_sources=_DECLARATION, cuda_sources=SOURCE.read_text(),
                       functions=["tq4_decode_launch"], extra_cuda_cflags=["-O3", "-std=c++17"])


@cache
def available() -> bool:
    """Whether the kernel runs here: a CUDA device, a CUDA build of torch, nvcc, and a successful build (a failed
    build warns once; callers under "auto" then take the Triton kernel)."""
    from torch.utils.cpp_extension import CUDA_HOME

    if not torch.cuda.is_available() or torch.version.cuda is None or CUDA_HOME is None:
        return False
    try:
        _module()
    except Exception as e:  # a compiler or toolkit problem: the Triton kernel still runs
        warnings.warn(f"the CUDA attention kernel could not be built ({e}); attention runs the Triton kernel",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def reads(key_encoder: Any, value_encoder: Any) -> bool:
    """Whether the kernel reads these encoders' codes: both one 4-bit run of direction codes covering every
    coordinate (two codes per byte, coordinate 2i in the low nibble of byte i) with float16 norms, dims in DIMS."""
    return key_encoder.dim == value_encoder.dim and all(
        enc.derived("cpu", "cuda-attention-reads", lambda e=enc: _reads(e)) for enc in (key_encoder, value_encoder))


def _reads(enc: Any) -> bool:
    """Whether the kernel reads ``enc``'s codes (:func:`reads`; computed once per encoder)."""
    if getattr(enc, "norm_dtype", None) != "float16" or not hasattr(enc, "code_runs") or not enc.is_trained:
        return False
    runs = enc.code_runs()
    return enc.dim in DIMS and len(runs) == 1 and runs[0].bits == 4 and runs[0].width == enc.dim


def compressed_splits(qp: Tensor, qsc: Tensor, keys: Any, values: Any, out: Tensor, m: Tensor, l_: Tensor,
                      lengths: Tensor | None, rows: int, splits_c: int, tokens_per_split: int, scaling: float,
                      key_layout: tuple, key_table: list[int], value_table: list[int]) -> None:
    """Write the partial softmaxes of the compressed splits 0 .. splits_c - 1 of a split-K decode step.

    qp f16 [B Hkv rows, planes x padded groups]: the planar, scaled queries, qsc float32 [B Hkv rows] their
    scales (the Triton query kernel's output); keys / values CompressedTokens [B, Hkv, T, D] (codes read in
    place, batch-major); out float32 [B Hkv, splits, rows, D], m / l_ float32 [B Hkv, splits, rows]: the
    partials (splits >= splits_c are the window's, left to the Triton kernel); ``lengths``: None, or int64 [2]
    on the device (the valid codes are then read there); ``tokens_per_split`` a multiple of 64; ``key_layout``
    the keys' RunLayout tuple; the tables: the prmt words of the keys' and values' magnitudes. The launch goes to
    the current device (the caller makes it qp's)."""
    kq, vq, kn, vn = keys.codes.qdata, values.codes.qdata, keys.codes.norm, values.codes.norm
    bh, dim = qsc.shape[0] // rows, keys.encoder.dim
    _module().tq4_decode_launch(
        qp.data_ptr(), qsc.data_ptr(), kq.data_ptr(), kn.data_ptr(), vq.data_ptr(), vn.data_ptr(), out.data_ptr(),
        m.data_ptr(), l_.data_ptr(), 0 if lengths is None else lengths.data_ptr(), bh, rows, kq.shape[2], splits_c,
        out.shape[1], tokens_per_split, kq.stride(1), vq.stride(1), kn.stride(1), vn.stride(1), qp.shape[1],
        key_layout[4], scaling * math.log2(math.e), key_table, value_table, dim,
        torch.cuda.current_stream(qp.device).cuda_stream)
