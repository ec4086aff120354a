// Tensor-core decode over an fp8 e4m3 cache for __half queries (own file so the build runs in
// parallel).
#include "decode_mma.cuh"

namespace pagedcore {
cudaError_t launch_decode_mma_fp8_e4m3_f16(const AttentionParams& p, int head_size,
                                          cudaStream_t stream) {
  return launch_decode_mma_fp8<__half, __nv_fp8_e4m3>(p, head_size, stream);
}
}  // namespace pagedcore
