// Paged decode (one query token per request), one pass or partitioned.
//
// Grid (Hq, num_decodes, max_partitions), kDecodeThreads threads. A thread block computes one
// query head over one partition of the context: the query sits in shared memory as float, each
// warp walks whole KV blocks (K read as 16-byte vectors through the block table), scores go to
// shared memory, softmax uses block-wide max and sum reductions, then V is accumulated with the
// out-of-context slots zeroed by select (never by arithmetic, so stale NaNs cannot leak).
// With one partition the block writes the output; otherwise it writes its normalised partial
// output, max and exp-sum, and `decode_reduce_kernel` merges the partitions stably.
#pragma once
#include "dtype.cuh"
#include "params.h"

namespace pagedcore {

// Context of one decode: visible keys are [ctx_start, seq_len); partitions start at `begin`,
// the block-aligned position at or below ctx_start.
struct DecodeSpan {
  int seq_len, ctx_start, begin, num_parts;
  // Keys [partition_begin, partition_end) of partition `part`.
  __device__ __forceinline__ int partition_begin(int part, int partition_size) const {
    return begin + part * partition_size;
  }
  __device__ __forceinline__ int partition_end(int part, int partition_size) const {
    return min(partition_begin(part, partition_size) + partition_size, seq_len);
  }
};

__device__ __forceinline__ DecodeSpan decode_span(const AttentionParams& p, int req) {
  DecodeSpan s;
  s.seq_len = p.seq_lens[req];
  s.ctx_start = p.window > 0 ? max(0, s.seq_len - p.window) : 0;
  s.begin = (s.ctx_start / p.block_size) * p.block_size;
  s.num_parts = cdiv(s.seq_len - s.begin, p.partition_size);
  return s;
}

// C is the cache element type: T, or an fp8 type (then K and V are read as 16 fp8 elements
// per 16-byte vector, widened exactly, and the scales are applied once: k_scale on each key's
// dot product, v_scale on the output row).
template <typename T, int HEAD, int BLOCK, typename C = T>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(AttentionParams p) {
  constexpr int X = vec_elems<C>();
  constexpr int NWARPS = kDecodeThreads / 32;
  constexpr int TG = 32 / BLOCK;  // threads per key in the QK phase
  constexpr int CHUNKS = HEAD / X;
  constexpr int V_VECS = BLOCK / X;          // 16-byte vectors per V row of one block
  constexpr int V_ROWS = 32 / V_VECS;        // V rows a warp covers per step
  constexpr int V_ROWS_PER_THREAD = (HEAD + V_ROWS - 1) / V_ROWS;
  static_assert(BLOCK <= 32 && 32 % BLOCK == 0, "block size must divide 32");
  static_assert(HEAD % X == 0 && BLOCK % X == 0, "head and block sizes must be multiples of x");

  const int head = blockIdx.x;
  const int item = blockIdx.y;
  const int part = blockIdx.z;
  const int req = p.work[item];
  const DecodeSpan span = decode_span(p, req);
  if (part >= span.num_parts) return;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int p_begin = span.partition_begin(part, p.partition_size);
  const int p_end = span.partition_end(part, p.partition_size);
  const int blk_begin = p_begin / BLOCK;
  const int blk_end = cdiv(p_end, BLOCK);
  const int pos_q = span.seq_len - 1;
  const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[head] : 0.f;

  extern __shared__ float smem[];
  float* q_s = smem;                           // [HEAD]
  float* logits = q_s + HEAD;                  // [partition_size]
  float* out_s = logits + p.partition_size;    // [NWARPS][HEAD]
  float* scratch = out_s + NWARPS * HEAD;      // [32]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t q_tok = p.query_start_loc[req];
  const T* q = static_cast<const T*>(p.query) + q_tok * p.q_stride_t + head * p.q_stride_h;
  for (int d = tid; d < HEAD; d += kDecodeThreads) q_s[d] = to_float(q[d]);
  __syncthreads();

  const int* bt = p.block_table + static_cast<int64_t>(req) * p.block_table_stride;
  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  const int64_t head_stride = static_cast<int64_t>(HEAD) * BLOCK;
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (is_fp8<C>()) {
    k_scale = *p.k_scale;
    v_scale = *p.v_scale;
  }

  // QK: a warp takes one block; TG lanes share a key, each summing every TG-th 16-byte chunk.
  const int tok = lane / TG;
  const int g = lane % TG;
  float qk_max = -INFINITY;
  for (int blk = blk_begin + warp; blk < blk_end; blk += NWARPS) {
    const int64_t phys = bt[blk];
    const C* kb = k_cache + (phys * p.num_kv_heads + kv_head) * head_stride;
    float acc = 0.f;
#pragma unroll
    for (int c = g; c < CHUNKS; c += TG) {
      float kv[X];
      load_vec<C>(kb + (c * BLOCK + tok) * X, kv);
#pragma unroll
      for (int i = 0; i < X; ++i) acc += q_s[c * X + i] * kv[i];
    }
#pragma unroll
    for (int m = TG / 2; m >= 1; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if constexpr (is_fp8<C>()) acc *= k_scale;
    if (g == 0) {
      const int pos = blk * BLOCK + tok;
      const bool visible = pos >= span.ctx_start && pos < p_end;
      const float s = transform_score(acc, p.scale, p.soft_cap, slope, pos, pos_q);
      logits[pos - p_begin] = visible ? s : -INFINITY;
      if (visible) qk_max = fmaxf(qk_max, s);
    }
  }
  qk_max = block_max<NWARPS>(qk_max, scratch);  // its barrier also publishes `logits`

  const int n_tok = (blk_end - blk_begin) * BLOCK;
  float exp_sum = 0.f;
  for (int i = tid; i < n_tok; i += kDecodeThreads) {
    const float s = logits[i];
    const float e = s == -INFINITY ? 0.f : __expf(s - qk_max);
    logits[i] = e;
    exp_sum += e;
  }
  exp_sum = block_sum<NWARPS>(exp_sum, scratch);
  float inv_sum = exp_sum > 0.f ? 1.f / exp_sum : 0.f;
  if constexpr (is_fp8<C>()) inv_sum *= v_scale;  // the partial output is linear in V

  // PV: lane covers V rows row0 + r * V_ROWS and the vv-th 16-byte vector of the block's keys.
  const int vv = lane % V_VECS;
  const int row0 = lane / V_VECS;
  float acc[V_ROWS_PER_THREAD];
#pragma unroll
  for (int r = 0; r < V_ROWS_PER_THREAD; ++r) acc[r] = 0.f;
  for (int blk = blk_begin + warp; blk < blk_end; blk += NWARPS) {
    const int64_t phys = bt[blk];
    const C* vb = v_cache + (phys * p.num_kv_heads + kv_head) * head_stride;
    const int tok0 = blk * BLOCK + vv * X;
    float pr[X];
    bool keep[X];
#pragma unroll
    for (int i = 0; i < X; ++i) {
      pr[i] = logits[tok0 + i - p_begin];
      keep[i] = tok0 + i >= span.ctx_start && tok0 + i < p_end;
    }
#pragma unroll
    for (int r = 0; r < V_ROWS_PER_THREAD; ++r) {
      const int d = row0 + r * V_ROWS;
      if (HEAD % V_ROWS == 0 || d < HEAD) {
        float v[X];
        load_vec<C>(vb + d * BLOCK + vv * X, v);
#pragma unroll
        for (int i = 0; i < X; ++i) acc[r] += pr[i] * (keep[i] ? v[i] : 0.f);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < V_ROWS_PER_THREAD; ++r) {
#pragma unroll
    for (int m = V_VECS / 2; m >= 1; m /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], m);
  }
  if (vv == 0) {
#pragma unroll
    for (int r = 0; r < V_ROWS_PER_THREAD; ++r) {
      const int d = row0 + r * V_ROWS;
      if (HEAD % V_ROWS == 0 || d < HEAD) out_s[warp * HEAD + d] = acc[r];
    }
  }
  __syncthreads();

  if (span.num_parts == 1) {
    T* out = static_cast<T*>(p.out) + q_tok * p.o_stride_t + head * p.o_stride_h;
    for (int d = tid; d < HEAD; d += kDecodeThreads) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < NWARPS; ++w) v += out_s[w * HEAD + d];
      out[d] = from_float<T>(v * inv_sum);
    }
    return;
  }
  const int64_t row = (static_cast<int64_t>(item) * p.num_heads + head) * p.max_partitions + part;
  for (int d = tid; d < HEAD; d += kDecodeThreads) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) v += out_s[w * HEAD + d];
    p.tmp_out[row * HEAD + d] = v * inv_sum;
  }
  if (tid == 0) {
    p.max_logits[row] = qk_max;
    p.exp_sums[row] = exp_sum;
  }
}

