/* Direction codes of TurboQuant Q_mse (the fast path of turboquant.encode_directions).
 *
 * Each row x [d] is rotated (y = R x with R [d, d] row-major, or y = x without R) and taken to its
 * direction u = y / ||y||. Its coordinates form runs, each with its own codebook or none (a run left
 * out of the code). For each pre-scale alpha (alphas[0..A)) the nearest level of alpha * u_i is taken
 * per coded coordinate; the kernel keeps, per row, the alpha whose code c maximizes
 * cos(u, c) = <u, c> / ||c|| (the first on ties) and writes that code bit-packed, each coded run as
 * its own little-endian stream of ceil(len * bits / 8) bytes (packing.c), one run after the other,
 * with ||y||, <u, c> and ||c||^2.
 *
 * A codebook must be symmetric with 2H = 2^bits levels (H <= 8): positive levels pos_levels [H]
 * ascending and the H - 1 positive boundaries between them, so a coordinate's level is
 * sign(u_i) * pos_levels[j] with j = #{boundaries < alpha |u_i|}, and its index in the full ascending
 * codebook is H + j for u_i > 0 and H - 1 - j otherwise. With H <= 8 the positive levels fit one AVX2
 * register, and the boundary count is H - 1 compares.
 *
 * Called through ctypes (tqindex/native.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define TQ_X86 1
#include <immintrin.h>
#endif

#define MAX_H 8

static inline int level_of(float v, const float *bounds, int nb) {
    int j = 0;
    for (int k = 0; k < nb; k++) j += v > bounds[k];
    return j;
}

void tq_pack_row(const uint8_t *c, int64_t d, int64_t bits, uint8_t *o); /* packing.c */

/* One run's code at pre-scale alpha, packed at out (bits per code, little-endian stream): the index
 * in the full ascending codebook of the level of each coordinate, from its sign sy and |u| ay
 * (portable loop, 8 codes at a time). */
static void write_packed_generic(const float *sy, const float *ay, int64_t len, float alpha, const float *bd, int nb,
                                 int h, int bits, uint8_t *out) {
    for (int64_t i = 0; i < len; i += 8, out += bits) {
        uint8_t code[8];
        int64_t m = len - i < 8 ? len - i : 8;
        for (int64_t k = 0; k < m; k++) {
            int j = level_of(alpha * ay[i + k], bd, nb);
            code[k] = (uint8_t)(sy[i + k] > 0.f ? h + j : h - 1 - j);
        }
        tq_pack_row(code, m, bits, out);
    }
}

/* <|u|, level(alpha |u|)> and the sum of squared levels over one run (portable loop). */
static void alpha_sums_generic(const float *ay, int64_t d, float alpha, const float *lv, const float *bd, int nb,
                               float *dot, float *sq) {
    float s = 0.f, q = 0.f;
    for (int64_t i = 0; i < d; i++) {
        float l = lv[level_of(alpha * ay[i], bd, nb)];
        s += l * ay[i];
        q += l * l;
    }
    *dot = s, *sq = q;
}

/* One run of coordinates: its codebook half (levels padded to MAX_H, nb = H - 1 boundaries), its length,
 * its slot in the row's buffers of |u| and y (8-aligned, len rounded up to 8 floats, zeros past len), and
 * its code's bits per coordinate and packed bytes. */
typedef struct {
    int64_t len, slot;
    const float *levels, *bounds;
    int nb, bits;
    int64_t nbytes;
} run_t;

/* The pre-scale (first on ties) whose code maximizes cos(u, c) over the row's runs, with that code's
 * <|u|, |c|> = <u, c> and ||c||^2 (portable loop). */
static void best_alpha_generic(const float *ay, const run_t *runs, int64_t nrun, const float *alphas, int64_t A,
                               float *balpha, float *bdot, float *bsq) {
    float best = -INFINITY;
    *balpha = alphas[0], *bdot = 0.f, *bsq = 0.f;
    for (int64_t a = 0; a < A; a++) {
        float s_all = 0.f, q_all = 0.f;
        for (int64_t r = 0; r < nrun; r++) {
            float sv, qv;
            alpha_sums_generic(ay + runs[r].slot, runs[r].len, alphas[a], runs[r].levels, runs[r].bounds, runs[r].nb, &sv, &qv);
            s_all += sv, q_all += qv;
        }
        float c = q_all > 0.f ? s_all / sqrtf(q_all) : 0.f;
        if (c > best) best = c, *bdot = s_all, *bsq = q_all, *balpha = alphas[a];
    }
}

