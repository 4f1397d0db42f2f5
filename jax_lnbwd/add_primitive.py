"""add_layernorm's tangent map: s = x + residual, y = layernorm(s), as one linear primitive.

For add_layernorm (jax_lnbwd/add_layernorm.py) the tangents of (y, s) given tangents
(dx, dresidual, dweight, dbias) are
    ds = dx + dresidual,
    dy = tangent_map(s, weight, mean, rstd; ds, dweight, dbias)   (jax_lnbwd/primitive.py),
linear in (dx, dresidual, dweight, dbias). Its transpose takes cotangents (gy, gs) to
    g = layernorm's backward of gy + gs,   dx = dresidual = g,   dweight, dbias,
and that sum is ONE call of target v2: gs goes in as `dresidual` and the kernel adds it while it
writes dx (llm.c accumulates into dinp for the same reason: the residual stream's
gradient and the norm's meet there). Written as two primitives (an add and tangent_p) JAX would
transpose them into the FFI call followed by a separate add over the whole activation.

`add_tangent_p` is bound to (s, weight, mean, rstd, dx, dresidual, dweight, dbias) in the layout
of tangent_p (seg_dims segment axes first) and returns (dy, ds). Its other rules are tangent_p's,
written once in jax_lnbwd/linear_primitive.py: forward mode evaluates the jnp formula; vmap adds
a segment axis; its derivatives are the primitive again for the tangent operands (it is linear
in them) and jnp's JVP of the formula for s, weight, mean and rstd.
"""
from __future__ import annotations

from jax.interpreters import ad

from . import linear_primitive
from .primitive import tangent_reference


def add_tangent_reference(s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims: int):
    """(dy, ds) in jnp: ds = dx + dresidual in s's dtype (as jnp's x + residual), dy from ds."""
    ds = dx + dresidual
    return tangent_reference(s, weight, mean, rstd, ds, dweight, dbias, seg_dims=seg_dims), ds


def _transpose(cts, s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims, kernel, block_size):
    """(gy, gs) -> (dx, dresidual, dweight, dbias) cotangents: one FFI call, gs added to dx in it."""
    gy, gs = cts
    if type(gy) is ad.Zero:          # only s is used: its cotangent passes to x and residual
        if type(gs) is ad.Zero:
            return (None,) * 4
        g, gweight, gbias = gs, None, None
    else:
        g, gweight, gbias = linear_primitive.ffi_backward(gy, s, weight, mean, rstd, dweight, dbias,
                                                          None if type(gs) is ad.Zero else gs,
                                                          seg_dims=seg_dims, kernel=kernel, block_size=block_size)
    return tuple(g if ad.is_undefined_primal(t) else None for t in (dx, dresidual)) + (gweight, gbias)


add_tangent_p = linear_primitive.define("jax_lnbwd_add_layernorm_tangent", add_tangent_reference, _transpose,
                                        fn="add_layernorm", tangent_names=("dx", "dresidual", "dweight", "dbias"),
                                        n_out=2)


def add_tangent_map(s, weight, mean, rstd, dx, dresidual, dweight, dbias, *, seg_dims: int, kernel: int,
                    block_size: int):
    """(dy, ds), the tangents of add_layernorm's (y, s); kernel and block_size are the backward's."""
    return linear_primitive.bind(add_tangent_p, s, weight, mean, rstd, dx, dresidual, dweight, dbias,
                                 seg_dims=seg_dims, kernel=kernel, block_size=block_size)
