"""The switches: which implementation each half of a norm runs, overriding the dispatch rule.

By default (mode "auto") dispatch.py decides, per call and per platform, whether our FFI kernel
or XLA's fused jnp runs each direction: our kernels on CUDA where they are faster than XLA's
(measured crossovers by direction, C, rows and dtype), jnp everywhere else. The switches below
override that rule; all are read when a norm is traced (a jit traced before a switch changed
keeps what it was traced with: jit caches by its arguments, not by these settings).

The forward half, JAX_LNBWD_FORWARD / jax_lnbwd.use_ffi_forward:
  * unset or "auto": the rule;
  * "ffi" / use_ffi_forward(True): the FFI forward on every platform (the CPU runs its C++
    handler: how the CPU tests reach it);
  * "xla" / use_ffi_forward(False): the jnp forward on every platform.
The backward half, JAX_LNBWD_BACKWARD / jax_lnbwd.use_ffi_backward:
  * unset or "auto": the rule;
  * "ffi" / use_ffi_backward(True): the FFI backward on every platform;
  * use_ffi_backward(False): the jnp backward (given the forward's saved statistics) on every
    platform, whichever forward ran.
The off switch, JAX_LNBWD_BACKWARD=xla / jax_lnbwd.use_xla_backward(True): the whole norm is
the jnp reference differentiated by JAX (no custom_jvp, no FFI call in either direction), for
A/B comparisons and as a safety valve. use_xla_backward(False) forces the FFI backward, as
use_ffi_backward(True) does; the two share one setting, and the last one set wins.

Each use_* takes True, False or None (None: back to the environment variable); it takes effect
at once, and in a `with` statement it is undone when the block ends:
    with jax_lnbwd.use_xla_backward():
        grads = jax.jit(jax.grad(loss))(params)
An explicit kernel= or block_size= always runs that backward kernel, on every platform.
"""
from __future__ import annotations

import os

FORWARD_ENV_VAR = "JAX_LNBWD_FORWARD"
BACKWARD_ENV_VAR = "JAX_LNBWD_BACKWARD"
ENV_VAR = BACKWARD_ENV_VAR   # the off switch's variable

# The modes: "auto" (the rule), "ffi" (our kernel on every platform), "xla" (forward: jnp on
# every platform; backward: the whole norm as the jnp reference), "jnp" (backward only: the jnp
# backward given the saved statistics).
_ENV_CHOICES = {FORWARD_ENV_VAR: ("auto", "ffi", "xla"), BACKWARD_ENV_VAR: ("auto", "ffi", "xla")}

_overrides: dict[str, str | None] = {FORWARD_ENV_VAR: None, BACKWARD_ENV_VAR: None}


def _mode(var: str) -> str:
    if _overrides[var] is not None:
        return _overrides[var]
    value = os.environ.get(var, "").strip().lower() or "auto"
    if value not in _ENV_CHOICES[var]:
        raise ValueError(f"jax_lnbwd: environment variable {var}={os.environ[var]!r}; "
                         f"expected one of {', '.join(_ENV_CHOICES[var])} (or unset: auto)")
    return value


def forward_mode() -> str:
    """'auto' (the dispatch rule), 'ffi' (the FFI forward everywhere) or 'xla' (jnp everywhere)."""
    return _mode(FORWARD_ENV_VAR)


def backward_mode() -> str:
    """'auto' (the dispatch rule), 'ffi' (the FFI backward everywhere), 'jnp' (the jnp backward
    given the saved statistics, everywhere) or 'xla' (the whole norm as the jnp reference)."""
    return _mode(BACKWARD_ENV_VAR)


def xla_backward_enabled() -> bool:
    """True when the whole norm is the jnp reference differentiated by JAX (the off switch)."""
    return backward_mode() == "xla"


class _Switch:
    """A context manager and plain call that sets one variable's override: `modes` maps
    True/False to a mode; None returns to the environment variable."""
    var: str
    modes: dict

    def __init__(self, enabled: bool | None = True):
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"{type(self).__name__}: 'enabled' must be True, False or None, got {enabled!r}")
        self._previous = _overrides[self.var]
        _overrides[self.var] = None if enabled is None else self.modes[enabled]

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        _overrides[self.var] = self._previous
        return False


class use_xla_backward(_Switch):
    """True: the whole norm is the jnp reference, differentiated by JAX (the off switch).
    False: the FFI backward on every platform. None: JAX_LNBWD_BACKWARD decides (unset: the
    dispatch rule). Takes effect at once; in a `with` statement it is undone when the block ends."""
    var, modes = BACKWARD_ENV_VAR, {True: "xla", False: "ffi"}


class use_ffi_backward(_Switch):
    """True: the FFI backward on every platform. False: the jnp backward (given the forward's
    saved statistics) on every platform. None: JAX_LNBWD_BACKWARD decides (unset: the dispatch
    rule). Takes effect at once; in a `with` statement it is undone when the block ends."""
    var, modes = BACKWARD_ENV_VAR, {True: "ffi", False: "jnp"}


class use_ffi_forward(_Switch):
    """True: the FFI forward on every platform. False: the jnp forward on every platform. None:
    JAX_LNBWD_FORWARD decides (unset: the dispatch rule). Takes effect at once for what is traced
    next; in a `with` statement it is undone when the block ends."""
    var, modes = FORWARD_ENV_VAR, {True: "ffi", False: "xla"}
