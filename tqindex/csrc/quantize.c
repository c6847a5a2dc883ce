/* Direction search of TurboQuant Q_mse codes (the fast path of turboquant.direction_search).
 *
 * For each rotated row y [d] and each pre-scale alpha (alphas[0..A)), the nearest codebook level of
 * alpha * y_i is taken per coordinate; the kernel keeps, per row, the alpha whose code c maximizes
 * cos(y, c) = <y, c> / ||c|| (the first on ties) and writes that code's indices with <y, c> and ||c||^2.
 *
 * The codebook must be symmetric with an even number 2H of levels (H <= 8): positive levels
 * pos_levels [H] ascending and the H - 1 positive boundaries between them, so a coordinate's level
 * is sign(y_i) * pos_levels[j] with j = #{boundaries < alpha |y_i|}, and its index in the full
 * ascending codebook is H + j for y_i > 0 and H - 1 - j otherwise. With H <= 8 the positive levels
 * fit one AVX2 register, and the boundary count is H - 1 compares.
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

/* Full-codebook indices of one row's levels at pre-scale alpha (portable loop). */
static void write_codes_generic(const float *row, const float *ay, int64_t d, float alpha, const float *bd, int nb,
                                int h, uint8_t *out) {
    for (int64_t i = 0; i < d; i++) {
        int j = level_of(alpha * ay[i], bd, nb);
        out[i] = (uint8_t)(row[i] > 0.f ? h + j : h - 1 - j);
    }
}

/* <|y|, level(alpha |y|)> and the sum of squared levels over one row (portable loop). */
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

/* One run of coordinates: its codebook half (levels padded to MAX_H, nb = H - 1 boundaries), its length
 * and its slot in the row's |y| buffer (8-aligned, len rounded up to 8 floats, zeros past len). */
typedef struct {
    int64_t len, slot;
    const float *levels, *bounds;
    int nb;
} run_t;

/* The pre-scale (first on ties) whose code maximizes cos(y, c) over the row's runs, with that code's
 * <|y|, |c|> = <y, c> and ||c||^2 (portable loop). */
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

/* s += <l, y>, q += <l, l> over one run's slot yr at pre-scale al (l: the levels of al·y, zero past len).
 * Inlined with a constant nb at each call of run_sums_nb, so the boundary compares unroll. */
__attribute__((always_inline)) AVX2 static inline void run_sums(const float *yr, int64_t len, __m256 al, __m256 levels,
                                                                const __m256 *b, int nb, __m256 *s, __m256 *q) {
    for (int64_t i = 0; i < len; i += 8) {
        __m256 y = _mm256_loadu_ps(yr + i), v = _mm256_mul_ps(y, al);
        __m256i j = _mm256_setzero_si256();
        for (int k = 0; k < nb; k++) j = _mm256_sub_epi32(j, _mm256_castps_si256(_mm256_cmp_ps(v, b[k], _CMP_GT_OQ)));
        __m256 l = _mm256_permutevar8x32_ps(levels, j);
        if (i + 8 > len) l = _mm256_and_ps(l, _mm256_castsi256_ps(tail_mask(len - i)));
        *s = _mm256_fmadd_ps(l, y, *s);
        *q = _mm256_fmadd_ps(l, l, *q);
    }
}

AVX2 static void run_sums_nb(const float *yr, int64_t len, __m256 al, __m256 levels, const __m256 *b, int nb,
                             __m256 *s, __m256 *q) {
    switch (nb) {  /* the codebooks of 1, 2, 3 and 4 bits */
    case 0: run_sums(yr, len, al, levels, b, 0, s, q); break;
    case 1: run_sums(yr, len, al, levels, b, 1, s, q); break;
    case 3: run_sums(yr, len, al, levels, b, 3, s, q); break;
    case 7: run_sums(yr, len, al, levels, b, 7, s, q); break;
    default: run_sums(yr, len, al, levels, b, nb, s, q);
    }
}

/* The best pre-scale of one row (see best_alpha_generic): each run's |y| is read from its slot 8
 * coordinates at a time, its codebook held in registers over up to 8 pre-scales at once. */
AVX2 static void best_alpha_avx2(const float *ay, const run_t *runs, int64_t nrun, const float *alphas, int64_t A,
                                 float *balpha, float *bdot, float *bsq) {
    float best = -INFINITY;
    *balpha = alphas[0], *bdot = 0.f, *bsq = 0.f;
    for (int64_t a0 = 0; a0 < A; a0 += 8) {
        int64_t na = A - a0 < 8 ? A - a0 : 8;
        __m256 S[8], Q[8], b[MAX_H];
        for (int64_t a = 0; a < na; a++) S[a] = Q[a] = _mm256_setzero_ps();
        for (int64_t r = 0; r < nrun; r++) {
            const run_t *run = runs + r;
            __m256 levels = _mm256_loadu_ps(run->levels);
            for (int k = 0; k < run->nb; k++) b[k] = _mm256_set1_ps(run->bounds[k]);
            for (int64_t a = 0; a < na; a++)
                run_sums_nb(ay + run->slot, run->len, _mm256_set1_ps(alphas[a0 + a]), levels, b, run->nb, S + a, Q + a);
        }
        for (int64_t a = 0; a < na; a++) {
            float sv = hsum(S[a]), qv = hsum(Q[a]), c = qv > 0.f ? sv / sqrtf(qv) : 0.f;
            if (c > best) best = c, *bdot = sv, *bsq = qv, *balpha = alphas[a0 + a];
        }
    }
}

