// CPU handlers of the QK-norm targets (targets.h: qk_norm_fwd, qk_norm_fused_fwd, qk_norm_bwd,
// qk_norm_fused_bwd): the math of the CUDA kernels, written plainly, so that QK-norm runs and is
// tested on machines without a GPU. Every head of q and k is one row of D elements, normalized
// by the norms' own row functions (cpu_rows.h: cpu::NormFwdRow, cpu::NormBwdRow), in fp32 (fp64
// for float64 data), outputs rounded once:
//   forward   y = x̂ * (offset + w), x̂ = (x - mean) * rstd (rmsnorm: mean = 0, offset its own);
//   backward  dx = (g - a - x̂ * b) * rstd, g = (offset + w) * dy, a = mean(g) (0 for rmsnorm),
//             b = mean(g * x̂); dweight = the sum of dy * x̂ over every row of the set, in fp32
//             (fp64), stored once in the weights' dtype.
// The two sets, q's rows and k's, are independent: each has its own weight, statistics and
// dweight. The rows of a set lie where a RowLayout says (the separate form's [rows, D] arrays, or
// the fused form's q or k heads inside qkv). The fused forms work in place in their result,
// which the caller aliases to operand 0 (input_output_aliases {0: 0}); where XLA hands over two
// buffers, operand 0 is first copied into the result whole (so its v heads arrive there), and
// then the q and k heads are read from and written to the result.
#include <cstdint>
#include <cstring>
#include <vector>

#include "checks/qk_norm.h"
#include "handlers/cpu_rows.h"
#include "handlers/handlers.h"
#include "handlers/operands.h"

namespace lnbwd {
namespace {

// Where the rows of one set lie: row r (r = token * heads + head) starts at element
// (r / heads) * width + (first + r % heads) * D. The separate form's [rows, D] array is the
// layout with heads 1, first 0 and width D (row r at r * D); the fused form's q set has heads =
// q_heads, first = 0, and its k set heads = kv_heads, first = q_heads, both with qkv's width.
struct RowLayout {
  int64_t heads;   // the set's heads per token
  int64_t first;   // heads before the set's first one in a token
  int64_t width;   // elements per token
  int64_t D;       // elements per head (row)
  int64_t Start(int64_t r) const { return (r / heads) * width + (first + r % heads) * D; }
};

RowLayout Separate(const QkShape& s) { return {1, 0, s.D, s.D}; }
RowLayout FusedQ(const QkShape& s) { return {s.q_heads, 0, s.width, s.D}; }
RowLayout FusedK(const QkShape& s) { return {s.kv_heads, s.q_heads, s.width, s.D}; }

// One set's forward: `rows` rows of x at `at`, normalized into y at the same places (y may be
// x: in place), with the set's weight row w (null: absent); its statistics by row: mean (null
// for rmsnorm, whose mean is not saved) and rstd.
template <typename D, typename Q>
void FwdSet(bool centered, const typename D::S* x, typename D::S* y, const RowLayout& at, int64_t rows,
            const typename Q::S* w, typename D::A eps, typename D::A offset, typename D::A* mean,
            typename D::A* rstd) {
  using A = typename D::A;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = at.Start(r);
    A m, s;
    cpu::NormFwdRow<D, Q>(centered, x + o, w, /*b=*/nullptr, y + o, at.D, eps, offset, &m, &s);
    if (mean) mean[r] = m;
    rstd[r] = s;
  }
}

// One set's backward: dx at `at` from dy and x at the same places (dx may be dy: in place), and
// dw_out (D elements) = the sum over the set's rows of dy * x̂, stored once in P's dtype.
template <typename D, typename P>
void BwdSet(bool centered, const typename D::S* dy, const typename D::S* x, typename D::S* dx, const RowLayout& at,
            int64_t rows, const typename P::S* w, const typename D::A* mean, const typename D::A* rstd,
            typename D::A offset, typename P::S* dw_out) {
  using A = typename D::A;
  std::vector<A> dweight(at.D, A(0));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = at.Start(r);
    cpu::NormBwdRow<D, P>(centered, dy + o, x + o, w, centered ? mean[r] : A(0), rstd[r], /*dres=*/nullptr, dx + o,
                          dweight.data(), /*dbias=*/nullptr, at.D, offset);
  }
  for (int64_t i = 0; i < at.D; ++i) dw_out[i] = P::Store(dweight[i]);
}

// Calls run(D{}, P{}) with the CPU types (cpu_rows.h) of the data's dtype t and of the weights'
// (shape.param_dtype): the pairs the checks admit, F32 weights beside BF16/F16 data included.
template <typename Run>
ffi::Error DispatchQk(ffi::DataType t, const QkShape& shape, const char* data_name, const char* fn, Run run) {
  using T = ffi::DataType;
  const bool f32_params = shape.param_dtype == T::F32;
  switch (t) {
    case T::F32: run(cpu::F32{}, cpu::F32{}); break;
    case T::F64: run(cpu::F64{}, cpu::F64{}); break;
    case T::BF16: f32_params ? run(cpu::BF16{}, cpu::F32{}) : run(cpu::BF16{}, cpu::BF16{}); break;
    case T::F16: f32_params ? run(cpu::F16{}, cpu::F32{}) : run(cpu::F16{}, cpu::F16{}); break;
    default:
      return ArgError(std::string("'") + data_name + "' has dtype " + DtypeName(t) + ", which has no CPU implementation",
                      fn);
  }
  return ffi::Error::Success();
}

