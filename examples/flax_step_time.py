"""Time a Flax transformer's jitted train step with Flax's LayerNorm and with jax_lnbwd's.

For measurements use ``python -m benchmarks.e2e`` (GPT-, BERT- and ViT-style models in linen and
nnx, interleaved rounds, a kernel trace attributed to layernorm). This script stays as the
small model that tests/flax/test_flax.py trains to compare the two LayerNorms' loss curves.

    python examples/flax_step_time.py            # H200-sized: batch 16, seq 1024, d_model 1600, bf16
    python examples/flax_step_time.py --small    # a few seconds on a CPU

The model is a small pre-LN transformer: token embedding, `--layers` residual blocks (each
LayerNorm -> causal token mixer, and LayerNorm -> MLP), a final LayerNorm and a head, trained
with optax's adam on next-token cross-entropy. The token mixer is a gated causal mean (each
position mixes the mean of the positions up to it): it mixes tokens like attention but costs
O(seq), so that the step is made of matmuls and the elementwise work around them, layernorms
included, rather than of a softmax over seq² scores.

Both variants start from the same parameters (the same seed: the parameter trees are
identical) and train on the same fixed batch. For each, the train step is compiled, run
`--warmup` times, then timed `--steps` times, one step at a time up to
jax.block_until_ready; the median is printed, with the loss after the last step (both runs
should agree to the compute dtype's precision). The compute dtype is `--dtype` (params stay
float32, as in mixed-precision training).

tests/flax/test_flax.py trains this model, --small, for 20 steps with each LayerNorm and checks
that parameters and losses match and that our custom call is in the compiled step.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jax_lnbwd
from jax_lnbwd.flax import LayerNorm as LnbwdLayerNorm


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 16
    seq: int = 1024
    d_model: int = 1600
    layers: int = 2
    mlp_ratio: int = 4
    vocab: int = 1024
    dtype: str = "bfloat16"


SMALL = Config(batch=4, seq=16, d_model=64, layers=2, mlp_ratio=4, vocab=64, dtype="float32")


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


def time_steps(cfg: Config, norm: type, warmup: int, steps: int):
    """(median seconds per step, loss after the last step) of the train step with `norm`."""
    model, params = init(cfg, norm)
    tx = optimizer()
    opt_state, batch = tx.init(params), tokens(cfg)
    train_step = make_train_step(model, tx)
    for _ in range(warmup):  # the first call compiles
        params, opt_state, loss = jax.block_until_ready(train_step(params, opt_state, batch))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(train_step(params, opt_state, batch))
        times.append(time.perf_counter() - start)
    return statistics.median(times), float(loss)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help=f"a CPU-sized model: {SMALL}")
    for field in dataclasses.fields(Config):
        parser.add_argument("--" + field.name.replace("_", "-"), type=str if field.name == "dtype" else int,
                            help=f"default {field.default} ({SMALL.__dict__[field.name]} with --small)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    opts = parser.parse_args()
    cfg = dataclasses.replace(SMALL if opts.small else Config(), **{
        f.name: getattr(opts, f.name) for f in dataclasses.fields(Config) if getattr(opts, f.name) is not None})
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"jax_lnbwd kernel {jax_lnbwd.DEFAULT_KERNEL}")
    print(f"model: {cfg}, adam, {cfg.batch * cfg.seq} tokens per step; "
          f"{cfg.layers * 2 + 1} LayerNorms over {cfg.d_model} features")
    results = {}
    for name, norm in (("flax.linen.LayerNorm", nn.LayerNorm), ("jax_lnbwd.flax.LayerNorm", LnbwdLayerNorm)):
        results[name] = time_steps(cfg, norm, opts.warmup, opts.steps)
        seconds, loss = results[name]
        print(f"{name:26s} {seconds * 1e3:9.3f} ms/step (median of {opts.steps})   loss after "
              f"{opts.warmup + opts.steps} steps {loss:.5f}")
    (flax_s, _), (ours_s, _) = results.values()
    print(f"speed-up {flax_s / ours_s:.3f}x ({(flax_s - ours_s) * 1e3:+.3f} ms/step saved)")


if __name__ == "__main__":
    main()
