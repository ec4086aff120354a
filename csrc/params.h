// Launch parameters shared by the .cu kernels and the torch bindings (no torch types here, so
// the kernels compile with nvcc alone).
//
// KV-cache layout (one tensor per layer, `[2, num_blocks, num_kv_heads * head_size * block_size]`):
//   K = cache[0] viewed as [num_blocks, num_kv_heads, head_size / x, block_size, x],
//   V = cache[1] viewed as [num_blocks, num_kv_heads, head_size, block_size],
// with x = 16 / sizeof(element): one 16-byte vector holds x consecutive head dims of one key.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace pagedcore {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };
// The fp8 KV-cache formats (cuda_fp8.h __nv_fp8_e4m3 / __nv_fp8_e5m2).
enum class Fp8 : int { kE4M3 = 0, kE5M2 = 1 };

struct CacheWriteParams {
  const void* key;            // [T, Hkv, D]
  const void* value;          // [T, Hkv, D]
  void* k_cache;              // see layout above
  void* v_cache;
  const int64_t* slot_mapping;  // [T], -1 = skip
  int64_t key_stride_t, key_stride_h, value_stride_t, value_stride_h;  // elements
  int num_tokens, num_kv_heads, head_size, block_size;
  // fp8 cache only: [1] float32 dequantization scales; the write stores fp8(x / scale).
  const float* k_scale;
  const float* v_scale;
};

struct AttentionParams {
  void* out;                   // [T, Hq, D]
  const void* query;           // [T, Hq, D]
  const void* k_cache;
  const void* v_cache;
  const int* block_table;      // [B, max_blocks]
  int64_t block_table_stride;
  const int* seq_lens;         // [B]
  const int* query_start_loc;  // [B + 1]
  // decode: [num_items] request indices; prefill: [num_items, 2] (request, first query row).
  const int* work;
  int num_items;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;  // elements
  int num_heads, num_kv_heads, block_size;
  float scale;
  float soft_cap;              // 0 = none
  const float* alibi_slopes;   // [Hq] or nullptr
  int window;                  // 0 = none
  bool causal;
  bool prefill_lane_per_key;   // prefill: the first softmax formulation (reference path)
  int decode_unroll;           // mma decode: 16-key tiles whose loads are issued together (1, 2)
  int prefill_rows;            // mma prefill: query rows per tile (64 or 128)
  bool prefill_pipe;           // mma prefill: pipelined K/V gather (block table read ahead)
  bool prefill_plain_mask;     // mma prefill (fast): masked plain tiles without branches
                               // (in the padding after prefill_pipe, like the two new bools
                               // below after prefill_sched: the older fields keep their
                               // offsets, so the older kernels' code is unchanged)
  int prefill_warps;           // mma prefill: warps per thread block (4 or 8)
  int prefill_keys;            // mma prefill: keys per shared-memory K/V tile (64 or 32)
  int prefill_stages;          // mma prefill: K/V tiles in flight (2 or 3)
  bool prefill_fast;           // mma prefill: straight-line softmax of unmasked tiles
  bool prefill_sched;          // mma prefill: head-major tile order, blocks-per-SM bound
  bool prefill_warp_mask;      // mma prefill (fast): masks decided per warp, masked warps skip
  bool prefill_one_barrier;    // mma prefill (2 stages): the ring's one barrier per tile
  // decode only
  int partition_size;          // tokens, a multiple of block_size
  int max_partitions;          // grid.z; 1 = one pass (tmp buffers unused)
  bool grouped;                // one thread block per KV head serves its whole query group
  float* tmp_out;              // [num_items, Hq, max_partitions, D]
  float* max_logits;           // [num_items, Hq, max_partitions]
  float* exp_sums;             // [num_items, Hq, max_partitions]
  // fp8 cache only: [1] float32 dequantization scales (attention reads fp8 * scale), read on
  // the device so captured CUDA graphs see in-place updates.
  const float* k_scale;
  const float* v_scale;
};

// Each returns cudaSuccess or the launch error; an unsupported head/block size returns
// cudaErrorInvalidValue (the bindings check sizes first and raise a clear error).
cudaError_t launch_cache_write(const CacheWriteParams& p, DType dtype, cudaStream_t stream);

