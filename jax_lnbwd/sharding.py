"""The backward op under sharding: every device runs the kernel on its own rows.

XLA's SPMD partitioner cannot see into a custom call, so by default it replicates one: it
all-gathers dy and x onto every device and each device computes the whole backward. The op is
therefore a `jax.experimental.custom_partitioning` function, `layernorm_bwd_segments`, that
tells the partitioner how to split it. Its arrays keep x's leading axes (the layout is in
backward.py: k segment axes, then row axes, then C), and the rule is per axis:

  * row axes (all leading axes of a plain layernorm) may be sharded over any mesh axes, and
    stay so: each device runs the FFI op on its own rows, dx keeps x's sharding (no gather),
    and dweight/dbias, the device's partial sums, are added up over the mesh axes that split
    the rows with ONE psum (dweight and dbias stacked, in float32; float64 for float64);
  * segment axes (vmap's batch axes: one dweight/dbias per example) may be sharded too: a
    device then holds whole examples, computes their sums itself, and dweight/dbias come out
    sharded like the segments; only row axes call for the psum;
  * C must be whole on every device (each row's dx needs sums over all of its columns): a
    C-sharded input is gathered along C, with a ShardingFallbackWarning;
  * an axis whose size does not divide evenly over its mesh axes (a padded sharding) is
    gathered too, with a ShardingFallbackWarning: padding rows would enter the sums.

Inside a shard_map over all mesh axes the op never reaches this rule: JAX lowers it as the
plain FFI call on the local arrays, so it returns the local rows' sums, like any jnp code
would (see the README's "Flax and sharding"). On one device it is the plain FFI call too.
A shard_map over only some mesh axes is the one case left to XLA (layernorm_bwd_segments).

Target v2 (`layernorm_bwd_segments_v2`: a float32 weight beside 16-bit data, and an optional
residual gradient added to dx) is partitioned by the same rule: dresidual shards like dy, and
dweight/dbias (and their psum's result) have the weight's dtype.

The rule is given twice: `sharding_rule` (Shardy, JAX's default partitioner) names the factor
of every dimension, for propagation; `infer_sharding_from_operands` does the same for the older
GSPMD partitioner (jax_use_shardy_partitioner=False). `partition` serves both.
"""
from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.mlir import ir
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _ffi, reference
from .kernels import workspace_bytes


class ShardingFallbackWarning(UserWarning):
    """The layernorm backward gathers an input because it cannot use its sharding as it is."""


def _local(dy, x, weight, mean, rstd, dresidual, seg_dims, kernel, block_size, v2: bool):
    """The FFI op on the arrays it is given: whole arrays, or one device's block when partitioned.

    Flattens the layout to the FFI's (rows, C), segments = product of the segment axes, and
    sizes the workspace from these shapes: a device's call gets a workspace for its own rows.
    v2: target v2 (dresidual may be None); else target v1 (dresidual is None).
    """
    segs, C = x.shape[:seg_dims], x.shape[-1]
    segments, rows = math.prod(segs), math.prod(x.shape[:-1])
    ws = workspace_bytes(kernel, rows, C, str(jnp.dtype(x.dtype)), block_size, segments)
    args = (dy.reshape(rows, C), x.reshape(rows, C), weight.reshape(math.prod(weight.shape[:-1]), C),
            mean.reshape(rows), rstd.reshape(rows))
    kw = dict(segments=segments, kernel=kernel, block_size=block_size, workspace_bytes=ws)
    if v2:
        res = None if dresidual is None else dresidual.reshape(rows, C)
        dx, dweight, dbias = _ffi.layernorm_bwd_segments_v2(*args, dresidual=res, **kw)
    else:
        dx, dweight, dbias = _ffi.layernorm_bwd_segments(*args, **kw)
    return dx.reshape(x.shape), dweight.reshape(*segs, C), dbias.reshape(*segs, C)


def _local_op(dy, x, weight, mean, rstd, seg_dims, kernel, block_size):
    return _local(dy, x, weight, mean, rstd, None, seg_dims, kernel, block_size, v2=False)


def _local_op_v2(dy, x, weight, mean, rstd, seg_dims, kernel, block_size):
    return _local(dy, x, weight, mean, rstd, None, seg_dims, kernel, block_size, v2=True)


def _local_op_v2_residual(dy, x, weight, mean, rstd, dresidual, seg_dims, kernel, block_size):
    return _local(dy, x, weight, mean, rstd, dresidual, seg_dims, kernel, block_size, v2=True)


