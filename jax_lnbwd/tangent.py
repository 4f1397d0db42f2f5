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

rmsnorm (x̂ = x * rstd, y = x̂ * (offset + weight), norms.RMSNORM) is the same with no mean and
no bias: dx̂ = rstd * (dx - x̂ * mean(x̂ * dx)), dy = (offset + weight) * dx̂ + x̂ * dweight, and
its transpose is rmsnorm's backward, dx = rstd * (g - x̂ * mean(g * x̂)), g = (offset + weight) * dy.
So the two are one formula (`tangent_reference`) keyed by the row's `centered`: a centered norm
subtracts the means and adds dbias.

Every primitive here is bound to (x, weight, *stats, *tangents) with static parameters
seg_dims, kernel, block_size and bwd_mode (and rmsnorm's offset). stats are the norm's saved statistics
(layernorm: mean, rstd; rmsnorm: rstd). The tangents are one or more data tangents shaped like x
(dx; dx and dresidual) followed by the parameters' (dweight, dbias; rmsnorm: dweight). Operand
layout, for `seg_dims` = k:
    x and the data tangents:      (*segments, *rows, C)  (k segment axes, then any row axes);
    stats:                        (*segments, *rows), float32 (float64 for float64 x);
    weight and its tangents:      (*segments', C) where each segment axis is as in x or 1 (shared).
Every result has x's shape and dtype. `define` makes such a primitive from its jnp formula and
its transpose and writes once what all have in common (evaluation, lowering, abstract
evaluation, JVP, vmap, and the refusal to transpose in x, weight or the stats).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import reference
from .norms import NORMS, Norm
from .ops import backward as backward_op, ffi

WEIGHT = 1   # the weight's operand index
STATIC = ("seg_dims", "kernel", "block_size", "bwd_mode")


def bind(p: Primitive, *args, **params):
    """p bound to args. Inside shard_map every operand is first typed as varying along the same
    mesh axes (a replicated weight next to sharded rows, say), so that the results' type is x's."""
    axes = ffi.varying_axes(*args)
    return p.bind(*(ffi.vary(a, axes) for a in args), **params)


def ffi_backward(norm, ct, x, weight, stats, ptangents, dresidual, *, seg_dims, kernel, block_size, bwd_mode="auto",
                 offset=0.0):
    """(gx, *gparams): the norm's backward on cotangent ct, with the parameter tangents'
    cotangents (None where they are not being transposed) summed to their shapes. dresidual
    (None or x's shape) is added to gx (in the kernel: target v2). The backward is the FFI op or
    the jnp one, as the dispatch rule says (ops/backward.py: `dispatched`)."""
    segs, C = x.shape[:seg_dims], x.shape[-1]
    # A segment axis along which the weight is shared and no per-segment sum is wanted (every
    # parameter tangent being transposed is shared too: grad of vmap with shared parameters)
    # is just more rows: the innermost such axes fold into the rows. Fewer segments, and the
    # op sums over those axes itself.
    wanted = [p for p in ptangents if ad.is_undefined_primal(p)]
    k = seg_dims
    while k > 0 and weight.shape[k - 1] == 1 and all(p.aval.shape[k - 1] == 1 for p in wanted):
        k -= 1
    weight = weight.reshape(weight.shape[:k] + weight.shape[seg_dims:])
    # The op takes one weight shared by all segments, or one per segment.
    if math.prod(weight.shape[:-1]) != 1:
        weight = jnp.broadcast_to(weight, (*segs[:k], C))
    gx, *grads = backward_op.dispatched(ct, x, weight, *stats, seg_dims=k, kernel=kernel, block_size=block_size,
                                        caller=norm.name, dresidual=dresidual, norm=norm, offset=offset,
                                        mode=bwd_mode)

    def summed(g, p):
        """Per-segment sums -> p's shape: a parameter shared by segments gets their total."""
        if not ad.is_undefined_primal(p):
            return None
        axes = tuple(i for i in range(k) if p.aval.shape[i] == 1 and segs[i] != 1)
        if axes:
            g = jnp.sum(g.astype(reference.acc_dtype(g.dtype)), axis=axes, keepdims=True)
        return g.reshape(p.aval.shape).astype(p.aval.dtype)

    return (gx, *(summed(g, p) for g, p in zip(grads, ptangents)))


def _abstract_eval(x, weight, *rest, n_stats, n_params, n_out, **params):
    seg_dims = params["seg_dims"]
    stats, tangents = rest[:n_stats], rest[n_stats:]
    data, ptangents = tangents[:-n_params], tangents[-n_params:]
    segs, C = x.shape[:seg_dims], x.shape[-1]
    for d in data:
        assert d.shape == x.shape and d.dtype == x.dtype, (d, x)
    for s in stats:
        assert s.shape == x.shape[:-1], (s, x)
    for p in (weight, *ptangents):
        assert p.ndim == seg_dims + 1 and p.shape[-1] == C, (p, x, seg_dims)
        assert all(n in (s, 1) for n, s in zip(p.shape, segs)), (p, x, seg_dims)
    out = x.update(weak_type=False)
    return [out] * n_out if n_out > 1 else out


def _jvp(p, formula, n_nonlinear, primals, tangents, **params):
    out = p.bind(*primals, **params)
    nonlinear, linear = primals[:n_nonlinear], primals[n_nonlinear:]
    t_nonlinear, t_linear = tangents[:n_nonlinear], tangents[n_nonlinear:]
    parts = []
    if any(type(t) is not ad.Zero for t in t_linear):
        parts.append(bind(p, *nonlinear, *map(ad.instantiate_zeros, t_linear), **params))
    if any(type(t) is not ad.Zero for t in t_nonlinear):
        f = lambda *a: formula(*a, *linear, **params)  # noqa: E731
        parts.append(jax.jvp(f, nonlinear, tuple(map(ad.instantiate_zeros, t_nonlinear)))[1])
    # One result or several: summed as tuples, returned as the primitive returns them.
    pack, unpack = ((tuple, list) if p.multiple_results else (lambda v: (v,), lambda v: v[0]))
    if not parts:
        return out, unpack(tuple(ad.Zero.from_primal_value(o) for o in pack(out)))
    return out, unpack(functools.reduce(lambda a, b: tuple(map(jnp.add, a, b)), map(pack, parts)))


def _batch(p, n_out, n_params, args, dims, **params):
    B = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    shared = (WEIGHT, *range(len(args) - n_params, len(args)))   # weight and its tangents
    out = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if d is not None:
            a = jnp.moveaxis(a, d, 0)
        elif i in shared:       # shared by the new segments
            a = a[None]
        else:                   # x, the stats, the data tangents: the same for every example
            a = jnp.broadcast_to(a, (B, *a.shape))
        out.append(a)
    result = bind(p, *out, **{**params, "seg_dims": params["seg_dims"] + 1})
    return result, ((0,) * n_out if n_out > 1 else 0)


def _transpose(fn: str, tangent_names, linear_transpose, nonlinear_names, cts, *args, **params):
    n = len(nonlinear_names)
    if any(ad.is_undefined_primal(a) for a in args[:n]):
        names = ", ".join(tangent_names[:-1]) + " and " + tangent_names[-1]
        raise ValueError(f"jax_lnbwd: the {fn} tangent map is linear in {names} only; it cannot be "
                         f"transposed in {', '.join(nonlinear_names[:-1])} or {nonlinear_names[-1]}")
    cotangents = linear_transpose(cts, *args, **params)
    return (None,) * n + tuple(cotangents)


def define(name: str, formula, linear_transpose, *, norm: Norm, fn: str, tangent_names: tuple[str, ...],
           n_out: int = 1) -> Primitive:
    """The primitive `name`, a tangent map of `fn` (a function of `norm`) with the rules above.

    formula(x, weight, *stats, *tangents, **static) -> its n_out results in jnp.
    linear_transpose(cts, x, weight, *stats, *tangents, **static) -> the cotangents of the
    tangent operands (named `tangent_names`, None where not transposed).
    static: seg_dims, kernel, block_size, bwd_mode (the backward's switch mode, captured when the
    norm was traced), and offset for a norm that takes one.
    """
    p = Primitive(name)
    p.multiple_results = n_out > 1
    n_stats, n_params = len(norm.stats), len(norm.params)
    static = STATIC + (("offset",) if norm.offset else ())

    def impl(*args, **params):
        out = formula(*args, **params)
        return list(out) if p.multiple_results else out

    p.def_impl(jax.jit(impl, static_argnames=static))
    p.def_abstract_eval(functools.partial(_abstract_eval, n_stats=n_stats, n_params=n_params, n_out=n_out))
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=p.multiple_results))
    ad.primitive_jvps[p] = functools.partial(_jvp, p, formula, 2 + n_stats)
    ad.primitive_transposes[p] = functools.partial(_transpose, fn, tangent_names, linear_transpose,
                                                   ("x", "weight", *norm.stats))
    batching.primitive_batchers[p] = functools.partial(_batch, p, n_out, n_params)
    return p


