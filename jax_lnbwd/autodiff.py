"""The norms' forward and their custom_jvps: the one place a public op's value and derivative meet.

`forward` is THE forward of a norm, (y, *stats), for checked inputs, and `add_forward` add_*'s
(y, s, *stats); every path computes them here. Which one runs, the fused FFI forward
(ops/forward.py: reads x once) or jnp's (reference.py), is the dispatch rule's answer
(dispatch.py: by the switches, the platform, C, rows and dtype), staged per platform by
jax.lax.platform_dependent when it differs between platforms (so an export for cpu and cuda
carries both). The two compute the same numbers (statistics in fp32, centered variance, y
rounded once).

The public functions are jax.custom_jvps (`norm`, `add_norm`). Their JVP rule computes the
forward once and the tangent by a linear primitive whose transpose is the FFI backward
(tangent.py). So:
  * forward mode (jax.jvp, jax.linearize, jacfwd) evaluates the tangent map in jnp;
  * reverse mode (jax.grad, vjp, jacrev) linearizes and transposes: one FFI call per norm,
    with the op's own vmap, sharding and derivative rules (ops/backward.py, ops/partition.py),
    or the jnp backward where the dispatch rule says XLA is faster (tangent.py);
  * any order of either (hessian, check_grads order 2) composes the rules of both.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import _checks, dispatch, reference, tangent
from .norms import Norm
from .ops import ffi, forward as forward_op

def _explicitly_sharded(*arrays) -> bool:
    """Whether any array's type names mesh axes (jax.sharding.AxisType.Explicit)."""
    for a in arrays:
        sharding = None if a is None else jax.typeof(a).sharding
        if sharding is not None and any(e is not None for e in getattr(sharding, "spec", ())):
            return True
    return False


def _decide_forward(norm: Norm, x, *arrays, add: bool = False, differentiated: bool = False) -> dispatch.Decision:
    """The dispatch rule's answer for this forward (dispatch.py). Under Explicit mesh axes the
    FFI forward's results would be typed without a sharding, which platform_dependent's branches
    must agree on: the jnp forward runs there. A build without the CUDA handler has no fused
    forward for CUDA; the jnp forward needs no handler, so inference still runs there."""
    return dispatch.decide(norm, dispatch.FORWARD, x.shape, x.dtype, add=add, differentiated=differentiated,
                           explicitly_sharded=_explicitly_sharded(x, *arrays), cuda_built=ffi.WITH_CUDA)


def forward(norm: Norm, x, weight, bias, eps: float, offset: float = 0.0, differentiated: bool = False):
    """`norm`'s (y, *stats) for checked inputs, by the fused FFI forward or jnp, as the dispatch rule says
    (differentiated: the forward of a JVP rule, i.e. of a training step)."""
    decision = _decide_forward(norm, x, weight, bias, differentiated=differentiated)
    return dispatch.run(decision, lambda x, w, b: forward_op.norm_fwd_op(norm, x, w, b, eps, offset),
                        lambda x, w, b: reference.norm_fwd(norm, x, w, b, eps, offset), x, weight, bias)


def add_forward(norm: Norm, x, residual, weight, bias, eps: float, x_bias=None, offset: float = 0.0,
                differentiated: bool = False):
    """`norm`'s (y, s, *stats) with s = x + residual in x's dtype (with x_bias: (x + x_bias) + residual,
    reference.add_residual), for checked inputs. Where the rule runs our kernel, the
    residual-fused FFI forward computes them all in one kernel that reads x and residual once;
    elsewhere jnp's add followed by the jnp forward. Both normalize the rounded s."""
    decision = _decide_forward(norm, x, residual, weight, bias, x_bias, add=True, differentiated=differentiated)

    def unfused(x, r, w, b, xb):
        s = reference.add_residual(x, r, xb)
        y, *stats = reference.norm_fwd(norm, s, w, b, eps, offset)
        return (y, s, *stats)

    fused = lambda x, r, w, b, xb: forward_op.add_norm_fwd_op(norm, x, r, w, b, eps, xb, offset)  # noqa: E731
    return dispatch.run(decision, fused, unfused, x, residual, weight, bias, x_bias)


def fill_params(norm: Norm, x, weight, bias, dweight, dbias):
    """(weight, *parameter tangents) with an absent weight as ones and absent tangents as zeros,
    in the parameters' dtype (float32 beside 16-bit x when either present parameter is: then the
    backward runs target v2 and the other parameter's gradient is summed in float32 too).
    layernorm: (weight, dweight, dbias); rmsnorm: (weight, dweight)."""
    C = x.shape[-1]
    dtype = jnp.float32 if _checks.is_mixed(x, weight, bias) else x.dtype
    if weight is None:
        weight, dweight = jnp.ones((C,), dtype), jnp.zeros((C,), dtype)
    elif weight.dtype != dtype:   # a 16-bit weight beside a float32 bias: exact upcast
        weight, dweight = weight.astype(dtype), dweight.astype(dtype)
    if not norm.centered:
        return weight, dweight
    if bias is None:
        dbias = jnp.zeros((C,), dtype)
    return weight, dweight, dbias


