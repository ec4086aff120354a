// Tensor-core prefill kernels for __nv_bfloat16 at head sizes 96 and 112 (own file so the build runs in
// parallel; dispatched from prefill_mma_bf16.cu).
#include "prefill_mma_launch.cuh"

namespace pagedcore {
template cudaError_t launch_prefill_mma_head<__nv_bfloat16, 96>(const AttentionParams&, cudaStream_t);
template cudaError_t launch_prefill_mma_head<__nv_bfloat16, 112>(const AttentionParams&, cudaStream_t);
}  // namespace pagedcore
