// The GPU flags that `dnvme io` and `dnvme tune` share, and what they resolve to.
//
//   --gpu             the I/O buffer is device memory (cudaMalloc), moved by a GdsHandle
//   --gpu-device N    on CUDA device N (default 0)
//   --gds             through cuFile (GPUDirect Storage, or P2PDMA): cufile=require, so a machine
//                     without it fails with the reason instead of measuring the bounce path
//   --gds-compat      with --gds: also accept cuFile's compat mode (no nvidia-fs, no P2PDMA)
// --gpu alone is cufile=never: the bounce path (pinned staging buffers + the libaio engine).
//
// Failures follow the CLI's exit codes (commands.h): inconsistent flags throw UsageError (2); a
// machine without a usable device is a runtime failure (1) whose message is CUDA's reason.
//
// Thread safety: used from main()'s thread only.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "dnvme/gds_handle.h"
#include "dnvme/gpu.h"
#include "dnvme/status.h"

namespace dnvme::cli {

struct GpuFlags {
  bool gpu = false;
  int device = 0;
  bool gds = false;
  bool gds_compat = false;

  // Set by AddGpuFlags, so CheckGpuFlags can tell an explicit --gpu-device from the default.
  CLI::Option* device_opt = nullptr;
};

// Registers --gpu, --gpu-device, --gds and --gds-compat on `app`; `what` names what the buffer
// is used for in the help text ("the I/O buffer", "the tuner's buffers").
void AddGpuFlags(CLI::App* app, GpuFlags* flags, const std::string& what);

// Throws UsageError for --gds/--gds-compat/--gpu-device without --gpu, --gds-compat without
// --gds, or a negative device.
void CheckGpuFlags(const GpuFlags& flags);

// The handle options the flags ask for (cufile never / require, compat, device).
GdsOptions GdsOptionsFor(const GpuFlags& flags);

// The device the flags name: its properties, or CUDA's reason there is no usable device
// (gpu::DeviceCount's status, with "--gpu: " in front). A device index past the last device
// throws UsageError.
Result<gpu::DeviceInfo> OpenGpu(const GpuFlags& flags);

// 13000 -> "13.0"; "none" for 0.
std::string CudaVersionString(int version);

// "0 NVIDIA H100 80GB HBM3 (0000:1B:00.0)".
std::string DeviceLabel(const gpu::DeviceInfo& info);

}  // namespace dnvme::cli
