// Split-K decode attention over 4-bit value codes and 4- or 8-bit key codes, CUDA C++. Built once per head dim
// D, pair of code kinds, ring depth and tiles per step (macros TQ_D, TQ_KEYS, TQ_VALUES, TQ_RING, TQ_PER): keys
// are 4-bit direction codes with float16 norms (tq4), FP4 E2M1 codes with UE8M0 exponents per group of 32 (fp4)
// or 8-bit direction codes with float16 norms (tq8); values are tq4 or fp4 codes.
//
// A block takes one (batch row x KV head, block of up to 8 query rows, split of the compressed tokens); each of its
// WARPS warps takes every WARPS-th tile of 16 tokens of the split and keeps its own online softmax. Tokens are on
// the M dimension of the tensor-core products (mma.m16n8k16, f16 operands, f32 accumulation), query rows on N:
//
//   scores^T [16 tokens, 8 rows] = K [16 tokens, D] . Q^T [D, 8 rows]       (K decoded in registers: operand A)
//   out^T    [D, 8 rows]        += V^T [D, 16 tokens] . P [16 tokens, 8 rows] (V decoded in registers: operand A)
//
// The codes stay in the cache's own layout (token rows of D / 2 bytes, coordinate 2i in the low nibble of byte i;
// 8-bit: D bytes, coordinate i in byte i). A product's sum over its k dimension may take the coordinates (tokens)
// in any order as long as both operands take the same one, so each thread loads contiguous bytes: for K, thread
// (g = lane / 4, t = lane % 4) holds rows g and g + 8 of the tile and the codes of coordinates [t D / 4,
// (t + 1) D / 4) of each, its k-step ks covering coordinates t D / 4 + 4 ks .. + 3 (the queries are loaded in the
// same order); for V, thread (g, t) holds tokens 2t, 2t + 1, 2t + 8, 2t + 9 and bytes [g D / 16, (g + 1) D / 16) of
// each, the output row g (g + 8) of m-tile mt being coordinate g D / 8 + 2 mt (+ 1). 4-bit codes become f16 levels
// by prmt lookups (the eight magnitudes' low and high bytes in four registers, the sign set from the code's high
// bit); 8-bit codes by a 256-entry table in shared memory, one copy per bank so that a warp's 32 lookups never
// conflict. FP4 levels are multiplied (f16x2) by 2^(group exponent - the token's largest), exact down to 2^-24,
// and 2^(largest - 127) is folded like a norm. The probabilities' fragment (C layout, tokens on rows) becomes the
// B operand of the second product by two movmatrix transposes. Key norms and query scales are applied to the
// score fragment, value norms to the probabilities. Each warp streams its tiles through its own ring of RING
// shared-memory stages filled by 16-byte cp.async copies (codes, and the 16-byte-aligned runs holding the side
// data) and computes PER tiles per step with one update of its online softmax for them all (more independent work
// between the softmax's shuffles): RING - PER tiles are in flight while PER are computed.
//
// Each block writes its split's partial softmax (running max in natural-log units, normalizer, value sum in the
// value encoder's rotated domain) in the layout of the Triton attention kernel's partials, beside the window's
// splits that kernel wrote before. Launched with counters (steps with few (bh, row block) pairs), the last block
// of a pair to finish (a counter per pair, taken after a memory fence) merges them all by log-sum-exp, rotates the
// compressed sum back and writes the output: one launch where the Triton path needs two; without, the Triton merge
// kernel follows. The reference is tqindex.kv.attention.compressed_attention_ref.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <vector>

#include "levels4.cuh"

#ifndef TQ_D
#define TQ_D 128
#endif
#ifndef TQ_KEYS
#define TQ_KEYS 0
#endif
#ifndef TQ_VALUES
#define TQ_VALUES 0
#endif
#ifndef TQ_RING
#define TQ_RING 4
#endif
#ifndef TQ_PER
#define TQ_PER 1
#endif

