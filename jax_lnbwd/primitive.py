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
This file holds the formula and the transpose; the rules tangent_p shares with add_layernorm's
tangent map (evaluation, lowering, JVP, vmap, abstract evaluation) are written once, in
jax_lnbwd/linear_primitive.py, which also gives the operands' layout.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import ad

from . import linear_primitive, reference


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


def _transpose(ct, x, weight, mean, rstd, dx, dweight, dbias, *, seg_dims, kernel, block_size):
    """(dx, dweight, dbias) cotangents by the FFI op: dy -> the layernorm backward."""
    linear = (dx, dweight, dbias)
    if type(ct) is ad.Zero or not any(ad.is_undefined_primal(t) for t in linear):
        return (None,) * 3
    gx, gweight, gbias = linear_primitive.ffi_backward(ct, x, weight, mean, rstd, dweight, dbias, None,
                                                       seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    return gx if ad.is_undefined_primal(dx) else None, gweight, gbias


tangent_p = linear_primitive.define("jax_lnbwd_layernorm_tangent", tangent_reference, _transpose,
                                    fn="layernorm", tangent_names=("dx", "dweight", "dbias"))


def tangent_map(x, weight, mean, rstd, dx, dweight, dbias, *, seg_dims: int, kernel: int, block_size: int):
    """dy = the tangent map at (x, weight, mean, rstd) applied to (dx, dweight, dbias).

    Operands in the layout of jax_lnbwd/linear_primitive.py; kernel and block_size are those
    of the FFI backward that the transpose runs.
    """
    return linear_primitive.bind(tangent_p, x, weight, mean, rstd, dx, dweight, dbias,
                                 seg_dims=seg_dims, kernel=kernel, block_size=block_size)
