"""The dispatch rule (jax_lnbwd/dispatch.py) picks as documented: the switches first, an explicit
kernel, Explicit mesh axes, XLA's forward under autodiff, the measured CUDA crossovers, and jnp off
CUDA. The suite runs with the FFI backward forced and the crossovers at 1 (conftest.py); these
tests restore the defaults: the environment variables unset and the measured table.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import jax_lnbwd
from conftest import MEASURED_CROSSOVERS, make_inputs
from jax_lnbwd import config, dispatch
from jax_lnbwd.norms import LAYERNORM, RMSNORM

FORWARD, BACKWARD = dispatch.FORWARD, dispatch.BACKWARD
ALL_TARGETS = jax_lnbwd.TARGETS


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    """The package's defaults: no switch set, the measured crossovers, CUDA a kernel platform."""
    for var in (config.FORWARD_ENV_VAR, config.BACKWARD_ENV_VAR):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.setitem(config._overrides, var, None)
    monkeypatch.setattr(dispatch, "CROSSOVERS", dict(MEASURED_CROSSOVERS))
    dispatch.clear_decisions()


def _decide(direction, shape, dtype="bfloat16", norm=RMSNORM, **kw):
    return dispatch.decide(norm, direction, shape, jnp.dtype(dtype), **kw)


# --- the documented table (README "Where each norm runs") ---------------------------------------

