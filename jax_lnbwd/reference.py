"""Pure-jnp norms (layernorm, rmsnorm), forward and backward: the test oracle and the XLA baseline.

Statistics and sums are computed in float32 (float64 for float64 inputs), and x̂ is centered:
x̂ = (x - mean) * rstd, never through E[x²] - E[x]² (rmsnorm: x̂ = x * rstd, no mean).
"""
from __future__ import annotations

import jax.numpy as jnp


def acc_dtype(dtype) -> jnp.dtype:
    """The accumulation (and mean/rstd) dtype for data of `dtype`."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def add_residual(x, residual, x_bias=None):
    """add_layernorm's s: x + residual in x's dtype (one rounding: jnp's add); with x's own bias
    (x_bias, shape (C,) or broadcastable), (x + x_bias) + residual in the accumulation dtype,
    in that order, rounded once to x's dtype (the fused kernel's order). residual None: no
    residual (x, or x + x_bias rounded once)."""
    if x_bias is None:
        return x if residual is None else x + residual
    acc = acc_dtype(x.dtype)
    s = x.astype(acc) + x_bias.astype(acc)
    return (s if residual is None else s + residual.astype(acc)).astype(x.dtype)


def layernorm_fwd(x, weight, bias, eps: float = 1e-5):
    """Returns (y, mean, rstd); mean and rstd have shape x.shape[:-1] in the accumulation dtype."""
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=-1)
    xc = xf - mean[..., None]
    rstd = 1.0 / jnp.sqrt(jnp.mean(xc * xc, axis=-1) + jnp.asarray(eps, acc))
    y = xc * rstd[..., None]
    if weight is not None:
        y = y * weight.astype(acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(x.dtype), mean, rstd


def layernorm(x, weight, bias, eps: float = 1e-5):
    """y = (x - mean) * rstd * weight + bias over the last axis."""
    return layernorm_fwd(x, weight, bias, eps)[0]


def layernorm_bwd(dy, x, weight, mean, rstd):
    """(dx, dweight, dbias) of layernorm given the saved mean and rstd.

    With g = weight * dy and x̂ = (x - mean) * rstd, over the last axis (C elements):
      dx = (g - mean(g) - x̂ * mean(g * x̂)) * rstd,
    and summed over every leading axis: dweight = Σ dy * x̂, dbias = Σ dy.
    """
    acc = acc_dtype(x.dtype)
    dyf = dy.astype(acc)
    xhat = (x.astype(acc) - mean.astype(acc)[..., None]) * rstd.astype(acc)[..., None]
    g = dyf * weight.astype(acc)
    a = jnp.mean(g, axis=-1, keepdims=True)
    b = jnp.mean(g * xhat, axis=-1, keepdims=True)
    dx = (g - a - xhat * b) * rstd.astype(acc)[..., None]
    lead = tuple(range(x.ndim - 1))
    dweight = jnp.sum(dyf * xhat, axis=lead)
    dbias = jnp.sum(dyf, axis=lead)
    return dx.astype(x.dtype), dweight.astype(weight.dtype), dbias.astype(weight.dtype)


# --- RMSNorm: y = x * rstd * (offset + weight), rstd = 1 / sqrt(mean(x²) + eps) -----------------

def scale(weight, offset: float, acc):
    """The scale a norm applies, offset + weight, in the accumulation dtype (None: no scale)."""
    if weight is None:
        return None
    w = weight.astype(acc)
    return w + jnp.asarray(offset, acc) if offset else w


def rmsnorm_fwd(x, weight, eps: float = 1e-6, offset: float = 0.0):
    """Returns (y, rstd); rstd has shape x.shape[:-1] in the accumulation dtype. x is not
    centered: rstd = 1 / sqrt(mean(x²) + eps), y = x * rstd * (offset + weight) rounded once."""
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    rstd = 1.0 / jnp.sqrt(jnp.mean(xf * xf, axis=-1) + jnp.asarray(eps, acc))
    y = xf * rstd[..., None]
    w = scale(weight, offset, acc)
    if w is not None:
        y = y * w
    return y.astype(x.dtype), rstd


def rmsnorm(x, weight, eps: float = 1e-6, offset: float = 0.0):
    """y = x * rstd * (offset + weight) over the last axis."""
    return rmsnorm_fwd(x, weight, eps, offset)[0]


def rmsnorm_bwd(dy, x, weight, rstd, offset: float = 0.0):
    """(dx, dweight) of rmsnorm given the saved rstd.

    With g = (offset + weight) * dy and x̂ = x * rstd, over the last axis (C elements):
      dx = (g - x̂ * mean(g * x̂)) * rstd,
    and summed over every leading axis: dweight = Σ dy * x̂ (the offset does not enter it).
    """
    acc = acc_dtype(x.dtype)
    dyf = dy.astype(acc)
    xhat = x.astype(acc) * rstd.astype(acc)[..., None]
    g = dyf * scale(weight, offset, acc)
    b = jnp.mean(g * xhat, axis=-1, keepdims=True)
    dx = (g - xhat * b) * rstd.astype(acc)[..., None]
    lead = tuple(range(x.ndim - 1))
    dweight = jnp.sum(dyf * xhat, axis=lead)
    return dx.astype(x.dtype), dweight.astype(weight.dtype)


# --- by a norm's row of facts (norms.py): what the shared machinery calls -------------------------

def norm_fwd(norm, x, weight, bias, eps: float, offset: float = 0.0):
    """(y, *stats) of `norm`: layernorm's (y, mean, rstd), rmsnorm's (y, rstd) (bias is None)."""
    if norm.centered:
        return layernorm_fwd(x, weight, bias, eps)
    return rmsnorm_fwd(x, weight, eps, offset)


def norm_bwd(norm, dy, x, weight, stats, offset: float = 0.0):
    """(dx, *parameter gradients) of `norm` given its saved stats."""
    if norm.centered:
        return layernorm_bwd(dy, x, weight, *stats)
    return rmsnorm_bwd(dy, x, weight, *stats, offset)
