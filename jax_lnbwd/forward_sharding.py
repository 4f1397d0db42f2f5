"""The fused forward's FFI calls, and their rule under sharding: every device normalizes its own rows.

XLA's SPMD partitioner cannot see into a custom call, so by default it would replicate it (gather
x onto every device). The op is therefore a `jax.experimental.custom_partitioning` function.
Its arrays keep x's leading axes (flattening (batch, seq, C) sharded over batch and seq into
rows would need a transpose across devices); the layout, for `seg_dims` = k, is
  x:             (*segments, *rows, C)   k segment axes (vmap's batch axes), then row axes;
  weight, bias:  (*segments, C), each segment axis as in x or 1 (shared); absent ones are not
                 operands at all;
  y:             like x;  mean, rstd: x's shape without C.
The residual variant (add_layernorm's forward, target jax_lnbwd_add_layernorm_fwd_v1) has one
more operand, residual, and one more result, s = x + residual: both laid out and sharded like x.
With x's own bias (target jax_lnbwd_add_layernorm_fwd_v2, s = (x + x_bias) + residual), x_bias
is one more parameter, laid out and sharded like weight and bias (the first of the parameters).
The rule, per axis:
  * every leading axis of x may be sharded over any mesh axes, and y, mean and rstd (and residual
    and s) keep that sharding: each row is normalized by itself, so no communication at all;
  * weight and bias follow x's segment axes where they have them, and are replicated otherwise;
  * C must be whole on every device (each row's statistics need all of its columns): a
    C-sharded x is gathered along C, with a ShardingFallbackWarning; so is an axis whose size
    does not divide evenly over its mesh axes.
Inside a shard_map over all mesh axes the op never reaches this rule: it is the plain FFI call
on the local arrays. The rule is given for Shardy (`sharding_rule`) and for GSPMD
(`infer_sharding_from_operands`); `partition` serves both.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.mlir import ir
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _ffi, reference
from .sharding import ShardingFallbackWarning, usable_spec

TARGET = "jax_lnbwd_layernorm_fwd_v1"
# The residual variant: inputs (x, residual, weight, bias), results (y, s, mean, rstd).
ADD_TARGET = "jax_lnbwd_add_layernorm_fwd_v1"
# ... with x's own bias: inputs (x, x_bias, residual, weight, bias), the same results.
ADD_BIAS_TARGET = "jax_lnbwd_add_layernorm_fwd_v2"


def ffi_forward(x, weight, bias, eps: float, residual=None, x_bias=None):
    """The FFI target on (rows, C) x and (W, C) weight/bias: (y, mean, rstd); with a (rows, C)
    residual of x's dtype, the residual variant: (y, s, mean, rstd), s = x + residual rounded to
    x's dtype and y, mean, rstd those of s; with a (W, C) x_bias (W >= 1) too, s = (x + x_bias) +
    residual (target v2).

    W is 0 (absent), 1 (shared) or S dividing rows (rows form S equal segments, segment s uses
    parameter row s). The bare call: no checks, batching, derivative or sharding rule. Inside
    shard_map the results are typed as varying along every mesh axis any input varies along
    (a replicated weight next to sharded rows is cast to varying first), like jnp code.
    """
    has_res = residual is not None
    _ffi.check_handler_for_default_platform("add_layernorm_fwd_op" if has_res else "layernorm_fwd_op")
    if x_bias is not None:
        operands = (x, x_bias, residual, weight, bias)
    else:
        operands = (x, residual, weight, bias) if has_res else (x, weight, bias)
    axes = _ffi.varying_axes(*operands)
    operands = tuple(_ffi.vary(a, axes) for a in operands)
    typed = dict(sharding=NamedSharding(jax.sharding.get_abstract_mesh(), P()),
                 manual_axis_type=jax.sharding.ManualAxisType(varying=axes)) if axes else {}
    rows, C = x.shape
    stat = reference.acc_dtype(x.dtype)
    row = jax.ShapeDtypeStruct((rows, C), x.dtype, **typed)   # y (and s)
    stats = (jax.ShapeDtypeStruct((rows,), stat, **typed),) * 2   # mean, rstd
    out_types = (row, row, *stats) if has_res else (row, *stats)
    target = ADD_BIAS_TARGET if x_bias is not None else ADD_TARGET if has_res else TARGET
    return jax.ffi.ffi_call(target, out_types)(*operands, eps=np.float64(eps))


def local_op(x, params, seg_dims: int, has_w: bool, has_b: bool, eps: float, residual=None, has_xb: bool = False):
    """The op on the arrays it is given (whole, or one device's block): flattens the layout to
    the FFI's (rows, C), with an empty (0, C) array for an absent parameter. (y, mean, rstd), or
    (y, s, mean, rstd) with a residual; has_xb: params start with x_bias."""
    C = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    it = iter(params)
    pdtype = params[0].dtype if params else x.dtype

    def flat(present):
        if not present:
            return jnp.zeros((0, C), pdtype)
        p = next(it)
        return p.reshape(math.prod(p.shape[:-1]), C)

    xb = flat(True) if has_xb else None
    w, b = flat(has_w), flat(has_b)
    res = None if residual is None else residual.reshape(rows, C)
    *rows_out, mean, rstd = ffi_forward(x.reshape(rows, C), w, b, eps, res, xb)
    return (*(a.reshape(x.shape) for a in rows_out), mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1]))


def layernorm_fwd_partitioned(x, params, seg_dims: int, has_w: bool, has_b: bool, eps: float, residual=None,
                              has_xb: bool = False):
    """The op, partitioned by the rule below wherever XLA partitions it. A shard_map over only
    some mesh axes is left to XLA (custom_partitioning cannot name the automatic axes): the plain
    FFI call runs there and XLA gathers x along the automatic axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes and set(mesh.manual_axes) != set(mesh.axis_names):
        warnings.warn(f"jax_lnbwd: inside a shard_map over mesh axes {mesh.manual_axes} of "
                      f"{mesh.axis_names}, the layernorm forward gathers x along the others; "
                      "shard_map over all axes, or jit with shardings, keeps it sharded.",
                      ShardingFallbackWarning)
        return local_op(x, params, seg_dims, has_w, has_b, eps, residual, has_xb)
    has_res = residual is not None
    operands = (x, residual, *params) if has_res else (x, *params)
    return _partitioned(len(params), has_res, has_xb)(*operands, seg_dims, has_w, has_b, eps, has_res)


def _specs(arg_shapes, warn: bool):
    """x's usable spec, one entry per axis: C and unevenly split axes replaced by None."""
    return tuple(usable_spec(arg_shapes[0], "the layernorm forward",
                             "each row's mean and variance need all of its columns: x is", warn))


def _shardings(seg_dims, has_res, mesh, arg_shapes, spec):
    """(argument shardings, result shardings) for (x, [residual], *params) -> (y, [s], mean, rstd)."""
    x = arg_shapes[0]

    def param(p):  # a parameter's segment axis follows x's where it is not broadcast (size 1)
        return NamedSharding(mesh, P(*[spec[i] if p.shape[i] == x.shape[i] else None for i in range(seg_dims)], None))

    rows, stats = NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(*spec[:-1]))
    n_rows = 2 if has_res else 1   # x, and residual: sharded alike
    return ((rows,) * n_rows + tuple(param(p) for p in arg_shapes[n_rows:]),
            (rows,) * n_rows + (stats, stats))


