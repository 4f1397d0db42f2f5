// Every FFI target, written once: X(Handler, key, name) for each.
//
//   name     the target name XLA knows, with its version. Names are baked into exported
//            programs: a new handler signature gets a new name, and old names stay registered.
//   key      the version-free key Python reads the name by (_jax_lnbwd.targets(), read by
//            jax_lnbwd/norms.py).
//   Handler  the C++ pieces of the target, by convention:
//              lnbwd::<Handler>Operands()     its operands, results and attributes, one
//                                             commented .Arg/.Ret/.Attr a line (handlers/operands.h);
//              lnbwd::<Handler>Cpu / ...Cuda  its two implementations (handlers/*_cpu.cc, *_cuda.cc);
//              JaxLnbwd<Handler>Cpu / ...Cuda the handler symbols XLA calls, generated from the
//                                             two above in the same files.
// ffi/module.cc generates the registrations and targets() from this list; handlers/handlers.h
// the symbols' declarations. A new target is a line here, an operand list and two implementations.
#pragma once

// The fused forward: x [, residual] [, params] -> y [, s], statistics.
#define LNBWD_FORWARD_TARGETS(X)                                                       \
  X(LayernormFwd, "layernorm_fwd", "jax_lnbwd_layernorm_fwd_v1")                       \
  X(AddLayernormFwd, "add_layernorm_fwd", "jax_lnbwd_add_layernorm_fwd_v1")            \
  X(AddBiasLayernormFwd, "add_bias_layernorm_fwd", "jax_lnbwd_add_layernorm_fwd_v2")   \
  X(RmsnormFwd, "rmsnorm_fwd", "jax_lnbwd_rmsnorm_fwd_v1")                             \
  X(AddRmsnormFwd, "add_rmsnorm_fwd", "jax_lnbwd_add_rmsnorm_fwd_v1")

// The backward: dy, x, weight, statistics [, dresidual] -> dx, parameter gradients, workspace.
#define LNBWD_BACKWARD_TARGETS(X)                                                      \
  X(LayernormBwd, "layernorm_bwd", "jax_lnbwd_layernorm_bwd_v1")                       \
  X(LayernormBwdV2, "layernorm_bwd_v2", "jax_lnbwd_layernorm_bwd_v2")                  \
  X(RmsnormBwd, "rmsnorm_bwd", "jax_lnbwd_rmsnorm_bwd_v1")

// QK-norm as one op: attention's q and k heads normalized over head_dim, q's and k's in
// one call, separate (q, k) or fused (qkv, v heads passed through), forward and backward. One
// target serves both norms: the int32 attribute 'norm' carries the NormKind.
#define LNBWD_QK_TARGETS(X)                                                            \
  X(QkNormFwd, "qk_norm_fwd", "jax_lnbwd_qk_norm_fwd_v1")                              \
  X(QkNormFusedFwd, "qk_norm_fused_fwd", "jax_lnbwd_qk_norm_fused_fwd_v1")             \
  X(QkNormBwd, "qk_norm_bwd", "jax_lnbwd_qk_norm_bwd_v1")                              \
  X(QkNormFusedBwd, "qk_norm_fused_bwd", "jax_lnbwd_qk_norm_fused_bwd_v1")

#define LNBWD_TARGETS(X) LNBWD_FORWARD_TARGETS(X) LNBWD_BACKWARD_TARGETS(X) LNBWD_QK_TARGETS(X)

namespace lnbwd {

// k<Handler>Target: a target's name, for the messages that name another target.
#define LNBWD_TARGET_NAME(Handler, key, name) inline constexpr const char k##Handler##Target[] = name;
LNBWD_TARGETS(LNBWD_TARGET_NAME)
#undef LNBWD_TARGET_NAME

}  // namespace lnbwd
