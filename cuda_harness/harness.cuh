// The common setup of the standalone CUDA programs that run the backward's kernels of
// ffi/kernels/ without JAX or XLA: the checks in tests/cuda/ (what the sanitizers run) and the
// configuration sweeps in tools/tune/. Built with -Icuda_harness -Iffi/kernels -Iffi.
// Exact-size device buffers (one cudaMalloc each, so memcheck sees a stray access), problems
// with a float64 CPU reference, the dtype conversions, and what each kernel accepts, from the
// kernel registry (ffi/registry.h, linked from ffi/registry.cc).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backward/api.h"
#include "backward/registers/kernel11.h"
#include "backward/tma_ring/kernel12.h"
#include "check_cuda.h"
#include "registry.h"
#include "registry_cuda.h"

using namespace lnbwd;

// An attribute of device 0, the one the check and the tools run on.
inline int device0_attribute(cudaDeviceAttr attr) {
  int v = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&v, attr, 0));
  return v;
}

// jax's names (float32) or the short ones (f32, bf16); anything else stops the program, so that
// a typo is never measured as another dtype.
inline Dtype parse_dtype(const std::string& s) {
  if (s == "float64" || s == "f64") return Dtype::kF64;
  if (s == "float32" || s == "f32") return Dtype::kF32;
  if (s == "bfloat16" || s == "bf16") return Dtype::kBF16;
  if (s == "float16" || s == "f16") return Dtype::kF16;
  std::fprintf(stderr, "unknown dtype '%s' (float64, float32, bfloat16, float16)\n", s.c_str());
  std::exit(2);
}

// Host values are doubles; these store them in the device dtype and read them back.
inline void encode(Dtype d, const std::vector<double>& v, std::vector<unsigned char>& out) {
  out.resize(v.size() * dtype_item_bytes(d));
  for (size_t i = 0; i < v.size(); ++i) {
    switch (d) {
      case Dtype::kF64: reinterpret_cast<double*>(out.data())[i] = v[i]; break;
      case Dtype::kF32: reinterpret_cast<float*>(out.data())[i] = float(v[i]); break;
      case Dtype::kBF16: reinterpret_cast<__nv_bfloat16*>(out.data())[i] = __float2bfloat16(float(v[i])); break;
      case Dtype::kF16: reinterpret_cast<__half*>(out.data())[i] = __float2half(float(v[i])); break;
    }
  }
}
inline double decode(Dtype d, const unsigned char* p, size_t i) {
  switch (d) {
    case Dtype::kF64: return reinterpret_cast<const double*>(p)[i];
    case Dtype::kF32: return reinterpret_cast<const float*>(p)[i];
    case Dtype::kBF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
    case Dtype::kF16: return __half2float(reinterpret_cast<const __half*>(p)[i]);
  }
  return 0;
}

struct DeviceBuf {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuf(size_t n) : bytes(n) { CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(n, 1))); }
  ~DeviceBuf() { cudaFree(ptr); }
};