// The fused forms' result starts as operand 0 (see the top): copied where XLA did not alias them.
void CopyIfNotAliased(const ffi::AnyBuffer& from, ffi::AnyBuffer& to) {
  if (from.untyped_data() != to.untyped_data()) std::memcpy(to.untyped_data(), from.untyped_data(), from.size_bytes());
}

// A typed pointer to a buffer's data, or null for rmsnorm's (0,) mean (or a (0, D) weight).
template <typename T>
T* Data(const ffi::AnyBuffer& b) {
  return b.element_count() > 0 ? static_cast<T*>(b.untyped_data()) : nullptr;
}

// Both sets' forward, for both forms: set i (0: q, 1: k) has its rows read at x[i] and written
// at y[i] (y[i] == x[i]: in place), laid out by at[i], with weight w[i] and statistics mean[i]
// (rmsnorm's (0,) placeholder is not written) and rstd[i].
using Two = const ffi::AnyBuffer* const (&)[2];
ffi::Error Forward(const QkShape& s, ffi::DataType t, const char* data_name, const char* fn,
                   const void* const (&x)[2], void* const (&y)[2], const RowLayout (&at)[2], Two w, Two mean,
                   Two rstd, double eps, double offset) {
  const bool centered = s.norm == NormKind::kLayerNorm;
  const int64_t rows[2] = {s.rows_q, s.rows_k};
  return DispatchQk(t, s, data_name, fn, [&](auto d, auto p) {
    using D = decltype(d);
    using P = decltype(p);
    using S = typename D::S;
    using A = typename D::A;
    const A e = static_cast<A>(eps), off = centered ? A(0) : static_cast<A>(offset);
    for (int i = 0; i < 2; ++i) {
      FwdSet<D, P>(centered, static_cast<const S*>(x[i]), static_cast<S*>(y[i]), at[i], rows[i],
                   Data<const typename P::S>(*w[i]), e, off, centered ? Data<A>(*mean[i]) : nullptr,
                   Data<A>(*rstd[i]));
    }
  });
}

// Both sets' backward, for both forms: set i's dx written at dx[i] from dy[i] and x[i] (dx[i] ==
// dy[i]: in place), laid out by at[i]; its weight gradient into row i of dweights [2, D].
ffi::Error Backward(const QkShape& s, ffi::DataType t, const char* data_name, const char* fn,
                    const void* const (&dy)[2], const void* const (&x)[2], void* const (&dx)[2],
                    const RowLayout (&at)[2], Two w, Two mean, Two rstd, ffi::AnyBuffer& dweights, double offset) {
  const bool centered = s.norm == NormKind::kLayerNorm;
  const int64_t rows[2] = {s.rows_q, s.rows_k};
  return DispatchQk(t, s, data_name, fn, [&](auto d, auto p) {
    using D = decltype(d);
    using P = decltype(p);
    using S = typename D::S;
    using PS = typename P::S;
    using A = typename D::A;
    const A off = centered ? A(0) : static_cast<A>(offset);
    for (int i = 0; i < 2; ++i) {
      BwdSet<D, P>(centered, static_cast<const S*>(dy[i]), static_cast<const S*>(x[i]), static_cast<S*>(dx[i]), at[i],
                   rows[i], Data<const PS>(*w[i]), Data<const A>(*mean[i]), Data<const A>(*rstd[i]), off,
                   Data<PS>(dweights) + i * s.D);
    }
  });
}

ffi::Error QkNormFwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer q_weight, ffi::AnyBuffer k_weight,
                        ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> k_out,
                        ffi::Result<ffi::AnyBuffer> q_mean, ffi::Result<ffi::AnyBuffer> q_rstd,
                        ffi::Result<ffi::AnyBuffer> k_mean, ffi::Result<ffi::AnyBuffer> k_rstd, double eps,
                        double offset, int32_t norm) {
  const char* fn = "qk_norm_fwd";
  QkShape shape;
  if (auto e = CheckQkNormFwdArgs(q, k, q_weight, k_weight, *q_out, *k_out, *q_mean, *q_rstd, *k_mean, *k_rstd, eps,
                                  offset, norm, &shape);
      e.failure()) {
    return e;
  }
  return Forward(shape, q.element_type(), "q", fn, {q.untyped_data(), k.untyped_data()},
                 {q_out->untyped_data(), k_out->untyped_data()}, {Separate(shape), Separate(shape)},
                 {&q_weight, &k_weight}, {&*q_mean, &*k_mean}, {&*q_rstd, &*k_rstd}, eps, offset);
}

