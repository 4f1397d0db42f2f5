"""add_layernorm's forward: the residual-fused FFI forward (target jax_lnbwd_add_layernorm_fwd_v1)
where layernorm's forward is the fused one, jnp's add + layernorm's forward elsewhere.

The switch is layernorm's (JAX_LNBWD_FORWARD, jax_lnbwd.use_ffi_forward): use_ffi_forward(True)
runs the target's C++ CPU handler, so the CPU checks the wiring's values; the `ffi_branch_on_cpu`
fixture puts the CPU among the platforms that take the fused branch of platform_dependent (the
branch CUDA takes by default). Values against the jnp reference (x + residual in x's dtype, then
reference.layernorm, differentiated by JAX); s bit-equal to jnp's add."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_lnbwd
from conftest import DTYPES, PLATFORMS, assert_close, put
from jax_lnbwd import add_layernorm, config, use_ffi_forward
from jax_lnbwd import TARGET_V2
from jax_lnbwd import TARGET_ADD_FWD as ADD_TARGET, TARGET_FWD as FWD
from test_add_layernorm import ARGNUMS, _inputs, _loss, _reference, _want

ALLOW = [export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS]


@pytest.fixture(autouse=True)
def _switch_off(monkeypatch):
    monkeypatch.delenv(config.FORWARD_ENV_VAR, raising=False)
    monkeypatch.setitem(config._overrides, config.FORWARD_ENV_VAR, None)


@pytest.fixture
def ffi_branch_on_cpu(monkeypatch):
    monkeypatch.setattr(sys.modules["jax_lnbwd.dispatch"], "KERNEL_PLATFORMS", ("cuda", "cpu"))


def _grad_fn(gy, gs):
    return jax.jit(jax.grad(lambda *a: _loss(add_layernorm, *a, gy, gs), argnums=ARGNUMS))


def _assert_values(x, r, w, b, gy, gs, dtype):
    """(y, s) and the four gradients of add_layernorm against the reference."""
    y, s = jax.jit(add_layernorm)(x, r, w, b)
    grads = _grad_fn(gy, gs)(x, r, w, b)
    (y_want, s_want), g_want = _want(x, r, w, b, gy, gs)
    np.testing.assert_array_equal(np.asarray(s), s_want)
    assert_close("y", y, y_want, dtype)
    for name, g, h in zip(("dx", "dresidual", "dweight", "dbias"), grads, g_want):
        assert_close(name, g, h, dtype)


@pytest.mark.parametrize("dtype,mixed", [(d, False) for d in DTYPES] + [("bfloat16", True), ("float16", True)])
def test_forced_fused_forward(dtype, mixed):
    """use_ffi_forward(True): one residual-fused forward call and one backward call, no plain
    forward, and the reference's values."""
    x, r, w, b, gy, gs = _inputs("cpu", dtype, mixed=mixed)
    with use_ffi_forward(True):
        text = _grad_fn(gy, gs).lower(x, r, w, b).as_text()
        assert text.count(f"@{ADD_TARGET}(") == 1 and f"@{FWD}(" not in text
        assert text.count(f"@{TARGET_V2}(") == 1
        _assert_values(x, r, w, b, gy, gs, dtype)


@pytest.mark.parametrize("shape", [(1, 1), (3, 1601), (40,), (2, 3000)], ids=str)
def test_forced_fused_forward_odd_shapes(shape):
    x, r, w, b, gy, gs = _inputs("cpu", "bfloat16", shape=shape, seed=1, mixed=True)
    with use_ffi_forward(True):
        _assert_values(x, r, w, b, gy, gs, "bfloat16")


def test_switch_off_and_default_on_cpu(monkeypatch):
    """The default on the CPU, use_ffi_forward(False) and JAX_LNBWD_FORWARD=xla: jnp's add and
    forward, no forward target."""
    x, r, w, b, _, _ = _inputs("cpu", "float32", seed=2)
    f = lambda: jax.jit(lambda *a: add_layernorm(*a)).lower(x, r, w, b).as_text()  # noqa: E731  (traced afresh)
    assert ADD_TARGET not in f() and FWD not in f()
    with use_ffi_forward(False):
        assert ADD_TARGET not in f()
    monkeypatch.setenv(config.FORWARD_ENV_VAR, "xla")
    assert ADD_TARGET not in f()
    with use_ffi_forward(True):   # overrides the environment
        assert ADD_TARGET in f()


