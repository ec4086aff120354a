// Tensor-core prefill kernels instantiated for __nv_bfloat16 (own file so the build runs in parallel);
// head sizes 96 and 112 are instantiated in prefill_mma_mid_bf16.cu and 128 in
// prefill_mma_wide_bf16.cu, for the same reason.
#include "prefill_mma_launch.cuh"

namespace pagedcore {
extern template cudaError_t launch_prefill_mma_head<__nv_bfloat16, 96>(const AttentionParams&,
                                                             cudaStream_t);
extern template cudaError_t launch_prefill_mma_head<__nv_bfloat16, 112>(const AttentionParams&,
                                                              cudaStream_t);
extern template cudaError_t launch_prefill_mma_head<__nv_bfloat16, 128>(const AttentionParams&,
                                                              cudaStream_t);

cudaError_t launch_prefill_mma_bf16(const AttentionParams& p, int head_size, cudaStream_t stream) {
  return launch_prefill_mma<__nv_bfloat16>(p, head_size, stream);
}
}  // namespace pagedcore
