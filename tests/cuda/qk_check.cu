// Standalone check of QK-norm's one-launch kernels (norm_fwd_sets and norm_bwd_sets: two sets of
// head rows, common/head_rows.h), without JAX or XLA, against a float64 CPU reference:
//   * both layouts: q and k in buffers of their own (contiguous rows), and the fused projection
//     [tokens, (Hq + 2 Hk) * D] normalized in place, whose v heads must stay as they were (the
//     forward's input, the backward's incoming cotangent);
//   * layernorm (no bias) and RMSNorm (offset 0 and 1), every dtype, fp32 weights beside 16-bit
//     data, no weight (forward), head counts 1 to 64, a single token, rows up to the widest
//     kHeadRowsMaxBytes allows;
//   * the backward on every kernel-11 configuration of groups up to a warp (norm_bwd_sets_config)
//     and, on sm_90, every configuration of kernel 12's ring of row chunks
//     (norm_bwd_kernel12_chunk_sets), with enough tokens that a block refills its buffers, in
//     exactly the workspace norm_bwd_sets_workspace_bytes gives, twice to the same bits.
// As the other checks: exact-size cudaMalloc buffers and NaN-poisoned outputs, so that
// compute-sanitizer sees every stray access and unwritten output.
//
//   qk_check           (LNBWD_QUICK=1: fewer shapes, for the sanitizers; LNBWD_DTYPE=float32,
//                       bfloat16, float16 or float64: that dtype's cases only, so that a caller
//                       can run the dtypes side by side)
//
// Build:
//   nvcc -O3 -lineinfo -std=c++17 -arch=sm_90 -Iffi/kernels -Iffi -Icuda_harness tests/cuda/qk_check.cu ffi/registry.cc \
//        $(find ffi/kernels -name '*.cu') -o /tmp/qk_check
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "forward/api.h"
#include "harness.cuh"

