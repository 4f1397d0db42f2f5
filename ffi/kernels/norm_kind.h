// Which normalization a launch computes, as the kernels, the FFI glue and the standalone checks
// all name it. Plain C++: no CUDA header, so the CPU-only build uses it too.
//
//   kLayerNorm: xhat_i = (x_i - mean) * rstd,  rstd = 1 / sqrt(var + eps),  var centered;
//               y_i = xhat_i * w_i + b_i.
//   kRmsNorm:   xhat_i = x_i * rstd,            rstd = 1 / sqrt(mean_i(x_i^2) + eps);
//               y_i = xhat_i * (offset + w_i)   (no mean subtracted, no bias; Gemma stores w
//               zero-centred and uses offset = 1).
// RMSNorm is layernorm with mean = 0 and without the terms that the mean's gradient brings: the
// kernels run it through the same code, told by this field (per launch, never per element)
// with the mean and dbias pointers null.
#pragma once

namespace lnbwd {

enum class NormKind { kLayerNorm, kRmsNorm };

// The offset the kernels add to the weight: RMSNorm's, or -0.0 where there is none (layernorm,
// or an offset of 0). w + (-0.0) is w bit for bit for every w (+0 + -0 = +0, -0 + -0 = -0; any
// other w is unchanged exactly), while w + (+0.0) would turn a weight of -0 into +0. So the
// backward kernels add it unconditionally: one add per weight element, and no branch, no
// predicate and no register for it in layernorm's loops (a uniform branch on the offset made the
// compiler allocate the register paths' rows worse). The fused forward, closer to its issue
// limit, takes the norm kind as a template parameter instead: only RMSNorm's kernels add it.
constexpr double kernel_offset(NormKind k, double offset) {
  return k == NormKind::kRmsNorm && offset != 0.0 ? offset : -0.0;
}

}  // namespace lnbwd
