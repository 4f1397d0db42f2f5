// The launcher API of the norm backward kernels (layernorm and RMSNorm, NormKind): plain
// pointers, sizes and a stream.
// This header is shared by the kernels (compiled by nvcc) and the XLA FFI glue (compiled by the
// host compiler). It never includes an XLA header and every launcher returns a cudaError_t.
//
// The math, for one row of C elements, with mean and rstd saved by the forward pass:
//   xhat_i = (x_i - mean) * rstd                 (centered: never E[x^2] - E[x]^2)
//   g_i    = weight_i * dy_i
//   a      = (1/C) * sum_i g_i
//   b      = (1/C) * sum_i g_i * xhat_i
//   dx_i   = (g_i - a - xhat_i * b) * rstd
// and, summed over all rows,
//   dweight_i = sum_rows dy_i * xhat_i,   dbias_i = sum_rows dy_i.
//
// Segments (for per-example gradients under vmap): the rows may be split into S equal,
// contiguous segments, each with its own dweight/dbias row (and optionally its own weight row).
// S = 1 is the plain op.
//
// Mixed precision (weight_f32): x, dy and dx are bf16 or fp16 while weight, dweight and dbias are
// float32. g_i = weight_i * dy_i is then formed in fp32 from the float32 weight itself (never
// rounded to 16 bits), and the fp32 sums are stored as float32.
//
// Residual gradient (dresidual): dx_i = (layernorm's dx_i, in fp32) + dresidual_i, rounded once.
// dresidual may be dx itself (the FFI caller aliases it to the output): each element is read
// once, by the thread that then writes the same element of dx.
//
// RMSNorm (norm = NormKind::kRmsNorm, kernels 11 and 12 only; norm_kind.h): mean and dbias are
// null, and with g_i = (offset + weight_i) * dy_i, xhat_i = x_i * rstd,
//   dx_i      = (g_i - xhat_i * b) * rstd   (a = 0: no mean was subtracted)
//   dweight_i = sum_rows dy_i * xhat_i      (offset does not enter it).
// The kernels run it through layernorm's code with mean = 0 and a = 0 (NormArgs, per launch,
// backward/norm_weight.cuh); offset is added to the weight where it is loaded or staged.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/device_limits.h"   // DeviceLimits, device_limits
#include "common/head_rows.h"
#include "dtype.h"
#include "norm_kind.h"

