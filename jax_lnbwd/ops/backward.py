"""The backward FFI op of any norm, made batchable, differentiable and partitionable: op(dy, x, weight, *stats).

The op keeps x's leading axes instead of flattening them into rows, so that a sharding of any
of them reaches the partitioning rule (ops/partition.py) as it is. For `seg_dims` = k
(static), the layout is
  dy, x:        (*segments, *rows, C)  k segment axes, then at least one row axis;
  weight:       (*segments, C), all segment axes as in x (one weight per segment), or all 1
                (one weight shared by every segment);
  stats:        (*segments, *rows) each: the norm's saved statistics (layernorm: mean, rstd;
                rmsnorm: rstd; norms.py);
  dx:           like x;  the parameter gradients (layernorm: dweight, dbias; rmsnorm: dweight):
                (*segments, C), sums over each segment's rows.
Segment axes are the batch axes that vmap added (one per vmap level): per-example sums.

Three wrappers around the FFI call (`ffi_call`), from the inside out (see `segmented_op`):
  * jax.experimental.custom_partitioning (ops/partition.py): under a sharded jit every device
    runs the op on its own rows, and dweight/dbias are summed with one psum;
  * jax.custom_batching.custom_vmap: under vmap the batch axis becomes one more segment axis
    of the rows, so a vmapped backward is still ONE FFI call, with per-example dweight/dbias
    (the sums over each example's rows, not over the whole batch);
  * jax.custom_jvp: the op's own derivative is the JVP of the same math in pure jnp, so the
    backward is differentiable again, in both modes: grad of grad, and jax.jvp of jax.grad
    (the usual Hessian-vector product).
A norm's reverse mode reaches this op as the transpose of its tangent map (tangent.py);
layernorm_bwd calls it directly.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks, dispatch, reference
from ..kernels import KERNELS, workspace_bytes
from ..norms import Norm
from . import ffi, partition

# Kernels that can split the rows into segments with their own dweight/dbias sums: the ones
# that run under vmap (KernelInfo.segments). Others sum over all rows only (the C++ refuses
# segments > 1 for them).
SEGMENT_KERNELS = frozenset(k for k, info in KERNELS.items() if info.segments)


def ffi_call(dy, x, weight, *stats, segments: int, kernel: int, block_size: int, workspace_bytes: int,
             v2: bool, norm: Norm, dresidual=None, alias_residual: bool = False, offset: float = 0.0):
    """`norm`'s FFI target on (rows, C) arrays: (dx, *grads) (layernorm: dx, dweight, dbias; rmsnorm:
    dx, dweight). stats are the norm's saved statistics, (rows,) each. weight is (1, C) shared by
    all rows, or (segments, C); the rows form `segments` equal contiguous segments and the
    parameter gradients have shape (segments, C): the sums over each segment's rows.

    v1 (v2=False, layernorm only): weight of x's dtype, nothing added to dx. v2 adds
      * mixed precision: weight may be float32 beside bfloat16/float16 dy and x. g = weight * dy
        is then formed in fp32 from the float32 weight (never rounded to 16 bits), and the
        gradients have weight's dtype: the fp32 sums, stored as float32. One pass, no cast of x.
      * dresidual (rows, C) of x's dtype: a gradient added to dx inside the kernel,
        dx = the norm's dx + dresidual, summed in fp32 and rounded once: the residual stream's
        gradient of a fused add + norm. The kernel reads each element of it once and writes dx
        once. By default dx is a buffer of its own: in a transformer block the residual stream's
        gradient is also read by the matmuls and the bias gradient of the branch it came
        through, so XLA would have to copy it first to write dx into it (a copy of a whole
        activation per block, as slow as the add that the fusion saves). alias_residual=True
        passes it aliased to dx (input_output_aliases) instead: dx is written into dresidual's
        buffer, which saves that buffer where dresidual is dead after the call. The kernels
        take either (each element of dresidual is read by the thread that then writes it as dx).
    An absent dresidual is a zero-size placeholder with the attribute has_residual=False (one
    target, no aliasing then). Kernels 1-10 refuse both additions, and rmsnorm. rmsnorm's target
    is v2's form, with `offset` (added to the weight by the kernel) as one more attribute.

    The bare call: no batching rule (no `vmap_method`, which newer JAX may not accept), no
    derivative and no sharding rule; the wrappers below add them.
    """
    rows, C = x.shape
    attributes = dict(kernel=np.int32(kernel), block_size=np.int32(block_size))
    operands = (dy, x, weight, *stats)
    aliases = None
    if v2:
        ffi.check_handler_for_default_platform(norm.name + "_bwd")
        _checks.v2_args(norm.name + "_bwd", x, weight, dresidual)
        has_residual = dresidual is not None
        operands += (dresidual if has_residual else jnp.zeros((0,), x.dtype),)
        attributes["has_residual"] = has_residual
        aliases = {len(operands) - 1: 0} if has_residual and alias_residual else None
    if norm.offset:
        attributes["offset"] = np.float64(offset)
    grads = tuple(((segments, C), weight.dtype) for _ in norm.params)     # dweight[, dbias]
    results = (((rows, C), x.dtype), *grads,                               # dx
               ((workspace_bytes,), np.uint8))                             # workspace (flags, partial sums)
    target = norm.bwd_target_v2 if v2 else norm.bwd_target
    dx, *out, _ = ffi.call(target, operands, results, op=norm.name + "_bwd", aliases=aliases, **attributes)
    return (dx, *out)


def _local(norm: Norm, v2: bool, offset: float, dy, x, weight, *rest):
    """The op on the arrays it is given: whole arrays, or one device's block when partitioned.

    rest = (*stats, [dresidual,] seg_dims, kernel, block_size). Flattens the layout to the FFI's
    (rows, C), segments = product of the segment axes, and sizes the workspace from these
    shapes: a device's call gets a workspace for its own rows.
    """
    *arrays, seg_dims, kernel, block_size = rest
    stats, dresidual = arrays[:len(norm.stats)], arrays[len(norm.stats):]
    segs, C = x.shape[:seg_dims], x.shape[-1]
    segments, rows = math.prod(segs), math.prod(x.shape[:-1])
    ws = workspace_bytes(kernel, rows, C, str(jnp.dtype(x.dtype)), block_size, segments, op=f"{norm.name}_bwd")
    args = (dy.reshape(rows, C), x.reshape(rows, C), weight.reshape(math.prod(weight.shape[:-1]), C),
            *(s.reshape(rows) for s in stats))
    res = dresidual[0].reshape(rows, C) if dresidual else None
    dx, *grads = ffi_call(*args, segments=segments, kernel=kernel, block_size=block_size,
                          workspace_bytes=ws, v2=v2, norm=norm, dresidual=res, offset=offset)
    return (dx.reshape(x.shape), *(g.reshape(*segs, C) for g in grads))


@functools.cache
def _partitioned(norm: Norm, v2: bool, residual: bool, offset: float):
    """(dy, x, weight, *stats, [dresidual,] seg_dims, kernel, block_size) -> (dx, *grads),
    partitioned (ops/partition.py); one per norm, target, residual and offset."""
    def local(*args):
        return _local(norm, v2, offset, *args)

    return partition.backward_partitioned(local, 3 + len(norm.stats) + residual, norm)


def partitioned_call(dy, x, weight, *arrays, seg_dims: int, kernel: int, block_size: int, v2: bool,
                     norm: Norm, offset: float = 0.0):
    """`norm`'s op on (dy, x, weight, *stats, [dresidual]), partitioned wherever XLA partitions it. A
    shard_map over some mesh axes with the others automatic is left to XLA: the plain FFI call
    runs and XLA gathers its inputs along the automatic axes (partition.partly_manual warns)."""
    args = (dy, x, weight, *arrays, seg_dims, kernel, block_size)
    if partition.partly_manual(f"the {norm.name} backward", "dy and x"):
        return _local(norm, v2, offset, *args)
    return _partitioned(norm, v2, len(arrays) > len(norm.stats), offset)(*args)


def reference_segments(norm: Norm, offset: float, dy, x, weight, *arrays, seg_dims: int):
    """What the op computes, in jnp: the norm's reference backward on each segment of rows, plus
    the residual gradient (if given) added to dx in fp32 and rounded once, as target v2 does."""
    stats, dresidual = arrays[:len(norm.stats)], arrays[len(norm.stats):]
    segs, C = x.shape[:seg_dims], x.shape[-1]
    S, rows = math.prod(segs), math.prod(x.shape[seg_dims:-1])
    if S == 1:   # one segment: the plain formula on x's own axes (a vmap over an axis of 1 would
        # leave XLA's CPU backend a reduction it runs several times slower, and merging the row
        # axes would merge their shardings, which an Explicit mesh then refuses to add to dresidual)
        body = x.shape[seg_dims:]
        dx, *grads = reference.norm_bwd(norm, dy.reshape(body), x.reshape(body), weight.reshape(C),
                                        tuple(s.reshape(body[:-1]) for s in stats), offset)
    else:
        per_segment_weight = jnp.broadcast_to(weight.reshape(math.prod(weight.shape[:-1]), C), (S, C))
        dx, *grads = jax.vmap(lambda dy, x, w, *st: reference.norm_bwd(norm, dy, x, w, st, offset))(
            dy.reshape(S, rows, C), x.reshape(S, rows, C), per_segment_weight, *(s.reshape(S, rows) for s in stats))
    dx = dx.reshape(x.shape)
    if dresidual:
        acc = reference.acc_dtype(x.dtype)
        dx = (dx.astype(acc) + dresidual[0].astype(acc)).astype(x.dtype)
    return (dx, *(g.reshape(*segs, C) for g in grads))


def _vmap_rule(norm, offset, seg_dims, kernel, block_size, caller, axis_size, in_batched, dy, x, weight, *arrays):
    """custom_vmap rule: a batch of B problems is one problem with one more segment axis.

    custom_vmap has moved every batched argument's batch axis to the front, which is exactly
    where a new (outermost) segment axis goes: example b's rows are segment b's, and the
    parameter gradients come out per example, (B, *segments, C). An unbatched argument is the
    same for every example and is broadcast. The call goes through segmented_op again, so a
    further (outer) vmap applies this rule once more: nested vmaps still make one FFI call. The
    stats and a residual gradient (add_*'s) are batched like dy.
    """
    B = axis_size
    dy_b, x_b, weight_b, *arrays_b = in_batched
    example = x.shape[1:] if x_b else x.shape
    segs, C = example[:seg_dims], example[-1]
    n_out = 1 + len(norm.params)
    if B == 0:  # an empty batch: nothing to compute
        return ((jnp.zeros((0, *example), x.dtype),) + (jnp.zeros((0, *segs, C), weight.dtype),) * (n_out - 1),
                (True,) * n_out)

    def batch(a, batched):
        return a if batched else jnp.broadcast_to(a, (B, *a.shape))

    example_weight = weight.shape[1:] if weight_b else weight.shape
    if weight_b or math.prod(example_weight[:-1]) != 1:
        # Weights differ between segments: one per new segment, (B, *segments, C).
        weight = jnp.broadcast_to(weight, (B, *segs, C))
    else:  # one weight shared by all segments, old and new
        weight = weight.reshape((1,) * (seg_dims + 1) + (C,))
    residual = len(arrays) > len(norm.stats)
    out = segmented_op(norm, offset, seg_dims + 1, kernel, block_size, caller, residual)(
        batch(dy, dy_b), batch(x, x_b), weight, *(batch(a, b) for a, b in zip(arrays, arrays_b)))
    return out, (True,) * n_out


@functools.cache
def segmented_op(norm: Norm, offset: float, seg_dims: int, kernel: int, block_size: int, caller: str,
                 residual: bool):
    """`norm`'s FFI op for these static settings: op(dy, x, weight, *stats) -> (dx, *grads), or with
    `residual` op(dy, x, weight, *stats, dresidual), whose dx is the norm's dx + dresidual
    (add_*'s backward).

    Which target runs is decided by what it must do: for layernorm v1 for a weight of x's dtype
    and no residual (so programs and tests that used v1 still see v1), else v2 (a float32
    weight beside 16-bit x: float32 gradients; or a residual gradient added to dx); rmsnorm has
    the one target. Shapes as above; `caller` is the public function that errors name. The
    wrappers:
      * custom_partitioning (partitioned_call): under a sharded jit each device runs the FFI on
        its own rows and the parameter gradients are summed with one psum;
      * custom_vmap (`run`): vmap of the op is _vmap_rule, one FFI call with more segments;
      * custom_jvp (outer, so that it, not custom_vmap's generic rule, defines derivatives):
        the op's tangents are the JVP of reference_segments (pure jnp), its value the FFI's.
        JAX derives reverse mode from it (linearize + transpose of jnp), so grad of grad and
        jvp of grad both work. Under vmap, JAX batches the JVP rule too; its primal call
        goes through `op`, so it reaches _vmap_rule (and higher orders reach this rule again).
    vmap and differentiation are thus handled before custom_partitioning is reached, which
    only ever sees a plain call with static settings. A first-order grad only calls the op (the
    FFI alone, no jnp backward); the jnp JVP is traced only when the backward itself is
    differentiated. Cached, so equal settings give the same function (and jit caches hit).
    """
    @jax.custom_batching.custom_vmap
    def run(dy, x, weight, *arrays):
        if math.prod(x.shape[:seg_dims]) > 1 and kernel not in SEGMENT_KERNELS:
            raise ValueError(
                f"{caller}: kernel {kernel} sums dweight/dbias over all rows and cannot keep one sum "
                f"per example: per-example (vmapped) dweight/dbias need kernel "
                f"{' or '.join(map(str, sorted(SEGMENT_KERNELS)))} or kernel=None")
        v2 = residual or weight.dtype != x.dtype or norm.bwd_target is None
        return partitioned_call(dy, x, weight, *arrays, seg_dims=seg_dims, kernel=kernel, block_size=block_size,
                                v2=v2, norm=norm, offset=offset)

    run.def_vmap(functools.partial(_vmap_rule, norm, offset, seg_dims, kernel, block_size, caller))
    op = jax.custom_jvp(run)

    @op.defjvp
    def op_jvp(primals, tangents):
        _, tangents_out = jax.jvp(functools.partial(reference_segments, norm, offset, seg_dims=seg_dims),
                                  primals, tangents)
        return op(*primals), tangents_out

    return op


def backward(dy, x, weight, *stats, seg_dims: int, kernel: int, block_size: int, caller: str,
             norm: Norm, dresidual=None, offset: float = 0.0):
    """(dx, *grads) by `norm`'s op, for the layout above with possibly NO row axis.

    (x of shape (*segments, C): one row per segment; the op needs a row axis, so one is added.)
    dresidual (x's shape and dtype), if given, is added to dx in the kernel (target v2).
    """
    if x.ndim == seg_dims + 1:
        expand = lambda a: None if a is None else jnp.expand_dims(a, seg_dims)  # noqa: E731
        dx, *grads = backward(
            expand(dy), expand(x), weight, *map(expand, stats), seg_dims=seg_dims, kernel=kernel,
            block_size=block_size, caller=caller, norm=norm, dresidual=expand(dresidual), offset=offset)
        return (jnp.squeeze(dx, seg_dims), *grads)
    residual = () if dresidual is None else (dresidual,)
    op = segmented_op(norm, offset, seg_dims, kernel, block_size, caller, bool(residual))
    return op(dy, x, weight, *stats, *residual)


def dispatched(dy, x, weight, *stats, seg_dims: int, kernel: int, block_size: int, caller: str,
               norm: Norm, dresidual=None, offset: float = 0.0, mode: str = "auto"):
    """`backward`, or the same sums in jnp (reference_segments), as the dispatch rule decides
    (dispatch.py) under the switches' `mode` that the call captured when it was traced ("ffi"
    when a kernel or block size was given: the FFI op everywhere)."""
    if mode != "jnp":   # a build without the CUDA handler cannot train on a GPU: say so now
        ffi.check_handler_for_default_platform(norm.name + "_bwd")
    decision = dispatch.decide(norm, dispatch.BACKWARD, x.shape, x.dtype, add=dresidual is not None, mode_=mode,
                               cuda_built=ffi.WITH_CUDA)
    residual = () if dresidual is None else (dresidual,)
    n_stats = len(stats)

    def ours(dy, x, weight, *arrays):
        st, res = arrays[:n_stats], arrays[n_stats:]
        return tuple(backward(dy, x, weight, *st, seg_dims=seg_dims, kernel=kernel, block_size=block_size,
                              caller=caller, norm=norm, dresidual=res[0] if res else None, offset=offset))

    def jnp_path(dy, x, weight, *arrays):
        if x.ndim == seg_dims + 1:   # no row axis: one row per segment
            expand = lambda a: jnp.expand_dims(a, seg_dims)  # noqa: E731
            out = reference_segments(norm, offset, *map(expand, (dy, x)), weight, *map(expand, arrays),
                                     seg_dims=seg_dims)
            return (jnp.squeeze(out[0], seg_dims), *out[1:])
        return tuple(reference_segments(norm, offset, dy, x, weight, *arrays, seg_dims=seg_dims))

    return dispatch.run(decision, ours, jnp_path, dy, x, weight, *stats, *residual)

