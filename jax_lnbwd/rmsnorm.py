"""RMSNorm's public functions: rmsnorm, rmsnorm_fwd, rmsnorm_bwd and add_rmsnorm.

    y = x * rsqrt(mean(x²) + eps) * (offset + weight)        over the last axis

The norm most models train with (Llama, Mistral, Gemma, Qwen, T5). Each function checks its
arguments (_checks.py), applies the switches (config.py), and calls the machinery every norm
shares with RMSNorm's row of facts (norms.RMSNORM: its targets, one statistic rstd, one
parameter weight): the custom_jvps and the forward in autodiff.py, the tangent maps in
tangent.py, the FFI ops in ops/ and their partitioning rule in ops/partition.py. So everything
layernorm does, rmsnorm does: jit, grad, vmap with per-example dweight, jvp and any order of
derivatives, sharded jit and shard_map, export, the XLA switches.

offset: Gemma stores its scale zero-centred and normalizes with (1 + weight). offset=1.0 makes
the kernels add the 1 (in fp32) to the stored weight, which stays as it is; dweight is the same
sum as without it (d(offset + w)/dw = 1).
"""
from __future__ import annotations

from . import _checks, autodiff, config, reference
from .norms import RMSNORM
from .ops import backward as backward_op


def _settings(fn, x, weight, eps, offset, kernel, block_size, *, residual=False) -> autodiff.Settings:
    """The custom_jvp's settings, checked, for rmsnorm's functions."""
    eps = _checks.forward_args(fn, x, {"weight": weight}, eps)
    offset = _checks.offset(fn, offset, weight)
    return autodiff.settings(RMSNORM, eps, kernel, block_size, offset, fn=fn, x=x, mixed=_checks.is_mixed(x, weight),
                             residual=residual)


def rmsnorm(x, weight, *, eps: float = 1e-6, offset: float = 0.0, kernel: int | None = None,
            block_size: int | None = None):
    """RMSNorm over the last axis: x * rsqrt(mean(x²) + eps) * (offset + weight).

    x has any rank >= 1, a last axis (C) of at least 1 element, and dtype float32, bfloat16,
    float16 or float64 (float64 needs jax_enable_x64); weight has shape (C,) and x's dtype, or is
    None (no scale; offset must then be 0). Mixed precision: beside bfloat16/float16 x the
    weight may be float32; it is never rounded: y is computed in fp32 and rounded once, and
    dweight is a float32 sum from one kernel pass. offset (Gemma's zero-centred scale: 1.0) is
    added to the weight by the kernels, in fp32. rstd is float32 (float64 for float64). The
    forward is the fused FFI op on CUDA and jnp elsewhere (jax_lnbwd.use_ffi_forward); the
    backward runs our FFI op with `kernel` (None: the default; kernels 11 and 12 run rmsnorm).
    Works under jit, grad and jvp to any order, vmap, scan, checkpoint, jax.export, sharded jit
    and shard_map. jax_lnbwd.use_xla_backward replaces it by the jnp reference.
    """
    fn = "rmsnorm"
    settings = _settings(fn, x, weight, eps, offset, kernel, block_size)
    if autodiff.whole_jnp(settings, x):
        return reference.rmsnorm(x, weight, settings.eps, settings.offset)
    x, weight = autodiff.vary_all(x, weight)
    return autodiff.norm(x, weight, None, settings)


def rmsnorm_fwd(x, weight, *, eps: float = 1e-6, offset: float = 0.0):
    """(y, rstd) of rmsnorm over the last axis; rstd is float32 (float64 for float64)."""
    fn = "rmsnorm_fwd"
    eps = _checks.forward_args(fn, x, {"weight": weight}, eps)
    offset = _checks.offset(fn, offset, weight)
    return autodiff.forward(RMSNORM, x, weight, None, eps, offset)


def rmsnorm_bwd(dy, x, weight, rstd, *, offset: float = 0.0, kernel: int | None = None,
                block_size: int | None = None):
    """The raw backward op: (dx, dweight) given the forward's saved rstd.

    dy and x have any shape (..., C); weight (C,) of x's dtype, or float32 beside 16-bit x
    (float32 dweight); rstd has shape x.shape[:-1], float32 (float64 for float64 x). dweight is
    summed over all leading axes (under vmap: per example). Differentiable and batchable.
    """
    fn = "rmsnorm_bwd"
    _checks.backward_args(fn, dy, x, weight, rstd=rstd)
    offset = _checks.offset(fn, offset, weight)
    s = autodiff.settings(RMSNORM, 0.0, kernel, block_size, offset, fn=fn, x=x, mixed=_checks.is_mixed(x, weight))
    if config.xla_backward_enabled():
        return reference.rmsnorm_bwd(dy, x, weight, rstd, offset)
    return backward_op.dispatched(dy, x, weight, rstd, seg_dims=0, kernel=s.kernel, block_size=s.block_size,
                                  caller=fn, norm=RMSNORM, offset=offset, mode=s.bwd_mode)


def add_rmsnorm(x, residual, weight, *, x_bias=None, eps: float = 1e-6, offset: float = 0.0,
                kernel: int | None = None, block_size: int | None = None):
    """(y, s) with s = x + residual (in x's dtype) and y = rmsnorm(s, weight).

    Like add_layernorm: x and residual have one shape and dtype; x_bias, a (C,) parameter (the
    bias of the projection that made x), is added first: s = (x + x_bias) + residual in fp32,
    rounded once. The forward is one fused kernel where rmsnorm's is; the backward is ONE call
    that adds s's cotangent (the residual stream's gradient) to dx inside the kernel.
    residual=None (a first block, nothing to add yet), as the Flax AddRMSNorm: s = x (+ x_bias,
    rounded once) and y = rmsnorm(s, weight).
    """
    fn = "add_rmsnorm"
    if residual is None:
        _settings(fn, x, weight, eps, offset, kernel, block_size)
        _checks.param(fn, "x_bias", x_bias, x)
        s = reference.add_residual(x, None, x_bias)
        return rmsnorm(s, weight, eps=eps, offset=offset, kernel=kernel, block_size=block_size), s
    _checks.array(fn, "residual", residual)
    settings = _settings(fn, x, weight, eps, offset, kernel, block_size, residual=True)
    _checks.param(fn, "x_bias", x_bias, x)
    _checks.residual(fn, residual, x)
    if autodiff.whole_jnp(settings, x, add=True):
        s = reference.add_residual(x, residual, x_bias)
        return reference.rmsnorm(s, weight, settings.eps, settings.offset), s
    x, residual, weight, x_bias = autodiff.vary_all(x, residual, weight, x_bias)
    return autodiff.add_norm(x, residual, weight, None, x_bias, settings)
