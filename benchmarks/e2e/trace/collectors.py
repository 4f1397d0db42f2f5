"""How a trace is collected: the kernels, memcpys and memsets of a few steps, from every device.

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
"""
from __future__ import annotations

import glob
import json
import os
import tempfile

import jax

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # torch's chrome-trace categories


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
