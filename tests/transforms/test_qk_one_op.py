"""QK-norm as one op (jax_lnbwd/qk_autodiff.py, qk_tangent.py), forced by the switches: ONE custom
call per direction for q's and k's heads (both forms, both norms), the same values and gradients
as the two-call path (the default, mode "auto") to per-dtype tolerances, in every mode mixture
(forward only, backward only, both), with mixed precision, absent weights and offset; every
transformation the public functions claim (jvp, linearize, vmap with shared and per-example
weights, check_grads and hessian in float64, scan, checkpoint, export, shard_map); the dispatch
rule's QK rows, and the refusals that leave the two calls running whatever the switches.

Every test sets the switches itself (the suite forces the FFI backward: conftest.py) and restores
the measured crossovers, whose QK rows are empty.
"""
from __future__ import annotations

import collections
import contextlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_lnbwd
from conftest import MEASURED_CROSSOVERS, np_dtype, rel_err
from jax_lnbwd import config, dispatch, qk_norm, qk_norm_fused, reference
from jax_lnbwd.norms import QK_TARGETS, RMSNORM

HQ, HK = 4, 2                   # grouped-query heads
FORMS = ("qk_norm", "qk_norm_fused")
NORMS = ("rmsnorm", "layernorm")
# The one op against the two calls: the same math, summed in other orders.
TOL = {"float64": 1e-12, "float32": 1e-6, "bfloat16": 1e-2}


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    """The package's defaults: both switches "auto", the measured crossovers (QK's: none)."""
    for var in (config.FORWARD_ENV_VAR, config.BACKWARD_ENV_VAR):
        monkeypatch.setenv(var, "auto")
        monkeypatch.setitem(config._overrides, var, None)
    monkeypatch.setattr(dispatch, "CROSSOVERS", dict(MEASURED_CROSSOVERS))
    dispatch.clear_decisions()


@contextlib.contextmanager
def forced(direction: str = "both"):
    """The switches that force our kernels: "both", "forward" or "backward"; "none" forces nothing."""
    with contextlib.ExitStack() as stack:
        if direction in ("both", "forward"):
            stack.enter_context(jax_lnbwd.use_ffi_forward(True))
        if direction in ("both", "backward"):
            stack.enter_context(jax_lnbwd.use_ffi_backward(True))
        yield


def form_fn(form: str, **kw):
    """The public function as f(*data, q_weight, k_weight) -> a tuple of outputs."""
    if form == "qk_norm":
        return lambda q, k, qw, kw_: qk_norm(q, k, qw, kw_, **kw)
    return lambda qkv, qw, kw_: (qk_norm_fused(qkv, qw, kw_, q_heads=HQ, kv_heads=HK, **kw),)


def make(form: str, dtype="float32", weight_dtype=None, lead=(2, 3), D=32, seed=0):
    """(data, q_weight, k_weight, cotangents): host arrays; cotangents in the accumulation dtype."""
    rng = np.random.default_rng(seed)
    t, wt = np_dtype(dtype), np_dtype(weight_dtype or dtype)
    shapes = [lead + (HQ, D), lead + (HK, D)] if form == "qk_norm" else [lead + ((HQ + 2 * HK) * D,)]
    acc = np.float64 if dtype == "float64" else np.float32
    data = tuple(rng.standard_normal(s).astype(t) for s in shapes)
    qw, kw = ((1 + 0.1 * rng.standard_normal(D)).astype(wt) for _ in range(2))
    return data, qw, kw, tuple(rng.standard_normal(s).astype(acc) for s in shapes)


def loss(fn, cts):
    """A scalar of fn's outputs that is not linear in them, so that second derivatives see them."""
    def f(*args):
        return sum(jnp.sum(jnp.sin(o.astype(c.dtype)) * c) for o, c in zip(fn(*args), cts))
    return f


def values_and_grads(fn, data, qw, kw, cts):
    """fn's outputs and the gradients of `loss` in every given argument, jitted. JAX caches what it
    traced by the function, and the switches are read when tracing: pass a fresh fn per mode."""
    args = (*data, qw, kw)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    return jax.jit(fn)(*args), jax.jit(jax.grad(loss(fn, cts), argnums=argnums))(*args)


def assert_same(got, want, dtype, what=""):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape, g.dtype, w.dtype)
        err = rel_err(g, w)
        assert err <= TOL[dtype], f"{what} leaf {i}: rel_err {err:.2e} > {TOL[dtype]:.0e}"


def targets(text: str) -> collections.Counter:
    """How many custom calls of each of our targets a lowered program makes."""
    return collections.Counter({t: text.count(f"@{t}(") for t in jax_lnbwd.TARGETS if f"@{t}(" in text})


def lowered(fn, *args) -> collections.Counter:
    """targets() of fn jitted now (a fresh function: JAX's caches would keep another mode's trace)."""
    return targets(jax.jit(lambda *a: fn(*a)).lower(*args).as_text())


def one_op_targets(form: str) -> tuple[str, str]:
    return (QK_TARGETS.fwd, QK_TARGETS.bwd) if form == "qk_norm" else (QK_TARGETS.fused_fwd, QK_TARGETS.fused_bwd)


# --- the dispatch rule ----------------------------------------------------------------------------

