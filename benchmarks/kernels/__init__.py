"""Validate, then time, the layernorm backward against its peers: ``python -m benchmarks.kernels``.

This reproduces and extends main() of llm.c's dev/cuda/layernorm_backward.cu. For every
(dtype, shape, kernel, block size) the op is first checked against the pure-jnp reference
(a failure is printed in red and that entry is not timed), then timed. Peers are timed the
same way: ``xla`` (reference.layernorm_bwd under jit, given mean/rstd), ``autodiff`` (XLA's VJP
of a jnp layernorm, recomputing the statistics), ``copy`` (a same-bytes device copy: the
ceiling), and, where they import on a CUDA GPU, ``torch`` and ``liger``. Kernels come from
jax_lnbwd.KERNELS, so new ones are benchmarked with no change here.

How one op is timed (device time, never one call by wall clock)
---------------------------------------------------------------
* One JAX call costs tens of µs of host dispatch, more than a small kernel runs. So one jitted
  function applies the op k times in a chain (``--chain``; 50 on GPU, 3 on CPU): the dx of
  step i is the dy of step i+1. Each step's outputs, and the constant inputs too, go through
  ``jax.lax.optimization_barrier``: XLA can then neither fuse steps, nor CSE them, nor hoist
  input-only work (the autodiff peer's statistics, x̂) out of the chain and share it between
  steps. XLA does drop barrier outputs that nothing reads, so every step's dweight and dbias
  are stacked into an output of the chain (one small copy per call); else the peers would
  skip their column sums. Values drift along a chain (dx is about w*dy per column); nobody
  looks at them, and GPU arithmetic runs at one speed whatever they are. Validation is
  separate: one call on the fresh inputs, before any timing.
* On CPU, XLA removes the barriers before fusion (on GPU only after scheduling), so there the
  peers' steps may fuse with each other (the copy's k passes become one): the CPU run checks
  that everything works, its numbers mean little.
* The chain is compiled and run once (warm-up). A timed run is n back-to-back calls of it with
  one ``jax.block_until_ready`` at the end; dispatch is asynchronous and the GPU runs calls in
  stream order, so the host queues call i+1 while the device runs call i. After the warm-up, n
  grows until a run lasts >= ``--min-run-ms`` (20 ms on GPU; on CPU 0, i.e. n = 1, as
  independent CPU calls may overlap): a run's fixed cost (first dispatch, final sync, about a
  millisecond) then adds at most a few percent to the smallest shapes' steps.
  time.perf_counter() around the run, divided by n*k, is one sample; we report the median of
  ``--reps`` samples. Nothing is subtracted, so what the op leaves idle between steps counts
  against it.
* torch and liger run the same k-step chain captured in a CUDA graph (eager if capture
  fails), replayed n times between two torch.cuda.Event records.
* Nothing is rotated and no cache is flushed. Instead the data is larger than the H200's 60 MB
  L2: a step moves 3*rows*C elements, 75-805 MB for the default GPU shapes (8192x1600 and
  16384x768 in bf16 are the tightest, 1.3x L2). 1024x768 (4.7 MB in bf16) fits in L2 on
  purpose: it shows the small, launch- and latency-bound case, where L2 flatters everyone.

Bytes and the columns of the table
----------------------------------
bytes = (3*rows*C + 3*C)*itemsize + 2*rows*stat_itemsize: read dy and x, write dx; read
weight, write dweight and dbias; read mean and rstd (float32, float64 for float64). Every
impl of a (shape, dtype) is credited with these same bytes, so GB/s ratios are speed ratios.
The copy peer reads bytes/2 and writes bytes/2 per step: an elementwise bitwise NOT of a
uint32 array (a real read+write pass; a plain copy or ``x * 1`` could be elided by XLA).

  µs      median device time of one op call (one chain step)
  GB/s    bytes / time
  %copy   copy_µs / µs: the share of the same-bytes copy speed reached
  ×xla    xla_µs / µs: speed-up over the XLA-fused jnp backward
  ×best   best_µs / µs: speed-up over the fastest non-copy peer (xla, autodiff, torch, liger)

On CPU the table marks our rows ``[cpu-ref]``: the CPU handler runs the same C++ reference for
every kernel id, so they time that reference, not a kernel.

``--out DIR`` writes DIR/bench.txt (the table), DIR/bench.json (all rows and metadata) and
DIR/bench.png (GB/s bars per shape, one panel per dtype, the copy ceiling as a dashed line;
needs matplotlib: ``pip install -e ".[bench]"``). A run cut short (a time limit on a shared
GPU) keeps what it measured: bench.json is rewritten after every (shape, dtype) group, with
"complete": false until the last, and our kernels' lines are printed as each group finishes;
the full table comes at the end. Colours are used on a terminal only, never with NO_COLOR set.

Files: timing.py (inputs, validation, the chained steps and how they are timed), peers.py
(torch and Liger), report.py (table and plot), cli.py (options and the run).
"""
