"""Shared helpers for the jax_lnbwd tests: x64, 8 CPU devices, platforms, inputs, error measure,
tolerances (RTOL: the one table of per-dtype tolerances, and below it every other tolerance the
tests use, each derived from it or named with its reason; no test module keeps its own).

Every test that runs the op takes a `platform` ("cpu" or "gpu") from PLATFORMS, places its
inputs on that platform's first device and jits, so one test body covers the C++ reference on
the CPU and the CUDA kernels on the GPU. GPU cases carry the `gpu` marker (registered in
pyproject.toml) and are skipped, not failed, on a machine without a GPU; `pytest -m gpu` runs
only them and `pytest -m "not gpu"` none of them.

The tests live in folders by area (api/, transforms/, ops/, kernels/, flax/, bench/, install/;
cuda/ holds the standalone CUDA checks, not pytest). This file, at the top, is every folder's
conftest. Helpers are imported by the test modules with `from conftest import ...`: pytest puts
this folder on sys.path when it loads this conftest, and a test module's own folder when it
imports the module (there is no __init__.py anywhere under tests/, so module names are unique
across folders).

Markers (registered in pyproject.toml): `gpu` (above), and `slow` for the long cases (the e2e
bench's commands, exhaustive sweeps, builds): the default run includes them (CI runs everything);
`pytest -m "not slow"` is the quick run while developing.
"""
from __future__ import annotations

import functools
import os
import pathlib

# 8 host CPU devices, for the sharding tests (test_sharding.py): an XLA flag, read when JAX
# creates its CPU client, so it is set before jax is imported. It changes only the CPU
# platform: a GPU stays visible (jax.devices("gpu")), and tests that place nothing run on
# the default device as before.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _gpu_possible() -> bool:
    """Whether JAX could find a GPU here, asked before jax starts: JAX_PLATFORMS allows one and a
    CUDA or ROCm PJRT plugin is installed (jax[cuda12], jax[cuda13]: jax_plugins.xla_cuda*)."""
    import importlib.util
    import pkgutil
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and set(platforms) <= {"cpu"}:
        return False
    spec = importlib.util.find_spec("jax_plugins")
    locations = spec.submodule_search_locations if spec is not None else None
    return bool(locations) and any(m.name.startswith(("xla_cuda", "xla_rocm"))
                                   for m in pkgutil.iter_modules(locations))


# The CPU suite's time is mostly XLA compiling small programs (every test jits afresh, eager
# jnp compiles op by op). Without a GPU, XLA's LLVM backend optimizes at level 0: about a third
# less compile time, the same results (no fast math either way; our CPU handler is C++ built by
# CMake, not XLA code). A run that may see a GPU keeps XLA's default (the GPU tests time
# kernels beside XLA's), and so does an XLA_FLAGS that sets the level itself.
if not _gpu_possible() and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# The suite tests our kernels: the FFI backward runs on every platform (the CPU's C++ handler
# included), as JAX_LNBWD_BACKWARD=ffi makes it, unless a test sets the switches itself. The
# dispatch rule's defaults (jnp off CUDA, XLA below the crossovers) are tested in
# tests/api/test_dispatch.py, which restores the measured crossovers (MEASURED_CROSSOVERS).
os.environ.setdefault("JAX_LNBWD_BACKWARD", "ffi")

import jax  # noqa: E402

# float64 inputs must stay float64: the f64 path and the f64 references depend on it. This must
# run before any array is made, hence at import of conftest, before any test module.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_lnbwd  # noqa: E402
from jax_lnbwd import dispatch as _dispatch  # noqa: E402

# On a GPU the tests run our kernels at every shape: the rule's crossovers (below which XLA's
# fusion runs by default) are set to 1 for the suite, and kept here for the tests of the rule.
MEASURED_CROSSOVERS = dict(_dispatch.CROSSOVERS)
_dispatch.CROSSOVERS = {k: ((1, 1),) for k in MEASURED_CROSSOVERS}

DTYPES = ("float32", "bfloat16", "float16", "float64")

