"""The ops the kernel bench times, one row of OPS each: ``--op NAME`` (comma list, or ``all``).

An op's name is ``<norm>_<pass>``, the pass ``fwd`` or ``bwd``, as the public functions and the
FFI targets are named; the layernorm ops also answer to a short alias:

  layernorm_bwd      (backward)     the backward kernels of jax_lnbwd.KERNELS, given mean/rstd
  layernorm_fwd      (forward)      the fused forward: y, mean, rstd; x read once
  add_layernorm_fwd  (add_forward)  s = x + residual, then the forward of s; s is an output too
  rmsnorm_bwd                       the backward kernels that run rmsnorm (kernels 11, 12), given rstd
  rmsnorm_fwd                       the fused forward: y, rstd
  add_rmsnorm_fwd                   s = x + residual, then rmsnorm's forward of s

A new op is one more Op here: how to make its inputs and reference (prepare), which steps to
time (impls), its outputs and its bytes.

Each op's Case holds what every impl of one (shape, dtype) shares: the chained input (the
"state": dy for a backward, x for a forward), the constant inputs, the reference outputs in
float64, and the bytes the op must move, which every impl of the case is credited with (so
GB/s ratios are speed ratios). Steps map (state, *consts) -> outputs; outputs[0] becomes the
next step's state (module doc of timing.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_lnbwd import KERNELS, RMSNORM, LAYERNORM, autodiff, layernorm_bwd, layernorm_fwd, reference, rmsnorm_bwd
from jax_lnbwd import rmsnorm_fwd as rmsnorm_fwd_public

from jax_lnbwd.norms import Norm
from jax_lnbwd.ops.forward import add_layernorm_fwd_op, add_rmsnorm_fwd_op, layernorm_fwd_op, rmsnorm_fwd_op

from . import pallas
from .timing import EPS

# Every op's defaults end with small-C rows: head_dim-sized norms (QK-norm: rows = tokens x
# heads) and small models, C 64, 128 and 256 at 64 MB a tensor in bf16.
SMALL_C_GPU_SHAPES = "524288x64,262144x128,131072x256"
FORWARD_GPU_SHAPES = "16384x1600,8192x8192,16384x1024,4096x16384,8192x768," + SMALL_C_GPU_SHAPES
BACKWARD_GPU_SHAPES = ("8192x1600,16384x768,16384x1600,16384x2048,16384x4096,8192x8192,4096x16384,1024x768,"
                       + SMALL_C_GPU_SHAPES)
# Llama-sized rows (d 2048 to 16384); every step moves 134-805 MB, past the H200's L2.
RMS_GPU_SHAPES = "16384x2048,16384x4096,8192x8192,4096x16384," + SMALL_C_GPU_SHAPES


@dataclasses.dataclass
class Case:
    """One (op, shape, dtype): inputs, float64 reference outputs, bytes; see the module doc."""
    nbytes: int
    state: jax.Array
    consts: tuple
    ref: list            # float64 numpy arrays, in the order of Op.outputs
    params: str          # the dtype of weight and bias
    # The torch and Liger peers' inputs (peers.torch_step): layernorm_bwd (x, w, b, dy),
    # layernorm_fwd (x, w, b), rmsnorm_bwd (x, w, dy), rmsnorm_fwd (x, w).
    torch_inputs: tuple = ()


@dataclasses.dataclass(frozen=True)
class Impl:
    """One timed entry: its table name, its step, whether it is a peer (not ours), and the
    tolerance factor for each output (exact=0: bit-equal to the reference)."""
    name: str
    step: Callable | None  # None: a peer timed elsewhere (copy, torch, liger)
    peer: bool
    tol: dict = dataclasses.field(default_factory=dict)  # output name -> factor (default 1)


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    alias: str
    title: str
    outputs: tuple[str, ...]
    gpu_shapes: str
    peers: tuple[str, ...]   # the --peers that apply, besides copy
    prepare: Callable        # (rows, C, dtype, params, key) -> Case
    impls: Callable          # (case, args, combos) -> [Impl], ours and the jnp peers
    norm: Norm               # the op's norm (norms.py): what the backward kernels must run (their refusals)
    kernels: bool = False    # takes --kernels / --block-sizes
    carry: int = 1           # outputs chained into the next step (timing.time_jax): add ops 2


def _stat_bytes(rows: int, dtype: str, stats: int = 2) -> int:
    return stats * rows * reference.acc_dtype(dtype).itemsize  # mean and rstd, or rstd


def _params_dtype(dtype: str, params: str):
    return jnp.dtype(jnp.float32 if params == "float32" and jnp.dtype(dtype).itemsize == 2 else dtype)


def _f64(arrays) -> list:
    return [np.asarray(a, np.float64) for a in arrays]


# ---------------------------------------------------------------------------------------------
# layernorm_bwd: dy, x, weight, mean, rstd -> dx, dweight, dbias


def backward_bytes(rows: int, C: int, dtype: str) -> int:
    """Read dy and x, write dx; read weight, write dweight and dbias; read mean and rstd."""
    return (3 * rows * C + 3 * C) * jnp.dtype(dtype).itemsize + _stat_bytes(rows, dtype)


def _prepare_backward(rows, C, dtype, params, key) -> Case:
    kx, kdy, kw, kb = jax.random.split(key, 4)
    x = jax.random.normal(kx, (rows, C), dtype)
    dy = jax.random.normal(kdy, (rows, C), dtype)
    w = (1 + 0.1 * jax.random.normal(kw, (C,), jnp.float32)).astype(dtype)
    b = jax.random.normal(kb, (C,), dtype)
    _, mean, rstd = jax.jit(lambda x, w, b: layernorm_fwd(x, w, b, eps=EPS))(x, w, b)
    acc = reference.acc_dtype(x.dtype)
    ref = jax.jit(reference.layernorm_bwd)(dy.astype(acc), x.astype(acc), w.astype(acc), mean, rstd)
    return Case(backward_bytes(rows, C, dtype), dy, (x, w, b, mean, rstd), _f64(ref), dtype,
                torch_inputs=(x, w, b, dy))


def backward_ours(kernel: int, block_size: int):
    def step(dy, x, w, b, mean, rstd):
        return layernorm_bwd(dy, x, w, mean, rstd, kernel=kernel, block_size=block_size)
    return step


def backward_xla(dy, x, w, b, mean, rstd):
    return reference.layernorm_bwd(dy, x, w, mean, rstd)


def backward_autodiff(dy, x, w, b, mean, rstd):
    _, vjp = jax.vjp(lambda x, w, b: reference.layernorm(x, w, b, EPS), x, w, b)
    return vjp(dy)  # the statistics are recomputed from x inside every step


def _default(step, args) -> list:
    """The package's default entry (--peers default): the public function with no kernel named,
    which runs what the dispatch rule picks for this shape (jax_lnbwd/dispatch.py): our kernel or
    XLA's fusion. Its row against xla's shows that the default is never the slower."""
    return [Impl("default", step, False)] if "default" in args.peers else []


def _pallas(op: str, args) -> list:
    """The Pallas entry of op, where --peers asks for it and it runs here (pallas.py)."""
    return [Impl(pallas.NAME, pallas.step(op), True)] if pallas.NAME in args.peers else []


def _backward_impls(case, args, combos):
    loose = {"dweight": 10, "dbias": 10}  # kernels with precise=False
    out = [Impl(f"k{kid}/bs{bs}", backward_ours(kid, bs), False, {} if KERNELS[kid].precise else loose)
           for kid, bs in combos]
    return out + _default(backward_default, args) + [
        Impl(p, {"xla": backward_xla, "autodiff": backward_autodiff}[p], True)
        for p in ("xla", "autodiff") if p in args.peers] + _pallas("layernorm_bwd", args)


def backward_default(dy, x, w, b, mean, rstd):
    return layernorm_bwd(dy, x, w, mean, rstd)


# ---------------------------------------------------------------------------------------------
# layernorm_fwd: x, weight, bias -> y, mean, rstd


def forward_bytes(rows: int, C: int, dtype: str, params: str) -> int:
    """Read x, write y; read weight and bias; write mean and rstd."""
    return (2 * rows * C * jnp.dtype(dtype).itemsize + 2 * C * _params_dtype(dtype, params).itemsize
            + _stat_bytes(rows, dtype))


def _inputs(key, rows, C, dtype, params, tensors: int):
    """`tensors` random (rows, C) arrays in dtype, then weight and bias in the params dtype."""
    keys = jax.random.split(key, tensors + 2)
    pdtype = _params_dtype(dtype, params)
    xs = [jax.random.normal(k, (rows, C), dtype) for k in keys[:tensors]]
    w = (1 + 0.1 * jax.random.normal(keys[-2], (C,), jnp.float32)).astype(pdtype)
    return (*xs, w, jax.random.normal(keys[-1], (C,), pdtype))


def _forward_ref(x, w, b):
    acc = reference.acc_dtype(x.dtype)
    return jax.jit(reference.layernorm_fwd)(x.astype(acc), w.astype(acc), b.astype(acc), EPS)


def _prepare_forward(rows, C, dtype, params, key) -> Case:
    x, w, b = _inputs(key, rows, C, dtype, params, 1)
    return Case(forward_bytes(rows, C, dtype, params), x, (w, b), _f64(_forward_ref(x, w, b)),
                str(w.dtype), torch_inputs=(x, w, b))


def forward_ours(x, w, b):
    return layernorm_fwd_op(x, w, b, EPS)


def forward_xla(x, w, b):
    return reference.layernorm_fwd(x, w, b, EPS)


def forward_default(x, w, b):
    return layernorm_fwd(x, w, b, eps=EPS)


def _forward_impls_of(ours, xla, default, op: str):
    """An op's forward entries: ours, the default (the dispatch rule's pick), XLA's jnp (with
    --peers xla) and Pallas's."""
    def impls(case, args, combos):
        return [Impl("ours", ours, False)] + _default(default, args) \
            + ([Impl("xla", xla, True)] if "xla" in args.peers else []) + _pallas(op, args)
    return impls


