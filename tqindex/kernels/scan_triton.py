"""GPU scan of direction codes (TurboQuantMSE, TurboQuantPCA) with a fused top-k, in Triton.

One kernel body serves a flat scan (:func:`_flat_scan_kernel`: programs over query blocks x row splits)
and IVF lists (:func:`_lists_scan_kernel`: one program per list and block of the queries probing it,
list buffers reached through a table of pointers). A program decodes a tile of BLOCK_N code rows in
registers, multiplies it with its BLOCK_Q queries on the tensor cores (f16 operands, f32 accumulation;
vectors on the MMA's M dimension, so few queries waste nothing), applies the per-vector scale (and
``-||x̂||²`` for "l2") to the score tile and keeps a running top-KT of every query column by repeated
extraction of the tile's column maximum while it beats the column's current KT-th best. The full
[queries, rows] score matrix is never written: each program writes KT candidates per query.

Decoding, per run of the code (``CodeRun``): a run of b-bit codes is read in groups (one byte for b = 1,
2, 4, 8; three bytes of eight codes for b = 3) and split into *planes*: plane p holds code p of every
group, so the query is reordered once on the host (``planar queries``) and each plane is one MMA of
K = groups. Levels: codebooks are symmetric (level(c) = -level(2^b - 1 - c)), so a code is a sign and a
magnitude index; ``DECODE`` picks how the magnitude is found: 0 a gather from a small table, 1 a select
tree over the magnitude bits (any device, also Triton's interpreter), 2 (4-bit runs, CUDA only) inline
PTX ``prmt`` byte permutes from four registers holding the eight f16 magnitudes, eight codes per
instruction sequence.

For 1-16 queries over ``tq4`` codes, CUDA C++ kernels (:mod:`~tqindex.kernels.scan_cuda`) compute the tile
maxima of a scan of few queries instead, in int8 with less work per code.

The candidates are then re-scored exactly by the same tile code in float32 (:func:`_rescore_kernel`: float32
levels and queries, one query per program, the candidate rows read in place), so scores and the final top-k
equal the reference scan's (:class:`~tqindex.scorer.DecodeScorer`) up to summation order and exact ties.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..codes import Codes
from ..scorer import CodeRunList, Scorer
from ..topk import TopK, top_columns
from . import multiprocessors, scan_cuda
from .planes import RunLayout, cdiv, coordinates_on, next_power_of_2, run_layouts, to_planes

TILES = {2: (256, 4), 16: (256, 8), 32: (64, 4), 64: (64, 4), 128: (64, 4), 256: (32, 4)}
"""Queries per program (BLOCK_Q: 2 holds one query, scored by FMAs; 16 and more, the MMA's N dimension) ->
(code rows per tile, the MMA's M dimension; warps), measured on an H200 at 10M x 128 (tq4)."""
TILES_TOPK = {2: (256, 4), 16: (256, 8), 32: (64, 8), 64: (64, 8)}
"""The same where each query keeps a running top-k in registers (the flat top-k mode and the IVF lists):
fewer queries per program and 8 warps, else the score tile, the decoded planes and the top-k state spill."""
TILES_FILTER = {**TILES, 16: (64, 4), 128: (32, 4), 256: (32, 8)}
"""The same for the filtering scan: 64-row tiles and 4 warps at 16 queries (on an H100, 390k x 50 tq4, 16 queries,
GPU time: 0.047 ms against 0.063 with 256 rows and 8 warps, 0.058 with 128 and 4); 32-row tiles from 128 queries on,
8 warps at 256 (at 4 warps the filter's hit extraction spilled registers; on an H200 at 10M x 128 tq4 and 4096
queries its scan took 102 ms instead of 119, at 256 queries 6.8 instead of 8.2)."""
TILES_TILE_MAX = {**TILES, 128: (32, 4), 256: (64, 4)}
"""The same for the tile maxima: 64-row blocks and 4 warps at 256 queries. On an H200 (10M x 128 tq4, GPU time of
graph replays) the tile maxima of tiles of 128 rows took 56.9 ms for 4096 queries and 3.64 ms for 256 against 68.6
and 4.34 with 32 rows and 8 warps (32 rows and 4 warps: 58.3 and 3.69; 64 rows and 8 warps: 90.3 and 5.50); on an
H100 (tiles of 512 rows, 4096 queries) 44.4 ms against 50.4 with 32 rows and 4 warps."""
TILES_TILE_MAX_SHORT, SHORT_CODES = {**TILES_TILE_MAX, 256: (32, 4)}, 32
"""The same for codes of at most SHORT_CODES bytes a row: 32-row blocks at 256 queries. On an H100 (390k x 50 tq4,
4096 queries, GPU time) the tile maxima of tiles of 64 rows took 1.72 ms against 2.09 in blocks of 64 rows."""
MODE_TOPK, MODE_FILTER, MODE_MAX, MODE_TILE_MAX = 0, 1, 2, 3
PROGRAMS_PER_SM = 4
DECODE_GATHER, DECODE_SELECT, DECODE_PRMT = 0, 1, 2


# --------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _magnitude(m, MAG, H: tl.constexpr):
    """Magnitude ``MAG[m]`` of indices m < H (H = 1, 2, 4, 8 or 128) by a select tree (H <= 8) or a gather."""
    if H == 1:
        v = tl.zeros(m.shape, tl.float32) + tl.load(MAG)
    elif H > 8:
        v = tl.load(MAG + m)
    else:
        b0 = (m & 1) != 0
        v = tl.where(b0, tl.load(MAG + 1), tl.load(MAG))
        if H >= 4:
            v23 = tl.where(b0, tl.load(MAG + 3), tl.load(MAG + 2))
            v = tl.where((m & 2) != 0, v23, v)
            if H == 8:
                v45 = tl.where(b0, tl.load(MAG + 5), tl.load(MAG + 4))
                v67 = tl.where(b0, tl.load(MAG + 7), tl.load(MAG + 6))
                v47 = tl.where((m & 2) != 0, v67, v45)
                v = tl.where((m & 4) != 0, v47, v)
    return v


@triton.jit
def _level(code, MAG, BITS: tl.constexpr, DECODE: tl.constexpr, EXACT: tl.constexpr = False):
    """Level of b-bit codes (int32) of a symmetric codebook with magnitudes MAG (ascending), as f16 (EXACT:
    float32)."""
    H: tl.constexpr = 1 << (BITS - 1)
    neg = code < H
    m = tl.where(neg, H - 1 - code, code - H)
    if DECODE == 0:
        mag = tl.load(MAG + m)
    else:
        mag = _magnitude(m, MAG, H)
    lev = tl.where(neg, -mag, mag)
    if not EXACT:
        lev = lev.to(tl.float16)
    return lev


PRMT_ASM = tl.constexpr("""
{
.reg .b32 w, n, t, m, ml, mh, x, sl, sh, ll, hl, lh, hh, s, z;
mov.b32 z, 0;
mov.b32 w, $4;
not.b32 n, w;
shr.u32 n, n, 3;
and.b32 n, n, 0x11111111;
mul.lo.u32 t, n, 7;
xor.b32 m, w, t;
and.b32 ml, m, 0x07070707;
shr.u32 mh, m, 4;
and.b32 mh, mh, 0x07070707;
shr.u32 x, ml, 4;
or.b32 x, x, ml;
prmt.b32 ml, x, z, 0x0020;
shr.u32 x, mh, 4;
or.b32 x, x, mh;
prmt.b32 mh, x, z, 0x0020;
prmt.b32 ll, $5, $9, ml;
prmt.b32 hl, $13, $17, ml;
prmt.b32 lh, $5, $9, mh;
prmt.b32 hh, $13, $17, mh;
not.b32 sl, w;
shl.b32 sl, sl, 4;
and.b32 sl, sl, 0x80808080;
not.b32 sh, w;
and.b32 sh, sh, 0x80808080;
prmt.b32 $0, ll, hl, 0x5140;
prmt.b32 s, sl, z, 0x1404;
xor.b32 $0, $0, s;
prmt.b32 $1, ll, hl, 0x7362;
prmt.b32 s, sl, z, 0x3424;
xor.b32 $1, $1, s;
prmt.b32 $2, lh, hh, 0x5140;
prmt.b32 s, sh, z, 0x1404;
xor.b32 $2, $2, s;
prmt.b32 $3, lh, hh, 0x7362;
prmt.b32 s, sh, z, 0x3424;
xor.b32 $3, $3, s;
}
""")
"""PTX of :func:`_nibble_levels`: the four code bytes of $4 -> f16 levels of their low nibbles ($0: bytes
0 and 1, $1: bytes 2 and 3) and high nibbles ($2, $3). $5/$9 hold the low bytes and $13/$17 the high
bytes of the eight f16 magnitudes (ascending). Per nibble c: negative when bit 3 is clear (n = 1), the
magnitude index is (c ^ 7n) & 7; the indices of the low (high) nibbles are packed into one prmt
selector, which looks up the low and high bytes of four magnitudes at once; byte pairs are interleaved
into f16 pairs and the sign bits of negative codes set by a xor."""


PRMT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 17))  # 4 outputs; $4; 4 x 4 table words


