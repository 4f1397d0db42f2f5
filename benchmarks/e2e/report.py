"""The e2e bench's outputs: one row per run, the text table and the PNG."""
from __future__ import annotations

import statistics

from .._term import aligner

COLUMNS = """\
  ms/step   median over the rounds of one round's time per step (a round: its steps back to
            back, enough of them to last --round-seconds)
  spread    (slowest round - fastest round) / median, for this run
  ×base     the median over the rounds of the baseline's round time / this run's in the same
            round (> 1: faster than the baseline); in brackets the lowest and highest of them
  ln, +mix  GPU ms per step while kernels made only of the norm's work run (ln for LayerNorm,
            rms for RMSNorm; norm when the table has both), and while those or kernels that fuse
            it with other work run (a lower and an upper bound; kernels running at once count
            once; see trace/summary.py)
  kernel    GPU ms per step in all kernels, memcpys and memsets (summed)
  idle      ms per step the GPU ran nothing inside a step (between its first kernel and its
            last); of --trace-repeats traces, the one whose traced step is the median
  host      ms per step the GPU waited between steps, from one step's last kernel to the next
            one's first: the host launching the next step late (its dispatch, a Python pause),
            not the kernels' doing
  unmap     the share of kernel time matched to no HLO instruction nor library (should be ~0)
  loss      the loss after the last step: every run of a model takes the same steps from the
            same initial parameters, so the variants' losses agree to the compute dtype's rounding
            (the traces take more steps: the table after them shows a later loss)
  n/a       no trace (--trace none, or no collector on this machine)"""

# With --devices N > 1 (data parallel): what the columns above then mean, and three more.
COMM_COLUMNS = """\
  data parallel: ms/step is the step of all GPUs together; ln to idle and the three below are
            per GPU (the mean over the GPUs); loss is the mean over the global batch
  comm      GPU ms per step in collective kernels (NCCL's all-reduce of the gradients, ...)
  overlap   ms per step a collective runs while one of our kernels (lnbwd) runs on the same
            GPU: communication hidden behind our op (0 for variants without our kernels)
  exposed   ms per step a collective runs while no other kernel runs on its GPU: what the
            step waits for communication (the smaller, the better the overlap)"""


def ln_ms(t: dict) -> float:
    """GPU ms per step that layernorm-only kernels occupy (overlaps once; a summary written
    before the busy figures existed gives its sum)."""
    return t.get("ln_busy_ms", t["ln_ms"])


def ln_mixed_ms(t: dict) -> float:
    """The same for layernorm-only and mixed kernels together."""
    return t.get("ln_mixed_busy_ms", t["ln_ms"] + t["mixed_ms"])


# With --qk-norm: the QK-norm's columns (trace/summary.py's qk figures).
QK_COLUMNS = """  qk, +qmix GPU ms per step while kernels made only of the QK-norm's work run (ours, where our
            kernels serve only it), and while those or kernels that fuse it with other work run
            (XLA fuses Flax's QK-norm into the projections' and rotary's kernels: its qk is a
            lower bound, +qmix an upper bound)"""


def has_qk(table) -> bool:
    """Whether any row's trace has the QK-norm's figures (then the table has its columns)."""
    return any("qk_busy_ms" in (r.get("trace") or {}) for r in table or ())


def columns(comm: bool, table: list[dict] | None = None) -> str:
    """The columns' legend; comm: with the data-parallel columns; table: its rows, whose traces
    say whether the QK-norm's columns are there."""
    return COLUMNS + ("\n" + QK_COLUMNS if has_qk(table) else "") + ("\n" + COMM_COLUMNS if comm else "")


SHORT = {"bfloat16": "bf16", "float32": "fp32"}
NORM_COLUMN = {"layernorm": "ln", "rmsnorm": "rms"}


def norm_column(norms) -> str:
    """The name of the norm-only column: the norm's own (ln, rms), or norm for a mix of them."""
    names = {NORM_COLUMN.get(n, n) for n in norms}
    return names.pop() if len(names) == 1 else "norm"


def rows(runs, baseline: str | tuple[str, ...], norms: dict | None = None) -> list[dict]:
    """One dict per run: its timings, its ratio against the baseline variant and its trace.
    baseline: a variant name, or several (one per norm: a LayerNorm model's baseline is not an
    RMSNorm model's); a run's baseline is the one of them that ran its (model, api, dtype).
    norms: {model: its norm's name} (config.py), for the column names."""
    norms = norms or {}
    names = (baseline,) if isinstance(baseline, str) else tuple(baseline)
    base = {(r.model, r.api, r.dtype): r for r in runs if r.variant in names}
    out = []
    for r in runs:
        med = statistics.median(r.times)
        row = {"model": r.model, "api": r.api, "dtype": r.dtype, "variant": r.variant, "norm": norms.get(r.model),
               "baseline": r.variant in names,
               "ms": med * 1e3, "round_ms": [t * 1e3 for t in r.times], "round_steps": r.round_steps,
               "step_estimate_ms": None if r.step_estimate_s is None else r.step_estimate_s * 1e3,
               "spread_pct": 100 * (max(r.times) - min(r.times)) / med,
               "devices": r.devices, "compile_s": r.compile_s, "loss_first": r.losses[0], "loss_last": r.losses[-1],
               "trace": r.trace, "paths": r.paths}
        b = base.get((r.model, r.api, r.dtype))
        if b is not None:  # paired: a round's ratio cancels the drift that slows both runs
            per_round = [bt / t for bt, t in zip(b.times, r.times)]
            row.update(speedup=statistics.median(per_round), speedup_min=min(per_round),
                       speedup_max=max(per_round), speedup_rounds=per_round,
                       speedup_of_medians=statistics.median(b.times) / med)
        out.append(row)
    return out


