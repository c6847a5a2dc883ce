/* Nibble lookup-table scan ("fast scan") over packed 1/2/3/4-bit TurboQuant Q_mse codes.
 *
 * A code row is `nbytes` packed bytes; each 4-bit nibble t (t = 2p: low nibble of byte p, t = 2p + 1:
 * high nibble) holds 4/b whole codes, so a query's partial inner product with the row is a sum of
 * 2 * nbytes table entries T[t][nibble_t]. Rows of 3-bit codes (a bit stream, 8 codes in 3 bytes) are
 * scored exactly by 6-bit pairs of codes (pair_dot, tables of 64 entries), and expanded as the
 * approximate stage reads them to a split layout of 3/4 as many nibbles (split3; tables of an additive
 * approximation of the codebook, tqindex/lut.py).
 *
 * The scan quantizes T to uint8 per query (tq_quantize_tables: T ~= qmul * U + per-nibble offsets
 * summing to qadd), looks up 32 rows at once with `pshufb` on AVX2 for 3 queries per pass over a block
 * (a portable loop gives the same integers elsewhere), keeps the `depth` best approximate scores per
 * query (a reservoir whose threshold starts from a sampled estimate), re-scores those candidates
 * exactly with the float tables and merges them into the caller's exact top-k min-heaps (faiss layout:
 * root = smallest of the k kept; an empty row gets its best k sorted ascending).
 *
 * score(row v) = scale[v] * <q, c_v> + bias_v + qoffset[q], with bias_v = -scale[v]^2 * ||c_v||^2
 * when `sq_table` is given ("l2" scoring) and 0 otherwise.
 *
 * Two helpers of the IVF search close the file: the k best columns of each row (the coarse step's
 * top-nprobe, tq_top_columns) and the grouping of (query, list) pairs by list (tq_group_pairs).
 *
 * Called through ctypes (tqindex/native.py): no Python objects are touched, and ctypes releases the GIL.
 */
#include <math.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define TQ_X86 1
#include <immintrin.h>
#endif

/* 1 when this CPU runs the AVX2 (and FMA) paths. */
static int cpu_avx2(void) {
#ifdef TQ_X86
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

#define BLOCK 32          /* rows looked up together */
#define GROUP 8           /* most blocks transposed together (256 rows) */
#define TABLE_MAX 127     /* largest quantized table entry: a byte's two lookups add in 8 bits */
#define CHUNK 256         /* byte positions summed in 16-bit lanes before widening to 32 bits */

/* The L1 data (level 1) or L2 (level 2) cache size in bytes, where the C library knows it (else common sizes). */
static int64_t cache_bytes(int level) {
    long v = 0;
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
    v = sysconf(level == 1 ? _SC_LEVEL1_DCACHE_SIZE : _SC_LEVEL2_CACHE_SIZE);
#endif
    return v > 0 ? v : level == 1 ? 32 << 10 : 512 << 10;
}

/* Row order of the 32 sums a block produces: even rows 0..14, 16..30, then odd rows 1..15, 17..31. */
static const uint8_t PERM[BLOCK] = {0, 2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                    1, 3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

/* ---------------------------------------------------------------------------------------- heaps */

/* (va, ia) ranks below (vb, ib): a smaller value, or an equal value and a larger id. */
static inline int worse(float va, int64_t ia, float vb, int64_t ib) { return va < vb || (va == vb && ia > ib); }

/* Replace the root of a min-heap of k (value, id) pairs (the root ranks lowest, see `worse`) by (v, id)
 * and sift it down. */
static void heap_replace_top(float *val, int64_t *ids, int64_t k, float v, int64_t id) {
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, c;
        if (l >= k) break;
        c = (r < k && worse(val[r], ids[r], val[l], ids[l])) ? r : l;
        if (!worse(val[c], ids[c], v, id)) break;
        val[i] = val[c];
        ids[i] = ids[c];
        i = c;
    }
    val[i] = v;
    ids[i] = id;
}

/* rank[i] = how many of keys[0, n) come before keys[i] in descending order (larger, or equal and
 * earlier). */
static void rank_desc(const int32_t *keys, int64_t n, int64_t *rank) {
    for (int64_t i = 0; i < n; i++) {
        int64_t r = 0;
        for (int64_t j = 0; j < n; j++) r += (keys[j] > keys[i]) | ((keys[j] == keys[i]) & (j < i));
        rank[i] = r;
    }
}

#ifdef TQ_X86
/* Sum of the eight 32-bit lanes of c. */
__attribute__((target("avx2"))) static inline int32_t hsum_epi32(__m256i c) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

/* rank_desc with AVX2: keys before i count when >= keys[i] (> keys[i] - 1), keys after it when larger;
 * it reads keys[n, roundup(n, 8)), which must hold INT32_MIN (no float's key). */
__attribute__((target("avx2"))) static void rank_desc_avx2(const int32_t *keys, int64_t n, int64_t *rank) {
    static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++) {
        __m256i ki = _mm256_set1_epi32(keys[i]), ge = _mm256_set1_epi32(keys[i] - 1), c = _mm256_setzero_si256();
        int64_t i0 = i & ~(int64_t)7, j = 0;
        for (; j < i0; j += 8) c = _mm256_sub_epi32(c, _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(keys + j)), ge));
        __m256i kj = _mm256_loadu_si256((const __m256i *)(keys + j)),
                before = _mm256_loadu_si256((const __m256i *)(lanes + 8 - (i - i0)));  /* lanes of j < i */
        c = _mm256_sub_epi32(c, _mm256_blendv_epi8(_mm256_cmpgt_epi32(kj, ki), _mm256_cmpgt_epi32(kj, ge), before));
        for (j += 8; j < n; j += 8) c = _mm256_sub_epi32(c, _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(keys + j)), ki));
        rank[i] = hsum_epi32(c);
    }
}
#endif

/* Candidate reservoir: scores above `thr` are appended; when `cap` (= 2 keep) are held, a selection
 * keeps the `keep` largest and raises `thr` to the smallest kept, so an insert costs O(1) amortized. */
typedef struct {
    float *val;
    int64_t *row;
    int64_t n, keep;
    float thr;
    int32_t *tmp;           /* scratch [2 keep] keys */
    int simd;               /* count with AVX2 */
    int block_best;         /* take only the best score of each block (threshold sampling) */
} reservoir_t;

/* Order-preserving integer key of a float (non-NaN): a < b exactly when key(a) < key(b). */
static inline int32_t float_key(float f) {
    int32_t b;
    memcpy(&b, &f, sizeof b);
    return b ^ ((b >> 31) & 0x7fffffff);
}

/* rank[i] = how many of v[0, n) (no NaN) come before v[i] in descending order (larger, or equal and
 * earlier), through their keys key [n + 8] (scratch). */
static void rank_floats(const float *v, int64_t n, int32_t *key, int64_t *rank, int simd) {
    for (int64_t i = 0; i < n + 8; i++) key[i] = i < n ? float_key(v[i]) : INT32_MIN;
#ifdef TQ_X86
    if (simd) {
        rank_desc_avx2(key, n, rank);
        return;
    }
#endif
    (void)simd;
    rank_desc(key, n, rank);
}

/* Number of keys in k[0, n) at or above t. */
static int64_t count_at_least(const int32_t *k, int64_t n, int32_t t) {
    int32_t c = 0;
    for (int64_t i = 0; i < n; i++) c += k[i] >= t;
    return c;
}

#ifdef TQ_X86
__attribute__((target("avx2"))) static int64_t count_at_least_avx2(const int32_t *k, int64_t n, int32_t t) {
    __m256i tv = _mm256_set1_epi32(t - 1), c0 = _mm256_setzero_si256(), c1 = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {  /* k > t - 1, counted as -1 per lane */
        c0 = _mm256_add_epi32(c0, _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(k + i)), tv));
        c1 = _mm256_add_epi32(c1, _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(k + i + 8)), tv));
    }
    return -(int64_t)hsum_epi32(_mm256_add_epi32(c0, c1)) + count_at_least(k + i, n - i, t);
}
#endif

#ifdef TQ_X86
#define COUNT(k, n, t) (r->simd ? count_at_least_avx2(k, n, t) : count_at_least(k, n, t))
#else
#define COUNT(k, n, t) count_at_least(k, n, t)
#endif

/* Keeps the `keep` largest entries (ties at the threshold in arrival order) and raises thr to the
 * smallest of them. The threshold key is searched over [min key, max key] by counting passes, each
 * probe interpolated between the counts at the bounds (or halving the bounds after a probe that did
 * not), until exactly `keep` keys lie at or above the lower bound, or the bounds meet at a tied key. */
