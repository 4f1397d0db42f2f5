"""The registry of the norm variants the training-step bench compares: what a variant is, and
register(), the hook that variants.py (LayerNorm), variants_rms.py (RMSNorm) and a module of
--variant-module call to add theirs."""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen
import flax.nnx


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    linen: Callable[..., flax.linen.Module]   # (dtype=, epsilon=) -> (x, residual) -> (y, x + residual)
    nnx: Callable[..., flax.nnx.Module]       # (features, dtype=, epsilon=, rngs=) -> the same
    # Whether the module also takes x's own bias: constructed with x_bias=True, it holds the bias
    # of the projection in front of it and returns (y, (x + x_bias) + residual); the models then
    # build that projection without one (models_linen.Transformer).
    x_bias: bool = False
    # Whether the add & norm is one op each way (the residual add inside the forward kernel, the
    # stream's gradient inside the backward's): what its layernorm-only kernels move, for the byte
    # floor of our own kernels (floor.py).
    fused: bool = False
    # The norm it computes: a model (config.ModelConfig.norm) runs the variants of its norm.
    # An rmsnorm variant's modules also take offset= (the models pass cfg.offset).
    norm: str = "layernorm"
    # The QK-norm it runs in a model that has one (config.ModelConfig.qk_norm, --qk-norm): "flax"
    # (Flax's two RMSNorms) or "ours" (jax_lnbwd.flax.QKNorm), variants_rms.qk_norm_module. None:
    # no QK-norm of its own (it then runs Flax's, the baseline's), and it runs in any model;
    # a variant that names one runs only in models with a QK-norm (the CLI's check).
    qk_norm: str | None = None


VARIANTS: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    """Adds a variant (replacing one of the same name) and returns it."""
    VARIANTS[variant.name] = variant
    return variant
