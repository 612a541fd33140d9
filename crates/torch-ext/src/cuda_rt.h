// The CUDA driver API and NVRTC, opened with dlopen (never linked), shared by the extension's
// run-time compiled kernels (paged attention, the row kernels): compile a CUDA C++ source for the
// current device, load it into the device's primary context (the one torch uses) and launch on
// torch's current stream. Only for builds with VERL_WITH_CUDA.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <nvrtc.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace vt_rt {

// ---- libcuda (driver API), opened with dlopen ----------------------------------------------
typedef int CUresult_t;
typedef int CUdevice_t;
typedef void* CUcontext_t;
typedef void* CUmodule_t;
typedef void* CUfunction_t;
typedef void* CUstream_t;
constexpr int kAttrMultiprocessorCount = 16;   // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
constexpr int kAttrComputeCapMajor = 75;       // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttrComputeCapMinor = 76;       // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
constexpr int kAttrL2CacheSize = 38;           // CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE

struct CudaApi {
  CUresult_t (*cuInit)(unsigned int);
  CUresult_t (*cuGetErrorString)(CUresult_t, const char**);
  CUresult_t (*cuDeviceGet)(CUdevice_t*, int);
  CUresult_t (*cuDeviceGetAttribute)(int*, int, CUdevice_t);
  CUresult_t (*cuDevicePrimaryCtxRetain)(CUcontext_t*, CUdevice_t);
  CUresult_t (*cuCtxGetCurrent)(CUcontext_t*);
  CUresult_t (*cuCtxSetCurrent)(CUcontext_t);
  CUresult_t (*cuModuleLoadData)(CUmodule_t*, const void*);
  CUresult_t (*cuModuleGetFunction)(CUfunction_t*, CUmodule_t, const char*);
  CUresult_t (*cuLaunchKernel)(CUfunction_t, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, unsigned, CUstream_t, void**, void**);
  CUresult_t (*cuEventCreate)(void**, unsigned);
  CUresult_t (*cuEventRecord)(void*, CUstream_t);
  CUresult_t (*cuEventSynchronize)(void*);
  CUresult_t (*cuEventDestroy)(void*);
  CUresult_t (*cuEventElapsedTime)(float*, void*, void*);
  CUresult_t (*cuStreamIsCapturing)(CUstream_t, int*);
  CUresult_t (*cuStreamWaitEvent)(CUstream_t, void*, unsigned);
  CUresult_t (*cuDeviceGetName)(char*, int, CUdevice_t);
  std::string error;  // non-empty: unusable
};

template <typename P>
bool load_sym(void* lib, const char* name, P& out, std::string& error) {
  out = reinterpret_cast<P>(dlsym(lib, name));
  if (out == nullptr && error.empty()) {
    error = std::string("symbol ") + name + " not found";
  }
  return out != nullptr;
}

inline const CudaApi& cuda_api() {
  static const CudaApi api = [] {
    CudaApi a{};
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = dlerror();
      a.error = std::string("dlopen(libcuda.so.1) failed (is the NVIDIA driver installed?): ") +
                (e ? e : "unknown error");
      return a;
    }
    std::string err;
    load_sym(lib, "cuInit", a.cuInit, err);
    load_sym(lib, "cuGetErrorString", a.cuGetErrorString, err);
    load_sym(lib, "cuDeviceGet", a.cuDeviceGet, err);
    load_sym(lib, "cuDeviceGetAttribute", a.cuDeviceGetAttribute, err);
    load_sym(lib, "cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain, err);
    load_sym(lib, "cuCtxGetCurrent", a.cuCtxGetCurrent, err);
    load_sym(lib, "cuCtxSetCurrent", a.cuCtxSetCurrent, err);
    load_sym(lib, "cuModuleLoadData", a.cuModuleLoadData, err);
    load_sym(lib, "cuModuleGetFunction", a.cuModuleGetFunction, err);
    load_sym(lib, "cuLaunchKernel", a.cuLaunchKernel, err);
    load_sym(lib, "cuEventCreate", a.cuEventCreate, err);
    load_sym(lib, "cuEventRecord", a.cuEventRecord, err);
    load_sym(lib, "cuEventSynchronize", a.cuEventSynchronize, err);
    load_sym(lib, "cuEventDestroy_v2", a.cuEventDestroy, err);
    load_sym(lib, "cuEventElapsedTime", a.cuEventElapsedTime, err);
    load_sym(lib, "cuStreamIsCapturing", a.cuStreamIsCapturing, err);
    load_sym(lib, "cuStreamWaitEvent", a.cuStreamWaitEvent, err);
    load_sym(lib, "cuDeviceGetName", a.cuDeviceGetName, err);
    if (!err.empty()) {
      a.error = "libcuda.so.1: " + err;
      return a;
    }
    const CUresult_t r = a.cuInit(0);
    if (r != 0) {
      a.error = "cuInit failed with CUDA error " + std::to_string(r);
    }
    return a;
  }();
  return api;
}

