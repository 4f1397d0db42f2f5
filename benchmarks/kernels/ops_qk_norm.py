"""The QK-norm ops of the kernel bench (ops.py): qk_norm_fwd, qk_norm_bwd (q and k apart,
jax_lnbwd.qk_norm) and qk_norm_fused_fwd, qk_norm_fused_bwd (the fused projection's qkv,
jax_lnbwd.qk_norm_fused), each its bytes, its Case (cases.py) and its entries.

Shapes: the bench's ROWSxC is read as TOKENSxD here, D the head_dim, with Q_HEADS query heads
and KV_HEADS key (and value) heads, fixed: q [TOKENS, Q_HEADS, D], k [TOKENS, KV_HEADS, D],
qkv [TOKENS, (Q_HEADS + 2 * KV_HEADS) * D] (q heads, then k heads, then v heads). Every head is
one row of the norm: TOKENS * (Q_HEADS + KV_HEADS) rows of D.

Entries (the same four for every op):
  ours       the public function (qk_norm, qk_norm_fused) with our kernels forced
             (jax_lnbwd.use_ffi_forward(True), use_ffi_backward(True)): what the other ops call
             ours, our kernel, on every platform: the one op, q's and k's heads in one launch
             each way.
  default    the public function under the dispatch rule (jax_lnbwd/dispatch.py): what a user
             gets, our kernel or XLA's fusion per direction and shape (--peers default)
  two-calls  a peer: two jax_lnbwd.rmsnorm calls, on q and on k, our kernels forced as in ours
             (the fused form: q and k sliced out of qkv, normalized, concatenated with v again);
             what ours must beat once it is one launch (--peers two-calls)
  xla        a peer: the jnp reference (reference.rmsnorm_fwd, rmsnorm_bwd given rstd) per head,
             fused by XLA (--peers xla)
and the copy peer, as for every op. torch and liger (CUDA only, peers_rms.qk_step): torch's
F.rms_norm and Liger's RMSNorm applied to q and to k viewed as [TOKENS * heads, D] (the fused
form: sliced out of qkv and concatenated back), the backward by autograd.

The backward: no public function takes qk_norm's saved statistics yet (rmsnorm_bwd does for one
tensor), so the backward entries (ours, default, two-calls) time the backward of the public
function: its pullback, jax.vjp(f, *primals)[1], made once per case (prepare: the forward runs
there, outside the timed chain, in jnp: a case must not need our FFI forward). A pullback is a
pytree whose leaves are the saved residuals (x, the weights, rstd), so it is a constant input of
the step like any other: it goes through the chain's optimization barriers (timing.time_jax) and
XLA can neither hoist nor share work between steps. A step is then the pullback applied to the
chained cotangent: the backward alone, as the other backward ops are timed, not the forward.
The backward's path is fixed when its forward is traced (a backward uses its forward's
decision), so each pullback is made under its entry's switches.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from jax_lnbwd import qk_norm, qk_norm_fused, reference, rmsnorm, use_ffi_backward, use_ffi_forward

from .cases import Case, Impl, default_impls, f64, params_dtype, stat_bytes
from .timing import EPS

# The two facts of every qk op's shape, written once: a shape TOKENSxD is TOKENS tokens of
# Q_HEADS query heads and KV_HEADS key heads of head_dim D (Llama-3-8B's and Qwen3-8B's heads:
# grouped-query attention, 4 q heads per kv head).
Q_HEADS = 32
KV_HEADS = 8
HEADS = Q_HEADS + 2 * KV_HEADS  # the heads of a fused qkv row: q, k and v
SHAPES_NOTE = f"qk ops read ROWSxC as TOKENSxD (head_dim D), with {Q_HEADS} q heads and {KV_HEADS} k/v heads"

OURS, DEFAULT, TWO_CALLS, XLA = "ours", "default", "two-calls", "xla"


def title(what: str) -> str:
    """An op's title (the plot's panels): what it is and how its shapes read."""
    return f"{what} (TOKENSxD, {Q_HEADS} q + {KV_HEADS} k heads)"


def split_heads(qkv):
    """(q [..., Q_HEADS, D], k [..., KV_HEADS, D], v [..., KV_HEADS, D]) of qkv [..., HEADS * D]."""
    D = qkv.shape[-1] // HEADS
    heads = qkv.reshape(*qkv.shape[:-1], HEADS, D)
    return heads[..., :Q_HEADS, :], heads[..., Q_HEADS:Q_HEADS + KV_HEADS, :], heads[..., Q_HEADS + KV_HEADS:, :]


def join_heads(q, k, v):
    """qkv [..., HEADS * D] of its q, k and v heads: split_heads' inverse."""
    heads = jnp.concatenate([q, k, v], axis=-2)
    return heads.reshape(*heads.shape[:-2], -1)


