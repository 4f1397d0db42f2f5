"""Checks of the layernorm backward on several devices; run by test_sharding.py in a subprocess.

    python tests/sharding_checks.py --platform cpu     # 8 host CPU devices (XLA flag set below)
    python tests/sharding_checks.py --platform gpu     # every visible GPU (at least 2)

The number of host CPU devices is an XLA flag read when JAX starts, and the pytest process has
started JAX long before, hence a separate process. Every check prints one JSON line
{"check": name, "ok": bool, "detail": str}; the exit status is 0 when all passed.

What "sharded correctly" means here, for a gradient of a loss through layernorm with x's rows
sharded: the results equal those of the same program on one device (up to the order of the
sums), dx keeps x's sharding, and the compiled program has no all-gather, all-to-all or
collective-permute (nothing row-sized moves between devices) and exactly one all-reduce: our
psum of dweight and dbias stacked, f32[2, C]. `baseline_gathers` shows that without our
partitioning rule XLA does gather (so the HLO checks can see a failure).
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

import jax_lnbwd  # noqa: E402
from jax_lnbwd import reference  # noqa: E402
from jax_lnbwd.sharding import ShardingFallbackWarning, _local_op  # noqa: E402

RTOL = {"float32": 1e-5, "bfloat16": 1e-2}
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"shape {a.shape} vs {b.shape}"
    ref = np.linalg.norm(b.ravel())
    return float(np.linalg.norm((a - b).ravel()) / (ref if ref > 0 else 1.0))


def assert_close(got, want, dtype, what=""):
    for name, g, w in zip(("dx", "dweight", "dbias"), got, want):
        err = rel_err(g, w)
        assert err <= RTOL[dtype], f"{what} {name}: rel_err {err:.2e} > {RTOL[dtype]:.0e}"


def collectives(compiled_text: str) -> list[str]:
    """Every collective instruction of a compiled program (async ones once, by their -start)."""
    return [line.strip() for line in compiled_text.splitlines() if COLLECTIVE.search(line)]


def assert_one_psum_no_gather(jitted, args, C: int):
    ops = collectives(jitted.lower(*args).compile().as_text())
    moved = [op for op in ops if "all-reduce" not in op]
    assert not moved, "row-sized data moves between devices:\n" + "\n".join(moved)
    reduces = [op for op in ops if "all-reduce" in op]
    assert len(reduces) == 1 and f"f32[2,{C}]" in reduces[0], \
        f"expected one all-reduce of f32[2,{C}] (dweight and dbias), got:\n" + "\n".join(reduces)


# --- the programs ---------------------------------------------------------------------------------

def loss(norm, x, w, b, r):
    return jnp.sum(norm(x, w, b).astype(jnp.float32) * r)


def grads(norm):
    """(x, w, b, r) -> (dx, dweight, dbias) of sum(norm(x, w, b) * r)."""
    return jax.grad(lambda *a: loss(norm, *a), argnums=(0, 1, 2))


def inputs(shape, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    C = shape[-1]
    t = jnp.dtype(dtype)
    return (rng.standard_normal(shape).astype(t), (1 + 0.1 * rng.standard_normal(C)).astype(t),
            rng.standard_normal(C).astype(t), rng.standard_normal(shape).astype(np.float32))


class Env:
    """The devices and meshes of this run: a 1-D mesh over all devices, and a 2-D one."""

    def __init__(self, platform: str, axis_type=AxisType.Auto):
        self.devices = jax.devices(platform)
        n = len(self.devices)
        assert n >= 2, f"needs at least 2 {platform} devices, found {n}"
        types = (axis_type,)
        self.mesh1 = Mesh(np.array(self.devices), ("data",), axis_types=types)
        a = 2 if n % 2 == 0 else 1
        self.mesh2 = Mesh(np.array(self.devices).reshape(a, n // a), ("a", "b"), axis_types=types * 2)
        self.n = n

    def grid(self, C):
        """(batch, seq, C) that every mesh axis, or both together, split evenly."""
        return (2 * self.n, 2 * self.n, C)

    def one_device(self, fn, *args):
        """fn jitted on the first device alone: what the sharded runs must equal."""
        return jax.jit(fn)(*(jax.device_put(a, self.devices[0]) for a in args))

    def sharded(self, fn, mesh, x_spec, *args):
        """fn jitted with x and r (args 0 and 3) sharded by x_spec, weight and bias replicated."""
        xs, rep = NamedSharding(mesh, x_spec), NamedSharding(mesh, P())
        jitted = jax.jit(fn, in_shardings=(xs, rep, rep, xs))
        return jitted, jitted(*args)


ENV: Env


# --- the checks -----------------------------------------------------------------------------------

@check
def rows_sharded_1d():
    """(batch, seq, C) with the batch over all devices: grads equal one device's, one psum."""
    for dtype in ("float32", "bfloat16"):
        args = inputs((2 * ENV.n, 16, 256), dtype)
        f = grads(jax_lnbwd.layernorm)
        jitted, got = ENV.sharded(f, ENV.mesh1, P("data"), *args)
        assert_close(got, ENV.one_device(f, *args), dtype, dtype)
        assert got[0].sharding.is_equivalent_to(NamedSharding(ENV.mesh1, P("data")), 3), got[0].sharding
        assert_one_psum_no_gather(jitted, args, 256)


