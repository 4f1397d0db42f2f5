"""Flax LayerNorms and RMSNorms whose passes are jax_lnbwd's FFI ops: drop-in replacements for Flax's own.

    from jax_lnbwd.flax import LayerNorm        # in place of flax.linen.LayerNorm
    from jax_lnbwd.flax import nnx as lnbwd_nnx # lnbwd_nnx.LayerNorm in place of flax.nnx.LayerNorm
    from jax_lnbwd.flax import AddLayerNorm     # y, s = AddLayerNorm()(x, residual): s = x + residual
    from jax_lnbwd.flax import RMSNorm          # in place of flax.linen.RMSNorm (AddRMSNorm too)
    from jax_lnbwd.flax import QKNorm           # q, k = QKNorm()(q, k): per head, two RMSNorms' params

AddLayerNorm (linen, and nnx.AddLayerNorm) fuses a block's residual add with its LayerNorm:
the backward adds the residual stream's gradient inside the one kernel call.

Each is a subclass of the Flax class it replaces: the same constructor, attributes, defaults
(epsilon=1e-6), parameter names, shapes and initializers, so existing code and checkpoints work
unchanged; only __call__ differs, normalizing with jax_lnbwd.layernorm / rmsnorm. Every option
of Flax's modules is accepted; which ones run on our ops and which run Flax's own code (logged
once): _options.py and the README's "Flax".
"""
from .linen import AddLayerNorm, AddRMSNorm, LayerNorm, QKNorm, RMSNorm

__all__ = ["LayerNorm", "AddLayerNorm", "RMSNorm", "AddRMSNorm", "QKNorm"]
