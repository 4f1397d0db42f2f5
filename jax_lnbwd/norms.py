"""The op family: one row of facts per norm, read by every mechanism that the ops share.

A norm normalizes each row of x over its last axis (C elements) and saves fp32 statistics
(fp64 for fp64 x) for the backward. Its row says what differs between norms:
  * which FFI targets run it: the fused forward, add_*'s residual-fused forward (without and
    with x's own bias), and the backward's versions;
  * which statistics it saves and which parameters it has.
The mechanisms (the forward and backward FFI ops in ops/, their vmap, derivative and
partitioning rules, the tangent-map primitive in tangent.py) take the row as a static
parameter, so a new norm is a new row plus its reference math and kernels, not a copy of them.

Target names carry a version: they are baked into exported programs, so a new signature gets
a new name and the old names stay registered (ffi/module.cc).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Norm:
    name: str                 # the public function, e.g. "layernorm"; errors start with it
    fwd_target: str           # fused forward: x, [weight], [bias] -> y, stats
    add_fwd_target: str       # add_*'s forward: x, residual, params -> y, s, stats
    add_bias_fwd_target: str  # ... with x's own bias: x, x_bias, residual, params -> y, s, stats
    bwd_target: str           # backward v1: a weight of x's dtype, nothing added to dx
    bwd_target_v2: str        # backward v2: v1 plus a float32 weight beside 16-bit x and a
                              # residual gradient added to dx
    stats: tuple[str, ...]    # the saved statistics, per row
    params: tuple[str, ...]   # the parameters, each (C,), scale first

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.bwd_target, self.bwd_target_v2, self.fwd_target, self.add_fwd_target, self.add_bias_fwd_target)


LAYERNORM = Norm(
    name="layernorm",
    fwd_target="jax_lnbwd_layernorm_fwd_v1",
    add_fwd_target="jax_lnbwd_add_layernorm_fwd_v1",
    add_bias_fwd_target="jax_lnbwd_add_layernorm_fwd_v2",
    bwd_target="jax_lnbwd_layernorm_bwd_v1",
    bwd_target_v2="jax_lnbwd_layernorm_bwd_v2",
    stats=("mean", "rstd"),
    params=("weight", "bias"),
)

NORMS = (LAYERNORM,)

# Every FFI target a program traced with jax_lnbwd may call: what jax.export must be told to
# allow, e.g. disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in TARGETS].
TARGETS = tuple(t for norm in NORMS for t in norm.targets)
