// Tensor-core prefill kernels for __nv_bfloat16 at head size 128 (the heaviest instantiations, in their
// own file so the build runs in parallel; dispatched from prefill_mma_bf16.cu).
#include "prefill_mma_launch.cuh"

namespace pagedcore {
template cudaError_t launch_prefill_mma_head<__nv_bfloat16, 128>(const AttentionParams&, cudaStream_t);
}  // namespace pagedcore
