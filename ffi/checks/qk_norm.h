// Argument checks of the QK-norm targets (targets.h: qk_norm_fwd, qk_norm_fused_fwd, qk_norm_bwd,
// qk_norm_fused_bwd), shared by their CPU and CUDA handlers: plain host C++, no CUDA.
//
// QK-norm normalizes each head of attention's q and k (one row of D = head_dim values) over D,
// with one weight (D,) for all q heads and one for all k heads. A target takes one of two forms:
//   separate  q [rows_q, D] and k [rows_k, D]: each row is one head (rows = tokens * heads);
//   fused     qkv [tokens, width], width = (q_heads + 2 * kv_heads) * D: per token the q heads,
//             then the k heads, then the v heads. The q set's row r (r = token * q_heads + head)
//             starts at element (r / q_heads) * width + (r % q_heads) * D, the k set's at
//             (r / kv_heads) * width + (q_heads + r % kv_heads) * D; the v heads pass through.
// Both norms run through the same targets: the int32 attribute 'norm' holds a NormKind value
// (ToNormKind), and the norm decides whether a mean is saved (layernorm) or is a (0,) array
// (rmsnorm). Each target has one entry point below, which checks every buffer and attribute and
// fills a QkShape; a handler calls it before anything else, and reads its sizes from the shape.
// Python builds its calls right (jax_lnbwd/ops/qk.py); these checks exist for direct
// jax.ffi.ffi_call users and exported programs, so that no kernel runs on buffers it does not
// expect. Errors name the target's function, the argument, its shape and what was expected, e.g.
//   qk_norm_fwd: 'k' has shape (6, 9) but expected (6, 8): k's head_dim must be q's (q has shape (4, 8))
//   qk_norm_fused_fwd: 'qkv' has shape (2, 100) but its width 100 is not a multiple of
//       q_heads + 2 * kv_heads = 6 (q_heads=4, kv_heads=1): expected (2, 6 * D) for a head_dim D >= 1
//   qk_norm_bwd: 'norm' is 7 but expected 0 (layernorm) or 1 (rmsnorm)
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>

#include "checks/common.h"
#include "errors/ffi_errors.h"
#include "norm_kind.h"

namespace lnbwd {

// What the checks found, for the handlers: the sizes of both sets of rows and their layout.
struct QkShape {
  int64_t rows_q, rows_k;   // rows (heads) of each set: separate form, q's and k's rows;
                            // fused form, tokens * q_heads and tokens * kv_heads
  int64_t D;                // head_dim: the elements of one row, the axis normalized over
  int64_t tokens, q_heads, kv_heads, width;   // fused form only (width = (q_heads + 2 * kv_heads) * D);
                                              // 0 in the separate form
  int64_t q_weight_rows, k_weight_rows;       // 0 (absent) or 1; the backward's are always 1
  ffi::DataType param_dtype;                  // the weights' dtype (the data's when both are absent):
                                              // the data's, or float32 beside bfloat16/float16 data
  NormKind norm;                              // the 'norm' attribute's kind
};

// The 'norm' attribute's values are NormKind's, which jax_lnbwd/norms.py writes as Norm.kind.
static_assert(static_cast<int>(NormKind::kLayerNorm) == 0 && static_cast<int>(NormKind::kRmsNorm) == 1,
              "the 'norm' attribute of the qk_norm targets is NormKind's value: 0 layernorm, 1 rmsnorm");

// The 'norm' attribute as a NormKind; any value that is not a NormKind's is an error.
inline ffi::Error ToNormKind(int32_t attr, NormKind* out, const char* fn) {
  switch (attr) {
    case static_cast<int32_t>(NormKind::kLayerNorm): *out = NormKind::kLayerNorm; return ffi::Error::Success();
    case static_cast<int32_t>(NormKind::kRmsNorm): *out = NormKind::kRmsNorm; return ffi::Error::Success();
    default: return ArgError("'norm' is " + std::to_string(attr) + " but expected 0 (layernorm) or 1 (rmsnorm)", fn);
  }
}

// The norm's name, for messages.
constexpr const char* NormName(NormKind k) { return k == NormKind::kLayerNorm ? "layernorm" : "rmsnorm"; }

// offset: rmsnorm's (the 1 of Gemma's 1 + w), any finite number; layernorm takes none (0).
inline ffi::Error CheckQkOffset(double offset, NormKind norm, const char* fn) {
  if (auto e = CheckOffset(offset, fn); e.failure()) return e;
  if (norm == NormKind::kLayerNorm && offset != 0.0) {
    return ArgError("'offset' is " + std::to_string(offset) + " but layernorm takes none: expected 0", fn);
  }
  return ffi::Error::Success();
}

// q (separate form): [rows, D], 1 <= D < 2^31, of a dtype the kernels take. Sets *rows and *D.
inline ffi::Error CheckQkRows(const char* name, const ffi::AnyBuffer& a, int64_t* rows, int64_t* D, const char* fn) {
  const auto d = a.dimensions();
  if (d.size() != 2) return ArgError(std::string("'") + name + "' has shape " + ShapeStr(d) + " but expected (rows, D)", fn);
  if (d[1] < 1 || d[1] > INT32_MAX) {
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(d) +
                        " but its head_dim D (the last axis) must be at least 1 and below 2^31",
                    fn);
  }
  if (auto e = CheckDataDtype(name, a.element_type(), fn); e.failure()) return e;
  *rows = d[0];
  *D = d[1];
  return ffi::Error::Success();
}

