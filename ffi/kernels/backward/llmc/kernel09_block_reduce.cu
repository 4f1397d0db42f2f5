// Kernel 9 of llm.c's dev/cuda/layernorm_backward.cu: "block reduction without atomics".
//
// Technique (kept from llm.c): kernel 8's persistent warps with 16-byte accesses and the
// transposed shared-memory order of the block's dbias/dweight sums (element k of lane L at
// L + 32 * k within each step of 32 * VEC columns, so the 32 lanes touch 32 different banks),
// but without any float atomic:
//  * inside a block, for every element of a step, warps 1..W-1 park their value in a staging
//    area (one float per thread), a barrier, and warp 0 adds them in warp order to its own and
//    into the shared sums, and a second barrier before the staging area is reused. Warp 0 is
//    the only writer of the sums, so they need no atomics;
//  * across blocks, each block writes its sums to its own fp32 slot in global memory, counts
//    itself done (an unsigned int atomic), and the last block adds the slots in block order,
//    four floats per load, then transposes back and writes dweight/dbias 16 bytes at a time.
// Every sum is taken in a fixed order, so the result is bitwise reproducible (deterministic).
//
// This needs C to be a multiple of 32 * VEC (128 for fp32, 256 for bf16/fp16): llm.c
// __trap()ped on other C ("prefer to crash here than run into a deadlock later on"). Such C
// are refused instead (cudaErrorInvalidConfiguration, and in Python at trace time). 16-byte
// accesses need 16-byte aligned buffers and workspace (XLA's are): cudaErrorMisalignedAddress
// otherwise.
//
// Repairs relative to llm.c:
//  * Every warp of a block runs the same number of row steps (rows past the end add zeros and
//    write nothing). In llm.c a warp whose rows ran out left the loop while the others still
//    waited at the barriers inside it, so the barriers paired up wrongly (and warp 0 could read
//    stale staging data) whenever the rows did not divide evenly among the warps.
//  * No printf and no __trap() in the kernel: the launcher refuses C it cannot do.
//  * Fences: after writing the block's slot, before the block is counted done (llm.c had
//    none, so the last block could add a slot that was not yet visible), and in the last block
//    before it reads the slots (from L2, __ldcg).
//  * The slots and the counter are in the workspace XLA gives; only the counter is zeroed, with
//    cudaMemsetAsync on the caller's stream (every slot is written before it is read). llm.c
//    used cudaMemset on the legacy default stream.
//  * dx is written, not accumulated, and dweight/dbias are written, not added to: XLA's output
//    buffers are uninitialized.
//  * g = weight * dy is rounded once (mul_rn) in both passes; 64-bit row and slot offsets.
//  * The grid never has more blocks than the workspace has slots, nor than the rows have warps.
//  * More than 48 KB of shared memory is opted in to; C + block_size up to 29055 fits Hopper.
#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_device.cuh"