@check
def rows_sharded_2d():
    """Rows over two mesh axes: batch over a and seq over b (sequence parallel), both over
    the batch, and b before a. x's leading axes reach the rule unflattened, so no layout needs
    a transpose between devices."""
    args = inputs(ENV.grid(128))
    f = grads(jax_lnbwd.layernorm)
    want = ENV.one_device(f, *args)
    for spec in (P("a", "b"), P(("a", "b")), P("b", "a")):
        jitted, got = ENV.sharded(f, ENV.mesh2, spec, *args)
        assert_close(got, want, "float32", str(spec))
        assert got[0].sharding.is_equivalent_to(NamedSharding(ENV.mesh2, spec), 3), (spec, got[0].sharding)
        assert_one_psum_no_gather(jitted, args, 128)


@check
def explicit_mesh_axes():
    """The same with Explicit mesh axes (shardings in the types; jax.make_mesh's default)."""
    env = Env(ENV.devices[0].platform, AxisType.Explicit)
    args = inputs(ENV.grid(128))
    f = grads(jax_lnbwd.layernorm)
    jitted, got = env.sharded(f, env.mesh2, P("a", "b"), *args)
    assert_close(got, ENV.one_device(f, *args), "float32")
    assert_one_psum_no_gather(jitted, args, 128)


@check
def baseline_gathers():
    """Without the partitioning rule (the bare FFI call) XLA gathers x and dy: what the
    rule avoids, and proof that the HLO checks see it."""
    def bare(x, w, b, r):
        _, mean, rstd = reference.layernorm_fwd(x, w, b)
        kernel = jax_lnbwd.KERNELS[jax_lnbwd.DEFAULT_KERNEL]
        return _local_op(r.astype(x.dtype), x, w, mean, rstd, 0, kernel.id, kernel.default_block_size)
    args = inputs((2 * ENV.n, 16, 256))
    jitted, _ = ENV.sharded(bare, ENV.mesh1, P("data"), *args)
    ops = collectives(jitted.lower(*args).compile().as_text())
    assert any("all-gather" in op for op in ops), "expected all-gathers:\n" + "\n".join(ops)


