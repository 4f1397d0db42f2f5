"""The fused layernorm forward: one FFI call that reads x once and writes y, mean and rstd.

    y, mean, rstd = layernorm_fwd_op(x, weight, bias, eps=1e-5)

x has any rank >= 1 and dtype float32, bfloat16, float16 or float64; normalization is over the
last axis (C). weight and bias are (C,) arrays or None (no scale / no shift). Their dtype is x's,
or float32 when x is bfloat16/float16 (mixed precision: the parameters stay float32, the output
is computed in fp32 and rounded once to x's dtype). mean and rstd have shape x.shape[:-1] and
dtype float32 (float64 for float64 x). The numbers are jax_lnbwd.reference.layernorm_fwd's:
statistics in fp32 (fp64), variance centered.

On the GPU the CUDA kernels in ffi/kernels/forward/ run; on the CPU a C++ reference. The op is
wrapped, from the inside out, in
  * jax.experimental.custom_partitioning (forward_sharding.py): under a sharded jit each device
    normalizes its own rows, without communication;
  * jax.custom_batching.custom_vmap: vmap folds the batch axis into the rows (exact for the
    forward: every row is normalized by itself); per-example weight/bias become one parameter
    row per example, so a vmapped call is still ONE FFI call;
  * jax.custom_jvp: derivatives are the JVP of reference.layernorm_fwd (pure jnp), so the op is
    differentiable in both modes, though a training step's custom_vjp never needs it.
It works under jit, vmap, grad/jvp, shard_map and jax.export (target jax_lnbwd_layernorm_fwd_v1).

The residual variant, add_layernorm's forward, is the same op with one more input and output:

    y, s, mean, rstd = add_layernorm_fwd_op(x, residual, weight, bias, eps=1e-5)

s = x + residual (the sum in fp32, fp64 for fp64, rounded once to x's dtype: bit-equal to jnp's
`x + residual`), and y, mean, rstd are the layernorm of that rounded s. One kernel reads x and
residual once and writes y, s, mean and rstd (target jax_lnbwd_add_layernorm_fwd_v1), where jnp
would run an add (read 2, write 1) and then the forward (read s again). residual has x's shape
and dtype; the same wrappers apply (residual and s are batched and sharded like x).

With x's own bias, the bias of the projection that produced x (x_bias: (C,), a parameter like
weight and bias), s = (x + x_bias) + residual, both adds in fp32 (fp64) and rounded once
(reference.add_residual): target jax_lnbwd_add_layernorm_fwd_v2. XLA would otherwise run that
bias add on its own between the matmul and this kernel (it cannot fuse into a custom call).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from . import reference
from .forward_sharding import ADD_BIAS_TARGET, ADD_TARGET, TARGET, layernorm_fwd_partitioned

__all__ = ["layernorm_fwd_op", "add_layernorm_fwd_op", "TARGET", "ADD_TARGET", "ADD_BIAS_TARGET"]

_SUPPORTED = ("float32", "bfloat16", "float16", "float64")


def _name(a) -> str:
    return str(jnp.dtype(a.dtype))


def _check(x, weight, bias, eps, fn: str = "layernorm_fwd", x_bias=None):
    """Trace-time checks; returns (eps as float, weight, bias, x_bias) with a 16-bit parameter
    next to a float32 one upcast to float32 (exact), so all reach the kernel in one dtype.
    Messages start with `fn`. x_bias (add_layernorm_fwd only) is checked like weight and bias."""
    try:
        eps_f = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: eps must be a positive finite float, got {eps!r}") from None
    if isinstance(eps, (bool, str, bytes)) or not math.isfinite(eps_f) or eps_f <= 0.0:
        raise ValueError(f"{fn}: eps must be a positive finite float, got {eps!r}")
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{fn}: 'x' must be an array, got {type(x).__name__}")
    if _name(x) not in _SUPPORTED:
        raise TypeError(f"{fn}: 'x' has dtype {_name(x)} but expected one of {', '.join(_SUPPORTED)}")
    if x.ndim < 1:
        raise ValueError(f"{fn}: 'x' must have rank >= 1 (normalization is over the last axis)")
    C = x.shape[-1]
    if C < 1:
        raise ValueError(f"{fn}: 'x' has shape {tuple(x.shape)} but the last axis (C) must be >= 1")
    sixteen = _name(x) in ("bfloat16", "float16")
    for name, p in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if p is None:
            continue
        if not hasattr(p, "dtype") or not hasattr(p, "shape"):
            raise TypeError(f"{fn}: '{name}' must be an array or None, got {type(p).__name__}")
        if tuple(p.shape) != (C,):
            raise ValueError(f"{fn}: '{name}' has shape {tuple(p.shape)} but expected ({C},) "
                             f"for x of shape {tuple(x.shape)}")
        if p.dtype != x.dtype and not (sixteen and _name(p) == "float32"):
            allowed = f"{_name(x)} or float32" if sixteen else _name(x)
            raise TypeError(f"{fn}: '{name}' has dtype {_name(p)} but expected {allowed} "
                            f"for x of dtype {_name(x)}")
    present = [p for p in (weight, bias, x_bias) if p is not None]
    if len({jnp.dtype(p.dtype) for p in present}) > 1:   # exact: bf16/f16 -> f32
        weight, bias, x_bias = (None if p is None else p.astype(jnp.float32) for p in (weight, bias, x_bias))
    return eps_f, weight, bias, x_bias


def layernorm_fwd_op(x, weight, bias, eps: float = 1e-5):
    """(y, mean, rstd) of layernorm over the last axis, by the fused FFI forward (see the module
    docstring for shapes and dtypes)."""
    eps, weight, bias, _ = _check(x, weight, bias, eps)
    params = tuple(p for p in (weight, bias) if p is not None)
    if x.ndim == 1:  # one row: the op needs a row axis
        y, mean, rstd = _op(0, weight is not None, bias is not None, eps)(x[None], *params)
        return y[0], mean[0], rstd[0]
    return _op(0, weight is not None, bias is not None, eps)(x, *params)


def add_layernorm_fwd_op(x, residual, weight, bias, eps: float = 1e-5, x_bias=None):
    """(y, s, mean, rstd): s = x + residual rounded to x's dtype (with x_bias, (x + x_bias) +
    residual), and layernorm's (y, mean, rstd) of s, by the residual-fused FFI forward (see the
    module docstring). residual must have x's shape and dtype; x_bias is a (C,) parameter."""
    fn = "add_layernorm_fwd"
    eps, weight, bias, x_bias = _check(x, weight, bias, eps, fn, x_bias)
    if not hasattr(residual, "dtype") or not hasattr(residual, "shape"):
        raise TypeError(f"{fn}: 'residual' must be an array, got {type(residual).__name__}")
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"{fn}: 'residual' has shape {tuple(residual.shape)} but expected {tuple(x.shape)} "
                         "(x's shape)")
    if residual.dtype != x.dtype:
        raise TypeError(f"{fn}: 'residual' has dtype {_name(residual)} but expected {_name(x)} (x's dtype)")
    params = tuple(p for p in (x_bias, weight, bias) if p is not None)
    op = _op(0, weight is not None, bias is not None, eps, True, x_bias is not None)
    if x.ndim == 1:  # one row: the op needs a row axis
        return tuple(o[0] for o in op(x[None], residual[None], *params))
    return op(x, residual, *params)


