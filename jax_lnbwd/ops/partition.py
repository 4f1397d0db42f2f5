"""The ops under sharding: every device runs the kernel on its own rows.

XLA's SPMD partitioner cannot see into a custom call, so by default it replicates one: it
all-gathers the inputs onto every device and each device computes the whole op. The forward
and backward ops are therefore `jax.experimental.custom_partitioning` functions, made by
`forward_partitioned` and `backward_partitioned` below from the op on local arrays, which tell
the partitioner how to split them. Their arrays keep x's leading axes (flattening (batch, seq,
C) sharded over batch and seq into rows would need a transpose across devices); for `seg_dims`
= k the layout is
  x (and dy, residual, dresidual, y, s, dx):  (*segments, *rows, C)  k segment axes (vmap's
                                              batch axes: per-example parameters and sums),
                                              then row axes;
  statistics (mean, rstd):                    (*segments, *rows);
  parameters and their gradients:             (*segments, C), each segment axis as in x or 1
                                              (shared by the segments).
The rule, per axis:
  * row axes may be sharded over any mesh axes, and stay so: each device runs the FFI op on its
    own rows; the forward needs no communication at all (each row is normalized by itself),
    and the backward's parameter gradients, the device's partial sums, are added up over the
    mesh axes that split the rows with ONE psum (stacked, in float32; float64 for float64);
  * segment axes may be sharded too: a device then holds whole examples, computes their sums
    itself, and the sums come out sharded like the segments; only row axes call for the psum;
    parameters follow x's segment axes where they have them and are replicated otherwise;
  * C must be whole on every device (each row's statistics and gradient need all of its
    columns): a C-sharded input is gathered along C, with a ShardingFallbackWarning;
  * an axis whose size does not divide evenly over its mesh axes (a padded sharding) is
    gathered too, with a ShardingFallbackWarning: padding rows would enter the sums.

Inside a shard_map over all mesh axes the ops never reach this rule: JAX lowers them as the
plain FFI call on the local arrays, so the backward returns the local rows' sums, like any jnp
code would (see the README's "Flax and sharding"). On one device it is the plain FFI call too.
A shard_map over only some mesh axes is the one case left to XLA (`partly_manual`).

QK-norm's one op (ops/qk.py) has its rule here too, `qk_partitioned` (at the end, built from the
same helpers: usable_spec, split_axes, psum_sums): every axis of q and k but D is rows to it.

The rule is given twice: `sharding_rule` (Shardy, JAX's default partitioner) names the factor
of every dimension, for propagation; `infer_sharding_from_operands` does the same for the older
GSPMD partitioner (jax_use_shardy_partitioner=False). `partition` serves both.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.mlir import ir
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import reference
from ..norms import Norm


class ShardingFallbackWarning(UserWarning):
    """A jax_lnbwd op gathers an input because it cannot use its sharding as it is."""


def in_partly_manual() -> bool:
    """Whether we are inside a shard_map over some mesh axes with the others automatic
    (shard_map(..., axis_names=...)), where custom_partitioning cannot name the automatic axes."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(mesh.manual_axes) and set(mesh.manual_axes) != set(mesh.axis_names)


