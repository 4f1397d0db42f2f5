"""jax_lnbwd.flax.LayerNorm: flax.linen.LayerNorm with jax_lnbwd's backward."""
from __future__ import annotations

import flax.linen as nn
from flax.linen import dtypes

from ._options import check_options, normalize


class LayerNorm(nn.LayerNorm):
    """flax.linen.LayerNorm, normalizing with jax_lnbwd.layernorm (backward: our FFI op).

    A subclass with the same fields and defaults (epsilon=1e-6, param_dtype=float32, ...) and
    the same parameters, `scale` and `bias` of shape (features,), made by the same
    initializers with the same RNG streams; auto-named `LayerNorm_<n>` like Flax's, so
    parameter trees and checkpoints are interchangeable. Normalization is over the last axis.

    dtypes as in Flax: the computation dtype is `dtype`, or when None the promotion of x's
    dtype and the parameters' (x bfloat16 with float32 params: float32). x, scale and bias are
    cast to it, since our op takes one dtype; statistics are float32 (float64 for float64).
    With dtype=bfloat16 and float32 params, the params are thus rounded to bfloat16 before
    use, as flax.nnx.LayerNorm does (linen's multiplies by the float32 scale and rounds the
    result): outputs differ by bfloat16 rounding. Unsupported options raise a ValueError
    (see jax_lnbwd/flax/_options.py).
    """

    @nn.compact
    def __call__(self, x, *, mask=None):
        check_options(self, x, mask)
        features = (x.shape[-1],)
        scale = self.param("scale", self.scale_init, features, self.param_dtype) if self.use_scale else None
        bias = self.param("bias", self.bias_init, features, self.param_dtype) if self.use_bias else None
        dtype = dtypes.canonicalize_dtype(x, scale, bias, dtype=self.dtype)
        return normalize(x, scale, bias, epsilon=self.epsilon, dtype=dtype)