// k beside q (separate form): [rows_k, D] with q's D and dtype. Sets *rows.
inline ffi::Error CheckQkRowsLike(const char* name, const ffi::AnyBuffer& a, const ffi::AnyBuffer& q, int64_t* rows,
                                  const char* fn) {
  const auto d = a.dimensions();
  const int64_t D = q.dimensions()[1];
  if (d.size() != 2 || d[1] != D) {
    const std::string want = d.size() == 2 ? DimsStr({2, d[0], D}) : "(rows, " + std::to_string(D) + ")";
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(d) + " but expected " + want + ": " + name +
                        "'s head_dim must be q's (q has shape " + ShapeStr(q.dimensions()) + ")",
                    fn);
  }
  if (a.element_type() != q.element_type()) {
    return ArgError(std::string("'") + name + "' has dtype " + DtypeName(a.element_type()) + " but expected " +
                        DtypeName(q.element_type()) + " (q's dtype)",
                    fn);
  }
  *rows = d[0];
  return ffi::Error::Success();
}

// qkv (fused form): [tokens, width], width = (q_heads + 2 * kv_heads) * D for an integer
// 1 <= D < 2^31, q_heads and kv_heads at least 1, of a dtype the kernels take. Sets the fused
// form's sizes in *s: tokens, q_heads, kv_heads, width, D, rows_q and rows_k.
inline ffi::Error CheckQkFusedRows(const char* name, const ffi::AnyBuffer& qkv, int64_t q_heads, int64_t kv_heads,
                                   QkShape* s, const char* fn) {
  if (q_heads < 1) return ArgError("'q_heads' is " + std::to_string(q_heads) + " but expected at least 1", fn);
  if (kv_heads < 1) return ArgError("'kv_heads' is " + std::to_string(kv_heads) + " but expected at least 1", fn);
  const auto d = qkv.dimensions();
  if (d.size() != 2) {
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(d) +
                        " but expected (tokens, (q_heads + 2 * kv_heads) * D)",
                    fn);
  }
  const int64_t tokens = d[0], width = d[1];
  const std::string heads_str = "(q_heads=" + std::to_string(q_heads) + ", kv_heads=" + std::to_string(kv_heads) + ")";
  // Heads beyond the width leave D < 1; below it their sum cannot overflow.
  if (q_heads > width || kv_heads > width || width % (q_heads + 2 * kv_heads) != 0) {
    const std::string heads = q_heads <= width && kv_heads <= width ? std::to_string(q_heads + 2 * kv_heads)
                                                                     : "q_heads + 2 * kv_heads";
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(d) + " but its width " +
                        std::to_string(width) + " is not a multiple of q_heads + 2 * kv_heads = " + heads + " " +
                        heads_str + ": expected (" + std::to_string(tokens) + ", " + heads +
                        " * D) for a head_dim D >= 1",
                    fn);
  }
  const int64_t D = width / (q_heads + 2 * kv_heads);
  if (D > INT32_MAX) {
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(d) + " but its head_dim D = " +
                        std::to_string(D) + " " + heads_str + " must be below 2^31",
                    fn);
  }
  if (auto e = CheckDataDtype(name, qkv.element_type(), fn); e.failure()) return e;
  s->tokens = tokens;
  s->q_heads = q_heads;
  s->kv_heads = kv_heads;
  s->width = width;
  s->D = D;
  s->rows_q = tokens * q_heads;
  s->rows_k = tokens * kv_heads;
  return ffi::Error::Success();
}

