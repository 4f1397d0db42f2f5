// qk_check's cases (tests/cuda/qk_check.cu): a case's norm, dtypes, layout and head counts, where
// each set's rows lie in their buffers, the float64 statistics of a row, and the tolerances.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

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

// The fused layout's v heads, which both directions must leave as they were: `before` is the
// buffer's bytes before the launch (the forward's input, the backward's incoming cotangent),
// `got` after it. False (with a FAIL line) at the first token whose v heads changed.
bool v_heads_untouched(const Case& c, const std::vector<unsigned char>& got, const std::vector<unsigned char>& before,
                       const std::string& label) {
  const Layout L{c};
  const size_t it = dtype_item_bytes(c.dtype);
  for (int64_t t = 0; t < c.tokens; ++t) {
    const size_t v0 = (t * L.width() + (c.hq + c.hk) * c.D) * it, vn = c.hk * c.D * it;
    if (std::memcmp(got.data() + v0, before.data() + v0, vn) != 0) {
      std::printf("FAIL %s: token %lld's v heads changed\n", label.c_str(), (long long)t);
      return false;
    }
  }
  return true;
}

}  // namespace
