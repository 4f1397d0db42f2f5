// The operands, results and attributes of every FFI target (targets.h), one list per target that
// both of its handlers bind: the CPU handler binds the list as it is, the CUDA handler appends the
// contexts it needs (XLA's stream, and for the backward the device's ordinal). A binding's
// arguments, results, attributes and contexts are decoded each by their own index, so contexts
// after the attributes change nothing in the call XLA makes: the implementation's parameters
// follow the binding's order, operands first, contexts last.
//
// "dtype" is x's dtype; the statistics (mean, rstd) are float32, or float64 for float64 x. The
// parameters (weight, bias, x_bias) may be float32 beside bfloat16/float16 x (mixed precision:
// used as they are, never rounded to 16 bits). A parameter of shape (0, C) is absent; (1, C) is
// shared by all rows; (segments, C) gives each of `segments` equal runs of rows its own row.
#pragma once

#include <cstdint>

#include "xla/ffi/api/api.h"

namespace lnbwd {

using xla::ffi::AnyBuffer;
using xla::ffi::Ffi;

// --- The fused forward ---------------------------------------------------------------------

// y = ((x - mean) * rstd) * weight + bias, with mean and the centered variance of each row.
inline auto LayernormFwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // x [rows, C] dtype
      .Arg<AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
      .Arg<AnyBuffer>()   // bias [0 (absent), 1 or segments, C] weight's dtype
      .Ret<AnyBuffer>()   // y [rows, C] dtype
      .Ret<AnyBuffer>()   // mean [rows] float32 (float64 for float64 x)
      .Ret<AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
      .Attr<double>("eps");   // added to the variance, in the statistics' dtype
}

// The residual variant: s = x + residual, rounded once to dtype, and the layernorm of s.
inline auto AddLayernormFwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // x [rows, C] dtype
      .Arg<AnyBuffer>()   // residual [rows, C] dtype
      .Arg<AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
      .Arg<AnyBuffer>()   // bias [0 (absent), 1 or segments, C] weight's dtype
      .Ret<AnyBuffer>()   // y [rows, C] dtype: the layernorm of s
      .Ret<AnyBuffer>()   // s [rows, C] dtype: x + residual, rounded once to dtype
      .Ret<AnyBuffer>()   // mean [rows] float32 (float64 for float64 x), of s
      .Ret<AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
      .Attr<double>("eps");   // added to the variance, in the statistics' dtype
}

// The residual variant with x's own bias (the bias of the projection that produced x):
// s = (x + x_bias) + residual, in that order, rounded once.
inline auto AddBiasLayernormFwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // x [rows, C] dtype
      .Arg<AnyBuffer>()   // x_bias [1 or segments, C] dtype, or float32 for 16-bit x
      .Arg<AnyBuffer>()   // residual [rows, C] dtype
      .Arg<AnyBuffer>()   // weight [0 (absent), 1 or segments, C] x_bias's dtype
      .Arg<AnyBuffer>()   // bias [0 (absent), 1 or segments, C] x_bias's dtype
      .Ret<AnyBuffer>()   // y [rows, C] dtype: the layernorm of s
      .Ret<AnyBuffer>()   // s [rows, C] dtype: (x + x_bias) + residual, rounded once to dtype
      .Ret<AnyBuffer>()   // mean [rows] float32 (float64 for float64 x), of s
      .Ret<AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
      .Attr<double>("eps");   // added to the variance, in the statistics' dtype
}

// RMSNorm: y = (x * rstd) * (offset + weight), rstd = 1 / sqrt(mean(x^2) + eps); no mean, no bias.
inline auto RmsnormFwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // x [rows, C] dtype
      .Arg<AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
      .Ret<AnyBuffer>()   // y [rows, C] dtype: (x * rstd) * (offset + weight)
      .Ret<AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x): 1 / sqrt(mean(x^2) + eps)
      .Attr<double>("eps")       // added to mean(x^2), in the statistics' dtype
      .Attr<double>("offset");   // added to the weight, in the accumulator type (Gemma: 1); ignored without weight
}

// RMSNorm's residual variant: s = (x [+ x_bias]) + residual, rounded once, and the rmsnorm of s.
inline auto AddRmsnormFwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // x [rows, C] dtype
      .Arg<AnyBuffer>()   // x_bias [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
      .Arg<AnyBuffer>()   // residual [rows, C] dtype
      .Arg<AnyBuffer>()   // weight [0 (absent), 1 or segments, C] x_bias's dtype when both are present
      .Ret<AnyBuffer>()   // y [rows, C] dtype: the rmsnorm of s
      .Ret<AnyBuffer>()   // s [rows, C] dtype: (x [+ x_bias]) + residual, rounded once to dtype
      .Ret<AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
      .Attr<double>("eps")       // added to mean(s^2), in the statistics' dtype
      .Attr<double>("offset");   // added to the weight, in the accumulator type (Gemma: 1); ignored without weight
}