@check
def vmap_segments_sharded():
    """vmap(grad): per-example dweight/dbias (segments). With the batch sharded each device
    holds whole examples: no collective at all, and dweight comes out sharded like the batch.
    Weight and bias shared by the batch, or per example (then split with the batch)."""
    x, w, b, r = inputs((ENV.n, 8, 128))
    per_example = np.stack([w] * ENV.n) * np.linspace(0.5, 1.5, ENV.n, dtype=np.float32)[:, None]
    for in_axes, args in (((0, None, None, 0), (x, w, b, r)), ((0, 0, 0, 0), (x, per_example, per_example, r))):
        f = jax.vmap(grads(jax_lnbwd.layernorm), in_axes=in_axes)
        jitted, got = ENV.sharded(f, ENV.mesh1, P("data"), *args)
        assert_close(got, ENV.one_device(f, *args), "float32", str(in_axes))
        assert got[1].shape == (ENV.n, 128)
        assert got[1].sharding.is_equivalent_to(NamedSharding(ENV.mesh1, P("data")), 2), got[1].sharding
        ops = collectives(jitted.lower(*args).compile().as_text())
        assert not ops, f"{in_axes}: expected no collectives:\n" + "\n".join(ops)


@check
def vmap_segments_and_rows_sharded():
    """vmap(grad) with the batch over a and the rows of each example over b: each device sums
    its rows of its examples, and one psum over b adds them up: f32[2, examples/a, C]."""
    args = inputs(ENV.grid(128))
    f = jax.vmap(grads(jax_lnbwd.layernorm), in_axes=(0, None, None, 0))
    jitted, got = ENV.sharded(f, ENV.mesh2, P("a", "b"), *args)
    assert_close(got, ENV.one_device(f, *args), "float32")
    ops = collectives(jitted.lower(*args).compile().as_text())
    a, b = ENV.mesh2.shape["a"], ENV.mesh2.shape["b"]
    if b == 1:  # two devices: the mesh is 2x1 and b splits nothing
        assert not ops, "\n".join(ops)
    else:
        assert len(ops) == 1 and "all-reduce" in ops[0] and f"f32[2,{2 * ENV.n // a},128]" in ops[0], "\n".join(ops)


@check
def scan_over_layers():
    """lax.scan over stacked layers (as flax.linen.scan does): one psum, inside the loop."""
    x, w, b, r = inputs((2 * ENV.n, 8, 128))
    ws, bs = np.stack([w, 0.5 * w, w + 1]), np.stack([b, -b, 2 * b])

    def deep(x, ws, bs, r):
        def layer(h, wb):
            return h + 0.5 * jax_lnbwd.layernorm(h, *wb), None
        return jnp.sum(jax.lax.scan(layer, x, (ws, bs))[0] * r)

    f = jax.grad(deep, argnums=(0, 1, 2))
    jitted, got = ENV.sharded(f, ENV.mesh1, P("data"), x, ws, bs, r)
    assert_close(got, ENV.one_device(f, x, ws, bs, r), "float32")
    assert_one_psum_no_gather(jitted, (x, ws, bs, r), 128)


@check
def grad_of_grad():
    """The backward's own derivative (jnp) composes with the partitioned op."""
    x, w, b, r = inputs((2 * ENV.n, 8, 64))

    def gnorm(x, w, b, r):
        g = jax.grad(lambda x: loss(jax_lnbwd.layernorm, x, w, b, r))(x)
        return jnp.sum(g * g)

    f = jax.grad(gnorm, argnums=(0, 1, 2))
    _, got = ENV.sharded(f, ENV.mesh1, P("data"), x, w, b, r)
    assert_close(got, ENV.one_device(f, x, w, b, r), "float32")


def expect_warning(fn, pattern):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    messages = [str(w.message) for w in caught if issubclass(w.category, ShardingFallbackWarning)]
    assert any(re.search(pattern, m) for m in messages), f"no ShardingFallbackWarning matching {pattern!r}: {messages}"
    return out


@check
def c_sharded_warns_and_gathers():
    """C sharded: a warning, x and dy gathered along C, and still the right answer. (On a
    2-D mesh with both axes > 1: batch over a and C over b, the rows stay split over a.)"""
    args = inputs(ENV.grid(128))
    f = grads(jax_lnbwd.layernorm)
    spec = P("a", None, "b") if ENV.mesh2.shape["b"] > 1 else P(None, None, "a")
    _, got = expect_warning(lambda: ENV.sharded(f, ENV.mesh2, spec, *args), r"last axis \(C=128\)")
    assert_close(got, ENV.one_device(f, *args), "float32")


