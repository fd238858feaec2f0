// The interface between shardtrain and its CUDA backend plugin, libshardtrain_cuda.so (the
// Makefile builds src/**/*.cu into it; src/backend/cuda_plugin.cpp loads it with dlopen on first
// need). Private to src/: no CUDA header here, so that the loader compiles in every build.
//
// The plugin exports one extern "C" function, shardtrain_cuda_plugin(), which returns a table of
// function pointers to its entry points (the cuda_impl:: functions below). Everything else the
// plugin needs from shardtrain (Comm, CollectiveError, all_ok, ...) it takes from the executable,
// which is linked with -rdynamic for that. Plugin and executable come from the same build: the
// table carries kAbiVersion and its own size, and the loader refuses a plugin whose differ.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "shardtrain/backend/cuda.h"

namespace shardtrain::cuda_plugin {

// Raise on any change to CudaPluginTable or to the classes whose objects cross the boundary (the
// versions so far: docs/architecture.md, "The CUDA plugin").
inline constexpr int kAbiVersion = 7;
inline constexpr const char* kFileName = "libshardtrain_cuda.so";
inline constexpr const char* kEntryPoint = "shardtrain_cuda_plugin";

// The CUDA layer of cuda.h as the plugin implements it (cuda_impl:: below).
struct CudaPluginTable {
  int abi_version;    // kAbiVersion
  std::size_t size;   // sizeof(CudaPluginTable)
  int (*device_count)(std::string* why);
  std::string (*device_uuid)(int device);
  std::unique_ptr<CudaContext> (*create_context)(int device);
  std::unique_ptr<Backend<float>> (*make_backend_f32)(CudaContext& ctx);
  std::unique_ptr<Backend<bf16>> (*make_backend_bf16)(CudaContext& ctx);
  std::unique_ptr<Comm> (*make_nccl_comm)(Comm& host, CudaContext& ctx);
  std::unique_ptr<Comm> (*make_staged_comm)(Comm& host, CudaContext& ctx);
  std::string (*memory_kind)(const void* p);
};

using EntryPoint = const CudaPluginTable* (*)();

}  // namespace shardtrain::cuda_plugin

// Inside the plugin only: its implementations, named apart from the cuda.h functions that the
// executable defines (the executable's symbols would otherwise interpose the plugin's own).
namespace shardtrain::cuda_impl {
int device_count(std::string* why);
std::string device_uuid(int device);
std::unique_ptr<CudaContext> create_context(int device);
template <typename T> std::unique_ptr<Backend<T>> make_backend(CudaContext& ctx);
std::unique_ptr<Comm> make_nccl_comm(Comm& host, CudaContext& ctx);
std::unique_ptr<Comm> make_staged_comm(Comm& host, CudaContext& ctx);
std::string memory_kind(const void* p);
}  // namespace shardtrain::cuda_impl
