"""What the Flax norms share: which path a call takes, and the call to jax_lnbwd's ops.

Every option of Flax's LayerNorm and RMSNorm is accepted. A call runs on jax_lnbwd's ops when
its options say "normalize each row over trailing axes" (route() below); otherwise Flax's own
code computes it, exactly as Flax's module would, and the module logs once (per class and set
of options, logger "jax_lnbwd.flax") that it did. Flax's code runs for:
  * mask (statistics over some of the features);
  * axis_name (statistics averaged across devices under shard_map or pmap; with jit and
    sharded inputs a row is never split, jax_lnbwd/ops/partition.py, so it is not needed there);
  * reduction_axes that are not the trailing axes of x, or feature_axes outside them (a
    parameter per row, not per feature);
  * linen's force_float32_reductions=False (statistics in x's dtype; ours are float32 or wider);
  * nnx's promote_dtype other than Flax's default;
  * dtypes the ops do not take (complex).
Reduction over several trailing axes runs on the ops as one row of their product: x of shape
(B, H, C) with reduction_axes=(1, 2) is normalized as (B, H*C), and the parameters (feature
axes inside the reduced ones) are broadcast over the row; their gradients sum back through
the broadcast.
Accepted and ignored on the ops: use_fast_variance. Flax's default (True) computes the variance
as E[x²] - E[x]², its False as E[(x - E[x])²]; ours is always the centered E[(x - E[x])²], the
same number up to rounding, and it does not lose digits when |mean| >> std. axis_index_groups
matters only with axis_name (as in Flax).
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from flax.linen import normalization as linen_normalization

from .. import reference
from .._checks import SUPPORTED
from ..layernorm import add_layernorm, layernorm
from ..norms import LAYERNORM, RMSNORM, Norm
from ..rmsnorm import add_rmsnorm, rmsnorm

log = logging.getLogger("jax_lnbwd.flax")
_logged: set = set()


def _canonical(axes, ndim: int) -> tuple[int, ...]:
    """Sorted, non-negative, deduplicated axes (Flax's _canonicalize_axes, sorted)."""
    axes = axes if isinstance(axes, (tuple, list)) else (axes,)
    return tuple(sorted({a % ndim for a in axes}))


def feature_shape(module, x) -> tuple[int, ...]:
    """The parameters' shape as linen makes them: x's sizes on the feature axes."""
    return tuple(x.shape[a] for a in _canonical(module.feature_axes, x.ndim))


def broadcast_shape(module, x) -> tuple[int, ...]:
    """A parameter's shape as Flax broadcasts it against x: x's sizes on the feature axes, 1 elsewhere."""
    features = _canonical(module.feature_axes, x.ndim)
    return tuple(n if a in features else 1 for a, n in enumerate(x.shape))


@dataclasses.dataclass(frozen=True)
class Row:
    """A call on jax_lnbwd's ops: each row is x.shape[start:] flattened, and each parameter,
    reshaped to `params` (x's sizes on the feature axes, 1 on the other reduced axes), is
    broadcast over it. The default (the last axis) is start = ndim - 1: nothing is reshaped."""
    start: int
    params: tuple[int, ...]

    def trivial(self, x) -> bool:
        return self.start == x.ndim - 1 and self.params == (x.shape[-1],)

    def pack(self, x):
        return x if self.trivial(x) else x.reshape(x.shape[:self.start] + (-1,))

    def pack_param(self, p, x):
        if p is None or self.trivial(x):
            return p
        return jnp.broadcast_to(jnp.reshape(p, self.params), x.shape[self.start:]).reshape(-1)


def route(module, x, mask, *, has_params: bool = True) -> Row | None:
    """The Row our ops normalize, or None when Flax's own code must compute the call (logged once)."""
    x = jnp.asarray(x) if not hasattr(x, "ndim") else x
    reasons = []
    if mask is not None:
        reasons.append("mask")
    if getattr(module, "axis_name", None) is not None:
        reasons.append(f"axis_name={module.axis_name!r}")
    if not getattr(module, "force_float32_reductions", True):
        reasons.append("force_float32_reductions=False")
    promote = getattr(module, "promote_dtype", None)
    if promote is not None and promote is not _nnx_promote_dtype():
        reasons.append("promote_dtype")
    start = x.ndim - 1
    if x.ndim >= 1:
        reduced = _canonical(module.reduction_axes, x.ndim)
        features = _canonical(module.feature_axes, x.ndim)
        start = reduced[0]
        if reduced != tuple(range(start, x.ndim)):
            reasons.append(f"reduction_axes={module.reduction_axes!r}")
        elif not set(features) <= set(reduced):
            reasons.append(f"feature_axes={module.feature_axes!r}")
    else:
        reasons.append("x of rank 0")
    dtypes = [x.dtype] + [jnp.dtype(d) for d in (module.dtype, module.param_dtype if has_params else None)
                          if d is not None]
    compute = jnp.result_type(*dtypes)
    if not (jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.floating)) \
            or str(jnp.dtype(compute)) not in SUPPORTED:
        reasons.append(f"dtype {jnp.dtype(compute)}")
    if reasons:
        _log_once(module, reasons)
        return None
    params = tuple(x.shape[a] if a in features else 1 for a in range(start, x.ndim))
    return Row(start, params)


