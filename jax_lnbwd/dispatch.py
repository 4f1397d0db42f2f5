"""The one dispatch rule: for each norm call and direction, where our FFI kernel runs and where
XLA's fused jnp does.

Every call of every op (layernorm, add_layernorm, rmsnorm, add_rmsnorm; forward and backward)
asks `decide` once, when it is traced, and runs what it answers through `run`:

  1. the switches (config.py) first: the off switch makes the whole norm jnp before any call
     gets here; "ffi" runs our kernel on every platform (the CPU runs the C++ handler), "xla"
     (forward) and "jnp" (backward) run jnp on every platform. An explicit kernel= or
     block_size= forces our backward kernel the same way. A call captures the mode when it is
     traced; a backward uses its forward's.
  2. Under Explicit mesh axes (sharding in types) the forward is jnp: the FFI forward's results
     would be typed without a sharding.
  3. Under autodiff (the forward of a training step: a custom_jvp rule's) the forward is jnp on
     every platform: XLA fuses it with its neighbours (the residual add in front, the converts
     of its consumers), and a custom call in its place moves XLA's fusion decisions elsewhere in
     the step. Measured in a public-style Llama step (benchmarks/e2e, public_llama; docs/e2e.md):
     with our forward XLA fuses the rotary sin/cos gather into every q and k transpose and the
     step is 2% slower, with either backward; with XLA's forward and our backward it is not.
     The backward is where our kernels gain in a step (the fused residual gradient included).
  4. Otherwise ("auto", the default): our kernel on CUDA only, and there only where it beats
     XLA's fusion of the same jnp (`cuda_kernel_wins`: the crossovers measured in the kernel
     bench, CROSSOVERS below); jnp on every other platform (XLA's CPU code is faster than our
     C++ reference handler, which exists for tests and forcing).

QK-norm (qk_norm, qk_norm_fused) asks first whether it runs as one op for q's and k's heads or
as two norm calls (`qk_one_op`): the one op where some direction would run it (the switches'
"ffi", or in "auto" its crossovers: D >= 64 with 65536 rows) and nothing refuses it
(`qk_refusal`: dtypes, row bytes, sharding). The one op's forward and backward then ask `decide`
as op "qk_norm" (or "qk_norm_fused"), with q's and k's rows together and head_dim as C; two
calls ask it as the norm each one is.

When the rule leaves every platform to jnp in both directions (no CUDA handler in this build, or a
shape below both crossovers), the public functions return the jnp reference differentiated by JAX
(`whole_jnp`): the very program plain jnp code makes, with no custom_jvp around it.

The platform is not known when a call is traced (a program can be lowered for several, or
exported), so a decision names the platforms that get our kernel, and `run` stages both paths
with jax.lax.platform_dependent: the lowering keeps only the branch of the platform it lowers
for. Shapes, dtypes and the switches are known at trace time, so everything else is decided
here, in Python, once.

`decisions()` lists what was decided since `clear_decisions()`, so a benchmark or a user can
see which path each norm of a traced program took (the e2e bench prints it per run).
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from . import _jax_lnbwd, config
from .norms import Norm

FORWARD, BACKWARD = "forward", "backward"
EVERY = ("every",)     # our kernel on every platform (a switch, or an explicit kernel)
NONE = ()              # jnp on every platform
# The platforms (jax.lax.platform_dependent's names) where mode "auto" runs our kernel when it
# wins; CUDA only if this build has the CUDA handler.
KERNEL_PLATFORMS = ("cuda",)

# Where our CUDA kernels beat XLA's fusion of the same jnp, from the kernel bench on the H200
# (docs/results/2026-12-03-crossover_h200.txt: every op, bf16 and fp32, C from 32 to 16384 at
# 64 MB a tensor and at L2-sized shapes; docs/results/2026-12-04-small_rows_h200.txt: the
# small-row kernels of layernorm and rmsnorm, C from 64 to 512 at 64 MB a tensor;
# docs/results/2026-12-06-small_c_checks_h100.txt: the backward at C = 32, where kernel 12's ring of
# row chunks and kernel 11's small rows both beat XLA's fusion, on the H100;
# docs/results/2026-12-07-small_c_qk_h100.txt: the forward of layernorm, add_layernorm and 16-bit
# rmsnorm at C = 32 with 2^20 rows, and 16-bit add_layernorm at C = 64 with 2^19 rows, where the
# small-row forward runs 1.5-2.1x XLA's fusion, on the H100; docs/results/2026-12-07-forward_rows_h100.txt:
# rmsnorm and add_rmsnorm at C = 32 from 2^18 rows and 16-bit add_rmsnorm at C = 64 from 2^16
# rows, 1.05-1.6x XLA's fusion, on the H100). For each
# (op, direction, element bytes): (C, rows) pairs; our kernel runs when C >= c and rows >= r for
# one of them. A pair marked ALIGNED holds only for rows of whole 16-byte vectors (C * itemsize a
# multiple of 16): the small-row kernels run only those, and other rows of such widths take
# the whole-warp kernels, which were not measured there. Below, the launch of a custom
# call and our per-row layout cost more than XLA's fused reduction saves: XLA's fusion reads
# short rows at its full speed, and a backward with few rows leaves our two-kernel reduction of
# dweight (partials, then a finalize) a larger share. 16-bit dtypes share the bf16 row, float64
# the float32 row. The add ops' backward is the plain backward with the residual gradient
# added in the kernel.
ALIGNED = "aligned"
CROSSOVERS = {
    ("layernorm", FORWARD, 2): ((256, 1), (64, 65536, ALIGNED), (32, 1048576, ALIGNED)),
    ("layernorm", FORWARD, 4): ((128, 1), (64, 65536, ALIGNED), (32, 1048576, ALIGNED)),
    ("rmsnorm", FORWARD, 2): ((128, 1), (64, 65536, ALIGNED), (32, 262144, ALIGNED)),
    ("rmsnorm", FORWARD, 4): ((128, 1), (64, 65536, ALIGNED), (32, 262144, ALIGNED)),
    ("add_layernorm", FORWARD, 2): ((128, 1), (64, 524288, ALIGNED), (32, 1048576, ALIGNED)),
    ("add_layernorm", FORWARD, 4): ((64, 1), (32, 1048576, ALIGNED)),
    ("add_rmsnorm", FORWARD, 2): ((128, 1), (64, 65536, ALIGNED), (32, 262144, ALIGNED)),
    ("add_rmsnorm", FORWARD, 4): ((64, 1), (32, 262144, ALIGNED)),
    ("layernorm", BACKWARD, 2): ((256, 1024), (64, 65536, ALIGNED), (32, 1048576, ALIGNED)),
    ("layernorm", BACKWARD, 4): ((256, 1024), (64, 65536, ALIGNED), (32, 1048576, ALIGNED)),
    ("rmsnorm", BACKWARD, 2): ((256, 1024), (64, 65536, ALIGNED), (32, 1048576, ALIGNED)),
    ("rmsnorm", BACKWARD, 4): ((256, 1024), (64, 65536, ALIGNED), (32, 1048576, ALIGNED)),
    # QK-norm as one op (qk_autodiff.py: q's and k's heads in one call; C is head_dim, rows are
    # q's and k's heads together), against the two-call path (each call dispatched as
    # rmsnorm/layernorm is, by the rows above) and XLA's fusion, at 16384 tokens of 32 q and 8 kv
    # heads, D = 64, 128, 256 (bf16: docs/results/2026-12-05-qk_norm_h200.txt; fp32 and the
    # contiguous sets' row loop: docs/results/2026-12-05-qk_norm_fp32_h100.txt; qk_norm on the
    # H200 with every peer: docs/results/2026-12-06-small_c_h200.txt):
    #   * qk_norm_fused: the one op normalizes q and k in place in the fused projection, where two
    #     calls slice q and k out and concatenate them back: 3x the two calls and 2x XLA's
    #     fusion forward, 1.5-2x XLA's backward, in bf16 and fp32. From D >= 64 with the
    #     small-row norms' 65536 rows;
    #   * qk_norm (q and k apart): forward, the one op at 94-99% of a copy, 2-9% ahead of the two
    #     calls and 2-10% of XLA's fusion, bf16 and fp32; backward (bf16), the one op and the two
    #     calls within 1% of each other, 1.4-1.6x XLA's. The same rows as qk_norm_fused's.
    # Without pairs mode "auto" keeps the two calls; mode "ffi" always runs the one op.
    ("qk_norm", FORWARD, 2): ((64, 65536, ALIGNED),),
    ("qk_norm", FORWARD, 4): ((64, 65536, ALIGNED),),
    ("qk_norm", BACKWARD, 2): ((64, 65536, ALIGNED),),
    ("qk_norm", BACKWARD, 4): ((64, 65536, ALIGNED),),
    ("qk_norm_fused", FORWARD, 2): ((64, 65536, ALIGNED),),
    ("qk_norm_fused", FORWARD, 4): ((64, 65536, ALIGNED),),
    ("qk_norm_fused", BACKWARD, 2): ((64, 65536, ALIGNED),),
    ("qk_norm_fused", BACKWARD, 4): ((64, 65536, ALIGNED),),
}
# Rows measured where our kernel was never the faster (every other empty row: not measured).
NEVER_FASTER: set[tuple[str, str, int]] = set()


@dataclasses.dataclass(frozen=True)
class Decision:
    """What `decide` answered for one traced call: the op (the public name, e.g. "add_rmsnorm"),
    the direction, x's rows, C and dtype, the platforms where our kernel runs (EVERY, NONE or
    some of KERNEL_PLATFORMS) and why."""
    op: str
    direction: str
    rows: int
    C: int
    dtype: str
    platforms: tuple
    why: str

    @property
    def path(self) -> str:
        """'ffi everywhere', 'ffi on cuda' (jnp elsewhere) or 'jnp'."""
        if self.platforms == EVERY:
            return "ffi everywhere"
        return "ffi on " + ", ".join(self.platforms) if self.platforms else "jnp"


_LOG: collections.deque = collections.deque(maxlen=100_000)


def decisions() -> list[Decision]:
    """The decisions of every norm call traced since clear_decisions(), oldest first."""
    return list(_LOG)


def clear_decisions() -> None:
    _LOG.clear()


def crossovers(op: str, direction: str, dtype) -> tuple:
    """The (C, rows) pairs (a third element ALIGNED: for 16-byte rows only) from which our CUDA
    kernel is the faster for `op` ("rmsnorm", "add_layernorm", "qk_norm", ...), direction and
    dtype; none where it was never the faster (NEVER_FASTER) or has not been measured."""
    return CROSSOVERS[_row(op, direction, dtype)]


def _row(op: str, direction: str, dtype) -> tuple[str, str, int]:
    """The CROSSOVERS key of op, direction and dtype: the add ops' backward is the plain one's;
    16-bit dtypes share the 2-byte row, float64 the 4-byte one."""
    bytes_ = min(max(np.dtype(dtype).itemsize, 2), 4)
    return op.removeprefix("add_") if direction == BACKWARD else op, direction, bytes_


def cuda_kernel_wins(op: str, direction: str, rows: int, C: int, dtype) -> tuple[bool, str]:
    """Whether our CUDA kernel beats XLA's fusion at this shape (the measured crossovers), and why."""
    pairs = crossovers(op, direction, dtype)
    if not pairs:
        if _row(op, direction, dtype) in NEVER_FASTER:
            return False, f"{op} {direction}: measured on the GPU and never the faster: the other path runs"
        return False, f"{op} {direction}: not measured on the GPU yet (no crossovers): the other path runs"
    aligned = C * np.dtype(dtype).itemsize % 16 == 0
    for c, r, *only in pairs:
        if C >= c and rows >= r and (aligned or ALIGNED not in only):
            return True, f"C {C} >= {c}, rows {rows} >= {r}: our kernel is faster"
    need = " or ".join(f"C >= {c} with rows >= {r}" + (" and 16-byte rows" if ALIGNED in only else "")
                       for c, r, *only in pairs)
    return False, f"C {C}, rows {rows}: XLA's fusion is faster (ours needs {need})"


