"""The norms' tangent maps: linear JAX primitives whose transpose is the FFI backward.

layernorm. With x̂ = (x - mean) * rstd over the last axis (C elements), y = x̂ * weight + bias.
Its derivative at (x, weight, bias), applied to tangents (dx, dweight, dbias), is
    dx̂ = rstd * (dx - mean(dx) - x̂ * mean(x̂ * dx))
    dy  = weight * dx̂ + x̂ * dweight + dbias,
linear in (dx, dweight, dbias). Its transpose, cotangent dy -> (dx, dweight, dbias), is the
layernorm backward that our FFI op computes: the map dx -> dx̂ is
rstd * (I - 11ᵀ/C - x̂x̂ᵀ/C), a symmetric matrix, so with g = weight * dy,
    dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)),  dweight = Σ dy * x̂,  dbias = Σ dy.

add_layernorm (s = x + residual, y = layernorm(s)). The tangents of (y, s) given tangents
(dx, dresidual, dweight, dbias) are ds = dx + dresidual and dy = the map above applied to
(ds, dweight, dbias), linear in all four. Its transpose takes cotangents (gy, gs) to
g = layernorm's backward of gy + gs (dx = dresidual = g), and that sum is ONE call of backward
target v2: gs goes in as `dresidual` and the kernel adds it while it writes dx (llm.c
accumulates into dinp for the same reason: the residual stream's gradient and the norm's meet
there). Written as two primitives (an add and tangent_p) JAX would transpose them into the FFI
call followed by a separate add over the whole activation.

The public functions are jax.custom_jvps whose rules return the forward's values and one of
these primitives (autodiff.py). What each transformation then sees:
  * jax.jvp, jax.linearize's linear function, jacfwd: the primitive is evaluated; its
    implementation and lowering are the jnp formula (`tangent_reference`), which XLA fuses and
    partitions like any jnp code;
  * jax.grad, vjp, jacrev: JAX linearizes (the primitive, its tangent operands unknown, goes
    into the linear program with x, weight, mean, rstd as residuals) and transposes: the
    transpose rule is ONE call of the FFI op (ops/backward.py), which brings its own batching,
    partitioning and derivative rules;
  * vmap: the batching rule binds the primitive again with one more segment axis, the op's
    layout, so reverse mode over a vmap is still one FFI call: with per-example dweight/dbias
    where they are wanted (per-example weights), and with the batch folded into the rows where
    only their total is (weights shared by the batch);
  * derivatives of the tangent map itself (second order: hessian, jvp of jvp, grad of jvp): its
    JVP rule is the primitive again for the tangent operands (it is linear in them) plus the jnp
    JVP of the formula for x, weight, mean and rstd.

Every primitive here is bound to (x, weight, mean, rstd, *tangents) with static parameters
seg_dims, kernel and block_size. The tangents are one or more data tangents shaped like x (dx;
dx and dresidual) followed by dweight and dbias. Operand layout, for `seg_dims` = k:
    x and the data tangents:  (*segments, *rows, C)  (k segment axes, then any row axes);
    mean, rstd:               (*segments, *rows), float32 (float64 for float64 x);
    weight, dweight, dbias:   (*segments', C) where each segment axis is as in x or 1 (shared).
Every result has x's shape and dtype. `define` makes such a primitive from its jnp formula and
its transpose and writes once what all have in common (evaluation, lowering, abstract
evaluation, JVP, vmap, and the refusal to transpose in x, weight, mean or rstd).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import reference
from .ops import backward as backward_op, ffi

# x, weight, mean, rstd: the operands the map is not linear in.
N_NONLINEAR = 4
WEIGHT = 1
STATIC = ("seg_dims", "kernel", "block_size")


def bind(p: Primitive, *args, seg_dims: int, kernel: int, block_size: int):
    """p bound to args. Inside shard_map every operand is first typed as varying along the same
    mesh axes (a replicated weight next to sharded rows, say), so that the results' type is x's."""
    axes = ffi.varying_axes(*args)
    return p.bind(*(ffi.vary(a, axes) for a in args), seg_dims=seg_dims, kernel=kernel, block_size=block_size)


def ffi_backward(ct, x, weight, mean, rstd, dweight, dbias, dresidual, *, seg_dims, kernel, block_size):
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
    gx, gweight, gbias = backward_op.backward(ct, x, weight, mean, rstd, seg_dims=k, kernel=kernel,
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


def _abstract_eval(x, weight, mean, rstd, *tangents, seg_dims, kernel, block_size, n_out):
    *data, dweight, dbias = tangents
    segs, C = x.shape[:seg_dims], x.shape[-1]
    for d in data:
        assert d.shape == x.shape and d.dtype == x.dtype, (d, x)
    assert mean.shape == rstd.shape == x.shape[:-1], (mean, rstd, x)
    for p in (weight, dweight, dbias):
        assert p.ndim == seg_dims + 1 and p.shape[-1] == C, (p, x, seg_dims)
        assert all(n in (s, 1) for n, s in zip(p.shape, segs)), (p, x, seg_dims)
    out = x.update(weak_type=False)
    return [out] * n_out if n_out > 1 else out


def _jvp(p, formula, primals, tangents, *, seg_dims, kernel, block_size):
    params = dict(seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    out = p.bind(*primals, **params)
    nonlinear, linear = primals[:N_NONLINEAR], primals[N_NONLINEAR:]
    t_nonlinear, t_linear = tangents[:N_NONLINEAR], tangents[N_NONLINEAR:]
    parts = []
    if any(type(t) is not ad.Zero for t in t_linear):
        parts.append(bind(p, *nonlinear, *map(ad.instantiate_zeros, t_linear), **params))
    if any(type(t) is not ad.Zero for t in t_nonlinear):
        f = lambda *a: formula(*a, *linear, seg_dims=seg_dims)  # noqa: E731
        parts.append(jax.jvp(f, nonlinear, tuple(map(ad.instantiate_zeros, t_nonlinear)))[1])
    # One result or several: summed as tuples, returned as the primitive returns them.
    pack, unpack = ((tuple, list) if p.multiple_results else (lambda v: (v,), lambda v: v[0]))
    if not parts:
        return out, unpack(tuple(ad.Zero.from_primal_value(o) for o in pack(out)))
    return out, unpack(functools.reduce(lambda a, b: tuple(map(jnp.add, a, b)), map(pack, parts)))


def _batch(p, n_out, args, dims, *, seg_dims, kernel, block_size):
    B = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    shared = (WEIGHT, len(args) - 2, len(args) - 1)   # weight, dweight, dbias
    out = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if d is not None:
            a = jnp.moveaxis(a, d, 0)
        elif i in shared:       # shared by the new segments
            a = a[None]
        else:                   # x, mean, rstd, the data tangents: the same for every example
            a = jnp.broadcast_to(a, (B, *a.shape))
        out.append(a)
    result = bind(p, *out, seg_dims=seg_dims + 1, kernel=kernel, block_size=block_size)
    return result, ((0,) * n_out if n_out > 1 else 0)


def _transpose(fn: str, tangent_names, linear_transpose, cts, *args, seg_dims, kernel, block_size):
    if any(ad.is_undefined_primal(a) for a in args[:N_NONLINEAR]):
        names = ", ".join(tangent_names[:-1]) + " and " + tangent_names[-1]
        raise ValueError(f"jax_lnbwd: the {fn} tangent map is linear in {names} only; it cannot be "
                         "transposed in x, weight, mean or rstd")
    cotangents = linear_transpose(cts, *args, seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    return (None,) * N_NONLINEAR + tuple(cotangents)


def define(name: str, formula, linear_transpose, *, fn: str, tangent_names: tuple[str, ...],
           n_out: int = 1) -> Primitive:
    """The primitive `name`, a tangent map of `fn` with the rules above.

    formula(x, weight, mean, rstd, *tangents, seg_dims) -> its n_out results in jnp.
    linear_transpose(cts, x, weight, mean, rstd, *tangents, seg_dims, kernel, block_size) -> the
    cotangents of the tangent operands (named `tangent_names`, None where not transposed).
    """
    p = Primitive(name)
    p.multiple_results = n_out > 1

    def impl(*args, seg_dims, kernel, block_size):
        out = formula(*args, seg_dims=seg_dims)
        return list(out) if p.multiple_results else out

    p.def_impl(jax.jit(impl, static_argnames=STATIC))
    p.def_abstract_eval(functools.partial(_abstract_eval, n_out=n_out))
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=p.multiple_results))
    ad.primitive_jvps[p] = functools.partial(_jvp, p, formula)
    ad.primitive_transposes[p] = functools.partial(_transpose, fn, tangent_names, linear_transpose)
    batching.primitive_batchers[p] = functools.partial(_batch, p, n_out)
    return p


# --- layernorm ------------------------------------------------------------------------------

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


def _layernorm_transpose(ct, x, weight, mean, rstd, dx, dweight, dbias, *, seg_dims, kernel, block_size):
    """(dx, dweight, dbias) cotangents by the FFI op: dy -> the layernorm backward."""
    linear = (dx, dweight, dbias)
    if type(ct) is ad.Zero or not any(ad.is_undefined_primal(t) for t in linear):
        return (None,) * 3
    gx, gweight, gbias = ffi_backward(ct, x, weight, mean, rstd, dweight, dbias, None,
                                      seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    return gx if ad.is_undefined_primal(dx) else None, gweight, gbias


tangent_p = define("jax_lnbwd_layernorm_tangent", tangent_reference, _layernorm_transpose,
                   fn="layernorm", tangent_names=("dx", "dweight", "dbias"))


def tangent_map(x, weight, mean, rstd, dx, dweight, dbias, *, seg_dims: int, kernel: int, block_size: int):
    """dy = the tangent map at (x, weight, mean, rstd) applied to (dx, dweight, dbias).

    Operands in the layout above; kernel and block_size are those of the FFI backward that the
    transpose runs.
    """
    return bind(tangent_p, x, weight, mean, rstd, dx, dweight, dbias,
                seg_dims=seg_dims, kernel=kernel, block_size=block_size)


# --- add_layernorm ---------------------------------------------------------------------------

def add_tangent_reference(s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims: int):
    """(dy, ds) in jnp: ds = dx + dresidual in s's dtype (as jnp's x + residual), dy from ds."""
    ds = dx + dresidual
    return tangent_reference(s, weight, mean, rstd, ds, dweight, dbias, seg_dims=seg_dims), ds


def _add_transpose(cts, s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims, kernel, block_size):
    """(gy, gs) -> (dx, dresidual, dweight, dbias) cotangents: one FFI call, gs added to dx in it."""
    gy, gs = cts
    if type(gy) is ad.Zero:          # only s is used: its cotangent passes to x and residual
        if type(gs) is ad.Zero:
            return (None,) * 4
        g, gweight, gbias = gs, None, None
    else:
        g, gweight, gbias = ffi_backward(gy, s, weight, mean, rstd, dweight, dbias,
                                         None if type(gs) is ad.Zero else gs,
                                         seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    return tuple(g if ad.is_undefined_primal(t) else None for t in (dx, dresidual)) + (gweight, gbias)


add_tangent_p = define("jax_lnbwd_add_layernorm_tangent", add_tangent_reference, _add_transpose,
                       fn="add_layernorm", tangent_names=("dx", "dresidual", "dweight", "dbias"), n_out=2)


def add_tangent_map(s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims: int, kernel: int,
                    block_size: int):
    """(dy, ds), the tangents of add_layernorm's (y, s); kernel and block_size are the backward's."""
    return bind(add_tangent_p, s, weight, mean, rstd, dx, dresidual, dweight, dbias,
                seg_dims=seg_dims, kernel=kernel, block_size=block_size)