AVX2 static void write_codes_avx2(const float *row, const float *ay, int64_t d, float alpha, const float *bd, int nb,
                                  int h, uint8_t *out) {
    __m256 a = _mm256_set1_ps(alpha), zero = _mm256_setzero_ps();
    __m256i hv = _mm256_set1_epi32(h), hm1 = _mm256_set1_epi32(h - 1);
    __m256 b[MAX_H];
    for (int k = 0; k < nb; k++) b[k] = _mm256_set1_ps(bd[k]);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(ay + i), a);
        __m256i j = _mm256_setzero_si256();
        for (int k = 0; k < nb; k++) j = _mm256_sub_epi32(j, _mm256_castps_si256(_mm256_cmp_ps(v, b[k], _CMP_GT_OQ)));
        __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(row + i), zero, _CMP_GT_OQ));
        __m256i code = _mm256_blendv_epi8(_mm256_sub_epi32(hm1, j), _mm256_add_epi32(hv, j), pos);
        __m256i w = _mm256_packus_epi32(code, code);  /* 16-bit: lanes [c0..c3 c0..c3 | c4..c7 c4..c7] */
        w = _mm256_packus_epi16(w, w);                /* bytes c0..c3 in lane 0, c4..c7 in lane 1 */
        uint32_t lo = (uint32_t)_mm256_extract_epi32(w, 0), hi = (uint32_t)_mm256_extract_epi32(w, 4);
        memcpy(out + i, &lo, 4);
        memcpy(out + i + 4, &hi, 4);
    }
    write_codes_generic(row + i, ay + i, d - i, alpha, bd, nb, h, out + i);
}
#endif

typedef void (*row_fn)(const float *, const run_t *, int64_t, const float *, int64_t, float *, float *, float *);
typedef void (*codes_fn)(const float *, const float *, int64_t, float, const float *, int, int, uint8_t *);

static int use_simd(int allow_simd) {
#ifdef TQ_X86
    return allow_simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    (void)allow_simd;
    return 0;
#endif
}

/* y [n, d] float32 rows whose coordinates form nseg runs: run s covers seg_len[s] coordinates and
 * uses a codebook of 2 seg_H[s] levels (seg_H in 1..8) with positive levels pos_levels[s * 8 + j],
 * j < seg_H[s], and positive boundaries pos_bounds[s * 8 + j], j < seg_H[s] - 1 (see the file comment;
 * one pre-scale alpha serves every run). Writes idx [n, d] (uint8 indices into each run's ascending
 * codebook), dot [n] = <y, c> and sq [n] = ||c||^2 of the chosen code. Returns 0, -1 for a bad run
 * (seg_H outside 1..8, lengths not summing to d), -2 when out of memory. */
int tq_quantize_direction(const float *y, int64_t n, int64_t d, const float *alphas, int64_t A, int64_t nseg,
                          const int64_t *seg_len, const int64_t *seg_H, const float *pos_levels,
                          const float *pos_bounds, uint8_t *idx, float *dot, float *sq, int allow_simd) {
    int64_t total = 0, slots = 0;
    for (int64_t s = 0; s < nseg; s++) {
        if (seg_H[s] < 1 || seg_H[s] > MAX_H || seg_len[s] < 0) return -1;
        total += seg_len[s], slots += (seg_len[s] + 7) / 8 * 8;
    }
    if (total != d) return -1;
    row_fn best_alpha = best_alpha_generic;
    codes_fn write_codes = write_codes_generic;
#ifdef TQ_X86
    if (use_simd(allow_simd)) best_alpha = best_alpha_avx2, write_codes = write_codes_avx2;
#endif
    float *lv = calloc((size_t)(nseg * MAX_H + 1), sizeof(float)), *bd = calloc((size_t)(nseg * MAX_H + 1), sizeof(float));
    float *ay = calloc((size_t)(slots + 1), sizeof(float));  /* |y| of each run in its slot, zeros after */
    run_t *runs = malloc(sizeof(run_t) * (size_t)(nseg + 1));
    if (!lv || !bd || !ay || !runs) {
        free(lv), free(bd), free(ay), free(runs);
        return -2;
    }
    for (int64_t s = 0, slot = 0; s < nseg; s++) {  /* levels padded to MAX_H: the AVX2 path loads 8 */
        memcpy(lv + s * MAX_H, pos_levels + s * MAX_H, sizeof(float) * (size_t)seg_H[s]);
        memcpy(bd + s * MAX_H, pos_bounds + s * MAX_H, sizeof(float) * (size_t)(seg_H[s] - 1));
        runs[s] = (run_t){seg_len[s], slot, lv + s * MAX_H, bd + s * MAX_H, (int)seg_H[s] - 1};
        slot += (seg_len[s] + 7) / 8 * 8;
    }
    for (int64_t r = 0; r < n; r++) {
        const float *row = y + r * d;
        for (int64_t s = 0, i0 = 0; s < nseg; i0 += seg_len[s++])
            for (int64_t i = 0; i < seg_len[s]; i++) ay[runs[s].slot + i] = fabsf(row[i0 + i]);
        float balpha, bdot, bsq;
        best_alpha(ay, runs, nseg, alphas, A, &balpha, &bdot, &bsq);
        for (int64_t s = 0, i0 = 0; s < nseg; i0 += seg_len[s++])
            write_codes(row + i0, ay + runs[s].slot, seg_len[s], balpha, runs[s].bounds, runs[s].nb, (int)seg_H[s],
                        idx + r * d + i0);
        dot[r] = bdot, sq[r] = bsq;
    }
    free(lv), free(bd), free(ay), free(runs);
    return 0;
}