// The fused form: qkv_out is qkv (aliased) or a copy of it, normalized in place.
ffi::Error QkNormFusedFwdCpu(ffi::AnyBuffer qkv, ffi::AnyBuffer q_weight, ffi::AnyBuffer k_weight,
                             ffi::Result<ffi::AnyBuffer> qkv_out, ffi::Result<ffi::AnyBuffer> q_mean,
                             ffi::Result<ffi::AnyBuffer> q_rstd, ffi::Result<ffi::AnyBuffer> k_mean,
                             ffi::Result<ffi::AnyBuffer> k_rstd, double eps, double offset, int32_t norm,
                             int64_t q_heads, int64_t kv_heads) {
  const char* fn = "qk_norm_fused_fwd";
  QkShape shape;
  if (auto e = CheckQkNormFusedFwdArgs(qkv, q_weight, k_weight, *qkv_out, *q_mean, *q_rstd, *k_mean, *k_rstd, eps,
                                       offset, norm, q_heads, kv_heads, &shape);
      e.failure()) {
    return e;
  }
  CopyIfNotAliased(qkv, *qkv_out);
  void* out = qkv_out->untyped_data();
  return Forward(shape, qkv.element_type(), "qkv", fn, {out, out}, {out, out}, {FusedQ(shape), FusedK(shape)},
                 {&q_weight, &k_weight}, {&*q_mean, &*k_mean}, {&*q_rstd, &*k_rstd}, eps, offset);
}

// The workspace is the CUDA kernels' scratch: unused here.
ffi::Error QkNormBwdCpu(ffi::AnyBuffer dq_out, ffi::AnyBuffer dk_out, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer q_weight, ffi::AnyBuffer k_weight, ffi::AnyBuffer q_mean, ffi::AnyBuffer q_rstd,
                        ffi::AnyBuffer k_mean, ffi::AnyBuffer k_rstd, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dweights,
                        ffi::Result<ffi::AnyBuffer> workspace, double offset, int32_t norm) {
  const char* fn = "qk_norm_bwd";
  QkShape shape;
  if (auto e = CheckQkNormBwdArgs(dq_out, dk_out, q, k, q_weight, k_weight, q_mean, q_rstd, k_mean, k_rstd, *dq, *dk,
                                  *dweights, *workspace, offset, norm, &shape);
      e.failure()) {
    return e;
  }
  return Backward(shape, q.element_type(), "q", fn, {dq_out.untyped_data(), dk_out.untyped_data()},
                  {q.untyped_data(), k.untyped_data()}, {dq->untyped_data(), dk->untyped_data()},
                  {Separate(shape), Separate(shape)}, {&q_weight, &k_weight}, {&q_mean, &k_mean}, {&q_rstd, &k_rstd},
                  *dweights, offset);
}

// The fused form: dqkv is dqkv_out (aliased) or a copy of it, its q and k heads replaced in place
// by their dx (each element of dy read before the same element of dx is written); its v heads
// stay dqkv_out's.
ffi::Error QkNormFusedBwdCpu(ffi::AnyBuffer dqkv_out, ffi::AnyBuffer qkv, ffi::AnyBuffer q_weight,
                             ffi::AnyBuffer k_weight, ffi::AnyBuffer q_mean, ffi::AnyBuffer q_rstd,
                             ffi::AnyBuffer k_mean, ffi::AnyBuffer k_rstd, ffi::Result<ffi::AnyBuffer> dqkv,
                             ffi::Result<ffi::AnyBuffer> dweights, ffi::Result<ffi::AnyBuffer> workspace,
                             double offset, int32_t norm, int64_t q_heads, int64_t kv_heads) {
  const char* fn = "qk_norm_fused_bwd";
  QkShape shape;
  if (auto e = CheckQkNormFusedBwdArgs(dqkv_out, qkv, q_weight, k_weight, q_mean, q_rstd, k_mean, k_rstd, *dqkv,
                                       *dweights, *workspace, offset, norm, q_heads, kv_heads, &shape);
      e.failure()) {
    return e;
  }
  CopyIfNotAliased(dqkv_out, *dqkv);
  void* g = dqkv->untyped_data();
  const void* x = qkv.untyped_data();
  return Backward(shape, qkv.element_type(), "qkv", fn, {g, g}, {x, x}, {g, g}, {FusedQ(shape), FusedK(shape)},
                  {&q_weight, &k_weight}, {&q_mean, &k_mean}, {&q_rstd, &k_rstd}, *dweights, offset);
}

}  // namespace
}  // namespace lnbwd

// The QK-norm targets' CPU handler symbols: each target's operands (handlers/operands.h) bound to
// its implementation above.
#define LNBWD_CPU_HANDLER(Handler, key, name) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLnbwd##Handler##Cpu, lnbwd::Handler##Cpu, lnbwd::Handler##Operands());
LNBWD_QK_TARGETS(LNBWD_CPU_HANDLER)
#undef LNBWD_CPU_HANDLER
