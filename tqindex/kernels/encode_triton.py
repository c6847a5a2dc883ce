"""GPU encoding of direction codes (TurboQuantMSE, TurboQuantPCA), in Triton.

Two kernels, each one pass over the input; both return what
:func:`tqindex.directions.encode_directions_reference` returns: packed codes, ``||y||``, ``<u, c>`` and
``||c||²`` of the chosen code.

:func:`_encode_rows_kernel` (one coded run covering every coordinate, at most 4 bits, dims up to
ROWS_MAX_DIM: TurboQuantMSE's usual codes) holds a block of rows in registers in natural coordinate order:
``y = x Rᵀ`` at about fp32 accuracy (each row split into two float16 pieces; a Hadamard rotation: each piece times
the signs multiplied by the ±1 matrix exactly in one MMA; a dense one: three float16 MMAs of the pieces with the
two float16 pieces of Rᵀ, as :func:`split_rotate`), ``u = |y| / ||x||``, then
for every pre-scale alpha the level of each coordinate, the lowest magnitude raised by one step (:func:`level_steps`)
per positive boundary divided by alpha that ``|u|`` exceeds (0.0 or 1.0 times the step, added: no selects), and the
cosine ``<u, c> / ||c||`` of the row; the best alpha's codes (``2^(b-1) + m`` for positive coordinates,
``2^(b-1) - 1 - m`` for the others) are summed by shifts into one word per group of ``planes``
consecutive coordinates and stored byte by byte.

:func:`_encode_kernel` (any runs, any dim) takes blocks of BLOCK_N rows and, for each plane of each run
(``planes.py``), computes that plane of the rotated rows as one MMA with the rotation's matching rows into
its own scratch rows (in L2), so no register slicing is needed and each MMA runs once. Two passes over
the planes follow:

1. the direction search: for every pre-scale alpha, the magnitude index of each coordinate of
   ``|u| = |y| / ||x||`` is the number of the codebook's positive boundaries below ``alpha |u|``,
   and ``<u, c>`` and ``||c||²`` are summed per row; the best alpha maximizes ``<u, c> / ||c||`` (the
   first on ties);
2. the codes for that alpha, packed: the planes of a group are shifted into one byte (three bytes for
   3-bit codes) and stored.

Large-dim Hadamard rotations are applied first by torch's butterflies (``ROTATE=False`` then reads the
rotated rows directly).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..directions import rescue_unsafe_rows
from ..rotation import hadamard_matrix
from . import multiprocessors
from .planes import RunLayout, cdiv, next_power_of_2, plane_coordinates, plane_width, run_layouts, to_planes
from .scan_triton import _magnitude

BLOCK_N = 32
"""Rows per program."""
BLOCK_K = 32
"""Input coordinates per MMA step of the rotation (tf32x3 operands of 64 spill registers at d = 128)."""
MAX_ALPHAS = 8
PROGRAMS_PER_SM = 4
NUM_WARPS = 8
ROWS_MAX_DIM = 128
"""Dims (padded to a power of two) up to which one-run codes are encoded with rows held in registers (at 256
the rotation operand no longer fits in shared memory)."""
ROWS_TILES = {(2, 128): (16, 2), (1, 128): (32, 4)}
"""Rows per block and warps of the register kernel by rotation (ROTATE: 2 Hadamard, 1 dense) and padded dim, measured
with 7 pre-scales. Hadamard, 10M x 128 tq4: on an H200 16 rows and 2 warps 16.1 ms, 16 / 4 and 32 / 4 17.5-17.7,
32 / 8 19.2, 64 / 8 19.0 (before the FMA-pipe comparisons); on an H100 16 / 2 11.9 ms, 16 / 4 15.6, 32 / 4 13.3.
Dense, on an H100: 2M x 100 tq3 16 / 2 3.92 ms, 16 / 4 3.69, 32 / 4 3.21; 4M x 96 tq2 5.98, 5.50, 3.64 (with the
rotation in three tf32 products before, 11.00 and 16.64 ms at 16 / 2). Others: ROWS_ELEMENTS / dim rows (at least
16) and 4 warps."""
ROWS_ELEMENTS = 4096
SAT_STEPS = 3
"""Thresholds of the register kernel's level search compared on the FMA pipe (``_above``), the others on the ALU
pipe, so both pipes work. On an H100 with 0, 1, 2, 3, 7 of them: 10M x 128 tq4 12.30, 11.58, 11.84, 11.68,
11.91 ms, 4M x 64 tq4 2.29, 2.24, 2.16, 2.06, 2.10, 2M x 100 tq3 11.12, 10.91, 10.83, 10.68, 10.82 (the same run:
with a select per threshold on the ALU pipe, the kernel before, 15.63, 2.79, 11.39)."""


@triton.jit
def _row_scales(amax):
    """Powers of two (scale, 1 / scale) per row that bring its largest coordinate ``amax`` near 1 (exact),
    so no sum of squares under- or overflows; the codes are those of the rows as given, the norm is scaled
    back."""
    e = tl.minimum(tl.maximum(127 - ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF), -126), 126)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), ((127 - e) << 23).to(tl.float32, bitcast=True)


_SATURATED = tl.constexpr(-(2.0**126))


@triton.jit
def _above(u, t, SAT: tl.constexpr):
    """1.0 where u > t, else 0.0 (float32 u in [0, 2], threshold t > 0). A comparison to float runs on the ALU pipe,
    at half the rate of the FMA pipe; SAT (CUDA only) computes it there: ``fma.rn.sat(u, 2^126, -t 2^126)``, exact
    for t >= 2^-90 (direction codebooks' positive boundaries are far above), as ``t 2^126`` is exact or -inf and the
    fused ``(u - t) 2^126`` is at most 0 unless u > t, then at least ``ulp(t) 2^126 > 1``, saturated to 1."""
    if SAT:
        return tl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, 0f7E800000, $2;", "=f,f,f",
                                         [u, tl.zeros_like(u) + t * _SATURATED], tl.float32, True, 1)
    else:
        return (u > t).to(tl.float32)


@triton.jit
def _pieces(x):
    """float32 x (magnitudes below 2^16) as two float16 pieces hi + lo, 22 bits of its mantissa."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _row_block(P, rows, col, n, d):
    """Rows ``rows`` [BLOCK_N] of P [n, d] at columns ``col`` [DP], zeros outside: [BLOCK_N, DP] float32."""
    return tl.load(P + rows[:, None].to(tl.int64) * d + col[None, :], mask=(rows < n)[:, None] & (col[None, :] < d),
                   other=0.0)


@triton.jit
def _rotate_run(Y, X, RP, rows, rmask, scale, d, pw, R: tl.constexpr, DK: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Write the planes of one run of the rotated rows, scaled per row, ``(scale X) @ RP[:, cols]``, to the
    program's scratch rows of Y [BLOCK_N, pw] (float32)."""
    P: tl.constexpr = R[2]
    GP: tl.constexpr = R[4]
    STEP: tl.constexpr = R[5]
    for p in range(P):  # runtime loops: large dims would unroll into a very long compile
        for g0 in range(0, GP, STEP):
            cols = R[7] + p * GP + g0 + tl.arange(0, STEP)
            y = tl.zeros((BLOCK_N, STEP), tl.float32)
            for k0 in range(0, DK, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(X + rows[:, None].to(tl.int64) * d + k[None, :],
                             mask=rmask[:, None] & (k[None, :] < d), other=0.0) * scale[:, None]
                rk = tl.load(RP + k[:, None] * pw + cols[None, :], mask=k[:, None] < d, other=0.0)
                y = tl.dot(xk, rk, y, input_precision=PRECISION)
            tl.store(Y + tl.arange(0, BLOCK_N)[:, None] * pw + cols[None, :], y)


@triton.jit
def _search_run(dots, sqs, Y, ystride, yrows, rmask, inv, MAG, BND, ALPHAS, R: tl.constexpr, A: tl.constexpr,
                AP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add one run's <u, c> and ||c||² of every pre-scale to dots / sqs [BLOCK_N, AP]; the run's planes are
    read from Y (rows ``yrows``, row stride ``ystride``)."""
    H: tl.constexpr = 1 << (R[0] - 1)
    P: tl.constexpr = R[2]
    GP: tl.constexpr = R[4]
    STEP: tl.constexpr = R[5]
    acol = tl.arange(0, AP)[None, :]
    for p in range(P):
        for g0 in range(0, GP, STEP):
            g = g0 + tl.arange(0, STEP)
            valid = rmask[:, None] & ((g * P + p) < R[10])[None, :]
            y = tl.load(Y + yrows[:, None] * ystride + R[7] + p * GP + g[None, :], mask=valid, other=0.0)
            u = tl.abs(y) * inv[:, None]
            for a in range(A):  # not unrolled: one pre-scale's temporaries at a time
                alpha = tl.load(ALPHAS + a)
                m = tl.zeros((BLOCK_N, STEP), tl.int32)
                for j in range(H - 1):
                    m += (u * alpha > tl.load(BND + R[9] + j)).to(tl.int32)
                mag = _magnitude(m, MAG + R[9], H)
                dot = tl.sum(tl.where(valid, u * mag, 0.0), axis=1)
                sq = tl.sum(tl.where(valid, mag * mag, 0.0), axis=1)
                dots = tl.where(acol == a, dots + dot[:, None], dots)
                sqs = tl.where(acol == a, sqs + sq[:, None], sqs)
    return dots, sqs


@triton.jit
def _emit_run(dot, sq, Y, ystride, yrows, rows, rmask, inv, alpha, MAG, BND, OUT, row_bytes, R: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Codes of one run at the chosen pre-scales (alpha [BLOCK_N]), packed and stored; their <u, c> and
    ||c||² added to dot / sq [BLOCK_N]."""
    BITS: tl.constexpr = R[0]
    GB: tl.constexpr = R[1]
    H: tl.constexpr = 1 << (BITS - 1)
    P: tl.constexpr = R[2]
    GP: tl.constexpr = R[4]
    STEP: tl.constexpr = R[5]
    for g0 in range(0, GP, STEP):
        g = g0 + tl.arange(0, STEP)
        word = tl.zeros((BLOCK_N, STEP), tl.int32)
        for p in range(P):
            valid = rmask[:, None] & ((g * P + p) < R[10])[None, :]
            v = tl.load(Y + yrows[:, None] * ystride + R[7] + p * GP + g[None, :], mask=valid, other=0.0) * inv[:, None]
            u = tl.abs(v)
            m = tl.zeros((BLOCK_N, STEP), tl.int32)
            for j in range(H - 1):
                m += (u * alpha[:, None] > tl.load(BND + R[9] + j)).to(tl.int32)
            mag = _magnitude(m, MAG + R[9], H)
            dot += tl.sum(tl.where(valid, u * mag, 0.0), axis=1)
            sq += tl.sum(tl.where(valid, mag * mag, 0.0), axis=1)
            code = tl.where(v > 0, H + m, H - 1 - m)
            word = word | tl.where(valid, code << (p * BITS), 0)
        base = OUT + rows[:, None].to(tl.int64) * row_bytes + R[6] + g[None, :] * GB
        for b in tl.static_range(GB):  # the bytes of each group
            ok = rmask[:, None] & ((g * GB + b) < R[8])[None, :]
            tl.store(base + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=ok)
    return dot, sq


@triton.jit
def _encode_kernel(X, XN, RP, SCRATCH, n, d, pw, MAG, BND, ALPHAS, OUT, row_bytes, NORM, DOT, SQ,
                   R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, A: tl.constexpr, AP: tl.constexpr,
                   ROTATE: tl.constexpr, DK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Persistent program over row blocks pid, pid + programs, ... of X [n, d] (ROTATE: planes computed
    into the program's SCRATCH rows [BLOCK_N, pw]) or of the rotated planar rows X [n, pw]; XN [n, d]: the
    rows as given, whose norm ||x|| = ||y|| is taken."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for blk in range(pid, tl.cdiv(n, BLOCK_N), programs):
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n
        amax = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in range(0, DK, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(XN + rows[:, None].to(tl.int64) * d + k[None, :], mask=rmask[:, None] & (k[None, :] < d),
                         other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xk), axis=1))
        scale, unscale = _row_scales(amax)
        ss = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in range(0, DK, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(XN + rows[:, None].to(tl.int64) * d + k[None, :], mask=rmask[:, None] & (k[None, :] < d),
                         other=0.0) * scale[:, None]
            ss += tl.sum(xk * xk, axis=1)
        norm = tl.sqrt(ss)
        inv = 1.0 / tl.where(norm > 0, norm, 1.0)
        if ROTATE:
            Y = SCRATCH + pid * BLOCK_N * pw
            yrows = tl.arange(0, BLOCK_N).to(tl.int64)
            tl.debug_barrier()  # the previous block's reads of the scratch rows are done
            _rotate_run(Y, X, RP, rows, rmask, scale, d, pw, R0, DK, BLOCK_N, BLOCK_K, PRECISION)
            if R1[3] > 0:
                _rotate_run(Y, X, RP, rows, rmask, scale, d, pw, R1, DK, BLOCK_N, BLOCK_K, PRECISION)
            if R2[3] > 0:
                _rotate_run(Y, X, RP, rows, rmask, scale, d, pw, R2, DK, BLOCK_N, BLOCK_K, PRECISION)
            tl.debug_barrier()  # the planes are written
        else:  # the rotated rows as given: their directions are |y| scale / ||scale x||
            Y = X
            yrows = rows.to(tl.int64)
            inv = inv * scale
        dots = tl.zeros((BLOCK_N, AP), tl.float32)
        sqs = tl.zeros((BLOCK_N, AP), tl.float32)
        dots, sqs = _search_run(dots, sqs, Y, pw, yrows, rmask, inv, MAG, BND, ALPHAS, R0, A, AP, BLOCK_N)
        if R1[3] > 0:
            dots, sqs = _search_run(dots, sqs, Y, pw, yrows, rmask, inv, MAG, BND, ALPHAS, R1, A, AP, BLOCK_N)
        if R2[3] > 0:
            dots, sqs = _search_run(dots, sqs, Y, pw, yrows, rmask, inv, MAG, BND, ALPHAS, R2, A, AP, BLOCK_N)
        acol = tl.arange(0, AP)[None, :]
        cos = tl.where(acol < A, dots / tl.sqrt(tl.maximum(sqs, 1e-30)), float("-inf"))
        best = tl.argmax(cos, axis=1)  # the first of equal maxima
        alpha = tl.load(ALPHAS + best)
        dot = tl.zeros((BLOCK_N,), tl.float32)
        sq = tl.zeros((BLOCK_N,), tl.float32)
        dot, sq = _emit_run(dot, sq, Y, pw, yrows, rows, rmask, inv, alpha, MAG, BND, OUT, row_bytes, R0, BLOCK_N)
        if R1[3] > 0:
            dot, sq = _emit_run(dot, sq, Y, pw, yrows, rows, rmask, inv, alpha, MAG, BND, OUT, row_bytes, R1,
                                BLOCK_N)
        if R2[3] > 0:
            dot, sq = _emit_run(dot, sq, Y, pw, yrows, rows, rmask, inv, alpha, MAG, BND, OUT, row_bytes, R2,
                                BLOCK_N)
        tl.store(NORM + rows, norm * unscale, mask=rmask)
        tl.store(DOT + rows, dot, mask=rmask)
        tl.store(SQ + rows, sq, mask=rmask)


@triton.jit
def _encode_rows_kernel(X, XN, RT, RT2, THR, MAG, STEPS, ALPHAS, OUT, NORM, DOT, SQ, n, d, row_bytes, post,
                        R: tl.constexpr, A: tl.constexpr, ROTATE: tl.constexpr, DP: tl.constexpr,
                        BLOCK_N: tl.constexpr, AHEAD: tl.constexpr, SAT: tl.constexpr):
    """Persistent program over row blocks of one coded run covering every coordinate, in natural order,
    each block held in registers: X [n, d] (ROTATE 0: the rotated rows; otherwise rotated here, each row (scaled by
    a power of two, its largest coordinate into [1, 2)) split into two float16 pieces hi + lo, 22 bits of mantissa:
    1, a dense rotation, ``y = (hi RT + hi RT2 + lo RT) post`` with RT + RT2 the float16 pieces of the rotation's
    transpose times 1 / post, [DP, DP] zero padded (:func:`_natural_rotation`), products summed in float32 on
    tensor cores; 2, a Hadamard rotation, ``y = (x * RT2) H post`` with RT the ±1 matrix H [DP, DP], RT2 the signs
    and post 1 / sqrt(d): the pieces' products with ±1 are exact), XN [n, d] the rows as given (norms); with AHEAD
    (Hadamard rotations, where it was measured) each block's rows XN are loaded while the program works on the block
    before. The operands RT (RT2) are loaded once per program. THR [A, H]: the positive boundaries divided by each
    pre-scale (the direction search compares |u| with them, the first SAT of them on the FMA pipe, :func:`_above`;
    a runtime loop over the pre-scales keeps one pre-scale's temporaries live, not A), STEPS: :func:`level_steps` of
    the magnitudes MAG; the codes of a group (``planes`` consecutive coordinates) are summed into one word by
    shifts."""
    BITS: tl.constexpr = R[0]
    GB: tl.constexpr = R[1]
    P: tl.constexpr = R[2]
    NBYTES: tl.constexpr = R[8]
    W: tl.constexpr = R[10]
    H: tl.constexpr = 1 << (BITS - 1)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    col = tl.arange(0, DP)
    valid_col = col < W
    shift = (tl.arange(0, P) * BITS)[None, None, :]
    g = tl.arange(0, DP // P)
    if ROTATE == 1:
        rt = tl.load(RT + col[:, None] * DP + col[None, :])
        rt2 = tl.load(RT2 + col[:, None] * DP + col[None, :])
    elif ROTATE == 2:
        rt = tl.load(RT + col[:, None] * DP + col[None, :])
        signs = tl.load(RT2 + col)
    if AHEAD:
        xn_next = _row_block(XN, pid * BLOCK_N + tl.arange(0, BLOCK_N), col, n, d)
    for blk in range(pid, tl.cdiv(n, BLOCK_N), programs):
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n
        if AHEAD:  # this block's rows were loaded one step ahead: the loads overlap the previous block's work
            xn = xn_next
            xn_next = _row_block(XN, rows + programs * BLOCK_N, col, n, d)
        else:
            xn = _row_block(XN, rows, col, n, d)
        scale, unscale = _row_scales(tl.max(tl.abs(xn), axis=1))
        xs = xn * scale[:, None]
        norm = tl.sqrt(tl.sum(xs * xs, axis=1))
        inv = 1.0 / tl.where(norm > 0, norm, 1.0)
        if ROTATE == 1:
            hi, lo = _pieces(xs)
            y = tl.dot(hi, rt, tl.dot(lo, rt, tl.dot(hi, rt2))) * post  # the small terms first
        elif ROTATE == 2:
            hi, lo = _pieces(xs * signs[None, :])
            y = tl.dot(lo, rt, tl.dot(hi, rt)) * post
        else:
            y = _row_block(X, rows, col, n, d) * scale[:, None]
        u = tl.abs(y) * inv[:, None]
        best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        best_a = tl.zeros((BLOCK_N,), tl.int32)
        best_dot = tl.zeros((BLOCK_N,), tl.float32)
        best_sq = tl.zeros((BLOCK_N,), tl.float32)
        for a in range(A):
            mag = tl.zeros((BLOCK_N, DP), tl.float32) + tl.load(MAG)
            for j in tl.static_range(H - 1):  # thresholds ascend: each one |u| exceeds raises it a level
                mag = _above(u, tl.load(THR + a * H + j), j < SAT) * tl.load(STEPS + j) + mag
            if W < DP:
                mag = tl.where(valid_col[None, :], mag, 0.0)
            dot = tl.sum(u * mag, axis=1)
            sq = tl.sum(mag * mag, axis=1)
            cos = dot / tl.sqrt(tl.maximum(sq, 1e-30))
            better = cos > best  # the first pre-scale of equal cosines
            best = tl.where(better, cos, best)
            best_a = tl.where(better, a, best_a)
            best_dot = tl.where(better, dot, best_dot)
            best_sq = tl.where(better, sq, best_sq)
        levels = tl.zeros((BLOCK_N, DP), tl.float32)
        for j in tl.static_range(H - 1):
            levels += _above(u, tl.load(THR + best_a * H + j)[:, None], j < SAT)
        m = levels.to(tl.int32)
        code = tl.where(valid_col[None, :], tl.where(y > 0, H + m, H - 1 - m), 0)
        word = tl.sum(tl.reshape(code, (BLOCK_N, DP // P, P)) << shift, axis=2)  # [BLOCK_N, groups]
        base = OUT + rows[:, None].to(tl.int64) * row_bytes + g[None, :] * GB
        for b in tl.static_range(GB):  # the bytes of each group
            ok = rmask[:, None] & ((g * GB + b) < NBYTES)[None, :]
            tl.store(base + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=ok)
        tl.store(NORM + rows, norm * unscale, mask=rmask)
        tl.store(DOT + rows, best_dot, mask=rmask)
        tl.store(SQ + rows, best_sq, mask=rmask)


@lru_cache(maxsize=32)
def _planar_rotation(rotation: Any, layouts: tuple[RunLayout, ...]) -> Tensor:
    """The rotation's rows in planar order as MMA operand: float32 [dim, plane_width] (zero columns where
    padded), cached per rotation object."""
    coords = plane_coordinates(layouts, rotation.dim).to(rotation.matmul_matrix.device)
    r = torch.nn.functional.pad(rotation.matmul_matrix.float(), (0, 0, 0, 1))  # a zero row for padding
    return r[coords].T.contiguous()


@lru_cache(maxsize=32)
def _natural_rotation(rotation: Any, dp: int) -> tuple[int, Tensor, Tensor, float]:
    """The register kernel's rotation operands (ROTATE, RT, RT2, post), cached per rotation object: for a Hadamard
    rotation (2, the ±1 matrix float16 [dp, dp], the signs float32 [dp], 1 / sqrt(dim)), else (1, the float16 pieces
    of the rotation's transpose times 2^s [dp, dp] zero padded (:func:`_split_transpose`), 2^-s)."""
    m = rotation.matmul_matrix
    if rotation.kind == "hadamard":
        signs = rotation.signs.to(m.device).float().contiguous()
        return 2, hadamard_matrix(dp).to(m.device).half(), signs, rotation.dim**-0.5
    hi, lo, s = _split_transpose(rotation)
    pad = (0, dp - rotation.dim, 0, dp - rotation.dim)
    return 1, torch.nn.functional.pad(hi, pad), torch.nn.functional.pad(lo, pad), 2.0**-s


class RunTables(NamedTuple):
    """What the encode kernels read of the coded runs, on one device (:func:`_run_tables`)."""

    layouts: list[RunLayout]
    mags: Tensor  # the runs' magnitudes float32 [total], run r's at its mag_offset
    steps: Tensor  # float32 [total]: mags[i] + steps[i] rounds to mags[i + 1] (level_steps)
    bounds: Tensor  # positive boundaries float32 [total]
    alphas: Tensor  # pre-scales float32 [A]
    thresholds: Tensor  # the boundaries divided by each pre-scale, float32 [A, total]


@lru_cache(maxsize=32)
def _run_tables(runs: tuple[Any, ...], alphas: Tensor) -> RunTables:
    """The runs' tables on the device of ``alphas``, cached per codebook and pre-scale tensors (the encoder's
    cached device copies)."""
    layouts, mags, bounds = run_layouts(runs)
    device, alphas = alphas.device, alphas.float().contiguous()
    bounds = bounds.to(device)
    return RunTables(layouts, mags.to(device), level_steps(mags).to(device), bounds, alphas,
                     (bounds[None, :] / alphas[:, None]).contiguous())


def level_steps(mags: Tensor) -> Tensor:
    """float32 steps s of ascending float32 magnitudes [n] (any device; s[n - 1] = 0) such that ``mags[i] + s[i]``
    rounds to ``mags[i + 1]``: exactly, or where a rounding tie leaves no float32 step that reaches it (50 of the
    3,683 magnitudes of tq1-tq4 at dims 2-128), to a neighbour an ulp away. The register kernel raises a magnitude
    level by level by these steps."""
    target = torch.cat([mags[1:], mags[-1:]])
    s = target - mags
    got = mags + s  # a rounded difference can miss by an ulp: one nudge toward the target
    up, down = torch.nextafter(s, target + 1), torch.nextafter(s, -target - 1)
    return torch.where(got < target, up, torch.where(got > target, down, s))


@lru_cache(maxsize=32)
def _split_transpose(rotation: Any) -> tuple[Tensor, Tensor, int]:
    """The rotation's transpose times 2^s (its largest magnitude into [0.5, 1), so the low piece stays clear of float16's
    subnormals) as two float16 pieces whose sum is it to 22 bits, and s; cached per rotation object."""
    rt = rotation.matmul_matrix.float().T
    s = -int(torch.frexp(rt.abs().amax())[1])
    return *_halves((rt * 2.0**s).contiguous()), s


def _halves(t: Tensor) -> tuple[Tensor, Tensor]:
    """float32 t (magnitudes below 1) as two float16 pieces whose sum is t to 22 bits."""
    hi = t.half()
    return hi, (t - hi.float()).half()


def _mm32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of float16 matrices, summed and returned in float32 (cuBLAS's float16 tensor cores on CUDA)."""
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()


def split_rotate(x: Tensor, rotation: Any) -> Tensor:
    """``rotation.apply(x)`` for rows x float32 [N, d] of a matmul rotation, to about float32 accuracy by three
    float16 products: each row and the rotation scaled by a power of two (the largest magnitude into [0.5, 1)), both
    split into two float16 pieces (22 bits of each), the products of the pieces but the two small ones summed in
    float32, the scales undone. The tensor cores sum less exactly than a float32 product: a relative error of
    1.9e-6 at d = 1536 on an H200, against 2.3e-7. There, 1M x 1536: 56 ms against 94 for float32 ``x @ R.T`` and
    the encoder's own tf32x3 planes (about 135 ms of its 178: one pre-scale 160 ms, without rotation 24).
    Exact enough for rows of norms in ``checks.NORM_SAFE`` (the encoder encodes the others again, scaled)."""
    e = torch.frexp(x.abs().amax(1, keepdim=True))[1].clamp(-126, 126)
    hi, lo = _halves(torch.ldexp(x, -e))
    r_hi, r_lo, s = _split_transpose(rotation)
    y = _mm32(hi, r_hi)
    y += _mm32(hi, r_lo)
    y += _mm32(lo, r_hi)
    return torch.ldexp(y, e - s)


def in_registers(layouts: Sequence[RunLayout], dim: int) -> bool:
    """Whether :func:`_encode_rows_kernel` encodes these codes: one coded run of at most 4 bits covering all
    ``dim`` coordinates, dims up to ROWS_MAX_DIM."""
    first = layouts[0]
    return first.width == dim and first.bits <= 4 and layouts[1].groups == 0 and next_power_of_2(dim) <= ROWS_MAX_DIM


def encode_directions_triton(x: Tensor, rotation: Any, runs: Sequence[Any], alphas: Tensor
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`tqindex.directions.encode_directions` by the GPU kernels (module notes): x float32 [N, d]
    -> (qdata uint8 [N, bytes], ||y|| [N], <u, c> [N], ||c||² [N])."""
    if len(alphas) > MAX_ALPHAS:
        raise ValueError(f"the GPU encoder tries at most {MAX_ALPHAS} pre-scales, got {len(alphas)}")
    tables = _run_tables(tuple(runs), alphas.to(x.device))
    layouts, mags, bounds, alphas = tables.layouts, tables.mags, tables.bounds, tables.alphas
    device, (n, d) = x.device, x.shape
    x = x.float().contiguous()
    rotate = rotation.matmul_matrix is not None
    row_bytes = sum(r.nbytes for r in runs)
    qdata = torch.empty(n, row_bytes, dtype=torch.uint8, device=device)
    norm, dot, sq = (torch.empty(n, device=device) for _ in range(3))
    in_kernel = rotate
    if n and in_registers(layouts, d):
        dp = next_power_of_2(d)
        kind, rt, rt2, post = _natural_rotation(rotation, dp) if rotate else (0, x, x, 1.0)
        block, warps = ROWS_TILES.get((kind, dp), (max(16, ROWS_ELEMENTS // dp), 4))
        src = x if rotate else rotation.apply(x).contiguous()
        _encode_rows_kernel[(_programs(cdiv(n, block), device),)](
            src, x, rt, rt2, tables.thresholds, mags, tables.steps, alphas, qdata, norm, dot, sq, n, d, row_bytes, post,
            R=tuple(layouts[0]), A=len(alphas), ROTATE=kind, DP=dp, BLOCK_N=block, AHEAD=kind == 2,
            SAT=SAT_STEPS if device.type == "cuda" else 0, num_warps=warps)
    elif n:
        pw = plane_width(layouts)
        programs = _programs(cdiv(n, BLOCK_N), device)
        in_kernel = rotate and d <= ROWS_MAX_DIM
        if in_kernel:
            src, rp = x, _planar_rotation(rotation, tuple(layouts))
            scratch = torch.empty(programs, BLOCK_N, pw, device=device)
        else:  # identity, a large Hadamard (torch's butterflies) or a large dense rotation rotated first, as planes
            src = to_planes(split_rotate(x, rotation) if rotate else rotation.apply(x), layouts).contiguous()
            rp = scratch = src  # not read
        _encode_kernel[(programs,)](
            src, x, rp, scratch, n, d, pw, mags, bounds, alphas, qdata,
            row_bytes, norm, dot, sq, R0=tuple(layouts[0]), R1=tuple(layouts[1]), R2=tuple(layouts[2]),
            A=len(alphas), AP=max(2, next_power_of_2(len(alphas))), ROTATE=in_kernel,
            DK=cdiv(d, BLOCK_K) * BLOCK_K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION="tf32x3" if device.type == "cuda" else "ieee",
            num_warps=NUM_WARPS)
    if not in_kernel:  # the kernel scaled the rows, not the rotation applied to them first
        rescue_unsafe_rows(encode_directions_triton, x, rotation, runs, alphas, qdata, norm, dot, sq)
    return qdata, norm, dot, sq


def _programs(blocks: int, device: torch.device) -> int:
    """Persistent programs for ``blocks`` row blocks: PROGRAMS_PER_SM per multiprocessor on GPUs (at least 1)."""
    return max(1, min(blocks, PROGRAMS_PER_SM * multiprocessors(device)) if device.type == "cuda" else blocks)
