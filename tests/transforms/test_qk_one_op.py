"""QK-norm as one op (jax_lnbwd/qk_autodiff.py, qk_tangent.py), forced by the switches: ONE custom
call per direction for q's and k's heads (both forms, both norms), the same values and gradients
as the two-call path (the default, mode "auto") to per-dtype tolerances, in every mode mixture
(forward only, backward only, both), with mixed precision, absent weights and offset; shard_map
and sharded jit; the dispatch rule's QK rows, and the refusals that leave the two calls running
whatever the switches. Every other transformation the public functions claim (jvp, linearize,
vmap with shared and per-example weights, check_grads and hessian in float64, scan, checkpoint,
export): test_qk_one_op_transforms.py; the helpers both use: qk_one_op_cases.py.

Every test sets the switches itself (the suite forces the FFI backward: conftest.py) and restores
the measured crossovers (both forms' from D = 64 with 65536 rows: none of these tests'
shapes).
"""
from __future__ import annotations

import collections
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_lnbwd
from jax_lnbwd import dispatch, qk_norm, reference
from jax_lnbwd.norms import QK_TARGETS, RMSNORM
from qk_one_op_cases import (FORMS, NORMS, _auto, assert_same, forced, form_fn, loss, lowered,  # noqa: F401
                             make, one_op_targets, targets, values_and_grads)


# --- the dispatch rule ----------------------------------------------------------------------------

def test_rows():
    """The measured QK rows: both forms' one op from D 64 with 65536 rows of 16-byte vectors,
    both directions, every dtype. "ffi" always runs the one op."""
    for direction in (dispatch.FORWARD, dispatch.BACKWARD):
        for op in ("qk_norm", "qk_norm_fused"):
            for dtype, rows, D, want in (("bfloat16", 1 << 20, 128, True), ("float16", 65536, 64, True),
                                         ("bfloat16", 65535, 128, False), ("bfloat16", 1 << 20, 32, False),
                                         ("bfloat16", 1 << 20, 68, False), ("float32", 1 << 20, 128, True),
                                         ("float64", 65536, 64, True), ("float32", 65535, 64, False),
                                         ("float32", 1 << 20, 36, False)):
                wins, why = dispatch.cuda_kernel_wins(op, direction, rows, D, jnp.dtype(dtype))
                assert wins == want, (op, dtype, rows, D, why)
    one_op = lambda op, rows, dtype, cuda_built=True: dispatch.qk_one_op(  # noqa: E731
        op, rows, 128, jnp.dtype(dtype), refusal=None, bwd_mode="auto", cuda_built=cuda_built)
    assert one_op("qk_norm_fused", 1 << 20, "bfloat16")
    assert not one_op("qk_norm_fused", 1 << 20, "bfloat16", cuda_built=False)
    assert not one_op("qk_norm_fused", 1024, "bfloat16")
    assert one_op("qk_norm", 1 << 20, "bfloat16") and one_op("qk_norm", 1 << 20, "float32")
    assert not one_op("qk_norm", 1024, "bfloat16")
    assert one_op("qk_norm_fused", 1 << 20, "float32") and not one_op("qk_norm_fused", 1024, "float32")
    d = dispatch.decide(RMSNORM, dispatch.BACKWARD, (96, 64), jnp.float32, op="qk_norm_fused")
    assert (d.op, d.rows, d.C, d.platforms) == ("qk_norm_fused", 96, 64, dispatch.NONE)
    assert dispatch.decide(RMSNORM, dispatch.FORWARD, (96, 64), jnp.float32, op="qk_norm", mode_="ffi").platforms \
        == dispatch.EVERY


@pytest.mark.parametrize("form", FORMS)
def test_auto_and_off_switch_run_two_calls(form):
    """No QK target in "auto" (nor, on the CPU, any target), nor under the off switch even with
    the forward forced: the whole norm is then the jnp reference per set."""
    data, qw, kw, cts = make(form)

    def ops():
        fn = form_fn(form)
        return lowered(fn, *data, qw, kw) + lowered(jax.grad(loss(fn, cts), argnums=(0, 1)), *data, qw, kw)

    assert not ops()
    with jax_lnbwd.use_ffi_forward(True), jax_lnbwd.use_xla_backward(True):
        assert not ops()