def partly_manual(op: str, gathered: str) -> bool:
    """in_partly_manual(), with a warning if so: the caller runs the plain FFI call there, and
    XLA gathers `gathered` along the automatic axes.
    op: e.g. "the layernorm backward"; gathered: e.g. "dy and x"."""
    if not in_partly_manual():
        return False
    mesh = jax.sharding.get_abstract_mesh()
    them = "them" if " and " in gathered else "it"
    warnings.warn(f"jax_lnbwd: inside a shard_map over mesh axes {mesh.manual_axes} of "
                  f"{mesh.axis_names}, {op} gathers {gathered} along the others; "
                  f"shard_map over all axes, or jit with shardings, keeps {them} sharded.",
                  ShardingFallbackWarning)
    return True


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None -> (), 'a' -> ('a',), ('a', 'b') -> itself."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def usable_spec(x, op: str, c_needs: str, warn: bool, name: str = "x", last: str = "C") -> list:
    """x's sharding as a spec the op can keep, one entry per axis of x: C (each row needs all of
    its columns) and axes that do not split evenly (padding rows would enter the row sums) are
    replaced by None, i.e. gathered, with a ShardingFallbackWarning each when `warn`.

    op names the op for errors ("the layernorm backward"); c_needs says what a row needs C for
    and what is gathered ("each row's gradient needs all of its columns: dy and x are"); name
    and last name x and its last axis in the warnings."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        # JAX hands the rule NamedShardings whenever the program has a mesh (any NamedSharding
        # in it); without one there would be no axis names to psum over.
        raise NotImplementedError(f"jax_lnbwd: {op} can only be partitioned over a mesh (NamedSharding), "
                                  f"got {sharding!r}")
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    notes = []
    if spec[-1] is not None:
        notes.append(f"{name}'s last axis ({last}={x.shape[-1]}) is sharded over mesh axes {axes_of(spec[-1])}, "
                     f"but {c_needs} gathered along {last}. Shard the leading axes instead.")
        spec[-1] = None
    for i, size in enumerate(x.shape[:-1]):
        devices = math.prod(sharding.mesh.shape[a] for a in axes_of(spec[i]))
        if size % devices:
            notes.append(f"axis {i} of {name} (size {size}) does not split evenly over mesh axes "
                         f"{axes_of(spec[i])} ({devices} devices): it is gathered.")
            spec[i] = None
    if warn:
        for note in notes:
            warnings.warn(f"jax_lnbwd: {note}", ShardingFallbackWarning)
    return spec


def split_axes(spec, mesh) -> tuple[str, ...]:
    """The mesh axes that these spec entries shard over, but for those of size 1 (they split
    nothing, and a psum over them would cost an all-reduce): the axes of a psum over rows."""
    return tuple(a for entry in spec for a in axes_of(entry) if mesh.shape[a] > 1)


def psum_sums(sums, axes: tuple[str, ...], acc, dtype) -> list:
    """The devices' partial sums added up over mesh `axes` with ONE psum, stacked, in the
    accumulation dtype `acc` (adding n devices' 16-bit partial sums in 16 bits would round n
    times), and returned in `dtype`."""
    total = jax.lax.psum(jnp.stack(sums).astype(acc), axes)
    return [total[i].astype(dtype) for i in range(len(sums))]


def _param_sharding(mesh, spec, seg_dims, p, x) -> NamedSharding:
    """A parameter's (or its gradient's) sharding: its segment axes follow x's where they are
    not broadcast (size 1); C is whole."""
    return NamedSharding(mesh, P(*[spec[i] if p.shape[i] == x.shape[i] else None for i in range(seg_dims)], None))


def _factors(x_shape, seg_dims: int) -> tuple[list[str], str]:
    """Shardy's factor names for x's leading axes: (segment factors s<i>, 's0 .. r0 r1 ..')."""
    segs = [f"s{i}" for i in range(seg_dims)]
    return segs, " ".join(segs + [f"r{i}" for i in range(len(x_shape) - 1 - seg_dims)])


# --- the backward: (dy, x, weight, *stats, [dresidual]) -> (dx, *grads) ----------------------------
# grads: the parameter gradients (layernorm: dweight, dbias; rmsnorm: dweight), one per segment.

def _bwd_specs(seg_dims, arg_shapes, warn: bool, op: str):
    """(x's usable spec as a tuple, the mesh axes that split its rows), from x's sharding."""
    x = arg_shapes[1]
    spec = usable_spec(x, op, "each row's gradient needs all of its columns: dy and x are", warn)
    return tuple(spec), split_axes(spec[seg_dims:-1], x.sharding.mesh)


def _bwd_shardings(n_stats, n_grads, seg_dims, mesh, arg_shapes, spec):
    """(argument shardings, result shardings); dresidual, where present, is sharded like dy."""
    x, weight = arg_shapes[1], arg_shapes[2]
    rows, sums = NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(*spec[:seg_dims], None))
    stats = NamedSharding(mesh, P(*spec[:-1]))
    n_res = len(arg_shapes) - 3 - n_stats
    args = (rows, rows, _param_sharding(mesh, spec, seg_dims, weight, x)) + (stats,) * n_stats + (rows,) * n_res
    return args, (rows,) + (sums,) * n_grads


def _bwd_partition(local, n_stats, n_grads, op, seg_dims, kernel, block_size, mesh, arg_shapes, result_shape):
    """What each device runs, on the shardings it needs (the partitioner reshards to them)."""
    spec, row_axes = _bwd_specs(seg_dims, arg_shapes, True, op)
    arg_shardings, result_shardings = _bwd_shardings(n_stats, n_grads, seg_dims, mesh, arg_shapes, spec)
    acc = reference.acc_dtype(arg_shapes[1].dtype)
    sums_dtype = arg_shapes[2].dtype   # weight's: x's, or float32 beside 16-bit x (v2)

    def per_device(*arrays):
        dx, *grads = local(*arrays, seg_dims, kernel, block_size)
        if row_axes:
            grads = psum_sums(grads, row_axes, acc, sums_dtype)
        return (dx, *grads)

    return mesh, per_device, result_shardings, arg_shardings


def _bwd_infer(n_stats, n_grads, op, seg_dims, kernel, block_size, mesh, arg_shapes, result_shape):
    spec, _ = _bwd_specs(seg_dims, arg_shapes, False, op)
    return _bwd_shardings(n_stats, n_grads, seg_dims, mesh, arg_shapes, spec)[1]


def _bwd_rule(n_stats, n_grads, seg_dims, kernel, block_size, mesh, value_types, result_types):
    """Shardy's factors: s<i> segment axes, r<i> row axes, c columns, w<i> a weight axis of
    size 1 (broadcast over its segment axis). E.g. layernorm, one segment axis and two row axes:
    's0 r0 r1 c, s0 r0 r1 c, s0 c, s0 r0 r1, s0 r0 r1 -> s0 r0 r1 c, s0 c, s0 c'. The row
    factors are absent from the parameter gradients: our partition sums over them. A dresidual
    operand (after the stats) has dy's factors."""
    x_shape = ir.RankedTensorType(value_types[1]).shape
    w_shape = ir.RankedTensorType(value_types[2]).shape
    segs, lead = _factors(x_shape, seg_dims)
    weight = " ".join(s if w_shape[i] == x_shape[i] else f"w{i}" for i, s in enumerate(segs))
    sums = " ".join(segs + ["c"])
    stats = f", {lead}" * n_stats
    residual = f", {lead} c" * (len(value_types) - 3 - n_stats)
    return f"{lead} c, {lead} c, {weight} c{stats}{residual} -> {lead} c" + f", {sums}" * n_grads


def backward_partitioned(local, n_arrays: int, norm: Norm):
    """local(*arrays, seg_dims, kernel, block_size) -> (dx, *grads), `norm`'s backward partitioned
    by the rule above; arrays = (dy, x, weight, *stats, [dresidual]). The three settings are static."""
    n_stats, n_grads, op = len(norm.stats), len(norm.params), f"the {norm.name} backward"
    cp = custom_partitioning(local, static_argnums=(n_arrays, n_arrays + 1, n_arrays + 2))
    cp.def_partition(partition=functools.partial(_bwd_partition, local, n_stats, n_grads, op),
                     infer_sharding_from_operands=functools.partial(_bwd_infer, n_stats, n_grads, op),
                     sharding_rule=functools.partial(_bwd_rule, n_stats, n_grads))
    return cp


# --- the fused forward: (x, [residual], *params) -> (y, [s], *stats) ----------------------------

def _fwd_specs(arg_shapes, warn: bool, op: str):
    """x's usable spec, one entry per axis: C and unevenly split axes replaced by None."""
    return tuple(usable_spec(arg_shapes[0], op, "each row's statistics need all of its columns: x is", warn))


def _fwd_shardings(n_stats, seg_dims, has_res, mesh, arg_shapes, spec):
    """(argument shardings, result shardings); residual and s are sharded like x."""
    x = arg_shapes[0]
    rows, stats = NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(*spec[:-1]))
    n_rows = 2 if has_res else 1
    return ((rows,) * n_rows + tuple(_param_sharding(mesh, spec, seg_dims, p, x) for p in arg_shapes[n_rows:]),
            (rows,) * n_rows + (stats,) * n_stats)