static void reservoir_shrink(reservoir_t *r) {
    int32_t *keys = r->tmp;
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    for (int64_t i = 0; i < r->n; i++) {
        int32_t k = float_key(r->val[i]);
        keys[i] = k;
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
    /* count(>= lo) = at_lo >= keep > above = count(>= top) */
    int64_t above = COUNT(keys, r->n, hi), at_lo = r->n;
    if (above >= r->keep) lo = hi, at_lo = above, above = 0;
    else {
        int64_t top = hi, bisect = 0;
        while (top - lo > 1 && at_lo != r->keep) {
            int64_t span = top - lo, step = span / 2;
            if (!bisect) step = (int64_t)((double)span * ((double)(at_lo - r->keep) + 0.5) / (double)(at_lo - above));
            step = step < 1 ? 1 : step > span - 1 ? span - 1 : step;
            int32_t mid = (int32_t)(lo + step);
            int64_t c = COUNT(keys, r->n, mid);
            if (c >= r->keep) lo = mid, at_lo = c;
            else top = mid, above = c;
            bisect = !bisect && 2 * (top - lo) > span;  /* the probe kept more than half */
        }
    }
    int64_t m = 0;
    int32_t low = INT32_MAX;  /* the smallest key kept */
    if (at_lo == r->keep) {  /* no surplus ties at the threshold */
        for (int64_t i = 0; i < r->n; i++) {
            int take = keys[i] >= lo;
            r->val[m] = r->val[i];
            r->row[m] = r->row[i];
            low = take && keys[i] < low ? keys[i] : low;
            m += take;
        }
    } else {
        int64_t ties = r->keep - above;  /* entries equal to the threshold that stay */
        for (int64_t i = 0; i < r->n; i++) {
            int tie = keys[i] == lo, take = (keys[i] > lo) | (tie & (ties > 0));
            ties -= tie & take;
            r->val[m] = r->val[i];
            r->row[m] = r->row[i];
            m += take;
        }
        low = lo;
    }
    r->n = r->keep;
    memcpy(&r->thr, &(int32_t){low ^ ((low >> 31) & 0x7fffffff)}, sizeof r->thr);
}

static inline void reservoir_add(reservoir_t *r, float v, int64_t row) {
    r->val[r->n] = v;
    r->row[r->n] = row;
    if (++r->n == 2 * r->keep) reservoir_shrink(r);
}

/* Offers the scores sc [32] (PERM order) of a block whose lanes `mask` scored above r->thr: each of
 * them, or with block_best only their best (one entry per block). */
static inline void reservoir_offer(reservoir_t *r, const float *sc, unsigned mask, int64_t row0) {
    if (r->block_best) {
        int best = __builtin_ctz(mask);
        for (unsigned m = mask & (mask - 1); m; m &= m - 1)
            best = sc[__builtin_ctz(m)] > sc[best] ? __builtin_ctz(m) : best;
        reservoir_add(r, sc[best], row0 + PERM[best]);
        return;
    }
    while (mask) {
        int i = __builtin_ctz(mask);
        mask &= mask - 1;
        if (sc[i] > r->thr) reservoir_add(r, sc[i], row0 + PERM[i]);
    }
}

/* --------------------------------------------------------------------------------------- scratch */

/* Scratch memory of each thread, kept between calls (up to SCRATCH_KEEP bytes) and freed when the
 * thread ends: a scan then maps no fresh pages (page faults and, with several threads, TLB shootdowns
 * when they are unmapped). Slot 0 serves tq_fastscan and tq_fastscan_lists, slot 1 tq_fastscan_candidates. */
#define SCRATCH_KEEP ((size_t)16 << 20)
typedef struct {
    uint8_t *p;
    size_t cap;
} arena_t;
static pthread_key_t arena_key;
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;

static void arenas_free(void *p) {
    arena_t *a = p;
    free(a[0].p), free(a[1].p), free(a);
}

static void arenas_init(void) { pthread_key_create(&arena_key, arenas_free); }

/* Points *ptrs[i] at sizes[i] bytes (64-byte aligned) of this thread's arena `slot`; 0, or -1 when out
 * of memory. */
static int arena_get(int slot, int count, const size_t *sizes, void **const *ptrs) {
    pthread_once(&arena_once, arenas_init);
    arena_t *a = pthread_getspecific(arena_key);
    if (!a) {
        if (!(a = calloc(2, sizeof *a))) return -1;
        pthread_setspecific(arena_key, a);
    }
    a += slot;
    size_t total = 64;
    for (int i = 0; i < count; i++) total += (sizes[i] + 63) & ~(size_t)63;
    if (a->cap < total) {
        free(a->p);
        a->p = malloc(total);
        a->cap = a->p ? total : 0;
        if (!a->p) return -1;
    }
    uint8_t *at = (uint8_t *)(((uintptr_t)a->p + 63) & ~(uintptr_t)63);
    for (int i = 0; i < count; i++) {
        *ptrs[i] = at;
        at += (sizes[i] + 63) & ~(size_t)63;
    }
    return 0;
}

/* Ends a call's use of arena `slot` (after a successful arena_get): a large one is given back. */
static void arena_done(int slot) {
    arena_t *a = (arena_t *)pthread_getspecific(arena_key) + slot;
    if (a->cap > SCRATCH_KEEP) free(a->p), a->p = NULL, a->cap = 0;
}

/* ----------------------------------------------------------------------------------------- sums */

/* Integer table sums of the 32 rows of one transposed block, in PERM order.
 * tb: [nbytes][2][32] low / high nibbles; lut: [2 * nbytes][16] uint8. */
static void block_sums_generic(const uint8_t *tb, const uint8_t *lut, int64_t nbytes, uint32_t *out) {
    for (int i = 0; i < BLOCK; i++) {
        int v = PERM[i];
        uint32_t s = 0;
        for (int64_t p = 0; p < nbytes; p++)
            s += lut[32 * p + tb[2 * BLOCK * p + v]] + lut[32 * p + 16 + tb[2 * BLOCK * p + BLOCK + v]];
        out[i] = s;
    }
}

/* Everything one block of 32 rows needs to score against a group of queries. */
typedef struct {
    const uint8_t *tb;      /* [nbytes][2][32] transposed codes, low / high nibbles */
    const float *scale;     /* [32] per-row scale, PERM order */
    const float *bias;      /* [32] per-row bias, PERM order (-inf for missing rows) */
    int64_t row0;           /* first row of the block */
} block_t;

typedef struct {
    const uint8_t *lut;     /* [2 nbytes][16] uint8 tables */
    float mul, add, off;
    reservoir_t *res;       /* approximate candidates */
} query_t;

/* Scores the blocks [nblk] for the queries qs [nqb] into their reservoirs. */
static void score_blocks_generic(const block_t *blocks, int nblk, const query_t *qs, int nqb, int64_t nbytes) {
    uint32_t s[BLOCK];
    float sc[BLOCK];
    for (const block_t *b = blocks; b < blocks + nblk; b++) {
        for (int j = 0; j < nqb; j++) {
            const query_t *q = qs + j;
            block_sums_generic(b->tb, q->lut, nbytes, s);
            unsigned mask = 0;
            for (int i = 0; i < BLOCK; i++) {
                sc[i] = b->scale[i] * (q->mul * (float)s[i] + q->add) + b->bias[i] + q->off;
                mask |= (unsigned)(sc[i] > q->res->thr) << i;
            }
            if (mask) reservoir_offer(q->res, sc, mask, b->row0);
        }
    }
}

#ifdef TQ_X86
#define AVX2 __attribute__((target("avx2,fma")))

/* Adds one query's 16-bit accumulators to its 32-bit sums (PERM order: e0 rows 0, 2, .., 14, e1
 * rows 16, .., 30, o0 rows 1, .., 15, o1 rows 17, .., 31): a0 sums both bytes of each 16-bit lane
 * (rows 2j, 2j+1; mod 2^16), a1 the high bytes, so the even row's sum is a0 - 256 a1. */
AVX2 static inline void widen(__m256i a0, __m256i a1, __m256i *e) {
    __m256i ev = _mm256_sub_epi16(a0, _mm256_slli_epi16(a1, 8));
    e[0] = _mm256_add_epi32(e[0], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(ev)));
    e[1] = _mm256_add_epi32(e[1], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(ev, 1)));
    e[2] = _mm256_add_epi32(e[2], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(a1)));
    e[3] = _mm256_add_epi32(e[3], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a1, 1)));
}

/* Scores of 32 rows for NQ queries at once: each code byte is loaded and split into nibbles once.
 * Table entries are at most 127, so a byte's two lookups add without overflow in 8 bits. */