def _call(norm: Norm, add: bool, x_shape, op: str | None = None) -> tuple[str, int, int]:
    """(the public op's name, rows, C) of a call on x of x_shape (`op`: an op that is not the norm's
    own, QK-norm's)."""
    C = int(x_shape[-1]) if len(x_shape) else 1
    return op or ("add_" if add else "") + norm.name, int(np.prod(x_shape[:-1], dtype=np.int64)), C


def mode(direction: str) -> str:
    """The switches' mode for a direction now (config.py): what a call traced now captures."""
    return config.forward_mode() if direction == FORWARD else config.backward_mode()


def decide(norm: Norm, direction: str, x_shape, dtype, *, add: bool = False, mode_: str | None = None,
           differentiated: bool = False, explicitly_sharded: bool = False, cuda_built: bool = True,
           op: str | None = None) -> Decision:
    """Where our kernel runs this call (see the module doc), recorded in decisions().

    mode_: the switches' mode the call captured when it was traced (a backward is traced after
    the forward that asked for it, outside any `with` block around that forward; None: now).
    differentiated: a forward computed under autodiff (a training step's), whose statistics a
    backward will use. op: the op when it is not the norm's own ("qk_norm", "qk_norm_fused":
    x_shape is then (rows of q and k together, head_dim))."""
    mode_ = mode(direction) if mode_ is None else mode_
    op, rows, C = _call(norm, add, x_shape, op)
    if mode_ == "ffi":
        platforms, why = EVERY, "forced: use_ffi_*(True), JAX_LNBWD_*=ffi or an explicit kernel"
    elif mode_ in ("xla", "jnp"):
        platforms, why = NONE, "forced: use_ffi_*(False) or JAX_LNBWD_FORWARD=xla"
    elif direction == FORWARD and explicitly_sharded:
        platforms, why = NONE, "Explicit mesh axes: the jnp forward"
    elif direction == FORWARD and differentiated:
        platforms, why = NONE, ("under autodiff: XLA fuses the forward with its neighbours (the residual add, "
                                "the consumers' converts); a custom call there moves XLA's fusions elsewhere "
                                "in the step")
    else:
        wins, why = cuda_kernel_wins(op, direction, rows, C, dtype)
        platforms = tuple(p for p in KERNEL_PLATFORMS if p != "cuda" or cuda_built) if wins else NONE
        if wins and "cuda" in KERNEL_PLATFORMS and not cuda_built:
            why = "no CUDA handler in this build"
    decision = Decision(op, direction, rows, C, str(np.dtype(dtype)), platforms, why)
    _LOG.append(decision)
    return decision


