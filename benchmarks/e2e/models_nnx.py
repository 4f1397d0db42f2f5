"""The benchmark's transformers in flax.nnx: the same models as models_linen.py, op for op."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .models_linen import LN_SCOPE
from .rope import rotary

INIT = nnx.initializers.normal(0.02)


def skip_bias_key(cfg: ModelConfig, out_bias: bool, rngs: nnx.Rngs) -> None:
    """A projection whose bias moved into the add & norm after it (out_bias False) still draws
    the key its bias would have: nnx draws parameter keys from one stream in order, so every
    later weight, and so every variant's starting point, stays the same."""
    if cfg.dense_bias and not out_bias:
        rngs.params()


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, out_bias: bool = True):
        d = cfg.d_model
        self.cfg = cfg
        self.qkv = nnx.Linear(d, 3 * d, dtype=dtype, kernel_init=INIT, use_bias=cfg.dense_bias, rngs=rngs)
        self.proj = nnx.Linear(d, d, dtype=dtype, kernel_init=INIT, use_bias=cfg.dense_bias and out_bias, rngs=rngs)
        skip_bias_key(cfg, out_bias, rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.cfg.heads
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, d // h), 3, axis=2)
        if self.cfg.rope:
            q, k = rotary(q), rotary(k)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=self.cfg.causal,
                                         implementation=self.cfg.attention)
        return self.proj(o.reshape(b, t, d))


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, out_bias: bool = True):
        d, f = cfg.d_model, cfg.hidden
        self.up = nnx.Linear(d, f, dtype=dtype, kernel_init=INIT, use_bias=cfg.dense_bias, rngs=rngs)
        self.gate = (nnx.Linear(d, f, dtype=dtype, kernel_init=INIT, use_bias=cfg.dense_bias, rngs=rngs)
                     if cfg.mlp == "swiglu" else None)
        self.down = nnx.Linear(f, d, dtype=dtype, kernel_init=INIT, use_bias=cfg.dense_bias and out_bias, rngs=rngs)
        skip_bias_key(cfg, out_bias, rngs)

    def __call__(self, x):
        if self.gate is not None:
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
        return self.down(jax.nn.gelu(self.up(x)))  # linen's nn.gelu


class Transformer(nnx.Module):
    """inputs (tokens, or vit patches) -> logits; `add_norm` is the variant's nnx module class;
    x_bias as in models_linen.Transformer."""

    def __init__(self, cfg: ModelConfig, add_norm: Callable[..., nnx.Module], dtype, rngs: nnx.Rngs,
                 x_bias: bool = False):
        self.cfg, self.dtype = cfg, dtype
        d = cfg.d_model
        if cfg.name == "vit":
            self.patch_embed = nnx.Linear(cfg.patch_dim, d, dtype=dtype, kernel_init=INIT, rngs=rngs)
            self.cls = nnx.Param(INIT(rngs.params(), (1, 1, d)))
        else:
            self.embed = nnx.Embed(cfg.vocab, d, dtype=dtype, embedding_init=INIT, rngs=rngs)
        self.head = (nnx.Linear(d, cfg.classes, dtype=dtype, kernel_init=INIT, rngs=rngs)
                     if cfg.name == "vit" else None if cfg.tied_head else
                     nnx.Linear(d, cfg.vocab, dtype=dtype, kernel_init=INIT, use_bias=False, rngs=rngs))
        self.pos = None if cfg.rope else nnx.Param(INIT(rngs.params(), (cfg.seq, d)))
        fb = cfg.dense_bias and x_bias   # the projections' biases move into the add & norms
        self.attn = nnx.List([Attention(cfg, dtype, rngs, out_bias=not fb) for _ in range(cfg.layers)])
        self.mlp = nnx.List([Mlp(cfg, dtype, rngs, out_bias=not fb) for _ in range(cfg.layers)])
        # norm 0 (the embeddings') has no projection in front of it
        kw = {"offset": cfg.offset} if cfg.norm == "rmsnorm" else {}
        self.norms = nnx.List([add_norm(d, dtype=dtype, epsilon=cfg.epsilon, rngs=rngs, **kw,
                                        **({"x_bias": True} if fb and i > 0 else {}))
                               for i in range(2 * cfg.layers + 1)])

    def norm(self, i, x, residual=None):
        with jax.named_scope(LN_SCOPE):
            return self.norms[i](x, residual)

    def __call__(self, inputs):
        cfg, dt = self.cfg, self.dtype
        if cfg.name == "vit":
            x = self.patch_embed(inputs)
            cls = jnp.broadcast_to(self.cls[...].astype(dt), (x.shape[0], 1, cfg.d_model))
            x = jnp.concatenate([cls, x], axis=1)
        else:
            x = self.embed(inputs)
        if self.pos is not None:
            x = x + self.pos[...].astype(dt)
        if cfg.pre_ln:  # s: the residual stream; y: the LayerNorm of it, the next layer's input
            y, s = self.norm(0, x)
            for i in range(cfg.layers):
                y, s = self.norm(2 * i + 1, self.attn[i](y), s)
                y, s = self.norm(2 * i + 2, self.mlp[i](y), s)  # the last: the final LN
        else:  # post-LN: the stream is the LayerNorm's output
            y, _ = self.norm(0, x)
            for i in range(cfg.layers):
                y, _ = self.norm(2 * i + 1, self.attn[i](y), y)
                y, _ = self.norm(2 * i + 2, self.mlp[i](y), y)
        if self.head is None:
            return self.embed.attend(y)  # the head tied to the token embedding
        return self.head(y[:, 0] if cfg.name == "vit" else y)
