"""The public-style decoders (config.py: public_llama, public_gemma) in flax.nnx: the same models
as models_public_linen.py, op for op (its docstring says what they are and why they exist).

The modules are made in the order a step reads them (the embedding; per layer the input norm,
q, k, v, the QK-norm where the model has one, o, the post-attention norm, gate, up, down; the
final norm; the head): nnx draws the parameter keys from one stream in that order, and every
variant's norm draws one key (as nnx.RMSNorm does; a QK-norm two, one for each of its
RMSNorms), so the variants of a model start from the same weights.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .models_linen import LN_SCOPE
from .models_nnx import INIT
from .models_public_linen import QK_SCOPE, activation, apply_rotary, attend, gather_rotary


def linear(n_in: int, n_out: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, kernel_init=INIT, rngs=rngs)


class PublicAttention(nnx.Module):
    """qk_norm: the QK-norm module (variants_rms.qk_norm_module), or None: none."""
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, qk_norm: Callable[..., nnx.Module] | None = None):
        d = cfg.d_model
        self.cfg, self.dtype = cfg, dtype
        self.q_proj, self.k_proj, self.v_proj = (linear(d, d, dtype, rngs) for _ in range(3))
        self.qk_norm = None if qk_norm is None else qk_norm(d // cfg.heads, dtype=dtype, epsilon=cfg.epsilon,
                                                            offset=cfg.offset, rngs=rngs)
        self.o_proj = linear(d, d, dtype, rngs)

    def __call__(self, x, position_ids):
        cfg, dt = self.cfg, self.dtype
        b, t, d = x.shape
        h = cfg.heads
        q, k, v = (proj(x).reshape(b, t, h, d // h) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm is not None:
            with jax.named_scope(QK_SCOPE):
                q, k = self.qk_norm(q, k)
        sin, cos = gather_rotary(cfg, position_ids)
        q, k = apply_rotary(q, sin, cos, dt), apply_rotary(k, sin, cos, dt)
        return self.o_proj(attend(q, k, v, dt).reshape(b, t, d))


class PublicMlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.hidden
        self.cfg = cfg
        self.gate_proj = linear(d, f, dtype, rngs)
        self.up_proj = linear(d, f, dtype, rngs)
        self.down_proj = linear(f, d, dtype, rngs)

    def __call__(self, x):
        act = activation(self.cfg)
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


def add_and_norm(norm: nnx.Module, x, residual):
    """models_public_linen.add_and_norm: the variant's add & norm under jax.named_scope(LN_SCOPE)."""
    with jax.named_scope(LN_SCOPE):
        return norm(x, residual)


class PublicDecoderLayer(nnx.Module):
    """models_public_linen.PublicDecoderLayer: (x, residual) -> (the MLP's output, residual)."""

    def __init__(self, cfg: ModelConfig, add_norm: Callable[..., nnx.Module], dtype, rngs: nnx.Rngs,
                 qk_norm: Callable[..., nnx.Module] | None = None):
        def norm():
            return add_norm(cfg.d_model, dtype=dtype, epsilon=cfg.epsilon, offset=cfg.offset, rngs=rngs)
        self.input_norm = norm()
        self.self_attn = PublicAttention(cfg, dtype, rngs, qk_norm)
        self.post_attention_norm = norm()
        self.mlp = PublicMlp(cfg, dtype, rngs)

    def __call__(self, x, residual, position_ids):
        y, residual = add_and_norm(self.input_norm, x, residual)
        x = self.self_attn(y, position_ids)
        y, residual = add_and_norm(self.post_attention_norm, x, residual)
        return self.mlp(y), residual


class PublicDecoder(nnx.Module):
    """tokens -> logits, the public-style decoder; `add_norm` is the variant's nnx module class,
    `qk_norm` its QK-norm module where cfg.qk_norm (None: no QK-norm)."""

    def __init__(self, cfg: ModelConfig, add_norm: Callable[..., nnx.Module], dtype, rngs: nnx.Rngs,
                 qk_norm: Callable[..., nnx.Module] | None = None):
        self.cfg, self.dtype = cfg, dtype
        d = cfg.d_model
        self.embed_tokens = nnx.Embed(cfg.vocab, d, dtype=dtype, embedding_init=INIT, rngs=rngs)
        self.layers = nnx.List([PublicDecoderLayer(cfg, add_norm, dtype, rngs, qk_norm) for _ in range(cfg.layers)])
        self.norm = add_norm(d, dtype=dtype, epsilon=cfg.epsilon, offset=cfg.offset, rngs=rngs)
        self.lm_head = None if cfg.tied_head else linear(d, cfg.vocab, dtype, rngs)

    def __call__(self, tokens):
        cfg, dt = self.cfg, self.dtype
        x = self.embed_tokens(tokens)
        if cfg.embed_scale:  # Gemma
            x = x * jnp.asarray(math.sqrt(cfg.d_model), dt)
        b, t = tokens.shape
        position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, position_ids)
        y, _ = add_and_norm(self.norm, x, residual)
        if self.lm_head is None:  # Gemma: tied to the embedding
            return self.embed_tokens.attend(y)
        return self.lm_head(y)
