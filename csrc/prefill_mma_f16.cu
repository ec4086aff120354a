// Tensor-core prefill kernels instantiated for __half (own file so the build runs in parallel);
// head sizes 96 and 112 are instantiated in prefill_mma_mid_f16.cu and 128 in
// prefill_mma_wide_f16.cu, for the same reason.
#include "prefill_mma_launch.cuh"

namespace pagedcore {
extern template cudaError_t launch_prefill_mma_head<__half, 96>(const AttentionParams&,
                                                             cudaStream_t);
extern template cudaError_t launch_prefill_mma_head<__half, 112>(const AttentionParams&,
                                                              cudaStream_t);
extern template cudaError_t launch_prefill_mma_head<__half, 128>(const AttentionParams&,
                                                              cudaStream_t);

cudaError_t launch_prefill_mma_f16(const AttentionParams& p, int head_size, cudaStream_t stream) {
  return launch_prefill_mma<__half>(p, head_size, stream);
}
}  // namespace pagedcore
