"""The backward of layernorm is our FFI custom call, not jnp that XLA differentiated.

The grad program, lowered (StableHLO) and compiled (the platform's optimized HLO), holds one
custom call to jax_lnbwd.TARGET per layernorm, carrying the chosen kernel and block size; the
forward-only program holds none.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import PLATFORMS, device, make_inputs, put
from jax_lnbwd import KERNELS, TARGET, layernorm

STABLEHLO_CALL = f"stablehlo.custom_call @{TARGET}("
HLO_CALL = f'custom_call_target="{TARGET}"'


def _inputs(platform, shape=(4, 8), dtype="float32"):
    x, _, w, b = make_inputs(shape, dtype, seed=0)
    return put(platform, x, w, b)


def _loss(x, w, b, **kw):
    return jnp.sum(layernorm(x, w, b, **kw) ** 2)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_grad_program_calls_target(platform):
    args = _inputs(platform)
    lowered = jax.jit(jax.grad(_loss, argnums=(0, 1, 2))).lower(*args)
    assert lowered.as_text().count(STABLEHLO_CALL) == 1
    compiled = lowered.compile()
    assert compiled.as_text().count(HLO_CALL) == 1
    # It was compiled for, and runs on, the platform under test.
    dx, _, _ = compiled(*args)
    assert dx.devices() == {device(platform)}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_one_call_per_layernorm(platform):
    x, w, b = _inputs(platform)

    def two_layers(x, w, b):
        return jnp.sum(layernorm(layernorm(x, w, b), w, b) ** 2)

    lowered = jax.jit(jax.grad(two_layers, argnums=(0, 1, 2))).lower(x, w, b)
    assert lowered.as_text().count(STABLEHLO_CALL) == 2
    assert lowered.compile().as_text().count(HLO_CALL) == 2


@pytest.mark.parametrize("platform", PLATFORMS)
def test_forward_program_does_not_call_target(platform):
    args = _inputs(platform)
    lowered = jax.jit(layernorm).lower(*args)
    assert TARGET not in lowered.as_text()
    assert TARGET not in lowered.compile().as_text()
    # Nor does the forward of the loss, whose grad does call it.
    assert TARGET not in jax.jit(_loss).lower(*args).compile().as_text()


@pytest.mark.parametrize(
    "kernel,block_size",
    [(k, bs) for k in sorted(KERNELS) for bs in (None, *KERNELS[k].block_sizes)],
    ids=lambda v: "default" if v is None else str(v))
def test_kernel_and_block_size_reach_the_call(kernel, block_size):
    info = KERNELS[kernel]
    dtype = info.dtypes[0]
    args = _inputs("cpu", dtype=dtype)
    bs = info.default_block_size if block_size is None else block_size
    if info.refuse(8, dtype, bs) is not None:
        pytest.skip(f"kernel {kernel} refuses C=8 {dtype} at block_size {bs}")
    text = jax.jit(jax.grad(lambda *a: _loss(*a, kernel=kernel, block_size=block_size),
                            argnums=(0, 1, 2))).lower(*args).as_text()
    call = next(line for line in text.splitlines() if STABLEHLO_CALL in line)
    assert f"kernel = {kernel} : i32" in call
    assert f"block_size = {bs} : i32" in call