# --- the op for static settings ------------------------------------------------------------------
#
# Layout (forward_sharding.py): x (*segments, *rows, C) with seg_dims segment axes; each present
# parameter (*segments, C), a segment axis either as in x or 1 (shared). Absent parameters are not
# operands. Segment axes are the batch axes vmap added where a parameter is batched. With has_res
# (the residual variant) the operands are (x, residual, *params), residual laid out as x, and
# the results (y, s, mean, rstd); with has_xb too, x_bias is the first of the parameters.

def _reference(seg_dims: int, has_w: bool, has_b: bool, eps: float, has_res: bool, has_xb: bool, x, *operands):
    """What the op computes, in jnp: reference.layernorm_fwd with each parameter broadcast over
    its segment's rows (of s = reference.add_residual(x, residual[, x_bias]) for has_res)."""
    residual, params = (operands[0], operands[1:]) if has_res else (None, operands)
    row_axes = x.ndim - 1 - seg_dims
    it = iter(params)

    def widen(present):
        if not present:
            return None
        p = next(it)
        return p.reshape(*p.shape[:-1], *(1,) * row_axes, p.shape[-1])

    xb = widen(has_xb)
    s = reference.add_residual(x, residual, xb) if has_res else x
    w, b = widen(has_w), widen(has_b)
    y, mean, rstd = reference.layernorm_fwd(s, w, b, eps)
    return (y, s, mean, rstd) if has_res else (y, mean, rstd)


