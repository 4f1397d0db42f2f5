"""The e2e bench's output, for cli.py: the table as printed (and the byte floor, floor.py), --out's
files (e2e.txt, e2e.json, e2e.png) and the run's wall-seconds line."""
from __future__ import annotations

import json
import os
import sys

import jax

from .._term import paint
from . import floor, report, scaling


def seconds(meta) -> str:
    return "wall seconds: " + ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in meta["seconds"].items())


def emit(runs, args, meta, traced: bool, floors=None, kinds: str = ""):
    """Prints the table (and the byte floor, floor.py) and writes --out's files; called after
    the rounds (the timings are safe even if a trace then fails or takes the process down)
    and again after the traces. `kinds`: --kernels' breakdown (printed already), which e2e.txt
    also keeps."""
    table = report.rows(runs, args.baselines, {c.name: c.norm for c in args.configs})
    text = report.format_table(table, comm=args.devices > 1)
    paths = "\n\nwhich path each run's norms took (jax_lnbwd.dispatch: ffi = our kernel, jnp = XLA's fusion):\n" + \
        "\n".join(f"  {r.label}: {r.paths}" for r in runs)
    text += paths
    if meta.get("scaling"):
        text += "\n\n" + scaling.format_rows(meta["scaling"])
    fl = floor.format_block(floor.against(floors, table)) if floors else ""
    if jax.default_backend() != "gpu":
        # Off a GPU: one short table, once, after the traces; the byte floor, the trace columns and
        # their legend are GPU quantities (e2e.txt and e2e.json still keep everything).
        if traced:
            print()
            print("CPU smoke run: every variant compiled and ran (their losses should agree); the times are a CPU's, "
                  "not a measurement (run it on a GPU for one)")
            print(report.format_table(table, comm=args.devices > 1, traces=False) + paths)
            if meta.get("scaling"):
                print("\n" + scaling.format_rows(meta["scaling"]))
    else:
        print()
        if not traced:
            print("step times (the trace columns say n/a until the traces, which come next):")
        print(text)
        if traced:
            print()
            print(report.columns(args.devices > 1, table))
        if fl:
            print()
            print(fl + ("\n" + floor.LEGEND if traced else ""))
    if meta["failures"]:
        print(paint(f"{len(meta['failures'])} runs failed and are missing (above)", "red"))
    if not args.out:
        return table
    meta = {**meta, "complete": traced, "torch": getattr(sys.modules.get("torch"), "__version__", None)}
    devices = meta["device"] + (f" x{args.devices}, data parallel" if args.devices > 1 else "")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "e2e.json"), "w") as fh:
        json.dump({"meta": meta, "rows": table, "floor": floors or []}, fh, indent=1, default=str)
    with open(os.path.join(args.out, "e2e.txt"), "w") as fh:
        fh.write(f"{meta['date']}  {devices}  jax {meta['jax']}  jax_lnbwd {meta['jax_lnbwd']}\n"
                 f"argv: {' '.join(meta['argv'])}\n\n{text}\n\n{report.columns(args.devices > 1, table)}\n" +
                 (f"\n{fl}\n{floor.LEGEND}\n" if fl else "") + (f"\n{kinds}\n" if kinds else ""))
    title = f"training step, {devices}" + ("" if jax.default_backend() == "gpu" else " (CPU smoke test)")
    try:
        made = report.plot(table, os.path.join(args.out, "e2e.png"), title,
                           "GPU" if jax.default_backend() == "gpu" else "CPU")
    except Exception as e:  # a broken plot must not cost the run's numbers
        made = False
        print(paint(f"e2e.png failed: {type(e).__name__}: {e}", "red"))
    print(f"wrote {args.out}/e2e.txt, e2e.json" + (" and e2e.png" if made else
          " (no e2e.png: pip install -e '.[bench]' for matplotlib)") + ("" if traced else "; traces next"))
    return table