inline void cu_check(CUresult_t r, const char* what) {
  if (r == 0) return;
  const CudaApi& a = cuda_api();
  const char* msg = nullptr;
  if (a.cuGetErrorString != nullptr) a.cuGetErrorString(r, &msg);
  throw std::runtime_error(std::string("torch-ext CUDA: ") + what + " failed: CUDA error " +
                           std::to_string(r) + (msg ? std::string(" (") + msg + ")" : ""));
}

inline const CudaApi& cuda_checked() {
  const CudaApi& a = cuda_api();
  if (!a.error.empty()) throw std::runtime_error("torch-ext CUDA: " + a.error);
  return a;
}

// ---- libnvrtc, opened with dlopen ------------------------------------------------------------
struct NvrtcApi {
  decltype(&nvrtcGetErrorString) getErrorString;
  decltype(&nvrtcVersion) version;
  decltype(&nvrtcCreateProgram) createProgram;
  decltype(&nvrtcDestroyProgram) destroyProgram;
  decltype(&nvrtcCompileProgram) compileProgram;
  decltype(&nvrtcGetProgramLogSize) getProgramLogSize;
  decltype(&nvrtcGetProgramLog) getProgramLog;
  decltype(&nvrtcGetPTXSize) getPTXSize;
  decltype(&nvrtcGetPTX) getPTX;
  decltype(&nvrtcGetCUBINSize) getCUBINSize;
  decltype(&nvrtcGetCUBIN) getCUBIN;
  decltype(&nvrtcGetNumSupportedArchs) getNumSupportedArchs;
  decltype(&nvrtcGetSupportedArchs) getSupportedArchs;
  std::string path;
  std::string error;
};

// The directory of torch's CUDA libraries (libc10_cuda.so sits next to libtorch_cuda.so).
inline std::string torch_lib_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&c10::cuda::getCurrentCUDAStream), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  char resolved[PATH_MAX];
  std::string file = realpath(info.dli_fname, resolved) ? resolved : info.dli_fname;
  const auto slash = file.rfind('/');
  return slash == std::string::npos ? "" : file.substr(0, slash);
}

// libnvrtc opens libnvrtc-builtins.so.<version> by bare name at compile time, which fails when
// its directory is not on the loader's search path (the pip wheel's case). Loading it first from
// libnvrtc's own directory makes that lookup find the already-loaded library by its soname.
inline void preload_nvrtc_builtins(void* nvrtc) {
  void* sym = dlsym(nvrtc, "nvrtcVersion");
  Dl_info info{};
  if (sym == nullptr || dladdr(sym, &info) == 0 || info.dli_fname == nullptr) return;
  char resolved[PATH_MAX];
  std::string file = realpath(info.dli_fname, resolved) ? resolved : info.dli_fname;
  const auto slash = file.rfind('/');
  if (slash == std::string::npos) return;
  const std::string dir = file.substr(0, slash);
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind("libnvrtc-builtins.so", 0) == 0) names.push_back(n);
  }
  closedir(d);
  for (const auto& n : names) dlopen((dir + "/" + n).c_str(), RTLD_NOW | RTLD_GLOBAL);
}

