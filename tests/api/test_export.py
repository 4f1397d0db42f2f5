"""jax.export: programs that use layernorm (and its gradients) export, serialize and run again.

An exported program names our custom call by its target, jax_lnbwd.TARGET, a versioned name
that stays registered (README: "JAX transformations"). JAX refuses to export a custom call it
does not know to be stable unless the caller disables that one check by target name; with
the check disabled, the program round-trips through bytes and gives bit-identical results.
The deserialized program only needs jax_lnbwd imported (which registers the target).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_lnbwd
from conftest import PLATFORMS, make_inputs, put
from jax_lnbwd import TARGET, layernorm

ALLOW = [export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS]   # bwd v1, v2, fwd, add fwd v1, v2
EXPORT_PLATFORM = {"cpu": "cpu", "gpu": "cuda"}  # our platform names -> jax.export's
ARGNUMS = (0, 1, 2)


def _loss(x, w, b, r):
    return jnp.sum(layernorm(x, w, b) * r)


# name -> (function of (x, w, b, r), batch size: None for unbatched inputs)
PROGRAMS = {
    "forward": (lambda x, w, b, r: layernorm(x, w, b), None),
    "grad": (jax.grad(_loss, argnums=ARGNUMS), None),
    "value-and-grad-no-bias": (jax.value_and_grad(lambda x, w, r: jnp.sum(layernorm(x, w, None) * r), argnums=(0, 1)),
                               None),
    "vmap-grad": (jax.vmap(jax.grad(_loss, argnums=ARGNUMS), in_axes=(0, None, None, 0)), 3),
}


def _args(platform, batch, dtype="float32"):
    x, r, w, b = make_inputs((batch or 1, 6, 40), dtype, seed=0)
    if batch is None:
        x, r = x[0], r[0]
    return put(platform, x, w, b, r)


def _call_args(name, args):
    x, w, b, r = args
    return (x, w, r) if name == "value-and-grad-no-bias" else args


def _export(platform, name, **kw):
    fn, batch = PROGRAMS[name]
    args = _call_args(name, _args(platform, batch))
    exported = export.export(jax.jit(fn), platforms=[EXPORT_PLATFORM[platform]], **kw)(*args)
    return exported, fn, args


def _assert_bit_identical(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_exported_call_is_bit_identical(platform, name):
    exported, fn, args = _export(platform, name, disabled_checks=ALLOW)
    _assert_bit_identical(exported.call(*args), jax.jit(fn)(*args))
    # The backward is our custom call (the forward alone has none), named by the stable target.
    assert (f"@{TARGET}(" in exported.mlir_module()) == (name != "forward")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_serialize_round_trip_is_bit_identical(platform, name):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    exported, fn, args = _export(platform, name, disabled_checks=ALLOW)
    blob = exported.serialize()
    restored = export.deserialize(blob)
    assert restored.in_avals == exported.in_avals and restored.out_avals == exported.out_avals
    _assert_bit_identical(restored.call(*args), jax.jit(fn)(*args))
    # Inside a new jit too, as a piece of a larger program.
    _assert_bit_identical(jax.jit(restored.call)(*args), jax.jit(fn)(*args))


def test_export_without_disabling_the_check_raises():
    with pytest.raises(ValueError, match=f"(?s)custom calls.*{TARGET}"):
        _export("cpu", "grad")
    # The forward alone calls nothing of ours: it exports with no check disabled.
    _export("cpu", "forward")
