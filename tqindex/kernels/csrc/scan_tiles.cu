// Tile maxima of a few queries over one 4-bit run of direction codes with float16 norms (tq4 and its variants),
// CUDA C++: for each tile of TILE consecutive code rows and each query, the tile's best score in int8 arithmetic.
// It is the first pass of the GPU scan of few queries (tqindex.kernels.scan_triton.TritonScorer.candidates): the
// rows of each query's best tiles are then scored exactly, so the maxima only have to rank tiles. The Triton
// kernel computes the same maxima (MODE_TILE_MAX, f16) for every code; these read only 4-bit runs, with about
// half its integer work per code, so that a scan of 1-16 queries runs nearer memory speed.
//
// Arithmetic: the run's eight magnitudes are rounded to int8 on the scale 126 / the largest, at least 1 (two tables of
// four bytes for the negative codes 0-7, two for the positive 8-15; levels4.cuh's lookup_i8 turns a 32-bit word of
// eight codes into eight int8 levels with six prmt, mma_kernel looks them up its own way); each query is rounded to
// int8 on the scale 127 / its largest coordinate magnitude (by every block, into shared memory); products of int8 are
// summed into int32 exactly. A score is the sum times the row's norm, the query's scale and both int8 scales (for l2,
// minus norm^2 times the sum of the squared int8 levels times the level scale squared); rows past the end score -inf.
// The PyTorch reference (scan_cuda.tile_maxima_ref) computes the same roundings and sums.
//
// Two kernels, measured on an H200 (10M x 128, 1M x 1536): for 1-4 queries rows_kernel, one row per thread and
// dp4a (four products per instruction, per query); for 5-16 mma_kernel, 16 rows per tensor-core MMA, whose cost
// grows with the queries' tiles of eight, not with the queries (10M x 128: 1, 2, 4, 8 queries 209, 228, 265, 365 us
// by rows_kernel; 8 and 16 queries 242 and 309 us by mma_kernel; 1M x 1536: 1-4 queries 298-315 us by rows_kernel,
// 8 and 16 queries 227 and 350 us by mma_kernel).
//
// rows_kernel: a block of TILE threads takes tiles TILE rows at a time (a grid of resident blocks strides over the
// tiles); a thread takes one row: it reads the row's codes in 16-byte loads through L1 (row_bytes a multiple of
// 32, two loads in flight per step; a warp's load covers half of 32 sectors, the next load the other half from L1:
// streaming loads that skip L1 took 266 instead of 213 us over 10M x 128), the queries from shared memory (the
// same address for every thread: broadcast). A tile's maximum per query is reduced by warp shuffles, then across
// the block's warps in shared memory.

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "levels4.cuh"

