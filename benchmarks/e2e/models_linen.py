"""The benchmark's transformers in flax.linen (see config.py for the three families).

Every LayerNorm is an add & norm of the variant (variants.py), called under
``jax.named_scope(LN_SCOPE)``: the scope is how the trace attribution (trace.py) finds the
layernorm's operations, forward and backward, in the compiled step.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ModelConfig

LN_SCOPE = "e2e_layernorm"  # the name scope around every add & norm, in both APIs
INIT = nn.initializers.normal(0.02)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = self.cfg.heads
        qkv = nn.Dense(3 * d, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * h, d // h), 3, axis=2)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=self.cfg.causal,
                                         implementation=self.cfg.attention)
        return nn.Dense(d, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias, name="proj")(o.reshape(b, t, d))


class Mlp(nn.Module):
    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        m = nn.Dense(self.cfg.mlp_ratio * d, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias, name="up")(x)
        return nn.Dense(d, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias, name="down")(nn.gelu(m))


class Transformer(nn.Module):
    """inputs (tokens, or vit patches) -> logits; `add_norm` is the variant's linen module."""
    cfg: ModelConfig
    add_norm: Callable[..., nn.Module]
    dtype: Any

    def norm(self, x, residual=None):
        with jax.named_scope(LN_SCOPE):
            return self.add_norm(dtype=self.dtype, epsilon=self.cfg.epsilon)(x, residual)

    @nn.compact
    def __call__(self, inputs):
        cfg, dt = self.cfg, self.dtype
        embed = None
        if cfg.name == "vit":
            x = nn.Dense(cfg.d_model, dtype=dt, kernel_init=INIT, name="patch_embed")(inputs)
            cls = self.param("cls", INIT, (1, 1, cfg.d_model)).astype(dt)
            x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, cfg.d_model)), x], axis=1)
        else:
            embed = nn.Embed(cfg.vocab, cfg.d_model, dtype=dt, embedding_init=INIT, name="embed")
            x = embed(inputs)
        x = x + self.param("pos", INIT, (cfg.seq, cfg.d_model)).astype(dt)
        if cfg.pre_ln:  # s: the residual stream; y: the LayerNorm of it, the next layer's input
            y, s = self.norm(x)
            for i in range(cfg.layers):
                y, s = self.norm(Attention(cfg, dt, name=f"attn_{i}")(y), s)
                y, s = self.norm(Mlp(cfg, dt, name=f"mlp_{i}")(y), s)  # the last: the final LN
        else:  # post-LN: the stream is the LayerNorm's output
            y, _ = self.norm(x)
            for i in range(cfg.layers):
                y, _ = self.norm(Attention(cfg, dt, name=f"attn_{i}")(y), y)
                y, _ = self.norm(Mlp(cfg, dt, name=f"mlp_{i}")(y), y)
        if embed is not None:
            return embed.attend(y)  # the head tied to the token embedding
        return nn.Dense(cfg.classes, dtype=dt, kernel_init=INIT, name="head")(y[:, 0])
