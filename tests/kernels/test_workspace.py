"""The workspace XLA allocates for kernels 11 and 12 is what their launcher uses.

GPU only. The launcher plans its persistent grid from the device (blocks that fit per SM, SM
count, rows, segments) and uses one partial slot of 2*C accumulators per block (per cluster for
split rows). jax_lnbwd/kernels.py sizes the workspace at trace time by asking that same plan
(norm_bwd_workspace_bytes, through the nanobind module), so the custom call's workspace in
the lowered program must be at most 1.25x (here: exactly) the bytes the launch uses.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lnbwd import TARGET, kernels, layernorm

pytestmark = pytest.mark.gpu

CASES = [  # (kernel, dtype, x shape, vmap batch or None)
    (12, "bfloat16", (4096, 16384), None),   # split rows: a slot per cluster
    (12, "bfloat16", (16384, 1600), None),
    (12, "float32", (1024, 768), None),
    (12, "float32", (64, 16384), None),     # wide rows
    (11, "bfloat16", (4096, 1600), None),
    (11, "float16", (333, 1001), None),     # misaligned rows
    (11, "float32", (8, 40000), None),      # kernel 11's wide path
    (12, "float64", (512, 2048), None),
    (12, "bfloat16", (64, 2048), 16),        # 16 segments
]


def _workspace_in_program(kernel, dtype, shape, batch):
    C = shape[-1]
    w = jnp.ones((C,), dtype)
    loss = lambda x: jnp.sum(layernorm(x, w, w, kernel=kernel).astype(jnp.float32))
    f = jax.grad(loss)
    if batch:
        f = jax.vmap(f)
        shape = (batch,) + shape
    text = jax.jit(f).lower(jax.ShapeDtypeStruct(shape, dtype)).as_text()
    calls = [line for line in text.splitlines() if TARGET in line]
    assert len(calls) == 1, calls
    sizes = re.findall(r"tensor<(\d+)xui8>", calls[0])
    assert len(sizes) == 1, calls[0]
    return int(sizes[0])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}-b{c[3]}")
def test_allocated_workspace_is_what_the_launcher_uses(case):
    from jax_lnbwd import _jax_lnbwd

    kernel, dtype, shape, batch = case
    allocated = _workspace_in_program(kernel, dtype, shape, batch)
    rows, C = int(np.prod(shape[:-1])) * (batch or 1), shape[-1]
    plan = _jax_lnbwd.launch_plan(kernel, dtype, rows, C, batch or 1, kernels._cuda_device())
    acc = 8 if dtype == "float64" else 4
    assert plan["workspace_bytes"] == 256 + plan["slots"] * 2 * C * acc, plan
    assert plan["workspace_bytes"] <= allocated <= 1.25 * plan["workspace_bytes"], (allocated, plan)
    # A slot per block (or cluster) of a grid sized to the GPU: a few per SM at most.
    assert plan["slots"] <= (batch or 1) * 32 * kernels.sm_count(), plan
