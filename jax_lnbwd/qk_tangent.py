"""QK-norm's one op, backward half: its tangent map, a linear primitive whose transpose is ONE call.

QK-norm normalizes q's and k's heads with one norm (rmsnorm or layernorm, no bias), each set
with its own weight (D,). Its tangent is therefore two of the norm's tangent maps side by side
(tangent.py's formula, `tangent.tangent_reference`, once per set), and its transpose two of the
norm's backwards, which the one op computes in one call (ops/qk.py: qk_bwd_call, or
qk_fused_bwd_call for the fused projection, where the v heads' cotangent passes through). The
primitives here, one per form, are bound by the forms' custom_jvp (qk_autodiff.py) to
    (*data, q_weight, k_weight, *q_stats, *k_stats, *ddata, dq_weight, dk_weight) -> tangents
with data (q, k) and results (tq, tk) for qk_norm, and data (qkv,) and result (tqkv,) for
qk_norm_fused (its v heads' tangent is dqkv's). Leading axes of q, k and qkv are rows; the
weights and their tangents are (D,) (an absent weight is ones, its tangent zeros); the stats
are each set's heads' statistics, shaped like its heads without D. What each transformation
sees is what tangent.py describes for the norms:
  * jvp, linearize's linear function: the formula in jnp (XLA fuses it);
  * grad, vjp: the transpose, `backward`: the one op where the dispatch rule runs it (the
    switches' "ffi"), else each set's own dispatched backward (ops/backward.py: dispatched),
    as two norm calls would run;
  * vmap: with shared weights the batch axis is more rows, so the primitive is bound again and
    reverse mode over the vmap is still one call; with per-example weights (or weight tangents)
    each set is the norm's own tangent map with a segment axis (per-example weight sums);
  * derivatives of the map itself: linear in its tangents, the jnp JVP of the formula in the rest
    (tangent._jvp). It refuses to be transposed in data, weights or stats (tangent._transpose).
The one op itself is made batchable and differentiable by `one_op` (below), which the forward
(qk_autodiff.py) uses too; the bare call inside it is partitioned (ops/partition.py:
qk_partitioned): under a sharded jit each device runs the backward on its own heads and the
weight gradients, its partial sums, are added with one psum over the axes that split them.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import autodiff, dispatch, reference, tangent
from .ops import backward as backward_op, ffi, partition
from .ops.qk import qk_bwd_call, qk_fused_bwd_call


@dataclasses.dataclass(frozen=True)
class QkSettings:
    """What QK-norm's one op holds static: the norm's settings for each set (autodiff.Settings:
    the norm, eps, offset, and the backward two norm calls would run: kernel, block size and
    the backward's switch mode, captured when the public function was traced), and the form:
    the fused projection's head counts, or 0 for separate q and k."""
    per_set: autodiff.Settings
    q_heads: int = 0
    kv_heads: int = 0

    @property
    def fn(self) -> str:
        """The public function (errors, decisions)."""
        return "qk_norm_fused" if self.q_heads else "qk_norm"

    @property
    def n_data(self) -> int:
        """How many data operands the form has: (q, k) or (qkv,)."""
        return 1 if self.q_heads else 2

    def head_shapes(self, *data) -> tuple[tuple, tuple, int]:
        """(q's heads' leading shape, k's, D): the stats' shapes, without slicing anything."""
        if not self.q_heads:
            q, k = data
            return q.shape[:-1], k.shape[:-1], q.shape[-1]
        (qkv,) = data
        lead, D = qkv.shape[:-1], qkv.shape[-1] // (self.q_heads + 2 * self.kv_heads)
        return lead + (self.q_heads,), lead + (self.kv_heads,), D

    def split(self, *data):
        """(q, k, v): (q, k, None) for the separate form; the fused form's heads [..., H, D]."""
        if not self.q_heads:
            return (*data, None)
        (qkv,) = data
        *_, D = self.head_shapes(qkv)
        heads = qkv.reshape(qkv.shape[:-1] + (self.q_heads + 2 * self.kv_heads, D))
        hq, hk = self.q_heads, self.q_heads + self.kv_heads
        return heads[..., :hq, :], heads[..., hq:hk, :], heads[..., hk:, :]

    def join(self, q, k, v) -> tuple:
        """The form's data from its sets: (q, k), or (qkv,) with the heads in the order q, k, v."""
        if not self.q_heads:
            return q, k
        heads = jnp.concatenate([q, k, v], axis=-2)
        return (heads.reshape(heads.shape[:-2] + (-1,)),)


def one_op(local, reference_fn, two_calls, weights: tuple[int, ...], fold: bool):
    """local(*arrays), a bare one-op call on arrays whose leading axes are rows, as a function
    that vmap and differentiation reach (ops/forward.py's wrappers, for the one op):
      * custom_vmap: where `fold` and the weights (operands at `weights`) are shared by the
        batch, the batch axis is more rows: the op again on the batched arrays (so nested vmaps
        are one call). Otherwise jax.vmap of two_calls (our op of each norm, whose own rules
        keep one weight per example): per-example weights, and the backward, whose weight
        gradients under vmap are per example while the one op sums over all of its rows.
      * custom_jvp (outside, so that it defines derivatives): the JVP of reference_fn, the same
        math in jnp; so a backward is differentiable again (grad of grad, hessian).
    """
    @jax.custom_batching.custom_vmap
    def run(*args):
        return local(*args)

    @run.def_vmap
    def rule(axis_size, in_batched, *args):
        if fold and not any(in_batched[i] for i in weights):
            out = op(*(a if b or i in weights else jnp.broadcast_to(a, (axis_size, *a.shape))
                       for i, (a, b) in enumerate(zip(args, in_batched))))
        else:
            out = jax.vmap(two_calls, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    op = jax.custom_jvp(run)

    @op.defjvp
    def op_jvp(primals, tangents):
        return op(*primals), jax.jvp(reference_fn, primals, tangents)[1]

    return op


# --- the backward: (*cts, *data, q_weight, k_weight, *q_stats, *k_stats) -> (*gdata, dq_weight, dk_weight) ---

def _unpack_bwd(s: QkSettings, args) -> tuple:
    """(cts, data, weights, q_stats, k_stats) of the backward's operands."""
    n, m = s.n_data, len(s.per_set.norm.stats)
    return args[:n], args[n:2 * n], args[2 * n:2 * n + 2], args[2 * n + 2:2 * n + 2 + m], args[2 * n + 2 + m:]


def _bwd_local(s: QkSettings, *args) -> tuple:
    """The one call, on the form's arrays reshaped to the targets' 2-D rows and back."""
    cts, data, (q_weight, k_weight), q_stats, k_stats = _unpack_bwd(s, args)
    norm, offset = s.per_set.norm, s.per_set.offset
    flat = lambda stats: tuple(st.reshape(-1) for st in stats)  # noqa: E731
    if s.q_heads:
        (ct,), (qkv,) = cts, data
        width = qkv.shape[-1]
        dqkv, dq_weight, dk_weight = qk_fused_bwd_call(
            norm, ct.reshape(-1, width), qkv.reshape(-1, width), q_weight, k_weight, flat(q_stats), flat(k_stats),
            s.q_heads, s.kv_heads, offset)
        return dqkv.reshape(qkv.shape), dq_weight, dk_weight
    (cq, ck), (q, k) = cts, data
    D = q.shape[-1]
    dq, dk, dq_weight, dk_weight = qk_bwd_call(
        norm, cq.reshape(-1, D), ck.reshape(-1, D), q.reshape(-1, D), k.reshape(-1, D), q_weight, k_weight,
        flat(q_stats), flat(k_stats), offset)
    return dq.reshape(q.shape), dk.reshape(k.shape), dq_weight, dk_weight


def _bwd_per_set(s: QkSettings, f, *args) -> tuple:
    """The same from f(dy, x, weight, stats) -> (dx, dweight, ...), a norm's backward, once per set;
    the v heads' cotangent passes through."""
    cts, data, (q_weight, k_weight), q_stats, k_stats = _unpack_bwd(s, args)
    (cq, ck, cv), (q, k, _) = s.split(*cts), s.split(*data)
    dq, dq_weight, *_ = f(cq, q, q_weight, q_stats)
    dk, dk_weight, *_ = f(ck, k, k_weight, k_stats)
    return (*s.join(dq, dk, cv), dq_weight, dk_weight)


def _norm_bwd(s: QkSettings, *, dispatched: bool):
    """One set's backward by our FFI op, or (dispatched) as the dispatch rule says for the norm."""
    ps = s.per_set
    params = dict(seg_dims=0, kernel=ps.kernel, block_size=ps.block_size, caller=s.fn, norm=ps.norm, offset=ps.offset)
    if dispatched:
        return lambda dy, x, w, stats: backward_op.dispatched(dy, x, w, *stats, mode=ps.bwd_mode, **params)
    return lambda dy, x, w, stats: backward_op.backward(dy, x, w, *stats, **params)


@functools.cache
def bwd_op(s: QkSettings):
    """The one op's backward for these settings, batchable and differentiable (`one_op`)."""
    norm, offset = s.per_set.norm, s.per_set.offset
    ref = functools.partial(_bwd_per_set, s, lambda dy, x, w, stats: reference.norm_bwd(norm, dy, x, w, stats, offset))
    two_calls = functools.partial(_bwd_per_set, s, _norm_bwd(s, dispatched=False))
    n = s.n_data
    local = partition.qk_partitioned(functools.partial(_bwd_local, s), len(norm.stats), bool(s.q_heads), True, s.fn)
    return one_op(local, ref, two_calls, (2 * n, 2 * n + 1), fold=False)


def _rows(s: QkSettings, *data) -> tuple[int, int]:
    """(q's and k's rows together, D): the shape the dispatch rule sees."""
    q_lead, k_lead, D = s.head_shapes(*data)
    return math.prod(q_lead) + math.prod(k_lead), D


def backward(s: QkSettings, *args) -> tuple:
    """(*the form's cotangents, dq_weight, dk_weight) for the backward's operands (above): ONE call
    of the one op where the dispatch rule runs it (dispatch.decide, op s.fn, under the backward
    mode the public function captured), else each set's own dispatched backward."""
    data = args[s.n_data:2 * s.n_data]
    decision = dispatch.decide(s.per_set.norm, dispatch.BACKWARD, _rows(s, *data), data[0].dtype, op=s.fn,
                               mode_=s.per_set.bwd_mode, cuda_built=ffi.WITH_CUDA)
    theirs = functools.partial(_bwd_per_set, s, _norm_bwd(s, dispatched=True))
    return dispatch.run(decision, bwd_op(s), theirs, *args)


# --- the tangent-map primitives ----------------------------------------------------------------

def _unpack(s: QkSettings, args) -> tuple:
    """(data, weights, q_stats, k_stats, ddata, dweights) of the primitive's operands."""
    n, m = s.n_data, len(s.per_set.norm.stats)
    stats = args[n + 2:n + 2 + 2 * m]
    return args[:n], args[n:n + 2], stats[:m], stats[m:], args[n + 2 + 2 * m:-2], args[-2:]


def _set_tangent(s: QkSettings, x, weight, stats, dx, dweight, **params):
    """One set's tangent: the norm's own map (a centered norm's dbias is zero: QK-norm has no bias)."""
    norm = s.per_set.norm
    ptangents = (dweight, jnp.zeros_like(dweight)) if norm.centered else (dweight,)
    return tangent.tangent_reference(norm, x, weight, *stats, dx, *ptangents, offset=s.per_set.offset, **params)


def _formula(*args, settings: QkSettings) -> list:
    """The tangents in jnp: each set's map (tangent.tangent_reference), the v heads' tangent dv."""
    s = settings
    data, (q_weight, k_weight), q_stats, k_stats, ddata, (dq_weight, dk_weight) = _unpack(s, args)
    (q, k, _), (dq, dk, dv) = s.split(*data), s.split(*ddata)
    return list(s.join(_set_tangent(s, q, q_weight, q_stats, dq, dq_weight, seg_dims=0),
                       _set_tangent(s, k, k_weight, k_stats, dk, dk_weight, seg_dims=0), dv))


def _abstract_eval(*args, settings: QkSettings):
    data, weights, q_stats, k_stats, ddata, dweights = _unpack(settings, args)
    q_lead, k_lead, D = settings.head_shapes(*data)
    for d, t in zip(data, ddata):
        assert d.shape == t.shape and d.dtype == t.dtype, (d, t)
    for stats, lead in ((q_stats, q_lead), (k_stats, k_lead)):
        assert all(st.shape == lead for st in stats), (stats, lead)
    for w in (*weights, *dweights):
        assert w.shape == (D,), (w, D)
    return [d.update(weak_type=False) for d in data]


def _linear_transpose(cts, *args, settings: QkSettings):
    """The tangents' cotangents (None where not transposed): `backward` on the outputs' cotangents."""
    s = settings
    data, weights, q_stats, k_stats, ddata, dweights = _unpack(s, args)
    wanted = [ad.is_undefined_primal(t) for t in (*ddata, *dweights)]
    if all(type(c) is ad.Zero for c in cts) or not any(wanted):
        return (None,) * len(wanted)
    grads = backward(s, *map(ad.instantiate_zeros, cts), *data, *weights, *q_stats, *k_stats)
    return tuple(g if w else None for g, w in zip(grads, wanted))


def _batch(p: Primitive, args, dims, *, settings: QkSettings):
    """Shared weights and weight tangents: the batch axis first (an unbatched data operand
    broadcast), bound again: leading axes are rows. Otherwise each set by its norm's tangent map
    (tangent.tangent_map) with one segment axis: per-example weights and weight sums."""
    s = settings
    B = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    params_at = (s.n_data, s.n_data + 1, len(args) - 2, len(args) - 1)   # weights and their tangents
    shared = all(dims[i] is None for i in params_at)

    def front(i, a, d):
        if d is not None:
            return jnp.moveaxis(a, d, 0)
        if i in params_at:
            return a if shared else a[None]   # shared by the new segments
        return jnp.broadcast_to(a, (B, *a.shape))

    args = [front(i, a, d) for i, (a, d) in enumerate(zip(args, dims))]
    if shared:
        return tangent.bind(p, *args, settings=s), [0] * s.n_data
    data, (q_weight, k_weight), q_stats, k_stats, ddata, (dq_weight, dk_weight) = _unpack(s, args)
    (q, k, _), (dq, dk, dv) = s.split(*data), s.split(*ddata)
    params = {**s.per_set.backward(), "seg_dims": 1}
    norm = s.per_set.norm

    def one_set(x, weight, stats, dx, dweight):
        ptangents = (dweight, jnp.zeros_like(dweight)) if norm.centered else (dweight,)
        return tangent.tangent_map(norm, x, weight, stats, ptangents, dx, **params)

    out = s.join(one_set(q, q_weight, q_stats, dq, dq_weight), one_set(k, k_weight, k_stats, dk, dk_weight), dv)
    return list(out), [0] * s.n_data


def _nonlinear_names(s: QkSettings) -> tuple[str, ...]:
    stats = tuple(f"{x}_{st}" for x in "qk" for st in s.per_set.norm.stats)
    return (*(("qkv",) if s.q_heads else ("q", "k")), "q_weight", "k_weight", *stats)


def _define(name: str, tangent_names: tuple[str, ...]) -> Primitive:
    """A QK-norm tangent-map primitive (one per form), with the rules above."""
    p = Primitive(name)
    p.multiple_results = True
    p.def_impl(jax.jit(_formula, static_argnames="settings"))
    p.def_abstract_eval(_abstract_eval)
    mlir.register_lowering(p, mlir.lower_fun(_formula, multiple_results=True))

    def jvp(primals, tangents, *, settings):
        n_nonlinear = len(_nonlinear_names(settings))
        return tangent._jvp(p, _formula, n_nonlinear, primals, tangents, settings=settings)

    def transpose(cts, *args, settings):
        return tangent._transpose(settings.fn, tangent_names, _linear_transpose, _nonlinear_names(settings), cts,
                                  *args, settings=settings)

    ad.primitive_jvps[p] = jvp
    ad.primitive_transposes[p] = transpose
    batching.primitive_batchers[p] = functools.partial(_batch, p)
    return p


_PRIMITIVES = {False: _define("jax_lnbwd_qk_norm_tangent", ("dq", "dk", "dq_weight", "dk_weight")),
               True: _define("jax_lnbwd_qk_norm_fused_tangent", ("dqkv", "dq_weight", "dk_weight"))}


def tangent_map(s: QkSettings, data, weights, q_stats, k_stats, ddata, dweights) -> list:
    """The form's output tangents at (data, weights, stats) applied to (ddata, dweights), all
    operands in the layout above (weights filled: ones where absent, their tangents zeros)."""
    return tangent.bind(_PRIMITIVES[bool(s.q_heads)], *data, *weights, *q_stats, *k_stats, *ddata, *dweights,
                        settings=s)