// q_weight and k_weight beside data of dtype t and head_dim D: each (0, D) (absent) or (1, D)
// (`required`, the backward's: (1, D) only, the caller passing ones for an absent weight), of
// dtype t or float32 beside 16-bit t; present ones share one dtype. Sets the weights' rows and
// param_dtype in *s.
inline ffi::Error CheckQkWeights(const ffi::AnyBuffer& q_weight, const ffi::AnyBuffer& k_weight, int64_t D,
                                 ffi::DataType t, bool required, QkShape* s, const char* fn) {
  const struct {
    const char* name;
    const ffi::AnyBuffer& buf;
    int64_t* rows;
  } weights[] = {{"q_weight", q_weight, &s->q_weight_rows}, {"k_weight", k_weight, &s->k_weight_rows}};
  for (const auto& w : weights) {
    const auto d = w.buf.dimensions();
    if (d.size() != 2 || d[1] != D || d[0] > 1 || d[0] < (required ? 1 : 0)) {
      const std::string one = DimsStr({2, 1, D});
      const std::string want = required ? one + " (the backward takes both weights: ones for an absent one)"
                                        : DimsStr({2, 0, D}) + " (absent) or " + one;
      return ArgError(std::string("'") + w.name + "' has shape " + ShapeStr(d) + " but expected " + want +
                          " for head_dim D=" + std::to_string(D),
                      fn);
    }
    if (!ParamDtypeAllowed(w.buf.element_type(), t)) {
      return ArgError(std::string("'") + w.name + "' has dtype " + DtypeName(w.buf.element_type()) +
                          " but expected " + DtypeName(t) + (Is16Bit(t) ? " or float32" : "") + " for data of dtype " +
                          DtypeName(t),
                      fn);
    }
    *w.rows = d[0];
  }
  if (s->q_weight_rows > 0 && s->k_weight_rows > 0 && q_weight.element_type() != k_weight.element_type()) {
    return ArgError(std::string("'q_weight' has dtype ") + DtypeName(q_weight.element_type()) + " but 'k_weight' has " +
                        DtypeName(k_weight.element_type()) + "; pass both in one dtype",
                    fn);
  }
  s->param_dtype = s->q_weight_rows > 0 ? q_weight.element_type()
                   : s->k_weight_rows > 0 ? k_weight.element_type()
                                          : t;
  return ffi::Error::Success();
}

// One buffer's expected dims and dtype, for CheckQkBuffers.
struct QkExpect {
  const char* name;
  const ffi::AnyBuffer& buf;
  Dims dims;
  ffi::DataType dtype;
  bool any_dtype;     // rmsnorm's (0,) mean: nothing is read or written, its dtype is not looked at
  const char* note;   // said after the expected shape, or null: e.g. "(tokens * q_heads)"
};

// The first buffer of `list` whose dims or dtype differ from its expectation, as an error whose
// text ends with context() (built only then, e.g. " for q of shape (4, 8)"); success if none.
template <size_t N, typename Context>
ffi::Error CheckQkBuffers(const QkExpect (&list)[N], Context context, const char* fn) {
  for (const QkExpect& e : list) {
    if (!HasDims(e.buf, e.dims)) {
      return ArgError(std::string("'") + e.name + "' has shape " + ShapeStr(e.buf.dimensions()) + " but expected " +
                          DimsStr(e.dims) + (e.note ? std::string(" ") + e.note : std::string()) + context(),
                      fn);
    }
    if (!e.any_dtype && e.buf.element_type() != e.dtype) {
      return ArgError(std::string("'") + e.name + "' has dtype " + DtypeName(e.buf.element_type()) +
                          " but expected " + DtypeName(e.dtype) + context(),
                      fn);
    }
  }
  return ffi::Error::Success();
}

// The statistics of one set of `rows` rows: mean (rows,) for layernorm, (0,) for rmsnorm (which
// saves none); rstd (rows,); both in the statistics' dtype (StatsDtype).
inline QkExpect QkMean(const char* name, const ffi::AnyBuffer& mean, int64_t rows, NormKind norm, ffi::DataType t,
                       const char* note) {
  const bool centered = norm == NormKind::kLayerNorm;
  return {name, mean, {1, centered ? rows : 0, 0}, StatsDtype(t), !centered, centered ? note : "(rmsnorm saves no mean)"};
}

