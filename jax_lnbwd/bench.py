"""Validate, then time, the layernorm backward against its peers: ``python -m jax_lnbwd.bench``.

This reproduces and extends main() of llm.c's dev/cuda/layernorm_backward.cu. For every
(dtype, shape, kernel, block size) the op is first checked against the pure-jnp reference
(a failure is printed in red and that entry is not timed), then timed. Peers are timed the
same way: ``xla`` (reference.layernorm_bwd under jit, given mean/rstd), ``autodiff`` (XLA's VJP
of a jnp layernorm, recomputing the statistics), ``copy`` (a same-bytes device copy: the
ceiling), and, where they import on a CUDA GPU, ``torch`` and ``liger``. Kernels come from
jax_lnbwd.KERNELS, so new ones are benchmarked with no change here.

How one op is timed (device time, never one call by wall clock)
---------------------------------------------------------------
* One JAX call costs tens of µs of host dispatch, more than a small kernel runs. So one jitted
  function applies the op k times in a chain (``--chain``; 50 on GPU, 3 on CPU): the dx of
  step i is the dy of step i+1. Each step's outputs, and the constant inputs too, go through
  ``jax.lax.optimization_barrier``: XLA can then neither fuse steps, nor CSE them, nor hoist
  input-only work (the autodiff peer's statistics, x̂) out of the chain and share it between
  steps. XLA does drop barrier outputs that nothing reads, so every step's dweight and dbias
  are stacked into an output of the chain (one small copy per call); else the peers would
  skip their column sums. Values drift along a chain (dx is about w*dy per column); nobody
  looks at them, and GPU arithmetic runs at one speed whatever they are. Validation is
  separate: one call on the fresh inputs, before any timing.
* On CPU, XLA removes the barriers before fusion (on GPU only after scheduling), so there the
  peers' steps may fuse with each other (the copy's k passes become one): the CPU run checks
  that everything works, its numbers mean little.
* The chain is compiled and run once (warm-up). A timed run is n back-to-back calls of it with
  one ``jax.block_until_ready`` at the end; dispatch is asynchronous and the GPU runs calls in
  stream order, so the host queues call i+1 while the device runs call i. After the warm-up, n
  grows until a run lasts >= ``--min-run-ms`` (20 ms on GPU; on CPU 0, i.e. n = 1, as
  independent CPU calls may overlap): a run's fixed cost (first dispatch, final sync, about a
  millisecond) then adds at most a few percent to the smallest shapes' steps.
  time.perf_counter() around the run, divided by n*k, is one sample; we report the median of
  ``--reps`` samples. Nothing is subtracted, so what the op leaves idle between steps counts
  against it.
* torch and liger run the same k-step chain captured in a CUDA graph (eager if capture
  fails), replayed n times between two torch.cuda.Event records.
* Nothing is rotated and no cache is flushed. Instead the data is larger than the H200's 60 MB
  L2: a step moves 3*rows*C elements, 75-805 MB for the default GPU shapes (8192x1600 and
  16384x768 in bf16 are the tightest, 1.3x L2). 1024x768 (4.7 MB in bf16) fits in L2 on
  purpose: it shows the small, launch- and latency-bound case, where L2 flatters everyone.

Bytes and the columns of the table
----------------------------------
bytes = (3*rows*C + 3*C)*itemsize + 2*rows*stat_itemsize: read dy and x, write dx; read
weight, write dweight and dbias; read mean and rstd (float32, float64 for float64). Every
impl of a (shape, dtype) is credited with these same bytes, so GB/s ratios are speed ratios.
The copy peer reads bytes/2 and writes bytes/2 per step: an elementwise bitwise NOT of a
uint32 array (a real read+write pass; a plain copy or ``x * 1`` could be elided by XLA).

  µs      median device time of one op call (one chain step)
  GB/s    bytes / time
  %copy   copy_µs / µs: the share of the same-bytes copy speed reached
  ×xla    xla_µs / µs: speed-up over the XLA-fused jnp backward
  ×best   best_µs / µs: speed-up over the fastest non-copy peer (xla, autodiff, torch, liger)

``--out DIR`` writes DIR/bench.json (all rows and metadata) and DIR/bench.png (GB/s bars per
shape, one panel per dtype, the copy ceiling as a dashed line), the latter if matplotlib
imports. A run cut short (a time limit on a shared GPU) keeps what it measured: bench.json is
rewritten after every (shape, dtype) group, with "complete": false until the last, and our
kernels' lines are printed as each group finishes; the full table comes at the end.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import DEFAULT_KERNEL, KERNELS, __version__, layernorm_bwd, layernorm_fwd, reference

GPU_SHAPES = "8192x1600,16384x768,16384x1600,16384x2048,16384x4096,8192x8192,4096x16384,1024x768"
CPU_SHAPES = "256x768,64x1601"
DTYPES = ("float32", "bfloat16", "float16", "float64")
PEERS = ("xla", "autodiff", "copy", "torch", "liger")
# Norm-wise relative error allowed against the float32 (float64) reference; kernels with
# precise=False get 10x this for dweight and dbias.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 2e-2, "float16": 5e-3}
EPS = 1e-5

RED, GREY, RESET = ("", "", "") if os.environ.get("NO_COLOR") else ("\033[31m", "\033[90m", "\033[0m")


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


# ---------------------------------------------------------------------------------------------
# torch and liger peers (CUDA only, imported lazily)


def torch_step(impl: str, x, w, b, dy):
    """(step, dy0) for a torch-side peer; step(dy) -> (dx, dweight, dbias) on CUDA tensors.

    Each peer gets mean/rstd from its own forward, in the shape and dtype it expects (for
    torch: (rows, 1) float32, float64 for float64), from the same x, w, b and eps.
    """
    import torch

    def to_torch(a):  # via float32/64 numpy: exact for every dtype here, and needs no DLPack
        acc = np.float64 if a.dtype == jnp.float64 else np.float32
        return torch.from_numpy(np.array(a.astype(acc))).to("cuda").to(getattr(torch, str(a.dtype)))

    tx, tw, tb, tdy = (to_torch(a) for a in (x, w, b, dy))
    C = tx.shape[-1]
    if impl == "torch":
        _, mean, rstd = torch.ops.aten.native_layer_norm(tx, [C], tw, tb, EPS)
        def step(d):
            return torch.ops.aten.native_layer_norm_backward(d, tx, [C], mean, rstd, tw, tb,
                                                             [True, True, True])
    else:
        from liger_kernel.ops.layer_norm import layer_norm_backward, layer_norm_forward
        fwd = layer_norm_forward(tx, tw, tb, EPS)
        mean, rstd = fwd[2], fwd[3]
        def step(d):
            return tuple(layer_norm_backward(d, tx, tw, tb, mean, rstd))[:3]
    return step, tdy


def time_torch(step, d0, k: int, reps: int, min_run_s: float) -> tuple[float, bool]:
    """(median seconds per step, whether a CUDA graph was used): the JAX method with events."""
    import torch

    def chain():
        d = d0
        for _ in range(k):
            d = step(d)[0]
        return d

    chain()  # warm-up (Triton compiles here)
    replay, graphed = chain, False
    try:  # a CUDA graph of the chain: like XLA's, free of per-launch host cost
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's capture-unsafe CUDA calls are refused. With torch's
        # default (global), a call from one of JAX's threads during the capture failed, and
        # left JAX's stream in an error state for the rest of the run.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            chain()
        replay, graphed = graph.replay, True
    except Exception:
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(n: int) -> float:
        start.record()
        for _ in range(n):
            replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    run(1)
    n = calls_per_run(run, min_run_s)
    return statistics.median(run(n) / (n * k) for _ in range(reps)), graphed


def available_peers(on_gpu: bool) -> dict[str, str | None]:
    """{peer: None if usable, else why not}."""
    why = {"xla": None, "autodiff": None, "copy": None}
    if not on_gpu:
        return {**why, "torch": "JAX runs on the CPU here", "liger": "JAX runs on the CPU here"}
    try:
        import torch
        why["torch"] = None if torch.cuda.is_available() else "torch sees no CUDA GPU"
    except Exception as e:
        why["torch"] = f"torch does not import ({type(e).__name__})"
    try:
        import liger_kernel.ops.layer_norm  # noqa: F401
        why["liger"] = why["torch"]
    except Exception as e:
        why["liger"] = f"liger_kernel does not import ({type(e).__name__})"
    return why


# ---------------------------------------------------------------------------------------------
# Plan, run, report


def traffic_bytes(rows: int, C: int, dtype: str) -> int:
    item = jnp.dtype(dtype).itemsize
    return (3 * rows * C + 3 * C) * item + 2 * rows * reference.acc_dtype(dtype).itemsize


def plan_ours(kernels, block_sizes: str, dtype: str, C: int):
    """([(kernel, block_size)], [refusal reasons]) for one (dtype, C)."""
    combos, refused = [], []
    for kid in kernels:
        info = KERNELS[kid]
        if dtype not in info.dtypes:
            refused.append(f"k{kid}: dtype {dtype} not in {', '.join(info.dtypes)}")
            continue
        if block_sizes == "best":
            sizes = [info.default_block_size]
        elif block_sizes == "all":
            sizes = list(info.block_sizes)
        else:
            sizes = [int(s) for s in block_sizes.split(",")]
        for bs in sizes:
            why = (f"block size not in {list(info.block_sizes)}" if bs not in info.block_sizes
                   else info.refuse(C, dtype, bs))
            if why is None:
                combos.append((kid, bs))
            else:
                refused.append(f"k{kid}/bs{bs}: {why}")
    return combos, refused


class Progress:
    """tqdm if it imports, else a one-line counter on stderr; write() prints above it."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self.bar = total, 0, enabled, None
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if enabled and tqdm is not None:
            self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, leave=False)

    def step(self, label: str):
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update(1)
        elif self.enabled:
            print(f"\r\033[K[{self.n}/{self.total}] {label}", end="", file=sys.stderr, flush=True)

    def write(self, msg: str):
        self.close(final=False)
        if self.bar is None:
            print(msg, flush=True)
        else:
            self.bar.write(msg)

    def close(self, final: bool = True):
        if self.bar is None and self.enabled:
            print("\r\033[K", end="", file=sys.stderr, flush=True)  # erase the counter line
        elif self.bar is not None and final:
            self.bar.close()