def _nnx_promote_dtype():
    try:
        from flax.nnx.nn import dtypes
    except ImportError:   # older Flax: linen only
        return None
    return dtypes.promote_dtype


def _log_once(module, reasons) -> None:
    name = type(module).__module__ + "." + type(module).__qualname__
    key = (name, tuple(reasons))
    if key not in _logged:
        _logged.add(key)
        log.warning("%s with %s: computed by Flax's own code (jnp, differentiated by JAX), not by "
                    "jax_lnbwd's kernels", name, ", ".join(reasons))


# --- Flax's own code with an offset ----------------------------------------------------------------
#
# Flax's RMSNorm has no offset; ours adds it to the scale, y = x̂ * (offset + scale). Where Flax's
# code computes the call, it runs with (offset + scale) in place of scale.

class _ScaleOffset:
    """A linen module as linen's _normalize sees it (it only calls .param), with `offset` added to
    the parameter `scale`."""

    def __init__(self, module, offset: float):
        self.module, self.offset = module, offset

    def param(self, name, *args, **kwargs):
        p = self.module.param(name, *args, **kwargs)
        return p + self.offset if name == "scale" else p


def linen_rmsnorm_with_offset(module, x, mask):
    """linen.RMSNorm.__call__'s own body, with module.offset added to the scale."""
    mean, var = linen_normalization._compute_stats(
        x, module.reduction_axes, module.dtype, module.axis_name, module.axis_index_groups, use_mean=False,
        use_fast_variance=module.use_fast_variance, mask=mask, force_float32_reductions=module.force_float32_reductions)
    return linen_normalization._normalize(
        _ScaleOffset(module, module.offset), x, mean, var, module.reduction_axes, module.feature_axes, module.dtype,
        module.param_dtype, module.epsilon, False, module.use_scale, jax.nn.initializers.zeros, module.scale_init,
        module.force_float32_reductions)


def nnx_rmsnorm_with_offset(module, x, mask):
    """nnx.RMSNorm.__call__'s own body, with module.offset added to the scale."""
    from flax.nnx.nn import normalization as nnx_normalization

    scale = None if module.scale is None else module.scale[...] + module.offset
    x, scale = module.promote_dtype((x, scale), dtype=module.dtype)
    mean, var = nnx_normalization._compute_stats(
        x, module.reduction_axes, module.dtype, module.axis_name, module.axis_index_groups, use_mean=False,
        use_fast_variance=module.use_fast_variance, mask=mask)
    return nnx_normalization._normalize(x, mean, var, scale, None, module.reduction_axes, module.feature_axes,
                                        module.dtype, module.epsilon)


# --- dtypes ----------------------------------------------------------------------------------------
#
# Flax's rule (linen and nnx alike): the output dtype is `dtype`, or when None the promotion of
# x's dtype and the parameters' (bf16 x with float32 params: float32). Both compute in float32
# (float64 for float64) and cast y to that dtype once; linen from x and the parameters as they
# are, nnx after first casting x, scale and bias to `dtype` (promote_dtype).
#
# Our op returns y in x's dtype, computed in fp32 from float32 (or x's dtype) parameters. So:
#   * x is cast to the compute dtype `compute`: for linen the wider of x's dtype and the output
#     dtype (only then could a narrower x not hold the result: bf16 x with dtype=None and float32
#     params gives a float32 y, as in Flax); for nnx the output dtype, as nnx casts x;
#   * the parameters are passed as they are when the op takes them: in `compute`, or float32
#     beside 16-bit `compute` (mixed precision: never rounded, float32 gradients). Any other
#     dtype is cast exactly (bf16 to float32, say), or, rarely, rounded (float64 params
#     beside a float32 x) to `compute`;
#   * y is cast to the output dtype if it differs (x float32 with dtype=bfloat16: y is
#     computed in float32 and rounded once, as Flax does).
# The common mixed-precision setup, dtype=bfloat16 with float32 params and bf16 activations,
# thus runs the op on bf16 x with float32 scale and bias: no cast at all.


