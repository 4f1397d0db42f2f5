"""Weak scaling from one device to N: each data-parallel run beside the same run on one device.

With ``--devices N --scaling`` every run is built a second time on one device, with the same
batch per device, and the two are timed in alternation, round after round. Per run the report
gives one device's ms per step, N devices' ms per step, and the efficiency t1 / tN, the median of
the per-round ratios: 1.00 means N devices do N times the work in the same time; what lowers it
is the all-reduce of the gradients (the norms' own psum of dweight included) and the devices'
waits for each other.
"""
from __future__ import annotations

import statistics


def measure(runs, plan, rounds: int, build, run_steps, seed: int) -> list[dict]:
    """One row per run of `runs` (built for N devices): its one-device twin built from the matching
    `plan` entry (cfg, api, dtype, variant), then `rounds` alternating timings of the pair."""
    by_label = {f"{cfg.name} {api} {dtype} {variant.name}": (cfg, api, dtype, variant)
                for cfg, api, dtype, variant in plan}
    pairs = []
    for run in runs:
        cfg, api, dtype, variant = by_label[run.label]
        one = build(cfg, api, variant, dtype, seed, devices=1)
        run_steps(one, 2)   # warm up, as the N-device run was
        pairs.append((run, one))
    rows = []
    for run, one in pairs:
        t1, tn = [], []
        for _ in range(rounds):
            t1.append(run_steps(one, run.round_steps) / run.round_steps)
            tn.append(run_steps(run, run.round_steps) / run.round_steps)
        rows.append({"run": run.label, "devices": run.devices, "one_ms": statistics.median(t1) * 1e3,
                     "many_ms": statistics.median(tn) * 1e3,
                     "efficiency": statistics.median(a / b for a, b in zip(t1, tn))})
    return rows


def format_rows(rows: list[dict]) -> str:
    """The scaling table: run, 1 device ms, N devices ms, efficiency t1 / tN."""
    if not rows:
        return ""
    n = rows[0]["devices"]
    width = max(len(r["run"]) for r in rows)
    head = f"{'weak scaling, batch per device':<{width}}  1 device ms  {n} devices ms  t1/t{n}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['run']:<{width}}  {r['one_ms']:11.3f}  {r['many_ms']:{10 + len(str(n))}.3f}"
                     f"  {r['efficiency']:{3 + len(str(n))}.3f}")
    return "\n".join(lines)
