// Kernel 11 internals shared by its launcher files, the CUDA check (tests/cuda/check.cu) and the
// tuning tools (tools/tune/), which run configurations directly. The FFI glue uses backward/api.h
// only.
#pragma once

#include <vector>

#include "backward/api.h"
#include "common/head_rows.h"
#ifdef __CUDACC__
#include "common/vec.cuh"
#endif

namespace lnbwd {

struct Kernel11Config {
  int vec = 1;            // elements per access (16 bytes worth, or 1 when rows are misaligned)
  int nv = 1;             // accesses per thread per tensor per row
  bool prefetch = false;  // load the group's next row before reducing the current one
  int tpr = 32;           // threads per row group (a multiple of 32; small rows: 4 to 16)
  bool reg_sums = false;  // small rows: dbias/dweight sums in registers, not shared memory
  int groups = 1;         // row groups per block
};

// Threads per block for a variant of rows of whole warps. A block of 1024 threads can have 64
// registers per thread at most; variants with more row data per thread (NV >= 2) are capped at
// 512 threads, which lets the compiler use up to 128 registers instead of spilling to local memory.
constexpr int kMaxThreads = 1024;
constexpr int max_threads(int nv) { return nv >= 2 ? 512 : kMaxThreads; }
constexpr int kMaxNamedBarrierGroups = 15;   // barrier ids 1..15; id 0 is __syncthreads()
// Small rows: groups of kMinRowThreads (common/vec.cuh) to 16 threads (32 is a warp: the plain
// path), in blocks of kSmallThreads.
constexpr int kSmallThreads = 256;

// Dynamic shared memory of a configuration's block, in accumulators of acc_bytes (kernel11_config.cu).
size_t kernel11_smem_bytes(const Kernel11Config& cfg, int64_t C, size_t acc_bytes);
// Whether a small-row variant (sums in registers or shared memory, NV, prefetch) is compiled
// (kernel11_rows_in_registers.cu).
bool kernel11_small_variant(bool reg_sums, int nv, bool prefetch);
// Every compiled configuration that can hold a row of C in registers (empty: use the wide path).
std::vector<Kernel11Config> kernel11_candidates(Dtype dtype, int64_t C, bool vectorized, const DeviceLimits& lim);
// The configuration the default launcher uses; false if no register path fits. max_tpr: the
// widest row group allowed (kernel11_sets.cu's head rows: a warp).
bool kernel11_pick(Dtype dtype, int64_t C, bool vectorized, const DeviceLimits& lim, Kernel11Config* cfg,
                   int max_tpr = kMaxThreads);
cudaError_t norm_bwd_kernel11_config(const NormBwdParams& p, const Kernel11Config& cfg, cudaStream_t stream);
// QK-norm's two sets of head rows in one launch, with configuration cfg (kernel11_sets.cu).
cudaError_t norm_bwd_sets_config(const NormBwdParams& a, const NormBwdParams& b, const Kernel11Config& cfg,
                                 cudaStream_t stream);

// Rows too wide for registers: two streaming passes per row (kernel11_wide_rows.cu).
cudaError_t norm_bwd_kernel11_wide(const NormBwdParams& p, cudaStream_t stream);

}  // namespace lnbwd