// fp8 KV cache (fp16 / bf16 / fp32 queries): cache write with quantization, the CUDA-core
// decode (decode.cuh, per-head blocks; the tensor-core one is below, decode_mma.cuh) and the
// WMMA / CUDA-core prefill (prefill.cuh) reading
// fp8 K/V; block sizes 16 and 32 (16 fp8 elements per 16-byte vector).
cudaError_t launch_cache_write_fp8(const CacheWriteParams& p, DType dtype, Fp8 kind,
                                   cudaStream_t stream);
cudaError_t launch_decode_fp8_f16(const AttentionParams& p, int head_size, Fp8 kind,
                                  cudaStream_t stream);
cudaError_t launch_decode_fp8_bf16(const AttentionParams& p, int head_size, Fp8 kind,
                                   cudaStream_t stream);
cudaError_t launch_decode_fp8_f32(const AttentionParams& p, int head_size, Fp8 kind,
                                  cudaStream_t stream);
cudaError_t launch_prefill_fp8_f16(const AttentionParams& p, int head_size, Fp8 kind,
                                   cudaStream_t stream);
cudaError_t launch_prefill_fp8_bf16(const AttentionParams& p, int head_size, Fp8 kind,
                                    cudaStream_t stream);
cudaError_t launch_prefill_fp8_f32(const AttentionParams& p, int head_size, Fp8 kind,
                                   cudaStream_t stream);

cudaError_t launch_decode_f16(const AttentionParams& p, int head_size, cudaStream_t stream);
cudaError_t launch_decode_bf16(const AttentionParams& p, int head_size, cudaStream_t stream);
cudaError_t launch_decode_f32(const AttentionParams& p, int head_size, cudaStream_t stream);

// Tensor-core kernels (fp16 / bf16, head sizes 64-128): decode_mma.cuh, prefill_mma.cuh.
cudaError_t launch_decode_mma_f16(const AttentionParams& p, int head_size, cudaStream_t stream);
cudaError_t launch_decode_mma_bf16(const AttentionParams& p, int head_size, cudaStream_t stream);
// ... and over an fp8 cache (fp16 / bf16 queries, block sizes 16 and 32; two tiles of loads in
// flight per warp).
cudaError_t launch_decode_mma_fp8_e4m3_f16(const AttentionParams& p, int head_size,
                                           cudaStream_t stream);
cudaError_t launch_decode_mma_fp8_e5m2_f16(const AttentionParams& p, int head_size,
                                           cudaStream_t stream);
cudaError_t launch_decode_mma_fp8_e4m3_bf16(const AttentionParams& p, int head_size,
                                            cudaStream_t stream);
cudaError_t launch_decode_mma_fp8_e5m2_bf16(const AttentionParams& p, int head_size,
                                            cudaStream_t stream);
cudaError_t launch_prefill_mma_f16(const AttentionParams& p, int head_size, cudaStream_t stream);
cudaError_t launch_prefill_mma_bf16(const AttentionParams& p, int head_size, cudaStream_t stream);

cudaError_t launch_prefill_f16(const AttentionParams& p, int head_size, cudaStream_t stream);
cudaError_t launch_prefill_bf16(const AttentionParams& p, int head_size, cudaStream_t stream);
cudaError_t launch_prefill_f32(const AttentionParams& p, int head_size, cudaStream_t stream);

// Dynamic shared memory of one decode thread block (the Python planner mirrors these formulas).
constexpr int kDecodeThreads = 128;
constexpr int kGroupChunkMax = 8;  // query heads a grouped block accumulates at once, at most
inline int decode_smem_bytes(int head_size, int partition_size) {
  return static_cast<int>(sizeof(float)) *
         (head_size + partition_size + (kDecodeThreads / 32) * head_size + 32);
}
// mma decode: four warps' partial outputs (16 head rows each) plus their max and sum.
constexpr int kMmaDecodeThreads = 128;
inline int decode_mma_smem_bytes(int head_size) {
  return static_cast<int>(sizeof(float)) * (kMmaDecodeThreads / 32) * 16 * (head_size + 2);
}
inline int decode_grouped_smem_bytes(int head_size, int partition_size, int group) {
  return static_cast<int>(sizeof(float)) *
         (group * head_size + group * partition_size +
          (kDecodeThreads / 32) * kGroupChunkMax * head_size + 2 * group);
}

}  // namespace pagedcore