namespace {

double tolerance(Dtype d) {
  return d == Dtype::kF64 ? 1e-12 : d == Dtype::kF32 ? 1e-5 : d == Dtype::kBF16 ? 1e-2 : 2e-3;
}

Dtype stat_of(Dtype d) { return d == Dtype::kF64 ? Dtype::kF64 : Dtype::kF32; }

struct Case {
  NormKind norm;
  Dtype dtype, pdtype;
  bool weight;     // forward only: the backward always has one
  bool fused;      // the fused projection, in place; else q and k in buffers of their own
  int64_t tokens, hq, hk, D;
  double offset;
};

// Where row r of set s (0: q, 1: k) starts, in elements of its buffer.
struct Layout {
  const Case& c;
  int64_t width() const { return (c.hq + 2 * c.hk) * c.D; }
  int64_t heads(int s) const { return s == 0 ? c.hq : c.hk; }
  int64_t rows(int s) const { return c.tokens * heads(s); }
  int64_t at(int s, int64_t r) const {
    if (!c.fused) return r * c.D;
    return (r / heads(s)) * width() + ((s == 1 ? c.hq : 0) + r % heads(s)) * c.D;
  }
  size_t elems(int s) const { return c.fused ? c.tokens * width() : rows(s) * c.D; }
};

// The statistics of one row: mean (0 for RMSNorm) and rstd.
void stats(const Case& c, const double* x, double* mean, double* rstd) {
  double m = 0, q = 0;
  if (c.norm == NormKind::kLayerNorm) {
    for (int64_t i = 0; i < c.D; ++i) m += x[i];
    m /= c.D;
  }
  for (int64_t i = 0; i < c.D; ++i) q += (x[i] - m) * (x[i] - m);
  *mean = m;
  *rstd = 1.0 / std::sqrt(q / c.D + 1e-5);
}

std::string label_of(const char* dir, const Case& c) {
  char s[200];
  std::snprintf(s, sizeof(s), "%s %s %s/%s%s %s tokens %lld heads %lld/%lld D %lld offset %g", dir,
                c.norm == NormKind::kRmsNorm ? "rmsnorm" : "layernorm", dtype_name(c.dtype), dtype_name(c.pdtype),
                c.weight ? "" : " no weight", c.fused ? "fused" : "separate", (long long)c.tokens, (long long)c.hq,
                (long long)c.hk, (long long)c.D, c.offset);
  return s;
}

int run_fwd(const Case& c, std::mt19937& gen) {
  std::normal_distribution<double> n(0.0, 1.0);
  const Layout L{c};
  const std::string label = label_of("fwd", c);
  const Dtype st = stat_of(c.dtype);
  std::vector<double> x[2], w[2];
  std::vector<unsigned char> hx[2], hw[2];
  for (int s = 0; s < (c.fused ? 1 : 2); ++s) {
    x[s].resize(L.elems(s));
    for (auto& v : x[s]) v = 0.5 + 2.0 * n(gen);
    x[s] = rounded(c.dtype, x[s], &hx[s]);
  }
  if (c.fused) { x[1] = x[0]; hx[1] = hx[0]; }
  for (int s = 0; s < 2; ++s) {
    w[s].resize(c.weight ? c.D : 0);
    for (auto& v : w[s]) v = (c.offset != 0 ? 0.0 : 1.0) + 0.1 * n(gen);
    w[s] = rounded(c.pdtype, w[s], &hw[s]);
  }
  // The reference, written over the input's values (so that the fused buffer's v heads stay).
  std::vector<double> ry[2] = {x[0], x[c.fused ? 0 : 1]}, rmean[2], rrstd[2];
  for (int s = 0; s < 2; ++s) {
    rmean[s].resize(L.rows(s));
    rrstd[s].resize(L.rows(s));
    std::vector<double>& y = ry[c.fused ? 0 : s];
    for (int64_t r = 0; r < L.rows(s); ++r) {
      const double* xr = x[s].data() + L.at(s, r);
      stats(c, xr, &rmean[s][r], &rrstd[s][r]);
      for (int64_t i = 0; i < c.D; ++i) {
        const double wi = c.weight ? (c.norm == NormKind::kRmsNorm ? c.offset : 0.0) + w[s][i] : 1.0;
        y[L.at(s, r) + i] = (xr[i] - rmean[s][r]) * rrstd[s][r] * wi;
      }
    }
  }
  if (c.fused) ry[1] = ry[0];
  const size_t it = dtype_item_bytes(c.dtype);
  std::vector<unsigned char> first[2];
  for (int run = 0; run < 2; ++run) {
    // The fused projection is normalized in place: a fresh copy of the input every run.
    DeviceBuf dx0 = upload(hx[0]), dx1 = upload(c.fused ? std::vector<unsigned char>{} : hx[1]);
    DeviceBuf dy0(c.fused ? 0 : L.elems(0) * it), dy1(c.fused ? 0 : L.elems(1) * it);
    DeviceBuf dw0 = upload(hw[0]), dw1 = upload(hw[1]);
    DeviceBuf mean0(L.rows(0) * dtype_item_bytes(st)), mean1(L.rows(1) * dtype_item_bytes(st));
    DeviceBuf rstd0(L.rows(0) * dtype_item_bytes(st)), rstd1(L.rows(1) * dtype_item_bytes(st));
    for (DeviceBuf* b : {&dy0, &dy1, &mean0, &mean1, &rstd0, &rstd1}) CHECK_CUDA(cudaMemset(b->ptr, 0xFF, b->bytes));
    NormFwdParams p[2] = {};
    for (int s = 0; s < 2; ++s) {
      void* xbuf = c.fused ? dx0.ptr : (s == 0 ? dx0.ptr : dx1.ptr);
      const size_t off = c.fused && s == 1 ? c.hq * c.D * it : 0;
      p[s].x = static_cast<char*>(xbuf) + off;
      p[s].y = c.fused ? static_cast<char*>(xbuf) + off : (s == 0 ? dy0.ptr : dy1.ptr);   // fused: in place
      p[s].mean = c.norm == NormKind::kLayerNorm ? (s == 0 ? mean0.ptr : mean1.ptr) : nullptr;
      p[s].rstd = s == 0 ? rstd0.ptr : rstd1.ptr;
      p[s].weight = c.weight ? (s == 0 ? dw0.ptr : dw1.ptr) : nullptr;
      p[s].weight_rows = c.weight ? 1 : 0;
      p[s].rows = L.rows(s);
      p[s].C = c.D;
      p[s].dtype = c.dtype;
      p[s].param_dtype = c.pdtype;
      p[s].eps = 1e-5;
      p[s].norm = c.norm;
      p[s].offset = c.offset;
      if (c.fused) p[s].heads = HeadRows{L.heads(s), L.width()};
    }
    cudaError_t err = norm_fwd_sets(p[0], p[1], 0);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      std::printf("FAIL %s: %s\n", label.c_str(), cudaGetErrorString(err));
      return 1;
    }
    std::vector<unsigned char> got[2];
    got[0] = c.fused ? download(dx0, dx0.bytes) : download(dy0, dy0.bytes);
    got[1] = c.fused ? got[0] : download(dy1, dy1.bytes);
    if (run == 1) {
      if (got[0] != first[0] || got[1] != first[1]) {
        std::printf("FAIL %s: a second run gave other bits\n", label.c_str());
        return 1;
      }
      break;
    }
    first[0] = got[0];
    first[1] = got[1];
    for (int s = 0; s < 2; ++s) {
      const double ey = rel_err_of(decode_all(c.dtype, got[s]), ry[s]);
      const double er = rel_err_of(decode_all(st, download(s == 0 ? rstd0 : rstd1, L.rows(s) * dtype_item_bytes(st))),
                                   rrstd[s]);
      const double em = c.norm == NormKind::kLayerNorm
                            ? rel_err_of(decode_all(st, download(s == 0 ? mean0 : mean1, L.rows(s) * dtype_item_bytes(st))),
                                         rmean[s])
                            : 0.0;
      const double ts = c.dtype == Dtype::kF64 ? 1e-12 : 1e-5;
      if (ey > tolerance(c.dtype) || er > ts || em > ts) {
        std::printf("FAIL %s: set %d rel_err y %.2e rstd %.2e mean %.2e\n", label.c_str(), s, ey, er, em);
        return 1;
      }
    }
    if (c.fused) {   // the v heads: the input's bytes, untouched
      for (int64_t t = 0; t < c.tokens; ++t) {
        const size_t v0 = (t * L.width() + (c.hq + c.hk) * c.D) * it, vn = c.hk * c.D * it;
        if (std::memcmp(got[0].data() + v0, hx[0].data() + v0, vn) != 0) {
          std::printf("FAIL %s: token %lld's v heads changed\n", label.c_str(), (long long)t);
          return 1;
        }
      }
    }
  }
  return 0;
}

