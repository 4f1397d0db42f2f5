"""``--kernels N``: after the table, what each run's kernels are and where its kernel time
moved against its baseline.

For every traced run: its kernel time per step by kind (trace/classify.py's kind rule: ours, gemm,
attention, reduce fusion, loop fusion, copy/memset, comm, other), its N costliest kernels of
the ln and mixed classes, and its N costliest XLA fusions of the other class (the fusions
outside layernorm, which a variant can still change: XLA fuses the work around a LayerNorm
differently when the LayerNorm is a custom call). Then, for every run that is not a baseline,
the per-kind difference against the baseline of the same (model, api, dtype), largest change
first, and the difference in idle time: a reader sees which kinds a variant's step gained or lost.
Then the matmul kernels whose time changed most (XLA autotunes each compiled step on its own,
so a variant's identical matmuls can get other cuBLAS algorithms) and the idle time's change
by the kind of kernel after each gap.
"""
from __future__ import annotations

import re

# XLA's own matmul kernels (Triton: gemm_fusion_dot_240) are named after their HLO fusion, whose
# number differs from one compiled step to another: they are compared by the name without it.
_FUSION_NUMBER = re.compile(r"^(\w*fusion\w*?)(?:[._]\d+)+$")

def label(row: dict) -> str:
    return f"{row['model']} {row['api']} {row['dtype']} {row['variant']}"


def kinds_line(kinds: dict) -> str:
    """The nonzero kinds, largest first: "gemm 20.123, loop fusion 5.020, ..." (ms per step)."""
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v)


def diff_line(row: dict, base: dict) -> str:
    """One run's kernel time per kind minus its baseline's, in ms per step, largest change first."""
    a, b = row["trace"]["kinds"], base["trace"]["kinds"]
    d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in dict.fromkeys([*b, *a]) if a.get(k) or b.get(k)}
    parts = ", ".join(f"{k} {v:+.3f}" for k, v in sorted(d.items(), key=lambda kv: -abs(kv[1])))
    idle = row["trace"]["idle_ms"] - base["trace"]["idle_ms"]
    host = ("" if "between_ms" not in row["trace"] or "between_ms" not in base["trace"] else
            f"; host {row['trace']['between_ms'] - base['trace']['between_ms']:+.3f}")
    return (f"{label(row)} vs {base['variant']}: kernel {sum(d.values()):+.3f} ms per step: {parts}; "
            f"idle {idle:+.3f}{host}")


def idle_line(row: dict, base: dict | None = None) -> str:
    """The run's idle time split by the kind of kernel that starts after each gap: "ours 26.0
    gaps 0.081 ms, ..." per step, largest first; with base, the change against it instead."""
    a = row["trace"].get("idle_after", {})
    if base is None:
        return ", ".join(f"{k} {c:.1f} gaps {ms:.3f}" for k, (c, ms) in
                         sorted(a.items(), key=lambda kv: -kv[1][1]))
    b = base["trace"].get("idle_after", {})
    none = (0, 0.0)
    d = {k: (a.get(k, none)[0] - b.get(k, none)[0], a.get(k, none)[1] - b.get(k, none)[1])
         for k in dict.fromkeys([*b, *a])}
    return ", ".join(f"{k} {c:+.1f} gaps {ms:+.3f}" for k, (c, ms) in sorted(d.items(), key=lambda kv: -abs(kv[1][1])))


def gemm_lines(row: dict, base: dict, n: int) -> list[str]:
    """The n matmul kernels whose time per step changed most against the baseline, each as
    "  +0.120 ms  launches 12.0 -> 24.0  name": a variant whose identical matmuls got other
    algorithms (XLA autotunes each compiled step on its own) shows them here. XLA's gemm
    fusions are summed by their name without the HLO number (_FUSION_NUMBER)."""
    def by_name(gemms):
        out: dict[str, tuple[float, float]] = {}
        for _, name, c, ms in gemms:
            key = _FUSION_NUMBER.sub(r"\1", name)
            c0, ms0 = out.get(key, (0, 0.0))
            out[key] = (c0 + c, ms0 + ms)
        return out
    a, b = by_name(row["trace"].get("gemms", [])), by_name(base["trace"].get("gemms", []))
    d = sorted(((a.get(k, (0, 0.0))[1] - b.get(k, (0, 0.0))[1], k) for k in {*a, *b}), key=lambda t: -abs(t[0]))
    return [f"  {dms:+.3f} ms  launches {b.get(k, (0, 0))[0]:.1f} -> {a.get(k, (0, 0))[0]:.1f}  {k[:90]}"
            for dms, k in d[:n] if abs(dms) >= 0.0005]


def _kernels(entries) -> list[str]:
    width = max((len(e[0]) for e in entries), default=0)
    return [f"  {c:{width}} {n:6.1f} {ms:7.3f}  {name[:100]}" for c, name, n, ms in entries]


def text(table: list[dict], n: int) -> str:
    """The --kernels report for report.rows()'s rows (runs without a trace are left out)."""
    traced = [r for r in table if r.get("trace") and "kinds" in r["trace"]]
    base = {(r["model"], r["api"], r["dtype"]): r for r in traced if r["baseline"]}
    out = []
    for r in traced:
        t = r["trace"]
        out += ["", f"{label(r)}: kernel ms per step by kind: {kinds_line(t['kinds'])}",
                f" its {n} costliest ln and mixed kernels (launches, ms per step)", *_kernels(t.get("top", [])),
                f" its {n} costliest XLA fusions outside layernorm (class other)",
                *_kernels(t.get("top_other", []))]
        if "idle_after" in t:
            out += [f" idle {t['idle_ms']:.3f} ms per step, by the kernel after each gap: {idle_line(r)}",
                    " its longest gaps (us, before -> after)",
                    *(f"  {us:8.1f}  {kb} -> {ka}  ({nb[:50]} -> {na[:50]})"
                      for us, kb, ka, nb, na in t.get("longest_gaps", [])[:n])]
    # Each variant with the baseline of its (model, api, dtype), where that one was traced.
    pairs = [(r, b) for r in traced if not r["baseline"]
             and (b := base.get((r["model"], r["api"], r["dtype"]))) is not None]
    diffs = [diff_line(r, b) for r, b in pairs]
    if diffs:
        out += ["", "kernel time per step against the baseline, by kind (ms, largest change first):", *diffs]
    gemm_diffs = []
    for r, b in pairs:
        if "gemms" in r["trace"] and "gemms" in b["trace"]:
            gemm_diffs += [f"{label(r)} vs {b['variant']}:", *(gemm_lines(r, b, n) or ["  (the same matmul kernels)"])]
    if gemm_diffs:
        out += ["", "matmul kernels against the baseline, largest change in ms per step first:", *gemm_diffs]
    idles = [f"{label(r)} vs {b['variant']}: {idle_line(r, b)}" for r, b in pairs if "idle_after" in r["trace"]]
    if idles:
        out += ["", "idle time per step against the baseline, by the kernel after each gap (gaps, ms):", *idles]
    return "\n".join(out)
