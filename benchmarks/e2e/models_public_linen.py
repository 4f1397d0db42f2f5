"""The public-style decoders (config.py: public_llama, public_gemma) in flax.linen.

Why they exist: the bench's own llama (models_linen.py) is written the project's way, a fused
qkv projection, rotary angles computed from an iota, jax.nn.dot_product_attention, norms whose
output is in the compute dtype. Users' public Flax Llama and Gemma code is built differently,
and XLA fuses differently around our custom calls in such a graph: a float32 norm output feeding
the projections, the rotary sin and cos gathered from a float32 table (so q and k are rotated in
float32), attention scores and a float32 softmax written out as einsums. These models are our
own code with that structure, so that a step is measured the way such a model would run:

  embed       nn.Embed in the compute dtype; Gemma: times sqrt(d_model), cast to the compute dtype
  positions   jnp.broadcast_to(jnp.arange(seq), (batch, seq)), made inside the model
  rotary      sin and cos tables, float32 (max positions = seq, head_dim), gathered at the
              position ids in each attention layer; x * cos + rotate_half(x) * sin is float32
              (promoted by the table) and cast back to the compute dtype, for q and k
  attention   separate q, k, v, o projections (no bias); scores = q.k / sqrt(head_dim) as an
              einsum, a causal jnp.where with the dtype's most negative value, softmax in
              float32, cast back, an einsum with v
  QK-norm     (config.ModelConfig.qk_norm, --qk-norm; Qwen3's) q and k, reshaped to heads, each
              RMS-normalized over head_dim by the variant's QK-norm module (submodule qk_norm,
              scales of shape (head_dim,), output in the compute dtype) before rotary, under
              jax.named_scope(QK_SCOPE): not LN_SCOPE, so the "ln" columns and the byte floor
              still count the add & norms alone
  MLP         down(act(gate(x)) * up(x)), separate projections, no bias; act: silu (Llama) or
              tanh-approximated GELU (Gemma); hidden width config.llama_hidden(d_model)
  layer       residual = h; h = attn(input_norm(h)); h = residual + h; residual = h;
              h = mlp(post_attention_norm(h)); h = residual + h
  head        a final norm, then an untied Dense (Llama) or the embedding's transpose (Gemma)

Every norm, with the residual add in front of it, is the variant's add & norm called under
jax.named_scope(LN_SCOPE), as models_linen.Transformer calls it: `y, s = norm(x, residual)`
returns the norm of s = x + residual and s, so the layer's two residual adds are the ones the
add & norms make (the first norm's residual is None). Its baseline variant is public_rmsnorm
(variants_rms.py), the norm as public code writes it, whose output is float32.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .config import GATED, ModelConfig
from .models_linen import INIT, LN_SCOPE

ROPE_BASE = 10000.0
QK_SCOPE = "e2e_qk_norm"  # the name scope around the QK-norm, in both APIs


def rotary_tables(positions: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(sin, cos), float32 numpy arrays of shape (positions, head_dim): the angle of position p
    at column i is p / ROPE_BASE^(2 (i mod head_dim/2) / head_dim), each frequency twice (once
    for each half that rotate_half pairs). Computed in float64, stored as float32."""
    inv_freq = 1.0 / ROPE_BASE ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.sin(emb).astype(np.float32), np.cos(emb).astype(np.float32)


def rotate_half(x):
    """(x1, x2) -> (-x2, x1) over the halves of the last axis."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def gather_rotary(cfg: ModelConfig, position_ids):
    """sin and cos at the position ids: float32, (batch, seq, 1, head_dim)."""
    sin, cos = rotary_tables(cfg.seq, cfg.d_model // cfg.heads)
    return tuple(jnp.asarray(table)[position_ids][:, :, None, :] for table in (sin, cos))


def apply_rotary(x, sin, cos, dtype):
    """x * cos + rotate_half(x) * sin: float32 (the tables promote x), cast back to dtype."""
    return (x * cos + rotate_half(x) * sin).astype(dtype)


def attend(q, k, v, dtype):
    """Causal attention written out: (batch, seq, heads, head_dim) each -> the same shape."""
    t, head_dim = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.asarray(math.sqrt(head_dim), dtype)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def activation(cfg: ModelConfig) -> Callable:
    """The gated MLP's activation: silu (swiglu, Llama) or tanh-approximated GELU (geglu, Gemma)."""
    if cfg.mlp not in GATED:
        raise ValueError(f"{cfg.name}: a public-style model takes mlp {' or '.join(GATED)}, not {cfg.mlp!r}")
    return jax.nn.silu if cfg.mlp == "swiglu" else lambda g: jax.nn.gelu(g, approximate=True)


