// Standalone check of RMSNorm on the shared kernels (NormKind::kRmsNorm, ffi/kernels/norm_kind.h),
// without JAX or XLA, against a float64 CPU reference: the fused forward (every path, with and
// without weight, offset 0 and 1, fp32 parameters beside 16-bit x, segments, the residual variant
// with and without x_bias) and the backward on kernels 11 and 12 (offset, residual gradient, also
// aliased to dx, mixed precision, segments with shared or per-segment weights). As check.cu and
// forward_check.cu: exact-size cudaMalloc buffers and poisoned outputs, so that compute-sanitizer
// sees every stray access and unwritten output (run_rms_sanitizers.sh runs the four tools).
//
// Also checked: the backward runs in exactly the workspace norm_bwd_workspace_bytes gives
// layernorm for the same problem, runs twice to the same bits, and mean and dbias are never
// touched (they are null).
//
//   rms_check           (LNBWD_QUICK=1: fewer shapes, for the sanitizers)
//
// Build:
//   nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi -Icuda_harness tests/cuda/rms_check.cu ffi/registry.cc \
//        $(find ffi/kernels -name '*.cu') -o /tmp/rms_check
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "forward/api.h"
#include "harness.cuh"

namespace {

double tolerance(Dtype d) {
  return d == Dtype::kF64 ? 1e-12 : d == Dtype::kF32 ? 1e-5 : d == Dtype::kBF16 ? 1e-2 : 2e-3;
}

Dtype stat_of(Dtype d) { return d == Dtype::kF64 ? Dtype::kF64 : Dtype::kF32; }

// RMSNorm's rstd of a row, and the weight of column i (offset + w, or 1 without a weight).
double rstd_ref(const std::vector<double>& x, int64_t r, int64_t C) {
  double q = 0;
  for (int64_t i = 0; i < C; ++i) q += x[r * C + i] * x[r * C + i];
  return 1.0 / std::sqrt(q / C + 1e-5);
}

struct FwdCase {
  int64_t rows, C;
  Dtype dtype, pdtype;
  int64_t weight_rows, x_bias_rows;
  bool residual;
  double offset;
  FwdPath path;
  int64_t max_blocks = 0;   // > 0: a grid of at most this many blocks, which then stride over rows
};

int run_fwd(const FwdCase& c, std::mt19937& gen) {
  std::normal_distribution<double> n(0.0, 1.0);
  const size_t N = c.rows * c.C, it = dtype_item_bytes(c.dtype);
  std::vector<double> x(N), r(c.residual ? N : 0), w(c.weight_rows * c.C), xb(c.x_bias_rows * c.C);
  for (auto& v : x) v = 0.5 + 2.0 * n(gen);
  for (auto& v : r) v = n(gen);
  for (auto& v : w) v = (c.offset != 0 ? 0.0 : 1.0) + 0.1 * n(gen);
  for (auto& v : xb) v = n(gen);
  std::vector<unsigned char> hx, hr, hw, hxb;
  x = rounded(c.dtype, x, &hx);
  r = rounded(c.dtype, r, &hr);
  w = rounded(c.pdtype, w, &hw);
  xb = rounded(c.pdtype, xb, &hxb);
  // The rows normalized: x, or s = (x [+ x_bias]) + residual summed in the accumulator type and
  // rounded once to the dtype.
  std::vector<double> s = x;
  std::vector<unsigned char> hs_want;
  if (c.residual) {
    for (size_t i = 0; i < N; ++i) {
      const int64_t row = i / c.C, col = i % c.C;
      double v = x[i];
      if (c.x_bias_rows > 0) {
        v += xb[(row / (c.rows / c.x_bias_rows)) * c.C + col];
        if (c.dtype != Dtype::kF64) v = float(v);
      }
      s[i] = c.dtype == Dtype::kF64 ? v + r[i] : double(float(v + r[i]));
    }
    s = rounded(c.dtype, s, &hs_want);
  }
  DeviceBuf dx_ = upload(hx), dr = upload(hr), dw = upload(hw), dxb = upload(hxb);
  DeviceBuf y(N * it), sum(c.residual ? N * it : 0), rstd(c.rows * dtype_acc_bytes(c.dtype));
  CHECK_CUDA(cudaMemset(y.ptr, 0xFF, y.bytes));
  CHECK_CUDA(cudaMemset(rstd.ptr, 0xFF, rstd.bytes));
  if (c.residual) CHECK_CUDA(cudaMemset(sum.ptr, 0xFF, sum.bytes));
  NormFwdParams p = {};
  p.y = y.ptr;
  p.rstd = rstd.ptr;
  p.x = dx_.ptr;
  p.weight = c.weight_rows > 0 ? dw.ptr : nullptr;
  p.rows = c.rows;
  p.C = c.C;
  p.weight_rows = c.weight_rows;
  p.dtype = c.dtype;
  p.param_dtype = c.pdtype;
  p.eps = 1e-5;
  p.path = c.path;
  p.residual = c.residual ? dr.ptr : nullptr;
  p.s = c.residual ? sum.ptr : nullptr;
  p.x_bias = c.x_bias_rows > 0 ? dxb.ptr : nullptr;
  p.x_bias_rows = c.x_bias_rows;
  p.norm = NormKind::kRmsNorm;
  p.offset = c.offset;
  p.max_blocks = c.max_blocks;
  NormFwdConfig cfg;
  if (norm_fwd_pick(p, &cfg) != cudaSuccess) return -1;   // a forced path that cannot hold the row
  char label[200];
  std::snprintf(label, sizeof(label), "fwd %lldx%lld %s/%s w%lld xb%lld%s offset %g path %d", (long long)c.rows,
                (long long)c.C, dtype_name(c.dtype), dtype_name(c.pdtype), (long long)c.weight_rows,
                (long long)c.x_bias_rows, c.residual ? " residual" : "", c.offset, int(cfg.path));
  if (c.max_blocks > 0) std::snprintf(label + std::strlen(label), sizeof(label) - std::strlen(label), " blocks %u", cfg.blocks);
  cudaError_t err = norm_fwd(p, 0);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("FAIL %s: %s\n", label, cudaGetErrorString(err));
    return 1;
  }
  if (c.residual && download(sum, sum.bytes) != hs_want) {
    std::printf("FAIL %s: s is not (x [+ x_bias]) + residual rounded once\n", label);
    return 1;
  }
  std::vector<double> ry(N), rr(c.rows);
  for (int64_t row = 0; row < c.rows; ++row) {
    rr[row] = rstd_ref(s, row, c.C);
    const int64_t wr = c.weight_rows > 0 ? row / (c.rows / c.weight_rows) : 0;
    for (int64_t i = 0; i < c.C; ++i) {
      const double wi = c.weight_rows > 0 ? c.offset + w[wr * c.C + i] : 1.0;
      ry[row * c.C + i] = s[row * c.C + i] * rr[row] * wi;
    }
  }
  const double ey = rel_err_of(decode_all(c.dtype, download(y, y.bytes)), ry);
  const double er = rel_err_of(decode_all(stat_of(c.dtype), download(rstd, rstd.bytes)), rr);
  const double ts = c.dtype == Dtype::kF64 ? 1e-12 : 1e-5;
  if (ey > tolerance(c.dtype) || er > ts) {
    std::printf("FAIL %s: rel_err y %.2e (tol %.0e) rstd %.2e (tol %.0e)\n", label, ey, tolerance(c.dtype), er, ts);
    return 1;
  }
  return 0;
}

