// qk_check's forward check (tests/cuda/qk_check.cu): norm_fwd_sets on one case against the
// float64 reference, both layouts.
#pragma once

#include <random>
#include <vector>

#include "forward/api.h"
#include "qk_cases.cuh"

namespace {

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
    if (c.fused && !v_heads_untouched(c, got[0], hx[0], label)) return 1;   // the input's bytes, untouched
  }
  return 0;
}

}  // namespace
