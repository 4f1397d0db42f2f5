"""Timing of the fused layernorm forward against XLA's jnp forward and a same-bytes copy, and of
add + layernorm (add_layernorm's forward) fused against XLA's add then layernorm.

    python benchmarks/forward.py                              # default shapes, bf16 and fp32
    python benchmarks/forward.py --shapes 16384x1600,8192x8192 --dtypes bfloat16 --params float32
    python benchmarks/forward.py --ops add --shapes 8192x1600 --dtypes bfloat16 --params float32
    python benchmarks/forward.py --json out.json              # also write the rows as JSON

Peers, per shape and dtype (x (rows, C); weight and bias (C,) in --params: "same" = x's dtype,
"float32" = fp32 parameters next to 16-bit x, the mixed-precision setup):
  ours   jax_lnbwd.forward.layernorm_fwd_op: one FFI call, x read once;
  xla    jax_lnbwd.reference.layernorm_fwd jitted: XLA's fusions of the same jnp math;
  copy   a same-bytes pass: bitwise NOT of x's bytes as uint32 (reads and writes rows*C*itemsize
         each, like the forward; a plain copy or x * 1 could be elided by XLA).
--ops add (op "add+ln"): s = x + residual, then (y, mean, rstd) of s; s is an output too (the
residual stream goes on to the next block). Peers:
  ours        jax_lnbwd.forward.add_layernorm_fwd_op: one FFI call reads x and residual once and
              writes y, s, mean, rstd (target jax_lnbwd_add_layernorm_fwd_v1);
  ours-unfus  jnp's add, then our fused forward of s (add_layernorm's forward without the
              residual variant: XLA's add fusion reads 2 tensors and writes 1, then the forward);
  xla         jnp's add, then reference.layernorm_fwd, jitted: XLA's fusions;
  copy        NOT of two tensors' bytes (reads 2 and writes 2, like the fused op).
Method (the repository's, see DESIGN.md "Timing on the GPU"): one jitted function chains k
steps, each step's y feeding the next, with jax.lax.optimization_barrier between steps so XLA
can neither fuse, CSE nor hoist them; mean and rstd of every step leave as outputs (else XLA
would drop them). Seconds per step = run time / (calls * k), the median over --reps runs of at
least --min-run-s each. GB/s counts the bytes a forward must move: read x, write y (add+ln: read
x and residual, write y and s).
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
from jax_lnbwd.forward import add_layernorm_fwd_op, layernorm_fwd_op

EPS = 1e-5


def ours_step(x, w, b):
    return layernorm_fwd_op(x, w, b, EPS)


def xla_step(x, w, b):
    return reference.layernorm_fwd(x, w, b, EPS)


def copy_step(words, w, b):
    return (jnp.bitwise_not(words),)


# add + layernorm: state x, consts (residual, w, b); every step's s, mean and rstd are outputs.
def add_ours_step(x, r, w, b):
    return add_layernorm_fwd_op(x, r, w, b, EPS)


def add_unfused_step(x, r, w, b):
    s = x + r
    y, mean, rstd = layernorm_fwd_op(s, w, b, EPS)
    return y, s, mean, rstd


def add_xla_step(x, r, w, b):
    s = x + r
    y, mean, rstd = reference.layernorm_fwd(s, w, b, EPS)
    return y, s, mean, rstd


def add_copy_step(words, words_r, w, b):
    return jnp.bitwise_not(words), jnp.bitwise_not(words_r)


def time_chain(step, state, consts, k: int, reps: int, min_run_s: float) -> float:
    """Median seconds per step of `step` chained k times inside one jitted function."""
    def chain(state, consts):
        kept = []
        for _ in range(k):   # unrolled: no while-loop overhead between steps
            out = step(state, *consts)
            (state, *rest), consts = jax.lax.optimization_barrier((out, consts))
            kept += rest
        if kept and len({a.shape for a in kept}) > 1:   # add+ln keeps s besides the statistics
            return state, tuple(kept)
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


def bench_add(shape, dtype: str, params: str, k: int, reps: int, min_run_s: float) -> list[dict]:
    """The add+ln rows of one shape: copy, xla, ours-unfus, ours (see the module docstring)."""
    rows, C = shape
    rng = np.random.default_rng(1)
    pdtype = jnp.float32 if params == "float32" else jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal(shape), jnp.dtype(dtype))
    r = jnp.asarray(rng.standard_normal(shape), jnp.dtype(dtype))
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(C), pdtype)
    b = jnp.asarray(rng.standard_normal(C), pdtype)
    # Correctness first: s is jnp's add bit for bit; y against XLA's (max abs difference).
    y_ours, s_ours = jax.jit(add_ours_step)(x, r, w, b)[:2]
    y_ref, s_ref = jax.jit(add_xla_step)(x, r, w, b)[:2]
    if not bool(jnp.array_equal(s_ours, s_ref)):
        raise AssertionError(f"add+ln {rows}x{C} {dtype}: s differs from jnp's x + residual")
    diff = float(jnp.max(jnp.abs(y_ours.astype(jnp.float32) - y_ref.astype(jnp.float32))))
    nbytes = rows * C * jnp.dtype(dtype).itemsize
    words = jnp.zeros((nbytes // 4,), jnp.uint32)
    out = []
    peers = (("copy", add_copy_step, words, words + 1), ("xla", add_xla_step, x, r),
             ("ours-unfus", add_unfused_step, x, r), ("ours", add_ours_step, x, r))
    for impl, step, state, second in peers:
        sec = time_chain(step, state, (second, w, b), k, reps, min_run_s)
        out.append({"op": "add+ln", "shape": f"{rows}x{C}", "dtype": dtype, "params": str(jnp.dtype(pdtype)),
                    "impl": impl, "us": sec * 1e6, "gbps": 4 * nbytes / sec / 1e9, "max_abs_diff_vs_xla": diff})
    copy_us, xla_us = out[0]["us"], out[1]["us"]
    for row in out:
        row["pct_copy"] = 100 * copy_us / row["us"]
        row["vs_xla"] = xla_us / row["us"]
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
    parser.add_argument("--ops", default="forward,add",
                        help="forward (layernorm's forward alone) and/or add (x + residual, then it)")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    ops = args.ops.split(",")
    if not ops or set(ops) - {"forward", "add"}:
        parser.error(f"--ops takes forward and/or add, got {args.ops!r}")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; chain {args.chain}, median of {args.reps}")
    print(f"{'op':>7} {'shape':>12} {'dtype':>9} {'params':>8} {'impl':>10} {'us':>9} {'GB/s':>7} {'%copy':>6} "
          f"{'xXLA':>6}")
    rows = []
    for op in ops:
        for dtype in args.dtypes.split(","):
            for s in args.shapes.split(","):
                shape = tuple(int(v) for v in s.lower().split("x"))
                run = bench if op == "forward" else bench_add
                for r in run(shape, dtype, args.params, args.chain, args.reps, args.min_run_s):
                    r.setdefault("op", "forward")
                    rows.append(r)
                    print(f"{r['op']:>7} {r['shape']:>12} {r['dtype']:>9} {r['params']:>8} {r['impl']:>10} "
                          f"{r['us']:9.2f} {r['gbps']:7.0f} {r['pct_copy']:5.1f}% {r['vs_xla']:5.2f}x", flush=True)
                print(f"{'':>20} max |y_ours - y_xla| = {rows[-1]['max_abs_diff_vs_xla']:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