@check
def uneven_rows_warn_and_gather():
    """Rows that do not split evenly (XLA pads them): gathered, with a warning."""
    x, w, b, r = inputs((ENV.n + ENV.n // 2, 64))

    def doubled(x, w, b, r, sharding=None):
        x = 2 * x if sharding is None else jax.lax.with_sharding_constraint(2 * x, sharding)
        return loss(jax_lnbwd.layernorm, x, w, b, r)

    f = jax.grad(doubled, argnums=(0, 1, 2))
    padded = jax.jit(lambda *a: f(*a, sharding=NamedSharding(ENV.mesh1, P("data"))))
    got = expect_warning(lambda: padded(x, w, b, r), "does not split evenly")
    assert_close(got, ENV.one_device(f, x, w, b, r), "float32")


def shard_map_grads(norm, mesh, manual, check_vma, user_psum):
    """grads inside shard_map over the `manual` axes, x and r split over them along the batch."""
    spec = P(manual)

    def local(x, w, b, r):
        dx, dw, db = grads(norm)(x, w, b, r)
        if user_psum:
            dw, db = jax.lax.psum((dw, db), manual)
        return dx, dw[None], db[None]  # one row per shard: what each shard returned

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), P(), spec),
                                 out_specs=(spec, spec, spec), axis_names=set(manual), check_vma=check_vma))


@check
def shard_map_like_jnp():
    """Inside shard_map the op works on local rows and returns local sums, and JAX's rules
    for replicated parameters apply as for jnp code: with check_vma=True (the default) the
    gradient of a replicated weight is psummed over the shards by JAX itself; with
    check_vma=False it is the shard's own sum unless the user psums. Every combination is
    compared with the same shard_map over the pure-jnp reference layernorm."""
    args = inputs((2 * ENV.n, 8, 128))
    manual = ("a", "b")
    for check_vma in (True, False):
        for user_psum in (False, True):
            got = shard_map_grads(jax_lnbwd.layernorm, ENV.mesh2, manual, check_vma, user_psum)(*args)
            want = shard_map_grads(reference.layernorm, ENV.mesh2, manual, check_vma, user_psum)(*args)
            assert_close(got, want, "float32", f"check_vma={check_vma} psum={user_psum}")
    # check_vma=False, no psum: shard i's dweight is the sum over its own rows only.
    got = shard_map_grads(jax_lnbwd.layernorm, ENV.mesh2, manual, False, False)(*args)
    x, w, b, r = args
    blocks = np.split(np.arange(x.shape[0]), ENV.n)
    per_shard = [grads(reference.layernorm)(x[i], w, b, r[i]) for i in blocks]
    assert_close((got[0], got[1], got[2]), (np.concatenate([g[0] for g in per_shard]),
                                            np.stack([g[1] for g in per_shard]),
                                            np.stack([g[2] for g in per_shard])), "float32", "per shard")


@check
def shard_map_over_some_axes_warns():
    """shard_map over a only, b automatic: the op gathers along b (a warning) and is right."""
    args = inputs((2 * ENV.n, 8, 128))
    got = expect_warning(lambda: shard_map_grads(jax_lnbwd.layernorm, ENV.mesh2, ("a",), True, True)(*args),
                         "gathers dy and x")
    want = shard_map_grads(reference.layernorm, ENV.mesh2, ("a",), True, True)(*args)
    assert_close(got, want, "float32")


