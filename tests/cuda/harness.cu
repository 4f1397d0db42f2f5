// Standalone CUDA harness for the kernels in ffi/kernels/, without JAX or XLA.
//
// Why it exists: XLA's pooled allocator hands kernels slices of one big allocation, so
// compute-sanitizer's memcheck cannot see a kernel write one element past its buffer. Here every
// buffer is its own cudaMalloc of exactly the size the kernel may touch, so the sanitizers
// (memcheck, racecheck, synccheck, initcheck) see every stray access. It also times kernel 11's
// configurations directly (CUDA events), which is how its launch heuristic was tuned.
//
//   harness check [kernel ...]        validate kernels over shapes x dtypes x block sizes vs a CPU
//                                     reference, and the seed launchers' refusals (default: 1-12)
//   harness blocks ROWS C DTYPE [kernel ...]  time seed kernels (default 1-10) at each block size
//   harness sweep ROWS C DTYPE [default]  time every kernel 11 and 12 configuration (or only
//                                     kernel 12's default) and a same-bytes copy, the kernels
//                                     replayed from a CUDA graph (the GPU's time alone)
//   harness host ROWS C DTYPE         the host time of one call of the default launcher
//   harness profile ROWS C DTYPE      three calls of the default launcher, for ncu
//
// Build (tests/cuda/run_sanitizers.sh builds it and runs it under compute-sanitizer):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi/kernels tests/cuda/harness.cu $(find ffi/kernels -name '*.cu')
#include <chrono>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernel11/kernel11.h"
#include "kernel12/kernel12.h"
#include "api.h"

using namespace lnbwd;

#define CHECK_CUDA(expr)                                                                       \
  do {                                                                                         \
    cudaError_t e_ = (expr);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

// An attribute of device 0, the one the harness runs on.
static int device0_attribute(cudaDeviceAttr attr) {
  int v = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&v, attr, 0));
  return v;
}

// Device 0's limits as the launchers see them (api.h; JAX_LNBWD_TEST_DEVICE_LIMITS applies).
static DeviceLimits device0_limits() {
  DeviceLimits l;
  CHECK_CUDA(device_limits(0, &l));
  return l;
}

static size_t item_bytes(Dtype d) { return d == Dtype::kF64 ? 8 : d == Dtype::kF32 ? 4 : 2; }
static size_t acc_bytes(Dtype d) { return d == Dtype::kF64 ? 8 : 4; }
static const char* dtype_name(Dtype d) {
  return d == Dtype::kF64 ? "float64" : d == Dtype::kF32 ? "float32" : d == Dtype::kBF16 ? "bfloat16" : "float16";
}
// jax's names (float32) or the short ones (f32, bf16); anything else stops the harness, so that
// a typo is never measured as another dtype.
static Dtype parse_dtype(const std::string& s) {
  if (s == "float64" || s == "f64") return Dtype::kF64;
  if (s == "float32" || s == "f32") return Dtype::kF32;
  if (s == "bfloat16" || s == "bf16") return Dtype::kBF16;
  if (s == "float16" || s == "f16") return Dtype::kF16;
  std::fprintf(stderr, "harness: unknown dtype '%s' (float64, float32, bfloat16, float16)\n", s.c_str());
  std::exit(2);
}

