// The fused forward's configuration sweep, without JAX or XLA: every path and row group
// (threads a row) that fits one shape, timed with CUDA events, the launcher's own pick first; how
// layernorm_fwd_pick (ffi/kernels/forward/forward_launch.cu) chooses is revisited with it. How a
// call compares with a copy and with the peers is the kernel bench's question (python -m
// benchmarks.kernels); correctness is tests/cuda/forward_check.cu's.
//
//   forward_tune ROWS C DTYPE [f32params] [residual [x_bias]] [rms] [tpr=N] [chain]
//   forward_tune ROWS C DTYPE [f32params] [rms] sets=Q:K [chain]
//
// tpr=N: only the register path at N threads a row (one configuration, e.g. for ncu's first
// launch). sets=Q:K: QK-norm's forward on contiguous q and k (jax_lnbwd.qk_norm): the ROWS rows
// dealt to two sets in the ratio Q:K (32:8 for 32 q heads and 8 kv heads), timed as one launch
// of norm_fwd_sets and as two launches of norm_fwd, one per set (two rmsnorm calls).
// Build (tools/tune/build.sh OUT_DIR forward_tune does this):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi/kernels -Icuda_harness tools/tune/forward_tune.cu \
//        ffi/kernels/forward/*.cu ffi/kernels/common/occupancy.cu ffi/kernels/common/device_limits.cu -o forward_tune
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "forward_buffers.cuh"

// Median µs of 7 runs of 20 launches, timed with events.
template <typename F>
static double time_us(F&& launch) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  launch();
  std::vector<double> t;
  for (int rep = 0; rep < 7; ++rep) {
    CHECK_CUDA(cudaEventRecord(a));
    for (int i = 0; i < 20; ++i) launch();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.0 / 20);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// DTYPE's kernel dtype; false (with a message) for any other name: a typo must never be timed as
// another dtype.
static bool parse_dtype(const std::string& dtype, Dtype* d) {
  if (dtype != "float32" && dtype != "bfloat16" && dtype != "float16" && dtype != "float64") {
    std::fprintf(stderr, "forward_tune: unknown dtype '%s' (float32, bfloat16, float16, float64)\n", dtype.c_str());
    return false;
  }
  *d = dtype == "float32" ? Dtype::kF32 : dtype == "bfloat16" ? Dtype::kBF16 : dtype == "float16" ? Dtype::kF16 : Dtype::kF64;
  return true;
}

