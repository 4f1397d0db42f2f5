"""QK-norm: attention's queries and keys normalized per head, over head_dim (Qwen3, Gemma 3, OLMo 2).

    q_out, k_out = qk_norm(q, k, q_weight, k_weight)              # q [..., Hq, D], k [..., Hk, D]
    qkv_out = qk_norm_fused(qkv, q_weight, k_weight, q_heads=Hq, kv_heads=Hk)

Each head's D values are one row of the norm, and one weight (D,) scales every head:

    q_out[..., h, :] = x̂(q[..., h, :]) * (offset + q_weight)     (k likewise, with k_weight)

with rmsnorm's x̂ = x * rsqrt(mean(x²) + eps), or layernorm's (x - mean) * rsqrt(var + eps)
(norm="layernorm": no bias, no offset). Hq may differ from Hk (grouped-query attention).

q and k are normalized by the rmsnorm (or layernorm) op, one call each, so both forms have
everything those ops have: jit, grad and jvp to any order, vmap, scan, checkpoint, jax.export,
sharding over rows and over a head axis (heads are rows to the op). dq_weight and dk_weight
are summed over all rows and heads, in fp32 when the weights are fp32.

qk_norm_fused takes the fused projection's output [..., (Hq + 2·Hk)·D], heads in the order q,
k, v, and returns the same array with the q and k heads normalized and v unchanged. It splits
the heads, normalizes q and k, and concatenates the three back. Where the norm is our kernel (a
custom call, which reads a contiguous operand) the q and k slices and the concatenation are
copies around the two calls; a kernel that reads q and k in place in the fused array needs none.

The norm kind is the public keyword's string ("rmsnorm", "layernorm"), converted to its row
(norms.RMSNORM, norms.LAYERNORM) here, at the boundary.
"""
from __future__ import annotations

import jax.numpy as jnp

from . import _checks
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
    return _normalize("qk_norm", q, k, q_weight, k_weight, eps, offset, norm)


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
    heads = qkv.reshape(qkv.shape[:-1] + (q_heads + 2 * kv_heads, D))
    q, k, v = (heads[..., :q_heads, :], heads[..., q_heads:q_heads + kv_heads, :],
               heads[..., q_heads + kv_heads:, :])
    q, k = _normalize(fn, q, k, q_weight, k_weight, eps, offset, norm)
    return jnp.concatenate([q, k, v], axis=-2).reshape(qkv.shape)


def _normalize(fn, q, k, q_weight, k_weight, eps, offset, norm):
    """Both forms' checks, named for `fn`, then one norm call for q and one for k."""
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
    if norm is RMSNORM:
        return rmsnorm(q, q_weight, eps=eps, offset=offset), rmsnorm(k, k_weight, eps=eps, offset=offset)
    return layernorm(q, q_weight, None, eps=eps), layernorm(k, k_weight, None, eps=eps)
