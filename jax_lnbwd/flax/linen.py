"""jax_lnbwd.flax.LayerNorm, AddLayerNorm, RMSNorm, AddRMSNorm: Flax's linen norms with jax_lnbwd's
ops; QKNorm: attention's q and k normalized per head by two of the RMSNorms."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from ._options import (LAYERNORM, RMSNORM, add_inputs, add_normalize, broadcast_shape, feature_shape,
                       linen_rmsnorm_with_offset, normalize, route)


class LayerNorm(nn.LayerNorm):
    """flax.linen.LayerNorm, normalizing with jax_lnbwd.layernorm (backward: our FFI op).

    A subclass with the same fields and defaults (epsilon=1e-6, param_dtype=float32, ...) and
    the same parameters, `scale` and `bias` of shape (features,), made by the same
    initializers with the same RNG streams; auto-named `LayerNorm_<n>` like Flax's, so
    parameter trees and checkpoints are interchangeable. Normalization is over the last axis.

    dtypes exactly as in linen: y has `dtype`, or when None the promotion of x's dtype and the
    parameters'; it is computed in float32 (float64 for float64) from x and the parameters as
    they are, and rounded once. float32 parameters are never rounded: beside bf16/fp16 x they
    go to the op as float32 (mixed precision: float32 scale/bias gradients). x is cast only
    when the output dtype is wider than x's (bf16 x, float32 params, dtype=None: y is float32,
    as in Flax); with dtype=bfloat16 it is not cast at all. (The rule: _options.py.)
    Every option of Flax's is accepted: those our ops do not cover (mask, axis_name, axes other
    than trailing ones, force_float32_reductions=False) run Flax's own code, logged once
    (jax_lnbwd/flax/_options.py).
    """

    @nn.compact
    def __call__(self, x, *, mask=None):
        row = route(self, x, mask, has_params=self.use_scale or self.use_bias)
        if row is None:
            return nn.LayerNorm.__call__(self, x, mask=mask)
        scale, bias = _params(self, x)
        return normalize("linen", LAYERNORM, row, x, scale, bias, epsilon=self.epsilon, dtype=self.dtype)


class AddLayerNorm(nn.LayerNorm):
    """The residual add and a LayerNorm in one: `y, s = AddLayerNorm()(x, residual)` is
    `s = x + residual; y = nn.LayerNorm()(s)` with the same fields, parameters (`scale`, `bias`
    of shape (features,), same initializers) and dtypes as LayerNorm above, but through
    jax_lnbwd.add_layernorm: the backward adds the residual stream's gradient (s's cotangent)
    inside the one kernel call. For a pre-LN block:

        y, h = AddLayerNorm()(h, attention_out)    # h = h + attention_out; y = LN(h)
        h2 = h + mlp(y)

    residual=None gives (LayerNorm(x), x). s has jnp's promotion of x's and residual's dtypes.
    When the compute dtype is wider than s's (bf16 activations with dtype=None and float32
    params) the add and the norm are done separately, with Flax's numbers.

    use_x_bias=True adds one more parameter, `x_bias` of the scale's shape (x_bias_init, zeros
    by default, param_dtype): the bias of the projection that produced x, moved here from that
    Dense (built with use_bias=False), so that the forward kernel adds it as well, s = (x +
    x_bias) + residual, and XLA runs no bias add of its own (jax_lnbwd.add_layernorm's x_bias):

        y, h = AddLayerNorm(use_x_bias=True)(nn.Dense(d, use_bias=False)(o), h)
    """
    use_x_bias: bool = False
    x_bias_init: Callable[..., Any] = nn.initializers.zeros

    @nn.compact
    def __call__(self, x, residual=None, *, mask=None):
        row = route(self, x, mask, has_params=self.use_scale or self.use_bias or self.use_x_bias)
        if row is None:
            _, _, s = add_inputs(x, residual, _x_bias(self, x), broadcast_shape(self, x))
            return nn.LayerNorm.__call__(self, s, mask=mask), s
        scale, bias = _params(self, x)
        x_bias = _x_bias(self, x)
        return add_normalize("linen", LAYERNORM, row, x, residual, scale, bias, epsilon=self.epsilon, dtype=self.dtype,
                             x_bias=x_bias)


def _x_bias(module, x):
    """The Add* modules' `x_bias` (the scale's shape), None without use_x_bias."""
    if not module.use_x_bias:
        return None
    return module.param("x_bias", module.x_bias_init, feature_shape(module, x), module.param_dtype)


def _params(module, x):
    """(scale, bias) as linen.LayerNorm makes them (None where unused)."""
    features = feature_shape(module, x)
    scale = module.param("scale", module.scale_init, features, module.param_dtype) if module.use_scale else None
    bias = module.param("bias", module.bias_init, features, module.param_dtype) if module.use_bias else None
    return scale, bias


class RMSNorm(nn.RMSNorm):
    """flax.linen.RMSNorm, normalizing with jax_lnbwd.rmsnorm (backward: our FFI op).

    A subclass with the same fields and defaults (epsilon=1e-6, param_dtype=float32,
    use_scale=True, ...), the same parameter `scale` of shape (features,) made by scale_init, and
    auto-named `RMSNorm_<n>` like Flax's, so parameter trees and checkpoints are interchangeable.
    dtypes as LayerNorm above (the rule: _options.py). One field more:

    offset (default 0.0): added to the scale by the kernel, y = x * rstd * (offset + scale).
    offset=1.0 is Gemma's zero-centred scale (store it with scale_init=zeros); the stored scale
    is untouched and its gradient is the same as without the offset.
    Options our ops do not cover run Flax's own code (as LayerNorm's), with offset + scale.
    """
    offset: float = 0.0

    @nn.compact
    def __call__(self, x, *, mask=None):
        row = route(self, x, mask, has_params=self.use_scale)
        if row is None:
            return _flax_rmsnorm(self, x, mask)
        scale = _rms_scale(self, x)
        return normalize("linen", RMSNORM, row, x, scale, None, epsilon=self.epsilon, dtype=self.dtype,
                         offset=self.offset)


class AddRMSNorm(RMSNorm):
    """The residual add and an RMSNorm in one: `y, s = AddRMSNorm()(x, residual)` is
    `s = x + residual; y = RMSNorm()(s)` with RMSNorm's fields, parameter and dtypes, through
    jax_lnbwd.add_rmsnorm: the backward adds the residual stream's gradient (s's cotangent)
    inside the one kernel call. For a pre-norm block (Llama):

        y, h = AddRMSNorm()(attention_out, h)    # h = h + attention_out; y = RMSNorm(h)

    residual=None gives (RMSNorm(x), x). use_x_bias=True adds the parameter `x_bias`
    (features,), the bias of the projection that produced x, added by the forward kernel
    (as AddLayerNorm's)."""
    use_x_bias: bool = False
    x_bias_init: Callable[..., Any] = nn.initializers.zeros

    @nn.compact
    def __call__(self, x, residual=None, *, mask=None):
        row = route(self, x, mask, has_params=self.use_scale or self.use_x_bias)
        if row is None:
            _, _, s = add_inputs(x, residual, _x_bias(self, x), broadcast_shape(self, x))
            return _flax_rmsnorm(self, s, mask), s
        scale = _rms_scale(self, x)
        x_bias = _x_bias(self, x)
        return add_normalize("linen", RMSNORM, row, x, residual, scale, None, epsilon=self.epsilon, dtype=self.dtype,
                             x_bias=x_bias, offset=self.offset)


def _rms_scale(module, x):
    """`scale` as linen.RMSNorm makes it (None without use_scale)."""
    if not module.use_scale:
        return None
    return module.param("scale", module.scale_init, feature_shape(module, x), module.param_dtype)


def _flax_rmsnorm(module, x, mask):
    """Flax's own linen.RMSNorm code (with offset + scale where offset is not 0)."""
    if module.offset == 0.0:
        return nn.RMSNorm.__call__(module, x, mask=mask)
    return linen_rmsnorm_with_offset(module, x, mask)


class QKNorm(nn.Module):
    """QK-norm (Qwen3, Gemma 3, OLMo 2): `q_out, k_out = QKNorm()(q, k)` normalizes q [..., Hq, D]
    and k [..., Hk, D] per head over head_dim D, as two RMSNorms over the last axis would.

    It holds them as submodules named `q_norm` and `k_norm`, each the RMSNorm above (so
    jax_lnbwd.rmsnorm, one call each) with a `scale` of shape (D,) inferred at init: the
    parameter tree {'q_norm': {'scale'}, 'k_norm': {'scale'}} of a model that normalizes q and k
    with two Flax RMSNorms of those names, whose checkpoints load as they are. The fields are
    flax.linen.RMSNorm's and are passed to both (offset: RMSNorm's above).
    """
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_scale: bool = True
    scale_init: Callable[..., Any] = nn.initializers.ones
    offset: float = 0.0

    def setup(self):
        fields = dict(epsilon=self.epsilon, dtype=self.dtype, param_dtype=self.param_dtype, use_scale=self.use_scale,
                      scale_init=self.scale_init, offset=self.offset)
        self.q_norm = RMSNorm(**fields)
        self.k_norm = RMSNorm(**fields)

    def __call__(self, q, k):
        return self.q_norm(q), self.k_norm(k)
