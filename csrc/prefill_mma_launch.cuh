// Launches of the tensor-core prefill kernel (prefill_mma.cuh): one compiled configuration
// per variant, chosen from the launch parameters; the .cu files instantiate these by dtype
// and head size.
#pragma once
#include "prefill_mma.cuh"

namespace pagedcore {

template <typename T, int HEAD, int MT, bool PIPE, int NW, int KN, int ST = 2,
          bool FAST = false, int MINB = 1, bool HMAJOR = false, bool WMASK = false,
          bool ONEBAR = false, bool PMASK = false>
cudaError_t launch_prefill_mma_cfg(const AttentionParams& p, cudaStream_t stream) {
  constexpr int smem = FaSmem<T, HEAD, MT, NW, KN, ST>::BYTES;
  auto kernel = prefill_mma_kernel<T, HEAD, MT, PIPE, NW, KN, ST, FAST, MINB, HMAJOR, WMASK,
                                   ONEBAR, PMASK>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  if constexpr (MINB > 1) {  // ask for the whole carveout: MINB blocks' shared memory per SM
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(p.num_items, p.num_heads), NW * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

// The compiled configurations, by (`p.prefill_rows`, `p.prefill_warps`, `p.prefill_keys`,
// `p.prefill_stages`, `p.prefill_pipe`): rows per tile = 16 * MT * warps.
//   64 rows,  4 warps, 64 keys, 2 stages: MT 1, measured gather or pipelined gather
//   128 rows, 4 warps, 64 keys, 2 stages: MT 2, measured gather or pipelined gather
//   128 rows, 8 warps, 64 keys, 2 or 3 stages: MT 1, pipelined (Q fragments in registers)
//   128 rows, 4 warps, 32 keys, 2 or 3 stages: MT 2, pipelined (half the S registers)
//   256 rows, 8 warps, 32 keys, 2 stages: MT 2, pipelined
//   `p.prefill_fast`: 128 rows, 4 warps, MT 2, pipelined, 32 keys and 3 stages or 64 keys
//   and 2 stages, with the straight-line softmax of unmasked tiles and the lazy O rescale
//   `p.prefill_warp_mask`: the fast 128-row, 64-key, 2-stage kernel with per-warp masks, in
//   the default or (`p.prefill_sched`) head-major order, or in the default order with one
//   barrier per tile (`p.prefill_one_barrier`) and / or the straight-line masked softmax of
//   plain tiles (`p.prefill_plain_mask`)
template <typename T, int HEAD>
cudaError_t launch_prefill_mma_head(const AttentionParams& p, cudaStream_t stream) {
  const int rows = p.prefill_rows, warps = p.prefill_warps, keys = p.prefill_keys;
  const int stages = p.prefill_stages;
  if (p.prefill_warp_mask) {
    if (!p.prefill_fast || !p.prefill_pipe || warps != 4 || keys != 64 || rows != 128 ||
        stages != 2)
      return cudaErrorInvalidValue;
    if (p.prefill_sched)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 64, 2, true, 2, true, true>(p, stream);
    if (p.prefill_plain_mask && p.prefill_one_barrier)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 64, 2, true, 1, false, true, true,
                                    true>(p, stream);
    if (p.prefill_plain_mask)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 64, 2, true, 1, false, true, false,
                                    true>(p, stream);
    if (p.prefill_one_barrier)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 64, 2, true, 1, false, true, true>(
          p, stream);
    return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 64, 2, true, 1, false, true>(p, stream);
  }
  if (p.prefill_sched) {  // FAST, head-major order, blocks-per-SM bound
    if (!p.prefill_fast || !p.prefill_pipe || warps != 4) return cudaErrorInvalidValue;
    if (keys == 64) {
      if (rows == 128 && stages == 2)
        return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 64, 2, true, 2, true>(p, stream);
      return cudaErrorInvalidValue;
    }
    if (keys != 32) return cudaErrorInvalidValue;
    if (rows == 128 && stages == 3)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 32, 3, true, 2, true>(p, stream);
    if (rows == 128 && stages == 4)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 32, 4, true, 2, true>(p, stream);
    if (rows == 64 && stages == 3)
      return launch_prefill_mma_cfg<T, HEAD, 1, true, 4, 32, 3, true, 3, true>(p, stream);
    return cudaErrorInvalidValue;
  }
  if (p.prefill_fast) {
    if (p.prefill_pipe && stages == 3 && rows == 128 && warps == 4 && keys == 32)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 32, 3, true>(p, stream);
    if (p.prefill_pipe && stages == 2 && rows == 128 && warps == 4 && keys == 64)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 64, 2, true>(p, stream);
    return cudaErrorInvalidValue;
  }
  if (p.prefill_pipe && stages == 3) {
    if (rows == 128 && warps == 8 && keys == 64)
      return launch_prefill_mma_cfg<T, HEAD, 1, true, 8, 64, 3>(p, stream);
    if (rows == 128 && warps == 4 && keys == 32)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 32, 3>(p, stream);
    return cudaErrorInvalidValue;
  }
  if (stages != 2) return cudaErrorInvalidValue;
  if (p.prefill_pipe) {
    if (rows == 64 && warps == 4 && keys == 64)
      return launch_prefill_mma_cfg<T, HEAD, 1, true, 4, 64>(p, stream);
    if (rows == 128 && warps == 4 && keys == 64)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 64>(p, stream);
    if (rows == 128 && warps == 8 && keys == 64)
      return launch_prefill_mma_cfg<T, HEAD, 1, true, 8, 64>(p, stream);
    if (rows == 128 && warps == 4 && keys == 32)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 4, 32>(p, stream);
    if (rows == 256 && warps == 8 && keys == 32)
      return launch_prefill_mma_cfg<T, HEAD, 2, true, 8, 32>(p, stream);
    return cudaErrorInvalidValue;
  }
  if (warps != 4 || keys != 64) return cudaErrorInvalidValue;
  if (rows == 128) return launch_prefill_mma_cfg<T, HEAD, 2, false, 4, 64>(p, stream);
  if (rows == 64) return launch_prefill_mma_cfg<T, HEAD, 1, false, 4, 64>(p, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_prefill_mma(const AttentionParams& p, int head_size, cudaStream_t stream) {
  if (p.num_items == 0) return cudaSuccess;
  switch (head_size) {
    case 64:
      return launch_prefill_mma_head<T, 64>(p, stream);
    case 80:
      return launch_prefill_mma_head<T, 80>(p, stream);
    case 96:
      return launch_prefill_mma_head<T, 96>(p, stream);
    case 112:
      return launch_prefill_mma_head<T, 112>(p, stream);
    case 128:
      return launch_prefill_mma_head<T, 128>(p, stream);
    default:
      return cudaErrorInvalidValue;  // 256: prefill.cuh (register budget)
  }
}

}  // namespace pagedcore
