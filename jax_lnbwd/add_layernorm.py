"""add_layernorm: the residual add and the layernorm of a transformer block, with one backward.

    y, s = add_layernorm(x, residual, weight, bias)      # s = x + residual, y = layernorm(s)
    y, s = add_layernorm(x, residual, weight, bias, x_bias=b)   # s = (x + b) + residual

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

x's own bias. In GPT-2, BERT and ViT blocks x is a projection with a bias (attention's output
projection, the MLP's down projection). XLA fuses that bias add into its own residual add, but
not into a custom call: written as `Dense(use_bias=True)` followed by add_layernorm, the bias add
runs as a kernel of its own (read x, write x + b) between the matmul and ours, and in the
backward the bias gradient (the column sums of ds) is a reduce of its own too. With x_bias=b
(the projection without its bias) the forward kernel adds it: s = (x + b) + residual, in fp32,
rounded once (target jax_lnbwd_add_layernorm_fwd_v2). Its gradient is the column sum of ds,
summed by XLA in fp32 from the kernel's ds.

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
from .layernorm import (_add_forward, _check_float, _check_inputs, _check_param, _dtype_name, _resolve_kernel,
                        fill_params, is_mixed)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7))
def _add_layernorm(x, residual, weight, bias, x_bias, eps, kernel, block_size):
    y, s, _, _ = _add_forward(x, residual, weight, bias, eps, x_bias)
    return y, s


@_add_layernorm.defjvp
def _add_layernorm_jvp(eps, kernel, block_size, primals, tangents):
    """(y, s) and their tangents (dy, ds) = add_tangent_map(...; dx, dresidual, dweight, dbias).

    With x_bias, s = (x + x_bias) + residual is linear in (x, x_bias, residual): x_bias's tangent
    is added to x's, in fp32 (fp64) and rounded to x's dtype, so that in reverse mode x_bias's
    cotangent is the fp32 column sum of ds (JAX transposes the broadcast into that sum)."""
    x, residual, weight, bias, x_bias = primals
    dx, dresidual, dweight, dbias, dx_bias = tangents
    y, s, mean, rstd = _add_forward(x, residual, weight, bias, eps, x_bias)
    weight, dweight, dbias = fill_params(s, weight, bias, dweight, dbias)
    if x_bias is not None:
        acc = reference.acc_dtype(x.dtype)
        dx = (dx.astype(acc) + jax.numpy.broadcast_to(dx_bias.astype(acc), dx.shape)).astype(x.dtype)
    dy, ds = add_tangent_map(s, weight, mean, rstd, dx, dresidual, dweight, dbias,
                             seg_dims=0, kernel=kernel, block_size=block_size)
    return (y, s), (dy, ds)


def add_layernorm(x, residual, weight, bias, *, x_bias=None, eps: float = 1e-5, kernel: int | None = None,
                  block_size: int | None = None):
    """(y, s) with s = x + residual (in x's dtype) and y = layernorm(s, weight, bias).

    x and residual have the same shape (..., C) and dtype; weight, bias and the dtype rules
    (mixed precision included: float32 weight/bias beside 16-bit x) are layernorm's. x_bias, a
    (C,) parameter under the same rules (x's own bias: the bias of the projection that made x),
    is added first: s = (x + x_bias) + residual, in fp32 (fp64) and rounded once; its gradient
    is the fp32 column sum of ds, in x_bias's dtype. The
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
    _check_param(fn, "x_bias", x_bias, x)
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"{fn}: 'residual' has shape {tuple(residual.shape)} but x has shape {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"{fn}: 'residual' has dtype {_dtype_name(residual)} but x has dtype "
                        f"{_dtype_name(x)}; cast them to one dtype")
    kernel, block_size = _resolve_kernel(fn, kernel, block_size, _dtype_name(x), x.shape[-1],
                                         mixed=is_mixed(x, weight, bias), residual=True)
    if config.xla_backward_enabled():
        s = reference.add_residual(x, residual, x_bias)
        return reference.layernorm(s, weight, bias, eps), s
    axes = _ffi.varying_axes(*(a for a in (x, residual, weight, bias, x_bias) if a is not None))
    x, residual, weight, bias, x_bias = (None if a is None else _ffi.vary(a, axes)
                                         for a in (x, residual, weight, bias, x_bias))
    return _add_layernorm(x, residual, weight, bias, x_bias, eps, kernel, block_size)
