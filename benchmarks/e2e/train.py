"""One variant's training step, compiled, with its state: build it, step it, time it.

A step is optax's adam on float32 parameters, the model computing in `dtype`, the loss
(softmax cross-entropy in float32) averaged over the batch. jit donates the parameters and the
optimizer state, as a training loop does, so a step updates them in place.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import models_linen, models_nnx
from .config import ModelConfig, make_batch
from .variants import Variant


@dataclasses.dataclass
class Run:
    """One (model, api, dtype, variant): the compiled step, its state and what it measured."""
    model: str
    api: str
    dtype: str
    variant: str
    step: Any            # the compiled step: (params, opt_state, batch) -> (params, opt_state, loss)
    state: tuple         # (params, opt_state), replaced after every step (they are donated)
    batch: tuple
    hlo: str             # the compiled step's optimized HLO, for the trace attribution
    compile_s: float
    times: list = dataclasses.field(default_factory=list)  # seconds per step, one per round
    losses: list = dataclasses.field(default_factory=list)  # the last loss of each run_steps
    trace: dict | None = None

    @property
    def label(self) -> str:
        return f"{self.model} {self.api} {self.dtype} {self.variant}"


def init(cfg: ModelConfig, api: str, variant: Variant, dtype, inputs, seed: int):
    """(apply(params, inputs) -> logits, float32 params) for one API and variant."""
    if api == "linen":
        model = models_linen.Transformer(cfg, variant.linen, dtype)
        params = jax.jit(model.init)(jax.random.key(seed), inputs)["params"]
        return (lambda p, x: model.apply({"params": p}, x)), params
    # nnx, in its functional form: the module's state is a pytree that jit and optax take
    # directly, and the module is rebuilt from it inside the traced step (no per-call Python
    # graph traversal, as nnx.jit would add).
    graphdef, params = nnx.split(models_nnx.Transformer(cfg, variant.nnx, dtype, rngs=nnx.Rngs(seed)))
    return (lambda p, x: nnx.merge(graphdef, p)(x)), params


def build(cfg: ModelConfig, api: str, variant: Variant, dtype: str, seed: int = 0,
          learning_rate: float = 1e-4) -> Run:
    """Initializes the variant's model and compiles its training step (not yet run)."""
    batch = make_batch(cfg, dtype, seed)
    apply, params = init(cfg, api, variant, jnp.dtype(dtype), batch[0], seed)
    tx = optax.adam(learning_rate)

    def loss_fn(p, batch):
        logits = apply(p, batch[0]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    def train_step(p, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    opt_state = tx.init(params)
    t0 = time.perf_counter()
    step = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, opt_state, batch).compile()
    return Run(cfg.name, api, dtype, variant.name, step, (params, opt_state), batch, step.as_text(),
               time.perf_counter() - t0)


def run_steps(run: Run, n: int) -> float:
    """Runs n steps back to back, as a training loop does (the host queues step i+1 while the
    GPU runs step i), and returns the seconds from the first dispatch until the last step's
    outputs are ready. The loss of the last step is kept in run.losses."""
    params, opt_state = run.state
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    for _ in range(n):
        params, opt_state, loss = run.step(params, opt_state, run.batch)
    jax.block_until_ready((params, opt_state, loss))
    seconds = time.perf_counter() - t0
    run.state = (params, opt_state)
    run.losses.append(float(loss))
    return seconds