namespace {

constexpr int TILE = 256;  // rows per tile, threads per block (python: scan_cuda.TILE)
constexpr int WARPS = TILE / 32;

__device__ __forceinline__ int dp4a(uint32_t a, uint32_t b, int c) { return __dp4a(int(a), int(b), c); }

// The queries as the Triton scan lays them out (planar): coordinate 2g + h of query j at q[j * stride + h * half + g].
struct Planar {
  const float* q;
  int stride, half;
  __device__ float at(int j, int i) const { return q[(int64_t)j * stride + (i & 1) * half + (i >> 1)]; }
};

// The block's largest |coordinate| of query j over dim coordinates (every thread gets it; red: WARPS floats of
// shared memory).
__device__ float block_absmax(Planar q, int j, int dim, float* red) {
  float mx = 0.f;
  for (int i = threadIdx.x; i < dim; i += TILE) mx = fmaxf(mx, fabsf(q.at(j, i)));
  for (int off = 16; off; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  return mx;
}

// Rounds the m queries q (dim coordinates each) to int8 on the scale 127 / each one's largest magnitude: q8
// [nq][dim] in coordinate order (zero past m) and sc [nq], the query's scale times both int8 scales, in shared
// memory (red: WARPS floats).
__device__ void int8_queries(Planar q, const float* qscale, int m, int nq, int dim, float lscale, int8_t* q8,
                             float* sc, float* red) {
  for (int j = 0; j < nq; ++j) {
    const float mx = j < m ? block_absmax(q, j, dim, red) : 0.f;
    const float to8 = mx > 0.f ? 127.f / mx : 0.f;
    for (int i = threadIdx.x; i < dim; i += TILE)
      q8[j * dim + i] = j < m ? int8_t(__float2int_rn(q.at(j, i) * to8)) : int8_t(0);
    if (threadIdx.x == 0) sc[j] = j < m ? qscale[j] * lscale * mx / 127.f : 0.f;
  }
  __syncthreads();
}

// The tile maxima of a block's warps, red [WARPS][nq] (shared), to out [tiles, m] (the block's threads).
__device__ __forceinline__ void write_tile(const float* red, int nq, int m, int64_t tile, float* out) {
  if (threadIdx.x < m) {
    float b = red[threadIdx.x];
    for (int w = 1; w < WARPS; ++w) b = fmaxf(b, red[w * nq + threadIdx.x]);
    out[tile * m + threadIdx.x] = b;
  }
}

// 1-4 queries: one row per thread (below).
template <int NQ, bool L2>
__global__ void __launch_bounds__(TILE) rows_kernel(const uint8_t* __restrict__ codes, const __half* __restrict__ norm,
                                                    Planar q, const float* __restrict__ qscale,
                                                    int m, int64_t n, int row_bytes, int64_t tiles, uint4 tab,
                                                    float lscale, float* __restrict__ out) {
  extern __shared__ uint4 smem[];
  const int dim = row_bytes * 2, chunks = row_bytes / 8;  // a uint4 of int8 query: 16 coordinates, two code words
  uint4* qs = smem;                                          // [NQ][chunks]: int8 queries
  float* red = reinterpret_cast<float*>(qs + NQ * chunks);   // [WARPS][NQ]
  float* scs = red + WARPS * NQ;                             // [NQ]
  int8_queries(q, qscale, m, NQ, dim, lscale, reinterpret_cast<int8_t*>(qs), scs, red);
  float sc[NQ];
#pragma unroll
  for (int j = 0; j < NQ; ++j) sc[j] = scs[j];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t row = tile * TILE + threadIdx.x;
    const bool ok = row < n;
    const uint4* src = reinterpret_cast<const uint4*>(codes + (ok ? row : 0) * row_bytes);
    int acc[NQ];
#pragma unroll
    for (int j = 0; j < NQ; ++j) acc[j] = 0;
    int sq = 0;
#pragma unroll 2
    for (int c = 0; c < row_bytes / 16; c += 2) {
      const uint4 v[2] = {__ldg(src + c), __ldg(src + c + 1)};
#pragma unroll
      for (int h = 0; h < 4; ++h) {  // two code words: sixteen coordinates, one uint4 of each query
        const uint32_t w0 = h == 0 ? v[0].x : h == 1 ? v[0].z : h == 2 ? v[1].x : v[1].z;
        const uint32_t w1 = h == 0 ? v[0].y : h == 1 ? v[0].w : h == 2 ? v[1].y : v[1].w;
        uint32_t l0, l1, l2, l3;
        tq4::lookup_i8(w0, tab.x, tab.y, tab.z, tab.w, l0, l1);
        tq4::lookup_i8(w1, tab.x, tab.y, tab.z, tab.w, l2, l3);
        if constexpr (L2) sq = dp4a(l3, l3, dp4a(l2, l2, dp4a(l1, l1, dp4a(l0, l0, sq))));
        const int at = c * 2 + h;
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
          const uint4 qq = qs[j * chunks + at];
          acc[j] = dp4a(l3, qq.w, dp4a(l2, qq.z, dp4a(l1, qq.y, dp4a(l0, qq.x, acc[j]))));
        }
      }
    }
    const float nv = ok ? __half2float(norm[row]) : 0.f;
    float best[NQ];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
      float score = float(acc[j]) * nv * sc[j];
      if constexpr (L2) score -= nv * nv * float(sq) * lscale * lscale;
      best[j] = ok ? score : -INFINITY;
#pragma unroll
      for (int off = 16; off; off >>= 1) best[j] = fmaxf(best[j], __shfl_xor_sync(0xffffffffu, best[j], off));
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < NQ; ++j) red[warp * NQ + j] = best[j];
    }
    __syncthreads();
    write_tile(red, NQ, m, tile, out);
    __syncthreads();
  }
}