def whole_jnp(norm: Norm, x_shape, dtype, *, add: bool = False, bwd_mode: str, cuda_built: bool) -> bool:
    """Whether no platform would run a kernel of ours for this call in either direction: the
    switches leave both to the rule, and CUDA is not built or below both crossovers. The norm is
    then the jnp reference differentiated by JAX, exactly what plain jnp code runs (so on the CPU,
    and for narrow rows on CUDA, XLA sees no custom_jvp at all). Recorded in decisions() as one
    decision, direction "both". The off switch (mode "xla") answers True too."""
    if bwd_mode == "xla":
        return True
    if mode(FORWARD) != "auto" or bwd_mode != "auto":
        return False
    op, rows, C = _call(norm, add, x_shape)
    if cuda_built and "cuda" in KERNEL_PLATFORMS and any(
            cuda_kernel_wins(op, d, rows, C, dtype)[0] for d in (FORWARD, BACKWARD)):
        return False
    if any(p != "cuda" for p in KERNEL_PLATFORMS):
        return False
    why = "no CUDA handler in this build" if not cuda_built else "XLA's fusion is faster in both directions"
    _LOG.append(Decision(op, "both", rows, C, str(np.dtype(dtype)), NONE,
                         why + ": the jnp reference, differentiated by JAX"))
    return True


