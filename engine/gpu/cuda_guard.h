// The DeferCudaInit/AllowCudaInit gate (dnvme/gpu.h), for code in engine/gpu that initialises
// CUDA without going through cuda.cc's wrappers (cuFile's driver open).
#pragma once

#include "dnvme/status.h"

namespace dnvme::gpu {

// OK when CUDA may be initialised now; else Unsupported quoting DeferCudaInit's reason.
Status CheckCudaInitAllowed();

}  // namespace dnvme::gpu