AVX2 static inline __attribute__((always_inline)) void scan_block_avx2_n(const block_t *b, const query_t *qs,
                                                                          const int NQ, int64_t nbytes) {
    __m256i e[4][4];
    for (int j = 0; j < NQ; j++) e[j][0] = e[j][1] = e[j][2] = e[j][3] = _mm256_setzero_si256();
    for (int64_t p0 = 0; p0 < nbytes; p0 += CHUNK) {
        int64_t p1 = p0 + CHUNK < nbytes ? p0 + CHUNK : nbytes;
        __m256i a[4][2];
        for (int j = 0; j < NQ; j++) a[j][0] = a[j][1] = _mm256_setzero_si256();
        for (int64_t p = p0; p < p1; p++) {
            __m256i lo = _mm256_loadu_si256((const __m256i *)(b->tb + 2 * BLOCK * p));
            __m256i hi = _mm256_loadu_si256((const __m256i *)(b->tb + 2 * BLOCK * p + BLOCK));
            for (int j = 0; j < NQ; j++) {
                const uint8_t *lut = qs[j].lut + 32 * p;
                __m256i tl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lut));
                __m256i th = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(lut + 16)));
                __m256i r = _mm256_add_epi8(_mm256_shuffle_epi8(tl, lo), _mm256_shuffle_epi8(th, hi));
                a[j][0] = _mm256_add_epi16(a[j][0], r);
                a[j][1] = _mm256_add_epi16(a[j][1], _mm256_srli_epi16(r, 8));
            }
        }
        for (int j = 0; j < NQ; j++) widen(a[j][0], a[j][1], e[j]);
    }
    for (int j = 0; j < NQ; j++) {
        const query_t *q = qs + j;
        __m256 mul = _mm256_set1_ps(q->mul), add = _mm256_set1_ps(q->add), off = _mm256_set1_ps(q->off);
        __m256 thr = _mm256_set1_ps(q->res->thr);
        __m256 sc[4];
        unsigned mask = 0;
        for (int g = 0; g < 4; g++) {
            __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e[j][g]), mul, add);
            __m256 bo = _mm256_add_ps(_mm256_loadu_ps(b->bias + 8 * g), off);
            sc[g] = _mm256_fmadd_ps(t, _mm256_loadu_ps(b->scale + 8 * g), bo);
            mask |= (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(sc[g], thr, _CMP_GT_OQ)) << (8 * g);
        }
        if (mask) {
            float buf[BLOCK];
            for (int g = 0; g < 4; g++) _mm256_storeu_ps(buf + 8 * g, sc[g]);
            reservoir_offer(q->res, buf, mask, b->row0);
        }
    }
}

AVX2 static void score_blocks_avx2(const block_t *blocks, int nblk, const query_t *qs, int nqb, int64_t nbytes) {
    const block_t *end = blocks + nblk;
    switch (nqb) {
        case 4: for (const block_t *b = blocks; b < end; b++) scan_block_avx2_n(b, qs, 4, nbytes); break;
        case 3: for (const block_t *b = blocks; b < end; b++) scan_block_avx2_n(b, qs, 3, nbytes); break;
        case 2: for (const block_t *b = blocks; b < end; b++) scan_block_avx2_n(b, qs, 2, nbytes); break;
        default: for (const block_t *b = blocks; b < end; b++) scan_block_avx2_n(b, qs, 1, nbytes); break;
    }
}
#endif

#define QGROUP 3  /* queries scored together per block */

typedef void (*scan_fn)(const block_t *, int, const query_t *, int, int64_t);

static scan_fn pick_scan(int allow_simd) {
#ifdef TQ_X86
    if (allow_simd && cpu_avx2()) return score_blocks_avx2;
#endif
    (void)allow_simd;
    return score_blocks_generic;
}

/* 1 when the SIMD path serves this CPU. */
int tq_fastscan_simd(void) { return pick_scan(1) != score_blocks_generic; }

/* ------------------------------------------------------------------------------------- tables */

#define SLOTS 4           /* codes per nibble at most (1-bit codes) */

/* Float nibble tables out [m, T, 16] of rotated queries qs [m, dim]: entry [i, t, v] is
 * sum_j qs[i, coord[t, j]] * bank[bank_of[t], j, v] over the SLOTS code slots j of nibble t, where
 * coord[t, j] = dim stands for no coordinate (weight 0); the rule of LookupTables.nibble_tables, its
 * reference (coord int32 [T, SLOTS], bank_of int32 [T], bank float [*, SLOTS, 16]: fastscan.table_layout). */
void tq_nibble_tables(const float *qs, int64_t m, int64_t dim, const int32_t *coord, const int32_t *bank_of,
                      const float *bank, int64_t T, float *out) {
    for (int64_t i = 0; i < m; i++) {
        const float *q = qs + i * dim;
        for (int64_t t = 0; t < T; t++) {
            const float *b = bank + (int64_t)bank_of[t] * SLOTS * 16;
            float *o = out + (i * T + t) * 16;
            for (int v = 0; v < 16; v++) o[v] = 0.f;
            for (int j = 0; j < SLOTS; j++) {
                int32_t c = coord[SLOTS * t + j];
                if (c >= dim) continue;  /* an unused slot */
                float w = q[c];
                for (int v = 0; v < 16; v++) o[v] += w * b[16 * j + v];
            }
        }
    }
}

/* Quantizes float tables [m, T, 16] to uint8 [m, T, 16] in [0, 127] with, per query i,
 * sum_t tables[i, t, v_t] ~= mul[i] * sum_t u8[i, t, v_t] + add[i]: each table is shifted to start at
 * 0 (the shifts sum to add[i]) and all of a query's tables share one step mul[i] (the rule of
 * fastscan.quantize_tables, its reference). */
void tq_quantize_tables(const float *tables, int64_t m, int64_t T, uint8_t *u8, float *mul, float *add) {
    for (int64_t i = 0; i < m; i++) {
        const float *t = tables + i * T * 16;
        uint8_t *o = u8 + i * T * 16;
        float span = 0.f, low_sum = 0.f;
        for (int64_t j = 0; j < T; j++) {
            float lo = t[16 * j], hi = t[16 * j];
            for (int v = 1; v < 16; v++) {
                float x = t[16 * j + v];
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
            span = hi - lo > span ? hi - lo : span;
            low_sum += lo;
        }
        float step = span / TABLE_MAX;
        step = step > 0.f ? step : 1.f;
        float inv = 1.f / step;
        for (int64_t j = 0; j < T; j++) {
            float lo = t[16 * j];
            for (int v = 1; v < 16; v++) lo = t[16 * j + v] < lo ? t[16 * j + v] : lo;
            for (int v = 0; v < 16; v++) {  /* + 1.5 * 2^23 rounds to the nearest integer, ties to even */
                float x = ((t[16 * j + v] - lo) * inv + 12582912.f) - 12582912.f;
                o[16 * j + v] = (uint8_t)(x > TABLE_MAX ? TABLE_MAX : x);
            }
        }
        mul[i] = step;
        add[i] = low_sum;
    }
}

/* -------------------------------------------------------------------------------------- scanning */

#define SWAP_UNITS(a, b, mask, shift)                            \
    do {                                                         \
        uint64_t a_ = (a), b_ = (b);                             \
        (a) = (a_ & (mask)) | ((b_ << (shift)) & ~(mask));       \
        (b) = ((a_ >> (shift)) & (mask)) | (b_ & ~(mask));       \
    } while (0)

/* Transposes an 8 x 8 byte tile held as 8 little-endian words (x[i] byte j -> x[j] byte i). */
static inline void transpose8(uint64_t *x) {
    const uint64_t m1 = 0x00FF00FF00FF00FFull, m2 = 0x0000FFFF0000FFFFull, m4 = 0x00000000FFFFFFFFull;
    SWAP_UNITS(x[0], x[1], m1, 8);
    SWAP_UNITS(x[2], x[3], m1, 8);
    SWAP_UNITS(x[4], x[5], m1, 8);
    SWAP_UNITS(x[6], x[7], m1, 8);
    SWAP_UNITS(x[0], x[2], m2, 16);
    SWAP_UNITS(x[1], x[3], m2, 16);
    SWAP_UNITS(x[4], x[6], m2, 16);
    SWAP_UNITS(x[5], x[7], m2, 16);
    SWAP_UNITS(x[0], x[4], m4, 32);
    SWAP_UNITS(x[1], x[5], m4, 32);
    SWAP_UNITS(x[2], x[6], m4, 32);
    SWAP_UNITS(x[3], x[7], m4, 32);
}

#ifdef TQ_X86
#define SWAP_UNITS256(a, b, mask, shift)                                                                   \
    do {                                                                                                   \
        __m256i a_ = (a), b_ = (b);                                                                        \
        (a) = _mm256_or_si256(_mm256_and_si256(a_, mask), _mm256_andnot_si256(mask, _mm256_slli_epi64(b_, shift))); \
        (b) = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi64(a_, shift), mask), _mm256_andnot_si256(mask, b_)); \
    } while (0)

/* Bytes [p, p + 8) of the 32 rows at src (row stride `stride`, readable 8 bytes from each row's p) as
 * x[j] = byte p + j of rows 0..31: the 8 x 8 tiles of the four row groups sit in the four 64-bit lanes. */
AVX2 static inline void load_tile_avx2(const uint8_t *src, int64_t stride, __m256i *x) {
    const __m256i m1 = _mm256_set1_epi64x(0x00FF00FF00FF00FFll), m2 = _mm256_set1_epi64x(0x0000FFFF0000FFFFll),
                  m4 = _mm256_set1_epi64x(0x00000000FFFFFFFFll);
    for (int i = 0; i < 8; i++) {
        const uint8_t *r = src + i * stride;
        long long a, b, c, d;
        memcpy(&a, r, 8), memcpy(&b, r + 8 * stride, 8), memcpy(&c, r + 16 * stride, 8), memcpy(&d, r + 24 * stride, 8);
        x[i] = _mm256_set_epi64x(d, c, b, a);
    }
    SWAP_UNITS256(x[0], x[1], m1, 8);
    SWAP_UNITS256(x[2], x[3], m1, 8);
    SWAP_UNITS256(x[4], x[5], m1, 8);
    SWAP_UNITS256(x[6], x[7], m1, 8);
    SWAP_UNITS256(x[0], x[2], m2, 16);
    SWAP_UNITS256(x[1], x[3], m2, 16);
    SWAP_UNITS256(x[4], x[6], m2, 16);
    SWAP_UNITS256(x[5], x[7], m2, 16);
    SWAP_UNITS256(x[0], x[4], m4, 32);
    SWAP_UNITS256(x[1], x[5], m4, 32);
    SWAP_UNITS256(x[2], x[6], m4, 32);
    SWAP_UNITS256(x[3], x[7], m4, 32);
}