# Relative tolerances for rel_err (a norm-wise relative error, see below) of a result in each
# dtype against a float64 reference computed from the same (upcast) inputs. The op computes in
# fp32 (fp64 for float64) from exactly those inputs, so what limits each is:
#   float64:  f64 on both sides; only summation order differs. Measured <= 7e-16.
#   float32:  fp32 accumulation and fp32 mean/rstd against f64. Measured <= 3.4e-7 over the
#             shapes below (C up to 4100, up to 333 rows); 1e-5 leaves ~30x for longer sums
#             and other summation orders (the GPU kernels' block partial sums).
#   bfloat16: rounding the outputs to bf16, whose unit roundoff is 2^-8 = 3.9e-3: that bounds
#             the norm-wise error, typically ~1.7e-3. Measured <= 2.9e-3 (tiny shapes spread
#             more); 1e-2 is 2.5x the bound.
#   float16:  rounding the outputs to f16, unit roundoff 2^-11 = 4.9e-4 (the bound), typically
#             ~2.1e-4. Measured <= 2.5e-4; 2e-3 is 4x the bound.
# A wrong formula (a missing term, a wrong row, a dropped block of partial sums) is off by O(1).
RTOL = {
    "float64": 1e-12,
    "float32": 1e-5,
    "bfloat16": 1e-2,
    "float16": 2e-3,
}

# --- Every other tolerance of the tests: derived from RTOL, or a named special case ---------------

# mean and rstd are stored in fp32 for every x but float64 (fp64 there) and are computed from
# exact inputs: their tolerance is their own dtype's, not x's.
STAT_RTOL = {d: RTOL["float64" if d == "float64" else "float32"] for d in DTYPES}

# Second derivatives (hessian, grad of grad, jvp of grad) compose two first-order results, each
# within RTOL: the tangent map's or the forward's, then the backward's. Float64 measured <= 4e-16
# on the CPU; a wrong term is still off by O(1).
RTOL2 = {d: 2 * RTOL[d] for d in DTYPES}

# A kernel with precise=False may accumulate dweight/dbias in lower precision than fp32: llm.c
# kernels 3 and 4 add every block's sums into the bf16/f16 outputs with atomics, rounding at each
# addition, in an order the scheduler picks. Simulated for 4225 x 768: about 2e-2 in bf16 and
# 2.4e-3 in f16 with the 264 blocks of an H200's default grid. This is their tolerance at their
# default block size (no such kernel takes float64; that entry keeps the table total).
IMPRECISE_RTOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}

# The same kernels at every block size on 32 * SMs + 1 rows: block_size 32 makes 4224 blocks,
# each rounding its sums into dweight/dbias once more. Simulated for 4225 x 768: 8e-2 in bf16
# (1e-2 in f16, which that test does not run). float32 atomics round in fp32: IMPRECISE_RTOL's.
IMPRECISE_MANY_BLOCKS_RTOL = {"float32": IMPRECISE_RTOL["float32"], "bfloat16": 2e-1}


def kernel_rtol(info, dtype: str) -> float:
    """The tolerance of a kernel's outputs at its default block size: RTOL, or IMPRECISE_RTOL
    for a kernel whose KERNELS entry says precise=False."""
    return RTOL[dtype] if info.precise else IMPRECISE_RTOL[dtype]


# One float32 mean or rstd of a row, element by element, against float64 math on the same
# inputs: its own rounding and a few ulps of the row's fp32 sum, within 4 ulps (2^-21 relative).
# Measured: rstd of a constant row 5.4e-8; XLA's CPU mean of 1e4 + noise 2.05e-7 (jaxlib 0.10.0).
F32_STAT_ELEMENT_RTOL = 2.0**-21

