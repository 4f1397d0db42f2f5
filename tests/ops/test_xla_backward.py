"""The off switch: JAX_LNBWD_BACKWARD=xla or jax_lnbwd.use_xla_backward make layernorm (and
layernorm_bwd) use XLA's backward, JAX's derivative of the pure-jnp reference, instead of our
FFI op. Read when the function is traced: each test traces afresh (a new jit)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lnbwd
from conftest import PLATFORMS, assert_close, make_inputs, put, reference_stats
from jax_lnbwd import TARGET, config, layernorm, layernorm_bwd, reference, use_xla_backward

STABLEHLO_CALL = f"@{TARGET}("
HLO_CALL = f'custom_call_target="{TARGET}"'
ARGNUMS = (0, 1, 2)


@pytest.fixture(autouse=True)
def _switch_off(monkeypatch):
    """Every test starts with the environment variable unset and no Python override, and
    leaves things so."""
    monkeypatch.delenv(config.ENV_VAR, raising=False)
    monkeypatch.setitem(config._overrides, config.BACKWARD_ENV_VAR, None)


def _loss(norm, x, w, b, r):
    return jnp.sum(norm(x, w, b) * r)


def _args(platform="cpu", dtype="float32"):
    x, r, w, b = make_inputs((6, 40), dtype, seed=3)
    return put(platform, x, w, b, r)


def _ffi_calls(args) -> int:
    """Custom calls to our target in a freshly traced grad program (StableHLO and compiled)."""
    lowered = jax.jit(jax.grad(functools.partial(_loss, layernorm), argnums=ARGNUMS)).lower(*args)
    stablehlo = lowered.as_text().count(STABLEHLO_CALL)
    assert lowered.compile().as_text().count(HLO_CALL) == stablehlo
    return stablehlo


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_environment_variable(platform, dtype, monkeypatch):
    args = _args(platform, dtype)
    # Unset: the dispatch rule (our kernel on CUDA, where the suite's crossovers make it win;
    # XLA's backward on the CPU).
    assert _ffi_calls(args) == (1 if platform == "gpu" else 0)
    monkeypatch.setenv(config.ENV_VAR, "ffi")
    assert _ffi_calls(args) == 1
    monkeypatch.setenv(config.ENV_VAR, "xla")
    assert _ffi_calls(args) == 0
    # XLA's backward is exactly JAX's derivative of the reference.
    got = jax.jit(jax.grad(functools.partial(_loss, layernorm), argnums=ARGNUMS))(*args)
    want = jax.jit(jax.grad(functools.partial(_loss, reference.layernorm), argnums=ARGNUMS))(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    monkeypatch.setenv(config.ENV_VAR, "FFI")  # case and spaces do not matter
    assert _ffi_calls(args) == 1


def test_bad_environment_value_raises(monkeypatch):
    monkeypatch.setenv(config.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=f"{config.ENV_VAR}='cuda'.*auto, ffi, xla"):
        layernorm(*_args()[:3])


def test_use_xla_backward_as_a_call():
    args = _args()
    use_xla_backward(True)
    assert _ffi_calls(args) == 0
    use_xla_backward(False)
    assert _ffi_calls(args) == 1
    use_xla_backward(None)   # back to the environment (unset: the rule, jnp on the CPU)
    assert _ffi_calls(args) == 0


def test_use_xla_backward_as_a_context_manager(monkeypatch):
    args = _args()
    with use_xla_backward():
        assert _ffi_calls(args) == 0
        with use_xla_backward(False):
            assert _ffi_calls(args) == 1
        assert _ffi_calls(args) == 0
    assert _ffi_calls(args) == 0   # unset: the rule, jnp on the CPU
    # The Python setting overrides the environment variable.
    monkeypatch.setenv(config.ENV_VAR, "xla")
    assert _ffi_calls(args) == 0
    with use_xla_backward(False):
        assert _ffi_calls(args) == 1


def test_use_xla_backward_checks_its_argument():
    with pytest.raises(TypeError, match="use_xla_backward"):
        use_xla_backward("xla")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_layernorm_bwd_and_other_transformations(platform):
    # layernorm_bwd follows the switch too, and layernorm keeps every transformation.
    x, w, b, r = _args(platform, "float64")
    mean, rstd = reference_stats(x)
    mean, rstd = put(platform, mean, rstd)
    with use_xla_backward():
        text = jax.jit(layernorm_bwd).lower(r, x, w, mean, rstd).as_text()
        assert STABLEHLO_CALL not in text
        got = jax.jit(layernorm_bwd)(r, x, w, mean, rstd)
        for name, g, want in zip(("dx", "dweight", "dbias"), got, reference.layernorm_bwd(r, x, w, mean, rstd)):
            assert_close(name, g, want, "float64")
        hvp = jax.jit(lambda *p: jax.jvp(jax.grad(functools.partial(_loss, layernorm), argnums=ARGNUMS),
                                         p, p))(x, w, b, r)
        vmapped = jax.jit(jax.vmap(jax.grad(functools.partial(_loss, layernorm)), in_axes=(0, None, None, 0)))(
            x[None], w, b, r[None])
    want_hvp = jax.jvp(jax.grad(functools.partial(_loss, reference.layernorm), argnums=ARGNUMS), (x, w, b, r),
                       (x, w, b, r))
    for g, want in zip(jax.tree.leaves(hvp), jax.tree.leaves(want_hvp)):
        assert_close("hvp", g, want, "float64")
    assert_close("vmap(grad)", vmapped[0], jax.grad(functools.partial(_loss, reference.layernorm))(x, w, b, r),
                 "float64")


def test_errors_are_still_checked_with_the_switch_on():
    with use_xla_backward():
        with pytest.raises(ValueError, match="^layernorm: unknown kernel 99"):
            layernorm(*_args()[:3], kernel=99)
        with pytest.raises(ValueError, match=r"^layernorm: 'x' has shape \(4, 0\)"):
            layernorm(np.zeros((4, 0), np.float32), None, None)


def test_exported_names():
    assert jax_lnbwd.use_xla_backward is use_xla_backward