# --- the norms' formula, one for both: `centered` adds the means and the bias ---------------------

def _per_column(p, rows: int, acc):
    """(*segments', C) -> (*segments', 1 per row axis, C) in `acc`: broadcasts against x."""
    return p.astype(acc).reshape(p.shape[:-1] + (1,) * rows + p.shape[-1:])


def tangent_reference(norm, x, weight, *rest, seg_dims: int, offset: float = 0.0, **_):
    """dy, `norm`'s formula above in jnp, accumulated in float32 (float64 for float64).
    rest = (*stats, dx, *parameter tangents); a centered norm subtracts the means (of x: its
    saved mean; of dx: mean(dx)) and adds dbias, the rest is one formula. The scale is
    offset + weight (reference.scale: the weight itself for a norm without an offset)."""
    n = len(norm.stats)
    stats, dx, (dweight, *dbias) = dict(zip(norm.stats, rest[:n])), rest[n], rest[n + 1:]
    acc = reference.acc_dtype(x.dtype)
    rows = x.ndim - 1 - seg_dims
    r = stats["rstd"].astype(acc)[..., None]
    xc = x.astype(acc) - stats["mean"].astype(acc)[..., None] if norm.centered else x.astype(acc)
    xhat = xc * r
    d = dx.astype(acc)
    dc = d - jnp.mean(d, axis=-1, keepdims=True) if norm.centered else d
    dxhat = (dc - xhat * jnp.mean(xhat * d, axis=-1, keepdims=True)) * r
    dy = dxhat * _per_column(reference.scale(weight, offset, acc), rows, acc) + xhat * _per_column(dweight, rows, acc)
    if norm.centered:
        dy = dy + _per_column(dbias[0], rows, acc)
    return dy.astype(x.dtype)


