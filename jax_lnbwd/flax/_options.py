"""What the Flax norms share: the options they refuse, and the call to jax_lnbwd.layernorm / rmsnorm.

Supported as in Flax: epsilon, dtype, param_dtype, use_bias, use_scale, bias_init, scale_init.
Refused with a ValueError, because our ops cannot do them:
  * reduction_axes and feature_axes other than the last axis (-1 or x.ndim - 1);
  * axis_name / axis_index_groups (statistics averaged across devices): with jit and shardings
    a normalized axis is never split (see jax_lnbwd/ops/partition.py), so they are not needed there;
  * mask (statistics over some of the features);
  * linen's force_float32_reductions=False: our statistics are always float32 or wider.
Accepted and ignored: use_fast_variance. Flax's default (True) computes the variance as
E[x²] - E[x]², its False as E[(x - E[x])²]; ours is always the centered E[(x - E[x])²], the
same number up to rounding, and it does not lose digits when |mean| >> std.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import reference
from ..layernorm import add_layernorm, layernorm
from ..rmsnorm import add_rmsnorm, rmsnorm


def check_options(module, x, mask) -> None:
    """Raise a ValueError naming the first option of `module` that we cannot honour."""
    name = type(module).__module__ + "." + type(module).__qualname__
    last = {x.ndim - 1}
    for option in ("reduction_axes", "feature_axes"):
        axes = getattr(module, option)
        axes = {a % x.ndim for a in (axes if isinstance(axes, (tuple, list)) else (axes,))}
        if axes != last:
            raise ValueError(f"{name}: {option}={getattr(module, option)!r} is not supported: "
                             "jax_lnbwd normalizes over the last axis only (-1)")
    for option in ("axis_name", "axis_index_groups"):
        if getattr(module, option) is not None:
            raise ValueError(f"{name}: {option} is not supported (statistics across devices); with jit "
                             "and sharded inputs each row is normalized on one device and it is not needed")
    if mask is not None:
        raise ValueError(f"{name}: mask is not supported (statistics over all features only)")
    if not getattr(module, "force_float32_reductions", True):
        raise ValueError(f"{name}: force_float32_reductions=False is not supported: jax_lnbwd always "
                         "reduces in float32 (float64 for float64)")


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


def normalize(module_kind: str, x, scale, bias, *, epsilon: float, dtype, rms: bool = False, offset: float = 0.0):
    """jax_lnbwd.layernorm of x, scale and bias (rms: jax_lnbwd.rmsnorm of x and scale, with
    `offset` added to the scale) with Flax's dtypes (the rule above)."""
    out, compute = dtypes_for(module_kind, x, scale, bias, dtype)
    x = jnp.asarray(x, compute)
    if rms:
        y = rmsnorm(x, _param_as_op_takes(scale, compute), eps=epsilon, offset=offset)
    else:
        y = layernorm(x, _param_as_op_takes(scale, compute), _param_as_op_takes(bias, compute), eps=epsilon)
    return y.astype(out)


def add_normalize(module_kind: str, x, residual, scale, bias, *, epsilon: float, dtype, x_bias=None,
                  rms: bool = False, offset: float = 0.0):
    """(y, s): s = x + residual with jnp's promotion (what `x + residual` gives in a Flax block),
    y = normalize(s) by the rule above. When s already has the compute dtype (the usual case:
    all float32, or bf16 activations with dtype=bfloat16), ONE jax_lnbwd.add_layernorm does both,
    and its backward is one kernel call; otherwise (the compute dtype is wider than s's) s is
    added in jnp and normalized like LayerNorm does, so the values are Flax's either way.
    residual None (a block with nothing to add yet): (normalize(x), x).

    x_bias (use_x_bias: the bias of the projection that made x, moved into the module) is added
    first, s = (x + x_bias) + residual in fp32 (fp64) and rounded once to s's dtype
    (jax_lnbwd.reference.add_residual); in the fused call it is the kernel's x_bias. rms: the
    same with jax_lnbwd.add_rmsnorm (no bias; `offset` added to the scale)."""
    norm = dict(epsilon=epsilon, dtype=dtype, rms=rms, offset=offset)
    x = jnp.asarray(x)
    if residual is None:
        x = reference.add_residual(x, None, x_bias)
        return normalize(module_kind, x, scale, bias, **norm), x
    residual = jnp.asarray(residual)
    s_dtype = jnp.result_type(x, residual)
    probe = jax.ShapeDtypeStruct(x.shape, s_dtype)
    out, compute = dtypes_for(module_kind, probe, scale, bias, dtype)
    x, residual = x.astype(s_dtype), residual.astype(s_dtype)
    if compute != s_dtype:
        s = reference.add_residual(x, residual, x_bias)
        return normalize(module_kind, s, scale, bias, **norm), s
    x_bias = _param_as_op_takes(x_bias, compute)
    if rms:
        y, s = add_rmsnorm(x, residual, _param_as_op_takes(scale, compute), x_bias=x_bias, eps=epsilon, offset=offset)
    else:
        y, s = add_layernorm(x, residual, _param_as_op_takes(scale, compute), _param_as_op_takes(bias, compute),
                             x_bias=x_bias, eps=epsilon)
    return y.astype(out), s
