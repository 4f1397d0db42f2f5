// The kernel registry: what every CUDA kernel of the backward (ids 1-12) is and accepts, written
// once. The FFI handlers check a call against it, jax_lnbwd.KERNELS is read from it (through
// the nanobind module, ffi/module.cc), and the CUDA check and tuning tools (tests/cuda/,
// tools/tune/) iterate over it. Host-only C++ with no CUDA header: the CPU-only build has it too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/dtype.h"

namespace lnbwd {

// What a kernel's limits depend on in the GPU it runs on.
struct RefusalLimits {
  int64_t max_smem_per_block;   // dynamic shared memory a block may opt in to (bytes)
  const char* source;           // where the numbers come from, for refusal messages
};

// Where no GPU is present (the CPU handler; Python without a GPU), refusals use an H100/H200's
// limits, so that a program traced there is refused what it would be refused on the GPU.
inline constexpr RefusalLimits kDefaultRefusalLimits = {232448, "an H100/H200 (no GPU to ask)"};

// One call, as far as the limits care.
struct KernelRequest {
  Dtype dtype;
  int64_t C;
  int block_size;            // 0: the kernel's default (or its own choice, for kernels 11-12)
  int64_t segments = 1;      // dweight/dbias rows (per-example sums under vmap)
  int64_t weight_rows = 1;   // 1, or one weight row per segment
};

struct KernelFacts {
  int id;
  const char* name;
  const char* description;
  unsigned dtypes;          // dtype_bit()s
  // Block sizes: the powers of two from min_block_size to max_block_size, or only 0 (the kernel
  // chooses its block shape from C) when both are 0.
  int min_block_size;
  int max_block_size;
  int default_block_size;
  bool deterministic;       // bit-identical run to run
  bool precise;             // sums in fp32 (fp64); false: rounded in the output dtype
  bool segments;            // keeps one dweight/dbias sum per segment
  bool device_limited;      // its limits depend on RefusalLimits (shared memory)
  bool rmsnorm;             // runs RMSNorm's backward too (target rmsnorm_bwd), not layernorm's only
  bool v2_operands;         // takes what layernorm's v2 target adds: a float32 weight beside 16-bit
                            // x (mixed precision) and a residual gradient added to dx
  const char* constraints;  // what limits C, in words
  // "" if the kernel accepts the request on such a device, else why not: a sentence that names
  // the kernel, the setting and the limit.
  std::string (*limits)(const KernelFacts&, const KernelRequest&, const RefusalLimits&);
};

// Every kernel, in id order.
const std::vector<KernelFacts>& AllKernels();
// The kernel with this id, or nullptr.
const KernelFacts* FindKernel(int id);
// The lowest and highest kernel ids (for messages).
int MinKernelId();
int MaxKernelId();

bool TakesDtype(const KernelFacts& k, Dtype d);
std::vector<int> BlockSizes(const KernelFacts& k);
// The block size a request runs: block_size, or the default for 0.
int ResolvedBlockSize(const KernelFacts& k, int block_size);

// "" if `k` accepts the request on such a device, else why not (see KernelFacts::limits). The
// dtype, block size and segments are checked here for every kernel, then k.limits.
std::string KernelRefusal(const KernelFacts& k, const KernelRequest& r, const RefusalLimits& device);

// The ids of the kernels with a fact, e.g. KernelIdsWith(&KernelFacts::rmsnorm): "11 and 12".
std::string KernelIdsWith(bool KernelFacts::*fact);

// Names the dtypes of a set, "float32, bfloat16, float16".
std::string DtypeList(unsigned dtypes);

}  // namespace lnbwd
