"""The RMSNorm variants (Variant.norm "rmsnorm", for llama), registered beside the LayerNorm ones.

  flax_rmsnorm       Flax's RMSNorm after a jnp add: the baseline. With an offset (Gemma's
                     zero-centred scale, ``--offset 1.0``) Flax has no such option, so the
                     baseline is FlaxOffsetRMSNorm below: Flax's RMSNorm computation with
                     (offset + scale) in place of scale, written out.
  jax_lnbwd_rmsnorm  the drop-in jax_lnbwd.flax.RMSNorm (nnx: jax_lnbwd.flax.nnx.RMSNorm)
  add_rmsnorm        jax_lnbwd.flax.AddRMSNorm: the residual add fused, one backward call
  public_rmsnorm     the public models' baseline (config.py: public_llama, public_gemma): a jnp
                     add, then RMSNorm as users' public Flax Llama/Gemma code writes it, whose
                     output is float32 (PublicRMSNorm below)

Three diagnosis variants, in no default list, tell which half of the drop-in a step's difference
comes from (the switches are read when the norm is traced, so the module's call sets them; the
dispatch rule's default in a training step is XLA's forward and our backward, jax_lnbwd/dispatch.py):

  jax_lnbwd_rmsnorm_jnp_fwd  the drop-in with the jnp forward and our backward
                             (inside jax_lnbwd.use_ffi_forward(False))
  jax_lnbwd_rmsnorm_ffi_fwd  the drop-in with our forward and our backward
                             (inside jax_lnbwd.use_ffi_forward(True))
  jax_lnbwd_rmsnorm_jnp_bwd  the drop-in with our forward and the jnp backward
                             (inside use_ffi_forward(True) and jax_lnbwd.use_ffi_backward(False))

With an offset every variant initializes its scale to zeros (so y starts as x * rstd, as with
offset 0 and ones).

QK-norm (``--qk-norm``: the public-style models normalize q and k per head over head_dim, as
Qwen3 does; config.ModelConfig.qk_norm). Two variants compare its implementations, both with
public_rmsnorm's add & norms, so that they differ in the QK-norm only:

  qk_flax       Flax's own nn.RMSNorm twice, as submodules q_norm and k_norm of one module
                (FlaxQKNorm below; FlaxOffsetRMSNorm with an offset): the baseline
  qk_jax_lnbwd  jax_lnbwd.flax.QKNorm (nnx: jax_lnbwd.flax.nnx.QKNorm)

Both hold the same parameters under the same names ({'q_norm': {'scale'}, 'k_norm': {'scale'}},
(head_dim,) each, in the attention's submodule qk_norm), so the two variants share a checkpoint
layout and start from the same weights. A variant without a QK-norm of its own
(Variant.qk_norm None: every other one) runs Flax's, the baseline's, in a model that has one.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from jax import lax

import jax_lnbwd
import jax_lnbwd.flax
import jax_lnbwd.flax.nnx

from .registry import Variant, register


def ours(api: str, name: str) -> type:
    """jax_lnbwd.flax's (linen) or jax_lnbwd.flax.nnx's class `name`."""
    return getattr(jax_lnbwd.flax if api == "linen" else jax_lnbwd.flax.nnx, name)


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


def _public_rms(s, weight, offset: float, epsilon: float, dtype):
    """RMSNorm as public Flax Llama/Gemma code writes it: the mean square in float32, s divided
    by its root (s promoted to float32 by the division), rounded to dtype, then times the
    float32 weight (Llama) or (1 + weight) (Gemma, offset 1): y is float32, whatever dtype is.
    That promotion is the point of this baseline: the next projection gets a float32 input."""
    var = jnp.mean(jnp.square(s.astype(jnp.float32)), axis=-1, keepdims=True)
    normed = s / jnp.sqrt(var + epsilon)
    scale = offset + weight if offset else weight
    return scale * normed.astype(dtype or s.dtype)


class PublicRMSNorm(nn.Module):
    """The linen public-style RMSNorm: one float32 parameter "weight", ones (offset 0) or zeros
    (an offset: Gemma's zero-centred weight)."""
    epsilon: float = 1e-6
    dtype: Any = None
    offset: float = 0.0

    @nn.compact
    def __call__(self, s):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        weight = self.param("weight", init, (s.shape[-1],), jnp.float32)
        return _public_rms(s, weight, self.offset, self.epsilon, self.dtype)


class NnxPublicRMSNorm(nnx.Module):
    """The nnx public-style RMSNorm; draws its weight's key as nnx.RMSNorm draws its scale's, so
    the parameters made after it are the same for every variant."""
    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, offset: float = 0.0,
                 rngs: nnx.Rngs):
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.weight = nnx.Param(init(rngs.params(), (num_features,), jnp.float32))
        self.epsilon, self.dtype, self.offset = epsilon, dtype, offset

    def __call__(self, s):
        return _public_rms(s, self.weight[...], self.offset, self.epsilon, self.dtype)


