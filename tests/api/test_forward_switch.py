"""layernorm's forward: the fused FFI forward on CUDA, jnp elsewhere (jax.lax.platform_dependent),
and its switch (JAX_LNBWD_FORWARD=xla, jax_lnbwd.use_ffi_forward). Read when layernorm is traced:
every test traces afresh (a new function under jit). use_ffi_forward(True) runs the FFI forward
(its C++ CPU handler) on the CPU, so CPU tests check the wiring's values too."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_lnbwd
from conftest import PLATFORMS, assert_close, make_inputs, put
from jax_lnbwd import config, layernorm, reference, use_ffi_forward
from jax_lnbwd import TARGET_FWD as FWD

DISABLED = [export.DisabledSafetyCheck.custom_call(t) for t in
            (FWD, jax_lnbwd.TARGET, "jax_lnbwd_layernorm_bwd_v2")]


@pytest.fixture(autouse=True)
def _switch_off(monkeypatch):
    monkeypatch.delenv(config.FORWARD_ENV_VAR, raising=False)
    monkeypatch.setitem(config._overrides, config.FORWARD_ENV_VAR, None)


def _norm(x, w, b):
    return layernorm(x, w, b)


def _exported(platform: str, *args) -> str:
    """The StableHLO of layernorm exported for `platform` (traced afresh)."""
    return export.export(jax.jit(lambda x, w, b: layernorm(x, w, b)), platforms=[platform],
                         disabled_checks=DISABLED)(*args).mlir_module()


needs_cuda_build = pytest.mark.skipif(
    not jax_lnbwd.WITH_CUDA, reason="a build without the CUDA handler lowers the jnp forward for CUDA too")


@needs_cuda_build
def test_default_is_ffi_on_cuda_and_jnp_elsewhere():
    x, _, w, b = make_inputs((4, 3, 40), "bfloat16", seed=1)
    assert f"@{FWD}(" in _exported("cuda", x, w, b)
    assert f"@{FWD}(" not in _exported("cpu", x, w, b)
    # One program for both platforms carries both branches.
    both = export.export(jax.jit(lambda x, w, b: layernorm(x, w, b)), platforms=["cpu", "cuda"],
                         disabled_checks=DISABLED)(x, w, b)
    assert f"@{FWD}(" in both.mlir_module()
    np.testing.assert_array_equal(np.asarray(both.call(x, w, b)),
                                  np.asarray(jax.jit(reference.layernorm)(x, w, b)))


@needs_cuda_build
def test_switch_to_xla(monkeypatch):
    x, _, w, b = make_inputs((4, 40), "float32", seed=2)
    monkeypatch.setenv(config.FORWARD_ENV_VAR, "xla")
    assert f"@{FWD}(" not in _exported("cuda", x, w, b)
    monkeypatch.setenv(config.FORWARD_ENV_VAR, "ffi")
    assert f"@{FWD}(" in _exported("cuda", x, w, b)
    with use_ffi_forward(False):   # overrides the environment
        assert f"@{FWD}(" not in _exported("cuda", x, w, b)
    assert f"@{FWD}(" in _exported("cuda", x, w, b)
    monkeypatch.setenv(config.FORWARD_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="JAX_LNBWD_FORWARD='fast'"):
        _exported("cuda", x, w, b)
    with pytest.raises(TypeError, match="use_ffi_forward: 'enabled'"):
        use_ffi_forward("yes")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forced_ffi_forward_values_and_transformations(dtype):
    """use_ffi_forward(True): the CPU runs the FFI forward inside layernorm, under jit, vmap,
    grad and jvp, with the jnp reference's numbers."""
    x, dy, w, b = (jnp.asarray(a) for a in make_inputs((2, 5, 48), dtype, seed=3))
    with use_ffi_forward(True):
        f = jax.jit(lambda x, w, b: layernorm(x, w, b))
        assert f"@{FWD}(" in f.lower(x, w, b).as_text()
        assert_close("y", f(x, w, b), reference.layernorm(x, w, b), dtype)
        yv = jax.vmap(lambda x, w, b: layernorm(x, w, b))(x, jnp.stack([w, 2 * w]), b[None].repeat(2, 0))
        assert_close("vmap y", yv[1], reference.layernorm(x[1], 2 * w, b), dtype)
        grads = jax.jit(jax.grad(lambda x, w, b: jnp.sum(layernorm(x, w, b) * dy), argnums=(0, 1, 2)))(x, w, b)
        _, t = jax.jvp(lambda x: layernorm(x, w, b), (x,), (dy,))
    want = jax.grad(lambda x, w, b: jnp.sum(reference.layernorm(x, w, b).astype(jnp.float32) * dy),
                    argnums=(0, 1, 2))(*(a.astype(jnp.float32) for a in (x, w, b)))
    for name, g, h in zip(("dx", "dweight", "dbias"), grads, want):
        assert_close(name, g, h, dtype)
    _, t_want = jax.jvp(lambda x: reference.layernorm(x, w, b), (x,), (dy,))
    assert_close("jvp", t, t_want, dtype)


