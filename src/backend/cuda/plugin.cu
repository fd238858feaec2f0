// The entry point of libshardtrain_cuda.so: the table of the plugin's functions (plugin_abi.h),
// which src/backend/cuda_plugin.cpp looks up with dlsym.
#include "plugin_abi.h"

namespace {
const shardtrain::cuda_plugin::CudaPluginTable kTable = {
    shardtrain::cuda_plugin::kAbiVersion,
    sizeof(shardtrain::cuda_plugin::CudaPluginTable),
    &shardtrain::cuda_impl::device_count,
    &shardtrain::cuda_impl::device_uuid,
    &shardtrain::cuda_impl::create_context,
    &shardtrain::cuda_impl::make_backend<float>,
    &shardtrain::cuda_impl::make_backend<shardtrain::bf16>,
    &shardtrain::cuda_impl::make_nccl_comm,
    &shardtrain::cuda_impl::make_staged_comm,
    &shardtrain::cuda_impl::memory_kind,
};
}  // namespace

extern "C" const shardtrain::cuda_plugin::CudaPluginTable* shardtrain_cuda_plugin() { return &kTable; }