// Merges the partitions of one (decode, head): weights exp(m_i - max) * sum_i, normalised.
// Grid (Hq, num_decodes); dynamic shared memory max_partitions floats + 32.
template <typename T, int HEAD>
__global__ void __launch_bounds__(kDecodeThreads) decode_reduce_kernel(AttentionParams p) {
  constexpr int NWARPS = kDecodeThreads / 32;
  const int head = blockIdx.x;
  const int item = blockIdx.y;
  const int req = p.work[item];
  const DecodeSpan span = decode_span(p, req);
  if (span.num_parts == 1) return;  // the decode kernel wrote the output itself
  extern __shared__ float smem[];
  float* weights = smem;                      // [max_partitions]
  float* scratch = weights + p.max_partitions;  // [32]
  const int64_t row0 = (static_cast<int64_t>(item) * p.num_heads + head) * p.max_partitions;
  const int tid = threadIdx.x;

  float m = -INFINITY;
  for (int i = tid; i < span.num_parts; i += kDecodeThreads) m = fmaxf(m, p.max_logits[row0 + i]);
  m = block_max<NWARPS>(m, scratch);
  float total = 0.f;
  for (int i = tid; i < span.num_parts; i += kDecodeThreads) {
    const float mi = p.max_logits[row0 + i];
    const float w = mi == -INFINITY ? 0.f : p.exp_sums[row0 + i] * __expf(mi - m);
    weights[i] = w;
    total += w;
  }
  total = block_sum<NWARPS>(total, scratch);  // its barriers also publish `weights`
  const float inv_total = total > 0.f ? 1.f / total : 0.f;
  const int64_t q_tok = p.query_start_loc[req];
  T* out = static_cast<T*>(p.out) + q_tok * p.o_stride_t + head * p.o_stride_h;
  for (int d = tid; d < HEAD; d += kDecodeThreads) {
    float v = 0.f;
    for (int i = 0; i < span.num_parts; ++i) v += weights[i] * p.tmp_out[(row0 + i) * HEAD + d];
    out[d] = from_float<T>(v * inv_total);
  }
}

