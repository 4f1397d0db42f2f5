"""qk_norm and qk_norm_fused sharded (the 8 CPU devices conftest.py configures): over rows and
over the head axis, on both paths (the two norm calls and the one op, forced), with nothing
row-sized moving between devices; and the one op gathering a sharded last axis with a warning.
The values and gradients are checked against one device's."""
from __future__ import annotations

import contextlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_lnbwd
from conftest import assert_close
from jax_lnbwd import config, qk_norm, qk_norm_fused
from jax_lnbwd.norms import QK_TARGETS
from qk_norm_cases import inputs, loss

COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute)(-start)?\(")


def _one_op(path):
    """The switches that force QK-norm's one op in both directions (path "one op"), or none."""
    stack = contextlib.ExitStack()
    if path == "one op":
        stack.enter_context(jax_lnbwd.use_ffi_forward(True))
        stack.enter_context(jax_lnbwd.use_ffi_backward(True))
    return stack


def _custom_calls(text: str) -> set[str]:
    return set(re.findall(r'custom_call_target="([^"]+)"', text))


@pytest.mark.parametrize("path", ["two calls", "one op"])
@pytest.mark.parametrize("spec", [P("data"), P(None, None, "data")], ids=["rows", "heads"])
def test_sharded_over_rows_or_heads(spec, path, monkeypatch):
    """q and k [B, T, H, D] sharded over the batch or over the heads (tensor parallel): values
    and gradients equal one device's, and nothing row-sized moves between devices. Both paths:
    the default (mode "auto": two norm calls, which keep their partitioning rules) and the one
    op, forced, whose rule (ops/partition.py: qk_partitioned) runs it on each device's heads."""
    monkeypatch.setenv(config.BACKWARD_ENV_VAR, "auto")
    devices = jax.devices("cpu")
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    args = inputs((n, 3, 2 * n, 32), (n, 3, n, 32))
    f = lambda: jax.value_and_grad(lambda *a: loss(qk_norm, *a), argnums=(0, 1, 2, 3))  # noqa: E731
    act, rep = NamedSharding(mesh, spec), NamedSharding(mesh, P())
    want = jax.jit(f())(*(jax.device_put(a, devices[0]) for a in args))
    with _one_op(path), warnings.catch_warnings():
        warnings.simplefilter("error", jax_lnbwd.ShardingFallbackWarning)
        jitted = jax.jit(f(), in_shardings=(act, act, rep, rep, act, act))
        got = jitted(*args)
        text = jitted.lower(*args).compile().as_text()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(f"{spec}", g, w, "float32")
    assert got[1][0].sharding.is_equivalent_to(act, 4)
    moved = [line for line in text.splitlines() if COLLECTIVE.search(line)]
    assert not moved, "\n".join(moved)
    one_op = {QK_TARGETS.fwd, QK_TARGETS.bwd}
    assert (one_op <= _custom_calls(text)) if path == "one op" else not one_op & _custom_calls(text)


def _fused_grads():
    return jax.value_and_grad(lambda qkv, qw, kw, r: jnp.sum(qk_norm_fused(qkv, qw, kw, q_heads=2, kv_heads=1) * r),
                              argnums=(0, 1, 2))


def test_fused_one_op_sharded_over_rows():
    """qk_norm_fused's one op under a jit sharding qkv [B, T, W] over its rows: each device runs
    it on its tokens (nothing row-sized moves; the weight gradients' one psum), values equal one
    device's."""
    devices = jax.devices("cpu")
    n = len(devices)
    mesh = Mesh(np.array(devices).reshape(n // 2, 2), ("a", "b"))
    rng = np.random.default_rng(3)
    qkv, r = rng.standard_normal((2, n, 4, 4 * 32)).astype(np.float32)
    qw, kw = (1 + 0.1 * rng.standard_normal((2, 32))).astype(np.float32)
    act, rep = NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P())
    want = jax.jit(_fused_grads())(*(jax.device_put(a, devices[0]) for a in (qkv, qw, kw, r)))
    with _one_op("one op"), warnings.catch_warnings():
        warnings.simplefilter("error", jax_lnbwd.ShardingFallbackWarning)
        jitted = jax.jit(_fused_grads(), in_shardings=(act, rep, rep, act))
        got = jitted(qkv, qw, kw, r)
        text = jitted.lower(qkv, qw, kw, r).compile().as_text()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close("fused", g, w, "float32")
    assert got[1][0].sharding.is_equivalent_to(act, 3)
    moved = [line for line in text.splitlines() if COLLECTIVE.search(line)]
    assert not moved, "\n".join(moved)
    assert {QK_TARGETS.fused_fwd, QK_TARGETS.fused_bwd} <= _custom_calls(text)


@pytest.mark.parametrize("form", ["qk_norm", "qk_norm_fused"])
def test_one_op_gathers_a_sharded_last_axis(form):
    """The one op needs each head's D values (and, fused, each token's interleaved q, k and v
    heads) on one device: a sharded last axis is gathered with a ShardingFallbackWarning, and
    the values are still one device's."""
    devices = jax.devices("cpu")
    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(4)
    qw, kw = (1 + 0.1 * rng.standard_normal((2, 32))).astype(np.float32)
    if form == "qk_norm":
        last = NamedSharding(mesh, P(None, None, None, "data"))
        q, k, _, _, rq, rk = inputs((2, 3, 4, 32), (2, 3, 2, 32), seed=4)
        args, f = (q, k, qw, kw, rq, rk), lambda: jax.value_and_grad(  # noqa: E731
            lambda *a: loss(qk_norm, *a), argnums=(0, 1, 2, 3))
        shardings, match = (last, last, None, None, None, None), "(q|k)'s last axis"
    else:
        last = NamedSharding(mesh, P(None, None, "data"))
        qkv, r = rng.standard_normal((2, 2, 3, 4 * 32)).astype(np.float32)
        args, f, shardings, match = (qkv, qw, kw, r), _fused_grads, (last, None, None, None), "qkv's last axis"
    want = jax.jit(f())(*args)
    with _one_op("one op"), pytest.warns(jax_lnbwd.ShardingFallbackWarning, match=match):
        jitted = jax.jit(f(), in_shardings=shardings)
        got = jitted(*args)
        text = jitted.lower(*args).compile().as_text()
    assert {QK_TARGETS.fwd if form == "qk_norm" else QK_TARGETS.fused_fwd} <= _custom_calls(text)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(form, g, w, "float32")