# rstd of rows far from zero (|mean| >> std), norm-wise: the fp32 mean is off by d (the rounding
# of a row sum near C * mean), the centered values carry that offset, and d^2 adds to the
# variance: rstd is off by about (d / std)^2 / 2, far above float32 rounding. Rows of
# 1e4 + N(0, 1), C = 2048, through the op's forward: measured 4.2e-5.
OFFSET_RSTD_RTOL = 1e-4
# The same through XLA's jnp forward (layernorm_fwd), element by element, on rows of
# 1e4 + N(0, 0.1^2) (d / std is 10x larger): XLA's fp32 sum order differs between jaxlib
# versions, and jaxlib 0.10.0's rstd is 2.0e-4 off (0.10.2's < 1e-4).
XLA_OFFSET_RSTD_RTOL = 5e-4


@functools.cache
def platforms() -> tuple[str, ...]:
    """("cpu",), plus "gpu" when JAX has a GPU backend here."""
    try:
        has_gpu = len(jax.devices("gpu")) > 0
    except RuntimeError:  # "Unknown backend: 'gpu' requested ..."
        has_gpu = False
    return ("cpu", "gpu") if has_gpu else ("cpu",)


HAS_GPU = "gpu" in platforms()

# The skip for GPU-only tests. Tests get it through the registered `gpu` marker (see
# pytest_collection_modifyitems below); `requires_gpu` is the same skip for direct use.
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU (jax.devices('gpu') found none)")

# Parametrize a test over this to run it on every platform: the GPU case is always collected,
# so a CPU-only run shows it as skipped rather than silently dropping it.
PLATFORMS = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def pytest_collection_modifyitems(config, items):
    # The long cases first (a stable sort: the rest keep their order): pytest-xdist hands out
    # the first quarter of the tests one at a time to each worker in turn, so the long ones
    # spread over the workers instead of one of them finishing alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.devices('gpu') found none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The checkout (or .ci/run's copy of tests/, examples/ and benchmarks/): benchmarks/ and examples/
# are run from there. Its jax_lnbwd/ source folder is never what a test imports: see bench_cwd.
CHECKOUT = pathlib.Path(__file__).resolve().parent.parent


def bench_cwd(tmp_path) -> pathlib.Path:
    """A working directory for `python -m benchmarks...` in a subprocess: a folder under tmp_path
    holding only a link to the checkout's benchmarks/. `python -m` puts the working directory
    first on the child's sys.path; the checkout's would put its jax_lnbwd/ source folder ahead of
    the installed package, which a non-editable install leaves without its compiled extension."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    link = cwd / "benchmarks"
    if not link.exists():
        link.symlink_to(CHECKOUT / "benchmarks", target_is_directory=True)
    return cwd


# The working directory for a `python -c` child (sys.path[0] is then the working directory):
# tests/, which holds no package that could shadow an installed one.
CHILD_CWD = str(pathlib.Path(__file__).resolve().parent)


def shape_id(shape) -> str:
    """A test id for a shape: (2, 3, 40) -> "2x3x40"."""
    return "x".join(map(str, shape))


def device(platform: str):
    """The first device of `platform` ("cpu" or "gpu")."""
    return jax.devices(platform)[0]


def put(platform: str, *arrays):
    """The arrays, committed to `platform`'s first device (a jit then runs there)."""
    dev = device(platform)
    out = tuple(jax.device_put(a, dev) for a in arrays)
    return out if len(out) > 1 else out[0]


def np_dtype(dtype):
    """A numpy dtype for a name: ml_dtypes' bfloat16 for "bfloat16"."""
    return np.dtype(jnp.dtype(dtype))


def make_inputs(shape, dtype, seed: int = 0):
    """(x, dy, weight, bias) as host numpy arrays in `dtype`, all random and never zero.

    x and dy are standard normal of `shape`; weight = 1 + 0.1 * normal and bias is normal,
    of shape (C,). The values are drawn in float64 and rounded to `dtype` once, so upcasting
    them again gives exactly what the op saw.
    """
    rng = np.random.default_rng(seed)
    C = shape[-1]
    x = rng.standard_normal(shape)
    dy = rng.standard_normal(shape)
    weight = 1.0 + 0.1 * rng.standard_normal(C)
    bias = rng.standard_normal(C)
    t = np_dtype(dtype)
    return x.astype(t), dy.astype(t), weight.astype(t), bias.astype(t)