/* transpose_block for 32 rows that may be read 8 bytes past their end: each transposed register is one
 * position's 32 bytes, split into its nibbles before it is stored. */
AVX2 static void transpose_block_avx2(const uint8_t *codes, int64_t nbytes, int64_t r0, uint8_t *tb) {
    const __m256i m4b = _mm256_set1_epi8(0x0f);
    for (int64_t p0 = 0; p0 < nbytes; p0 += 8) {
        int w = nbytes - p0 < 8 ? (int)(nbytes - p0) : 8;
        __m256i x[8];
        load_tile_avx2(codes + r0 * nbytes + p0, nbytes, x);
        for (int j = 0; j < w; j++) {
            uint8_t *dst = tb + 2 * (p0 + j) * BLOCK;
            _mm256_storeu_si256((__m256i *)dst, _mm256_and_si256(x[j], m4b));
            _mm256_storeu_si256((__m256i *)(dst + BLOCK), _mm256_and_si256(_mm256_srli_epi16(x[j], 4), m4b));
        }
    }
}

/* The same for 32 rows of 3-bit codes (row_bytes each, 8 codes in 3 bytes) into tb [sbytes][2][BLOCK] in
 * the split layout (see split3): the rows' bytes are transposed into raw [row_bytes rounded up to 24]
 * [BLOCK], then each 3 bytes of 32 rows give 8 codes with byte-lane shifts (16-bit shifts, masked per
 * byte), their 4 pair nibbles and 2 low-bit nibbles. */
AVX2 static void transpose3_block_avx2(const uint8_t *codes, int64_t row_bytes, int64_t nbytes, int64_t r0,
                                       uint8_t *raw, uint8_t *tb) {
    for (int64_t p0 = 0; p0 < row_bytes; p0 += 8) {
        __m256i x[8];
        load_tile_avx2(codes + r0 * row_bytes + p0, row_bytes, x);
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(raw + (p0 + j) * BLOCK), x[j]);
    }
    const int64_t npair = nbytes, nlow = (nbytes + 1) / 2;
    const __m256i m1 = _mm256_set1_epi8(1), m2 = _mm256_set1_epi8(2), m3 = _mm256_set1_epi8(3),
                  m4 = _mm256_set1_epi8(4), m6 = _mm256_set1_epi8(6), m7 = _mm256_set1_epi8(7),
                  m8 = _mm256_set1_epi8(8), m12 = _mm256_set1_epi8(12);
    for (int64_t g = 0; 4 * g < nbytes; g++) {
        const uint8_t *r = raw + 3 * g * BLOCK;
        __m256i b0 = _mm256_loadu_si256((const __m256i *)r), b1 = _mm256_loadu_si256((const __m256i *)(r + BLOCK)),
                b2 = _mm256_loadu_si256((const __m256i *)(r + 2 * BLOCK));
        __m256i c[8];
        c[0] = _mm256_and_si256(b0, m7);
        c[1] = _mm256_and_si256(_mm256_srli_epi16(b0, 3), m7);
        c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b0, 6), m3), _mm256_and_si256(_mm256_slli_epi16(b1, 2), m4));
        c[3] = _mm256_and_si256(_mm256_srli_epi16(b1, 1), m7);
        c[4] = _mm256_and_si256(_mm256_srli_epi16(b1, 4), m7);
        c[5] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 7), m1), _mm256_and_si256(_mm256_slli_epi16(b2, 1), m6));
        c[6] = _mm256_and_si256(_mm256_srli_epi16(b2, 2), m7);
        c[7] = _mm256_and_si256(_mm256_srli_epi16(b2, 5), m7);
        for (int i = 0; i < 4 && 4 * g + i < npair; i++)  /* codes 8g + 2i, 8g + 2i + 1 without their low bits */
            _mm256_storeu_si256((__m256i *)(tb + (4 * g + i) * BLOCK),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c[2 * i], 1), m3),
                                                _mm256_and_si256(_mm256_slli_epi16(c[2 * i + 1], 1), m12)));
        for (int i = 0; i < 2 && 2 * g + i < nlow; i++) {  /* the low bits of codes 8g + 4i .. 8g + 4i + 3 */
            const __m256i *q = c + 4 * i;
            __m256i v = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(q[0], m1), _mm256_and_si256(_mm256_slli_epi16(q[1], 1), m2)),
                                        _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(q[2], 2), m4),
                                                        _mm256_and_si256(_mm256_slli_epi16(q[3], 3), m8)));
            _mm256_storeu_si256((__m256i *)(tb + (npair + 2 * g + i) * BLOCK), v);
        }
    }
    if ((npair + nlow) % 2) memset(tb + (npair + nlow) * BLOCK, 0, BLOCK);  /* the empty last nibble */
}
#endif

/* Transposes rows [r0, r0 + cnt) (cnt <= BLOCK) of codes [*, nbytes] into tb [nbytes][2][BLOCK], the
 * low and high nibbles of each position apart (missing rows are zero), 8 x 8 byte tiles at a time. */
static void transpose_block(const uint8_t *codes, int64_t nbytes, int64_t r0, int cnt, uint8_t *tb) {
    for (int g = 0; g < BLOCK; g += 8) {
        for (int64_t p0 = 0; p0 < nbytes; p0 += 8) {
            int w = nbytes - p0 < 8 ? (int)(nbytes - p0) : 8, rows = cnt - g < 8 ? cnt - g : 8;
            uint64_t x[8] = {0};
            const uint8_t *src = codes + (r0 + g) * nbytes + p0;
            if (w == 8)
                for (int i = 0; i < rows; i++) memcpy(&x[i], src + i * nbytes, 8);
            else
                for (int i = 0; i < rows; i++)
                    for (int j = 0; j < w; j++) x[i] |= (uint64_t)src[i * nbytes + j] << (8 * j);
            transpose8(x);
            for (int j = 0; j < w; j++) {
                uint64_t lo = x[j] & 0x0F0F0F0F0F0F0F0Full, hi = (x[j] >> 4) & 0x0F0F0F0F0F0F0F0Full;
                memcpy(tb + 2 * (p0 + j) * BLOCK + g, &lo, 8);
                memcpy(tb + 2 * (p0 + j) * BLOCK + BLOCK + g, &hi, 8);
            }
        }
    }
}

/* sum_t table[t][nibble_t(row)] over the 2 * nbytes nibbles of one code row (float tables), in four
 * partial sums so the additions overlap. */
static float row_dot(const uint8_t *row, const float *table, int64_t nbytes) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int64_t p = 0;
    for (; p + 2 <= nbytes; p += 2) {
        const float *t = table + 32 * p;
        s0 += t[row[p] & 15], s1 += t[16 + (row[p] >> 4)];
        s2 += t[32 + (row[p + 1] & 15)], s3 += t[48 + (row[p + 1] >> 4)];
    }
    if (p < nbytes) s0 += table[32 * p + (row[p] & 15)], s1 += table[32 * p + 16 + (row[p] >> 4)];
    return (s0 + s1) + (s2 + s3);
}

/* Code rows: `row_bytes` bytes each, read as `nbytes` nibble-packed bytes (bits 4: as they are; bits 3:
 * a stream of 3-bit codes, nbytes = ceil(d / 2), scored exactly by pairs of codes and expanded by the
 * approximate stage to the split layout of scan_nbytes(nbytes, 3) bytes). */
typedef struct {
    const uint8_t *codes;   /* [n, row_bytes] */
    int64_t n, row_bytes, nbytes;
    int bits;
} rows_t;

/* The 3-bit codes of a stream row (8 codes in 3 bytes, least significant bits first) as out [nbytes]:
 * code j in nibble j (codes past the row's end read as 0). */
static void expand3(const uint8_t *row, int64_t row_bytes, int64_t nbytes, uint8_t *out) {
    for (int64_t g = 0; 4 * g < nbytes; g++) {
        uint32_t w = 0, b;
        if (3 * g + 4 <= row_bytes) memcpy(&w, row + 3 * g, 4), w &= 0xffffff;
        else
            for (int i = 0; i < 3 && 3 * g + i < row_bytes; i++) w |= (uint32_t)row[3 * g + i] << (8 * i);
        b = (w & 0x3f) | ((w & 0xfc0) << 2) | ((w & 0x3f000) << 4) | ((w & 0xfc0000) << 6);  /* 2 codes a byte */
        b = (b & 0x07070707u) | ((b & 0x38383838u) << 1);                                  /* one a nibble */
        if (4 * g + 4 <= nbytes) memcpy(out + 4 * g, &b, 4);
        else
            for (int i = 0; 4 * g + i < nbytes; i++) out[4 * g + i] = (uint8_t)(b >> (8 * i));
    }
}

