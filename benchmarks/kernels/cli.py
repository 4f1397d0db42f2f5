"""The kernel bench's command line: ``python -m benchmarks.kernels [options]`` (``--help``)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from jax_lnbwd import DEFAULT_KERNEL, KERNELS

from .. import _term
from .._term import Progress, paint
from . import __doc__ as METHOD
from .peers import available_peers, time_torch, torch_step
from .report import CPU_MARK, format_table, plot
from .timing import (TOLERANCE, autodiff_step, copy_step, json_safe, make_inputs, ours_step,
                     reference_grads, time_jax, traffic_bytes, validate, xla_step)

GPU_SHAPES = "8192x1600,16384x768,16384x1600,16384x2048,16384x4096,8192x8192,4096x16384,1024x768"
CPU_SHAPES = "256x768,64x1601"
DTYPES = ("float32", "bfloat16", "float16", "float64")
PEERS = ("xla", "autodiff", "copy", "torch", "liger")


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
                prog.write(paint(f"FAIL {dtype} {shape} {impl}: rel err {msg} "
                                 f"(tol {TOLERANCE[dtype]:g}{loose}); not timed", "red"))
                log["failures"].append({**where, "errors": json_safe(errs)})
                continue
            if extra.get("cuda_graph") is False:
                prog.write(paint(f"note: {impl} {dtype} {shape} timed eagerly (no CUDA graph)", "grey"))
        except Exception as e:  # an impl that breaks (OOM, API drift) must not end the run
            prog.write(paint(f"ERROR {dtype} {shape} {impl}: {type(e).__name__}: {str(e)[:300]}", "red"))
            log["failures"].append({**where, "error": repr(e)[:1000]})
            continue
        # On CPU our rows all run the one C++ reference, whatever the kernel id: not kernel timings.
        out.append({**where, "peer": impl in PEERS, "kernel_timing": impl in PEERS or args.on_gpu,
                    "us": sec * 1e6, "gbps": nbytes / sec / 1e9, "bytes": nbytes,
                    "errors": json_safe(errs), **extra})
    # Relative columns: each against the same-bytes copy, xla and the fastest non-copy peer.
    us = {r["impl"]: r["us"] for r in out}
    best = min((r["us"] for r in out if r["peer"] and r["impl"] != "copy"), default=None)
    for r in out:
        r["pct_copy"] = 100 * us["copy"] / r["us"] if "copy" in us else None
        r["vs_xla"] = us["xla"] / r["us"] if "xla" in us else None
        r["vs_best"] = best / r["us"] if best else None
    return out


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

    intro, method = METHOD.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=intro, epilog=method,
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
    p.add_argument("--out", default=None, help="directory for bench.txt, bench.json and bench.png")
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
    args.on_gpu = on_gpu
    meta = _term.machine()
    print(f"jax_lnbwd {meta['jax_lnbwd']} kernel bench  {meta['date']}  device: {meta['device']}  "
          f"jax {meta['jax']}")
    print(f"timing: median of {args.reps} runs, each n back-to-back calls of a jitted {args.chain}-step "
          f"chain (run >= {args.min_run_s * 1e3:g} ms), divided by n*{args.chain}", flush=True)
    if not on_gpu:
        print("note: on CPU XLA drops the optimization barriers before fusion, so steps may fuse, and "
              "every kernel id runs the same C++ reference: a smoke test, not a measurement")

    why_not = available_peers(on_gpu) if any(q in args.peers for q in ("torch", "liger")) else {}
    peers = [q for q in args.peers if why_not.get(q) is None]
    for why in dict.fromkeys(why_not.get(q) for q in args.peers if why_not.get(q)):
        skipped = ", ".join(q for q in args.peers if why_not.get(q) == why)
        print(paint(f"peers skipped: {skipped}: {why}", "grey"))
    plans = [(dtype, rows, C, *plan_ours(args.kernels, args.block_sizes, dtype, C))
             for dtype in args.dtypes for rows, C in args.shapes]
    prog = Progress(sum(len(p[3]) + len(peers) for p in plans), not args.no_progress)
    log = {"failures": [], "refused": []}
    table = []
    meta.update({"argv": sys.argv[1:] if argv is None else list(argv), "chain": args.chain,
                 "reps": args.reps, "min_run_ms": args.min_run_s * 1e3, "peers": peers,
                 "tolerance": TOLERANCE, "kernel_timings": on_gpu,
                 "kernels": {k: KERNELS[k].name for k in args.kernels}})

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
            prog.write(paint(f"refused: {dtype} {rows}x{C} {why}", "grey"))
            log["refused"].append({"shape": f"{rows}x{C}", "dtype": dtype, "reason": why})
        group = bench_group(rows, C, dtype, combos, peers, args, jax.random.fold_in(key, i), prog, log)
        table += group
        for r in group:  # ours as soon as the group is done; the full table comes at the end
            if not r["peer"]:
                mark = "" if r["kernel_timing"] else f" {CPU_MARK}"
                prog.write(f"{dtype} {rows}x{C} {r['impl']}{mark}: {r['us']:.2f} µs" +
                           (f", {r['pct_copy']:.1f}% of copy" if r["pct_copy"] else "") +
                           (f", {r['vs_best']:.2f}x the best peer" if r["vs_best"] else ""))
        if args.out:
            write_json(complete=False)
    prog.close()

    text = format_table(table) if table else "(nothing was timed)"
    if args.out:
        write_json(complete=True)
        with open(os.path.join(args.out, "bench.txt"), "w") as fh:
            fh.write(f"{meta['date']}  {meta['device']}  jax {meta['jax']}  jax_lnbwd {meta['jax_lnbwd']}\n"
                     f"argv: {' '.join(meta['argv'])}\n\n{text}\n")
        png = os.path.join(args.out, "bench.png")
        title = f"layernorm backward, {meta['device']}" + ("" if on_gpu else " (CPU: not kernel timings)")
        try:
            made = plot(table, png, title) if table else False
            print(f"wrote {args.out}/bench.txt, bench.json" + (" and bench.png" if made else
                  " (no bench.png: matplotlib missing, pip install -e '.[bench]', or no rows)"))
        except Exception as e:  # a broken plot must not cost the run's numbers
            print(f"wrote {args.out}/bench.txt, bench.json; " +
                  paint(f"bench.png failed: {type(e).__name__}: {e}", "red"))
    if log["failures"]:
        print(paint(f"{len(log['failures'])} entries failed validation or raised, not timed (above)", "red"))
    print()
    print(text)


if __name__ == "__main__":
    main()