// Host values are doubles; these store them in the device dtype and read them back.
static void encode(Dtype d, const std::vector<double>& v, std::vector<unsigned char>& out) {
  out.resize(v.size() * item_bytes(d));
  for (size_t i = 0; i < v.size(); ++i) {
    switch (d) {
      case Dtype::kF64: reinterpret_cast<double*>(out.data())[i] = v[i]; break;
      case Dtype::kF32: reinterpret_cast<float*>(out.data())[i] = float(v[i]); break;
      case Dtype::kBF16: reinterpret_cast<__nv_bfloat16*>(out.data())[i] = __float2bfloat16(float(v[i])); break;
      case Dtype::kF16: reinterpret_cast<__half*>(out.data())[i] = __float2half(float(v[i])); break;
    }
  }
}
static double decode(Dtype d, const unsigned char* p, size_t i) {
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

// Seed kernels 1-9 go through kLlmcKernels (layernorm_bwd.h); kernel 10, also in that table,
// has its own block sizes and refusal rule here (KERNELS[10] in jax_lnbwd/kernels.py).
static bool is_seed(int kernel) { return kernel >= 1 && kernel <= 9; }

// Partial slots in the workspace: the rule of jax_lnbwd/kernels.py (KernelInfo.partial_slots).
static int64_t workspace_slots(int kernel, int64_t rows, int block_size, int sms) {
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
static cudaError_t run(const Problem& pb, int kernel, int block_size, const Kernel11Config* cfg, Outputs* out,
                       int sms, int repeats = 1, const Kernel12Config* cfg12 = nullptr, int64_t slots = 0) {
  const Dtype d = pb.dtype;
  const size_t it = item_bytes(d), st = acc_bytes(d);
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
  LayernormBwdParams p{dx.ptr, dw.ptr, db.ptr, dy.ptr, x.ptr, w.ptr, mean.ptr, rstd.ptr, pb.rows, pb.C, 1, 0, d,
                       block_size, ws.ptr, ws.bytes};
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < repeats && err == cudaSuccess; ++i) {
    if (is_seed(kernel)) err = kLlmcKernels[kernel - 1].launch(p, 0);
    else if (kernel == 10) err = layernorm_bwd_kernel10(p, 0);
    else if (cfg) err = layernorm_bwd_kernel11_config(p, *cfg, 0);
    else if (cfg12) err = layernorm_bwd_kernel12_config(p, *cfg12, 0);
    else if (kernel == 12) err = layernorm_bwd_kernel12(p, 0);
    else err = layernorm_bwd_kernel11(p, 0);
  }
  if (err != cudaSuccess) return err;
  CHECK_CUDA(cudaDeviceSynchronize());
  out->dx.resize(dx.bytes); out->dw.resize(dw.bytes); out->db.resize(db.bytes);
  CHECK_CUDA(cudaMemcpy(out->dx.data(), dx.ptr, dx.bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(out->dw.data(), dw.ptr, dw.bytes, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(out->db.data(), db.ptr, db.bytes, cudaMemcpyDeviceToHost));
  return cudaSuccess;
}

static double rel_err(Dtype d, const std::vector<unsigned char>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = decode(d, got.data(), i);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// What `check` runs for each kernel, mirroring jax_lnbwd/kernels.py: its block sizes, whether
// it takes a dtype, whether it refuses a C (KernelInfo.refuse), and its flags.
static std::vector<int> block_sizes_of(int kernel) {
  if (is_seed(kernel)) {
    std::vector<int> out;
    const LlmcKernelLimits l = kLlmcKernels[kernel - 1].limits(Dtype::kF32, 1, 0);
    for (int bs = 32; bs <= l.max_block_size; bs *= 2) out.push_back(bs);
    return out;
  }
  if (kernel == 10) return {32, 64, 128, 256, 512};   // KERNELS[10].block_sizes
  return {0};
}
static bool takes_dtype(int kernel, Dtype d) {
  return is_seed(kernel) ? kLlmcKernels[kernel - 1].limits(d, 1, 0).dtype_ok : true;
}
static bool refuses(int kernel, Dtype d, int64_t C, int block_size, int max_smem) {
  if (is_seed(kernel)) {
    const LlmcKernelLimits l = kLlmcKernels[kernel - 1].limits(d, C, block_size);
    return C % l.c_multiple != 0 || l.smem_bytes > size_t(max_smem);
  }
  return kernel == 10 && layernorm_bwd_kernel10_limits(d, C, block_size).smem_bytes > size_t(max_smem);
}
static bool deterministic(int kernel) { return kernel >= 9; }
static bool precise(int kernel) { return kernel != 3 && kernel != 4; }
// Kernels whose grid shrinks to the partial slots the workspace has.
static bool grid_fits_slots(int kernel) { return kernel == 5 || kernel == 9 || kernel == 10; }

// Norm-wise relative error allowed against the float64 reference. dx is always computed in
// fp32 and rounded once; an imprecise kernel (bf16/f16 atomics) gets more room for dweight/dbias.
static double tolerance(Dtype d, bool precise_sums) {
  switch (d) {
    case Dtype::kF64: return 1e-12;
    case Dtype::kF32: return 1e-5;
    // Kernels 3 and 4 add dweight/dbias with 16-bit atomics: every partial sum is rounded, in
    // an order set by the scheduler. At C = 1 the single dbias is 4225 rows summed that way, and
    // relative errors of 0.21 (bf16) and 0.031 (fp16) were seen under synccheck's scheduling.
    case Dtype::kBF16: return precise_sums ? 2e-2 : 5e-1;
    case Dtype::kF16: return precise_sums ? 3e-3 : 1e-1;
  }
  return 0;
}

// The seed launchers must refuse (return an error, launch nothing) what they cannot do.
static int check_refusals(const std::vector<int>& kernels, int* checked) {
  int failures = 0;
  auto expect = [&](int kernel, Dtype d, int64_t C, int block_size, int64_t segments, cudaError_t want,
                    const char* what) {
    const int64_t rows = 2 * segments;
    const size_t it = item_bytes(d);
    DeviceBuf dy(rows * C * it), x(rows * C * it), dx(rows * C * it), w(C * it), dw(segments * C * it),
        db(segments * C * it), mean(rows * 4), rstd(rows * 4), ws(kWorkspaceHeaderBytes + rows * 2 * C * 4);
    LayernormBwdParams p{dx.ptr, dw.ptr, db.ptr, dy.ptr, x.ptr, w.ptr, mean.ptr, rstd.ptr, rows, C, segments, 0, d,
                         block_size, ws.ptr, ws.bytes};
    const cudaError_t got = kLlmcKernels[kernel - 1].launch(p, 0);
    CHECK_CUDA(cudaDeviceSynchronize());
    ++*checked;
    if (got != want) {
      ++failures;
      std::printf("FAIL kernel %d %s: %s returned %s, expected %s\n", kernel, dtype_name(d), what,
                  cudaGetErrorName(got), cudaGetErrorName(want));
    }
  };
  for (int kernel : kernels) {
    if (!is_seed(kernel)) continue;
    for (Dtype d : {Dtype::kF32, Dtype::kBF16, Dtype::kF16, Dtype::kF64}) {
      if (!takes_dtype(kernel, d)) expect(kernel, d, 768, 0, 1, cudaErrorInvalidValue, "an unsupported dtype");
    }
    const Dtype d = takes_dtype(kernel, Dtype::kF32) ? Dtype::kF32 : Dtype::kBF16;
    expect(kernel, d, 768, 48, 1, cudaErrorInvalidConfiguration, "block_size 48");
    expect(kernel, d, 768, 16, 1, cudaErrorInvalidConfiguration, "block_size 16");
    expect(kernel, d, 768, 2048, 1, cudaErrorInvalidConfiguration, "block_size 2048");
    expect(kernel, d, 768, 0, 2, cudaErrorInvalidValue, "2 segments");
    if (kernel >= 2) expect(kernel, d, 40000, 0, 1, cudaErrorInvalidConfiguration, "C=40000 (shared memory)");
    if (kernel >= 8) expect(kernel, d, 1600, 0, 1, cudaErrorInvalidConfiguration, "C=1600 (not whole x128 steps)");
  }
  return failures;
}

static int check(const std::vector<int>& kernels) {
  const int sms = device0_attribute(cudaDevAttrMultiProcessorCount);
  const int max_smem = device0_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  // LNBWD_QUICK=1 (for the sanitizers, which run kernels 10-100x slower) keeps the shapes that
  // exercise every code path: misaligned and aligned C, a row count past the grid's warps.
  const bool quick = std::getenv("LNBWD_QUICK") != nullptr;
  // Kernel 12 splits rows over clusters of two blocks from 4096 columns in 16-bit types and from
  // 12288 in fp32, and every configuration is checked at every C (split or not); 32768 is the
  // widest 16-bit row it splits. 12292 (a multiple of 4, not of 8) takes its wide-row path in
  // fp32, whose rows that wide do not split.
  const std::vector<int64_t> cs = quick ? std::vector<int64_t>{1, 3, 40, 768, 1601, 4096, 12292, 16384, 30000}
                                        : std::vector<int64_t>{1, 3, 8, 40, 768, 1600, 1601, 4096, 8192, 12288,
                                                               12292, 16384, 30000, 32768};
  // 1 and 7 rows, and one row more than the 32 * SMs warps of the seed's persistent grids (the
  // grid of kernels 3-4 and 6-10, and of kernel 5 at 1024 threads): one warp takes a second row
  // while all others have none, which is what broke the barriers of the seed's kernels 9 and 10.
  // 2 * SMs + 1 rows: a block of kernel 12 with one group (its wide path, or rows of 16384)
  // takes a third row.
  const std::vector<int64_t> rs = quick ? std::vector<int64_t>{7, 2 * int64_t(sms) + 1, 32 * int64_t(sms) + 1}
                                        : std::vector<int64_t>{1, 7, 2 * int64_t(sms) + 1, 32 * int64_t(sms) + 1};
  // Keep the CPU reference quick; under the sanitizers (quick), keep each launch small too (the
  // many-rows case still runs for every C up to 1601). racecheck, the slowest tool on kernels
  // with many shared-memory accesses, can lower the bound with LNBWD_QUICK_MAX_ELEMENTS.
  const char* max_env = std::getenv("LNBWD_QUICK_MAX_ELEMENTS");
  const int64_t max_elements = !quick ? 20'000'000 : max_env ? std::atoll(max_env) : 8'000'000;
  const Dtype ds[] = {Dtype::kF32, Dtype::kBF16, Dtype::kF16, Dtype::kF64};
  int failures = 0, checked = 0;
  failures += check_refusals(kernels, &checked);
  struct Worst { double dx = 0, dw = 0, db = 0; int cases = 0; };
  std::vector<std::vector<Worst>> worst(13, std::vector<Worst>(4));
  for (Dtype d : ds) {
    for (int64_t C : cs) {
      for (int64_t rows : rs) {
        if (rows * C > max_elements) continue;
        std::unique_ptr<Problem> pb;           // made when a kernel first needs it
        for (int kernel : kernels) {
          if (!takes_dtype(kernel, d)) continue;
          std::vector<int> sizes = block_sizes_of(kernel);
          if (quick && sizes.size() > 2) sizes = {sizes.front(), sizes.back()};
          for (int bs : sizes) {
            if (refuses(kernel, d, C, bs, max_smem)) continue;
            if (!pb) pb = std::make_unique<Problem>(d, rows, C, unsigned(rows * 131 + C));
            // The default workspace, and (for a kernel that fits its grid to the workspace, at
            // the most rows) a workspace of a single slot: the grid must shrink, not overrun.
            const bool tight = grid_fits_slots(kernel) && rows == rs.back() && bs == sizes.back();
            // Kernel 12: its default, then every configuration it can pick from (each one is
            // reachable from the default on some C).
            const std::vector<Kernel12Config> k12 = kernel == 12 ? kernel12_candidates(d, C, device0_limits()) : std::vector<Kernel12Config>{};
            for (int v = -1; v < int(k12.size()); ++v)
            for (int64_t slots : {int64_t(0), int64_t(1)}) {
              if (slots == 1 && (!tight || v >= 0)) continue;
              const Kernel12Config* c12 = v < 0 ? nullptr : &k12[v];
              Outputs a, b;
              cudaError_t err = run(*pb, kernel, bs, nullptr, &a, sms, 1, c12, slots);
              bool same = true;
              if (err == cudaSuccess && deterministic(kernel)) {
                err = run(*pb, kernel, bs, nullptr, &b, sms, 1, c12, slots);
                same = err == cudaSuccess && a.dx == b.dx && a.dw == b.dw && a.db == b.db;
              }
              const double ex = err ? INFINITY : rel_err(d, a.dx, pb->ref_dx);
              const double ew = err ? INFINITY : rel_err(d, a.dw, pb->ref_dw);
              const double eb = err ? INFINITY : rel_err(d, a.db, pb->ref_db);
              const double tx = tolerance(d, true), tp = tolerance(d, precise(kernel));
              const bool ok = err == cudaSuccess && same && ex <= tx && ew <= tp && eb <= tp;
              Worst& wst = worst[kernel][int(d)];
              wst.dx = std::max(wst.dx, ex); wst.dw = std::max(wst.dw, ew); wst.db = std::max(wst.db, eb);
              ++wst.cases;
              ++checked;
              if (!ok) {
                ++failures;
                std::printf("FAIL kernel %d %s rows=%lld C=%lld block_size=%d%s%s: %s dx %.2e dw %.2e db %.2e%s\n",
                            kernel, dtype_name(d), (long long)rows, (long long)C, bs, slots ? " (1 slot)" : "",
                            c12 ? (" config nb=" + std::to_string(c12->nb) + (c12->raw_weight ? " raw weight" : "") +
                                   (c12->split > 1 ? " split" : "")).c_str()
                                : "",
                            cudaGetErrorString(err), ex, ew, eb, same ? "" : " NOT deterministic");
              }
            }
          }
        }
      }
    }
  }
  // The worst error seen per kernel and dtype, to size tolerances (imprecise kernels above all).
  for (int kernel : kernels) {
    for (Dtype d : ds) {
      const Worst& w = worst[kernel][int(d)];
      if (w.cases) {
        std::printf("kernel %2d %-8s %4d cases, worst rel err dx %.1e dweight %.1e dbias %.1e\n", kernel,
                    dtype_name(d), w.cases, w.dx, w.dw, w.db);
      }
    }
  }
  std::printf("harness check: %d cases, %d failures\n", checked, failures);
  return failures ? 1 : 0;
}

// Times kernels 1-10 at each of their block sizes (median of 15 runs, CUDA events), on random
// data: what the seed's own benchmark loop did, to pick each kernel's default block size.
static int blocks(int64_t rows, int64_t C, Dtype d, const std::vector<int>& kernels) {
  const int sms = device0_attribute(cudaDevAttrMultiProcessorCount);
  const int max_smem = device0_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const size_t it = item_bytes(d), st = acc_bytes(d);
  const double bytes = double(3 * rows * C + 3 * C) * it + 2.0 * rows * st;
  Problem pb(d, rows, C, 5);
  DeviceBuf dy(pb.h_dy.size()), x(pb.h_x.size()), dx(rows * C * it), w(C * it), dw(C * it), db(C * it),
      mean(rows * st), rstd(rows * st), ws(kWorkspaceHeaderBytes + 32 * int64_t(sms) * 2 * C * st);
  CHECK_CUDA(cudaMemcpy(dy.ptr, pb.h_dy.data(), pb.h_dy.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(x.ptr, pb.h_x.data(), pb.h_x.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(w.ptr, pb.h_w.data(), pb.h_w.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(mean.ptr, pb.h_mean.data(), pb.h_mean.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(rstd.ptr, pb.h_rstd.data(), pb.h_rstd.size(), cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0)); CHECK_CUDA(cudaEventCreate(&e1));
  std::printf("%s %lldx%lld (%.0f MB)\n", dtype_name(d), (long long)rows, (long long)C, bytes / 1e6);
  for (int kernel : kernels) {
    if (!takes_dtype(kernel, d)) continue;
    for (int bs : block_sizes_of(kernel)) {
      if (refuses(kernel, d, C, bs, max_smem)) continue;
      LayernormBwdParams p{dx.ptr, dw.ptr, db.ptr, dy.ptr, x.ptr, w.ptr, mean.ptr, rstd.ptr, rows, C, 1, 0, d, bs,
                           ws.ptr, ws.bytes};
      auto launch = [&] { return is_seed(kernel) ? kLlmcKernels[kernel - 1].launch(p, 0) : layernorm_bwd_kernel10(p, 0); };
      cudaError_t err = launch();
      std::vector<float> ms;
      for (int i = 0; i < 15 && err == cudaSuccess; ++i) {
        CHECK_CUDA(cudaEventRecord(e0));
        err = launch();
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float t = 0;
        CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      if (err != cudaSuccess) {
        std::printf("  kernel %2d block_size %4d: %s\n", kernel, bs, cudaGetErrorString(err));
        continue;
      }
      std::sort(ms.begin(), ms.end());
      const double us = ms[ms.size() / 2] * 1e3;
      std::printf("  kernel %2d block_size %4d: %9.1f us %6.0f GB/s\n", kernel, bs, us, bytes / us / 1e3);
    }
  }
  return 0;
}

// The buffers and parameters of one full-size problem, every input byte 0x3c: what profile and
// host run as they are (the values don't matter there), and sweep after filling the inputs with
// random values.
struct FilledProblem {
  DeviceBuf dy, x, dx, w, dw, db, mean, rstd, ws;
  LayernormBwdParams p;
  FilledProblem(int64_t rows, int64_t C, Dtype d, int sms)
      : dy(rows * C * item_bytes(d)), x(rows * C * item_bytes(d)), dx(rows * C * item_bytes(d)), w(C * item_bytes(d)),
        dw(C * item_bytes(d)), db(C * item_bytes(d)), mean(rows * acc_bytes(d)), rstd(rows * acc_bytes(d)),
        ws(kWorkspaceHeaderBytes + std::min<int64_t>(rows, 4 * sms) * 2 * C * acc_bytes(d)),
        p{dx.ptr, dw.ptr, db.ptr, dy.ptr, x.ptr, w.ptr, mean.ptr, rstd.ptr, rows, C, 1, 0, d, 0, ws.ptr, ws.bytes} {
    for (DeviceBuf* b : {&dy, &x, &w, &mean, &rstd}) CHECK_CUDA(cudaMemset(b->ptr, 0x3c, b->bytes));
  }
};

// Runs the default kernel 12 launcher a few times on a big problem (for ncu).
static int profile(int64_t rows, int64_t C, Dtype d) {
  FilledProblem f(rows, C, d, device0_attribute(cudaDevAttrMultiProcessorCount));
  for (int i = 0; i < 3; ++i) CHECK_CUDA(layernorm_bwd_kernel12(f.p, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  return 0;
}

// Host time of one call of the default kernel 12 launcher (enqueueing only, the GPU runs behind):
// the median over 10 rounds of 200 calls each, the stream drained between rounds.
static int host(int64_t rows, int64_t C, Dtype d) {
  FilledProblem f(rows, C, d, device0_attribute(cudaDevAttrMultiProcessorCount));
  CHECK_CUDA(layernorm_bwd_kernel12(f.p, 0));
  std::vector<double> us;
  for (int round = 0; round < 10; ++round) {
    CHECK_CUDA(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) CHECK_CUDA(layernorm_bwd_kernel12(f.p, 0));
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::sort(us.begin(), us.end());
  std::printf("%s %lldx%lld: %.2f us of host time per call\n", dtype_name(d), (long long)rows, (long long)C, us[us.size() / 2]);
  return 0;
}

// Times every kernel 11 and kernel 12 configuration that fits, or only kernel 12's default.
static int sweep(int64_t rows, int64_t C, Dtype d, bool default_only) {
  const int sms = device0_attribute(cudaDevAttrMultiProcessorCount);
  const size_t it = item_bytes(d);
  const double bytes = double(3 * rows * C + 3 * C) * it + 2.0 * rows * acc_bytes(d);
  // Ceiling: a device-to-device copy moving the same bytes (half read, half written).
  DeviceBuf a(size_t(bytes / 2)), b(size_t(bytes / 2));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0)); CHECK_CUDA(cudaEventCreate(&e1));
  // Median over 15 samples of 10 back-to-back calls, each call's time the sample's over 10. The
  // kernels' calls are replayed from a CUDA graph, as under XLA's command buffers: launched one
  // by one, a call whose kernel is shorter than the host's launch work times the host (about 5
  // us a call on the H200, where a 1024x768 backward takes 7). The copy is launched one by one:
  // in a graph it becomes a copy-engine node, slower than the copy kernel the driver launches
  // outside one (16384x1600 bf16 on the H200: 59.7 against 42 us).
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto time_it = [&](auto&& fn, bool in_graph = true) {
    constexpr int kCalls = 10;
    fn(stream);   // warm-up; the launchers' first call asks the driver about their kernel
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaGraphExec_t exec = nullptr;
    if (in_graph) {
      cudaGraph_t graph;
      CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
      for (int c = 0; c < kCalls; ++c) fn(stream);
      CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
      CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      CHECK_CUDA(cudaGraphDestroy(graph));
      CHECK_CUDA(cudaGraphLaunch(exec, stream));   // the first replay uploads the graph
    }
    std::vector<float> ms;
    for (int i = 0; i < 15; ++i) {
      CHECK_CUDA(cudaEventRecord(e0, stream));
      if (in_graph) {
        CHECK_CUDA(cudaGraphLaunch(exec, stream));
      } else {
        for (int c = 0; c < kCalls; ++c) fn(stream);
      }
      CHECK_CUDA(cudaEventRecord(e1, stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t / kCalls);
    }
    if (exec) CHECK_CUDA(cudaGraphExecDestroy(exec));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3;   // median, microseconds
  };
  const double copy_us = time_it([&](cudaStream_t st) { CHECK_CUDA(cudaMemcpyAsync(b.ptr, a.ptr, a.bytes, cudaMemcpyDeviceToDevice, st)); },
                                false);
  std::printf("%s %lldx%lld: copy %.1f us (%.0f GB/s)\n", dtype_name(d), (long long)rows, (long long)C, copy_us,
              bytes / copy_us / 1e3);

  // Device buffers for the kernel, filled like a real call: dy and x independent standard
  // normals, weight 1 + 0.1 N(0, 1), mean 0 and rstd 1 (x's own statistics, near enough). With
  // the earlier fill (the same data in dy and x, zeros elsewhere, so dx was all zeros) the sweep
  // ran up to 10% faster than the bench on the same configuration (bf16 8192x8192: 117.5
  // against 130.1 us); how much of that the fill explains is still to be measured.
  Problem pb(d, std::min<int64_t>(rows, 64), C, 1);   // small reference problem, for a correctness spot check
  std::mt19937 gen(3);
  std::normal_distribution<double> n(0, 1);
  auto upload = [&](DeviceBuf& buf, Dtype as, auto&& value, size_t count) {
    std::vector<double> v(count);
    for (auto& e : v) e = value();
    std::vector<unsigned char> h;
    encode(as, v, h);
    CHECK_CUDA(cudaMemcpy(buf.ptr, h.data(), h.size(), cudaMemcpyHostToDevice));
  };
  const Dtype stat = d == Dtype::kF64 ? Dtype::kF64 : Dtype::kF32;   // mean and rstd are acc_t
  FilledProblem f(rows, C, d, sms);
  upload(f.dy, d, [&] { return n(gen); }, rows * C);
  upload(f.x, d, [&] { return n(gen); }, rows * C);
  upload(f.w, d, [&] { return 1 + 0.1 * n(gen); }, C);
  upload(f.mean, stat, [] { return 0.0; }, rows);
  upload(f.rstd, stat, [] { return 1.0; }, rows);
  const LayernormBwdParams& p = f.p;
  Kernel11Config picked;
  const bool has_pick = kernel11_pick(d, C, C % (16 / it) == 0, device0_limits(), &picked);
  std::vector<Kernel11Config> cfgs;
  if (!default_only) cfgs = kernel11_candidates(d, C, C % (16 / it) == 0, device0_limits());
  for (const Kernel11Config& c : cfgs) {
    Outputs o;
    const cudaError_t err = run(pb, 11, 0, &c, &o, sms);
    const double e = err ? INFINITY : rel_err(d, o.dx, pb.ref_dx);
    const double us = time_it([&](cudaStream_t st) { CHECK_CUDA(layernorm_bwd_kernel11_config(p, c, st)); });
    const bool is_pick = has_pick && c.nv == picked.nv && c.prefetch == picked.prefetch && c.tpr == picked.tpr;
    std::printf("  vec=%d nv=%d prefetch=%d tpr=%4d groups=%2d: %8.1f us %6.0f GB/s %5.1f%% of copy  dx err %.1e%s\n",
                c.vec, c.nv, int(c.prefetch), c.tpr, c.groups, us, bytes / us / 1e3, 100 * copy_us / us, e,
                is_pick ? "  <- default" : "");
  }
  if (!has_pick && !default_only) {
    const double us = time_it([&](cudaStream_t st) { CHECK_CUDA(layernorm_bwd_kernel11_wide(p, st)); });
    std::printf("  k11 wide path: %8.1f us %6.0f GB/s %5.1f%% of copy\n", us, bytes / us / 1e3, 100 * copy_us / us);
  }
  if (kernel12_wide_fits(d, C, device0_limits()) && !default_only) {
    const double us = time_it([&](cudaStream_t st) { CHECK_CUDA(layernorm_bwd_kernel12_wide(p, st)); });
    std::printf("  k12 wide path: %8.1f us %6.0f GB/s %5.1f%% of copy\n", us, bytes / us / 1e3, 100 * copy_us / us);
  }
  Kernel12Config pick12;
  const bool has12 = kernel12_pick(d, C, device0_limits(), &pick12);
  for (const Kernel12Config& c : kernel12_candidates(d, C, device0_limits())) {
    const bool is_pick = has12 && c.nv == pick12.nv && c.nb == pick12.nb && c.tpr == pick12.tpr &&
                         c.groups == pick12.groups && c.raw_weight == pick12.raw_weight && c.split == pick12.split;
    if (default_only && !is_pick) continue;
    Outputs o;
    const cudaError_t err = run(pb, 12, 0, nullptr, &o, sms, 1, &c);
    const double e = err ? INFINITY : rel_err(d, o.dx, pb.ref_dx);
    const double us = time_it([&](cudaStream_t st) { CHECK_CUDA(layernorm_bwd_kernel12_config(p, c, st)); });
    std::printf("  k12 split=%d regs=%d raw_w=%d nv=%d nb=%d tpr=%4d groups=%2d: %8.1f us %6.0f GB/s %5.1f%% of copy  dx err %.1e%s\n",
                c.split, int(c.regs), int(c.raw_weight), c.nv, c.nb, c.tpr, c.groups, us, bytes / us / 1e3, 100 * copy_us / us, e,
                is_pick ? "  <- default" : "");
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  if (mode == "sweep" && (argc == 5 || (argc == 6 && std::string(argv[5]) == "default"))) {
    return sweep(std::atoll(argv[2]), std::atoll(argv[3]), parse_dtype(argv[4]), argc == 6);
  }
  if (mode == "host" && argc >= 5) return host(std::atoll(argv[2]), std::atoll(argv[3]), parse_dtype(argv[4]));
  if (mode == "profile" && argc >= 5) return profile(std::atoll(argv[2]), std::atoll(argv[3]), parse_dtype(argv[4]));
  if (mode == "check") {
    std::vector<int> kernels;
    for (int i = 2; i < argc; ++i) kernels.push_back(std::atoi(argv[i]));
    if (kernels.empty()) kernels = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    for (int k : kernels) {
      if (k < 1 || k > 12) {
        std::fprintf(stderr, "harness check: no kernel %d (ids 1-12)\n", k);
        return 2;
      }
    }
    return check(kernels);
  }
  if (mode == "blocks" && argc >= 5) {
    std::vector<int> kernels;
    for (int i = 5; i < argc; ++i) kernels.push_back(std::atoi(argv[i]));
    if (kernels.empty()) kernels = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    for (int k : kernels) {
      if (k < 1 || k > 10) {
        std::fprintf(stderr, "harness blocks: kernel ids 1-10 only, got %d\n", k);
        return 2;
      }
    }
    return blocks(std::atoll(argv[2]), std::atoll(argv[3]), parse_dtype(argv[4]), kernels);
  }
  std::fprintf(stderr,
               "usage: harness check [kernel ...] | harness blocks ROWS C DTYPE [kernel ...] | "
               "harness sweep ROWS C DTYPE [default] | harness host ROWS C DTYPE | harness profile ROWS C DTYPE\n");
  return 2;
}
