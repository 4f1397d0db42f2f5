"""Programs exported by an earlier jax_lnbwd (tests/api/data/exported, made by
tools/export_compat.py before the package was laid out by op) still load and run: the targets
they call (backward v1 and v2, the fused forward, add_layernorm's forward v2) keep their names and
signatures. On the CPU the results are bit-identical to the ones stored with them; on a GPU they
agree within the dtype's tolerance (the stored results are the CPU's)."""
from __future__ import annotations

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