inline const NvrtcApi& nvrtc_api() {
  static const NvrtcApi api = [] {
    NvrtcApi a{};
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("VERL_NVRTC_PATH")) {
      if (*env) candidates.push_back(env);
    }
    const std::string dir = torch_lib_dir();
    if (!dir.empty()) {
      candidates.push_back(dir + "/../../nvidia/cu13/lib/libnvrtc.so.13");
      candidates.push_back(dir + "/libnvrtc.so.13");
    }
    candidates.push_back("libnvrtc.so.13");
    candidates.push_back("libnvrtc.so");
    std::string tried;
    void* lib = nullptr;
    for (const auto& c : candidates) {
      lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) {
        a.path = c;
        break;
      }
      const char* e = dlerror();
      tried += "\n  " + c + ": " + (e ? e : "not found");
    }
    if (lib == nullptr) {
      a.error = "could not load libnvrtc (set VERL_NVRTC_PATH to its path); tried:" + tried;
      return a;
    }
    preload_nvrtc_builtins(lib);
    std::string err;
    load_sym(lib, "nvrtcGetErrorString", a.getErrorString, err);
    load_sym(lib, "nvrtcVersion", a.version, err);
    load_sym(lib, "nvrtcCreateProgram", a.createProgram, err);
    load_sym(lib, "nvrtcDestroyProgram", a.destroyProgram, err);
    load_sym(lib, "nvrtcCompileProgram", a.compileProgram, err);
    load_sym(lib, "nvrtcGetProgramLogSize", a.getProgramLogSize, err);
    load_sym(lib, "nvrtcGetProgramLog", a.getProgramLog, err);
    load_sym(lib, "nvrtcGetPTXSize", a.getPTXSize, err);
    load_sym(lib, "nvrtcGetPTX", a.getPTX, err);
    load_sym(lib, "nvrtcGetCUBINSize", a.getCUBINSize, err);
    load_sym(lib, "nvrtcGetCUBIN", a.getCUBIN, err);
    load_sym(lib, "nvrtcGetNumSupportedArchs", a.getNumSupportedArchs, err);
    load_sym(lib, "nvrtcGetSupportedArchs", a.getSupportedArchs, err);
    if (!err.empty()) a.error = a.path + ": " + err;
    return a;
  }();
  return api;
}

inline const NvrtcApi& nvrtc_checked() {
  const NvrtcApi& a = nvrtc_api();
  if (!a.error.empty()) throw std::runtime_error("torch-ext CUDA: " + a.error);
  return a;
}

struct Binary {
  std::string image;  // CUBIN or NUL-terminated PTX
  std::string log;
  std::string target;
};

// Compiles `source` (`name` in messages) with `options` for compute capability `arch` (e.g. 90):
// a CUBIN for sm_<arch> when NVRTC knows it, else PTX for the newest virtual architecture below it
// (the driver finishes it). `verbose` adds ptxas' register/spill report to the log (CUBIN only).
inline Binary compile_source(const std::string& source, const std::string& name,
                             const std::vector<std::string>& options, int arch, bool verbose) {
  const NvrtcApi& nv = nvrtc_checked();
  int n_archs = 0;
  std::vector<int> archs;
  if (nv.getNumSupportedArchs(&n_archs) == NVRTC_SUCCESS && n_archs > 0) {
    archs.resize(static_cast<size_t>(n_archs));
    if (nv.getSupportedArchs(archs.data()) != NVRTC_SUCCESS) archs.clear();
  }
  bool exact = archs.empty();
  int virt = 0;
  for (int a : archs) {
    if (a == arch) exact = true;
    if (a <= arch && a > virt) virt = a;
  }
  if (!exact && virt == 0) {
    std::ostringstream s;
    s << name << ": NVRTC (" << nv.path << ") supports no architecture <= sm_" << arch;
    throw std::runtime_error(s.str());
  }
  Binary bin;
  bin.target = exact ? "sm_" + std::to_string(arch) : "compute_" + std::to_string(virt);
  std::vector<std::string> opts = {"--gpu-architecture=" + bin.target, "-std=c++17"};
  opts.insert(opts.end(), options.begin(), options.end());
  if (verbose && exact) opts.push_back("--ptxas-options=-v");
  std::vector<const char*> argv;
  for (const auto& o : opts) argv.push_back(o.c_str());

  nvrtcProgram prog = nullptr;
  nvrtcResult r =
      nv.createProgram(&prog, source.c_str(), (name + ".cu").c_str(), 0, nullptr, nullptr);
  if (r != NVRTC_SUCCESS) {
    throw std::runtime_error(name + ": nvrtcCreateProgram: " + nv.getErrorString(r));
  }
  std::unique_ptr<nvrtcProgram, void (*)(nvrtcProgram*)> guard(&prog, [](nvrtcProgram* p) {
    nvrtc_api().destroyProgram(p);
  });
  r = nv.compileProgram(prog, static_cast<int>(argv.size()), argv.data());
  size_t log_size = 0;
  if (nv.getProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    bin.log.resize(log_size);
    nv.getProgramLog(prog, &bin.log[0]);
    bin.log.resize(std::strlen(bin.log.c_str()));
  }
  if (r != NVRTC_SUCCESS) {
    std::ostringstream s;
    s << name << ": NVRTC compilation failed (" << nv.getErrorString(r) << ") for " << bin.target
      << ", options:";
    for (const auto& o : opts) s << ' ' << o;
    s << "\n" << bin.log;
    throw std::runtime_error(s.str());
  }
  size_t size = 0;
  if (exact) {
    r = nv.getCUBINSize(prog, &size);
    if (r == NVRTC_SUCCESS) {
      bin.image.resize(size);
      r = nv.getCUBIN(prog, &bin.image[0]);
    }
  } else {
    r = nv.getPTXSize(prog, &size);
    if (r == NVRTC_SUCCESS) {
      bin.image.resize(size);
      r = nv.getPTX(prog, &bin.image[0]);
    }
  }
  if (r != NVRTC_SUCCESS) {
    throw std::runtime_error(name + ": reading the compiled kernel: " + nv.getErrorString(r));
  }
  return bin;
}