namespace {

using tq4::lookup;
using tq4::prmt;
using tq4::Table;

enum Kind { TQ4 = 0, FP4 = 1, TQ8 = 2 };  // code kinds (TQ_KEYS: any; TQ_VALUES: TQ4 or FP4)

constexpr int D = TQ_D;
constexpr int KEYS = TQ_KEYS, VALUES = TQ_VALUES;
constexpr int WARPS = 4;
constexpr int TILE = 16;  // tokens per warp step
constexpr int ROWS = 8;   // query rows per block (the N of the products)
constexpr int RING = TQ_RING;  // tiles a warp's ring holds
constexpr int PER = TQ_PER;    // tiles per online-softmax step (RING - PER copies in flight)
static_assert(PER >= 1 && RING > PER, "a ring holds the tiles of a step and at least one in flight");
constexpr int MT = D / 16;  // m-tiles of the value product, k-steps of the key product
constexpr int GROUPS = D / 32;  // FP4 scale groups of a token
constexpr int KROW = KEYS == TQ8 ? D : D / 2, VROW = D / 2;  // code bytes of a token's key, value
constexpr int KSIDE = KEYS == FP4 ? GROUPS : 2, VSIDE = VALUES == FP4 ? GROUPS : 2;  // side bytes of a token
constexpr float LN2 = 0.6931471805599453f;

// One stage of a warp's ring in shared memory: the key codes of a tile's 16 tokens, their value codes, then the
// 16-byte units holding the keys' side data (which may start anywhere in a unit: one unit more than its bytes),
// the values'.
struct Stage {
  static constexpr int KCODES = TILE * KROW, VCODES = TILE * VROW;
  static constexpr int KUNITS = KSIDE + 1, VUNITS = VSIDE + 1;
  static constexpr int KSIDE_AT = KCODES + VCODES, VSIDE_AT = KSIDE_AT + 16 * KUNITS;
  static constexpr int BYTES = VSIDE_AT + 16 * VUNITS;
};
constexpr int RINGS = WARPS * RING * Stage::BYTES;
constexpr int TABLE = KEYS == TQ8 ? 256 * 32 * 4 : 0;  // the 8-bit levels, a 4-byte slot per code and bank
constexpr int SUMS = WARPS * ROWS * D * 4;  // the warps' value sums (reusing the rings at the end)
constexpr int SMEM = RINGS + TABLE > SUMS ? RINGS + TABLE : SUMS;
constexpr int MAX_SPLITS = 128;  // splits the merge takes at most (python: attention_cuda.MAX_SPLITS)
static_assert(SMEM >= (ROWS * D + MAX_SPLITS * ROWS) * 4, "the merge's work space: ROWS x D floats, its weights");

// f16 levels of bytes ``at`` and at + 1 of w (8-bit codes) from this lane's copy of the table.
__device__ __forceinline__ uint32_t levels8(const uint16_t* tab, uint32_t w, int at) {
  return tab[prmt(w, 0u, 0x4440 + at) * 64] | uint32_t(tab[prmt(w, 0u, 0x4441 + at) * 64]) << 16;
}

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t transposed(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {  // f16x2 product
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 2^k for k <= 0 as f16 bits (0 below 2^-24).
__device__ __forceinline__ uint32_t pow2_half(int k) {
  return k >= -14 ? uint32_t(k + 15) << 10 : k >= -24 ? 1u << (k + 24) : 0u;
}

// The largest of the N bytes at p (N-byte aligned): a token's largest UE8M0 group exponent.
template <int N>
__device__ __forceinline__ int largest(const uint8_t* p) {
  uint32_t w;
  if constexpr (N == 2) {
    w = *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (N == 4) {
    w = *reinterpret_cast<const uint32_t*>(p);
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w = __vmaxu4(v.x, v.y);
  }
  w = __vmaxu4(w, w >> 16);
  return (int)max(w & 0xffu, (w >> 8) & 0xffu);
}

// The factor a token's side data ``p`` folds on its scores (probabilities): its float16 norm, or (FP4)
// 2^(largest exponent - 127), setting ``top`` to that exponent.
template <bool E2M1>
__device__ __forceinline__ float token_factor(const uint8_t* p, int& top) {
  if constexpr (E2M1) {
    top = largest<GROUPS>(p);
    return __int_as_float(top ? top << 23 : 0x400000);  // 2^(top - 127), subnormal for top = 0
  } else {
    return __half2float(*reinterpret_cast<const __half*>(p));
  }
}

__device__ __forceinline__ void copy16(uint32_t dst, const void* src, int bytes) {  // bytes < 16: zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// N 32-bit words from 4N-byte-aligned shared memory, in vector loads.
template <int N>
__device__ __forceinline__ void lds(const uint8_t* p, uint32_t (&w)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i / 4];
      w[i] = v.x, w[i + 1] = v.y, w[i + 2] = v.z, w[i + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

// Copy this lane's units of a tile's rows of ROW bytes (unit lane + 32 i: 16 bytes at 16 lane + 512 i, of row
// lane_row + i 512 / ROW), ``src`` and ``dst`` at its first unit: rows from ``rows`` on zero-filled.
template <int ROW>
__device__ __forceinline__ void issue_codes(uint32_t dst, const uint8_t* src, int rows, int lane_row) {
#pragma unroll
  for (int i = 0; i < TILE * ROW / 512; ++i)
    copy16(dst + 512 * i, src + 512 * i, lane_row + i * (512 / ROW) < rows ? 16 : 0);
}

// The copies of a warp's tiles, one every WARPS tiles from token ``first``, issued in order: each lane's sources
// advance by a step of WARPS tiles. A lane below Stage::KUNITS + Stage::VUNITS also copies one 16-byte unit of the
// side data (a tile's side bytes start anywhere in a unit; the step moves them by a multiple of 16 bytes), none of
// it past token t_hi. On an H100 (tq4, batch 8 x 131k tokens, GPU time) a step took 504 us against 514-518 with
// every copy's address and bound computed from its token.
struct Copier {
  static constexpr int STEP = WARPS * TILE;  // tokens from one of a warp's tiles to its next
  const uint8_t *k, *v, *side, *side_at, *side_end;
  int left, lane, side_step;  // tokens from the next tile on to t_hi; bytes of side data per step
  uint32_t side_dst;

  __device__ __forceinline__ Copier(int first, int t_hi, const uint8_t* kc, const uint8_t* vc, const uint8_t* ks,
                                    const uint8_t* vs, int lane_)
      : k(kc + (int64_t)first * KROW + 16 * lane_), v(vc + (int64_t)first * VROW + 16 * lane_), left(t_hi - first),
        lane(lane_) {
    const bool key = lane < Stage::KUNITS;
    const int unit = key ? lane : lane - Stage::KUNITS, per = key ? KSIDE : VSIDE;
    side = key ? ks : vs;
    const uintptr_t start = reinterpret_cast<uintptr_t>(side + (int64_t)first * per) & ~uintptr_t(15);
    side_at = reinterpret_cast<const uint8_t*>(start) + 16 * unit;
    side_end = side + (int64_t)t_hi * per;
    side_step = STEP * per;
    side_dst = (key ? Stage::KSIDE_AT : Stage::VSIDE_AT) + 16 * unit;
  }

  __device__ __forceinline__ void issue(uint32_t stage) {  // the next tile into ``stage``
    issue_codes<KROW>(stage + 16 * lane, k, left, lane * 16 / KROW);
    issue_codes<VROW>(stage + Stage::KCODES + 16 * lane, v, left, lane * 16 / VROW);
    if (lane < Stage::KUNITS + Stage::VUNITS) {
      const int64_t rest = side_end - side_at;
      const int bytes = rest <= 0 ? 0 : rest < 16 ? (int)rest : 16;
      copy16(stage + side_dst, bytes ? side_at : side, bytes);
    }
    k += STEP * KROW;
    v += STEP * VROW;
    side_at += side_step;
    left -= STEP;
  }
};

// The merge: threads sharing a set of query rows (four columns each), rows a pass takes, passes.
constexpr int TPR = D / 4, RS = WARPS * 32 / TPR, NR = ROWS / RS;

// The log-sum-exp merge of block row rb's partials over the nsplit splits of bh (splits < splits_c compressed: in
// the value encoder's rotated domain; the rest the window's, plain): the compressed sum rotated back by mv float32
// [D, D] (row k: the rotated domain's coordinate k), the window's added, divided by the normalizer (0 for rows
// that see no key), written to res [B, Q, Hq, D] (bf16 or f16). Partials are read through L2 (other blocks wrote
// them), every load of a loop issued before its results are used. ``work``: shared memory for ROWS x D floats
// and the weights of MAX_SPLITS x ROWS partials.
__device__ __noinline__ void merge(const float* out, const float* m_in, const float* l_in, const float* mv, void* res,
                                   bool res_bf16, int bh, int rb, int rows, int nsplit, int splits_c, int hkv, int hq,
                                   int nq, float* work) {
  __shared__ float total[ROWS];
  float* weight = work + ROWS * D;  // [split][row]: exp(m - the row's largest m)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nrows = min(ROWS, rows - rb * ROWS);
  const int64_t base = (int64_t)bh * nsplit * rows + rb * ROWS;  // row rb * ROWS of split 0
  for (int r = warp; r < nrows; r += WARPS) {  // a warp per row: its largest m, weights, normalizer
    float m[MAX_SPLITS / 32], l[MAX_SPLITS / 32], mx = -INFINITY, sum = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_SPLITS / 32; ++i) {
      const int sp = lane + 32 * i;
      m[i] = sp < nsplit ? __ldcg(m_in + base + (int64_t)sp * rows + r) : -INFINITY;
      l[i] = sp < nsplit ? __ldcg(l_in + base + (int64_t)sp * rows + r) : 0.f;
      mx = fmaxf(mx, m[i]);
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
#pragma unroll
    for (int i = 0; i < MAX_SPLITS / 32; ++i) {
      const float w = m[i] == -INFINITY ? 0.f : __expf(m[i] - mx);
      sum += l[i] * w;
      weight[(lane + 32 * i) * ROWS + r] = w;
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) total[r] = sum;
  }
  __syncthreads();
  const int c = 4 * (threadIdx.x % TPR), r0 = threadIdx.x / TPR;  // columns c .. c + 3, rows r0 + RS j
  float4 acc[NR];
#pragma unroll
  for (int j = 0; j < NR; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  const auto add = [&](int sp) {  // split sp's partial, weighted
#pragma unroll
    for (int j = 0; j < NR; ++j) {
      const int r = r0 + RS * j;
      if (r < nrows) {
        const float w = weight[sp * ROWS + r];
        const float4 v = __ldcg(reinterpret_cast<const float4*>(out + (base + (int64_t)sp * rows + r) * D + c));
        acc[j].x += w * v.x, acc[j].y += w * v.y, acc[j].z += w * v.z, acc[j].w += w * v.w;
      }
    }
  };
#pragma unroll 8
  for (int sp = 0; sp < splits_c; ++sp) add(sp);
  // rotate the compressed sum back: work[r][k] = acc, then acc[r][c] = sum_k work[r][k] mv[k][c]
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    *reinterpret_cast<float4*>(work + (r0 + RS * j) * D + c) = acc[j];
    acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  __syncthreads();
#pragma unroll 16
  for (int k = 0; k < D; ++k) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(mv + k * D + c));
#pragma unroll
    for (int j = 0; j < NR; ++j) {
      const float a = work[(r0 + RS * j) * D + k];
      acc[j].x += a * v.x, acc[j].y += a * v.y, acc[j].z += a * v.z, acc[j].w += a * v.w;
    }
  }
#pragma unroll 8
  for (int sp = splits_c; sp < nsplit; ++sp) add(sp);
  const int b = bh / hkv, g = rows / nq;  // query heads per KV head
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    const int r = r0 + RS * j;
    if (r >= nrows) continue;
    const int row = rb * ROWS + r, h = (bh % hkv) * g + row / nq;
    const int64_t at = (((int64_t)b * nq + row % nq) * hq + h) * D + c;
    const float inv = total[r] > 0.f ? 1.f / total[r] : 0.f;
    const float x[4] = {acc[j].x * inv, acc[j].y * inv, acc[j].z * inv, acc[j].w * inv};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (res_bf16)
        reinterpret_cast<__nv_bfloat16*>(res)[at + e] = __float2bfloat16(x[e]);
      else
        reinterpret_cast<__half*>(res)[at + e] = __float2half(x[e]);
    }
  }
}

template <bool MERGE>
__global__ void __launch_bounds__(WARPS * 32) decode_kernel(
    const __half* __restrict__ qp, const float* __restrict__ qsc, const uint8_t* __restrict__ kc,
    const uint8_t* __restrict__ ks, const uint8_t* __restrict__ vc, const uint8_t* __restrict__ vs,
    const uint16_t* __restrict__ klevels, float* __restrict__ out, float* __restrict__ m_out,
    float* __restrict__ l_out, const int64_t* __restrict__ lengths, int rows, int tc, int nsplit,
    int tokens_per_split, int64_t kc_stride, int64_t vc_stride, int64_t ks_stride, int64_t vs_stride, int pw, int gp,
    float scale_log2, Table kt, Table vt, const float* __restrict__ mv, void* __restrict__ res, bool res_bf16,
    int* __restrict__ counters, int hkv, int hq, int nq) {
  const int bh = blockIdx.x, rb = blockIdx.y, sp = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if (lengths != nullptr) tc = (int)lengths[0];
  const int t_lo = sp * tokens_per_split, t_hi = min(t_lo + tokens_per_split, tc);
  kc += bh * kc_stride;
  vc += bh * vc_stride;
  ks += bh * ks_stride;
  vs += bh * vs_stride;

  extern __shared__ __align__(16) uint8_t smem[];
  const uint16_t* tab = reinterpret_cast<const uint16_t*>(smem + RINGS) + 2 * lane;  // this lane's bank
  if constexpr (KEYS == TQ8) {  // the code c's level for bank b in the 4-byte slot 32 c + b
    uint32_t* slots = reinterpret_cast<uint32_t*>(smem + RINGS);
    for (int i = threadIdx.x; i < 256 * 32; i += WARPS * 32) slots[i] = klevels[i / 32];
    __syncthreads();
  }

  // the queries as B operands: row rb * 8 + g, coordinates t D / 4 + 4 ks + (0, 1) and (2, 3) (planar order of
  // 4-bit codes: coordinate c at column (c % 2) * gp + c / 2; of 8-bit codes: column c)
  uint32_t qb[MT][2];
  const int row = rb * ROWS + g;
  const __half* q = qp + ((int64_t)bh * rows + row) * pw;
#pragma unroll
  for (int k = 0; k < MT; ++k) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = t * (D / 4) + 4 * k + 2 * j;  // even
      __half2 h = __float2half2_rn(0.f);
      if (row < rows) h = KEYS == TQ8 ? __halves2half2(q[c], q[c + 1]) : __halves2half2(q[c / 2], q[gp + c / 2]);
      qb[k][j] = *reinterpret_cast<uint32_t*>(&h);
    }
  }
  // score factors of this thread's columns 2t, 2t + 1
  float qs[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = rb * ROWS + 2 * t + j;
    qs[j] = r < rows ? qsc[(int64_t)bh * rows + r] * scale_log2 : 0.f;
  }

  float acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // log2 units; l: this thread's tokens only

  // this warp's tiles t_lo + (warp + WARPS i) TILE, i < n, through its ring of RING stages
  uint8_t* mine = smem + warp * RING * Stage::BYTES;
  const uint32_t mine_s = (uint32_t)__cvta_generic_to_shared(mine);
  const int first = t_lo + warp * TILE, n = first < t_hi ? (t_hi - first + WARPS * TILE - 1) / (WARPS * TILE) : 0;
  Copier copier(first, t_hi, kc, vc, ks, vs, lane);
  const int ks_off = (int)(reinterpret_cast<uintptr_t>(ks) & 15), vs_off = (int)(reinterpret_cast<uintptr_t>(vs) & 15);
  constexpr int KW = KROW / 16, VW = D / 64 > 0 ? D / 64 : 1;  // words of a key (value) row a thread reads
  constexpr int KG = D / 128 > 0 ? D / 128 : 1;  // FP4 key groups a thread's words cover
  // one tile's scaled scores s (tokens past t_hi: -inf) and its value factors vnorm, from stage st at token t0
  auto scores = [&](const uint8_t* st, int t0, float (&s)[4], float (&vnorm)[2]) {
    const uint8_t* kside = st + Stage::KSIDE_AT + ks_off;
    const uint8_t* vside = st + Stage::VSIDE_AT + vs_off;
    uint32_t kw[2][KW];  // key rows g, g + 8
    float knorm[2];  // tokens g, g + 8 (0 past the split)
    uint32_t kf[2][KG];  // FP4 keys: f16x2 factors of rows g, g + 8 in groups t D / 128 (+ 1)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = g + 8 * r;
      lds(st + i * KROW + t * (KROW / 4), kw[r]);
      const bool ok = t0 + i < t_hi;
      int ktop = 0, vtop = 0;
      knorm[r] = ok ? token_factor<KEYS == FP4>(kside + i * KSIDE, ktop) : 0.f;
      vnorm[r] = ok ? token_factor<VALUES == FP4>(vside + i * VSIDE, vtop) : 0.f;
      if constexpr (KEYS == FP4) {
#pragma unroll
        for (int x = 0; x < KG; ++x) kf[r][x] = pow2_half(kside[i * KSIDE + t * D / 128 + x] - ktop) * 0x10001u;
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = 0.f;  // (token g, column 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
    if constexpr (KEYS == TQ8) {
#pragma unroll
      for (int j = 0; j < KW; ++j)
        mma(s, levels8(tab, kw[0][j], 0), levels8(tab, kw[1][j], 0), levels8(tab, kw[0][j], 2),
            levels8(tab, kw[1][j], 2), qb[j][0], qb[j][1]);
    } else {
#pragma unroll
      for (int j = 0; j < KW; ++j) {
        uint32_t la, ha, lb, hb, lc, hc, ld, hd;
        lookup<KEYS == FP4>(kw[0][j], kt, la, ha, lb, hb);
        lookup<KEYS == FP4>(kw[1][j], kt, lc, hc, ld, hd);
        uint32_t a[8] = {prmt(la, ha, 0x5140), prmt(lc, hc, 0x5140), prmt(la, ha, 0x7362), prmt(lc, hc, 0x7362),
                         prmt(lb, hb, 0x5140), prmt(ld, hd, 0x5140), prmt(lb, hb, 0x7362), prmt(ld, hd, 0x7362)};
        if constexpr (KEYS == FP4) {
#pragma unroll
          for (int x = 0; x < 8; ++x) a[x] = mul2(a[x], kf[x & 1][j / 4]);
        }
        mma(s, a[0], a[1], a[2], a[3], qb[2 * j][0], qb[2 * j][1]);
        mma(s, a[4], a[5], a[6], a[7], qb[2 * j + 1][0], qb[2 * j + 1][1]);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i >> 1;
      s[i] = t0 + g + 8 * r < t_hi ? s[i] * knorm[r] * qs[i & 1] : -INFINITY;
    }
  };
  // one tile's value product into acc, from stage st, with the probabilities' B fragments pb0, pb1
  auto values = [&](const uint8_t* st, uint32_t pb0, uint32_t pb1) {
    const uint8_t* vside = st + Stage::VSIDE_AT + vs_off;
    uint32_t vw[4][VW];  // value tokens 2t, 2t + 1, 2t + 8, 2t + 9
    uint32_t vf[2];  // FP4 values: f16x2 factors of tokens (2t, 2t + 1), (2t + 8, 2t + 9) in group g D / 256
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = 2 * t + (r & 1) + 8 * (r >> 1);
      lds(st + Stage::KCODES + i * VROW + g * (D / 16), vw[r]);
      if constexpr (VALUES == FP4) {
        const uint32_t f = pow2_half(vside[i * VSIDE + g * D / 256] - largest<GROUPS>(vside + i * VSIDE));
        vf[r >> 1] = r & 1 ? vf[r >> 1] | f << 16 : f;
      }
    }
#pragma unroll
    for (int j = 0; j < VW; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // bytes 0-1, then 2-3 of word j: m-tiles 4j + 2h, 4j + 2h + 1
        const uint32_t sel = h ? 0x7362 : 0x5140;
        uint32_t la, ha, lb, hb, lc, hc, ld, hd;
        lookup<VALUES == FP4>(prmt(vw[0][j], vw[1][j], sel), vt, la, ha, lb, hb);
        lookup<VALUES == FP4>(prmt(vw[2][j], vw[3][j], sel), vt, lc, hc, ld, hd);
        uint32_t a[8] = {prmt(la, ha, 0x6240), prmt(la, ha, 0x7351), prmt(lc, hc, 0x6240), prmt(lc, hc, 0x7351),
                         prmt(lb, hb, 0x6240), prmt(lb, hb, 0x7351), prmt(ld, hd, 0x6240), prmt(ld, hd, 0x7351)};
        if constexpr (VALUES == FP4) {
#pragma unroll
          for (int x = 0; x < 8; ++x) a[x] = mul2(a[x], vf[(x >> 1) & 1]);
        }
        const int mt = 4 * j + 2 * h;
        if (mt < MT) mma(acc[mt], a[0], a[1], a[2], a[3], pb0, pb1);
        if (mt + 1 < MT) mma(acc[mt + 1], a[4], a[5], a[6], a[7], pb0, pb1);
      }
    }
  };
  // PER tiles per step (one softmax update for them all); RING - PER tiles in flight while PER are computed
#pragma unroll
  for (int i = 0; i < RING - PER; ++i) {
    if (i < n) copier.issue(mine_s + i * Stage::BYTES);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  for (int it = 0; it < n; it += PER) {
    __syncwarp();  // the previous step's stages are read: the copies may overwrite them
#pragma unroll
    for (int x = 0; x < PER; ++x) {
      if (it + RING - PER + x < n) copier.issue(mine_s + (it + RING - PER + x) % RING * Stage::BYTES);
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.wait_group %0;" ::"n"(RING - PER) : "memory");
    __syncwarp();
    // tile it + x of the step: past the split where it + x >= n, so all its scores are -inf and its
    // probabilities 0 (its stage holds finite levels of other tiles' codes, or none)
    float s[PER][4], vn[PER][2];
#pragma unroll
    for (int x = 0; x < PER; ++x)
      scores(mine + (it + x) % RING * Stage::BYTES, first + (it + x) * WARPS * TILE, s[x], vn[x]);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int x = 0; x < PER; ++x) {
      mx[0] = fmaxf(mx[0], fmaxf(s[x][0], s[x][2]));
      mx[1] = fmaxf(mx[1], fmaxf(s[x][1], s[x][3]));
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], o));
      mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], o));
    }
    const bool grew = mx[0] > m[0] || mx[1] > m[1];
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float mn = fmaxf(m[j], mx[j]);
        const float alpha = m[j] == -INFINITY ? 0.f : exp2f(m[j] - mn);
        m[j] = mn;
        l[j] *= alpha;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          acc[i][j] *= alpha;
          acc[i][j + 2] *= alpha;
        }
      }
    }
