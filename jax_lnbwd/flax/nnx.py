"""jax_lnbwd.flax.nnx.LayerNorm and AddLayerNorm: flax.nnx.LayerNorm with jax_lnbwd's op.

    from jax_lnbwd.flax import nnx as lnbwd_nnx
    norm = lnbwd_nnx.LayerNorm(num_features, rngs=rngs)   # in place of nnx.LayerNorm(...)
    y, s = lnbwd_nnx.AddLayerNorm(num_features, rngs=rngs)(x, residual)   # s = x + residual
    q, k = lnbwd_nnx.QKNorm(head_dim, rngs=rngs)(q, k)                     # per head over head_dim
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ._options import (LAYERNORM, RMSNORM, add_inputs, add_normalize, broadcast_shape, normalize,
                       nnx_rmsnorm_with_offset, route)


class _XBias:
    """The Add* modules' one extra Param: `x_bias` (num_features,) with use_x_bias=True, made by
    x_bias_init (zeros) in param_dtype, else None; reshaped against x as the scale is. Put
    before the Flax class in the bases."""

    def __init__(self, num_features: int, *args, use_x_bias: bool = False,
                 x_bias_init=nnx.initializers.zeros_init(), rngs: nnx.Rngs, **kwargs):
        super().__init__(num_features, *args, rngs=rngs, **kwargs)
        self.x_bias = nnx.Param(x_bias_init(rngs.params(), (num_features,), self.param_dtype)) if use_x_bias else None

    def x_bias_value(self):
        return None if self.x_bias is None else self.x_bias[...]


class LayerNorm(nnx.LayerNorm):
    """flax.nnx.LayerNorm, normalizing with jax_lnbwd.layernorm (backward: our FFI op).

    A subclass: __init__ is Flax's own (same arguments, defaults, `scale`/`bias` Params, RNG
    use, metadata), so the module's state is the same; only __call__ differs. dtypes as in
    nnx: y has `dtype`, or when None the promotion of x's and the parameters' dtypes, and x is
    cast to it as nnx casts it; statistics are float32 (float64 for float64). Unlike nnx, float32
    parameters are never rounded: beside bf16/fp16 x they go to the op as float32 (mixed
    precision: float32 scale/bias gradients). The rule: _options.py. Every option of Flax's is
    accepted: those our ops do not cover (mask, axis_name, axes other than trailing ones, a
    promote_dtype of one's own) run Flax's own code, logged once (jax_lnbwd/flax/_options.py).
    """

    def __call__(self, x, *, mask=None):
        row = route(self, x, mask, has_params=_has_params(self))
        if row is None:
            return nnx.LayerNorm.__call__(self, x, mask=mask)
        return normalize("nnx", LAYERNORM, row, x, *_params(self), epsilon=self.epsilon, dtype=self.dtype)


class AddLayerNorm(_XBias, nnx.LayerNorm):
    """The residual add and a LayerNorm in one: `y, s = AddLayerNorm(n, rngs=rngs)(x, residual)`
    is `s = x + residual; y = LayerNorm(n, rngs=rngs)(s)` (same arguments, state and dtypes as
    LayerNorm above) through jax_lnbwd.add_layernorm, whose backward adds s's cotangent inside
    the one kernel call. residual=None gives (LayerNorm(x), x).

    use_x_bias=True: one more Param, `x_bias` (num_features,), made by x_bias_init (zeros) in
    param_dtype: the bias of the projection that produced x, moved here from that Linear
    (use_bias=False), added by the forward kernel: s = (x + x_bias) + residual (as linen's
    AddLayerNorm, jax_lnbwd/flax/linen.py)."""

    def __call__(self, x, residual=None, *, mask=None):
        row = route(self, x, mask, has_params=_has_params(self))
        if row is None:
            _, _, s = add_inputs(x, residual, self.x_bias_value(), broadcast_shape(self, x))
            return nnx.LayerNorm.__call__(self, s, mask=mask), s
        return add_normalize("nnx", LAYERNORM, row, x, residual, *_params(self), epsilon=self.epsilon,
                             dtype=self.dtype, x_bias=self.x_bias_value())


def _has_params(module) -> bool:
    return any(getattr(module, name, None) is not None for name in ("scale", "bias", "x_bias"))


def _params(module):
    """(scale, bias) values (None where unused)."""
    scale = None if module.scale is None else module.scale[...]
    bias = None if module.bias is None else module.bias[...]
    return scale, bias


class RMSNorm(nnx.RMSNorm):
    """flax.nnx.RMSNorm, normalizing with jax_lnbwd.rmsnorm (backward: our FFI op).

    A subclass: __init__ is Flax's own (same arguments, defaults, `scale` Param), plus `offset`
    (default 0.0), added to the scale by the kernel (Gemma's zero-centred scale: 1.0). dtypes as
    LayerNorm above; options our ops do not cover run Flax's own code, with offset + scale."""

    def __init__(self, num_features: int, *args, offset: float = 0.0, rngs: nnx.Rngs, **kwargs):
        super().__init__(num_features, *args, rngs=rngs, **kwargs)
        self.offset = offset

    def __call__(self, x, mask=None):
        row = route(self, x, mask, has_params=_has_params(self))
        if row is None:
            return _flax_rmsnorm(self, x, mask)
        return normalize("nnx", RMSNORM, row, x, _scale(self), None, epsilon=self.epsilon, dtype=self.dtype,
                         offset=self.offset)


class AddRMSNorm(_XBias, RMSNorm):
    """The residual add and an RMSNorm in one: `y, s = AddRMSNorm(n, rngs=rngs)(x, residual)`
    is `s = x + residual; y = RMSNorm(n, rngs=rngs)(s)` through jax_lnbwd.add_rmsnorm (as
    AddLayerNorm; use_x_bias adds the Param `x_bias`)."""

    def __call__(self, x, residual=None, *, mask=None):
        row = route(self, x, mask, has_params=_has_params(self))
        if row is None:
            _, _, s = add_inputs(x, residual, self.x_bias_value(), broadcast_shape(self, x))
            return _flax_rmsnorm(self, s, mask), s
        return add_normalize("nnx", RMSNORM, row, x, residual, _scale(self), None, epsilon=self.epsilon,
                             dtype=self.dtype, x_bias=self.x_bias_value(), offset=self.offset)


def _scale(module):
    return None if module.scale is None else module.scale[...]


def _flax_rmsnorm(module, x, mask):
    """Flax's own nnx.RMSNorm code (with offset + scale where offset is not 0)."""
    if module.offset == 0.0:
        return nnx.RMSNorm.__call__(module, x, mask)
    return nnx_rmsnorm_with_offset(module, x, mask)


class QKNorm(nnx.Module):
    """QK-norm: `q_out, k_out = QKNorm(head_dim, rngs=rngs)(q, k)` normalizes q [..., Hq, D] and k
    [..., Hk, D] per head over head_dim D (= num_features), as two RMSNorms would.

    Its state is two of the RMSNorms above, attributes `q_norm` and `k_norm`, each with a
    `scale` Param (D,): the state of a module that holds two flax.nnx.RMSNorms by those names,
    made with the same RNG use, so checkpoints load as they are. The arguments are
    flax.nnx.RMSNorm's and are passed to both (offset: RMSNorm's above).
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 use_scale: bool = True, scale_init=nnx.initializers.ones, offset: float = 0.0, rngs: nnx.Rngs):
        fields = dict(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, use_scale=use_scale,
                      scale_init=scale_init, offset=offset, rngs=rngs)
        self.q_norm = RMSNorm(num_features, **fields)
        self.k_norm = RMSNorm(num_features, **fields)

    def __call__(self, q, k):
        return self.q_norm(q), self.k_norm(k)
