// Prefill kernels instantiated for __nv_bfloat16 (one file per dtype so the build runs in parallel).
#include "prefill.cuh"

namespace pagedcore {
cudaError_t launch_prefill_bf16(const AttentionParams& p, int head_size, cudaStream_t stream) {
  return launch_prefill<__nv_bfloat16>(p, head_size, stream);
}
}  // namespace pagedcore
