"""``--kernel-time``: the GPU time of a step's kernels alone, beside the step's time.

A step of the chain (timing.time_jax, peers.time_torch) is its kernels plus what the framework
adds per call: the launch, the command buffer's or graph's node, the gaps between kernels. At
the L2-resident shapes that part can be as large as the kernel (docs/forward.md, "Kernel time
and step time"), and it differs between JAX's custom calls, XLA's own fusions and a torch CUDA
graph: the step's µs then compares frameworks as much as kernels. With --kernel-time, after an
implementation is timed, one more call of its chain (the same compiled chain, or the same
graph) runs under the e2e bench's trace collector (benchmarks/e2e/trace/collectors.py: on a GPU
CUPTI through torch.profiler, which records JAX's kernels too and leaves XLA's command buffers
as they run untraced; on the CPU jax.profiler's thunks, which check the tool and measure
nothing). The union of the call's kernel, memcpy and memset intervals over the k steps is the
kernel time per step: the table's ``kern µs``; ``µs - kern µs`` is what the step spent outside
its kernels. One traced call is one sample, so the column moves more from run to run than µs.
"""
from __future__ import annotations

# The e2e bench's trace package imports Flax (its models name the layernorm scope): imported
# here only when --kernel-time is given, so that the kernel bench starts without it.


def collector() -> tuple[str | None, str]:
    """(the collector --kernel-time uses, or None; why): the e2e bench's choice for --trace auto."""
    from ..e2e.trace import collectors
    return collectors.available("auto")


def per_step_us(call, k: int, how: str) -> float | None:
    """The kernel time of one step in µs: call() runs one k-step chain and waits for it; its
    activities' union (host copies left out, as the e2e bench leaves them out of a step) / k.
    None if the collector saw no activity."""
    from ..e2e.trace import collectors
    from ..e2e.trace.classify import HOST_COPY
    from ..e2e.trace.intervals import length, merge
    events = collectors.collect(call, how)
    spans = [(start, start + dur) for name, _op, start, dur, *_ in events if not HOST_COPY.search(name)]
    return length(merge(spans)) / k / 1e3 if spans else None
