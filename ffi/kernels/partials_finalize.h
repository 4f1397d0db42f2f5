// Sums the per-block partial slots of the workspace into dweight and dbias (fixed order);
// `slots` is the number of slots per segment.
#pragma once

#include "layernorm_bwd.h"

namespace lnbwd {

cudaError_t finalize_partials_launch(const LayernormBwdParams& p, int slots, cudaStream_t stream);

}  // namespace lnbwd
