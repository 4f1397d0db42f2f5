"""jit(grad) of each norm, the package's default path against the jnp reference differentiated by
JAX, timed as a user's training code calls it: ``python -m benchmarks.grad_time``.

The question it answers: does the default (jax_lnbwd/dispatch.py: jnp on the CPU, the measured
crossovers on CUDA) cost anything against plain jnp? It times whole calls of one jitted gradient
(host dispatch included: that is what a CPU user pays), the two functions interleaved round by
round so that drift falls on both, and reports the median per-round ratio jnp / default (> 1:
the default is faster). The kernel bench (benchmarks/kernels) owns kernel-level timings; this is
the whole-function view, meaningful on the CPU where there are no kernels of ours by default.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jax_lnbwd
from jax_lnbwd import reference

CASES = (("layernorm", (4096, 1024), "float32"), ("rmsnorm", (4096, 1024), "float32"),
         ("layernorm", (256, 768), "bfloat16"), ("rmsnorm", (256, 768), "bfloat16"))


def _pair(norm: str, shape, dtype):
    """(default, jnp) gradient functions and their arguments: d/d(x, weight[, bias]) of sum(y * r)."""
    keys = jax.random.split(jax.random.key(0), 4)
    x, r = (jax.random.normal(k, shape, dtype) for k in keys[:2])
    w = (1 + 0.1 * jax.random.normal(keys[2], shape[-1:], jnp.float32)).astype(dtype)
    b = (0.1 * jax.random.normal(keys[3], shape[-1:], jnp.float32)).astype(dtype)
    if norm == "layernorm":
        ours, ref, args = (lambda x, w, b: jax_lnbwd.layernorm(x, w, b)), \
            (lambda x, w, b: reference.layernorm(x, w, b, 1e-5)), (x, w, b)
    else:
        ours, ref, args = (lambda x, w: jax_lnbwd.rmsnorm(x, w)), (lambda x, w: reference.rmsnorm(x, w, 1e-6)), (x, w)
    argnums = tuple(range(len(args)))

    def grad(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum((f(*a) * r).astype(jnp.float32)), argnums=argnums))
    return grad(ours), grad(ref), args


def _time(fn, args, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.grad_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=21, help="interleaved rounds (default 21)")
    p.add_argument("--round-ms", type=float, default=200.0, help="each function's time per round (default 200)")
    a = p.parse_args(argv)
    print(f"jit(grad) on {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}: "
          f"{a.rounds} interleaved rounds; ratio = jnp / default per round, median [min-max]")
    print(f"{'norm':10} {'shape':>10} {'dtype':9} {'default µs':>11} {'jnp µs':>9}  ratio")
    for norm, shape, dtype in CASES:
        ours, ref, args = _pair(norm, shape, dtype)
        for f in (ours, ref):
            jax.block_until_ready(f(*args))
        calls = max(1, int(a.round_ms / 1e3 / max(_time(ref, args, 3), 1e-6)))
        t_ours, t_ref = [], []
        for i in range(a.rounds):
            for f, ts in ((ours, t_ours), (ref, t_ref)) if i % 2 == 0 else ((ref, t_ref), (ours, t_ours)):
                ts.append(_time(f, args, calls))
        ratios = [r / o for o, r in zip(t_ours, t_ref)]
        print(f"{norm:10} {'x'.join(map(str, shape)):>10} {dtype:9} {statistics.median(t_ours) * 1e6:11.0f} "
              f"{statistics.median(t_ref) * 1e6:9.0f}  {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
