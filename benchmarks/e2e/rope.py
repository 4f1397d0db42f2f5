"""Rotary position embeddings (Llama's, rotate-half form), for the models with cfg.rope."""
from __future__ import annotations

import jax.numpy as jnp

BASE = 10000.0


def rotary(x):
    """x (batch, seq, heads, head_dim) with each head's pairs (i, i + head_dim/2) rotated by
    position * BASE^(-2i/head_dim); the angles in float32, the rotation in x's dtype."""
    t, half = x.shape[1], x.shape[-1] // 2
    freq = BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq          # (seq, half)
    cos, sin = (f(angle).astype(x.dtype)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