// Buffers of values: to and from the device, in its dtype, and how far they are from a reference
// (the RMSNorm and QK-norm checks).
// Norm-wise relative error of decoded device values against a reference.
inline double rel_err_of(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline std::vector<double> decode_all(Dtype d, const std::vector<unsigned char>& b) {
  std::vector<double> out(b.size() / dtype_item_bytes(d));
  for (size_t i = 0; i < out.size(); ++i) out[i] = decode(d, b.data(), i);
  return out;
}

// Host values rounded to what a device buffer of dtype d holds, and that buffer's bytes.
inline std::vector<double> rounded(Dtype d, std::vector<double> v, std::vector<unsigned char>* bytes) {
  encode(d, v, *bytes);
  return decode_all(d, *bytes);
}

inline DeviceBuf upload(const std::vector<unsigned char>& h) {
  DeviceBuf b(h.size());
  CHECK_CUDA(cudaMemcpy(b.ptr, h.data(), h.size(), cudaMemcpyHostToDevice));
  return b;
}

inline std::vector<unsigned char> download(const DeviceBuf& b, size_t bytes) {
  std::vector<unsigned char> h(bytes);
  CHECK_CUDA(cudaMemcpy(h.data(), b.ptr, bytes, cudaMemcpyDeviceToHost));
  return h;
}

// One problem on the device with exact-size buffers, and its float64 CPU reference.
struct Problem {
  Dtype dtype;
  int64_t rows, C;
  std::vector<double> dy, x, w, mean, rstd, ref_dx, ref_dw, ref_db;
  std::vector<unsigned char> h_dy, h_x, h_w, h_mean, h_rstd;   // the inputs in device format
  Problem(Dtype d, int64_t r, int64_t c, unsigned seed) : dtype(d), rows(r), C(c) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> n(0.0, 1.0);
    auto round_trip = [&](std::vector<double>& v) {   // the values the device will really see
      std::vector<unsigned char> b;
      encode(dtype, v, b);
      for (size_t i = 0; i < v.size(); ++i) v[i] = decode(dtype, b.data(), i);
    };
    dy.resize(rows * C); x.resize(rows * C); w.resize(C);
    for (auto& v : dy) v = n(gen);
    for (auto& v : x) v = 0.5 + 2.0 * n(gen);
    for (auto& v : w) v = 1.0 + 0.1 * n(gen);
    round_trip(dy); round_trip(x); round_trip(w);
    mean.assign(rows, 0); rstd.assign(rows, 0);
    for (int64_t r = 0; r < rows; ++r) {
      double m = 0, var = 0;
      for (int64_t i = 0; i < C; ++i) m += x[r * C + i];
      m /= C;
      for (int64_t i = 0; i < C; ++i) var += (x[r * C + i] - m) * (x[r * C + i] - m);
      var /= C;
      mean[r] = d == Dtype::kF64 ? m : double(float(m));
      rstd[r] = d == Dtype::kF64 ? 1.0 / std::sqrt(var + 1e-5) : double(float(1.0 / std::sqrt(var + 1e-5)));
    }
    encode(d, dy, h_dy); encode(d, x, h_x); encode(d, w, h_w);
    const Dtype stat = d == Dtype::kF64 ? Dtype::kF64 : Dtype::kF32;
    encode(stat, mean, h_mean); encode(stat, rstd, h_rstd);
    ref_dx.assign(rows * C, 0); ref_dw.assign(C, 0); ref_db.assign(C, 0);
    for (int64_t r = 0; r < rows; ++r) {
      double a = 0, b = 0;
      for (int64_t i = 0; i < C; ++i) {
        const double xh = (x[r * C + i] - mean[r]) * rstd[r];
        a += w[i] * dy[r * C + i];
        b += w[i] * dy[r * C + i] * xh;
      }
      a /= C; b /= C;
      for (int64_t i = 0; i < C; ++i) {
        const double xh = (x[r * C + i] - mean[r]) * rstd[r];
        ref_dx[r * C + i] = (w[i] * dy[r * C + i] - a - xh * b) * rstd[r];
        ref_dw[i] += dy[r * C + i] * xh;
        ref_db[i] += dy[r * C + i];
      }
    }
  }
};

struct Outputs { std::vector<unsigned char> dx, dw, db; };

// The kernel with this id in the registry (ffi/registry.h); an unknown id stops the program.
inline const KernelFacts& facts(int kernel) {
  const KernelFacts* k = FindKernel(kernel);
  if (k == nullptr) {
    std::fprintf(stderr, "no kernel %d (ids %d-%d)\n", kernel, MinKernelId(), MaxKernelId());
    std::exit(2);
  }
  return *k;
}

// Device 0's limits, as the registry's refusals take them.
// Device 0's limits as the launchers see them (common/device_limits.h; JAX_LNBWD_TEST_DEVICE_LIMITS
// applies).
inline DeviceLimits device0_limits() {
  DeviceLimits l;
  CHECK_CUDA(device_limits(0, &l));
  return l;
}

inline RefusalLimits device0_refusal_limits() {
  RefusalLimits l;
  CHECK_CUDA(QueryRefusalLimits(0, &l));
  return l;
}

// Whether the registry refuses (kernel, dtype, C, block size) on this GPU: such a case is not run.
inline bool refuses(int kernel, Dtype d, int64_t C, int block_size, const RefusalLimits& device) {
  return !KernelRefusal(facts(kernel), {d, C, block_size}, device).empty();
}

