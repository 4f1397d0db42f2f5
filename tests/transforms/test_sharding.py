"""The backward op on several devices: jit with shardings, vmap, scan and shard_map.

On the CPU these run on the 8 host devices that conftest.py configures; on the GPU on every
visible GPU, when there are at least two (else skipped).

What "sharded correctly" means here, for a gradient of a loss through layernorm with x's rows
sharded: the results equal those of the same program on one device (up to the order of the
sums), dx keeps x's sharding, and the compiled program has no all-gather, all-to-all or
collective-permute (nothing row-sized moves between devices) and exactly one all-reduce: our
psum of dweight and dbias stacked, f32[2, C]. `test_baseline_gathers` shows that without our
partitioning rule XLA does gather (so the HLO checks can see a failure).
"""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_lnbwd
from conftest import HAS_GPU, assert_close
from jax_lnbwd import reference
from jax_lnbwd import ShardingFallbackWarning
from jax_lnbwd.norms import LAYERNORM
from jax_lnbwd.ops import backward as backward_op

COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def _gpu_count() -> int:
    return len(jax.devices("gpu")) if HAS_GPU else 0


SHARDING_PLATFORMS = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(_gpu_count() < 2, reason="needs at least 2 GPUs")])]


def assert_grads_close(got, want, dtype="float32", what=""):
    for name, g, w in zip(("dx", "dweight", "dbias"), got, want):
        assert_close(f"{what} {name}", g, w, dtype)


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


@pytest.fixture(params=SHARDING_PLATFORMS)
def env(request):
    return Env(request.param)


# --- the tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_sharded_1d(env, dtype):
    """(batch, seq, C) with the batch over all devices: grads equal one device's, one psum."""
    args = inputs((2 * env.n, 16, 256), dtype)
    f = grads(jax_lnbwd.layernorm)
    jitted, got = env.sharded(f, env.mesh1, P("data"), *args)
    assert_grads_close(got, env.one_device(f, *args), dtype)
    assert got[0].sharding.is_equivalent_to(NamedSharding(env.mesh1, P("data")), 3), got[0].sharding
    assert_one_psum_no_gather(jitted, args, 256)


@pytest.mark.parametrize("spec", [P("a", "b"), P(("a", "b")), P("b", "a")], ids=str)
def test_rows_sharded_2d(env, spec):
    """Rows over two mesh axes: batch over a and seq over b (sequence parallel), both over
    the batch, and b before a. x's leading axes reach the rule unflattened, so no layout needs
    a transpose between devices."""
    args = inputs(env.grid(128))
    f = grads(jax_lnbwd.layernorm)
    jitted, got = env.sharded(f, env.mesh2, spec, *args)
    assert_grads_close(got, env.one_device(f, *args), what=str(spec))
    assert got[0].sharding.is_equivalent_to(NamedSharding(env.mesh2, spec), 3), (spec, got[0].sharding)
    assert_one_psum_no_gather(jitted, args, 128)


def test_explicit_mesh_axes(env):
    """The same with Explicit mesh axes (shardings in the types; jax.make_mesh's default)."""
    explicit = Env(env.devices[0].platform, AxisType.Explicit)
    args = inputs(env.grid(128))
    f = grads(jax_lnbwd.layernorm)
    jitted, got = explicit.sharded(f, explicit.mesh2, P("a", "b"), *args)
    assert_grads_close(got, env.one_device(f, *args))
    assert_one_psum_no_gather(jitted, args, 128)


def test_baseline_gathers(env):
    """Without the partitioning rule (the bare FFI call) XLA gathers x and dy: what the
    rule avoids, and proof that the HLO checks see it."""
    def bare(x, w, b, r):
        _, mean, rstd = reference.layernorm_fwd(x, w, b)
        kernel = jax_lnbwd.KERNELS[jax_lnbwd.DEFAULT_KERNEL]
        return backward_op._local(LAYERNORM, False, 0.0, r.astype(x.dtype), x, w, mean, rstd, 0, kernel.id,
                                  kernel.default_block_size)
    args = inputs((2 * env.n, 16, 256))
    jitted, _ = env.sharded(bare, env.mesh1, P("data"), *args)
    ops = collectives(jitted.lower(*args).compile().as_text())
    assert any("all-gather" in op for op in ops), "expected all-gathers:\n" + "\n".join(ops)