#ifdef TQ_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* Lanes [0, m) set (m in 1..8). */
AVX2 static inline __m256i tail_mask(int64_t m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* S[a] += <l, y>, Q[a] += <l, l> for na pre-scales al[a] over one run's slot yr (l: the levels of
 * al[a]·y, zero past len). Inlined with constant na and nb, so the alphas and boundary compares unroll
 * and the accumulators stay in registers: each slice of y is loaded once for all pre-scales. */
__attribute__((always_inline)) AVX2 static inline void run_sums(const float *yr, int64_t len, const __m256 *al, int na,
                                                                __m256 levels, const __m256 *b, int nb, __m256 *S,
                                                                __m256 *Q) {
    for (int64_t i = 0; i < len; i += 8) {
        __m256 y = _mm256_loadu_ps(yr + i);
        __m256 keep = _mm256_castsi256_ps(i + 8 > len ? tail_mask(len - i) : _mm256_set1_epi32(-1));
        for (int a = 0; a < na; a++) {
            __m256 v = _mm256_mul_ps(y, al[a]);
            __m256i j = _mm256_setzero_si256();
            for (int k = 0; k < nb; k++) j = _mm256_sub_epi32(j, _mm256_castps_si256(_mm256_cmp_ps(v, b[k], _CMP_GT_OQ)));
            __m256 l = _mm256_and_ps(_mm256_permutevar8x32_ps(levels, j), keep);
            S[a] = _mm256_fmadd_ps(l, y, S[a]);
            Q[a] = _mm256_fmadd_ps(l, l, Q[a]);
        }
    }
}

/* run_sums over all runs of a row, from zero; the codebooks of 1, 2, 3 and 4 bits get constant nb. */
__attribute__((always_inline)) AVX2 static inline void row_sums(const float *ay, const run_t *runs, int64_t nrun,
                                                                const __m256 *al, int na, __m256 *S, __m256 *Q) {
    for (int a = 0; a < na; a++) S[a] = Q[a] = _mm256_setzero_ps();
    for (int64_t r = 0; r < nrun; r++) {
        const run_t *run = runs + r;
        const float *yr = ay + run->slot;
        __m256 levels = _mm256_loadu_ps(run->levels), b[MAX_H];
        for (int k = 0; k < run->nb; k++) b[k] = _mm256_set1_ps(run->bounds[k]);
        switch (run->nb) {
        case 0: run_sums(yr, run->len, al, na, levels, b, 0, S, Q); break;
        case 1: run_sums(yr, run->len, al, na, levels, b, 1, S, Q); break;
        case 3: run_sums(yr, run->len, al, na, levels, b, 3, S, Q); break;
        case 7: run_sums(yr, run->len, al, na, levels, b, 7, S, Q); break;
        default: run_sums(yr, run->len, al, na, levels, b, run->nb, S, Q);
        }
    }
}

/* [hsum(v[0]), ..., hsum(v[7])] */
AVX2 static inline __m256 hsum8(const __m256 *v) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The best pre-scale of one row (see best_alpha_generic), 8 pre-scales at a time (7, the default
 * search, exactly; others padded with the last one). */
AVX2 static void best_alpha_avx2(const float *ay, const run_t *runs, int64_t nrun, const float *alphas, int64_t A,
                                 float *balpha, float *bdot, float *bsq) {
    float best = -INFINITY;
    *balpha = alphas[0], *bdot = 0.f, *bsq = 0.f;
    if (A == 1) {  /* nothing to choose */
        __m256 al = _mm256_set1_ps(alphas[0]), S, Q;
        row_sums(ay, runs, nrun, &al, 1, &S, &Q);
        *bdot = hsum(S), *bsq = hsum(Q);
        return;
    }
    for (int64_t a0 = 0; a0 < A; a0 += 8) {
        int na = A - a0 < 8 ? (int)(A - a0) : 8;
        __m256 al[8], S[8], Q[8];
        for (int a = 0; a < 8; a++) al[a] = _mm256_set1_ps(alphas[a0 + (a < na ? a : na - 1)]);
        int width = na == 7 ? 7 : 8;
        if (width == 7) row_sums(ay, runs, nrun, al, 7, S, Q);
        else row_sums(ay, runs, nrun, al, 8, S, Q);
        for (int a = width; a < 8; a++) S[a] = Q[a] = _mm256_setzero_ps();
        __m256 s = hsum8(S), q = hsum8(Q);
        __m256 c = _mm256_and_ps(_mm256_div_ps(s, _mm256_sqrt_ps(q)), _mm256_cmp_ps(q, _mm256_setzero_ps(), _CMP_GT_OQ));
        float sv[8], qv[8], cv[8];
        _mm256_storeu_ps(sv, s), _mm256_storeu_ps(qv, q), _mm256_storeu_ps(cv, c);
        for (int a = 0; a < na; a++)
            if (cv[a] > best) best = cv[a], *bdot = sv[a], *bsq = qv[a], *balpha = alphas[a0 + a];
    }
}

