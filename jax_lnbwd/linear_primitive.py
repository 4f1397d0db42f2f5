"""The rules shared by the tangent-map primitives of layernorm and add_layernorm.

Both tangent maps are linear JAX primitives bound to (x, weight, mean, rstd, *tangents) with
static parameters seg_dims, kernel and block_size (jax_lnbwd/primitive.py explains the math,
jax_lnbwd/add_primitive.py the added residual). The tangents are one or more data tangents
shaped like x (dx; dx and dresidual) followed by dweight and dbias. Operand layout, for
`seg_dims` = k:
    x and the data tangents:  (*segments, *rows, C)  (k segment axes, then any row axes);
    mean, rstd:               (*segments, *rows), float32 (float64 for float64 x);
    weight, dweight, dbias:   (*segments', C) where each segment axis is as in x or 1 (shared).
Every result has x's shape and dtype.

`define` makes such a primitive from its jnp formula and its transpose, and writes once what
the two have in common:
  * evaluation and lowering: the jnp formula, which XLA fuses and partitions like any jnp code;
  * abstract evaluation: the layout above is checked, the results are typed as x;
  * JVP: linear in the tangent operands, so for their tangents the primitive itself (a later
    transpose still reaches the FFI op); for x, weight, mean and rstd, jnp's JVP of the formula;
  * vmap: the batch axis becomes a new outermost segment axis (the FFI op's own layout), so
    reverse mode over a vmap is still one FFI call;
  * transpose: refused in x, weight, mean and rstd (the map is not linear in them); for the
    tangent operands, the primitive's own rule, which calls `ffi_backward`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _ffi, backward, reference

# x, weight, mean, rstd: the operands the map is not linear in.
N_NONLINEAR = 4
WEIGHT = 1
STATIC = ("seg_dims", "kernel", "block_size")


def bind(p: Primitive, *args, seg_dims: int, kernel: int, block_size: int):
    """p bound to args. Inside shard_map every operand is first typed as varying along the same
    mesh axes (a replicated weight next to sharded rows, say), so that the results' type is x's."""
    axes = _ffi.varying_axes(*args)
    return p.bind(*(_ffi.vary(a, axes) for a in args), seg_dims=seg_dims, kernel=kernel, block_size=block_size)


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
