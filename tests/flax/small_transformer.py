"""The small transformer tests/flax/test_flax.py trains with Flax's LayerNorm and with ours.

A pre-LN transformer: token embedding, `layers` residual blocks (each LayerNorm -> causal token
mixer, and LayerNorm -> MLP), a final LayerNorm and a head, trained with optax's adam on
next-token cross-entropy over one fixed batch. The token mixer is a gated causal mean (each
position mixes the mean of the positions up to it): it mixes tokens like attention but costs
O(seq), so that the step is made of matmuls and the elementwise work around them, layernorms
included. Equal seeds give equal parameters whichever LayerNorm class the model is built with.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 4
    seq: int = 16
    d_model: int = 64
    layers: int = 2
    mlp_ratio: int = 4
    vocab: int = 64
    dtype: str = "float32"


class CausalMix(nn.Module):
    """out = W_o (sigmoid(W_g x) * causal_mean(W_v x)): an attention-like token mixer."""
    dtype: Any

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        value = nn.Dense(d, dtype=self.dtype, name="value")(x)
        gate = nn.Dense(d, dtype=self.dtype, name="gate")(x)
        positions = jnp.arange(1, x.shape[-2] + 1, dtype=jnp.float32)[:, None]
        mean = (jnp.cumsum(value.astype(jnp.float32), axis=-2) / positions).astype(self.dtype)
        return nn.Dense(d, dtype=self.dtype, name="out")(jax.nn.sigmoid(gate) * mean)


class Block(nn.Module):
    norm: type  # flax.linen.LayerNorm or jax_lnbwd.flax.LayerNorm
    mlp_ratio: int
    dtype: Any

    @nn.compact
    def __call__(self, h):
        d = h.shape[-1]
        h = h + CausalMix(self.dtype)(self.norm(dtype=self.dtype)(h))
        m = nn.Dense(self.mlp_ratio * d, dtype=self.dtype)(self.norm(dtype=self.dtype)(h))
        return h + nn.Dense(d, dtype=self.dtype)(nn.gelu(m))


class Model(nn.Module):
    cfg: Config
    norm: type

    @nn.compact
    def __call__(self, tokens):
        dtype = jnp.dtype(self.cfg.dtype)
        h = nn.Embed(self.cfg.vocab, self.cfg.d_model, dtype=dtype)(tokens)
        for _ in range(self.cfg.layers):
            h = Block(self.norm, self.cfg.mlp_ratio, dtype)(h)
        return nn.Dense(self.cfg.vocab, dtype=dtype)(self.norm(dtype=dtype)(h))


def tokens(cfg: Config, seed: int = 0):
    """A fixed batch of random tokens, (batch, seq + 1): inputs and next-token targets."""
    return jax.random.randint(jax.random.key(seed), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)


def init(cfg: Config, norm: type, seed: int = 0):
    """(model, float32 params) for this LayerNorm class; equal seeds give equal params."""
    model = Model(cfg, norm)
    return model, model.init(jax.random.key(seed), tokens(cfg)[:, :-1])["params"]


def make_train_step(model, optimizer):
    """jit((params, opt_state, tokens) -> (params, opt_state, loss)): one adam step."""
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def optimizer():
    return optax.adam(1e-3)