# ---------------------------------------------------------------------------------------------
# Bytes. Both forms are credited the same bytes: the fused form's v heads are left where they are
# by a kernel that normalizes q and k in place in qkv, so only the q and k heads need to move.


def forward_bytes(tokens: int, D: int, dtype: str, params: str) -> int:
    """qk_norm_fwd: read q and k, write q_out and k_out; read both weights; write rstd (one per
    head row)."""
    rows = tokens * (Q_HEADS + KV_HEADS)
    return (2 * rows * D * jnp.dtype(dtype).itemsize + 2 * D * params_dtype(dtype, params).itemsize
            + stat_bytes(rows, dtype, 1))


def fused_forward_bytes(tokens: int, D: int, dtype: str, params: str) -> int:
    """qk_norm_fused_fwd: read and write the q and k heads of qkv only, as forward_bytes; read both
    weights; write rstd. The v heads are not counted: an in-place kernel leaves them untouched
    (the output is qkv, v passes through). An entry that copies v (today's slices and
    concatenation around two calls) moves more and is not credited it."""
    return forward_bytes(tokens, D, dtype, params)


def backward_bytes(tokens: int, D: int, dtype: str) -> int:
    """qk_norm_bwd and qk_norm_fused_bwd: read dy and x, write dx, for q and for k; read both
    weights, write both dweights; read rstd. The fused form's v gradient is dy's v heads, passed
    through: not counted (as its forward's v heads)."""
    rows = tokens * (Q_HEADS + KV_HEADS)
    return (3 * rows * D + 4 * D) * jnp.dtype(dtype).itemsize + stat_bytes(rows, dtype, 1)


# ---------------------------------------------------------------------------------------------
# The functions timed: the public ones, two rmsnorm calls, and the jnp reference


def qk_public(q, k, wq, wk):
    return qk_norm(q, k, wq, wk, eps=EPS)


def qk_two_calls(q, k, wq, wk):
    return rmsnorm(q, wq, eps=EPS), rmsnorm(k, wk, eps=EPS)


def qk_xla(q, k, wq, wk):
    return reference.rmsnorm(q, wq, EPS), reference.rmsnorm(k, wk, EPS)


def fused_public(qkv, wq, wk):
    return qk_norm_fused(qkv, wq, wk, q_heads=Q_HEADS, kv_heads=KV_HEADS, eps=EPS)


def fused_two_calls(qkv, wq, wk):
    q, k, v = split_heads(qkv)
    return join_heads(*qk_two_calls(q, k, wq, wk), v)


def fused_xla(qkv, wq, wk):
    q, k, v = split_heads(qkv)
    return join_heads(*qk_xla(q, k, wq, wk), v)


def switches(forward: bool, backward: bool = True) -> contextlib.ExitStack:
    """jax_lnbwd's switches for what is traced inside: our forward (True) or the jnp one (False),
    and our backward or the jnp one, on every platform (the CPU runs our C++ handlers)."""
    stack = contextlib.ExitStack()
    stack.enter_context(use_ffi_forward(forward))
    stack.enter_context(use_ffi_backward(backward))
    return stack


def forward_step(fn, forced: bool, fused: bool):
    """A forward step of fn: traced with our kernels forced (ours, two-calls) or not (default,
    xla); its outputs as a tuple (the fused form's one array in a 1-tuple)."""
    def step(*args):
        with switches(True) if forced else contextlib.nullcontext():
            out = fn(*args)
        return (out,) if fused else out
    return step