namespace lnbwd {
namespace {

constexpr int kWarpSize = 32;

template <typename T>
__global__ void __launch_bounds__(1024)
kernel9(T* __restrict__ dx, T* __restrict__ dweight, T* __restrict__ dbias, float* __restrict__ partials,
        unsigned int* __restrict__ counter, const T* __restrict__ dy, const T* __restrict__ x,
        const T* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows,
        int C) {
  constexpr int VEC = 16 / sizeof(T);
  using V = Packed<T, VEC>;
  // Shared memory: [dbias sums | dweight sums] (C floats each), the two staging areas (a float
  // per thread each; warp 0's part is unused, as in llm.c), and the last-block flag.
  extern __shared__ float shared[];
  float* dbias_sh = shared;
  float* dweight_sh = shared + C;
  float* dbias_stage = shared + 2 * C;
  float* dweight_stage = dbias_stage + blockDim.x;
  unsigned int* is_last = reinterpret_cast<unsigned int*>(dweight_stage + blockDim.x);
  const int warp_id = threadIdx.x / kWarpSize;
  const int warps_in_block = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int per_step = kWarpSize * VEC;   // columns a warp covers per step
  const int steps = C / per_step;         // exact: the launcher refuses other C

  zero_block_sums(dbias_sh, dweight_sh, C);
  __syncthreads();   // sums zeroed before warp 0 adds to them

  // All warps of the block take the same number of row steps, because the loop body has
  // barriers: a warp without a row (row >= rows) contributes zeros and writes nothing.
  const int64_t rows_per_step = static_cast<int64_t>(gridDim.x) * warps_in_block;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * warps_in_block; first < rows; first += rows_per_step) {
    const int64_t row = first + warp_id;
    const bool row_ok = row < rows;   // uniform across the warp
    const T* dy_r = dy + row * C;
    const T* x_r = x + row * C;
    T* dx_r = dx + row * C;
    const float mean_r = row_ok ? mean[row] : 0.0f;
    const float rstd_r = row_ok ? rstd[row] : 0.0f;

    // Pass 1: a = mean(g), b = mean(g * xhat), g = weight * dy, xhat = (x - mean) * rstd, each lane
    // summing over its 16-byte vectors as in kernel 8 (x128_row_sums), then across the warp.
    float sum_g = 0.0f, sum_g_xhat = 0.0f;
    if (row_ok) x128_row_sums(dy_r, x_r, weight, mean_r, rstd_r, lane, C, sum_g, sum_g_xhat);
    const float a = warp_sum(sum_g) / C;
    const float b = warp_sum(sum_g_xhat) / C;

    // Pass 2: dx = (g - a - xhat * b) * rstd, and the block's share of dbias and dweight summed
    // across warps through the staging area.
    for (int s = 0; s < steps; ++s) {
      const int col = s * per_step + lane * VEC;
      const int sh = s * per_step + lane;
      V dyv, xv, wv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        dyv[k] = from_acc<T>(0.0f);
        xv[k] = from_acc<T>(0.0f);
        wv[k] = from_acc<T>(0.0f);
      }
      if (row_ok) {
        dyv = load_cs(reinterpret_cast<const V*>(dy_r + col));
        xv = load_cs(reinterpret_cast<const V*>(x_r + col));
        wv = load(reinterpret_cast<const V*>(weight + col));
      }
      V dxv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = to_acc(dyv[k]);
        const float xhat = (to_acc(xv[k]) - mean_r) * rstd_r;
        if (warp_id != 0) {
          dbias_stage[threadIdx.x] = d;
          dweight_stage[threadIdx.x] = d * xhat;
        }
        __syncthreads();   // staging complete before warp 0 reads it
        if (warp_id == 0) {
          float sb = d, sw = d * xhat;
          for (int j = 1; j < warps_in_block; ++j) {   // warp order: deterministic
            sb += dbias_stage[lane + j * kWarpSize];
            sw += dweight_stage[lane + j * kWarpSize];
          }
          dbias_sh[sh + k * kWarpSize] += sb;
          dweight_sh[sh + k * kWarpSize] += sw;
        }
        __syncthreads();   // warp 0 has read the staging area before anyone overwrites it
        dxv[k] = from_acc<T>((mul_rn(to_acc(wv[k]), d) - a - xhat * b) * rstd_r);
      }
      if (row_ok) store_cg(reinterpret_cast<V*>(dx_r + col), dxv);   // cached in L2, not L1
    }
  }
  __syncthreads();   // warp 0's last additions to the sums done before they are read

  // Each block writes its sums (transposed order) to its own slot; the last one adds the slots.
  write_block_slot(partials, dbias_sh, dweight_sh, C);
  if (!last_block_to_finish(counter, is_last)) return;

  // Sum the slots in block order, four columns per 16-byte load, back into the shared sums.
  for (int i = threadIdx.x * 4; i < C; i += blockDim.x * 4) {
    float4 sb = make_float4(0.0f, 0.0f, 0.0f, 0.0f), sw = sb;
    for (unsigned int blk = 0; blk < gridDim.x; ++blk) {
      const float* p = partials + static_cast<size_t>(blk) * 2 * C + i;
      const float4 b4 = __ldcg(reinterpret_cast<const float4*>(p));
      const float4 w4 = __ldcg(reinterpret_cast<const float4*>(p + C));
      sb.x += b4.x; sb.y += b4.y; sb.z += b4.z; sb.w += b4.w;
      sw.x += w4.x; sw.y += w4.y; sw.z += w4.z; sw.w += w4.w;
    }
    *reinterpret_cast<float4*>(dbias_sh + i) = sb;
    *reinterpret_cast<float4*>(dweight_sh + i) = sw;
  }
  __syncthreads();   // all totals in shared memory before they are transposed back

  // Transpose back to column order and convert, a warp per step, 16 bytes per lane.
  for (int s = warp_id; s < steps; s += warps_in_block) {
    const int col = s * per_step + lane * VEC;
    const int sh = s * per_step + lane;
    V db, dw;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      db[k] = from_acc<T>(dbias_sh[sh + k * kWarpSize]);
      dw[k] = from_acc<T>(dweight_sh[sh + k * kWarpSize]);
    }
    *reinterpret_cast<V*>(dbias + col) = db;
    *reinterpret_cast<V*>(dweight + col) = dw;
  }
}

template <typename T>
cudaError_t launch(const NormBwdParams& p, const LlmcLimits& l, cudaStream_t stream) {
  if (!can_vectorize<T>(p) || reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) return cudaErrorMisalignedAddress;
  return launch_last_block_kernel<T>(kernel9<T>, LlmcSums::kSlotPerBlock, p,
                                     1024 / l.block_size, l.block_size, l.smem_bytes, stream);
}

}  // namespace

cudaError_t norm_bwd_kernel9(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(9, p, &l));
  return dispatch_llmc_dtypes<9, float, __nv_bfloat16, __half>(p.dtype, [&](auto t) { return launch<decltype(t)>(p, l, stream); });
}

}  // namespace lnbwd
