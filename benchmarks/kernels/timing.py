"""How the kernel bench validates and times one op: inputs, the reference, the chained steps.

The method is described in benchmarks/kernels/__init__.py (``python -m benchmarks.kernels --help``).
"""
from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_lnbwd import layernorm_bwd, layernorm_fwd, reference

# Norm-wise relative error allowed against the float32 (float64) reference; kernels with
# precise=False get 10x this for dweight and dbias.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 2e-2, "float16": 5e-3}
EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# Inputs, reference, validation


def make_inputs(rows: int, C: int, dtype: str, key):
    """Random (dy, x, w, b, mean, rstd) for one (shape, dtype); mean/rstd from layernorm_fwd."""
    kx, kdy, kw, kb = jax.random.split(key, 4)
    x = jax.random.normal(kx, (rows, C), dtype)
    dy = jax.random.normal(kdy, (rows, C), dtype)
    w = (1 + 0.1 * jax.random.normal(kw, (C,), jnp.float32)).astype(dtype)
    b = jax.random.normal(kb, (C,), dtype)
    _, mean, rstd = jax.jit(lambda x, w, b: layernorm_fwd(x, w, b, eps=EPS))(x, w, b)
    return dy, x, w, b, mean, rstd


def reference_grads(dy, x, w, mean, rstd):
    """(dx, dweight, dbias) from the jnp reference on upcast inputs, as float64 numpy."""
    acc = reference.acc_dtype(x.dtype)
    out = jax.jit(reference.layernorm_bwd)(dy.astype(acc), x.astype(acc), w.astype(acc), mean, rstd)
    return [np.asarray(o, np.float64) for o in out]


def to_f64(a) -> np.ndarray:
    """A JAX array or a torch tensor as a float64 numpy array."""
    if hasattr(a, "detach"):  # torch
        return a.detach().double().cpu().numpy()
    return np.asarray(a).astype(np.float64)


def rel_err(out, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (the absolute error if ref is 0); NaN stays NaN."""
    o = to_f64(out).reshape(ref.shape)
    denom = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(o - ref))
    return num / denom if denom > 0 else num


def json_safe(errs: dict) -> dict:
    """Errors with NaN/inf as strings, so bench.json stays strict JSON."""
    return {n: e if math.isfinite(e) else str(e) for n, e in errs.items()}


def validate(outs, ref, dtype: str, precise: bool = True):
    """(ok, {name: error}) for outs = (dx, dweight, dbias). `not e <= tol` fails NaN too."""
    errs, ok = {}, True
    for name, o, r in zip(("dx", "dweight", "dbias"), outs, ref):
        tol = TOLERANCE[dtype] * (10 if name != "dx" and not precise else 1)
        errs[name] = rel_err(o, r)
        ok = ok and errs[name] <= tol
    return ok, errs


# ---------------------------------------------------------------------------------------------
# The chained steps. Each maps (state, *consts) -> new state, state = (dy, dweight, dbias).


def ours_step(kernel: int, block_size: int):
    def step(state, x, w, b, mean, rstd):
        return layernorm_bwd(state[0], x, w, mean, rstd, kernel=kernel, block_size=block_size)
    return step


def xla_step(state, x, w, b, mean, rstd):
    return reference.layernorm_bwd(state[0], x, w, mean, rstd)


def autodiff_step(state, x, w, b, mean, rstd):
    _, vjp = jax.vjp(lambda x, w, b: reference.layernorm(x, w, b, EPS), x, w, b)
    return vjp(state[0])  # the statistics are recomputed from x inside every step


def copy_step(state, *consts):
    return (jnp.bitwise_not(state[0]),)  # read bytes/2, write bytes/2


def time_jax(step, state, consts, k: int, reps: int, min_run_s: float) -> float:
    """Median seconds per step of `step` chained k times inside one jitted function."""
    def chain(state, consts):
        kept = []
        for _ in range(k):  # unrolled in the HLO: no while-loop overhead between steps
            # The barrier makes this step's outputs and the inputs opaque to XLA, so step i+1
            # can be neither fused with, nor CSE'd against, nor hoisted out of, step i.
            state, consts = jax.lax.optimization_barrier((step(state, *consts), consts))
            kept += state[1:]
        # XLA drops barrier outputs that nothing reads, so every step's dweight and dbias leave
        # as an output (one small stacking copy per call) or XLA would skip computing them.
        return state, (jnp.stack(kept) if kept else None)
    fn = jax.jit(chain)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(state, consts)  # asynchronous: returns before the device is done
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    run(1)  # compile and warm up
    n = calls_per_run(run, min_run_s)
    return statistics.median(run(n) / (n * k) for _ in range(reps))


def calls_per_run(run, min_run_s: float) -> int:
    """The number of calls n for which run(n) (seconds) lasts at least min_run_s, found by
    growing n. A run has a fixed cost besides its calls (the first dispatch, the final sync):
    on the H200 a 50-step chain of 1024x768 took 1.96 ms in run(1), so n scaled from run(1)
    alone was 11, runs lasted 4 ms instead of 20, and the fixed cost added 0.8 us to each 7 us
    step (7.83 us a step at n = 11, 7.24 at 50, 7.05 at 200)."""
    n = 1
    while (t := run(n)) < min_run_s:
        n = max(n + 1, min(10 * n, math.ceil(1.2 * n * min_run_s / max(t, 1e-9))))
    return n


def traffic_bytes(rows: int, C: int, dtype: str) -> int:
    item = jnp.dtype(dtype).itemsize
    return (3 * rows * C + 3 * C) * item + 2 * rows * reference.acc_dtype(dtype).itemsize
