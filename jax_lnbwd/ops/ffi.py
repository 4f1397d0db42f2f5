"""Registers our FFI handlers with XLA at import, and builds every FFI call the ops make.

`call` is the one place a jax.ffi.ffi_call is made: it checks that the platform has a handler,
types the operands and results for shard_map, and passes the attributes. The forward and
backward ops (ops/forward.py, ops/backward.py) say which target, operands, results and
attributes; nothing else about the call is written twice.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from .. import _jax_lnbwd

WITH_CUDA: bool = bool(_jax_lnbwd.with_cuda)

for _name, _capsule, _platform in _jax_lnbwd.registrations():
    jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


def _default_platform() -> str:
    """The platform a computation traced now will run on unless told otherwise: that of
    jax.default_device (or the jax_default_device setting) when set, else the default backend's.
    Under jit the tracers carry no device, so this is the best trace time can know."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def check_handler_for_default_platform(op: str):
    """Raises at trace time if the FFI call of `op` is headed for a GPU with no handler of ours.

    A build without nvcc has only the CPU handlers (WITH_CUDA False). On a GPU XLA would fail
    only when compiling, with "No FFI handler registered ... on a platform CUDA", which says
    neither why nor what to do. The check sits at each FFI call, not in the public functions:
    their default forward off CUDA is jnp, so inference on the GPU still works with such a build;
    only the backward (and the FFI forward, when forced) needs the handler."""
    if WITH_CUDA or _default_platform() not in ("gpu", "cuda", "rocm"):
        return
    raise RuntimeError(
        f"{op}: this jax_lnbwd was built without its CUDA handler (jax_lnbwd.WITH_CUDA is "
        "False: no CUDA compiler, nvcc, was found when it was built), but JAX's default device "
        f"is a GPU ({_default_platform()}), where {op} cannot run. Install a jax_lnbwd wheel "
        "built with the CUDA kernels, or rebuild from source with the CUDA toolkit's nvcc on "
        "the PATH: JAX_LNBWD_CUDA=ON pip install . (ON fails loudly if nvcc is missing). To run "
        "on the CPU instead, use jax.default_device(jax.devices('cpu')[0]).")


_warned_no_handler = False


def warn_no_handler_on_gpu(op: str) -> None:
    """Warns once per process when a norm headed for a GPU runs XLA's jnp because this build has no
    CUDA handler (the dispatch rule's default; forcing our kernels raises instead)."""
    global _warned_no_handler
    if _warned_no_handler or WITH_CUDA or _default_platform() not in ("gpu", "cuda", "rocm"):
        return
    _warned_no_handler = True
    import warnings
    warnings.warn(f"{op}: this jax_lnbwd was built without its CUDA handler (jax_lnbwd.WITH_CUDA is False), "
                  "so on the GPU its norms run as XLA's jnp. Install a wheel built with the CUDA kernels, or "
                  "rebuild with nvcc on the PATH (JAX_LNBWD_CUDA=ON pip install .).", RuntimeWarning, stacklevel=4)


def varying_axes(*arrays) -> frozenset:
    """The shard_map mesh axes along which any of the arrays varies (their type's "varying
    manual axes"): empty outside shard_map, and with shard_map(check_vma=False)."""
    return frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))


def vary(a, axes: frozenset):
    """`a`, typed as varying along `axes` too. A no-op at run time (the values are the same on
    every device); under autodiff its transpose is a psum over the added axes."""
    missing = tuple(axes - varying_axes(a))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def call(target: str, operands: tuple, results: tuple, *, op: str, aliases=None, **attributes):
    """jax.ffi.ffi_call(target) on `operands`, with `results` as ((shape, dtype), ...) pairs.

    Inside shard_map JAX types every value with the mesh axes it varies along, and an FFI call's
    results have the types we declare: all operands are brought to the same varying axes (a
    replicated weight next to sharded rows, say) and the results vary along them too, typed on
    the (manual) mesh in effect. `op` names the public op for the missing-handler error.
    """
    check_handler_for_default_platform(op)
    axes = varying_axes(*operands)
    operands = tuple(vary(a, axes) for a in operands)
    typed = {}
    if axes:
        typed = dict(sharding=jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), P()),
                     manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    out_types = tuple(jax.ShapeDtypeStruct(shape, dtype, **typed) for shape, dtype in results)
    return jax.ffi.ffi_call(target, out_types, input_output_aliases=aliases)(*operands, **attributes)