def run(decision: Decision, ours, jnp_path, *args):
    """ours(*args) where the decision runs our kernel, jnp_path(*args) elsewhere: one branch when
    the decision is the same on every platform, else both staged by platform_dependent."""
    if decision.platforms == EVERY:
        return ours(*args)
    if not decision.platforms:
        return jnp_path(*args)
    return jax.lax.platform_dependent(*args, **{p: ours for p in decision.platforms}, default=jnp_path)


# --- QK-norm: one op for q's and k's heads, or a norm call for each -----------------------------

def qk_refusal(q_dtype, k_dtype, weight_dtypes, D: int, *, explicitly_sharded: bool, partly_manual: bool) -> str | None:
    """Why QK-norm cannot run as one op here, or None where it can: the one op's conditions, the
    same on every platform (the CPU handler's too), so that the rule is one. Refused, the two
    norm calls run instead, whatever the mode.
      * q and k of one dtype, and the present weights (`weight_dtypes`, None for an absent one) of
        one dtype: the call takes one of each (an absent weight is ones of the present one's dtype);
      * rows of whole 16-byte vectors (D * itemsize a multiple of 16) of at most
        head_rows_max_bytes bytes: the CUDA kernels' limits (ffi/kernels/common/head_rows.h);
      * not under Explicit mesh axes (the call's results would be typed without a sharding), nor
        inside a shard_map over only some mesh axes (custom_partitioning cannot name the others).
    A sharded jit is no refusal: the one op has a custom_partitioning rule (ops/partition.py:
    qk_partitioned), so rows and heads stay sharded as with the two calls (the norms' rules):
    each device runs it on its own heads and the backward's weight gradients take one psum;
    a sharded D (or fused width) is gathered with a ShardingFallbackWarning, as the norms' C is."""
    row_bytes, most = D * np.dtype(q_dtype).itemsize, _jax_lnbwd.head_rows_max_bytes
    present = {np.dtype(w) for w in weight_dtypes if w is not None}
    if np.dtype(q_dtype) != np.dtype(k_dtype):
        return f"q is {np.dtype(q_dtype)} but k is {np.dtype(k_dtype)}"
    if len(present) > 1:
        return f"the weights have two dtypes ({', '.join(sorted(map(str, present)))})"
    if row_bytes % 16 or row_bytes > most:
        return f"a head's row is {row_bytes} bytes (the one op takes multiples of 16 up to {most})"
    if explicitly_sharded:
        return "Explicit mesh axes"
    if partly_manual:
        return "inside a shard_map over only some mesh axes"
    return None


