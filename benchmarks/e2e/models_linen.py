"""The benchmark's transformers in flax.linen (see config.py for the families).

Every norm (LayerNorm, or llama's RMSNorm) is an add & norm of the variant (variants.py), called
under ``jax.named_scope(LN_SCOPE)``: the scope is how the trace attribution (trace/classify.py)
finds the norm's operations, forward and backward, in the compiled step.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .rope import rotary

LN_SCOPE = "e2e_layernorm"  # the name scope around every add & norm, in both APIs
INIT = nn.initializers.normal(0.02)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Any
    out_bias: bool = True   # False: the output projection's bias lives in the add & norm after it

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = self.cfg.heads
        qkv = nn.Dense(3 * d, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * h, d // h), 3, axis=2)
        if self.cfg.rope:
            q, k = rotary(q), rotary(k)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=self.cfg.causal,
                                         implementation=self.cfg.attention)
        return nn.Dense(d, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias and self.out_bias,
                        name="proj")(o.reshape(b, t, d))


class Mlp(nn.Module):
    cfg: ModelConfig
    dtype: Any
    out_bias: bool = True   # as Attention's

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        m = nn.Dense(self.cfg.hidden, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias, name="up")(x)
        if self.cfg.mlp == "swiglu":
            gate = nn.Dense(self.cfg.hidden, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias,
                            name="gate")(x)
            m = nn.silu(gate) * m
        else:
            m = nn.gelu(m)
        return nn.Dense(d, dtype=self.dtype, kernel_init=INIT, use_bias=self.cfg.dense_bias and self.out_bias,
                        name="down")(m)


class Transformer(nn.Module):
    """inputs (tokens, or vit patches) -> logits; `add_norm` is the variant's linen module.

    x_bias (a variant whose add & norm takes x's own bias, variants.Variant.x_bias): with Dense
    biases (cfg.dense_bias) the output projection of attention and the MLP's down projection
    are built without theirs, and the add & norm after each adds it (parameter x_bias: the
    same parameters and initial values, moved)."""
    cfg: ModelConfig
    add_norm: Callable[..., nn.Module]
    dtype: Any
    x_bias: bool = False

    def norm(self, x, residual=None, x_bias: bool = False):
        kw = {"x_bias": True} if x_bias else {}
        if self.cfg.norm == "rmsnorm":
            kw["offset"] = self.cfg.offset
        with jax.named_scope(LN_SCOPE):
            return self.add_norm(dtype=self.dtype, epsilon=self.cfg.epsilon, **kw)(x, residual)

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
        if not cfg.rope:
            x = x + self.param("pos", INIT, (cfg.seq, cfg.d_model)).astype(dt)
        fb = cfg.dense_bias and self.x_bias   # the projections' biases move into the add & norms
        attn = lambda i: Attention(cfg, dt, out_bias=not fb, name=f"attn_{i}")  # noqa: E731
        mlp = lambda i: Mlp(cfg, dt, out_bias=not fb, name=f"mlp_{i}")  # noqa: E731
        if cfg.pre_ln:  # s: the residual stream; y: the LayerNorm of it, the next layer's input
            y, s = self.norm(x)
            for i in range(cfg.layers):
                y, s = self.norm(attn(i)(y), s, fb)
                y, s = self.norm(mlp(i)(y), s, fb)  # the last: the final LN
        else:  # post-LN: the stream is the LayerNorm's output
            y, _ = self.norm(x)
            for i in range(cfg.layers):
                y, _ = self.norm(attn(i)(y), y, fb)
                y, _ = self.norm(mlp(i)(y), y, fb)
        if embed is not None and cfg.tied_head:
            return embed.attend(y)  # the head tied to the token embedding
        if embed is not None:
            return nn.Dense(cfg.vocab, dtype=dt, kernel_init=INIT, use_bias=False, name="head")(y)
        return nn.Dense(cfg.classes, dtype=dt, kernel_init=INIT, name="head")(y[:, 0])
