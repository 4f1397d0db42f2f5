"""jax_lnbwd: LayerNorm for JAX whose backward pass runs hand-written CUDA kernels via the XLA FFI."""
from . import reference
from ._ffi import TARGET, TARGET_V2, WITH_CUDA
from .config import use_ffi_forward, use_xla_backward
from .kernels import DEFAULT_KERNEL, KERNELS, KernelInfo
from .add_layernorm import add_layernorm
from .forward import ADD_BIAS_TARGET as TARGET_ADD_FWD_V2, ADD_TARGET as TARGET_ADD_FWD, TARGET as TARGET_FWD
from .layernorm import layernorm, layernorm_bwd, layernorm_fwd

# Every FFI target a program traced with jax_lnbwd may call (the backward's two versions, the
# fused forward and add_layernorm's residual variants of it, without and with x_bias): what
# jax.export must be told to allow, e.g.
#   disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in jax_lnbwd.TARGETS]
TARGETS = (TARGET, TARGET_V2, TARGET_FWD, TARGET_ADD_FWD, TARGET_ADD_FWD_V2)

__all__ = ["layernorm", "add_layernorm", "layernorm_fwd", "layernorm_bwd", "reference", "KERNELS", "KernelInfo",
           "DEFAULT_KERNEL", "TARGET", "TARGET_V2", "TARGET_FWD", "TARGET_ADD_FWD", "TARGET_ADD_FWD_V2", "TARGETS",
           "WITH_CUDA",
           "use_xla_backward", "use_ffi_forward"]
__version__ = "0.1.0"
