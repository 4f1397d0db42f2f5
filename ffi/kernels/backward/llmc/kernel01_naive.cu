// Kernel 1 of llm.c's dev/cuda/layernorm_backward.cu: "naive".
//
// Technique (kept from llm.c): the CPU loop moved to the GPU as it is, one thread per row.
// Each thread walks its row's C columns twice: pass 1 sums g_i = weight_i * dy_i and
// g_i * xhat_i (the two row reductions of the backward), pass 2 writes dx_i and adds dy_i and
// dy_i * xhat_i to dbias[i] and dweight[i] with global fp32 atomicAdd. It is slow for two
// reasons the later kernels remove: the 32 threads of a warp read 32 different rows, so every
// load instruction touches 32 cache lines instead of one (uncoalesced), and all rows add to the
// same C addresses of dweight/dbias at about the same time, so the atomics queue at L2.
//
// Repairs relative to llm.c:
//  * dx is written, not accumulated: llm.c's dinp[i] += dval read XLA's uninitialized output.
//  * dweight/dbias are zeroed with cudaMemsetAsync on the caller's stream before the kernel's
//    atomics accumulate into them (llm.c relied on its caller to zero them).
//  * g = weight * dy is rounded once (mul_rn) in both passes, so that the compiler cannot fuse
//    it into an FMA in one pass only; then C = 1 gives dx = g - mean(g) = 0 exactly.
//  * 64-bit row offsets: llm.c's b * T * C + t * C overflows int32 beyond 2^31 elements.
// float32 only, as in llm.c (which offers kernel 1 only in its fp32 build). Not
// deterministic: the order in which the rows' atomics reach an address varies from run to run.
#include "backward/llmc/llmc_common.cuh"

namespace lnbwd {
namespace {

static_assert(kLlmcFacts[1].dtypes == dtype_bit(Dtype::kF32), "kernel 1 is built for float32 only");

__global__ void __launch_bounds__(1024)
kernel1(float* __restrict__ dx, float* __restrict__ dweight, float* __restrict__ dbias, const float* __restrict__ dy,
        const float* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ mean,
        const float* __restrict__ rstd, int64_t rows, int C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;   // no barrier follows, so threads without a row may leave
  const float* dy_r = dy + row * C;
  const float* x_r = x + row * C;
  float* dx_r = dx + row * C;
  const float mean_r = mean[row];
  const float rstd_r = rstd[row];

  // Pass 1: a = mean(g), b = mean(g * xhat), with g = weight * dy and xhat = (x - mean) * rstd.
  float sum_g = 0.0f, sum_g_xhat = 0.0f;
  for (int i = 0; i < C; ++i) {
    const float xhat = (x_r[i] - mean_r) * rstd_r;
    const float g = mul_rn(weight[i], dy_r[i]);
    sum_g += g;
    sum_g_xhat += g * xhat;
  }
  const float a = sum_g / C;
  const float b = sum_g_xhat / C;

  // Pass 2: dx = (g - a - xhat * b) * rstd; this row's dy and dy * xhat go to dbias, dweight.
  for (int i = 0; i < C; ++i) {
    const float d = dy_r[i];
    const float xhat = (x_r[i] - mean_r) * rstd_r;
    atomicAdd(&dbias[i], d);
    atomicAdd(&dweight[i], d * xhat);
    dx_r[i] = (mul_rn(weight[i], d) - a - xhat * b) * rstd_r;
  }
}

}  // namespace

cudaError_t norm_bwd_kernel1(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(1, p, &l));
  const int64_t grid = ceil_div<int64_t>(p.rows, l.block_size);   // one thread per row
  if (grid > INT32_MAX) return cudaErrorInvalidConfiguration;
  // The atomics add into dweight/dbias, so they must start at zero.
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dweight, 0, p.C * sizeof(float), stream));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dbias, 0, p.C * sizeof(float), stream));
  kernel1<<<static_cast<unsigned int>(grid), l.block_size, 0, stream>>>(
      static_cast<float*>(p.dx), static_cast<float*>(p.dweight), static_cast<float*>(p.dbias),
      static_cast<const float*>(p.dy), static_cast<const float*>(p.x), static_cast<const float*>(p.weight),
      static_cast<const float*>(p.mean), static_cast<const float*>(p.rstd), p.rows, static_cast<int>(p.C));
  return cudaGetLastError();
}

}  // namespace lnbwd
