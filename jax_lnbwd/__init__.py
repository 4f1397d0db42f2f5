"""jax_lnbwd: LayerNorm for JAX whose backward pass runs hand-written CUDA kernels via the XLA FFI."""
from . import reference
from ._ffi import TARGET, WITH_CUDA
from .config import use_ffi_forward, use_xla_backward
from .kernels import DEFAULT_KERNEL, KERNELS, KernelInfo
from .add_layernorm import add_layernorm
from .layernorm import layernorm, layernorm_bwd, layernorm_fwd

__all__ = ["layernorm", "add_layernorm", "layernorm_fwd", "layernorm_bwd", "reference", "KERNELS", "KernelInfo",
           "DEFAULT_KERNEL", "TARGET", "WITH_CUDA", "use_xla_backward", "use_ffi_forward"]
__version__ = "0.1.0"