@pytest.mark.parametrize("op,direction,dtype,C,rows,ours", [
    # forward: layernorm bf16 from C 256, fp32 from 128; rmsnorm from 128; the add ops bf16 128, fp32 64;
    # layernorm and rmsnorm also from C 64 with >= 65536 rows, 16-bit add_layernorm from C 64 with
    # >= 524288 rows, 16-bit add_rmsnorm from C 64 with >= 65536 rows; layernorm and add_layernorm
    # from C 32 with >= 1048576 rows, rmsnorm and add_rmsnorm from C 32 with >= 262144 rows (the
    # small-row kernels)
    ("layernorm", FORWARD, "bfloat16", 128, 262144, True),
    ("layernorm", FORWARD, "bfloat16", 128, 8192, False),
    ("layernorm", FORWARD, "bfloat16", 256, 131072, True),
    ("layernorm", FORWARD, "float32", 64, 524288, True),
    ("layernorm", FORWARD, "float32", 32, 1048576, True),
    ("layernorm", FORWARD, "float32", 32, 524288, False),
    ("rmsnorm", FORWARD, "bfloat16", 32, 1048576, True),
    ("rmsnorm", FORWARD, "bfloat16", 16, 1048576, False),
    ("rmsnorm", FORWARD, "float32", 34, 1048576, False),   # not 16-byte rows
    ("layernorm", FORWARD, "float32", 128, 262144, True),
    ("rmsnorm", FORWARD, "bfloat16", 64, 524288, True),
    ("rmsnorm", FORWARD, "bfloat16", 64, 8192, False),
    ("rmsnorm", FORWARD, "bfloat16", 128, 8, True),
    ("rmsnorm", FORWARD, "float16", 128, 8, True),
    ("rmsnorm", FORWARD, "float32", 64, 524288, True),
    ("add_layernorm", FORWARD, "bfloat16", 128, 262144, True),
    ("add_layernorm", FORWARD, "float32", 64, 524288, True),
    ("add_layernorm", FORWARD, "float32", 32, 1048576, True),
    ("add_layernorm", FORWARD, "float32", 32, 524288, False),
    ("add_layernorm", FORWARD, "bfloat16", 64, 524288, True),
    ("add_layernorm", FORWARD, "bfloat16", 64, 262144, False),
    ("rmsnorm", FORWARD, "float32", 32, 262144, True),
    ("rmsnorm", FORWARD, "float32", 32, 131072, False),
    ("rmsnorm", FORWARD, "bfloat16", 32, 262144, True),
    ("rmsnorm", FORWARD, "bfloat16", 32, 131072, False),
    ("add_rmsnorm", FORWARD, "bfloat16", 64, 65536, True),
    ("add_rmsnorm", FORWARD, "bfloat16", 64, 32768, False),
    ("add_rmsnorm", FORWARD, "bfloat16", 36, 262144, False),   # not 16-byte rows
    ("add_rmsnorm", FORWARD, "bfloat16", 32, 262144, True),
    ("add_rmsnorm", FORWARD, "float32", 32, 262144, True),
    ("add_rmsnorm", FORWARD, "float32", 32, 131072, False),
    ("add_rmsnorm", FORWARD, "float64", 64, 524288, True),
    # backward: C >= 256 with >= 1024 rows, C >= 64 with >= 65536 rows or C >= 32 with >= 1048576
    # rows (the small-row kernels)
    ("layernorm", BACKWARD, "bfloat16", 128, 262144, True),
    ("layernorm", BACKWARD, "bfloat16", 128, 8192, False),
    ("layernorm", BACKWARD, "bfloat16", 32, 1048576, True),
    ("layernorm", BACKWARD, "bfloat16", 32, 524288, False),
    ("rmsnorm", BACKWARD, "float32", 32, 1048576, True),
    ("rmsnorm", BACKWARD, "float32", 16, 1048576, False),
    ("layernorm", BACKWARD, "bfloat16", 256, 131072, True),
    ("layernorm", BACKWARD, "bfloat16", 4096, 256, False),
    ("layernorm", BACKWARD, "bfloat16", 1024, 1024, True),
    ("layernorm", BACKWARD, "float32", 128, 262144, True),
    ("layernorm", BACKWARD, "float32", 128, 8192, False),
    ("rmsnorm", BACKWARD, "float32", 64, 524288, True),
    ("rmsnorm", BACKWARD, "bfloat16", 128, 262144, True),
    ("rmsnorm", BACKWARD, "bfloat16", 100, 262144, False),   # not 16-byte rows: no small-row kernel
    ("rmsnorm", BACKWARD, "bfloat16", 260, 262144, True),    # C >= 256: any rows
    ("rmsnorm", FORWARD, "float32", 66, 524288, False),
    ("rmsnorm", FORWARD, "float32", 68, 524288, True),
    ("rmsnorm", BACKWARD, "bfloat16", 2048, 16384, True),
    ("add_rmsnorm", BACKWARD, "bfloat16", 2048, 16384, True),
    ("add_rmsnorm", BACKWARD, "bfloat16", 128, 16384, False),
    ("add_rmsnorm", BACKWARD, "bfloat16", 128, 65536, True),
])
def test_crossovers(op, direction, dtype, C, rows, ours):
    wins, why = dispatch.cuda_kernel_wins(op, direction, rows, C, jnp.dtype(dtype))
    assert wins == ours, why
    norm = LAYERNORM if op.endswith("layernorm") else RMSNORM
    d = _decide(direction, (rows, C), dtype, norm=norm, add=op.startswith("add_"))
    assert d.platforms == (("cuda",) if ours else ()) and d.op == op, d
    assert d.path == ("ffi on cuda" if ours else "jnp")


def test_every_op_direction_and_width_has_a_row():
    for op in ("layernorm", "rmsnorm", "add_layernorm", "add_rmsnorm"):
        for direction in (FORWARD, BACKWARD):
            for dtype in ("bfloat16", "float16", "float32", "float64"):
                assert dispatch.crossovers(op, direction, jnp.dtype(dtype))


