// CUDA runtime errors as Status (engine/gpu only).
#pragma once

#include <string>

#include "dnvme/gpu.h"
#include "dnvme/status.h"
#include "engine/gpu/cuda_guard.h"

#if DNVME_HAVE_CUDA
#include <cuda_runtime_api.h>

namespace dnvme::gpu {

// OK for cudaSuccess; else "<context>: cudaErrorName: description". Clears the runtime's sticky
// last-error so the next call starts clean.
Status CudaCheck(cudaError_t err, const std::string& context);

}  // namespace dnvme::gpu
#endif

namespace dnvme::gpu {
void LogCudaFailure(const Status& st);
}  // namespace dnvme::gpu
