"""Where a step's GPU time goes: a kernel-level trace of a few steps, attributed to layernorm.

Collecting (``--trace``)
  torch   CUPTI through torch.profiler (CUDA activity only) in this process: it records every
          kernel, memcpy and memset on the GPU, JAX's included, with their kernel names. XLA does
          not know it is being traced, so the step runs as it does untraced (CUDA graphs and all).
  jax     jax.profiler: XLA's own tracer. Each kernel comes with the HLO instruction that
          launched it (the "hlo_op" stat), so no name matching is needed; XLA may run the step
          differently while it traces (it can turn off command buffers, which adds launch gaps:
          compare idle times across variants of one trace kind only). On CPU this collects
          XLA's per-instruction tasks ("thunks") instead of kernels: that checks the tool, it
          measures nothing about a GPU.
  auto    torch on a GPU where torch imports and sees CUDA, else jax.

Attribution rule
  Every add & norm of the models runs under ``jax.named_scope("e2e_layernorm")``. JAX keeps
  the scope in each HLO operation's metadata (op_name) through jvp and transpose, so the
  forward, the backward and the weight-gradient sums of each LayerNorm, and the residual add
  in front of it and its gradient, all carry it. In the compiled step, an instruction that
  launches a kernel (a fusion, a custom call, a copy) is
    ln      if every operation in it (a fusion's fused operations included) carries the scope;
    mixed   if some do: XLA fused layernorm work with other work (a matmul's bias add or the
            GELU before a LayerNorm, a gradient add after it);
    other   if none do.
  Kernels are matched to instructions by the trace's hlo_op where there is one, else by name:
  XLA names a fusion's kernel after the instruction ("loop_add_fusion.3" -> loop_add_fusion_3).
  Our own kernels (C++ namespace lnbwd) are ln. Kernels named by their library (cuBLAS,
  cuBLASLt, CUTLASS, cuDNN: matmuls and attention) and memcpys/memsets are other. What is left
  matched nothing: unmapped, and its share of the time is reported (it should be ~0; if not,
  ``--trace jax`` matches by the trace's HLO op instead of by name).

Limits
  "ln" is a lower bound and "ln + mixed" an upper bound of what layernorm costs: a mixed
  kernel's time is not split. XLA compiles identical fusions once and names the kernel after
  the first, so by name all copies take the first one's class (the jax trace has no such
  limit). Operations without metadata (parameters, constants, some that XLA creates) take no
  part; an instruction with none at all is other. The optimizer's update of the LayerNorm
  parameters is adam's (other), as is the loss. Tracing adds a little to every launch, so idle
  times compare between variants under the same collector, not with an untraced step.

Kinds: where ALL the kernel time goes
  Independent of the classes above, every activity also gets a kind, from its kernel name
  (and HLO op where the trace has one), the first rule that matches winning (kind()):
    comm           a collective (the comm class)
    ours           our kernels: lnbwd in the name, or a custom call to a jax_lnbwd target
    copy/memset    memcpys, memsets, and XLA's bare copy instructions (copy.3)
    attention      cuDNN's and flash attention (cudnn, flash, fmha, sdpa in the name)
    gemm           matmuls: cuBLAS, cuBLASLt (nvjet), xmma, CUTLASS, sm90_..., XLA's Triton gemm
                   fusions (gemm in the name), and a CPU thunk of a dot instruction (dot.3)
    reduce fusion  XLA kernels with a reduction: the name starts with input_ or contains reduce
    loop fusion    XLA's other kernels: elementwise, transpose and concatenate fusions (loop_,
                   wrapped_, triton_, ...fusion), and anything matched to an HLO instruction
    other          the rest (sorts, RNG, kernels of other libraries)
  A variant's per-kind difference against its baseline shows where a step gained or lost
  time outside layernorm (cli's --kernels prints it).

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

import glob
import json
import os
import re
import tempfile
from collections import defaultdict

import jax

from .models_linen import LN_SCOPE

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # torch's chrome-trace categories
OURS = re.compile(r"lnbwd")  # our CUDA kernels live in C++ namespace lnbwd
# Kernels of the matmul and attention libraries (cuBLAS, cuBLASLt's nvjet, CUTLASS, cuDNN), and
# copies: named by their library, not after an instruction. They never do layernorm's work.
LIBRARY = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|cudnn|flash|^sm\d+_|memcpy|memset", re.IGNORECASE)
# Collectives: NCCL's kernels (ncclDevKernel_AllReduce_Sum_f32_RING_LL, ...), XLA's own collective
# kernels and the HLO ops (all-reduce-start.3; a CPU thunk is named after its op: all-reduce.29).
COMM = re.compile(r"nccl|all[-_]?reduce|reduce[-_]?scatter|all[-_]?gather|all[-_]?to[-_]?all|"
                  r"collective[-_]?permute", re.IGNORECASE)
# The kinds, in the order kind() tries them (the module doc): name patterns, case-insensitive.
KINDS = ("ours", "gemm", "attention", "reduce fusion", "loop fusion", "copy/memset", "comm", "other")
_COPY = re.compile(r"memcpy|memset|^copy([._]\d+)?$", re.IGNORECASE)
_ATTENTION = re.compile(r"cudnn|flash|fmha|sdpa", re.IGNORECASE)
_GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|^sm\d+_|^dot([._]|$)", re.IGNORECASE)
_REDUCE = re.compile(r"^input_|reduce", re.IGNORECASE)
_FUSION = re.compile(r"fusion|^loop_|^wrapped_|^triton", re.IGNORECASE)
# Copies between the host and a GPU (torch: "Memcpy DtoH (Device -> Pinned)"; jax: MemcpyD2H):
# the host asks for them (the loss read after the last step), so they bound no step's GPU work.
HOST_COPY = re.compile(r"DtoH|HtoD|D2H|H2D", re.IGNORECASE)


def available(how: str) -> tuple[str | None, str]:
    """(the collector to use or None, why) for --trace `how`."""
    if how == "none":
        return None, "--trace none"
    on_gpu = jax.default_backend() == "gpu"
    if how == "torch" and not on_gpu:
        return None, "JAX runs on the CPU"
    if how == "torch" or how == "auto" and on_gpu:
        try:
            import torch
            if torch.cuda.is_available():
                return "torch", "CUPTI through torch.profiler"
            why = "torch sees no CUDA GPU"
        except Exception as e:
            why = f"torch does not import ({type(e).__name__})"
        if how == "torch":
            return None, why
        return "jax", f"jax.profiler (not torch: {why})"
    return "jax", "jax.profiler" + ("" if on_gpu else " (CPU thunks, not GPU kernels)")


def collect(fn, how: str) -> list[tuple]:
    """Runs fn() under the collector; returns its GPU activities, each as
    (name, hlo_op, start_ns, dur_ns, device, stream), from every device."""
    return _collect_torch(fn) if how == "torch" else _collect_jax(fn)


def _collect_torch(fn):
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    return [(e["name"], None, float(e["ts"]) * 1e3, float(e["dur"]) * 1e3,
             e.get("args", {}).get("device", 0), e.get("args", {}).get("stream", 0)) for e in events
            if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]


def _collect_jax(fn):
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            fn()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return []
        data = jax.profiler.ProfileData.from_file(files[0])
    planes = [p for p in data.planes if p.name.startswith("/device:GPU:")]
    if planes:  # one plane per GPU ("/device:GPU:1"), one line per stream
        out = []
        for plane in planes:
            device = int(plane.name.rsplit(":", 1)[1])
            lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or list(plane.lines)
            out += [(e.name, dict(e.stats).get("hlo_op"), e.start_ns, e.duration_ns, device, ln.name)
                    for ln in lines for e in ln.events]
        return out
    out = []  # CPU: XLA's thunks, the events that carry an hlo_op (and their device's ordinal)
    for plane in data.planes:
        if plane.name.startswith("/host:CPU"):
            for ln in plane.lines:
                for e in ln.events:
                    stats = dict(e.stats)
                    if stats.get("hlo_op"):
                        out.append((e.name, stats["hlo_op"], e.start_ns, e.duration_ns,
                                    stats.get("device_ordinal", 0), ln.name))
    return out


# ---------------------------------------------------------------------------------------------
# The compiled step's instructions, classified


_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s")
# Only calls= (a fusion's body, a wrapped or async op's): to_apply= bodies (a reduction's add)
# are shared between instructions by XLA, with the metadata of one of them.
_CALLS = re.compile(r"\bcalls=(\{[^}]*\}|%?[\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def sanitize(name: str) -> str:
    """An HLO instruction name as XLA names its kernel: "loop_add_fusion.3" -> "loop_add_fusion_3"."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def classify_hlo(hlo_text: str) -> dict[str, str]:
    """{sanitized instruction name: "ln" | "mixed" | "other"} for every instruction of the module."""
    comps: dict[str, list] = defaultdict(list)  # computation -> [(instruction, op_name, calls)]
    current = None
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            op = _OP_NAME.search(line)
            calls = [c for group in _CALLS.findall(line) for c in re.findall(r"%?([\w.\-]+)", group)]
            comps[current].append((m.group(1), op.group(1) if op else None, calls))
        elif (c := _COMPUTATION.match(line)) and " = " not in line:
            current = c.group(1)
    memo: dict[str, list] = {}

    def op_names(comp: str) -> list:  # every op_name inside a computation, recursively
        if comp not in memo:
            memo[comp] = []
            memo[comp] = [o for _, op, calls in comps.get(comp, ()) for o in
                          ([op] if op else []) + [x for c in calls for x in op_names(c)]]
        return memo[comp]

    out = {}
    for instrs in comps.values():
        for name, op, calls in instrs:
            ops = ([op] if op else []) + [x for c in calls for x in op_names(c)]
            inside = [LN_SCOPE in o for o in ops]
            out[sanitize(name)] = ("ln" if inside and all(inside) else "mixed" if any(inside) else "other")
    return out


