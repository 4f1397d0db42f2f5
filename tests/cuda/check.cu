// The check the sanitizers run (tests/cuda/run_sanitizers.sh): every kernel of ffi/kernels/ over
// shapes x dtypes x block sizes (and kernel 12's configurations) against a float64 CPU
// reference, with exact-size buffers and poisoned outputs, and llm.c's launchers' refusals. What
// each kernel takes (dtypes, block sizes, refused C, flags) comes from the kernel registry.
//
// Why a standalone program: XLA's pooled allocator hands kernels slices of one big allocation,
// so compute-sanitizer's memcheck cannot see a kernel write one element past its buffer. Here
// every buffer is its own cudaMalloc of exactly the size the kernel may touch, so the sanitizers
// (memcheck, racecheck, synccheck, initcheck) see every stray access.
//
//   check [kernel ...]   (default: every kernel in the registry)
//   LNBWD_QUICK=1: fewer shapes (for the sanitizers); LNBWD_QUICK_MAX_ELEMENTS caps rows * C,
//   LNBWD_MAX_C caps C (a control whose planted bug only small rows reach); LNBWD_SHARD=K/N checks
//   the K-th of N parts (cuda_harness/shard.h; a part is one (dtype, C, rows) at a time, and the
//   refusals are part 0's).
//
// Build (tools/tune/build.sh OUT_DIR check does this, sharing its compile of the kernels with
// tune; run_sanitizers.sh builds it the same way, with -lineinfo):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi -Icuda_harness tests/cuda/check.cu ffi/registry.cc \
//        $(find ffi/kernels -name '*.cu') -o check
#include <memory>

#include "harness.cuh"
#include "shard.h"

