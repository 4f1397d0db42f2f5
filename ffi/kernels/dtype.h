// The element types of the layernorm kernels (forward and backward), as the kernels and the
// host-side registry (ffi/registry.h) both name them. Plain C++: no CUDA header, so the CPU-only
// build uses it too.
#pragma once

namespace lnbwd {

enum class Dtype { kF32, kBF16, kF16, kF64 };

// Bytes of one element, and of the accumulator it is summed in (fp32, fp64 for float64 data).
constexpr int dtype_item_bytes(Dtype d) { return d == Dtype::kF64 ? 8 : d == Dtype::kF32 ? 4 : 2; }
constexpr int dtype_acc_bytes(Dtype d) { return d == Dtype::kF64 ? 8 : 4; }

// jax's names for them.
constexpr const char* dtype_name(Dtype d) {
  return d == Dtype::kF64 ? "float64" : d == Dtype::kF32 ? "float32" : d == Dtype::kBF16 ? "bfloat16" : "float16";
}

// A set of dtypes as bits: dtype_bit(kF32) | dtype_bit(kBF16) ...
constexpr unsigned dtype_bit(Dtype d) { return 1u << static_cast<int>(d); }
inline constexpr Dtype kAllDtypes[] = {Dtype::kF32, Dtype::kBF16, Dtype::kF16, Dtype::kF64};

}  // namespace lnbwd
