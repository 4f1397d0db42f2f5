"""add_layernorm's tangent map: s = x + residual, y = layernorm(s), as one linear primitive.

For add_layernorm (jax_lnbwd/add_layernorm.py) the tangents of (y, s) given tangents
(dx, dresidual, dweight, dbias) are
    ds = dx + dresidual,
    dy = tangent_map(s, weight, mean, rstd; ds, dweight, dbias)   (jax_lnbwd/primitive.py),
linear in (dx, dresidual, dweight, dbias). Its transpose takes cotangents (gy, gs) to
    g = layernorm's backward of gy + gs,   dx = dresidual = g,   dweight, dbias,
and that sum is ONE call of target v2: gs goes in as `dresidual`, aliased to dx, and the kernel
adds it while it writes dx (llm.c accumulates into dinp for the same reason: the residual stream's
gradient and the norm's meet there). Written as two primitives (an add and tangent_p) JAX would
transpose them into the FFI call followed by a separate add over the whole activation.

`add_tangent_p` is bound to (s, weight, mean, rstd, dx, dresidual, dweight, dbias) in the layout
of tangent_p (seg_dims segment axes first) and returns (dy, ds). Forward mode evaluates the jnp
formula; vmap adds a segment axis; derivatives of it follow tangent_p's (linear in the tangent
operands; jnp JVP of the formula for s, weight, mean, rstd).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _ffi
from .primitive import N_NONLINEAR, _backward, tangent_reference

add_tangent_p = Primitive("jax_lnbwd_add_layernorm_tangent")
add_tangent_p.multiple_results = True


def add_tangent_reference(s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims: int):
    """(dy, ds) in jnp: ds = dx + dresidual in s's dtype (as jnp's x + residual), dy from ds."""
    ds = dx + dresidual
    return tangent_reference(s, weight, mean, rstd, ds, dweight, dbias, seg_dims=seg_dims), ds


def add_tangent_map(s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims: int, kernel: int,
                    block_size: int):
    """(dy, ds), the tangents of add_layernorm's (y, s); kernel and block_size are the backward's.
    Inside shard_map every operand is typed as varying along the same mesh axes first."""
    args = (s, weight, mean, rstd, dx, dresidual, dweight, dbias)
    axes = _ffi.varying_axes(*args)
    return add_tangent_p.bind(*(_ffi.vary(a, axes) for a in args),
                              seg_dims=seg_dims, kernel=kernel, block_size=block_size)


def _impl(*args, seg_dims, kernel, block_size):
    return list(add_tangent_reference(*args, seg_dims=seg_dims))


def _abstract_eval(s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims, kernel, block_size):
    assert dx.shape == dresidual.shape == s.shape and dx.dtype == dresidual.dtype == s.dtype, (dx, dresidual, s)
    out = s.update(weak_type=False)
    return [out, out]


def _transpose(cts, s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims, kernel, block_size):
    """(gy, gs) -> (dx, dresidual, dweight, dbias) cotangents: one FFI call, gs added to dx in it."""
    if any(ad.is_undefined_primal(a) for a in (s, weight, mean, rstd)):
        raise ValueError("jax_lnbwd: the add_layernorm tangent map is linear in dx, dresidual, dweight "
                         "and dbias only; it cannot be transposed in x, weight, mean or rstd")
    gy, gs = cts
    if type(gy) is ad.Zero:          # only s is used: its cotangent passes to x and residual
        if type(gs) is ad.Zero:
            return (None,) * 8
        g, gweight, gbias = gs, None, None
    else:
        g, gweight, gbias = _backward(gy, s, weight, mean, rstd, dweight, dbias,
                                      None if type(gs) is ad.Zero else gs,
                                      seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    return ((None,) * N_NONLINEAR + tuple(g if ad.is_undefined_primal(t) else None for t in (dx, dresidual))
            + (gweight, gbias))


def _jvp(primals, tangents, *, seg_dims, kernel, block_size):
    """As tangent_p's: the primitive for the tangent operands, jnp's JVP for the others."""
    params = dict(seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    out = add_tangent_p.bind(*primals, **params)
    nonlinear, linear = primals[:N_NONLINEAR], primals[N_NONLINEAR:]
    t_nonlinear, t_linear = tangents[:N_NONLINEAR], tangents[N_NONLINEAR:]
    parts = []
    if any(type(t) is not ad.Zero for t in t_linear):
        parts.append(add_tangent_map(*nonlinear, *map(ad.instantiate_zeros, t_linear), **params))
    if any(type(t) is not ad.Zero for t in t_nonlinear):
        formula = lambda *a: add_tangent_reference(*a, *linear, seg_dims=seg_dims)  # noqa: E731
        parts.append(jax.jvp(formula, nonlinear, tuple(map(ad.instantiate_zeros, t_nonlinear)))[1])
    if not parts:
        return out, [ad.Zero.from_primal_value(o) for o in out]
    return out, list(functools.reduce(lambda a, b: tuple(map(jnp.add, a, b)), parts))


def _batch(args, dims, *, seg_dims, kernel, block_size):
    """vmap: the batch axis becomes a new outermost segment axis (as tangent_p's rule)."""
    B = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    out = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if d is not None:
            a = jnp.moveaxis(a, d, 0)
        elif i in (1, 6, 7):    # weight, dweight, dbias: shared by the new segments
            a = a[None]
        else:                   # s, mean, rstd, dx, dresidual: the same for every example
            a = jnp.broadcast_to(a, (B, *a.shape))
        out.append(a)
    return add_tangent_map(*out, seg_dims=seg_dims + 1, kernel=kernel, block_size=block_size), (0, 0)


add_tangent_p.def_impl(jax.jit(_impl, static_argnames=("seg_dims", "kernel", "block_size")))
add_tangent_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(add_tangent_p, mlir.lower_fun(_impl, multiple_results=True))
ad.primitive_jvps[add_tangent_p] = _jvp
ad.primitive_transposes[add_tangent_p] = _transpose
batching.primitive_batchers[add_tangent_p] = _batch