#pragma unroll
    for (int x = 0; x < PER; ++x) {
      float p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = exp2f(s[x][i] - (m[i & 1] == -INFINITY ? 0.f : m[i & 1]));
      l[0] += p[0] + p[2];
      l[1] += p[1] + p[3];
      values(mine + (it + x) % RING * Stage::BYTES, transposed(half2_bits(p[0] * vn[x][0], p[1] * vn[x][0])),
             transposed(half2_bits(p[2] * vn[x][1], p[3] * vn[x][1])));
    }
  }

  // combine the warps: maxima and normalizers per column, then the value sums rescaled to the block's maximum
  __shared__ float sm_m[WARPS][ROWS], sm_l[WARPS][ROWS];
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads();  // every warp is done with its ring, which now holds the value sums
  float(*sm_acc)[ROWS][D] = reinterpret_cast<float(*)[ROWS][D]>(smem);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l[j] += __shfl_xor_sync(0xffffffffu, l[j], o);
    if (g == 0) {
      sm_m[warp][2 * t + j] = m[j];
      sm_l[warp][2 * t + j] = l[j];
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int c = g * (D / 8) + 2 * i;
      sm_acc[warp][2 * t + j][c] = acc[i][j];
      sm_acc[warp][2 * t + j][c + 1] = acc[i][j + 2];
    }
  }
  __syncthreads();
  const int nrows = min(ROWS, rows - rb * ROWS);
  const int64_t base = ((int64_t)bh * nsplit + sp) * rows + rb * ROWS;
  for (int i = threadIdx.x; i < nrows * D; i += WARPS * 32) {
    const int r = i / D, c = i % D;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, sm_m[w][r]);
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w)
      if (sm_m[w][r] != -INFINITY) sum += sm_acc[w][r][c] * exp2f(sm_m[w][r] - top);
    out[(base + r) * D + c] = sum;
    if (c == 0) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w)
        if (sm_m[w][r] != -INFINITY) total += sm_l[w][r] * exp2f(sm_m[w][r] - top);
      m_out[base + r] = top * LN2;
      l_out[base + r] = total;
    }
  }

  // MERGE: the last block of (bh, rb) to finish merges every split's partial (the window's were written by an
  // earlier launch); each block's writes are fenced before it counts itself
  if constexpr (MERGE) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + (int64_t)bh * gridDim.y + rb, 1) == (int)gridDim.z - 1;
    __syncthreads();
    if (last) {
      __threadfence();
      merge(out, m_out, l_out, mv, res, res_bf16, bh, rb, rows, nsplit, (int)gridDim.z, hkv, hq, nq,
            reinterpret_cast<float*>(smem));
    }
  }
}

}  // namespace

