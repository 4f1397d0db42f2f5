"""Flax LayerNorms whose backward is jax_lnbwd's FFI op: drop-in replacements for Flax's own.

    from jax_lnbwd.flax import LayerNorm        # in place of flax.linen.LayerNorm
    from jax_lnbwd.flax import nnx              # nnx.LayerNorm in place of flax.nnx.LayerNorm
    from jax_lnbwd.flax import AddLayerNorm     # y, s = AddLayerNorm()(x, residual): s = x + residual

AddLayerNorm (linen, and nnx.AddLayerNorm) fuses a block's residual add with its LayerNorm:
the backward adds the residual stream's gradient inside the one kernel call.

Each is a subclass of the Flax class it replaces: the same constructor, attributes, defaults
(epsilon=1e-6), parameter names, shapes and initializers, so existing code and checkpoints work
unchanged; only __call__ differs, normalizing with jax_lnbwd.layernorm. What is and is not
supported is in _options.py and the README ("Flax and sharding").
"""
from .linen import AddLayerNorm, LayerNorm

__all__ = ["LayerNorm", "AddLayerNorm"]