// cfg: a kernel-11 configuration to force (norm_bwd_sets_config), chunks: one of kernel 12's
// ring of row chunks (norm_bwd_kernel12_chunk_sets); neither: norm_bwd_sets' pick.
int run_bwd(const Case& c, const Kernel11Config* cfg, std::mt19937& gen, const Kernel12Config* chunks = nullptr) {
  std::normal_distribution<double> n(0.0, 1.0);
  const Layout L{c};
  std::string label = label_of("bwd", c);
  if (cfg) {
    char s[120];
    std::snprintf(s, sizeof(s), " cfg tpr %d nv %d%s%s", cfg->tpr, cfg->nv, cfg->prefetch ? " prefetch" : "",
                  cfg->reg_sums ? " reg sums" : "");
    label += s;
  }
  if (chunks) {
    char s[120];
    std::snprintf(s, sizeof(s), " chunks tpr %d groups %d nb %d", chunks->tpr, chunks->groups, chunks->nb);
    label += s;
  }
  const Dtype st = stat_of(c.dtype), pd = c.pdtype;
  const size_t it = dtype_item_bytes(c.dtype);
  const int nsets = c.fused ? 1 : 2;
  std::vector<double> x[2], dy[2], w[2], mean[2], rstd[2];
  std::vector<unsigned char> hx[2], hdy[2], hw[2], hmean[2], hrstd[2];
  for (int s = 0; s < nsets; ++s) {
    x[s].resize(L.elems(s));
    dy[s].resize(L.elems(s));
    for (auto& v : x[s]) v = 0.5 + 2.0 * n(gen);
    for (auto& v : dy[s]) v = n(gen);
    x[s] = rounded(c.dtype, x[s], &hx[s]);
    dy[s] = rounded(c.dtype, dy[s], &hdy[s]);
  }
  if (c.fused) { x[1] = x[0]; dy[1] = dy[0]; }
  std::vector<double> rdx[2] = {dy[0], dy[c.fused ? 0 : 1]}, rdw(2 * c.D, 0.0);
  for (int s = 0; s < 2; ++s) {
    w[s].resize(c.D);
    for (auto& v : w[s]) v = (c.offset != 0 ? 0.0 : 1.0) + 0.1 * n(gen);
    w[s] = rounded(pd, w[s], &hw[s]);
    mean[s].resize(L.rows(s));
    rstd[s].resize(L.rows(s));
    for (int64_t r = 0; r < L.rows(s); ++r) stats(c, x[s].data() + L.at(s, r), &mean[s][r], &rstd[s][r]);
    mean[s] = rounded(st, mean[s], &hmean[s]);
    rstd[s] = rounded(st, rstd[s], &hrstd[s]);
    // g = (offset + w) dy, a = mean(g) (layernorm), b = mean(g xhat), dx = (g - a - xhat b) rstd,
    // dweight = sum over the set's rows of dy xhat.
    const double off = c.norm == NormKind::kRmsNorm ? c.offset : 0.0;
    std::vector<double>& dx = rdx[c.fused ? 0 : s];
    for (int64_t r = 0; r < L.rows(s); ++r) {
      const int64_t at = L.at(s, r);
      double a = 0, b = 0;
      for (int64_t i = 0; i < c.D; ++i) {
        const double g = (off + w[s][i]) * dy[s][at + i], xh = (x[s][at + i] - mean[s][r]) * rstd[s][r];
        a += g;
        b += g * xh;
      }
      a = c.norm == NormKind::kLayerNorm ? a / c.D : 0.0;
      b /= c.D;
      for (int64_t i = 0; i < c.D; ++i) {
        const double xh = (x[s][at + i] - mean[s][r]) * rstd[s][r];
        dx[at + i] = ((off + w[s][i]) * dy[s][at + i] - a - xh * b) * rstd[s][r];
        rdw[s * c.D + i] += dy[s][at + i] * xh;
      }
    }
  }
  if (c.fused) rdx[1] = rdx[0];
  LaunchPlan plan;
  CHECK_CUDA(norm_bwd_sets_workspace_bytes(c.dtype, L.rows(0), L.rows(1), c.D, c.fused, 0, &plan));
  DeviceBuf ws(plan.workspace_bytes), dwt(2 * c.D * dtype_item_bytes(pd));
  DeviceBuf xin0 = upload(hx[0]), xin1 = upload(c.fused ? std::vector<unsigned char>{} : hx[1]);
  DeviceBuf wq = upload(hw[0]), wk = upload(hw[1]);
  DeviceBuf m0 = upload(hmean[0]), m1 = upload(hmean[1]), r0 = upload(hrstd[0]), r1 = upload(hrstd[1]);
  std::vector<unsigned char> first[3];
  for (int run = 0; run < 2; ++run) {
    // dy in: the fused buffer is the cotangent, written over in place by dx (its v heads stay).
    DeviceBuf dy0 = upload(hdy[0]), dy1 = upload(c.fused ? std::vector<unsigned char>{} : hdy[1]);
    DeviceBuf dx0(c.fused ? 0 : L.elems(0) * it), dx1(c.fused ? 0 : L.elems(1) * it);
    for (DeviceBuf* b : {&dx0, &dx1, &dwt, &ws}) CHECK_CUDA(cudaMemset(b->ptr, 0xFF, b->bytes));
    NormBwdParams p[2] = {};
    for (int s = 0; s < 2; ++s) {
      const size_t off = c.fused && s == 1 ? c.hq * c.D * it : 0;
      p[s].dy = static_cast<char*>(c.fused || s == 0 ? dy0.ptr : dy1.ptr) + off;
      p[s].dx = c.fused ? static_cast<char*>(dy0.ptr) + off : (s == 0 ? dx0.ptr : dx1.ptr);
      p[s].x = static_cast<char*>(c.fused || s == 0 ? xin0.ptr : xin1.ptr) + off;
      p[s].weight = s == 0 ? wq.ptr : wk.ptr;
      p[s].mean = c.norm == NormKind::kLayerNorm ? (s == 0 ? m0.ptr : m1.ptr) : nullptr;
      p[s].rstd = s == 0 ? r0.ptr : r1.ptr;
      p[s].rows = L.rows(s);
      p[s].C = c.D;
      p[s].segments = 1;
      p[s].dtype = c.dtype;
      p[s].weight_f32 = pd != c.dtype;
      p[s].norm = c.norm;
      p[s].offset = c.offset;
      p[s].device = 0;
      if (c.fused) p[s].heads = HeadRows{L.heads(s), L.width()};
    }
    p[0].dweight = dwt.ptr;
    p[0].workspace = ws.ptr;
    p[0].workspace_bytes = ws.bytes;
    cudaError_t err = cfg      ? norm_bwd_sets_config(p[0], p[1], *cfg, 0)
                      : chunks ? norm_bwd_kernel12_chunk_sets(p[0], p[1], *chunks, 0)
                               : norm_bwd_sets(p[0], p[1], 0);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      std::printf("FAIL %s: %s (workspace %zu bytes)\n", label.c_str(), cudaGetErrorString(err), ws.bytes);
      return 1;
    }
    std::vector<unsigned char> got[3];
    got[0] = c.fused ? download(dy0, dy0.bytes) : download(dx0, dx0.bytes);
    got[1] = c.fused ? got[0] : download(dx1, dx1.bytes);
    got[2] = download(dwt, dwt.bytes);
    if (run == 1) {
      for (int i = 0; i < 3; ++i) {
        if (got[i] != first[i]) {
          std::printf("FAIL %s: a second run gave other bits\n", label.c_str());
          return 1;
        }
      }
      break;
    }
    for (int i = 0; i < 3; ++i) first[i] = got[i];
    const double tw = c.dtype == Dtype::kF64 ? 1e-12 : pd == Dtype::kF32 ? 1e-5 : tolerance(pd);
    for (int s = 0; s < 2; ++s) {
      const double ex = rel_err_of(decode_all(c.dtype, got[s]), rdx[s]);
      const std::vector<double> gw = decode_all(pd, got[2]);
      const double ew = rel_err_of(std::vector<double>(gw.begin() + s * c.D, gw.begin() + (s + 1) * c.D),
                                   std::vector<double>(rdw.begin() + s * c.D, rdw.begin() + (s + 1) * c.D));
      if (ex > tolerance(c.dtype) || ew > tw) {
        std::printf("FAIL %s: set %d rel_err dx %.2e dweight %.2e (workspace %zu bytes)\n", label.c_str(), s, ex, ew,
                    ws.bytes);
        return 1;
      }
    }
    if (c.fused) {   // the v heads: the incoming cotangent's bytes, untouched
      for (int64_t t = 0; t < c.tokens; ++t) {
        const size_t v0 = (t * L.width() + (c.hq + c.hk) * c.D) * it, vn = c.hk * c.D * it;
        if (std::memcmp(got[0].data() + v0, hdy[0].data() + v0, vn) != 0) {
          std::printf("FAIL %s: token %lld's v heads changed\n", label.c_str(), (long long)t);
          return 1;
        }
      }
    }
  }
  return 0;
}

}  // namespace

