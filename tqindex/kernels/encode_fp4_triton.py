"""GPU encoding of FP4-UE8M0 codes (:class:`tqindex.fp4.FP4UE8M0`), in Triton: one pass over the rotated rows.

A program holds a block of rows as [rows, groups, group_size] and computes each group's absolute maximum, its
UE8M0 exponent ``E = rounding(log2(scale_constant · absmax))`` from the bits of that product in float64 (exact:
no logarithm), the E2M1 code of every element of ``y / 2^E`` (its magnitude index by comparisons with the
midpoints, ties to the even code, its sign from y's sign bit), and stores the codes nibble-packed (element 2j in
the low nibble of byte j) with the scale bytes ``E + 127``. The rotation is applied by torch first. The
reference is the encoder's PyTorch path (``codebooks.e2m1_encode``, ``ue8m0_exponent``, ``packing.pack``).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_triton import _pow2
from .planes import cdiv, next_power_of_2

ROUNDINGS = {"round": 0, "ceil": 1, "floor": 2}
BLOCK_ELEMENTS = 4096
"""Row elements per program."""
SQRT_HALF_MANTISSA = tl.constexpr(0x6A09E667F3BCD)
"""The 52 mantissa bits of sqrt(2) in float64: 1.m >= sqrt(2) rounds log2 up."""


@triton.jit
def _encode_fp4_kernel(Y, n, dim, OUT, SCALE, nbytes, C, G: tl.constexpr, GP: tl.constexpr,
                       GS: tl.constexpr, ROUNDING: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows blk * BLOCK_N ... of the rotated rows Y float32 [n, dim] -> nibble-packed E2M1 codes OUT uint8
    [n, nbytes] and UE8M0 scale bytes SCALE uint8 [n, G] (module notes); C: the scale constant, float64 [1]."""
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = r < n
    col = tl.arange(0, GP)[None, :, None] * GS + tl.arange(0, GS)[None, None, :]  # [1, GP, GS]
    ok = rmask[:, None, None] & (col < dim)
    y = tl.load(Y + r[:, None, None].to(tl.int64) * dim + col, mask=ok, other=0.0)  # [BLOCK_N, GP, GS]
    amax = tl.max(tl.abs(y), axis=2)  # [BLOCK_N, GP]
    v = amax.to(tl.float64) * tl.load(C)  # as the reference: float64
    bits = v.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF).to(tl.int32) - 1023  # v = 1.m 2^e (normal: amax >= 2^-149)
    mant = bits & 0xFFFFFFFFFFFFF
    if ROUNDING == 0:
        e = e + (mant >= SQRT_HALF_MANTISSA).to(tl.int32)
    elif ROUNDING == 1:
        e = e + (mant != 0).to(tl.int32)
    e = tl.where(amax > 0, tl.minimum(tl.maximum(e, -127), 127), -127)
    half = -e // 2  # y / 2^E as two exact power-of-two products, each factor normal
    u = tl.abs(y) * _pow2(half)[:, :, None] * _pow2(-e - half)[:, :, None]
    idx = ((u > 0.25).to(tl.int32) + (u >= 0.75).to(tl.int32) + (u > 1.25).to(tl.int32) + (u >= 1.75).to(tl.int32)
           + (u > 2.5).to(tl.int32) + (u >= 3.5).to(tl.int32) + (u > 5.0).to(tl.int32))  # ties to the even code
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    code = tl.where(ok, idx | (sign << 3), 0)
    lo, hi = tl.split(tl.reshape(code, (BLOCK_N, GP * GS // 2, 2)))
    byte = tl.arange(0, GP * GS // 2)[None, :]
    tl.store(OUT + r[:, None].to(tl.int64) * nbytes + byte, (lo | (hi << 4)).to(tl.uint8),
             mask=rmask[:, None] & (byte < nbytes))
    g = tl.arange(0, GP)[None, :]
    tl.store(SCALE + r[:, None].to(tl.int64) * G + g, (e + 127).to(tl.uint8), mask=rmask[:, None] & (g < G))


@lru_cache(maxsize=16)
def _constant(value: float, device: torch.device) -> Tensor:
    """``value`` as a float64 tensor [1] on ``device`` (cached: no host copy while CUDA graphs are recorded)."""
    return torch.tensor([value], dtype=torch.float64, device=device)


def encode_fp4_triton(y: Tensor, group_size: int, scale_constant: float, rounding: str) -> tuple[Tensor, Tensor]:
    """FP4-UE8M0 codes of rotated rows y float32 [n, dim] in groups of ``group_size`` (a power of two) ->
    (nibble-packed E2M1 codes uint8 [n, ceil(dim / 2)], UE8M0 scale bytes uint8 [n, ceil(dim / group_size)])."""
    y = y.float().contiguous()
    n, dim = y.shape
    groups, nbytes = cdiv(dim, group_size), cdiv(dim, 2)
    qdata = torch.empty(n, nbytes, dtype=torch.uint8, device=y.device)
    scale = torch.empty(n, groups, dtype=torch.uint8, device=y.device)
    if n:
        gp = next_power_of_2(groups)
        block = max(1, min(next_power_of_2(n), BLOCK_ELEMENTS // (gp * group_size)))
        c = _constant(float(scale_constant), y.device)
        _encode_fp4_kernel[(cdiv(n, block),)](y, n, dim, qdata, scale, nbytes, c, G=groups, GP=gp, GS=group_size,
                                              ROUNDING=ROUNDINGS[rounding], BLOCK_N=block)
    return qdata, scale
