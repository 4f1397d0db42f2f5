"""The kernel bench's command line: ``python -m benchmarks.kernels [options]`` (``--help``)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from jax_lnbwd import DEFAULT_KERNEL, KERNELS
from jax_lnbwd.kernels import v2_refusal
from jax_lnbwd.norms import Norm

from .. import _term
from .._term import Progress, paint
from . import __doc__ as METHOD
from . import dram, kernel_time
from .cases import Impl
from .ops import GROUPS, OPS, resolve
from .ops_qk_norm import SHAPES_NOTE
from .peers import available_peers, call, time_torch, torch_step
from .report import CPU_MARK, format_table, plot
from .timing import TOLERANCE, copy_step, copy_words, json_safe, time_jax, validate

CPU_SHAPES = "256x768,64x1601"
CPU_CHAIN, GPU_CHAIN = 3, 50
DTYPES = ("float32", "bfloat16", "float16", "float64")
PEERS = ("default", "xla", "autodiff", "copy", "torch", "liger", "pallas", "ours-unfus", "two-calls")
L2_MB = 60  # the H200's L2


def plan_ours(kernels, block_sizes: str, dtype: str, C: int, norm: Norm):
    """([(kernel, block_size)], [refusal reasons]) for one (dtype, C) of norm's backward."""
    combos, refused = [], []
    for kid in kernels:
        info = KERNELS[kid]
        if (why := v2_refusal(kid, mixed=False, residual=False, norm=norm)) is not None:
            refused.append(f"k{kid}: {why.split(';')[0]}")
            continue
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


def mark_l2(rows, l2_bytes, dram_gbps):
    """Marks a group's rows L2 (fits_l2) where chain steps find their data in the L2: the op's
    bytes fit in it (l2_bytes), or its same-bytes copy ran faster than the DRAM can (dram_gbps),
    so that %copy would compare against an L2-assisted copy. Off a GPU (None, None) nothing is."""
    copy = next((r for r in rows if r["impl"] == "copy"), None)
    fast = dram_gbps is not None and copy is not None and copy["gbps"] > dram_gbps
    for r in rows:
        r["fits_l2"] = fast or (l2_bytes is not None and r["bytes"] <= l2_bytes)


