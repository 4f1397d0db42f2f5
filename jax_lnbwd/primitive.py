"""layernorm's tangent map: a linear JAX primitive whose transpose is the FFI backward.

With x̂ = (x - mean) * rstd over the last axis (C elements), y = x̂ * weight + bias. Its
derivative at (x, weight, bias), applied to tangents (dx, dweight, dbias), is
    dx̂ = rstd * (dx - mean(dx) - x̂ * mean(x̂ * dx))
    dy  = weight * dx̂ + x̂ * dweight + dbias,
linear in (dx, dweight, dbias). Its transpose, cotangent dy -> (dx, dweight, dbias), is the
layernorm backward that our FFI op computes: the map dx -> dx̂ is
rstd * (I - 11ᵀ/C - x̂x̂ᵀ/C), a symmetric matrix, so with g = weight * dy,
    dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)),  dweight = Σ dy * x̂,  dbias = Σ dy.

`layernorm` (jax_lnbwd/layernorm.py) is a jax.custom_jvp whose rule returns the forward's y
and this primitive, `tangent_p`, bound to (x, weight, mean, rstd; dx, dweight, dbias). What
each transformation then sees:
  * jax.jvp, jax.linearize's linear function, jacfwd: the primitive is evaluated; its
    implementation and lowering are the jnp formula above (`tangent_reference`), which XLA
    fuses and partitions like any jnp code;
  * jax.grad, vjp, jacrev: JAX linearizes (the primitive, its tangent operands unknown, goes
    into the linear program with x, weight, mean, rstd as residuals) and transposes: the
    transpose rule is ONE call of the FFI op (jax_lnbwd/backward.py), which brings its own
    batching, partitioning and derivative rules;
  * vmap: the batching rule binds the primitive again with one more segment axis, the op's
    layout (backward.py), so reverse mode over a vmap is still one FFI call: with per-example
    dweight/dbias where they are wanted (per-example weights), and with the batch folded into
    the rows where only their total is (weights shared by the batch);
  * derivatives of the tangent map itself (second order: hessian, jvp of jvp, grad of jvp):
    its JVP rule is the primitive again for the tangent operands (it is linear in them) plus
    the jnp JVP of the formula for x, weight, mean and rstd.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _ffi, backward, reference

# Operands, all arrays, for `seg_dims` = k (a static parameter), in the op's layout:
#   x, dx:                    (*segments, *rows, C)  (k segment axes, then any row axes);
#   mean, rstd:               (*segments, *rows), float32 (float64 for float64 x);
#   weight, dweight, dbias:   (*segments', C) where each segment axis is as in x or 1 (shared).
# The result dy has x's shape and dtype. The tangent operands are dx, dweight and dbias.
N_NONLINEAR = 4
tangent_p = Primitive("jax_lnbwd_layernorm_tangent")


def tangent_reference(x, weight, mean, rstd, dx, dweight, dbias, *, seg_dims: int):
    """dy, the formula above in jnp, accumulated in float32 (float64 for float64)."""
    acc = reference.acc_dtype(x.dtype)
    rows = x.ndim - 1 - seg_dims

    def per_column(p):  # (*segments', C) -> (*segments', 1 per row axis, C): broadcasts against x
        return p.astype(acc).reshape(p.shape[:-1] + (1,) * rows + p.shape[-1:])

    r = rstd.astype(acc)[..., None]
    xhat = (x.astype(acc) - mean.astype(acc)[..., None]) * r
    d = dx.astype(acc)
    dxhat = (d - jnp.mean(d, axis=-1, keepdims=True) - xhat * jnp.mean(xhat * d, axis=-1, keepdims=True)) * r
    dy = dxhat * per_column(weight) + xhat * per_column(dweight) + per_column(dbias)
    return dy.astype(x.dtype)


def tangent_map(x, weight, mean, rstd, dx, dweight, dbias, *, seg_dims: int, kernel: int, block_size: int):
    """dy = the tangent map at (x, weight, mean, rstd) applied to (dx, dweight, dbias).

    kernel and block_size are those of the FFI backward that the transpose runs. Inside
    shard_map every operand is first typed as varying along the same mesh axes (a replicated
    weight next to sharded rows, say), so that dy's type is x's.
    """
    args = (x, weight, mean, rstd, dx, dweight, dbias)
    axes = _ffi.varying_axes(*args)
    return tangent_p.bind(*(_ffi.vary(a, axes) for a in args),
                          seg_dims=seg_dims, kernel=kernel, block_size=block_size)


def _impl(*args, seg_dims, kernel, block_size):
    return tangent_reference(*args, seg_dims=seg_dims)


def _abstract_eval(x, weight, mean, rstd, dx, dweight, dbias, *, seg_dims, kernel, block_size):
    segs, C = x.shape[:seg_dims], x.shape[-1]
    assert dx.shape == x.shape and dx.dtype == x.dtype, (dx, x)
    assert mean.shape == rstd.shape == x.shape[:-1], (mean, rstd, x)
    for p in (weight, dweight, dbias):
        assert p.ndim == seg_dims + 1 and p.shape[-1] == C, (p, x, seg_dims)
        assert all(n in (s, 1) for n, s in zip(p.shape, segs)), (p, x, seg_dims)
    return x.update(weak_type=False)


def _backward(ct, x, weight, mean, rstd, dweight, dbias, dresidual, *, seg_dims, kernel, block_size):
    """(gx, gweight, gbias): the FFI op on cotangent ct, with dweight/dbias's cotangents (None where
    they are not being transposed) summed to their shapes. dresidual (None or x's shape) is
    added to gx in the kernel (target v2)."""
    segs, C = x.shape[:seg_dims], x.shape[-1]
    # A segment axis along which the weight is shared and no per-segment sum is wanted (every
    # parameter tangent being transposed is shared too: grad of vmap with shared parameters)
    # is just more rows: the innermost such axes fold into the rows. Fewer segments, and the
    # op sums over those axes itself.
    wanted = [p for p in (dweight, dbias) if ad.is_undefined_primal(p)]
    k = seg_dims
    while k > 0 and weight.shape[k - 1] == 1 and all(p.aval.shape[k - 1] == 1 for p in wanted):
        k -= 1
    weight = weight.reshape(weight.shape[:k] + weight.shape[seg_dims:])
    # The op takes one weight shared by all segments, or one per segment.
    if math.prod(weight.shape[:-1]) != 1:
        weight = jnp.broadcast_to(weight, (*segs[:k], C))
    gx, gweight, gbias = backward.backward(ct, x, weight, mean, rstd, seg_dims=k, kernel=kernel,
                                           block_size=block_size, caller="layernorm", dresidual=dresidual)

    def summed(g, p):
        """Per-segment sums -> p's shape: a parameter shared by segments gets their total."""
        if not ad.is_undefined_primal(p):
            return None
        axes = tuple(i for i in range(k) if p.aval.shape[i] == 1 and segs[i] != 1)
        if axes:
            g = jnp.sum(g.astype(reference.acc_dtype(g.dtype)), axis=axes, keepdims=True)
        return g.reshape(p.aval.shape).astype(p.aval.dtype)

    return gx, summed(gweight, dweight), summed(gbias, dbias)


def _transpose(ct, x, weight, mean, rstd, dx, dweight, dbias, *, seg_dims, kernel, block_size):
    """(dx, dweight, dbias) cotangents by the FFI op: dy -> the layernorm backward."""
    if any(ad.is_undefined_primal(a) for a in (x, weight, mean, rstd)):
        raise ValueError("jax_lnbwd: the layernorm tangent map is linear in dx, dweight and dbias "
                         "only; it cannot be transposed in x, weight, mean or rstd")
    linear = (dx, dweight, dbias)
    if type(ct) is ad.Zero or not any(ad.is_undefined_primal(t) for t in linear):
        return (None,) * 7
    gx, gweight, gbias = _backward(ct, x, weight, mean, rstd, dweight, dbias, None,
                                   seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    return (None,) * N_NONLINEAR + (gx if ad.is_undefined_primal(dx) else None, gweight, gbias)


def _jvp(primals, tangents, *, seg_dims, kernel, block_size):
    """Linear in the tangent operands: for their tangents the primitive itself (so that a
    transpose still reaches the FFI op); for x, weight, mean and rstd, jnp's JVP of the formula."""
    params = dict(seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    y = tangent_p.bind(*primals, **params)
    nonlinear, linear = primals[:N_NONLINEAR], primals[N_NONLINEAR:]
    t_nonlinear, t_linear = tangents[:N_NONLINEAR], tangents[N_NONLINEAR:]
    parts = []
    if any(type(t) is not ad.Zero for t in t_linear):
        parts.append(tangent_map(*nonlinear, *map(ad.instantiate_zeros, t_linear), **params))
    if any(type(t) is not ad.Zero for t in t_nonlinear):
        formula = lambda *a: tangent_reference(*a, *linear, seg_dims=seg_dims)  # noqa: E731
        parts.append(jax.jvp(formula, nonlinear, tuple(map(ad.instantiate_zeros, t_nonlinear)))[1])
    if not parts:
        return y, ad.Zero.from_primal_value(y)
    return y, functools.reduce(jnp.add, parts)


def _batch(args, dims, *, seg_dims, kernel, block_size):
    """vmap: the batch axis becomes a new outermost segment axis (as the op's own vmap rule)."""
    B = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    out = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if d is not None:
            a = jnp.moveaxis(a, d, 0)
        elif i in (1, 5, 6):    # weight, dweight, dbias: shared by the new segments
            a = a[None]
        else:                   # x, mean, rstd, dx: the same for every example
            a = jnp.broadcast_to(a, (B, *a.shape))
        out.append(a)
    return tangent_map(*out, seg_dims=seg_dims + 1, kernel=kernel, block_size=block_size), 0


tangent_p.def_impl(jax.jit(_impl, static_argnames=("seg_dims", "kernel", "block_size")))
tangent_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(tangent_p, mlir.lower_fun(_impl, multiple_results=False))
ad.primitive_jvps[tangent_p] = _jvp
ad.primitive_transposes[tangent_p] = _transpose
batching.primitive_batchers[tangent_p] = _batch