// ---- devices ---------------------------------------------------------------------------------
struct DeviceInfo {
  int arch = 0;
  int sms = 0;
  int l2_bytes = 0;
  std::string name;
  CUcontext_t primary = nullptr;
};

// Guards the device table and the kernel caches of every user of this header.
inline std::mutex& rt_mutex() {
  static std::mutex m;
  return m;
}

// The device's compute capability and SM count; retains its primary context (the one the CUDA
// runtime and torch use).
inline const DeviceInfo& device_info(int index) {
  static std::map<int, DeviceInfo> devices;
  const CudaApi& cu = cuda_checked();
  std::lock_guard<std::mutex> lock(rt_mutex());
  auto it = devices.find(index);
  if (it == devices.end()) {
    DeviceInfo info;
    CUdevice_t dev = 0;
    cu_check(cu.cuDeviceGet(&dev, index), "cuDeviceGet");
    int major = 0, minor = 0;
    cu_check(cu.cuDeviceGetAttribute(&major, kAttrComputeCapMajor, dev), "cuDeviceGetAttribute");
    cu_check(cu.cuDeviceGetAttribute(&minor, kAttrComputeCapMinor, dev), "cuDeviceGetAttribute");
    cu_check(cu.cuDeviceGetAttribute(&info.sms, kAttrMultiprocessorCount, dev),
             "cuDeviceGetAttribute");
    cu_check(cu.cuDeviceGetAttribute(&info.l2_bytes, kAttrL2CacheSize, dev),
             "cuDeviceGetAttribute");
    char name[256] = {0};
    cu_check(cu.cuDeviceGetName(name, int(sizeof(name)) - 1, dev), "cuDeviceGetName");
    info.name = name;
    info.arch = major * 10 + minor;
    cu_check(cu.cuDevicePrimaryCtxRetain(&info.primary, dev), "cuDevicePrimaryCtxRetain");
    it = devices.emplace(index, info).first;
  }
  return it->second;
}

// Makes the device's primary context current on this thread.
inline void make_current(const DeviceInfo& info) {
  const CudaApi& cu = cuda_checked();
  CUcontext_t cur = nullptr;
  cu_check(cu.cuCtxGetCurrent(&cur), "cuCtxGetCurrent");
  if (cur != info.primary) cu_check(cu.cuCtxSetCurrent(info.primary), "cuCtxSetCurrent");
}

// Loads a compiled image (modules are never unloaded) and returns its functions `names`.
inline std::vector<CUfunction_t> load_functions(const Binary& bin,
                                                const std::vector<const char*>& names) {
  const CudaApi& cu = cuda_checked();
  CUmodule_t mod = nullptr;
  cu_check(cu.cuModuleLoadData(&mod, bin.image.data()),
           ("cuModuleLoadData (" + bin.target + ")").c_str());
  std::vector<CUfunction_t> out;
  for (const char* n : names) {
    CUfunction_t fn = nullptr;
    cu_check(cu.cuModuleGetFunction(&fn, mod, n), (std::string("cuModuleGetFunction(") + n + ")").c_str());
    out.push_back(fn);
  }
  return out;
}

inline CUstream_t current_stream(int index) {
  return reinterpret_cast<CUstream_t>(c10::cuda::getCurrentCUDAStream(index).stream());
}

}  // namespace vt_rt
