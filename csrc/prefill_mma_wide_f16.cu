// Tensor-core prefill kernels for __half at head size 128 (the heaviest instantiations, in their
// own file so the build runs in parallel; dispatched from prefill_mma_f16.cu).
#include "prefill_mma_launch.cuh"

namespace pagedcore {
template cudaError_t launch_prefill_mma_head<__half, 128>(const AttentionParams&, cudaStream_t);
}  // namespace pagedcore
