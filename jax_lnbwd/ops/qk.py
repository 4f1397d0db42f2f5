"""QK-norm's FFI ops, bare: one call normalizes every head of q and of k.

    q_out, k_out, q_stats, k_stats = qk_fwd_call(norm, q, k, q_weight, k_weight, eps, offset)
    qkv_out, q_stats, k_stats = qk_fused_fwd_call(norm, qkv, q_weight, k_weight, q_heads, kv_heads, eps, offset)
    dq, dk, dq_weight, dk_weight = qk_bwd_call(norm, dq_out, dk_out, q, k, q_weight, k_weight, q_stats, k_stats, offset)
    dqkv, dq_weight, dk_weight = qk_fused_bwd_call(norm, dqkv_out, qkv, q_weight, k_weight, q_stats, k_stats,
                                                   q_heads, kv_heads, offset)

Each head of attention's q and k (D = head_dim values) is one row of `norm` (norms.RMSNORM or
norms.LAYERNORM, passed to the targets as its kind), normalized over D, with one weight (D,)
for every q head and one for every k head:
    q_out = x̂(q) * (offset + q_weight),  x̂ = x * rstd (rmsnorm) or (x - mean) * rstd (layernorm)
(k likewise with k_weight; layernorm has no bias and no offset: offset 0). Statistics in fp32
(fp64 for float64 data), outputs rounded once to the data's dtype.

The operands are 2-D: the separate form's q [rows_q, D] and k [rows_k, D] (every row a head:
rows = tokens * heads), or the fused form's qkv [tokens, (q_heads + 2 * kv_heads) * D], which
holds per token the q heads, then the k heads, then the v heads; its result is qkv with the q
and k heads normalized and the v heads unchanged, aliased to qkv (input_output_aliases {0: 0}:
the kernel works in place where qkv is dead after the call, and XLA copies qkv first where it
is not). The fused backward likewise aliases dqkv to its cotangent dqkv_out, whose v heads pass
through. q_stats and k_stats are tuples in `norm.stats` order (layernorm (mean, rstd), rmsnorm
(rstd,)), of shape (rows,): for the fused form row (token, head) row-major, tokens * q_heads
for q and tokens * kv_heads for k. Weights are (D,) arrays, in the data's dtype or float32
beside bfloat16/float16 data (mixed precision: used as float32, and their gradients float32);
the forward takes None (no scale), the backward needs both (pass ones for an absent weight).
offset (rmsnorm's) assumes both weights are present, as the public functions require: the
forward applies it only to a weight it has, while the backward adds it to the ones it is given.

These are the bare calls: no argument checks in Python (the handlers' checks, ffi/checks/
qk_norm.h, raise at run time, naming the target's function), and no batching, partitioning or
derivative rules: the one-op path of the public functions (qk_autodiff.py, qk_tangent.py) wraps
them with batching and derivative rules, and with a partitioning rule (ops/partition.py:
qk_partitioned: each device runs them on its own heads, D whole). The targets are
norms.QK_TARGETS.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .. import _jax_lnbwd, reference
from ..kernels import WORKSPACE_HEADER_BYTES, _cuda_device, dtype_name
from ..norms import QK_TARGETS, Norm
from . import ffi

__all__ = ["qk_fwd_call", "qk_fused_fwd_call", "qk_bwd_call", "qk_fused_bwd_call", "qk_workspace_bytes"]


def qk_workspace_bytes(dtype, rows_q: int, rows_k: int, D: int, fused: bool = False) -> int:
    """Scratch the QK-norm backward's CUDA kernels use for q's rows_q and k's rows_k rows of D
    (fused: head rows of the fused projection, which take other kernels than q and k of their
    own): on JAX's first GPU, what the C++ that plans their launch says (qk_launch_plan); without
    one (a CPU-only build or machine, where the workspace goes unused) the workspace's header
    alone."""
    dev = _cuda_device()
    plan = getattr(_jax_lnbwd, "qk_launch_plan", None)
    if dev is not None and plan is not None:
        return int(plan(dtype_name(dtype), int(rows_q), int(rows_k), int(D), dev, fused=fused)["workspace_bytes"])
    return WORKSPACE_HEADER_BYTES


def _stats_results(norm: Norm, rows: int, dtype) -> tuple:
    """(mean, rstd) result types of one set of rows: rmsnorm's mean is a (0,) placeholder."""
    stat = reference.acc_dtype(dtype)
    return ((rows if norm.centered else 0,), stat), ((rows,), stat)


def _stats(norm: Norm, mean, rstd) -> tuple:
    """The saved statistics in norm.stats order, from the targets' (mean, rstd)."""
    return tuple({"mean": mean, "rstd": rstd}[name] for name in norm.stats)


def _mean_rstd(norm: Norm, stats: tuple, rows_dtype) -> tuple:
    """The targets' (mean, rstd) from the statistics in norm.stats order (rmsnorm's mean: (0,))."""
    saved = dict(zip(norm.stats, stats))
    mean = saved["mean"] if "mean" in saved else jnp.zeros((0,), reference.acc_dtype(rows_dtype))
    return mean, saved["rstd"]


def _fwd_weights(q_weight, k_weight, D: int, data_dtype) -> tuple:
    """The forward's weight operands: (1, D) each, or (0, D) for an absent one, in the present
    one's dtype (the data's when both are absent). A weight keeps its own length: one that is
    not the data's D is the handler's error."""
    present = next((w.dtype for w in (q_weight, k_weight) if w is not None), data_dtype)
    return tuple(jnp.zeros((0, D), present) if w is None else w.reshape(1, -1) for w in (q_weight, k_weight))


