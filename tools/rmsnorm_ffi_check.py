"""Calls the three RMSNorm FFI targets directly (jax.ffi.ffi_call, no jax_lnbwd Python API) and
compares them with a float64 numpy reference of the math in ffi/kernels/norm_kind.h:

  rstd = 1 / sqrt(mean(x^2) + eps),  y = (x * rstd) * (offset + w)
  g = (offset + w) * dy,  xhat = x * rstd
  dx = (g - xhat * mean(g * xhat)) * rstd [+ dresidual],  dweight = sum_rows dy * xhat (per segment)

and the residual variant (s = (x [+ x_bias]) + residual, rounded once to x's dtype, then the
rmsnorm of s). A check of the C++ side while the Python API is written; the real tests are the
lead's.

  python tools/rmsnorm_ffi_check.py [cpu|cuda]     (default cpu; cuda needs a CUDA build and a GPU)
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_lnbwd._ffi  # noqa: F401  registers every target of this build

jax.config.update("jax_enable_x64", True)
PLATFORM = sys.argv[1] if len(sys.argv) > 1 else "cpu"
DEVICE = jax.devices(PLATFORM)[0]
TOL = {jnp.float64: 1e-12, jnp.float32: 2e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def stat_dtype(dt):
    return jnp.float64 if dt == jnp.float64 else jnp.float32


def rel(got, ref):
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


def put(a):
    return jax.device_put(a, DEVICE)


def fwd_ref(x, w, eps, offset):
    x = np.asarray(x, np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=1) + eps)
    y = x * rstd[:, None]
    if w.shape[0] > 0:
        y = y * (offset + np.repeat(np.asarray(w, np.float64), x.shape[0] // w.shape[0], axis=0))
    return y, rstd


def bwd_ref(dy, x, w, rstd, offset, dres, segments):
    dy, x = np.asarray(dy, np.float64), np.asarray(x, np.float64)
    rows, C = x.shape
    wr = offset + np.repeat(np.asarray(w, np.float64), rows // w.shape[0], axis=0)
    rstd = np.asarray(rstd, np.float64)[:, None]
    g, xhat = wr * dy, x * rstd
    dx = (g - xhat * np.mean(g * xhat, axis=1, keepdims=True)) * rstd
    if dres is not None:
        dx = dx + np.asarray(dres, np.float64)
    dw = (dy * xhat).reshape(segments, rows // segments, C).sum(axis=1)
    return dx, dw


def check(name, got, ref, tol, failures):
    e = rel(got, ref)
    ok = e <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {e:.2e} (tol {tol:.0e})")
    if not ok:
        failures.append(name)


def main():
    rng = np.random.default_rng(0)
    failures = []
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
        for pdt in ({dt, jnp.float32} if dt in (jnp.bfloat16, jnp.float16) else {dt}):
            for rows, C, W, offset in ((8, 64, 1, 0.0), (6, 48, 1, 1.0), (8, 40, 4, 1.0), (4, 8, 0, 1.0)):
                tag = f"{jnp.dtype(dt).name}/{jnp.dtype(pdt).name} {rows}x{C} W={W} offset={offset}"
                st = stat_dtype(dt)
                x = jnp.asarray(rng.normal(0.3, 1.5, (rows, C)), dt)
                w = jnp.asarray(0.1 * rng.normal(size=(W, C)) + (0.0 if offset else 1.0), pdt)
                eps = 1e-5
                y, rstd = jax.ffi.ffi_call("jax_lnbwd_rmsnorm_fwd_v1", (jax.ShapeDtypeStruct((rows, C), dt),
                                                                        jax.ShapeDtypeStruct((rows,), st)))(
                    put(x), put(w), eps=np.float64(eps), offset=np.float64(offset))
                ry, rr = fwd_ref(x, w, eps, offset)
                check("rmsnorm_fwd y " + tag, y, ry, TOL[dt], failures)
                check("rmsnorm_fwd rstd " + tag, rstd, rr, TOL[st] if st == jnp.float64 else 1e-6, failures)

                # The residual variant, with and without x's own bias.
                r = jnp.asarray(rng.normal(size=(rows, C)), dt)
                for xb_rows in (0, 1):
                    xb = jnp.asarray(rng.normal(size=(xb_rows, C)), pdt)
                    y2, s2, rstd2 = jax.ffi.ffi_call(
                        "jax_lnbwd_add_rmsnorm_fwd_v1",
                        (jax.ShapeDtypeStruct((rows, C), dt), jax.ShapeDtypeStruct((rows, C), dt),
                         jax.ShapeDtypeStruct((rows,), st)))(put(x), put(xb), put(r), put(w), eps=np.float64(eps),
                                                             offset=np.float64(offset))
                    sref = np.asarray(x, np.float64)
                    if xb_rows:
                        sref = sref + np.asarray(xb, np.float64)
                    sref = np.asarray(jnp.asarray(sref + np.asarray(r, np.float64), dt), np.float64)
                    check(f"add_rmsnorm_fwd s (x_bias rows {xb_rows}) " + tag, s2, sref, 0 if dt == jnp.float64 else 1e-7, failures)
                    ry2, _ = fwd_ref(s2, w, eps, offset)
                    check(f"add_rmsnorm_fwd y (x_bias rows {xb_rows}) " + tag, y2, ry2, TOL[dt], failures)

                if W == 0:
                    continue   # the backward always has a weight
                dy = jnp.asarray(rng.normal(size=(rows, C)), dt)
                dres = jnp.asarray(rng.normal(size=(rows, C)), dt)
                for segments in sorted({1, W}):
                    for has_res in (False, True):
                        for kernel in (11, 12):
                            out = (jax.ShapeDtypeStruct((rows, C), dt), jax.ShapeDtypeStruct((segments, C), pdt),
                                   jax.ShapeDtypeStruct((1 << 20,), jnp.uint8))
                            res_arg = dres if has_res else jnp.zeros((0,), dt)
                            dx, dw, _ = jax.ffi.ffi_call("jax_lnbwd_rmsnorm_bwd_v1", out)(
                                put(dy), put(x), put(w if W == segments else w[:1]), put(rstd), put(res_arg),
                                kernel=np.int32(kernel), block_size=np.int32(0), has_residual=has_res,
                                offset=np.float64(offset))
                            rdx, rdw = bwd_ref(dy, x, w if W == segments else w[:1], rstd, offset,
                                               dres if has_res else None, segments)
                            t = f"{tag} k{kernel} S={segments} res={has_res}"
                            check("rmsnorm_bwd dx " + t, dx, rdx, TOL[dt] * 2, failures)
                            check("rmsnorm_bwd dweight " + t, dw, rdw, TOL[pdt] * 2, failures)

    # The reference's backward against jax's autodiff of the forward formula (float64).
    x64 = rng.normal(0.3, 1.5, (6, 16))
    w64, dy64, off = 0.1 * rng.normal(size=(1, 16)), rng.normal(size=(6, 16)), 1.0

    def rms(x, w):
        return x / jnp.sqrt(jnp.mean(x * x, axis=1, keepdims=True) + 1e-5) * (off + w)

    _, vjp = jax.vjp(rms, jnp.asarray(x64), jnp.asarray(w64))
    gx, gw = vjp(jnp.asarray(dy64))
    _, r64 = fwd_ref(x64, w64, 1e-5, off)
    rdx, rdw = bwd_ref(dy64, x64, w64, r64, off, None, 1)
    check("reference dx against jax.vjp", rdx, np.asarray(gx), 1e-12, failures)
    check("reference dweight against jax.vjp", rdw, np.asarray(gw), 1e-12, failures)

    # Refusals: llm.c's kernels, and an error naming the function.
    x = jnp.ones((4, 8), jnp.float32)
    for kernel, want in ((3, "kernel 3 (llm.c's) does not support rmsnorm"), (11, "rmsnorm_bwd: 'rstd' has shape")):
        rstd = jnp.ones((4 if kernel == 3 else 3,), jnp.float32)
        try:
            jax.ffi.ffi_call("jax_lnbwd_rmsnorm_bwd_v1", (jax.ShapeDtypeStruct((4, 8), jnp.float32),
                                                           jax.ShapeDtypeStruct((1, 8), jnp.float32),
                                                           jax.ShapeDtypeStruct((1 << 16,), jnp.uint8)))(
                put(x), put(x), put(x[:1]), put(rstd), put(jnp.zeros((0,), jnp.float32)), kernel=np.int32(kernel),
                block_size=np.int32(0), has_residual=False, offset=np.float64(0.0))[0].block_until_ready()
            print(f"FAIL refusal kernel {kernel}: no error")
            failures.append(f"refusal {kernel}")
        except Exception as e:   # XlaRuntimeError / ValueError
            ok = want in str(e)
            print(f"{'ok  ' if ok else 'FAIL'} refusal kernel {kernel}: {str(e).splitlines()[0][:160]}")
            if not ok:
                failures.append(f"refusal {kernel}")
    print(f"{PLATFORM}: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