_forward_impls = _forward_impls_of(forward_ours, forward_xla, forward_default, "layernorm_fwd")


# ---------------------------------------------------------------------------------------------
# add_layernorm_fwd: x, residual, weight, bias -> y, s, mean, rstd


def add_forward_bytes(rows: int, C: int, dtype: str, params: str) -> int:
    """Read x and residual, write y and s; read weight and bias; write mean and rstd."""
    return forward_bytes(rows, C, dtype, params) + 2 * rows * C * jnp.dtype(dtype).itemsize


def _prepare_add_forward(rows, C, dtype, params, key) -> Case:
    x, r, w, b = _inputs(key, rows, C, dtype, params, 2)
    s = jax.jit(jnp.add)(x, r)  # jnp's add in x's dtype: s must equal it bit for bit
    y, mean, rstd = _forward_ref(s, w, b)
    return Case(add_forward_bytes(rows, C, dtype, params), x, (r, w, b), _f64((y, s, mean, rstd)),
                str(w.dtype))


def add_forward_ours(x, r, w, b):
    return add_layernorm_fwd_op(x, r, w, b, EPS)


def add_forward_unfused(x, r, w, b):
    """jnp's add (XLA's fusion: read 2 tensors, write 1), then our fused forward of s."""
    s = x + r
    y, mean, rstd = layernorm_fwd_op(s, w, b, EPS)
    return y, s, mean, rstd