def impls_of(steps: dict):
    """An op's entries: ours, the default (--peers default), then the peers two-calls and xla."""
    def impls(case, args, combos):
        return ([Impl(OURS, steps[OURS], False)] + default_impls(steps[DEFAULT], args)
                + [Impl(p, steps[p], True, our_kernels=p == TWO_CALLS) for p in (TWO_CALLS, XLA) if p in args.peers])
    return impls


def _weights(key, D: int, dtype: str, params: str):
    pdtype = params_dtype(dtype, params)
    return tuple((1 + 0.1 * jax.random.normal(k, (D,), jnp.float32)).astype(pdtype) for k in jax.random.split(key))


def _acc(*arrays):
    """The arrays in their accumulation dtype (float32, float64 for float64): the reference's."""
    return tuple(a.astype(reference.acc_dtype(a.dtype)) for a in arrays)


_rms_fwd_ref = jax.jit(reference.rmsnorm_fwd, static_argnums=2)


# ---------------------------------------------------------------------------------------------
# qk_norm_fwd: q, k, q_weight, k_weight -> q_out, k_out. The state is q, k the first constant;
# carry 2 makes k_out the next step's k (else each step's k_out would leave the chain and be
# stacked with the others: one more copy of k a step, timing.time_jax).


def prepare_forward(tokens, D, dtype, params, key) -> Case:
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (tokens, Q_HEADS, D), dtype)
    k = jax.random.normal(kk, (tokens, KV_HEADS, D), dtype)
    wq, wk = _weights(kw, D, dtype, params)
    ref = (_rms_fwd_ref(*_acc(q, wq), EPS)[0], _rms_fwd_ref(*_acc(k, wk), EPS)[0])
    return Case(forward_bytes(tokens, D, dtype, params), q, (k, wq, wk), f64(ref), str(wq.dtype),
                torch_inputs=(q, k, wq, wk))


forward_impls = impls_of({OURS: forward_step(qk_public, True, False), DEFAULT: forward_step(qk_public, False, False),
                          TWO_CALLS: forward_step(qk_two_calls, True, False), XLA: forward_step(qk_xla, False, False)})


# ---------------------------------------------------------------------------------------------
# qk_norm_fused_fwd: qkv, q_weight, k_weight -> qkv_out (v heads unchanged); qkv chained


def prepare_fused_forward(tokens, D, dtype, params, key) -> Case:
    kx, kw = jax.random.split(key)
    qkv = jax.random.normal(kx, (tokens, HEADS * D), dtype)
    wq, wk = _weights(kw, D, dtype, params)
    q, k, v = split_heads(qkv)
    ref = join_heads(_rms_fwd_ref(*_acc(q, wq), EPS)[0], _rms_fwd_ref(*_acc(k, wk), EPS)[0], *_acc(v))
    return Case(fused_forward_bytes(tokens, D, dtype, params), qkv, (wq, wk), f64([ref]), str(wq.dtype),
                torch_inputs=(qkv, wq, wk))


fused_forward_impls = impls_of({
    OURS: forward_step(fused_public, True, True), DEFAULT: forward_step(fused_public, False, True),
    TWO_CALLS: forward_step(fused_two_calls, True, True), XLA: forward_step(fused_xla, False, True)})


# ---------------------------------------------------------------------------------------------
# The backwards: each entry's pullback, made in prepare (the module doc)


def pullbacks(fns: dict, *primals) -> dict:
    """{entry: jax.vjp(fns[entry], *primals)[1]}, each traced under its entry's switches: ours and
    two-calls with our backward forced (and the jnp forward: nothing of ours runs here), the
    default under the dispatch rule."""
    out = {}
    for name, fn in fns.items():
        with contextlib.nullcontext() if name == DEFAULT else switches(False):
            out[name] = jax.jit(lambda *a, fn=fn: jax.vjp(fn, *a)[1])(*primals)
    return out


def _stats(*pairs):
    """rstd of each (x, weight), from the jnp forward in the accumulation dtype."""
    return tuple(_rms_fwd_ref(*_acc(x, w), EPS)[1] for x, w in pairs)


