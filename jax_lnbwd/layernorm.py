"""LayerNorm's public functions: layernorm, layernorm_fwd, layernorm_bwd and add_layernorm.

Each checks its arguments (_checks.py: a bad input raises before any kernel runs, the message
starting with the function's name), applies the switches (config.py), and calls the shared
machinery with LayerNorm's row of facts (norms.LAYERNORM): the custom_jvps and the forward in
autodiff.py, the tangent maps in tangent.py, the FFI ops in ops/ (forward.py, backward.py) and
their partitioning rule in ops/partition.py.

add_layernorm: the residual add and the layernorm of a transformer block, with one backward.

    y, s = add_layernorm(x, residual, weight, bias)              # s = x + residual, y = layernorm(s)
    y, s = add_layernorm(x, residual, weight, bias, x_bias=b)    # s = (x + b) + residual

A pre-LN block computes s = x + residual (the residual stream) and normalizes it; s flows on to
the next block and y into attention or the MLP. In the backward the residual stream's gradient
gs (from the later blocks) and the norm's dx meet: ds = layernorm_bwd(gy) + gs. Written as
`s = x + residual; y = layernorm(s)`, XLA runs our backward kernel and then a separate add that
reads and writes the whole activation again. Here the sum is computed inside the kernel: gs is
passed to backward target v2 as `dresidual` and the kernel adds it while it writes dx. dx is a
buffer of its own, not gs's: gs is also read by the matmuls of the branch it flows back into, so
XLA would copy gs before writing into it (ops/backward.py). The forward is fused the same way
where layernorm's is: one kernel reads x and residual once and writes y, s, mean and rstd.

x's own bias. In GPT-2, BERT and ViT blocks x is a projection with a bias (attention's output
projection, the MLP's down projection). XLA fuses that bias add into its own residual add, but
not into a custom call: written as `Dense(use_bias=True)` followed by add_layernorm, the bias add
runs as a kernel of its own between the matmul and ours, and in the backward the bias gradient
(the column sums of ds) is a reduce of its own too. With x_bias=b (the projection without its
bias) the forward kernel adds it: s = (x + b) + residual, in fp32, rounded once. Its gradient is
the column sum of ds, summed by XLA in fp32 from the kernel's ds.
"""
from __future__ import annotations

from . import _checks, autodiff, config, reference
from .norms import LAYERNORM
from .ops import backward as backward_op


