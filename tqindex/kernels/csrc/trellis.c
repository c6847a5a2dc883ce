/* Tail-biting Viterbi search of bitshift-trellis codes (the fast path of trellis.tail_biting).
 *
 * A row of d targets gets d symbols of `bits` bits; coordinate i's state is the last state_bits bits of
 * the symbol string up to symbol i (symbol i lowest), its level levels[state]. The search minimizes the
 * summed squared error: a free search of the row turned by d/2 picks the symbols at the string's seam,
 * then a search whose first and last states hold them gives the symbols. Costs are float32 sums in the
 * reference's order (no fused multiply-add) and ties go to the lowest state, so both give the same symbols.
 * LANES rows are searched together, one per vector lane: every lane does the same operations.
 *
 * Called through ctypes (tqindex/kernels/trellis_native.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 8

/* One search of `rows` <= LANES rows t [rows, d] over targets t[l][(i + shift) mod d], i = 0..d-1 -> sym [rows, d].
 * history[l] < 0: lane l starts free; else the state before step 0 and the one after step d-1 have these low
 * (state_bits - bits) bits. cost, next: [S][LANES] floats; back: [d][S >> bits][LANES] bytes. */
static void search(const float *t, int64_t rows, int64_t d, int64_t shift, const float *levels, int state_bits,
                   int bits, const int64_t *history, float *cost, float *next,
                   uint8_t *back, uint8_t *sym) {
    const int64_t S = (int64_t)1 << state_bits, fan = (int64_t)1 << bits, lows = S >> bits;
    const int64_t low_mask = lows - 1;
    for (int64_t s = 0; s < S; s++)
        for (int l = 0; l < LANES; l++)
            cost[s * LANES + l] = (history[l] < 0 || (s & low_mask) == history[l]) ? 0.0f : INFINITY;
    for (int64_t i = 0; i < d; i++) {
        const float *restrict from = i % 2 ? next : cost;  /* the two buffers take turns */
        float *restrict to = i % 2 ? cost : next;
        float x[LANES];
        for (int l = 0; l < LANES; l++) x[l] = l < rows ? t[l * d + (i + shift) % d] : 0.0f;
        uint8_t *b = back + i * lows * LANES;
        for (int64_t lo = 0; lo < lows; lo++) {
            float best[LANES];
            int32_t arg[LANES];
            for (int l = 0; l < LANES; l++) { best[l] = from[lo * LANES + l]; arg[l] = 0; }
            for (int32_t h = 1; h < fan; h++) {
                const float *c = from + (h * lows + lo) * LANES;
                for (int l = 0; l < LANES; l++) {
                    int less = c[l] < best[l];
                    best[l] = less ? c[l] : best[l];
                    arg[l] = less ? h : arg[l];
                }
            }
            for (int l = 0; l < LANES; l++) b[lo * LANES + l] = (uint8_t)arg[l];
            for (int64_t a = 0; a < fan; a++) {
                const float level = levels[lo * fan + a];
                float *o = to + (lo * fan + a) * LANES;
                for (int l = 0; l < LANES; l++) { float e = x[l] - level; o[l] = best[l] + e * e; }
            }
        }
    }
    const float *last = d % 2 ? next : cost;
    for (int l = 0; l < rows; l++) {
        int64_t state = -1;
        float least = INFINITY;
        for (int64_t s = 0; s < S; s++) {
            if (history[l] >= 0 && (s & low_mask) != history[l]) continue;
            if (state < 0 || last[s * LANES + l] < least) { least = last[s * LANES + l]; state = s; }
        }
        for (int64_t i = d - 1; i >= 0; i--) {
            sym[l * d + i] = (uint8_t)(state & (fan - 1));
            int64_t high = back[(i * lows + (state >> bits)) * LANES + l];
            state = (high << (state_bits - bits)) | (state >> bits);
        }
    }
}

/* targets [n, d] float32, levels [2^state_bits] -> symbols [n, d] uint8. Returns 0; 1 for sizes that make no
 * trellis (state_bits not a whole number of symbols, more of them than d); -1 when out of memory. */
int tq_trellis_tail_biting(const float *targets, int64_t n, int64_t d, const float *levels, int state_bits,
                           int bits, uint8_t *symbols) {
    if (bits < 1 || bits > 8 || state_bits <= bits || state_bits > 16 || state_bits % bits
        || d < state_bits / bits)
        return 1;
    const int64_t S = (int64_t)1 << state_bits, lows = S >> bits, memory = state_bits / bits - 1;
    float *cost = malloc(2 * S * LANES * sizeof(float));
    uint8_t *back = malloc((size_t)(d * lows * LANES));
    uint8_t *seam = malloc((size_t)(d * LANES));
    if (!cost || !back || !seam) { free(cost); free(back); free(seam); return -1; }
    const int64_t turn = d / 2;
    int64_t free_start[LANES], history[LANES];
    for (int l = 0; l < LANES; l++) free_start[l] = -1;
    for (int64_t r = 0; r < n; r += LANES) {
        const int64_t rows = n - r < LANES ? n - r : LANES;
        const float *t = targets + r * d;
        search(t, rows, d, d - turn, levels, state_bits, bits, free_start, cost, cost + S * LANES, back, seam);
        for (int l = 0; l < LANES; l++) {
            history[l] = 0;
            for (int64_t j = 0; l < rows && j < memory; j++)
                history[l] |= (int64_t)seam[l * d + (d - 1 - j + turn) % d] << (bits * j);
        }
        search(t, rows, d, 0, levels, state_bits, bits, history, cost, cost + S * LANES, back, symbols + r * d);
    }
    free(cost); free(back); free(seam);
    return 0;
}