def bench_group(op, rows: int, C: int, dtype: str, combos, peers, args, key, prog: Progress, log: dict):
    """Validate and time every impl of one (op, shape, dtype); returns its table rows."""
    shape = f"{rows}x{C}"
    case = op.prepare(rows, C, dtype, args.params, key)
    entries = op.impls(case, args, combos)
    entries += [Impl(p, None, True) for p in peers if p in ("copy", "torch", "liger")]
    out = []
    for entry in entries:
        impl = entry.name
        prog.step(f"{op.alias} {dtype} {shape} {impl}")
        where = {"op": op.name, "shape": shape, "dtype": dtype, "params": case.params, "impl": impl}
        try:
            extra = {}
            trace = None
            if args.collector:   # --kernel-time: one more call of the timed chain, traced
                def trace(call):
                    extra["kernel_us"] = kernel_time.per_step_us(call, args.chain, args.collector)
            if impl == "copy":  # nothing to validate: the op's bytes, once, at copy speed
                sec = time_jax(copy_step, copy_words(case.nbytes), (), args.chain, args.reps, args.min_run_s,
                               trace=trace)
                ok, errs = True, {}
            elif impl in ("torch", "liger"):
                tstep, d0 = torch_step(op.name, impl, *case.torch_inputs)
                ok, errs = validate(call(tstep, d0), case.ref, dtype, op.outputs)
                if ok:
                    sec, extra["cuda_graph"] = time_torch(tstep, d0, args.chain, args.reps,
                                                          args.min_run_s, trace=trace)
            else:
                outs = jax.jit(entry.step)(case.state, *case.consts)
                ok, errs = validate(outs, case.ref, dtype, op.outputs, entry.tol)
                if ok:
                    sec = time_jax(entry.step, case.state, case.consts, args.chain, args.reps,
                                   args.min_run_s, op.carry, trace=trace)
            if not ok:
                msg = " ".join(f"{n}={e:.3g}" for n, e in errs.items())
                tols = ", ".join(f"x{f:g} for {n}" for n, f in entry.tol.items())
                prog.write(paint(f"FAIL {op.name} {dtype} {shape} {impl}: rel err {msg} "
                                 f"(tol {TOLERANCE[dtype]:g}{', ' + tols if tols else ''}); not timed", "red"))
                log["failures"].append({**where, "errors": json_safe(errs)})
                continue
            if extra.get("cuda_graph") is False:
                prog.write(paint(f"note: {impl} {dtype} {shape} timed eagerly (no CUDA graph)", "grey"))
        except Exception as e:  # an impl that breaks (OOM, API drift) must not end the run
            prog.write(paint(f"ERROR {op.name} {dtype} {shape} {impl}: {type(e).__name__}: "
                             f"{str(e)[:300]}", "red"))
            log["failures"].append({**where, "error": repr(e)[:1000]})
            continue
        # On CPU our rows (and a peer that runs our kernels: two-calls) run the C++ reference
        # handlers (one for every kernel id): not kernel timings.
        timing = (entry.peer and not entry.our_kernels) or args.on_gpu
        out.append({**where, "peer": entry.peer, "kernel_timing": timing,
                    "us": sec * 1e6, "gbps": case.nbytes / sec / 1e9, "bytes": case.nbytes,
                    "errors": json_safe(errs), **extra})
    mark_l2(out, args.l2_mb * 2**20 if args.on_gpu else None, args.dram_gbps if args.on_gpu else None)
    # Relative columns: each against the same-bytes copy, xla and the fastest non-copy peer.
    us = {r["impl"]: r["us"] for r in out}
    best = min((r["us"] for r in out if r["peer"] and r["impl"] != "copy"), default=None)
    for r in out:
        r["pct_copy"] = 100 * us["copy"] / r["us"] if "copy" in us else None
        r["vs_xla"] = us["xla"] / r["us"] if "xla" in us else None
        r["vs_best"] = best / r["us"] if best else None
        r["pct_peak"] = 100 * r["gbps"] / args.dram_gbps if args.dram_gbps else None
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
    names = (", ".join(f"{n} ({op.alias})" for n, op in OPS.items()) + "; groups: "
             + ", ".join(f"{g} ({','.join(members)})" for g, members in GROUPS.items()))
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=intro,
                                epilog="How ops are timed and what each column means: --method.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", action="store_true", help="print the method (timing, bytes, columns) and exit")
    p.add_argument("--op", default="layernorm_bwd",
                   help=f"comma list of ops from {names}, or 'all' (default layernorm_bwd)")
    p.add_argument("--kernels", default=str(DEFAULT_KERNEL),
                   help=f"backward kernels: comma list of ids from {sorted(KERNELS)} or 'all' "
                        f"(default {DEFAULT_KERNEL})")
    p.add_argument("--block-sizes", default="best",
                   help="backward: 'best' (each kernel's default), 'all' (each kernel's list) or a comma list")
    p.add_argument("--shapes", type=shapes, default=None,
                   help="comma list of ROWSxC (default on GPU: per op, "
                        + "; ".join(f"{n} {op.gpu_shapes}" for n, op in OPS.items())
                        + f"; on CPU: {CPU_SHAPES}); {SHAPES_NOTE}")
    p.add_argument("--dtypes", default="bfloat16,float32", help=f"comma list from {','.join(DTYPES)}")
    p.add_argument("--params", choices=("same", "float32"), default="same",
                   help="forward ops: weight/bias in x's dtype, or float32 beside 16-bit x (mixed "
                        "precision; ignored for 32- and 64-bit x); the backward's are x's dtype")
    p.add_argument("--peers", default=None,
                   help=f"comma list from {','.join(PEERS)} (default: all that run); each op takes those "
                        "that apply: autodiff the layernorm and rmsnorm backwards, torch and liger "
                        "layernorm's, rmsnorm's and the qk ops' (not the add_ ops), "
                        "pallas layernorm's and rmsnorm's (JAX's Pallas GPU ops), ours-unfus the add_ ops, "
                        "two-calls the qk ops (two jax_lnbwd.rmsnorm calls, on q and on k)")
    p.add_argument("--reps", type=int, default=7, help="timed runs; the median is reported (default 7)")
    p.add_argument("--chain", type=int, default=None,
                   help=f"op calls per chain (default {GPU_CHAIN} GPU, {CPU_CHAIN} CPU)")
    p.add_argument("--min-run-ms", type=float, default=None,
                   help="chain calls per timed run until it lasts this long (default 20 GPU, 0 CPU)")
    p.add_argument("--l2-mb", type=float, default=L2_MB,
                   help=f"the GPU's L2 in MB: shapes whose bytes fit are marked L2 (default {L2_MB}, the H200's)")
    p.add_argument("--dram-gbps", type=float, default=None,
                   help=f"the DRAM's peak in GB/s, the %%peak column's denominator; a copy faster than it "
                        f"marks a shape L2 (default: ${dram.ENV}, else the device's from dram.py's table)")
    p.add_argument("--kernel-time", action="store_true",
                   help="after timing each impl, trace one call of its chain and add the column kern µs: "
                        "its kernels' time per step alone (kernel_time.py; µs - kern µs is what the step "
                        "spends outside its kernels)")
    p.add_argument("--seed", type=int, default=0, help="for the random inputs (default 0)")
    p.add_argument("--out", default=None, help="directory for bench.txt, bench.json and bench.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if a.method:
        print(METHOD)
        p.exit()
    try:
        a.ops = resolve(csv(a.op))
    except KeyError as e:
        a.ops = None
        p.error(f"--op: unknown op {e.args[0]!r}; expected a comma list from {names}, or 'all'")
    if not a.ops:
        p.error(f"--op: expected a comma list from {names}, or 'all'")
    a.cpu_sized = not on_gpu and a.shapes is None and a.chain is None
    a.shapes = {op.name: a.shapes or shapes(op.gpu_shapes if on_gpu else CPU_SHAPES) for op in a.ops}
    a.chain = a.chain or (GPU_CHAIN if on_gpu else CPU_CHAIN)
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


def plan(args, peers):
    """[(op, dtype, rows, C, combos, refused, peers)]: every group to time, in order."""
    out = []
    for op in args.ops:
        op_peers = [q for q in peers if q == "copy" or q in op.peers]
        for dtype in args.dtypes:
            for rows, C in args.shapes[op.name]:
                combos, refused = (plan_ours(args.kernels, args.block_sizes, dtype, C, op.norm) if op.kernels
                                   else ([], []))
                out.append((op, dtype, rows, C, combos, refused, op_peers))
    return out


def main(argv=None):
    jax.config.update("jax_enable_x64", True)  # float64 stays float64; before any array is made
    on_gpu = jax.default_backend() == "gpu"
    args = parse_args(argv, on_gpu)
    args.on_gpu = on_gpu
    meta = _term.machine()
    args.dram_gbps, peak_from = dram.peak_gbps(meta["device"], args.dram_gbps)
    print(f"jax_lnbwd {meta['jax_lnbwd']} kernel bench  {meta['date']}  device: {meta['device']}  "
          f"jax {meta['jax']}")
    print(f"ops: {', '.join(op.name for op in args.ops)}; timing: median of {args.reps} runs, each n "
          f"back-to-back calls of a jitted {args.chain}-step chain (run >= {args.min_run_s * 1e3:g} ms), "
          f"divided by n*{args.chain}", flush=True)
    if not on_gpu:
        print("note: on CPU XLA drops the optimization barriers before fusion, so steps may fuse, and "
              "our ops run the C++ reference handlers: a smoke test, not a measurement")
    if args.cpu_sized:
        print(f"note: CPU-sized defaults (shapes {CPU_SHAPES}, chain {CPU_CHAIN}, one call per run); "
              "on a GPU the defaults are the measurement's (--help)")
    print("denominators: %copy = a same-bytes copy's time over ours, measured in this run; %peak = GB/s over "
          + (f"the DRAM's peak, {args.dram_gbps:g} GB/s ({peak_from})" if args.dram_gbps else
             f"the DRAM's peak: none known for {meta['device']} (--dram-gbps or ${dram.ENV})"))

    why_not = available_peers(on_gpu) if any(q in args.peers for q in ("torch", "liger", "pallas")) else {}
    peers = [q for q in args.peers if why_not.get(q) is None]
    for why in dict.fromkeys(why_not.get(q) for q in args.peers if why_not.get(q)):
        skipped = ", ".join(q for q in args.peers if why_not.get(q) == why)
        print(paint(f"peers skipped: {skipped}: {why}", "grey"))
    args.peers = peers  # what the ops' entries (ops.py) may use: those that run here
    args.collector = None
    if args.kernel_time:
        args.collector, how = kernel_time.collector()
        print(paint(f"--kernel-time: {how}" if args.collector else f"--kernel-time: no collector ({how})", "grey"))
    plans = plan(args, peers)
    prog = Progress(sum(len(p[4]) + len(p[6]) + (0 if p[0].kernels else 1) for p in plans),
                    not args.no_progress)
    log = {"failures": [], "refused": []}
    table = []
    meta.update({"argv": sys.argv[1:] if argv is None else list(argv), "ops": [op.name for op in args.ops],
                 "chain": args.chain, "reps": args.reps, "min_run_ms": args.min_run_s * 1e3,
                 "peers": peers, "params": args.params, "l2_mb": args.l2_mb, "dram_gbps": args.dram_gbps,
                 "kernel_time": args.collector,
                 "tolerance": TOLERANCE, "kernel_timings": on_gpu,
                 "kernels": {k: KERNELS[k].name for k in args.kernels}})

    def write_json(complete: bool):
        # Rewritten after every group, so that a run cut short (a time limit on a shared GPU)
        # leaves what it measured: "complete" says whether every group is in.
        meta["torch"] = getattr(sys.modules.get("torch"), "__version__", None)
        with open(os.path.join(args.out, "bench.json"), "w") as fh:
            json.dump({"meta": meta, "complete": complete, "rows": table, **log}, fh, indent=1, default=str)

    if args.out:
        os.makedirs(args.out, exist_ok=True)
    key = jax.random.key(args.seed)
    for i, (op, dtype, rows, C, combos, refused, op_peers) in enumerate(plans):
        for why in refused:
            prog.write(paint(f"refused: {dtype} {rows}x{C} {why}", "grey"))
            log["refused"].append({"op": op.name, "shape": f"{rows}x{C}", "dtype": dtype, "reason": why})
        group = bench_group(op, rows, C, dtype, combos, op_peers, args, jax.random.fold_in(key, i), prog, log)
        table += group
        for r in group:  # ours as soon as the group is done; the full table comes at the end
            if not r["peer"]:
                mark = "" if r["kernel_timing"] else f" {CPU_MARK}"
                prog.write(f"{op.name} {dtype} {rows}x{C} {r['impl']}{mark}: {r['us']:.2f} µs" +
                           (f", {r['pct_copy']:.1f}% of copy" if r["pct_copy"] else "") +
                           (f", {r['pct_peak']:.1f}% of DRAM peak" if r["pct_peak"] else "") +
                           (f", {r['vs_best']:.2f}x the best peer" if r["vs_best"] else ""))
        if args.out:
            write_json(complete=False)
    prog.close()

    text = format_table(table, args.l2_mb, args.dram_gbps) if table else "(nothing was timed)"
    if args.out:
        write_json(complete=True)
        with open(os.path.join(args.out, "bench.txt"), "w") as fh:
            fh.write(f"{meta['date']}  {meta['device']}  jax {meta['jax']}  jax_lnbwd {meta['jax_lnbwd']}\n"
                     f"argv: {' '.join(meta['argv'])}\n\n{text}\n")
        png = os.path.join(args.out, "bench.png")
        title = meta["device"] + ("" if on_gpu else " (CPU: not kernel timings)")
        try:
            made = plot(table, png, title, {op.name: op.title for op in args.ops}) if table else False
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
