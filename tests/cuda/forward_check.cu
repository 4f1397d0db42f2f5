// Standalone check of the fused forward (ffi/kernels/forward/), without JAX or XLA.
//
// Why it exists: XLA's pooled allocator hands kernels slices of one big allocation, so
// compute-sanitizer's memcheck cannot see a kernel touch one element past its buffer. Here every
// buffer is its own cudaMalloc of exactly the bytes the kernel may touch (a misaligned case
// starts one element into its allocation and ends at its end), so memcheck, racecheck,
// synccheck and initcheck see every stray access, race and unwritten output.
//
//   forward_check [check]                every path (registers at each feasible row-group size,
//                                        shared memory, global memory) x dtypes x parameter
//                                        kinds x shapes, plain and with a residual (add_layernorm's
//                                        variant: s = x + residual must match the CPU's rounded
//                                        sum bit for bit; and with x's own bias, s = (x + x_bias)
//                                        + residual in the accumulator type), against a CPU
//                                        reference in double
//
// The buffers are cuda_harness/forward_buffers.cuh's (the forward's configuration sweep,
// tools/tune/forward_tune.cu, uses them too).
//
// Build and run (tests/cuda/run_forward_sanitizers.sh builds it so and runs it under the sanitizers):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi/kernels -Icuda_harness tests/cuda/forward_check.cu \
//        ffi/kernels/forward/*.cu ffi/kernels/common/occupancy.cu ffi/kernels/common/device_limits.cu -o /tmp/forward_check
//   /tmp/forward_check check
//   for t in memcheck racecheck synccheck initcheck; do
//     compute-sanitizer --tool $t --error-exitcode 1 /tmp/forward_check check; done

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "forward_buffers.cuh"

struct Case {
  int64_t rows, C;
  Dtype dtype, param_dtype;
  int64_t weight_rows, bias_rows;   // 0 absent, 1 shared, S per segment
  bool misaligned;                  // x, y (and residual, s) one element into their allocations: scalar path
  FwdPath path;
  int tpr;
  bool residual;                    // the residual variant: y is the layernorm of s = x + residual
  int64_t x_bias_rows = 0;          // the residual variant only: x's own bias, 0 absent, 1 shared, S per segment
  int64_t max_blocks = 0;           // > 0: a grid of at most this many blocks, which then stride over rows
};

// s as the kernels form it: (x + x_bias) + residual with each add in the accumulator type (fp32,
// or fp64 for fp64 data), then rounded once to the dtype by store(). Without x_bias, x + residual.
static double expected_sum(Dtype d, double x, double xb, double r, bool has_xb) {
  if (d == Dtype::kF64) return has_xb ? (x + xb) + r : x + r;
  if (!has_xb) return x + r;   // exact in double; store() rounds it once (twice for 16-bit: harmless)
  const float t = static_cast<float>(static_cast<double>(static_cast<float>(x)) + static_cast<float>(xb));
  return static_cast<float>(static_cast<double>(t) + static_cast<float>(r));
}

