// Small device helpers shared by the kernels: packed vector loads and stores, dtype <-> accumulator
// conversions and warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace lnbwd {

// Accumulate in fp32, or in fp64 when the data itself is fp64.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using acc_t = typename AccOf<T>::type;

// mean and rstd are saved in fp32 by the forward pass (fp64 for fp64 data).
template <typename T> using stat_t = acc_t<T>;

template <typename T> __device__ __forceinline__ acc_t<T> to_acc(T v) { return static_cast<acc_t<T>>(v); }
template <> __device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_acc(float v) { return __float2half_rn(v); }

// g = weight * dy rounded once, in a form the compiler may not fuse into a neighbouring add
// (an FMA would keep the product unrounded in one pass and rounded in the other). With g
// bit-identical in both passes, C = 1 gives dx = g - mean(g) = 0 exactly.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// N elements of T moved as one access of N * sizeof(T) bytes. With N * sizeof(T) == 16 the
// compiler emits LDG.128/STG.128 (one instruction moves 16 bytes, the widest per-thread access),
// which is what keeps enough bytes in flight to saturate HBM. The caller guarantees alignment.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  static constexpr int size = N;
  T v[N];
  __device__ __forceinline__ T& operator[](int i) { return v[i]; }
  __device__ __forceinline__ const T& operator[](int i) const { return v[i]; }
};

// Every element of a packed vector converted to the accumulator type.
template <typename T, int N>
__device__ __forceinline__ Packed<acc_t<T>, N> to_acc(const Packed<T, N>& v) {
  Packed<acc_t<T>, N> out;
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_acc(v[i]);
  return out;
}

// bf16 is the upper half of an fp32, so widening is exact bit work on the 32-bit word holding
// two elements: the even (low) element shifted up, the odd (high) one with the low half masked
// off. One integer instruction each; converted one element at a time, nvcc 13 extracts the odd
// element with a PRMT before shifting it: two. Kernel 12 is issue-bound enough at C = 1600 for
// that extra instruction per element to cost time.
template <int N>
__device__ __forceinline__ Packed<float, N> to_acc(const Packed<__nv_bfloat16, N>& v) {
  Packed<float, N> out;
#pragma unroll
  for (int i = 0; i + 1 < N; i += 2) {
    uint32_t pair;
    memcpy(&pair, &v.v[i], sizeof(pair));
    out[i] = __uint_as_float(pair << 16);
    out[i + 1] = __uint_as_float(pair & 0xffff0000u);
  }
  if constexpr (N % 2 == 1) out[N - 1] = to_acc(v[N - 1]);
  return out;
}

// The raw bits of an N * sizeof(T)-byte access, so the cache-hinted intrinsics (which exist only
// for built-in types) can be used for any packed type.
template <int BYTES> struct BitsOf;
template <> struct BitsOf<2> { using type = unsigned short; };
template <> struct BitsOf<4> { using type = unsigned int; };
template <> struct BitsOf<8> { using type = uint2; };
template <> struct BitsOf<16> { using type = uint4; };
template <typename V> using Bits = typename BitsOf<sizeof(V)>::type;

// The same bytes as another type of the same size.
template <typename To, typename From>
__device__ __forceinline__ To same_bytes(const From& v) {
  static_assert(sizeof(To) == sizeof(From));
  To out;
  memcpy(&out, &v, sizeof(To));
  return out;
}

template <typename V> __device__ __forceinline__ V load(const V* p) { return *p; }

// N elements of T from memory known to be 16-byte aligned: one access where that is at most 16
// bytes, else 16-byte pieces. (The wider case is a float32 weight beside 16-bit data: 8 floats,
// 32 bytes, whose alignment XLA promises only to 16.)
template <int N, typename T>
__device__ __forceinline__ Packed<T, N> load_vec(const T* p) {
  if constexpr (sizeof(T) * N <= 16) {
    return load(reinterpret_cast<const Packed<T, N>*>(p));
  } else {
    constexpr int kPiece = 16 / sizeof(T);
    static_assert(N % kPiece == 0, "whole 16-byte pieces");
    Packed<T, N> out;
#pragma unroll
    for (int h = 0; h < N; h += kPiece) {
      const Packed<T, kPiece> piece = load(reinterpret_cast<const Packed<T, kPiece>*>(p + h));
#pragma unroll
      for (int q = 0; q < kPiece; ++q) out[h + q] = piece[q];
    }
    return out;
  }
}

// Streaming load (ld.global.cs, "evict first"): the data is touched once more at most, so it
// should not push data that is reused (weight, partial sums) out of the caches.
template <typename V>
__device__ __forceinline__ V load_cs(const V* p) {
  return same_bytes<V>(__ldcs(reinterpret_cast<const Bits<V>*>(p)));
}

// Load that bypasses L1 (ld.global.cg): for data other blocks of the same grid wrote, which only
// L2 holds coherently.
template <typename V>
__device__ __forceinline__ V load_cg(const V* p) {
  return same_bytes<V>(__ldcg(reinterpret_cast<const Bits<V>*>(p)));
}

// Store that caches in L2 but not L1 (st.global.cg): dx is read by the next kernel, not by us.
template <typename V>
__device__ __forceinline__ void store_cg(V* p, const V& v) {
  __stcg(reinterpret_cast<Bits<V>*>(p), same_bytes<Bits<V>>(v));
}

// Streaming store (st.global.cs): written once, never read again by this kernel.
template <typename V>
__device__ __forceinline__ void store_cs(V* p, const V& v) {
  __stcs(reinterpret_cast<Bits<V>*>(p), same_bytes<Bits<V>>(v));
}

// Butterfly reduction: after log2(32) xor-shuffles every lane holds the sum of all 32 lanes.
// The order of additions is fixed, so the result is bit-identical run to run.
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Row groups narrower than a warp (the small-C paths: rows of a few hundred bytes, several to a
// warp). A group of `width` lanes (a power of two below 32) is an aligned run of lanes,
// [k * width, (k + 1) * width); its lanes reach the row's sums among themselves, and the
// warp's other groups may be on other rows or already past the last one, so each group's
// shuffles name only its own lanes: lanes_mask. A group has at least kMinRowThreads threads,
// so that each of its 16-byte loads covers 64 contiguous bytes (two whole 32-byte sectors).
constexpr int kMinRowThreads = 4;

__device__ __forceinline__ unsigned lanes_mask(int width, int lane) {
  return ((1u << width) - 1u) << (lane & ~(width - 1));
}

// The sum over one such group: a butterfly of log2(width) xor-shuffles, each within the group
// (an offset below width never leaves it). Every lane ends with the same bits, run to run.
template <typename A>
__device__ __forceinline__ A lanes_sum(A v, int width, unsigned mask) {
  for (int offset = width / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(mask, v, offset);
  return v;
}
// Two such sums at once: one loop, so the per-step work of a shuffle whose mask and width are
// known only at run time (nvcc checks the mask's lanes for divergence before each step) is paid
// once for both.
template <typename A>
__device__ __forceinline__ void lanes_sum2(A& u, A& v, int width, unsigned mask) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    u += __shfl_xor_sync(mask, u, offset);
    v += __shfl_xor_sync(mask, v, offset);
  }
}

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }
template <typename T>
__host__ __device__ constexpr T round_up(T a, T b) { return ceil_div(a, b) * b; }

}  // namespace lnbwd