def test_switches_and_explicit_kernel_come_first(monkeypatch):
    shape = (8, 16)   # below every crossover: the rule alone picks jnp
    assert _decide(FORWARD, shape).platforms == ()
    with jax_lnbwd.use_ffi_forward(True):
        assert _decide(FORWARD, shape).platforms == dispatch.EVERY
    with jax_lnbwd.use_ffi_backward(True):
        assert _decide(BACKWARD, shape).platforms == dispatch.EVERY
    with jax_lnbwd.use_xla_backward(False):
        assert _decide(BACKWARD, shape).platforms == dispatch.EVERY
    with jax_lnbwd.use_ffi_backward(False):
        assert _decide(BACKWARD, (16384, 2048)).platforms == ()
    assert _decide(BACKWARD, shape, mode_="ffi").platforms == dispatch.EVERY   # an explicit kernel
    monkeypatch.setenv(config.FORWARD_ENV_VAR, "ffi")
    assert _decide(FORWARD, shape).platforms == dispatch.EVERY
    monkeypatch.setenv(config.FORWARD_ENV_VAR, "xla")
    assert _decide(FORWARD, (16384, 2048)).platforms == ()
    monkeypatch.setenv(config.BACKWARD_ENV_VAR, "ffi")
    assert _decide(BACKWARD, shape).platforms == dispatch.EVERY


def test_autodiff_explicit_sharding_and_build():
    big = (16384, 2048)
    assert _decide(FORWARD, big).platforms == ("cuda",)
    assert _decide(FORWARD, big, differentiated=True).platforms == ()
    assert _decide(FORWARD, big, explicitly_sharded=True).platforms == ()
    assert _decide(BACKWARD, big).platforms == ("cuda",)
    no_cuda = _decide(BACKWARD, big, cuda_built=False)
    assert no_cuda.platforms == () and "no CUDA handler" in no_cuda.why


def _targets(text: str) -> set[str]:
    return {t for t in ALL_TARGETS if f"@{t}(" in text}


def _grad(norm):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(norm(x, w) ** 2), argnums=(0, 1)))


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "add_layernorm", "add_rmsnorm"])
def test_cpu_runs_jnp_by_default(name):
    """The default on the CPU: no custom call in either direction, values the reference's."""
    x, r, w, b = make_inputs((64, 256), "float32", seed=1)
    norm = {"layernorm": lambda x, w: jax_lnbwd.layernorm(x, w, b),
            "rmsnorm": jax_lnbwd.rmsnorm,
            "add_layernorm": lambda x, w: jax_lnbwd.add_layernorm(x, r, w, b)[0],
            "add_rmsnorm": lambda x, w: jax_lnbwd.add_rmsnorm(x, r, w)[0]}[name]
    assert not _targets(jax.jit(norm).lower(x, w).as_text())
    assert not _targets(_grad(norm).lower(x, w).as_text())
    assert dispatch.decisions() and all("cpu" not in d.platforms and d.platforms != dispatch.EVERY
                                         for d in dispatch.decisions())


def test_no_kernel_anywhere_is_the_plain_reference(monkeypatch):
    """Where no platform would run a kernel of ours (narrow rows here, or no CUDA build), the
    public function is the jnp reference differentiated by JAX: the same program as jnp code."""
    x, _, w, _ = make_inputs((64, 32), "float32", seed=4)
    ours = jax.jit(jax.grad(lambda x, w: jnp.sum(jax_lnbwd.rmsnorm(x, w) ** 2), argnums=(0, 1)))
    ref = jax.jit(jax.grad(lambda x, w: jnp.sum(jax_lnbwd.reference.rmsnorm(x, w) ** 2), argnums=(0, 1)))
    assert ours.lower(x, w).as_text().count("stablehlo.") == ref.lower(x, w).as_text().count("stablehlo.")
    last = dispatch.decisions()[-1]
    assert last.direction == "both" and last.path == "jnp" and "differentiated by JAX" in last.why
    x, _, w, _ = make_inputs((4096, 1024), "float32", seed=4)
    monkeypatch.setattr(jax_lnbwd.ops.ffi, "WITH_CUDA", False)
    jax.jit(jax_lnbwd.rmsnorm).lower(x, w)
    assert dispatch.decisions()[-1].why.startswith("no CUDA handler")