int main() {
  // Line-buffered, so that a run stopped by a time limit still shows how far it got.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const bool quick = std::getenv("LNBWD_QUICK") != nullptr;
  const char* only = std::getenv("LNBWD_DTYPE");
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
        // vectors), on both layouts: 2500 tokens of 32 q and 8 k heads are 80000 and 20000 rows,
        // several chunks a block, so buffers are refilled and phases flip; a chunk of k heads spans
        // several tokens (several copies), one of q heads part of one. LNBWD_QUICK (the
        // sanitizers are slow): the pick's configuration only (the first), with 1200 tokens,
        // still three or more chunks for some blocks of 132 SMs.
        if (lim.cc_major >= 9 && kernel12_has_code(0)) {
          bool first = true;
          for (const Kernel12Config& ch : kernel12_chunk_candidates(d, D, lim)) {
            if (ch.nv != 1) continue;   // the sets' kernel takes one row a group per chunk
            if (quick && !first) break;
            const int64_t many = quick ? 1200 : 2500;
            first = false;
            count(run_bwd({NormKind::kRmsNorm, d, pd, true, true, many, 32, 8, D, 1.0}, nullptr, gen, &ch));
            count(run_bwd({NormKind::kLayerNorm, d, pd, true, false, many, 32, 8, D, 0.0}, nullptr, gen, &ch));
            count(run_bwd({NormKind::kLayerNorm, d, pd, true, true, 37, 4, 2, D, 0.0}, nullptr, gen, &ch));
          }
        }
      }
    }
    std::printf("  %s done: %d cases so far, %d failures\n", dtype_name(d), cases, failures);
  }
  std::printf("qk check: %d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