namespace {

// Kernels whose grid shrinks to the partial slots the workspace has.
bool grid_fits_slots(int kernel) { return kernel == 5 || kernel == 9 || kernel == 10; }

// Norm-wise relative error allowed against the float64 reference. dx is always computed in
// fp32 and rounded once; an imprecise kernel (bf16/f16 atomics) gets more room for dweight/dbias.
double tolerance(Dtype d, bool precise_sums) {
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

// llm.c's launchers (kernels 1-10) must refuse (return an error, launch nothing) what they
// cannot do, and the registry must refuse the same: a dtype they are not built for or segments
// (cudaErrorInvalidValue), a block size or C they cannot run (cudaErrorInvalidConfiguration), and
// more shared memory than the GPU has (the driver's error at the opt-in).
int check_refusals(const std::vector<int>& kernels, int* checked) {
  const RefusalLimits device = device0_refusal_limits();
  int failures = 0;
  // exact: the launcher must return `want`; otherwise any error will do.
  auto expect = [&](int kernel, Dtype d, int64_t C, int block_size, int64_t segments, cudaError_t want, bool exact,
                    const char* what) {
    const int64_t rows = 2 * segments;
    const size_t it = dtype_item_bytes(d);
    DeviceBuf dy(rows * C * it), x(rows * C * it), dx(rows * C * it), w(C * it), dw(segments * C * it),
        db(segments * C * it), mean(rows * 4), rstd(rows * 4), ws(kWorkspaceHeaderBytes + rows * 2 * C * 4);
    NormBwdParams p{dx.ptr, dw.ptr, db.ptr, dy.ptr, x.ptr, w.ptr, mean.ptr, rstd.ptr, rows, C, segments, 0, d,
                         block_size, ws.ptr, ws.bytes};
    p.norm = NormKind::kLayerNorm;
    const cudaError_t got = launch_kernel(kernel, p, 0);
    CHECK_CUDA(cudaDeviceSynchronize());
    ++*checked;
    if (exact ? got != want : got == cudaSuccess) {
      ++failures;
      std::printf("FAIL kernel %d %s: %s returned %s, expected %s\n", kernel, dtype_name(d), what,
                  cudaGetErrorName(got), exact ? cudaGetErrorName(want) : "an error");
    }
    const KernelRequest r{d, C, block_size, segments, 1};
    if (KernelRefusal(facts(kernel), r, device).empty()) {
      ++failures;
      std::printf("FAIL kernel %d %s: %s is refused by the launcher but accepted by the registry\n", kernel,
                  dtype_name(d), what);
    }
  };
  for (int kernel : kernels) {
    const KernelFacts& k = facts(kernel);
    if (k.max_block_size == 0) continue;   // kernels 11-12 take any C and choose their own blocks
    for (Dtype d : kAllDtypes) {
      if (!TakesDtype(k, d)) expect(kernel, d, 768, 0, 1, cudaErrorInvalidValue, true, "an unsupported dtype");
    }
    const Dtype d = TakesDtype(k, Dtype::kF32) ? Dtype::kF32 : Dtype::kBF16;
    expect(kernel, d, 768, 48, 1, cudaErrorInvalidConfiguration, true, "block_size 48");
    expect(kernel, d, 768, 16, 1, cudaErrorInvalidConfiguration, true, "block_size 16");
    expect(kernel, d, 768, 2 * k.max_block_size, 1, cudaErrorInvalidConfiguration, true, "twice the largest block_size");
    expect(kernel, d, 768, 0, 2, cudaErrorInvalidValue, true, "2 segments");
    if (kernel >= 2) expect(kernel, d, 40000, 0, 1, cudaSuccess, false, "C=40000 (shared memory)");
    if (refuses(kernel, d, 1600, 0, device)) {
      expect(kernel, d, 1600, 0, 1, cudaErrorInvalidConfiguration, true, "C=1600 (not whole x128 steps)");
    }
  }
  return failures;
}

int check(const std::vector<int>& kernels) {
  const int sms = device0_attribute(cudaDevAttrMultiProcessorCount);
  const RefusalLimits device = device0_refusal_limits();
  // LNBWD_QUICK=1 (for the sanitizers, which run kernels 10-100x slower) keeps the shapes that
  // exercise every code path: misaligned and aligned C, a row count past the grid's warps.
  const bool quick = std::getenv("LNBWD_QUICK") != nullptr;
  // Kernel 12 splits rows over clusters of two blocks from 4096 columns in 16-bit types and from
  // 12288 in fp32, and every configuration is checked at every C (split or not); 32768 is the
  // widest 16-bit row it splits. 12292 (a multiple of 4, not of 8) takes its wide-row path in
  // fp32, whose rows that wide do not split.
  // 40 to 512 (aligned) take kernel 11's small rows, groups narrower than a warp, in every dtype
  // (kernel 12 takes those of at most a warp of vectors in its ring of row chunks, fp64 aside);
  // 17, 33, 511 and 513 are their unaligned neighbours.
  const std::vector<int64_t> cs = quick ? std::vector<int64_t>{1, 3, 40, 64, 128, 256, 768, 1601, 4096, 12292, 16384, 30000}
                                        : std::vector<int64_t>{1, 3, 8, 17, 33, 40, 64, 128, 256, 511, 512, 513, 768,
                                                               1600, 1601, 4096, 8192, 12288, 12292, 16384, 30000, 32768};
  // 1 and 7 rows, and one row more than the 32 * SMs warps of llm.c's persistent grids (the
  // grid of kernels 3-4 and 6-10, and of kernel 5 at 1024 threads): one warp takes a second row
  // while all others have none, which is what broke the barriers of llm.c's kernels 9 and 10.
  // 2 * SMs + 1 rows: a block of kernel 12 with one group (its wide path, or rows of 16384)
  // takes a third row.
  // 256 * SMs + 3 rows (small rows only, C <= 256): several chunks per block for kernel 12's ring
  // of row chunks (two blocks an SM, a chunk of up to 1024 rows), so each buffer is refilled
  // and its barriers' phases flip, and the last chunk is short.
  const int64_t ring_rows = 256 * int64_t(sms) + 3;
  const std::vector<int64_t> rs = quick ? std::vector<int64_t>{7, 2 * int64_t(sms) + 1, 32 * int64_t(sms) + 1, ring_rows}
                                        : std::vector<int64_t>{1, 7, 2 * int64_t(sms) + 1, 32 * int64_t(sms) + 1, ring_rows};
  // Keep the CPU reference quick; under the sanitizers (quick), keep each launch small too (the
  // many-rows case still runs for every C up to 1601). racecheck, the slowest tool on kernels
  // with many shared-memory accesses, can lower the bound with LNBWD_QUICK_MAX_ELEMENTS.
  const char* max_env = std::getenv("LNBWD_QUICK_MAX_ELEMENTS");
  const int64_t max_elements = !quick ? 20'000'000 : max_env ? std::atoll(max_env) : 8'000'000;
  const char* max_c_env = std::getenv("LNBWD_MAX_C");
  const int64_t max_c = max_c_env ? std::atoll(max_c_env) : INT64_MAX;
  const Dtype ds[] = {Dtype::kF32, Dtype::kBF16, Dtype::kF16, Dtype::kF64};
  const Shard shard = shard_from_env("check");
  int failures = 0, checked = 0;
  if (shard.first()) failures += check_refusals(kernels, &checked);
  struct Worst { double dx = 0, dw = 0, db = 0; int cases = 0; };
  std::vector<std::vector<Worst>> worst(MaxKernelId() + 1, std::vector<Worst>(4));
  int64_t group = 0;   // the (dtype, C, rows) checked so far: LNBWD_SHARD's parts
  for (Dtype d : ds) {
    for (int64_t C : cs) {
      if (C > max_c) continue;
      for (int64_t rows : rs) {
        if (rows * C > max_elements || (rows == ring_rows && C > 256)) continue;
        if (!shard.mine(group++)) continue;
        std::unique_ptr<Problem> pb;           // made when a kernel first needs it
        for (int kernel : kernels) {
          const KernelFacts& k = facts(kernel);
          if (!TakesDtype(k, d)) continue;
          std::vector<int> sizes = BlockSizes(k);
          if (quick && sizes.size() > 2) sizes = {sizes.front(), sizes.back()};
          for (int bs : sizes) {
            if (refuses(kernel, d, C, bs, device)) continue;
            if (!pb) pb = std::make_unique<Problem>(d, rows, C, unsigned(rows * 131 + C));
            // The default workspace, and (for a kernel that fits its grid to the workspace, at
            // the most rows) a workspace of a single slot: the grid must shrink, not overrun.
            const bool tight = grid_fits_slots(kernel) && rows == rs.back() && bs == sizes.back();
            // Kernels 11 and 12: the default, then every configuration they can pick from (each
            // one is reachable from the default on some C, or from the tuning tools).
            const std::vector<Kernel12Config> k12 = kernel == 12 ? kernel12_candidates(d, C, device0_limits()) : std::vector<Kernel12Config>{};
            const std::vector<Kernel11Config> k11 =
                kernel == 11 ? kernel11_candidates(d, C, C % (16 / int(dtype_item_bytes(d))) == 0, device0_limits())
                             : std::vector<Kernel11Config>{};
            for (int v = -1; v < int(k12.size() + k11.size()); ++v)
            for (int64_t slots : {int64_t(0), int64_t(1)}) {
              if (slots == 1 && (!tight || v >= 0)) continue;
              const Kernel12Config* c12 = v < 0 || k12.empty() ? nullptr : &k12[v];
              const Kernel11Config* c11 = v < 0 || k11.empty() ? nullptr : &k11[v];
              Outputs a, b;
              cudaError_t err = run(*pb, kernel, bs, c11, &a, sms, 1, c12, slots);
              bool same = true;
              if (err == cudaSuccess && k.deterministic) {
                err = run(*pb, kernel, bs, c11, &b, sms, 1, c12, slots);
                same = err == cudaSuccess && a.dx == b.dx && a.dw == b.dw && a.db == b.db;
              }
              const double ex = err ? INFINITY : rel_err(d, a.dx, pb->ref_dx);
              const double ew = err ? INFINITY : rel_err(d, a.dw, pb->ref_dw);
              const double eb = err ? INFINITY : rel_err(d, a.db, pb->ref_db);
              const double tx = tolerance(d, true), tp = tolerance(d, k.precise);
              const bool ok = err == cudaSuccess && same && ex <= tx && ew <= tp && eb <= tp;
              Worst& wst = worst[kernel][int(d)];
              wst.dx = std::max(wst.dx, ex); wst.dw = std::max(wst.dw, ew); wst.db = std::max(wst.db, eb);
              ++wst.cases;
              ++checked;
              if (!ok) {
                ++failures;
                std::printf("FAIL kernel %d %s rows=%lld C=%lld block_size=%d%s%s: %s dx %.2e dw %.2e db %.2e%s\n",
                            kernel, dtype_name(d), (long long)rows, (long long)C, bs, slots ? " (1 slot)" : "",
                            c12   ? (" config nb=" + std::to_string(c12->nb) + (c12->raw_weight ? " raw weight" : "") +
                                     (c12->split > 1 ? " split" : "") +
                                     (c12->chunks ? " chunks of " + std::to_string(c12->nv) + " rows a group" : "")).c_str()
                            : c11 ? (" config tpr=" + std::to_string(c11->tpr) + " nv=" + std::to_string(c11->nv) +
                                     (c11->prefetch ? " prefetch" : "") + (c11->reg_sums ? " sums in registers" : "")).c_str()
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
  std::printf("check: %d cases, %d failures\n", checked, failures);
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> kernels;
  for (int i = 1; i < argc; ++i) {
    const int id = std::atoi(argv[i]);
    if (FindKernel(id) == nullptr) {
      std::fprintf(stderr, "usage: check [kernel ...]: no kernel '%s' (ids %d-%d)\n", argv[i], MinKernelId(),
                   MaxKernelId());
      return 2;
    }
    kernels.push_back(id);
  }
  if (kernels.empty()) {
    for (const KernelFacts& k : AllKernels()) kernels.push_back(k.id);
  }
  return check(kernels);
}