def _attributes(norm: Norm, offset: float) -> dict:
    return dict(offset=np.float64(offset), norm=np.int32(norm.kind))


def qk_fwd_call(norm: Norm, q, k, q_weight, k_weight, eps: float, offset: float = 0.0):
    """(q_out, k_out, q_stats, k_stats): every row of q [rows_q, D] and k [rows_k, D] normalized by
    `norm` with its set's weight ((D,) or None)."""
    (rows_q, D), rows_k = q.shape, k.shape[0]
    weights = _fwd_weights(q_weight, k_weight, D, q.dtype)
    results = (((rows_q, D), q.dtype), ((rows_k, D), k.dtype),
               *_stats_results(norm, rows_q, q.dtype), *_stats_results(norm, rows_k, q.dtype))
    q_out, k_out, q_mean, q_rstd, k_mean, k_rstd = ffi.call(
        QK_TARGETS.fwd, (q, k, *weights), results, op="qk_norm_fwd", eps=np.float64(eps), **_attributes(norm, offset))
    return q_out, k_out, _stats(norm, q_mean, q_rstd), _stats(norm, k_mean, k_rstd)


def qk_fused_fwd_call(norm: Norm, qkv, q_weight, k_weight, q_heads: int, kv_heads: int, eps: float,
                      offset: float = 0.0):
    """(qkv_out, q_stats, k_stats): qkv [tokens, (q_heads + 2 * kv_heads) * D] with its q and k
    heads normalized by `norm` and its v heads unchanged, aliased to qkv."""
    tokens, width = qkv.shape
    D = width // max(q_heads + 2 * kv_heads, 1)   # bad head counts or widths are the handler's errors
    weights = _fwd_weights(q_weight, k_weight, D, qkv.dtype)
    results = ((qkv.shape, qkv.dtype), *_stats_results(norm, tokens * q_heads, qkv.dtype),
               *_stats_results(norm, tokens * kv_heads, qkv.dtype))
    qkv_out, q_mean, q_rstd, k_mean, k_rstd = ffi.call(
        QK_TARGETS.fused_fwd, (qkv, *weights), results, op="qk_norm_fused_fwd", aliases={0: 0},
        eps=np.float64(eps), q_heads=np.int64(q_heads), kv_heads=np.int64(kv_heads), **_attributes(norm, offset))
    return qkv_out, _stats(norm, q_mean, q_rstd), _stats(norm, k_mean, k_rstd)


def qk_bwd_call(norm: Norm, dq_out, dk_out, q, k, q_weight, k_weight, q_stats, k_stats, offset: float = 0.0):
    """(dq, dk, dq_weight, dk_weight): the backward of qk_fwd_call given the cotangents dq_out,
    dk_out and the saved statistics; the weights (D,) are required, and their gradients (D,),
    in the weights' dtype, are the sums over all of their set's rows. The target returns the two
    as one (2, D) array: the CUDA kernels' one finalize pass writes both rows."""
    (rows_q, D), rows_k = q.shape, k.shape[0]
    q_mean, q_rstd = _mean_rstd(norm, q_stats, q.dtype)
    k_mean, k_rstd = _mean_rstd(norm, k_stats, q.dtype)
    operands = (dq_out, dk_out, q, k, q_weight.reshape(1, -1), k_weight.reshape(1, -1), q_mean, q_rstd, k_mean,
                k_rstd)
    ws = qk_workspace_bytes(q.dtype, rows_q, rows_k, D)
    results = (((rows_q, D), q.dtype), ((rows_k, D), k.dtype), ((2, D), q_weight.dtype), ((ws,), np.uint8))
    dq, dk, dweights, _ = ffi.call(QK_TARGETS.bwd, operands, results, op="qk_norm_bwd", **_attributes(norm, offset))
    return dq, dk, dweights[0], dweights[1]


def qk_fused_bwd_call(norm: Norm, dqkv_out, qkv, q_weight, k_weight, q_stats, k_stats, q_heads: int,
                      kv_heads: int, offset: float = 0.0):
    """(dqkv, dq_weight, dk_weight): the backward of qk_fused_fwd_call given the cotangent
    dqkv_out (to which dqkv is aliased: its v heads are dqkv_out's) and the saved statistics;
    the weights (D,) are required."""
    tokens, width = qkv.shape
    D = q_weight.shape[-1]
    q_mean, q_rstd = _mean_rstd(norm, q_stats, qkv.dtype)
    k_mean, k_rstd = _mean_rstd(norm, k_stats, qkv.dtype)
    operands = (dqkv_out, qkv, q_weight.reshape(1, -1), k_weight.reshape(1, -1), q_mean, q_rstd, k_mean, k_rstd)
    ws = qk_workspace_bytes(qkv.dtype, tokens * q_heads, tokens * kv_heads, D, fused=True)
    results = ((qkv.shape, qkv.dtype), ((2, D), q_weight.dtype), ((ws,), np.uint8))
    dqkv, dweights, _ = ffi.call(
        QK_TARGETS.fused_bwd, operands, results, op="qk_norm_fused_bwd", aliases={0: 0},
        q_heads=np.int64(q_heads), kv_heads=np.int64(kv_heads), **_attributes(norm, offset))
    return dqkv, dweights[0], dweights[1]