def format_table(table: list[dict], comm: bool = False, traces: bool = True) -> str:
    """The text table; comm: with the columns comm, overlap and exposed (data parallel);
    traces=False: without the trace's columns (a CPU smoke run: they are GPU quantities)."""
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    qk = has_qk(table)
    head = ("model", "api", "dtype", "variant", "ms/step", "spread", "×base", norm_column(r.get("norm") for r in table),
            "+mix") + (("qk", "+qmix") if qk else ()) + ("kernel", "idle", "host", "unmap", "loss") + (
            ("comm", "overlap", "exposed") if comm else ())
    cells, groups = [], []
    for r in table:
        t = r["trace"] or {}
        ratio = "-" if "speedup" not in r else "base" if r["baseline"] else (
            f"{r['speedup']:.3f} [{r['speedup_min']:.3f}-{r['speedup_max']:.3f}]")
        mixed = None if not t else ln_mixed_ms(t)
        unmap = None if not t else 100 * t["unmapped_ms"] / max(t["kernel_ms"], 1e-12)
        cells.append((r["model"], r["api"], r["dtype"], r["variant"], f(r["ms"], ".3f"),
                      f"{r['spread_pct']:.1f}%", ratio, f(ln_ms(t) if t else None, ".3f"), f(mixed, ".3f")) +
                     ((f(t.get("qk_busy_ms"), ".3f"), f(t.get("qk_mixed_busy_ms"), ".3f")) if qk else ()) +
                     (f(t.get("kernel_ms"), ".2f"), f(t.get("idle_ms"), ".3f"), f(t.get("between_ms"), ".3f"),
                      "n/a" if unmap is None else f"{unmap:.0f}%", f"{r['loss_last']:.4g}") +
                     (tuple(f(t.get(k), ".3f") for k in ("comm_ms", "overlap_ms", "comm_exposed_ms"))
                      if comm else ()))
        groups.append((r["model"], r["api"], r["dtype"]))
    if not traces:   # keep model .. ×base and loss
        keep = list(range(7)) + [head.index("loss")]
        head = tuple(head[i] for i in keep)
        cells = [tuple(c[i] for i in keep) for c in cells]
    line = aligner(head, cells, left=range(4))
    lines = [line(head), "-" * len(line(head))]
    for i, c in enumerate(cells):
        if i and groups[i] != groups[i - 1]:
            lines.append("")
        lines.append(line(c))
    return "\n".join(lines)


def plot(table: list[dict], path: str, title: str, device: str = "GPU") -> bool:
    """e2e.png: step time per run (bars, the rounds' range as whiskers) and, where traced, each
    run's GPU time per step split into ln, mixed, other kernels and idle."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    traced = [r for r in table if r["trace"]]
    def label(r):
        return f"{r['model']} {r['api']} {SHORT.get(r['dtype'], r['dtype'])}\n{r['variant']}"
    labels = [label(r) for r in table]
    fig, axes = plt.subplots(2 if traced else 1, 1, squeeze=False,
                             figsize=(max(8.0, 0.9 * len(table) + 2), 8 if traced else 4.2))
    ax = axes[0, 0]
    variants = list(dict.fromkeys(r["variant"] for r in table))
    colour = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    ms = [r["ms"] for r in table]
    lo = [r["ms"] - min(r["round_ms"]) for r in table]
    hi = [max(r["round_ms"]) - r["ms"] for r in table]
    ax.bar(range(len(table)), ms, color=[colour[r["variant"]] for r in table], yerr=[lo, hi], capsize=3)
    for i, r in enumerate(table):
        if "speedup" in r and not r["baseline"]:
            ax.annotate(f"{r['speedup']:.3f}x", (i, max(r["round_ms"])), ha="center", va="bottom",
                        fontsize="x-small")
    ax.set_xticks(range(len(table)))
    ax.set_xticklabels(labels, fontsize="x-small")
    ax.set_ylabel("ms per step (median, rounds' range)")
    ax.set_title(title)
    if traced:  # side by side: what layernorm costs is a few % of a step, too thin in a stack
        ax = axes[1, 0]
        norm = norm_column(r.get("norm") for r in traced)
        parts = [(norm, ln_ms, "C3"), (f"{norm} + mixed", ln_mixed_ms, "C1"),
                 ("idle", lambda t: t["idle_ms"], "0.6")]
        if any(r["trace"].get("devices", 1) > 1 for r in traced):  # data parallel: per device
            parts += [("comm overlapping ours", lambda t: t["overlap_ms"], "C2"),
                      ("comm exposed", lambda t: t["comm_exposed_ms"], "C4")]
        w = 0.8 / len(parts)
        for j, (name, get, c) in enumerate(parts):
            ax.bar([i + (j - (len(parts) - 1) / 2) * w for i in range(len(traced))],
                   [get(r["trace"]) for r in traced], w, label=name, color=c)
        ax.set_xticks(range(len(traced)))
        ax.set_xticklabels([label(r) for r in traced], fontsize="x-small")
        ax.set_ylabel(f"{device} ms per step" + (" per device" if len(parts) > 3 else "") + " (traced)")
        ax.legend(fontsize="small", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