_OUR_CALL = re.compile(r'custom_call_target="jax_lnbwd_')


def our_calls(hlo_text: str) -> frozenset[str]:
    """The sanitized names of the module's custom calls to our FFI targets: how the jax trace
    (whose CPU thunks are named after the instruction, not the kernel) finds our op's events."""
    return frozenset(sanitize(m.group(1)) for line in hlo_text.splitlines()
                     if _OUR_CALL.search(line) and (m := _INSTRUCTION.match(line)))


def attribute(name: str, hlo_op: str | None, classes: dict[str, str]) -> str:
    """The class of one traced activity: comm, ln, mixed, other or unmapped (see the module doc)."""
    if COMM.search(name) or hlo_op and COMM.search(hlo_op):
        return "comm"
    if hlo_op and sanitize(hlo_op) in classes:
        return classes[sanitize(hlo_op)]
    if OURS.search(name):
        return "ln"
    key = sanitize(name)
    for candidate in (key, re.sub(r"_\d+$", "", key)):  # a fusion's second kernel: name_1
        if candidate in classes:
            return classes[candidate]
    return "other" if LIBRARY.search(name) else "unmapped"


def kind(name: str, hlo_op: str | None = None, ours: frozenset[str] = frozenset(),
         xla: bool = False) -> str:
    """The kind of one traced activity (KINDS, the rule in the module doc). ours: our_calls()
    of the module; xla: the activity was matched to an HLO instruction of the module (its
    class is ln, mixed or other), so an XLA kernel that no fusion pattern names is a loop fusion."""
    if COMM.search(name) or hlo_op and COMM.search(hlo_op):
        return "comm"
    if OURS.search(name) or hlo_op and sanitize(hlo_op) in ours:
        return "ours"
    for k, pattern in (("copy/memset", _COPY), ("attention", _ATTENTION), ("gemm", _GEMM),
                       ("reduce fusion", _REDUCE), ("loop fusion", _FUSION)):
        if pattern.search(name):
            return k
    return "loop fusion" if xla else "other"


