"""Attention straight from direction codes on GPUs (Triton): decode steps and prefill chunks over a
compressed past.

Two or three launches per call. The query kernel rotates the queries into the key encoder's planar order by
products with a precomputed matrix (the rotation's columns, reordered; a block of columns per program) and
divides each row by a power of two at or above its largest possible coordinate (its norm times the matrix's
largest column norm). The attention kernel is split-K (flash-decoding): a program takes one (batch row, KV
head), a block of BLOCK_M query rows (the G query heads sharing that KV head times the Q query positions,
head-major) and a range of key tokens, and keeps an online softmax (running max ``m``, normalizer ``l``,
weighted value sum). Its range lies either in the compressed past (codes) or in the full-precision window (the
newest tokens, causal):

- compressed tokens: keys are decoded plane by plane in registers (``planes.py``, the scan's decoders)
  and multiplied with the rotated, planar queries (f16 operands, f32 accumulation), the key scale folded
  into the score tile; values are decoded in their natural coordinate order (planes interleaved by
  ``tl.join``), their scale folded into the probabilities, and summed in the value encoder's rotated
  domain;
- FP4-UE8M0 codes (keys, values or both) are read as one 4-bit run of the E2M1 levels (each byte's two
  codes remapped to the symmetric codebook's order, then the same decoders); each 32-element scale group's
  levels are multiplied by 2^(its exponent - the token's largest), exact in f16 down to 2^-24 relative
  to the token's largest group, and 2^(largest - 127) is folded like a norm;
- window tokens: plain f16 products of the queries and the window, with the causal mask.

Each program writes its partial (m, l, sum); the merge kernel combines them by log-sum-exp, rotates the
compressed part's sum back (one product with the inverse rotation's matrix), adds the window's and writes the
output in the [B, Q, Hq, D] layout attention layers return. Where the CUDA C++ kernel reads the codes
(:mod:`.attention_cuda`, backend "cuda"), it computes a decode step's compressed splits after this kernel
computed the window's, and where a step has few (batch row x KV head) pairs, it also merges them: no merge
kernel runs. Where the row blocks alone fill the card (prefill chunks: thousands of query rows), each program
instead takes every token of its rows, compressed then window (rotating its sum back in between, skipping
window tokens after its rows' causal limit) and writes the output itself: no partials, no merge. No
full-precision copy of the compressed history is made. The PyTorch reference is
:func:`tqindex.kv.attention.compressed_attention_ref`.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import attention_cuda, multiprocessors
from .planes import FP4_GROUP, RunLayout, cdiv, next_power_of_2, run_layouts, to_planes
from .scan_triton import (_groups, _level, _nibble_levels, _plane_levels, _scan_tables, default_decode,
                          prmt_tables)

BLOCK_N = 64
"""Key tokens per tile."""
PROGRAMS_PER_SM = 8
"""Programs per multiprocessor a decode step's splits aim at (the split count follows from it; the CUDA kernel's
splits: :func:`.attention_cuda.splits`)."""
MIN_SPLIT_TOKENS = 256
"""Least compressed tokens per program: fewer splits for the merge to combine where the past is short."""
DECODE_WARPS = 4
"""Warps per program of a decode step (16-row blocks; 8 where codes are 8-bit, else registers spill)."""
NUM_STAGES = 2
"""Software-pipelining stages of the token loop (measured best of 1-4 on an H200 with 64-token tiles)."""
WINDOW_SPLIT = 1024
"""Window tokens per program (prefill chunks are long windows)."""
MERGE_ROWS = 16
"""Query rows per program of the query and merge kernels (the least M of a tensor-core product)."""
MERGE_COLUMNS = 32
"""Least output columns per program of the query and merge kernels. Where a call's row blocks (batch rows x KV
heads x blocks of MERGE_ROWS) leave multiprocessors idle, each takes that many columns or more, a slice of the
rotation's matrix (:func:`_columns`): the whole [128, 128] matrix took 255 registers and spilled, and at
batch 1 and 8 (8 KV heads, d128, on an H100) the two kernels were most of a short step (a decode step over 4k
tokens: 26.9 us, 23.9 with 32 columns, and the CUDA kernel's splits); with 256 row blocks (batch 32) more programs
only added waves (4k: 101 us, 107 with 32 columns)."""
MERGE_STAGES = tl.constexpr(4)
"""Splits whose partials the merge kernel has in flight (software pipelining of its loops over splits)."""
ONE_PASS_ROWS = 128
"""Query rows per program of a one-pass call (prefill chunks) that has as many: each tile of codes decoded
serves twice the rows of a split-K program's 64."""
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _pow2(e):
    """2^e as float32 for int32 e (exact for e >= -126; 0 below)."""
    return tl.where(e >= -126, ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _e2m1_symmetric(byte):
    """Bytes of two E2M1 codes (sign bit 3, magnitude index bits 0-2) -> the codes of the symmetric codebook
    the decoders read (``FP4UE8M0.level_run``): c ^ 8, or c ^ 15 where the sign bit is set."""
    return byte ^ 0x88 ^ (((byte >> 3) & 0x11) * 7)


@triton.jit
def _group_exponents(S, tok, tmask, NG: tl.constexpr, NGP: tl.constexpr):
    """UE8M0 exponents of the FP4 scale groups of tokens ``tok`` (S: [tokens, NG] bytes) -> (int32
    [BLOCK_N, NGP], 0 past NG; each token's largest [BLOCK_N])."""
    g = tl.arange(0, NGP)
    e = tl.load(S + tok[:, None].to(tl.int64) * NG + g[None, :], mask=tmask[:, None] & (g[None, :] < NG),
                other=0).to(tl.int32)
    return e, tl.max(e, axis=1)


@triton.jit
def _token_scales(N, tok, tmask, NG: tl.constexpr, NGP: tl.constexpr, FP4: tl.constexpr):
    """Per-token scales float32 [BLOCK_N] folded on score or probability tiles: the norms N [tokens], or for
    FP4 2^(largest group exponent - 127) (N: exponents [tokens, NG]); and that exponent (int32; FP4 only)."""
    if FP4:
        e, emax = _group_exponents(N, tok, tmask, NG, NGP)
        return _pow2(emax - 127), emax
    else:
        return tl.load(N + tok, mask=tmask, other=0.0).to(tl.float32), tok


@triton.jit
def _key_scores(q_ptr, rows_ok, KC, kstride, tok, tmask, MAG, R: tl.constexpr, DECODE: tl.constexpr, T0, T1, T2, T3,
                KS, kmax, FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """<R q, c> [BLOCK_M, BLOCK_N]: the planar query rows at ``q_ptr`` ([BLOCK_M, 1] pointers) with the key
    codes of tokens ``tok`` (one run, layout R), decoded plane by plane. FP4: each k-step is one scale
    group, its levels scaled by 2^(exponent - kmax) (exponents KS [tokens, groups]; kmax [BLOCK_N])."""
    BITS: tl.constexpr = R[0]
    GB: tl.constexpr = R[1]
    P: tl.constexpr = R[2]
    G: tl.constexpr = R[3]
    GP: tl.constexpr = R[4]
    BK: tl.constexpr = R[5]
    W: tl.constexpr = R[10]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, GP, BK):
        g = k0 + tl.arange(0, BK)
        gmask = tmask[:, None] & (g[None, :] < G)
        byte, grp = _groups(KC + tok[:, None].to(tl.int64) * kstride + g[None, :] * GB, gmask, g, GB, R[8])
        if FP4:
            byte = _e2m1_symmetric(byte)
            grp = byte.to(tl.int32)
            # k-step k0 // BK is scale group k0 // BK (16 code bytes each); R[4] // BK groups per token
            e = tl.load(KS + tok.to(tl.int64) * (R[4] // BK) + k0 // BK, mask=tmask, other=0).to(tl.int32)
            factor = _pow2(e - kmax)[:, None]
        if DECODE == 2 and BITS == 4:
            lo, hi = _nibble_levels(byte, T0, T1, T2, T3)
        for p in tl.static_range(P):
            if DECODE == 2 and BITS == 4:
                v = lo if p == 0 else hi
            else:
                v = _plane_levels(grp, p, MAG, BITS, DECODE)
            if FP4:
                v = v.to(tl.float32) * factor
            v = tl.where(gmask & (g[None, :] * P + p < W), v, 0.0).to(tl.float16)  # [BLOCK_N, BK]
            q = tl.load(q_ptr + (p * GP + g)[None, :], mask=rows_ok, other=0.0)  # [BLOCK_M, BK]
            acc = tl.dot(q, tl.trans(v), acc)
    return acc


@triton.jit
def _value_rows(VC, vstride, tok, tmask, MAG, R: tl.constexpr, DECODE: tl.constexpr, T0, T1, T2, T3,
                VS, vmax, NG: tl.constexpr, NGP: tl.constexpr, FP4: tl.constexpr, DP: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Levels of the value codes of tokens ``tok`` in natural coordinate order, f16 [BLOCK_N, DP] (one
    coded run; coordinates past it are 0). The planes of a group are interleaved by a tree of joins. FP4:
    each scale group's levels scaled by 2^(exponent - vmax) (exponents VS [tokens, NG]; vmax [BLOCK_N])."""
    BITS: tl.constexpr = R[0]
    GB: tl.constexpr = R[1]
    P: tl.constexpr = R[2]
    GP: tl.constexpr = DP // P
    g = tl.arange(0, GP)
    byte, w = _groups(VC + tok[:, None].to(tl.int64) * vstride + g[None, :] * GB, tmask[:, None], g, GB, R[8])
    if FP4:
        byte = _e2m1_symmetric(byte)
        w = byte.to(tl.int32)
    if P == 1:
        v = _level(w, MAG, BITS, 1)
    elif P == 2:
        if DECODE == 2:
            lo, hi = _nibble_levels(byte, T0, T1, T2, T3)
        else:
            lo = _level(w & 15, MAG, BITS, 1)
            hi = _level(w >> 4, MAG, BITS, 1)
        v = tl.reshape(tl.join(lo, hi), (BLOCK_N, DP))
    elif P == 4:
        p0 = _level(w & 3, MAG, BITS, 1)
        p1 = _level((w >> 2) & 3, MAG, BITS, 1)
        p2 = _level((w >> 4) & 3, MAG, BITS, 1)
        p3 = _level((w >> 6) & 3, MAG, BITS, 1)
        v = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BLOCK_N, DP))
    else:  # eight planes (1- or 3-bit codes): code i of a group is coordinate 8g + i
        M: tl.constexpr = (1 << BITS) - 1
        e0 = tl.join(tl.join(_level(w & M, MAG, BITS, 1), _level((w >> (4 * BITS)) & M, MAG, BITS, 1)),
                     tl.join(_level((w >> (2 * BITS)) & M, MAG, BITS, 1), _level((w >> (6 * BITS)) & M, MAG, BITS, 1)))
        e1 = tl.join(tl.join(_level((w >> BITS) & M, MAG, BITS, 1), _level((w >> (5 * BITS)) & M, MAG, BITS, 1)),
                     tl.join(_level((w >> (3 * BITS)) & M, MAG, BITS, 1),
                             _level((w >> (7 * BITS)) & M, MAG, BITS, 1)))
        v = tl.reshape(tl.join(e0, e1), (BLOCK_N, DP))
    if FP4:  # NGP groups of FP4_GROUP coordinates make DP
        e, _ = _group_exponents(VS, tok, tmask, NG, NGP)
        factor = tl.reshape(tl.broadcast_to(_pow2(e - vmax[:, None])[:, :, None], (BLOCK_N, NGP, DP // NGP)),
                            (BLOCK_N, DP))
        v = v.to(tl.float32) * factor
    coord = tl.arange(0, DP)
    return tl.where(coord[None, :] < R[10], v, 0.0).to(tl.float16)


@triton.jit
def _masked(s, visible, mask_ptr, MASK_KIND: tl.constexpr):
    """Scores s with -inf where not ``visible`` or where the attention mask says so (MASK_KIND 0: none,
    1: bool, True = attend, 2: additive float)."""
    if MASK_KIND == 1:
        visible = visible & (tl.load(mask_ptr, mask=visible, other=0) != 0)
    elif MASK_KIND == 2:
        s += tl.load(mask_ptr, mask=visible, other=0.0)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _query_rows(Q, b, kvh, r, rows, nq, q_sb, q_sh, q_sq):
    """Pointers to the queries of rows ``r`` of KV head ``kvh`` of batch row ``b``: row r is query head
    kvh * G + r // nq at position r % nq of q [B, Hq, Q, D] (strides q_sb, q_sh, q_sq; unit stride in D)."""
    h = kvh * (rows // nq) + r // nq
    return Q + b.to(tl.int64) * q_sb + h.to(tl.int64) * q_sh + (r % nq).to(tl.int64) * q_sq


@triton.jit
def _query_kernel(Q, MQ, BOUND, QP, QSC, COUNTERS, hkv, rows, nq, q_sb, q_sh, q_sq, D: tl.constexpr, DP: tl.constexpr,
                  PW: tl.constexpr, PWP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  COUNTER_ROWS: tl.constexpr, PRECISION: tl.constexpr):
    """Program (batch row x KV head ``bh``, row block, block of BLOCK_C columns): its query rows rotated into
    planar order, ``q MQ`` (MQ float32 [DP, PWP]: the rotation's columns in planar order, zero padded), those
    columns; each row divided by the power of two at or above ``||q|| BOUND`` (BOUND float32 [1]: MQ's largest
    column norm, so no coordinate exceeds 1, and every column block of a row takes the same divisor); written
    f16 to QP [bh * rows + r, PW], the divisors to QSC [bh * rows + r]. COUNTER_ROWS > 0: the first column
    block also zeroes the CUDA kernel's merge counters of its rows (COUNTERS int32 [bh, row blocks of
    COUNTER_ROWS])."""
    bh, rb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    q_rows = _query_rows(Q, bh // hkv, bh % hkv, r, rows, nq, q_sb, q_sh, q_sq)
    KQ: tl.constexpr = DP if DP <= 128 else 64  # rows of MQ per product (registers)
    y = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    sq = tl.zeros((BLOCK_R,), tl.float32)
    for k0 in tl.static_range(0, DP, KQ):
        d = k0 + tl.arange(0, KQ)
        q = tl.load(q_rows[:, None] + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        y = tl.dot(q, tl.load(MQ + d[:, None] * PWP + c[None, :]), y, input_precision=PRECISION)
        sq += tl.sum(q * q, axis=1)
    bound = tl.sqrt(sq) * tl.load(BOUND)
    scale = tl.where(bound > 0, tl.exp2(tl.ceil(tl.log2(tl.maximum(bound, 1e-30)))), 1.0)
    i = bh.to(tl.int64) * rows + r
    tl.store(QP + i[:, None] * PW + c[None, :], (y / scale[:, None]).to(tl.float16),
             mask=ok[:, None] & (c[None, :] < PW))
    if cb == 0:
        tl.store(QSC + i, scale, mask=ok)
        if COUNTER_ROWS > 0:
            blocks = tl.cdiv(rows, COUNTER_ROWS)
            j = rb * (BLOCK_R // COUNTER_ROWS) + tl.arange(0, BLOCK_R // COUNTER_ROWS)
            tl.store(COUNTERS + bh * blocks + j, tl.zeros(j.shape, tl.int32), mask=j < blocks)


@triton.jit
def _softmax_step(s, acc, m_i, l_i):
    """One tile of the online softmax: scores s [BLOCK_M, BLOCK_N] -> (probabilities p, acc rescaled, new max,
    new normalizer); the caller adds p V to acc."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2((m_i - shift) * LOG2E)
    p = tl.exp2((s - shift[:, None]) * LOG2E)
    return p, acc * alpha[:, None], m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _compressed_tiles(acc, m_i, l_i, t_lo, t_hi, QP, QSC, KC, KN, VC, VN, bh64, r, rmask, mask_rows, rows, kbytes,
                      vbytes, kc_stride, vc_stride, kn_stride, vn_stride, mask_st, scaling, softcap, KMAG, VMAG,
                      KT0, KT1, KT2, KT3, VT0, VT1, VT2, VT3, KR: tl.constexpr, VR: tl.constexpr,
                      KFP4: tl.constexpr, VFP4: tl.constexpr, KG: tl.constexpr, KGP: tl.constexpr, VG: tl.constexpr,
                      VGP: tl.constexpr, PWK: tl.constexpr, DP: tl.constexpr, MASK_KIND: tl.constexpr,
                      SOFTCAP: tl.constexpr, DECODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax of rows ``r`` over compressed tokens t_lo..t_hi (every one visible to every row),
    values summed in the value encoder's rotated domain -> (acc, m_i, l_i)."""
    qsc = tl.load(QSC + bh64 * rows + r, mask=rmask, other=1.0)
    q_ptr = QP + (bh64 * rows + r)[:, None] * PWK
    for t0 in range(t_lo, t_hi, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tmask = tok < t_hi
        ks, kmax = _token_scales(KN + bh64 * kn_stride, tok, tmask, KG, KGP, KFP4)
        s = _key_scores(q_ptr, rmask[:, None], KC + bh64 * kc_stride, kbytes, tok, tmask, KMAG, KR, DECODE,
                        KT0, KT1, KT2, KT3, KN + bh64 * kn_stride, kmax, KFP4, BLOCK_M, BLOCK_N)
        s = s * qsc[:, None] * ks[None, :] * scaling
        if SOFTCAP:
            s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)  # softcap * tanh(s / softcap)
        s = _masked(s, tmask[None, :] & rmask[:, None], mask_rows + tok[None, :] * mask_st, MASK_KIND)
        p, acc, m_i, l_i = _softmax_step(s, acc, m_i, l_i)
        vs, vmax = _token_scales(VN + bh64 * vn_stride, tok, tmask, VG, VGP, VFP4)
        v = _value_rows(VC + bh64 * vc_stride, vbytes, tok, tmask, VMAG, VR, DECODE, VT0, VT1, VT2, VT3,
                        VN + bh64 * vn_stride, vmax, VG, VGP, VFP4, DP, BLOCK_N)
        acc = tl.dot((p * vs[None, :]).to(tl.float16), v, acc)
    return acc, m_i, l_i


@triton.jit
def _window_tiles(acc, m_i, l_i, t_lo, t_hi, Q, KW, VW, b, bh, hkv, bh64, r, rmask, mask_rows, rows, nq, tc, tw,
                  q_sb, q_sh, q_sq, kw_stride, vw_stride, kw_tstride, vw_tstride, mask_st, scaling, softcap,
                  D: tl.constexpr, DP: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
                  CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax of rows ``r`` over window tokens t_lo..t_hi: query row r (position r % nq of the
    last nq) sees window token j <= tw - nq + r % nq where CAUSAL -> (acc, m_i, l_i)."""
    dcol = tl.arange(0, DP)
    last = tw - nq + r % nq
    q_rows = _query_rows(Q, b, bh % hkv, r, rows, nq, q_sb, q_sh, q_sq)
    q = tl.load(q_rows[:, None] + dcol[None, :], mask=rmask[:, None] & (dcol[None, :] < D), other=0.0)
    q = q.to(tl.float16)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tmask = tok < t_hi
        k = tl.load(KW + bh64 * kw_stride + tok[:, None] * kw_tstride + dcol[None, :],
                    mask=tmask[:, None] & (dcol[None, :] < D), other=0.0).to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * scaling
        if SOFTCAP:
            s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)
        visible = tmask[None, :] & rmask[:, None]
        if CAUSAL:
            visible = visible & (tok[None, :] <= last[:, None])
        s = _masked(s, visible, mask_rows + (tc + tok)[None, :] * mask_st, MASK_KIND)
        p, acc, m_i, l_i = _softmax_step(s, acc, m_i, l_i)
        v = tl.load(VW + bh64 * vw_stride + tok[:, None] * vw_tstride + dcol[None, :],
                    mask=tmask[:, None] & (dcol[None, :] < D), other=0.0).to(tl.float16)
        acc = tl.dot(p.to(tl.float16), v, acc)
    return acc, m_i, l_i


@triton.jit
def _halves(x):
    """x [rows, n] -> (x[:, :n / 2], x[:, n / 2:])."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def _rows_times(x, MV, k0, c0, NC: tl.constexpr, DP: tl.constexpr, PRECISION: tl.constexpr):
    """x [rows, n] times rows k0 .. k0 + n, columns c0 .. c0 + NC of MV float32 [DP, DP]."""
    k = k0 + tl.arange(0, x.shape[1])
    c = c0 + tl.arange(0, NC)
    return tl.dot(x, tl.load(MV + k[:, None] * DP + c[None, :]), input_precision=PRECISION)


@triton.jit
def _rotated_back(acc, MV, c0, NC: tl.constexpr, DP: tl.constexpr, PRECISION: tl.constexpr):
    """Sums acc [rows, DP] in the value encoder's rotated domain, rotated back: columns c0 .. c0 + NC of acc MV
    (MV float32 [DP, DP], the rotation's inverse, zero padded; float32 accuracy). DP 256: four products of 64
    rows of MV each (the whole matrix does not fit in shared memory)."""
    if DP <= 128:
        return _rows_times(acc, MV, 0, c0, NC, DP, PRECISION)
    else:
        h0, h1 = _halves(acc)
        q0, q1 = _halves(h0)
        q2, q3 = _halves(h1)
        out = _rows_times(q0, MV, 0, c0, NC, DP, PRECISION) + _rows_times(q1, MV, DP // 4, c0, NC, DP, PRECISION)
        return out + _rows_times(q2, MV, DP // 2, c0, NC, DP, PRECISION) + \
            _rows_times(q3, MV, 3 * DP // 4, c0, NC, DP, PRECISION)


@triton.jit
def _store_result(acc, total, RES, bh, r, ok, hkv, hq, rows, nq, c0, D: tl.constexpr):
    """acc / total (0 for rows that see no key) in RES's dtype to columns c0 .. c0 + acc.shape[1] of
    RES [B, Q, Hq, D] (rows ``r`` of ``bh``)."""
    d = c0 + tl.arange(0, acc.shape[1])
    res = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1.1754943508222875e-38)[:, None], 0.0)
    b, h = bh // hkv, (bh % hkv) * (rows // nq) + r // nq
    at = ((b.to(tl.int64) * nq + r % nq) * hq + h) * D
    tl.store(RES + at[:, None] + d[None, :], res.to(RES.dtype.element_ty), mask=ok[:, None] & (d[None, :] < D))


@triton.jit(do_not_specialize=("tc", "tw", "splits_c", "nsplit", "first_split", "tokens_per_split"))  # no recompiles
def _attention_kernel(
    QP, QSC, Q, KC, KN, VC, VN, KW, VW, MASK, OUT, M_OUT, L_OUT, MV, RES, LENGTHS,
    hkv, hq, rows, nq, tc, tw, q_sb, q_sh, q_sq, mask_sb, mask_sq, mask_st, kbytes, vbytes, kc_stride, vc_stride,
    kn_stride, vn_stride, kw_stride, vw_stride, kw_tstride, vw_tstride, splits_c, nsplit, first_split,
    tokens_per_split, scaling, softcap,
    KMAG, VMAG, KT0, KT1, KT2, KT3, VT0, VT1, VT2, VT3,
    KR: tl.constexpr, VR: tl.constexpr, KFP4: tl.constexpr, VFP4: tl.constexpr, KG: tl.constexpr, KGP: tl.constexpr,
    VG: tl.constexpr, VGP: tl.constexpr, PWK: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, DECODE: tl.constexpr,
    ONE_PASS: tl.constexpr, PRECISION: tl.constexpr, DEVICE_LENGTHS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (batch row x KV head ``bh``, row block, split first_split + its third index, of nsplit). ONE_PASS
    (one split): the attention of its query rows over every token, the compressed part's sum rotated back by
    MV float32 [DP, DP] (the value rotation's inverse, zero padded) before the window's is added, written to
    RES [B, Q, Hq, D]. Else the partial softmax over the split's tokens (splits < splits_c: compressed tokens;
    the others: window tokens), written to OUT [bh, split, rows, DP] (compressed: the value encoder's rotated
    domain; window: plain), M_OUT / L_OUT [bh, split, rows]. Side data KN / VN: the norms [bh, tokens] of
    direction codes, or (KFP4 / VFP4) the UE8M0 group exponents [bh, tokens, KG / VG] of FP4 codes (kn_stride /
    vn_stride: per bh). DEVICE_LENGTHS: tc and tw are read from LENGTHS int64 [2] (the valid codes and window
    tokens; the arguments are then the capacities the grid was sized for: splits past the codes hold nothing)."""
    if DEVICE_LENGTHS:
        tc = tl.load(LENGTHS).to(tl.int32)
        tw = tl.load(LENGTHS + 1).to(tl.int32)
    bh, mb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2) + first_split
    b = bh // hkv
    bh64 = bh.to(tl.int64)
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < rows
    mask_rows = MASK + b.to(tl.int64) * mask_sb + (r % nq).to(tl.int64)[:, None] * mask_sq  # [BLOCK_M, 1]
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DP), tl.float32)
    if ONE_PASS or sp < splits_c:
        t_lo = 0 if ONE_PASS else sp * tokens_per_split
        t_hi = tc if ONE_PASS else tl.minimum(t_lo + tokens_per_split, tc)
        acc, m_i, l_i = _compressed_tiles(
            acc, m_i, l_i, t_lo, t_hi, QP, QSC, KC, KN, VC, VN, bh64, r, rmask, mask_rows, rows, kbytes, vbytes,
            kc_stride, vc_stride, kn_stride, vn_stride, mask_st, scaling, softcap, KMAG, VMAG, KT0, KT1, KT2, KT3,
            VT0, VT1, VT2, VT3, KR, VR, KFP4, VFP4, KG, KGP, VG, VGP, PWK, DP, MASK_KIND, SOFTCAP, DECODE,
            BLOCK_M, BLOCK_N)
    if ONE_PASS:
        acc = _rotated_back(acc, MV, 0, DP, DP, PRECISION)
        t_hi = tw
        if CAUSAL:  # the window tokens after the block's last query position are masked for all its rows
            t_hi = tl.minimum(tw, tw - nq + tl.max(tl.where(rmask, r % nq, 0)) + 1)
        acc, m_i, l_i = _window_tiles(
            acc, m_i, l_i, 0, t_hi, Q, KW, VW, b, bh, hkv, bh64, r, rmask, mask_rows, rows, nq, tc, tw, q_sb, q_sh,
            q_sq, kw_stride, vw_stride, kw_tstride, vw_tstride, mask_st, scaling, softcap, D, DP, MASK_KIND,
            SOFTCAP, CAUSAL, BLOCK_N)
        _store_result(acc, l_i, RES, bh, r, rmask, hkv, hq, rows, nq, 0, D)
    else:
        if sp >= splits_c:
            per = tl.cdiv(tw, nsplit - splits_c)
            t_lo = (sp - splits_c) * per
            acc, m_i, l_i = _window_tiles(
                acc, m_i, l_i, t_lo, tl.minimum(t_lo + per, tw), Q, KW, VW, b, bh, hkv, bh64, r, rmask, mask_rows,
                rows, nq, tc, tw, q_sb, q_sh, q_sq, kw_stride, vw_stride, kw_tstride, vw_tstride, mask_st, scaling,
                softcap, D, DP, MASK_KIND, SOFTCAP, CAUSAL, BLOCK_N)
        base = (bh64 * nsplit + sp) * rows + r
        tl.store(M_OUT + base, m_i, mask=rmask)
        tl.store(L_OUT + base, l_i, mask=rmask)
        tl.store(OUT + base[:, None] * DP + tl.arange(0, DP)[None, :], acc, mask=rmask[:, None])


@triton.jit
def _merge_split(acc, total, OUT, M, L, at, ok, shift, c0, DP: tl.constexpr):
    """Add columns c0 .. c0 + acc.shape[1] of one split's partial sums (rows at ``at``), weighted by
    exp(m - shift), to acc, and its normalizers to total."""
    m = tl.load(M + at, mask=ok, other=float("-inf"))
    w = tl.where(m > float("-inf"), tl.exp2((m - shift) * LOG2E), 0.0)
    part = tl.load(OUT + at[:, None] * DP + c0 + tl.arange(0, acc.shape[1])[None, :], mask=ok[:, None], other=0.0)
    return acc + part * w[:, None], total + tl.load(L + at, mask=ok, other=0.0) * w


@triton.jit(do_not_specialize=("splits", "splits_c"))
def _merge_kernel(OUT, M, L, MV, RES, hkv, hq, rows, nq, splits, splits_c, D: tl.constexpr, DP: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    """Program (batch row x KV head ``bh``, row block, block of BLOCK_C output columns): the log-sum-exp merge of
    the splits' partial softmaxes (OUT [bh, split, rows, DP], M / L [bh, split, rows]): the compressed splits'
    sum (all DP columns) rotated back by MV float32 [DP, DP] (the value rotation's inverse, zero padded) into
    its columns, plus those columns of the window splits' sum, divided by the normalizer (0 for rows that see no
    key); written in RES's dtype to RES [B, Q, Hq, D]."""
    bh, rb, c0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BLOCK_C
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    base = bh.to(tl.int64) * splits * rows + r
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for sp in tl.range(splits, num_stages=MERGE_STAGES):
        top = tl.maximum(top, tl.load(M + base + sp * rows, mask=ok, other=float("-inf")))
    shift = tl.where(top > float("-inf"), top, 0.0)
    total = tl.zeros((BLOCK_R,), tl.float32)
    acc_c = tl.zeros((BLOCK_R, DP), tl.float32)
    acc_w = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for sp in tl.range(splits_c, num_stages=MERGE_STAGES):  # the compressed splits: in the values' rotated domain
        acc_c, total = _merge_split(acc_c, total, OUT, M, L, base + sp * rows, ok, shift, 0, DP)
    for sp in tl.range(splits_c, splits, num_stages=MERGE_STAGES):  # the window's
        acc_w, total = _merge_split(acc_w, total, OUT, M, L, base + sp * rows, ok, shift, c0, DP)
    acc = _rotated_back(acc_c, MV, c0, BLOCK_C, DP, PRECISION) + acc_w
    _store_result(acc, total, RES, bh, r, ok, hkv, hq, rows, nq, c0, D)


# --------------------------------------------------------------------------------------------------
# host side


def _tables(encoder: Any, device: torch.device, side: str) -> tuple[tuple, Tensor, list[int], Tensor]:
    """What the kernels need of the ``side`` ("keys" or "values") encoder on ``device``: its run's layout
    (constexpr tuple), magnitudes and prmt words (the scan's tables; FP4: of its ``level_run``), and a
    float32 matrix, zero padded to
    powers of two: for keys [DP, PWP], row j the rotation's image of coordinate j in planar order (the
    query map); for values [DP, DP], row j the rotated domain's coordinate j rotated back."""
    if hasattr(encoder, "level_run"):  # FP4: one 4-bit run of the E2M1 levels, one scale group per k-step
        runs, mags, _ = run_layouts([encoder.level_run()], max_step=FP4_GROUP // 2)
        layouts, mags = tuple(tuple(r) for r in runs), mags.to(device)
        prmt = prmt_tables(mags, runs)
    else:
        layouts, mags, prmt, _ = _scan_tables(encoder, device)
    dim = encoder.dim
    eye = torch.eye(dim, device=device)
    image = to_planes(encoder.rotate(eye), [RunLayout(*layouts[0])]) if side == "keys" else encoder.rotate_back(eye)
    matrix = torch.zeros(next_power_of_2(dim), next_power_of_2(image.shape[1]), device=device)
    matrix[:dim, : image.shape[1]] = image
    return layouts[0], mags, prmt[:4], matrix


def _key_tables(encoder: Any, device: torch.device) -> tuple[tuple, Tensor, list[int], Tensor, Tensor]:
    """:func:`_tables` of the keys' encoder, and its query map's largest column norm (float32 [1]: the query
    kernel's bound on a rotated coordinate per unit of query norm)."""
    layout, mags, prmt, matrix = _tables(encoder, device, "keys")
    return layout, mags, prmt, matrix, matrix.norm(dim=0).amax().reshape(1)


def _columns(width: int, blocks: int, sms: int) -> int:
    """Output columns per program of the query or merge kernel over ``width`` columns (a power of two) for
    ``blocks`` row blocks on ``sms`` multiprocessors (MERGE_COLUMNS notes): the width split into as many parts as
    fill the multiprocessors once, down to MERGE_COLUMNS."""
    parts = next_power_of_2(cdiv(sms, blocks))
    return max(min(MERGE_COLUMNS, width), width // parts)


def mask_layout(mask: Tensor | None, b: int, nq: int, total: int) -> tuple[Tensor | None, tuple[int, int, int], int]:
    """The kernel's view of an attention mask [B|1, 1, Q, T] (bool, True = attend, or additive float):
    (the mask or None, its batch / query / token strides, MASK_KIND 0 / 1 / 2). Masks per query head are
    not read by the kernel (ValueError)."""
    if mask is None:
        return None, (0, 0, 0), 0
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, b) or mask.shape[2:] != (nq, total):
        raise ValueError(f"the attention kernel reads masks [B|1, 1, {nq}, {total}], got {tuple(mask.shape)}")
    m = mask.expand(b, 1, nq, total)
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
        return m, (m.stride(0), m.stride(2), m.stride(3)), 1
    m = m.float()
    return m, (m.stride(0), m.stride(2), m.stride(3)), 2


def compressed_attention_triton(q: Tensor, keys: Any, values: Any, mask: Tensor | None, scaling: float,
                                softcap: float | None = None, causal: bool = True, decode: int | None = None,
                                one_pass: bool | None = None, lengths: Tensor | None = None, cuda: bool = False
                                ) -> Tensor:
    """:func:`tqindex.kv.attention.compressed_attention` by the kernels of the module notes: the queries'
    rotation into planar order, then the split-K attention and its merge, or one pass. q [B, Hq, Q, D] (any
    strides); keys / values CompressedTokens [B, Hkv, T, D] whose codes the kernels read (``attention_reads``);
    mask None (then causal over the window) or [B|1, 1, Q, T] (:func:`mask_layout`). Returns [B, Hq, Q, D] in
    q's dtype, a view of a [B, Q, Hq, D] tensor (the layout attention layers pass on). ``one_pass``: each
    program takes all tokens of its rows (module notes; default: where the row blocks alone fill the card).
    ``lengths``: int64 [2] on q's device, the valid codes and window tokens, read by the kernel (the codes and
    the window are then buffers of that capacity and ``mask`` is None): the launches depend on the capacities
    only, so that a CUDA graph replays them as the buffers fill. ``cuda``: the compressed splits of a split-K
    step with no mask and no soft cap (f16 or bf16 queries) are computed by the CUDA C++ kernel where it runs them
    (:func:`.attention_cuda.plan`, whose ``reads`` the caller checked), after the window's splits by the Triton
    kernel, and also merged by it where :func:`.attention_cuda.merges`."""
    bsz, hq, nq, dim = q.shape
    hkv, tc, tw = keys.shape[1], keys.codes.shape[2], keys.window.shape[2]
    rows, device = (hq // hkv) * nq, q.device
    kr, kmag, kt, mq, bound = keys.encoder.derived(device, "triton-attention-keys",
                                                   lambda: _key_tables(keys.encoder, device))
    vr, vmag, vt, mv = values.encoder.derived(device, "triton-attention-values",
                                              lambda: _tables(values.encoder, device, "values"))
    q = q if q.stride(-1) == 1 else q.contiguous()
    dp = next_power_of_2(dim)
    pw = kr[2] * kr[4]  # the key run's planes x padded groups
    block_m = 16 if rows <= 16 else 64
    row_blocks = cdiv(rows, block_m)
    precision = "tf32x3" if q.is_cuda else "ieee"  # float32 accuracy on tensor cores (the interpreter: ieee)
    sms = multiprocessors(device)
    want = cdiv(PROGRAMS_PER_SM * sms, bsz * hkv * row_blocks)
    one_pass = want == 1 if one_pass is None else one_pass
    if one_pass and rows >= ONE_PASS_ROWS:
        block_m = ONE_PASS_ROWS
        row_blocks = cdiv(rows, block_m)
    mask_t, (msb, msq, mst), mask_kind = mask_layout(mask, bsz, nq, tc + tw)
    splits_w = cdiv(tw, WINDOW_SPLIT) if tw else 0
    module = None  # the CUDA kernel's, where it computes the compressed splits
    if cuda and tc and not one_pass and mask_t is None and softcap is None and q.dtype != torch.float32:
        module = attention_cuda.plan(keys, values, rows, splits_w)
    fused = module is not None and attention_cuda.merges(bsz * hkv, rows)  # the CUDA kernel also merges
    splits_c, per = 0, BLOCK_N
    if tc and not one_pass:
        if module:
            n = attention_cuda.splits(tc, bsz * hkv * cdiv(rows, attention_cuda.ROWS), sms, fused)
        else:
            n = min(want, cdiv(tc, MIN_SPLIT_TOKENS))
        most = attention_cuda.MAX_SPLITS - splits_w if fused else n
        per = cdiv(cdiv(tc, min(n, most)), BLOCK_N) * BLOCK_N
        splits_c = cdiv(tc, per)
    splits = 1 if one_pass else splits_c + splits_w
    qp = torch.empty(bsz * hkv * rows, pw, device=device, dtype=torch.float16)
    qsc = torch.empty(bsz * hkv * rows, device=device)
    res = torch.empty(bsz, nq, hq, dim, device=device, dtype=q.dtype)
    out = res if one_pass else torch.empty(bsz * hkv, splits, rows, dp, device=device)
    m = qsc if one_pass else torch.empty(bsz * hkv, splits, rows, device=device)  # (one pass: unused pointers)
    l_ = m if one_pass else torch.empty_like(m)
    kq, vq = keys.codes.qdata, values.codes.qdata  # [B, Hkv, capacity, bytes], batch-major
    kfp4, vfp4 = keys.codes.norm is None, values.codes.norm is None  # FP4: group exponents instead of norms
    kn = keys.codes.scale if kfp4 else keys.codes.norm
    vn = values.codes.scale if vfp4 else values.codes.norm
    kg, vg = (side.shape[-1] if fp4 else 1 for side, fp4 in ((kn, kfp4), (vn, vfp4)))
    kw, vw = keys.window.contiguous(), values.window.contiguous()
    dec = default_decode(device) if decode is None else decode
    first = splits_c if module else 0
    counters = torch.empty(bsz * hkv * cdiv(rows, attention_cuda.ROWS), device=device, dtype=torch.int32) \
        if fused else None
    qcols, mcols = (_columns(width, bsz * hkv * cdiv(rows, MERGE_ROWS), sms) for width in (mq.shape[1], dp))
    _query_kernel[(bsz * hkv, cdiv(rows, MERGE_ROWS), mq.shape[1] // qcols)](
        q, mq, bound, qp, qsc, qsc if counters is None else counters, hkv, rows, nq, q.stride(0), q.stride(1),
        q.stride(2), D=dim, DP=dp, PW=pw, PWP=mq.shape[1], BLOCK_R=MERGE_ROWS, BLOCK_C=qcols,
        COUNTER_ROWS=attention_cuda.ROWS if fused else 0, PRECISION=precision, num_warps=4)
    if splits > first:
        _attention_kernel[(bsz * hkv, row_blocks, splits - first)](
            qp, qsc, q, kq, kn, vq, vn, kw, vw, qsc if mask_t is None else mask_t, out, m, l_, mv, res,
            qsc if lengths is None else lengths, hkv, hq, rows, nq, tc, tw, q.stride(0), q.stride(1), q.stride(2), msb,
            msq, mst, kq.shape[-1], vq.shape[-1], kq.stride(1), vq.stride(1), kn.stride(1), vn.stride(1), kw.stride(1),
            vw.stride(1), kw.stride(2), vw.stride(2), splits_c, splits, first, per, scaling, softcap or 1.0, kmag,
            vmag, *kt, *vt,
            KR=kr, VR=vr, KFP4=kfp4, VFP4=vfp4, KG=kg, KGP=next_power_of_2(kg), VG=vg, VGP=next_power_of_2(vg),
            PWK=pw, D=dim, DP=dp, MASK_KIND=mask_kind, SOFTCAP=softcap is not None, CAUSAL=causal and mask is None,
            DECODE=dec, ONE_PASS=one_pass, PRECISION=precision, DEVICE_LENGTHS=lengths is not None,
            BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            num_warps=8 if block_m > 16 or kr[0] == 8 else DECODE_WARPS, num_stages=NUM_STAGES)
    if module:
        attention_cuda.decode_step(module, qp, qsc, counters, keys, values, out, m, l_, lengths, rows, splits_c, per,
                                   scaling, kr, kmag, kt, vt, mv, res)
    if not one_pass and not fused:
        _merge_kernel[(bsz * hkv, cdiv(rows, MERGE_ROWS), dp // mcols)](
            out, m, l_, mv, res, hkv, hq, rows, nq, splits, splits_c, D=dim, DP=dp, BLOCK_R=MERGE_ROWS,
            BLOCK_C=mcols, PRECISION=precision, num_warps=4)
    return res.transpose(1, 2)
