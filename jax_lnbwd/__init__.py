"""jax_lnbwd: normalization layers for JAX whose passes run hand-written CUDA kernels via the XLA FFI."""
from . import reference
from .config import use_ffi_backward, use_ffi_forward, use_xla_backward
from .kernels import DEFAULT_KERNEL, KERNELS, KernelInfo
from .layernorm import add_layernorm, layernorm, layernorm_bwd, layernorm_fwd
from .rmsnorm import add_rmsnorm, rmsnorm, rmsnorm_bwd, rmsnorm_fwd
from .norms import LAYERNORM, RMSNORM, TARGETS
from .qk_norm import qk_norm, qk_norm_fused
from .ops.ffi import WITH_CUDA
from .ops.partition import ShardingFallbackWarning
from . import dispatch

# LayerNorm's FFI targets by name (norms.py holds every norm's; TARGETS is all of them, the
# allow-list jax.export needs).
TARGET, TARGET_V2 = LAYERNORM.bwd_target, LAYERNORM.bwd_target_v2
TARGET_FWD, TARGET_ADD_FWD, TARGET_ADD_FWD_V2 = (LAYERNORM.fwd_target, LAYERNORM.add_fwd_target,
                                                 LAYERNORM.add_bias_fwd_target)
# RMSNorm's: the fused forward, add_rmsnorm's forward (x_bias optional) and the backward.
TARGET_RMS_FWD, TARGET_ADD_RMS_FWD, TARGET_RMS_BWD = (RMSNORM.fwd_target, RMSNORM.add_fwd_target,
                                                      RMSNORM.bwd_target_v2)

__all__ = ["layernorm", "add_layernorm", "layernorm_fwd", "layernorm_bwd",
           "rmsnorm", "add_rmsnorm", "rmsnorm_fwd", "rmsnorm_bwd", "qk_norm", "qk_norm_fused",
           "reference", "KERNELS", "KernelInfo",
           "DEFAULT_KERNEL", "TARGET", "TARGET_V2", "TARGET_FWD", "TARGET_ADD_FWD", "TARGET_ADD_FWD_V2",
           "TARGET_RMS_FWD", "TARGET_ADD_RMS_FWD", "TARGET_RMS_BWD", "TARGETS",
           "WITH_CUDA", "ShardingFallbackWarning", "use_xla_backward", "use_ffi_forward",
           "use_ffi_backward", "dispatch"]
__version__ = "0.1.0"