// The launcher of kernel `kernel` (1-12) at its default configuration.
inline cudaError_t launch_kernel(int kernel, const NormBwdParams& p, cudaStream_t stream) {
  if (kernel >= 1 && kernel <= 10) return kLlmcLaunchers[kernel - 1](p, stream);
  if (kernel == 11) return norm_bwd_kernel11(p, stream);
  if (kernel == 12) return norm_bwd_kernel12(p, stream);
  return cudaErrorInvalidValue;
}

// Partial slots in the workspace: the rule of jax_lnbwd/kernels.py (KernelInfo.partial_slots).
inline int64_t workspace_slots(int kernel, int64_t rows, int block_size, int sms) {
  const int64_t row_warps = block_size >= 32 ? (rows + block_size / 32 - 1) / (block_size / 32) : rows;
  switch (kernel) {
    case 5: return std::max<int64_t>(1, std::min<int64_t>(sms, row_warps));
    case 9: case 10: return std::max<int64_t>(1, std::min<int64_t>((1024 / block_size) * sms, row_warps));
    case 11: case 12: return std::max<int64_t>(1, std::min<int64_t>(rows, 4 * sms));
    default: return 1;   // kernels 1-4, 6-8: no slot or one scratch row; the handler wants one
  }
}

// Runs `kernel` (1-12; cfg forces a kernel 11 configuration, cfg12 a kernel 12 one) with
// exact-size buffers. slots > 0 overrides the workspace's partial slots.
inline cudaError_t run(const Problem& pb, int kernel, int block_size, const Kernel11Config* cfg, Outputs* out,
                       int sms, int repeats = 1, const Kernel12Config* cfg12 = nullptr, int64_t slots = 0) {
  const Dtype d = pb.dtype;
  const size_t it = dtype_item_bytes(d), st = dtype_acc_bytes(d);
  DeviceBuf dy(pb.h_dy.size()), x(pb.h_x.size()), w(pb.h_w.size()), mean(pb.h_mean.size()), rstd(pb.h_rstd.size());
  DeviceBuf dx(pb.rows * pb.C * it), dw(pb.C * it), db(pb.C * it);
  if (slots <= 0) slots = workspace_slots(kernel, pb.rows, block_size, sms);
  DeviceBuf ws(kWorkspaceHeaderBytes + slots * 2 * pb.C * st);
  CHECK_CUDA(cudaMemcpy(dy.ptr, pb.h_dy.data(), pb.h_dy.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(x.ptr, pb.h_x.data(), pb.h_x.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(w.ptr, pb.h_w.data(), pb.h_w.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(mean.ptr, pb.h_mean.data(), pb.h_mean.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(rstd.ptr, pb.h_rstd.data(), pb.h_rstd.size(), cudaMemcpyHostToDevice));
  // Poison outputs and workspace (0xFF bytes are NaN in every float dtype): unwritten = wrong.
  CHECK_CUDA(cudaMemset(dx.ptr, 0xFF, dx.bytes)); CHECK_CUDA(cudaMemset(dw.ptr, 0xFF, dw.bytes));
  CHECK_CUDA(cudaMemset(db.ptr, 0xFF, db.bytes)); CHECK_CUDA(cudaMemset(ws.ptr, 0xFF, ws.bytes));
  NormBwdParams p{dx.ptr, dw.ptr, db.ptr, dy.ptr, x.ptr, w.ptr, mean.ptr, rstd.ptr, pb.rows, pb.C, 1, 0, d,
                       block_size, ws.ptr, ws.bytes};
  p.norm = NormKind::kLayerNorm;
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < repeats && err == cudaSuccess; ++i) {
    if (cfg) err = norm_bwd_kernel11_config(p, *cfg, 0);
    else if (cfg12) err = norm_bwd_kernel12_config(p, *cfg12, 0);
    else err = launch_kernel(kernel, p, 0);
  }
  if (err != cudaSuccess) return err;
  CHECK_CUDA(cudaDeviceSynchronize());
  out->dx.resize(dx.bytes); out->dw.resize(dw.bytes); out->db.resize(db.bytes);
  CHECK_CUDA(cudaMemcpy(out->dx.data(), dx.ptr, dx.bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(out->dw.data(), dw.ptr, dw.bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(out->db.data(), db.ptr, db.bytes, cudaMemcpyDeviceToHost));
  return cudaSuccess;
}

inline double rel_err(Dtype d, const std::vector<unsigned char>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = decode(d, got.data(), i);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

