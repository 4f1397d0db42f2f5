// qk_check's backward check (tests/cuda/qk_check.cu): norm_bwd_sets (or a forced configuration)
// on one case against the float64 reference, in exactly the workspace
// norm_bwd_sets_workspace_bytes gives, twice to the same bits.
#pragma once

#include <random>
#include <vector>

#include "qk_cases.cuh"

namespace {

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
    if (c.fused && !v_heads_untouched(c, got[0], hdy[0], label)) return 1;   // the incoming cotangent's bytes, untouched
  }
  return 0;
}

}  // namespace
