// Exact float32 scores of candidate rows of one 4-bit run of direction codes with float16 norms (tq4 and its
// variants), CUDA C++: the second pass of the GPU scan of few queries (tqindex.kernels.scan_triton.TritonScorer
// .rescore), which scores every row of each query's best tiles. The Triton kernel computes the same scores for every
// code by decoding each coordinate's level (a select tree) and multiplying it by the query's coordinate; here a block
// first writes one query's products with all sixteen levels into shared memory, lut[i][c] = q_i * level(c) for every
// coordinate i, and a row's score is then one shared-memory load and one add per code. Per coordinate the products
// equal the Triton kernel's (float32); only the order of the sum differs.
//
// A block of THREADS threads takes ROWS consecutive places of one query's candidates (place k of query i stands for
// row cand[i][k / span] * span + k % span), a thread one row at a time: it reads the row's codes in 16-byte loads,
// two in flight. The 32 rows of a warp read the same coordinate's sixteen products at a time: sixteen consecutive
// words lie on distinct banks, so the loads never conflict.

#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace rescore {

constexpr int THREADS = 256;
constexpr int ROWS = 1024;  // places per block

template <bool L2>
__global__ void __launch_bounds__(THREADS)
    lut_kernel(const uint8_t* __restrict__ codes, const __half* __restrict__ norm, const float* __restrict__ q,
               int qstride, int half, const float* __restrict__ qscale, const int64_t* __restrict__ qrows,
               int64_t n, int row_bytes, float4 mlo, float4 mhi, const int64_t* __restrict__ cand, int64_t c,
               int64_t span, int64_t blocks_per_query, float* __restrict__ out_v, int64_t* __restrict__ out_i) {
  extern __shared__ float lut[];  // [dim][16], then the levels [16] and their squares [16]
  const int64_t i = blockIdx.x / blocks_per_query, first = blockIdx.x % blocks_per_query * ROWS;
  const int64_t j = qrows ? qrows[i] : i;
  const int dim = 2 * row_bytes;
  float* level = lut + dim * 16;
  float* sqlev = level + 16;
  if (threadIdx.x < 16) {
    const int t = threadIdx.x, at = t < 8 ? 7 - t : t - 8;
    const float mag = at < 4 ? (at == 0 ? mlo.x : at == 1 ? mlo.y : at == 2 ? mlo.z : mlo.w)
                             : (at == 4 ? mhi.x : at == 5 ? mhi.y : at == 6 ? mhi.z : mhi.w);
    level[t] = t < 8 ? -mag : mag;
    sqlev[t] = mag * mag;
  }
  __syncthreads();
  const float* qj = q + j * qstride;
  for (int e = threadIdx.x; e < dim * 16; e += THREADS) {
    const int coord = e >> 4;
    lut[e] = qj[(coord & 1) * half + (coord >> 1)] * level[e & 15];  // coordinate 2g + h: planar h * half + g
  }
  __syncthreads();
  const float qs = qscale[j];
  const int64_t width = c * span;
  const int64_t end = first + ROWS < width ? first + ROWS : width;
  for (int64_t k = first + threadIdx.x; k < end; k += THREADS) {
    const int64_t entry = cand[i * c + k / span], row = entry * span + k % span;
    const bool ok = entry >= 0 && row < n;
    float score = -INFINITY;
    if (ok) {
      const uint4* src = reinterpret_cast<const uint4*>(codes + row * row_bytes);
      float a0 = 0.f, a1 = 0.f, sq = 0.f;
      for (int b = 0; b < row_bytes / 16; b += 2) {  // row_bytes: a multiple of 32
        const uint4 v[2] = {__ldg(src + b), __ldg(src + b + 1)};
#pragma unroll
        for (int w = 0; w < 8; ++w) {  // eight coordinates of a 32-bit word: bytes of two codes, low nibble first
          const uint32_t x = w == 0 ? v[0].x : w == 1 ? v[0].y : w == 2 ? v[0].z : w == 3 ? v[0].w
                           : w == 4 ? v[1].x : w == 5 ? v[1].y : w == 6 ? v[1].z : v[1].w;
          const float* l = lut + (b * 32 + w * 8) * 16;  // coordinate 2 * (16 b + 4 w)
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const uint32_t lo = (x >> (8 * s)) & 15u, hi = (x >> (8 * s + 4)) & 15u;
            a0 += l[(2 * s) * 16 + lo];
            a1 += l[(2 * s + 1) * 16 + hi];
            if constexpr (L2) sq += sqlev[lo] + sqlev[hi];
          }
        }
      }
      const float s = __half2float(norm[row]);
      score = (a0 + a1) * s * qs;
      if constexpr (L2) score -= s * s * sq;
    }
    out_v[i * width + k] = score;
    out_i[i * width + k] = ok ? row : -1;
  }
}

}  // namespace rescore

// Exact float32 scores out_v [m, c * span] and rows out_i int64 [m, c * span] (-inf and -1 for none) of the
// candidates cand int64 [m, c] (rows, or tiles of span rows; -1 for none) of m queries: query qrows[i] (int64 [m];
// 0: i) of q (the Triton scan's planar float32 queries: row stride qstride, coordinate 2g + h at h * half + g;
// qscale float32 [m]) over n code rows of row_bytes bytes (a multiple of 32, 16-byte aligned) with float16 norms;
// mags: the run's eight ascending magnitudes (code c < 8: -mags[7 - c], else mags[c - 8]); l2: minus each row's
// squared norm times its levels' squares. Pointers and the stream as integers.
void rescore_launch(int64_t codes, int64_t norm, int64_t q, int64_t qstride, int64_t half, int64_t qscale,
                    int64_t qrows, int64_t m, int64_t n, int64_t row_bytes, bool l2, const std::vector<double>& mags,
                    int64_t cand, int64_t c, int64_t span, int64_t out_v, int64_t out_i, int64_t stream) {
  using namespace rescore;
  const int64_t width = c * span, per_query = (width + ROWS - 1) / ROWS;
  if (m == 0 || width == 0) return;
  const int smem = int((2 * row_bytes * 16 + 32) * sizeof(float));
  auto kernel = l2 ? lut_kernel<true> : lut_kernel<false>;
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const float4 lo = make_float4(float(mags[0]), float(mags[1]), float(mags[2]), float(mags[3]));
  const float4 hi = make_float4(float(mags[4]), float(mags[5]), float(mags[6]), float(mags[7]));
  kernel<<<(unsigned)(m * per_query), THREADS, smem, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const __half*>(norm),
      reinterpret_cast<const float*>(q), (int)qstride, (int)half, reinterpret_cast<const float*>(qscale),
      reinterpret_cast<const int64_t*>(qrows), n, (int)row_bytes, lo, hi, reinterpret_cast<const int64_t*>(cand), c,
      span, per_query, reinterpret_cast<float*>(out_v), reinterpret_cast<int64_t*>(out_i));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("rescore kernel: ") + cudaGetErrorString(e));
}
