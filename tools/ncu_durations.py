"""Kernel time alone, per kernel name, from ncu's CSV of gpu__time_duration.

A step of the kernel bench is the kernel's time plus what the framework adds per call (the launch,
the command buffer's node, the gap to the next kernel). ncu times the kernel alone, so the two
together split a step: run ncu over the bench's chain, then this.

    ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \\
        -k regex:forward_rows --launch-skip 10 --launch-count 20 \\
        python3 -m benchmarks.kernels --op rmsnorm_fwd --dtypes bfloat16 --shapes 16384x4096 \\
        --peers copy --reps 1 --min-run-ms 1 --no-progress > ncu.csv
    python3 tools/ncu_durations.py ncu.csv

--cache-control none leaves the L2 as the chain's previous step left it (ncu's default flushes it
before every kernel); --clock-control none keeps the GPU's own clocks (the default locks them at
base). ncu's own measurement adds about 1.5 µs to every kernel (an H200 one-element fill measures
1.7-2.1 µs), the same for every implementation: compare kernels, not steps.
"""
from __future__ import annotations

import csv
import io
import statistics
import sys

METRIC = "gpu__time_duration.sum"
_SCALE_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def durations(text: str) -> dict[str, list[float]]:
    """Kernel name (without its argument list) -> each launch's duration in µs, in launch order.
    Lines that are not CSV rows (the program's own output, ncu's ==PROF== lines) are skipped."""
    rows = list(csv.reader(io.StringIO("\n".join(l for l in text.splitlines() if l.startswith('"')))))
    if not rows:
        return {}
    head = rows[0]
    name, metric, value, unit = (head.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
    out: dict[str, list[float]] = {}
    for r in rows[1:]:
        if len(r) <= max(name, metric, value, unit) or r[metric] != METRIC:
            continue
        if r[unit] not in _SCALE_US:
            raise ValueError(f"ncu_durations: unknown unit {r[unit]!r} of {METRIC}")
        us = float(r[value].replace(",", "")) * _SCALE_US[r[unit]]
        out.setdefault(without_arguments(r[name]), []).append(us)
    return out


def without_arguments(kernel: str) -> str:
    """A kernel's name without its trailing argument list: "f<1, T>(Args<T2>, int)" -> "f<1, T>"."""
    kernel = kernel.strip()
    if not kernel.endswith(")"):
        return kernel
    depth = 0
    for i in range(len(kernel) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(kernel[i], 0)
        if depth == 0:
            return kernel[:i].rstrip()
    return kernel


def table(by_name: dict[str, list[float]]) -> str:
    """One line per kernel, the most launched first: launches, median and least µs."""
    lines = []
    for n, us in sorted(by_name.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"{n[:72]:72s} n={len(us):4d}  median {statistics.median(us):8.2f} µs  min {min(us):8.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 tools/ncu_durations.py NCU_CSV  (- for standard input)", file=sys.stderr)
        return 2
    text = sys.stdin.read() if argv[0] == "-" else open(argv[0]).read()
    by_name = durations(text)
    print(table(by_name) if by_name else f"no {METRIC} rows in {argv[0]}")
    return 0 if by_name else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
