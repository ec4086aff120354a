// Prefill over an fp8 KV cache for float queries (one file per query dtype so the build runs in
// parallel).
#include "prefill.cuh"

namespace pagedcore {
cudaError_t launch_prefill_fp8_f32(const AttentionParams& p, int head_size, Fp8 kind,
                               cudaStream_t stream) {
  return launch_prefill_fp8<float>(p, head_size, kind, stream);
}
}  // namespace pagedcore