/* write_packed_generic with 8 codes per step: shifted to their bit offsets and OR-ed into one word,
 * whose low `bits` bytes are the packed group. sy and ay are read in whole vectors (zeros past len). */
AVX2 static void write_packed_avx2(const float *sy, const float *ay, int64_t len, float alpha, const float *bd, int nb,
                                   int h, int bits, uint8_t *out) {
    __m256 a = _mm256_set1_ps(alpha), zero = _mm256_setzero_ps();
    __m256i hv = _mm256_set1_epi32(h), hm1 = _mm256_set1_epi32(h - 1);
    __m256i shift = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    __m256 b[MAX_H];
    for (int k = 0; k < nb; k++) b[k] = _mm256_set1_ps(bd[k]);
    for (int64_t i = 0; i < len; i += 8, out += bits) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(ay + i), a);
        __m256i j = _mm256_setzero_si256();
        for (int k = 0; k < nb; k++) j = _mm256_sub_epi32(j, _mm256_castps_si256(_mm256_cmp_ps(v, b[k], _CMP_GT_OQ)));
        __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(sy + i), zero, _CMP_GT_OQ));
        __m256i code = _mm256_blendv_epi8(_mm256_sub_epi32(hm1, j), _mm256_add_epi32(hv, j), pos);
        if (i + 8 > len) code = _mm256_and_si256(code, tail_mask(len - i));
        __m256i w = _mm256_sllv_epi32(code, shift);
        __m128i o = _mm_or_si128(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0x4E));
        o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0xB1));
        uint32_t word = (uint32_t)_mm_cvtsi128_si32(o);
        memcpy(out, &word, (size_t)(i + 8 <= len ? bits : ((len - i) * bits + 7) / 8));
    }
}

/* Rows [4 or 1] x columns [16 or 8] of y = x Rt (tile of rotate_avx2), inlined with constant nr, nc. */
__attribute__((always_inline)) AVX2 static inline void rotate_tile(const float *x, int64_t d, int nr, int nc,
                                                                   const float *rt, int64_t dpad, float *y) {
    __m256 acc[4][2];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < d; k++) {
        __m256 b[2];
        for (int c = 0; c < nc; c++) b[c] = _mm256_loadu_ps(rt + k * dpad + 8 * c);
        for (int r = 0; r < nr; r++) {
            __m256 xv = _mm256_broadcast_ss(x + r * d + k);
            for (int c = 0; c < nc; c++) acc[r][c] = _mm256_fmadd_ps(xv, b[c], acc[r][c]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) _mm256_storeu_ps(y + r * dpad + 8 * c, acc[r][c]);
}

/* y [nr, dpad] = x [nr, d] Rt with Rt [d, dpad] (R transposed, zero columns past d), tiles of 4 rows
 * by 16 columns held in registers while Rt streams from L1/L2. */
AVX2 static void rotate_avx2(const float *x, int64_t nr, int64_t d, const float *rt, int64_t dpad, float *y) {
    for (int64_t c0 = 0; c0 < dpad; c0 += 16) {
        int wide = dpad - c0 >= 16;
        int64_t r = 0;
        for (; r + 4 <= nr; r += 4) {
            if (wide) rotate_tile(x + r * d, d, 4, 2, rt + c0, dpad, y + r * dpad + c0);
            else rotate_tile(x + r * d, d, 4, 1, rt + c0, dpad, y + r * dpad + c0);
        }
        for (; r < nr; r++) {
            if (wide) rotate_tile(x + r * d, d, 1, 2, rt + c0, dpad, y + r * dpad + c0);
            else rotate_tile(x + r * d, d, 1, 1, rt + c0, dpad, y + r * dpad + c0);
        }
    }
}

/* ||row|| over d coordinates, and each coded run's part of the row in its slots: y in sy, |y| / ||y|| in ay. */
AVX2 static float prepare_row_avx2(const float *row, int64_t d, const run_t *runs, const int64_t *col, int64_t nrun,
                                   float *ay, float *sy) {
    __m256 q = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 x = d - i >= 8 ? _mm256_loadu_ps(row + i) : _mm256_maskload_ps(row + i, tail_mask(d - i));
        q = _mm256_fmadd_ps(x, x, q);
    }
    float len = sqrtf(hsum(q));
    __m256 div = _mm256_set1_ps(len > 0.f ? len : 1.f), sign = _mm256_set1_ps(-0.f);
    for (int64_t r = 0; r < nrun; r++) {
        const float *src = row + col[r];
        float *a = ay + runs[r].slot, *v = sy + runs[r].slot;
        for (int64_t i = 0; i < runs[r].len; i += 8) {
            __m256 x = runs[r].len - i >= 8 ? _mm256_loadu_ps(src + i) : _mm256_maskload_ps(src + i, tail_mask(runs[r].len - i));
            _mm256_storeu_ps(v + i, x);
            _mm256_storeu_ps(a + i, _mm256_div_ps(_mm256_andnot_ps(sign, x), div));
        }
    }
    return len;
}
#endif