def test_cuda_lowering_follows_the_rule():
    """Lowered for CUDA (from the CPU: needs the CUDA handler in this build): a wide norm runs our
    forward alone and our backward under grad; a narrow one runs neither."""
    if not jax_lnbwd.WITH_CUDA:
        pytest.skip("this build has no CUDA handler")
    from jax import export
    allow = [export.DisabledSafetyCheck.custom_call(t) for t in ALL_TARGETS]

    def exported(fn, *args):
        return export.export(fn, platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()

    for C, ours in ((2048, True), (64, False)):
        x = jax.ShapeDtypeStruct((1024, C), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((C,), jnp.float32)
        fwd = _targets(exported(jax.jit(jax_lnbwd.rmsnorm), x, w))
        grad = _targets(exported(_grad(jax_lnbwd.rmsnorm), x, w))
        assert fwd == ({RMSNORM.fwd_target} if ours else set()), (C, fwd)
        assert grad == ({RMSNORM.bwd_target_v2} if ours else set()), (C, grad)


def test_a_backward_keeps_the_switch_its_forward_was_traced_under():
    """use_ffi_backward around the forward call decides the backward that JAX traces later."""
    x, _, w, _ = make_inputs((8, 32), "float32", seed=2)

    def loss(x, w, enabled):
        with jax_lnbwd.use_ffi_backward(enabled):
            y = jax_lnbwd.rmsnorm(x, w)
        return jnp.sum(y ** 2)

    forced = jax.jit(jax.grad(functools.partial(loss, enabled=True), argnums=(0, 1)))
    assert RMSNORM.bwd_target_v2 in _targets(forced.lower(x, w).as_text())
    with jax_lnbwd.use_ffi_backward(True):   # the inner switch wins for what it wraps
        inner = jax.grad(functools.partial(loss, enabled=False), argnums=(0, 1))
        assert not _targets(jax.jit(inner).lower(x, w).as_text())


def test_explicit_kernel_runs_everywhere():
    x, _, w, _ = make_inputs((8, 32), "float32", seed=3)
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jax_lnbwd.rmsnorm(x, w, kernel=12) ** 2), argnums=(0, 1)))
    assert RMSNORM.bwd_target_v2 in _targets(grad.lower(x, w).as_text())
    assert dispatch.decisions()[-1].path == "ffi everywhere"


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "add_layernorm", "add_rmsnorm"])
def test_default_grad_under_explicit_mesh_axes(name):
    """The default path (jnp both ways on the CPU) under a jit whose rows are sharded over two
    Explicit mesh axes (jax.make_mesh's default): the gradients are the reference's. The jnp
    backward keeps x's own axes, so the residual gradient adds to dx with matching shardings."""
    mesh = jax.make_mesh((4, 2), ("data", "seq"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices("cpu")[:8])
    x, r, w, b = make_inputs((8, 16, 64), "float32", seed=6)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "seq", None))
    xs, rs = jax.device_put(x, rows), jax.device_put(r, rows)
    ref = jax_lnbwd.reference
    ours, theirs = {
        "layernorm": (lambda x, r, w: jax_lnbwd.layernorm(x, w, b), lambda x, r, w: ref.layernorm(x, w, b)),
        "rmsnorm": (lambda x, r, w: jax_lnbwd.rmsnorm(x, w), lambda x, r, w: ref.rmsnorm(x, w)),
        "add_layernorm": (lambda x, r, w: sum(jax_lnbwd.add_layernorm(x, r, w, b, x_bias=b)),
                          lambda x, r, w: ref.layernorm(x + b + r, w, b) + x + b + r),
        "add_rmsnorm": (lambda x, r, w: sum(jax_lnbwd.add_rmsnorm(x, r, w, x_bias=b)),
                        lambda x, r, w: ref.rmsnorm(x + b + r, w) + x + b + r),
    }[name]

    def grads(f, *args):
        return jax.jit(jax.grad(lambda x, r, w: jnp.sum(f(x, r, w) ** 2), argnums=(0, 1, 2)))(*args)

    got = grads(ours, xs, rs, w)
    want = grads(theirs, x, r, w)
    for g, e in zip(got, want):
        assert jnp.allclose(g, e, rtol=1e-4, atol=1e-4), (name, float(jnp.max(jnp.abs(g - e))))
