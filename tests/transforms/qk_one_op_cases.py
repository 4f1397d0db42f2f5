"""Shared by tests/transforms' QK one-op test modules (not a test module itself): the head counts,
forms, norms and tolerances, the autouse fixture that restores the package's defaults (a module
that imports `_auto` uses it), the switches that force the one op, the inputs, the loss, and the
counts of our custom calls in a lowered program. Imported as `from qk_one_op_cases import ...`
(pytest puts a test module's folder on sys.path, as for tests/bench/e2e_shapes.py)."""
from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_lnbwd
from conftest import MEASURED_CROSSOVERS, np_dtype, rel_err
from jax_lnbwd import config, dispatch, qk_norm, qk_norm_fused
from jax_lnbwd.norms import QK_TARGETS

HQ, HK = 4, 2                   # grouped-query heads
FORMS = ("qk_norm", "qk_norm_fused")
NORMS = ("rmsnorm", "layernorm")
# The one op against the two calls: the same math, summed in other orders.
TOL = {"float64": 1e-12, "float32": 1e-6, "bfloat16": 1e-2}


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    """The package's defaults: both switches "auto", the measured crossovers."""
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
