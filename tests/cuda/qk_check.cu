// Standalone check of QK-norm's one-launch kernels (norm_fwd_sets and norm_bwd_sets: two sets of
// head rows, common/head_rows.h), without JAX or XLA, against a float64 CPU reference:
//   * both layouts: q and k in buffers of their own (contiguous rows), and the fused projection
//     [tokens, (Hq + 2 Hk) * D] normalized in place, whose v heads must stay as they were (the
//     forward's input, the backward's incoming cotangent);
//   * layernorm (no bias) and RMSNorm (offset 0 and 1), every dtype, fp32 weights beside 16-bit
//     data, no weight (forward), head counts 1 to 64, a single token, rows up to the widest
//     kHeadRowsMaxBytes allows;
//   * the backward on every kernel-11 configuration of groups up to a warp (norm_bwd_sets_config)
//     and, on sm_90, every configuration of kernel 12's ring of row chunks on q and k of their
//     own (norm_bwd_kernel12_chunk_sets), with enough tokens that a block refills its buffers, in
//     exactly the workspace norm_bwd_sets_workspace_bytes gives, twice to the same bits.
// As the other checks: exact-size cudaMalloc buffers and NaN-poisoned outputs, so that
// compute-sanitizer sees every stray access and unwritten output. The cases and reference are in
// qk_cases.cuh, the forward check in qk_check_fwd.cuh, the backward's in qk_check_bwd.cuh; this
// file is the matrix of cases.
//
//   qk_check           (LNBWD_QUICK=1: fewer shapes, for the sanitizers; LNBWD_DTYPE=float32,
//                       bfloat16, float16 or float64: that dtype's cases only, so that a caller
//                       can run the dtypes side by side; LNBWD_SHARD=K/N: the K-th of N parts,
//                       cuda_harness/shard.h, a part one (dtype, parameter dtype, D) at a time)
//
// Build:
//   nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi -Icuda_harness tests/cuda/qk_check.cu ffi/registry.cc \
//        $(find ffi/kernels -name '*.cu') -o /tmp/qk_check
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "qk_check_bwd.cuh"
#include "qk_check_fwd.cuh"
#include "shard.h"

int main() {
  // Line-buffered, so that a run stopped by a time limit still shows how far it got.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const bool quick = std::getenv("LNBWD_QUICK") != nullptr;
  const char* only = std::getenv("LNBWD_DTYPE");
  const Shard shard = shard_from_env("qk_check");
  int64_t group = 0;   // the (dtype, parameter dtype, D) checked so far: LNBWD_SHARD's parts
  std::mt19937 gen(4321);
  int cases = 0, failures = 0;
  auto count = [&](int result) {
    ++cases;
    failures += result;
  };
  const DeviceLimits lim = device0_limits();
  // (tokens, Hq, Hk): GQA as Qwen3 and Llama have it, one head, many heads, a single token.
  struct Heads {
    int64_t tokens, hq, hk;
  };
  const std::vector<Heads> heads = quick ? std::vector<Heads>{{37, 4, 2}, {1, 64, 1}}
                                         : std::vector<Heads>{{300, 32, 8}, {37, 4, 2}, {1, 64, 1}, {129, 1, 1}, {5, 64, 64}};
  for (Dtype d : kAllDtypes) {
    if (only && std::string(only) != dtype_name(d)) continue;
    const int64_t item = dtype_item_bytes(d), widest = kHeadRowsMaxBytes / item;
    std::vector<int64_t> dims;
    for (int64_t D : {8, 32, 64, 80, 128, 256, 512, 1024}) {
      if (D * item % 16 == 0 && D <= widest && (!quick || D == 64 || D == 80 || D == widest)) dims.push_back(D);
    }
    for (Dtype pd : {d, Dtype::kF32}) {
      if (pd != d && (d == Dtype::kF32 || d == Dtype::kF64)) continue;
      for (int64_t D : dims) {
        if (!shard.mine(group++)) continue;
        for (auto [tokens, hq, hk] : heads) {
          for (bool fused : {false, true}) {
            for (NormKind norm : {NormKind::kRmsNorm, NormKind::kLayerNorm}) {
              const double offset = norm == NormKind::kRmsNorm && D % 16 == 0 ? 1.0 : 0.0;
              count(run_fwd({norm, d, pd, true, fused, tokens, hq, hk, D, offset}, gen));
              count(run_bwd({norm, d, pd, true, fused, tokens, hq, hk, D, offset}, nullptr, gen));
            }
            count(run_fwd({NormKind::kRmsNorm, d, pd, false, fused, tokens, hq, hk, D, 0.0}, gen));
          }
        }
        // Every kernel-11 configuration of groups up to a warp, on the fused layout.
        for (const Kernel11Config& cfg : kernel11_candidates(d, D, true, lim)) {
          if (cfg.tpr > 32) continue;
          count(run_bwd({NormKind::kRmsNorm, d, pd, true, true, 300, 32, 8, D, 1.0}, &cfg, gen));
          count(run_bwd({NormKind::kLayerNorm, d, pd, true, false, 37, 4, 2, D, 0.0}, &cfg, gen));
        }
        // Every configuration of kernel 12's ring of row chunks (sm_90; rows of at most a warp of
        // vectors), on q and k of their own (the ring takes no head rows): 2500 tokens of 32 q and
        // 8 k heads are 80000 and 20000 rows, several chunks a block, so buffers are refilled and
        // phases flip; 37 tokens of 4 and 2 heads leave most blocks no chunk (their slots are
        // zeros). LNBWD_QUICK (the sanitizers are slow): the pick's configuration only (the
        // first), with 1200 tokens, still three or more chunks for some blocks of 132 SMs.
        if (lim.cc_major >= 9 && kernel12_has_code(0)) {
          bool first = true;
          for (const Kernel12Config& ch : kernel12_chunk_candidates(d, D, lim)) {
            // One row a group per chunk, as the pick (check.cu runs the kernel's other rows a
            // group on a tensor: the sets' launch is the same for every one).
            if (ch.nv != 1) continue;
            if (quick && !first) break;
            const int64_t many = quick ? 1200 : 2500;
            first = false;
            count(run_bwd({NormKind::kRmsNorm, d, pd, true, false, many, 32, 8, D, 1.0}, nullptr, gen, &ch));
            count(run_bwd({NormKind::kLayerNorm, d, pd, true, false, many, 32, 8, D, 0.0}, nullptr, gen, &ch));
            count(run_bwd({NormKind::kLayerNorm, d, pd, true, false, 37, 4, 2, D, 0.0}, nullptr, gen, &ch));
          }
        }
      }
    }
    std::printf("  %s done: %d cases so far, %d failures\n", dtype_name(d), cases, failures);
  }
  std::printf("qk check: %d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
