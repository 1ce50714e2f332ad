#include "tools/dnvme/gpu_cli.h"

#include <spdlog/fmt/fmt.h>

#include "tools/dnvme/commands.h"

namespace dnvme::cli {

void AddGpuFlags(CLI::App* app, GpuFlags* flags, const std::string& what) {
  app->add_flag("--gpu", flags->gpu,
                fmt::format("Put {} in GPU memory, moved by a gds_handle (the CUDA "
                            "bounce path unless --gds)",
                            what));
  flags->device_opt =
      app->add_option("--gpu-device", flags->device, "CUDA device for --gpu (default 0)");
  app->add_flag("--gds,--use_gds", flags->gds,
                "With --gpu: require cuFile (GPUDirect Storage or P2PDMA); fail with the reason "
                "when it is unavailable");
  app->add_flag("--gds-compat", flags->gds_compat,
                "With --gds: also accept cuFile's compat mode (no nvidia-fs, no P2PDMA)");
}

void CheckGpuFlags(const GpuFlags& flags) {
  if (!flags.gpu) {
    // Each of these only changes how GPU memory moves; alone they would silently time host
    // memory, which is not what the caller asked to measure.
    if (flags.gds) throw UsageError("--gds needs --gpu (GPUDirect Storage moves GPU memory)");
    if (flags.gds_compat) throw UsageError("--gds-compat needs --gpu --gds");
    if (flags.device_opt != nullptr && flags.device_opt->count() > 0) {
      throw UsageError("--gpu-device needs --gpu");
    }
    return;
  }
  if (flags.gds_compat && !flags.gds) throw UsageError("--gds-compat needs --gds");
  if (flags.device < 0) {
    throw UsageError(fmt::format("--gpu-device must not be negative, got {}", flags.device));
  }
}

GdsOptions GdsOptionsFor(const GpuFlags& flags) {
  GdsOptions o;
  o.cufile = flags.gds ? CuFilePolicy::kRequire : CuFilePolicy::kNever;
  o.cufile_compat = flags.gds_compat;
  o.device = flags.device;
  return o;
}

Result<gpu::DeviceInfo> OpenGpu(const GpuFlags& flags) {
  Result<int> count = gpu::DeviceCount();
  if (!count.ok()) return count.status().WithContext("--gpu");
  if (flags.device >= *count) {
    throw UsageError(fmt::format("--gpu-device {}: this machine has {} CUDA device{} (0..{})",
                                 flags.device, *count, *count == 1 ? "" : "s", *count - 1));
  }
  Result<gpu::DeviceInfo> info = gpu::GetDeviceInfo(flags.device);
  if (!info.ok()) return info.status().WithContext(fmt::format("--gpu device {}", flags.device));
  return info;
}

std::string CudaVersionString(int version) {
  if (version <= 0) return "none";
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

std::string DeviceLabel(const gpu::DeviceInfo& info) {
  return fmt::format("{} {} ({})", info.index, info.name,
                     info.pci_bus_id.empty() ? "no PCI bus id" : info.pci_bus_id);
}

}  // namespace dnvme::cli
