/* Tail-biting Viterbi search of bitshift-trellis codes (the fast path of trellis.tail_biting_reference).
 *
 * A row of d targets gets d symbols of `bits` bits; coordinate i's state is the last state_bits bits of
 * the symbol string up to symbol i (symbol i lowest), its level levels[state]. The search minimizes the
 * summed squared error: a free search of the row turned by d/2 picks the symbols at the string's seam,
 * then a search whose first and last states hold them gives the symbols. Costs are float32 sums in the
 * reference's order and ties go to the lowest state, so both give the same symbols.
 *
 * Called through ctypes (tqindex/kernels/trellis_native.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One search over targets t[(i + shift) mod d], i = 0..d-1 -> sym[i]. history < 0: free start; else the
 * state before step 0 and the one after step d-1 have these low (state_bits - bits) bits.
 * cost, next: [S] floats; back: [d * (S >> bits)] bytes. */
static void search(const float *t, int64_t d, int64_t shift, const float *levels, int state_bits, int bits,
                   int64_t history, float *cost, float *next, uint8_t *back, uint8_t *sym) {
    const int64_t S = (int64_t)1 << state_bits, fan = (int64_t)1 << bits, lows = S >> bits;
    const int64_t low_mask = lows - 1;
    for (int64_t s = 0; s < S; s++) cost[s] = (history < 0 || (s & low_mask) == history) ? 0.0f : INFINITY;
    for (int64_t i = 0; i < d; i++) {
        const float x = t[(i + shift) % d];
        uint8_t *b = back + i * lows;
        for (int64_t lo = 0; lo < lows; lo++) {  /* predecessors (h << (state_bits - bits)) | lo */
            float best = cost[lo];
            uint8_t arg = 0;
            for (int64_t h = 1; h < fan; h++) {
                float c = cost[h * lows + lo];
                if (c < best) { best = c; arg = (uint8_t)h; }
            }
            b[lo] = arg;
            for (int64_t a = 0; a < fan; a++) {  /* state lo * fan + a follows lo with symbol a */
                float e = x - levels[lo * fan + a];
                next[lo * fan + a] = best + e * e;
            }
        }
        float *swap = cost; cost = next; next = swap;
    }
    int64_t state = -1;
    float least = INFINITY;
    for (int64_t s = 0; s < S; s++) {
        if (history >= 0 && (s & low_mask) != history) continue;
        if (state < 0 || cost[s] < least) { least = cost[s]; state = s; }
    }
    for (int64_t i = d - 1; i >= 0; i--) {
        sym[i] = (uint8_t)(state & (fan - 1));
        int64_t high = back[i * lows + (state >> bits)];
        state = (high << (state_bits - bits)) | (state >> bits);
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
    float *cost = malloc(2 * S * sizeof(float));
    uint8_t *back = malloc((size_t)(d * lows)), *seam = malloc((size_t)d);
    if (!cost || !back || !seam) { free(cost); free(back); free(seam); return -1; }
    const int64_t turn = d / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *t = targets + r * d;
        uint8_t *out = symbols + r * d;
        /* turned by `turn`: step i reads t[(i - turn) mod d], so original position p is step (p + turn) mod d */
        search(t, d, d - turn, levels, state_bits, bits, -1, cost, cost + S, back, seam);
        int64_t history = 0;
        for (int64_t j = 0; j < memory; j++) history |= (int64_t)seam[(d - 1 - j + turn) % d] << (bits * j);
        search(t, d, 0, levels, state_bits, bits, history, cost, cost + S, back, out);
    }
    free(cost); free(back); free(seam);
    return 0;
}
