// The CUDA layer of include/shardtrain/backend/cuda.h in the executable: a loader for the CUDA backend
// plugin, libshardtrain_cuda.so (src/**/*.cu, linked against cuBLAS, NCCL and the CUDA runtime).
// The executable links none of the CUDA libraries, so a CPU run maps none of them; the plugin is
// dlopen()ed the first time a CUDA function needs it:
//   - from $SHARDTRAIN_CUDA_PLUGIN when set (a path), else from the directory of the executable
//     file (found in /proc/self/maps, so that a start through the dynamic loader, as
//     tests/gpu/bundle.sh's wrappers do with their own glibc, still finds libexec/);
//   - cuda_runtime_device_count asks the driver first (libcuda.so.1, dlopen'ed alone: absent on
//     machines without an NVIDIA driver) and loads the plugin only when the driver sees a device,
//     so '--device auto' without a GPU maps no CUDA library beyond the driver's, if installed;
//   - a plugin that fails to load is reported with dlerror()'s text: in the `why` of
//     cuda_runtime_device_count and in the std::runtime_error of the factories.
// A build without CUDA (no nvcc, make CUDA=0) has no plugin: cuda_built() is false and the
// factories throw "built without CUDA".
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

#include "shardtrain/backend/cuda.h"

#if SHARDTRAIN_CUDA
#include "cuda/plugin_abi.h"
#endif

namespace shardtrain {

#if !SHARDTRAIN_CUDA

namespace {
[[noreturn]] void no_cuda() {
  throw std::runtime_error("built without CUDA: this shardtrain was compiled on a machine without nvcc; rebuild with "
                           "the CUDA toolkit installed, or use '--device cpu'");
}
}  // namespace

bool cuda_built() { return false; }
int cuda_runtime_device_count(std::string* why) {
  if (why) *why = "built without CUDA";
  return 0;
}
std::string cuda_runtime_device_uuid(int) { no_cuda(); }
std::string cuda_memory_kind(const void*) { no_cuda(); }
std::unique_ptr<CudaContext> CudaContext::create(int) { no_cuda(); }
template <typename T> std::unique_ptr<Backend<T>> make_cuda_backend(CudaContext&) { no_cuda(); }
template std::unique_ptr<Backend<float>> make_cuda_backend<float>(CudaContext&);
template std::unique_ptr<Backend<bf16>> make_cuda_backend<bf16>(CudaContext&);
std::unique_ptr<Comm> make_nccl_comm(Comm&, CudaContext&) { no_cuda(); }
std::unique_ptr<Comm> make_staged_comm(Comm&, CudaContext&) { no_cuda(); }

#else  // SHARDTRAIN_CUDA

namespace {

using cuda_plugin::CudaPluginTable;

// The file this code was loaded from (the executable: the loader is linked into it), from the
// mapping that holds this function; /proc/self/exe when that fails. Under `ld-linux-x86-64.so.2
// prog` /proc/self/exe names the dynamic loader, but the mapping still names prog.
std::string this_binary() {
  const auto self = reinterpret_cast<std::uintptr_t>(&this_binary);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream s(line);
    std::string range, perms, offset, dev, inode, path;
    s >> range >> perms >> offset >> dev >> inode;
    std::getline(s >> std::ws, path);
    const size_t dash = range.find('-');
    if (dash == std::string::npos || path.empty() || path[0] != '/') continue;
    const std::uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const std::uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (self < lo || self >= hi) continue;
    constexpr std::string_view kDeleted = " (deleted)";  // the file was replaced while running
    if (path.ends_with(kDeleted)) path.resize(path.size() - kDeleted.size());
    return path;
  }
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/self/exe", ec).string();
}

// Where the plugin is looked for, and how that was decided (for messages).
std::string plugin_path(std::string* origin) {
  if (const char* env = std::getenv("SHARDTRAIN_CUDA_PLUGIN"); env && *env) {
    *origin = "SHARDTRAIN_CUDA_PLUGIN";
    return env;
  }
  *origin = "next to the executable";
  return (std::filesystem::path(this_binary()).parent_path() / cuda_plugin::kFileName).string();
}

struct Plugin {
  const CudaPluginTable* table = nullptr;
  std::string error;  // why table is null
};

// Loads the plugin once per process (thread-safe); a failure is kept and reported on every use.
// Never unloaded: its objects (contexts, backends, Comms) may live until exit.
const Plugin& plugin() {
  static const Plugin p = [] {
    Plugin r;
    std::string origin;
    const std::string path = plugin_path(&origin);
    const std::string what = "cannot load the CUDA backend plugin " + path + " (" + origin + "): ";
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      r.error = what + (e ? e : "dlopen failed");
      return r;
    }
    auto entry = reinterpret_cast<cuda_plugin::EntryPoint>(dlsym(h, cuda_plugin::kEntryPoint));
    if (!entry) {
      r.error = what + "no " + cuda_plugin::kEntryPoint + " in it (not a shardtrain CUDA plugin)";
      return r;
    }
    const CudaPluginTable* t = entry();
    if (!t || t->abi_version != cuda_plugin::kAbiVersion || t->size != sizeof(CudaPluginTable)) {
      r.error = what + "it was built for another shardtrain (plugin interface " +
                (t ? std::to_string(t->abi_version) : std::string("?")) + ", this binary's " +
                std::to_string(cuda_plugin::kAbiVersion) + "); rebuild both with make";
      return r;
    }
    r.table = t;
    return r;
  }();
  return p;
}

