// The weight as the backward kernels use it, g_i = (offset + weight_i) * dy_i: a vector of the
// weight widened to the accumulator type, with RMSNorm's offset added (Gemma's 1 + w, added in
// the accumulator type, never rounded to the weight's dtype). Layernorm's offset is -0.0
// (kernel_offset, norm_kind.h: the launcher passes it), for which the add leaves every weight
// exactly as loaded, so it needs no branch.
#pragma once

#include "common/vec.cuh"

namespace lnbwd {

// The norm kind as the backward kernels take it (launch_with_partials, launch.cuh, fills it):
//   centered: 1 for layernorm, 0 for RMSNorm. The kernels use mean = centered * mean_r and
//             s1 -> centered * s1 (the mean's gradient term, s1/C or k0), so that RMSNorm, whose
//             mean pointer is then its rstd (a valid address; the product is 0), runs the same
//             instructions: a multiply per row, no branch and no predicate in the loops, and
//             1 * v == v leaves layernorm's values exactly as they were.
//   offset:   added to the weight (kernel_offset, norm_kind.h: -0.0 for layernorm).
template <typename A>
struct NormArgs {
  A centered;
  A offset;
};

template <typename A, typename O, int VEC>
__device__ __forceinline__ Packed<A, VEC> weight_in_acc(const Packed<O, VEC>& w, A offset) {
  Packed<A, VEC> out = to_acc(w);
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] += offset;
  return out;
}

}  // namespace lnbwd
