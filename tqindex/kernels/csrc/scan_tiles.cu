// Tile maxima of a few queries over one 4-bit run of direction codes with float16 norms (tq4 and its variants),
// CUDA C++: for each tile of TILE consecutive code rows and each query, the tile's best score in int8 arithmetic.
// It is the first pass of the GPU scan of few queries (tqindex.kernels.scan_triton.TritonScorer.candidates): the
// rows of each query's best tiles are then scored exactly, so the maxima only have to rank tiles. The Triton
// kernel computes the same maxima (MODE_TILE_MAX, f16) for every code; this one reads only 4-bit runs, with about
// half the integer work per code, so that a scan of 1-8 queries runs near memory speed.
//
// Arithmetic: the run's eight magnitudes are rounded to int8 on the scale 127 / the largest (two tables of four
// bytes for the negative codes 0-7, two for the positive 8-15; levels4.cuh's lookup_i8 turns a 32-bit word of
// eight codes into eight int8 levels with six prmt); each query is rounded to int8 on the scale 127 / its largest
// coordinate magnitude (by every block, into shared memory); dp4a sums four products of int8 at a time into int32,
// exactly. A score is the sum times the row's norm, the query's scale and both int8 scales (for l2, minus norm^2
// times the sum of the squared int8 levels times the level scale squared); rows past the end score -inf. The
// PyTorch reference (scan_cuda.tile_maxima_ref) computes the same roundings and sums.
//
// A block of TILE threads takes tiles TILE rows at a time (a grid of resident blocks strides over the tiles); a
// thread takes one row: it reads the row's codes in 16-byte loads through L1 (row_bytes a multiple of 32, two
// loads in flight per step; a warp's load covers half of 32 sectors, the next load the other half from L1: on an
// H200 streaming loads that skip L1 took 266 instead of 213 us over 10M x 128), the queries from shared memory
// (the same address for every thread: broadcast). A tile's maximum per query is reduced by warp shuffles, then
// across the block's warps in shared memory.

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "levels4.cuh"

namespace {

constexpr int TILE = 256;  // rows per tile, threads per block (python: scan_cuda.TILE)
constexpr int WARPS = TILE / 32;

__device__ __forceinline__ int dp4a(uint32_t a, uint32_t b, int c) { return __dp4a(int(a), int(b), c); }

// The block's largest |x| over n floats (every thread gets it; red: WARPS floats of shared memory).
__device__ float block_absmax(const float* x, int n, float* red) {
  float mx = 0.f;
  for (int i = threadIdx.x; i < n; i += TILE) mx = fmaxf(mx, fabsf(x[i]));
  for (int off = 16; off; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  return mx;
}

template <int NQ, bool L2>
__global__ void __launch_bounds__(TILE) tile_max_kernel(const uint8_t* __restrict__ codes,
                                                        const __half* __restrict__ norm,
                                                        const float* __restrict__ q,
                                                        const float* __restrict__ qscale, int m, int64_t n,
                                                        int row_bytes, int64_t tiles, uint4 tab, float lscale,
                                                        float* __restrict__ out) {
  extern __shared__ uint4 smem[];
  const int dim = row_bytes * 2, chunks = row_bytes / 8;  // a uint4 of int8 query: 16 coordinates, two code words
  uint4* qs = smem;                                          // [NQ][chunks]
  float* red = reinterpret_cast<float*>(qs + NQ * chunks);   // [WARPS][NQ]
  int8_t* q8 = reinterpret_cast<int8_t*>(qs);
  float sc[NQ];  // the query's scale times both int8 scales
#pragma unroll
  for (int j = 0; j < NQ; ++j) {
    const float mx = j < m ? block_absmax(q + (int64_t)j * dim, dim, red) : 0.f;
    const float to8 = mx > 0.f ? 127.f / mx : 0.f;
    for (int i = threadIdx.x; i < dim; i += TILE)
      q8[j * dim + i] = j < m ? int8_t(__float2int_rn(q[(int64_t)j * dim + i] * to8)) : int8_t(0);
    sc[j] = j < m ? qscale[j] * lscale * mx / 127.f : 0.f;
  }
  __syncthreads();
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
    if (threadIdx.x < NQ && threadIdx.x < m) {
      float b = red[threadIdx.x];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) b = fmaxf(b, red[w * NQ + threadIdx.x]);
      out[tile * m + threadIdx.x] = b;
    }
    __syncthreads();
  }
}

template <int NQ, bool L2>
void launch(const uint8_t* codes, const __half* norm, const float* q, const float* qscale, int m, int64_t n,
            int row_bytes, uint4 tab, float lscale, float* out, cudaStream_t stream) {
  const int smem = NQ * (row_bytes / 8) * 16 + WARPS * NQ * 4;
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(tile_max_kernel<NQ, L2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int device = 0, sms = 0, resident = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, tile_max_kernel<NQ, L2>, TILE, smem);
  const int64_t tiles = (n + TILE - 1) / TILE;
  const int64_t grid = std::min<int64_t>(tiles, int64_t(sms) * std::max(resident, 1));
  tile_max_kernel<NQ, L2><<<(unsigned)grid, TILE, smem, stream>>>(codes, norm, q, qscale, m, n, row_bytes, tiles, tab,
                                                                  lscale, out);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("tile_max_kernel: ") + cudaGetErrorString(e));
}

}  // namespace

// Tile maxima out float32 [ceil(n / TILE), m] of m <= 8 queries q (float32 [m, row_bytes * 2], the coordinates in
// order, scaled like the Triton scan's planar queries; qscale float32 [m]) over n code rows of row_bytes bytes
// (a multiple of 32) with float16 norms; ``tab``: the four words of the run's int8 levels (negative codes 0-3,
// 4-7, positive codes 8-11, 12-15), lscale their scale. Pointers and the stream as integers.
void tile_max_launch(int64_t codes, int64_t norm, int64_t q, int64_t qscale, int64_t m, int64_t n, int64_t row_bytes,
                     bool l2, const std::vector<int64_t>& tab, double lscale, int64_t out, int64_t stream) {
  const uint4 t = make_uint4((uint32_t)tab[0], (uint32_t)tab[1], (uint32_t)tab[2], (uint32_t)tab[3]);
  auto go = [&](auto nq, auto l2c) {
    launch<decltype(nq)::value, decltype(l2c)::value>(
        reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const __half*>(norm),
        reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(qscale), (int)m, n, (int)row_bytes, t,
        (float)lscale, reinterpret_cast<float*>(out), reinterpret_cast<cudaStream_t>(stream));
  };
  auto with_l2 = [&](auto nq) {
    if (l2) go(nq, std::true_type{}); else go(nq, std::false_type{});
  };
  if (m <= 1) with_l2(std::integral_constant<int, 1>{});
  else if (m <= 2) with_l2(std::integral_constant<int, 2>{});
  else if (m <= 4) with_l2(std::integral_constant<int, 4>{});
  else with_l2(std::integral_constant<int, 8>{});
}
