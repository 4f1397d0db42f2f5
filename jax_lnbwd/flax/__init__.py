"""Flax LayerNorms whose backward is jax_lnbwd's FFI op: drop-in replacements for Flax's own.

    from jax_lnbwd.flax import LayerNorm        # in place of flax.linen.LayerNorm
    from jax_lnbwd.flax import nnx              # nnx.LayerNorm in place of flax.nnx.LayerNorm

Each is a subclass of the Flax class it replaces: the same constructor, attributes, defaults
(epsilon=1e-6), parameter names, shapes and initializers, so existing code and checkpoints work
unchanged; only __call__ differs, normalizing with jax_lnbwd.layernorm. What is and is not
supported is in _options.py and the README ("Flax and sharding").
"""
from .linen import LayerNorm

__all__ = ["LayerNorm"]
