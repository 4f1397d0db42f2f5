// device_limits (common/device_limits.h): a GPU's limits as the launchers need them, asked of the
// driver once per device and remembered (the launchers ask on every call, and a driver query is
// host work the GPU waits for when the kernel is short).
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "common/device_limits.h"

namespace lnbwd {
namespace {

// The test caps of JAX_LNBWD_TEST_DEVICE_LIMITS: -1 leaves the device's value.
struct TestCaps {
  bool ok = true;    // the variable parsed
  bool set = false;  // it set anything
  long long smem = -1, sms = -1, clusters = -1, cooperative = -1;
};

// "smem=101376,clusters=0,cooperative=0,sms=8": comma-separated key=integer pairs.
TestCaps parse_caps(const char* text) {
  TestCaps caps;
  if (text == nullptr || *text == '\0') return caps;
  std::string s(text);
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(',', start), s.size());
    const std::string item = s.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) return TestCaps{false};
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    char* stop = nullptr;
    const long long v = std::strtoll(value.c_str(), &stop, 10);
    if (value.empty() || *stop != '\0' || v < 0) return TestCaps{false};
    if (key == "smem") caps.smem = v;
    else if (key == "sms") caps.sms = v;
    else if (key == "clusters") caps.clusters = v;
    else if (key == "cooperative") caps.cooperative = v;
    else return TestCaps{false};
    caps.set = true;
  }
  return caps;
}

const TestCaps& test_caps() {
  static const TestCaps caps = parse_caps(std::getenv("JAX_LNBWD_TEST_DEVICE_LIMITS"));
  return caps;
}

cudaError_t ask_driver(int device, DeviceLimits* out) {
  DeviceLimits l;
  l.device = device;
  int smem = 0, clusters = 0, cooperative = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&l.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&l.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, device));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device));
  l.smem_optin = static_cast<size_t>(smem);
  l.clusters = clusters != 0;
  l.cooperative = cooperative != 0;
  const TestCaps& caps = test_caps();
  if (!caps.ok) return cudaErrorInvalidValue;
  if (caps.set) {
    l.test_caps = true;
    if (caps.smem >= 0) l.smem_optin = static_cast<size_t>(caps.smem);
    if (caps.sms >= 0) l.sms = static_cast<int>(caps.sms);
    if (caps.clusters == 0) l.clusters = false;
    if (caps.cooperative == 0) l.cooperative = false;
  }
  if (l.sms < 1) return cudaErrorInvalidValue;   // "sms=0": no grid can be sized
  *out = l;
  return cudaSuccess;
}

}  // namespace

cudaError_t device_limits(int device, DeviceLimits* out) {
  if (device < 0) LNBWD_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<int, DeviceLimits> known;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find(device); it != known.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  DeviceLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(ask_driver(device, &l));
  known.emplace(device, l);
  *out = l;
  return cudaSuccess;
}

bool cooperative_finish_opt_in() {
  static const bool on = [] {
    const char* v = std::getenv("JAX_LNBWD_COOPERATIVE_FINISH");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

ScopedDevice::ScopedDevice(int device) {
  if (device < 0) return;
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device) {
    status_ = cudaSetDevice(device);
    if (status_ != cudaSuccess) previous_ = -1;
  } else {
    previous_ = -1;   // already current: nothing to restore
  }
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace lnbwd