/* Floats of the pair tables exact_tables writes (none but for 3-bit codes). */
static inline int64_t exact_size(int64_t nbytes, int bits) { return bits == 3 ? 64 * nbytes : 0; }

/* The exact tables of code rows of `bits` from their float nibble tables t [2 nbytes, 16] (for 3-bit
 * codes one code per nibble): t itself, or for 3-bit codes the pair tables out [nbytes, 64], entry
 * [i, a + 8 b] = t[2i, a] + t[2i + 1, b] (codes 2i and 2i + 1, six consecutive bits of the stream). */
static const float *exact_tables(const float *t, int64_t nbytes, int bits, float *out) {
    if (bits != 3) return t;
    for (int64_t i = 0; i < nbytes; i++)
        for (int b = 0; b < 8; b++)
            for (int a = 0; a < 8; a++) out[64 * i + 8 * b + a] = t[32 * i + a] + t[32 * i + 16 + b];
    return out;
}

/* sum_i pt[i][pair_i] over the npairs 6-bit code pairs of a stream row of 3-bit codes (row_bytes bytes;
 * pairs past its end read as 0), four pairs (3 bytes) at a time, in four partial sums. */
static float pair_dot(const uint8_t *row, int64_t row_bytes, const float *pt, int64_t npairs) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int64_t g = 0;
    for (; 4 * g + 4 <= npairs && 3 * g + 4 <= row_bytes; g++, pt += 256) {
        uint32_t w;
        memcpy(&w, row + 3 * g, 4);
        s0 += pt[w & 63], s1 += pt[64 + ((w >> 6) & 63)];
        s2 += pt[128 + ((w >> 12) & 63)], s3 += pt[192 + ((w >> 18) & 63)];
    }
    for (; 4 * g < npairs; g++, pt += 256) {  /* the last group or two, read byte by byte */
        uint32_t w = 0;
        for (int i = 0; i < 3 && 3 * g + i < row_bytes; i++) w |= (uint32_t)row[3 * g + i] << (8 * i);
        for (int j = 0; j < 4 && 4 * g + j < npairs; j++) s0 += pt[64 * j + ((w >> (6 * j)) & 63)];
    }
    return (s0 + s1) + (s2 + s3);
}

/* <c_v, table> of code row v, with the rows' exact tables (exact_tables). */
static inline float code_dot(const rows_t *c, int64_t v, const float *exact) {
    const uint8_t *row = c->codes + v * c->row_bytes;
    return c->bits == 3 ? pair_dot(row, c->row_bytes, exact, c->nbytes) : row_dot(row, exact, c->nbytes);
}

/* Bytes per row the approximate stage scans: nbytes, or for 3-bit codes (nbytes = ceil(d/2)) the split
 * layout's ceil(d/2) pair nibbles and ceil(d/4) low-bit nibbles. */
static inline int64_t scan_nbytes(int64_t nbytes, int bits) {
    return bits == 3 ? (nbytes + (nbytes + 1) / 2 + 1) / 2 : nbytes;
}

/* The split layout out [scan_nbytes(nbytes, 3)] of a row of 3-bit codes e [nbytes] (code j in nibble j):
 * nibble t < nbytes holds code 2t >> 1 (bits 0-1) and code 2t + 1 >> 1 (bits 2-3), nibble nbytes + u
 * (u < ceil(nbytes / 2)) the low bits of codes 4u .. 4u + 3 (bit j: code 4u + j); a last odd nibble is 0. */
static void split3(const uint8_t *e, int64_t nbytes, uint8_t *out) {
    const int64_t nlow = (nbytes + 1) / 2;
    memset(out, 0, (size_t)scan_nbytes(nbytes, 3));
    for (int64_t t = 0; t < nbytes; t++)
        out[t >> 1] |= (uint8_t)((((e[t] >> 1) & 3) | (((e[t] >> 5) & 3) << 2)) << (4 * (t & 1)));
    for (int64_t u = 0; u < nlow; u++) {
        uint8_t a = e[2 * u], b = 2 * u + 1 < nbytes ? e[2 * u + 1] : 0;
        int64_t t = nbytes + u;
        out[t >> 1] |= (uint8_t)(((a & 1) | ((a >> 3) & 2) | ((b & 1) << 2) | ((b >> 1) & 8)) << (4 * (t & 1)));
    }
}

/* Bytes of scratch load_block needs: a zero-padded copy of a block's rows, then the raw transposition
 * of 3-bit rows (or their split rows and one expanded row). */
static int64_t block_scratch(int64_t nbytes) { return 2 * BLOCK * (nbytes + 8) + 16; }

/* Transposes rows [r0, r0 + cnt) as the approximate stage reads them into tb [scan_nbytes][2][BLOCK] (see
 * transpose_block), with scratch xb [block_scratch(nbytes)]. With AVX2, a block of fewer than BLOCK rows,
 * or one whose tile loads would read past the last row (8 bytes at a time), is first copied into xb,
 * zero-padded (an IVF list ends in such a block). */
static void load_block(const rows_t *c, int64_t r0, int cnt, int simd, uint8_t *xb, uint8_t *tb) {
    const int64_t rb = c->row_bytes;
#ifdef TQ_X86
    if (simd) {
        const uint8_t *src = c->codes + r0 * rb;
        if (cnt < BLOCK || (r0 + BLOCK) * rb + 8 > c->n * rb) {
            memcpy(xb, src, (size_t)(cnt * rb));
            memset(xb + cnt * rb, 0, (size_t)((BLOCK - cnt) * rb + 8));
            src = xb;
        }
        if (c->bits == 4) transpose_block_avx2(src, rb, 0, tb);
        else transpose3_block_avx2(src, rb, c->nbytes, 0, xb + BLOCK * rb + 8, tb);
        return;
    }
#endif
    (void)simd;
    if (c->bits == 4) {
        transpose_block(c->codes, rb, r0, cnt, tb);
        return;
    }
    const int64_t sb = scan_nbytes(c->nbytes, 3);
    uint8_t *e = xb + BLOCK * sb;  /* one row, one code per nibble */
    for (int i = 0; i < cnt; i++) {
        expand3(c->codes + (r0 + i) * rb, rb, c->nbytes, e);
        split3(e, c->nbytes, xb + i * sb);
    }
    transpose_block(xb, sb, 0, cnt, tb);
}

/* What one scan of code rows shares: the rows, the query tables and transposition buffers. */
typedef struct {
    rows_t rows;
    const float *scale;     /* [n] */
    const float *sq_exact;  /* the exact tables of ||c||^2 (exact_tables), or NULL */
    const uint8_t *qtab;    /* [nq, 2 sbytes, 16], sbytes = scan_nbytes(nbytes, bits) */
    const float *qmul, *qadd, *qoffset;
    scan_fn scan;
    int simd;
    int64_t group;          /* blocks transposed together, at most GROUP */
    int64_t row_tag;        /* added to the row numbers entering the reservoirs */
    uint8_t *tb;            /* [group][sbytes][2][BLOCK] */
    uint8_t *xb;            /* [block_scratch(nbytes)] load_block scratch */
} scan_t;

/* Scores the blocks first, first + stride, ... of 32 rows for the queries qidx[0, m) (tables and
 * reservoirs res[qidx[i]]), c->group blocks at a time (transposed once, then scanned by every query while
 * they are in the L1 cache). */
static void scan_blocks(const scan_t *c, int64_t first, int64_t stride, const int64_t *qidx, reservoir_t *res,
                        int64_t m) {
    const int64_t n = c->rows.n, nbytes = c->rows.nbytes, nblocks = (n + BLOCK - 1) / BLOCK;
    const int64_t sb = scan_nbytes(nbytes, c->rows.bits), tsize = 2 * sb * 16;
    float sp[GROUP][BLOCK], bp[GROUP][BLOCK];
    block_t blk[GROUP];
    query_t qg[QGROUP];
    for (int64_t b0 = first; b0 < nblocks; b0 += c->group * stride) {
        int nblk = 0;
        for (; nblk < c->group && b0 + nblk * stride < nblocks; nblk++) {
            int64_t r0 = (b0 + nblk * stride) * BLOCK;
            int cnt = n - r0 < BLOCK ? (int)(n - r0) : BLOCK;
            uint8_t *tbb = c->tb + nblk * 2 * BLOCK * sb;
            load_block(&c->rows, r0, cnt, c->simd, c->xb, tbb);
            for (int i = 0; i < BLOCK; i++) {
                int v = PERM[i];
                float s = v < cnt ? c->scale[r0 + v] : 0.f;
                sp[nblk][i] = s;
                bp[nblk][i] = v >= cnt      ? -INFINITY  /* missing rows never win */
                              : c->sq_exact ? -s * s * code_dot(&c->rows, r0 + v, c->sq_exact)
                                            : 0.f;
            }
            blk[nblk] = (block_t){tbb, sp[nblk], bp[nblk], c->row_tag + r0};
        }
        for (int64_t i0 = 0; i0 < m; i0 += QGROUP) {
            int nqb = m - i0 < QGROUP ? (int)(m - i0) : QGROUP;
            for (int j = 0; j < nqb; j++) {
                int64_t q = qidx[i0 + j];
                qg[j] = (query_t){c->qtab + q * tsize, c->qmul[q], c->qadd[q], c->qoffset ? c->qoffset[q] : 0.f,
                                  res + q};
            }
            c->scan(blk, nblk, qg, nqb, sb);
        }
    }
}