/* Portable rotate_avx2: y [nr, dpad] = x [nr, d] Rt. */
static void rotate_generic(const float *x, int64_t nr, int64_t d, const float *rt, int64_t dpad, float *y) {
    for (int64_t r = 0; r < nr; r++) {
        float *yr = y + r * dpad;
        memset(yr, 0, sizeof(float) * (size_t)dpad);
        for (int64_t k = 0; k < d; k++)
            for (int64_t j = 0; j < dpad; j++) yr[j] += x[r * d + k] * rt[k * dpad + j];
    }
}

static float prepare_row_generic(const float *row, int64_t d, const run_t *runs, const int64_t *col, int64_t nrun,
                                 float *ay, float *sy) {
    float q = 0.f;
    for (int64_t i = 0; i < d; i++) q += row[i] * row[i];
    float len = sqrtf(q), div = len > 0.f ? len : 1.f;
    for (int64_t r = 0; r < nrun; r++)
        for (int64_t i = 0; i < runs[r].len; i++) {
            float x = row[col[r] + i];
            sy[runs[r].slot + i] = x, ay[runs[r].slot + i] = fabsf(x) / div;
        }
    return len;
}

typedef void (*row_fn)(const float *, const run_t *, int64_t, const float *, int64_t, float *, float *, float *);
typedef void (*codes_fn)(const float *, const float *, int64_t, float, const float *, int, int, int, uint8_t *);
typedef void (*rotate_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *);
typedef float (*prepare_fn)(const float *, int64_t, const run_t *, const int64_t *, int64_t, float *, float *);

static int use_simd(int allow_simd) {
#ifdef TQ_X86
    return allow_simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    (void)allow_simd;
    return 0;
#endif
}

#define ROTATE_ROWS 16 /* rows rotated per block */

/* x [n, d] float32 rows (rotated by rot [d, d] row-major, y = rot x, unless rot is NULL) whose
 * coordinates form nseg runs: run s covers seg_len[s] coordinates; with seg_H[s] = 0 it is left out of
 * the code, else it uses a codebook of 2 seg_H[s] levels (seg_H in 1, 2, 4, 8) with positive levels
 * pos_levels[s * 8 + j], j < seg_H[s], and positive boundaries pos_bounds[s * 8 + j], j < seg_H[s] - 1
 * (see the file comment; one pre-scale alpha serves every run). Writes qdata [n, row_bytes] (the coded
 * runs packed one after the other), norm [n] = ||y||, dot [n] = <u, c> and sq [n] = ||c||^2 of the
 * chosen code. Returns 0, -1 for bad runs (seg_H not 0, 1, 2, 4 or 8, lengths not summing to d, packed
 * sizes not summing to row_bytes), -2 when out of memory. */
