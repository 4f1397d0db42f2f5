"""The off switch: run XLA's backward (JAX's derivative of the jnp reference) instead of our FFI op.

For A/B comparisons and as a safety valve. Two ways to turn it on, both read when layernorm
(or layernorm_bwd) is traced:
  * the environment variable JAX_LNBWD_BACKWARD=xla (=ffi, or unset, for our op);
  * jax_lnbwd.use_xla_backward(True): a process-wide setting that overrides the environment;
    also a context manager, which restores the previous setting on exit:
        with jax_lnbwd.use_xla_backward():
            grads = jax.jit(jax.grad(loss))(params)
    use_xla_backward(None) returns to the environment variable.
A jit traced before the switch changed keeps the backward it was traced with (jit caches by
its arguments, not by this setting): switch before the first call, or trace a new function.
"""
from __future__ import annotations

import os

ENV_VAR = "JAX_LNBWD_BACKWARD"
_CHOICES = ("ffi", "xla")

_override: bool | None = None   # use_xla_backward's setting; None: the environment decides


def xla_backward_enabled() -> bool:
    """True when layernorm should use XLA's backward instead of the FFI op (checked at trace time)."""
    if _override is not None:
        return _override
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "ffi"):
        return False
    if value == "xla":
        return True
    raise ValueError(f"jax_lnbwd: environment variable {ENV_VAR}={os.environ[ENV_VAR]!r}; "
                     f"expected one of {', '.join(_CHOICES)} (or unset)")


class use_xla_backward:
    """Make layernorm use XLA's backward (True), our FFI op (False), or follow the environment
    variable JAX_LNBWD_BACKWARD (None). Takes effect at once; used in a `with` statement it
    is undone when the block ends."""

    def __init__(self, enabled: bool | None = True):
        global _override
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"use_xla_backward: 'enabled' must be True, False or None, got {enabled!r}")
        self._previous = _override
        _override = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        global _override
        _override = self._previous
        return False


# --- the forward switch --------------------------------------------------------------------------
#
# layernorm's forward (y, mean, rstd) runs the fused FFI forward (jax_lnbwd/ops/forward.py) on CUDA
# and the jnp reference elsewhere: the choice is made per platform by jax.lax.platform_dependent,
# so one traced program (an export for several platforms, say) takes the right branch on each.
# Read when layernorm is traced, like the backward switch:
#   * JAX_LNBWD_FORWARD=xla: the jnp forward everywhere (=ffi, or unset: the default above);
#   * jax_lnbwd.use_ffi_forward(False): the same, overriding the environment; True forces the
#     FFI forward on every platform (the CPU runs its C++ handler: how CPU tests reach it);
#     None returns to the environment (the per-platform default). Also a context manager.
# Under Explicit mesh axes (sharding in types) the default takes the jnp forward on every platform.

FORWARD_ENV_VAR = "JAX_LNBWD_FORWARD"

_forward_override: bool | None = None   # use_ffi_forward's setting; None: the environment decides


def ffi_forward_mode() -> str:
    """'auto' (FFI forward on CUDA, jnp elsewhere), 'ffi' (FFI everywhere) or 'xla' (jnp everywhere)."""
    if _forward_override is not None:
        return "ffi" if _forward_override else "xla"
    value = os.environ.get(FORWARD_ENV_VAR, "").strip().lower()
    if value in ("", "ffi"):
        return "auto"
    if value == "xla":
        return "xla"
    raise ValueError(f"jax_lnbwd: environment variable {FORWARD_ENV_VAR}={os.environ[FORWARD_ENV_VAR]!r}; "
                     f"expected one of {', '.join(_CHOICES)} (or unset)")


class use_ffi_forward:
    """Make layernorm's forward the FFI op on every platform (True), the jnp reference on every
    platform (False), or follow JAX_LNBWD_FORWARD (None: FFI on CUDA, jnp elsewhere). Takes
    effect at once for what is traced next; in a `with` statement it is undone when the block ends."""

    def __init__(self, enabled: bool | None = True):
        global _forward_override
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"use_ffi_forward: 'enabled' must be True, False or None, got {enabled!r}")
        self._previous = _forward_override
        _forward_override = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        global _forward_override
        _forward_override = self._previous
        return False
