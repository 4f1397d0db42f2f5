// The launcher API of the fused norm forward (layernorm and RMSNorm): plain pointers, sizes and a stream. Shared by
// the kernels (nvcc) and the XLA FFI glue (host compiler); never includes an XLA header.
//
// The math, for one row of C elements x_0..x_{C-1}, in fp32 (fp64 for fp64 data):
//   mean = (1/C) sum_i x_i
//   var  = (1/C) sum_i (x_i - mean)^2        centered: never E[x^2] - E[x]^2, which loses every
//                                             digit of var when |mean| >> std
//   rstd = 1 / sqrt(var + eps)
//   y_i  = ((x_i - mean) * rstd) * weight_i + bias_i,   rounded once to x's dtype
// mean and rstd are saved (fp32, fp64 for fp64) for the backward. The row is read from DRAM
// once: it stays on chip (registers, or shared memory for wide rows) for the three passes.
//
// The residual variant (add_layernorm: residual and s set) reads x and residual once and
// normalizes their sum, rounded to x's dtype first:
//   s_i = round(x_i + residual_i)            the sum in fp32 (fp64), rounded once to dtype
//   y   = the layernorm above of the row s   (not of the unrounded sum)
// and writes s as well: it is what jnp's `x + residual` gives for equal dtypes (a 16-bit pair's
// fp32 sum rounded to 16 bits is the correctly rounded sum: fp32 has at least 2p + 2 bits), so
// y, mean and rstd are the layernorm of exactly the s the caller gets back.
//
// With x's own bias (add_layernorm's x_bias: the bias of the projection that produced x, whose
// add XLA would otherwise run on its own between the matmul and this kernel):
//   s_i = round((x_i + x_bias_i) + residual_i)   in fp32 (fp64), in that order, rounded once
//
// RMSNorm (norm = NormKind::kRmsNorm; norm_kind.h): no mean is taken or subtracted,
//   rstd = 1 / sqrt((1/C) sum_i x_i^2 + eps),   y_i = (x_i * rstd) * (offset + weight_i)
// with offset + weight_i in the accumulator type (y_i = x_i * rstd without a weight); mean and
// bias are null. The same kernels run it with mean = 0, skipping the mean's reduction; the
// residual variant and x_bias are as above.
//
// Mixed precision: for bf16/fp16 x, weight, bias (and x_bias) may be float32 (params kept in fp32, as
// Flax keeps them); they are used in fp32 as they are, never rounded to 16 bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/head_rows.h"
#include "dtype.h"
#include "norm_kind.h"

namespace lnbwd {

// Where a row lives between its passes (see forward_rows.cu and forward_wide.cu).
enum class FwdPath {
  kAuto,          // the launcher picks (what the FFI handler uses)
  kRegisters,     // a warp, or a few warps, per row; the row in registers
  kSharedMemory,  // a block per row; the row in shared memory
  kGlobal,        // a block per row; the row re-read from global memory (L2) for passes 2 and 3
};

// Outputs are written, never accumulated into.
struct NormFwdParams {
  void* y;                // [rows, C] dtype
  void* mean;             // [rows] float32 (float64 when dtype is kF64); null for kRmsNorm
  void* rstd;             // [rows] float32 (float64 when dtype is kF64)
  const void* x;          // [rows, C] dtype
  const void* weight;     // [weight_rows, C] param_dtype, or nullptr: no scale (1)
  const void* bias;       // [bias_rows, C] param_dtype, or nullptr: no shift (0); null for kRmsNorm
  int64_t rows;
  int64_t C;              // >= 1, below 2^31
  // 1: one parameter row for all rows; S > 1 (dividing rows): the rows form S equal contiguous
  // segments and segment s uses parameter row s (vmap over per-example parameters).
  int64_t weight_rows;
  int64_t bias_rows;
  Dtype dtype;
  Dtype param_dtype;      // dtype, or kF32 when dtype is kBF16 or kF16
  double eps;             // used in the statistics' dtype (rounded to fp32 for fp32 statistics)
  FwdPath path;           // kAuto, or a path to force (the standalone check exercises each)
  int tpr;                // 0: the launcher's choice; else the register path's threads per row
                          // (a power of two, 32 to 512: tools/tune/forward_tune.cu's sweep)
  // The residual variant: both set, or both nullptr (the plain forward). Never aliased to x or y.
  const void* residual;   // [rows, C] dtype
  void* s;                // [rows, C] dtype: x + residual, rounded to dtype; the rows normalized
  // The residual variant only, optional: x's own bias, added to x before the residual.
  const void* x_bias;     // [x_bias_rows, C] param_dtype, or nullptr
  int64_t x_bias_rows;    // as weight_rows
  // The norm kind, which every caller sets. RMSNorm: mean and bias null; offset is added to the
  // weight (ignored for kLayerNorm).
  NormKind norm;
  double offset = 0.0;
  // 0: as many blocks as row groups, up to the device's grid limit (what the FFI glue uses); else
  // at most max_blocks, so that blocks stride over rows (the standalone checks' grid-stride cases:
  // otherwise only more than 2^31 - 1 row groups would stride).
  int64_t max_blocks = 0;
  // The rows' layout: contiguous (heads.heads = 0), or heads inside wider token rows
  // (common/head_rows.h). Only norm_fwd_sets takes head rows; norm_fwd refuses them.
  HeadRows heads;
};

// What the launcher runs for a shape: the path, the vector width (elements per access: 16 bytes,
// or 1 when rows are not 16-byte aligned), for kRegisters the row group: `tpr` threads per row,
// each holding `nv` vectors, and `rows_per_block` row groups per block; and the grid.
struct NormFwdConfig {
  FwdPath path;
  int vec;
  int nv;
  int tpr;
  int rows_per_block;
  int threads;            // per block
  size_t smem_bytes;      // dynamic shared memory per block
  unsigned int blocks;    // the grid: a block per rows_per_block rows, up to the grid limit (and
                          // max_blocks); the blocks then stride over the rest
};

// The configuration norm_fwd would launch for `p` on the current device (p.path forces a
// path; cudaErrorInvalidValue if that path cannot hold this row). Host-only; reads device limits.
cudaError_t norm_fwd_pick(const NormFwdParams& p, NormFwdConfig* cfg);

// Launches the forward on `stream`. cudaErrorInvalidValue for a dtype pair it has no kernel for
// (the FFI glue refuses those first). rows == 0 launches nothing.
cudaError_t norm_fwd(const NormFwdParams& p, cudaStream_t stream);

// QK-norm's forward: two sets of rows (attention's q heads and k heads, each set with its own
// pointers, rows, weight and layout) normalized by ONE launch (forward_sets.cu). The sets must
// agree in everything else: C, dtypes, norm, eps, offset; no residual; one parameter row (or
// none) each. Rows must be 16-byte aligned and at most kHeadRowsMaxBytes (common/head_rows.h);
// cudaErrorInvalidValue otherwise. In place is allowed (y == x: the fused projection's buffer),
// since each row is read whole before it is written.
cudaError_t norm_fwd_sets(const NormFwdParams& a, const NormFwdParams& b, cudaStream_t stream);
// The configuration norm_fwd_sets launches, and the blocks of set a (blocks0).
cudaError_t norm_fwd_sets_pick(const NormFwdParams& a, const NormFwdParams& b, NormFwdConfig* cfg,
                               unsigned int* blocks0);

}  // namespace lnbwd
