// Prefill kernels instantiated for __half (one file per dtype so the build runs in parallel).
#include "prefill.cuh"

namespace pagedcore {
cudaError_t launch_prefill_f16(const AttentionParams& p, int head_size, cudaStream_t stream) {
  return launch_prefill<__half>(p, head_size, stream);
}
}  // namespace pagedcore