def _fwd_partition(local, n_stats, op, seg_dims, has_w, has_b, eps, has_res, mesh, arg_shapes, result_shape):
    spec = _fwd_specs(arg_shapes, True, op)
    arg_shardings, result_shardings = _fwd_shardings(n_stats, seg_dims, has_res, mesh, arg_shapes, spec)

    def per_device(*arrays):
        return local(*arrays, seg_dims, has_w, has_b, eps, has_res)

    return mesh, per_device, result_shardings, arg_shardings


def _fwd_infer(n_stats, op, seg_dims, has_w, has_b, eps, has_res, mesh, arg_shapes, result_shape):
    return _fwd_shardings(n_stats, seg_dims, has_res, mesh, arg_shapes, _fwd_specs(arg_shapes, False, op))[1]


def _fwd_rule(n_stats, seg_dims, has_w, has_b, eps, has_res, mesh, value_types, result_types):
    """Shardy's factors: s<i> segment axes, r<i> row axes, c columns, w<k>_<i> a parameter axis
    of size 1 (broadcast over its segment axis). E.g. layernorm, one segment axis, one row axis,
    weight and bias per segment: 's0 r0 c, s0 c, s0 c -> s0 r0 c, s0 r0, s0 r0'; with a residual
    (it and s are factored like x): 's0 r0 c, s0 r0 c, s0 c, s0 c -> s0 r0 c, s0 r0 c, s0 r0, s0 r0'."""
    x_shape = ir.RankedTensorType(value_types[0]).shape
    segs, lead = _factors(x_shape, seg_dims)
    n_rows = 2 if has_res else 1
    params = []
    for k, t in enumerate(value_types[n_rows:]):
        p_shape = ir.RankedTensorType(t).shape
        params.append(" ".join([s if p_shape[i] == x_shape[i] else f"w{k}_{i}" for i, s in enumerate(segs)] + ["c"]))
    rows = [f"{lead} c"] * n_rows
    return ", ".join([*rows, *params]) + " -> " + ", ".join([*rows] + [lead] * n_stats)