// Launch over grid (bh, row blocks, the splits_c compressed splits of the nsplit partials) on ``stream``: pointers
// and the stream as integers (device addresses, cudaStream_t; ``klevels``: the 256 f16 levels of 8-bit key codes,
// else unused), strides in bytes, the prmt table words of the keys' and the values' 4-bit magnitudes (four each).
// ``counters``: 0 (the partials are merged by a later launch), or int32 [bh x row blocks], zero: then the last
// block of each (bh, row block) merges them into res [B, Q, Hq, D] (bf16 where res_bf16, else f16).
void decode_launch(int64_t qp, int64_t qsc, int64_t kc, int64_t ks, int64_t vc, int64_t vs, int64_t klevels,
                   int64_t out, int64_t m_out, int64_t l_out, int64_t lengths, int64_t bh, int64_t rows, int64_t tc,
                   int64_t splits_c, int64_t nsplit, int64_t tokens_per_split, int64_t kc_stride, int64_t vc_stride,
                   int64_t ks_stride, int64_t vs_stride, int64_t pw, int64_t gp, double scale_log2,
                   const std::vector<int64_t>& ktab, const std::vector<int64_t>& vtab, int64_t mv, int64_t res,
                   bool res_bf16, int64_t counters, int64_t hkv, int64_t hq, int64_t nq, int64_t stream) {
  static const bool opted =
      cudaFuncSetAttribute(decode_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM) == cudaSuccess &&
      cudaFuncSetAttribute(decode_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM) == cudaSuccess;
  (void)opted;
  const dim3 grid((unsigned)bh, (unsigned)((rows + ROWS - 1) / ROWS), (unsigned)splits_c);
  const Table kt{(uint32_t)ktab[0], (uint32_t)ktab[1], (uint32_t)ktab[2], (uint32_t)ktab[3], 1u << 16};
  const Table vt{(uint32_t)vtab[0], (uint32_t)vtab[1], (uint32_t)vtab[2], (uint32_t)vtab[3], 1u << 16};
  (counters ? decode_kernel<true> : decode_kernel<false>)<<<grid, WARPS * 32, SMEM,
                                                           reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __half*>(qp), reinterpret_cast<const float*>(qsc), reinterpret_cast<const uint8_t*>(kc),
      reinterpret_cast<const uint8_t*>(ks), reinterpret_cast<const uint8_t*>(vc), reinterpret_cast<const uint8_t*>(vs),
      reinterpret_cast<const uint16_t*>(klevels), reinterpret_cast<float*>(out), reinterpret_cast<float*>(m_out),
      reinterpret_cast<float*>(l_out), reinterpret_cast<const int64_t*>(lengths), (int)rows, (int)tc, (int)nsplit,
      (int)tokens_per_split, kc_stride, vc_stride, ks_stride, vs_stride, (int)pw, (int)gp, (float)scale_log2, kt, vt,
      reinterpret_cast<const float*>(mv), reinterpret_cast<void*>(res), res_bf16, reinterpret_cast<int*>(counters),
      (int)hkv, (int)hq, (int)nq);
}