def backward_step(name: str):
    """qk_norm_bwd's step of a pullback entry: its pullback applied to the chained (dq, dk)."""
    def step(dq, dk, pulls, saved):
        return pulls[name]((dq, dk))
    return step


def fused_backward_step(name: str):
    """qk_norm_fused_bwd's step of a pullback entry: its pullback applied to the chained dqkv."""
    def step(dqkv, pulls, saved):
        return pulls[name](dqkv)
    return step


# qk_norm_bwd: dq, dk -> dq, dk, dq_weight, dk_weight (q, k, the weights and rstd saved). The
# state is dq, dk the first constant, carried as k is in the forward.


def prepare_backward(tokens, D, dtype, params, key) -> Case:
    kq, kk, kdq, kdk, kw = jax.random.split(key, 5)
    q = jax.random.normal(kq, (tokens, Q_HEADS, D), dtype)
    k = jax.random.normal(kk, (tokens, KV_HEADS, D), dtype)
    dq = jax.random.normal(kdq, q.shape, dtype)
    dk = jax.random.normal(kdk, k.shape, dtype)
    wq, wk = _weights(kw, D, dtype, "same")
    rq, rk = _stats((q, wq), (k, wk))
    bwd = jax.jit(reference.rmsnorm_bwd)
    (dxq, dwq), (dxk, dwk) = bwd(*_acc(dq, q, wq), rq), bwd(*_acc(dk, k, wk), rk)
    pulls = pullbacks({OURS: qk_public, TWO_CALLS: qk_two_calls, DEFAULT: qk_public}, q, k, wq, wk)
    return Case(backward_bytes(tokens, D, dtype), dq, (dk, pulls, (q, k, wq, wk, rq, rk)),
                f64((dxq, dxk, dwq, dwk)), dtype, torch_inputs=(q, k, wq, wk, dq, dk))


def backward_xla(dq, dk, pulls, saved):
    q, k, wq, wk, rq, rk = saved
    (dxq, dwq), (dxk, dwk) = reference.rmsnorm_bwd(dq, q, wq, rq), reference.rmsnorm_bwd(dk, k, wk, rk)
    return dxq, dxk, dwq, dwk


backward_impls = impls_of({**{name: backward_step(name) for name in (OURS, DEFAULT, TWO_CALLS)}, XLA: backward_xla})


# qk_norm_fused_bwd: dqkv -> dqkv (dv = dy's v heads), dq_weight, dk_weight; dqkv chained


def prepare_fused_backward(tokens, D, dtype, params, key) -> Case:
    kx, kdy, kw = jax.random.split(key, 3)
    qkv = jax.random.normal(kx, (tokens, HEADS * D), dtype)
    dqkv = jax.random.normal(kdy, qkv.shape, dtype)
    wq, wk = _weights(kw, D, dtype, "same")
    (q, k, _), (dq, dk, dv) = split_heads(qkv), split_heads(dqkv)
    rq, rk = _stats((q, wq), (k, wk))
    bwd = jax.jit(reference.rmsnorm_bwd)
    (dxq, dwq), (dxk, dwk) = bwd(*_acc(dq, q, wq), rq), bwd(*_acc(dk, k, wk), rk)
    pulls = pullbacks({OURS: fused_public, TWO_CALLS: fused_two_calls, DEFAULT: fused_public}, qkv, wq, wk)
    return Case(backward_bytes(tokens, D, dtype), dqkv, (pulls, (qkv, wq, wk, rq, rk)),
                f64((join_heads(dxq, dxk, *_acc(dv)), dwq, dwk)), dtype, torch_inputs=(qkv, wq, wk, dqkv))


def fused_backward_xla(dqkv, pulls, saved):
    qkv, wq, wk, rq, rk = saved
    (q, k, _), (dq, dk, dv) = split_heads(qkv), split_heads(dqkv)
    (dxq, dwq), (dxk, dwk) = reference.rmsnorm_bwd(dq, q, wq, rq), reference.rmsnorm_bwd(dk, k, wk, rk)
    return join_heads(dxq, dxk, dv), dwq, dwk


fused_backward_impls = impls_of({**{name: fused_backward_step(name) for name in (OURS, DEFAULT, TWO_CALLS)},
                                 XLA: fused_backward_xla})
