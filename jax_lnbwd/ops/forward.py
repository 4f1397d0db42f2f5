"""The fused forward FFI op of any norm: one call that reads x once and writes y and the stats.

    y, mean, rstd = layernorm_fwd_op(x, weight, bias, eps=1e-5)
    y, s, mean, rstd = add_layernorm_fwd_op(x, residual, weight, bias, eps=1e-5, x_bias=None)
    y, rstd = rmsnorm_fwd_op(x, weight, eps=1e-6, offset=0.0)
    y, s, rstd = add_rmsnorm_fwd_op(x, residual, weight, eps=1e-6, x_bias=None, offset=0.0)

x has any rank >= 1 and dtype float32, bfloat16, float16 or float64; normalization is over the
last axis (C). weight and bias are (C,) arrays or None (no scale / no shift). Their dtype is x's,
or float32 when x is bfloat16/float16 (mixed precision: the parameters stay float32, the output
is computed in fp32 and rounded once to x's dtype). mean and rstd have shape x.shape[:-1] and
dtype float32 (float64 for float64 x). The numbers are jax_lnbwd.reference.layernorm_fwd's:
statistics in fp32 (fp64), variance centered.

The residual variant (add_layernorm's forward) has one more input and output: s = x + residual
(the sum in fp32, fp64 for fp64, rounded once to x's dtype: bit-equal to jnp's `x + residual`),
and y, mean, rstd are the layernorm of that rounded s. One kernel reads x and residual once and
writes y, s, mean and rstd, where jnp would run an add (read 2, write 1) and then the forward
(read s again). With x's own bias (x_bias: the bias of the projection that produced x, a (C,)
parameter like weight and bias), s = (x + x_bias) + residual, both adds in fp32 (fp64) and
rounded once (reference.add_residual): XLA would otherwise run that bias add on its own between
the matmul and this kernel (it cannot fuse into a custom call). The targets are the norm's row
(norms.py): fwd_target, add_fwd_target, add_bias_fwd_target.

On the GPU the CUDA kernels in ffi/kernels/forward/ run; on the CPU a C++ reference. The op is
wrapped, from the inside out, in
  * jax.experimental.custom_partitioning (ops/partition.py): under a sharded jit each device
    normalizes its own rows, without communication;
  * jax.custom_batching.custom_vmap: vmap folds the batch axis into the rows (exact for the
    forward: every row is normalized by itself); per-example parameters become one parameter
    row per example, so a vmapped call is still ONE FFI call;
  * jax.custom_jvp: derivatives are the JVP of the jnp reference, so the op is differentiable in
    both modes, though the norms' custom_jvps never need it (their tangent is tangent.py's).
Layout, for `seg_dims` = k: x (and residual, y, s) (*segments, *rows, C); each present
parameter (*segments, C), a segment axis either as in x or 1 (shared); absent parameters are not
operands. With has_res the operands are (x, residual, *params), with has_xb x_bias is the first
of the parameters, and the results are (y, s, mean, rstd).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks, reference
from ..norms import LAYERNORM, RMSNORM, Norm
from . import ffi, partition

__all__ = ["layernorm_fwd_op", "add_layernorm_fwd_op", "rmsnorm_fwd_op", "add_rmsnorm_fwd_op"]


def ffi_call(norm: Norm, x, weight, bias, eps: float, residual=None, x_bias=None, offset: float = 0.0):
    """`norm`'s FFI target on (rows, C) x and (W, C) parameters: (y, *stats); with a (rows, C)
    residual of x's dtype, the residual variant: (y, s, *stats), s = x + residual rounded to x's
    dtype and y, stats those of s; with a (W, C) x_bias (W >= 1) too, s = (x + x_bias) + residual.

    W is 0 (absent), 1 (shared) or S dividing rows (rows form S equal segments, segment s uses
    parameter row s). rmsnorm has no bias (None), its residual target always takes x_bias (a
    zero-size (0, C) array when absent), and `offset` is its attribute. The bare call: no
    checks, batching, derivative or sharding rule.
    """
    has_res = residual is not None
    params = (weight,) if bias is None and not norm.centered else (weight, bias)
    if not norm.centered and has_res and x_bias is None:
        x_bias = jnp.zeros((0, x.shape[1]), weight.dtype)
    if x_bias is not None:
        operands = (x, x_bias, residual, *params)
        target = norm.add_bias_fwd_target or norm.add_fwd_target
    elif has_res:
        operands, target = (x, residual, *params), norm.add_fwd_target
    else:
        operands, target = (x, *params), norm.fwd_target
    rows, C = x.shape
    stat = reference.acc_dtype(x.dtype)
    row, stats = ((rows, C), x.dtype), (((rows,), stat),) * len(norm.stats)   # y (and s); stats
    results = (row, row, *stats) if has_res else (row, *stats)
    op = f"add_{norm.name}_fwd_op" if has_res else f"{norm.name}_fwd_op"
    attributes = dict(eps=np.float64(eps))
    if norm.offset:
        attributes["offset"] = np.float64(offset)
    return ffi.call(target, operands, results, op=op, **attributes)


def _local(norm: Norm, offset: float, has_xb: bool, x, *rest):
    """The op on the arrays it is given (whole, or one device's block): flattens the layout to
    the FFI's (rows, C), with an empty (0, C) array for an absent parameter.
    rest = ([residual,] *params, seg_dims, has_w, has_b, eps, has_res)."""
    *arrays, seg_dims, has_w, has_b, eps, has_res = rest
    residual, params = (arrays[0], arrays[1:]) if has_res else (None, arrays)
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
    w = flat(has_w)
    b = flat(has_b) if norm.centered else None
    res = None if residual is None else residual.reshape(rows, C)
    out = ffi_call(norm, x.reshape(rows, C), w, b, eps, res, xb, offset)
    n_rows = 2 if has_res else 1
    return (*(a.reshape(x.shape) for a in out[:n_rows]), *(st.reshape(x.shape[:-1]) for st in out[n_rows:]))


@functools.cache
def _partitioned(norm: Norm, offset: float, n_params: int, has_res: bool, has_xb: bool):
    """The partitioned op for n_params present parameters (x_bias first with has_xb)."""
    def local(x, *rest):
        return _local(norm, offset, has_xb, x, *rest)

    return partition.forward_partitioned(local, 1 + has_res + n_params, norm)


def partitioned_call(norm: Norm, offset: float, x, params, seg_dims: int, has_w: bool, has_b: bool, eps: float,
                     residual, has_xb: bool):
    """The op, partitioned wherever XLA partitions it. A shard_map over only some mesh axes is
    left to XLA (partition.partly_manual): the plain FFI call runs there and XLA gathers x along
    the automatic axes."""
    has_res = residual is not None
    arrays = (x, residual, *params) if has_res else (x, *params)
    statics = (seg_dims, has_w, has_b, eps, has_res)
    if partition.partly_manual(f"the {norm.name} forward", "x"):
        return _local(norm, offset, has_xb, *arrays, *statics)
    return _partitioned(norm, offset, len(params), has_res, has_xb)(*arrays, *statics)


def _reference(norm: Norm, offset: float, seg_dims: int, has_w: bool, has_b: bool, eps: float, has_res: bool,
               has_xb: bool, x, *operands):
    """What the op computes, in jnp: the norm's reference forward with each parameter broadcast
    over its segment's rows (of s = reference.add_residual(x, residual[, x_bias]) for has_res)."""
    residual, params = (operands[0], operands[1:]) if has_res else (None, operands)
    row_axes = x.ndim - 1 - seg_dims
    it = iter(params)

    def widen(present):
        if not present:
            return None
        p = next(it)
        return p.reshape(*p.shape[:-1], *(1,) * row_axes, p.shape[-1])

    xb = widen(has_xb)
    s = reference.add_residual(x, residual, xb) if has_res else x
    w, b = widen(has_w), widen(has_b)
    y, *stats = reference.norm_fwd(norm, s, w, b, eps, offset)
    return (y, s, *stats) if has_res else (y, *stats)


def _vmap_rule(norm, offset, seg_dims, has_w, has_b, eps, has_res, has_xb, axis_size, in_batched, x, *operands):
    """custom_vmap rule: B problems are one problem whose rows are the examples' rows.

    custom_vmap has moved every batched argument's batch axis to the front. x becomes
    (B, *example) (broadcast if unbatched). A parameter that is batched, or already per segment,
    becomes (B, *segments, C): one row per new segment; a shared one stays shared, (1, ..., 1, C).
    The call goes through _op again (one more segment axis), so nested vmaps make one FFI call.
    """
    B = axis_size
    n_rows = 2 if has_res else 1   # x, and residual: batched alike
    rows_b, p_b = in_batched[:n_rows], in_batched[n_rows:]
    rows_in, params = (x, *operands[:n_rows - 1]), operands[n_rows - 1:]
    example = x.shape[1:] if rows_b[0] else x.shape
    segs, C = example[:seg_dims], example[-1]
    stat = reference.acc_dtype(x.dtype)
    n_stats = len(norm.stats)
    n_out = n_rows + n_stats
    if B == 0:  # an empty batch: nothing to compute
        return ((jnp.zeros((0, *example), x.dtype),) * n_rows + (jnp.zeros((0, *example[:-1]), stat),) * n_stats,
                (True,) * n_out)
    rows_in = tuple(a if b else jnp.broadcast_to(a, (B, *a.shape)) for a, b in zip(rows_in, rows_b))

    def batch(p, batched):
        ex = p.shape[1:] if batched else p.shape
        if batched or math.prod(ex[:-1]) != 1:
            return jnp.broadcast_to(p, (B, *segs, C))
        return p.reshape((1,) * (seg_dims + 1) + (C,))

    params = tuple(batch(p, b) for p, b in zip(params, p_b))
    out = _op(norm, offset, seg_dims + 1, has_w, has_b, eps, has_res, has_xb)(*rows_in, *params)
    return out, (True,) * n_out


@functools.cache
def _op(norm: Norm, offset: float, seg_dims: int, has_w: bool, has_b: bool, eps: float, has_res: bool, has_xb: bool):
    """`norm`'s op(x, *params) -> (y, *stats), or with has_res op(x, residual, *params) -> (y, s, *stats)
    (params = (x_bias, weight, bias)'s present ones with has_xb), for these static settings
    (cached: equal settings give the same function, so jit caches hit)."""
    @jax.custom_batching.custom_vmap
    def run(x, *operands):
        residual, params = (operands[0], operands[1:]) if has_res else (None, operands)
        return partitioned_call(norm, offset, x, params, seg_dims, has_w, has_b, eps, residual, has_xb)

    run.def_vmap(functools.partial(_vmap_rule, norm, offset, seg_dims, has_w, has_b, eps, has_res, has_xb))
    op = jax.custom_jvp(run)

    @op.defjvp
    def op_jvp(primals, tangents):
        ref = functools.partial(_reference, norm, offset, seg_dims, has_w, has_b, eps, has_res, has_xb)
        _, tangents_out = jax.jvp(ref, primals, tangents)
        return op(*primals), tangents_out

    return op


def norm_fwd_op(norm: Norm, x, weight, bias, eps: float, offset: float = 0.0):
    """(y, *stats) of `norm` over the last axis by the fused FFI forward, for any rank >= 1
    (checked by the caller: a public function or one of the *_fwd_op below). Parameters of
    two dtypes reach the kernel in one (_checks.one_param_dtype)."""
    weight, bias = _checks.one_param_dtype(weight, bias)
    params = tuple(p for p in (weight, bias) if p is not None)
    op = _op(norm, offset, 0, weight is not None, bias is not None, eps, False, False)
    if x.ndim == 1:  # one row: the op needs a row axis
        return tuple(o[0] for o in op(x[None], *params))
    return op(x, *params)


def add_norm_fwd_op(norm: Norm, x, residual, weight, bias, eps: float, x_bias=None, offset: float = 0.0):
    """(y, s, *stats): s = x + residual rounded to x's dtype (with x_bias, (x + x_bias) +
    residual), and `norm`'s (y, *stats) of s, by the residual-fused FFI forward."""
    weight, bias, x_bias = _checks.one_param_dtype(weight, bias, x_bias)
    params = tuple(p for p in (x_bias, weight, bias) if p is not None)
    op = _op(norm, offset, 0, weight is not None, bias is not None, eps, True, x_bias is not None)
    if x.ndim == 1:  # one row: the op needs a row axis
        return tuple(o[0] for o in op(x[None], residual[None], *params))
    return op(x, residual, *params)


def layernorm_fwd_op(x, weight, bias, eps: float = 1e-5):
    """(y, mean, rstd) of layernorm over the last axis, by the fused FFI forward (see the module
    docstring for shapes and dtypes)."""
    eps = _checks.forward_args("layernorm_fwd", x, {"weight": weight, "bias": bias}, eps)
    return norm_fwd_op(LAYERNORM, x, weight, bias, eps)


def add_layernorm_fwd_op(x, residual, weight, bias, eps: float = 1e-5, x_bias=None):
    """(y, s, mean, rstd): s = x + residual rounded to x's dtype (with x_bias, (x + x_bias) +
    residual), and layernorm's (y, mean, rstd) of s, by the residual-fused FFI forward (see the
    module docstring). residual must have x's shape and dtype; x_bias is a (C,) parameter."""
    fn = "add_layernorm_fwd"
    eps = _checks.forward_args(fn, x, {"weight": weight, "bias": bias, "x_bias": x_bias}, eps)
    _checks.residual(fn, residual, x)
    return add_norm_fwd_op(LAYERNORM, x, residual, weight, bias, eps, x_bias)


def rmsnorm_fwd_op(x, weight, eps: float = 1e-6, offset: float = 0.0):
    """(y, rstd) of rmsnorm over the last axis, by the fused FFI forward."""
    eps = _checks.forward_args("rmsnorm_fwd", x, {"weight": weight}, eps)
    return norm_fwd_op(RMSNORM, x, weight, None, eps, _checks.offset("rmsnorm_fwd", offset, weight))


def add_rmsnorm_fwd_op(x, residual, weight, eps: float = 1e-6, x_bias=None, offset: float = 0.0):
    """(y, s, rstd): s = x + residual (with x_bias, (x + x_bias) + residual) rounded to x's
    dtype, and rmsnorm's (y, rstd) of s, by the residual-fused FFI forward."""
    fn = "add_rmsnorm_fwd"
    eps = _checks.forward_args(fn, x, {"weight": weight, "x_bias": x_bias}, eps)
    _checks.residual(fn, residual, x)
    return add_norm_fwd_op(RMSNORM, x, residual, weight, None, eps, x_bias, _checks.offset(fn, offset, weight))