// --- The backward --------------------------------------------------------------------------
// The kernel attributes choose the CUDA kernel (ids as in jax_lnbwd.KERNELS); the CPU handler
// checks them as the CUDA handler does and runs its reference for every id. The workspace is
// XLA-owned scratch: a header of flags, then per-block partial sums (unused on the CPU).

// Layernorm, with a weight of x's dtype:
//   dx = (g - mean(g) - xhat * mean(g * xhat)) * rstd,  g = weight * dy,  xhat = (x - mean) * rstd;
//   dweight, dbias = the sums of dy * xhat and dy over each segment's rows.
inline auto LayernormBwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // dy [rows, C] dtype
      .Arg<AnyBuffer>()   // x [rows, C] dtype
      .Arg<AnyBuffer>()   // weight [1 or segments, C] dtype
      .Arg<AnyBuffer>()   // mean [rows] float32 (float64 for float64 x)
      .Arg<AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
      .Ret<AnyBuffer>()   // dx [rows, C] dtype
      .Ret<AnyBuffer>()   // dweight [segments, C] dtype: sums over each segment's rows
      .Ret<AnyBuffer>()   // dbias [segments, C] dtype
      .Ret<AnyBuffer>()   // workspace [bytes] uint8: flags, then per-block partial sums
      .Attr<int32_t>("kernel")        // which CUDA kernel (ids as in jax_lnbwd.KERNELS)
      .Attr<int32_t>("block_size");   // threads per block, 0 = the kernel's best
}

// Layernorm's v2: v1 plus two things, run by the kernels whose registry entry says v2_operands
// (registry.cc; the others refuse them).
//  * Mixed precision: weight may be float32 beside bfloat16/float16 x ("pdtype" below: x's dtype,
//    or float32). g = weight * dy is formed in fp32 from the float32 weight, never rounded, and
//    dweight/dbias, summed in fp32 as always, are stored as pdtype.
//  * A residual gradient: with has_residual, dx = layernorm's dx + dresidual, added in fp32 and
//    rounded once (the backward of add_layernorm: the residual stream's gradient passes through).
//    The caller aliases dresidual to dx (input_output_aliases {5: 0}): XLA then writes dx in
//    dresidual's buffer where that is dead after the call, and copies it first where it is not.
//    Each element is read once and written once, by the same thread. Absent (has_residual
//    false), dresidual is a placeholder with no elements, e.g. a (0,) array, and nothing aliases.
inline auto LayernormBwdV2Operands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // dy [rows, C] dtype
      .Arg<AnyBuffer>()   // x [rows, C] dtype
      .Arg<AnyBuffer>()   // weight [1 or segments, C] pdtype: dtype, or float32 beside bf16/f16
      .Arg<AnyBuffer>()   // mean [rows] float32 (float64 for float64 x)
      .Arg<AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
      .Arg<AnyBuffer>()   // dresidual [rows, C] dtype, added to dx (may be aliased to it); (0,) when !has_residual
      .Ret<AnyBuffer>()   // dx [rows, C] dtype: layernorm's dx (+ dresidual)
      .Ret<AnyBuffer>()   // dweight [segments, C] pdtype: sums over each segment's rows
      .Ret<AnyBuffer>()   // dbias [segments, C] pdtype
      .Ret<AnyBuffer>()   // workspace [bytes] uint8: flags, then per-block partial sums
      .Attr<int32_t>("kernel")       // which CUDA kernel (ids as in jax_lnbwd.KERNELS)
      .Attr<int32_t>("block_size")   // threads per block, 0 = the kernel's best
      .Attr<bool>("has_residual");   // whether dresidual is added (else it is a placeholder)
}