def qk_one_op(op: str, rows: int, D: int, dtype, *, refusal: str | None, bwd_mode: str, cuda_built: bool) -> bool:
    """Whether QK-norm (`op`: "qk_norm" or "qk_norm_fused") runs as its one op (qk_autodiff.py),
    whose forward and backward then ask `decide` for their own direction, or as two norm calls,
    each dispatched as rmsnorm/layernorm is. The one op where some platform would run it in some
    direction (the switches' "ffi", or a crossover on CUDA) and nothing
    refuses it (qk_refusal); a refusal there is recorded as one decision, direction "both". The
    off switch (mode "xla") is two calls, each the jnp reference. rows: q's and k's together."""
    if bwd_mode == "xla":
        return False
    kernel_somewhere = any(p != "cuda" or cuda_built for p in KERNEL_PLATFORMS)
    wanted = [d for d, m in ((FORWARD, mode(FORWARD)), (BACKWARD, bwd_mode))
              if m == "ffi" or (m == "auto" and kernel_somewhere and cuda_kernel_wins(op, d, rows, D, dtype)[0])]
    if wanted and refusal is not None:
        _LOG.append(Decision(op, "both", rows, D, str(np.dtype(dtype)), NONE, f"two norm calls: {refusal}"))
    return bool(wanted) and refusal is None
