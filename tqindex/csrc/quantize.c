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

#ifdef TQ_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static void alpha_sums_avx2(const float *ay, int64_t d, float alpha, const float *lv, const float *bd, int nb,
                                 float *dot, float *sq) {
    __m256 levels = _mm256_loadu_ps(lv), a = _mm256_set1_ps(alpha);
    __m256 b[MAX_H];
    for (int k = 0; k < nb; k++) b[k] = _mm256_set1_ps(bd[k]);
    __m256 s = _mm256_setzero_ps(), q = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 y = _mm256_loadu_ps(ay + i), v = _mm256_mul_ps(y, a);
        __m256i j = _mm256_setzero_si256();
        for (int k = 0; k < nb; k++) j = _mm256_sub_epi32(j, _mm256_castps_si256(_mm256_cmp_ps(v, b[k], _CMP_GT_OQ)));
        __m256 l = _mm256_permutevar8x32_ps(levels, j);
        s = _mm256_fmadd_ps(l, y, s);
        q = _mm256_fmadd_ps(l, l, q);
    }
    float ts[8], tq[8], rs = 0.f, rq = 0.f;
    _mm256_storeu_ps(ts, s);
    _mm256_storeu_ps(tq, q);
    for (int k = 0; k < 8; k++) rs += ts[k], rq += tq[k];
    for (; i < d; i++) {
        float l = lv[level_of(alpha * ay[i], bd, nb)];
        rs += l * ay[i];
        rq += l * l;
    }
    *dot = rs, *sq = rq;
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

typedef void (*sums_fn)(const float *, int64_t, float, const float *, const float *, int, float *, float *);
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
    int64_t total = 0;
    for (int64_t s = 0; s < nseg; s++) {
        if (seg_H[s] < 1 || seg_H[s] > MAX_H || seg_len[s] < 0) return -1;
        total += seg_len[s];
    }
    if (total != d) return -1;
    sums_fn sums = alpha_sums_generic;
    codes_fn write_codes = write_codes_generic;
#ifdef TQ_X86
    if (use_simd(allow_simd)) sums = alpha_sums_avx2, write_codes = write_codes_avx2;
#endif
    float *lv = calloc((size_t)(nseg * MAX_H + 1), sizeof(float)), *bd = calloc((size_t)(nseg * MAX_H + 1), sizeof(float));
    float *ay = malloc(sizeof(float) * (size_t)(d > 0 ? d : 1));
    if (!lv || !bd || !ay) {
        free(lv), free(bd), free(ay);
        return -2;
    }
    for (int64_t s = 0; s < nseg; s++) {  /* padded to MAX_H: alpha_sums_avx2 loads 8 levels */
        memcpy(lv + s * MAX_H, pos_levels + s * MAX_H, sizeof(float) * (size_t)seg_H[s]);
        memcpy(bd + s * MAX_H, pos_bounds + s * MAX_H, sizeof(float) * (size_t)(seg_H[s] - 1));
    }
    for (int64_t r = 0; r < n; r++) {
        const float *row = y + r * d;
        for (int64_t i = 0; i < d; i++) ay[i] = fabsf(row[i]);
        float best = -INFINITY, bdot = 0.f, bsq = 0.f, balpha = alphas[0];
        for (int64_t a = 0; a < A; a++) {
            float s_all = 0.f, q_all = 0.f;
            for (int64_t s = 0, i0 = 0; s < nseg; i0 += seg_len[s++]) {
                float sv, qv;
                sums(ay + i0, seg_len[s], alphas[a], lv + s * MAX_H, bd + s * MAX_H, (int)seg_H[s] - 1, &sv, &qv);
                s_all += sv, q_all += qv;
            }
            float c = q_all > 0.f ? s_all / sqrtf(q_all) : 0.f;
            if (c > best) best = c, bdot = s_all, bsq = q_all, balpha = alphas[a];
        }
        for (int64_t s = 0, i0 = 0; s < nseg; i0 += seg_len[s++])
            write_codes(row + i0, ay + i0, seg_len[s], balpha, bd + s * MAX_H, (int)seg_H[s] - 1, (int)seg_H[s],
                        idx + r * d + i0);
        dot[r] = bdot, sq[r] = bsq;
    }
    free(lv), free(bd), free(ay);
    return 0;
}