/* The keep-th largest value held (-inf when fewer are held); may shrink the reservoir to keep. */
static float reservoir_floor(reservoir_t *r) {
    if (r->n < r->keep) return -INFINITY;
    if (r->n > r->keep) reservoir_shrink(r);
    float low = r->val[0];
    for (int64_t i = 1; i < r->n; i++) low = r->val[i] < low ? r->val[i] : low;
    return low;
}

/* Blocks transposed together: as many as fill 3/4 of the L1 cache, 1 to GROUP. */
static int64_t blocks_per_group(int64_t nbytes) {
    int64_t group = cache_bytes(1) / 4 * 3 / (2 * BLOCK * nbytes);
    return group < 1 ? 1 : group > GROUP ? GROUP : group;
}

/* Threshold estimate: the best score of every `stride`-th block, stride = depth / SAMPLE_HITS; about
 * SAMPLE_HITS of these blocks hold a row of the true top `depth` (at most that many, however the rows
 * cluster). Used when stride >= MIN_SAMPLE_STRIDE. */
#define SAMPLE_HITS 8
#define MIN_SAMPLE_STRIDE 8

/* Approximate stage: the `depth` best approximate scores of code rows [0, n) per query, in no order,
 * into cval / crow [nq, depth] (-inf / row -1 where fewer rows exist). Returns 0, or -1 when out of
 * memory.
 *
 * For a deep top (depth >= SAMPLE_HITS * MIN_SAMPLE_STRIDE) each query first scores a sample of the
 * blocks and starts the full scan at a threshold t: the sample_keep-th best of the sampled blocks' best
 * scores, which exceeds the true depth-th best score with probability ~1e-3 (binomial tail, one hit
 * per block at most; a lower rank would let in more rows than the rescans it saves), so few rows enter
 * the reservoir. A query whose full scan finds fewer than `depth` rows above t is scanned again
 * without it, so the result never depends on the estimate (on GloVe-50, 20k and 100k rows, k = 64:
 * 2 to 6 queries in 10,000).
 *
 * codes [n, row_bytes] uint8, read as nbytes nibble-packed bytes (bits 4: row_bytes = nbytes) or as
 * 3-bit codes (bits 3; nbytes = ceil(d/2)), scanned in the split layout; scale [n] float; sq_table
 * [2 nbytes, 16] float or NULL (exact, one 3-bit code per nibble); qtab [nq, 2 sbytes, 16] uint8 (entries
 * <= 127, sbytes = scan_nbytes(nbytes, bits)) with qmul, qadd [nq]; qoffset [nq] or NULL.
 * allow_simd = 0 forces the portable loop. */
int tq_fastscan_candidates(const uint8_t *codes, int64_t n, int64_t row_bytes, int64_t nbytes, int bits,
                           const float *scale, const float *sq_table, int64_t nq, const uint8_t *qtab,
                           const float *qmul, const float *qadd, const float *qoffset, int64_t depth, float *cval,
                           int64_t *crow, int allow_simd) {
    for (int64_t i = 0; i < nq * depth; i++) cval[i] = -INFINITY, crow[i] = -1;
    if (n <= 0 || nq <= 0 || depth <= 0) return 0;
    scan_fn scan = pick_scan(allow_simd);
    int simd = scan != score_blocks_generic;
    const int64_t sb = scan_nbytes(nbytes, bits), tsize = 2 * sb * 16, cap = 2 * depth, nblocks = (n + BLOCK - 1) / BLOCK;
    const int64_t stride = depth / SAMPLE_HITS;
    int64_t sample_keep = 0;  /* the rank taken among the sampled blocks' best scores */
    if (stride >= MIN_SAMPLE_STRIDE) {
        double hits = (double)depth / (double)stride;
        sample_keep = (int64_t)ceil(hits + 2.5 * sqrt(hits) + 2.0);
    }
    const int sample = sample_keep > 0 && nblocks / stride > sample_keep;  /* more sampled blocks than that */
    /* Queries whose tables fill 3/4 of the L2 cache are scanned together (each chunk transposes the rows
     * again). */
    int64_t table_bytes = cache_bytes(2) / 4 * 3;
    table_bytes = table_bytes < (96 << 10) ? 96 << 10 : table_bytes > (3 << 19) ? 3 << 19 : table_bytes;
    const int64_t group = blocks_per_group(sb);
    int64_t chunk = table_bytes / tsize;
    chunk = chunk < QGROUP ? QGROUP : chunk;
    chunk = (nq + (nq + chunk - 1) / chunk - 1) / ((nq + chunk - 1) / chunk);  /* equal chunks */
    uint8_t *tb, *xb;
    float *sqx, *rval, *floor_;
    int64_t *rrow, *qidx, *ridx;
    reservoir_t *res;
    int32_t *tmp;
    const size_t sizes[] = {(size_t)(group * 2 * BLOCK * sb), (size_t)block_scratch(nbytes),
                            sizeof(float) * (size_t)exact_size(nbytes, bits),
                            sizeof(float) * (size_t)(chunk * cap), sizeof(float) * (size_t)chunk,
                            sizeof(int64_t) * (size_t)(chunk * cap), sizeof(int64_t) * (size_t)chunk,
                            sizeof(int64_t) * (size_t)chunk, sizeof(reservoir_t) * (size_t)chunk,
                            sizeof(int32_t) * (size_t)cap};
    void **const ptrs[] = {(void **)&tb, (void **)&xb, (void **)&sqx, (void **)&rval, (void **)&floor_,
                           (void **)&rrow, (void **)&qidx, (void **)&ridx, (void **)&res, (void **)&tmp};
    if (arena_get(1, 10, sizes, ptrs)) return -1;
    const float *sq = sq_table ? exact_tables(sq_table, nbytes, bits, sqx) : NULL;
    for (int64_t c0 = 0; c0 < nq; c0 += chunk) {
        int64_t m = c0 + chunk < nq ? chunk : nq - c0;
        /* this chunk's queries c0.. are its tables and reservoirs 0.. */
        const scan_t ctx = {{codes, n, row_bytes, nbytes, bits}, scale, sq, qtab + c0 * tsize, qmul + c0,
                            qadd + c0, qoffset ? qoffset + c0 : NULL, scan, simd, group, 0, tb, xb};
        for (int64_t i = 0; i < m; i++) {
            qidx[i] = i;
            floor_[i] = -INFINITY;
        }
        if (sample) {  /* the sample's top sample_keep, in the same buffers */
            for (int64_t i = 0; i < m; i++)
                res[i] = (reservoir_t){rval + i * cap, rrow + i * cap, 0, sample_keep, -INFINITY, tmp, simd, 1};
            scan_blocks(&ctx, 0, stride, qidx, res, m);
            for (int64_t i = 0; i < m; i++) floor_[i] = reservoir_floor(res + i);
        }
        for (int64_t i = 0; i < m; i++)
            res[i] = (reservoir_t){rval + i * cap, rrow + i * cap, 0, depth, floor_[i], tmp, simd, 0};
        scan_blocks(&ctx, 0, 1, qidx, res, m);
        int64_t nredo = 0;  /* queries whose estimate was too high: scanned again from scratch */
        for (int64_t i = 0; i < m; i++)
            if (res[i].n < depth && floor_[i] > -INFINITY) {
                ridx[nredo++] = i;
                res[i] = (reservoir_t){res[i].val, res[i].row, 0, depth, -INFINITY, tmp, simd, 0};
            }
        if (nredo) scan_blocks(&ctx, 0, 1, ridx, res, nredo);
        for (int64_t i = 0; i < m; i++) {
            reservoir_t *r = res + i;
            if (r->n > depth) reservoir_shrink(r);
            int64_t cnt = r->n < depth ? r->n : depth;
            memcpy(cval + (c0 + i) * depth, r->val, sizeof(float) * (size_t)cnt);
            memcpy(crow + (c0 + i) * depth, r->row, sizeof(int64_t) * (size_t)cnt);
        }
    }
    arena_done(1);
    return 0;
}

/* Candidates ranked by counting (O(depth^2)) up to this depth; deeper ones go through the heap. */
#define RANK_MAX_DEPTH 256
/* Re-scoring fetches the code row, scale and label of the candidate this many places ahead. */
#define PREFETCH 8
/* A candidate row is (list << LIST_BITS) | row of that list. */
#define LIST_BITS 32

/* Where candidates come from: code rows of nl lists (one for a flat scan), list l labelled labels[l][row]
 * (label_base[l] + row where labels[l] is NULL). */
typedef struct {
    const rows_t *rows;            /* [nl] */
    const float *const *scale;     /* [nl] -> [n] */
    const int64_t *const *labels;  /* [nl] -> [n] or NULL */
    const int64_t *label_base;     /* [nl] */
} source_t;