class FlaxQKNorm(nn.Module):
    """The linen QK-norm baseline: `q, k = FlaxQKNorm()(q, k)`, Flax's nn.RMSNorm over the last
    axis of q and of k, as submodules named q_norm and k_norm (jax_lnbwd.flax.QKNorm's names and
    parameters); with an offset FlaxOffsetRMSNorm, Flax's computation with (offset + scale)."""
    epsilon: float = 1e-6
    dtype: Any = None
    offset: float = 0.0
    scale_init: Callable = nn.initializers.ones

    def setup(self):
        kw = {"epsilon": self.epsilon, "dtype": self.dtype, "scale_init": self.scale_init}
        cls = functools.partial(FlaxOffsetRMSNorm, offset=self.offset) if self.offset else nn.RMSNorm
        self.q_norm = cls(**kw)
        self.k_norm = cls(**kw)

    def __call__(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class NnxFlaxQKNorm(nnx.Module):
    """The nnx QK-norm baseline: nnx.RMSNorm (NnxOffsetRMSNorm with an offset) as q_norm and
    k_norm, each drawing its key as jax_lnbwd.flax.nnx.QKNorm's do."""
    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, offset: float = 0.0,
                 scale_init=nnx.initializers.ones, rngs: nnx.Rngs):
        kw = {"epsilon": epsilon, "dtype": dtype, "scale_init": scale_init, "rngs": rngs}
        cls = functools.partial(NnxOffsetRMSNorm, offset=offset) if offset else nnx.RMSNorm
        self.q_norm = cls(num_features, **kw)
        self.k_norm = cls(num_features, **kw)

    def __call__(self, q, k):
        return self.q_norm(q), self.k_norm(k)


def qk_norm_module(api: str, kind: str | None) -> Callable[..., Any]:
    """The QK-norm of a Variant.qk_norm kind ("ours": jax_lnbwd's QKNorm; "flax" or None: Flax's
    two RMSNorms), as the public models make it: linen (dtype=, epsilon=, offset=, name=),
    nnx (head_dim, dtype=, epsilon=, offset=, rngs=); called as `q, k = module(q, k)`. With an
    offset the scales start at zeros."""
    cls = ours(api, "QKNorm") if kind == "ours" else FlaxQKNorm if api == "linen" else NnxFlaxQKNorm
    zeros = nn.initializers.zeros if api == "linen" else nnx.initializers.zeros

    def make(*args, dtype, epsilon: float, offset: float = 0.0, **kw):
        return cls(*args, dtype=dtype, epsilon=epsilon, **_norm_kwargs(offset, zeros), **kw)
    return make