@pytest.mark.parametrize("direction", ["both", "forward", "backward"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("form", FORMS)
def test_one_call_per_direction(form, norm, direction):
    """Forced, the lowered program holds one QK call per forced direction and no norm's target;
    the other direction runs as two calls would (jnp on the CPU in "auto")."""
    data, qw, kw, cts = make(form)
    fwd, bwd = one_op_targets(form)
    fn = form_fn(form, norm=norm)
    with forced(direction):
        forward = lowered(fn, *data, qw, kw)
        grad = lowered(jax.grad(loss(fn, cts), argnums=tuple(range(len(data) + 2))), *data, qw, kw)
    fwd_n = int(direction in ("both", "forward"))
    assert forward == collections.Counter({fwd: fwd_n} if fwd_n else {})
    assert grad == collections.Counter({t: 1 for t, on in ((fwd, fwd_n), (bwd, direction != "forward")) if on})


# --- the same numbers as the two calls ------------------------------------------------------------

# (norm, dtype, weight dtype, weights given ("both", "none", "q"), offset, forced direction)
CASES = [
    ("rmsnorm", "float32", None, "both", 0.0, "both"),
    ("layernorm", "float32", None, "both", 0.0, "both"),
    ("rmsnorm", "bfloat16", None, "both", 0.0, "both"),
    ("layernorm", "bfloat16", None, "both", 0.0, "both"),
    ("rmsnorm", "bfloat16", "float32", "both", 0.0, "both"),     # mixed precision
    ("layernorm", "bfloat16", "float32", "q", 0.0, "both"),      # mixed, k's weight absent
    ("rmsnorm", "float32", None, "none", 0.0, "both"),
    ("layernorm", "bfloat16", None, "none", 0.0, "both"),
    ("rmsnorm", "float32", None, "q", 0.0, "both"),
    ("rmsnorm", "float32", None, "both", 1.0, "both"),           # Gemma's offset
    ("rmsnorm", "bfloat16", "float32", "both", 1.0, "both"),
    ("rmsnorm", "float32", None, "both", 1.0, "forward"),
    ("layernorm", "float32", None, "both", 0.0, "backward"),
    ("rmsnorm", "bfloat16", "float32", "q", 0.0, "backward"),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_two_calls(form, case):
    norm, dtype, weight_dtype, given, offset, direction = case
    data, qw, kw, cts = make(form, dtype, weight_dtype, seed=1)
    if offset:   # zero-centred weights
        qw, kw = (qw - 1).astype(qw.dtype), (kw - 1).astype(kw.dtype)
    qw, kw = (qw if given in ("both", "q") else None), (kw if given == "both" else None)
    want = values_and_grads(form_fn(form, norm=norm, offset=offset), data, qw, kw, cts)
    with forced(direction):
        got = values_and_grads(form_fn(form, norm=norm, offset=offset), data, qw, kw, cts)
    assert_same(got, want, dtype)
    assert any(d.op == form and d.path == "ffi everywhere" for d in dispatch.decisions())


# --- sharding (the 8 CPU devices conftest.py configures) ------------------------------------------

def _mesh():
    return Mesh(np.array(jax.devices("cpu")).reshape(4, 2), ("a", "b"))


@pytest.mark.parametrize("form", FORMS)
def test_shard_map_over_all_axes(form):
    """Inside shard_map the one op runs on each device's rows; replicated weights' gradients are
    psummed by JAX (check_vma), as for the two calls."""
    data, qw, kw, cts = make(form, lead=(8, 3), seed=12)
    n, spec = len(data), P(("a", "b"))

    def local(*args):   # each device's loss, on its rows and its block of the cotangents
        return jax.grad(loss(form_fn(form), args[n + 2:]), argnums=tuple(range(n + 2)))(*args[:n + 2])

    sharded = lambda: jax.jit(jax.shard_map(  # noqa: E731
        lambda *a: local(*a), mesh=_mesh(), in_specs=(spec,) * n + (P(), P()) + (spec,) * n,
        out_specs=(spec,) * n + (P(), P())))
    want = sharded()(*data, qw, kw, *cts)
    with forced():
        got = sharded()(*data, qw, kw, *cts)
        text = sharded().lower(*data, qw, kw, *cts).as_text()
    assert targets(text) == dict.fromkeys(one_op_targets(form), 1)
    assert_same(got, want, "float32")


SHARDINGS = {   # (data specs, the form) on the (4, 2) mesh ("a", "b"), lead (8, 4)
    "rows": ((P(("a", "b")), P(("a", "b"))), "qk_norm"),
    "rows and heads": ((P("a", None, "b"), P("a", None, "b")), "qk_norm"),
    "q and k apart": ((P("a", "b"), P(None, None, "b")), "qk_norm"),   # each set's sums counted once
    "fused rows": ((P("a", "b"),), "qk_norm_fused"),
}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("case", list(SHARDINGS))
def test_sharded_jit_is_right(case, norm):
    """Under a sharded jit the one op is partitioned (ops/partition.py: qk_partitioned): one call
    per direction on each device's heads, no gather, the numbers the two calls'."""
    specs, form = SHARDINGS[case]
    data, qw, kw, cts = make(form, lead=(8, 4), seed=13)
    n = len(data)
    act, rep = tuple(NamedSharding(_mesh(), spec) for spec in specs), NamedSharding(_mesh(), P())
    f = lambda: jax.grad(loss(form_fn(form, norm=norm), cts), argnums=tuple(range(n + 2)))  # noqa: E731
    want = jax.jit(f())(*data, qw, kw)
    with forced(), warnings.catch_warnings():
        warnings.simplefilter("error", jax_lnbwd.ShardingFallbackWarning)
        jitted = jax.jit(f(), in_shardings=(*act, rep, rep))
        got = jitted(*data, qw, kw)
        text = jitted.lower(*data, qw, kw).compile().as_text()
    assert set(one_op_targets(form)) <= set(re.findall(r'custom_call_target="([^"]+)"', text))
    assert not re.search(r"\b(all-gather|all-to-all|collective-permute)(-start)?\(", text)
    assert_same(got, want, "float32")


# --- refusals: two calls whatever the switches ----------------------------------------------------

def _explicit(a):
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices("cpu")[:8])
    return jax.device_put(a, NamedSharding(mesh, P("rows")))


REFUSALS = {
    "dtypes": (lambda q, k, qw, kw: (q, k.astype(jnp.bfloat16), qw, kw.astype(jnp.bfloat16)), "q is float32 but k"),
    "weight dtypes": (lambda q, k, qw, kw: (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), qw,
                                            kw.astype(jnp.bfloat16)), "the weights have two dtypes"),
    "row bytes": (lambda q, k, qw, kw: (q[..., :7], k[..., :7], qw[:7], kw[:7]), "a head's row is 28 bytes"),
    "row too long": (lambda q, k, qw, kw: (jnp.tile(q, 17), jnp.tile(k, 17), jnp.tile(qw, 17), jnp.tile(kw, 17)),
                     "a head's row is 2176 bytes"),   # 544 float32: over head_rows_max_bytes (2048)
    "explicit mesh axes": (lambda q, k, qw, kw: (_explicit(q), _explicit(k), qw, kw), "Explicit mesh axes"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_run_two_calls(case):
    change, reason = REFUSALS[case]
    (q, k), qw, kw, _ = make("qk_norm", lead=(8, 3), seed=14)
    args = change(*map(jnp.asarray, (q, k, qw, kw)))
    with forced():
        text = jax.jit(jax.grad(lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in qk_norm(*a)),
                                argnums=(0, 1))).lower(*args).as_text()
    assert not {QK_TARGETS.fwd, QK_TARGETS.bwd} & set(targets(text))
    refused = [d for d in dispatch.decisions() if d.op == "qk_norm"]
    assert refused and all(d.direction == "both" and d.path == "jnp" for d in refused), refused
    assert reason in refused[-1].why and refused[-1].why.startswith("two norm calls"), refused[-1].why


def test_partly_manual_shard_map_runs_two_calls():
    (q, k), qw, kw, (cq, ck) = make("qk_norm", lead=(8, 3), seed=15)

    def local(q, k, qw, kw, cq, ck):
        return jax.grad(loss(form_fn("qk_norm"), (cq, ck)), argnums=(0, 1))(q, k, qw, kw)

    f = jax.jit(jax.shard_map(local, mesh=_mesh(), in_specs=(P("a"), P("a"), P(), P(), P("a"), P("a")),
                              out_specs=(P("a"), P("a")), axis_names={"a"}))
    with forced(), warnings.catch_warnings():
        warnings.simplefilter("ignore", jax_lnbwd.ShardingFallbackWarning)   # the two calls' gathers
        assert not {QK_TARGETS.fwd, QK_TARGETS.bwd} & set(targets(f.lower(q, k, qw, kw, cq, ck).as_text()))
    assert "only some mesh axes" in [d for d in dispatch.decisions() if d.op == "qk_norm"][-1].why


def test_transpose_in_data_is_refused():
    """The tangent map is linear in its tangents only (as the norms' are)."""
    from jax_lnbwd import qk_autodiff, qk_tangent
    (q, k), qw, kw, _ = make("qk_norm", seed=16)
    s = qk_autodiff.settings("qk_norm", RMSNORM, 1e-6, 0.0, q, qw, kw)
    _, q_rstd = reference.rmsnorm_fwd(q, qw)
    _, k_rstd = reference.rmsnorm_fwd(k, kw)
    f = lambda q: qk_tangent.tangent_map(s, (q, k), (qw, kw), (q_rstd,), (k_rstd,), (q, k), (qw, kw))  # noqa: E731
    with pytest.raises(ValueError, match=r"the qk_norm tangent map is linear in dq, dk, dq_weight and "
                                         r"dk_weight only; it cannot be transposed in q, k, q_weight, "
                                         r"k_weight, q_rstd or k_rstd"):
        jax.linear_transpose(f, q)([q, k])
