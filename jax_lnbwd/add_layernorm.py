"""add_layernorm: the residual add and the layernorm of a transformer block, with one backward.

    y, s = add_layernorm(x, residual, weight, bias)      # s = x + residual, y = layernorm(s)

A pre-LN block computes s = x + residual (the residual stream) and normalizes it; s flows on to
the next block and y into attention or the MLP. In the backward the residual stream's gradient
gs (from the later blocks) and the norm's dx meet: ds = layernorm_bwd(gy) + gs. Written as
`s = x + residual; y = layernorm(s)`, XLA runs our backward kernel and then a separate add that
reads and writes the whole activation again. Here the sum is computed inside the kernel: gs is
passed to target v2 as `dresidual` and the kernel adds it while it writes dx (llm.c's layernorm
backward accumulates into dinp for the same reason). dx is a buffer of its own, not gs's: gs is
also read by the matmuls of the branch it flows back into, so XLA would copy gs before writing
into it (_ffi.layernorm_bwd_segments_v2). The gradients of x and residual are both that ds.

The forward is fused the same way where layernorm's is (on CUDA; jax_lnbwd.use_ffi_forward,
JAX_LNBWD_FORWARD): one kernel reads x and residual once and writes y, s, mean and rstd (target
jax_lnbwd_add_layernorm_fwd_v1), instead of an add that reads two tensors and writes one, then
the forward reading s again. Either way s is rounded to x's dtype and that s is normalized
(layernorm._add_forward).

Like layernorm, add_layernorm is a jax.custom_jvp: its JVP rule runs the forward (y, s, mean,
rstd) and the linear primitive add_tangent_p (jax_lnbwd/add_primitive.py), whose transpose is
the one FFI call. So it works under jit, grad, jvp (forward mode), vmap,
shard_map / sharded jit, and jax.export, as layernorm does.
"""
from __future__ import annotations

import functools

import jax

from . import _ffi, config, reference
from .add_primitive import add_tangent_map
from .layernorm import _add_forward, _check_float, _check_inputs, _dtype_name, _resolve_kernel, fill_params, is_mixed


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _add_layernorm(x, residual, weight, bias, eps, kernel, block_size):
    y, s, _, _ = _add_forward(x, residual, weight, bias, eps)
    return y, s


@_add_layernorm.defjvp
def _add_layernorm_jvp(eps, kernel, block_size, primals, tangents):
    """(y, s) and their tangents (dy, ds) = add_tangent_map(...; dx, dresidual, dweight, dbias)."""
    x, residual, weight, bias = primals
    dx, dresidual, dweight, dbias = tangents
    y, s, mean, rstd = _add_forward(x, residual, weight, bias, eps)
    weight, dweight, dbias = fill_params(s, weight, bias, dweight, dbias)
    dy, ds = add_tangent_map(s, weight, mean, rstd, dx, dresidual, dweight, dbias,
                             seg_dims=0, kernel=kernel, block_size=block_size)
    return (y, s), (dy, ds)


def add_layernorm(x, residual, weight, bias, *, eps: float = 1e-5, kernel: int | None = None,
                  block_size: int | None = None):
    """(y, s) with s = x + residual (in x's dtype) and y = layernorm(s, weight, bias).

    x and residual have the same shape (..., C) and dtype; weight, bias and the dtype rules
    (mixed precision included: float32 weight/bias beside 16-bit x) are layernorm's. The
    backward is ONE call of target v2 that computes ds = layernorm's dx + the cotangent of s
    in the kernel; x and residual both get ds. Kernels 11 and 12 run it (kernel=None: the
    default); 1-10 refuse at trace time. The forward is one fused kernel where layernorm's is
    (on CUDA; jax_lnbwd.use_ffi_forward). Works under jit, grad, jvp, vmap, shard_map / sharded
    jit and jax.export. jax_lnbwd.use_xla_backward applies here too (jnp add + layernorm,
    differentiated by JAX).
    """
    fn = "add_layernorm"
    _check_float(fn, "residual", residual)
    eps = _check_inputs(fn, x, weight, bias, eps)
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"{fn}: 'residual' has shape {tuple(residual.shape)} but x has shape {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"{fn}: 'residual' has dtype {_dtype_name(residual)} but x has dtype "
                        f"{_dtype_name(x)}; cast them to one dtype")
    kernel, block_size = _resolve_kernel(fn, kernel, block_size, _dtype_name(x), x.shape[-1],
                                         mixed=is_mixed(x, weight, bias), residual=True)
    if config.xla_backward_enabled():
        s = x + residual
        return reference.layernorm(s, weight, bias, eps), s
    axes = _ffi.varying_axes(*(a for a in (x, residual, weight, bias) if a is not None))
    x, residual, weight, bias = (None if a is None else _ffi.vary(a, axes) for a in (x, residual, weight, bias))
    return _add_layernorm(x, residual, weight, bias, eps, kernel, block_size)