template <typename T, int HEAD>
cudaError_t launch_decode_reduce(const AttentionParams& p, cudaStream_t stream) {
  const int reduce_smem = static_cast<int>(sizeof(float)) * (p.max_partitions + 32);
  auto reduce = decode_reduce_kernel<T, HEAD>;
  if (reduce_smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(reduce, cudaFuncAttributeMaxDynamicSharedMemorySize, reduce_smem);
    if (err != cudaSuccess) return err;
  }
  reduce<<<dim3(p.num_heads, p.num_items), kDecodeThreads, reduce_smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int HEAD, int BLOCK, typename C = T>
cudaError_t launch_decode_block(const AttentionParams& p, cudaStream_t stream) {
  const int smem = decode_smem_bytes(HEAD, p.partition_size);
  auto kernel = decode_kernel<T, HEAD, BLOCK, C>;
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(p.num_heads, p.num_items, p.max_partitions);
  kernel<<<grid, kDecodeThreads, smem, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.max_partitions == 1) return err;
  return launch_decode_reduce<T, HEAD>(p, stream);
}

template <typename T, int HEAD, int BLOCK>
cudaError_t launch_decode_grouped_block(const AttentionParams& p, cudaStream_t stream);

template <typename T, int HEAD>
cudaError_t launch_decode_head(const AttentionParams& p, cudaStream_t stream) {
  switch (p.block_size) {
    case 8:
      return p.grouped ? launch_decode_grouped_block<T, HEAD, 8>(p, stream)
                       : launch_decode_block<T, HEAD, 8>(p, stream);
    case 16:
      return p.grouped ? launch_decode_grouped_block<T, HEAD, 16>(p, stream)
                       : launch_decode_block<T, HEAD, 16>(p, stream);
    case 32:
      return p.grouped ? launch_decode_grouped_block<T, HEAD, 32>(p, stream)
                       : launch_decode_block<T, HEAD, 32>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_decode(const AttentionParams& p, int head_size, cudaStream_t stream) {
  if (p.num_items == 0) return cudaSuccess;
  switch (head_size) {
    case 64:
      return launch_decode_head<T, 64>(p, stream);
    case 80:
      return launch_decode_head<T, 80>(p, stream);
    case 96:
      return launch_decode_head<T, 96>(p, stream);
    case 112:
      return launch_decode_head<T, 112>(p, stream);
    case 128:
      return launch_decode_head<T, 128>(p, stream);
    case 256:
      return launch_decode_head<T, 256>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// fp8 cache: per-head blocks (never grouped), block sizes 16 and 32.
template <typename T, typename C>
cudaError_t launch_decode_fp8_cache(const AttentionParams& p, int head_size,
                                    cudaStream_t stream) {
  if (p.num_items == 0) return cudaSuccess;
  if (p.grouped || (p.block_size != 16 && p.block_size != 32)) return cudaErrorInvalidValue;
  const bool b16 = p.block_size == 16;
  switch (head_size) {
    case 64:
      return b16 ? launch_decode_block<T, 64, 16, C>(p, stream)
                 : launch_decode_block<T, 64, 32, C>(p, stream);
    case 80:
      return b16 ? launch_decode_block<T, 80, 16, C>(p, stream)
                 : launch_decode_block<T, 80, 32, C>(p, stream);
    case 96:
      return b16 ? launch_decode_block<T, 96, 16, C>(p, stream)
                 : launch_decode_block<T, 96, 32, C>(p, stream);
    case 112:
      return b16 ? launch_decode_block<T, 112, 16, C>(p, stream)
                 : launch_decode_block<T, 112, 32, C>(p, stream);
    case 128:
      return b16 ? launch_decode_block<T, 128, 16, C>(p, stream)
                 : launch_decode_block<T, 128, 32, C>(p, stream);
    case 256:
      return b16 ? launch_decode_block<T, 256, 16, C>(p, stream)
                 : launch_decode_block<T, 256, 32, C>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_decode_fp8(const AttentionParams& p, int head_size, Fp8 kind,
                              cudaStream_t stream) {
  return kind == Fp8::kE4M3 ? launch_decode_fp8_cache<T, __nv_fp8_e4m3>(p, head_size, stream)
                            : launch_decode_fp8_cache<T, __nv_fp8_e5m2>(p, head_size, stream);
}

}  // namespace pagedcore