def dtypes_for(module_kind: str, x, scale, bias, dtype):
    """(output dtype, compute dtype) by Flax's rule above; module_kind is 'linen' or 'nnx'."""
    args = [a for a in (x, scale, bias) if a is not None]
    out = jnp.dtype(dtype) if dtype is not None else jnp.dtype(jnp.result_type(*args))
    compute = jnp.promote_types(x.dtype, out) if module_kind == "linen" else out
    return out, jnp.dtype(compute)


def _param_as_op_takes(p, compute):
    """p as is if the op takes it beside x of dtype `compute`, else cast (see above)."""
    if p is None:
        return None
    p = jnp.asarray(p)
    sixteen = compute in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if p.dtype == compute or (sixteen and p.dtype == jnp.float32):
        return p
    return p.astype(jnp.float32 if sixteen else compute)


def normalize(module_kind: str, norm: Norm, row: Row, x, scale, bias, *, epsilon: float, dtype,
              offset: float = 0.0):
    """`norm` (LAYERNORM: jax_lnbwd.layernorm of x, scale and bias; RMSNORM: jax_lnbwd.rmsnorm of x
    and scale, with `offset` added to the scale) over `row`, with Flax's dtypes (the rule above)."""
    out, compute = dtypes_for(module_kind, x, scale, bias, dtype)
    x = jnp.asarray(x, compute)
    shape = x.shape
    rows = row.pack(x)
    scale = _param_as_op_takes(row.pack_param(scale, x), compute)
    if norm is RMSNORM:
        y = rmsnorm(rows, scale, eps=epsilon, offset=offset)
    else:
        y = layernorm(rows, scale, _param_as_op_takes(row.pack_param(bias, x), compute), eps=epsilon)
    return y.reshape(shape).astype(out)


def add_inputs(x, residual, x_bias, row_params=None):
    """(x, residual) in s's dtype (jnp's promotion of theirs: what `x + residual` gives in a Flax
    block), and s = (x + x_bias) + residual, rounded once (jax_lnbwd.reference.add_residual).
    x_bias has the scale's shape; row_params is the shape it is broadcast from against x
    (Row.params, or broadcast_shape where Flax's code normalizes s)."""
    x = jnp.asarray(x)
    if residual is not None:
        residual = jnp.asarray(residual)
        s_dtype = jnp.result_type(x, residual)
        x, residual = x.astype(s_dtype), residual.astype(s_dtype)
    if x_bias is not None and row_params is not None and tuple(x_bias.shape) != tuple(row_params):
        x_bias = jnp.reshape(x_bias, row_params)
    return x, residual, reference.add_residual(x, residual, x_bias)


def add_normalize(module_kind: str, norm: Norm, row: Row, x, residual, scale, bias, *, epsilon: float, dtype,
                  x_bias=None, offset: float = 0.0):
    """(y, s): s = x + residual with jnp's promotion (add_inputs), y = normalize(s) by the rule
    above. When s already has the compute dtype (the usual case: all float32, or bf16
    activations with dtype=bfloat16), ONE jax_lnbwd.add_layernorm / add_rmsnorm does both, and
    its backward is one kernel call; otherwise (the compute dtype is wider than s's) s is added
    in jnp and normalized like LayerNorm does, so the values are Flax's either way. residual
    None (a block with nothing to add yet): (normalize(x + x_bias), x + x_bias).

    x_bias (use_x_bias: the bias of the projection that made x, moved into the module) is added
    first, s = (x + x_bias) + residual in fp32 (fp64) and rounded once to s's dtype; in the
    fused call it is the kernel's x_bias."""
    norm_args = dict(epsilon=epsilon, dtype=dtype, offset=offset)
    x, residual, s = add_inputs(x, residual, x_bias, row.params)
    if residual is None:
        return normalize(module_kind, norm, row, s, scale, bias, **norm_args), s
    probe = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out, compute = dtypes_for(module_kind, probe, scale, bias, dtype)
    if compute != x.dtype:
        return normalize(module_kind, norm, row, s, scale, bias, **norm_args), s
    shape = x.shape
    x_bias = _param_as_op_takes(row.pack_param(x_bias, x), compute)
    scale = _param_as_op_takes(row.pack_param(scale, x), compute)
    if norm is RMSNORM:
        y, s = add_rmsnorm(row.pack(x), row.pack(residual), scale, x_bias=x_bias, eps=epsilon, offset=offset)
    else:
        bias = _param_as_op_takes(row.pack_param(bias, x), compute)
        y, s = add_layernorm(row.pack(x), row.pack(residual), scale, bias, x_bias=x_bias, eps=epsilon)
    return y.reshape(shape).astype(out), s.reshape(shape)