/* Scratch of merge_query: ex, eid, rank [depth], key [depth + 8], exact [exact_size]. */
typedef struct {
    float *ex;
    int64_t *eid, *rank;
    int32_t *key;
    float *exact;
} merge_t;

/* Re-scores one query's candidates cand [depth] (tagged rows, -1: none) exactly with its float nibble
 * tables ft [2 nbytes, 16] (plus `off`, and -scale^2 * ||c||^2 with the exact tables sq) and merges them
 * into the heap row ev / ei [k]; a row that held nothing (all -inf) receives its best k in ascending
 * order. Returns 1 when the row is only a heap, else 0. */
static int merge_query(const source_t *src, const float *ft, const float *sq, float off, const int64_t *cand,
                       int64_t depth, int64_t k, float *ev, int64_t *ei, const merge_t *w, int simd) {
    const int64_t low = ((int64_t)1 << LIST_BITS) - 1;
    const float *exact = exact_tables(ft, src->rows->nbytes, src->rows->bits, w->exact);
    int empty = depth <= RANK_MAX_DEPTH;  /* rank the candidates into an empty heap row */
    for (int64_t j = 0; empty && j < k; j++) empty = ev[j] == -INFINITY;
    int64_t cnt = 0;
    for (int64_t j = 0; j < depth; j++) {
        int64_t v = cand[j];
        if (j + PREFETCH < depth && cand[j + PREFETCH] >= 0) {
            int64_t u = cand[j + PREFETCH];
            const rows_t *c = src->rows + (u >> LIST_BITS);
            __builtin_prefetch(c->codes + (u & low) * c->row_bytes);
            __builtin_prefetch(src->scale[u >> LIST_BITS] + (u & low));
            if (src->labels[u >> LIST_BITS]) __builtin_prefetch(src->labels[u >> LIST_BITS] + (u & low));
        }
        if (v < 0) continue;
        int64_t l = v >> LIST_BITS, r = v & low;
        const rows_t *c = src->rows + l;
        float s = src->scale[l][r];
        float e = s * code_dot(c, r, exact) + (sq ? -s * s * code_dot(c, r, sq) : 0.f) + off;
        int64_t id = src->labels[l] ? src->labels[l][r] : src->label_base[l] + r;
        if (empty) w->ex[cnt] = e, w->eid[cnt++] = id;
        else if (e > ev[0]) heap_replace_top(ev, ei, k, e, id);
    }
    if (!empty) return 1;
    if (cnt > k) {  /* keep the best k (ties in candidate order), then rank only those */
        reservoir_t best = {w->ex, w->eid, cnt, k, -INFINITY, w->key, simd, 0};
        reservoir_shrink(&best);
        cnt = k;
    }
    rank_floats(w->ex, cnt, w->key, w->rank, simd);
    for (int64_t j = 0; j < cnt; j++) ev[k - 1 - w->rank[j]] = w->ex[j], ei[k - 1 - w->rank[j]] = w->eid[j];
    return 0;
}

/* Rows of one query's float tables: 2 nbytes exact ones, then for 3-bit codes the 2 scan_nbytes of the
 * approximate stage (the layout of fastscan.table_layout). */
static inline int64_t table_rows(int64_t nbytes, int bits) {
    return 2 * nbytes + (bits == 3 ? 2 * scan_nbytes(nbytes, bits) : 0);
}

/* The float tables ftab [nq, table_rows, 16] of the rotated queries qs [nq, dim] (tq_nibble_tables with the
 * layout coord, bank_of, bank) and the approximate stage's quantized tables qtab [nq, 2 scan_nbytes, 16],
 * qmul, qadd [nq] (tq_quantize_tables). */
static void query_tables(const float *qs, int64_t nq, int64_t dim, const int32_t *coord, const int32_t *bank_of,
                         const float *bank, int64_t nbytes, int bits, float *ftab, uint8_t *qtab, float *qmul,
                         float *qadd) {
    const int64_t rows = table_rows(nbytes, bits), scan_rows = 2 * scan_nbytes(nbytes, bits);
    tq_nibble_tables(qs, nq, dim, coord, bank_of, bank, rows, ftab);
    if (rows == scan_rows) {
        tq_quantize_tables(ftab, nq, rows, qtab, qmul, qadd);
        return;
    }
    for (int64_t i = 0; i < nq; i++)
        tq_quantize_tables(ftab + (i * rows + 2 * nbytes) * 16, 1, scan_rows, qtab + i * scan_rows * 16, qmul + i,
                           qadd + i);
}

/* Scans code rows [0, n) for nq queries (see the file comment): the float tables ftab [nq, table_rows, 16]
 * of the rotated queries qs [nq, dim] and the approximate stage's quantized tables are built
 * (query_tables), approximate candidates found (tq_fastscan_candidates, which says how rows are read),
 * re-scored exactly with ftab and merged into heap row rows[i] (i when rows is NULL)
 * of heap_val / heap_ids [*, k], labelled labels[row] (label_base + row when labels is NULL). A heap
 * row that held nothing (all -inf) receives its best k in ascending order, itself a valid min-heap.
 * Returns 0 when every heap row it touched is in ascending order, 1 when some are only heaps, -1 when
 * out of memory. */
int tq_fastscan(const uint8_t *codes, int64_t n, int64_t row_bytes, int64_t nbytes, int bits, const float *scale,
                const float *sq_table, const int64_t *labels, int64_t label_base, int64_t nq, const float *qs,
                int64_t dim, const int32_t *coord, const int32_t *bank_of, const float *bank,
                const float *qoffset, int64_t depth, const int64_t *rows, int64_t k, float *heap_val, int64_t *heap_ids,
                int allow_simd) {
    if (n <= 0 || nq <= 0) return 0;
    if (depth > n) depth = n;
    const int64_t tsize = table_rows(nbytes, bits) * 16, qsize = 2 * scan_nbytes(nbytes, bits) * 16;
    float *ftab, *cval, *qmul, *qadd, *sqx;
    int64_t *crow;
    uint8_t *qtab;
    merge_t w;
    const size_t esize = sizeof(float) * (size_t)exact_size(nbytes, bits);
    const size_t sizes[] = {sizeof(float) * (size_t)(nq * tsize), sizeof(float) * (size_t)(nq * depth),
                            sizeof(float) * (size_t)nq, sizeof(float) * (size_t)nq, sizeof(float) * (size_t)depth,
                            sizeof(int64_t) * (size_t)(nq * depth), sizeof(int64_t) * (size_t)depth,
                            sizeof(int64_t) * (size_t)depth, (size_t)(nq * qsize), esize, esize,
                            sizeof(int32_t) * (size_t)(depth + 8)};
    void **const ptrs[] = {(void **)&ftab, (void **)&cval, (void **)&qmul, (void **)&qadd, (void **)&w.ex,
                           (void **)&crow, (void **)&w.eid, (void **)&w.rank, (void **)&qtab, (void **)&w.exact,
                           (void **)&sqx, (void **)&w.key};
    if (arena_get(0, 12, sizes, ptrs)) return -1;
    const rows_t codes_ = {codes, n, row_bytes, nbytes, bits};
    const source_t src = {&codes_, &scale, &labels, &label_base};
    const int simd = allow_simd && cpu_avx2();
    int heaps_only = 0;
    query_tables(qs, nq, dim, coord, bank_of, bank, nbytes, bits, ftab, qtab, qmul, qadd);
    int status = tq_fastscan_candidates(codes, n, row_bytes, nbytes, bits, scale, sq_table, nq, qtab, qmul, qadd,
                                        qoffset, depth, cval, crow, allow_simd);
    const float *sq = sq_table ? exact_tables(sq_table, nbytes, bits, sqx) : NULL;
    for (int64_t q = 0; status == 0 && q < nq; q++) {
        const float *ft = ftab + q * tsize;
        if (q + 1 < nq)  /* the next query's exact tables, from a cache level further out */
            for (int64_t l = 0; l < 2 * nbytes * 16; l += 16) __builtin_prefetch(ft + tsize + l);
        int64_t hrow = rows ? rows[q] : q;
        heaps_only |= merge_query(&src, ft, sq, qoffset ? qoffset[q] : 0.f, crow + q * depth, depth, k,
                                  heap_val + hrow * k, heap_ids + hrow * k, &w, simd);
    }
    arena_done(0);
    return status < 0 ? status : heaps_only;
}

/* IVF lists: code rows of nl lists (codes[l] [n[l], row_bytes] read as in tq_fastscan_candidates,
 * scale[l] [n[l]], labelled labels[l][row], or label_base[l] + row where labels[l] is NULL), list l probed
 * by the queries pair_q[pair_start[l], pair_start[l + 1]) (ascending). Scans them for the queries
 * [q0, q0 + nq) of qs [*, dim]: each query's tables are built once (as in tq_fastscan), its approximate
 * candidates gathered in one reservoir over every list it probes, and its `depth` best re-scored exactly
 * and merged into heap row q of heap_val / heap_ids [*, k]. Returns as tq_fastscan. */