def bench_group(rows: int, C: int, dtype: str, combos, peers, args, key, prog: Progress, log: dict):
    """Validate and time every impl of one (shape, dtype); returns its table rows."""
    shape = f"{rows}x{C}"
    nbytes = traffic_bytes(rows, C, dtype)
    dy, x, w, b, mean, rstd = make_inputs(rows, C, dtype, key)
    ref = reference_grads(dy, x, w, mean, rstd)
    consts = (x, w, b, mean, rstd)
    state = (dy, jnp.zeros_like(w), jnp.zeros_like(w))
    entries = [(f"k{kid}/bs{bs}", ours_step(kid, bs), KERNELS[kid].precise) for kid, bs in combos]
    entries += [(p, {"xla": xla_step, "autodiff": autodiff_step}.get(p), True) for p in peers]
    out = []
    for impl, step, precise in entries:
        prog.step(f"{dtype} {shape} {impl}")
        where = {"shape": shape, "dtype": dtype, "impl": impl}
        try:
            extra = {}
            if impl == "copy":  # nothing to validate; bytes/2 as uint32 words
                words = jnp.zeros((max(1, nbytes // 8),), jnp.uint32)
                sec = time_jax(copy_step, (words,), (), args.chain, args.reps, args.min_run_s)
                errs = {}
            elif impl in ("torch", "liger"):
                tstep, d0 = torch_step(impl, x, w, b, dy)
                ok, errs = validate(tstep(d0), ref, dtype)
                if ok:
                    sec, extra["cuda_graph"] = time_torch(tstep, d0, args.chain, args.reps,
                                                          args.min_run_s)
            else:
                ok, errs = validate(jax.jit(step)(state, *consts), ref, dtype, precise)
                if ok:
                    sec = time_jax(step, state, consts, args.chain, args.reps, args.min_run_s)
            if errs and not ok:
                msg = " ".join(f"{n}={e:.3g}" for n, e in errs.items())
                loose = "" if precise else ", 10x that for dweight/dbias"
                prog.write(f"{RED}FAIL {dtype} {shape} {impl}: rel err {msg} "
                           f"(tol {TOLERANCE[dtype]:g}{loose}); not timed{RESET}")
                log["failures"].append({**where, "errors": json_safe(errs)})
                continue
            if extra.get("cuda_graph") is False:
                prog.write(f"{GREY}note: {impl} {dtype} {shape} timed eagerly (no CUDA graph){RESET}")
        except Exception as e:  # an impl that breaks (OOM, API drift) must not end the run
            prog.write(f"{RED}ERROR {dtype} {shape} {impl}: {type(e).__name__}: {str(e)[:300]}{RESET}")
            log["failures"].append({**where, "error": repr(e)[:1000]})
            continue
        out.append({**where, "peer": impl in PEERS, "us": sec * 1e6, "gbps": nbytes / sec / 1e9,
                    "bytes": nbytes, "errors": json_safe(errs), **extra})
    # Relative columns: each against the same-bytes copy, xla and the fastest non-copy peer.
    us = {r["impl"]: r["us"] for r in out}
    best = min((r["us"] for r in out if r["peer"] and r["impl"] != "copy"), default=None)
    for r in out:
        r["pct_copy"] = 100 * us["copy"] / r["us"] if "copy" in us else None
        r["vs_xla"] = us["xla"] / r["us"] if "xla" in us else None
        r["vs_best"] = best / r["us"] if best else None
    return out


def format_table(rows) -> str:
    """The plain-text table: one line per timed entry, a rule between (shape, dtype) groups."""
    def f(v, fmt, suffix=""):
        return "-" if v is None else format(v, fmt) + suffix
    head = ("shape", "dtype", "impl", "µs", "GB/s", "%copy", "×xla", "×best")
    cells, groups = [], []
    for r in rows:
        cells.append((r["shape"], r["dtype"], r["impl"], f(r["us"], ".2f"), f(r["gbps"], ".1f"),
                      f(r["pct_copy"], ".1f", "%"), f(r["vs_xla"], ".2f", "x"), f(r["vs_best"], ".2f", "x")))
        groups.append((r["shape"], r["dtype"]))
    width = [max(len(c[i]) for c in cells + [head]) for i in range(len(head))]
    def line(c):  # text columns left-aligned, numbers right-aligned
        return "  ".join(s.ljust(wd) if i < 3 else s.rjust(wd) for i, (s, wd) in enumerate(zip(c, width)))
    lines = [line(head), "-" * len(line(head))]
    for i, c in enumerate(cells):
        if i and groups[i] != groups[i - 1]:
            lines.append("")
        lines.append(line(c))
    return "\n".join(lines)


def plot(rows, path: str, title: str) -> bool:
    """bench.png: per dtype a panel of GB/s bars grouped by shape, the copy speed a dashed line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "copy"))
    wide = max(8.0, 2 + 1.1 * len(shapes) * max(1, len(impls)) ** 0.5)
    fig, axes = plt.subplots(len(dtypes), 1, squeeze=False, figsize=(wide, 3.8 * len(dtypes)))
    width = 0.8 / max(1, len(impls))
    for ax, dtype in zip(axes[:, 0], dtypes):
        gbps = {(r["shape"], r["impl"]): r["gbps"] for r in rows if r["dtype"] == dtype}
        for j, impl in enumerate(impls):
            at = [i for i, s in enumerate(shapes) if (s, impl) in gbps]  # bars side by side per shape
            if at:
                ax.bar([i + (j - (len(impls) - 1) / 2) * width for i in at],
                       [gbps[shapes[i], impl] for i in at], width, label=impl, color=f"C{j % 10}")
        copies = [(i, gbps[s, "copy"]) for i, s in enumerate(shapes) if (s, "copy") in gbps]
        for n, (i, g) in enumerate(copies):
            ax.hlines(g, i - 0.45, i + 0.45, colors="black", linestyles="--",
                      label="copy (ceiling)" if n == 0 else None)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{title}: {dtype}")
        ax.legend(fontsize="small", ncol=min(6, len(impls) + 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv, on_gpu: bool):
    def csv(s):
        return [t for t in s.split(",") if t.strip()] if s not in ("", "none") else []

    def shapes(s):
        try:
            out = [tuple(int(n) for n in t.lower().split("x")) for t in csv(s)]
        except ValueError:
            out = [()]
        if not out or any(len(t) != 2 or min(t) < 1 for t in out):
            raise argparse.ArgumentTypeError(f"shapes are ROWSxC, comma separated: {s!r}")
        return out

    intro, method = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="python -m jax_lnbwd.bench", description=intro, epilog=method,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=str(DEFAULT_KERNEL),
                   help=f"comma list of ids from {sorted(KERNELS)} or 'all' (default {DEFAULT_KERNEL})")
    p.add_argument("--block-sizes", default="best",
                   help="'best' (each kernel's default), 'all' (each kernel's list) or a comma list")
    p.add_argument("--shapes", type=shapes, default=None,
                   help=f"comma list of ROWSxC (default: {GPU_SHAPES} on GPU, {CPU_SHAPES} on CPU)")
    p.add_argument("--dtypes", default="bfloat16,float32", help=f"comma list from {','.join(DTYPES)}")
    p.add_argument("--peers", default=None, help=f"comma list from {','.join(PEERS)} (default: all that run)")
    p.add_argument("--reps", type=int, default=7, help="timed runs; the median is reported (default 7)")
    p.add_argument("--chain", type=int, default=None, help="op calls per chain (default 50 GPU, 3 CPU)")
    p.add_argument("--min-run-ms", type=float, default=None,
                   help="chain calls per timed run until it lasts this long (default 20 GPU, 0 CPU)")
    p.add_argument("--seed", type=int, default=0, help="for the random inputs (default 0)")
    p.add_argument("--out", default=None, help="directory for bench.json and bench.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    a.shapes = a.shapes or shapes(GPU_SHAPES if on_gpu else CPU_SHAPES)
    a.chain = a.chain or (50 if on_gpu else 3)
    a.min_run_s = (a.min_run_ms if a.min_run_ms is not None else (20.0 if on_gpu else 0.0)) / 1e3
    ids = [t.strip() for t in csv(a.kernels)]
    if ids != ["all"] and not all(t.isdigit() and int(t) in KERNELS for t in ids) or not ids:
        p.error(f"--kernels: expected 'all' or ids from {sorted(KERNELS)}")
    a.kernels = sorted(KERNELS) if ids == ["all"] else [int(t) for t in ids]
    if a.block_sizes not in ("best", "all") and not all(t.isdigit() for t in csv(a.block_sizes)):
        p.error("--block-sizes: expected 'best', 'all' or a comma list of integers")
    a.dtypes = csv(a.dtypes)
    if not a.dtypes or any(d not in DTYPES for d in a.dtypes):
        p.error(f"--dtypes: expected a comma list from {', '.join(DTYPES)}")
    a.peers = list(PEERS) if a.peers is None else csv(a.peers)
    if any(q not in PEERS for q in a.peers):
        p.error(f"--peers: expected a comma list from {', '.join(PEERS)}")
    if a.reps < 1 or a.chain < 1:
        p.error("--reps and --chain must be >= 1")
    return a


def main(argv=None):
    jax.config.update("jax_enable_x64", True)  # float64 stays float64; before any array is made
    on_gpu = jax.default_backend() == "gpu"
    args = parse_args(argv, on_gpu)
    device = jax.devices()[0]
    device_name = device.device_kind if on_gpu else f"cpu ({platform.processor() or platform.machine()})"
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"jax_lnbwd {__version__} bench  {date}  device: {device_name}  jax {jax.__version__}")
    print(f"timing: median of {args.reps} runs, each n back-to-back calls of a jitted {args.chain}-step "
          f"chain (run >= {args.min_run_s * 1e3:g} ms), divided by n*{args.chain}", flush=True)
    if not on_gpu:
        print("note: on CPU XLA drops the optimization barriers before fusion, so steps may fuse: "
              "a smoke test, not a measurement")

    why_not = available_peers(on_gpu) if any(q in args.peers for q in ("torch", "liger")) else {}
    peers = [q for q in args.peers if why_not.get(q) is None]
    for why in dict.fromkeys(why_not.get(q) for q in args.peers if why_not.get(q)):
        skipped = ", ".join(q for q in args.peers if why_not.get(q) == why)
        print(f"{GREY}peers skipped: {skipped}: {why}{RESET}")
    plans = [(dtype, rows, C, *plan_ours(args.kernels, args.block_sizes, dtype, C))
             for dtype in args.dtypes for rows, C in args.shapes]
    prog = Progress(sum(len(p[3]) + len(peers) for p in plans), not args.no_progress)
    log = {"failures": [], "refused": []}
    table = []
    meta = {"date": date, "device": device_name, "platform": device.platform, "jax": jax.__version__,
            "jax_lnbwd": __version__, "python": platform.python_version(),
            "argv": sys.argv[1:] if argv is None else list(argv), "chain": args.chain, "reps": args.reps,
            "min_run_ms": args.min_run_s * 1e3, "peers": peers, "tolerance": TOLERANCE,
            "kernels": {k: KERNELS[k].name for k in args.kernels}}

    def write_json(complete: bool):
        # Rewritten after every (shape, dtype) group, so that a run cut short (a time limit on a
        # shared GPU) leaves what it measured: "complete" says whether every group is in.
        meta["torch"] = getattr(sys.modules.get("torch"), "__version__", None)
        with open(os.path.join(args.out, "bench.json"), "w") as fh:
            json.dump({"meta": meta, "complete": complete, "rows": table, **log}, fh, indent=1, default=str)

    if args.out:
        os.makedirs(args.out, exist_ok=True)
    key = jax.random.key(args.seed)
    for i, (dtype, rows, C, combos, refused) in enumerate(plans):
        for why in refused:
            prog.write(f"{GREY}refused: {dtype} {rows}x{C} {why}{RESET}")
            log["refused"].append({"shape": f"{rows}x{C}", "dtype": dtype, "reason": why})
        group = bench_group(rows, C, dtype, combos, peers, args, jax.random.fold_in(key, i), prog, log)
        table += group
        for r in group:  # ours as soon as the group is done; the full table comes at the end
            if not r["peer"]:
                prog.write(f"{dtype} {rows}x{C} {r['impl']}: {r['us']:.2f} µs" +
                           (f", {r['pct_copy']:.1f}% of copy" if r["pct_copy"] else "") +
                           (f", {r['vs_best']:.2f}x the best peer" if r["vs_best"] else ""))
        if args.out:
            write_json(complete=False)
    prog.close()

    if args.out:
        write_json(complete=True)
        png = os.path.join(args.out, "bench.png")
        try:
            made = plot(table, png, f"layernorm backward, {device_name}") if table else False
            print(f"wrote {args.out}/bench.json" + (f" and {png}" if made else
                                                    " (no bench.png: matplotlib missing or no rows)"))
        except Exception as e:  # a broken plot must not cost the run's numbers
            print(f"wrote {args.out}/bench.json; {RED}bench.png failed: {type(e).__name__}: {e}{RESET}")
    if log["failures"]:
        print(f"{RED}{len(log['failures'])} entries failed validation or raised, not timed (above){RESET}")
    print()
    print(format_table(table) if table else "(nothing was timed)")


if __name__ == "__main__":
    main()
