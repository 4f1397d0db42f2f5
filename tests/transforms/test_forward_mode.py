"""Forward-mode AD of layernorm, and every derivative transformation built on it.

layernorm is a jax.custom_jvp: its JVP is the forward's y plus a linear tangent map whose
transpose is our FFI backward (jax_lnbwd/tangent.py). These tests check, against JAX's own
derivatives of the pure-jnp reference (jax_lnbwd.reference.layernorm):
  * jax.jvp, jax.linearize (and linear_transpose of it), jax.jacfwd, jax.jacrev, jax.hessian,
    jvp of jvp, and check_grads with its default modes (forward and reverse) at order 1 and 2;
  * in every dtype: float64 to RTOL["float64"] (1e-12, rounding only), the others to their
    RTOL against float64 math on the same (rounded) inputs;
  * with weight and/or bias absent, under vmap (per-example tangents and weights), scan,
    checkpoint and jax.export;
  * that reverse mode still runs the FFI op (one custom call per layernorm) and forward mode
    none.
check_grads compares with finite differences in the inputs' dtype, which in 16 bits measure
rounding, not derivatives: it runs in float64 and float32; 16-bit derivatives are compared
with the reference instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.test_util import check_grads

import jax_lnbwd
from conftest import DTYPES, PLATFORMS, RTOL, RTOL2, assert_close, device, f64, make_inputs, put, shape_id
from jax_lnbwd import TARGET, layernorm, reference

STABLEHLO_CALL = f"@{TARGET}("
ARGNUMS = (0, 1, 2)
# id -> (weight given, bias given)
PARAMS = {"weight-bias": (True, True), "weight": (True, False), "bias": (False, True), "none": (False, False)}
SHAPES = [(1, 1), (3, 5), (7,), (2, 3, 40), (5, 1601)]


def _params(params, w, b):
    use_w, use_b = PARAMS[params]
    return (w if use_w else None), (b if use_b else None)


def _inputs(shape, dtype, seed=0):
    """(x, w, b) and tangents (tx, tw, tb), host arrays in dtype."""
    x, tx, w, b = make_inputs(shape, dtype, seed=seed)
    _, _, tw, tb = make_inputs(shape, dtype, seed=seed + 100)
    return (x, w, b), (tx, tw, tb)


def _cpu64(*arrays):
    return tuple(None if a is None else jax.device_put(f64(a), device("cpu")) for a in arrays)


def _loss(fn, x, w, b, r):
    """A scalar that depends nonlinearly on fn's output, so its Hessian is not just fn's."""
    return jnp.sum(jnp.sin(fn(x, w, b)) * r)


# --- jax.jvp in every dtype -------------------------------------------------------------------

# Every shape with both parameters, and every combination of parameters on one shape.
JVP_CASES = [(shape, "weight-bias") for shape in SHAPES] + [((2, 3, 40), p) for p in PARAMS if p != "weight-bias"]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape,params", JVP_CASES, ids=lambda v: v if isinstance(v, str) else shape_id(v))
@pytest.mark.parametrize("dtype", DTYPES)
def test_jvp_matches_reference(platform, dtype, shape, params):
    (x, w, b), (tx, tw, tb) = _inputs(shape, dtype, seed=1)
    use_w, use_b = PARAMS[params]

    def jvp(norm):
        # An absent parameter is None inside; its (ignored) tangent is passed anyway.
        fn = lambda x, w, b: norm(x, w if use_w else None, b if use_b else None)  # noqa: E731
        return jax.jit(lambda p, t: jax.jvp(fn, p, t))

    y, t = jvp(layernorm)(put(platform, x, w, b), put(platform, tx, tw, tb))
    assert y.dtype == t.dtype == jnp.dtype(dtype) and y.shape == t.shape == shape
    # The primal output is the forward's: bit for bit on the CPU (on the GPU, XLA may fuse the
    # forward's reductions differently in the two programs).
    forward = jax.jit(lambda x, w, b: layernorm(x, w if use_w else None, b if use_b else None))
    if platform == "cpu":
        np.testing.assert_array_equal(np.asarray(y), np.asarray(forward(*put(platform, x, w, b))))
    else:
        assert_close("y against the forward", y, forward(*put(platform, x, w, b)), dtype)
    want_y, want_t = jvp(reference.layernorm)(_cpu64(x, w, b), _cpu64(tx, tw, tb))
    assert_close("y", y, want_y, dtype)
    assert_close("tangent", t, want_t, dtype)


# --- linearize, jacobians, hessian (float64: rounding only) -------------------------------------

F64 = "float64"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_linearize_and_its_transpose(platform):
    (x, w, b), (tx, tw, tb) = _inputs((4, 9), F64, seed=2)
    args, tangents = put(platform, x, w, b), put(platform, tx, tw, tb)
    y, f_jvp = jax.linearize(layernorm, *args)
    want_y, want_t = jax.jvp(reference.layernorm, _cpu64(x, w, b), _cpu64(tx, tw, tb))
    assert_close("y", y, want_y, F64)
    assert_close("linearized", f_jvp(*tangents), want_t, F64)
    # Transposing the linearized function is reverse mode: the FFI op, equal to jax.vjp.
    ct = put(platform, make_inputs((4, 9), F64, seed=3)[1])
    got = jax.linear_transpose(f_jvp, *args)(ct)
    want = jax.vjp(reference.layernorm, *_cpu64(x, w, b))[1](*_cpu64(ct))
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
        assert_close(name, g, r, F64)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", [(6,), (3, 5), (2, 2, 4)], ids=shape_id)
@pytest.mark.parametrize("jac", ["jacfwd", "jacrev"])
def test_jacobians_float64(platform, shape, jac):
    (x, w, b), _ = _inputs(shape, F64, seed=4)
    transform = getattr(jax, jac)
    got = jax.jit(transform(layernorm, argnums=ARGNUMS))(*put(platform, x, w, b))
    want = jax.jit(jax.jacfwd(reference.layernorm, argnums=ARGNUMS))(*_cpu64(x, w, b))
    for name, g, r in zip(("d/dx", "d/dweight", "d/dbias"), got, want):
        assert g.shape == shape + r.shape[len(shape):]
        assert_close(f"{jac} {name}", g, r, F64)


HESSIANS = {
    "hessian": jax.hessian,                                            # jacfwd(jacrev)
    "jacfwd-jacfwd": lambda f, argnums: jax.jacfwd(jax.jacfwd(f, argnums=argnums), argnums=argnums),
    "jacrev-jacfwd": lambda f, argnums: jax.jacrev(jax.jacfwd(f, argnums=argnums), argnums=argnums),
    "jacrev-jacrev": lambda f, argnums: jax.jacrev(jax.jacrev(f, argnums=argnums), argnums=argnums),
}


# jax.hessian with every combination of parameters; the other compositions with both.
HESSIAN_CASES = [("hessian", p) for p in PARAMS] + [(h, "weight-bias") for h in HESSIANS if h != "hessian"]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("how,params", HESSIAN_CASES, ids=lambda v: str(v))
def test_hessians_float64(platform, how, params):
    (x, w, b), (r, _, _) = _inputs((3, 4), F64, seed=5)
    w, b = _params(params, w, b)
    argnums = tuple(i for i, a in enumerate((x, w, b)) if a is not None)
    hess = HESSIANS[how]
    got = jax.jit(hess(functools.partial(_loss_r, layernorm), argnums))(*put(platform, x, w, b, r))
    want = jax.jit(hess(functools.partial(_loss_r, reference.layernorm), argnums))(*_cpu64(x, w, b, r))
    for g, r_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(how, g, r_, F64)


def _loss_r(fn, x, w, b, r):
    return _loss(fn, x, w, b, r)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_jvp_of_jvp(platform):
    # A second directional derivative in forward mode only: the JVP of the tangent map.
    (x, w, b), (tx, tw, tb) = _inputs((5, 12), F64, seed=6)
    (ux, uw, ub), _ = _inputs((5, 12), F64, seed=7)

    def second(norm, p, t, u):
        return jax.jvp(lambda *q: jax.jvp(norm, q, t)[1], p, u)[1]

    got = jax.jit(functools.partial(second, layernorm))(*(put(platform, *a) for a in ((x, w, b), (tx, tw, tb),
                                                                                          (ux, uw, ub))))
    want = jax.jit(functools.partial(second, reference.layernorm))(
        _cpu64(x, w, b), _cpu64(tx, tw, tb), _cpu64(ux, uw, ub))
    assert_close("d2y", got, want, F64)


# --- check_grads, default modes (fwd and rev), orders 1 and 2 ----------------------------------

# Order 2 with both parameters and with none (order 1 covers each combination; order 2 is slow).
# Order 2 is `slow` (a quick run has order 2 through test_double_backward.py's check_grads).
CHECK_GRADS_CASES = [(1, p) for p in PARAMS] + [pytest.param(2, p, marks=pytest.mark.slow) for p in ("weight-bias", "none")]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("order,params", CHECK_GRADS_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_check_grads_default_modes(platform, dtype, order, params):
    (x, w, b), _ = _inputs((2, 3, 4), dtype, seed=8)
    use_w, use_b = PARAMS[params]
    fn = jax.jit(lambda x, w, b: layernorm(x, w if use_w else None, b if use_b else None))
    # In float32, check_grads' default step (1e-4) leaves finite differences of order 2 at the
    # noise of float32 rounding: they fail for the pure-jnp reference too. A step of 1e-3 keeps
    # rounding well below the tolerance (float64 uses the default).
    step = {} if dtype == "float64" else {"eps": 1e-3}
    with jax.default_device(device(platform)):
        check_grads(fn, put(platform, x, w, b), order=order, **step)


# --- 16-bit dtypes: the transformations run and match float64 math -------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["jacfwd", "jacrev", "hessian"])
def test_every_transformation_in_every_dtype(platform, dtype, how):
    (x, w, b), (r, _, _) = _inputs((3, 8), dtype, seed=9)
    if how == "hessian":
        got = jax.jit(jax.hessian(_loss_r_f32, argnums=ARGNUMS))(*put(platform, x, w, b, r))
        want = jax.jit(jax.hessian(functools.partial(_loss, reference.layernorm), argnums=ARGNUMS))(
            *_cpu64(x, w, b, r))
        # Second derivatives pass through two roundings to the dtype (the tangent map's and the
        # backward's outputs).
        tol = RTOL2[dtype]
    else:
        got = jax.jit(getattr(jax, how)(layernorm, argnums=ARGNUMS))(*put(platform, x, w, b))
        want = jax.jit(jax.jacfwd(reference.layernorm, argnums=ARGNUMS))(*_cpu64(x, w, b))
        tol = RTOL[dtype]
    for g, r_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == jnp.dtype(dtype)
        assert_close(how, g, r_, dtype, tol)


def _loss_r_f32(x, w, b, r):
    return _loss(layernorm, x, w, b, r)


# --- vmap --------------------------------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("in_axes", [(0, None, None), (0, 0, 0), (None, 0, None), (1, None, 0)],
                         ids=lambda a: "-".join(map(str, a)))
def test_vmap_of_jvp(platform, in_axes):
    """Batched primals and tangents (per-example weights when weight is batched): a loop of
    reference JVPs. Tangents are batched like their primals, plus dweight always."""
    B, shape = 3, (4, 10)
    per = [_inputs(shape, F64, seed=20 + i) for i in range(B)]
    prim = [np.stack([p[0][k] for p in per], axis=in_axes[k]) if in_axes[k] is not None else per[0][0][k]
            for k in range(3)]
    tan_axes = (in_axes[0], 0, in_axes[2])
    tan = [np.stack([p[1][k] for p in per], axis=tan_axes[k]) if tan_axes[k] is not None else per[0][1][k]
           for k in range(3)]
    f = jax.jit(jax.vmap(lambda p, t: jax.jvp(layernorm, p, t), in_axes=(in_axes, tan_axes)))
    y, t = f(tuple(put(platform, *prim)), tuple(put(platform, *tan)))
    for i in range(B):
        pick = lambda arrays, axes: [a if ax is None else np.take(a, i, axis=ax) for a, ax in zip(arrays, axes)]  # noqa: E731
        want_y, want_t = jax.jvp(reference.layernorm, _cpu64(*pick(prim, in_axes)), _cpu64(*pick(tan, tan_axes)))
        assert_close(f"example {i} y", y[i], want_y, F64)
        assert_close(f"example {i} tangent", t[i], want_t, F64)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_grad_of_vmapped_tangent_map_is_one_ffi_call(platform):
    """Reverse mode through a vmapped forward mode, differentiated in the tangents: the
    batched tangent map (one more segment axis) transposes to ONE FFI call with a segment per
    example; a weight tangent shared by the batch gets the sum over it. (Differentiated in
    the primals instead, the tangent map's derivative is jnp: test_hessians_float64.)"""
    (x, w, b), (tx, tw, tb) = _inputs((4, 6), F64, seed=30)
    txs = np.stack([tx, 2 * tx, -tx])

    def f(norm, txs, tw, tb):
        t = jax.vmap(lambda tx: jax.jvp(norm, (x, w, b), (tx, tw, tb))[1])(txs)
        return jnp.sum(jnp.sin(t))

    grad = jax.jit(jax.grad(functools.partial(f, layernorm), argnums=ARGNUMS))
    args = put(platform, txs, tw, tb)
    text = grad.lower(*args).as_text()
    got = grad(*args)
    want = jax.grad(functools.partial(f, reference.layernorm), argnums=ARGNUMS)(*_cpu64(txs, tw, tb))
    for name, g, r in zip(("d/dtx", "d/dtweight", "d/dtbias"), got, want):
        assert_close(name, g, r, F64)
    assert text.count(STABLEHLO_CALL) == 1


# --- scan, checkpoint, export ---------------------------------------------------------------------

def _scan_stack(norm, x, ws, bs, remat=False):
    def layer(h, wb):
        return jnp.tanh(norm(h, *wb)), None
    if remat:
        layer = jax.checkpoint(layer)
    return jax.lax.scan(layer, x, (ws, bs))[0]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan-remat"])
def test_jvp_and_jacfwd_through_scan(platform, remat):
    (x, w, b), (tx, tw, tb) = _inputs((4, 8), F64, seed=40)
    ws, bs = np.stack([w, 0.5 * w, w + 1]), np.stack([b, -b, 2 * b])
    tws, tbs = np.stack([tw] * 3), np.stack([tb, -tb, tb])
    ours = functools.partial(_scan_stack, layernorm, remat=remat)
    ref = functools.partial(_scan_stack, reference.layernorm)
    _, got = jax.jit(lambda p, t: jax.jvp(ours, p, t))(put(platform, x, ws, bs), put(platform, tx, tws, tbs))
    _, want = jax.jvp(ref, _cpu64(x, ws, bs), _cpu64(tx, tws, tbs))
    assert_close("scan jvp", got, want, F64)
    got = jax.jit(jax.jacfwd(ours, argnums=1))(*put(platform, x, ws, bs))
    want = jax.jacfwd(ref, argnums=1)(*_cpu64(x, ws, bs))
    assert_close("scan jacfwd", got, want, F64)


EXPORT_PLATFORM = {"cpu": "cpu", "gpu": "cuda"}
ALLOW = [export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS]   # bwd v1, v2, fwd, add fwd v1, v2


def _grad_and_hvp(x, w, b):
    """(gradient, Hessian-vector product) of a loss: jax.jvp of jax.grad (forward over reverse)."""
    grad = jax.grad(lambda *p: jnp.sum(jnp.sin(layernorm(*p))), argnums=ARGNUMS)
    return jax.jvp(grad, (x, w, b), (x, w, b))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("program", ["jvp", "grad-and-hvp"])
def test_export_forward_mode(platform, program):
    """Exported forward-mode programs: jvp holds no custom call (the tangent map is jnp);
    jvp of grad calls the versioned target. Both round-trip bit-identically."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    (x, w, b), (tx, tw, tb) = _inputs((3, 16), "float32", seed=50)
    if program == "jvp":
        fn, args = (lambda p, t: jax.jvp(layernorm, p, t)), (put(platform, x, w, b), put(platform, tx, tw, tb))
    else:
        fn, args = _grad_and_hvp, put(platform, x, w, b)
    exported = export.export(jax.jit(fn), platforms=[EXPORT_PLATFORM[platform]], disabled_checks=ALLOW)(*args)
    assert exported.mlir_module().count(STABLEHLO_CALL) == (program != "jvp")
    restored = export.deserialize(exported.serialize())
    for g, r in zip(jax.tree.leaves(restored.call(*args)), jax.tree.leaves(jax.jit(fn)(*args)), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


# --- which programs call the FFI op ----------------------------------------------------------------

PROGRAMS = {
    # name -> (function of (x, w, b), custom calls expected in the lowered program)
    "grad": (jax.grad(lambda x, w, b: jnp.sum(jnp.sin(layernorm(x, w, b))), argnums=ARGNUMS), 1),
    "vjp": (lambda x, w, b: jax.vjp(layernorm, x, w, b)[1](x), 1),
    "linear_transpose-of-linearize": (
        lambda x, w, b: jax.linear_transpose(jax.linearize(layernorm, x, w, b)[1], x, w, b)(x), 1),
    "jacrev": (jax.jacrev(layernorm, argnums=ARGNUMS), 1),
    "jvp": (lambda x, w, b: jax.jvp(layernorm, (x, w, b), (x, w, b)), 0),
    "linearize": (lambda x, w, b: jax.linearize(layernorm, x, w, b)[1](x, w, b), 0),
    "jacfwd": (jax.jacfwd(layernorm, argnums=ARGNUMS), 0),
    "forward": (layernorm, 0),
    "jvp-of-grad": (_grad_and_hvp, 1),
    # jacfwd(jacrev): the FFI op's value (the gradient) is not an output, only its JVP (jnp):
    # dead-code elimination (JAX's, before lowering) removes the call.
    "hessian": (jax.hessian(lambda x, w, b: jnp.sum(jnp.sin(layernorm(x, w, b))), argnums=ARGNUMS), 0),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_reverse_mode_calls_the_ffi_op_forward_mode_does_not(name):
    fn, calls = PROGRAMS[name]
    x, _, w, b = make_inputs((4, 8), "float32")
    assert jax.jit(fn).lower(x, w, b).as_text().count(STABLEHLO_CALL) == calls


@pytest.mark.parametrize("platform", PLATFORMS)
def test_zero_rows(platform):
    # No rows (C >= 1): empty outputs and tangents, and parameter gradients of exactly zero.
    # (C = 0 is refused with a ValueError: test_errors.py.)
    (x, w, b), (tx, tw, tb) = _inputs((0, 8), "float32")
    args = put(platform, x, w, b)
    y, t = jax.jit(lambda p, t: jax.jvp(layernorm, p, t))(args, put(platform, tx, tw, tb))
    assert y.shape == t.shape == (0, 8)
    dx, dw, db = jax.jit(jax.grad(lambda *p: jnp.sum(layernorm(*p)), argnums=ARGNUMS))(*args)
    assert dx.shape == (0, 8)
    np.testing.assert_array_equal(np.asarray(dw), np.zeros(8, np.float32))
    np.testing.assert_array_equal(np.asarray(db), np.zeros(8, np.float32))
    assert jax.jit(jax.jacfwd(layernorm, argnums=1))(*args).shape == (0, 8, 8)
