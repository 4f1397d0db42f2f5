"""How the package was built, and what it does when a build lacks the CUDA handler.

A build without nvcc has the CPU handler only (jax_lnbwd.WITH_CUDA False). Headed for a GPU,
the backward raises at trace time, saying why and what to do, instead of XLA's bare
"No FFI handler registered ... on a platform CUDA" at compile time. The CPU tests simulate a
GPU machine: WITH_CUDA and JAX's default backend are patched, and only tracing happens.
"""
from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_GPU, assert_close, make_inputs, put, reference_bwd, reference_stats
import jax_lnbwd
from jax_lnbwd import layernorm, layernorm_bwd
from jax_lnbwd.ops import ffi as _ffi

X = jax.ShapeDtypeStruct((4, 8), jnp.float32)
W = jax.ShapeDtypeStruct((8,), jnp.float32)
ROWS = jax.ShapeDtypeStruct((4,), jnp.float32)
NO_HANDLER = r"built without its CUDA handler.*WITH_CUDA is False.*nvcc.*wheel.*PATH"


def loss(x, w, b):
    return jnp.sum(layernorm(x, w, b) ** 2)


@pytest.fixture
def gpu_machine(monkeypatch):
    """JAX's default backend reported as a GPU's, with JAX's trace caches empty (a cached
    trace would skip the Python check) before and after."""
    jax.clear_caches()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    yield monkeypatch
    jax.clear_caches()


def test_with_cuda_is_exported_bool():
    assert isinstance(jax_lnbwd.WITH_CUDA, bool)
    assert jax_lnbwd.WITH_CUDA is _ffi.WITH_CUDA


def test_grad_without_handler_on_gpu_raises_at_trace_time(gpu_machine):
    gpu_machine.setattr(_ffi, "WITH_CUDA", False)
    with pytest.raises(RuntimeError, match=NO_HANDLER):
        jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(X, W, W)
    with pytest.raises(RuntimeError, match=NO_HANDLER):
        jax.jit(jax.grad(loss)).trace(X, W, W)


def test_layernorm_bwd_without_handler_on_gpu_raises(gpu_machine):
    gpu_machine.setattr(_ffi, "WITH_CUDA", False)
    with pytest.raises(RuntimeError, match=r"^layernorm_bwd: .*\(gpu\)"):
        jax.eval_shape(layernorm_bwd, X, X, W, ROWS, ROWS)


def test_ffi_forward_without_handler_on_gpu_raises(gpu_machine):
    """The optional FFI forward (forward.layernorm_fwd_op) needs the handler too."""
    from jax_lnbwd.ops.forward import layernorm_fwd_op
    gpu_machine.setattr(_ffi, "WITH_CUDA", False)
    with pytest.raises(RuntimeError, match=r"^layernorm_fwd_op: .*" + NO_HANDLER):
        jax.eval_shape(layernorm_fwd_op, X, W, W)


def test_default_without_handler_on_gpu_warns_and_runs_jnp(gpu_machine):
    """The default rule (no switch) cannot pick a kernel that is not built: the norm is jnp, and a
    warning says why and what to do."""
    gpu_machine.delenv("JAX_LNBWD_BACKWARD", raising=False)
    gpu_machine.setattr(_ffi, "WITH_CUDA", False)
    gpu_machine.setattr(_ffi, "_warned_no_handler", False)
    with pytest.warns(RuntimeWarning, match="built without its CUDA handler.*jnp"):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(X, W, W)
    assert "ffi_call" not in str(jaxpr)


def test_forward_without_handler_on_gpu_traces(gpu_machine):
    """The forward is jnp: inference needs no handler."""
    gpu_machine.setattr(_ffi, "WITH_CUDA", False)
    assert jax.eval_shape(layernorm, X, W, W).shape == (4, 8)


def test_grad_with_handler_on_gpu_traces(gpu_machine):
    gpu_machine.setattr(_ffi, "WITH_CUDA", True)
    jax.make_jaxpr(jax.grad(loss))(X, W, W)


def test_default_device_cpu_overrides_gpu_backend(gpu_machine):
    """On a GPU machine a CPU-only build still runs on the CPU when asked to (and right)."""
    gpu_machine.setattr(_ffi, "WITH_CUDA", False)
    x, dy, w, b = make_inputs((5, 24), "float32")
    mean, rstd = reference_stats(x)
    with jax.default_device(jax.devices("cpu")[0]):
        got = jax.jit(layernorm_bwd)(dy, x, w, mean, rstd)
    for name, g, want in zip(("dx", "dweight", "dbias"), got, reference_bwd(dy, x, w, mean, rstd)):
        assert_close(name, g, want, "float32")


def test_no_raise_on_cpu_backend():
    """The CPU needs no CUDA handler (this is every CPU test's situation)."""
    jax.clear_caches()
    jax.make_jaxpr(jax.grad(loss))(X, W, W)  # whatever WITH_CUDA is here


def _ffi_api_version(include_dir) -> tuple[int, int]:
    text = (pathlib.Path(include_dir) / "xla/ffi/api/c_api.h").read_text()
    major, minor = (int(re.search(rf"#define XLA_FFI_API_{k} (\d+)", text).group(1))
                    for k in ("MAJOR", "MINOR"))
    return major, minor


VENDORED = pathlib.Path(__file__).resolve().parents[2] / "third_party/xla_ffi/include"


@pytest.mark.skipif(not VENDORED.is_dir(), reason="run from outside the source tree")
def test_vendored_ffi_headers_no_newer_than_jaxlib():
    """The build compiles against the vendored headers of the oldest supported jaxlib; a jaxlib
    refuses handlers of a newer FFI API than its own, so ours must be no newer than this one."""
    ours, jaxlib = _ffi_api_version(VENDORED), _ffi_api_version(jax.ffi.include_dir())
    assert ours[0] == jaxlib[0] and ours[1] <= jaxlib[1], (ours, jaxlib)


@pytest.mark.gpu
def test_cuda_handler_runs_on_gpu():
    """On a GPU the installed build has the CUDA handler, and the gradient through it is right."""
    assert jax_lnbwd.WITH_CUDA, "this jax_lnbwd has no CUDA handler (built without nvcc)"
    assert HAS_GPU
    x, dy, w, b = make_inputs((64, 1600), "float32")
    mean, rstd = reference_stats(x)
    got = jax.jit(layernorm_bwd)(*put("gpu", dy, x, w, mean, rstd))
    assert all(g.devices() == {jax.devices("gpu")[0]} for g in got)
    for name, g, want in zip(("dx", "dweight", "dbias"), got, reference_bwd(dy, x, w, mean, rstd)):
        assert_close(name, np.asarray(g), want, "float32")
