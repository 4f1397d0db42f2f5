"""The public layernorm: a jax.custom_vjp whose forward is jnp and whose backward is our FFI op.

All argument checks happen here, at trace time, so a bad input raises TypeError/ValueError
before any kernel can see it.

The FFI op is wrapped three times (see _segmented_op), from the inside out:
  * jax.experimental.custom_partitioning (jax_lnbwd/sharding.py): under a sharded jit every
    device runs the op on its own rows, and dweight/dbias are summed with one psum;
  * jax.custom_batching.custom_vmap: under vmap the batch axis becomes one more segment axis
    of the rows, so a vmapped backward is still ONE FFI call, with per-example dweight/dbias
    (the sums over each example's rows, not over the whole batch);
  * jax.custom_jvp: the op's own derivative is the JVP of the same math in pure jnp, so the
    backward is differentiable again, in both modes: grad of grad, and jax.jvp of jax.grad
    (the usual Hessian-vector product). layernorm itself stays a custom_vjp.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, reference, sharding
from .kernels import DEFAULT_KERNEL, KERNELS

_SUPPORTED = {"float32", "bfloat16", "float16", "float64"}

# Kernels that can split the rows into segments with their own dweight/dbias sums: the ones
# that run under vmap (KernelInfo.segments). Others sum over all rows only (the C++ refuses
# segments > 1 for them).
_SEGMENT_KERNELS = frozenset(k for k, info in KERNELS.items() if info.segments)


def _dtype_name(a) -> str:
    return str(jnp.dtype(a.dtype))


def _check_float(name: str, a) -> None:
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"layernorm: '{name}' must be an array, got {type(a).__name__}")
    if _dtype_name(a) not in _SUPPORTED:
        raise TypeError(f"layernorm: '{name}' has dtype {_dtype_name(a)} but expected one of "
                        "float32, bfloat16, float16, float64")


def _check_eps(eps) -> float:
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"layernorm: eps must be a positive float, got {eps!r}") from None
    if isinstance(eps, (bool, str, bytes)) or not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"layernorm: eps must be a positive finite float, got {eps!r}")
    return value


def _check_param(name: str, p, x) -> None:
    """weight or bias: None (absent: scale 1, shift 0) or a (C,) array of x's dtype."""
    if p is None:
        return
    _check_float(name, p)
    C = x.shape[-1]
    if tuple(p.shape) != (C,):
        raise ValueError(f"layernorm: '{name}' has shape {tuple(p.shape)} but expected ({C},) "
                         f"for x of shape {tuple(x.shape)}")
    if p.dtype != x.dtype:
        raise TypeError(f"layernorm: '{name}' has dtype {_dtype_name(p)} but x has dtype "
                        f"{_dtype_name(x)}; cast them to one dtype")


def _check_inputs(x, weight, bias, eps) -> float:
    """The forward's arguments (shared by layernorm and layernorm_fwd); returns eps as a float."""
    eps = _check_eps(eps)
    _check_float("x", x)
    if x.ndim < 1:
        raise ValueError("layernorm: 'x' must have rank >= 1 (normalization is over the last axis)")
    _check_param("weight", weight, x)
    _check_param("bias", bias, x)
    return eps


def _resolve_kernel(kernel, block_size, dtype: str, C: int) -> tuple[int, int]:
    if kernel is None:
        kernel = DEFAULT_KERNEL
    if isinstance(kernel, bool) or not isinstance(kernel, (int, np.integer)) or int(kernel) not in KERNELS:
        raise ValueError(f"layernorm: unknown kernel {kernel!r}; known kernels are {sorted(KERNELS)} "
                         "(see jax_lnbwd.KERNELS) or None for the default")
    info = KERNELS[int(kernel)]
    if dtype not in info.dtypes:
        raise ValueError(f"layernorm: kernel {info.id} supports dtypes {', '.join(info.dtypes)}, not {dtype}")
    if block_size is None:
        block_size = info.default_block_size
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or int(block_size) not in info.block_sizes:
        raise ValueError(f"layernorm: kernel {info.id} accepts block_size in {list(info.block_sizes)} "
                         f"or None, got {block_size!r}")
    why = info.refuse(C, dtype, int(block_size))
    if why is not None:
        raise ValueError(f"layernorm: {why}")
    return info.id, int(block_size)