def merge(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint intervals in start order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(merged) -> float:
    return sum(b - a for a, b in merged)


def overlap(p, q) -> float:
    """The length of the intersection of two merged interval lists (both from merge())."""
    total, i, j = 0.0, 0, 0
    while i < len(p) and j < len(q):
        total += max(0.0, min(p[i][1], q[j][1]) - max(p[i][0], q[j][0]))
        if p[i][1] < q[j][1]:
            i += 1
        else:
            j += 1
    return total


def gaps(spans) -> list[tuple[float, str, str, str, str, float]]:
    """The idle gaps of one device: [(gap ns, kind before, kind after, name before, name after,
    start of the activity after)] for every stretch with no activity between its first start
    and its last end. spans: (start, end, kind, name) of every activity. The activity "before"
    a gap is the one whose end the gap starts at (with overlapping activities, the latest to
    end), the one "after" is the next to start."""
    out = []
    last = None  # (end, kind, name) of the activity that ends latest so far
    for start, end, kd, name in sorted(spans):
        if last is not None and start > last[0]:
            out.append((start - last[0], last[1], kd, last[2], name, start))
        if last is None or end > last[0]:
            last = (end, kd, name)
    return out


def step_starts(spans, steps: int) -> frozenset:
    """The start times of steps 2..n's first activities, from (start, ...) spans of n steps that
    each launch the same activities; empty when the count is not a multiple of n (the module
    doc, between)."""
    if steps < 2 or not spans or len(spans) % steps:
        return frozenset()
    starts = sorted(sp[0] for sp in spans)
    per = len(starts) // steps
    return frozenset(starts[k * per] for k in range(1, steps))


def summarize(events, classes: dict[str, str], steps: int, top: int = 0,
              ours: frozenset[str] = frozenset()) -> dict:
    """Per-step, per-device times in ms (see the module doc) from one trace of `steps`
    back-to-back steps. events: (name, hlo_op, start_ns, dur_ns[, device, stream]) (device 0
    when absent); ours: our_calls() of the module. "kinds": {kind: ms per step} for every
    kind of KINDS (they sum to kernel_ms). With top > 0 also "top": the `top` costliest
    kernels of the ln and mixed classes, each as [class, kernel name, launches per step, ms
    per step], for reading what a variant runs, "top_other": the `top` costliest XLA
    fusions of the other class, each as [kind, kernel name, launches per step, ms per step],
    and "gemms": every matmul kernel, by kernel name (the name is the library's algorithm:
    tile, stages, operand layouts), as ["gemm", name, launches per step, ms per step],
    costliest first, for comparing the algorithms two variants' identical matmuls got."""
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
                                 "in_steps": []})
    for name, op, start, dur, *where in events:
        cls = attribute(name, op, classes)
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
    union = idle = between = overlapped = exposed = ln_busy = lnmix_busy = 0.0
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