namespace lnbwd {

// What the launcher of kernel 11 or 12 chose for a problem: filled when NormBwdParams::plan
// is set, whether it then launches or not (plan_only), and on failure as far as it got, so that
// an error can say what was asked of the GPU.
struct LaunchPlan {
  int kernel = 0;             // the kernel that runs: 12 falls back to 11 where it cannot run
  const char* path = "";      // which of its paths, e.g. "ring", "wide rows", "rows in registers"
  int threads = 0;            // per block
  size_t smem = 0;            // dynamic shared memory per block
  int cluster = 1;            // blocks per thread-block cluster
  int64_t blocks = 0;         // in the grid
  int64_t slots = 0;          // partial slots written, all segments together
  bool cooperative = false;   // the grid sums its own slots after a grid-wide barrier (opt-in)
  size_t workspace_bytes = 0; // kWorkspaceHeaderBytes + slots * 2 * C accumulators
};

// Every kernel writes its outputs (never accumulates into them: XLA's buffers are uninitialized).
struct NormBwdParams {
  void* dx;             // [rows, C] dtype
  void* dweight;        // [segments, C] dtype (float32 when weight_f32)
  void* dbias;          // [segments, C] dtype (float32 when weight_f32); null for kRmsNorm
  const void* dy;       // [rows, C] dtype
  const void* x;        // [rows, C] dtype
  const void* weight;   // [C] dtype (float32 when weight_f32), or [segments, C] when weight_stride == C
  const void* mean;     // [rows] float32 (float64 when dtype is kF64); null for kRmsNorm
  const void* rstd;     // [rows] float32 (float64 when dtype is kF64)
  int64_t rows;
  int64_t C;
  int64_t segments;       // >= 1, divides rows
  int64_t weight_stride;  // 0: one weight row shared by all segments; C: one weight row per segment
  Dtype dtype;
  int block_size;       // threads per block; 0 picks the kernel's best
  void* workspace;      // scratch from XLA: a header (flags) then per-block partial sums
  size_t workspace_bytes;
  int device = -1;      // CUDA ordinal of the device `stream` belongs to; -1: the current device
  LaunchPlan* plan = nullptr;  // kernels 11 and 12: where to report the launch they choose
  bool plan_only = false;      // with `plan`: choose and report, launch nothing
  // Kernels 11 and 12 only: llm.c's kernels 1-10 ignore these two, so the FFI glue refuses them there.
  const void* dresidual = nullptr;  // [rows, C] dtype, added to dx; null: nothing added
  bool weight_f32 = false;  // weight, dweight, dbias are float32 while dtype is kBF16 or kF16
  // The norm kind, which every caller sets: kRmsNorm (kernels 11 and 12 only, as the two above)
  // has mean and dbias null and its weight offset, g_i = (offset + weight_i) * dy_i in the
  // accumulator type (offset is ignored for kLayerNorm).
  NormKind norm;
  double offset = 0.0;
  // The rows' layout: contiguous (heads.heads = 0), or heads inside wider token rows
  // (common/head_rows.h). Only norm_bwd_sets takes head rows.
  HeadRows heads;
};

// The workspace starts with a header of this many bytes (completion flags, zeroed by the
// launcher with cudaMemsetAsync on the caller's stream); per-block fp32 (fp64 for kF64)
// partial sums of dbias and dweight follow, 2 * C accumulators per partial slot. Kernels 11
// and 12 size it with norm_bwd_workspace_bytes; jax_lnbwd/kernels.py sizes llm.c's
// kernels' by the same layout.
constexpr size_t kWorkspaceHeaderBytes = 256;

// llm.c's kernels 1-10, repaired, each keeping its technique (see the comment at the top of
// ffi/kernels/backward/llmc/kernelNN_*.cu). They sum over all rows: segments must be 1 and
// weight_stride 0. What each accepts (dtypes, block sizes, C, shared memory) is in
// backward/llmc/llmc_limits.h, which the host-side registry (ffi/registry.h) reads too: callers
// ask the registry before they launch.
// A launcher still refuses what it cannot run, without launching: cudaErrorInvalidValue for a
// dtype it is not built for, segments it cannot do or more shared memory than the GPU has (the
// driver's answer to the opt-in), cudaErrorInvalidConfiguration for a block size or C it cannot run.
cudaError_t norm_bwd_kernel1(const NormBwdParams& p, cudaStream_t stream);   // naive
cudaError_t norm_bwd_kernel2(const NormBwdParams& p, cudaStream_t stream);   // smem reduce
cudaError_t norm_bwd_kernel3(const NormBwdParams& p, cudaStream_t stream);   // persistent + atomics
cudaError_t norm_bwd_kernel4(const NormBwdParams& p, cudaStream_t stream);   // atomicCAS bf16
cudaError_t norm_bwd_kernel5(const NormBwdParams& p, cudaStream_t stream);   // per-block scratch
cudaError_t norm_bwd_kernel6(const NormBwdParams& p, cudaStream_t stream);   // one shared scratch
cudaError_t norm_bwd_kernel7(const NormBwdParams& p, cudaStream_t stream);   // no cooperative groups
cudaError_t norm_bwd_kernel8(const NormBwdParams& p, cudaStream_t stream);   // x128 vectors
cudaError_t norm_bwd_kernel9(const NormBwdParams& p, cudaStream_t stream);   // block reduce
cudaError_t norm_bwd_kernel10(const NormBwdParams& p, cudaStream_t stream);  // vector smem

// llm.c's kernels 1-10 by id - 1 (the FFI glue and the CUDA check and tuning tools dispatch
// through this table).
using NormBwdLauncher = cudaError_t (*)(const NormBwdParams&, cudaStream_t);
inline constexpr NormBwdLauncher kLlmcLaunchers[] = {
    norm_bwd_kernel1, norm_bwd_kernel2, norm_bwd_kernel3, norm_bwd_kernel4,
    norm_bwd_kernel5, norm_bwd_kernel6, norm_bwd_kernel7, norm_bwd_kernel8,
    norm_bwd_kernel9, norm_bwd_kernel10,
};

// Workspace bytes kernel 11 or 12 uses for a problem on `device` (-1: the current one), with
// 16-byte aligned buffers (XLA's are): the header and the partial slots of the launch it would
// make. The launcher plans the same way; given fewer bytes, it uses fewer blocks, never more
// slots than there are. jax_lnbwd/kernels.py asks this at trace time (ffi/module.cc).
cudaError_t norm_bwd_workspace_bytes(int kernel, Dtype dtype, int64_t rows, int64_t C, int64_t segments,
                                          int device, LaunchPlan* plan);

// Kernel 11: rows kept in registers between the two passes, per-block fp32 partial sums of
// dweight/dbias added up in a fixed order (see kernel11_rows_in_registers.cu).
// Any C >= 1, any number of segments; block shape is chosen from C (p.block_size is ignored).
cudaError_t norm_bwd_kernel11(const NormBwdParams& p, cudaStream_t stream);

// Kernel 12: rows streamed into a shared-memory ring by the bulk copy engine (sm_90), sums in
// registers, per-block partials as kernel 11 (see kernel12_bulk_copy_ring.cu); small rows (kernel
// 11 holds one in a group narrower than a warp) on its ring of row chunks
// (kernel12_row_chunks.cu). Falls back to kernel 11 for 1 KB rows (a warp of kernel 11 at two
// vectors a thread), misaligned rows, rows too wide for the ring in the device's shared memory,
// fp64 small rows, GPUs before sm_90, and builds without sm_90 code (CUDA architectures without
// 90). kernel12_config.cu's norm_bwd_kernel12 says why.
cudaError_t norm_bwd_kernel12(const NormBwdParams& p, cudaStream_t stream);

// QK-norm's backward: two sets of rows (attention's q heads and k heads) in one launch of kernel
// 11's row loop over both, or one launch of kernel 12's ring of row chunks a set, then one
// finalize for both (backward/sets.cu says which). From each of a and b: its set's dx, dy,
// x, weight ([C]: one weight row each), mean, rstd, rows and heads layout (dy may be dx's own
// buffer: the fused projection's cotangent, normalized in place). From a only: dtype, C,
// weight_f32, norm, offset, workspace, device, plan; a.dweight is [2, C], row 0 set a's dweight
// and row 1 set b's; dbias is null (QK-norm has no bias; layernorm's dbias sums are dropped).
// Rows must be 16-byte aligned and at most kHeadRowsMaxBytes (common/head_rows.h), no dresidual,
// one segment: cudaErrorInvalidValue otherwise. Deterministic, as kernels 11 and 12.
cudaError_t norm_bwd_sets(const NormBwdParams& a, const NormBwdParams& b, cudaStream_t stream);
// The workspace norm_bwd_sets uses for sets of rows_a and rows_b rows of C on `device` (-1: the
// current one), as norm_bwd_workspace_bytes does for kernels 11 and 12; fused: the sets are head
// rows of the fused projection, else q and k in buffers of their own (the forms take different
// kernels).
cudaError_t norm_bwd_sets_workspace_bytes(Dtype dtype, int64_t rows_a, int64_t rows_b, int64_t C, bool fused,
                                          int device, LaunchPlan* plan);

}  // namespace lnbwd