# --- the plain and the add_* map of a norm, written once -----------------------------------------
# Operands: (x, weight, *stats, dx, *ptangents) and (s, weight, *stats, dx, dresidual, *ptangents),
# ptangents the parameters' tangents (dweight[, dbias]).

def _add_formula(norm):
    """add_*'s (dy, ds) in jnp: ds = dx + dresidual in s's dtype (as jnp's x + residual), dy the
    norm's map applied to ds."""
    n = len(norm.stats)

    def add_formula(s, weight, *rest, **params):
        stats, (dx, dresidual), ptangents = rest[:n], rest[n:n + 2], rest[n + 2:]
        ds = dx + dresidual
        return tangent_reference(norm, s, weight, *stats, ds, *ptangents, **params), ds
    return add_formula


def _norm_transpose(norm):
    """dy -> (dx, *parameter cotangents) by the FFI op: the norm's backward."""
    n = len(norm.stats)

    def transpose(ct, x, weight, *rest, **params):
        stats, dx, ptangents = rest[:n], rest[n], rest[n + 1:]
        if type(ct) is ad.Zero or not any(ad.is_undefined_primal(t) for t in (dx, *ptangents)):
            return (None,) * (1 + len(ptangents))
        gx, *grads = ffi_backward(norm, ct, x, weight, stats, ptangents, None, **params)
        return (gx if ad.is_undefined_primal(dx) else None, *grads)
    return transpose


def _add_norm_transpose(norm):
    """(gy, gs) -> (dx, dresidual, *parameter cotangents): one FFI call, gs added to dx in it."""
    n = len(norm.stats)

    def transpose(cts, s, weight, *rest, **params):
        stats, (dx, dresidual), ptangents = rest[:n], rest[n:n + 2], rest[n + 2:]
        gy, gs = cts
        if type(gy) is ad.Zero:          # only s is used: its cotangent passes to x and residual
            if type(gs) is ad.Zero:
                return (None,) * (2 + len(ptangents))
            g, grads = gs, (None,) * len(ptangents)
        else:
            g, *grads = ffi_backward(norm, gy, s, weight, stats, ptangents, None if type(gs) is ad.Zero else gs,
                                     **params)
        return tuple(g if ad.is_undefined_primal(t) else None for t in (dx, dresidual)) + tuple(grads)
    return transpose


def _primitives(norm):
    """(the norm's tangent-map primitive, add_*'s), e.g. jax_lnbwd_layernorm_tangent and
    jax_lnbwd_add_layernorm_tangent."""
    ptangents = tuple("d" + p for p in norm.params)
    plain = define(f"jax_lnbwd_{norm.name}_tangent", functools.partial(tangent_reference, norm),
                   _norm_transpose(norm), norm=norm, fn=norm.name, tangent_names=("dx", *ptangents))
    add = define(f"jax_lnbwd_add_{norm.name}_tangent", _add_formula(norm), _add_norm_transpose(norm), norm=norm,
                 fn=f"add_{norm.name}", tangent_names=("dx", "dresidual", *ptangents), n_out=2)
    return plain, add


_PRIMITIVES = {norm: _primitives(norm) for norm in NORMS}


# --- bound by the norms' custom_jvps (autodiff.py) ---------------------------------------------

def tangent_map(norm, x, weight, stats, ptangents, dx, **params):
    """dy = `norm`'s tangent map at (x, weight, *stats) applied to (dx, *ptangents). Operands in
    the layout above; params: seg_dims, kernel and block_size of the FFI backward that the
    transpose runs (and rmsnorm's offset)."""
    return bind(_PRIMITIVES[norm][0], x, weight, *stats, dx, *ptangents, **params)


def add_tangent_map(norm, s, weight, stats, ptangents, dx, dresidual, **params):
    """(dy, ds), the tangents of add_*'s (y, s)."""
    return bind(_PRIMITIVES[norm][1], s, weight, *stats, dx, dresidual, *ptangents, **params)