def layernorm(x, weight, bias, *, eps: float = 1e-5, kernel: int | None = None, block_size: int | None = None):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    x has any rank >= 1, a last axis (C) of at least 1 element, and dtype float32, bfloat16,
    float16 or float64 (float64 needs jax_enable_x64); weight and bias have shape (C,) and x's
    dtype, or are None (no scale / no shift, like Flax's use_scale=False / use_bias=False; no
    gradient is returned for them). Mixed precision: beside bfloat16/float16 x, weight and bias
    may be float32. They are then never rounded: y is computed in fp32 and rounded once to x's
    dtype, and their gradients are float32 sums from one kernel pass (target v2; kernels 11
    and 12). y always has x's dtype; statistics are float32 (float64 for float64). The forward
    is the fused FFI op on CUDA and jnp elsewhere (jax_lnbwd.use_ffi_forward,
    JAX_LNBWD_FORWARD); the backward (reverse mode) runs our FFI op with `kernel` (None: the
    default kernel). Works under jit, grad and jvp (to any order: jacfwd, jacrev, hessian,
    linearize), vmap, scan, checkpoint and jax.export, and on sharded inputs: jit with
    shardings, and shard_map (see jax_lnbwd/ops/partition.py).
    jax_lnbwd.use_xla_backward / JAX_LNBWD_BACKWARD=xla (config.py) replace all of it by the jnp
    reference, differentiated by JAX.
    """
    fn = "layernorm"
    eps = _checks.forward_args(fn, x, {"weight": weight, "bias": bias}, eps)
    settings = autodiff.settings(LAYERNORM, eps, kernel, block_size, fn=fn, x=x, mixed=_checks.is_mixed(x, weight, bias))
    if autodiff.whole_jnp(settings, x):
        return reference.layernorm(x, weight, bias, eps)
    x, weight, bias = autodiff.vary_all(x, weight, bias)
    return autodiff.norm(x, weight, bias, settings)


def layernorm_fwd(x, weight, bias, *, eps: float = 1e-5):
    """(y, mean, rstd) of layernorm over the last axis; mean/rstd are float32 (float64 for float64).

    weight and/or bias may be None (no scale, no shift)."""
    eps = _checks.forward_args("layernorm_fwd", x, {"weight": weight, "bias": bias}, eps)
    return autodiff.forward(LAYERNORM, x, weight, bias, eps)


def layernorm_bwd(dy, x, weight, mean, rstd, *, kernel: int | None = None, block_size: int | None = None):
    """The raw backward op: (dx, dweight, dbias) given the forward's saved mean and rstd.

    dy and x have any shape (..., C) with C >= 1; weight has shape (C,) and x's dtype, or
    float32 beside bfloat16/float16 x (mixed precision: target v2, float32 dweight/dbias; kernels
    11 and 12); mean and rstd have shape x.shape[:-1] and dtype float32 (float64 when x is
    float64). dweight and dbias are summed over all leading axes (under vmap: per example).
    `kernel` picks a CUDA kernel from KERNELS (None: the default); the CPU runs a C++ reference
    for every kernel. Differentiable (both modes, any order), and batchable.
    """
    fn = "layernorm_bwd"
    _checks.backward_args(fn, dy, x, weight, mean=mean, rstd=rstd)
    s = autodiff.settings(LAYERNORM, 0.0, kernel, block_size, fn=fn, x=x, mixed=_checks.is_mixed(x, weight))
    if config.xla_backward_enabled():
        return reference.layernorm_bwd(dy, x, weight, mean, rstd)
    return backward_op.dispatched(dy, x, weight, mean, rstd, seg_dims=0, kernel=s.kernel, block_size=s.block_size,
                                  caller=fn, norm=LAYERNORM, mode=s.bwd_mode)


def add_layernorm(x, residual, weight, bias, *, x_bias=None, eps: float = 1e-5, kernel: int | None = None,
                  block_size: int | None = None):
    """(y, s) with s = x + residual (in x's dtype) and y = layernorm(s, weight, bias).

    x and residual have the same shape (..., C) and dtype; weight, bias and the dtype rules
    (mixed precision included: float32 weight/bias beside 16-bit x) are layernorm's. x_bias, a
    (C,) parameter under the same rules (x's own bias: the bias of the projection that made x),
    is added first: s = (x + x_bias) + residual, in fp32 (fp64) and rounded once; its gradient
    is the fp32 column sum of ds, in x_bias's dtype. The backward is ONE call of target v2 that
    computes ds = layernorm's dx + the cotangent of s in the kernel; x and residual both get ds.
    Kernels 11 and 12 run it (kernel=None: the default); 1-10 refuse at trace time. The forward
    is one fused kernel where layernorm's is (on CUDA; jax_lnbwd.use_ffi_forward). Works under
    jit, grad, jvp, vmap, shard_map / sharded jit and jax.export. jax_lnbwd.use_xla_backward
    applies here too (jnp add + layernorm, differentiated by JAX). residual=None (a first block,
    nothing to add yet), as the Flax AddLayerNorm: s = x (+ x_bias, rounded once) and
    y = layernorm(s, weight, bias).
    """
    fn = "add_layernorm"
    if residual is None:
        _checks.forward_args(fn, x, {"weight": weight, "bias": bias, "x_bias": x_bias}, eps)
        s = reference.add_residual(x, None, x_bias)
        return layernorm(s, weight, bias, eps=eps, kernel=kernel, block_size=block_size), s
    _checks.array(fn, "residual", residual)
    eps = _checks.forward_args(fn, x, {"weight": weight, "bias": bias, "x_bias": x_bias}, eps)
    _checks.residual(fn, residual, x)
    settings = autodiff.settings(LAYERNORM, eps, kernel, block_size, fn=fn, x=x, mixed=_checks.is_mixed(x, weight, bias),
                                 residual=True)
    if autodiff.whole_jnp(settings, x, add=True):
        s = reference.add_residual(x, residual, x_bias)
        return reference.layernorm(s, weight, bias, eps), s
    x, residual, weight, bias, x_bias = autodiff.vary_all(x, residual, weight, bias, x_bias)
    return autodiff.add_norm(x, residual, weight, bias, x_bias, settings)