@triton.jit
def _nibble_levels(byte, T0, T1, T2, T3):
    """f16 levels of the low and high nibbles of uint8 ``byte`` (4-bit codes) by prmt lookups (CUDA)."""
    zero = 0 * byte.to(tl.int32)
    lo, hi = tl.inline_asm_elementwise(
        asm=PRMT_ASM, constraints=PRMT_CONSTRAINTS,
        args=[byte, T0 + zero, T1 + zero, T2 + zero, T3 + zero],
        dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _groups(base, gmask, g, GB: tl.constexpr, NBYTES: tl.constexpr):
    """The code groups at ``base`` ([rows, groups] pointers, group numbers ``g``; a group is one byte, or
    for 3-bit codes three bytes of eight codes; bytes past the run's NBYTES read as 0) -> (their first
    bytes, uint8; the groups as int32)."""
    byte = tl.load(base, mask=gmask & (g[None, :] * GB < NBYTES), other=0)
    grp = byte.to(tl.int32)
    if GB == 3:
        grp |= tl.load(base + 1, mask=gmask & (g[None, :] * 3 + 1 < NBYTES), other=0).to(tl.int32) << 8
        grp |= tl.load(base + 2, mask=gmask & (g[None, :] * 3 + 2 < NBYTES), other=0).to(tl.int32) << 16
    return byte, grp


@triton.jit
def _plane_levels(grp, p: tl.constexpr, MAG, BITS: tl.constexpr, DECODE: tl.constexpr, EXACT: tl.constexpr = False):
    """Levels of plane ``p`` (code p of each group) of int32 groups ``grp``."""
    code = (grp >> (p * BITS)) & ((1 << BITS) - 1)
    return _level(code, MAG, BITS, DECODE, EXACT)


@triton.jit
def _run_scores(acc, sq, rows, rmask, CODES, row_bytes, QP, qw, qcols, qmask, MAG,
                BITS: tl.constexpr, GB: tl.constexpr, P: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                BK: tl.constexpr, BOFF: tl.constexpr, QOFF: tl.constexpr, NBYTES: tl.constexpr,
                W: tl.constexpr, L2: tl.constexpr, DECODE: tl.constexpr, BLOCK_Q: tl.constexpr, T0, T1, T2, T3,
                EXACT: tl.constexpr):
    """Add one run's contribution to the score tile acc [BLOCK_N, BLOCK_Q] (and its squared levels to sq):
    MMAs for blocks of 16 queries or more, FMAs for one query: a step's products summed over its planes per
    element in f16 (EXACT: float32 levels, queries and sums), then over the step's groups in f32."""
    for k0 in range(0, GP, BK):  # a runtime loop: large dims would unroll into a very long compile
        g = k0 + tl.arange(0, BK)  # groups of this step
        gmask = rmask[:, None] & (g[None, :] < G)
        base = CODES + rows[:, None].to(tl.int64) * row_bytes + BOFF + g[None, :] * GB  # [BLOCK_N, BK]
        byte, grp = _groups(base, gmask, g, GB, NBYTES)
        if DECODE == 2 and BITS == 4 and not EXACT:
            lo, hi = _nibble_levels(byte, T0, T1, T2, T3)
        part = tl.zeros((acc.shape[0], BK), tl.float32 if EXACT else tl.float16)  # one query: the step's products
        for p in tl.static_range(P):
            if DECODE == 2 and BITS == 4 and not EXACT:
                v = lo if p == 0 else hi
            else:
                v = _plane_levels(grp, p, MAG, BITS, DECODE, EXACT)
            if L2:  # coordinates of the run only (elsewhere the planar queries are 0: no mask needed)
                v = tl.where(gmask & (g[None, :] * P + p < W), v, 0.0).to(v.dtype)
            q = tl.load(QP + qcols[None, :] * qw + QOFF + p * GP + g[:, None],
                        mask=qmask[None, :], other=0.0)  # [BK, BLOCK_Q]
            if BLOCK_Q >= 16:  # tensor cores
                acc = tl.dot(v, q, acc)
            else:  # one query (and a masked column: no size-1 dims): the planes' products summed per element
                part += v * tl.sum(q, axis=1).to(part.dtype)[None, :]
            if L2:
                vf = v.to(tl.float32)
                sq += tl.sum(vf * vf, axis=1)
        if BLOCK_Q < 16:  # then in f32 over the step's groups, no layout change
            acc += tl.sum(part.to(tl.float32), axis=1)[:, None]
    return acc, sq


@triton.jit
def _tile_scores(rows, n, CODES, NORM, row_bytes, QP, qw, qcols, qmask, QSCALE, MAG,
                 R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, L2: tl.constexpr,
                 DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, T, EXACT: tl.constexpr = False):
    """Scores [BLOCK_N, BLOCK_Q] f32 of code rows ``rows`` (masked rows: -inf). R0..R2: the runs'
    :class:`RunLayout` tuples; a run of 0 groups is absent. EXACT: one query (BLOCK_Q = 2, the second column
    masked), float32 planar queries QP, levels in float32."""
    rmask = rows < n
    acc = tl.zeros((BLOCK_N, BLOCK_Q), tl.float32)
    sq = tl.zeros((BLOCK_N,), tl.float32)
    acc, sq = _run_scores(acc, sq, rows, rmask, CODES, row_bytes, QP, qw, qcols, qmask, MAG + R0[9],
                          R0[0], R0[1], R0[2], R0[3], R0[4], R0[5], R0[6], R0[7], R0[8], R0[10], L2, DECODE,
                          BLOCK_Q, T[0], T[1], T[2], T[3], EXACT)
    if R1[3] > 0:
        acc, sq = _run_scores(acc, sq, rows, rmask, CODES, row_bytes, QP, qw, qcols, qmask, MAG + R1[9],
                              R1[0], R1[1], R1[2], R1[3], R1[4], R1[5], R1[6], R1[7], R1[8], R1[10], L2, DECODE,
                              BLOCK_Q, T[4], T[5], T[6], T[7], EXACT)
    if R2[3] > 0:
        acc, sq = _run_scores(acc, sq, rows, rmask, CODES, row_bytes, QP, qw, qcols, qmask, MAG + R2[9],
                              R2[0], R2[1], R2[2], R2[3], R2[4], R2[5], R2[6], R2[7], R2[8], R2[10], L2, DECODE,
                              BLOCK_Q, T[8], T[9], T[10], T[11], EXACT)
    s = tl.load(NORM + rows, mask=rmask, other=0.0).to(tl.float32)
    qs = tl.load(QSCALE + qcols, mask=qmask, other=1.0)
    score = acc * s[:, None] * qs[None, :]
    if L2:
        score = score - (s * s * sq)[:, None]
    return tl.where(rmask[:, None], score, float("-inf"))


@triton.jit
def _insert(vals, idx, score, rows, KT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Merge a score tile [BLOCK_N, BLOCK_Q] (row numbers ``rows``) into the running top-KT of each column
    (vals, idx [KT, BLOCK_Q]): the column maximum moves in while it beats the column's KT-th best."""
    thr = tl.min(vals, axis=0)
    kr = tl.arange(0, KT)[:, None]
    nr = tl.arange(0, BLOCK_N)[:, None]
    while tl.max((tl.max(score, axis=0) > thr).to(tl.int32), axis=0) > 0:
        best = tl.max(score, axis=0)
        at = tl.argmax(score, axis=0)
        take = best > thr
        slot = tl.argmin(vals, axis=0)
        hit = (kr == slot[None, :]) & take[None, :]
        vals = tl.where(hit, best[None, :], vals)
        row = tl.sum(tl.where(nr == at[None, :], rows[:, None], 0), axis=0)
        idx = tl.where(hit, row[None, :], idx)
        score = tl.where((nr == at[None, :]) & take[None, :], float("-inf"), score)
        thr = tl.min(vals, axis=0)
    return vals, idx


# --------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _flat_scan_kernel(CODES, NORM, n, row_bytes, QP, qw, nq, QSCALE, MAG, OUT_V, OUT_I, rows_per_split, tile_rows,
                      THR, thr_stride, COUNT, cap, ACTIVE, out_split, out_k, out_q,
                      R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, L2: tl.constexpr,
                      DECODE: tl.constexpr, KT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                      T0, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11, MODE: tl.constexpr):
    """Program (query block, row split) over rows [split * rows_per_split, ...) for BLOCK_Q queries.

    MODE 0 (top-k): the top-KT rows of each query, written to OUT_V / OUT_I at ``split * out_split + j * out_k + q *
    out_q`` (j < KT); with ACTIVE (bool [nq]) only for its true queries: a block of none of them scans nothing.
    MODE 1 (filter): every row scoring at least THR[q * thr_stride] appended to OUT_V / OUT_I [nq, cap] at the query's
    count COUNT[q], in no fixed order (rows past ``cap`` are counted, not written): up to 16 queries per program each
    hit takes its slot by one atomic, else a tile's hits leave one per column per round of column maxima.
    MODE 2: only each query's maximum (to time the scan alone).
    MODE 3 (tile maxima): each tile of ``tile_rows`` rows' maximum per query, OUT_V [tiles, nq] (tile = first row /
    tile_rows; tile_rows a multiple of BLOCK_N and a divisor of rows_per_split; other modes: rows_per_split)."""
    qb, sp = tl.program_id(0), tl.program_id(1)
    qcols = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qmask = qcols < nq
    start = sp * rows_per_split
    stop = tl.minimum(start + rows_per_split, n)
    if ACTIVE is not None:
        qmask = qmask & (tl.load(ACTIVE + qcols, mask=qmask, other=0) != 0)
        stop = tl.where(tl.max(qmask.to(tl.int32), axis=0) > 0, stop, start)
    vals = tl.full((KT, BLOCK_Q), float("-inf"), tl.float32)
    idx = tl.full((KT, BLOCK_Q), -1, tl.int32)
    T = (T0, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11)
    if MODE == 1:
        thr = tl.load(THR + qcols * thr_stride, mask=qmask, other=float("inf"))
    for t0 in range(start, stop, tile_rows):
        tmax = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
        for r0 in range(t0, tl.minimum(t0 + tile_rows, stop), BLOCK_N):  # a tile's blocks (pipelined loads)
            rows = r0 + tl.arange(0, BLOCK_N)
            rows = tl.where(rows < stop, rows, n)  # past this split: masked like rows past the end
            score = _tile_scores(rows, n, CODES, NORM, row_bytes, QP, qw, qcols, qmask, QSCALE, MAG,
                                 R0, R1, R2, L2, DECODE, BLOCK_N, BLOCK_Q, T)
            if MODE == 0:
                vals, idx = _insert(vals, idx, score, rows, KT, BLOCK_N)
            elif MODE == 1 and BLOCK_Q <= 16:  # each hit takes the next slot of its query's list
                hit = (score >= thr[None, :]) & qmask[None, :]  # masked rows score -inf, thresholds are finite
                slot = tl.atomic_add(COUNT + tl.broadcast_to(qcols[None, :], (BLOCK_N, BLOCK_Q)), 1, mask=hit,
                                     sem="relaxed")
                ok = hit & (slot < cap)
                at = qcols[None, :].to(tl.int64) * cap + slot
                tl.store(OUT_V + at, score, mask=ok)
                tl.store(OUT_I + at, tl.broadcast_to(rows[:, None], (BLOCK_N, BLOCK_Q)), mask=ok)
            elif MODE == 1:  # a tile's hits leave one per column per round (an atomic per hit costs more here)
                if tl.max(tl.max(tl.where(qmask[None, :], score - thr[None, :], float("-inf")), axis=0), axis=0) >= 0:
                    left = tl.where((score >= thr[None, :]) & qmask[None, :], score, float("-inf"))
                    best = tl.max(left, axis=0)
                    while tl.max(best, axis=0) > float("-inf"):
                        take = best > float("-inf")
                        at_row = tl.argmax(left, axis=0)
                        slot = tl.atomic_add(COUNT + qcols, 1, mask=take, sem="relaxed")
                        ok = take & (slot < cap)
                        at = qcols.to(tl.int64) * cap + slot
                        tl.store(OUT_V + at, best, mask=ok)
                        tl.store(OUT_I + at, r0 + at_row, mask=ok)
                        left = tl.where(tl.arange(0, BLOCK_N)[:, None] == at_row[None, :], float("-inf"), left)
                        best = tl.max(left, axis=0)
            elif MODE == 2:
                vals = tl.maximum(vals, tl.max(score, axis=0)[None, :])
            else:
                tmax = tl.maximum(tmax, tl.max(score, axis=0))
        if MODE == 3:
            tl.store(OUT_V + (t0 // tile_rows) * nq + qcols, tmax, mask=qmask)
    if MODE == 0 or MODE == 2:
        out = sp * out_split + tl.arange(0, KT)[:, None] * out_k + qcols[None, :] * out_q
        tl.store(OUT_V + out, vals, mask=qmask[None, :])
        tl.store(OUT_I + out, idx, mask=qmask[None, :])


@triton.jit
def _lists_scan_kernel(CODE_PTRS, NORM_PTRS, SIZES, ITEM_LIST, ITEM_START, ITEM_COUNT, QUERIES, row_bytes,
                       QP, qw, QSCALE, MAG, OUT_V, OUT_I,
                       R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, L2: tl.constexpr,
                       DECODE: tl.constexpr, KT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                       NORM_F16: tl.constexpr, T0, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11):
    """Program = one work item: list ITEM_LIST[i] against the queries QUERIES[start : start + count] (count
    <= BLOCK_Q), top-KT per (query, list) pair written at its pair slot: OUT_V / OUT_I [pairs, KT]."""
    it = tl.program_id(0)
    lst = tl.load(ITEM_LIST + it)
    start = tl.load(ITEM_START + it)
    count = tl.load(ITEM_COUNT + it)
    n = tl.load(SIZES + lst).to(tl.int32)
    codes = tl.load(CODE_PTRS + lst).to(tl.pointer_type(tl.uint8))
    if NORM_F16:
        norm = tl.load(NORM_PTRS + lst).to(tl.pointer_type(tl.float16))
    else:
        norm = tl.load(NORM_PTRS + lst).to(tl.pointer_type(tl.float32))
    j = tl.arange(0, BLOCK_Q)
    qmask = j < count
    qcols = tl.load(QUERIES + start + j, mask=qmask, other=0)
    vals = tl.full((KT, BLOCK_Q), float("-inf"), tl.float32)
    idx = tl.full((KT, BLOCK_Q), -1, tl.int32)
    T = (T0, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11)
    for r0 in range(0, n, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        score = _tile_scores(rows, n, codes, norm, row_bytes, QP, qw, qcols, qmask, QSCALE, MAG,
                             R0, R1, R2, L2, DECODE, BLOCK_N, BLOCK_Q, T)
        vals, idx = _insert(vals, idx, score, rows, KT, BLOCK_N)
    out = (start + j[None, :]) * KT + tl.arange(0, KT)[:, None]
    tl.store(OUT_V + out, vals, mask=qmask[None, :])
    tl.store(OUT_I + out, idx, mask=qmask[None, :])


@triton.jit
def _rescore_kernel(CODES, NORM, n, row_bytes, QP, qw, QROWS, QSCALE, MAG, CAND, c, OUT_V, OUT_I,
                    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, L2: tl.constexpr, DECODE: tl.constexpr,
                    SPAN: tl.constexpr, HAS_QROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    T0, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11):
    """Program (query i, block j of its candidate rows): exact float32 scores for query QROWS[i] (HAS_QROWS,
    else i; QP float32 planar queries). Entry e of CAND [m, c] stands for rows CAND[i, e] * SPAN + 0 ...
    SPAN - 1 (SPAN 1: a row; more: a tile), -1 for none. OUT_V / OUT_I [m, c * SPAN]: the scores (-inf where
    none or past the end) and rows (-1 there)."""
    i, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    k = j * BLOCK_N + tl.arange(0, BLOCK_N)  # places of query i's rows, [0, c * SPAN)
    kmask = k < c * SPAN
    entry = tl.load(CAND + i * c + k // SPAN, mask=kmask, other=-1).to(tl.int64)
    rows = entry * SPAN + k % SPAN
    rows = tl.where((entry >= 0) & (rows < n), rows, n)  # none, or past the end of a last partial tile
    if HAS_QROWS:
        q = tl.load(QROWS + i)
    else:
        q = i
    qcols = q + tl.arange(0, 2)
    qmask = tl.arange(0, 2) < 1  # one query; the second column masked
    score = _tile_scores(rows, n, CODES, NORM, row_bytes, QP, qw, qcols, qmask, QSCALE, MAG, R0, R1, R2, L2,
                         DECODE, BLOCK_N, 2, (T0, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11), True)
    out = i * c * SPAN + k
    tl.store(OUT_V + out, tl.max(tl.where(qmask[None, :], score, float("-inf")), axis=1), mask=kmask)
    tl.store(OUT_I + out, tl.where(rows < n, rows, -1), mask=kmask)


@triton.jit
def _planar_kernel(QS, m, dim, COORD, QP32, QP16, QSCALE, DP: tl.constexpr, PW: tl.constexpr, PWP: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """Rows of the queries QS float32 [m, dim] (contiguous) in planar order (COORD [PW]: each entry's
    coordinate, ``dim`` where padded), divided by the least power of two not below the row's largest magnitude
    (QSCALE [m]; 2^-99 for a zero row): QP32 float32 and QP16 float16 [m, PW]. :func:`planar_queries` is the
    reference."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r[:, None] < m
    row = QS + r[:, None].to(tl.int64) * dim
    d = tl.arange(0, DP)[None, :]
    amax = tl.max(tl.abs(tl.load(row + d, mask=ok & (d < dim), other=0.0)), axis=1)
    bits = tl.maximum(amax, 1e-30).to(tl.int32, bitcast=True)
    scale = tl.where((bits & 0x7FFFFF) == 0, bits, (bits & 0x7F800000) + 0x800000).to(tl.float32, bitcast=True)
    c = tl.arange(0, PWP)
    coord = tl.load(COORD + c, mask=c < PW, other=dim)[None, :]
    v = tl.load(row + coord, mask=ok & (coord < dim), other=0.0) / scale[:, None]
    out = r[:, None].to(tl.int64) * PW + c[None, :]
    keep = ok & (c[None, :] < PW)
    tl.store(QP32 + out, v, mask=keep)
    tl.store(QP16 + out, v.to(tl.float16), mask=keep)
    tl.store(QSCALE + r, scale, mask=r < m)


@triton.jit
def _gather_rows_kernel(CODE_PTRS, NORM_PTRS, LISTS, ROWS, OUT_CODES, OUT_NORM, c, row_bytes,
                        NORM_F16: tl.constexpr, BLOCK_B: tl.constexpr):
    """Copy code row ROWS[i] of list LISTS[i] (and its scale) to OUT_CODES[i] / OUT_NORM[i]; i < c."""
    i = tl.program_id(0)
    lst = tl.load(LISTS + i)
    row = tl.load(ROWS + i).to(tl.int64)
    codes = tl.load(CODE_PTRS + lst).to(tl.pointer_type(tl.uint8))
    b = tl.arange(0, BLOCK_B)
    for b0 in range(0, row_bytes, BLOCK_B):
        m = b0 + b < row_bytes
        tl.store(OUT_CODES + i * row_bytes + b0 + b, tl.load(codes + row * row_bytes + b0 + b, mask=m), mask=m)
    if NORM_F16:
        norm = tl.load(NORM_PTRS + lst).to(tl.pointer_type(tl.float16))
    else:
        norm = tl.load(NORM_PTRS + lst).to(tl.pointer_type(tl.float32))
    tl.store(OUT_NORM + i, tl.load(norm + row).to(tl.float32))


# --------------------------------------------------------------------------------------------------
# host side


def planar_queries(qs: Tensor, layouts: list[RunLayout]) -> tuple[Tensor, Tensor]:
    """Queries qs [m, dim] in planar order, float32 [m, plane_width], divided per query by the least power of
    two not below its largest magnitude (returned, float32 [m]; 2^-99 for a zero query). The reference of
    :func:`_planar_kernel`."""
    qs = qs.float()
    mant, exp = torch.frexp(qs.abs().amax(1).clamp_min(1e-30))  # amax = mant 2^exp, mant in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(mant), exp - (mant == 0.5).int())
    return to_planes(qs / scale[:, None], layouts).contiguous(), scale.contiguous()


def planar_queries_triton(qs: Tensor, layouts: list[RunLayout]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`planar_queries` in one launch, with the float16 copy the scan's MMAs read: (float32 [m, plane_width],
    float16 [m, plane_width], scales float32 [m])."""
    qs = qs.float().contiguous()
    (m, dim), coords = qs.shape, coordinates_on(tuple(layouts), qs.shape[1], qs.device)
    pw, dp = len(coords), next_power_of_2(dim)
    qp32 = torch.empty(m, pw, device=qs.device)
    qp16 = torch.empty(m, pw, dtype=torch.float16, device=qs.device)
    scale = torch.empty(m, device=qs.device)
    if m:
        block = max(1, min(next_power_of_2(m), 4096 // max(dp, next_power_of_2(pw))))
        _planar_kernel[(cdiv(m, block),)](qs, m, dim, coords, qp32, qp16, scale, DP=dp, PW=pw,
                                          PWP=next_power_of_2(pw), BLOCK_R=block)
    return qp32, qp16, scale


def prmt_tables(mags: Tensor, layouts: list[RunLayout]) -> list[int]:
    """Twelve int32 words: per run (MAX_RUNS), the lo and hi bytes of its eight f16 magnitudes (4-bit runs),
    four words each: lo bytes 0-3, lo bytes 4-7, hi bytes 0-3, hi bytes 4-7."""
    words = []
    for lay in layouts:
        if lay.bits == 4:
            h = mags[lay.mag_offset : lay.mag_offset + 8].half().cpu().view(torch.int16).int() & 0xFFFF
            lo, hi = (h & 0xFF).tolist(), (h >> 8).tolist()
            pack = lambda b: (b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24) - ((b[3] >> 7) << 32)  # noqa: E731
            words += [pack(lo[:4]), pack(lo[4:]), pack(hi[:4]), pack(hi[4:])]
        else:
            words += [0, 0, 0, 0]
    return words


def default_decode(device: torch.device) -> int:
    """The decode of 4-bit runs: prmt permutes on CUDA, a select tree elsewhere (the interpreter)."""
    return DECODE_PRMT if device.type == "cuda" else DECODE_SELECT


def _scan_tables(encoder: Any, device: torch.device) -> tuple[tuple, Tensor, list[int], Any]:
    """What a scan of ``encoder``'s codes needs on ``device`` (cached per encoder and device): the runs'
    layouts (constexpr tuples), their magnitudes float32 [total], the prmt table words and the first run's
    int8 levels (``scan_cuda.int8_levels``; None unless it is a 4-bit run)."""
    layouts, mags, _ = run_layouts(encoder.code_runs(device))
    first = layouts[0]
    levels_i8 = scan_cuda.int8_levels(mags[first.mag_offset : first.mag_offset + 8]) if first.bits == 4 else None
    mags = mags.to(device)
    return tuple(tuple(r) for r in layouts), mags, prmt_tables(mags, layouts), levels_i8


def candidate_depth(k: int) -> int:
    """Candidates kept per query by the f16 scan before exact re-scoring: a power of two >= k + max(8, k/4)."""
    return next_power_of_2(k + max(8, k // 4))


TILE_QUERIES = 16
"""Up to this many queries, when the rows re-scored (queries x kept tiles x tile rows) are at most as many as the
sampled bound below scans, a flat scan keeps only each tile's maximum per query: a query's
candidate_depth(k) best rows lie in its that many best tiles (no other tile holds a row above the least of
their maxima), whose rows are then scored exactly; elsewhere the sampled bound and filtering scan below (beyond
this many queries: TILE_ROWS_MAX). On an H200 (10M x 128 tq4, graph replays) 16 queries took 0.98 ms instead of 1.20
at k = 10 and 1.10 instead of 1.22 at k = 100; at 390k x 50, where their rows re-scored would exceed the sample,
0.32 and 0.46 ms instead of 0.30 and 0.32."""
TILE_ROWS, TILE_ROWS_MAX, RESCORE_ROWS = 32, 512, 32768
"""Beyond TILE_QUERIES queries, tiles of rows (groups of the kernel's row blocks) keep their maxima where the rows
re-scored per query (candidate_depth(k) tiles) are at most 1 / BATCH_TILE_LIMIT of the rows: tiles of the most rows
up to TILE_ROWS_MAX whose candidate_depth(k) tiles hold at most RESCORE_ROWS rows and 1 / BATCH_TILE_SHARE of the
rows, fewer (down to TILE_ROWS) where the share needs it (:func:`batch_tile_rows`). On an H100 (10M x 128 tq4, 4096
queries; 256 queries in brackets) tiles of 128 / 256 / 512 rows took 64.1 / 54.1 / 50.3 ms (4.34 / 3.67 / 3.43)
at k = 10 and 66.9 / 59.8 / 61.9 (4.57 / 4.05 / 4.16) at k = 100, the scan alone 47.4 (3.05): larger tiles make the
maxima and their top-k cheaper (tile maxima 56.4 / 48.6 / 44.7 ms, ``torch.topk`` 6.7 / 3.4 / 1.8) and the
re-scoring dearer (0.6 / 1.3 / 2.5 at k = 10, 2.5 / 5.0 / 9.9 at k = 100). An earlier H200 run against the sampled
bound and filtering scan: tiles of 128 rows 84.6 ms at k = 10 and 96.5 at k = 100 instead of 114.6 and 150.6. On an
H100 at 390k x 50 (tq4, GPU time, 4096 queries; 256 in brackets) tiles of 32 / 64 / 128 rows took 3.66 / 3.36 / 4.16
ms (0.304 / 0.283 / 0.331) at k = 10 and 5.22 / 6.44 / 10.2 (0.404 / 0.471 / 0.700) at k = 100, where the sampled
bound's steps summed to about 5.1 (0.46) and 6.5 (0.57): re-scored rows of 1 / 95 of the index (k = 100, 32 rows)
still won."""
BATCH_TILE_SHARE, BATCH_TILE_LIMIT = 128, 64


def batch_tile_rows(n: int, kt: int) -> int:
    """Rows per tile of a batch's tile maxima over n rows keeping kt tiles per query (TILE_ROWS_MAX notes): a power
    of two from TILE_ROWS to TILE_ROWS_MAX."""
    rows = TILE_ROWS_MAX
    while rows > TILE_ROWS and (kt * rows > RESCORE_ROWS or kt * rows * BATCH_TILE_SHARE > n):
        rows //= 2
    return rows


SAMPLE_FRACTION = 8
"""A flat scan first scans one row in this many (at least SAMPLE_TILES tiles per candidate kept) and
takes each tile's best score per query: the k-th largest of those (k distinct rows) bounds the final
k-th best from below, so the full scan keeps only the rows that reach it (about k * SAMPLE_FRACTION per
query) instead of maintaining a running top-k."""
SAMPLE_TILES = 4
RESCORE_BLOCK = 64
"""Candidate rows per program of the exact re-scoring (4 warps). On an H100 (390k x 50 tq4, GPU time) the rows of
4096 queries' best tiles took 0.98 ms at k = 10 and 1.99 at k = 100 against 1.05 and 2.09 in blocks of 128 rows (1.83
and 3.64 with 8 warps in blocks of 512); 256 queries' at k = 100 0.137 against 0.148."""
CAPACITY_FACTOR, CAPACITY_EXTRA = 3, 256
"""Candidate room per query in the filtering scan: CAPACITY_FACTOR times the expected count plus
CAPACITY_EXTRA (at least candidate_depth(k)); a query whose candidates overflow it is scanned again with the running
top-k, into the same room."""


class TritonScorer(Scorer):
    """The GPU scorer of direction codes (module notes). ``decode`` overrides the decode of 4-bit runs
    (DECODE_GATHER, DECODE_SELECT, DECODE_PRMT); ``cuda=False`` keeps the CUDA kernels out (to time
    the Triton kernels beside them)."""

    def __init__(self, encoder: Any, qs: Tensor, l2: bool, bar: Any = None, decode: int | None = None,
                 cuda: bool = True) -> None:
        super().__init__(encoder, qs, l2, bar)
        self.cuda = cuda
        self.runs, self.mags, self.tables, self.levels_i8 = encoder.derived(qs.device, "triton-scan",
                                                                          lambda: _scan_tables(encoder, qs.device))
        self.qp32, self.qp, self.qscale = planar_queries_triton(qs, [RunLayout(*r) for r in self.runs])
        self.decode = default_decode(qs.device) if decode is None else decode
        self.short_codes = sum(RunLayout(*r).nbytes for r in self.runs) <= SHORT_CODES

    def _common(self, m: int, mode: int) -> dict:
        """Launch constants for m query rows in scan mode ``mode`` (TILES, TILES_TOPK, TILES_FILTER, TILES_TILE_MAX)."""
        tile_max = TILES_TILE_MAX_SHORT if self.short_codes else TILES_TILE_MAX
        tiles = {MODE_TOPK: TILES_TOPK, MODE_FILTER: TILES_FILTER, MODE_TILE_MAX: tile_max}.get(mode, TILES)
        block_q = 2 if m == 1 else min(max(tiles), max(16, next_power_of_2(m)))
        block_n, warps = tiles[block_q]
        return dict(R0=self.runs[0], R1=self.runs[1], R2=self.runs[2], L2=self.l2, DECODE=self.decode,
                    BLOCK_N=block_n, BLOCK_Q=block_q, num_warps=warps)

    def _cuda_tiles(self, codes: Codes, m: int) -> bool:
        """Whether the CUDA kernel (``scan_cuda``) computes tile maxima of ``m`` queries over ``codes``."""
        return self.cuda and self.decode == DECODE_PRMT and scan_cuda.reads(self.runs, codes, m)

    # -- flat -------------------------------------------------------------------------------------------
    def scan(self, codes: Codes, k: int, rows: Tensor | None = None, mode: int = MODE_TOPK,
             threshold: Tensor | None = None, group: int = 1, into: tuple[Tensor, Tensor, Tensor] | None = None
             ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The flat kernel over codes [n] for query rows ``rows`` (all when None) -> (approximate scores float32
        [m, c], their rows int32 [m, c] (score -inf: none), bool [m] or None). MODE_TOPK: each program's top
        candidates, or with ``into`` = (scores, rows, active) ([m, c], [m, c], bool [m]) written into the first columns
        of the rows of the active queries only (fewer row splits if c needs it; the others' programs scan nothing);
        MODE_FILTER: the rows scoring at least ``threshold`` (float32 [m], any stride), and whether
        a query had more than there was room for (overflow); MODE_MAX: each query's maximum only (to time the
        scan alone). MODE_TILE_MAX: each tile of ``group`` blocks of rows' maximum per query [m, tiles]; it and
        MODE_MAX run the CUDA kernel of ``scan_cuda`` (tiles of scan_cuda.TILE rows) where it reads the codes."""
        sel = slice(None) if rows is None else rows
        qscale = self.qscale[sel].contiguous()
        n, m, kt = len(codes), len(qscale), 1 if mode == MODE_MAX else candidate_depth(k)  # MODE_MAX: one row
        if mode in (MODE_MAX, MODE_TILE_MAX) and self._cuda_tiles(codes, m):
            maxima = scan_cuda.tile_maxima(codes, self.qp32[sel], RunLayout(*self.runs[0]), qscale, self.levels_i8,
                                           self.l2)
            maxima = maxima.amax(1, keepdim=True) if mode == MODE_MAX else maxima
            return maxima, maxima, None
        qp = self.qp[sel].contiguous()  # the float16 queries the Triton kernel multiplies
        common = self._common(m, mode)
        block_n, q_blocks = common["BLOCK_N"], cdiv(m, common["BLOCK_Q"])
        sms = multiprocessors(qp.device)
        splits = max(1, min(cdiv(n, 4 * block_n), cdiv(PROGRAMS_PER_SM * sms, q_blocks)))
        if into is not None:  # kt columns per split
            splits = min(splits, into[0].shape[1] // kt)
        span = block_n * (group if mode == MODE_TILE_MAX else 1)
        per_split = cdiv(cdiv(n, splits), span) * span
        splits = cdiv(n, per_split)
        count = cap = None
        strides = (kt * m, m, 1)  # [splits, kt, m]
        if into is not None:
            out_v, out_i, _ = into
            strides = (kt, 1, out_v.stride(0))
        elif mode == MODE_TILE_MAX:
            out_v = torch.empty(cdiv(n, span), m, device=qp.device)
            out_i = out_v  # not written
        elif mode == MODE_FILTER:
            cap = max(kt, CAPACITY_FACTOR * kt * SAMPLE_FRACTION + CAPACITY_EXTRA)
            out_v = torch.full((m, cap), float("-inf"), device=qp.device)  # -inf past each query's count
            out_i = torch.empty(m, cap, dtype=torch.int32, device=qp.device)
            count = torch.zeros(m, dtype=torch.int32, device=qp.device)
        else:
            out_v = torch.empty(splits, kt, m, device=qp.device)
            out_i = torch.empty(splits, kt, m, dtype=torch.int32, device=qp.device)
        qdata, norm = codes.qdata.contiguous(), codes.norm.contiguous()
        _flat_scan_kernel[(q_blocks, splits)](
            qdata, norm, n, qdata.shape[1], qp, qp.shape[1], m, qscale, self.mags, out_v, out_i, per_split,
            span if mode == MODE_TILE_MAX else per_split,
            qscale if threshold is None else threshold, 1 if threshold is None else threshold.stride(0),
            qscale if count is None else count, cap or 0, None if into is None else into[2], *strides, KT=kt, **common,
            **{f"T{i}": self.tables[i] for i in range(12)}, MODE=mode)
        if mode == MODE_FILTER:
            return out_v, out_i, count > cap
        if into is not None:
            return out_v, out_i, None
        if mode == MODE_TILE_MAX:
            return out_v.T, out_i.T, None
        return out_v.permute(2, 0, 1).reshape(m, -1), out_i.permute(2, 0, 1).reshape(m, -1), None

    def candidates(self, codes: Codes, k: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor, bool]:
        """Scores and rows [m, c] that hold every query's top candidate_depth(k) rows, and whether the scores
        are exact: a running top-k for small n; where few rows would be re-scored the rows of each query's best
        tiles (TILE_QUERIES, TILE_ROWS_MAX), scored exactly; else the top-k of a sample bounds the k-th best and a
        filtering scan keeps the rows that reach it (queries whose candidates overflow are scanned again with a
        running top-k, on the device: nothing here waits for it)."""
        kt, m = candidate_depth(k), self.m if rows is None else len(rows)
        way, block_n, group, sample = self._candidates_plan(codes, k, m)
        if way == "topk":
            return *self.scan(codes, k, rows)[:2], False
        if way == "tiles":
            maxima, _, _ = self.scan(codes, k, rows, MODE_TILE_MAX, group=group)  # [m, tiles]
            return *self.rescore(rows, codes, top_columns(maxima, kt, "triton")[1], block_n * group), True
        maxima, _, _ = self.scan(codes[:sample], k, rows, MODE_TILE_MAX)  # [m, tiles]
        bound = top_columns(maxima, kt, "triton")[0][:, -1]  # kt distinct rows reach it: <= the final kt-th best
        vals, cand, overflow = self.scan(codes, k, rows, MODE_FILTER, bound)
        # rare: more rows reach the bound than there is room for; those queries' rows are cleared and scanned again
        vals.masked_fill_(overflow[:, None], float("-inf"))
        return *self.scan(codes, k, rows, into=(vals, cand, overflow))[:2], False

    def _candidates_plan(self, codes: Codes, k: int, m: int) -> tuple[str, int, int, int]:
        """How :meth:`candidates` finds m queries' candidates over codes: "topk" (a running top-k), "tiles" (the
        best tiles' rows) or "filter" (a sampled bound, then a filtering scan), with the rows per tile, the tiles'
        group and the sampled rows."""
        n, kt = len(codes), candidate_depth(k)
        block_n = scan_cuda.TILE if self._cuda_tiles(codes, m) else self._common(m, MODE_TILE_MAX)["BLOCK_N"]
        group = max(1, batch_tile_rows(n, kt) // block_n) if m > TILE_QUERIES else 1
        sample = max(n // SAMPLE_FRACTION, SAMPLE_TILES * kt * block_n)
        if n <= 2 * sample:
            return "topk", block_n, group, sample
        if m * kt * block_n <= sample if m <= TILE_QUERIES else kt * block_n * group * BATCH_TILE_LIMIT <= n:
            return "tiles", block_n, group, sample
        return "filter", block_n, group, sample

    def push(self, codes: Codes, labels: Tensor | int, top: TopK, rows: Tensor | None = None,
             offset: Tensor | None = None, shift: Tensor | None = None) -> None:
        if shift is not None:
            raise ValueError("the GPU scan takes unshifted queries (residual IVF lists are scanned in PyTorch)")
        n, m = len(codes), self.m if rows is None else len(rows)
        if n == 0 or m == 0:
            return
        scores, rows_of, exact = self.candidates(codes, top.k, rows)
        if not exact:  # the best candidate_depth(k) of each query, re-scored
            best = top_columns(scores, min(candidate_depth(top.k), scores.shape[1]), "triton", rows_of)[1]
            scores, rows_of = self.rescore(rows, codes, best)  # best: rows, -1 for none
        if isinstance(labels, int):  # rows_of: int64, -1 for none
            lab = torch.where(rows_of >= 0, rows_of + labels, -1) if labels else rows_of
        else:
            lab = torch.where(rows_of >= 0, labels.to(rows_of.device)[rows_of.clamp_min(0)], -1)
        if offset is not None:
            scores = scores + offset[:, None]
        top.merge(scores, lab, rows)
        self._advance(m * n)

    def rescore(self, qrows: Tensor | None, codes: Codes, cand: Tensor, span: int = 1) -> tuple[Tensor, Tensor]:
        """Exact float32 scores (the encoder's decode, up to summation order) of candidates cand [m, c] for
        query rows ``qrows`` [m] (all when None): rows of ``codes`` (span 1) or tiles of ``span`` rows, -1 for
        none -> (scores [m, c * span], -inf where none or past the end; rows int64 [m, c * span], -1 there). The CUDA
        kernel of ``scan_cuda`` scores them where it reads the codes."""
        m, width = cand.shape[0], cand.shape[1] * span
        if self.cuda and scan_cuda.rescores(self.runs, codes, m, width):
            return scan_cuda.rescore(codes, self.qp32, RunLayout(*self.runs[0]), self.qscale, self.levels_i8, self.l2,
                                     qrows, cand, span)
        out_v = torch.empty(m, width, device=cand.device)
        out_i = torch.empty(m, width, dtype=torch.int64, device=cand.device)
        if m and width:
            qdata, norm = codes.qdata.contiguous(), codes.norm.contiguous()
            _rescore_kernel[(m, cdiv(width, RESCORE_BLOCK))](
                qdata, norm, len(codes), qdata.shape[1], self.qp32, self.qp32.shape[1],
                self.qscale if qrows is None else qrows, self.qscale, self.mags, cand.contiguous(), cand.shape[1],
                out_v, out_i, R0=self.runs[0], R1=self.runs[1], R2=self.runs[2], L2=self.l2, DECODE=self.decode,
                SPAN=span, HAS_QROWS=qrows is not None, BLOCK_N=RESCORE_BLOCK, num_warps=4,
                **{f"T{i}": self.tables[i] for i in range(12)})
        return out_v, out_i

    # -- IVF --------------------------------------------------------------------------------------------
    def push_lists(self, lists: CodeRunList, probes: Tensor, top: TopK, offsets: Tensor | None = None,
                   shifts: Tensor | None = None) -> None:
        """Every probed list in one launch (module notes); with ``offsets`` the list-by-list strategy."""
        if offsets is not None or shifts is not None:
            super().push_lists(lists, probes, top, offsets, shifts)
            return
        device, (m, nprobe) = self.qs.device, probes.shape
        table = getattr(lists, "triton", None)
        if table is None:
            table = _ListTable(lists, device)
            if hasattr(lists, "__dict__"):  # a view cached with its index state keeps its table
                lists.triton = table
        kt = candidate_depth(top.k)
        common = self._common(m, MODE_TOPK)
        block_q = common["BLOCK_Q"]
        flat = probes.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair slots grouped by list
        queries = (order // nprobe).int()
        counts = torch.bincount(flat, minlength=len(table.sizes))
        starts = counts.cumsum(0) - counts
        chunks = (counts + block_q - 1) // block_q
        item_list = torch.repeat_interleave(torch.arange(len(counts), device=device), chunks)
        first = torch.repeat_interleave(chunks.cumsum(0) - chunks, chunks)
        chunk_no = torch.arange(len(item_list), device=device) - first
        item_start = starts[item_list] + chunk_no * block_q
        item_count = torch.minimum(counts[item_list] - chunk_no * block_q, torch.full_like(item_start, block_q))
        keep = table.sizes[item_list] > 0
        item_list, item_start, item_count = item_list[keep], item_start[keep], item_count[keep]
        pairs = m * nprobe
        out_v = torch.full((pairs, kt), float("-inf"), device=device)
        out_i = torch.full((pairs, kt), -1, dtype=torch.int32, device=device)
        if len(item_list):
            _lists_scan_kernel[(len(item_list),)](
                table.code_ptrs, table.norm_ptrs, table.sizes, item_list, item_start.int(), item_count.int(),
                queries, table.row_bytes, self.qp, self.qp.shape[1], self.qscale, self.mags, out_v, out_i,
                KT=kt, NORM_F16=table.norm_f16, **common, **{f"T{i}": self.tables[i] for i in range(12)})
        slot = torch.empty_like(order)
        slot[order] = torch.arange(pairs, device=device)  # pair (query i, probe j) -> its slot
        slot = slot.reshape(m, nprobe)
        vals = out_v[slot].reshape(m, nprobe * kt)
        rows = out_i[slot].reshape(m, nprobe * kt).long()
        lst = probes[:, :, None].expand(m, nprobe, kt).reshape(m, -1)
        v, j = top_columns(vals, min(kt, vals.shape[1]), "triton")
        rows, lst = rows.gather(1, j), lst.gather(1, j)
        valid = v > float("-inf")
        codes = table.gather(lst.reshape(-1), rows.clamp_min(0).reshape(-1))
        at = torch.arange(rows.numel(), device=device).reshape(rows.shape)  # rows of the gathered codes
        exact, _ = self.rescore(None, codes, torch.where(valid, at, -1))
        top.merge(exact, torch.where(valid, table.labels(lst, rows), -1))
        self._advance(int(table.sizes[probes].sum()))


class _ListTable:
    """Device pointers, sizes and labels of code lists, as the list kernels read them."""

    def __init__(self, lists: CodeRunList, device: torch.device) -> None:
        first = next(c for c, _ in lists if c is not None and len(c))
        self._keep = [(c.qdata.contiguous(), c.norm.contiguous()) if c is not None and len(c) else None
                      for c, _ in lists]  # the pointers below stay valid while these live
        ptr = lambda i: [0 if k is None else k[i].data_ptr() for k in self._keep]  # noqa: E731
        self.code_ptrs = torch.tensor(ptr(0), dtype=torch.int64, device=device)
        self.norm_ptrs = torch.tensor(ptr(1), dtype=torch.int64, device=device)
        self.sizes = torch.tensor([0 if k is None else len(k[0]) for k in self._keep], dtype=torch.int64,
                                  device=device)
        self.row_bytes = first.qdata.shape[1]
        self.norm_f16 = first.norm.dtype == torch.float16
        self.template = first
        base = [lab if isinstance(lab, int) else 0 for _, lab in lists]
        self._base = torch.tensor(base, dtype=torch.int64, device=device)
        explicit = [(i, lab) for i, (_, lab) in enumerate(lists) if not isinstance(lab, int) and len(lab)]
        self._explicit = None
        if explicit:  # one concatenated label table with each list's start
            starts = torch.zeros(len(lists), dtype=torch.int64)
            total = 0
            for i, lab in explicit:
                starts[i] = total
                total += len(lab)
            self._explicit = (starts.to(device), torch.cat([lab.to(device) for _, lab in explicit]))

    def labels(self, lst: Tensor, rows: Tensor) -> Tensor:
        """Labels of (list, row) pairs (any shape)."""
        if self._explicit is None:
            return self._base[lst] + rows
        starts, table = self._explicit
        return table[(starts[lst] + rows.clamp_min(0)).clamp_max(len(table) - 1)]

    def gather(self, lst: Tensor, rows: Tensor) -> Codes:
        """Codes of (list, row) pairs [c] as one contiguous Codes [c]."""
        c = len(lst)
        qdata = torch.empty(c, self.row_bytes, dtype=torch.uint8, device=lst.device)
        norm = torch.empty(c, device=lst.device)
        if c:
            _gather_rows_kernel[(c,)](self.code_ptrs, self.norm_ptrs, lst, rows, qdata, norm, c, self.row_bytes,
                                      NORM_F16=self.norm_f16, BLOCK_B=min(256, next_power_of_2(self.row_bytes)))
        return Codes(qdata=qdata, norm=norm.to(self.template.norm.dtype))
