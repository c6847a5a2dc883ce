// Tile maxima of a few queries over one 4-bit run of direction codes with float16 norms (tq4 and its variants),
// CUDA C++: for each tile of TILE consecutive code rows and each query, the tile's best score. It is the first pass
// of the GPU scan of few queries (tqindex.kernels.scan_triton.TritonScorer.candidates): the rows of each query's
// best tiles are then scored exactly. The Triton kernel computes the same maxima (MODE_TILE_MAX) for every code;
// this one reads only 4-bit runs, with less work per code, so that a scan of 1-4 queries runs nearer memory speed
// (its work grows with the queries: beyond 4, the Triton kernel's tensor-core products of 16 queries per decoded
// tile are the better trade).
//
// A block of TILE threads takes tiles TILE rows at a time (a grid of resident blocks strides over the tiles); a
// thread takes one row: it reads the row's codes in 16-byte loads (row_bytes a multiple of 32, two loads in flight
// per step), turns each 32-bit word (eight codes, coordinate 8w + i in bits 4i..4i+3) into four f16 pairs of
// levels by prmt lookups (levels4.cuh) and multiplies them with the queries' matching coordinates (f16 products
// and sums of four per pair lane, then float32), the queries read from shared memory (the same address for every
// thread: broadcast). Scores are those of the Triton scan: the sum times the row's norm and the query's scale
// (for l2, minus norm^2 times the sum of the squared levels); rows past the end score -inf. A tile's maximum per
// query is reduced by warp shuffles, then across the block's warps in shared memory.

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

__device__ __forceinline__ __half2 h2(uint32_t x) { return *reinterpret_cast<__half2*>(&x); }

template <int NQ, bool L2>
__global__ void __launch_bounds__(TILE) tile_max_kernel(const uint8_t* __restrict__ codes,
                                                        const __half* __restrict__ norm,
                                                        const uint4* __restrict__ q,
                                                        const float* __restrict__ qscale, int m, int64_t n,
                                                        int row_bytes, int64_t tiles, tq4::Table t,
                                                        float* __restrict__ out) {
  extern __shared__ uint4 smem[];
  const int words = row_bytes / 4;  // eight codes, eight f16 query coordinates (one uint4) each
  uint4* qs = smem;                 // [NQ][words]
  float* red = reinterpret_cast<float*>(qs + NQ * words);  // [WARPS][NQ]
  for (int i = threadIdx.x; i < NQ * words; i += TILE) qs[i] = i / words < m ? q[i] : make_uint4(0, 0, 0, 0);
  float qsc[NQ];
#pragma unroll
  for (int j = 0; j < NQ; ++j) qsc[j] = j < m ? qscale[j] : 0.f;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t row = tile * TILE + threadIdx.x;
    const bool ok = row < n;
    const uint4* src = reinterpret_cast<const uint4*>(codes + (ok ? row : 0) * row_bytes);
    float acc[NQ];
#pragma unroll
    for (int j = 0; j < NQ; ++j) acc[j] = 0.f;
    float sq = 0.f;
#pragma unroll 2
    for (int c = 0; c < row_bytes / 16; c += 2) {
      const uint4 v[2] = {__ldcs(src + c), __ldcs(src + c + 1)};
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        const uint32_t word = w % 4 == 0 ? v[w / 4].x : w % 4 == 1 ? v[w / 4].y : w % 4 == 2 ? v[w / 4].z : v[w / 4].w;
        uint32_t la, ha, lb, hb;
        tq4::lookup<false>(word, t, la, ha, lb, hb);
        const __half2 a0 = h2(tq4::prmt(la, ha, 0x5140)), a1 = h2(tq4::prmt(la, ha, 0x7362));
        const __half2 a2 = h2(tq4::prmt(lb, hb, 0x5140)), a3 = h2(tq4::prmt(lb, hb, 0x7362));
        if constexpr (L2) {
          const float2 f = __half22float2(__hfma2(a3, a3, __hfma2(a2, a2, __hfma2(a1, a1, __hmul2(a0, a0)))));
          sq += f.x + f.y;
        }
        const int at = c * 4 + w;  // this word's query coordinates
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
          const uint4 qq = qs[j * words + at];
          const __half2 s = __hfma2(a3, h2(qq.w), __hfma2(a2, h2(qq.z), __hfma2(a1, h2(qq.y), __hmul2(a0, h2(qq.x)))));
          const float2 f = __half22float2(s);
          acc[j] += f.x + f.y;
        }
      }
    }
    const float nv = ok ? __half2float(norm[row]) : 0.f;
    float best[NQ];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
      float score = acc[j] * nv * qsc[j];
      if constexpr (L2) score -= nv * nv * sq;
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
void launch(const uint8_t* codes, const __half* norm, const uint4* q, const float* qscale, int m, int64_t n,
            int row_bytes, tq4::Table t, float* out, cudaStream_t stream) {
  const int smem = NQ * (row_bytes / 4) * 16 + WARPS * NQ * 4;
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(tile_max_kernel<NQ, L2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int device = 0, sms = 0, resident = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, tile_max_kernel<NQ, L2>, TILE, smem);
  const int64_t tiles = (n + TILE - 1) / TILE;
  const int64_t grid = std::min<int64_t>(tiles, int64_t(sms) * std::max(resident, 1));
  tile_max_kernel<NQ, L2><<<(unsigned)grid, TILE, smem, stream>>>(codes, norm, q, qscale, m, n, row_bytes, tiles, t,
                                                                  out);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("tile_max_kernel: ") + cudaGetErrorString(e));
}

}  // namespace

// Tile maxima out float32 [ceil(n / TILE), m] of m <= 4 queries q (f16 [m, row_bytes * 2], the coordinates in
// order, scaled like the Triton scan's planar queries; qscale float32 [m]) over n code rows of row_bytes bytes
// (a multiple of 32) with float16 norms; ``tab``: the prmt words of the run's eight magnitudes. Pointers and the
// stream as integers.
void tile_max_launch(int64_t codes, int64_t norm, int64_t q, int64_t qscale, int64_t m, int64_t n, int64_t row_bytes,
                     bool l2, const std::vector<int64_t>& tab, int64_t out, int64_t stream) {
  const tq4::Table t{(uint32_t)tab[0], (uint32_t)tab[1], (uint32_t)tab[2], (uint32_t)tab[3]};
  auto go = [&](auto nq, auto l2c) {
    launch<decltype(nq)::value, decltype(l2c)::value>(
        reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const __half*>(norm),
        reinterpret_cast<const uint4*>(q), reinterpret_cast<const float*>(qscale), (int)m, n, (int)row_bytes, t,
        reinterpret_cast<float*>(out), reinterpret_cast<cudaStream_t>(stream));
  };
  auto with_l2 = [&](auto nq) {
    if (l2) go(nq, std::true_type{}); else go(nq, std::false_type{});
  };
  if (m <= 1) with_l2(std::integral_constant<int, 1>{});
  else if (m <= 2) with_l2(std::integral_constant<int, 2>{});
  else with_l2(std::integral_constant<int, 4>{});
}
