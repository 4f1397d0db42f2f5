"""jax_lnbwd.flax.nnx.LayerNorm: flax.nnx.LayerNorm with jax_lnbwd's backward.

    from jax_lnbwd.flax import nnx as lnbwd_nnx
    norm = lnbwd_nnx.LayerNorm(num_features, rngs=rngs)   # in place of nnx.LayerNorm(...)
"""
from __future__ import annotations

from flax import nnx

from ._options import check_options, normalize


class LayerNorm(nnx.LayerNorm):
    """flax.nnx.LayerNorm, normalizing with jax_lnbwd.layernorm (backward: our FFI op).

    A subclass: __init__ is Flax's own (same arguments, defaults, `scale`/`bias` Params, RNG
    use, metadata), so the module's state is the same; only __call__ differs. dtypes as in
    nnx: x, scale and bias are promoted to one dtype (`dtype` if given) by the module's
    `promote_dtype`, then normalized over the last axis; statistics are float32 (float64 for
    float64). Unsupported options raise a ValueError (see jax_lnbwd/flax/_options.py).
    """

    def __call__(self, x, *, mask=None):
        check_options(self, x, mask)
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return normalize(x, scale, bias, epsilon=self.epsilon, dtype=x.dtype)