// The backward's workspace: [bytes] uint8, scratch for the CUDA kernels (its size is the CUDA
// handler's to check; the CPU handler does not use it).
inline ffi::Error CheckQkWorkspace(const ffi::AnyBuffer& workspace, const char* fn) {
  if (workspace.dimensions().size() != 1 || workspace.element_type() != ffi::DataType::U8) {
    return ArgError("'workspace' has shape " + ShapeStr(workspace.dimensions()) + " and dtype " +
                        DtypeName(workspace.element_type()) + " but expected (bytes,) of dtype uint8",
                    fn);
  }
  return ffi::Error::Success();
}

// --- Each target's entry point ---------------------------------------------------------------

// Target qk_norm_fwd: q [rows_q, D] and k [rows_k, D] of one dtype and D; the weights (0 or 1,
// D); q_out, k_out like q and k; q_mean, q_rstd [rows_q] and k_mean, k_rstd [rows_k] (means (0,)
// for rmsnorm); eps > 0; offset finite (0 for layernorm); norm a NormKind value.
inline ffi::Error CheckQkNormFwdArgs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& q_weight,
                                     const ffi::AnyBuffer& k_weight, const ffi::AnyBuffer& q_out,
                                     const ffi::AnyBuffer& k_out, const ffi::AnyBuffer& q_mean,
                                     const ffi::AnyBuffer& q_rstd, const ffi::AnyBuffer& k_mean,
                                     const ffi::AnyBuffer& k_rstd, double eps, double offset, int32_t norm_attr,
                                     QkShape* shape) {
  const char* fn = "qk_norm_fwd";
  QkShape s{};
  if (auto e = ToNormKind(norm_attr, &s.norm, fn); e.failure()) return e;
  if (auto e = CheckQkRows("q", q, &s.rows_q, &s.D, fn); e.failure()) return e;
  if (auto e = CheckQkRowsLike("k", k, q, &s.rows_k, fn); e.failure()) return e;
  if (auto e = CheckEps(eps, fn); e.failure()) return e;
  if (auto e = CheckQkOffset(offset, s.norm, fn); e.failure()) return e;
  const ffi::DataType t = q.element_type();
  if (auto e = CheckQkWeights(q_weight, k_weight, s.D, t, /*required=*/false, &s, fn); e.failure()) return e;
  const QkExpect outputs[] = {
      {"q_out", q_out, {2, s.rows_q, s.D}, t, false, "(q's shape)"},
      {"k_out", k_out, {2, s.rows_k, s.D}, t, false, "(k's shape)"},
      QkMean("q_mean", q_mean, s.rows_q, s.norm, t, "(q's rows)"),
      {"q_rstd", q_rstd, {1, s.rows_q, 0}, StatsDtype(t), false, "(q's rows)"},
      QkMean("k_mean", k_mean, s.rows_k, s.norm, t, "(k's rows)"),
      {"k_rstd", k_rstd, {1, s.rows_k, 0}, StatsDtype(t), false, "(k's rows)"},
  };
  auto context = [&] {
    return std::string(" for ") + NormName(s.norm) + " of q with shape " + ShapeStr(q.dimensions()) +
           " and k with shape " + ShapeStr(k.dimensions()) + " of dtype " + DtypeName(t);
  };
  if (auto e = CheckQkBuffers(outputs, context, fn); e.failure()) return e;
  *shape = s;
  return ffi::Error::Success();
}

