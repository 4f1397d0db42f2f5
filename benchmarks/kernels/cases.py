"""What every op of the kernel bench is made of (ops.py lists the ops): a Case (one shape and
dtype's inputs, float64 reference and bytes), the Impls timed on it, the Op's row of facts, and
the pieces the layernorm and rmsnorm ops share (inputs, the default and Pallas entries, the
forward and add-forward entry lists).

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

from jax_lnbwd import reference
from jax_lnbwd.norms import Norm

from . import pallas


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
    # A peer that runs our kernels (the qk ops' two-calls): off a GPU, like ours, the C++
    # reference handlers, so its rows are no kernel timings there either.
    our_kernels: bool = False


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



def stat_bytes(rows: int, dtype: str, stats: int = 2) -> int:
    return stats * rows * reference.acc_dtype(dtype).itemsize  # mean and rstd, or rstd


def params_dtype(dtype: str, params: str):
    return jnp.dtype(jnp.float32 if params == "float32" and jnp.dtype(dtype).itemsize == 2 else dtype)


def f64(arrays) -> list:
    return [np.asarray(a, np.float64) for a in arrays]


def inputs(key, rows, C, dtype, params, tensors: int):
    """`tensors` random (rows, C) arrays in dtype, then weight and bias in the params dtype."""
    keys = jax.random.split(key, tensors + 2)
    pdtype = params_dtype(dtype, params)
    xs = [jax.random.normal(k, (rows, C), dtype) for k in keys[:tensors]]
    w = (1 + 0.1 * jax.random.normal(keys[-2], (C,), jnp.float32)).astype(pdtype)
    return (*xs, w, jax.random.normal(keys[-1], (C,), pdtype))


def default_impls(step, args) -> list:
    """The package's default entry (--peers default): the public function with no kernel named,
    which runs what the dispatch rule picks for this shape (jax_lnbwd/dispatch.py): our kernel or
    XLA's fusion. Its row against xla's shows that the default is never the slower."""
    return [Impl("default", step, False)] if "default" in args.peers else []


def pallas_impls(op: str, args) -> list:
    """The Pallas entry of op, where --peers asks for it and it runs here (pallas.py)."""
    return [Impl(pallas.NAME, pallas.step(op), True)] if pallas.NAME in args.peers else []


def forward_impls_of(ours, xla, default, op: str):
    """An op's forward entries: ours, the default (the dispatch rule's pick), XLA's jnp (with
    --peers xla) and Pallas's."""
    def impls(case, args, combos):
        return [Impl("ours", ours, False)] + default_impls(default, args) \
            + ([Impl("xla", xla, True)] if "xla" in args.peers else []) + pallas_impls(op, args)
    return impls


def add_forward_impls_of(ours, unfused, xla, default):
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