@pytest.mark.parametrize("per_example_params", [False, True], ids=["shared-params", "per-example-params"])
def test_vmap_segments_sharded(env, per_example_params):
    """vmap(grad): per-example dweight/dbias (segments). With the batch sharded each device
    holds whole examples: no collective at all, and dweight comes out sharded like the batch.
    Weight and bias shared by the batch, or per example (then split with the batch)."""
    x, w, b, r = inputs((env.n, 8, 128))
    if per_example_params:
        per_example = np.stack([w] * env.n) * np.linspace(0.5, 1.5, env.n, dtype=np.float32)[:, None]
        in_axes, args = (0, 0, 0, 0), (x, per_example, per_example, r)
    else:
        in_axes, args = (0, None, None, 0), (x, w, b, r)
    f = jax.vmap(grads(jax_lnbwd.layernorm), in_axes=in_axes)
    jitted, got = env.sharded(f, env.mesh1, P("data"), *args)
    assert_grads_close(got, env.one_device(f, *args))
    assert got[1].shape == (env.n, 128)
    assert got[1].sharding.is_equivalent_to(NamedSharding(env.mesh1, P("data")), 2), got[1].sharding
    ops = collectives(jitted.lower(*args).compile().as_text())
    assert not ops, "expected no collectives:\n" + "\n".join(ops)


def test_vmap_segments_and_rows_sharded(env):
    """vmap(grad) with the batch over a and the rows of each example over b: each device sums
    its rows of its examples, and one psum over b adds them up: f32[2, examples/a, C]."""
    args = inputs(env.grid(128))
    f = jax.vmap(grads(jax_lnbwd.layernorm), in_axes=(0, None, None, 0))
    jitted, got = env.sharded(f, env.mesh2, P("a", "b"), *args)
    assert_grads_close(got, env.one_device(f, *args))
    ops = collectives(jitted.lower(*args).compile().as_text())
    a, b = env.mesh2.shape["a"], env.mesh2.shape["b"]
    if b == 1:  # two devices: the mesh is 2x1 and b splits nothing
        assert not ops, "\n".join(ops)
    else:
        assert len(ops) == 1 and "all-reduce" in ops[0] and f"f32[2,{2 * env.n // a},128]" in ops[0], "\n".join(ops)


def test_scan_over_layers(env):
    """lax.scan over stacked layers (as flax.linen.scan does): one psum, inside the loop."""
    x, w, b, r = inputs((2 * env.n, 8, 128))
    ws, bs = np.stack([w, 0.5 * w, w + 1]), np.stack([b, -b, 2 * b])

    def deep(x, ws, bs, r):
        def layer(h, wb):
            return h + 0.5 * jax_lnbwd.layernorm(h, *wb), None
        return jnp.sum(jax.lax.scan(layer, x, (ws, bs))[0] * r)

    f = jax.grad(deep, argnums=(0, 1, 2))
    jitted, got = env.sharded(f, env.mesh1, P("data"), x, ws, bs, r)
    assert_grads_close(got, env.one_device(f, x, ws, bs, r))
    assert_one_psum_no_gather(jitted, (x, ws, bs, r), 128)


def test_grad_of_grad(env):
    """The backward's own derivative (jnp) composes with the partitioned op."""
    x, w, b, r = inputs((2 * env.n, 8, 64))

    def gnorm(x, w, b, r):
        g = jax.grad(lambda x: loss(jax_lnbwd.layernorm, x, w, b, r))(x)
        return jnp.sum(g * g)

    f = jax.grad(gnorm, argnums=(0, 1, 2))
    _, got = env.sharded(f, env.mesh1, P("data"), x, w, b, r)
    assert_grads_close(got, env.one_device(f, x, w, b, r))