// residual: the residual variant, which reads x and residual and writes y and s. x_bias (with
// residual): x's own bias added too. rms: RMSNorm's kernels (no mean, no bias). chain: each
// launch reads what the one before wrote (x and y swap), as in a network or the kernel bench's
// chain; otherwise every launch reads the same x, which may then be found partly in L2 from the
// launch before. GB/s counts the rows x C tensors read and written.
static int sweep(int64_t rows, int64_t C, const std::string& dtype, bool f32params, bool residual, bool x_bias,
                 bool rms, int only_tpr, bool chain) {
  Dtype d;
  if (!parse_dtype(dtype, &d)) return 2;
  const Dtype pd = f32params ? Dtype::kF32 : d;
  const size_t n = static_cast<size_t>(rows * C), bytes = n * item_bytes(d);
  DeviceBuffer x(bytes), y(bytes), mean(rows * stat_bytes(d)), rstd(rows * stat_bytes(d));
  DeviceBuffer w(C * item_bytes(pd)), b(C * item_bytes(pd));
  DeviceBuffer res(residual ? bytes : 0), sum(residual ? bytes : 0);
  x_bias = x_bias && residual;
  DeviceBuffer xb(x_bias ? C * item_bytes(pd) : 0);
  if (x_bias) CHECK_CUDA(cudaMemset(xb.ptr, 0, C * item_bytes(pd)));
  CHECK_CUDA(cudaMemset(x.ptr, 0x3c, bytes));   // finite values in every dtype
  if (residual) CHECK_CUDA(cudaMemset(res.ptr, 0x3c, bytes));
  CHECK_CUDA(cudaMemset(w.ptr, 0, C * item_bytes(pd)));
  CHECK_CUDA(cudaMemset(b.ptr, 0, C * item_bytes(pd)));
  const int tensors = residual ? 4 : 2;   // read and written, rows x C each
  CHECK_CUDA(cudaMemset(y.ptr, 0x3c, bytes));
  int launches = 0;
  auto swap_xy = [&](const void*& in, void*& out) {   // chain: odd launches read y and write x
    const bool odd = chain && (launches++ % 2 == 1);
    in = odd ? y.ptr : x.ptr;
    out = odd ? x.ptr : y.ptr;
  };
  std::printf("%s %lldx%lld %s (params %s)%s%s%s\n", rms ? "rmsnorm" : "layernorm", (long long)rows, (long long)C,
              dtype.c_str(), dtype_name(pd), residual ? " residual" : "", x_bias ? " x_bias" : "", chain ? " chain" : "");
  std::vector<std::pair<FwdPath, int>> paths;
  if (only_tpr == 0) paths = {{FwdPath::kAuto, 0}, {FwdPath::kSharedMemory, 0}, {FwdPath::kGlobal, 0}};
  for (int tpr = 2; tpr <= 512; tpr *= 2) {
    if (only_tpr == 0 || tpr == only_tpr) paths.push_back({FwdPath::kRegisters, tpr});
  }
  for (auto [path, tpr] : paths) {
    NormFwdParams p = {y.ptr, rms ? nullptr : mean.ptr, rstd.ptr, x.ptr, w.ptr, rms ? nullptr : b.ptr, rows, C, 1,
                            rms ? 0 : 1, d, pd, 1e-5, path, tpr, residual ? res.ptr : nullptr,
                            residual ? sum.ptr : nullptr, x_bias ? xb.ptr : nullptr, x_bias ? 1 : 0};
    p.norm = rms ? NormKind::kRmsNorm : NormKind::kLayerNorm;
    NormFwdConfig cfg;
    if (norm_fwd_pick(p, &cfg) != cudaSuccess) continue;
    const double us = time_us([&] {
      swap_xy(p.x, p.y);
      CHECK_CUDA(norm_fwd(p, 0));
    });
    std::printf("  %-9s tpr %3d nv %d vec %d rows/block %d threads %4d smem %7zu: %9.2f us %6.0f GB/s\n",
                path_name(path), cfg.tpr, cfg.nv, cfg.vec, cfg.rows_per_block, cfg.threads, cfg.smem_bytes, us,
                tensors * bytes / us / 1e3);
  }
  return 0;
}

