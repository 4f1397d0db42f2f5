"""The kernel bench's outputs: the text table and the PNG."""
from __future__ import annotations

from .._term import aligner

CPU_MARK = "[cpu-ref]"
CPU_NOTE = (f"{CPU_MARK}: on CPU every kernel id runs the same C++ reference handler; these rows "
            "time that reference, not a kernel")


def format_table(rows) -> str:
    """The plain-text table: one line per timed entry, a blank line between (shape, dtype)
    groups; rows that are not kernel timings (our rows on CPU) carry CPU_MARK and a footnote."""
    def f(v, fmt, suffix=""):
        return "-" if v is None else format(v, fmt) + suffix
    head = ("shape", "dtype", "impl", "µs", "GB/s", "%copy", "×xla", "×best")
    cells, groups = [], []
    for r in rows:
        impl = r["impl"] if r.get("kernel_timing", True) else f"{r['impl']} {CPU_MARK}"
        cells.append((r["shape"], r["dtype"], impl, f(r["us"], ".2f"), f(r["gbps"], ".1f"),
                      f(r["pct_copy"], ".1f", "%"), f(r["vs_xla"], ".2f", "x"), f(r["vs_best"], ".2f", "x")))
        groups.append((r["shape"], r["dtype"]))
    line = aligner(head, cells, left=range(3))
    lines = [line(head), "-" * len(line(head))]
    for i, c in enumerate(cells):
        if i and groups[i] != groups[i - 1]:
            lines.append("")
        lines.append(line(c))
    if not all(r.get("kernel_timing", True) for r in rows):
        lines += ["", CPU_NOTE]
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