def test_forced_ffi_forward_shard_map():
    """Inside shard_map each device normalizes its own rows by the FFI forward (8 CPU devices)."""
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs several CPU devices")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))
    P = jax.sharding.PartitionSpec
    x, _, w, b = (jnp.asarray(a) for a in make_inputs((4, 6, 40), "float32", seed=4))
    with use_ffi_forward(True):
        f = jax.jit(jax.shard_map(lambda x, w, b: layernorm(x, w, b), mesh=mesh,
                                  in_specs=(P("d"), P(), P()), out_specs=P("d")))
        y = f(x, w, b)
    assert_close("y", y, reference.layernorm(x, w, b), "float32")


@pytest.mark.parametrize("platform", [p for p in PLATFORMS if p.id == "gpu"])
def test_gpu_forward_is_the_fused_op(platform):
    x, _, w, b = put(platform, *make_inputs((8, 1600), "bfloat16", seed=5))
    f = jax.jit(lambda x, w, b: layernorm(x, w, b))
    assert f"{FWD}" in f.lower(x, w, b).compile().as_text()
    assert_close("y", f(x, w, b), reference.layernorm(x, w, b), "bfloat16")


@pytest.fixture
def ffi_branch_on_cpu(monkeypatch):
    """The default (per-platform) forward with the CPU among the FFI platforms: the
    platform_dependent branch that CUDA takes, exercised here."""
    import sys
    monkeypatch.setattr(sys.modules["jax_lnbwd.dispatch"], "KERNEL_PLATFORMS", ("cuda", "cpu"))


def test_platform_branch_under_transformations(ffi_branch_on_cpu):
    """The FFI branch of platform_dependent under jit, grad, vmap, sharded jit and export."""
    x, dy, w, b = (jnp.asarray(a) for a in make_inputs((4, 6, 40), "bfloat16", seed=6))
    w32 = w.astype(jnp.float32)
    f = jax.jit(lambda x, w, b: layernorm(x, w, b))
    assert FWD in f.lower(x, w32, b).compile().as_text()
    assert_close("y", f(x, w32, b), reference.layernorm(x, w32, b), "bfloat16")
    yv = jax.jit(jax.vmap(lambda x, w: layernorm(x, w, b)))(x, jnp.stack([w32 * (i + 1) for i in range(4)]))
    assert_close("vmap y", yv[2], reference.layernorm(x[2], 3 * w32, b), "bfloat16")
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(layernorm(x, w, b).astype(jnp.float32) * dy), argnums=(0, 1)))(x, w32)
    g_want = jax.grad(lambda x, w: jnp.sum(reference.layernorm(x, w, b).astype(jnp.float32) * dy),
                      argnums=(0, 1))(x, w32)
    assert_close("dx", g[0], g_want[0], "bfloat16")
    assert_close("dweight", g[1], g_want[1], "bfloat16")
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("a", "b"))
    NS, P = jax.sharding.NamedSharding, jax.sharding.PartitionSpec
    xs = jax.device_put(x, NS(mesh, P("a", "b")))
    ws, bs = (jax.device_put(a, NS(mesh, P())) for a in (w32, b))
    compiled = jax.jit(lambda x, w, b: layernorm(x, w, b)).lower(xs, ws, bs).compile()
    assert "all-gather" not in compiled.as_text()    # each device normalizes its own rows
    assert_close("sharded y", compiled(xs, ws, bs), reference.layernorm(x, w32, b), "bfloat16")
    exported = export.export(jax.jit(lambda x, w, b: layernorm(x, w, b)), platforms=["cpu"],
                             disabled_checks=DISABLED)(x, w32, b)
    assert f"@{FWD}(" in exported.mlir_module()
