"""Checks of the fused forward (and its residual variant) on several devices; run by
test_forward_sharding.py in a subprocess.

    python tests/transforms/forward_sharding_checks.py --platform cpu     # 8 host CPU devices (XLA flag below)
    python tests/transforms/forward_sharding_checks.py --platform gpu     # every visible GPU (at least 2)

Every check prints one JSON line {"check": name, "ok": bool, "detail": str}. "Sharded correctly"
for the forward: the results equal one device's, y, mean and rstd keep x's row sharding, and the
compiled program has no collective at all (each row is normalized by itself). The residual
variant's checks (add_*) also shard residual like x and check that s keeps that sharding.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
import warnings

if __name__ == "__main__":
    _platform = sys.argv[sys.argv.index("--platform") + 1] if "--platform" in sys.argv else "cpu"
    if _platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_lnbwd.ops.forward import add_layernorm_fwd_op, layernorm_fwd_op  # noqa: E402
from jax_lnbwd import ShardingFallbackWarning  # noqa: E402

COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def inputs(shape, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    C = shape[-1]
    t = jnp.dtype(dtype)
    return (rng.standard_normal(shape).astype(t), (1 + 0.1 * rng.standard_normal(C)).astype(np.float32),
            rng.standard_normal(C).astype(np.float32))


def assert_equal_outputs(got, want):
    """The FFI op computes each row alone: sharded and one-device results are bit-identical."""
    names = ("y", "s", "mean", "rstd") if len(got) == 4 else ("y", "mean", "rstd")
    for name, g, w in zip(names, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def collectives(jitted, *args) -> list[str]:
    text = jitted.lower(*args).compile().as_text()
    return [line.strip() for line in text.splitlines() if COLLECTIVE.search(line)]


def assert_no_collectives(jitted, *args):
    """The compiled program communicates nothing: the forward is row-local."""
    ops = collectives(jitted, *args)
    assert not ops, "the forward should not communicate:\n" + "\n".join(ops)


class Env:
    def __init__(self, platform: str):
        self.devices = jax.devices(platform)
        self.n = n = len(self.devices)
        assert n >= 2, f"needs at least 2 {platform} devices, found {n}"
        self.mesh1 = Mesh(np.array(self.devices), ("data",), axis_types=(AxisType.Auto,))
        a = 2 if n % 2 == 0 else 1
        self.mesh2 = Mesh(np.array(self.devices).reshape(a, n // a), ("a", "b"), axis_types=(AxisType.Auto,) * 2)

    def one_device(self, fn, *args):
        return jax.jit(fn)(*(jax.device_put(a, self.devices[0]) for a in args))


ENV: Env


def fwd(x, w, b):
    return layernorm_fwd_op(x, w, b, 1e-5)


@check
def rows_sharded():
    """(batch, seq, C) sharded over batch (1-D mesh) and over batch and seq (2-D mesh), bf16 x
    with float32 parameters: outputs equal one device's, keep x's sharding, no collective."""
    for mesh, spec in ((ENV.mesh1, P("data")), (ENV.mesh2, P("a", "b"))):
        x, w, b = inputs((2 * ENV.n, 2 * ENV.n, 256), "bfloat16")
        rep = NamedSharding(mesh, P())
        jitted = jax.jit(fwd, in_shardings=(NamedSharding(mesh, spec), rep, rep))
        got = jitted(x, w, b)
        assert_equal_outputs(got, ENV.one_device(fwd, x, w, b))
        assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 3), got[0].sharding
        assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), got[1].sharding
        assert_no_collectives(jitted, x, w, b)


@check
def vmap_per_example_weights_sharded():
    """vmap over examples with per-example weights, examples sharded: one parameter row per
    example, sharded with them; no collective."""
    x, _, b = inputs((2 * ENV.n, 16, 128))
    ws = np.random.default_rng(1).standard_normal((2 * ENV.n, 128)).astype(np.float32)
    f = jax.vmap(fwd, in_axes=(0, 0, None))
    rows = NamedSharding(ENV.mesh1, P("data"))
    jitted = jax.jit(f, in_shardings=(rows, rows, NamedSharding(ENV.mesh1, P())))
    got = jitted(x, ws, b)
    assert_equal_outputs(got, ENV.one_device(f, x, ws, b))
    assert_no_collectives(jitted, x, ws, b)


@check
def c_sharded_falls_back():
    """x sharded along C: gathered along C with a ShardingFallbackWarning, results still right."""
    x, w, b = inputs((2 * ENV.n, 8, 128))
    rep = NamedSharding(ENV.mesh1, P())
    jitted = jax.jit(fwd, in_shardings=(NamedSharding(ENV.mesh1, P(None, None, "data")), rep, rep))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jitted(x, w, b)
    assert any(issubclass(c.category, ShardingFallbackWarning) and "last axis (C=128)" in str(c.message)
               for c in caught), [str(c.message) for c in caught]
    assert_equal_outputs(got, ENV.one_device(fwd, x, w, b))


@check
def shard_map_local_rows():
    """Inside shard_map over all axes: the plain FFI call on each device's rows, replicated
    parameters cast to varying."""
    x, w, b = inputs((2 * ENV.n, 8, 64))
    spec = P("data")
    f = jax.jit(jax.shard_map(fwd, mesh=ENV.mesh1, in_specs=(spec, P(), P()), out_specs=(spec, spec, spec)))
    assert_equal_outputs(f(x, w, b), ENV.one_device(fwd, x, w, b))


def add_fwd(x, r, w, b):
    return add_layernorm_fwd_op(x, r, w, b, 1e-5)


@check
def add_rows_sharded():
    """The residual variant with x and residual sharded over batch (1-D mesh) and over batch and
    seq (2-D mesh), bf16 with float32 parameters: equal to one device's, y and s keep x's
    sharding, no collective."""
    for mesh, spec in ((ENV.mesh1, P("data")), (ENV.mesh2, P("a", "b"))):
        x, w, b = inputs((2 * ENV.n, 2 * ENV.n, 256), "bfloat16")
        r = inputs((2 * ENV.n, 2 * ENV.n, 256), "bfloat16", seed=1)[0]
        rows, rep = NamedSharding(mesh, spec), NamedSharding(mesh, P())
        jitted = jax.jit(add_fwd, in_shardings=(rows, rows, rep, rep))
        got = jitted(x, r, w, b)
        assert_equal_outputs(got, ENV.one_device(add_fwd, x, r, w, b))
        for out, rank in zip(got, (3, 3, 2, 2)):
            assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), rank), out.sharding
        assert_no_collectives(jitted, x, r, w, b)


@check
def add_vmap_per_example_weights_sharded():
    """The residual variant under vmap with per-example weights, examples sharded; no collective."""
    x, _, b = inputs((2 * ENV.n, 16, 128))
    r = inputs((2 * ENV.n, 16, 128), seed=1)[0]
    ws = np.random.default_rng(1).standard_normal((2 * ENV.n, 128)).astype(np.float32)
    f = jax.vmap(add_fwd, in_axes=(0, 0, 0, None))
    rows = NamedSharding(ENV.mesh1, P("data"))
    jitted = jax.jit(f, in_shardings=(rows, rows, rows, NamedSharding(ENV.mesh1, P())))
    got = jitted(x, r, ws, b)
    assert_equal_outputs(got, ENV.one_device(f, x, r, ws, b))
    assert_no_collectives(jitted, x, r, ws, b)


@check
def add_c_sharded_falls_back():
    """The residual variant with x and residual sharded along C: gathered, with the warning."""
    x, w, b = inputs((2 * ENV.n, 8, 128))
    r = inputs((2 * ENV.n, 8, 128), seed=1)[0]
    cols, rep = NamedSharding(ENV.mesh1, P(None, None, "data")), NamedSharding(ENV.mesh1, P())
    jitted = jax.jit(add_fwd, in_shardings=(cols, cols, rep, rep))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jitted(x, r, w, b)
    assert any(issubclass(c.category, ShardingFallbackWarning) and "last axis (C=128)" in str(c.message)
               for c in caught), [str(c.message) for c in caught]
    assert_equal_outputs(got, ENV.one_device(add_fwd, x, r, w, b))


@check
def add_shard_map_local_rows():
    """The residual variant inside shard_map over all axes: the plain FFI call per device."""
    x, w, b = inputs((2 * ENV.n, 8, 64))
    r = inputs((2 * ENV.n, 8, 64), seed=1)[0]
    spec = P("data")
    f = jax.jit(jax.shard_map(add_fwd, mesh=ENV.mesh1, in_specs=(spec, spec, P(), P()),
                              out_specs=(spec, spec, spec, spec)))
    assert_equal_outputs(f(x, r, w, b), ENV.one_device(add_fwd, x, r, w, b))


def main() -> int:
    global ENV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    opts = parser.parse_args()
    ENV = Env(opts.platform)
    failed = 0
    for name, fn in CHECKS.items():
        try:
            fn()
            result = {"check": name, "ok": True, "detail": ""}
        except Exception:  # report every check, not only the first failure
            result = {"check": name, "ok": False, "detail": traceback.format_exc(limit=-3)}
            failed += 1
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
