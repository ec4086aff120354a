// Prefill kernels instantiated for float (one file per dtype so the build runs in parallel).
#include "prefill.cuh"

namespace pagedcore {
cudaError_t launch_prefill_f32(const AttentionParams& p, int head_size, cudaStream_t stream) {
  return launch_prefill<float>(p, head_size, stream);
}
}  // namespace pagedcore
