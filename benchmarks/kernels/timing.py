"""How the kernel bench validates and times one op: tolerances, validation, the chained steps.

The method is described in benchmarks/kernels/__init__.py (``python -m benchmarks.kernels --help``);
each op's inputs, reference and steps are in ops.py.
"""
from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

# Norm-wise relative error allowed against the float32 (float64) reference; an Impl's tol
# factors scale it per output (10 for a backward kernel's dweight/dbias with precise=False,
# 0 for add_layernorm's s, which must equal jnp's x + residual bit for bit).
TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 2e-2, "float16": 5e-3}
EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# Validation


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


def validate(outs, ref, dtype: str, names, tol: dict | None = None):
    """(ok, {name: error}) for an op's outputs against its float64 reference; tol: a factor
    per output name (default 1). `not e <= tol` fails NaN too."""
    errs, ok = {}, True
    for name, o, r in zip(names, outs, ref):
        errs[name] = rel_err(o, r)
        ok = ok and errs[name] <= TOLERANCE[dtype] * (tol or {}).get(name, 1)
    return ok, errs


# ---------------------------------------------------------------------------------------------
# The chained steps. Each maps (state, *consts) -> outputs; outputs[0] is the next state.


def copy_step(words):
    """The copy peer: a bitwise NOT of uint32 words (copy_words()): a real read + write pass
    (a plain copy or ``x * 1`` could be elided by XLA)."""
    return (jnp.bitwise_not(words),)


def copy_words(nbytes: int):
    """The copy peer's input for an op that moves nbytes: nbytes/8 uint32 words, so that one
    step reads nbytes/2 and writes nbytes/2, one pass over the op's bytes at copy speed."""
    return jnp.zeros((max(1, nbytes // 8),), jnp.uint32)


def chained(step, k: int, carry: int = 1):
    """The jitted chain of k calls of `step`, unrolled: (state, consts) -> ((the last state, the
    last carried outputs), every step's other outputs). The first `carry` outputs of a step are
    the next step's first inputs (its state, then its first consts: an add op's y and s become the
    next x and residual, a residual stream; a qk op's q_out and k_out the next q and k)."""
    def chain(state, consts):
        kept = []
        for _ in range(k):  # unrolled in the HLO: no while-loop overhead between steps
            # The barrier makes this step's outputs and the inputs opaque to XLA, so step i+1
            # can be neither fused with, nor CSE'd against, nor hoisted out of, step i.
            outs, consts = jax.lax.optimization_barrier((step(state, *consts), consts))
            state, consts = outs[0], (*outs[1:carry], *consts[carry - 1:])
            kept += outs[carry:]
        # XLA drops barrier outputs that nothing reads, and then the work that only they needed.
        # So the last step's carried outputs leave the chain with the state: else nothing would
        # read a carried chain of its own (a qk op's k: an entry of separate ops for q and k,
        # two calls or XLA's, lost its whole k half), nor the last step's s (the add ops).
        # Every step's other outputs leave it too: stacked when they share a shape (dweight
        # and dbias, mean and rstd: one small copy per call). Each output of the jitted
        # function costs the host microseconds per call, as much as a small step's kernel:
        # hence the stack, and the carried s.
        last = (state, *consts[:carry - 1])
        if len({a.shape for a in kept}) == 1:
            return last, jnp.stack(kept)
        return last, tuple(kept)
    return jax.jit(chain)


def time_jax(step, state, consts, k: int, reps: int, min_run_s: float, carry: int = 1, trace=None) -> float:
    """Median seconds per step of `step` chained k times inside one jitted function (chained:
    the first `carry` outputs of a step are the next step's first inputs). trace: after the
    timing, trace(call) is given a function that runs one call of the same compiled chain and
    waits for it (--kernel-time, kernel_time.py)."""
    fn = chained(step, k, carry)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(state, consts)  # asynchronous: returns before the device is done
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    run(1)  # compile and warm up
    n = calls_per_run(run, min_run_s)
    sec = statistics.median(run(n) / (n * k) for _ in range(reps))
    if trace is not None:
        trace(lambda: jax.block_until_ready(fn(state, consts)))
    return sec


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
