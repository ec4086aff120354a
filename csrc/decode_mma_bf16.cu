// Tensor-core decode kernels instantiated for __nv_bfloat16 (own file so the build runs in parallel).
#include "decode_mma.cuh"

namespace pagedcore {
cudaError_t launch_decode_mma_bf16(const AttentionParams& p, int head_size, cudaStream_t stream) {
  return launch_decode_mma<__nv_bfloat16>(p, head_size, stream);
}
}  // namespace pagedcore