// Target qk_norm_fused_fwd: qkv [tokens, (q_heads + 2 * kv_heads) * D]; the weights (0 or 1, D);
// qkv_out like qkv; q_mean, q_rstd [tokens * q_heads] and k_mean, k_rstd [tokens * kv_heads]
// (means (0,) for rmsnorm); eps, offset and norm as qk_norm_fwd's; q_heads, kv_heads >= 1.
inline ffi::Error CheckQkNormFusedFwdArgs(const ffi::AnyBuffer& qkv, const ffi::AnyBuffer& q_weight,
                                          const ffi::AnyBuffer& k_weight, const ffi::AnyBuffer& qkv_out,
                                          const ffi::AnyBuffer& q_mean, const ffi::AnyBuffer& q_rstd,
                                          const ffi::AnyBuffer& k_mean, const ffi::AnyBuffer& k_rstd, double eps,
                                          double offset, int32_t norm_attr, int64_t q_heads, int64_t kv_heads,
                                          QkShape* shape) {
  const char* fn = "qk_norm_fused_fwd";
  QkShape s{};
  if (auto e = ToNormKind(norm_attr, &s.norm, fn); e.failure()) return e;
  if (auto e = CheckQkFusedRows("qkv", qkv, q_heads, kv_heads, &s, fn); e.failure()) return e;
  if (auto e = CheckEps(eps, fn); e.failure()) return e;
  if (auto e = CheckQkOffset(offset, s.norm, fn); e.failure()) return e;
  const ffi::DataType t = qkv.element_type();
  if (auto e = CheckQkWeights(q_weight, k_weight, s.D, t, /*required=*/false, &s, fn); e.failure()) return e;
  const QkExpect outputs[] = {
      {"qkv_out", qkv_out, {2, s.tokens, s.width}, t, false, "(qkv's shape)"},
      QkMean("q_mean", q_mean, s.rows_q, s.norm, t, "(tokens * q_heads)"),
      {"q_rstd", q_rstd, {1, s.rows_q, 0}, StatsDtype(t), false, "(tokens * q_heads)"},
      QkMean("k_mean", k_mean, s.rows_k, s.norm, t, "(tokens * kv_heads)"),
      {"k_rstd", k_rstd, {1, s.rows_k, 0}, StatsDtype(t), false, "(tokens * kv_heads)"},
  };
  auto context = [&] {
    return std::string(" for ") + NormName(s.norm) + " of qkv with shape " + ShapeStr(qkv.dimensions()) +
           " of dtype " + DtypeName(t) + ", q_heads=" + std::to_string(q_heads) +
           ", kv_heads=" + std::to_string(kv_heads);
  };
  if (auto e = CheckQkBuffers(outputs, context, fn); e.failure()) return e;
  *shape = s;
  return ffi::Error::Success();
}

// Target qk_norm_bwd: dq_out and q [rows_q, D], dk_out and k [rows_k, D], all of one dtype and
// D; the weights (1, D), one dtype (the data's, or float32 beside 16-bit data); the saved
// q_mean, q_rstd [rows_q] and k_mean, k_rstd [rows_k] (means (0,) for rmsnorm); dq, dk like q
// and k; dweights (2, D) of the weights' dtype (q's row, then k's); workspace [bytes] uint8 (its size
// is the CUDA handler's to check); offset finite (0 for layernorm); norm a NormKind value.
inline ffi::Error CheckQkNormBwdArgs(const ffi::AnyBuffer& dq_out, const ffi::AnyBuffer& dk_out,
                                     const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                     const ffi::AnyBuffer& q_weight, const ffi::AnyBuffer& k_weight,
                                     const ffi::AnyBuffer& q_mean, const ffi::AnyBuffer& q_rstd,
                                     const ffi::AnyBuffer& k_mean, const ffi::AnyBuffer& k_rstd,
                                     const ffi::AnyBuffer& dq, const ffi::AnyBuffer& dk,
                                     const ffi::AnyBuffer& dweights, const ffi::AnyBuffer& workspace,
                                     double offset, int32_t norm_attr,
                                     QkShape* shape) {
  const char* fn = "qk_norm_bwd";
  QkShape s{};
  if (auto e = ToNormKind(norm_attr, &s.norm, fn); e.failure()) return e;
  if (auto e = CheckQkRows("q", q, &s.rows_q, &s.D, fn); e.failure()) return e;
  if (auto e = CheckQkRowsLike("k", k, q, &s.rows_k, fn); e.failure()) return e;
  if (auto e = CheckQkOffset(offset, s.norm, fn); e.failure()) return e;
  const ffi::DataType t = q.element_type();
  if (auto e = CheckQkWeights(q_weight, k_weight, s.D, t, /*required=*/true, &s, fn); e.failure()) return e;
  const ffi::DataType stat = StatsDtype(t), pt = s.param_dtype;
  const QkExpect buffers[] = {
      {"dq_out", dq_out, {2, s.rows_q, s.D}, t, false, "(q's shape)"},
      {"dk_out", dk_out, {2, s.rows_k, s.D}, t, false, "(k's shape)"},
      QkMean("q_mean", q_mean, s.rows_q, s.norm, t, "(q's rows)"),
      {"q_rstd", q_rstd, {1, s.rows_q, 0}, stat, false, "(q's rows)"},
      QkMean("k_mean", k_mean, s.rows_k, s.norm, t, "(k's rows)"),
      {"k_rstd", k_rstd, {1, s.rows_k, 0}, stat, false, "(k's rows)"},
      {"dq", dq, {2, s.rows_q, s.D}, t, false, "(q's shape)"},
      {"dk", dk, {2, s.rows_k, s.D}, t, false, "(k's shape)"},
      {"dweights", dweights, {2, 2, s.D}, pt, false, "(q's and k's dweight rows)"},
  };
  auto context = [&] {
    return std::string(" for ") + NormName(s.norm) + " of q with shape " + ShapeStr(q.dimensions()) +
           " and k with shape " + ShapeStr(k.dimensions()) + " of dtype " + DtypeName(t) + ", weights of dtype " +
           DtypeName(pt);
  };
  if (auto e = CheckQkBuffers(buffers, context, fn); e.failure()) return e;
  if (auto e = CheckQkWorkspace(workspace, fn); e.failure()) return e;
  *shape = s;
  return ffi::Error::Success();
}