def half_switch(kind: str) -> Callable[[], Any]:
    """What makes the context a kind's norm is traced in: "ours_jnp_fwd": the jnp forward
    (use_ffi_forward(False)); "ours_ffi_fwd": our forward (use_ffi_forward(True)); "ours_jnp_bwd":
    our forward and the jnp backward (use_ffi_backward(False)); any other kind: nothing. Call the result
    right in the with statement: constructing a switch already sets it, the exit restores it."""
    if kind == "ours_jnp_fwd":
        return lambda: jax_lnbwd.use_ffi_forward(False)
    if kind == "ours_ffi_fwd":
        return lambda: jax_lnbwd.use_ffi_forward(True)
    if kind == "ours_jnp_bwd":
        def both():
            stack = contextlib.ExitStack()
            stack.enter_context(jax_lnbwd.use_ffi_forward(True))
            stack.enter_context(jax_lnbwd.use_ffi_backward(False))
            return stack
        return both
    return contextlib.nullcontext


def _norm_kwargs(offset: float, zeros) -> dict:
    return {"offset": offset, "scale_init": zeros} if offset else {}


def linen_rms(kind: str) -> type:
    """The linen add & norm of a kind: "flax", "ours" (the drop-in after a jnp add), "fused",
    "public" (PublicRMSNorm after a jnp add), or "ours_jnp_fwd" / "ours_jnp_bwd" (the drop-in
    traced with one half jnp, half_switch)."""
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
            if kind == "public":
                return PublicRMSNorm(dtype=self.dtype, epsilon=self.epsilon, offset=self.offset, name="norm")(s), s
            if kind.startswith("ours"):
                with half_switch(kind)():
                    return ours("linen", "RMSNorm")(**kw)(s), s
            cls = FlaxOffsetRMSNorm if self.offset else nn.RMSNorm
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
            elif kind == "public":
                self.norm = NnxPublicRMSNorm(features, dtype=dtype, epsilon=epsilon, offset=offset, rngs=rngs)
            else:
                cls = ours("nnx", "RMSNorm") if kind.startswith("ours") else NnxOffsetRMSNorm if offset else nnx.RMSNorm
                self.norm = cls(features, **kw)
            self.fused = kind == "fused"

        def __call__(self, x, residual=None):
            if self.fused:
                return self.norm(x, residual)
            s = x if residual is None else x + residual
            with half_switch(kind)():
                return self.norm(s), s
    AddNorm.__name__ = AddNorm.__qualname__ = f"AddNorm_rms_{kind}"
    return AddNorm


register(Variant("flax_rmsnorm", linen=linen_rms("flax"), nnx=nnx_rms("flax"), norm="rmsnorm"))
register(Variant("jax_lnbwd_rmsnorm", linen=linen_rms("ours"), nnx=nnx_rms("ours"), norm="rmsnorm"))
register(Variant("add_rmsnorm", linen=linen_rms("fused"), nnx=nnx_rms("fused"), norm="rmsnorm",
                 x_bias=True, fused=True))
register(Variant("public_rmsnorm", linen=linen_rms("public"), nnx=nnx_rms("public"), norm="rmsnorm"))
# Which half of the drop-in a step's difference comes from: its backward alone, its forward alone.
register(Variant("jax_lnbwd_rmsnorm_jnp_fwd", linen=linen_rms("ours_jnp_fwd"), nnx=nnx_rms("ours_jnp_fwd"),
                 norm="rmsnorm"))
register(Variant("jax_lnbwd_rmsnorm_jnp_bwd", linen=linen_rms("ours_jnp_bwd"), nnx=nnx_rms("ours_jnp_bwd"),
                 norm="rmsnorm"))
register(Variant("jax_lnbwd_rmsnorm_ffi_fwd", linen=linen_rms("ours_ffi_fwd"), nnx=nnx_rms("ours_ffi_fwd"),
                 norm="rmsnorm"))
# The QK-norm pair (--qk-norm): the public baseline's add & norms, Flax's QK-norm against ours.
register(Variant("qk_flax", linen=linen_rms("public"), nnx=nnx_rms("public"), norm="rmsnorm", qk_norm="flax"))
register(Variant("qk_jax_lnbwd", linen=linen_rms("public"), nnx=nnx_rms("public"), norm="rmsnorm", qk_norm="ours"))