# (dy, x, weight, mean, rstd, [dresidual,] seg_dims, kernel, block_size) -> (dx, dweight, dbias);
# the last three are static. One per target and residual, each partitioned by the rule below.
_partitioned_op = custom_partitioning(_local_op, static_argnums=(5, 6, 7))
_partitioned_op_v2 = custom_partitioning(_local_op_v2, static_argnums=(5, 6, 7))
_partitioned_op_v2_residual = custom_partitioning(_local_op_v2_residual, static_argnums=(6, 7, 8))


def layernorm_bwd_segments(dy, x, weight, mean, rstd, seg_dims: int, kernel: int, block_size: int):
    """The op, partitioned by the rule below wherever XLA partitions it.

    One case is left to XLA: a shard_map over some mesh axes with the others automatic
    (shard_map(..., axis_names=...)). custom_partitioning cannot name the automatic axes
    there, so the plain FFI call runs, and XLA gathers its inputs along the automatic axes.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes and set(mesh.manual_axes) != set(mesh.axis_names):
        warnings.warn(f"jax_lnbwd: inside a shard_map over mesh axes {mesh.manual_axes} of "
                      f"{mesh.axis_names}, the layernorm backward gathers dy and x along the others; "
                      "shard_map over all axes, or jit with shardings, keeps them sharded.",
                      ShardingFallbackWarning)
        return _local_op(dy, x, weight, mean, rstd, seg_dims, kernel, block_size)
    return _partitioned_op(dy, x, weight, mean, rstd, seg_dims, kernel, block_size)


def layernorm_bwd_segments_v2(dy, x, weight, mean, rstd, seg_dims: int, kernel: int, block_size: int,
                              dresidual=None):
    """Target v2 (mixed precision, residual gradient), partitioned as layernorm_bwd_segments.

    dresidual, if given, has x's shape and dtype and is sharded like dy; dweight and dbias have
    weight's dtype."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes and set(mesh.manual_axes) != set(mesh.axis_names):
        warnings.warn(f"jax_lnbwd: inside a shard_map over mesh axes {mesh.manual_axes} of "
                      f"{mesh.axis_names}, the layernorm backward gathers dy and x along the others; "
                      "shard_map over all axes, or jit with shardings, keeps them sharded.",
                      ShardingFallbackWarning)
        return _local(dy, x, weight, mean, rstd, dresidual, seg_dims, kernel, block_size, v2=True)
    if dresidual is None:
        return _partitioned_op_v2(dy, x, weight, mean, rstd, seg_dims, kernel, block_size)
    return _partitioned_op_v2_residual(dy, x, weight, mean, rstd, dresidual, seg_dims, kernel, block_size)


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None -> (), 'a' -> ('a',), ('a', 'b') -> itself."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def usable_spec(x, op: str, c_needs: str, warn: bool) -> list:
    """x's sharding as a spec the op can keep, one entry per axis of x: C (each row needs all of
    its columns) and axes that do not split evenly (padding rows would enter the row sums) are
    replaced by None, i.e. gathered, with a ShardingFallbackWarning each when `warn`.

    op names the op for errors ("the layernorm backward"); c_needs says what a row needs C for
    and what is gathered ("each row's gradient needs all of its columns: dy and x are")."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        # JAX hands the rule NamedShardings whenever the program has a mesh (any NamedSharding
        # in it); without one there would be no axis names to psum over.
        raise NotImplementedError(f"jax_lnbwd: {op} can only be partitioned over a mesh (NamedSharding), "
                                  f"got {sharding!r}")
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    notes = []
    if spec[-1] is not None:
        notes.append(f"x's last axis (C={x.shape[-1]}) is sharded over mesh axes {axes_of(spec[-1])}, "
                     f"but {c_needs} gathered along C. Shard the leading axes instead.")
        spec[-1] = None
    for i, size in enumerate(x.shape[:-1]):
        devices = math.prod(sharding.mesh.shape[a] for a in axes_of(spec[i]))
        if size % devices:
            notes.append(f"axis {i} of x (size {size}) does not split evenly over mesh axes "
                         f"{axes_of(spec[i])} ({devices} devices): it is gathered.")
            spec[i] = None
    if warn:
        for note in notes:
            warnings.warn(f"jax_lnbwd: {note}", ShardingFallbackWarning)
    return spec


def _specs(seg_dims, arg_shapes, warn: bool):
    """(x's usable spec as a tuple, the mesh axes that split its rows), from x's sharding."""
    x = arg_shapes[1]
    sharding = x.sharding
    spec = usable_spec(x, "the layernorm backward",
                       "each row's gradient needs all of its columns: dy and x are", warn)
    # The psum's axes; an axis of size 1 splits nothing (and would cost an all-reduce).
    row_axes = tuple(a for entry in spec[seg_dims:-1] for a in axes_of(entry) if sharding.mesh.shape[a] > 1)
    return tuple(spec), row_axes


def _shardings(seg_dims, mesh, arg_shapes, spec):
    """(argument shardings, result shardings) for (dy, x, weight, mean, rstd, [dresidual]) ->
    (dx, dw, db); dresidual, where present, is sharded like dy."""
    x, weight = arg_shapes[1], arg_shapes[2]
    # A weight axis that is not broadcast (size 1) follows its segment axis.
    weight_spec = [spec[i] if weight.shape[i] == x.shape[i] else None for i in range(seg_dims)]
    rows, sums = NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(*spec[:seg_dims], None))
    stats = NamedSharding(mesh, P(*spec[:-1]))
    args = (rows, rows, NamedSharding(mesh, P(*weight_spec, None)), stats, stats) + (rows,) * (len(arg_shapes) - 5)
    return args, (rows, sums, sums)


def _partition_with(local):
    """def_partition's `partition` for the op `local`(*arrays, seg_dims, kernel, block_size)."""
    def partition(seg_dims, kernel, block_size, mesh, arg_shapes, result_shape):
        """What each device runs, on the shardings it needs (the partitioner reshards to them)."""
        spec, row_axes = _specs(seg_dims, arg_shapes, warn=True)
        arg_shardings, result_shardings = _shardings(seg_dims, mesh, arg_shapes, spec)
        acc = reference.acc_dtype(arg_shapes[1].dtype)
        sums_dtype = arg_shapes[2].dtype   # weight's: x's, or float32 beside 16-bit x (v2)

        def per_device(*arrays):
            dx, dweight, dbias = local(*arrays, seg_dims, kernel, block_size)
            if row_axes:
                # One psum for both sums, in the accumulation dtype: adding n devices' 16-bit
                # partial sums in 16 bits would round n times.
                sums = jax.lax.psum(jnp.stack([dweight, dbias]).astype(acc), row_axes)
                dweight, dbias = sums[0].astype(sums_dtype), sums[1].astype(sums_dtype)
            return dx, dweight, dbias

        return mesh, per_device, result_shardings, arg_shardings
    return partition


def _infer_sharding_from_operands(seg_dims, kernel, block_size, mesh, arg_shapes, result_shape):
    spec, _ = _specs(seg_dims, arg_shapes, warn=False)
    return _shardings(seg_dims, mesh, arg_shapes, spec)[1]


def _sharding_rule(seg_dims, kernel, block_size, mesh, value_types, result_types):
    """Shardy's factors: s<i> segment axes, r<i> row axes, c columns, w<i> a weight axis of
    size 1 (broadcast over its segment axis). E.g. one segment axis and two row axes:
    's0 r0 r1 c, s0 r0 r1 c, s0 c, s0 r0 r1, s0 r0 r1 -> s0 r0 r1 c, s0 c, s0 c'. The row
    factors are absent from dweight/dbias: our partition sums over them. A sixth operand
    (dresidual, target v2) has dy's factors."""
    x_shape = ir.RankedTensorType(value_types[1]).shape
    w_shape = ir.RankedTensorType(value_types[2]).shape
    segs = [f"s{i}" for i in range(seg_dims)]
    lead = " ".join(segs + [f"r{i}" for i in range(len(x_shape) - 1 - seg_dims)])
    weight = " ".join(s if w_shape[i] == x_shape[i] else f"w{i}" for i, s in enumerate(segs))
    sums = " ".join(segs + ["c"])
    residual = f", {lead} c" * (len(value_types) - 5)
    return f"{lead} c, {lead} c, {weight} c, {lead}, {lead}{residual} -> {lead} c, {sums}, {sums}"


for _op, _fn in ((_partitioned_op, _local_op), (_partitioned_op_v2, _local_op_v2),
                 (_partitioned_op_v2_residual, _local_op_v2_residual)):
    _op.def_partition(
        partition=_partition_with(_fn),
        infer_sharding_from_operands=_infer_sharding_from_operands,
        sharding_rule=_sharding_rule,
    )