def layernorm_fwd(x, weight, bias, *, eps: float = 1e-5):
    """(y, mean, rstd) of layernorm over the last axis; mean/rstd are float32 (float64 for float64).

    weight and/or bias may be None (no scale, no shift)."""
    eps = _check_inputs(x, weight, bias, eps)
    return reference.layernorm_fwd(x, weight, bias, eps)


# --- the FFI op made batchable and differentiable ---------------------------------------------
#
# The op keeps x's leading axes instead of flattening them into rows, so that a sharding of any
# of them reaches the partitioning rule (jax_lnbwd/sharding.py) as it is: flattening (batch,
# seq, C) sharded over batch and seq into rows would need a transpose across devices. For
# `seg_dims` = k (static), the layout is
#   dy, x:        (*segments, *rows, C)  k segment axes, then at least one row axis;
#   weight:       (*segments, C), each segment axis either as in x or 1 (shared);
#   mean, rstd:   (*segments, *rows);
#   dx:           like x;  dweight, dbias: (*segments, C), sums over each segment's rows.
# Segment axes are the batch axes that vmap added (one per vmap level): per-example sums.

def _reference_segments(dy, x, weight, mean, rstd, *, seg_dims: int):
    """What the op computes, in jnp: reference.layernorm_bwd on each segment of rows."""
    segs, C = x.shape[:seg_dims], x.shape[-1]
    S, rows = math.prod(segs), math.prod(x.shape[seg_dims:-1])
    per_segment_weight = jnp.broadcast_to(weight.reshape(math.prod(weight.shape[:-1]), C), (S, C))
    dx, dweight, dbias = jax.vmap(reference.layernorm_bwd)(
        dy.reshape(S, rows, C), x.reshape(S, rows, C), per_segment_weight,
        mean.reshape(S, rows), rstd.reshape(S, rows))
    return dx.reshape(x.shape), dweight.reshape(*segs, C), dbias.reshape(*segs, C)


def _vmap_rule(seg_dims, kernel, block_size, axis_size, in_batched, dy, x, weight, mean, rstd):
    """custom_vmap rule: a batch of B problems is one problem with one more segment axis.

    custom_vmap has moved every batched argument's batch axis to the front, which is exactly
    where a new (outermost) segment axis goes: example b's rows are segment b's, and dweight/
    dbias come out per example, (B, *segments, C). An unbatched argument is the same for every
    example and is broadcast. The call goes through _segmented_op again, so a further (outer)
    vmap applies this rule once more: nested vmaps still make one FFI call.
    """
    B = axis_size
    dy_b, x_b, weight_b, mean_b, rstd_b = in_batched
    example = x.shape[1:] if x_b else x.shape
    segs, C = example[:seg_dims], example[-1]
    if B == 0:  # an empty batch: nothing to compute
        return (jnp.zeros((0, *example), x.dtype),) + (jnp.zeros((0, *segs, C), x.dtype),) * 2, (True,) * 3

    def batch(a, batched):
        return a if batched else jnp.broadcast_to(a, (B, *a.shape))

    example_weight = weight.shape[1:] if weight_b else weight.shape
    if weight_b or math.prod(example_weight[:-1]) != 1:
        # Weights differ between segments: one per new segment, (B, *segments, C).
        weight = jnp.broadcast_to(weight, (B, *segs, C))
    else:  # one weight shared by all segments, old and new
        weight = weight.reshape((1,) * (seg_dims + 1) + (C,))
    out = _segmented_op(seg_dims + 1, kernel, block_size)(
        batch(dy, dy_b), batch(x, x_b), weight, batch(mean, mean_b), batch(rstd, rstd_b))
    return out, (True, True, True)