int tq_fastscan_lists(int64_t nl, const uint8_t *const *codes, const int64_t *n, const float *const *scale,
                      const int64_t *const *labels, const int64_t *label_base, const int64_t *pair_start,
                      const int64_t *pair_q, int64_t row_bytes, int64_t nbytes, int bits, const float *sq_table,
                      int64_t q0, int64_t nq, const float *qs, int64_t dim, const int32_t *coord,
                      const int32_t *bank_of, const float *bank, int64_t depth, int64_t k, float *heap_val,
                      int64_t *heap_ids, int allow_simd) {
    if (nq <= 0 || nl <= 0 || depth <= 0) return 0;
    const scan_fn scan = pick_scan(allow_simd);
    const int simd = scan != score_blocks_generic;
    const int64_t sb = scan_nbytes(nbytes, bits), tsize = table_rows(nbytes, bits) * 16, qsize = 2 * sb * 16;
    const int64_t cap = 2 * depth, group = blocks_per_group(sb);
    const size_t esize = sizeof(float) * (size_t)exact_size(nbytes, bits);
    float *ftab, *qmul, *qadd, *rval, *sqx;
    int64_t *rrow, *qidx;
    uint8_t *qtab, *tb, *xb;
    int32_t *tmp;
    reservoir_t *res;
    rows_t *lists;
    merge_t w;
    const size_t sizes[] = {sizeof(float) * (size_t)(nq * tsize), (size_t)(nq * qsize), sizeof(float) * (size_t)nq,
                            sizeof(float) * (size_t)nq, sizeof(float) * (size_t)(nq * cap),
                            sizeof(int64_t) * (size_t)(nq * cap), sizeof(int64_t) * (size_t)nq,
                            sizeof(reservoir_t) * (size_t)nq, sizeof(int32_t) * (size_t)cap,
                            (size_t)(group * 2 * BLOCK * sb), (size_t)block_scratch(nbytes), esize,
                            sizeof(rows_t) * (size_t)nl, sizeof(float) * (size_t)depth,
                            sizeof(int64_t) * (size_t)depth, sizeof(int64_t) * (size_t)depth,
                            sizeof(int32_t) * (size_t)(depth + 8), esize};
    void **const ptrs[] = {(void **)&ftab, (void **)&qtab, (void **)&qmul, (void **)&qadd, (void **)&rval,
                           (void **)&rrow, (void **)&qidx, (void **)&res, (void **)&tmp, (void **)&tb, (void **)&xb,
                           (void **)&sqx, (void **)&lists, (void **)&w.ex, (void **)&w.eid, (void **)&w.rank,
                           (void **)&w.key, (void **)&w.exact};
    if (arena_get(0, 18, sizes, ptrs)) return -1;
    const float *sq = sq_table ? exact_tables(sq_table, nbytes, bits, sqx) : NULL;
    query_tables(qs + q0 * dim, nq, dim, coord, bank_of, bank, nbytes, bits, ftab, qtab, qmul, qadd);
    for (int64_t i = 0; i < nq; i++)
        res[i] = (reservoir_t){rval + i * cap, rrow + i * cap, 0, depth, -INFINITY, tmp, simd, 0};
    for (int64_t l = 0; l < nl; l++) {
        lists[l] = (rows_t){codes[l], n[l], row_bytes, nbytes, bits};
        const int64_t *p = pair_q + pair_start[l], *end = pair_q + pair_start[l + 1];
        while (p < end && *p < q0) p++;  /* this call's queries of the list's (ascending) */
        int64_t m = 0;
        for (; p < end && *p < q0 + nq; p++) qidx[m++] = *p - q0;
        if (m == 0 || n[l] == 0) continue;
        const scan_t ctx = {lists[l], scale[l], sq, qtab, qmul, qadd, NULL, scan, simd, group,
                            l << LIST_BITS, tb, xb};
        scan_blocks(&ctx, 0, 1, qidx, res, m);
    }
    const source_t src = {lists, scale, labels, label_base};
    int heaps_only = 0;
    for (int64_t i = 0; i < nq; i++) {
        reservoir_t *r = res + i;
        if (r->n > depth) reservoir_shrink(r);
        int64_t cnt = r->n < depth ? r->n : depth;
        heaps_only |= merge_query(&src, ftab + i * tsize, sq, 0.f, r->row, cnt, k,
                                  heap_val + (q0 + i) * k, heap_ids + (q0 + i) * k, &w, simd);
    }
    arena_done(0);
    return heaps_only;
}

/* ------------------------------------------------------------------------------- top columns */

#ifdef TQ_X86
/* The entries >= t of row [n] and their columns into cv, cc in column order, 8 columns at a time up to
 * *end (where the caller goes on); returns how many. */
AVX2 static int64_t at_least_avx2(const float *row, int64_t n, float t, float *cv, int64_t *cc, int64_t *end) {
    const __m256 tv = _mm256_set1_ps(t);
    int64_t cnt = 0, j = 0;
    for (; j + 8 <= n; j += 8) {
        unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), tv, _CMP_GE_OQ));
        for (; mask; mask &= mask - 1) {
            int b = __builtin_ctz(mask);
            cv[cnt] = row[j + b], cc[cnt++] = j + b;
        }
    }
    *end = j;
    return cnt;
}
#endif

/* The k largest entries of each row of x [m, n] (1 <= k <= n, no NaN), best first, into val [m, k] and
 * their columns into col [m, k]; of equal values the earlier column ranks first. Per row: the columns
 * fall into G groups (column j in group j mod G, G = 2k rounded up to a multiple of 8, at most n),
 * t = the k-th largest of their maxima (k entries are >= t, so is the k-th largest), and the entries
 * >= t (about 2k) are ranked by counting, or pass through a heap when ties make them many. Returns -1
 * when out of memory, else 0. */
int tq_top_columns(const float *x, int64_t m, int64_t n, int64_t k, float *val, int64_t *col) {
    float *cv = malloc(sizeof(float) * (size_t)n);
    int64_t *cc = malloc(sizeof(int64_t) * (size_t)n), *rank = malloc(sizeof(int64_t) * (size_t)n);
    int32_t *key = malloc(sizeof(int32_t) * (size_t)(n + 8));
    if (!cv || !cc || !rank || !key) {
        free(cv), free(cc), free(rank), free(key);
        return -1;
    }
    const int64_t groups = (2 * k + 7) / 8 * 8 < n ? (2 * k + 7) / 8 * 8 : n, per = n / groups;
    const int simd = cpu_avx2();
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * n;
        float *v = val + i * k, t = -INFINITY;
        int64_t *c = col + i * k, cnt = 0;
        memcpy(cv, row, sizeof(float) * (size_t)groups);  /* group maxima */
        for (int64_t r = 1; r < per; r++)
            for (int64_t g = 0; g < groups; g++) cv[g] = row[r * groups + g] > cv[g] ? row[r * groups + g] : cv[g];
        rank_floats(cv, groups, key, rank, simd);
        for (int64_t g = 0; g < groups; g++) t = rank[g] == k - 1 ? cv[g] : t;
        int64_t j = 0;
#ifdef TQ_X86
        if (simd) cnt = at_least_avx2(row, n, t, cv, cc, &j);
#endif
        for (; j < n; j++) {  /* the entries >= t, in column order */
            cv[cnt] = row[j], cc[cnt] = j;
            cnt += row[j] >= t;
        }
        if (cnt <= RANK_MAX_DEPTH) {
            rank_floats(cv, cnt, key, rank, simd);
            for (j = 0; j < cnt; j++)
                if (rank[j] < k) v[rank[j]] = cv[j], c[rank[j]] = cc[j];
            continue;
        }
        for (j = 0; j < k; j++) v[j] = -INFINITY, c[j] = INT64_MAX;  /* ranks below every entry */
        for (j = 0; j < cnt; j++)
            if (worse(v[0], c[0], cv[j], cc[j])) heap_replace_top(v, c, k, cv[j], cc[j]);
        for (int64_t e = k - 1; e > 0; e--) {  /* heap sort: the lowest ranked moves to the end */
            float tv = v[e];
            int64_t tc = c[e];
            v[e] = v[0], c[e] = c[0];
            heap_replace_top(v, c, e, tv, tc);
        }
    }
    free(cv), free(cc), free(rank), free(key);
    return 0;
}

/* Groups the (query, list) pairs of lists [m, p] (query i probes lists[i * p .. i * p + p), numbers < nl)
 * by list with a counting sort: list l is probed by queries[start[l], start[l + 1]), ascending. */
void tq_group_pairs(const int64_t *lists, int64_t m, int64_t p, int64_t nl, int64_t *start, int64_t *queries) {
    memset(start, 0, sizeof(int64_t) * (size_t)(nl + 1));
    for (int64_t i = 0; i < m * p; i++) start[lists[i] + 1]++;
    for (int64_t l = 0; l < nl; l++) start[l + 1] += start[l];
    for (int64_t i = 0; i < m * p; i++) queries[start[lists[i]]++] = i / p;  /* start[l] moves to start[l + 1] */
    for (int64_t l = nl; l > 0; l--) start[l] = start[l - 1];
    start[0] = 0;
}
