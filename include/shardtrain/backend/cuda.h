// shardtrain CUDA layer: device discovery and placement, the CUDA backend (cuBLAS + kernels) and
// the device-buffer collectives (NCCL, or MPI on host copies for ranks that share a GPU).
//
// Always declared. The CUDA code itself is a plugin, libshardtrain_cuda.so (src/**/*.cu, linked
// against cuBLAS, NCCL and the CUDA runtime), which the executable does not link: it is dlopen()ed
// on first need (src/backend/cuda_plugin.cpp) from $SHARDTRAIN_CUDA_PLUGIN when set, else from the
// directory of the executable file. So a CPU run maps no CUDA library: '--device cpu' loads
// nothing CUDA, and '--device auto' asks the NVIDIA driver (libcuda.so.1, alone) for devices and
// loads the plugin only when the driver sees one.
//   - Build without the CUDA backend (no nvcc, or make CUDA=0): no plugin; cuda_built() is false,
//     cuda_device_count() is 0 (unless the test hook below fakes a count) and the factories throw
//     std::runtime_error("built without CUDA ...").
//   - Plugin missing, or present but failing to load (e.g. libcudart not found): cuda_built() is
//     still true; cuda_runtime_device_count returns 0 with the reason (dlerror()'s text) in *why,
//     and the factories throw std::runtime_error("cannot load the CUDA backend plugin PATH (...):
//     <dlerror>").
// Nothing here calls a collective on its own except make_nccl_comm (see there).
#pragma once

#include <memory>
#include <string>

#include "shardtrain/backend/backend.h"
#include "shardtrain/runtime/runtime.h"

