// resident_units (occupancy.h): the driver's answers, remembered per (device, kernel, threads,
// shared memory, cluster). A kernel's opt-in to dynamic shared memory (the function attribute
// cudaFuncAttributeMaxDynamicSharedMemorySize) is one value per device and kernel, so it only
// ever rises: lowering it for a smaller launch would make a remembered larger one fail.
#include "common/occupancy.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "common/device_limits.h"

namespace lnbwd {
namespace {

using LaunchKey = std::tuple<int, const void*, int, size_t, int>;   // device, kernel, threads, smem, cluster

struct Remembered {
  std::mutex mutex;
  std::map<LaunchKey, int> units;
  std::map<std::pair<int, const void*>, size_t> smem_opt_in;   // (device, kernel) -> bytes
  std::map<std::pair<int, const void*>, int> code_arch;        // (device, kernel) -> 10 * major + minor
};

Remembered& remembered() {
  static Remembered r;
  return r;
}

cudaError_t ask_driver(const void* kernel, int threads, size_t smem, int cluster, int* out) {
  if (cluster == 1) return cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, threads, smem);
  cudaLaunchAttribute attr = cluster_dimension(cluster);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned int>(cluster));
  cfg.blockDim = dim3(static_cast<unsigned int>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(out, kernel, &cfg);
}

}  // namespace

cudaError_t resident_units(int device, const void* kernel, int threads, size_t smem, int cluster, int* out) {
  cudaError_t err = cudaSuccess;
  if (device < 0 && (err = cudaGetDevice(&device)) != cudaSuccess) return err;
  ScopedDevice scope(device);
  if (scope.status() != cudaSuccess) return scope.status();
  Remembered& r = remembered();
  std::lock_guard<std::mutex> lock(r.mutex);
  const LaunchKey key{device, kernel, threads, smem, cluster};
  if (auto it = r.units.find(key); it != r.units.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  size_t& opted = r.smem_opt_in[{device, kernel}];
  if (smem > opted) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    opted = smem;
  }
  err = ask_driver(kernel, threads, smem, cluster, out);
  if (err == cudaSuccess) r.units.emplace(key, *out);
  return err;
}

cudaError_t kernel_code_arch(int device, const void* kernel, int* arch) {
  cudaError_t err = cudaSuccess;
  if (device < 0 && (err = cudaGetDevice(&device)) != cudaSuccess) return err;
  ScopedDevice scope(device);
  if (scope.status() != cudaSuccess) return scope.status();
  Remembered& r = remembered();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (auto it = r.code_arch.find({device, kernel}); it != r.code_arch.end()) {
    *arch = it->second;
    return cudaSuccess;
  }
  cudaFuncAttributes attr = {};
  err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  *arch = std::min(attr.binaryVersion, attr.ptxVersion);
  r.code_arch.emplace(std::pair{device, kernel}, *arch);
  return cudaSuccess;
}

}  // namespace lnbwd
