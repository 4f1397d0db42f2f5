"""The LayerNorm variants the benchmark compares, and the hook for more.

A variant gives each model its "add & norm": a module called as ``norm(x, residual)`` that
returns ``(LayerNorm(x + residual), x + residual)``, or ``(LayerNorm(x), x)`` when residual is
None. Every LayerNorm of the models goes through it (pre-LN: the residual stream's add and the
next LayerNorm; post-LN: the add and the LayerNorm after it), so a variant that fuses the add
into the kernel (``jax_lnbwd.add_layernorm``) plugs in without touching the models:

    from benchmarks.e2e.variants import Variant, register
    register(Variant("fused", linen=MyLinenAddNorm, nnx=MyNnxAddNorm))

where ``MyLinenAddNorm(dtype=..., epsilon=...)`` is a linen module and ``MyNnxAddNorm(features,
dtype=..., epsilon=..., rngs=...)`` an nnx one, each with the call above. Registered here:
``flax`` (flax's LayerNorm), ``jax_lnbwd`` (the drop-in jax_lnbwd.flax.LayerNorm after a jnp add),
``add_layernorm`` (jax_lnbwd.flax.AddLayerNorm: add and norm fused, one backward call; with Dense
biases it holds the bias of the projection in front, use_x_bias) and ``add_layernorm_dense_bias``
(the same with that bias left in the Dense), and ``jax_lnbwd_jnp_forward`` (the drop-in with
the jnp forward instead of the fused one).
The RMSNorm variants (``flax_rmsnorm``, ``jax_lnbwd_rmsnorm``, ``add_rmsnorm``, for llama) are
in variants_rms.py. Run another with ``--variants flax,jax_lnbwd,fused``; a module outside this folder can be loaded first with
``--variant-module my.module`` (it calls register() when imported). The first variant listed
of each norm is the baseline that the others' step-time ratios are taken against.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx

import jax_lnbwd.flax
import jax_lnbwd.flax.nnx

from .registry import VARIANTS, Variant, register  # noqa: F401 (the hook's names, for callers of this module)


def linen_add_norm(norm_cls: type) -> type:
    """An add & norm linen module around a LayerNorm class with flax.linen.LayerNorm's API."""
    class AddNorm(nn.Module):
        dtype: Any
        epsilon: float

        @nn.compact
        def __call__(self, x, residual=None):
            s = x if residual is None else x + residual
            return norm_cls(dtype=self.dtype, epsilon=self.epsilon, name="norm")(s), s
    AddNorm.__name__ = AddNorm.__qualname__ = f"AddNorm_{norm_cls.__module__.split('.')[0]}"
    return AddNorm


def nnx_add_norm(norm_cls: type) -> type:
    """An add & norm nnx module around a LayerNorm class with flax.nnx.LayerNorm's API."""
    class AddNorm(nnx.Module):
        def __init__(self, features: int, *, dtype, epsilon: float, rngs: nnx.Rngs):
            self.norm = norm_cls(features, dtype=dtype, epsilon=epsilon, rngs=rngs)

        def __call__(self, x, residual=None):
            s = x if residual is None else x + residual
            return self.norm(s), s
    AddNorm.__name__ = AddNorm.__qualname__ = f"AddNorm_{norm_cls.__module__.split('.')[0]}"
    return AddNorm


register(Variant("flax", linen=linen_add_norm(nn.LayerNorm), nnx=nnx_add_norm(nnx.LayerNorm)))
register(Variant("jax_lnbwd", linen=linen_add_norm(jax_lnbwd.flax.LayerNorm),
                 nnx=nnx_add_norm(jax_lnbwd.flax.nnx.LayerNorm)))


def jnp_forward(norm_cls: type) -> type:
    """norm_cls traced with the jnp forward (jax_lnbwd.use_ffi_forward(False)) instead of the
    fused one: XLA then fuses the residual add into the forward's statistics, as in Flax's graph;
    the backward is still ours."""
    class Norm(norm_cls):
        def __call__(self, *args, **kwargs):
            with jax_lnbwd.use_ffi_forward(False):
                return super().__call__(*args, **kwargs)
    Norm.__name__ = Norm.__qualname__ = f"{norm_cls.__name__}JnpForward"
    return Norm


# The drop-in with the jnp forward: which forward pays in a whole step (docs/e2e.md).
register(Variant("jax_lnbwd_jnp_forward", linen=linen_add_norm(jnp_forward(jax_lnbwd.flax.LayerNorm)),
                 nnx=nnx_add_norm(jnp_forward(jax_lnbwd.flax.nnx.LayerNorm))))


def linen_fused_add_norm(cls: type) -> type:
    """An add & norm linen module that IS a residual-fused module (jax_lnbwd.flax.AddLayerNorm's
    API: (x, residual) -> (y, x + residual)); its params sit under "norm" like the others'.
    x_bias=True: the module's use_x_bias (x's own bias, a parameter of the module)."""
    class AddNorm(nn.Module):
        dtype: Any
        epsilon: float
        x_bias: bool = False

        @nn.compact
        def __call__(self, x, residual=None):
            kw = {"use_x_bias": True} if self.x_bias else {}
            return cls(dtype=self.dtype, epsilon=self.epsilon, name="norm", **kw)(x, residual)
    AddNorm.__name__ = AddNorm.__qualname__ = f"AddNorm_fused_{cls.__module__.split('.')[0]}"
    return AddNorm


def nnx_fused_add_norm(cls: type) -> type:
    """The nnx counterpart of linen_fused_add_norm."""
    class AddNorm(nnx.Module):
        def __init__(self, features: int, *, dtype, epsilon: float, rngs: nnx.Rngs, x_bias: bool = False):
            kw = {"use_x_bias": True} if x_bias else {}
            self.norm = cls(features, dtype=dtype, epsilon=epsilon, rngs=rngs, **kw)

        def __call__(self, x, residual=None):
            return self.norm(x, residual)
    AddNorm.__name__ = AddNorm.__qualname__ = f"AddNorm_fused_{cls.__module__.split('.')[0]}"
    return AddNorm


# The residual-fused block: the add and the LayerNorm in one op (jax_lnbwd.add_layernorm), whose
# backward adds the residual stream's gradient inside the one kernel call, and whose forward also
# adds the bias of the projection in front (x_bias). add_layernorm_dense_bias leaves that bias in
# the Dense: XLA then adds it in a kernel of its own, and sums its gradient in another.
register(Variant("add_layernorm", linen=linen_fused_add_norm(jax_lnbwd.flax.AddLayerNorm),
                 nnx=nnx_fused_add_norm(jax_lnbwd.flax.nnx.AddLayerNorm), x_bias=True, fused=True))
register(Variant("add_layernorm_dense_bias", linen=linen_fused_add_norm(jax_lnbwd.flax.AddLayerNorm),
                 nnx=nnx_fused_add_norm(jax_lnbwd.flax.nnx.AddLayerNorm), fused=True))


# Registered after the LayerNorm variants (VARIANTS keeps that order).
from . import variants_rms  # noqa: E402,F401
