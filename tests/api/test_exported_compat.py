"""Programs exported by an earlier jax_lnbwd (tests/api/data/exported, written by
tests/api/export_compat.py) still load and run: the targets they call keep their names and
signatures. Each fixture calls the targets listed for it below. On the CPU the results are bit-identical to the ones stored with them; on a
GPU they agree within the dtype's tolerance (the stored results are the CPU's)."""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_lnbwd  # noqa: F401  (registers the targets)
from conftest import PLATFORMS, assert_close, put

DATA = Path(__file__).with_name("data") / "exported"
PROGRAMS = sorted(p.stem for p in DATA.glob("*.bin"))
# The custom-call targets each fixture's module calls: the names baked into exported programs.
CALLS = {
    "layernorm_grad_v1": {"jax_lnbwd_layernorm_fwd_v1", "jax_lnbwd_layernorm_bwd_v1"},
    "layernorm_grad_mixed_v2": {"jax_lnbwd_layernorm_fwd_v1", "jax_lnbwd_layernorm_bwd_v2"},
    "add_layernorm_x_bias_grad": {"jax_lnbwd_add_layernorm_fwd_v2", "jax_lnbwd_layernorm_bwd_v2"},
    "layernorm_fused_forward": {"jax_lnbwd_layernorm_fwd_v1"},
    "rmsnorm_grad_f32": {"jax_lnbwd_rmsnorm_fwd_v1", "jax_lnbwd_rmsnorm_bwd_v1"},
    "rmsnorm_grad_bf16_offset": {"jax_lnbwd_rmsnorm_fwd_v1", "jax_lnbwd_rmsnorm_bwd_v1"},
    "add_rmsnorm_x_bias_grad": {"jax_lnbwd_add_rmsnorm_fwd_v1", "jax_lnbwd_rmsnorm_bwd_v1"},
}


def test_every_fixture_is_listed():
    assert set(PROGRAMS) == set(CALLS)


@pytest.mark.parametrize("name", PROGRAMS)
def test_fixture_calls_its_targets(name):
    exp = export.deserialize((DATA / f"{name}.bin").read_bytes())
    assert set(exp.platforms) == {"cpu", "cuda"}
    assert set(re.findall(r"custom_call @(\w+)", exp.mlir_module())) == CALLS[name]



@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", PROGRAMS)
def test_old_export_loads_and_runs(platform, name):
    exp = export.deserialize((DATA / f"{name}.bin").read_bytes())
    stored = np.load(DATA / f"{name}.npz")
    arrays = [stored[f"arr_{i}"] for i in range(len(stored.files))]
    n_in = len(exp.in_avals)
    args = [a.astype(aval.dtype) for a, aval in zip(arrays[:n_in], exp.in_avals)]
    got = [np.asarray(jnp.asarray(o).astype(jnp.float32)) for o in jax.tree.leaves(exp.call(*put(platform, *args)))]
    want = arrays[n_in:]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if platform == "cpu":
            np.testing.assert_array_equal(g, w, err_msg=f"{name} output {i}")
        else:
            dtype = "bfloat16" if any(a.dtype == jnp.bfloat16 for a in exp.in_avals) else "float32"
            assert_close(f"{name} output {i}", g, w, dtype)