// RMSNorm's backward, with g_i = (offset + weight_i) * dy_i and xhat_i = x_i * rstd:
//   dx_i = (g_i - xhat_i * mean_j(g_j xhat_j)) * rstd  [+ dresidual_i, added in fp32, rounded once]
//   dweight_i = sum over each segment's rows of dy_i * xhat_i   (offset does not enter it)
// Mixed precision and the residual gradient as in layernorm's v2 (dresidual may be aliased to
// dx: input_output_aliases {4: 0}), run by the kernels whose registry entry says rmsnorm. The
// workspace has the layout and the size of layernorm's for the same kernel, dtype, rows, C and
// segments (launch_plan in ffi/module.cc sizes both).
inline auto RmsnormBwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // dy [rows, C] dtype
      .Arg<AnyBuffer>()   // x [rows, C] dtype
      .Arg<AnyBuffer>()   // weight [1 or segments, C] pdtype: dtype, or float32 beside bf16/f16
      .Arg<AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
      .Arg<AnyBuffer>()   // dresidual [rows, C] dtype, added to dx (may be aliased to it); (0,) when !has_residual
      .Ret<AnyBuffer>()   // dx [rows, C] dtype: rmsnorm's dx (+ dresidual)
      .Ret<AnyBuffer>()   // dweight [segments, C] pdtype: sums over each segment's rows
      .Ret<AnyBuffer>()   // workspace [bytes] uint8: flags, then per-block partial sums (layernorm's size)
      .Attr<int32_t>("kernel")       // which CUDA kernel (ids as in jax_lnbwd.KERNELS)
      .Attr<int32_t>("block_size")   // threads per block, 0 = the kernel's best
      .Attr<bool>("has_residual")    // whether dresidual is added (else it is a placeholder)
      .Attr<double>("offset");       // g = (offset + weight) * dy, in the accumulator type (Gemma: 1)
}

// --- QK-norm (one op for q and k) ----------------------------------------------------------
// Each head of attention's q and k (D = head_dim values) is one row, normalized over D; one
// weight (D,) scales every q head, one every k head. The attribute 'norm' holds the NormKind
// (0 layernorm: centered, no bias, offset 0; 1 rmsnorm: no mean saved, its means are (0,)).
// "dtype" is the data's (q's, or qkv's); "stat" the statistics' (float32, float64 for float64
// data); a weight may be float32 beside bfloat16/float16 data (used as float32, never rounded;
// its gradient is float32 then). The checks: checks/qk_norm.h.
// The fused form's qkv [tokens, width], width = (q_heads + 2 * kv_heads) * D, holds per token
// the q heads, then the k heads, then the v heads; row r of the q set (r = token * q_heads +
// head) is head r % q_heads of token r / q_heads, of the k set head q_heads + r % kv_heads of
// token r / kv_heads, and the statistics are in that row order. Its result aliases operand 0
// (the Python caller passes input_output_aliases {0: 0}), so normally it IS that operand's
// buffer and the v heads are left as they are; where XLA hands over two buffers, the handler
// first copies operand 0 into the result and then works in place.

// q_out = x̂(q) * (offset + q_weight), k_out likewise, with rmsnorm's x̂ = x * rstd or layernorm's
// (x - mean) * rstd; statistics in fp32 (fp64), outputs rounded once.
inline auto QkNormFwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // q [rows_q, D] dtype
      .Arg<AnyBuffer>()   // k [rows_k, D] dtype (q's dtype and D)
      .Arg<AnyBuffer>()   // q_weight [0 (absent) or 1, D] dtype, or float32 beside 16-bit data
      .Arg<AnyBuffer>()   // k_weight [0 (absent) or 1, D] q_weight's dtype when both are present
      .Ret<AnyBuffer>()   // q_out [rows_q, D] dtype
      .Ret<AnyBuffer>()   // k_out [rows_k, D] dtype
      .Ret<AnyBuffer>()   // q_mean [rows_q] stat (layernorm), [0] (rmsnorm)
      .Ret<AnyBuffer>()   // q_rstd [rows_q] stat
      .Ret<AnyBuffer>()   // k_mean [rows_k] stat (layernorm), [0] (rmsnorm)
      .Ret<AnyBuffer>()   // k_rstd [rows_k] stat
      .Attr<double>("eps")        // added to the variance (mean square), in the statistics' dtype
      .Attr<double>("offset")     // rmsnorm's, added to both weights (Gemma: 1); 0 for layernorm
      .Attr<int32_t>("norm");     // NormKind: 0 layernorm, 1 rmsnorm
}

// The fused form: qkv's q and k heads normalized as qk_norm_fwd does, its v heads unchanged.
inline auto QkNormFusedFwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // qkv [tokens, (q_heads + 2 * kv_heads) * D] dtype: q, k, v heads per token
      .Arg<AnyBuffer>()   // q_weight [0 (absent) or 1, D] dtype, or float32 beside 16-bit data
      .Arg<AnyBuffer>()   // k_weight [0 (absent) or 1, D] q_weight's dtype when both are present
      .Ret<AnyBuffer>()   // qkv_out [tokens, (q_heads + 2 * kv_heads) * D] dtype: aliases qkv
      .Ret<AnyBuffer>()   // q_mean [tokens * q_heads] stat (layernorm), [0] (rmsnorm)
      .Ret<AnyBuffer>()   // q_rstd [tokens * q_heads] stat
      .Ret<AnyBuffer>()   // k_mean [tokens * kv_heads] stat (layernorm), [0] (rmsnorm)
      .Ret<AnyBuffer>()   // k_rstd [tokens * kv_heads] stat
      .Attr<double>("eps")         // added to the variance (mean square), in the statistics' dtype
      .Attr<double>("offset")      // rmsnorm's, added to both weights (Gemma: 1); 0 for layernorm
      .Attr<int32_t>("norm")       // NormKind: 0 layernorm, 1 rmsnorm
      .Attr<int64_t>("q_heads")    // q heads per token, >= 1
      .Attr<int64_t>("kv_heads");  // k heads (and v heads) per token, >= 1
}