// Target qk_norm_fused_bwd: dqkv_out and qkv [tokens, (q_heads + 2 * kv_heads) * D] of one
// dtype; the weights (1, D) as qk_norm_bwd's; the saved q_mean, q_rstd [tokens * q_heads] and
// k_mean, k_rstd [tokens * kv_heads] (means (0,) for rmsnorm); dqkv like qkv; dweights
// (2, D) of the weights' dtype (q's row, then k's); workspace [bytes] uint8; offset and norm as
// qk_norm_bwd's; q_heads, kv_heads >= 1.
inline ffi::Error CheckQkNormFusedBwdArgs(const ffi::AnyBuffer& dqkv_out, const ffi::AnyBuffer& qkv,
                                          const ffi::AnyBuffer& q_weight, const ffi::AnyBuffer& k_weight,
                                          const ffi::AnyBuffer& q_mean, const ffi::AnyBuffer& q_rstd,
                                          const ffi::AnyBuffer& k_mean, const ffi::AnyBuffer& k_rstd,
                                          const ffi::AnyBuffer& dqkv, const ffi::AnyBuffer& dweights,
                                          const ffi::AnyBuffer& workspace,
                                          double offset, int32_t norm_attr, int64_t q_heads, int64_t kv_heads,
                                          QkShape* shape) {
  const char* fn = "qk_norm_fused_bwd";
  QkShape s{};
  if (auto e = ToNormKind(norm_attr, &s.norm, fn); e.failure()) return e;
  if (auto e = CheckQkFusedRows("qkv", qkv, q_heads, kv_heads, &s, fn); e.failure()) return e;
  if (auto e = CheckQkOffset(offset, s.norm, fn); e.failure()) return e;
  const ffi::DataType t = qkv.element_type();
  if (auto e = CheckQkWeights(q_weight, k_weight, s.D, t, /*required=*/true, &s, fn); e.failure()) return e;
  const ffi::DataType stat = StatsDtype(t), pt = s.param_dtype;
  const QkExpect buffers[] = {
      {"dqkv_out", dqkv_out, {2, s.tokens, s.width}, t, false, "(qkv's shape)"},
      QkMean("q_mean", q_mean, s.rows_q, s.norm, t, "(tokens * q_heads)"),
      {"q_rstd", q_rstd, {1, s.rows_q, 0}, stat, false, "(tokens * q_heads)"},
      QkMean("k_mean", k_mean, s.rows_k, s.norm, t, "(tokens * kv_heads)"),
      {"k_rstd", k_rstd, {1, s.rows_k, 0}, stat, false, "(tokens * kv_heads)"},
      {"dqkv", dqkv, {2, s.tokens, s.width}, t, false, "(qkv's shape)"},
      {"dweights", dweights, {2, 2, s.D}, pt, false, "(q's and k's dweight rows)"},
  };
  auto context = [&] {
    return std::string(" for ") + NormName(s.norm) + " of qkv with shape " + ShapeStr(qkv.dimensions()) +
           " of dtype " + DtypeName(t) + ", q_heads=" + std::to_string(q_heads) +
           ", kv_heads=" + std::to_string(kv_heads) + ", weights of dtype " + DtypeName(pt);
  };
  if (auto e = CheckQkBuffers(buffers, context, fn); e.failure()) return e;
  if (auto e = CheckQkWorkspace(workspace, fn); e.failure()) return e;
  *shape = s;
  return ffi::Error::Success();
}

}  // namespace lnbwd