int tq_encode_directions(const float *x, int64_t n, int64_t d, const float *rot, const float *alphas, int64_t A,
                         int64_t nseg, const int64_t *seg_len, const int64_t *seg_H, const float *pos_levels,
                         const float *pos_bounds, uint8_t *qdata, int64_t row_bytes, float *norm, float *dot,
                         float *sq, int allow_simd) {
    int64_t total = 0, slots = 0, bytes = 0, dpad = (d + 7) / 8 * 8;
    for (int64_t s = 0; s < nseg; s++) {
        int64_t h = seg_H[s];
        if ((h != 0 && h != 1 && h != 2 && h != 4 && h != 8) || seg_len[s] < 0) return -1;
        total += seg_len[s];
        if (h) slots += (seg_len[s] + 7) / 8 * 8, bytes += (seg_len[s] * __builtin_ctzll(2 * h) + 7) / 8;
    }
    if (total != d || bytes != row_bytes) return -1;
    row_fn best_alpha = best_alpha_generic;
    codes_fn write_packed = write_packed_generic;
    rotate_fn rotate = rotate_generic;
    prepare_fn prepare_row = prepare_row_generic;
#ifdef TQ_X86
    if (use_simd(allow_simd))
        best_alpha = best_alpha_avx2, write_packed = write_packed_avx2, rotate = rotate_avx2, prepare_row = prepare_row_avx2;
#endif
    float *lv = calloc((size_t)(nseg * MAX_H + 1), sizeof(float)), *bd = calloc((size_t)(nseg * MAX_H + 1), sizeof(float));
    float *ay = calloc((size_t)(2 * slots + 1), sizeof(float)), *sy = ay + slots;  /* |u| and y of each coded run
                                                                                    * in its slot, zeros after */
    float *rt = rot ? calloc((size_t)(d * dpad), sizeof(float)) : NULL;  /* rot transposed, zero columns past d */
    float *yb = rot ? malloc(sizeof(float) * (size_t)(ROTATE_ROWS * dpad)) : NULL;
    run_t *runs = malloc(sizeof(run_t) * (size_t)(nseg + 1));
    int64_t *col = malloc(sizeof(int64_t) * (size_t)(nseg + 1)), ncoded = 0;
    if (!lv || !bd || !ay || (rot && (!rt || !yb)) || !runs || !col) {
        free(lv), free(bd), free(ay), free(rt), free(yb), free(runs), free(col);
        return -2;
    }
    for (int64_t s = 0, slot = 0, c = 0; s < nseg; c += seg_len[s++]) {  /* levels padded to MAX_H: AVX2 loads 8 */
        if (!seg_H[s]) continue;
        memcpy(lv + s * MAX_H, pos_levels + s * MAX_H, sizeof(float) * (size_t)seg_H[s]);
        memcpy(bd + s * MAX_H, pos_bounds + s * MAX_H, sizeof(float) * (size_t)(seg_H[s] - 1));
        int bits = __builtin_ctzll(2 * seg_H[s]);
        runs[ncoded] = (run_t){seg_len[s], slot, lv + s * MAX_H, bd + s * MAX_H, (int)seg_H[s] - 1, bits,
                               (seg_len[s] * bits + 7) / 8};
        col[ncoded++] = c;
        slot += (seg_len[s] + 7) / 8 * 8;
    }
    if (rot)
        for (int64_t j = 0; j < d; j++)
            for (int64_t k = 0; k < d; k++) rt[k * dpad + j] = rot[j * d + k];
    for (int64_t r0 = 0; r0 < n; r0 += ROTATE_ROWS) {
        int64_t nr = n - r0 < ROTATE_ROWS ? n - r0 : ROTATE_ROWS, ld = rot ? dpad : d;
        const float *block = x + r0 * d;
        if (rot) rotate(block, nr, d, rt, dpad, yb), block = yb;
        for (int64_t i = 0; i < nr; i++) {
            const float *row = block + i * ld;
            int64_t r = r0 + i;
            float len = prepare_row(row, d, runs, col, ncoded, ay, sy);
            float balpha, bdot, bsq;
            best_alpha(ay, runs, ncoded, alphas, A, &balpha, &bdot, &bsq);
            uint8_t *out = qdata + r * row_bytes;
            for (int64_t s = 0; s < ncoded; out += runs[s++].nbytes)
                write_packed(sy + runs[s].slot, ay + runs[s].slot, runs[s].len, balpha, runs[s].bounds, runs[s].nb,
                             runs[s].nb + 1, runs[s].bits, out);
            norm[r] = len, dot[r] = bdot, sq[r] = bsq;
        }
    }
    free(lv), free(bd), free(ay), free(rt), free(yb), free(runs), free(col);
    return 0;
}
