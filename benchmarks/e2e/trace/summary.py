"""One trace's figures per step and per device, and the choice among a run's repeated traces.

Per step and per device (n traced steps, back to back, on D devices; every activity carries
its device: torch's "device" arg, jax's GPU plane, or a CPU thunk's device_ordinal):
  kernel   the sum of kernel, memcpy and memset durations / n / D
  busy     the union of each device's intervals, summed over the devices / n / D (overlapping
           kernels counted once)
  idle     (last end - first start - union - between), per device, summed / n / D: time a
           GPU ran nothing inside the steps. Copies between the host and the GPU are left out
           of it: the host asks for them (the loss read after the last step, which waits for
           the Python loop), so they would add the host's time after the steps to every variant.
  between  the gaps from one step's last activity to the next step's first, summed / (n - 1)
           / D: the GPU waiting for the host to launch the next step (its dispatch, a pause of
           the Python process, the profiler's buffer). It belongs to the host, not to any
           kernel, so it is kept out of idle. Every step launches the same activities, so step
           k (k = 1..n-1) starts at activity k * (activities / n) in start order; a trace whose
           count is not a multiple of n (an activity lost) counts every gap as idle.
  idle_after, idle_before
           that idle time split over its gaps by the kind of the activity that starts after
           the gap (what the GPU waited for) and of the one the gap follows: {kind: [gaps per
           step, ms per step]}. A kernel launched on its own (not in a CUDA graph, or at a
           graph's edge) shows a gap of a few microseconds in front of it.
  longest_gaps
           the longest gaps of the trace: [us, kind before, kind after, name before, name after]
  ln_busy, ln_mixed_busy
           the union of the ln kernels' intervals, and of the ln and mixed ones, like busy:
           the GPU time layernorm occupies. Kernels that overlap count once: our finalize
           kernel is launched early (programmatic dependent launch) and waits on the GPU for
           the kernel before it, so its own duration also covers that kernel's run; the sums
           (ln, mixed) count such time twice.
  qk_busy_ms, qk_mixed_busy_ms
           the same for the QK-norm (classify.py: its scope's classes, qk_classes), where the
           module has any QK-norm work; our kernels count for it where our_scope says so, and
           then not for layernorm.
With one device these are the whole GPU's figures. Collective kernels (NCCL's, or XLA's own
all-reduce, reduce-scatter, all-gather, all-to-all, collective-permute; matched by kernel
name or HLO op, before any other rule) form a class of their own, comm, and give:
  comm          their summed durations / n / D
  overlap       the time a collective runs while one of OUR kernels (lnbwd in the name, or a
                custom call to a jax_lnbwd target in the jax trace) runs on the same device,
                on another stream: the all-reduce hidden behind our backward / n / D
  comm_exposed  the time a collective runs while no other kernel runs on its device: what
                the step waits for communication / n / D
All three are 0 on one device. A collective kernel starts when its own GPU reaches it and
ends when every GPU has sent its share: its time includes the wait for the slowest GPU, so
comm and comm_exposed also hold the GPUs' skew, not only the transfer.
"""
from __future__ import annotations

from collections import defaultdict

from .classify import HOST_COPY, KINDS, attribute, kind
from .intervals import gaps, length, merge, overlap, step_starts