__device__ __forceinline__ void mma_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 5-16 queries (NT tiles of eight, the MMA's N): a warp takes a whole tile (no block-wide reduction, no barrier) or,
// where tiles are few (tile_max_launch), the block's warps share one; a warp takes its rows 16 at a time on the MMA's M
// (m16n8k32, int8 operands, int32 sums). Lane (g = lane / 4, t = lane % 4) reads bytes 16t..16t+15 of each 64 of rows g
// and g + 8 (a group of four lanes reads a 64-byte piece of a row: coalesced); word 4t + s of the piece (eight codes)
// goes to the k slots 4t..4t+3 (codes 0-3) and 16 + 4t.. (codes 4-7) of the s-th MMA, and the queries' int8 coordinates
// of the same word to the same slots of B: any assignment of coordinates to k slots gives the same sums when A and B
// share it. Rows of 32 mod 64 bytes end in half a piece, whose absent half is zero.
//
// The levels take two lookups of four prmt per word and two MMAs, with no per-code select: a code nibble is itself a
// prmt selector, whose bit 3 asks for the selected byte's sign replicated. Looked up in the negative levels (all
// below zero), codes 0-7 give their level and codes 8-15 give -1; looked up with bit 3 flipped in the positive
// levels plus one (all at most 127), codes 8-15 give their level + 1 and codes 0-7 give 0. The two MMAs sum
// both, so every code counts its level exactly (int8_levels keeps the magnitudes in 1..126).
// At most 64 registers (__launch_bounds__(TILE, 4): four blocks per multiprocessor): unbounded, the compiler took
// 64-88 and 1M x 1536 with 8 queries took 325 us against 227; bounded to 48 (five blocks) it spilled.
// Measured on an H200 over 10M x 128 (8 and 16 queries) before this form: one lookup of six prmt and a pick per word
// and one MMA, 357 and 390 us; with query rows padded by 8 bytes (the B fragments' shared-memory reads on distinct
// banks) 360 and 393 us; the four rows' loads issued before any MMA, 338 and 409 us.
template <int NT, bool L2>
__device__ __forceinline__ void mma_piece(uint4 v0, uint4 v1, const int8_t* qrow, bool live, int dim, uint32_t neg0,
                                          uint32_t neg1, uint32_t pos0, uint32_t pos1, int (&acc)[NT][4], int& sq0,
                                          int& sq1) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // word 4t + s of the piece: k slots 4t..4t+3 (codes 0-3), 16+4t.. (4-7)
    const uint32_t w0 = s == 0 ? v0.x : s == 1 ? v0.y : s == 2 ? v0.z : v0.w;
    const uint32_t w1 = s == 0 ? v1.x : s == 1 ? v1.y : s == 2 ? v1.z : v1.w;
    const uint32_t f0 = w0 ^ 0x88888888u, f1 = w1 ^ 0x88888888u;
    // negative lookups (codes 0-7: level, 8-15: -1), positive ones (8-15: level + 1, 0-7: 0)
    const uint32_t n0 = tq4::prmt(neg0, neg1, w0), n2 = tq4::prmt(neg0, neg1, w0 >> 16);
    const uint32_t n1 = tq4::prmt(neg0, neg1, w1), n3 = tq4::prmt(neg0, neg1, w1 >> 16);
    const uint32_t p0 = tq4::prmt(pos0, pos1, f0), p2 = tq4::prmt(pos0, pos1, f0 >> 16);
    const uint32_t p1 = tq4::prmt(pos0, pos1, f1), p3 = tq4::prmt(pos0, pos1, f1 >> 16);
    if constexpr (L2) {  // a level squared, (n + p)^2: one of n, p is the level (+ 1), the other 0 (-1)
      sq0 += dp4a(n0, n0, dp4a(p0, p0, dp4a(n2, n2, dp4a(p2, p2, 0)))) + 2 * dp4a(n0, p0, dp4a(n2, p2, 0));
      sq1 += dp4a(n1, n1, dp4a(p1, p1, dp4a(n3, n3, dp4a(p3, p3, 0)))) + 2 * dp4a(n1, p1, dp4a(n3, p3, 0));
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint2 b = live ? *reinterpret_cast<const uint2*>(qrow + nt * 8 * dim + 8 * s) : make_uint2(0, 0);
      mma_s8(acc[nt], n0, n1, n2, n3, b.x, b.y);
      mma_s8(acc[nt], p0, p1, p2, p3, b.x, b.y);
    }
  }
}