namespace shardtrain {

// True when this binary was built with the CUDA backend (its plugin); says nothing of whether the
// plugin loads. Loads nothing.
bool cuda_built();

// Number of CUDA devices this process sees (honours CUDA_VISIBLE_DEVICES). 0 when there is no
// plugin, no driver or no device, or the plugin fails to load; then *why (if given) holds the
// reason (the driver's, the CUDA runtime's, or dlerror()'s). Never throws. Loads the plugin only
// when the driver sees a device.
// Test hook: the environment variable SHARDTRAIN_FAKE_CUDA_DEVICES=N makes it return N without
// asking the driver (only device placement logic may be tested this way; nothing runs on them).
int cuda_device_count(std::string* why = nullptr);

// The peak FLOP/s of a device by its name (for MFU) is in shardtrain/train/mfu.h (gpu_peak_flops).

// How the ranks of a run use devices; the result of plan_devices().
struct DevicePlan {
  bool cuda = false;      // run the backend on a GPU
  int gpu = -1;           // CUDA device ordinal of this rank (local rank modulo device count)
  bool nccl = false;      // data collectives through NCCL (else MPI on host copies)
  std::string summary;    // one line for the log, e.g. "cuda (4 devices on node n1, NCCL collectives)"
};

// Identity of CUDA device `device` as this process sees it: "GPU-<uuid hex>" (the same string
// for every process bound to that physical GPU, whatever CUDA_VISIBLE_DEVICES renumbering each
// has). Under SHARDTRAIN_FAKE_CUDA_DEVICES: "fake-GPU-<device>". Throws std::runtime_error.
std::string cuda_device_uuid(int device);

// What the CUDA runtime knows of the memory at `p` (cudaPointerGetAttributes): "device",
// "pinned host" (page-locked: cudaHostAlloc, Backend::alloc_pinned_host on a GPU), "managed", or
// "host" (pageable memory, unknown to CUDA). For tests and diagnostics; loads the plugin. Throws
// std::runtime_error (no plugin, or the runtime fails).
std::string cuda_memory_kind(const void* p);

// What cuda_device_count and cuda_device_uuid ask when SHARDTRAIN_FAKE_CUDA_DEVICES is not set:
// the driver, then the plugin's CUDA runtime (src/backend/cuda_plugin.cpp), or the stand-ins of a
// build without CUDA (the same file).
// Call the two functions above instead; these exist so that the test hook is read in one place.
int cuda_runtime_device_count(std::string* why);
std::string cuda_runtime_device_uuid(int device);

// Decides this rank's device from the options, pure (no CUDA calls), so that it can be unit
// tested on a machine without a GPU.
//   device:   "auto" (cuda when built with CUDA and a device is visible, else cpu), "cpu", "cuda"
//   gpu_comm: "nccl" (one rank per GPU, the default) or "mpi" (collectives through MPI on host
//             copies; allows several ranks per GPU)
//   local_rank, local_size: this rank's place among the ranks of its node; devices: visible GPUs;
//   built: cuda_built(); host: node name for messages.
// Throws std::invalid_argument naming the option ('--device', '--gpu-comm') when the value is
// unknown, or cuda is asked for but the build has no CUDA or the node has no device.
DevicePlan plan_devices(const std::string& device, const std::string& gpu_comm, int local_rank, int local_size,
                        int devices, bool built, const std::string& host);

// The "one rank per GPU" rule of NCCL, checked after plan_devices from what the node's ranks
// found: `ranks_on_gpu` is how many ranks of this node are bound to the same physical GPU as this
// rank (itself included; compared by cuda_device_uuid, so Slurm's per-task CUDA_VISIBLE_DEVICES,
// where every rank sees its own GPU as device 0, is fine). Throws std::invalid_argument when
// ranks_on_gpu > 1 with NCCL collectives, suggesting one rank per GPU or '--gpu-comm mpi'.
void check_gpu_sharing(const DevicePlan& plan, int ranks_on_gpu, int local_size, int devices,
                       const std::string& host);

// One rank's GPU: the device, one CUDA stream on which every backend call and collective of this
// rank is ordered, and the cuBLAS handle bound to that stream. Create one per rank.
class CudaContext {
 public:
  // Binds the calling thread to `device` (cudaSetDevice), creates the stream and cuBLAS handle.
  // Throws std::runtime_error naming the device and the CUDA error (or why the plugin cannot load).
  static std::unique_ptr<CudaContext> create(int device);
  virtual ~CudaContext() = default;
  virtual int device() const = 0;
  virtual std::string device_name() const = 0;  // e.g. "NVIDIA H200"
  virtual void* stream() const = 0;             // cudaStream_t
  virtual void* cublas() const = 0;             // cublasHandle_t
  virtual size_t free_bytes() const = 0;        // device memory free now, bytes
};

// The CUDA backend on `ctx` (which must outlive it). T = float or bf16. GEMMs are cuBLAS
// (cublasGemmEx / cublasGemmStridedBatchedEx, CUBLAS_COMPUTE_32F: fp32 accumulation, no TF32);
// the other ops are the kernels of src/backend/cuda/, whose per-element math is ops_math.h.
template <typename T> std::unique_ptr<Backend<T>> make_cuda_backend(CudaContext& ctx);

// Collective. A Comm on device buffers over the ranks of `host` (every rank of host must call it):
// rank 0 makes an ncclUniqueId, `host` broadcasts it, every rank calls ncclCommInitRank on its
// GPU. The blocking collectives run on ctx's stream and are complete (stream-synchronized) on
// return, as the MPI Comm's are. start_all_gather / start_reduce_scatter_sum are stream-ordered
// (Comm::stream_ordered in runtime.h): NCCL on a communication stream of the Comm's own, ordered
// after ctx's stream by an event; Request::wait() makes ctx's stream wait for it without blocking
// the host; synchronize() is the host's wait, under the watchdog. A failure to make the id on rank 0 is agreed (all_ok): CollectiveError on every
// rank. ncclCommInitRank is itself collective: when it fails on one rank, the others may wait
// inside it; that wait runs under the host's collective watchdog (--collective-timeout), which
// ends the job. Local init failures after it are agreed. barrier/watchdog/mpi_handle are
// delegated to `host`; `host` and `ctx` must outlive the returned Comm.
std::unique_ptr<Comm> make_nccl_comm(Comm& host, CudaContext& ctx);

// A Comm on device buffers that copies to host memory, runs the collective with `host` (MPI) and
// copies back: slower than NCCL, but works for several ranks sharing one GPU. Not collective to
// create. `host` and `ctx` must outlive it.
std::unique_ptr<Comm> make_staged_comm(Comm& host, CudaContext& ctx);

}  // namespace shardtrain
