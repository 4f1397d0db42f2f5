"""The op family: one row of facts per norm, read by every mechanism that the ops share.

A norm normalizes each row of x over its last axis (C elements) and saves fp32 statistics
(fp64 for fp64 x) for the backward. Its row says what differs between norms:
  * which FFI targets run it: the fused forward, add_*'s residual-fused forward (without and
    with x's own bias), and the backward's versions;
  * which statistics it saves and which parameters it has (so which gradients the backward
    returns), and whether the kernels add an offset to the weight (Gemma's zero-centred scale);
  * its kind: C++'s NormKind value, the attribute by which targets that serve both norms (QK_TARGETS)
    are told which to run.
The mechanisms (the forward and backward FFI ops in ops/, their vmap, derivative and
partitioning rules, the tangent-map primitive in tangent.py) take the row as a static
parameter, so a new norm is a new row plus its reference math and kernels, not a copy of them.

Target names carry a version: they are baked into exported programs, so a new signature gets
a new name and the old names stay registered. They are written once, in ffi/targets.h; the rows
below take them from the extension by a version-free key. QK-norm's targets (QK_TARGETS) serve
both norms, so they belong to no row: a call passes the row's kind. TARGETS lists them all.
"""
from __future__ import annotations

import dataclasses

from . import _jax_lnbwd

# {key: versioned target name} of every FFI target (ffi/targets.h).
_TARGET = _jax_lnbwd.targets()


@dataclasses.dataclass(frozen=True)
class Norm:
    name: str                 # the public function, e.g. "layernorm"; errors start with it
    kind: int                 # C++'s NormKind (ffi/kernels/norm_kind.h): 0 layernorm, 1 rmsnorm; the
                              # int32 attribute 'norm' of the targets that serve both (QK_TARGETS)
    centered: bool            # x̂ = (x - mean) * rstd (layernorm), or x * rstd (rmsnorm)
    fwd_target: str           # fused forward: x, [params] -> y, stats
    add_fwd_target: str       # add_*'s forward: x, residual, params -> y, s, stats (rmsnorm's takes
                              # x_bias too, zero-size when absent)
    add_bias_fwd_target: str | None  # ... with x's own bias, where that is a target of its own
    bwd_target: str | None    # backward v1 (layernorm only): a weight of x's dtype, nothing added to dx
    bwd_target_v2: str        # backward with a float32 weight beside 16-bit x and a residual
                              # gradient added to dx (attribute has_residual)
    stats: tuple[str, ...]    # the saved statistics, per row
    params: tuple[str, ...]   # the parameters, each (C,), scale first
    offset: bool = False      # takes `offset`, added to the weight by the kernels

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t in (self.bwd_target, self.bwd_target_v2, self.fwd_target, self.add_fwd_target,
                                 self.add_bias_fwd_target) if t is not None)


LAYERNORM = Norm(
    name="layernorm",
    kind=0,
    centered=True,
    fwd_target=_TARGET["layernorm_fwd"],
    add_fwd_target=_TARGET["add_layernorm_fwd"],
    add_bias_fwd_target=_TARGET["add_bias_layernorm_fwd"],
    bwd_target=_TARGET["layernorm_bwd"],
    bwd_target_v2=_TARGET["layernorm_bwd_v2"],
    stats=("mean", "rstd"),
    params=("weight", "bias"),
)

RMSNORM = Norm(
    name="rmsnorm",
    kind=1,
    centered=False,
    fwd_target=_TARGET["rmsnorm_fwd"],
    add_fwd_target=_TARGET["add_rmsnorm_fwd"],
    add_bias_fwd_target=None,
    bwd_target=None,
    bwd_target_v2=_TARGET["rmsnorm_bwd"],
    stats=("rstd",),
    params=("weight",),
    offset=True,
)

NORMS = (LAYERNORM, RMSNORM)
NORMS_BY_NAME = {norm.name: norm for norm in NORMS}   # the public names, e.g. qk_norm's `norm` keyword



@dataclasses.dataclass(frozen=True)
class QkTargets:
    """QK-norm's FFI targets (q's and k's heads in one call): one set for both norms,
    told apart by the int32 attribute `norm` (Norm.kind). The raw calls are ops/qk.py's."""
    fwd: str          # q, k, weights -> q_out, k_out, statistics
    fused_fwd: str    # qkv (q, k, v heads per token) -> qkv_out (v heads unchanged), statistics
    bwd: str          # dq_out, dk_out, q, k, weights, statistics -> dq, dk, dweights, workspace
    fused_bwd: str    # dqkv_out, qkv, weights, statistics -> dqkv (v heads dqkv_out's), dweights, workspace

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.fwd, self.fused_fwd, self.bwd, self.fused_bwd)


QK_TARGETS = QkTargets(
    fwd=_TARGET["qk_norm_fwd"],
    fused_fwd=_TARGET["qk_norm_fused_fwd"],
    bwd=_TARGET["qk_norm_bwd"],
    fused_bwd=_TARGET["qk_norm_fused_bwd"],
)

# Every FFI target a program traced with jax_lnbwd may call: what jax.export must be told to
# allow, e.g. disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in TARGETS].
TARGETS = tuple(t for norm in NORMS for t in norm.targets) + QK_TARGETS.targets