def add_forward_xla(x, r, w, b):
    s = x + r
    y, mean, rstd = reference.layernorm_fwd(s, w, b, EPS)
    return y, s, mean, rstd


def add_forward_default(x, r, w, b):
    return autodiff.add_forward(LAYERNORM, x, r, w, b, EPS, None)


def _add_forward_impls_of(ours, unfused, xla, default):
    """An add_* forward's entries: ours, the default (the dispatch rule's pick), jnp's add then
    our forward (ours-unfus), XLA's; s must equal jnp's add bit for bit in each."""
    def impls(case, args, combos):
        exact_s = {"s": 0}
        out = [Impl("ours", ours, False, exact_s)]
        if "default" in args.peers:
            out.append(Impl("default", default, False, exact_s))
        if "ours-unfus" in args.peers:
            out.append(Impl("ours-unfus", unfused, False, exact_s))
        if "xla" in args.peers:
            out.append(Impl("xla", xla, True, exact_s))
        return out
    return impls


_add_forward_impls = _add_forward_impls_of(add_forward_ours, add_forward_unfused, add_forward_xla,
                                           add_forward_default)


# ---------------------------------------------------------------------------------------------
# rmsnorm_bwd: dy, x, weight, rstd -> dx, dweight


def rms_backward_bytes(rows: int, C: int, dtype: str) -> int:
    """Read dy and x, write dx; read weight, write dweight; read rstd."""
    return (3 * rows * C + 2 * C) * jnp.dtype(dtype).itemsize + _stat_bytes(rows, dtype, 1)


