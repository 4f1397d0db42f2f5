"""Validate, then time, our norms' kernels against their peers: ``python -m benchmarks.kernels``.

``--op`` picks the ops (ops.py; a comma list, or ``all``; default layernorm_bwd):
  layernorm_bwd (backward)          the backward kernels of jax_lnbwd.KERNELS (``--kernels``)
  layernorm_fwd (forward)           the fused forward: y, mean, rstd
  add_layernorm_fwd (add_forward)   s = x + residual and the forward of s, in one kernel
  rmsnorm_bwd                       rmsnorm's backward (the kernels of KERNELS that run it: 11, 12)
  rmsnorm_fwd                       rmsnorm's fused forward: y, rstd
  add_rmsnorm_fwd                   s = x + residual and rmsnorm's forward of s, in one kernel
  qk_norm_fwd, qk_norm_bwd          QK-norm of q and k (jax_lnbwd.qk_norm), forward and backward
  qk_norm_fused_fwd, _bwd           QK-norm of the fused projection's qkv (jax_lnbwd.qk_norm_fused)
Op names are ``<norm>_<fwd|bwd>``, as the public functions and FFI targets are named; a new op
is one more row of ops.OPS. ``--op qk_norm`` selects both qk_norm ops, ``--op qk_norm_fused``
both fused ones. The rmsnorm ops' default GPU shapes are Llama-sized (d 2048-16384). The qk ops
read a shape ROWSxC as TOKENSxD, D the head_dim, with 32 q heads and 8 k (and v) heads
(ops_qk_norm.py); their default GPU shapes are 16384 tokens (batch 8 x 2048) of D 64, 128, 256.

The backward part reproduces and extends main() of llm.c's dev/cuda/layernorm_backward.cu.
For every (op, dtype, shape, impl) the op is first checked against the pure-jnp reference in
float32 (float64 for float64) (a failure is printed in red and that entry is not timed), then
timed. Peers are timed the same way: ``xla`` (the jnp op under jit: reference.layernorm_bwd
given mean/rstd, reference.layernorm_fwd), ``copy`` (one same-bytes device copy: the ceiling),
for the backward ``autodiff`` (XLA's VJP of a jnp layernorm, recomputing the statistics) and,
where they import on a CUDA GPU, ``torch`` and ``liger`` (layernorm_bwd and layernorm_fwd:
aten's native_layer_norm and its backward, Liger's layer_norm_forward and _backward, peers.py,
only y compared; rmsnorm_fwd and rmsnorm_bwd: torch.nn.functional.rms_norm, its backward by
autograd, and Liger's RMSNorm, peers_rms.py; the qk ops: the same, on q and on k) and
``pallas`` (JAX's Pallas GPU ``layer_norm`` and ``rms_norm``, forward and backward: pallas.py);
for the add_ ops ``ours-unfus`` (jnp's add, then our fused forward of s); for the qk ops
``two-calls`` (two jax_lnbwd.rmsnorm calls, our kernels: the two launches a one-launch QK-norm
saves). The qk ops' ``ours`` is the public function with our kernels forced; their backward
entries time the public function's pullback (jax.vjp, made outside the chain), given the saved
residuals: the backward alone (ops_qk_norm.py). Backward kernels come from jax_lnbwd.KERNELS, so new
ones are benchmarked with no change here. ``--params float32`` gives the forward ops float32
weight and bias beside 16-bit x (mixed precision).

How one op is timed (device time, never one call by wall clock)
---------------------------------------------------------------
* One JAX call costs tens of µs of host dispatch, more than a small kernel runs. So one jitted
  function applies the op k times in a chain (``--chain``; 50 on GPU, 3 on CPU): the first output
  of step i is the chained input of step i+1 (the backward's dx its dy, the forward's y its x; an
  add op's y and s its x and residual, a residual stream; a qk op's q and k both). Each step's
  outputs, and the constant inputs too, go through ``jax.lax.optimization_barrier``: XLA can then
  neither fuse steps, nor CSE them, nor hoist input-only work (the autodiff peer's statistics, x̂)
  out of the chain and share it between steps. XLA does drop barrier outputs that nothing reads,
  and the work that only they needed, so every step's other outputs leave the chain (dweight and
  dbias, or mean and rstd, stacked: one small copy per call, as each output of the jitted function
  costs the host microseconds per call), and so do the last step's chained inputs; else the peers
  would skip their column sums or statistics, and the separate ops of a qk peer their whole k
  half. Values drift along a chain (dx is about w*dy per column); nobody looks at them, and GPU
  arithmetic runs at one speed whatever they are. Validation is separate: one call on the fresh
  inputs, before any timing.
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
* torch and liger run the same k-step chain (the same inputs chained) captured in a CUDA graph
  (eager if capture fails), replayed n times between two torch.cuda.Event records.
* Nothing is rotated and no cache is flushed. Instead the data is larger than the H200's 60 MB
  L2: a backward step moves 3*rows*C elements, 75-805 MB for its default GPU shapes (8192x1600
  and 16384x768 in bf16 are the tightest, 1.3x L2); a forward step 2*rows*C, 25-537 MB
  (8192x768 in bf16 fits: marked L2). 1024x768 (4.7 MB in bf16) fits in L2 on
  purpose: it shows the small, launch- and latency-bound case, where L2 flatters everyone.

Bytes and the columns of the table
----------------------------------
Each op is credited with the bytes it must move (ops.py), the same for every impl of one
(op, shape, dtype), so GB/s ratios are speed ratios; statistics are float32 (float64 for float64):
  layernorm_bwd      read dy and x, write dx; read weight, write dweight and dbias; read mean, rstd
  layernorm_fwd      read x, write y; read weight and bias; write mean and rstd
  add_layernorm_fwd  read x and residual, write y and s; read weight and bias; write mean, rstd
  rmsnorm_bwd        read dy and x, write dx; read weight, write dweight; read rstd
  rmsnorm_fwd        read x, write y; read weight; write rstd
  add_rmsnorm_fwd    read x and residual, write y and s; read weight; write rstd
  qk_norm_fwd        read q and k, write q_out and k_out; read both weights; write rstd
  qk_norm_bwd        read dy and x, write dx, for q and k; read both weights, write both
                     dweights; read rstd
  qk_norm_fused_*    as qk_norm's: the q and k heads of qkv only (an in-place kernel leaves the
                     v heads untouched; an entry that copies them is not credited it)
A peer that moves more (Pallas's backwards also sum dbias; rms_norm's too) is not credited it.
The copy peer moves those bytes once at copy speed: per step, one elementwise bitwise NOT of a
uint32 array of bytes/8 words (reads bytes/2, writes bytes/2; a real read+write pass, where a
plain copy or ``x * 1`` could be elided by XLA). So %copy stays at or under 100% unless the
bytes fit in the L2, where the steps of a chain find their data: on a GPU such shapes are
marked ``L2`` (``--l2-mb``, default 60, the H200's).

  µs      median device time of one op call (one chain step)
  kern µs (--kernel-time) the step's kernels alone: one more call of the same chain, traced
          (kernel_time.py); µs - kern µs is what the step spends outside its kernels (the
          launch, the command buffer's or graph's node, the gaps), which differs between JAX's
          custom calls, XLA's fusions and a torch graph, and dominates the L2-resident shapes
  GB/s    bytes / time
  %copy   copy_µs / µs: the share of the same-bytes copy speed reached
  ×xla    xla_µs / µs: speed-up over the XLA-fused jnp op
  ×best   best_µs / µs: speed-up over the fastest non-copy peer (xla, autodiff, torch, liger,
          pallas; ours-unfus is ours, not a peer)

On CPU the table marks our rows ``[cpu-ref]``: the CPU handlers run C++ references (the same
one for every backward kernel id), so they time that reference, not a kernel. Off a GPU the
defaults are CPU-sized (two small shapes, a 3-step chain, one call per run): ``--op all``
runs in well under a minute, and the run says so.

``--out DIR`` writes DIR/bench.txt (the table), DIR/bench.json (all rows and metadata) and
DIR/bench.png (GB/s bars per shape, one panel per (op, dtype), the copy ceiling as a dashed line;
needs matplotlib: ``pip install -e ".[bench]"``). A run cut short (a time limit on a shared
GPU) keeps what it measured: bench.json is rewritten after every (op, shape, dtype) group, with
"complete": false until the last, and our kernels' lines are printed as each group finishes;
the full table comes at the end. Colours are used on a terminal only, never with NO_COLOR set.

Files: ops.py (the ops: inputs, references, steps, bytes), timing.py (validation, the chained
steps and how they are timed), kernel_time.py (--kernel-time), peers.py (torch and Liger; which peers run here), peers_rms.py
(their rmsnorm entries), pallas.py (JAX's Pallas GPU norms), report.py (table and plot),
cli.py (options and the run).
"""
