// Decode kernels instantiated for __nv_bfloat16 (one file per dtype so the build runs in parallel).
#include "decode_grouped.cuh"

namespace pagedcore {
cudaError_t launch_decode_bf16(const AttentionParams& p, int head_size, cudaStream_t stream) {
  return launch_decode<__nv_bfloat16>(p, head_size, stream);
}
}  // namespace pagedcore