// Norm-wise relative error sqrt(sum (a-b)^2 / sum b^2) (absolute when b is all zero).
static double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (std::isnan(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Runs one case; returns 0 on success, 1 on a wrong value (printed), -1 when the forced
// configuration does not apply to this shape (not counted).
static int run_case(const Case& c, std::mt19937_64& rng) {
  NormFwdParams p = {};
  p.norm = NormKind::kLayerNorm;
  p.rows = c.rows;
  p.C = c.C;
  p.dtype = c.dtype;
  p.param_dtype = c.param_dtype;
  p.weight_rows = c.weight_rows;
  p.bias_rows = c.bias_rows;
  p.eps = 1e-5;
  p.path = c.path;
  p.tpr = c.tpr;
  p.max_blocks = c.max_blocks;
  const size_t n = static_cast<size_t>(c.rows * c.C), item = item_bytes(c.dtype), pitem = item_bytes(c.param_dtype);
  const size_t lead = c.misaligned ? item : 0;
  DeviceBuffer x(n * item, lead), y(n * item, lead), mean(c.rows * stat_bytes(c.dtype)), rstd(c.rows * stat_bytes(c.dtype));
  DeviceBuffer w(c.weight_rows * c.C * pitem), b(c.bias_rows * c.C * pitem);
  DeviceBuffer res(c.residual ? n * item : 0, lead), sum(c.residual ? n * item : 0, lead);
  DeviceBuffer xbias(c.x_bias_rows * c.C * pitem);
  p.x_bias = c.x_bias_rows > 0 ? xbias.ptr : nullptr;
  p.x_bias_rows = c.x_bias_rows;
  p.x = x.ptr;
  p.y = y.ptr;
  p.residual = c.residual ? res.ptr : nullptr;
  p.s = c.residual ? sum.ptr : nullptr;
  p.mean = mean.ptr;
  p.rstd = rstd.ptr;
  p.weight = c.weight_rows > 0 ? w.ptr : nullptr;
  p.bias = c.bias_rows > 0 ? b.ptr : nullptr;
  NormFwdConfig cfg;
  if (c.rows > 0 && norm_fwd_pick(p, &cfg) != cudaSuccess) return -1;

  // Inputs: rows with an offset (|mean| a few times std) so a non-centered variance would show.
  std::normal_distribution<double> normal;
  std::vector<unsigned char> hx(n * item), hw(c.weight_rows * c.C * pitem), hb(c.bias_rows * c.C * pitem);
  for (size_t i = 0; i < n; ++i) store(c.dtype, hx.data(), i, 3.0 + normal(rng));
  // The residual variant: a residual of x's size, so the sums round; the expected s is the exact
  // sum rounded once to the dtype (via float for 16-bit: rounding twice changes nothing there),
  // and the reference below normalizes it.
  std::vector<unsigned char> hr_in(c.residual ? n * item : 0), hs_want(c.residual ? n * item : 0);
  std::vector<unsigned char> hxb(c.x_bias_rows * c.C * pitem);
  for (size_t i = 0; i < static_cast<size_t>(c.x_bias_rows * c.C); ++i) store(c.param_dtype, hxb.data(), i, normal(rng));
  for (size_t i = 0; c.residual && i < n; ++i) {
    store(c.dtype, hr_in.data(), i, normal(rng));
    const int64_t row = static_cast<int64_t>(i) / c.C, col = static_cast<int64_t>(i) % c.C;
    const double xb = c.x_bias_rows > 0 ? load(c.param_dtype, hxb.data(), (row / (c.rows / c.x_bias_rows)) * c.C + col) : 0;
    store(c.dtype, hs_want.data(), i,
          expected_sum(c.dtype, load(c.dtype, hx.data(), i), xb, load(c.dtype, hr_in.data(), i), c.x_bias_rows > 0));
  }
  if (c.residual) CHECK_CUDA(cudaMemcpy(res.ptr, hr_in.data(), hr_in.size(), cudaMemcpyHostToDevice));
  if (!hxb.empty()) CHECK_CUDA(cudaMemcpy(xbias.ptr, hxb.data(), hxb.size(), cudaMemcpyHostToDevice));
  const std::vector<unsigned char>& hrow = c.residual ? hs_want : hx;   // the rows normalized
  for (size_t i = 0; i < static_cast<size_t>(c.weight_rows * c.C); ++i) store(c.param_dtype, hw.data(), i, 1 + 0.1 * normal(rng));
  for (size_t i = 0; i < static_cast<size_t>(c.bias_rows * c.C); ++i) store(c.param_dtype, hb.data(), i, normal(rng));
  CHECK_CUDA(cudaMemcpy(x.ptr, hx.data(), hx.size(), cudaMemcpyHostToDevice));
  if (!hw.empty()) CHECK_CUDA(cudaMemcpy(w.ptr, hw.data(), hw.size(), cudaMemcpyHostToDevice));
  if (!hb.empty()) CHECK_CUDA(cudaMemcpy(b.ptr, hb.data(), hb.size(), cudaMemcpyHostToDevice));
  cudaError_t err = norm_fwd(p, 0);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  char label[256];
  std::snprintf(label, sizeof(label), "%lldx%lld %s params %s w%lld b%lld %s%s%s xb%lld tpr %d", (long long)c.rows,
                (long long)c.C, dtype_name(c.dtype), dtype_name(c.param_dtype), (long long)c.weight_rows,
                (long long)c.bias_rows, path_name(c.path), c.misaligned ? " misaligned" : "",
                c.residual ? " residual" : "", (long long)c.x_bias_rows, c.rows > 0 ? cfg.tpr : 0);
  if (c.max_blocks > 0) std::snprintf(label + std::strlen(label), sizeof(label) - std::strlen(label), " blocks %u", cfg.blocks);
  if (err != cudaSuccess) {
    std::printf("FAIL %s: %s\n", label, cudaGetErrorString(err));
    return 1;
  }
  std::vector<unsigned char> hy(n * item), hm(c.rows * stat_bytes(c.dtype)), hr(c.rows * stat_bytes(c.dtype));
  CHECK_CUDA(cudaMemcpy(hy.data(), y.ptr, hy.size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hm.data(), mean.ptr, hm.size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hr.data(), rstd.ptr, hr.size(), cudaMemcpyDeviceToHost));
  if (c.residual) {
    std::vector<unsigned char> hs(n * item);
    CHECK_CUDA(cudaMemcpy(hs.data(), sum.ptr, hs.size(), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(hs.data() + i * item, hs_want.data() + i * item, item) != 0) {
        std::printf("FAIL %s: s[%zu] = %.9g but (x + x_bias) + residual rounded is %.9g\n", label, i, load(c.dtype, hs.data(), i),
                    load(c.dtype, hs_want.data(), i));
        return 1;
      }
    }
  }

  // The reference in double from the exact inputs (the rounded s for the residual variant).
  const Dtype stat = c.dtype == Dtype::kF64 ? Dtype::kF64 : Dtype::kF32;
  std::vector<double> gy(n), ry(n), gm(c.rows), rm(c.rows), gr(c.rows), rr(c.rows);
  for (int64_t r = 0; r < c.rows; ++r) {
    double s = 0, q = 0;
    for (int64_t i = 0; i < c.C; ++i) s += load(c.dtype, hrow.data(), r * c.C + i);
    const double m = s / c.C;
    for (int64_t i = 0; i < c.C; ++i) {
      const double d = load(c.dtype, hrow.data(), r * c.C + i) - m;
      q += d * d;
    }
    const double rs = 1.0 / std::sqrt(q / c.C + 1e-5);
    const int64_t wr = c.weight_rows > 0 ? r / (c.rows / c.weight_rows) : 0;
    const int64_t br = c.bias_rows > 0 ? r / (c.rows / c.bias_rows) : 0;
    for (int64_t i = 0; i < c.C; ++i) {
      double v = (load(c.dtype, hrow.data(), r * c.C + i) - m) * rs;
      if (c.weight_rows > 0) v *= load(c.param_dtype, hw.data(), wr * c.C + i);
      if (c.bias_rows > 0) v += load(c.param_dtype, hb.data(), br * c.C + i);
      ry[r * c.C + i] = v;
      gy[r * c.C + i] = load(c.dtype, hy.data(), r * c.C + i);
    }
    rm[r] = m;
    rr[r] = rs;
    gm[r] = load(stat, hm.data(), r);
    gr[r] = load(stat, hr.data(), r);
  }
  const double tol_y = c.dtype == Dtype::kF64 ? 1e-12 : c.dtype == Dtype::kF32 ? 1e-5 : c.dtype == Dtype::kBF16 ? 1e-2 : 2e-3;
  const double tol_s = c.dtype == Dtype::kF64 ? 1e-12 : 1e-5;
  const double ey = rel_err(gy, ry), em = rel_err(gm, rm), er = rel_err(gr, rr);
  if (ey > tol_y || em > tol_s || er > tol_s) {
    std::printf("FAIL %s: rel_err y %.2e (tol %.0e) mean %.2e rstd %.2e (tol %.0e)\n", label, ey, tol_y, em, er, tol_s);
    return 1;
  }
  return 0;
}

static int check() {
  std::mt19937_64 rng(1234);
  const bool quick = std::getenv("LNBWD_QUICK") != nullptr;
  // 40 to 512 (aligned): small rows, row groups narrower than a warp (several a warp, some of
  // whose groups have no row in the last round).
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1}, {7, 1}, {7, 3}, {5, 1601}, {33, 1600}, {4, 8192}, {2, 30000}, {0, 8},
                                                     {1, 128}, {301, 64}, {77, 256}};
  if (!quick) shapes.insert(shapes.end(), {{4225, 64}, {2, 70000}, {300, 768}, {129, 40}, {300, 128}, {35, 512}, {9, 17}, {9, 513}});
  const Dtype dtypes[] = {Dtype::kF32, Dtype::kBF16, Dtype::kF16, Dtype::kF64};
  int cases = 0, failures = 0;
  for (auto [rows, C] : shapes) {
    for (Dtype d : dtypes) {
      std::vector<Dtype> pdts = {d};
      if (d == Dtype::kBF16 || d == Dtype::kF16) pdts.push_back(Dtype::kF32);
      for (Dtype pd : pdts) {
        // (weight_rows, bias_rows): both shared, weight only, none, per-segment weight.
        std::vector<std::pair<int64_t, int64_t>> params = {{1, 1}, {1, 0}, {0, 0}};
        if (rows % 7 == 0 && rows > 0) params.push_back({7, 1});
        for (auto [wr, br] : params) {
          for (bool mis : {false, true}) {
            if (mis && (wr != 1 || br != 1)) continue;
            // Quick (sanitizer) runs force three row-group sizes: part of a warp and one warp
            // (shuffles only) and four (named barriers); the automatic choice covers the others.
            std::vector<std::pair<FwdPath, int>> paths = {{FwdPath::kAuto, 0}, {FwdPath::kSharedMemory, 0}, {FwdPath::kGlobal, 0}};
            for (int tpr = 2; tpr <= 512; tpr *= 2) {
              if (!quick || tpr == 4 || tpr == 32 || tpr == 128) paths.push_back({FwdPath::kRegisters, tpr});
            }
            // The residual variant with shared parameters and with none (the parameter kinds
            // do not meet the residual's code), without x's own bias, with a shared one, and
            // (where rows allow segments) with one per segment of rows.
            for (bool res : {false, true}) {
              if (res && wr != br) continue;
              std::vector<int64_t> xbs = {0};
              if (res) xbs.push_back(1);
              if (res && rows % 7 == 0 && rows > 0) xbs.push_back(7);
              for (int64_t xb : xbs) {
                for (auto [path, tpr] : paths) {
                  const int r = run_case({rows, C, d, pd, wr, br, mis, path, tpr, res, xb}, rng);
                  if (r < 0) continue;
                  ++cases;
                  failures += r;
                }
              }
            }
          }
        }
      }
    }
  }
  // Grid-stride: a grid capped below the row count, so that each block runs several rows in turn
  // (at full size only beyond 2^31 - 1 row groups): a row group of one warp (4 a block), of four
  // and of 16 warps (a block each), and the wide paths, plain and residual. Then small rows,
  // groups of 4 threads (32 a block) over 1000 rows: the last round leaves some of a warp's
  // groups without a row.
  for (Dtype d : {Dtype::kBF16, Dtype::kF32}) {
    for (bool res : {false, true}) {
      const int r = run_case({1000, 64, d, d, 1, 1, false, FwdPath::kRegisters, 4, res, 0, /*max_blocks=*/3}, rng);
      if (r < 0) continue;
      ++cases;
      failures += r;
    }
  }
  for (Dtype d : {Dtype::kBF16, Dtype::kF32}) {
    for (auto [path, tpr] : std::vector<std::pair<FwdPath, int>>{{FwdPath::kRegisters, 32}, {FwdPath::kRegisters, 128},
                                                                 {FwdPath::kRegisters, 512}, {FwdPath::kSharedMemory, 0},
                                                                 {FwdPath::kGlobal, 0}}) {
      for (bool res : {false, true}) {
        const int r = run_case({37, 2048, d, d, 1, 1, false, path, tpr, res, 0, /*max_blocks=*/3}, rng);
        if (r < 0) continue;
        ++cases;
        failures += r;
      }
    }
  }
  std::printf("forward check: %d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  if (mode == "check") return check();
  std::fprintf(stderr, "usage: %s [check]\n", argv[0]);
  return 2;
}