const CudaPluginTable& need_plugin() {
  const Plugin& p = plugin();
  if (!p.table) throw std::runtime_error(p.error);
  return *p.table;
}

// Devices the NVIDIA driver sees, asked through libcuda.so.1 alone (no CUDA runtime, cuBLAS or
// NCCL). 0 with *why when there is no driver, it fails, or it sees no device. libcuda is not
// unloaded (after cuInit it may hold threads and exit handlers).
int driver_device_count(std::string* why) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    *why = std::string("no NVIDIA driver (") + (e ? e : "dlopen libcuda.so.1 failed") + ")";
    return 0;
  }
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  using ErrorString = int (*)(int, const char**);
  auto init = reinterpret_cast<Init>(dlsym(h, "cuInit"));
  auto count = reinterpret_cast<Count>(dlsym(h, "cuDeviceGetCount"));
  auto error_string = reinterpret_cast<ErrorString>(dlsym(h, "cuGetErrorString"));
  if (!init || !count) {
    *why = "libcuda.so.1 lacks cuInit or cuDeviceGetCount";
    return 0;
  }
  auto failed = [&](const char* call, int r) {
    const char* s = nullptr;
    if (!error_string || error_string(r, &s) != 0 || !s) s = "unknown error";
    *why = std::string(call) + " failed: " + s + " (CUresult " + std::to_string(r) + ")";
    return 0;
  };
  if (int r = init(0); r != 0) return failed("cuInit", r);
  int n = 0;
  if (int r = count(&n); r != 0) return failed("cuDeviceGetCount", r);
  if (n <= 0) *why = "the NVIDIA driver sees no CUDA device";
  return n > 0 ? n : 0;
}

}  // namespace

bool cuda_built() { return true; }

int cuda_runtime_device_count(std::string* why) {
  std::string w;
  int n = 0;
  std::string origin;
  const std::string path = plugin_path(&origin);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    w = "the CUDA backend plugin " + path + " (" + origin + ") does not exist";
  } else if (driver_device_count(&w) > 0) {
    const Plugin& p = plugin();  // a device is there: load cuBLAS, NCCL and the CUDA runtime
    if (p.table) n = p.table->device_count(&w);
    else w = p.error;
  }
  if (why) *why = w;
  return n;
}

std::string cuda_runtime_device_uuid(int device) { return need_plugin().device_uuid(device); }

std::string cuda_memory_kind(const void* p) { return need_plugin().memory_kind(p); }

std::unique_ptr<CudaContext> CudaContext::create(int device) { return need_plugin().create_context(device); }

template <typename T> std::unique_ptr<Backend<T>> make_cuda_backend(CudaContext& ctx) {
  const CudaPluginTable& t = need_plugin();
  if constexpr (std::is_same_v<T, float>) return t.make_backend_f32(ctx);
  else return t.make_backend_bf16(ctx);
}
template std::unique_ptr<Backend<float>> make_cuda_backend<float>(CudaContext&);
template std::unique_ptr<Backend<bf16>> make_cuda_backend<bf16>(CudaContext&);

std::unique_ptr<Comm> make_nccl_comm(Comm& host, CudaContext& ctx) {
  const Plugin& p = plugin();
  all_ok(host, p.table != nullptr, p.error);  // collective: every rank fails alike
  return p.table->make_nccl_comm(host, ctx);
}

std::unique_ptr<Comm> make_staged_comm(Comm& host, CudaContext& ctx) { return need_plugin().make_staged_comm(host, ctx); }

#endif  // SHARDTRAIN_CUDA

}  // namespace shardtrain
