"""QK-norm: attention's queries and keys normalized per head, over head_dim (Qwen3, Gemma 3, OLMo 2).

    q_out, k_out = qk_norm(q, k, q_weight, k_weight)              # q [..., Hq, D], k [..., Hk, D]
    qkv_out = qk_norm_fused(qkv, q_weight, k_weight, q_heads=Hq, kv_heads=Hk)

Each head's D values are one row of the norm, and one weight (D,) scales every head:

    q_out[..., h, :] = x̂(q[..., h, :]) * (offset + q_weight)     (k likewise, with k_weight)

with rmsnorm's x̂ = x * rsqrt(mean(x²) + eps), or layernorm's (x - mean) * rsqrt(var + eps)
(norm="layernorm": no bias, no offset). Hq may differ from Hk (grouped-query attention).

Two paths compute it, with the same numbers (statistics in fp32, outputs rounded once):
  * two norm calls (the default): q and k are normalized by the rmsnorm (or layernorm) op, one
    call each, each dispatched as that op is (dispatch.py: our kernel on CUDA above its
    crossovers, XLA's jnp elsewhere), so both forms have everything those ops have: jit, grad
    and jvp to any order, vmap, scan, checkpoint, jax.export, sharding over rows and over a
    head axis (heads are rows to the op). qk_norm_fused splits the heads, normalizes q and k,
    and concatenates the three back: where the norm is our kernel (a custom call, which reads
    a contiguous operand) the q and k slices and the concatenation are copies around the calls.
  * one op (qk_autodiff.py and qk_tangent.py): ONE FFI call per direction for q's and
    k's heads together (one kernel launch on the GPU); qk_norm_fused's reads and writes the
    fused projection in place (its v heads untouched), with no slices or concatenation. It runs
    where the dispatch rule says (dispatch.qk_one_op): on CUDA by default with D >= 64 and at
    least 65536 rows of q's and k's heads of 16-byte vectors (measured: qk_norm_fused's 1.9-3x the
    two calls and 1.5-2x XLA; qk_norm's 2-9% ahead of the two calls forward, even backward), and when a
    switch forces our kernels (use_ffi_forward(True), use_ffi_backward(True),
    JAX_LNBWD_FORWARD/BACKWARD=ffi) on every platform (the CPU runs the C++ handler), in the
    forced direction; the other direction then runs as it is dispatched.
    It has jit, grad and jvp to any order, vmap (shared weights: the batch is more rows, still
    one call; per-example weights: our norm's op per set), scan, checkpoint and jax.export, and
    a partitioning rule (ops/partition.py: qk_partitioned): under a sharded jit q and k may be
    split over their token and head axes (qk_norm_fused's projection over its tokens only),
    each device runs the op on its own heads with no communication, and the backward adds the
    weight gradients with one psum; a sharded D (the fused form: a sharded width, where q, k
    and v heads interleave) is gathered with a ShardingFallbackWarning. Where it cannot run
    (dispatch.qk_refusal: q and k of two dtypes, weights of two dtypes, a head's row not a
    multiple of 16 bytes or over the kernels' limit, Explicit mesh axes, a shard_map over only
    some mesh axes) the two calls run instead, whatever the switches, and decisions() says why.
dq_weight and dk_weight are summed over all rows and heads, in fp32 when the weights are fp32.
The off switch (use_xla_backward(True)) makes both forms the jnp reference per set.

Errors: arguments are checked at trace time, before either path is chosen, and every message
names the public function (qk_norm or qk_norm_fused) and the argument, e.g.
    qk_norm: 'k_weight' has shape (1, 8) but expected (8,)
The one op's handlers check again at run time (ffi/checks/qk_norm.h), naming the target.

The norm kind is the public keyword's string ("rmsnorm", "layernorm"), converted to its row
(norms.RMSNORM, norms.LAYERNORM) here, at the boundary.
"""
from __future__ import annotations

import jax

from . import _checks, autodiff, qk_autodiff
from .layernorm import layernorm
from .norms import RMSNORM, Norm
from .rmsnorm import rmsnorm


