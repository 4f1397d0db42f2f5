"""Timing of the fused layernorm forward against XLA's jnp forward and a same-bytes copy.

    python benchmarks/forward.py                              # default shapes, bf16 and fp32
    python benchmarks/forward.py --shapes 16384x1600,8192x8192 --dtypes bfloat16 --params float32
    python benchmarks/forward.py --json out.json              # also write the rows as JSON

Peers, per shape and dtype (x (rows, C); weight and bias (C,) in --params: "same" = x's dtype,
"float32" = fp32 parameters next to 16-bit x, the mixed-precision setup):
  ours   jax_lnbwd.forward.layernorm_fwd_op: one FFI call, x read once;
  xla    jax_lnbwd.reference.layernorm_fwd jitted: XLA's fusions of the same jnp math;
  copy   a same-bytes pass: bitwise NOT of x's bytes as uint32 (reads and writes rows*C*itemsize
         each, like the forward; a plain copy or x * 1 could be elided by XLA).
Method (the repository's, see DESIGN.md "Timing on the GPU"): one jitted function chains k
steps, each step's y feeding the next, with jax.lax.optimization_barrier between steps so XLA
can neither fuse, CSE nor hoist them; mean and rstd of every step leave as outputs (else XLA
would drop them). Seconds per step = run time / (calls * k), the median over --reps runs of at
least --min-run-s each. GB/s counts the bytes a forward must move: read x, write y.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_lnbwd import reference
from jax_lnbwd.forward import layernorm_fwd_op

EPS = 1e-5


def ours_step(x, w, b):
    return layernorm_fwd_op(x, w, b, EPS)


def xla_step(x, w, b):
    return reference.layernorm_fwd(x, w, b, EPS)


def copy_step(words, w, b):
    return (jnp.bitwise_not(words),)


def time_chain(step, state, consts, k: int, reps: int, min_run_s: float) -> float:
    """Median seconds per step of `step` chained k times inside one jitted function."""
    def chain(state, consts):
        kept = []
        for _ in range(k):   # unrolled: no while-loop overhead between steps
            out = step(state, *consts)
            (state, *rest), consts = jax.lax.optimization_barrier((out, consts))
            kept += rest
        return state, (jnp.stack(kept) if kept else None)

    fn = jax.jit(chain)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(state, consts)   # asynchronous
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    run(1)   # compile and warm up
    n = 1
    while (t := run(n)) < min_run_s:
        n = max(n + 1, min(10 * n, math.ceil(1.2 * n * min_run_s / max(t, 1e-9))))
    return statistics.median(run(n) / (n * k) for _ in range(reps))


def bench(shape, dtype: str, params: str, k: int, reps: int, min_run_s: float) -> list[dict]:
    rows, C = shape
    rng = np.random.default_rng(0)
    pdtype = jnp.float32 if params == "float32" else jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal(shape), jnp.dtype(dtype))
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(C), pdtype)
    b = jnp.asarray(rng.standard_normal(C), pdtype)
    # Correctness first: ours against the jnp reference (the same math), max abs difference of y.
    y_ours = jax.jit(ours_step)(x, w, b)[0]
    y_ref = jax.jit(xla_step)(x, w, b)[0]
    diff = float(jnp.max(jnp.abs(y_ours.astype(jnp.float32) - y_ref.astype(jnp.float32))))
    nbytes = rows * C * jnp.dtype(dtype).itemsize
    words = jnp.zeros((nbytes // 4,), jnp.uint32)
    out = []
    for impl, step, state in (("copy", copy_step, words), ("xla", xla_step, x), ("ours", ours_step, x)):
        sec = time_chain(step, state, (w, b), k, reps, min_run_s)
        out.append({"shape": f"{rows}x{C}", "dtype": dtype, "params": str(jnp.dtype(pdtype)), "impl": impl,
                    "us": sec * 1e6, "gbps": 2 * nbytes / sec / 1e9, "max_abs_diff_vs_xla": diff})
    copy_us = out[0]["us"]
    xla_us = out[1]["us"]
    for r in out:
        r["pct_copy"] = 100 * copy_us / r["us"]
        r["vs_xla"] = xla_us / r["us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="16384x1600,8192x8192,16384x1024,4096x16384,8192x768")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--params", choices=("same", "float32"), default="same",
                        help="weight/bias dtype: x's, or float32 (16-bit x only; fp32 x always uses fp32)")
    parser.add_argument("--chain", type=int, default=20, help="steps chained in one jitted call")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--min-run-s", type=float, default=0.2)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; chain {args.chain}, median of {args.reps}")
    print(f"{'shape':>12} {'dtype':>9} {'params':>8} {'impl':>5} {'us':>9} {'GB/s':>7} {'%copy':>6} {'xXLA':>6}")
    rows = []
    for dtype in args.dtypes.split(","):
        for s in args.shapes.split(","):
            shape = tuple(int(v) for v in s.lower().split("x"))
            for r in bench(shape, dtype, args.params, args.chain, args.reps, args.min_run_s):
                rows.append(r)
                print(f"{r['shape']:>12} {r['dtype']:>9} {r['params']:>8} {r['impl']:>5} {r['us']:9.2f} "
                      f"{r['gbps']:7.0f} {r['pct_copy']:5.1f}% {r['vs_xla']:5.2f}x", flush=True)
            print(f"{'':>12} max |y_ours - y_xla| = {rows[-1]['max_abs_diff_vs_xla']:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