def _partition(has_xb, seg_dims, has_w, has_b, eps, has_res, mesh, arg_shapes, result_shape):
    spec = _specs(arg_shapes, warn=True)
    arg_shardings, result_shardings = _shardings(seg_dims, has_res, mesh, arg_shapes, spec)

    def per_device(x, *rest):
        residual, params = (rest[0], rest[1:]) if has_res else (None, rest)
        return local_op(x, params, seg_dims, has_w, has_b, eps, residual, has_xb)

    return mesh, per_device, result_shardings, arg_shardings


def _infer_sharding_from_operands(seg_dims, has_w, has_b, eps, has_res, mesh, arg_shapes, result_shape):
    return _shardings(seg_dims, has_res, mesh, arg_shapes, _specs(arg_shapes, warn=False))[1]


def _sharding_rule(seg_dims, has_w, has_b, eps, has_res, mesh, value_types, result_types):
    """Shardy's factors: s<i> segment axes, r<i> row axes, c columns, w<i> a parameter axis of
    size 1 (broadcast over its segment axis). E.g. one segment axis, one row axis, weight and
    bias per segment: 's0 r0 c, s0 c, s0 c -> s0 r0 c, s0 r0, s0 r0'; with a residual (it and s
    are factored like x): 's0 r0 c, s0 r0 c, s0 c, s0 c -> s0 r0 c, s0 r0 c, s0 r0, s0 r0'."""
    x_shape = ir.RankedTensorType(value_types[0]).shape
    segs = [f"s{i}" for i in range(seg_dims)]
    lead = " ".join(segs + [f"r{i}" for i in range(len(x_shape) - 1 - seg_dims)])
    n_rows = 2 if has_res else 1
    params = []
    for k, t in enumerate(value_types[n_rows:]):
        p_shape = ir.RankedTensorType(t).shape
        params.append(" ".join([s if p_shape[i] == x_shape[i] else f"w{k}_{i}" for i, s in enumerate(segs)] + ["c"]))
    rows = [f"{lead} c"] * n_rows
    return ", ".join([*rows, *params]) + " -> " + ", ".join([*rows, lead, lead])


@functools.cache
def _partitioned(n_params: int, has_res: bool, has_xb: bool = False):
    """The custom_partitioning op for n_params present parameters (x_bias first with has_xb):
    (x, [residual], *params, seg_dims, has_w, has_b, eps, has_res) -> (y, [s], mean, rstd), the
    last five static."""
    n_arrays = 1 + has_res + n_params

    def op(x, *rest):
        arrays, (seg_dims, has_w, has_b, eps, _) = rest[:n_arrays - 1], rest[n_arrays - 1:]
        residual, params = (arrays[0], arrays[1:]) if has_res else (None, arrays)
        return local_op(x, params, seg_dims, has_w, has_b, eps, residual, has_xb)

    partitioned = custom_partitioning(op, static_argnums=tuple(range(n_arrays, n_arrays + 5)))
    partitioned.def_partition(partition=functools.partial(_partition, has_xb),
                              infer_sharding_from_operands=_infer_sharding_from_operands,
                              sharding_rule=_sharding_rule)
    return partitioned
