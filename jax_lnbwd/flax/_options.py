"""What the Flax LayerNorms share: the options they refuse, and the call to jax_lnbwd.layernorm.

Supported as in Flax: epsilon, dtype, param_dtype, use_bias, use_scale, bias_init, scale_init.
Refused with a ValueError, because jax_lnbwd.layernorm cannot do them:
  * reduction_axes and feature_axes other than the last axis (-1 or x.ndim - 1);
  * axis_name / axis_index_groups (statistics averaged across devices): with jit and shardings
    a normalized axis is never split (see jax_lnbwd/sharding.py), so they are not needed there;
  * mask (statistics over some of the features);
  * linen's force_float32_reductions=False: our statistics are always float32 or wider.
Accepted and ignored: use_fast_variance. Flax's default (True) computes the variance as
E[x²] - E[x]², its False as E[(x - E[x])²]; ours is always the centered E[(x - E[x])²], the
same number up to rounding, and it does not lose digits when |mean| >> std.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..layernorm import layernorm


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


def normalize(x, scale, bias, *, epsilon: float, dtype):
    """jax_lnbwd.layernorm of x, scale and bias all cast to `dtype` (the op needs one dtype)."""
    x, scale, bias = (None if a is None else jnp.asarray(a, dtype) for a in (x, scale, bias))
    return layernorm(x, scale, bias, eps=epsilon)