def _prepare_rms_backward(rows, C, dtype, params, key) -> Case:
    x, dy, w, _ = _inputs(key, rows, C, dtype, "same", 2)
    # rstd from the jnp forward: a case is made outside any entry's error handling, so it must
    # not need our FFI forward (and every entry gets the same rstd).
    acc = reference.acc_dtype(x.dtype)
    _, rstd = jax.jit(reference.rmsnorm_fwd, static_argnums=2)(x.astype(acc), w.astype(acc), EPS)
    ref = jax.jit(reference.rmsnorm_bwd)(dy.astype(acc), x.astype(acc), w.astype(acc), rstd)
    return Case(rms_backward_bytes(rows, C, dtype), dy, (x, w, rstd), _f64(ref), dtype,
                torch_inputs=(x, w, dy))


def rms_backward_ours(kernel: int, block_size: int):
    def step(dy, x, w, rstd):
        return rmsnorm_bwd(dy, x, w, rstd, kernel=kernel, block_size=block_size)
    return step


def rms_backward_xla(dy, x, w, rstd):
    return reference.rmsnorm_bwd(dy, x, w, rstd)


def rms_backward_autodiff(dy, x, w, rstd):
    _, vjp = jax.vjp(lambda x, w: reference.rmsnorm(x, w, EPS), x, w)
    return vjp(dy)  # rstd is recomputed from x inside every step


def _rms_backward_impls(case, args, combos):
    out = [Impl(f"k{kid}/bs{bs}", rms_backward_ours(kid, bs), False) for kid, bs in combos]
    steps = {"xla": rms_backward_xla, "autodiff": rms_backward_autodiff}
    return out + _default(rms_backward_default, args) + [Impl(p, steps[p], True) for p in steps if p in args.peers] \
        + _pallas("rmsnorm_bwd", args)


def rms_backward_default(dy, x, w, rstd):
    return rmsnorm_bwd(dy, x, w, rstd)


# ---------------------------------------------------------------------------------------------
# rmsnorm_fwd: x, weight -> y, rstd; add_rmsnorm_fwd: x, residual, weight -> y, s, rstd


def rms_forward_bytes(rows: int, C: int, dtype: str, params: str) -> int:
    """Read x, write y; read weight; write rstd."""
    return (2 * rows * C * jnp.dtype(dtype).itemsize + C * _params_dtype(dtype, params).itemsize
            + _stat_bytes(rows, dtype, 1))


def _rms_forward_ref(x, w):
    acc = reference.acc_dtype(x.dtype)
    return jax.jit(reference.rmsnorm_fwd, static_argnums=2)(x.astype(acc), w.astype(acc), EPS)


def _prepare_rms_forward(rows, C, dtype, params, key) -> Case:
    x, w, _ = _inputs(key, rows, C, dtype, params, 1)
    return Case(rms_forward_bytes(rows, C, dtype, params), x, (w,), _f64(_rms_forward_ref(x, w)),
                str(w.dtype), torch_inputs=(x, w))


def rms_forward_ours(x, w):
    return rmsnorm_fwd_op(x, w, EPS)