// QK-norm's two sets (sets=Q:K): one launch of norm_fwd_sets against two of norm_fwd, on the same
// buffers, each set chained as in sweep.
static int sets_sweep(int64_t rows, int64_t C, const std::string& dtype, bool f32params, bool rms, int64_t q_part,
                      int64_t k_part, bool chain) {
  if (q_part < 1 || k_part < 1) {
    std::fprintf(stderr, "forward_tune: sets=Q:K needs Q >= 1 and K >= 1\n");
    return 2;
  }
  Dtype d;
  if (!parse_dtype(dtype, &d)) return 2;
  const Dtype pd = f32params ? Dtype::kF32 : d;
  const int64_t rows_q = rows * q_part / (q_part + k_part), rows_k = rows - rows_q;
  const size_t bytes = static_cast<size_t>(rows * C) * item_bytes(d);
  DeviceBuffer x(bytes), y(bytes), mean(rows * stat_bytes(d)), rstd(rows * stat_bytes(d));
  DeviceBuffer wq(C * item_bytes(pd)), wk(C * item_bytes(pd));
  CHECK_CUDA(cudaMemset(x.ptr, 0x3c, bytes));   // finite values in every dtype
  CHECK_CUDA(cudaMemset(y.ptr, 0x3c, bytes));
  CHECK_CUDA(cudaMemset(wq.ptr, 0, C * item_bytes(pd)));
  CHECK_CUDA(cudaMemset(wk.ptr, 0, C * item_bytes(pd)));
  // Set q is the first rows_q rows of x and y (and of mean and rstd), set k the rest. chain: odd
  // launches (of one launch, or of a pair) read y and write x, as in sweep.
  auto at = [&](void* base, int64_t row, size_t item) { return static_cast<char*>(base) + row * item; };
  auto set = [&](int64_t first, int64_t n, void* w, bool odd) {
    NormFwdParams p = {at(odd ? x.ptr : y.ptr, first * C, item_bytes(d)),
                       rms ? nullptr : at(mean.ptr, first, stat_bytes(d)), at(rstd.ptr, first, stat_bytes(d)),
                       at(odd ? y.ptr : x.ptr, first * C, item_bytes(d)), w, nullptr, n, C, 1, 0, d, pd, 1e-5,
                       FwdPath::kAuto, 0, nullptr, nullptr, nullptr, 0};
    p.norm = rms ? NormKind::kRmsNorm : NormKind::kLayerNorm;
    return p;
  };
  auto both = [&](bool odd) {   // the two sets, reading x (odd: y)
    return std::pair<NormFwdParams, NormFwdParams>{set(0, rows_q, wq.ptr, odd), set(rows_q, rows_k, wk.ptr, odd)};
  };
  bool odd = true;
  auto sets = [&] {   // this launch's two sets
    odd = chain && !odd;
    return both(odd);
  };
  std::printf("%s %lldx%lld %s (params %s) sets %lld:%lld (q %lld rows, k %lld rows)%s\n", rms ? "rmsnorm" : "layernorm",
              (long long)rows, (long long)C, dtype.c_str(), dtype_name(pd), (long long)q_part, (long long)k_part,
              (long long)rows_q, (long long)rows_k, chain ? " chain" : "");
  NormFwdConfig cfg;
  unsigned int blocks0 = 0;
  const auto [a, b] = both(false);   // the pick reads the sets' shapes only: the chain's parity stays
  if (norm_fwd_sets_pick(a, b, &cfg, &blocks0) != cudaSuccess) {
    std::printf("  one launch: not taken (norm_fwd_sets_pick refuses these rows)\n");
  } else {
    const double us = time_us([&] {
      const auto [q, k] = sets();
      CHECK_CUDA(norm_fwd_sets(q, k, 0));
    });
    std::printf("  one launch    tpr %3d nv %d vec %d blocks %u (q %u): %9.2f us %6.0f GB/s\n", cfg.tpr, cfg.nv,
                cfg.vec, cfg.blocks, blocks0, us, 2 * bytes / us / 1e3);
  }
  const double us = time_us([&] {
    const auto [q, k] = sets();
    CHECK_CUDA(norm_fwd(q, 0));
    CHECK_CUDA(norm_fwd(k, 0));
  });
  std::printf("  two launches (norm_fwd on q, then on k)%20s: %9.2f us %6.0f GB/s\n", "", us, 2 * bytes / us / 1e3);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr,
                 "usage: %s ROWS C DTYPE [f32params] [residual [x_bias]] [rms] [tpr=N] [chain]\n"
                 "       %s ROWS C DTYPE [f32params] [rms] sets=Q:K [chain]\n",
                 argv[0], argv[0]);
    return 2;
  }
  bool f32params = false, residual = false, x_bias = false, rms = false, chain = false;
  int only_tpr = 0;
  bool sets = false;
  long long q_part = 0, k_part = 0;
  for (int i = 4; i < argc; ++i) {
    if (std::strncmp(argv[i], "tpr=", 4) == 0) only_tpr = std::atoi(argv[i] + 4);
    if (std::strncmp(argv[i], "sets=", 5) == 0) {
      sets = true;
      if (std::sscanf(argv[i] + 5, "%lld:%lld", &q_part, &k_part) != 2) {
        std::fprintf(stderr, "forward_tune: sets=Q:K, e.g. sets=32:8\n");
        return 2;
      }
    }
    rms |= std::string(argv[i]) == "rms";
    f32params |= std::string(argv[i]) == "f32params";
    residual |= std::string(argv[i]) == "residual";
    x_bias |= std::string(argv[i]) == "x_bias";
    chain |= std::string(argv[i]) == "chain";
  }
  if (sets) {
    return sets_sweep(std::atoll(argv[1]), std::atoll(argv[2]), argv[3], f32params, rms, q_part, k_part, chain);
  }
  return sweep(std::atoll(argv[1]), std::atoll(argv[2]), argv[3], f32params, residual, x_bias, rms, only_tpr, chain);
}