def summarize(events, classes: dict[str, str], steps: int, top: int = 0,
              ours: frozenset[str] = frozenset(), qk_classes: dict[str, str] | None = None,
              ours_scope: str = "ln") -> dict:
    """Per-step, per-device times in ms (see the module doc) from one trace of `steps`
    back-to-back steps. events: (name, hlo_op, start_ns, dur_ns[, device, stream]) (device 0
    when absent); ours: our_calls() of the module. "kinds": {kind: ms per step} for every
    kind of KINDS (they sum to kernel_ms). With top > 0 also "top": the `top` costliest
    kernels of the ln and mixed classes, each as [class, kernel name, launches per step, ms
    per step], for reading what a variant runs, "top_other": the `top` costliest XLA
    fusions of the other class, each as [kind, kernel name, launches per step, ms per step],
    and "gemms": every matmul kernel, by kernel name (the name is the library's algorithm:
    tile, stages, operand layouts), as ["gemm", name, launches per step, ms per step],
    costliest first, for comparing the algorithms two variants' identical matmuls got.
    qk_classes: classify_hlo(hlo, QK_SCOPE), and ours_scope: our_scope(hlo) (the QK-norm's
    figures; see the module doc)."""
    if not events:
        return {}
    per = defaultdict(float)
    count = defaultdict(int)
    kinds = dict.fromkeys(KINDS, 0.0)
    by_kernel = defaultdict(lambda: [0, 0.0])  # (class, name) -> [launches, ns]
    fusions = defaultdict(lambda: [0, 0.0])    # (kind, name) -> [launches, ns], other-class fusions
    gemms = defaultdict(lambda: [0, 0.0])      # ("gemm", kernel name) -> [launches, ns]
    # Each device's intervals: all, collectives, ours, everything but collectives, and (with
    # kind and name) everything but host copies, whose gaps are the idle time.
    spans = defaultdict(lambda: {"all": [], "comm": [], "ours": [], "busy": [], "ln": [], "lnmix": [],
                                 "qk": [], "qkmix": [], "in_steps": []})
    qk = bool(qk_classes) and any(c != "other" for c in qk_classes.values())
    for name, op, start, dur, *where in events:
        cls = attribute(name, op, classes, "other" if ours_scope == "qk" else "ln")
        per[cls] += dur
        count[cls] += 1
        kd = kind(name, op, ours, xla=cls in ("ln", "mixed", "other"))
        kinds[kd] += dur
        if cls in ("ln", "mixed"):
            k = by_kernel[(cls, op or name)]
        elif cls == "other" and kd in ("reduce fusion", "loop fusion"):
            k = fusions[(kd, op or name)]
        elif kd == "gemm":
            k = gemms[(kd, name)]
        else:
            k = [0, 0.0]
        k[0] += 1
        k[1] += dur
        dev = spans[where[0] if where else 0]
        iv = (start, start + dur)
        dev["all"].append(iv)
        if not HOST_COPY.search(name):
            dev["in_steps"].append((*iv, kd, name))
        dev["comm" if cls == "comm" else "busy"].append(iv)
        if kd == "ours":
            dev["ours"].append(iv)
        if cls in ("ln", "mixed"):
            dev["lnmix"].append(iv)
            if cls == "ln":
                dev["ln"].append(iv)
        if qk and (qcls := attribute(name, op, qk_classes, "ln" if ours_scope == "qk" else "other")) in ("ln", "mixed"):
            dev["qkmix"].append(iv)   # "ln" in the QK-norm's classes: all of it QK-norm's work
            if qcls == "ln":
                dev["qk"].append(iv)
    union = idle = between = overlapped = exposed = ln_busy = lnmix_busy = qk_busy = qkmix_busy = 0.0
    after, before = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    longest = []
    for dev in spans.values():
        firsts = step_starts(dev["in_steps"], steps)
        for g in gaps(dev["in_steps"]):  # the holes between the first start and the last end
            if g[5] in firsts:   # in front of a step's first activity: the host's
                between += g[0]
                continue
            idle += g[0]
            for table, k in ((before, g[1]), (after, g[2])):
                table[k][0] += 1
                table[k][1] += g[0]
            longest.append(g[:5])
        ln_busy += length(merge(dev["ln"]))
        lnmix_busy += length(merge(dev["lnmix"]))
        qk_busy += length(merge(dev["qk"]))
        qkmix_busy += length(merge(dev["qkmix"]))
        union += length(merge(dev["all"]))
        comm = merge(dev["comm"])
        overlapped += overlap(comm, merge(dev["ours"]))
        exposed += length(comm) - overlap(comm, merge(dev["busy"]))
    n = len(spans)
    ms = 1e-6 / steps / n
    return {"steps": steps, "devices": n, "kernels": len(events) / steps / n,
            "kernel_ms": sum(per.values()) * ms, "busy_ms": union * ms, "idle_ms": idle * ms,
            "between_ms": between * 1e-6 / max(steps - 1, 1) / n,
            **{f"{c}_ms": per[c] * ms for c in ("ln", "mixed", "other", "unmapped", "comm")},
            "ln_busy_ms": ln_busy * ms, "ln_mixed_busy_ms": lnmix_busy * ms,
            **({"qk_busy_ms": qk_busy * ms, "qk_mixed_busy_ms": qkmix_busy * ms} if qk else {}),
            "overlap_ms": overlapped * ms, "comm_exposed_ms": exposed * ms,
            "ln_kernels": count["ln"] / steps / n, "mixed_kernels": count["mixed"] / steps / n,
            "kinds": {k: v * ms for k, v in kinds.items()},
            "idle_after": {k: [c / steps / n, ns * ms] for k, (c, ns) in after.items()},
            "idle_before": {k: [c / steps / n, ns * ms] for k, (c, ns) in before.items()},
            "longest_gaps": [[g * 1e-3, *rest] for g, *rest in sorted(longest, reverse=True)[:max(top, 3)]],
            **({"top": costliest(by_kernel, top, steps * n, ms),
                "top_other": costliest(fusions, top, steps * n, ms),
                "gemms": costliest(gemms, len(gemms), steps * n, ms)} if top else {})}


def step_span_ms(summary: dict | None) -> float | None:
    """A traced step's GPU span (ms): its kernels' union plus the idle gaps between them; None
    for no trace, or one written before the bench recorded both."""
    if not summary or "busy_ms" not in summary or "idle_ms" not in summary:
        return None
    return summary["busy_ms"] + summary["idle_ms"]


def median_summary(summaries: list[dict]) -> dict:
    """Of several traces of one run, the one whose traced step (busy + idle) is the median:
    a single trace of a few steps can catch a host hiccup (a pause of the Python process, the
    profiler's own buffer flush) that shows as idle time of one variant only. The others'
    spans are kept under "spans_ms"."""
    done = sorted((s for s in summaries if s), key=step_span_ms)
    if not done:
        return {}
    return {**done[len(done) // 2], "repeats": len(done),
            "spans_ms": [step_span_ms(s) for s in done]}


def costliest(kernels: dict, top: int, per: int, ms: float) -> list:
    """[[class or kind, name, launches per step, ms per step]] of the `top` costliest of
    {(class or kind, name): [launches, ns]}, costliest first; per: steps x devices."""
    return [[c, name, k / per, ns * ms] for (c, name), (k, ns) in
            sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]]