def forward_partitioned(local, n_arrays: int, norm: Norm):
    """local(*arrays, seg_dims, has_w, has_b, eps, has_res) -> (y, [s], *stats), `norm`'s forward
    partitioned by the rule above; n_arrays = x, [residual] and the present parameters. The five
    settings are static."""
    n_stats, op = len(norm.stats), f"the {norm.name} forward"
    cp = custom_partitioning(local, static_argnums=tuple(range(n_arrays, n_arrays + 5)))
    cp.def_partition(partition=functools.partial(_fwd_partition, local, n_stats, op),
                     infer_sharding_from_operands=functools.partial(_fwd_infer, n_stats, op),
                     sharding_rule=functools.partial(_fwd_rule, n_stats))
    return cp


# --- QK-norm's one op (ops/qk.py; called by qk_autodiff.py and qk_tangent.py) ----------------------
# data: the separate form's (q [*rows, Hq, D], k [*rows, Hk, D]) or the fused form's (qkv [*rows, W]);
# forward:  (*data, q_weight, k_weight) -> (*outputs, *q_stats, *k_stats)
# backward: (*cts, *data, q_weight, k_weight, *q_stats, *k_stats) -> (*gdata, dq_weight, dk_weight)
# Weights and their gradients are (D,); stats are shaped like their set's heads without D (the
# fused form's: (*rows, Hq) and (*rows, Hk)). The rule, per axis:
#   * every axis of q and k but D is rows to the op (a head is a row), so their token axes and
#     head axis may be sharded and stay so: each device runs the op on its local heads; the
#     forward needs no communication, and the backward's weight gradients, the device's partial
#     sums, are added with ONE psum over the mesh axes that split rows or heads (psum_sums);
#   * D must be whole: a D-sharded q or k is gathered along D, with a ShardingFallbackWarning;
#   * the fused form's qkv may be sharded along its row axes only: its last axis holds each
#     token's q, k and v heads interleaved, so a sharded one is gathered, with the warning;
#   * unevenly split axes are gathered, with the warning (usable_spec).
# Where q and k are split over different mesh axes, a set's partial sums are counted once: the
# devices that hold a copy of another's heads (index > 0 along an axis that splits only the
# other set) add zeros to the one psum.

def _qk_data(fused: bool, backward: bool, arg_shapes) -> tuple:
    """The data operands among the arguments (after the cotangents in the backward)."""
    n = 1 if fused else 2
    return tuple(arg_shapes[n:2 * n] if backward else arg_shapes[:n])


def _qk_specs(fused: bool, backward: bool, arg_shapes, warn: bool, op: str) -> list[tuple]:
    """Each data operand's usable spec: D (or qkv's width) and unevenly split axes gathered."""
    if fused:
        return [tuple(usable_spec(_qk_data(fused, backward, arg_shapes)[0], op, "each token's q, k and v heads "
                                  "interleave along it, so qkv is", warn, name="qkv", last="W"))]
    needs = "each head's statistics and gradient need all of its values: q and k are"
    return [tuple(usable_spec(x, op, needs, warn, name=name, last="D"))
            for x, name in zip(_qk_data(fused, backward, arg_shapes), ("q", "k"))]


def _qk_shardings(n_stats: int, fused: bool, backward: bool, mesh, specs):
    """(argument shardings, result shardings): cotangents and outputs like their data, stats like
    their set's heads without D (the fused form's head axes whole), weights and their gradients whole."""
    data = tuple(NamedSharding(mesh, P(*spec)) for spec in specs)
    stat_specs = [specs[0][:-1] + (None,)] * 2 if fused else [spec[:-1] for spec in specs]
    q_stats, k_stats = (NamedSharding(mesh, P(*spec)) for spec in stat_specs)
    whole = NamedSharding(mesh, P(None))
    stats = (q_stats,) * n_stats + (k_stats,) * n_stats
    if backward:
        return (*data, *data, whole, whole, *stats), (*data, whole, whole)
    return (*data, whole, whole), (*data, *stats)


