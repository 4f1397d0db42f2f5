"""The RMSNorm variants (Variant.norm "rmsnorm", for llama), registered beside the LayerNorm ones.

  flax_rmsnorm       Flax's RMSNorm after a jnp add: the baseline. With an offset (Gemma's
                     zero-centred scale, ``--offset 1.0``) Flax has no such option, so the
                     baseline is FlaxOffsetRMSNorm below: Flax's RMSNorm computation with
                     (offset + scale) in place of scale, written out.
  jax_lnbwd_rmsnorm  the drop-in jax_lnbwd.flax.RMSNorm (nnx: jax_lnbwd.flax.nnx.RMSNorm)
  add_rmsnorm        jax_lnbwd.flax.AddRMSNorm: the residual add fused, one backward call

With an offset every variant initializes its scale to zeros (so y starts as x * rstd, as with
offset 0 and ones). Our modules are looked up when a model is built, so that this file imports
with a jax_lnbwd that has no RMSNorm modules yet; building then fails with OursMissing.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from jax import lax

import jax_lnbwd.flax

from .registry import Variant, register


class OursMissing(ImportError):
    """jax_lnbwd has no Flax RMSNorm module of that name (an older build)."""


def ours(api: str, name: str) -> type:
    """jax_lnbwd.flax's (linen) or jax_lnbwd.flax.nnx's class `name`, or OursMissing."""
    path = "jax_lnbwd.flax" + (".nnx" if api == "nnx" else "")
    try:
        mod = jax_lnbwd.flax if api == "linen" else __import__(path, fromlist=["x"])
        return getattr(mod, name)
    except (ImportError, AttributeError) as e:
        raise OursMissing(f"{path}.{name} is not in this jax_lnbwd ({type(e).__name__})") from e


def _offset_rms(x, scale, offset: float, epsilon: float, dtype):
    """Flax's RMSNorm arithmetic (statistics in at least fp32, y = x * (rsqrt(var + eps) *
    scale) rounded once to dtype) with offset + scale."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    var = jnp.mean(jnp.square(x.astype(acc)), axis=-1, keepdims=True)
    mul = lax.rsqrt(var + epsilon) * (offset + scale.astype(acc))
    return (x.astype(acc) * mul).astype(dtype or jnp.result_type(x, scale))


class FlaxOffsetRMSNorm(nn.Module):
    """The linen baseline with an offset: Flax's RMSNorm with (offset + scale)."""
    epsilon: float = 1e-6
    dtype: Any = None
    offset: float = 0.0
    scale_init: Callable = nn.initializers.zeros
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
        return _offset_rms(x, scale, self.offset, self.epsilon, self.dtype)


class NnxOffsetRMSNorm(nnx.Module):
    """The nnx baseline with an offset; draws its scale's key as nnx.RMSNorm does."""
    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, offset: float = 0.0,
                 scale_init=nnx.initializers.zeros, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.scale = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype))
        self.epsilon, self.dtype, self.offset = epsilon, dtype, offset

    def __call__(self, x):
        return _offset_rms(x, self.scale[...], self.offset, self.epsilon, self.dtype)


def _norm_kwargs(offset: float, zeros) -> dict:
    return {"offset": offset, "scale_init": zeros} if offset else {}


def linen_rms(kind: str) -> type:
    """The linen add & norm of a kind: "flax", "ours" (the drop-in after a jnp add) or "fused"."""
    class AddNorm(nn.Module):
        dtype: Any
        epsilon: float
        offset: float = 0.0
        x_bias: bool = False

        @nn.compact
        def __call__(self, x, residual=None):
            kw = {"dtype": self.dtype, "epsilon": self.epsilon, "name": "norm",
                  **_norm_kwargs(self.offset, nn.initializers.zeros)}
            if kind == "fused":
                bias = {"use_x_bias": True} if self.x_bias else {}
                return ours("linen", "AddRMSNorm")(**kw, **bias)(x, residual)
            s = x if residual is None else x + residual
            cls = ours("linen", "RMSNorm") if kind == "ours" else FlaxOffsetRMSNorm if self.offset else nn.RMSNorm
            return cls(**kw)(s), s
    AddNorm.__name__ = AddNorm.__qualname__ = f"AddNorm_rms_{kind}"
    return AddNorm


def nnx_rms(kind: str) -> type:
    """The nnx counterpart of linen_rms."""
    class AddNorm(nnx.Module):
        def __init__(self, features: int, *, dtype, epsilon: float, rngs: nnx.Rngs, offset: float = 0.0,
                     x_bias: bool = False):
            kw = {"dtype": dtype, "epsilon": epsilon, "rngs": rngs,
                  **_norm_kwargs(offset, nnx.initializers.zeros)}
            if kind == "fused":
                bias = {"use_x_bias": True} if x_bias else {}
                self.norm = ours("nnx", "AddRMSNorm")(features, **kw, **bias)
            else:
                cls = ours("nnx", "RMSNorm") if kind == "ours" else NnxOffsetRMSNorm if offset else nnx.RMSNorm
                self.norm = cls(features, **kw)
            self.fused = kind == "fused"

        def __call__(self, x, residual=None):
            if self.fused:
                return self.norm(x, residual)
            s = x if residual is None else x + residual
            return self.norm(s), s
    AddNorm.__name__ = AddNorm.__qualname__ = f"AddNorm_rms_{kind}"
    return AddNorm


register(Variant("flax_rmsnorm", linen=linen_rms("flax"), nnx=nnx_rms("flax"), norm="rmsnorm"))
register(Variant("jax_lnbwd_rmsnorm", linen=linen_rms("ours"), nnx=nnx_rms("ours"), norm="rmsnorm"))
register(Variant("add_rmsnorm", linen=linen_rms("fused"), nnx=nnx_rms("fused"), norm="rmsnorm",
                 x_bias=True, fused=True))