template <int NT, bool L2, int SPLIT>
__global__ void __launch_bounds__(TILE, 4) mma_kernel(const uint8_t* __restrict__ codes,
                                                      const __half* __restrict__ norm, Planar q,
                                                      const float* __restrict__ qscale, int m, int64_t n,
                                                      int row_bytes, int64_t tiles, uint4 tab, float lscale,
                                                      float* __restrict__ out) {
  constexpr int NQ = 8 * NT;
  extern __shared__ uint4 smem[];
  const int dim = row_bytes * 2;
  int8_t* q8 = reinterpret_cast<int8_t*>(smem);          // [NQ][dim]
  float* red = reinterpret_cast<float*>(q8 + NQ * dim);  // [WARPS][NQ]
  float* scs = red + WARPS * NQ;                         // [NQ]
  int8_queries(q, qscale, m, NQ, dim, lscale, q8, scs, red);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const uint32_t pos0 = tab.z + 0x01010101u, pos1 = tab.w + 0x01010101u;  // levels + 1 (at most 127: no carry)
  float sc[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) sc[nt][0] = scs[nt * 8 + 2 * t], sc[nt][1] = scs[nt * 8 + 2 * t + 1];
  const int pieces = row_bytes / 64;         // whole 64-byte pieces of a row (128 coordinates: 16 per lane)
  const bool tail = row_bytes % 64 && t < 2;  // this lane's share of a last half piece
  const int8_t* qrow = q8 + g * dim + 32 * t;  // query row g's coordinates of this lane's words
  // SPLIT warps take a tile (1 or WARPS), TILE / SPLIT rows each; a block takes WARPS / SPLIT tiles at a time
  constexpr int PER_BLOCK = WARPS / SPLIT, ROWS = TILE / SPLIT;
  for (int64_t tile = (int64_t)blockIdx.x * PER_BLOCK + warp / SPLIT; tile < tiles;
       tile += (int64_t)gridDim.x * PER_BLOCK) {
    float best[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) best[nt][0] = best[nt][1] = -INFINITY;
#pragma unroll 2
    for (int rg = 0; rg < ROWS; rg += 16) {  // the warp's rows 16 at a time: rows g and g + 8 of each
      const int64_t r0 = tile * TILE + warp % SPLIT * ROWS + rg + g, r1 = r0 + 8;
      const bool ok0 = r0 < n, ok1 = r1 < n;
      const uint4* p0 = reinterpret_cast<const uint4*>(codes + (ok0 ? r0 : 0) * row_bytes + 16 * t);
      const uint4* p1 = reinterpret_cast<const uint4*>(codes + (ok1 ? r1 : 0) * row_bytes + 16 * t);
      int acc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
      int sq0 = 0, sq1 = 0;
#pragma unroll 2
      for (int c = 0; c < pieces; ++c)
        mma_piece<NT, L2>(__ldg(p0 + 4 * c), __ldg(p1 + 4 * c), qrow + 128 * c, true, dim, tab.x, tab.y, pos0, pos1,
                          acc, sq0, sq1);
      if (row_bytes % 64) {  // the half piece: lanes t >= 2 hold no codes (their queries zero, levels not summed)
        const uint4 none = make_uint4(0, 0, 0, 0);
        int s0 = 0, s1 = 0;
        mma_piece<NT, L2>(tail ? __ldg(p0 + 4 * pieces) : none, tail ? __ldg(p1 + 4 * pieces) : none,
                          qrow + 128 * pieces, tail, dim, tab.x, tab.y, pos0, pos1, acc, s0, s1);
        sq0 += tail ? s0 : 0, sq1 += tail ? s1 : 0;
      }
      if constexpr (L2) {
        sq0 += __shfl_xor_sync(0xffffffffu, sq0, 1);
        sq0 += __shfl_xor_sync(0xffffffffu, sq0, 2);
        sq1 += __shfl_xor_sync(0xffffffffu, sq1, 1);
        sq1 += __shfl_xor_sync(0xffffffffu, sq1, 2);
      }
      const float n0 = ok0 ? __half2float(norm[r0]) : 0.f, n1 = ok1 ? __half2float(norm[r1]) : 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float s0 = float(acc[nt][i]) * n0 * sc[nt][i], s1 = float(acc[nt][2 + i]) * n1 * sc[nt][i];
          if constexpr (L2) {
            s0 -= n0 * n0 * float(sq0) * lscale * lscale;
            s1 -= n1 * n1 * float(sq1) * lscale * lscale;
          }
          best[nt][i] = fmaxf(best[nt][i], fmaxf(ok0 ? s0 : -INFINITY, ok1 ? s1 : -INFINITY));
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int off = 4; off < 32; off <<= 1)
          best[nt][i] = fmaxf(best[nt][i], __shfl_xor_sync(0xffffffffu, best[nt][i], off));
        const int j = nt * 8 + 2 * t + i;
        if (g == 0 && SPLIT == 1 && j < m) out[tile * m + j] = best[nt][i];
        if (g == 0 && SPLIT > 1) red[warp * NQ + j] = best[nt][i];
      }
    }
    if constexpr (SPLIT > 1) {  // the block's warps share the tile
      __syncthreads();
      write_tile(red, NQ, m, tile, out);
      __syncthreads();
    }
  }
}