def dense(features: int, dtype, name: str) -> nn.Dense:
    return nn.Dense(features, dtype=dtype, use_bias=False, kernel_init=INIT, name=name)


class PublicAttention(nn.Module):
    cfg: ModelConfig
    dtype: Any
    qk_norm: Callable[..., nn.Module] | None = None  # the QK-norm module (variants_rms.qk_norm_module), or none

    @nn.compact
    def __call__(self, x, position_ids):
        cfg, dt = self.cfg, self.dtype
        b, t, d = x.shape
        h = cfg.heads
        q, k, v = (dense(d, dt, name)(x).reshape(b, t, h, d // h) for name in ("q_proj", "k_proj", "v_proj"))
        if self.qk_norm is not None:
            with jax.named_scope(QK_SCOPE):
                q, k = self.qk_norm(dtype=dt, epsilon=cfg.epsilon, offset=cfg.offset, name="qk_norm")(q, k)
        sin, cos = gather_rotary(cfg, position_ids)
        q, k = apply_rotary(q, sin, cos, dt), apply_rotary(k, sin, cos, dt)
        return dense(d, dt, "o_proj")(attend(q, k, v, dt).reshape(b, t, d))


class PublicMlp(nn.Module):
    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg, dt = self.cfg, self.dtype
        act = activation(cfg)
        up = dense(cfg.hidden, dt, "up_proj")(x)
        return dense(cfg.d_model, dt, "down_proj")(act(dense(cfg.hidden, dt, "gate_proj")(x)) * up)


def add_and_norm(add_norm: Callable[..., nn.Module], cfg: ModelConfig, dtype, name: str, x, residual):
    """The variant's add & norm `name`, as models_linen.Transformer.norm calls it: (the norm of
    s = x + residual, s), under jax.named_scope(LN_SCOPE); residual None: (the norm of x, x)."""
    with jax.named_scope(LN_SCOPE):
        return add_norm(dtype=dtype, epsilon=cfg.epsilon, offset=cfg.offset, name=name)(x, residual)


class PublicDecoderLayer(nn.Module):
    """(x, residual) -> (the MLP's output, residual): the attention's residual add is the input
    norm's (with the previous layer's MLP output), the MLP's the post-attention norm's."""
    cfg: ModelConfig
    add_norm: Callable[..., nn.Module]
    dtype: Any
    qk_norm: Callable[..., nn.Module] | None = None

    @nn.compact
    def __call__(self, x, residual, position_ids):
        cfg, dt = self.cfg, self.dtype
        y, residual = add_and_norm(self.add_norm, cfg, dt, "input_norm", x, residual)
        x = PublicAttention(cfg, dt, self.qk_norm, name="self_attn")(y, position_ids)
        y, residual = add_and_norm(self.add_norm, cfg, dt, "post_attention_norm", x, residual)
        return PublicMlp(cfg, dt, name="mlp")(y), residual


class PublicDecoder(nn.Module):
    """tokens -> logits, the public-style decoder (the module doc); `add_norm` is the variant's
    linen module, `qk_norm` its QK-norm module where cfg.qk_norm (None: no QK-norm)."""
    cfg: ModelConfig
    add_norm: Callable[..., nn.Module]
    dtype: Any
    qk_norm: Callable[..., nn.Module] | None = None

    @nn.compact
    def __call__(self, tokens):
        cfg, dt = self.cfg, self.dtype
        embed = nn.Embed(cfg.vocab, cfg.d_model, dtype=dt, embedding_init=INIT, name="embed_tokens")
        x = embed(tokens)
        if cfg.embed_scale:  # Gemma
            x = x * jnp.asarray(math.sqrt(cfg.d_model), dt)
        b, t = tokens.shape
        position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        residual = None
        for i in range(cfg.layers):
            x, residual = PublicDecoderLayer(cfg, self.add_norm, dt, self.qk_norm, name=f"layers_{i}")(
                x, residual, position_ids)
        y, _ = add_and_norm(self.add_norm, cfg, dt, "norm", x, residual)
        if cfg.tied_head:  # Gemma
            return embed.attend(y)
        return dense(cfg.vocab, dt, "lm_head")(y)
