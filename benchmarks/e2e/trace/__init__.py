"""Where a step's GPU time goes: a kernel-level trace of a few steps, attributed to layernorm.

One idea a file, in the order a trace goes through them:
  collectors.py  --trace: running a few steps under torch's or jax's profiler, and the GPU
                 activities (kernels, memcpys, memsets) it recorded, from every device
  classify.py    each activity's class (ln, mixed, other, comm, unmapped), from the compiled
                 step's HLO and the layernorm scope, and its kind (gemm, attention, ours, ...)
  intervals.py   unions, intersections and gaps of one device's intervals
  summary.py     one trace's figures per step and per device (busy, idle, between steps, the
                 layernorm kernels' time, comm and its overlap), and the median of repeated traces
"""
from .classify import KINDS, attribute, classify_hlo, kind, our_calls, our_scope, sanitize
from .collectors import available, collect
from .intervals import gaps, length, merge, overlap, step_starts
from .summary import costliest, median_summary, step_span_ms, summarize

__all__ = ["KINDS", "attribute", "available", "classify_hlo", "collect", "costliest", "gaps", "kind",
           "length", "median_summary", "merge", "our_calls", "our_scope", "overlap", "sanitize", "step_span_ms",
           "step_starts", "summarize"]