def settings(norm: Norm, eps: float, kernel, block_size, offset: float = 0.0, *, fn: str, x, mixed: bool,
             residual: bool = False) -> "Settings":
    """A norm's checked custom_jvp settings: the backward kernel (_checks.kernel) and the
    backward's switch mode, captured now ("ffi" when a kernel or block size is given)."""
    given = kernel is not None or block_size is not None
    kernel, block_size = _checks.kernel(fn, kernel, block_size, _checks.dtype_name(x), x.shape[-1], norm=norm,
                                        mixed=mixed, residual=residual)
    return Settings(norm, eps, kernel, block_size, offset, "ffi" if given else dispatch.mode(dispatch.BACKWARD))


def whole_jnp(settings: "Settings", x, *, add: bool = False) -> bool:
    """Whether the public function should return the jnp reference, differentiated by JAX: the off
    switch, or no platform running a kernel of ours for x in either direction (dispatch.whole_jnp)."""
    whole = dispatch.whole_jnp(settings.norm, x.shape, x.dtype, add=add, bwd_mode=settings.bwd_mode,
                               cuda_built=ffi.WITH_CUDA)
    if whole and not ffi.WITH_CUDA and settings.bwd_mode != "xla":
        ffi.warn_no_handler_on_gpu(settings.norm.name)
    return whole


def vary_all(*arrays):
    """The arrays (None stays None) typed as varying along every shard_map mesh axis any of them
    varies along. Inside shard_map, x usually varies along mesh axes along which a replicated
    weight and bias do not; jnp's `x * weight` would cast weight to varying, and so do we,
    before the custom_jvp, so that its tangents and cotangents have matching types. The cast's
    transpose is a psum: the gradient of a replicated weight is summed over the shards, exactly
    as for jnp code."""
    axes = ffi.varying_axes(*(a for a in arrays if a is not None))
    return tuple(None if a is None else ffi.vary(a, axes) for a in arrays)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a norm's custom_jvp holds static: the norm, eps, the backward's kernel and block
    size, rmsnorm's offset, and the backward's switch mode."""
    norm: Norm
    eps: float
    kernel: int
    block_size: int
    offset: float = 0.0
    # The backward's switch mode when the norm was traced (dispatch.decide): the backward is traced
    # later, when JAX transposes, outside any `with` block around the forward. "ffi" when the
    # kernel or block size was given explicitly.
    bwd_mode: str = "auto"

    def backward(self) -> dict:
        """The static parameters of the tangent-map primitive (tangent.py)."""
        params = dict(seg_dims=0, kernel=self.kernel, block_size=self.block_size, bwd_mode=self.bwd_mode)
        if self.norm.offset:
            params["offset"] = self.offset
        return params


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def norm(x, weight, bias, settings: Settings):
    return forward(settings.norm, x, weight, bias, settings.eps, settings.offset)[0]


@norm.defjvp
def _norm_jvp(settings, primals, tangents):
    """y and its tangent dy = tangent_map(x, weight, *stats; dx, dweight[, dbias]).

    An absent weight is a scale of ones with a zero tangent, an absent bias a zero tangent:
    both are constants here, not tangents, so reverse mode returns no gradient for them."""
    x, weight, bias = primals
    dx, dweight, dbias = tangents
    y, *stats = forward(settings.norm, x, weight, bias, settings.eps, settings.offset, differentiated=True)
    weight, *ptangents = fill_params(settings.norm, x, weight, bias, dweight, dbias)
    dy = tangent.tangent_map(settings.norm, x, weight, stats, ptangents, dx, **settings.backward())
    return y, dy


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def add_norm(x, residual, weight, bias, x_bias, settings: Settings):
    y, s, *_ = add_forward(settings.norm, x, residual, weight, bias, settings.eps, x_bias, settings.offset)
    return y, s


@add_norm.defjvp
def _add_norm_jvp(settings, primals, tangents):
    """(y, s) and their tangents (dy, ds) = add_tangent_map(...; dx, dresidual, dweight[, dbias]).

    With x_bias, s = (x + x_bias) + residual is linear in (x, x_bias, residual): x_bias's tangent
    is added to x's, in fp32 (fp64) and rounded to x's dtype, so that in reverse mode x_bias's
    cotangent is the fp32 column sum of ds (JAX transposes the broadcast into that sum)."""
    x, residual, weight, bias, x_bias = primals
    dx, dresidual, dweight, dbias, dx_bias = tangents
    y, s, *stats = add_forward(settings.norm, x, residual, weight, bias, settings.eps, x_bias, settings.offset,
                               differentiated=True)
    weight, *ptangents = fill_params(settings.norm, s, weight, bias, dweight, dbias)
    if x_bias is not None:
        acc = reference.acc_dtype(x.dtype)
        dx = (dx.astype(acc) + jnp.broadcast_to(dx_bias.astype(acc), dx.shape)).astype(x.dtype)
    dy, ds = tangent.add_tangent_map(settings.norm, s, weight, stats, ptangents, dx, dresidual,
                                     **settings.backward())
    return (y, s), (dy, ds)