def rms_forward_xla(x, w):
    return reference.rmsnorm_fwd(x, w, EPS)


def rms_forward_default(x, w):
    return rmsnorm_fwd_public(x, w, eps=EPS)


_rms_forward_impls = _forward_impls_of(rms_forward_ours, rms_forward_xla, rms_forward_default, "rmsnorm_fwd")


def _prepare_add_rms_forward(rows, C, dtype, params, key) -> Case:
    x, r, w, _ = _inputs(key, rows, C, dtype, params, 2)
    s = jax.jit(jnp.add)(x, r)  # jnp's add in x's dtype: s must equal it bit for bit
    y, rstd = _rms_forward_ref(s, w)
    nbytes = rms_forward_bytes(rows, C, dtype, params) + 2 * rows * C * jnp.dtype(dtype).itemsize
    return Case(nbytes, x, (r, w), _f64((y, s, rstd)), str(w.dtype))


def add_rms_forward_ours(x, r, w):
    return add_rmsnorm_fwd_op(x, r, w, EPS)


def add_rms_forward_unfused(x, r, w):
    """jnp's add, then our fused forward of s."""
    s = x + r
    y, rstd = rmsnorm_fwd_op(s, w, EPS)
    return y, s, rstd


def add_rms_forward_xla(x, r, w):
    s = x + r
    y, rstd = reference.rmsnorm_fwd(s, w, EPS)
    return y, s, rstd


def add_rms_forward_default(x, r, w):
    return autodiff.add_forward(RMSNORM, x, r, w, None, EPS, None)


_add_rms_forward_impls = _add_forward_impls_of(add_rms_forward_ours, add_rms_forward_unfused, add_rms_forward_xla,
                                               add_rms_forward_default)


OPS = {op.name: op for op in (
    Op("layernorm_bwd", "backward", "layernorm backward", ("dx", "dweight", "dbias"),
       BACKWARD_GPU_SHAPES, ("default", "xla", "autodiff", "torch", "liger", "pallas"), _prepare_backward,
       _backward_impls, norm=LAYERNORM, kernels=True),
    Op("layernorm_fwd", "forward", "layernorm forward", ("y", "mean", "rstd"),
       FORWARD_GPU_SHAPES, ("default", "xla", "torch", "liger", "pallas"), _prepare_forward, _forward_impls,
       norm=LAYERNORM),
    Op("add_layernorm_fwd", "add_forward", "add + layernorm forward", ("y", "s", "mean", "rstd"),
       FORWARD_GPU_SHAPES, ("default", "xla", "ours-unfus"), _prepare_add_forward, _add_forward_impls,
       norm=LAYERNORM, carry=2),
    Op("rmsnorm_bwd", "rms_backward", "rmsnorm backward", ("dx", "dweight"), RMS_GPU_SHAPES,
       ("default", "xla", "autodiff", "torch", "liger", "pallas"), _prepare_rms_backward, _rms_backward_impls,
       norm=RMSNORM, kernels=True),
    Op("rmsnorm_fwd", "rms_forward", "rmsnorm forward", ("y", "rstd"), RMS_GPU_SHAPES,
       ("default", "xla", "torch", "liger", "pallas"), _prepare_rms_forward, _rms_forward_impls,
       norm=RMSNORM),
    Op("add_rmsnorm_fwd", "add_rms_forward", "add + rmsnorm forward", ("y", "s", "rstd"),
       RMS_GPU_SHAPES, ("default", "xla", "ours-unfus"), _prepare_add_rms_forward, _add_rms_forward_impls,
       norm=RMSNORM, carry=2),
)}
ALIASES = {op.alias: name for name, op in OPS.items()}


def resolve(names: list[str]) -> list[Op]:
    """The ops of --op's names and aliases (``all``: every op), in OPS order; KeyError names
    the first unknown one."""
    if names == ["all"]:
        return list(OPS.values())
    wanted = {ALIASES.get(n, n) for n in names}
    for n in names:
        if ALIASES.get(n, n) not in OPS:
            raise KeyError(n)
    return [op for name, op in OPS.items() if name in wanted]