def f64(a) -> np.ndarray:
    """`a` as a float64 numpy array (exact for every float dtype we use)."""
    return np.asarray(a).astype(np.float64)


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ (Frobenius norms) in float64; inf if anything is NaN.

    When b is all zeros (or empty) the relative error is undefined: then this is the absolute
    ‖a − b‖, which is 0.0 exactly when a is zero too.
    """
    a, b = f64(a), f64(b)
    assert a.shape == b.shape, f"shape {a.shape} vs reference {b.shape}"
    diff = float(np.linalg.norm((a - b).ravel()))
    ref = float(np.linalg.norm(b.ravel()))
    err = diff / ref if ref > 0 else diff
    return float("inf") if np.isnan(err) else err


def assert_close(name: str, got, want, dtype: str, rtol: float | None = None):
    """Assert rel_err(got, want) <= rtol (RTOL[dtype] by default), naming the output if not."""
    tol = RTOL[dtype] if rtol is None else rtol
    err = rel_err(got, want)
    assert err <= tol, f"{name}: rel_err {err:.3e} > {tol:.1e} ({dtype}, shape {np.shape(want)})"


def reference_stats(x, eps: float = 1e-5):
    """(mean, rstd) of x over the last axis as the op expects them: float32 (float64 for
    float64 x), computed on the CPU by the package's jnp reference."""
    cpu = device("cpu")
    xc = jax.device_put(x, cpu)
    _, mean, rstd = jax_lnbwd.reference.layernorm_fwd(xc, None, None, eps)
    return np.asarray(mean), np.asarray(rstd)


def reference_bwd(dy, x, weight, mean, rstd):
    """(dx, dweight, dbias) by reference.layernorm_bwd in float64, on the CPU, from the
    inputs upcast to float64 (mean and rstd too)."""
    cpu = device("cpu")
    args = [jax.device_put(f64(a), cpu) for a in (dy, x, weight, mean, rstd)]
    return tuple(np.asarray(o) for o in jax_lnbwd.reference.layernorm_bwd(*args))


def direct_ffi_call(platform, dy, x, weight, mean, rstd, *, segments: int = 1, kernel: int | None = None,
                    block_size: int = 0, dx_shape=None):
    """Run the FFI target jax_lnbwd.TARGET on host arrays, with no Python check in between.

    The target's signature (see README, "The FFI target"): dy, x (rows, C); weight (1, C) or
    (segments, C); mean, rstd (rows,); results dx (rows, C), dweight and dbias (segments, C),
    and a uint8 workspace; int32 attributes kernel and block_size (0 = the kernel's choice).
    `dx_shape` overrides dx's shape (to test the handler's checks of its results). The
    workspace has a partial slot for every row (and segment): no launcher gives a block fewer rows.
    Returns (dx, dweight, dbias) as numpy arrays.
    """
    x_shape, dtype = np.shape(x), np.asarray(x).dtype
    rows, C = x_shape[0], x_shape[-1]
    acc = 8 if dtype == np.float64 else 4
    out_types = (
        jax.ShapeDtypeStruct(dx_shape or x_shape, dtype),
        jax.ShapeDtypeStruct((segments, C), dtype),
        jax.ShapeDtypeStruct((segments, C), dtype),
        jax.ShapeDtypeStruct((256 + max(rows, segments, 1) * 2 * C * acc,), np.uint8),
    )
    call = jax.ffi.ffi_call(jax_lnbwd.TARGET, out_types)  # never vmapped: no vmap_method
    k = jax_lnbwd.DEFAULT_KERNEL if kernel is None else kernel
    f = jax.jit(lambda *a: call(*a, kernel=np.int32(k), block_size=np.int32(block_size)))
    dx, dweight, dbias, _ = jax.block_until_ready(f(*put(platform, dy, x, weight, mean, rstd)))
    return np.asarray(dx), np.asarray(dweight), np.asarray(dbias)
