"""jax_lnbwd.flax.nnx.LayerNorm and AddLayerNorm: flax.nnx.LayerNorm with jax_lnbwd's op.

    from jax_lnbwd.flax import nnx as lnbwd_nnx
    norm = lnbwd_nnx.LayerNorm(num_features, rngs=rngs)   # in place of nnx.LayerNorm(...)
    y, s = lnbwd_nnx.AddLayerNorm(num_features, rngs=rngs)(x, residual)   # s = x + residual
"""
from __future__ import annotations

from flax import nnx

from ._options import add_normalize, check_options, normalize


class _XBias:
    """The Add* modules' one extra Param: `x_bias` (num_features,) with use_x_bias=True, made by
    x_bias_init (zeros) in param_dtype, else None. Put before the Flax class in the bases."""

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
    precision: float32 scale/bias gradients). The rule: _options.py. Unsupported options
    raise a ValueError (see jax_lnbwd/flax/_options.py).
    """

    def __call__(self, x, *, mask=None):
        check_options(self, x, mask)
        return normalize("nnx", x, *_params(self), epsilon=self.epsilon, dtype=self.dtype)


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
        check_options(self, x, mask)
        return add_normalize("nnx", x, residual, *_params(self), epsilon=self.epsilon, dtype=self.dtype,
                             x_bias=self.x_bias_value())


def _params(module):
    """(scale, bias) values (None where unused)."""
    scale = None if module.scale is None else module.scale[...]
    bias = None if module.bias is None else module.bias[...]
    return scale, bias


class RMSNorm(nnx.RMSNorm):
    """flax.nnx.RMSNorm, normalizing with jax_lnbwd.rmsnorm (backward: our FFI op).

    A subclass: __init__ is Flax's own (same arguments, defaults, `scale` Param), plus `offset`
    (default 0.0), added to the scale by the kernel (Gemma's zero-centred scale: 1.0). dtypes as
    LayerNorm above."""

    def __init__(self, num_features: int, *args, offset: float = 0.0, rngs: nnx.Rngs, **kwargs):
        super().__init__(num_features, *args, rngs=rngs, **kwargs)
        self.offset = offset

    def __call__(self, x, *, mask=None):
        check_options(self, x, mask)
        return normalize("nnx", x, _scale(self), None, epsilon=self.epsilon, dtype=self.dtype, rms=True,
                         offset=self.offset)


class AddRMSNorm(_XBias, RMSNorm):
    """The residual add and an RMSNorm in one: `y, s = AddRMSNorm(n, rngs=rngs)(x, residual)`
    is `s = x + residual; y = RMSNorm(n, rngs=rngs)(s)` through jax_lnbwd.add_rmsnorm (as
    AddLayerNorm; use_x_bias adds the Param `x_bias`)."""

    def __call__(self, x, residual=None, *, mask=None):
        check_options(self, x, mask)
        return add_normalize("nnx", x, residual, _scale(self), None, epsilon=self.epsilon, dtype=self.dtype,
                             x_bias=self.x_bias_value(), rms=True, offset=self.offset)


def _scale(module):
    return None if module.scale is None else module.scale[...]