def _qk_partition(local, n_stats, fused, backward, op, mesh, arg_shapes, result_shape):
    specs = _qk_specs(fused, backward, arg_shapes, True, op)
    arg_shardings, result_shardings = _qk_shardings(n_stats, fused, backward, mesh, specs)
    if not backward:
        return mesh, local, result_shardings, arg_shardings
    # Each set's heads are split over its own axes (the fused form: qkv's, for both sets).
    own = [split_axes(specs[0][:-1], mesh)] * 2 if fused else [split_axes(spec[:-1], mesh) for spec in specs]
    axes = tuple(dict.fromkeys(own[0] + own[1]))
    acc = reference.acc_dtype(_qk_data(fused, backward, arg_shapes)[0].dtype)
    sums_dtype = arg_shapes[2 if fused else 4].dtype   # q_weight's: the data's, or float32 beside 16-bit data

    def per_device(*arrays):
        *gdata, dq_weight, dk_weight = local(*arrays)
        if not axes:
            return (*gdata, dq_weight, dk_weight)
        sums = []
        for partial, its in zip((dq_weight, dk_weight), own):
            others = [a for a in axes if a not in its]   # axes along which this set is a copy
            if others:
                first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in others])
                partial = jnp.where(first, partial, jnp.zeros_like(partial))
            sums.append(partial)
        return (*gdata, *psum_sums(sums, axes, acc, sums_dtype))

    return mesh, per_device, result_shardings, arg_shardings


def _qk_infer(n_stats, fused, backward, op, mesh, arg_shapes, result_shape):
    return _qk_shardings(n_stats, fused, backward, mesh, _qk_specs(fused, backward, arg_shapes, False, op))[1]


def _qk_rule(n_stats, fused, backward, mesh, value_types, result_types):
    """Shardy's factors: q<i>, k<i> the separate form's leading axes (heads included) and d their
    D, shared with the weights; r<i> the fused form's leading axes, w its width, hq and hk the
    stats' head axes. E.g. the separate rmsnorm forward on q, k [B, T, H, D]:
    'q0 q1 q2 d, k0 k1 k2 d, d, d -> q0 q1 q2 d, k0 k1 k2 d, q0 q1 q2, k0 k1 k2'; the fused
    backward on qkv [B, T, W]: 'r0 r1 w, r0 r1 w, d, d, r0 r1 hq, r0 r1 hk -> r0 r1 w, d, d'.
    The leading factors are absent from the weight gradients: our partition sums over them."""
    shapes = [ir.RankedTensorType(t).shape for t in value_types]
    first = shapes[1 if fused else 2] if backward else shapes[0]

    def lead(prefix, shape):
        return [f"{prefix}{i}" for i in range(len(shape) - 1)]

    if fused:
        rows = lead("r", first)
        data, q_stats, k_stats = [" ".join(rows + ["w"])], " ".join(rows + ["hq"]), " ".join(rows + ["hk"])
    else:
        k_shape = shapes[3] if backward else shapes[1]
        q_lead, k_lead = lead("q", first), lead("k", k_shape)
        data = [" ".join(q_lead + ["d"]), " ".join(k_lead + ["d"])]
        q_stats, k_stats = " ".join(q_lead), " ".join(k_lead)
    stats = [q_stats] * n_stats + [k_stats] * n_stats
    if backward:
        operands, results = data * 2 + ["d", "d"] + stats, data + ["d", "d"]
    else:
        operands, results = data + ["d", "d"], data + stats
    return ", ".join(operands) + " -> " + ", ".join(results)


def qk_partitioned(local, n_stats: int, fused: bool, backward: bool, fn: str):
    """local(*arrays), QK-norm's one-op forward or backward on arrays in the layout above (their
    leading shapes kept; local reshapes to the targets' 2-D rows), partitioned by the rule above.
    n_stats: the norm's statistics per set; fused: the form; fn: the public function (warnings)."""
    op = f"the {fn} {'backward' if backward else 'forward'}"

    def run(*arrays):
        return local(*arrays)

    cp = custom_partitioning(run)
    cp.def_partition(partition=functools.partial(_qk_partition, local, n_stats, fused, backward, op),
                     infer_sharding_from_operands=functools.partial(_qk_infer, n_stats, fused, backward, op),
                     sharding_rule=functools.partial(_qk_rule, n_stats, fused, backward))
    return cp
