"""Lowers a fixed set of jax_lnbwd programs and writes their StableHLO, for a before/after diff.

    python tools/hlo_snapshot.py OUT_DIR             # one file per program and platform
    diff -r BEFORE_DIR AFTER_DIR                      # a refactor must leave this empty

The programs cover what the package promises: grad (with mixed precision, also a float32
weight beside a 16-bit bias), vmap with
per-example weights, jvp, hessian, a sharded jit (Shardy), shard_map, add_layernorm with
x_bias, the raw layernorm_fwd/layernorm_bwd, the same for rmsnorm and add_rmsnorm (offset, x_bias,
no weight), and the Flax drop-ins (linen and nnx). Run it under each dispatch you want pinned,
e.g. again with JAX_LNBWD_FORWARD=ffi JAX_LNBWD_BACKWARD=ffi (every call on our targets). Each is
lowered for the CPU and for CUDA (cross-platform lowering: no GPU needed). The text is
printed without locations, and the keys of custom_partitioning callbacks (process-local
numbers) are masked.

A build without the CUDA handler lowers CUDA programs with the jnp forward where a CUDA build
uses the fused FFI forward; pass --as-cuda-build to lower as a CUDA build would (it sets
WITH_CUDA on the FFI module: lowering only, nothing runs).
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _pretend_cuda():
    for name in ("jax_lnbwd.ops.ffi", "jax_lnbwd._ffi"):   # this layout, and the one before it
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        mod.WITH_CUDA = True
        return
    raise SystemExit("hlo_snapshot: no FFI module found to mark as a CUDA build")


def programs():
    """name -> (function, args). Inputs are fixed; only their shapes and dtypes matter."""
    import flax.linen as nn
    from flax import nnx

    import jax_lnbwd
    import jax_lnbwd.flax as lnflax
    from jax_lnbwd.flax import nnx as lnnnx

    rng = np.random.default_rng(0)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    x, w, b = f32(8, 16, 64), f32(64), f32(64)
    xb = x.astype(jnp.bfloat16)
    ln, add_ln = jax_lnbwd.layernorm, jax_lnbwd.add_layernorm

    def loss(x, w, b):
        return jnp.sum(ln(x, w, b) ** 2)

    def add_loss(x, r, w, b, xbias):
        y, s = add_ln(x, r, w, b, x_bias=xbias)
        return jnp.sum(y ** 2) + jnp.sum(s * 0.5)

    out = {
        "grad_f32": (jax.grad(loss, argnums=(0, 1, 2)), (x, w, b)),
        "grad_bf16_mixed": (jax.grad(lambda x, w, b: jnp.sum(ln(x, w, b).astype(jnp.float32) ** 2),
                                     argnums=(0, 1, 2)), (xb, w, b)),
        "grad_bf16_w32_b16": (jax.grad(lambda x, w, b: jnp.sum(ln(x, w, b).astype(jnp.float32) ** 2),
                                       argnums=(0, 1, 2)), (xb, w, b.astype(jnp.bfloat16))),
        "fwd_bf16_w32_b16": (lambda x, w, b: jax_lnbwd.layernorm_fwd(x, w, b), (xb, w, b.astype(jnp.bfloat16))),
        "grad_no_params": (jax.grad(lambda x: jnp.sum(ln(x, None, None) ** 2)), (x,)),
        "grad_kernel11": (jax.grad(lambda x, w, b: jnp.sum(ln(x, w, b, kernel=11) ** 2), argnums=(0, 1)), (x, w, b)),
        "vmap_grad_per_example": (jax.vmap(jax.grad(loss, argnums=(0, 1, 2))),
                                  (x, f32(8, 64), f32(8, 64))),
        "grad_vmap_shared": (jax.grad(lambda x, w, b: jnp.sum(jax.vmap(ln, (0, None, None))(x, w, b) ** 2),
                                      argnums=(0, 1, 2)), (x, w, b)),
        "jvp": (lambda x, w, b: jax.jvp(lambda *a: ln(*a), (x, w, b), (x, w, b)), (x, w, b)),
        "hessian": (jax.hessian(lambda x, w, b: jnp.sum(ln(x, w, b) ** 3)), (f32(2, 8), f32(8), f32(8))),
        "layernorm_fwd": (lambda x, w, b: jax_lnbwd.layernorm_fwd(x, w, b), (x, w, b)),
        "layernorm_bwd": (lambda dy, x, w: jax_lnbwd.layernorm_bwd(dy, x, w, *jax_lnbwd.layernorm_fwd(x, w, None)[1:]),
                          (x, x, w)),
        "add_layernorm_grad": (jax.grad(lambda x, r, w, b: add_loss(x, r, w, b, None), argnums=(0, 1, 2, 3)),
                               (x, x, w, b)),
        "add_layernorm_x_bias_grad": (jax.grad(add_loss, argnums=(0, 1, 2, 3, 4)), (x, x, w, b, b)),
        "add_layernorm_x_bias_bf16": (jax.grad(lambda x, r, w, b, xbias: add_loss(x, r, w, b, xbias).astype(jnp.float32),
                                               argnums=(0, 1, 2, 3, 4)), (xb, xb, w, b, b)),
    }

    rms, add_rms = jax_lnbwd.rmsnorm, jax_lnbwd.add_rmsnorm

    def add_rms_loss(x, r, w, xbias):
        y, s = add_rms(x, r, w, x_bias=xbias, offset=1.0)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s.astype(jnp.float32) * 0.5)

    out.update({
        "rmsnorm_grad_f32": (jax.grad(lambda x, w: jnp.sum(rms(x, w) ** 2), argnums=(0, 1)), (x, w)),
        "rmsnorm_grad_bf16_mixed_offset": (jax.grad(lambda x, w: jnp.sum(rms(x, w, offset=1.0).astype(jnp.float32) ** 2),
                                                    argnums=(0, 1)), (xb, w)),
        "rmsnorm_grad_no_weight": (jax.grad(lambda x: jnp.sum(rms(x, None) ** 2)), (x,)),
        "rmsnorm_vmap_grad_per_example": (jax.vmap(jax.grad(lambda x, w: jnp.sum(rms(x, w) ** 2), argnums=(0, 1))),
                                          (x, f32(8, 64))),
        "rmsnorm_jvp": (lambda x, w: jax.jvp(lambda *a: rms(*a), (x, w), (x, w)), (x, w)),
        "rmsnorm_fwd": (lambda x, w: jax_lnbwd.rmsnorm_fwd(x, w, offset=1.0), (xb, w)),
        "rmsnorm_bwd": (lambda dy, x, w: jax_lnbwd.rmsnorm_bwd(dy, x, w, jax_lnbwd.rmsnorm_fwd(x, w)[1]), (x, x, w)),
        "add_rmsnorm_grad": (jax.grad(lambda x, r, w: add_rms_loss(x, r, w, None), argnums=(0, 1, 2)), (x, x, w)),
        "add_rmsnorm_x_bias_bf16": (jax.grad(add_rms_loss, argnums=(0, 1, 2, 3)), (xb, xb, w, w)),
    })

    mesh = jax.make_mesh((4, 2), ("data", "seq"), devices=jax.devices("cpu")[:8])
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "seq", None))
    xs = jax.device_put(x, sharded)
    out["sharded_jit_grad"] = (jax.grad(loss, argnums=(0, 1, 2)), (xs, w, b))
    out["sharded_jit_add_grad"] = (jax.grad(lambda x, r, w, b: add_loss(x, r, w, b, b), argnums=(0, 1, 2, 3)),
                                   (xs, xs, w, b))
    out["sharded_jit_rmsnorm_grad"] = (jax.grad(lambda x, r, w: add_rms_loss(x, r, w, None), argnums=(0, 1, 2)),
                                       (xs, xs, w))
    out["shard_map_grad"] = (jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                                           in_specs=(jax.sharding.PartitionSpec("data", "seq"),
                                                     jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec()),
                                           out_specs=(jax.sharding.PartitionSpec("data", "seq"),
                                                      jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec())),
                             (xs, w, b))

    class LinenBlock(nn.Module):
        @nn.compact
        def __call__(self, x, r):
            y, s = lnflax.AddLayerNorm(use_x_bias=True)(x, r)
            return lnflax.LayerNorm()(y) + s

    lin = LinenBlock()
    lin_params = lin.init(jax.random.key(0), x, x)
    out["flax_linen_grad"] = (jax.grad(lambda p, x: jnp.sum(lin.apply(p, x, x) ** 2)), (lin_params, x))

    nnx_ln, nnx_add = lnnnx.LayerNorm(64, rngs=nnx.Rngs(0)), lnnnx.AddLayerNorm(64, rngs=nnx.Rngs(0))
    gdef, state = nnx.split((nnx_ln, nnx_add))

    def nnx_loss(state, x):
        norm, add = nnx.merge(gdef, state)
        y, s = add(x, x)
        return jnp.sum(norm(y) ** 2) + jnp.sum(s)

    out["flax_nnx_grad"] = (jax.grad(nnx_loss), (state, xb))

    class LinenRmsBlock(nn.Module):
        @nn.compact
        def __call__(self, x, r):
            y, s = lnflax.AddRMSNorm()(x, r)
            return lnflax.RMSNorm()(y) + s

    lin_rms = LinenRmsBlock()
    lin_rms_params = lin_rms.init(jax.random.key(0), x, x)
    out["flax_linen_rms_grad"] = (jax.grad(lambda p, x: jnp.sum(lin_rms.apply(p, x, x) ** 2)), (lin_rms_params, x))
    nnx_rms = lnnnx.RMSNorm(64, rngs=nnx.Rngs(0))
    rgdef, rstate = nnx.split(nnx_rms)
    out["flax_nnx_rms_grad"] = (jax.grad(lambda st, x: jnp.sum(nnx.merge(rgdef, st)(x) ** 2)), (rstate, xb))
    return out


_CALLBACK_KEY = re.compile(r'(CustomSPMDPartitioning[^\n]*?backend_config = )"[^"]*"')


def lower_text(fn, args, platform: str) -> str:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return _CALLBACK_KEY.sub(r'\1"<key>"', text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--as-cuda-build", action="store_true", help="lower CUDA as a build with the CUDA handler")
    args = ap.parse_args(argv)
    if args.as_cuda_build:
        _pretend_cuda()
    os.makedirs(args.out_dir, exist_ok=True)
    for name, (fn, fargs) in programs().items():
        for platform in ("cpu", "cuda"):
            with open(os.path.join(args.out_dir, f"{name}.{platform}.mlir"), "w") as f:
                f.write(lower_text(fn, fargs, platform))
    print(f"hlo_snapshot: {len(programs()) * 2} programs written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
