"""Codes decoded to dense vectors in the encoder's rotated domain on GPUs (Triton): the blocks a prefill over a
compressed past hands to flash attention (:func:`tqindex.kv.attention.decoded_attention`).

One launch: a program takes one (batch row, head) and BLOCK_N tokens, decodes their codes with the attention
kernel's value decoder (``attention_triton._value_rows``: direction codes of one coded run, or FP4-UE8M0
codes), multiplies each token by its scale (the norm, or FP4's largest group scale) and writes the rows in
the requested dtype. The PyTorch reference is ``encoder.decode_rotated``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codes import Codes
from .attention_triton import _tables, _token_scales, _value_rows
from .planes import cdiv, next_power_of_2
from .scan_triton import default_decode

BLOCK_N = 64
"""Tokens per program."""


@triton.jit(do_not_specialize=("n",))  # no recompiles as blocks of new lengths come
def _decode_kernel(C, S, OUT, n, c_stride, s_stride, cbytes, MAG, T0, T1, T2, T3, R: tl.constexpr,
                   FP4: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                   DECODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (batch row x head ``bh``, token block): the rows of tokens ``tok`` of codes C [bh, tokens,
    cbytes] (c_stride bytes per bh) with side data S (norms [bh, tokens] or FP4 group exponents [bh, tokens,
    G]; s_stride per bh) -> OUT [bh, n, D] in OUT's dtype."""
    bh = tl.program_id(0).to(tl.int64)
    tok = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = tok < n
    scale, smax = _token_scales(S + bh * s_stride, tok, tmask, G, GP, FP4)
    v = _value_rows(C + bh * c_stride, cbytes, tok, tmask, MAG, R, DECODE, T0, T1, T2, T3, S + bh * s_stride, smax,
                    G, GP, FP4, DP, BLOCK_N)
    rows = v.to(tl.float32) * scale[:, None]
    d = tl.arange(0, DP)
    at = (bh * n + tok.to(tl.int64))[:, None] * D + d[None, :]
    tl.store(OUT + at, rows.to(OUT.dtype.element_ty), mask=tmask[:, None] & (d[None, :] < D))


def decode_rotated_triton(encoder: Any, codes: Codes, dtype: torch.dtype) -> Tensor:
    """``encoder.decode_rotated(codes)`` by the kernel of the module notes: codes [B, H, n] of an encoder the
    attention kernel reads (``planes.attention_reads``), batch-major planes (a token slice of a cache's
    buffers is fine) -> [B, H, n, dim] in ``dtype`` on the codes' device."""
    b, h, n = codes.shape
    qdata = codes.qdata
    device = qdata.device
    layout, mag, tables, _ = encoder.derived(device, "triton-attention-values",
                                             lambda: _tables(encoder, device, "values"))
    fp4 = codes.norm is None
    side = codes.scale if fp4 else codes.norm
    groups = side.shape[-1] if fp4 else 1
    if qdata.stride(-1) != 1 or qdata.stride(2) != qdata.shape[-1] or qdata.stride(0) != h * qdata.stride(1):
        qdata = qdata.contiguous()
    if side.stride(2) != groups or side.stride(0) != h * side.stride(1) or (fp4 and side.stride(3) != 1):
        side = side.contiguous()
    dim = encoder.dim
    out = torch.empty(b, h, n, dim, device=device, dtype=dtype)
    if n:
        _decode_kernel[(b * h, cdiv(n, BLOCK_N))](
            qdata, side, out, n, qdata.stride(1), side.stride(1), qdata.shape[-1], mag, *tables, R=layout, FP4=fp4,
            G=groups, GP=next_power_of_2(groups), D=dim, DP=next_power_of_2(dim), DECODE=default_decode(device),
            BLOCK_N=BLOCK_N, num_warps=4)
    return out