def test_forward_mode_sharded(env):
    """jax.jvp and jax.hessian-vector products (forward over reverse) on sharded rows: the
    tangent map is jnp, which XLA partitions itself; the reverse pass is the partitioned op."""
    x, w, b, r = inputs((2 * env.n, 8, 64))
    t = inputs((2 * env.n, 8, 64), seed=1)[:3]

    def fwd_and_hvp(norm, x, w, b, r):
        tangent = jax.jvp(lambda *p: loss(norm, *p, r), (x, w, b), t)[1]
        hvp = jax.jvp(lambda *p: grads(norm)(*p, r), (x, w, b), t)[1]
        return tangent, hvp

    f = lambda *a: fwd_and_hvp(jax_lnbwd.layernorm, *a)  # noqa: E731
    _, (tangent, hvp) = env.sharded(f, env.mesh1, P("data"), x, w, b, r)
    want_tangent, want_hvp = env.one_device(lambda *a: fwd_and_hvp(reference.layernorm, *a), x, w, b, r)
    assert_close("jvp", tangent, want_tangent, "float32")
    assert_grads_close(hvp, want_hvp, what="hvp")


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no-check_vma"])
def test_forward_mode_inside_shard_map(env, check_vma):
    """jax.jvp, jvp of grad and jacfwd inside a shard_map over all devices: the tangent map's
    operands are typed varying like x (a replicated weight next to sharded rows), as jnp's are."""
    x, w, b, t = inputs((2 * env.n, 8, 32))

    def program(norm):
        def local(x, w, b, t):
            tangent = jax.jvp(norm, (x, w, b), (t, w, b))[1]
            hvp = jax.jvp(jax.grad(lambda *p: jnp.sum(jnp.sin(norm(*p))), argnums=(0, 1, 2)), (x, w, b), (t, w, b))[1]
            jac = jax.jacfwd(lambda w: norm(x[:1, :1], w, b))(w)
            return tangent, hvp[0], hvp[1][None], jac
        spec = P("data")
        return jax.jit(jax.shard_map(local, mesh=env.mesh1, in_specs=(spec, P(), P(), spec),
                                     out_specs=(spec,) * 4, check_vma=check_vma))

    got = program(jax_lnbwd.layernorm)(x, w, b, t)
    want = program(reference.layernorm)(x, w, b, t)
    for name, g, r in zip(("jvp", "hvp dx", "hvp dweight", "jacfwd"), got, want):
        assert_close(name, g, r, "float32")


def test_forward_mode_explicit_mesh(env):
    """jax.jvp and vmap of it with Explicit mesh axes: the tangent keeps x's sharding."""
    explicit = Env(env.devices[0].platform, AxisType.Explicit)
    x, w, b, t = inputs((2 * env.n, 8, 32))
    rows = NamedSharding(explicit.mesh1, P("data"))
    with jax.set_mesh(explicit.mesh1):
        xs, ts = jax.device_put(x, rows), jax.device_put(t, rows)
        got = jax.jit(lambda x, t: jax.jvp(jax_lnbwd.layernorm, (x, w, b), (t, w, b)))(xs, ts)
        batched = jax.jit(jax.vmap(lambda x, t: jax.jvp(jax_lnbwd.layernorm, (x, w, b), (t, w, b))[1]))(xs, ts)
    want = jax.jvp(reference.layernorm, (x, w, b), (t, w, b))
    assert got[1].sharding.is_equivalent_to(rows, 3), got[1].sharding
    assert_close("y", got[0], want[0], "float32")
    assert_close("jvp", got[1], want[1], "float32")
    assert_close("vmap(jvp)", batched, want[1], "float32")


def expect_warning(fn, pattern):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    messages = [str(w.message) for w in caught if issubclass(w.category, ShardingFallbackWarning)]
    assert any(re.search(pattern, m) for m in messages), f"no ShardingFallbackWarning matching {pattern!r}: {messages}"
    return out