@functools.cache
def _segmented_op(seg_dims: int, kernel: int, block_size: int):
    """The FFI op for these static settings: op(dy, x, weight, mean, rstd) -> (dx, dweight, dbias).

    Shapes as above. Three wrappers around the FFI call, from the inside out:
      * custom_partitioning (sharding.layernorm_bwd_segments): under a sharded jit each device
        runs the FFI on its own rows and dweight/dbias are summed with one psum;
      * custom_vmap (`run`): vmap of the op is _vmap_rule, one FFI call with more segments;
      * custom_jvp (outer, so that it, not custom_vmap's generic rule, defines derivatives):
        the op's tangents are the JVP of _reference_segments (pure jnp), its value the FFI's.
        JAX derives reverse mode from it (linearize + transpose of jnp), so grad of grad and
        jvp of grad both work. Under vmap, JAX batches the JVP rule too; its primal call
        goes through `op`, so it reaches _vmap_rule (and higher orders reach this rule again).
    vmap and differentiation are thus handled before custom_partitioning is reached, which
    only ever sees a plain call with static settings. A first-order grad of layernorm only
    calls the op (the FFI alone, no jnp backward); the jnp JVP is traced only when the backward
    itself is differentiated. Cached, so equal settings give the same function (and jit caches hit).
    """
    @jax.custom_batching.custom_vmap
    def run(dy, x, weight, mean, rstd):
        if math.prod(x.shape[:seg_dims]) > 1 and kernel not in _SEGMENT_KERNELS:
            raise ValueError(
                f"layernorm: kernel {kernel} sums dweight/dbias over all rows and cannot keep one sum "
                f"per example: per-example (vmapped) dweight/dbias need kernel "
                f"{' or '.join(map(str, sorted(_SEGMENT_KERNELS)))} or kernel=None")
        return sharding.layernorm_bwd_segments(dy, x, weight, mean, rstd, seg_dims, kernel, block_size)

    run.def_vmap(functools.partial(_vmap_rule, seg_dims, kernel, block_size))
    op = jax.custom_jvp(run)

    @op.defjvp
    def op_jvp(primals, tangents):
        _, tangents_out = jax.jvp(functools.partial(_reference_segments, seg_dims=seg_dims), primals, tangents)
        return op(*primals), tangents_out

    return op


def _backward(dy, x, weight, mean, rstd, kernel: int, block_size: int):
    """(dx, dweight, dbias) for checked inputs of shape (..., C): one call, all rows one segment.

    weight None means a scale of ones (its dweight is then computed and ignored by the caller).
    """
    if x.ndim == 1:  # one row: the op needs a row axis
        dx, dweight, dbias = _backward(dy[None], x[None], weight, mean[None], rstd[None], kernel, block_size)
        return dx[0], dweight, dbias
    weight = jnp.ones(x.shape[-1:], x.dtype) if weight is None else weight
    return _segmented_op(0, kernel, block_size)(dy, x, weight, mean, rstd)


# --- the public ops -----------------------------------------------------------------------------

