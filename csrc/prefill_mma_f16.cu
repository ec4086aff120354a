// Tensor-core prefill kernels instantiated for __half (own file so the build runs in parallel).
#include "prefill_mma.cuh"

namespace pagedcore {
cudaError_t launch_prefill_mma_f16(const AttentionParams& p, int head_size, cudaStream_t stream) {
  return launch_prefill_mma<__half>(p, head_size, stream);
}
}  // namespace pagedcore
