"""The Pallas peers of the kernel bench: JAX's own Triton-lowered norms, from
``jax.experimental.pallas.ops.gpu`` (``rms_norm`` and ``layer_norm``), timed like every JAX
entry (timing.time_jax). GPU only: the module is imported lazily, on first use.

Those ops take x of shape (batch, seq, C) (two vmaps around a one-row pallas_call), a bias
beside the weight (rms_norm too: y = x * rstd * w + b; here zeros), and keep their statistics
in x's dtype with shape (batch, seq). So each step views x as (1, rows, C), and the backward
steps cast the case's float32 statistics to what Pallas's own forward would have saved (one
small cast of rows elements a step). The backward steps call the custom_vjp's backward rule
directly, given those statistics, as the other backward entries are timed: without the
forward. It computes dbias too (a column sum of dy; rms_norm's as well), which Pallas's API
does not let a caller drop.
"""
from __future__ import annotations

import importlib

import jax.numpy as jnp

from .timing import EPS

NAME = "pallas"
# The ops a Pallas entry exists for: op name -> (module under jax.experimental.pallas.ops.gpu,
# whether the op is a backward).
OPS = {"rmsnorm_fwd": ("rms_norm", False), "rmsnorm_bwd": ("rms_norm", True),
       "layernorm_fwd": ("layer_norm", False), "layernorm_bwd": ("layer_norm", True)}


def module(name: str):
    return importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")


def why_not(on_gpu: bool) -> str | None:
    """None if the Pallas peer can run here, else why not."""
    if not on_gpu:
        return "JAX runs on the CPU here"
    try:
        module("rms_norm"), module("layer_norm")
    except Exception as e:
        return f"jax.experimental.pallas.ops.gpu does not import ({type(e).__name__}: {str(e)[:100]})"
    return None


def step(op: str, interpret: bool = False):
    """The step of op's Pallas entry, with the step signature of ops.py's entries for op.
    interpret: Pallas's interpreter (any backend, slow), for tests off a GPU."""
    name, backward = OPS[op]
    mod = module(name)
    norm = getattr(mod, name)                   # the custom_vjp function: y only
    rule = getattr(mod, f"{name}_backward")     # its backward rule: (dx, dweight, dbias)

    def as3d(a):
        return a.reshape(1, *a.shape)

    if not backward:
        def forward(x, w, *bias):   # layernorm_fwd passes its bias; rmsnorm_fwd none
            b = bias[0] if bias else jnp.zeros_like(w)
            return (norm(as3d(x), w, b, eps=EPS, interpret=interpret).reshape(x.shape),)
        return forward

    def stats(*s, like):  # the case's float32 stats, as Pallas's forward saves them
        return tuple(a.astype(like.dtype).reshape(1, -1) for a in s)

    def finish(dx, dw, db, x):
        return dx.reshape(x.shape), dw, db

    if name == "rms_norm":
        def rms_backward(dy, x, w, rstd):
            res = (as3d(x), w, jnp.zeros_like(w), *stats(rstd, like=x))
            return finish(*rule(None, 3, EPS, "triton", interpret, res, as3d(dy)), x)
        return rms_backward

    def ln_backward(dy, x, w, b, mean, rstd):
        res = (as3d(x), w, b, *stats(mean, rstd, like=x))
        return finish(*rule(None, 3, EPS, "triton", interpret, res, as3d(dy)), x)
    return ln_backward
