"""The backward FFI op, made batchable, differentiable and partitionable: op(dy, x, weight, mean, rstd).

The op keeps x's leading axes instead of flattening them into rows, so that a sharding of any
of them reaches the partitioning rule (ops/partition.py) as it is. For `seg_dims` = k
(static), the layout is
  dy, x:        (*segments, *rows, C)  k segment axes, then at least one row axis;
  weight:       (*segments, C), all segment axes as in x (one weight per segment), or all 1
                (one weight shared by every segment);
  mean, rstd:   (*segments, *rows);
  dx:           like x;  dweight, dbias: (*segments, C), sums over each segment's rows.
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

from .. import _checks, reference
from ..kernels import KERNELS, workspace_bytes
from ..norms import LAYERNORM, Norm
from . import ffi, partition

# Kernels that can split the rows into segments with their own dweight/dbias sums: the ones
# that run under vmap (KernelInfo.segments). Others sum over all rows only (the C++ refuses
# segments > 1 for them).
SEGMENT_KERNELS = frozenset(k for k, info in KERNELS.items() if info.segments)


def ffi_call(dy, x, weight, mean, rstd, *, segments: int, kernel: int, block_size: int, workspace_bytes: int,
             v2: bool, dresidual=None, alias_residual: bool = False, norm: Norm = LAYERNORM):
    """The FFI target on (rows, C) arrays: (dx, dweight, dbias). weight is (1, C) shared by all
    rows, or (segments, C); the rows form `segments` equal contiguous segments and dweight,
    dbias have shape (segments, C): the sums over each segment's rows.

    v1 (v2=False): weight of x's dtype, nothing added to dx. v2 adds
      * mixed precision: weight may be float32 beside bfloat16/float16 dy and x. g = weight * dy
        is then formed in fp32 from the float32 weight (never rounded to 16 bits), and dweight,
        dbias have weight's dtype: the fp32 sums, stored as float32. One pass, no cast of x.
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
    target, no aliasing then). Kernels 1-10 refuse both additions.

    The bare call: no batching rule (no `vmap_method`, which newer JAX may not accept), no
    derivative and no sharding rule; the wrappers below add them.
    """
    rows, C = x.shape
    attributes = dict(kernel=np.int32(kernel), block_size=np.int32(block_size))
    operands = (dy, x, weight, mean, rstd)
    aliases = None
    if v2:
        ffi.check_handler_for_default_platform()
        _checks.v2_args(x, weight, dresidual)
        has_residual = dresidual is not None
        operands += (dresidual if has_residual else jnp.zeros((0,), x.dtype),)
        attributes["has_residual"] = has_residual
        aliases = {5: 0} if has_residual and alias_residual else None
    results = (((rows, C), x.dtype),                               # dx
               ((segments, C), weight.dtype),                      # dweight
               ((segments, C), weight.dtype),                      # dbias
               ((workspace_bytes,), np.uint8))                     # workspace (flags, partial sums)
    target = norm.bwd_target_v2 if v2 else norm.bwd_target
    dx, dweight, dbias, _ = ffi.call(target, operands, results, op="layernorm_bwd", aliases=aliases, **attributes)
    return dx, dweight, dbias


def _local(v2: bool, dy, x, weight, mean, rstd, *rest):
    """The op on the arrays it is given: whole arrays, or one device's block when partitioned.

    rest = ([dresidual,] seg_dims, kernel, block_size). Flattens the layout to the FFI's
    (rows, C), segments = product of the segment axes, and sizes the workspace from these
    shapes: a device's call gets a workspace for its own rows.
    """
    *dresidual, seg_dims, kernel, block_size = rest
    segs, C = x.shape[:seg_dims], x.shape[-1]
    segments, rows = math.prod(segs), math.prod(x.shape[:-1])
    ws = workspace_bytes(kernel, rows, C, str(jnp.dtype(x.dtype)), block_size, segments)
    args = (dy.reshape(rows, C), x.reshape(rows, C), weight.reshape(math.prod(weight.shape[:-1]), C),
            mean.reshape(rows), rstd.reshape(rows))
    res = dresidual[0].reshape(rows, C) if dresidual else None
    dx, dweight, dbias = ffi_call(*args, segments=segments, kernel=kernel, block_size=block_size,
                                  workspace_bytes=ws, v2=v2, dresidual=res)
    return dx.reshape(x.shape), dweight.reshape(*segs, C), dbias.reshape(*segs, C)


@functools.cache
def _partitioned(v2: bool, residual: bool):
    """(dy, x, weight, mean, rstd, [dresidual,] seg_dims, kernel, block_size) -> (dx, dweight,
    dbias), partitioned (ops/partition.py); one per target and residual."""
    def local(*args):
        return _local(v2, *args)

    return partition.backward_partitioned(local, 6 if residual else 5)


def partitioned_call(dy, x, weight, mean, rstd, *dresidual, seg_dims: int, kernel: int, block_size: int,
                     v2: bool):
    """The op, partitioned wherever XLA partitions it. A shard_map over some mesh axes with the
    others automatic is left to XLA: the plain FFI call runs and XLA gathers its inputs along the
    automatic axes (partition.partly_manual warns)."""
    args = (dy, x, weight, mean, rstd, *dresidual, seg_dims, kernel, block_size)
    if partition.partly_manual("the layernorm backward", "dy and x"):
        return _local(v2, *args)
    return _partitioned(v2, bool(dresidual))(*args)


def reference_segments(dy, x, weight, mean, rstd, *dresidual, seg_dims: int):
    """What the op computes, in jnp: reference.layernorm_bwd on each segment of rows, plus the
    residual gradient (if given) added to dx in fp32 and rounded once, as target v2 does."""
    segs, C = x.shape[:seg_dims], x.shape[-1]
    S, rows = math.prod(segs), math.prod(x.shape[seg_dims:-1])
    per_segment_weight = jnp.broadcast_to(weight.reshape(math.prod(weight.shape[:-1]), C), (S, C))
    dx, dweight, dbias = jax.vmap(reference.layernorm_bwd)(
        dy.reshape(S, rows, C), x.reshape(S, rows, C), per_segment_weight,
        mean.reshape(S, rows), rstd.reshape(S, rows))
    dx = dx.reshape(x.shape)
    if dresidual:
        acc = reference.acc_dtype(x.dtype)
        dx = (dx.astype(acc) + dresidual[0].astype(acc)).astype(x.dtype)
    return dx, dweight.reshape(*segs, C), dbias.reshape(*segs, C)


def _vmap_rule(seg_dims, kernel, block_size, caller, axis_size, in_batched, dy, x, weight, mean, rstd, *dresidual):
    """custom_vmap rule: a batch of B problems is one problem with one more segment axis.

    custom_vmap has moved every batched argument's batch axis to the front, which is exactly
    where a new (outermost) segment axis goes: example b's rows are segment b's, and dweight/
    dbias come out per example, (B, *segments, C). An unbatched argument is the same for every
    example and is broadcast. The call goes through segmented_op again, so a further (outer)
    vmap applies this rule once more: nested vmaps still make one FFI call. A residual gradient
    (add_layernorm's) is batched like dy.
    """
    B = axis_size
    dy_b, x_b, weight_b, mean_b, rstd_b, *res_b = in_batched
    example = x.shape[1:] if x_b else x.shape
    segs, C = example[:seg_dims], example[-1]
    if B == 0:  # an empty batch: nothing to compute
        return (jnp.zeros((0, *example), x.dtype),) + (jnp.zeros((0, *segs, C), weight.dtype),) * 2, (True,) * 3

    def batch(a, batched):
        return a if batched else jnp.broadcast_to(a, (B, *a.shape))

    example_weight = weight.shape[1:] if weight_b else weight.shape
    if weight_b or math.prod(example_weight[:-1]) != 1:
        # Weights differ between segments: one per new segment, (B, *segments, C).
        weight = jnp.broadcast_to(weight, (B, *segs, C))
    else:  # one weight shared by all segments, old and new
        weight = weight.reshape((1,) * (seg_dims + 1) + (C,))
    out = segmented_op(seg_dims + 1, kernel, block_size, caller, bool(dresidual))(
        batch(dy, dy_b), batch(x, x_b), weight, batch(mean, mean_b), batch(rstd, rstd_b),
        *(batch(r, b) for r, b in zip(dresidual, res_b)))
    return out, (True, True, True)


@functools.cache
def segmented_op(seg_dims: int, kernel: int, block_size: int, caller: str, residual: bool = False):
    """The FFI op for these static settings: op(dy, x, weight, mean, rstd) -> (dx, dweight, dbias),
    or with `residual` op(dy, x, weight, mean, rstd, dresidual), whose dx is the norm's dx +
    dresidual (add_layernorm's backward).

    Which target runs is decided by what it must do: v1 for a weight of x's dtype and no
    residual (so programs and tests that used v1 still see v1), else v2 (a float32 weight
    beside 16-bit x: float32 dweight/dbias; or a residual gradient added to dx).
    Shapes as above; `caller` is the public function that errors name. The wrappers:
      * custom_partitioning (partitioned_call): under a sharded jit each device runs the FFI on
        its own rows and dweight/dbias are summed with one psum;
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
    def run(dy, x, weight, mean, rstd, *dresidual):
        if math.prod(x.shape[:seg_dims]) > 1 and kernel not in SEGMENT_KERNELS:
            raise ValueError(
                f"{caller}: kernel {kernel} sums dweight/dbias over all rows and cannot keep one sum "
                f"per example: per-example (vmapped) dweight/dbias need kernel "
                f"{' or '.join(map(str, sorted(SEGMENT_KERNELS)))} or kernel=None")
        return partitioned_call(dy, x, weight, mean, rstd, *dresidual, seg_dims=seg_dims, kernel=kernel,
                                block_size=block_size, v2=residual or weight.dtype != x.dtype)

    run.def_vmap(functools.partial(_vmap_rule, seg_dims, kernel, block_size, caller))
    op = jax.custom_jvp(run)

    @op.defjvp
    def op_jvp(primals, tangents):
        _, tangents_out = jax.jvp(functools.partial(reference_segments, seg_dims=seg_dims), primals, tangents)
        return op(*primals), tangents_out

    return op


def backward(dy, x, weight, mean, rstd, *, seg_dims: int, kernel: int, block_size: int, caller: str,
             dresidual=None):
    """(dx, dweight, dbias) by the op, for the layout above with possibly NO row axis.

    (x of shape (*segments, C): one row per segment; the op needs a row axis, so one is added.)
    dresidual (x's shape and dtype), if given, is added to dx in the kernel (target v2).
    """
    if x.ndim == seg_dims + 1:
        expand = lambda a: None if a is None else jnp.expand_dims(a, seg_dims)  # noqa: E731
        dx, dweight, dbias = backward(
            expand(dy), expand(x), weight, expand(mean), expand(rstd), seg_dims=seg_dims, kernel=kernel,
            block_size=block_size, caller=caller, dresidual=expand(dresidual))
        return jnp.squeeze(dx, seg_dims), dweight, dbias
    residual = () if dresidual is None else (dresidual,)
    return segmented_op(seg_dims, kernel, block_size, caller, bool(residual))(dy, x, weight, mean, rstd, *residual)