def _vmap_rule(seg_dims, has_w, has_b, eps, has_res, has_xb, axis_size, in_batched, x, *operands):
    """custom_vmap rule: B problems are one problem whose rows are the examples' rows.

    custom_vmap has moved every batched argument's batch axis to the front. x becomes
    (B, *example) (broadcast if unbatched). A parameter that is batched, or already per segment,
    becomes (B, *segments, C): one row per new segment; a shared one stays shared, (1, ..., 1, C).
    The call goes through _op again (one more segment axis), so nested vmaps make one FFI call.
    """
    B = axis_size
    n_rows = 2 if has_res else 1   # x, and residual: batched alike
    rows_b, p_b = in_batched[:n_rows], in_batched[n_rows:]
    rows_in, params = (x, *operands[:n_rows - 1]), operands[n_rows - 1:]
    example = x.shape[1:] if rows_b[0] else x.shape
    segs, C = example[:seg_dims], example[-1]
    stat = reference.acc_dtype(x.dtype)
    n_out = n_rows + 2
    if B == 0:  # an empty batch: nothing to compute
        return ((jnp.zeros((0, *example), x.dtype),) * n_rows + (jnp.zeros((0, *example[:-1]), stat),) * 2,
                (True,) * n_out)
    rows_in = tuple(a if b else jnp.broadcast_to(a, (B, *a.shape)) for a, b in zip(rows_in, rows_b))

    def batch(p, batched):
        ex = p.shape[1:] if batched else p.shape
        if batched or math.prod(ex[:-1]) != 1:
            return jnp.broadcast_to(p, (B, *segs, C))
        return p.reshape((1,) * (seg_dims + 1) + (C,))

    params = tuple(batch(p, b) for p, b in zip(params, p_b))
    out = _op(seg_dims + 1, has_w, has_b, eps, has_res, has_xb)(*rows_in, *params)
    return out, (True,) * n_out


@functools.cache
def _op(seg_dims: int, has_w: bool, has_b: bool, eps: float, has_res: bool = False, has_xb: bool = False):
    """op(x, *params) -> (y, mean, rstd), or with has_res op(x, residual, *params) -> (y, s, mean,
    rstd) (params = (x_bias, weight, bias)'s present ones with has_xb), for these static settings
    (cached: equal settings give the same function, so jit caches hit)."""
    @jax.custom_batching.custom_vmap
    def run(x, *operands):
        residual, params = (operands[0], operands[1:]) if has_res else (None, operands)
        return layernorm_fwd_partitioned(x, params, seg_dims, has_w, has_b, eps, residual, has_xb)

    run.def_vmap(functools.partial(_vmap_rule, seg_dims, has_w, has_b, eps, has_res, has_xb))
    op = jax.custom_jvp(run)

    @op.defjvp
    def op_jvp(primals, tangents):
        _, tangents_out = jax.jvp(functools.partial(_reference, seg_dims, has_w, has_b, eps, has_res, has_xb),
                                  primals, tangents)
        return op(*primals), tangents_out

    return op
