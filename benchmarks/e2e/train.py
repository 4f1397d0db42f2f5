"""One variant's training step, compiled, with its state: build it, step it, time it.

A step is optax's adam on float32 parameters, the model computing in `dtype`, the loss
(softmax cross-entropy in float32) averaged over the batch. jit donates the parameters and the
optimizer state, as a training loop does, so a step updates them in place.

Data parallel (devices > 1): a 1-D mesh over the first `devices` devices, axis "data". The
batch is sharded along it and the parameters and optimizer state are replicated; jit is given
those shardings for its inputs and outputs, so each device runs the model on its share of the
batch and XLA's SPMD partitioner inserts the all-reduce of the gradients (our LayerNorm's own
dweight/dbias psum comes from its partitioning rule, jax_lnbwd/ops/partition.py). The configured
batch is per device: the global batch is batch * devices, so each device does the work of a
one-device step and the step times compare directly. The loss is the mean over the global batch.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_lnbwd

from . import models_linen, models_nnx, models_public_linen, models_public_nnx, variants_rms
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
    paths: str = ""      # which path the norms took (jax_lnbwd.dispatch), e.g. "forward jnp x13, backward ffi on cuda x13"
    times: list = dataclasses.field(default_factory=list)  # seconds per step, one per round
    losses: list = dataclasses.field(default_factory=list)  # the last loss of each run_steps
    trace: dict | None = None
    devices: int = 1     # data parallel over this many devices (the batch above is global)
    round_steps: int = 0  # steps per timed round (round_steps())
    step_estimate_s: float | None = None  # seconds per step just after the warm-up (probe())

    @property
    def label(self) -> str:
        return f"{self.model} {self.api} {self.dtype} {self.variant}"


def init(cfg: ModelConfig, api: str, variant: Variant, dtype, inputs, seed: int):
    """(apply(params, inputs) -> logits, float32 params) for one API and variant. The model is
    cfg.style's: "own" models_linen / models_nnx.Transformer, "public" models_public_linen /
    models_public_nnx.PublicDecoder (no Dense biases, so no x_bias to move; with cfg.qk_norm the
    variant's QK-norm, variants_rms.qk_norm_module)."""
    public = cfg.style == "public"
    if public and cfg.dense_bias:
        raise ValueError(f"{cfg.name}: the public-style models have no Dense biases (dense_bias=False)")
    if cfg.style not in ("own", "public"):
        raise ValueError(f"{cfg.name}: style {cfg.style!r}, expected 'own' or 'public'")
    if cfg.qk_norm and not public:
        raise ValueError(f"{cfg.name}: QK-norm (qk_norm=True) is an option of the public-style models only")
    qk = variants_rms.qk_norm_module(api, variant.qk_norm) if cfg.qk_norm else None
    if api == "linen":
        model = (models_public_linen.PublicDecoder(cfg, variant.linen, dtype, qk) if public else
                 models_linen.Transformer(cfg, variant.linen, dtype, x_bias=variant.x_bias))
        params = jax.jit(model.init)(jax.random.key(seed), inputs)["params"]
        return (lambda p, x: model.apply({"params": p}, x)), params
    # nnx, in its functional form: the module's state is a pytree that jit and optax take
    # directly, and the module is rebuilt from it inside the traced step (no per-call Python
    # graph traversal, as nnx.jit would add).
    model = (models_public_nnx.PublicDecoder(cfg, variant.nnx, dtype, rngs=nnx.Rngs(seed), qk_norm=qk) if public else
             models_nnx.Transformer(cfg, variant.nnx, dtype, rngs=nnx.Rngs(seed), x_bias=variant.x_bias))
    graphdef, params = nnx.split(model)
    return (lambda p, x: nnx.merge(graphdef, p)(x)), params


def mesh(devices: int) -> Mesh:
    """The data-parallel mesh: the first `devices` devices of the default backend, axis "data"."""
    found = jax.devices()
    if len(found) < devices:
        raise ValueError(f"e2e: {devices} devices asked for, {len(found)} visible "
                         f"({jax.default_backend()}: {', '.join(str(d) for d in found)})")
    # Auto axis: shardings propagate through the step as a user's jit with in/out shardings does
    # (under Explicit axes, shardings in the types, jax_lnbwd would take its jnp forward).
    return Mesh(np.array(found[:devices]), ("data",), axis_types=(AxisType.Auto,))


def build(cfg: ModelConfig, api: str, variant: Variant, dtype: str, seed: int = 0,
          learning_rate: float = 1e-4, devices: int = 1) -> Run:
    """Initializes the variant's model and compiles its training step (not yet run); with
    devices > 1, data parallel over that many devices with cfg.batch examples on each."""
    batch = make_batch(dataclasses.replace(cfg, batch=cfg.batch * devices), dtype, seed)
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
    if devices == 1:
        jitted = jax.jit(train_step, donate_argnums=(0, 1))
    else:  # parameters, optimizer state and loss replicated; the batch split along its first axis
        m = mesh(devices)
        rep, split = NamedSharding(m, P()), NamedSharding(m, P("data"))
        params, opt_state, batch = (jax.device_put(params, rep), jax.device_put(opt_state, rep),
                                    jax.device_put(batch, split))
        jitted = jax.jit(train_step, in_shardings=(rep, rep, split), out_shardings=(rep, rep, rep),
                         donate_argnums=(0, 1))
    jax_lnbwd.dispatch.clear_decisions()
    step = jitted.lower(params, opt_state, batch).compile()
    paths = norm_paths(jax_lnbwd.dispatch.decisions())
    return Run(cfg.name, api, dtype, variant.name, step, (params, opt_state), batch, step.as_text(),
               time.perf_counter() - t0, paths=paths, devices=devices)


def norm_paths(decisions) -> str:
    """What jax_lnbwd's dispatch rule picked for the norms of one compiled step, per direction:
    e.g. "forward jnp x13, backward ffi on cuda x13" (none: the variant has no jax_lnbwd norm)."""
    counts: dict = {}
    for d in decisions:
        key = (d.direction, d.path)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{direction} {path} x{n}" for (direction, path), n in counts.items()) or "none"


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


ROUND_STEPS_CAP = 1000  # steps per round at most, whatever --round-seconds asks (a fast CPU step)
PROBE_STEPS = 3         # untimed steps after the warm-up, twice over, that estimate a step's time


def probe(run: Run, n: int = PROBE_STEPS, repeats: int = 2) -> float:
    """Times `repeats` batches of n more steps (after the warm-up: compiled, allocated, caches
    hot) and keeps the faster batch's mean in run.step_estimate_s, the estimate that sizes the
    rounds (the first batch can still pay for a cold start)."""
    run.step_estimate_s = min(run_steps(run, n) for _ in range(repeats)) / n
    return run.step_estimate_s


def round_steps(step_s: float | None, seconds: float, minimum: int, cap: int = ROUND_STEPS_CAP) -> int:
    """Steps per round so that a round lasts at least `seconds` at `step_s` seconds a step:
    max(minimum, ceil(seconds / step_s)), and no more than max(minimum, cap). No estimate or
    seconds <= 0: minimum."""
    if not step_s or seconds <= 0:
        return minimum
    return max(minimum, min(cap, math.ceil(seconds / step_s)))