def qk_norm(q, k, q_weight, k_weight, *, eps: float = 1e-6, offset: float = 0.0, norm: str | Norm = "rmsnorm"):
    """(q_out, k_out): q [..., Hq, D] and k [..., Hk, D] normalized over their last axis (D).

    q and k have rank >= 2 and one head_dim D (their other axes may differ), each a dtype the
    norm ops take; q_weight and k_weight are (D,) in their tensor's dtype (or float32 beside
    bfloat16/float16: mixed precision, float32 gradients), or None (no scale). eps and offset
    are static Python floats; offset (Gemma's zero-centred scale: 1.0) is rmsnorm's, added to
    both weights. norm is "rmsnorm" or "layernorm" (no bias). Outputs have q's and k's dtypes.
    """
    fn = "qk_norm"
    norm, eps, offset = _check(fn, q, k, q_weight, k_weight, eps, offset, norm)
    s = qk_autodiff.settings(fn, norm, eps, offset, q, q_weight, k_weight)
    if qk_autodiff.one_op_runs(fn, q, k, q_weight, k_weight, q, k):
        return qk_autodiff.normalize(s, *autodiff.vary_all(q, k, q_weight, k_weight))
    return _two_calls(norm, q, k, q_weight, k_weight, eps, offset)


def qk_norm_fused(qkv, q_weight, k_weight, *, q_heads: int, kv_heads: int, eps: float = 1e-6,
                  offset: float = 0.0, norm: str | Norm = "rmsnorm"):
    """qkv [..., (q_heads + 2 * kv_heads) * D] (q heads, then k heads, then v heads) with its q
    and k heads normalized as qk_norm does and its v heads unchanged: the same shape and dtype.

    D = qkv.shape[-1] // (q_heads + 2 * kv_heads); the weights are (D,) or None.
    """
    fn = "qk_norm_fused"
    q_heads = _checks.head_count(fn, "q_heads", q_heads)
    kv_heads = _checks.head_count(fn, "kv_heads", kv_heads)
    D = _checks.fused_head_dim(fn, qkv, q_heads, kv_heads)
    # q's and k's heads as the checks and the rule see them (shapes only: nothing is sliced yet).
    q, k = (jax.ShapeDtypeStruct(qkv.shape[:-1] + (h, D), qkv.dtype) for h in (q_heads, kv_heads))
    norm, eps, offset = _check(fn, q, k, q_weight, k_weight, eps, offset, norm)
    s = qk_autodiff.settings(fn, norm, eps, offset, q, q_weight, k_weight, q_heads, kv_heads)
    if qk_autodiff.one_op_runs(fn, q, k, q_weight, k_weight, qkv):
        return qk_autodiff.normalize(s, *autodiff.vary_all(qkv, q_weight, k_weight))[0]
    q, k, v = s.split(qkv)
    return s.join(*_two_calls(norm, q, k, q_weight, k_weight, eps, offset), v)[0]


def _check(fn, q, k, q_weight, k_weight, eps, offset, norm) -> tuple[Norm, float, float]:
    """Both forms' checks, named for `fn`: (the norm's row, eps, offset)."""
    norm = _checks.norm_kind(fn, norm)
    eps = _checks.eps(fn, eps)
    _checks.heads(fn, "q", q)
    _checks.heads(fn, "k", k)
    _checks.same_head_dim(fn, q, k)
    _checks.param(fn, "q_weight", q_weight, q)
    _checks.param(fn, "k_weight", k_weight, k)
    offset = _checks.offset(fn, offset, q_weight, "q_weight")
    offset = _checks.offset(fn, offset, k_weight, "k_weight")
    if not norm.offset and offset != 0.0:
        raise ValueError(f"{fn}: offset={offset!r} is rmsnorm's; norm={norm.name!r} takes none (pass offset=0)")
    return norm, eps, offset


def _two_calls(norm, q, k, q_weight, k_weight, eps, offset):
    """One norm call for q and one for k, each dispatched as that norm is."""
    if norm is RMSNORM:
        return rmsnorm(q, q_weight, eps=eps, offset=offset), rmsnorm(k, k_weight, eps=eps, offset=offset)
    return layernorm(q, q_weight, None, eps=eps), layernorm(k, k_weight, None, eps=eps)