// Shared memory of a block for nq query slots over rows of row_bytes bytes.
int shared_bytes(int nq, int row_bytes) { return nq * row_bytes * 2 + WARPS * nq * 4 + nq * 4; }

// Blocks of kernel that fit on the current device at once with smem bytes of shared memory (the kernel opted in
// to them): asked of the runtime once per kernel, device and size, then remembered.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int smem) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int>, int64_t> known;
  int device = 0;
  cudaGetDevice(&device);
  const std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, smem);
  const auto found = known.find(key);
  if (found != known.end()) return found->second;
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int sms = 0, resident = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, TILE, smem);
  return known[key] = int64_t(sms) * std::max(resident, 1);
}

// Launches kernel (rows_kernel or mma_kernel) for nq query slots on a grid of resident blocks, each taking
// per_block tiles at a time.
template <typename Kernel>
void launch(Kernel kernel, int nq, int per_block, const uint8_t* codes, const __half* norm, Planar q,
            const float* qscale, int m, int64_t n, int row_bytes, uint4 tab, float lscale, float* out,
            cudaStream_t stream) {
  const int smem = shared_bytes(nq, row_bytes);
  const int64_t tiles = (n + TILE - 1) / TILE;
  const int64_t grid = std::min<int64_t>((tiles + per_block - 1) / per_block, resident_blocks(kernel, smem));
  kernel<<<(unsigned)grid, TILE, smem, stream>>>(codes, norm, q, qscale, m, n, row_bytes, tiles, tab, lscale, out);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("tile maxima kernel: ") + cudaGetErrorString(e));
}

}  // namespace

// Tile maxima out float32 [ceil(n / TILE), m] of m <= 16 queries q (the Triton scan's planar float32 queries: row
// stride qstride, coordinate 2g + h at h * half + g; qscale float32 [m]) over n code rows of row_bytes bytes
// (a multiple of 32) with float16 norms; ``tab``: the four words of the run's int8 levels (negative codes 0-3,
// 4-7, positive codes 8-11, 12-15), lscale their scale. 1-4 queries: rows_kernel, 5-16: mma_kernel with split warps
// per tile (1 or 8; 0: chosen by the tile count). Pointers and the stream as integers.
void tile_max_launch(int64_t codes, int64_t norm, int64_t q, int64_t qstride, int64_t half, int64_t qscale, int64_t m,
                     int64_t n, int64_t row_bytes, bool l2, const std::vector<int64_t>& tab, double lscale, int64_t out,
                     int64_t split, int64_t stream) {
  const uint4 t = make_uint4((uint32_t)tab[0], (uint32_t)tab[1], (uint32_t)tab[2], (uint32_t)tab[3]);
  auto go = [&](auto kernel, int nq, int per_block) {
    launch(kernel, nq, per_block, reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const __half*>(norm),
           Planar{reinterpret_cast<const float*>(q), (int)qstride, (int)half}, reinterpret_cast<const float*>(qscale),
           (int)m, n, (int)row_bytes, t, (float)lscale, reinterpret_cast<float*>(out),
           reinterpret_cast<cudaStream_t>(stream));
  };
  // mma_kernel: a warp per tile where there are at least four tiles per resident warp (10M x 128: 8 and 16 queries
  // 242 and 309 us against 274 and 341 us with eight warps per tile), else eight per tile (1M x 1536: 227 and 350 us
  // against 295 and 378 us); split (1 or WARPS) chooses
  auto mma = [&](auto one, auto shared, int nq) {
    const int64_t tiles = (n + TILE - 1) / TILE;
    if (split == 1 || (split == 0 && tiles >= 4 * WARPS * resident_blocks(one, shared_bytes(nq, (int)row_bytes))))
      go(one, nq, WARPS);
    else
      go(shared, nq, 1);
  };
  if (m <= 1) l2 ? go(rows_kernel<1, true>, 1, 1) : go(rows_kernel<1, false>, 1, 1);
  else if (m <= 2) l2 ? go(rows_kernel<2, true>, 2, 1) : go(rows_kernel<2, false>, 2, 1);
  else if (m <= 4) l2 ? go(rows_kernel<4, true>, 4, 1) : go(rows_kernel<4, false>, 4, 1);
  else if (m <= 8) l2 ? mma(mma_kernel<1, true, 1>, mma_kernel<1, true, WARPS>, 8)
                      : mma(mma_kernel<1, false, 1>, mma_kernel<1, false, WARPS>, 8);
  else l2 ? mma(mma_kernel<2, true, 1>, mma_kernel<2, true, WARPS>, 16)
          : mma(mma_kernel<2, false, 1>, mma_kernel<2, false, WARPS>, 16);
}