def test_c_sharded_warns_and_gathers(env):
    """C sharded: a warning, x and dy gathered along C, and still the right answer. (On a
    2-D mesh with both axes > 1: batch over a and C over b, the rows stay split over a.)"""
    args = inputs(env.grid(128))
    f = grads(jax_lnbwd.layernorm)
    spec = P("a", None, "b") if env.mesh2.shape["b"] > 1 else P(None, None, "a")
    _, got = expect_warning(lambda: env.sharded(f, env.mesh2, spec, *args), r"last axis \(C=128\)")
    assert_grads_close(got, env.one_device(f, *args))


def test_uneven_rows_warn_and_gather(env):
    """Rows that do not split evenly (XLA pads them): gathered, with a warning."""
    x, w, b, r = inputs((env.n + env.n // 2, 64))

    def doubled(x, w, b, r, sharding=None):
        x = 2 * x if sharding is None else jax.lax.with_sharding_constraint(2 * x, sharding)
        return loss(jax_lnbwd.layernorm, x, w, b, r)

    f = jax.grad(doubled, argnums=(0, 1, 2))
    padded = jax.jit(lambda *a: f(*a, sharding=NamedSharding(env.mesh1, P("data"))))
    got = expect_warning(lambda: padded(x, w, b, r), "does not split evenly")
    assert_grads_close(got, env.one_device(f, x, w, b, r))


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


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no-check_vma"])
@pytest.mark.parametrize("user_psum", [False, True], ids=["no-psum", "psum"])
def test_shard_map_like_jnp(env, check_vma, user_psum):
    """Inside shard_map the op works on local rows and returns local sums, and JAX's rules
    for replicated parameters apply as for jnp code: with check_vma=True (the default) the
    gradient of a replicated weight is psummed over the shards by JAX itself; with
    check_vma=False it is the shard's own sum unless the user psums. Every combination is
    compared with the same shard_map over the pure-jnp reference layernorm."""
    args = inputs((2 * env.n, 8, 128))
    manual = ("a", "b")
    got = shard_map_grads(jax_lnbwd.layernorm, env.mesh2, manual, check_vma, user_psum)(*args)
    want = shard_map_grads(reference.layernorm, env.mesh2, manual, check_vma, user_psum)(*args)
    assert_grads_close(got, want)
    if not check_vma and not user_psum:
        # shard i's dweight is the sum over its own rows only.
        x, w, b, r = args
        blocks = np.split(np.arange(x.shape[0]), env.n)
        per_shard = [grads(reference.layernorm)(x[i], w, b, r[i]) for i in blocks]
        assert_grads_close(got, (np.concatenate([g[0] for g in per_shard]), np.stack([g[1] for g in per_shard]),
                                 np.stack([g[2] for g in per_shard])), what="per shard")


def test_shard_map_over_some_axes_warns(env):
    """shard_map over a only, b automatic: the op gathers along b (a warning) and is right."""
    args = inputs((2 * env.n, 8, 128))
    got = expect_warning(lambda: shard_map_grads(jax_lnbwd.layernorm, env.mesh2, ("a",), True, True)(*args),
                         "gathers dy and x")
    want = shard_map_grads(reference.layernorm, env.mesh2, ("a",), True, True)(*args)
    assert_grads_close(got, want)


def test_export_inside_shard_map(env):
    """jax.export of a program whose layernorm runs inside a shard_map over all axes: the
    exported module calls our target directly and runs like the original."""
    from jax import export

    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    args = inputs((2 * env.n, 8, 128))
    program = shard_map_grads(jax_lnbwd.layernorm, env.mesh1, ("data",), True, False)
    shardings = [NamedSharding(env.mesh1, spec) for spec in (P("data"), P(), P(), P("data"))]
    args = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    exported = export.export(program, disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS])(*args)
    assert f"@{jax_lnbwd.TARGET}(" in exported.mlir_module()
    restored = export.deserialize(exported.serialize())
    for got, want in zip(jax.jit(restored.call)(*args), program(*args)):
        np.testing.assert_array_equal(got, want)