def test_rows_not_measured_yet():
    """QK-norm's rows are empty for both forms: "auto" never picks the one op; "ffi" always does."""
    for op in FORMS:
        for direction in (dispatch.FORWARD, dispatch.BACKWARD):
            for dtype in ("bfloat16", "float16", "float32", "float64"):
                assert dispatch.crossovers(op, direction, jnp.dtype(dtype)) == ()
            wins, why = dispatch.cuda_kernel_wins(op, direction, 1 << 20, 128, jnp.bfloat16)
            assert not wins and "not measured" in why
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


# --- transformations, forced ----------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
def test_jvp_linearize_and_transpose(form):
    data, qw, kw, _ = make(form, seed=2)
    tangents = tuple(0.5 * a for a in (*make(form, seed=3)[0], qw, kw))

    def run():
        fn, primals = form_fn(form), (*data, qw, kw)
        out, t = jax.jit(lambda p, t: jax.jvp(fn, p, t))(primals, tangents)
        y, lin = jax.linearize(fn, *primals)
        cts = jax.linear_transpose(lin, *primals)(t)
        return out, t, lin(*tangents), cts

    want = run()
    with forced():
        got = run()
    assert_same(got, want, "float32")


@pytest.mark.parametrize("form", FORMS)
def test_vmap_shared_weights_is_more_rows(form):
    """vmap (and vmap of vmap) with shared weights: still one call per direction, the same numbers."""
    data, qw, kw, cts = make(form, lead=(2, 3, 5), seed=4)
    axes = (0,) * len(data) + (None, None)
    batched = lambda: jax.vmap(jax.vmap(form_fn(form), in_axes=axes), in_axes=axes)  # noqa: E731
    want = values_and_grads(batched(), data, qw, kw, cts)
    with forced():
        got = values_and_grads(batched(), data, qw, kw, cts)
        fwd, bwd = one_op_targets(form)
        assert lowered(batched(), *data, qw, kw) == {fwd: 1}
        assert lowered(jax.grad(loss(batched(), cts), argnums=(0, len(data))), *data, qw, kw) == {fwd: 1, bwd: 1}
    assert_same(got, want, "float32")


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("form", FORMS)
def test_vmap_per_example_weights(form, norm):
    """Per-example weights: the values under vmap, the per-example gradients (vmap of grad: the
    backward batched) and the gradient of the batch's loss (grad of vmap: the tangent map batched)."""
    data, _, _, cts = make(form, lead=(3, 2), seed=5)
    rng = np.random.default_rng(6)
    qws, kws = (1 + 0.1 * rng.standard_normal((2, 3, 32))).astype(np.float32)
    argnums = tuple(range(len(data) + 2))

    def run():
        fn = form_fn(form, norm=norm)
        values = jax.jit(jax.vmap(fn))(*data, qws, kws)
        per_example = jax.vmap(jax.grad(loss(fn, [c[0] for c in cts]), argnums=argnums))
        of_batch = jax.grad(loss(jax.vmap(fn), cts), argnums=argnums)
        return values, jax.jit(per_example)(*data, qws, kws), jax.jit(of_batch)(*data, qws, kws)

    want = run()
    with forced():
        got = run()
    assert_same(got, want, "float32")


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("form", FORMS)
def test_check_grads_order_2(form, norm):
    """JAX's numerical check in float64 (16-byte rows: D = 8), forward and reverse, order 2."""
    data, qw, kw, cts = make(form, "float64", lead=(2,), D=8, seed=7)   # float64: conftest enables x64
    offset = 0.25 if norm == "rmsnorm" else 0.0
    with forced():
        check_grads(loss(form_fn(form, norm=norm, offset=offset), cts), (*data, qw, kw), order=2,
                    modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_hessian_of_weights(form):
    data, qw, kw, cts = make(form, "float64", lead=(3,), D=8, seed=8)

    def run():
        f = loss(form_fn(form), cts)
        return jax.jit(jax.hessian(lambda qw, kw: f(*data, qw, kw), argnums=(0, 1)))(qw, kw)

    with forced():
        got = run()
    want = run()   # "auto" on the CPU: the jnp reference per set, differentiated by JAX
    assert_same(got, want, "float64")


@pytest.mark.parametrize("form", FORMS)
def test_scan_and_checkpoint(form):
    """lax.scan over stacked layers' weights, each layer rematerialized (jax.checkpoint)."""
    data, _, _, cts = make(form, seed=9)
    qws, kws = (1 + 0.1 * np.random.default_rng(10).standard_normal((2, 3, 32))).astype(np.float32)

    def deep(*args):
        *data, qws, kws = args
        fn = form_fn(form)

        def layer(carry, w):
            return tuple(o * 1.5 for o in jax.checkpoint(fn)(*carry, *w)), None
        out, _ = jax.lax.scan(layer, tuple(data), (qws, kws))
        return out

    want = values_and_grads(deep, data, qws, kws, cts)
    with forced():
        got = values_and_grads(deep, data, qws, kws, cts)
    assert_same(got, want, "float32")


@pytest.mark.parametrize("form", FORMS)
def test_export_round_trip(form):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    data, qw, kw, cts = make(form, seed=11)
    with forced():
        fn = jax.jit(jax.grad(loss(form_fn(form), cts), argnums=tuple(range(len(data) + 2))))
        allow = [export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS]
        exported = export.export(fn, platforms=["cpu"], disabled_checks=allow)(*data, qw, kw)
        want = fn(*data, qw, kw)
    assert targets(exported.mlir_module()) == dict.fromkeys(one_op_targets(form), 1)
    restored = export.deserialize(exported.serialize())
    for g, w in zip(jax.tree.leaves(restored.call(*data, qw, kw)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


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