@check
def export_inside_shard_map():
    """jax.export of a program whose layernorm runs inside a shard_map over all axes: the
    exported module calls our target directly and runs like the original."""
    from jax import export

    args = inputs((2 * ENV.n, 8, 128))
    program = shard_map_grads(jax_lnbwd.layernorm, ENV.mesh1, ("data",), True, False)
    shardings = [NamedSharding(ENV.mesh1, spec) for spec in (P("data"), P(), P(), P("data"))]
    args = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    exported = export.export(program, disabled_checks=[export.DisabledSafetyCheck.custom_call(jax_lnbwd.TARGET)])(*args)
    restored = export.deserialize(exported.serialize())
    for got, want in zip(jax.jit(restored.call)(*args), program(*args)):
        np.testing.assert_array_equal(got, want)


@check
def v2_mixed_residual_rows_sharded():
    """Target v2 (sharding.layernorm_bwd_segments_v2) with bf16 data, a float32 weight and a
    residual gradient, rows over both mesh axes: equal to one device's, dx and dresidual keep
    x's sharding, dweight/dbias are float32, and the one psum is f32[2, C]; with both partitioners."""
    from jax_lnbwd import sharding
    rng = np.random.default_rng(3)
    shape, C = ENV.grid(128), 128
    t = jnp.bfloat16
    x, dy, res = (rng.standard_normal(shape).astype(t) for _ in range(3))
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    xf = jnp.asarray(x, jnp.float32)
    mean = xf.mean(-1)
    rstd = jax.lax.rsqrt(((xf - mean[..., None]) ** 2).mean(-1) + 1e-5)
    for residual in (False, True):
        def f(dy, x, w, mean, rstd, res):
            return sharding.layernorm_bwd_segments_v2(dy, x, w, mean, rstd, 0, 12, 0,
                                                      dresidual=res if residual else None)
        args = (dy, x, w, mean, rstd, res)
        want = ENV.one_device(f, *args)
        for shardy in (True, False):
            jax.config.update("jax_use_shardy_partitioner", shardy)
            try:
                rows, rep = NamedSharding(ENV.mesh2, P("a", "b")), NamedSharding(ENV.mesh2, P())
                stats = NamedSharding(ENV.mesh2, P("a", "b"))
                jitted = jax.jit(f, in_shardings=(rows, rows, rep, stats, stats, rows))
                got = jitted(*args)
            finally:
                jax.config.update("jax_use_shardy_partitioner", True)
            what = f"residual={residual} shardy={shardy}"
            assert got[1].dtype == got[2].dtype == jnp.float32, (what, got[1].dtype)
            for name, g, w_ in zip(("dx", "dweight", "dbias"), got, want):
                err = rel_err(g, w_)
                tol = RTOL["bfloat16"] if name == "dx" else RTOL["float32"]
                assert err <= tol, f"{what} {name}: rel_err {err:.2e} > {tol:.0e}"
            assert got[0].sharding.is_equivalent_to(rows, 3), (what, got[0].sharding)
            if shardy:
                assert_one_psum_no_gather(jitted, args, C)


@check
def gspmd_partitioner():
    """The older GSPMD partitioner (jax_use_shardy_partitioner=False) uses the same partition
    and infer_sharding_from_operands: same results, same single psum."""
    args = inputs(ENV.grid(128))
    f = grads(jax_lnbwd.layernorm)
    want = ENV.one_device(f, *args)
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        jitted, got = ENV.sharded(f, ENV.mesh2, P("a", "b"), *args)
        assert_close(got, want, "float32")
        assert_one_psum_no_gather(jitted, args, 128)
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)


def main() -> int:
    global ENV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset of: " + ", ".join(CHECKS))
    opts = parser.parse_args()
    ENV = Env(opts.platform)
    failed = 0
    for name in opts.checks.split(","):
        try:
            CHECKS[name]()
            result = {"check": name, "ok": True, "detail": ""}
        except Exception:  # report every check, not only the first failure
            result = {"check": name, "ok": False, "detail": traceback.format_exc(limit=-3)}
            failed += 1
        print(json.dumps(result), flush=True)
    print(json.dumps({"devices": ENV.n, "platform": ENV.devices[0].platform, "jax": jax.__version__}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
