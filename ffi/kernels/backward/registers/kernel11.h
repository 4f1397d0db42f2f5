// Kernel 11 internals shared by its launcher files, the CUDA check (tests/cuda/check.cu) and the
// tuning tools (tools/tune/), which run configurations directly. The FFI glue uses backward/api.h
// only.
#pragma once

#include <vector>

#include "backward/api.h"

namespace lnbwd {

struct Kernel11Config {
  int vec = 1;            // elements per access (16 bytes worth, or 1 when rows are misaligned)
  int nv = 1;             // accesses per thread per tensor per row
  bool prefetch = false;  // load the group's next row before reducing the current one
  int tpr = 32;           // threads per row group (a multiple of 32; small rows: 4 to 16)
  bool reg_sums = false;  // small rows: dbias/dweight sums in registers, not shared memory
  int groups = 1;         // row groups per block
};

// Every compiled configuration that can hold a row of C in registers (empty: use the wide path).
std::vector<Kernel11Config> kernel11_candidates(Dtype dtype, int64_t C, bool vectorized, const DeviceLimits& lim);
// The configuration the default launcher uses; false if no register path fits.
bool kernel11_pick(Dtype dtype, int64_t C, bool vectorized, const DeviceLimits& lim, Kernel11Config* cfg);
cudaError_t norm_bwd_kernel11_config(const NormBwdParams& p, const Kernel11Config& cfg, cudaStream_t stream);
// Rows too wide for registers: two streaming passes per row (kernel11_wide_rows.cu).
cudaError_t norm_bwd_kernel11_wide(const NormBwdParams& p, cudaStream_t stream);

}  // namespace lnbwd
