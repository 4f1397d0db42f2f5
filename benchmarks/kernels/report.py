"""The kernel bench's outputs: the text table and the PNG."""
from __future__ import annotations

from .._term import aligner

CPU_MARK = "[cpu-ref]"
CPU_NOTE = (f"{CPU_MARK}: on CPU our ops run C++ reference handlers (every backward kernel id the "
            "same one); these rows time that reference, not a kernel")


def format_table(rows, l2_mb: float = 60, dram_gbps: float | None = None) -> str:
    """The plain-text table: one line per timed entry, a blank line between (op, shape, dtype)
    groups. An op column when there are several ops, a params column when some weight/bias
    dtype differs from x's; rows that are not kernel timings (ours on CPU) carry CPU_MARK, and
    shapes whose bytes fit in the L2 an "L2" mark, each with a footnote. Two denominators:
    %copy (a same-bytes copy in this run) and %peak (the DRAM's peak, dram_gbps GB/s)."""
    def f(v, fmt, suffix=""):
        return "-" if v is None else format(v, fmt) + suffix
    ops = len({r.get("op") for r in rows}) > 1
    params = any(r.get("params", r["dtype"]) != r["dtype"] for r in rows)
    kern = any("kernel_us" in r for r in rows)   # --kernel-time
    head = (("op",) * ops + ("shape", "dtype") + ("params",) * params +
            ("impl", "µs") + ("kern µs",) * kern + ("GB/s", "%copy", "%peak", "×xla", "×best"))
    cells, groups = [], []
    for r in rows:
        impl = r["impl"] if r.get("kernel_timing", True) else f"{r['impl']} {CPU_MARK}"
        shape = r["shape"] + (" L2" if r.get("fits_l2") else "")
        cells.append(((r.get("op", ""),) * ops + (shape, r["dtype"]) + (r.get("params", r["dtype"]),) * params +
                      (impl, f(r["us"], ".2f")) + (f(r.get("kernel_us"), ".2f"),) * kern +
                      (f(r["gbps"], ".1f"), f(r["pct_copy"], ".1f", "%"), f(r.get("pct_peak"), ".1f", "%"),
                       f(r["vs_xla"], ".2f", "x"), f(r["vs_best"], ".2f", "x"))))
        groups.append((r.get("op"), r["shape"], r["dtype"]))
    line = aligner(head, cells, left=range(head.index("µs")))   # names left, figures right
    lines = [line(head), "-" * len(line(head))]
    for i, c in enumerate(cells):
        if i and groups[i] != groups[i - 1]:
            lines.append("")
        lines.append(line(c))
    peak = f"{dram_gbps:g} GB/s" if dram_gbps else "unknown here: -"
    lines += ["", f"%copy: a same-bytes device copy's time over this row's (this run's ceiling); "
                  f"%peak: GB/s over the DRAM's peak ({peak}; --dram-gbps)"]
    if not all(r.get("kernel_timing", True) for r in rows):
        lines += ["", CPU_NOTE]
    if kern:
        lines += ["", "kern µs: the step's kernels alone, from one traced call of its chain (--kernel-time); "
                      "µs - kern µs is what the step spends outside its kernels"]
    if any(r.get("fits_l2") for r in rows):
        lines += ["", f"L2: the op's bytes fit in the {l2_mb:g} MB L2 (--l2-mb), or its copy ran faster than "
                      "the DRAM's peak (--dram-gbps): steps of a chain find their data there, so %copy "
                      "may pass 100% and means little"]
    return "\n".join(lines)


def plot(rows, path: str, title: str, op_titles: dict | None = None) -> bool:
    """bench.png: per (op, dtype) a panel of GB/s bars grouped by shape, the copy speed a
    dashed line; op_titles: {op name: its title in the panels}."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = list(dict.fromkeys((r.get("op"), r["dtype"]) for r in rows))
    most = max(len({r["shape"] for r in rows if (r.get("op"), r["dtype"]) == k}) for k in panels)
    most_impls = max(len({r["impl"] for r in rows if (r.get("op"), r["dtype"]) == k}) for k in panels)
    wide = max(8.0, 2 + 1.1 * most * max(1, most_impls - 1) ** 0.5)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, figsize=(wide, 3.8 * len(panels)))
    for ax, (op, dtype) in zip(axes[:, 0], panels):
        mine = [r for r in rows if (r.get("op"), r["dtype"]) == (op, dtype)]
        shapes = list(dict.fromkeys(r["shape"] for r in mine))
        impls = list(dict.fromkeys(r["impl"] for r in mine if r["impl"] != "copy"))
        width = 0.8 / max(1, len(impls))
        gbps = {(r["shape"], r["impl"]): r["gbps"] for r in mine}
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
        ax.set_title(f"{(op_titles or {}).get(op, op or 'layernorm backward')}, {title}: {dtype}")
        ax.legend(fontsize="small", ncol=min(6, len(impls) + 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
