"""Whole training steps with Flax's norms and with jax_lnbwd's: ``python -m benchmarks.e2e``.

Three transformers written here (config.py: a GPT-2-style pre-LN decoder, d 1600, 25 heads,
seq 1024, batch 8; a BERT-style post-LN encoder, d 1024, seq 1024, batch 8; a ViT-style pre-LN
encoder, d 1024, 197 tokens, batch 8; 6 blocks each), in flax.linen and flax.nnx, train with
optax's adam on float32 parameters, computing in bf16 (``--dtypes``). Each (model, API, dtype)
runs once per LayerNorm variant (variants.py: ``flax``, ``jax_lnbwd``, ``add_layernorm``, which also
takes in the bias of the projection in front of it, ``add_layernorm_dense_bias``, which leaves it
in the Dense, and any registered). A fourth model, ``--models llama`` (a Llama-style pre-norm
decoder with RMSNorm, SwiGLU and rotary embeddings, no biases; d 2048, 16 heads, seq 2048, batch
4), runs the RMSNorm variants instead (variants_rms.py: ``flax_rmsnorm``, ``jax_lnbwd_rmsnorm``,
``add_rmsnorm``); ``--offset 1.0`` gives it Gemma's (1 + scale). Each model's baseline is the
first listed variant of its norm; the "ln" columns and the byte floor count its RMSNorms alike.
``--models public_llama,public_gemma``: the same decoder written as users' public Flax Llama and
Gemma code is (separate q/k/v projections, rotary from a gathered float32 sin/cos table,
attention as einsums with a float32 softmax; Gemma: scaled embeddings, GeGLU, a tied head,
(1 + weight)), which XLA fuses differently around the norms; their baseline is
``public_rmsnorm``, the norm as that code writes it (float32 output), then ``jax_lnbwd_rmsnorm``
and ``add_rmsnorm``. ``--qk-norm`` gives the public models Qwen3's QK-norm (q and k, after their
projections, RMS-normalized per head over head_dim before rotary) and runs its two
implementations against each other: ``qk_flax`` (Flax's two nn.RMSNorm, the baseline) and
``qk_jax_lnbwd`` (jax_lnbwd.flax.QKNorm), both with public_rmsnorm's add & norms and the same
parameters (variants_rms.py). The QK-norm has a name scope of its own: the "ln" columns and the
byte floor still count the add & norms alone, and the traced table gains the QK-norm's GPU time
per step, ``qk`` and ``+qmix`` (its kernels alone, and with the kernels XLA fused it into;
trace/classify.py). ``--dump-hlo DIR`` writes each run's optimized HLO there.

How a step is timed
-------------------
Every run is compiled and warmed up first, then takes a few more untimed steps whose mean
sizes its rounds: enough steps that a round lasts ``--round-seconds`` (at least ``--steps``,
at most 1000), the most that any variant of the same model, API and dtype needs, so the
variants take the same steps. Then come ``--rounds`` rounds; in each, every run takes its
steps back to back (parameters and optimizer state donated, the host queueing step i+1 while
the GPU runs step i, as in a training loop), and the wall time from the first dispatch until
the last step's outputs are ready, divided by the steps, is that round's time. Runs are
interleaved in one process, in reverse order every other round, so that clock and thermal
drift fall on all variants alike. A run's time is the median over the rounds; the spread is
(slowest - fastest round) / median. The ratio against the baseline (the first variant) is
paired: the median over the rounds of the baseline's round time / the run's in the same
round, which cancels drift that slows both; the range of these per-round ratios comes with it.

Data parallel (``--devices N``): each run trains over the first N devices, the batch (the
configured one is per device: the global batch is N times it) split over a 1-D mesh axis
"data", parameters and optimizer state replicated, so XLA all-reduces the gradients (our
LayerNorm's own dweight/dbias sums are all-reduced by its partitioning rule). A step's time is
then the whole data-parallel step, and the trace columns are per device, with three more:
comm (collective kernels), overlap (collectives running while our kernels run on the same
GPU) and exposed (collectives running while nothing else does). The 2-GPU run and how to
read it: docs/e2e.md.

Then, if a collector is available, each run takes ``--trace-steps`` more steps under a
kernel-level trace, ``--trace-repeats`` times (the trace whose traced step is the median
counts), attributed to layernorm as trace/ describes: the GPU time per step that layernorm's
kernels occupy (forward, backward, and the elementwise kernels XLA fused with them; kernels
that overlap count once), all kernels, the idle time per step, and the share no HLO
instruction could be matched to.
``--kernels N`` then lists each run's kernel time by kind (matmuls, attention, XLA's reduce
and loop fusions, ours, ...), its N costliest kernels, its idle time by the kind of kernel after
each gap and its N longest gaps, and each variant's differences against the baseline: per kind,
the N matmul kernels that changed most, and the idle time by kind (breakdown.py).

fp32 (``--dtypes float32``) keeps JAX's default matmul precision, which is TF32 on NVIDIA GPUs
since Ampere: what an fp32 user gets, and the normalization is in full fp32 either way (XLA's
elementwise and reduction kernels, and ours, do not use TF32). ``--matmul-precision highest``
makes the matmuls full fp32 too (several times slower steps: layernorm's share then shrinks).

After the rounds, the speed of a same-size copy is measured, and the table is followed by
the byte floor (floor.py): the layernorm work's minimal bytes per step at that speed, for an
unfused and a fused add & norm, and against the baseline's traced +mix, the most any
implementation of each form could cut it by and the step ratio it could at best reach.

``--out DIR`` writes DIR/e2e.txt (the table), DIR/e2e.json (every round, the trace summary,
the configs and versions) and DIR/e2e.png (needs matplotlib: ``pip install -e ".[bench]"``).

Files: config.py (models and sizes), models_linen.py, models_nnx.py, rope.py (rotary
embeddings), models_public_linen.py, models_public_nnx.py (the public-style decoders),
registry.py (what a variant is, and the hook for more), variants.py (the LayerNorm
variants), variants_rms.py (the RMSNorm variants), train.py (the step and its timing), trace/
(collection, attribution and kinds), report.py (table and plot), floor.py (the byte floor),
breakdown.py (--kernels), cli.py (options and the run), output.py (the printed table and
the --out files).
"""