def test_forced_fused_forward_vmap_jvp_shard_map():
    x, r, w, b, gy, gs = (np.asarray(a) for a in _inputs("cpu", "float32", shape=(4, 6, 64), seed=3))
    W = np.stack([w * (1 + i / 8) for i in range(4)])
    with use_ffi_forward(True):
        fn = jax.jit(jax.vmap(lambda x, r, w: add_layernorm(x, r, w, b)))
        assert fn.lower(x, r, W).as_text().count(f"@{ADD_TARGET}(") == 1
        y, s = fn(x, r, W)
        _, t = jax.jvp(add_layernorm, (x, r, w, b), (gy, gs, w, b))
        mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("d",))
        smap = jax.jit(jax.shard_map(lambda x, r, w, b: add_layernorm(x, r, w, b), mesh=mesh,
                                     in_specs=(P("d"), P("d"), P(), P()), out_specs=P("d")))
        y_sm, s_sm = smap(x, r, w, b)
    for i in range(4):
        assert_close(f"vmap y[{i}]", y[i], _reference(x[i], r[i], W[i], b)[0], "float32")
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + r))
    _, t_want = jax.jvp(_reference, (x, r, w, b), (gy, gs, w, b))
    for name, a, h in zip(("dy", "ds"), t, t_want):
        assert_close(f"jvp {name}", a, h, "float32")
    assert_close("shard_map y", y_sm, _reference(x, r, w, b)[0], "float32")
    np.testing.assert_array_equal(np.asarray(s_sm), np.asarray(x + r))


def test_platform_branch(ffi_branch_on_cpu):
    """The fused branch of platform_dependent (CUDA's by default) under jit, grad, a sharded jit
    (each device its own rows: no all-gather) and export with deserialization. Under autodiff
    the rule takes jnp's forward (dispatch.py), so the exported gradient holds the backward's
    target, and the exported forward the fused forward's."""
    x, r, w, b, gy, gs = _inputs("cpu", "bfloat16", shape=(4, 6, 64), seed=4, mixed=True)
    assert ADD_TARGET in jax.jit(add_layernorm).lower(x, r, w, b).compile().as_text()
    _assert_values(x, r, w, b, gy, gs, "bfloat16")
    mesh = Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))
    rows, rep = NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P())
    xs, rs = jax.device_put(x, rows), jax.device_put(r, rows)
    ws, bs = jax.device_put(w, rep), jax.device_put(b, rep)
    compiled = jax.jit(add_layernorm).lower(xs, rs, ws, bs).compile()
    assert "all-gather" not in compiled.as_text()
    y, s = compiled(xs, rs, ws, bs)
    assert tuple(s.sharding.spec[:2]) == ("a", "b")
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + r))
    assert_close("sharded y", y, _reference(x, r, w, b)[0], "bfloat16")
    fn = _grad_fn(gy, gs)
    exported = export.export(fn, platforms=["cpu"], disabled_checks=ALLOW)(x, r, w, b)
    assert f"@{ADD_TARGET}(" not in exported.mlir_module() and f"@{TARGET_V2}(" in exported.mlir_module()
    forward = export.export(jax.jit(add_layernorm), platforms=["cpu"], disabled_checks=ALLOW)(x, r, w, b)
    assert f"@{ADD_TARGET}(" in forward.mlir_module()
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    restored = export.deserialize(exported.serialize())
    for g, h in zip(restored.call(x, r, w, b), fn(x, r, w, b)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


def test_explicit_mesh_falls_back(ffi_branch_on_cpu):
    """Explicit mesh axes (shardings in the types): jnp's add and forward, as for layernorm."""
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("d",), axis_types=(AxisType.Explicit,))
    x, r, w, b, gy, gs = _inputs("cpu", "float32", shape=(4, 6, 64), seed=5)
    rows, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    args = (jax.device_put(x, rows), jax.device_put(r, rows), jax.device_put(w, rep), jax.device_put(b, rep))
    with jax.set_mesh(mesh):
        fn = jax.jit(add_layernorm)
        assert ADD_TARGET not in fn.lower(*args).as_text()
        y, s = fn(*args)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + r))
    assert_close("y", y, _reference(x, r, w, b)[0], "float32")


@pytest.mark.parametrize("platform", [p for p in PLATFORMS if p.id == "gpu"])
@pytest.mark.parametrize("dtype,mixed", [("bfloat16", True), ("float32", False)])
def test_gpu_default_is_the_fused_forward(platform, dtype, mixed):
    """On the GPU by default: one residual-fused forward (no plain forward); in a gradient, XLA's
    forward (the rule under autodiff, jax_lnbwd/dispatch.py) and one backward."""
    x, r, w, b, gy, gs = _inputs(platform, dtype, shape=(8, 128, 1600), seed=6, mixed=mixed)
    hlo = _grad_fn(gy, gs).lower(x, r, w, b).compile().as_text()
    assert f'custom_call_target="{ADD_TARGET}"' not in hlo and f'custom_call_target="{FWD}"' not in hlo
    assert hlo.count(f'custom_call_target="{TARGET_V2}"') == 1
    fwd = jax.jit(lambda *a: add_layernorm(*a)).lower(x, r, w, b).compile().as_text()
    assert fwd.count(f'custom_call_target="{ADD_TARGET}"') == 1 and f'custom_call_target="{FWD}"' not in fwd
    _assert_values(x, r, w, b, gy, gs, dtype)