struct BwdCase {
  int kernel;
  int64_t rows, C;
  Dtype dtype;
  bool weight_f32, residual, alias, per_segment_weight;
  int64_t segments;
  double offset;
};

int run_bwd(const BwdCase& c, std::mt19937& gen) {
  std::normal_distribution<double> n(0.0, 1.0);
  const Dtype pd = c.weight_f32 ? Dtype::kF32 : c.dtype, st = stat_of(c.dtype);
  const size_t N = c.rows * c.C, it = dtype_item_bytes(c.dtype);
  const int64_t W = c.per_segment_weight ? c.segments : 1, per = c.rows / c.segments;
  std::vector<double> dy(N), x(N), res(c.residual ? N : 0), w(W * c.C), rs(c.rows);
  for (auto& v : dy) v = n(gen);
  for (auto& v : x) v = 0.5 + 2.0 * n(gen);
  for (auto& v : res) v = n(gen);
  for (auto& v : w) v = (c.offset != 0 ? 0.0 : 1.0) + 0.1 * n(gen);
  std::vector<unsigned char> hdy, hx, hres, hw, hrs;
  dy = rounded(c.dtype, dy, &hdy);
  x = rounded(c.dtype, x, &hx);
  res = rounded(c.dtype, res, &hres);
  w = rounded(pd, w, &hw);
  for (int64_t r = 0; r < c.rows; ++r) rs[r] = rstd_ref(x, r, c.C);
  rs = rounded(st, rs, &hrs);
  // The reference: g = (offset + w) dy, xhat = x rstd, dx = (g - xhat mean(g xhat)) rstd (+ res),
  // dweight = sum over each segment's rows of dy xhat.
  std::vector<double> rdx(N), rdw(c.segments * c.C, 0.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t seg = r / per, wr = c.per_segment_weight ? seg : 0;
    double b = 0;
    for (int64_t i = 0; i < c.C; ++i) b += (c.offset + w[wr * c.C + i]) * dy[r * c.C + i] * x[r * c.C + i] * rs[r];
    b /= c.C;
    for (int64_t i = 0; i < c.C; ++i) {
      const double xh = x[r * c.C + i] * rs[r];
      rdx[r * c.C + i] = ((c.offset + w[wr * c.C + i]) * dy[r * c.C + i] - xh * b) * rs[r] + (c.residual ? res[r * c.C + i] : 0.0);
      rdw[seg * c.C + i] += dy[r * c.C + i] * xh;
    }
  }
  LaunchPlan plan;
  CHECK_CUDA(norm_bwd_workspace_bytes(c.kernel, c.dtype, c.rows, c.C, c.segments, 0, &plan));
  DeviceBuf ddy = upload(hdy), dxin = upload(hx), dw = upload(hw), drs = upload(hrs), dres = upload(hres);
  DeviceBuf dx(N * it), dwt(c.segments * c.C * dtype_item_bytes(pd)), ws(plan.workspace_bytes);
  char label[200];
  std::snprintf(label, sizeof(label), "bwd k%d %lldx%lld %s%s%s%s S=%lld%s offset %g", c.kernel, (long long)c.rows,
                (long long)c.C, dtype_name(c.dtype), c.weight_f32 ? " f32 weight" : "", c.residual ? " residual" : "",
                c.alias ? " (aliased)" : "", (long long)c.segments, c.per_segment_weight ? " per-segment weight" : "",
                c.offset);
  std::vector<unsigned char> first_dx, first_dw;
  for (int run = 0; run < 2; ++run) {
    // Poison (NaN in every float dtype) what is written; an aliased dresidual is dx's own buffer.
    CHECK_CUDA(cudaMemset(dwt.ptr, 0xFF, dwt.bytes));
    CHECK_CUDA(cudaMemset(ws.ptr, 0xFF, ws.bytes));
    if (c.alias) CHECK_CUDA(cudaMemcpy(dx.ptr, hres.data(), hres.size(), cudaMemcpyHostToDevice));
    else CHECK_CUDA(cudaMemset(dx.ptr, 0xFF, dx.bytes));
    NormBwdParams p{dx.ptr, dwt.ptr, nullptr, ddy.ptr, dxin.ptr, dw.ptr, nullptr, drs.ptr, c.rows, c.C,
                         c.segments, c.per_segment_weight ? c.C : 0, c.dtype, 0, ws.ptr, ws.bytes};
    p.device = 0;
    p.dresidual = c.residual ? (c.alias ? dx.ptr : dres.ptr) : nullptr;
    p.weight_f32 = c.weight_f32;
    p.norm = NormKind::kRmsNorm;
    p.offset = c.offset;
    cudaError_t err = c.kernel == 11 ? norm_bwd_kernel11(p, 0) : norm_bwd_kernel12(p, 0);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      std::printf("FAIL %s: %s (in layernorm's workspace of %zu bytes)\n", label, cudaGetErrorString(err), ws.bytes);
      return 1;
    }
    std::vector<unsigned char> gdx = download(dx, dx.bytes), gdw = download(dwt, dwt.bytes);
    if (run == 1) {
      if (gdx != first_dx || gdw != first_dw) {
        std::printf("FAIL %s: a second run gave other bits\n", label);
        return 1;
      }
      break;
    }
    first_dx = gdx;
    first_dw = gdw;
    const double ex = rel_err_of(decode_all(c.dtype, gdx), rdx), ew = rel_err_of(decode_all(pd, gdw), rdw);
    const double tw = c.dtype == Dtype::kF64 ? 1e-12 : pd == Dtype::kF32 ? 1e-5 : tolerance(pd);
    if (ex > tolerance(c.dtype) || ew > tw) {
      std::printf("FAIL %s: rel_err dx %.2e (tol %.0e) dweight %.2e (tol %.0e)\n", label, ex, tolerance(c.dtype), ew, tw);
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main() {
  const bool quick = std::getenv("LNBWD_QUICK") != nullptr;
  std::mt19937 gen(1234);
  int cases = 0, failures = 0, skipped = 0;
  auto count = [&](int result) {
    if (result < 0) { ++skipped; return; }
    ++cases;
    failures += result;
  };
  // Forward: every dtype (and fp32 parameters beside 16-bit x), every path, shapes that take the
  // register path with one and several warps a row, an unaligned row (scalar access), and a row
  // for the wide paths.
  const std::vector<std::pair<int64_t, int64_t>> fwd_shapes =
      quick ? std::vector<std::pair<int64_t, int64_t>>{{64, 768}, {12, 37}, {4, 20000}, {300, 128}}
            : std::vector<std::pair<int64_t, int64_t>>{{64, 768}, {256, 4096}, {12, 37}, {8, 1000}, {4, 20000}, {4, 70000},
                                                       {1000, 64}, {300, 128}, {52, 256}};
  for (Dtype d : kAllDtypes) {
    for (Dtype pd : {d, Dtype::kF32}) {
      if (pd != d && (d == Dtype::kF32 || d == Dtype::kF64)) continue;
      for (auto [rows, C] : fwd_shapes) {
        for (FwdPath path : {FwdPath::kAuto, FwdPath::kSharedMemory, FwdPath::kGlobal}) {
          if (path != FwdPath::kAuto && (quick || C < 1000)) continue;
          for (double offset : {0.0, 1.0}) {
            count(run_fwd({rows, C, d, pd, 1, 0, false, offset, path}, gen));
            count(run_fwd({rows, C, d, pd, 1, 0, true, offset, path}, gen));
            count(run_fwd({rows, C, d, pd, 4, 2, true, offset, path}, gen));   // segments, x_bias per segment
          }
          count(run_fwd({rows, C, d, pd, 0, 0, false, 1.0, path}, gen));       // no weight: offset ignored
          count(run_fwd({rows, C, d, pd, 0, 1, true, 1.0, path}, gen));
        }
      }
    }
  }
  // Grid-stride: a grid capped below the row count, so that each block runs several rows in turn
  // (at full size only beyond 2^31 - 1 rows): rows of four and eight warps (one sum a row, which
  // alternates between two shared buffers), and the wide paths; plain and residual.
  for (auto [rows, C, path] : std::vector<std::tuple<int64_t, int64_t, FwdPath>>{
           {24, 4096, FwdPath::kAuto}, {24, 16384, FwdPath::kAuto}, {7, 20000, FwdPath::kSharedMemory},
           {7, 20000, FwdPath::kGlobal}}) {
    for (bool residual : {false, true}) {
      count(run_fwd({rows, C, Dtype::kBF16, Dtype::kF32, 1, 0, residual, 1.0, path, /*max_blocks=*/5}, gen));
      count(run_fwd({rows, C, Dtype::kF32, Dtype::kF32, 1, 0, residual, 0.0, path, /*max_blocks=*/3}, gen));
    }
  }
  // Backward on kernels 11 and 12 (12 falls back to 11 where its ring does not apply: the
  // unaligned C, fp64 beyond the ring, GPUs before sm_90).
  const std::vector<std::pair<int64_t, int64_t>> bwd_shapes =
      quick ? std::vector<std::pair<int64_t, int64_t>>{{64, 768}, {12, 37}, {8, 16384}, {1000, 128}}
            : std::vector<std::pair<int64_t, int64_t>>{{64, 768}, {4096, 1024}, {12, 37}, {36, 1600}, {8, 16384}, {4, 30000},
                                                       {4000, 64}, {1000, 128}, {52, 256}};
  for (int kernel : {11, 12}) {
    for (Dtype d : kAllDtypes) {
      for (bool f32w : {false, true}) {
        if (f32w && (d == Dtype::kF32 || d == Dtype::kF64)) continue;
        for (auto [rows, C] : bwd_shapes) {
          for (double offset : {0.0, 1.0}) {
            count(run_bwd({kernel, rows, C, d, f32w, false, false, false, 1, offset}, gen));
            count(run_bwd({kernel, rows, C, d, f32w, true, offset != 0, false, 1, offset}, gen));
            count(run_bwd({kernel, rows, C, d, f32w, offset != 0, false, true, 4, offset}, gen));
            count(run_bwd({kernel, rows, C, d, f32w, false, false, false, 4, offset}, gen));   // shared weight
          }
        }
      }
    }
  }
  std::printf("rms check: %d cases, %d failures (%d forced paths not applicable)\n", cases, failures, skipped);
  return failures ? 1 : 0;
}