// The backward, per row with A = fp32 (fp64 for float64 data), xhat = (x - mean) * rstd (rmsnorm:
// mean = 0) and g = (offset + w) * dy (offset: rmsnorm's):
//   dx = (g - a - xhat * b) * rstd,  a = mean(g) (layernorm; 0 for rmsnorm),  b = mean(g * xhat);
//   dweight = the sum over all rows of the set (every token and head) of dy * xhat.
// No dbias. Every result is written, never accumulated into. The workspace is scratch for the
// CUDA kernels (sized by qk_launch_plan); the CPU handler does not use it.
inline auto QkNormBwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // dq_out [rows_q, D] dtype: the cotangent of q_out
      .Arg<AnyBuffer>()   // dk_out [rows_k, D] dtype: the cotangent of k_out
      .Arg<AnyBuffer>()   // q [rows_q, D] dtype
      .Arg<AnyBuffer>()   // k [rows_k, D] dtype
      .Arg<AnyBuffer>()   // q_weight [1, D] dtype, or float32 beside 16-bit data (ones when absent)
      .Arg<AnyBuffer>()   // k_weight [1, D] q_weight's dtype (ones when absent)
      .Arg<AnyBuffer>()   // q_mean [rows_q] stat (layernorm), [0] (rmsnorm)
      .Arg<AnyBuffer>()   // q_rstd [rows_q] stat
      .Arg<AnyBuffer>()   // k_mean [rows_k] stat (layernorm), [0] (rmsnorm)
      .Arg<AnyBuffer>()   // k_rstd [rows_k] stat
      .Ret<AnyBuffer>()   // dq [rows_q, D] dtype
      .Ret<AnyBuffer>()   // dk [rows_k, D] dtype
      .Ret<AnyBuffer>()   // dweights [2, D] the weights' dtype: row 0 the sum over q's rows, row 1 over k's
      .Ret<AnyBuffer>()   // workspace [bytes] uint8: the CUDA kernels' scratch
      .Attr<double>("offset")    // rmsnorm's, added to both weights (Gemma: 1); 0 for layernorm
      .Attr<int32_t>("norm");    // NormKind: 0 layernorm, 1 rmsnorm
}

// The fused form's backward: dqkv's q and k heads as qk_norm_bwd computes them, its v heads
// dqkv_out's (the result aliases dqkv_out: input_output_aliases {0: 0}).
inline auto QkNormFusedBwdOperands() {
  return Ffi::Bind()
      .Arg<AnyBuffer>()   // dqkv_out [tokens, (q_heads + 2 * kv_heads) * D] dtype: the cotangent of qkv_out
      .Arg<AnyBuffer>()   // qkv [tokens, (q_heads + 2 * kv_heads) * D] dtype: the forward's input
      .Arg<AnyBuffer>()   // q_weight [1, D] dtype, or float32 beside 16-bit data (ones when absent)
      .Arg<AnyBuffer>()   // k_weight [1, D] q_weight's dtype (ones when absent)
      .Arg<AnyBuffer>()   // q_mean [tokens * q_heads] stat (layernorm), [0] (rmsnorm)
      .Arg<AnyBuffer>()   // q_rstd [tokens * q_heads] stat
      .Arg<AnyBuffer>()   // k_mean [tokens * kv_heads] stat (layernorm), [0] (rmsnorm)
      .Arg<AnyBuffer>()   // k_rstd [tokens * kv_heads] stat
      .Ret<AnyBuffer>()   // dqkv [tokens, (q_heads + 2 * kv_heads) * D] dtype: aliases dqkv_out
      .Ret<AnyBuffer>()   // dweights [2, D] the weights' dtype: row 0 the sum over the q heads of every
                          //   token, row 1 over the k heads
      .Ret<AnyBuffer>()   // workspace [bytes] uint8: the CUDA kernels' scratch
      .Attr<double>("offset")      // rmsnorm's, added to both weights (Gemma: 1); 0 for layernorm
      .Attr<int32_t>("norm")       // NormKind: 0 layernorm, 1 rmsnorm
      .Attr<int64_t>("q_heads")    // q heads per token, >= 1
      .Attr<int64_t>("kv_heads");  // k heads (and v heads) per token, >= 1
}

}  // namespace lnbwd
