"""QK-norm's one op, forward half, and the custom_jvp of both forms: where its value and derivative meet.

When the dispatch rule runs QK-norm as one op (dispatch.qk_one_op: the switches' "ffi" today),
qk_norm and qk_norm_fused are `normalize`, a jax.custom_jvp over the form's data ((q, k) or
(qkv,)) and the two weights, holding QkSettings (qk_tangent.py) static. As autodiff.py's norms:
  * its value is `forward`: one call of the one op (ops/qk.py: qk_fwd_call, or qk_fused_fwd_call,
    which works in place on the fused projection) where the dispatch rule runs our forward, else
    each set's own forward (autodiff.forward: dispatched as rmsnorm/layernorm is);
  * its JVP rule computes the forward once, with the statistics (differentiated: the one op
    where forced, else the jnp forward per set, dispatch rule 3) and the tangents by ONE linear
    primitive (qk_tangent.py) whose transpose is ONE call of the one op's backward.
So under jax.grad the lowered program holds one custom call per direction when both are forced.
The one op is made batchable and differentiable by qk_tangent.one_op: under vmap with shared
weights the batch axis is more rows (still one call); with per-example weights each set runs
our norm's own op (two calls, per-example weights). Inside it the bare call is partitioned
(ops/partition.py: qk_partitioned): under a sharded jit each device runs it on its own heads,
the forward with no communication.

An absent weight is ones (its tangent zeros) in the present weight's dtype, the data's when both
are absent: the one op takes one weight dtype (autodiff.fill_params does the same for one norm).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from . import _checks, autodiff, dispatch, reference
from .ops import ffi, forward as forward_op, partition
from .ops.qk import qk_fused_fwd_call, qk_fwd_call
from .qk_tangent import QkSettings, one_op, tangent_map


def one_op_runs(fn: str, q, k, q_weight, k_weight, *arrays) -> bool:
    """Whether `fn` runs as the one op (dispatch.qk_one_op, refused by dispatch.qk_refusal) for q's
    and k's heads (arrays or shape-dtype structs: [..., heads, D]); `arrays`, the data as given,
    tell whether they are sharded."""
    rows = math.prod(q.shape[:-1]) + math.prod(k.shape[:-1])
    weight_dtypes = tuple(None if w is None else w.dtype for w in (q_weight, k_weight))
    refusal = dispatch.qk_refusal(q.dtype, k.dtype, weight_dtypes, q.shape[-1],
                                  explicitly_sharded=autodiff._explicitly_sharded(*arrays, q_weight, k_weight),
                                  partly_manual=partition.in_partly_manual())
    return dispatch.qk_one_op(fn, rows, q.shape[-1], q.dtype, refusal=refusal,
                              bwd_mode=dispatch.mode(dispatch.BACKWARD), cuda_built=ffi.WITH_CUDA)


def settings(fn: str, norm, eps: float, offset: float, q, q_weight, k_weight, q_heads: int = 0,
             kv_heads: int = 0) -> QkSettings:
    """The one op's static settings: each set's (autodiff.settings: the default backward kernel
    and the backward's switch mode, captured now) and the form (head counts; 0: separate)."""
    per_set = autodiff.settings(norm, eps, None, None, offset, fn=fn, x=q,
                                mixed=_checks.is_mixed(q, q_weight, k_weight))
    return QkSettings(per_set, q_heads, kv_heads)


def fill_weights(q_weight, k_weight, D: int, dtype, *tangents) -> tuple:
    """(q_weight, k_weight, *their tangents): an absent weight as ones and its tangent as zeros,
    in the present weight's dtype (`dtype`, the data's, when both are absent)."""
    dtype = next((w.dtype for w in (q_weight, k_weight) if w is not None), dtype)
    filled = tuple(jnp.ones((D,), dtype) if w is None else w for w in (q_weight, k_weight))
    return filled + tuple(jnp.zeros((D,), dtype) if w is None else t for w, t in zip((q_weight, k_weight), tangents))


# --- the forward: (*data, q_weight, k_weight) -> (*outputs, *q_stats, *k_stats) ----------------------

def _fwd_local(s: QkSettings, *args) -> tuple:
    """The one call, on the form's arrays reshaped to the targets' 2-D rows, with the statistics
    shaped like each set's heads without D."""
    data, (q_weight, k_weight) = args[:-2], args[-2:]
    q_lead, k_lead, D = s.head_shapes(*data)
    norm, eps, offset = s.per_set.norm, s.per_set.eps, s.per_set.offset
    if s.q_heads:
        (qkv,) = data
        out, q_stats, k_stats = qk_fused_fwd_call(norm, qkv.reshape(-1, qkv.shape[-1]), q_weight, k_weight,
                                                  s.q_heads, s.kv_heads, eps, offset)
        outs = (out.reshape(qkv.shape),)
    else:
        q, k = data
        q_out, k_out, q_stats, k_stats = qk_fwd_call(norm, q.reshape(-1, D), k.reshape(-1, D), q_weight, k_weight,
                                                     eps, offset)
        outs = (q_out.reshape(q.shape), k_out.reshape(k.shape))
    return (*outs, *(st.reshape(q_lead) for st in q_stats), *(st.reshape(k_lead) for st in k_stats))


def _fwd_per_set(s: QkSettings, f, *args) -> tuple:
    """The same from f(x, weight) -> (y, *stats), a norm's forward, once per set; v unchanged."""
    data, (q_weight, k_weight) = args[:-2], args[-2:]
    q, k, v = s.split(*data)
    (q_out, *q_stats), (k_out, *k_stats) = f(q, q_weight), f(k, k_weight)
    return (*s.join(q_out, k_out, v), *q_stats, *k_stats)


@functools.cache
def fwd_op(s: QkSettings):
    """The one op's forward for these settings, batchable and differentiable (qk_tangent.one_op):
    a batch with shared weights is more rows, per-example weights run our norm's forward per set."""
    norm, eps, offset = s.per_set.norm, s.per_set.eps, s.per_set.offset
    ref = functools.partial(_fwd_per_set, s, lambda x, w: reference.norm_fwd(norm, x, w, None, eps, offset))
    two_calls = functools.partial(_fwd_per_set, s, lambda x, w: forward_op.norm_fwd_op(norm, x, w, None, eps, offset))
    local = partition.qk_partitioned(functools.partial(_fwd_local, s), len(norm.stats), bool(s.q_heads), False, s.fn)
    return one_op(local, ref, two_calls, (s.n_data, s.n_data + 1), fold=True)


def forward(s: QkSettings, *args, differentiated: bool = False) -> tuple:
    """(*outputs, *q_stats, *k_stats) for (*data, q_weight, k_weight): ONE call of the one op where
    the dispatch rule runs our forward (dispatch.decide, op s.fn), else each set's own forward
    (autodiff.forward, dispatched as the norm; differentiated: under autodiff, the jnp one)."""
    data = args[:-2]
    q_lead, k_lead, D = s.head_shapes(*data)
    dtype = data[0].dtype
    decision = dispatch.decide(s.per_set.norm, dispatch.FORWARD, (math.prod(q_lead) + math.prod(k_lead), D), dtype,
                               op=s.fn, differentiated=differentiated, cuda_built=ffi.WITH_CUDA)
    norm, eps, offset = s.per_set.norm, s.per_set.eps, s.per_set.offset

    def ours(*args):
        return fwd_op(s)(*args[:-2], *fill_weights(*args[-2:], D, dtype))

    def theirs(*args):
        return _fwd_per_set(s, lambda x, w: autodiff.forward(norm, x, w, None, eps, offset, differentiated), *args)

    return dispatch.run(decision, ours, theirs, *args)


# --- the custom_jvp -------------------------------------------------------------------------------

@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def normalize(s: QkSettings, *args) -> tuple:
    """The form's outputs, (q_out, k_out) or (qkv_out,), for (*data, q_weight, k_weight)."""
    return forward(s, *args)[:s.n_data]


@normalize.defjvp
def _normalize_jvp(s, primals, tangents):
    """The outputs and their tangents: ONE tangent-map primitive (qk_tangent.py) for both sets."""
    n, m = s.n_data, len(s.per_set.norm.stats)
    data, ddata = primals[:n], tangents[:n]
    out = forward(s, *primals, differentiated=True)
    q_stats, k_stats = out[n:n + m], out[n + m:]
    _, _, D = s.head_shapes(*data)
    q_weight, k_weight, dq_weight, dk_weight = fill_weights(*primals[n:], D, data[0].dtype, *tangents[n:])
    tangents_out = tangent_map(s, data, (q_weight, k_weight), q_stats, k_stats, ddata, (dq_weight, dk_weight))
    return tuple(out[:n]), tuple(tangents_out)