def layernorm_bwd(dy, x, weight, mean, rstd, *, kernel: int | None = None, block_size: int | None = None):
    """The raw backward op: (dx, dweight, dbias) given the forward's saved mean and rstd.

    dy and x have any shape (..., C); weight has shape (C,); mean and rstd have shape x.shape[:-1]
    and dtype float32 (float64 when x is float64). dweight and dbias are summed over all
    leading axes (under vmap: per example). `kernel` picks a CUDA kernel from KERNELS (None: the
    default); the CPU runs a C++ reference for every kernel. Differentiable, and batchable.
    """
    _check_float("x", x)
    _check_float("dy", dy)
    if x.ndim < 1:
        raise ValueError("layernorm_bwd: 'x' must have rank >= 1")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"layernorm_bwd: 'dy' has shape {tuple(dy.shape)} but x has shape {tuple(x.shape)}")
    if dy.dtype != x.dtype:
        raise TypeError(f"layernorm_bwd: 'dy' has dtype {_dtype_name(dy)} but x has dtype {_dtype_name(x)}")
    if weight is None:
        raise TypeError("layernorm_bwd: 'weight' must be an array (for no scale pass ones)")
    _check_param("weight", weight, x)
    stat = reference.acc_dtype(x.dtype)
    for name, s in (("mean", mean), ("rstd", rstd)):
        if not hasattr(s, "shape"):
            raise TypeError(f"layernorm_bwd: '{name}' must be an array, got {type(s).__name__}")
        if tuple(s.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"layernorm_bwd: '{name}' has shape {tuple(s.shape)} but expected "
                             f"{tuple(x.shape[:-1])} for x of shape {tuple(x.shape)}")
        if s.dtype != stat:
            raise TypeError(f"layernorm_bwd: '{name}' has dtype {_dtype_name(s)} but expected {stat} "
                            f"for x of dtype {_dtype_name(x)}")
    C = x.shape[-1]
    if C < 1:
        raise ValueError(f"layernorm_bwd: 'x' has shape {tuple(x.shape)} but the last axis must be >= 1")
    kernel, block_size = _resolve_kernel(kernel, block_size, _dtype_name(x), C)
    return _backward(dy, x, weight, mean, rstd, kernel, block_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layernorm(x, weight, bias, eps, kernel, block_size):
    return reference.layernorm(x, weight, bias, eps)


def _layernorm_fwd_rule(x, weight, bias, eps, kernel, block_size):
    y, mean, rstd = reference.layernorm_fwd(x, weight, bias, eps)
    return y, (x, weight, bias is not None, mean, rstd)


def _layernorm_bwd_rule(eps, kernel, block_size, res, dy):
    x, weight, has_bias, mean, rstd = res
    dx, dweight, dbias = _backward(dy, x, weight, mean, rstd, kernel, block_size)
    # An absent parameter (None) gets no gradient: None, matching its (empty) pytree.
    return dx, None if weight is None else dweight, dbias if has_bias else None


_layernorm.defvjp(_layernorm_fwd_rule, _layernorm_bwd_rule)


def layernorm(x, weight, bias, *, eps: float = 1e-5, kernel: int | None = None, block_size: int | None = None):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    x has any rank >= 1 and dtype float32, bfloat16, float16 or float64; weight and bias have
    shape (C,) and x's dtype, or are None (no scale / no shift, like Flax's use_scale=False /
    use_bias=False; no gradient is returned for them). The forward runs in jnp (statistics in
    float32, float64 for float64); the backward runs our FFI op with `kernel` (None: the default
    kernel). Works under jit, grad (to any order), vmap, scan, checkpoint and jax.export, and
    on sharded inputs: jit with shardings, and shard_map (see jax_lnbwd/sharding.py).
    """
    eps = _check_inputs(x, weight, bias, eps)
    kernel, block_size = _resolve_kernel(kernel, block_size, _dtype_name(x), x.shape[-1])
    # Inside shard_map, x usually varies along mesh axes along which a replicated weight and
    # bias do not. jnp's `x * weight` would cast weight to varying; so do we, before the
    # custom_vjp, so that its cotangents have matching types. The cast's transpose is a psum:
    # the gradient of a replicated weight is summed over the shards, exactly as for jnp code.
    axes = _ffi.varying_axes(*(a for a in (x, weight, bias) if a is not None))
    x, weight, bias = (None if a is None else _ffi.vary(a, axes) for a in (x, weight, bias))
    return _layernorm(x, weight, bias, eps, kernel, block_size)
