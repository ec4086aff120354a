// Prefill over an fp8 KV cache for __nv_bfloat16 queries (one file per query dtype so the build runs in
// parallel).
#include "prefill.cuh"

namespace pagedcore {
cudaError_t launch_prefill_fp8_bf16(const AttentionParams& p, int head_size, Fp8 kind,
                               cudaStream_t stream) {
  return launch_prefill_fp8<__nv_bfloat16>(p, head_size, kind, stream);
}
}  // namespace pagedcore
